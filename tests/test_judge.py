"""LLM judges as rewards (reward.judge, rollout/judge.py) against a stand-in chat server that
misbehaves on demand: slow answers, HTTP 500s, 429s, unparsable text, answers that are not chat
completions. The stand-in refuses what vLLM's ChatCompletionRequest would not read (a body
without model/messages: 400) and speaks only POST /v1/chat/completions (404 otherwise); the
fields the judge sends are checked against vLLM's own source in test_vllm_contract.py, and a
real vLLM server judges a training run in test_vllm.py."""
from __future__ import annotations

import json
import math
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gspo_megatron.config import ConfigError, JudgeConfig
from gspo_megatron.resolve import load_config
from gspo_megatron.rollout.judge import CHAT_ROUTE, CombinedScorer, JudgeScorer
from gspo_megatron.rollout.rewards import RewardError
from run_output import explain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")

pytestmark = pytest.mark.timeout(300)


class StandInJudge:
    """A chat server whose answer to each request is `behave(user_message, n)` (n: the request's
    arrival index): ("ok", text), ("sleep", seconds), ("status", code), ("raw", bytes)."""

    def __init__(self, behave, api_key: str | None = None):
        self.behave, self.api_key = behave, api_key
        self.bodies: list[dict] = []
        self.slept = 0  # "sleep" answers that finished sleeping
        self._lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, data: bytes):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass

            def do_POST(self):
                if self.path != CHAT_ROUTE:
                    return self._send(404, b'{"detail":"Not Found"}')
                if outer.api_key and self.headers.get("Authorization") != f"Bearer {outer.api_key}":
                    return self._send(401, b'{"error":"Unauthorized"}')
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not isinstance(body.get("messages"), list) or "model" not in body:
                    return self._send(400, b'{"error":{"message":"model and messages are required"}}')
                with outer._lock:
                    n = len(outer.bodies)
                    outer.bodies.append(body)
                kind, arg = outer.behave(body["messages"][-1]["content"], n)
                if kind == "sleep":
                    time.sleep(arg)
                    with outer._lock:
                        outer.slept += 1
                    kind, arg = "ok", "7"
                if kind == "status":
                    return self._send(arg, b'{"error":{"message":"stand-in failure"}}')
                if kind == "raw":
                    return self._send(200, arg)
                answer = {"id": "x", "object": "chat.completion", "model": body["model"],
                          "choices": [{"index": 0, "message": {"role": "assistant", "content": arg},
                                       "finish_reason": "stop"}]}
                return self._send(200, json.dumps(answer).encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def judge():
    made = []

    def make(behave, **kw):
        j = StandInJudge(behave, **kw)
        made.append(j)
        return j

    yield make
    for j in made:
        j.close()


def _cfg(url, **kw) -> JudgeConfig:
    return JudgeConfig(url=url, **{"timeout_s": 2.0, "retries": 2, "max_concurrency": 4, **kw})


EXAMPLES = [{"prompt": f"q{i}", "answer": str(i)} for i in range(6)]
TEXTS = [f"response {i}" for i in range(6)]


def test_scores_are_parsed_from_the_template_the_judge_was_sent(judge):
    j = judge(lambda msg, n: ("ok", f"I'd say {len(msg) % 10}.5 out of 10"))
    s = JudgeScorer(_cfg(j.url, template="Q={prompt} A={answer} R={response} {unknown}"))
    scores, raised = s(TEXTS, EXAMPLES)
    assert raised == [False] * 6
    msgs = {b["messages"][0]["content"] for b in j.bodies}
    assert msgs == {f"Q=q{i} A={i} R=response {i} {{unknown}}" for i in range(6)}  # only the three fields
    assert scores == [len(f"Q=q{i} A={i} R=response {i} {{unknown}}") % 10 + 0.5 for i in range(6)]
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 16 and b["model"] == "judge" for b in j.bodies)


def test_a_json_field_score_and_an_api_key_from_the_environment(judge, monkeypatch):
    j = judge(lambda msg, n: ("ok", json.dumps({"score": n % 3, "why": "x"})), api_key="s3cret")
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    s = JudgeScorer(_cfg(j.url, score_json_field="score", api_key_env="JUDGE_KEY", max_concurrency=1))
    scores, raised = s(TEXTS, EXAMPLES)
    assert raised == [False] * 6 and scores == [0, 1, 2, 0, 1, 2]
    monkeypatch.setenv("JUDGE_KEY", "wrong")
    scores, raised = JudgeScorer(_cfg(j.url, score_json_field="score", api_key_env="JUDGE_KEY"))(TEXTS, EXAMPLES)
    assert raised == [True] * 6  # 401: not retried, scored as errors


def test_misbehaving_judges_are_scored_errors_within_the_timeout(judge):
    """Each failure is an error of its own sample only, with its reason; a judge that never
    answers costs at most timeout_s per sample (concurrently), never a stalled step; 5xx and 429
    are retried within the budget, so a judge that fails once then answers scores."""
    cases = {
        0: ("sleep", 30.0),  # never answers in time
        1: ("status", 500),  # always 500
        2: ("ok", "no number here"),  # unparsable
        3: ("raw", b"<html>not json</html>"),  # not a chat completion
        4: ("ok", "9" * 41),  # beyond float32
    }
    seen: dict[str, int] = {}

    def behave(msg, n):
        import re

        i = int(re.search(r"response (\d)", msg).group(1))
        seen[msg] = seen.get(msg, 0) + 1
        if i == 5:  # 429 once, then a score
            return ("status", 429) if seen[msg] == 1 else ("ok", "Score: 9")
        return cases[i]

    j = judge(behave)
    s = JudgeScorer(_cfg(j.url, timeout_s=1.5, retries=3, max_concurrency=6))
    scores, raised = s(TEXTS, EXAMPLES)
    print(s.last_errors)
    assert raised == [True, True, True, True, True, False] and scores[5] == 9.0
    assert j.slept == 0  # the call returned without waiting for the 30 s answer
    e = s.last_errors
    assert "timeout_s=1.5" in e[0] and "HTTP 500" in e[1] and "no match of score_regex" in e[2]
    assert "not a chat completion" in e[3] and "not a finite float32" in e[4] and e[5] is None
    assert all(j.url in x for x in e[:5])
    assert seen[next(m for m in seen if "response 1\n" in m)] >= 2  # 500s were retried


def test_a_deadline_after_a_server_error_still_names_the_server_error(judge):
    """The first attempt gets HTTP 500, the retry no answer within the deadline: the sample's
    reason names both, in order. Before, only the last: a timed-out retry hid the server's own
    error, and test_misbehaving_judges_are_scored_errors_within_the_timeout could fail on a
    loaded machine when its last, nearly budgetless, retry timed out."""
    j = judge(lambda msg, n: ("status", 500) if n == 0 else ("sleep", 30.0))
    s = JudgeScorer(_cfg(j.url, timeout_s=1.5, retries=1))
    scores, raised = s(TEXTS[:1], EXAMPLES[:1])
    e = s.last_errors[0]
    assert raised == [True] and len(j.bodies) == 2, (raised, len(j.bodies))
    assert "no answer within reward.judge.timeout_s=1.5 s (HTTP 500: " in e, e
    assert "; then: " in e and "timed out" in e.split("; then: ", 1)[1], e


def test_combined_rewards_are_weighted_counted_and_too_many_failures_stop_in_one_line(judge):
    j = judge(lambda msg, n: ("ok", "4") if "response 0" not in msg else ("status", 503))
    judge_s = JudgeScorer(_cfg(j.url, retries=0))

    def fn(texts, examples):
        return [1.0] * len(texts), [False] * len(texts)

    c = CombinedScorer([("fn", fn, 0.5), ("judge", judge_s, 2.0)], max_error_frac=0.5)
    total, raised = c(TEXTS, EXAMPLES)
    assert total == [0.5] + [0.5 + 8.0] * 5 and raised == [True] + [False] * 5
    m = c.take_metrics()
    assert m == {"reward_fn_mean": 1.0, "fn_errors": 0, "reward_judge_mean": 4.0, "judge_errors": 1}
    assert c.take_metrics()["judge_errors"] == 0  # per step
    bad = judge(lambda msg, n: ("status", 500))
    c2 = CombinedScorer([("judge", JudgeScorer(_cfg(bad.url, retries=0)), 1.0)], max_error_frac=0.5)
    with pytest.raises(RewardError) as e:
        c2(TEXTS, EXAMPLES)
    assert "\n" not in str(e.value) and "6 of 6" in str(e.value) and "HTTP 500" in str(e.value)


def test_judge_config_is_checked_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="reward.judge.url"):
        JudgeConfig(url="localhost:8000")
    with pytest.raises(ConfigError, match="{response}"):
        JudgeConfig(url="http://127.0.0.1:1", template="rate {prompt}")
    with pytest.raises(ConfigError, match="score_regex"):
        JudgeConfig(url="http://127.0.0.1:1", score_regex="(")
    with pytest.raises(ConfigError, match="reward.judge.timeout_s"):
        JudgeConfig(url="http://127.0.0.1:1", timeout_s=0)
    c = load_config(TINY, ["reward.judge.url=http://127.0.0.1:1"])
    assert c.reward.judge.url == "http://127.0.0.1:1" and c.reward.fn_weight is None


def test_the_default_score_regex_reads_exponents_and_refuses_what_is_not_finite():
    """Issue 52: the default score_regex had no exponent, so "8.5e-1" scored 8.5 and "1e309" 1.0.
    Reference: Python's float() of the whole number the judge wrote."""
    from gspo_megatron.rollout.judge import JudgeScorer

    j = JudgeScorer(JudgeConfig(url="http://127.0.0.1:1"))
    for answer, want in (("8.5e-1", 0.85), ("Score: 7", 7.0), ("-3.25E+1 points", -32.5), ("7e", 7.0),
                         ("10", 10.0), ("2.5e3x", 2500.0)):
        assert j.parse(answer) == pytest.approx(want), answer
    for answer in ("1e309", "-1e400", "9e38"):  # past float32: a failed sample
        with pytest.raises(ValueError, match="not a finite float32"):
            j.parse(answer)


@pytest.mark.parametrize("failure", ["stall", "http500"])
def test_a_samples_retries_share_its_one_budget(monkeypatch, failure):
    """Issue 52: every attempt of a sample gets only what is left of reward.judge.timeout_s, never
    the whole budget again. A fake clock (no sleeping, no elapsed-time bound): each attempt either
    fails after 3 s (or at the deadline it was given) or answers 500 after 1 s; each deadline the
    client was given is at most what was left of the budget (the whole budget again would not be)."""
    from gspo_megatron.rollout import judge as judge_mod
    from gspo_megatron.rollout.http_servers import DeadlineExceededError

    clock = {"t": 1000.0}

    class FakeTime:
        @staticmethod
        def monotonic():
            return clock["t"]

        @staticmethod
        def sleep(s):
            clock["t"] += max(0.0, s)

    from gspo_megatron.rollout import reward_servers

    monkeypatch.setattr(reward_servers, "time", FakeTime)  # the retry loop (ServedScorer.exchange) lives there
    j = judge_mod.JudgeScorer(JudgeConfig(url="http://127.0.0.1:1", timeout_s=10.0, retries=5))
    given: list[tuple[float, float]] = []  # (timeout_s given, budget left at that moment)
    start = clock["t"]

    def request_once(method, path, body, timeout_s):
        given.append((timeout_s, start + 10.0 - clock["t"]))
        if failure == "stall":  # cut after 3 s (or at its deadline, when that comes first)
            clock["t"] += min(timeout_s, 3.0)
            raise DeadlineExceededError("stalled", url="http://127.0.0.1:1")
        clock["t"] += 1.0
        return 500, b"busy"

    monkeypatch.setattr(j.client, "request_once", request_once)
    score, why = j._one("resp", {"prompt": "p", "answer": "a"})
    assert score is None and "no answer within reward.judge.timeout_s=10" in why, why
    assert given and all(t <= left + 1e-9 for t, left in given), given
    assert len(given) >= 3, given  # it did retry, each time with less
    assert all(b[0] < a[0] for a, b in zip(given, given[1:])), given


def test_a_text_override_keeps_the_text_typed():
    """`key=value` overrides are YAML: `Score: ([0-9.]+)` is a mapping and `1e3` a float. For a
    text field (str, Optional[str]) the text typed is kept; quotes are still removed, null is None
    where admitted, and a non-text field still takes YAML (a list, a number)."""
    c = load_config(TINY, ["reward.judge.url=http://127.0.0.1:1", "reward.judge.score_regex=Score: ([0-9.]+)",
                           "reward.judge.model=1e3", "reward.judge.score_json_field=null"])
    assert c.reward.judge.score_regex == "Score: ([0-9.]+)" and c.reward.judge.model == "1e3"
    assert c.reward.judge.score_json_field is None
    c = load_config(TINY, ["reward.judge.url=http://127.0.0.1:1", "reward.judge.model='a: b'",
                           "reward.judge.max_tokens=12", "rollout.vllm.extra_args=[--x, '1']"])
    assert c.reward.judge.model == "a: b" and c.reward.judge.max_tokens == 12
    assert list(c.rollout.vllm.extra_args) == ["--x", "1"]


@pytest.mark.timeout(600)
def test_a_judge_drives_training_and_its_failures_are_counted(judge, tmp_path):
    """3 GSPO steps whose reward is a stand-in judge's (fn_weight 0.5 with the task's reward):
    the judge scores by the response's length, one request in five answers HTTP 500 (retries 0:
    an error). Every row logs reward_judge_mean and judge_errors; the errors equal the 500s the
    stand-in sent; the run finishes."""
    from test_train_loop import gspo_rows
    from testlib import train_pooled

    def behave(msg, n):
        if n % 5 == 4:
            return ("status", 500)
        return ("ok", str(len(msg.split("Response: ")[1].split("\nScore:")[0]) % 7))

    j = judge(behave)
    out = tmp_path / "run"
    args = ["--config", TINY, f"out_dir={out}", "train.max_steps=3", "train.sft_warmup_steps=0",
            "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "checkpoint.interval=0",
            "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false", "eval.interval=0",
            f"reward.judge.url={j.url}", "reward.judge.retries=0", "reward.judge.timeout_s=20",
            "reward.fn_weight=0.5", "reward.max_error_frac=0.9"]
    r = train_pooled(2, *args, timeout=500)
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3]
    print([{k: x.get(k) for k in ("reward_mean", "reward_judge_mean", "judge_errors", "reward_raised")} for x in rows])
    assert all(math.isfinite(x["reward_judge_mean"]) and 0 <= x["reward_judge_mean"] <= 6 for x in rows)
    assert sum(x["judge_errors"] for x in rows) == sum(1 for n in range(len(j.bodies)) if n % 5 == 4) > 0
    assert all(x["reward_raised"] >= x["judge_errors"] for x in rows)
