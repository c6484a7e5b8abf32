"""Verified refits (rollout.verify_weights, train/refit_check.py): the probe's engine side for
every engine against transformers' log-probs, the SGLang double's input_token_logprobs against
SGLang 0.5.23's rules, and which pushes are checked. The trainer side, the whole loop, runs in
test_train_sglang.py (a corrupted push stops the run), test_vllm.py (the real server, every push)
and the configuration sweep (every engine cell verifies its pushes, across every layout)."""
from __future__ import annotations

import math
import os

import pytest
import torch

from gspo_megatron.resolve import load_config
from gspo_megatron.rollout.base import WeightVerificationError
from gspo_megatron.rollout.hf_engine import HFEngine, hub_weight_targets
from gspo_megatron.rollout.sglang_engine import SGLangEngine
from gspo_megatron.rollout.tokenizer import build_tokenizer
from gspo_megatron.train.refit_check import PROBE_TOKENS, RefitCheck, probe_ids

from sglang_double import SGLangDouble, teacher_forced_logprobs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
FAST = dict(request_timeout_s=30.0, ready_timeout_s=20.0, max_retries=1, retry_backoff_s=0.01)

pytestmark = pytest.mark.timeout(180)


def _model(vocab: int, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        initializer_range=0.3)).eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = build_tokenizer()
    model = _model(len(tok), 0)
    d = tmp_path_factory.mktemp("probe_model")
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return model, str(d)


def _check(*overrides: str) -> RefitCheck:
    cfg = load_config(TINY, ["rollout.verify_weights=true", *overrides])
    return RefitCheck(cfg, {"vocab_size": 98, "max_position_embeddings": 512})


def test_probe_ids_are_fixed_inside_the_vocabulary_and_never_the_last_id():
    for vocab in (2, 3, 98, 151936):
        ids = probe_ids(vocab)
        assert len(ids) == PROBE_TOKENS and ids == probe_ids(vocab)
        assert all(0 <= t < vocab - 1 for t in ids)  # SGLang reports id vocab-1 as 0
    assert len(set(probe_ids(151936))) > 100  # spread over the vocabulary, not one token
    # a model whose positions are fewer than the probe's: the probe fits in them
    cfg = load_config(TINY, ["rollout.verify_weights=true"])
    assert len(RefitCheck(cfg, {"vocab_size": 50, "max_position_embeddings": 32}).ids) == 32


def test_the_first_push_and_every_nth_version_are_checked():
    c = _check("rollout.verify_every=3")
    assert c.due(7)  # the run's first push, whatever its version (a resumed run starts anywhere)
    c.judge(7, "x", {"mismatch_logprob_abs": 0.0, "mismatch_logprob_max": 0.0})
    assert [v for v in range(8, 16) if c.due(v)] == [9, 12, 15]
    c1 = _check()
    c1.started = True
    assert all(c1.due(v) for v in range(5))


def test_a_mismatch_past_the_tolerance_is_one_line_naming_the_server_and_nan_fails():
    c = _check("rollout.verify_logprob_tol=0.01")
    c.judge(3, "http://a:1", {"mismatch_logprob_abs": 0.0099, "mismatch_logprob_max": 0.5})
    for bad in (0.0101, float("nan"), float("inf")):
        with pytest.raises(WeightVerificationError) as e:
            c.judge(4, "http://a:1", {"mismatch_logprob_abs": bad, "mismatch_logprob_max": 1.0})
        msg = str(e.value)
        assert "\n" not in msg and "weight version 4" in msg and "http://a:1" in msg and "probe" in msg, msg
    assert c.checked == 1


def test_an_engine_answer_of_the_wrong_length_or_positive_is_refused():
    c = _check()
    n = len(c.ids) - 1

    class Fake:
        def __init__(self, lps):
            self.lps = lps

        def probe_logprobs(self, ids):
            return {"http://s:1": self.lps}

    assert c.engine_logprobs(Fake([-1.0] * n)) == {"http://s:1": [-1.0] * n}
    for lps in ([-1.0] * (n - 1), [-1.0] * (n - 1) + [0.5], [-1.0] * (n - 1) + [math.nan]):
        with pytest.raises(WeightVerificationError, match="http://s:1"):
            c.engine_logprobs(Fake(lps))


def test_the_in_process_engine_probe_is_transformers_and_leaves_sampling_alone(served):
    from gspo_megatron.rollout.base import SamplingParams

    model, d = served
    ids = probe_ids(model.config.vocab_size)
    a, b = HFEngine(d, seed=5), HFEngine(d, seed=5)
    got = a.probe_logprobs(ids)
    ref = teacher_forced_logprobs(model, ids[:1], ids[1:], 1.0)
    assert list(got) == ["in-process"]
    torch.testing.assert_close(torch.tensor(got["in-process"]), ref, atol=1e-5, rtol=0)
    sp = SamplingParams(temperature=1.0, max_new_tokens=5)
    assert ([s.response_ids for s in a.generate([[1, 5, 6]], 3, sp)]
            == [s.response_ids for s in b.generate([[1, 5, 6]], 3, sp)])  # the probe drew no randomness


def test_sglang_probe_reads_input_token_logprobs_of_every_worker(served):
    """SGLangEngine.probe_logprobs against two doubles: /generate with return_logprob and
    logprob_start_len 0; each server's answer is transformers' log-probs of the served weights.
    A double that stores another tensor gives other log-probs (what the trainer then refuses)."""
    model, d = served
    ids = probe_ids(model.config.vocab_size)
    ref = teacher_forced_logprobs(model, ids[:1], ids[1:], 1.0)
    with SGLangDouble(d) as d1, SGLangDouble(d) as d2:
        eng = SGLangEngine({"urls": [d1.url, d2.url]}, model_path=d, **FAST)
        try:
            got = eng.probe_logprobs(ids)
            assert sorted(got) == sorted([d1.url, d2.url])
            for lps in got.values():
                torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-5, rtol=0)
            (body,) = [r.body for r in d1.records if r.path == "/generate"]
            assert body["logprob_start_len"] == 0 and body["return_logprob"] is True
            assert body["sampling_params"] == {"temperature": 1.0, "max_new_tokens": 1}
            # one served tensor changed: that server's probe moves, the other's does not
            name = next(n for n in hub_weight_targets(d2.engine.model) if ".mlp.experts.0.down_proj" in n)
            with torch.no_grad():
                hub_weight_targets(d2.engine.model)[name].get().mul_(2.0)
            moved = eng.probe_logprobs(ids)
            delta = {u: float((torch.tensor(v) - ref).abs().mean()) for u, v in moved.items()}
            assert delta[d1.url] < 1e-5 < 1e-4 < delta[d2.url], delta
        finally:
            eng.close()


def test_the_double_answers_input_logprobs_as_sglang_0_5_23(served):
    """input_token_logprobs as SGLang builds them: None first, ids from logprob_start_len on, an
    id >= vocab_size - 1 reported as 0 (logprob_result_processor.py:37-38, 54-57); a start past the
    prompt refused with SGLang's message (scheduler.py:3275-3277); without return_logprob the
    start is ignored (scheduler.py:3256-3258)."""
    import json
    import urllib.request

    model, d = served
    vocab = model.config.vocab_size
    row = [1, 7, vocab - 1, 9]

    def post(body):
        req = urllib.request.Request(dbl.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    sp = {"temperature": 1.0, "max_new_tokens": 1}
    with SGLangDouble(d) as dbl:
        status, out = post({"input_ids": row, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 1})
        assert status == 200
        got = out["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in got] == [7, 0, 9] and got[0][0] is None
        ref = teacher_forced_logprobs(model, row[:2], row[2:], 1.0)
        assert max(abs(a[0] - b) for a, b in zip(got[1:], ref.tolist())) < 1e-5
        status, out = post({"input_ids": row, "sampling_params": sp, "return_logprob": True, "logprob_start_len": 9})
        assert status == 400 and "is higher than the number of input tokens" in out["error"]["message"]
        status, out = post({"input_ids": row, "sampling_params": sp, "logprob_start_len": 0})
        assert status == 200 and "input_token_logprobs" not in out["meta_info"]
