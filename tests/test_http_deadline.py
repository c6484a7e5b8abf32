"""One deadline per HTTP exchange, whatever the framing (issue 52, row 2): the project's one HTTP
client, rollout/http_servers.ServerClient (the judge, the SGLang and the vLLM engines all speak
through it; the first test keeps it the only one), against tests/http_standin.py answering with
Content-Length, chunked and close-delimited bodies and misbehaving at every point of an answer.

The bug this guards: http.client drops `conn.sock` when an answer will close the connection
(HTTPConnection.getresponse, `if response.will_close: self.close()`), so the watchdog that cuts an
exchange at its deadline found no socket and a close-delimited answer dripping a byte at a time
ran as long as the server liked (still running at 60 s with timeout_s=3)."""
from __future__ import annotations

import ast
import json

import pytest

from http_standin import FRAMINGS, StandIn

# any of these in a module of the package is an HTTP client that bypasses ServerClient's deadline
CLIENT_MODULES = ("http.client", "urllib.request", "urllib3", "requests", "httpx", "aiohttp", "websocket")
DEADLINE_S = 0.6
BODY = {"text": "é\u2028\x00" * 3000, "ids": list(range(500)), "nested": {"a": [1.5, None, True]}}


def _client(url, **kw):
    from gspo_megatron.rollout.http_servers import ServerClient

    return ServerClient(url, timeout_s=DEADLINE_S, max_retries=0, **kw)


def test_servers_client_is_the_packages_only_http_client():
    """By construction: no module of gspo_megatron but rollout/http_servers.py imports an HTTP client
    library, so every exchange of every engine, judge and tracker goes through request_once."""
    from testlib import project_trees

    found = []
    for rel, tree in project_trees("gspo_megatron"):
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if any(m == c or m.startswith(c + ".") for c in CLIENT_MODULES):
                    found.append((rel, m))
    assert found == [("gspo_megatron/rollout/http_servers.py", "http.client")], found


@pytest.mark.parametrize("framing", FRAMINGS)
def test_every_framing_returns_the_body_exactly(framing):
    with StandIn(BODY, framing=framing) as srv:
        c = _client(srv.url)
        for _ in range(2):  # a second exchange on a fresh connection, as every request is
            status, data = c.request_once("POST", "/generate", {"input_ids": [1, 2]})
            assert status == 200 and json.loads(data) == BODY
        assert [(m, p) for m, p, _ in srv.requests] == [("POST", "/generate")] * 2
        assert json.loads(srv.requests[0][2]) == {"input_ids": [1, 2]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["drip", "stall_status", "stall_headers", "stall_body"])
@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_slow_or_stalled_answer_ends_at_its_deadline(framing, how):
    """A 400-byte body dripped at 20 bytes a second would take 20 s: the exchange ends at its 0.6 s
    deadline in every framing, and the server sees the client go before it has sent the body."""
    from gspo_megatron.rollout.http_servers import DeadlineExceededError, RetryableHTTPError

    body = json.dumps({"x": "y" * 390}).encode()
    with StandIn(body, framing=framing, how=how) as srv:
        with pytest.raises(RetryableHTTPError) as e:
            _client(srv.url).request_once("POST", "/generate", {"input_ids": [1]})
        msg = str(e.value)
        assert "\n" not in msg and srv.url in msg and "/generate" in msg, msg
        if how in ("drip", "stall_body"):  # cut mid-body: the deadline's own error, with what came
            assert isinstance(e.value, DeadlineExceededError), msg
            assert f"deadline of {DEADLINE_S:g} s" in msg and e.value.received < len(body), msg
        else:  # before the body: a timeout either way (the socket's or the watchdog's)
            assert "timed out" in msg, msg
        assert srv.sent < len(body)


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_truncated_answer_is_an_error_where_the_framing_can_tell(framing):
    from gspo_megatron.rollout.http_servers import RetryableHTTPError

    body = json.dumps(BODY).encode()
    with StandIn(body, framing=framing, how="truncated") as srv:
        c = _client(srv.url)
        if framing == "close":  # the end of the connection is the end of the body: nothing to tell
            status, data = c.request_once("POST", "/generate", {})
            assert status == 200 and data == body[:len(body) // 2]
            with pytest.raises(ValueError):
                json.loads(data)  # what every caller does next: a failed, counted sample
        else:
            with pytest.raises(RetryableHTTPError, match="IncompleteRead"):
                c.request_once("POST", "/generate", {})


@pytest.mark.parametrize("framing", FRAMINGS)
def test_an_answer_over_the_cap_is_cut_in_every_framing(framing):
    from gspo_megatron.rollout.http_servers import ResponseTooLargeError

    # 64 MiB: far more than loopback socket buffers hold, so the stand-in can only have written it all
    # if the client read it all.
    with StandIn(framing=framing, how="oversize", oversize=64 << 20) as srv:
        c = _client(srv.url, response_cap=lambda *a: 4096)
        with pytest.raises(ResponseTooLargeError, match="cap of 4096 bytes"):
            c.request_once("POST", "/generate", {})
    assert srv.sent < 64 << 20


def test_a_line_that_is_not_http_is_one_retryable_line():
    from gspo_megatron.rollout.http_servers import RetryableHTTPError

    with StandIn(how="garbage") as srv:
        with pytest.raises(RetryableHTTPError) as e:
            _client(srv.url).request_once("GET", "/health")
        assert "\n" not in str(e.value) and srv.url in str(e.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("framing", FRAMINGS)
def test_the_judge_counts_a_dripping_judge_as_a_failed_sample_at_its_deadline(framing):
    """The judge's whole budget (its retries included) is one timeout_s: a judge dripping its answer
    fails the sample within it, in every framing, as a counted failure (not a hang)."""
    from gspo_megatron.config import JudgeConfig
    from gspo_megatron.rollout.judge import JudgeScorer

    answer = {"choices": [{"message": {"content": "Score: 1"}}], "pad": "y" * 400}
    with StandIn(answer, framing=framing, how="drip") as srv:
        judge = JudgeScorer(JudgeConfig(url=srv.url, timeout_s=1.0, retries=2))
        score, err = judge._one("an answer", {"prompt": "q", "answer": "a"})
        assert score is None and "no answer within reward.judge.timeout_s=1 s" in err, err
        assert srv.sent < len(json.dumps(answer))
