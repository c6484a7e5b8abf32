"""What a judge or engine server answers is untrusted input (issue 52, rows 3 and 4): an answer
nested deeper than the interpreter's recursion limit is a failed, counted sample or one line, never
a RecursionError escaping the rollout; a judge key read from the environment with a character an
HTTP header cannot carry (an env file's trailing CR) is one line naming the variable, never the key.
Servers: tests/http_standin.py."""
from __future__ import annotations

import pytest

from http_standin import StandIn

# Far past the default recursion limit (1000) and far inside any response cap: 200 KB.
DEEP = "[" * 100_000 + "]" * 100_000


def _judge(url, **kw):
    from gspo_megatron.config import JudgeConfig
    from gspo_megatron.rollout.judge import JudgeScorer

    return JudgeScorer(JudgeConfig(url=url, timeout_s=10.0, retries=0, **kw))


@pytest.mark.parametrize("where", ["body", "content"])
def test_a_judge_answer_nested_too_deeply_is_a_failed_counted_sample(where):
    """The answer itself (`body`), or the judge's message content read as JSON through
    score_json_field (`content`): the sample fails with a reason, the others in the batch are
    scored, and CombinedScorer counts the failure against reward.max_error_frac."""
    from gspo_megatron.rollout.judge import CombinedScorer

    if where == "body":
        body, kw = f'{{"choices": {DEEP}}}'.encode(), {}
    else:
        body, kw = {"choices": [{"message": {"content": DEEP}}]}, {"score_json_field": "score"}
    with StandIn(body) as srv:
        judge = _judge(srv.url, **kw)
        scores, raised = judge(["a", "b"], [{"prompt": "p", "answer": "1"}] * 2)
        assert raised == [True, True] and scores == [0.0, 0.0]
        assert all("nested too deeply" in e for e in judge.last_errors), judge.last_errors
        combined = CombinedScorer([("judge", judge, 1.0)], max_error_frac=1.0)
        _, raised = combined(["a"], [{"prompt": "p", "answer": "1"}])
        assert raised == [True]
        assert "nested too deeply" in combined.last_errors[0]


def test_an_engine_answer_nested_too_deeply_is_one_protocol_error_line():
    """Every engine's JSON answer goes through ServerClient.request -> parse_json: a protocol error
    (one line, not retried), which the engines report as the run's one line."""
    from gspo_megatron.rollout.http_servers import EngineProtocolError, ServerClient

    with StandIn(DEEP.encode()) as srv:
        with pytest.raises(EngineProtocolError, match="nested too deeply") as e:
            ServerClient(srv.url, timeout_s=10, max_retries=0).post("/generate", {})
    assert "\n" not in str(e.value)


def test_the_loads_of_every_answer_maps_every_parse_failure_to_valueerror():
    from gspo_megatron.rollout.http_servers import loads_answer

    assert loads_answer(b'{"a": [1, 2]}') == {"a": [1, 2]}
    for bad in (DEEP, DEEP.encode(), "{", b"\xff", "1" * 10_000):  # the last: over int_max_str_digits
        with pytest.raises(ValueError):
            loads_answer(bad)


@pytest.mark.parametrize("key", ["sk-secret\r", "sk-secret\n", "sk secret", "sk-sécret", "\tsk-secret"])
def test_a_judge_key_no_header_can_carry_is_one_line_naming_the_variable_never_the_key(key, monkeypatch):
    from gspo_megatron.errors import InputError

    monkeypatch.setenv("GSPO_TEST_JUDGE_KEY", key)
    with pytest.raises(InputError) as e:
        _judge("http://127.0.0.1:9", api_key_env="GSPO_TEST_JUDGE_KEY")
    msg = str(e.value)
    assert "reward.judge.api_key_env=GSPO_TEST_JUDGE_KEY" in msg and "\n" not in msg
    assert key.strip() not in msg and "secret" not in msg and "sécret" not in msg, msg


def test_a_judge_key_with_a_cr_stops_the_run_in_one_line_that_never_shows_it(tmp_path):
    """The trainer's own main (pooled ranks): the run stops in one line, exit non-zero, before any
    request, and nothing it printed holds the key."""
    from testlib import REPO, train_pooled

    key = "sk-GSPO-SENTINEL-4f1c"
    r = train_pooled(1, "--config", f"{REPO}/launch/configs/tiny_cpu.yaml", f"out_dir={tmp_path / 'run'}",
                     "parallel.tp=1", "parallel.sequence_parallel=false", "train.max_steps=1",
                     "reward.judge.url=http://127.0.0.1:9", "reward.judge.api_key_env=GSPO_TEST_JUDGE_KEY",
                     env={"GSPO_TEST_JUDGE_KEY": key + "\r"}, timeout=300)
    assert r.returncode != 0
    assert key not in r.stdout + r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    ours = [x for x in r.stderr.splitlines() if "error:" in x]
    assert len(ours) == 1 and "reward.judge.api_key_env=GSPO_TEST_JUDGE_KEY" in ours[0], r.stderr[-2000:]
