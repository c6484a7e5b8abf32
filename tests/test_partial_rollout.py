"""Partial rollouts (rollout/partial.py): a weight push interrupts the generation in progress,
the unfinished responses continue with the new weights, and every token records the version (and
carries the engine log-prob) of the policy that produced it.

- the in-process engine stops mid-generate on interrupt() and returns what it has;
- a push through the async producer lands mid-generation: each carried-over sample's tokens hold
  two versions, and the log-probs of each part equal transformers' teacher-forced log-probs of the
  model that generated it (and not the other model's);
- SGLangEngine against the double: /abort_request cuts running requests, which come back partial;
- the training loop (2 processes, the double taking 80 ms per token, async_steps=1, partial):
  samples are carried over pushes at most steps, staleness stays <= 1, and the run trains.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors import safe_open

from gspo_megatron.rollout.async_producer import RolloutProducer
from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.hf_engine import HFEngine
from gspo_megatron.rollout.partial import PartialGenerator
from test_rollout_hf_engine import make_model, teacher_forced_logprobs
from run_output import explain

MAX_NEW = 12


@pytest.fixture(scope="module")
def tok():
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    return build_tokenizer()


@pytest.fixture(scope="module")
def prompts(tok):
    from gspo_megatron.rollout.data import render_prompt

    return [render_prompt(tok, "12+34="), render_prompt(tok, "reverse 1234567")]


def _engine(tok, seed=0):
    # no eos: every row runs to max_new_tokens unless interrupted
    return HFEngine(make_model(tok, seed), tokenizer=tok, eos_token_ids=(), seed=5)


def _on_forward(model, at: int, action):
    """Call action() once, during generate's `at`-th forward (1 = its prefill). The prompts here
    repeat (n = 2), so the engine's shared prefill (hf_engine.py `_shared_prefill`: each distinct
    prompt once, all but its last column) is one forward before generate's."""
    calls = [0]

    def hook(mod, args):
        calls[0] += 1
        if calls[0] == at + 1:
            action()

    return model.model.register_forward_pre_hook(hook)


def _hub(tmp_path, model):
    model.save_pretrained(str(tmp_path))
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.timeout(120)
def test_hf_engine_interrupt_returns_partial_rows(tok, prompts):
    eng = _engine(tok)
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    h = _on_forward(eng.model, 3, eng.interrupt)  # during the 3rd forward: 3 tokens exist after it
    try:
        out = eng.generate(prompts, 2, sp)
    finally:
        h.remove()
    assert [s.finish_reason for s in out] == ["abort"] * 4
    assert [len(s.response_ids) for s in out] == [3] * 4
    for s in out:  # the tokens it has come with their log-probs
        ref, _ = teacher_forced_logprobs(eng.model, s.prompt_ids, s.response_ids, 1.0)
        torch.testing.assert_close(torch.tensor(s.response_logprobs), ref, atol=1e-5, rtol=0)
        assert s.routed_experts is None
    # until resume(), generate returns at once with empty partial rows
    assert [(s.finish_reason, len(s.response_ids)) for s in eng.generate(prompts, 1, sp)] == [("abort", 0)] * 2
    eng.resume()
    assert [(s.finish_reason, len(s.response_ids)) for s in eng.generate(prompts, 1, sp)] == [("length", MAX_NEW)] * 2


@pytest.mark.timeout(180)
def test_push_mid_generation_carries_samples_over_two_versions(tok, prompts, tmp_path):
    """The must-show: a weight push lands during the 5th forward of a rollout; every sample's first
    5 tokens are version 0 with model A's log-probs, the other 7 version 1 with model B's."""
    cut = 5
    eng = _engine(tok, seed=0)
    model_a = make_model(tok, 0)
    model_b = make_model(tok, 42)
    weights_b = _hub(tmp_path / "b", model_b)
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    gate = threading.Condition()
    box: list = []
    landed = threading.Event()

    def land():  # the trainer's push arrives now: its interrupt is what stops generation
        eng.interrupt()
        landed.set()

    def push():
        if landed.wait(60):
            box[0].push(lambda: eng.update_weights(weights_b.items(), 1), interrupt=eng)

    # the hook before the producer: its thread starts generating at construction, and a hook
    # registered after the first forward counted one forward late (fresh-clone run 10: 6 tokens of
    # version 0, not 5)
    h = _on_forward(eng.model, cut, land)
    gen = PartialGenerator(eng, gate, timeout_s=60, stopped=lambda: bool(box) and box[0].stopped)
    producer = RolloutProducer(lambda t: gen.generate(prompts, 2, sp, seed=11), start=0, end=1, max_ahead=1,
                               version=lambda: eng.weight_version, data_state=dict, lock=gate, timeout_s=60)
    box.append(producer)
    pusher = threading.Thread(target=push)
    pusher.start()
    try:
        batch, _ = producer.get(0)
    finally:
        h.remove()
        producer.close(timeout_s=30)
        pusher.join(timeout=30)
    assert not pusher.is_alive() and eng.weight_version == 1
    samples = batch.payload
    assert len(samples) == 4 and gen.carried == 4
    for s in samples:
        assert s.token_versions == [0] * cut + [1] * (MAX_NEW - cut), s.token_versions
        assert s.weight_version == 0 and s.finish_reason == "length" and s.meta["segments"] == 2
        assert s.text == tok.decode(s.response_ids, skip_special_tokens=True)
        got = torch.tensor(s.response_logprobs)
        lp_a, _ = teacher_forced_logprobs(model_a, s.prompt_ids, s.response_ids, 1.0)
        lp_b, _ = teacher_forced_logprobs(model_b, s.prompt_ids, s.response_ids, 1.0)
        torch.testing.assert_close(got[:cut], lp_a[:cut], atol=1e-4, rtol=0)  # A generated these
        torch.testing.assert_close(got[cut:], lp_b[cut:], atol=1e-4, rtol=0)  # B, given A's prefix
        # the two policies disagree on these tokens, so the attribution above can fail
        assert (got[cut:] - lp_a[cut:]).abs().max() > 0.05 and (got[:cut] - lp_b[:cut]).abs().max() > 0.05


@pytest.mark.timeout(120)
def test_sglang_engine_interrupt_cuts_running_requests(tok, tmp_path):
    from sglang_double import SGLangDouble
    from test_train_sglang import _tiny_hf_dir

    from gspo_megatron.rollout.sglang_engine import SGLangEngine

    from sglang_double import Faults

    hf_dir = _tiny_hf_dir(tmp_path / "hf")
    # every request decodes 2 tokens and holds until the abort: the interrupt comes once both requests
    # (one per prompt) hold, never on a timer (a timer raced the requests on a loaded machine)
    with SGLangDouble(hf_dir, faults=Faults(per_token_s=0.01, hold_after_tokens=2)) as server:
        eng = SGLangEngine({"urls": [server.url], "request_timeout_s": 30, "ready_timeout_s": 30,
                            "max_retries": 0})

        def interrupt_when_held():
            deadline = time.monotonic() + 60
            while server.holding < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            eng.interrupt()

        try:
            sp = SamplingParams(temperature=1.0, max_new_tokens=8)
            threading.Thread(target=interrupt_when_held, daemon=True).start()
            out = eng.generate([[5, 6, 7], [8, 9]], 2, sp)
            # answered at the abort, not after 8 tokens: the rows with the 2 tokens decoded so far;
            # a row the random model ended (eos) within those 2 tokens finished before the interrupt
            aborted = [s for s in out if s.finish_reason == "abort"]
            assert aborted and all(s.finish_reason == "stop" and len(s.response_ids) <= 2
                                   for s in out if s.finish_reason != "abort"), \
                [(s.finish_reason, len(s.response_ids)) for s in out]
            assert all(len(s.response_ids) == 2 and len(s.response_logprobs) == 2 for s in aborted), \
                [len(s.response_ids) for s in aborted]
            assert eng.metrics["interrupted_rows"] == len(aborted) and eng.metrics["retries"] == 0  # not retried
            sent = eng.metrics["requests"]
            again = eng.generate([[5, 6, 7]], 2, sp)  # interrupted: nothing is sent
            assert [(s.finish_reason, len(s.response_ids)) for s in again] == [("abort", 0)] * 2
            assert eng.metrics["requests"] == sent
            eng.resume()
            server.faults.hold_after_tokens = 0
            assert all(s.finish_reason in ("length", "stop") for s in eng.generate([[5, 6, 7]], 2, sp))
        finally:
            eng.close()


@pytest.mark.timeout(600)
def test_loop_with_partial_rollouts_carries_samples_over_pushes(tmp_path):
    import json
    from sglang_double import SGLangDouble
    from testlib import train_pooled
    from test_train_sglang import _tiny_hf_dir, double_run_args

    from sglang_double import Faults

    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    steps = 4
    # By construction, not by timing (a loaded machine once trained slower than the double
    # decoded, and no push met a generation): step 2's batch (requests 4-7: one per prompt, no
    # dynamic sampling) decodes 2 tokens and holds until an abort. The producer generates it while
    # step 1 trains, so the push after step 1 must interrupt it: its rows come back with 2 tokens
    # and continue with the new weights. The double's generation competes with the trainer for
    # the CPU: the push's abort waits until one of those requests holds (has its 2 tokens), else
    # a step trained faster than the double generated would cut rows with no tokens (the delay
    # fault makes step 2's requests 3 s late by construction).
    faults = Faults(hold_after_tokens=2, hold_from_request=4, hold_requests=4, abort_all_waits_for_holding=1,
                    delay_s=3.0, delay_after=4, delay_requests=4)
    with SGLangDouble(hf_dir, faults=faults) as server:
        out = tmp_path / "run"
        args = double_run_args(hf_dir, out, steps, server.url, tmp_path / "sync", "rollout.prompts_per_step=4",
                               "rollout.samples_per_prompt=4", "train.minibatches_per_step=1", "rollout.async_steps=1",
                               "rollout.partial=true", "rollout.dynamic_sampling=false")
        r = train_pooled(2, *args, timeout=560)
        assert r.returncode == 0, explain(r.stderr)
        aborts = len(server.calls("/abort_request"))
        assert server.waits_timed_out == 0
    rows = [json.loads(x) for x in open(out / "metrics.jsonl") if '"gspo"' in x]
    assert [x["step"] for x in rows] == list(range(1, steps + 1))
    carried = [x["samples_carried"] for x in rows]
    print("samples carried over a push per step:", carried, "aborts sent:", aborts)
    print([{k: x.get(k) for k in ("t_wait_rollout", "t_train", "t_weight_sync", "rollout_version", "staleness_max")} for x in rows])
    assert aborts >= 1 and sum(carried) >= 1, (carried, aborts)
    assert all(x["staleness_max"] <= 1 and x["samples_dropped_stale"] == 0 for x in rows)
    assert all(x["loss"] == x["loss"] for x in rows)  # finite, trained


def test_max_token_age_masks_old_tokens_and_config_checks(tmp_path):
    from gspo_megatron.config import ConfigError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.base import Sample
    from gspo_megatron.train.batch import _full_sequence
    from gspo_megatron.train.loop import to_train_samples

    carried = Sample(0, [1, 2], [5, 6, 7, 8], [-1.0] * 4, "length", 3, token_versions=[3, 3, 4, 4])
    fresh = Sample(0, [1, 2], [5, 6], [-1.0] * 2, "stop", 4)
    a, b = to_train_samples([carried, fresh], [1.0, 0.0], 2, step=5, max_token_age=1)
    assert a.token_mask == [False, False, True, True] and b.token_mask is None  # all of b is young enough
    _, _, mask, _ = _full_sequence(a, 8, 0)
    assert mask.tolist() == [False, False, False, True, True, False, False, False]  # positions predicting 7, 8
    assert to_train_samples([carried, fresh], [1.0, 0.0], 2, step=5)[0].token_mask is None  # option off

    from test_config import minimal

    cfg = minimal(tmp_path)
    with pytest.raises(ConfigError, match="rollout.partial needs rollout.async_steps >= 1"):
        load_config(str(cfg), ["rollout.partial=true"])
    with pytest.raises(ConfigError, match="loss.max_token_age needs rollout.async_steps >= 1"):
        load_config(str(cfg), ["loss.max_token_age=1"])
    assert load_config(str(cfg), ["rollout.async_steps=1", "rollout.partial=true"]).rollout.partial
