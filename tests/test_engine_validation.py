"""Engine output is checked at the boundary (rollout/validate.py) and HTTP reads are bounded
(rollout/http_servers.py ServerClient.request_once).

* `check_response` over odd inputs, property style (random lengths, NaN / inf / null / positive /
  boundary values, ids at and past the vocabulary's ends, bools and floats as ids) against the rules
  written out independently here;
* SGLang (the test double misbehaving on request) and vLLM (a minimal local stub of its generate
  route): a response 40 tokens over max_new_tokens, NaN (as `NaN` and as orjson's `null`) log-probs
  and an id past the vocabulary are retried, and when every attempt violates, the group comes back
  as rejected samples (empty, meta["rejected"] naming the server and the reason), counted in
  metrics["rejected"], with a log line naming the server; generate() still returns
  len(prompts) * n samples in order; a violation that a retry cures costs nothing;
* agents: a session whose turn is rejected (by the engine, or over the session's own budget) ends,
  and its sample is rejected;
* a slow-loris server (one byte every 0.5 s) fails the request at the overall deadline, having
  sent fewer bytes than it would have; a body over the cap is refused (declared by Content-Length,
  or streamed without one) without being read whole.
"""
from __future__ import annotations

import json
import logging
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from gspo_megatron.rollout.base import Sample, SamplingParams
from gspo_megatron.rollout.tokenizer import build_tokenizer
from gspo_megatron.rollout.validate import (
    LOGPROB_TOL,
    EngineRejectedError,
    check_rejected_frac,
    check_response,
    rejected_reason,
)

from sglang_double import Faults, start_double_and_engine

pytestmark = pytest.mark.timeout(180)
FAST = dict(request_timeout_s=30.0, ready_timeout_s=20.0, max_retries=1, retry_backoff_s=0.01)


# ------------------------------------------------------------------------------ the pure rule
def _oracle(ids, lps, max_new, vocab) -> bool:
    """True when the response is valid, written from the rules, not from the implementation."""
    if len(ids) > max_new or len(lps) != len(ids):
        return False
    for t in ids:
        if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
            return False
    for x in lps:
        if x is None or type(x) is bool or not isinstance(x, (int, float)):
            return False
        if not math.isfinite(x) or x > LOGPROB_TOL:
            return False
    return True


def test_check_response_over_odd_inputs():
    rng = random.Random(1234)
    vocab = 50
    good_ids = [0, 1, vocab - 1, 17]
    bad_ids = [-1, vocab, vocab + 3, 10 ** 12, True, 3.0, "5", None]
    good_lps = [0.0, -0.0, -1e-30, -0.25, -7.5, -1e6, LOGPROB_TOL, LOGPROB_TOL / 2, 1e-7, -3]
    bad_lps = [math.nan, math.inf, -math.inf, math.nextafter(LOGPROB_TOL, 1.0), 0.5, 12.0, None, True, "x", -1e400]
    seen = {True: 0, False: 0}
    for _ in range(4000):
        max_new = rng.randint(1, 12)
        n = rng.choice([0, max_new, max_new + 1, rng.randint(0, max_new + 3)])
        ids = [rng.choice(good_ids) if rng.random() > 0.05 else rng.choice(bad_ids) for _ in range(n)]
        lps = [rng.choice(good_lps) if rng.random() > 0.05 else rng.choice(bad_lps) for _ in range(n)]
        if rng.random() < 0.05:
            lps = lps + [-0.1] if rng.random() < 0.5 else lps[:-1]
        v = None if rng.random() < 0.1 else vocab
        why = check_response(ids, lps, max_new_tokens=max_new, vocab_size=v)
        valid = _oracle(ids, lps, max_new, v)
        assert (why is None) == valid, (ids, lps, max_new, v, why)
        assert why is None or (isinstance(why, str) and why and "\n" not in why)
        seen[valid] += 1
    assert min(seen.values()) > 500, seen  # both outcomes were exercised


@pytest.mark.parametrize("ids,lps,max_new,vocab,expect", [
    ([], [], 1, 10, None),
    ([9] * 4, [-1.0] * 4, 4, 10, None),  # exactly the budget, the last id of the vocabulary
    ([9] * 5, [-1.0] * 5, 4, 10, "5 tokens for max_new_tokens=4"),
    ([10], [-1.0], 4, 10, "outside the vocabulary"),
    ([-1], [-1.0], 4, None, "outside the vocabulary"),
    ([10 ** 9], [-1.0], 4, None, None),  # no vocabulary known: only >= 0
    ([1], [LOGPROB_TOL], 4, 10, None),
    ([1], [math.nextafter(LOGPROB_TOL, 1.0)], 4, 10, "above 0"),
    ([1], [-math.inf], 4, 10, "not finite"),
    ([1], [None], 4, 10, "null"),
    ([1, 2], [-1.0], 4, 10, "1 log-probs for 2 tokens"),
    ([True], [-1.0], 4, 10, "not an integer id"),
])
def test_check_response_boundaries(ids, lps, max_new, vocab, expect):
    why = check_response(ids, lps, max_new_tokens=max_new, vocab_size=vocab)
    if expect is None:
        assert why is None
    else:
        assert why is not None and expect in why


def test_check_rejected_frac_is_one_line_above_the_limit():
    ok = Sample(0, [1], [2], [-0.1], "stop", 0)
    bad = Sample(0, [1], [], [], "abort", 0, meta={"rejected": "SGLang server http://x:1: 48 tokens"})
    assert rejected_reason(ok) is None and rejected_reason(bad).startswith("SGLang server http://x:1")
    assert check_rejected_frac([ok, bad], 0.5) == 1
    with pytest.raises(EngineRejectedError, match=r"2 of 3 samples .*max_rejected_frac=0.5.*http://x:1"):
        check_rejected_frac([ok, bad, bad], 0.5)


# ------------------------------------------------------------------------------ SGLang (double)
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=2, bos_token_id=None, initializer_range=0.3)
    d = tmp_path_factory.mktemp("tiny_qwen3_moe_validation")
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return str(d)


PROMPTS = [[5, 6, 7], [8, 9]]
SP = SamplingParams(temperature=0.8, max_new_tokens=8)


def _assert_group0_rejected(samples, n, url, what):
    assert len(samples) == len(PROMPTS) * n
    assert [s.prompt_index for s in samples] == [i for i in range(len(PROMPTS)) for _ in range(n)]
    for s in samples:  # nothing over budget, outside the vocabulary or non-finite is trainable
        assert len(s.response_ids) <= SP.max_new_tokens
        assert all(math.isfinite(x) and x <= LOGPROB_TOL for x in s.response_logprobs)
    bad = [s for s in samples if rejected_reason(s)]
    assert len(bad) == n and all(s.prompt_index == 0 for s in bad), [rejected_reason(s) for s in samples]
    for s in bad:
        assert s.response_ids == [] and s.response_logprobs == []
        assert url in rejected_reason(s) and what in rejected_reason(s), rejected_reason(s)
    assert all(not rejected_reason(s) and s.response_ids for s in samples if s.prompt_index == 1)


@pytest.mark.parametrize("fault,what", [
    (dict(overlong=2), "48 tokens for max_new_tokens=8"),
    (dict(nan_logprobs=2), "not finite"),
    (dict(nan_logprobs=2, nan_as="null"), "null"),
    (dict(oov_ids=2), "outside the vocabulary"),
])
def test_sglang_violating_responses_are_rejected_and_counted(model_dir, fault, what, caplog):
    # concurrency 1: group 0's request and its retry come first and take both faulty answers
    with start_double_and_engine(model_dir, faults=Faults(**fault), concurrency=1, **FAST) as (dbl, eng):
        with caplog.at_level(logging.WARNING, logger="gspo_megatron.rollout"), \
                pytest.warns(UserWarning, match="before any update_weights"):
            samples = eng.generate(PROMPTS, 2, SP)
        _assert_group0_rejected(samples, 2, dbl.url, what)
        assert eng.metrics["rejected"] == 2 and eng.metrics["retries"] == 1
        assert len(dbl.calls("/generate")) == 3  # group 0 twice (retried), group 1 once
        lines = [r.getMessage() for r in caplog.records if dbl.url in r.getMessage() and what in r.getMessage()]
        assert lines, [r.getMessage() for r in caplog.records]


def test_sglang_a_violation_a_retry_cures_is_not_rejected(model_dir):
    with start_double_and_engine(model_dir, faults=Faults(overlong=1), concurrency=1, **FAST) as (dbl, eng):
        with pytest.warns(UserWarning, match="before any update_weights"):
            samples = eng.generate(PROMPTS, 2, SP)
        assert not any(rejected_reason(s) for s in samples) and len(samples) == 4
        assert all(0 < len(s.response_ids) <= 8 for s in samples)
        assert eng.metrics["rejected"] == 0 and eng.metrics["retries"] == 1


# ------------------------------------------------------------------------------ vLLM (local stub)
class _VLLMStub:
    """POST /inference/v1/generate answering like vLLM 0.32 (choices with token_ids, logprobs.content,
    finish_reason, weight_versions), misbehaving as `mode` says for the first `bad` requests."""

    def __init__(self, mode: str, bad: int, vocab: int):
        self.mode, self.bad, self.vocab, self.calls = mode, bad, vocab, 0
        stub = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                data = json.dumps(stub.answer(body)).encode()  # allow_nan: NaN is written as NaN
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def answer(self, body):
        sp = body["sampling_params"]
        k, n = int(sp["max_tokens"]), int(sp["n"])
        self.calls += 1
        bad = self.calls <= self.bad and body["token_ids"] == PROMPTS[0]
        choices = []
        for i in range(n):
            ids = [7 + i] * k
            lps = [-0.5] * k
            if bad and self.mode == "overlong":
                ids, lps = ids + [7] * 40, lps + [-0.5] * 40
            if bad and self.mode == "nan":
                lps[-1] = float("nan")
            if bad and self.mode == "oov":
                ids[-1] = self.vocab + 3
            choices.append({"index": i, "finish_reason": "length", "token_ids": ids,
                            "logprobs": {"content": [{"token_id": t, "logprob": x} for t, x in zip(ids, lps)]},
                            "weight_versions": [{"version": "default", "start": 0, "end": len(ids)}]})
        return {"request_id": body["request_id"], "choices": choices}

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("mode,what", [("overlong", "48 tokens for max_new_tokens=8"), ("nan", "not finite"),
                                       ("oov", "outside the vocabulary")])
def test_vllm_violating_responses_are_rejected_and_counted(mode, what, caplog):
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    stub = _VLLMStub(mode, bad=2, vocab=100)
    try:
        eng = VLLMEngine({"urls": [stub.url], "max_retries": 1, "concurrency": 1, "request_timeout_s": 30},
                         hf_config={"vocab_size": 100}, wait_ready=False, retry_backoff_s=0.01)
        with caplog.at_level(logging.WARNING, logger="gspo_megatron.rollout"):
            samples = eng.generate(PROMPTS, 2, SP)
        _assert_group0_rejected(samples, 2, stub.url, what)
        assert eng.metrics["rejected"] == 2 and eng.metrics["retries"] == 1
        assert any(stub.url in r.getMessage() and what in r.getMessage() for r in caplog.records)
        eng.close()
    finally:
        stub.close()


# ------------------------------------------------------------------------------ agents
def test_an_agent_session_over_its_budget_or_fed_a_rejected_turn_is_rejected(tok):
    from gspo_megatron.rollout.agent import AgentRunner

    def generate(prompts, n, sampling, *, seed=None):
        out = []
        for i, p in enumerate(prompts):
            if p[0] == 1:  # prompt 0: the engine answers over the turn's budget
                ids = [10] * (sampling.max_new_tokens + 40)
                out.append(Sample(i, list(p), ids, [-0.1] * len(ids), "length", 0))
            elif len(p) > 3:  # prompt 1, second turn: the engine rejected it
                out.append(Sample(i, list(p), [], [], "abort", 0, meta={"rejected": "vLLM server http://h:1: NaN"}))
            else:
                out.append(Sample(i, list(p), [11, 12], [-0.1, -0.2], "stop", 0))
        return out

    turns = []

    def agent(example, s):
        a = s.generate(max_new_tokens=2)
        b = s.generate(max_new_tokens=2)
        turns.append((example["k"], a, b, s.done))
        return 1.0

    runner = AgentRunner(agent, tok, max_response_tokens=16)
    res = runner.run(generate, [{"k": 0}, {"k": 1}], [[1, 2], [3, 4]], 1, SP)
    assert res.errors == [None, None]
    r0, r1 = (rejected_reason(s) for s in res.samples)
    assert r0 is not None and "42 tokens for max_new_tokens=2" in r0
    assert r1 is not None and "http://h:1" in r1
    assert all(s.response_ids == [] and s.response_logprobs == [] for s in res.samples)
    assert sorted(turns) == [(0, [], [], True), (1, [11, 12], [], True)]
    assert res.stats["rejected"] == 2


# ------------------------------------------------------------------------------ bounded reads
class _Server:
    """A local HTTP server whose POST answer is `body`, sent as `how` says: "loris" (status line,
    headers and then the body one byte every `every_s`), "declared" (a Content-Length over the
    cap, then a few bytes), "stream" (no Content-Length, chunks until the client goes away).
    `sent` counts the body bytes written; `done` is set when the handler stops writing."""

    def __init__(self, how: str, body: bytes, every_s: float = 0.5):
        self.how, self.body, self.every_s = how, body, every_s
        self.sent, self.done = 0, threading.Event()
        srv = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    srv.serve(self)
                except OSError:
                    pass  # the client went away
                finally:
                    srv.done.set()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def serve(self, h):
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        if self.how == "stream":
            h.send_header("Connection", "close")
            h.end_headers()
            while self.sent < 64 << 20:  # stops when the client has gone (OSError) or at 64 MiB
                h.wfile.write(b" " * 65536)
                self.sent += 65536
            return
        h.send_header("Content-Length", str(len(self.body) if self.how == "loris" else 1 << 30))
        h.end_headers()
        if self.how == "declared":
            h.wfile.write(self.body[:10])
            self.sent += 10
            return
        h.wfile.flush()
        for b in self.body:
            stop = threading.Event()
            stop.wait(self.every_s)
            h.wfile.write(bytes([b]))
            h.wfile.flush()
            self.sent += 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_slow_loris_answer_fails_at_the_overall_deadline():
    from gspo_megatron.rollout.http_servers import RetryableHTTPError, ServerClient

    body = json.dumps({"x": "y" * 80}).encode()  # 89 bytes at 0.5 s each: ~45 s if let through
    srv = _Server("loris", body)
    try:
        c = ServerClient(srv.url, timeout_s=2.0, max_retries=0)
        with pytest.raises(RetryableHTTPError, match="deadline of 2 s") as e:  # retried like a timeout
            c.request_once("POST", "/generate", {"input_ids": [1]})
        assert type(e.value).__name__ == "DeadlineExceededError" and e.value.received < len(body)
        assert srv.done.wait(30)  # the server noticed the client had gone before it sent it all
        assert srv.sent < len(body)
    finally:
        srv.close()


def test_the_engine_fails_a_slow_loris_generate_at_its_deadline(model_dir):
    from gspo_megatron.rollout.sglang_engine import SGLangEngine, SGLangServerError

    body = json.dumps({"meta_info": {}, "pad": "y" * 60}).encode()
    srv = _Server("loris", body)
    try:
        eng = SGLangEngine({"urls": [srv.url]}, wait_ready=False, request_timeout_s=2.0, max_retries=0,
                           model_path=model_dir)
        with pytest.warns(UserWarning, match="before any update_weights"), \
                pytest.raises(SGLangServerError, match="deadline"):
            eng.generate([[1, 2, 3]], 1, SP)
        assert srv.done.wait(30) and srv.sent < len(body)
        eng.close()
    finally:
        srv.close()


@pytest.mark.parametrize("how", ["declared", "stream"])
def test_a_body_over_the_cap_is_refused(how):
    from gspo_megatron.rollout.http_servers import RetryableHTTPError, ServerClient

    srv = _Server(how, b'{"x": 1}' * 4)
    try:
        c = ServerClient(srv.url, timeout_s=30.0, max_retries=0)
        c.response_cap = lambda method, path, payload: 1 << 20  # what an engine derives from its request
        with pytest.raises(RetryableHTTPError, match=r"cap of 1048576 bytes"):
            c.request_once("POST", "/generate", {"input_ids": [1]})
        assert srv.done.wait(30)
        assert srv.sent < 64 << 20  # the client stopped reading; the server could not send it all
    finally:
        srv.close()


def test_generate_caps_grow_with_the_request_and_cover_routing():
    from gspo_megatron.rollout.http_servers import generate_response_cap

    small = generate_response_cap(1, 8)
    assert small >= 1 << 20  # the floor
    assert generate_response_cap(8, 4096) > 8 * 4096 * 100  # far above an honest answer
    routed = generate_response_cap(2, 64, extra_row_bytes=10 ** 6)
    assert routed - generate_response_cap(2, 64) == 2 * 10 ** 6


def test_cut_inflight_ends_a_hanging_exchange_at_once_and_only_that_servers():
    """ServerClient.cut_inflight (a server found dead by a health check, rollout/vllm_engine.py
    _Supervisor): a request the server never answers ends with a retryable error naming the
    reason, before the server would have answered, while another server's request is untouched."""
    from gspo_megatron.rollout.http_servers import RetryableHTTPError, ServerClient

    release = threading.Event()
    answered = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            release.wait(60)  # hangs until the test ends
            answered.append(self.path)
            try:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
            except OSError:
                pass

    servers = [ThreadingHTTPServer(("127.0.0.1", 0), H) for _ in range(2)]
    for srv in servers:
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    a, b = (ServerClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=60) for srv in servers)
    got: dict[str, BaseException | tuple] = {}

    def call(name, client):
        try:
            got[name] = client.request_once("GET", "/x")
        except BaseException as e:  # noqa: BLE001
            got[name] = e

    ta, tb = threading.Thread(target=call, args=("a", a)), threading.Thread(target=call, args=("b", b))
    ta.start(), tb.start()
    while a.inflight < 1 or b.inflight < 1:
        threading.Event().wait(0.01)
    assert a.cut_inflight("the server was found dead") == 1
    ta.join(30)
    assert not ta.is_alive() and isinstance(got["a"], RetryableHTTPError), got
    assert "cut short: the server was found dead" in str(got["a"]) and a.url in str(got["a"])
    assert not answered and tb.is_alive() and "b" not in got  # before any answer; b still waits
    release.set()
    tb.join(30)
    assert got["b"] == (200, b"{}")
    for srv in servers:
        srv.shutdown()
        srv.server_close()
