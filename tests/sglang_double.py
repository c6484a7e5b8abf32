"""TEST DOUBLE of an SGLang server's HTTP API — not SGLang, never used outside tests.

It speaks the subset of SGLang 0.5.23's native HTTP API that `SGLangEngine` uses, with SGLang's
field names and shapes, and refuses what that SGLang refuses:
  * a request field not declared for its route in gspo_megatron/rollout/sglang_api.py (the table
    tests/test_sglang_contract.py checks against SGLang's source): HTTP 422, FastAPI-style;
  * ``/update_weights_from_distributed`` / ``/update_weights_from_tensor`` outside a
    ``/begin_weight_update`` ... ``/end_weight_update`` session: 400 with SGLang's message
    (scheduler_components/weight_updater.py); a second begin while one is open: 400;
  * the four weight-group / distributed / tensor routes on a server with ``dp_size > 1``: 500
    (tokenizer_control_mixin.py asserts dp_size == 1);
  * routes SGLang 0.5.23 does not have (``/get_weight_version``): 404. The weight version is in
    ``/model_info``.
``/generate`` (``input_ids`` single or batched,
``sampling_params`` dict or list, ``return_logprob``, ``rid``, ``return_routed_experts``,
``routed_experts_start_len``; answers ``text``, ``output_ids``,
``meta_info`` {``id``, ``finish_reason`` {type, ...}, ``prompt_tokens``, ``completion_tokens``,
``output_token_logprobs`` [[logprob, token_id, null], ...], ``weight_version``,
``routed_experts``}), ``/health``,
``/health_generate``, ``/model_info``, ``/get_model_info``, ``/server_info``, ``/get_server_info``
(deprecated in SGLang, still answered), ``/begin_weight_update``, ``/end_weight_update``,
``/flush_cache`` (400 while "busy"), ``/abort_request`` ({abort_all} or {rid}),
``/update_weights_from_disk``, ``/init_weights_update_group`` + ``/update_weights_from_distributed``
(joins the trainer's group over gloo and receives the broadcasts), ``/destroy_weights_update_group``,
``/update_weights_from_tensor`` (ForkingPickler/base64 payloads; the in-process double can open
CPU tensors shared by the same process), ``/release_memory_occupation``,
``/resume_memory_occupation`` (frees only with ``memory_saver`` / ``--enable-memory-saver``, as
SGLang; /generate and weight updates then fail until resumed), ``/pause_generation``, ``/continue_generation``; and, as a router,
``/list_workers`` (``router_of=[urls]``: /generate is forwarded round-robin).

Routed experts mirror SGLang 0.5.23: only a double started with ``enable_return_routed_experts``
(``--enable-return-routed-experts``) returns ``meta_info.routed_experts``; without it the field is
silently absent (SGLang's capturer is None, state_capturer/routed_experts.py `create`, and
batch_result_processor.py `_maybe_collect_routed_experts` returns early). ``routed_experts_start_len``
outside [0, prompt length] is refused whenever ``return_routed_experts`` is set (flag or not), with
SGLang's message and HTTP 400 (managers/scheduler.py ~3300: the request is aborted with a 400
finish reason, which the tokenizer manager raises as ValueError and http_server.py answers as
{"error": {"message": ...}}). The payload is base64 (standard alphabet) of the C-order int32
bytes of [seqlen - 1 - start_len, num_hidden_layers, num_experts_per_tok] for positions
start_len .. seqlen - 2, seqlen = prompt + response (state_capturer/base.py `get_topk`,
detokenizer_manager.py `_b64_encode_per_request`). The experts are transformers' own router's:
after generating, the served model runs once on prompt + response with forward hooks on every
``model.layers[i].mlp.gate`` (Qwen3MoeTopKRouter returns (logits, scores, top-k indices)).

Generation is transformers' on a local HF directory through `HFEngine` (so log-probs are
``log_softmax(logits / T)``, untruncated, as SGLang reports by default); weights are fp32 unless
``dtype`` says otherwise. Every request is recorded (``double.records``; ``GET /_double/records``
for a subprocess double); faults are injected through ``double.faults`` (or
``POST /_double/faults`` {field: value}). Besides transport faults (5xx, dropped connections,
delays, malformed JSON), the double can break the response contract on request, which SGLang
itself does not: rows ``overlong_by`` tokens over max_new_tokens (``overlong``), a NaN log-prob
(``nan_logprobs``; written as ``NaN`` or, as orjson writes a NaN, ``null``: ``nan_as``), a token id
past the vocabulary (``oov_ids``). Without faults every answer is what SGLang 0.5.23 would send.

In-process: ``with SGLangDouble(model_dir) as d: d.url``; ``start_double_and_engine(...)``
yields (double, SGLangEngine) wired together. As a process it takes SGLang's launch arguments
(``python tests/sglang_double.py --model-path DIR --port P ...``; unknown arguments are ignored),
which is how `sglang_server.ServerProcesses` is tested.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run as a script: make gspo_megatron importable
    sys.path.insert(0, _REPO)


from gspo_megatron.rollout.sglang_api import ENDPOINTS, SESSION_ROUTES  # noqa: E402


@dataclass
class Faults:
    """Fault injection. Counters are consumed one request at a time (thread-safe)."""

    fault_path: str = "/generate"  # the endpoint the counters below apply to
    fail_5xx: int = 0  # answer HTTP 500
    drop: int = 0  # close the connection without an answer
    malformed: int = 0  # answer 200 with a body that is not JSON
    missing_fields: int = 0  # answer 200 JSON without meta_info
    server_abort: int = 0  # /generate: finish_reason abort though nobody asked
    stale: int = 0  # /generate: report weight_version "stale-0"
    no_version: int = 0  # /generate: meta_info without weight_version (an older SGLang)
    delay_s: float = 0.0  # /generate waits this long (abortable) ...
    delay_after: int = 0  # ... from the (delay_after+1)-th /generate request to arrive on
    delay_requests: int = 0  # ... and only this many requests from there (0: every later one)
    never_ready: bool = False  # /health_generate answers 503 forever
    flush_busy: int = 0  # /flush_cache answers 400 ("requests pending") this many times
    routed_experts_short: int = 0  # /generate: routed_experts payloads 4 bytes short (one int32 missing)
    routed_experts_extra_row: int = 0  # /generate: routed_experts payloads one position too long
    # /generate answers after this many seconds per token of its longest response (a GPU server's
    # decode time; concurrent requests overlap, as a batching server's do; bench/bench_async.py)
    per_token_s: float = 0.0
    # no model run: every row gets max_new_tokens ids drawn from a generator seeded by its rid (no
    # eos, no stop strings), each with log-prob -ln(vocab). With per_token_s this is a GPU server
    # as the trainer sees it: answers after a decode time, costing the trainer's CPU nothing
    # (bench/bench_async.py; with the model's generation the double competes with the trainer)
    canned: bool = False
    # every /generate row decodes this many tokens, then holds until a retract pause has come and
    # gone (/pause_generation {"mode": "retract"} ... /continue_generation): a weight push then lands
    # mid-generation by construction, not by timing. 0 = off.
    hold_after_tokens: int = 0
    hold_from_request: int = 0  # ... for the (hold_from_request+1)-th /generate request to arrive on
    hold_requests: int = 0  # ... and only this many requests from there (0: every later one). An abort also ends a hold
    # the (j+1)-th /pause_generation first waits (bounded: pause_wait_s) until this many /generate
    # requests have been admitted (past the pause gate and the delay fault, set to be retracted):
    # with hold_after_tokens, the push a trainer sends while its next batch is in flight then meets
    # every request of that batch, however late the requests reach the double. A request admitted
    # after the pause would hold until the next pause, which an async trainer sends only once this
    # batch is in: a deadlock that only the request timeout ends. () = off.
    pause_waits_for_requests: tuple = ()
    # /abort_request {abort_all} first waits (bounded: pause_wait_s) until this many requests hold
    # (hold_after_tokens), until one abort has seen them: a partial rollout's interrupt then cuts
    # rows that have tokens, however slowly the double generated them beside the trainer. 0 = off.
    abort_all_waits_for_holding: int = 0
    pause_wait_s: float = 120.0  # the bound of the waits above (each gone past counts in waits_timed_out)
    # weight updates are checked and answered (and set the weight version) as usual, but the served
    # weights stay the old ones: a server that silently keeps stale weights (train/smoke.py must fail)
    stale_weights: bool = False
    # weight-update requests (a disk update is one; distributed / tensor updates send one per
    # bucket) from the (scale_from_update+1)-th on store the tensor `scale_tensor` (a hub name)
    # multiplied by `scale_by`: a server that corrupts one tensor of a push, silently
    # (train/refit_check.py's probe must name it). "" = off.
    scale_tensor: str = ""
    scale_by: float = 1.0
    scale_from_update: int = 0
    # /generate reports output_token_logprobs[t] + logprob_offset for every response position t
    # with t % logprob_offset_every == 0 (an engine whose numerics drift on some tokens: IcePop
    # must mask exactly those). Keep the offset negative: a log-prob > 0 is refused at the boundary.
    logprob_offset: float = 0.0
    logprob_offset_every: int = 3
    # A server whose answers break the response contract (rollout/validate.py must refuse them;
    # SGLang itself never sends these). Each counter is a number of /generate responses; in each,
    # every row is altered after a normal generation (routing, if any, is left as generated).
    overlong: int = 0  # rows carry `overlong_by` tokens beyond max_new_tokens (the last one repeated)
    overlong_by: int = 40
    nan_logprobs: int = 0  # each row's last log-prob is NaN, written as `nan_as` says:
    # "NaN" (Python's json, allow_nan) or "null" (orjson, SGLang's ORJSONResponse, writes NaN as null)
    nan_as: str = "NaN"
    oov_ids: int = 0  # each row's last token id is the model's vocab_size + 3


class _Decoding:
    """One request's decode clock: `decoded` steps so far (a float: per_token_s each), held at
    `hold` tokens until a retract pause when held; retract_k: the step a retract pause froze it at
    (SGLangDouble.pause_generation sets it at once, whatever this request's thread is doing)."""

    def __init__(self, per_token_s: float, hold: int):
        self.longest, self.per_token_s, self.hold = 0, per_token_s, hold
        self.held = False
        self.decoded, self.last = 0.0, 0.0
        self.started = False  # False while the request's tokens are being generated up front
        self.retract_k: int | None = None

    def start(self, longest: int, t0: float) -> None:
        self.longest, self.last, self.started = longest, t0, True
        self.held = 0 < self.hold < longest and self.retract_k is None

    def advance(self, now: float) -> None:
        if self.per_token_s > 0:
            self.decoded = min(self.longest, self.decoded + max(0.0, now - self.last) / self.per_token_s)
        else:
            self.decoded = float(self.longest)
        if self.held:
            self.decoded = min(self.decoded, self.hold)
        self.last = now

    def retract(self, now: float) -> None:
        if self.retract_k is None:
            if self.started:
                self.advance(now)
            self.retract_k = int(self.decoded)  # 0 before its generation: all of it comes after

    def resume(self, k: int, longest: int, now: float) -> None:
        self.decoded, self.longest, self.last = float(k), longest, now
        self.retract_k, self.held = None, False


class _Server(ThreadingHTTPServer):
    # socketserver's default listen backlog is 5: a burst of concurrent requests (a partial
    # rollout's continuations, one per row) overflows it, and the dropped connections retry their
    # SYN after 1 s, a stall real SGLang (uvicorn's backlog: 2048) never shows
    request_queue_size = 2048


@dataclass
class Record:
    method: str
    path: str
    body: Any
    t: float = field(default_factory=time.time)


class SGLangDouble:
    """In-process test double of one SGLang server (see the module docstring)."""

    def __init__(
        self,
        model_path: str | None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        tp_size: int = 1,
        dp_size: int = 1,
        api_key: str | None = None,
        dtype: str = "float32",
        faults: Faults | None = None,
        router_of: list[str] | None = None,
        weight_version: str = "default",
        memory_saver: bool = False,
        enable_return_routed_experts: bool = False,
        version: str | None = None,
    ):
        from gspo_megatron.rollout.sglang_api import SGLANG_VERSION

        # what /server_info reports as "version" (SGLang 0.5.23 http_server.py server_info: __version__)
        self.version = SGLANG_VERSION if version is None else version
        self.model_path = model_path
        self.host, self.port = host, port
        self.tp_size, self.dp_size = tp_size, dp_size
        self.api_key = api_key
        self.dtype = dtype
        self.faults = faults or Faults()
        self.router_of = list(router_of or [])
        self.weight_version = weight_version
        self.records: list[Record] = []
        self.engine = None  # HFEngine
        self._lock = threading.Lock()  # generation and weight updates
        self._meta = threading.Lock()  # counters, records
        self._abort_epoch = 0
        self._aborted_rids: set[str] = set()
        self._answered = 0
        self._arrived = 0
        self._groups: dict[str, Any] = {}
        self.print_requests = False  # as a process: one "[request] METHOD /path" line per request (its log)
        self.memory_saver = memory_saver  # --enable-memory-saver: release really frees (else a no-op)
        self.memory_released = False
        # --enable-return-routed-experts: without it, return_routed_experts requests get no field
        self.enable_return_routed_experts = enable_return_routed_experts
        self.session_open = False  # a /begin_weight_update ... /end_weight_update session
        # SGLang's pause (tokenizer_manager.py is_pause / is_pause_cond) and its model_update_lock:
        # /generate requests in flight hold the reader side; a weight update waits for them unless
        # generation is paused (tokenizer_manager.py update_weights_from_disk: `writer_lock if not
        # is_paused else nullcontext()`; tokenizer_control_mixin.py the same for the other routes)
        self._flow = threading.Condition()
        self._paused: str | None = None  # the pause mode, None while generating
        self._pause_t = 0.0  # when the current pause began
        self._pauses = 0  # pauses that ended (continue_generation)
        self._inflight = 0  # /generate requests past the pause gate, not yet answered
        self.holding = 0  # requests held by Faults.hold_after_tokens right now
        self.delaying = 0  # requests in the delay of Faults.delay_s right now
        self._admitted = 0  # /generate requests that a retract pause would now set aside (or has)
        self._pause_calls = 0  # /pause_generation requests so far
        self.waits_timed_out = 0  # waits of Faults.pause_waits_for_requests / abort_all_waits_for_holding that gave up
        self._decoding: set = set()  # the _Decoding of every request in its decode time
        self.writer_timeout_s = 600.0  # how long a weight update waits for the requests in flight
        self.httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._rr = 0

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> None:
        if self.router_of or self.model_path is None or self.engine is not None:
            return
        from gspo_megatron.rollout.hf_engine import HFEngine

        # with the flag, the experts are those generation routed (prefill and each decode step)
        self.engine = HFEngine(self.model_path, dtype=self.dtype, max_batch_size=64,
                               return_routing=bool(self.enable_return_routed_experts))

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "SGLangDouble":
        self.load()
        handler = type("Handler", (_Handler,), {"double": self})
        self.httpd = _Server((self.host, self.port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True, name=f"sglang-double-{self.port}")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None
        for pg in self._groups.values():
            _destroy_group(pg)
        self._groups.clear()

    def __enter__(self) -> "SGLangDouble":
        return self.start() if self.httpd is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ introspection
    @property
    def arrived(self) -> int:
        """/generate requests that reached generation (each has taken its abort epoch: an
        /abort_request {abort_all} from now on ends it)."""
        with self._meta:
            return self._arrived

    def calls(self, path: str) -> list[Any]:
        with self._meta:
            return [r.body for r in self.records if r.path == path]

    def take(self, name: str) -> bool:
        """Consume one unit of fault counter `name`."""
        with self._meta:
            v = getattr(self.faults, name)
            if v > 0:
                setattr(self.faults, name, v - 1)
                return True
            return False

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict) -> tuple[int, Any]:
        unknown = sorted(set(body) - ENDPOINTS["/generate"].fields)
        if unknown:
            return 422, {"detail": [{"type": "extra_forbidden", "loc": ["body", k],
                                     "msg": "not a field of GenerateReqInput this client may send"} for k in unknown]}
        ids = body.get("input_ids")
        if ids is None:
            return 400, {"error": {"message": "input_ids is required (the double takes no text)"}}
        single = bool(ids) and isinstance(ids[0], int)
        rows = [ids] if single else ids
        n = len(rows)
        want_routing = bool(body.get("return_routed_experts", False))
        start_len = body.get("routed_experts_start_len", 0)
        if not isinstance(start_len, int) or isinstance(start_len, bool):  # api_types.py: _expect_int i64
            return 400, {"error": "routed_experts_start_len: expected i64"}
        if want_routing:
            for r in rows:  # managers/scheduler.py ~3300, checked whether or not the server has the flag
                msg = None
                if start_len < 0:
                    msg = (f"recv_req.routed_experts_start_len={start_len!r} is lower than 0. "
                           "Please use a non-negative routed_experts_start_len.")
                if start_len > len(r):
                    msg = (f"recv_req.routed_experts_start_len={start_len!r} is higher than the number of input "
                           f"tokens len(req.origin_input_ids)={len(r)!r}. Please use a smaller "
                           "routed_experts_start_len.")
                if msg is not None:
                    return 400, {"error": {"message": msg}}
        routing = start_len if want_routing and self.enable_return_routed_experts else None
        sps = body.get("sampling_params") or {}
        sps = sps if isinstance(sps, list) else [sps] * n
        rids = body.get("rid") or [uuid.uuid4().hex for _ in range(n)]
        rids = [rids] if isinstance(rids, str) else rids
        if len(sps) != n or len(rids) != n:
            return 400, {"error": {"message": "sampling_params / rid lists must match input_ids"}}
        with self._flow:  # a request arriving during a pause waits for continue_generation
            if not self._flow.wait_for(lambda: self._paused is None, timeout=600):
                return 503, {"error": {"message": "generation stayed paused for 600 s"}}
            self._inflight += 1
        try:
            return self._serve(body, rows, sps, rids, single, routing)
        finally:
            with self._flow:
                self._inflight -= 1
                self._flow.notify_all()

    def _serve(self, body, rows, sps, rids, single, routing) -> tuple[int, Any]:
        epoch = self._abort_epoch
        with self._meta:
            arrival = self._arrived
            self._arrived += 1
        f = self.faults
        if f.delay_s > 0 and arrival >= f.delay_after and (not f.delay_requests
                                                          or arrival < f.delay_after + f.delay_requests):
            end = time.monotonic() + f.delay_s
            with self._meta:
                self.delaying += 1
            try:
                while time.monotonic() < end and not self._is_aborted(epoch, rids):
                    time.sleep(0.01)
            finally:
                with self._meta:
                    self.delaying -= 1
        if self._is_aborted(epoch, rids) or self.take("server_abort"):
            out = [self._abort_row(r, rid) for r, rid in zip(rows, rids)]
        else:
            held = arrival >= f.hold_from_request and (not f.hold_requests
                                                         or arrival < f.hold_from_request + f.hold_requests)
            hold = f.hold_after_tokens if held else 0
            st = _Decoding(f.per_token_s, hold) if f.per_token_s > 0 or hold > 0 else None
            with self._flow:  # from now on a retract pause sets this request aside (pause_generation)
                if st is not None:
                    self._decoding.add(st)
                self._admitted += 1
                self._flow.notify_all()
            try:
                t_gen = time.monotonic()
                out = self._generate_rows(rows, sps, rids, body.get("return_logprob", False), routing)
                if isinstance(out, tuple):
                    return out
                if st is not None:
                    out = self._decode(out, rows, sps, rids, epoch, t_gen, body.get("return_logprob", False),
                                       routing, st)
            finally:
                if st is not None:
                    with self._flow:
                        self._decoding.discard(st)
        start = body.get("logprob_start_len")
        if body.get("return_logprob") and start is not None and start != -1:
            bad = self._input_logprobs(out, rows, int(start))
            if bad is not None:
                return bad
        if not any(o["meta_info"]["finish_reason"]["type"] == "abort" for o in out):
            self._misbehave(out, sps)
        if self.take("stale"):
            for o in out:
                o["meta_info"]["weight_version"] = "stale-0"
                for span in o["meta_info"].get("weight_versions", []):
                    span["version"] = "stale-0"
        if self.take("no_version"):  # an SGLang from before weight versions: neither field
            for o in out:
                o["meta_info"].pop("weight_version", None)
                o["meta_info"].pop("weight_versions", None)
        with self._meta:
            self._answered += 1
        return 200, (out[0] if single else out)

    def _input_logprobs(self, out, rows, start: int):
        """meta_info.input_token_logprobs from logprob_start_len `start`, as SGLang 0.5.23: one
        [logprob, token id, None] per prompt token from `start` on, None as the first logprob
        (scheduler_components/logprob_result_processor.py:37-38) and ids >= vocab_size - 1 reported
        as 0 (:54-57); a start past the prompt is refused (managers/scheduler.py:3275-3277).
        Computed with the served model at temperature 1. Returns an error answer or None."""
        vocab = int(self.engine.model.config.vocab_size)
        for o, row in zip(out, rows):
            if start > len(row):
                return 400, {"error": {"message": f"req.logprob_start_len={start} is higher than the number of input "
                                                  f"tokens len(req.origin_input_ids)={len(row)}. Please use a smaller "
                                                  "logprob_start_len."}}
            with self._lock:
                lps = teacher_forced_logprobs(self.engine.model, row[:start + 1], row[start + 1:], 1.0).tolist() \
                    if start + 1 < len(row) else []
            vals = [None] + lps
            o["meta_info"]["input_token_logprobs"] = [[v, t if t < vocab - 1 else 0, None]
                                                      for v, t in zip(vals, row[start:])]
        return None

    def _decode(self, out, rows, sps, rids, epoch, t_gen, return_logprob, routing, st):
        """The decode time of generation done up front: the rows' tokens appear one per
        per_token_s (concurrent requests overlap, as in a batching server). An abort answers what
        was decoded; a retract pause freezes the clock, and if the weights changed by
        continue_generation every row still decoding is continued from its tokens so far with the
        new weights (SGLang's retract puts the request back in the queue and, the cache flushed,
        recomputes its prefix under the new weights: scheduler.py pause_generation, flush_cache
        `is_fully_idle(ignore_waiting=self._engine_paused)`), its weight_versions spans saying which
        version decoded which tokens (weight_versions.py compute_weight_version_spans)."""
        return self._decode_loop(out, rows, sps, rids, epoch, t_gen, return_logprob, routing, st)

    def _decode_loop(self, out, rows, sps, rids, epoch, t_gen, return_logprob, routing, st):
        longest = max((o["meta_info"]["completion_tokens"] for o in out), default=0)
        counted = False  # this request is counted in self.holding
        with self._flow:
            st.start(longest, t_gen)
        try:
            while True:
                with self._flow:
                    if st.retract_k is None:
                        st.advance(time.monotonic())
                    k, done = st.retract_k, st.decoded >= st.longest
                    if st.held and st.decoded >= st.hold and not counted:
                        self.holding += 1
                        counted = True
                        self._flow.notify_all()
                if k is not None:  # retracted at decode step k: continue once generation resumes
                    with self._flow:
                        self._flow.wait_for(lambda: self._paused is None or self._is_aborted(epoch, rids),
                                            timeout=600)
                    out = [self._retracted(o, row, sp, rid, k, return_logprob, routing)
                           for o, row, sp, rid in zip(out, rows, sps, rids)]
                    with self._flow:
                        st.resume(k, max((o["meta_info"]["completion_tokens"] for o in out), default=0),
                                  time.monotonic())
                        if counted:
                            self.holding -= 1
                            counted = False
                    continue
                if done or self._is_aborted(epoch, rids):
                    break
                time.sleep(0.005)
        finally:
            if counted:
                with self._flow:
                    self.holding -= 1
        if self._is_aborted(epoch, rids):  # running requests answer with what they have
            out = [self._cut(o, int(st.decoded)) for o in out]
        return out

    def _retracted(self, o, prompt, sp, rid, k, return_logprob, routing):
        """Row `o` after a retract pause at decode step k: unchanged if it had finished by then or
        the weights did not change; else its tokens from k on come from the current weights."""
        meta = o["meta_info"]
        spans = meta.get("weight_versions") or [{"version": meta["weight_version"], "start": 0,
                                                "end": meta["completion_tokens"]}]
        if meta["completion_tokens"] <= k or self.weight_version == spans[-1]["version"]:
            return o
        from gspo_megatron.rollout.base import SamplingParams

        stop = sp.get("stop") or ()
        left = int(sp.get("max_new_tokens", 128)) - k
        params = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
            top_k=int(sp.get("top_k", -1)), max_new_tokens=left,
            stop_token_ids=tuple(sp.get("stop_token_ids") or ()), stop=(stop,) if isinstance(stop, str) else tuple(stop))
        head_ids = o["output_ids"][:k]
        head_lps = (meta.get("output_token_logprobs") or [])[:k]
        with self._lock:
            tail = (self._canned([list(prompt) + head_ids], [f"{rid}/{self.weight_version}"], params)[0]
                    if self.faults.canned else self.engine.generate([list(prompt) + head_ids], 1, params)[0])
            version = self.weight_version
            ids = head_ids + list(tail.response_ids)
            routed = None
            if routing is not None:
                from gspo_megatron.rollout.base import Sample

                routed = self._routed_experts(Sample(0, list(prompt), ids, [0.0] * len(ids), "stop", 0), routing)
        if tail.finish_reason == "stop":
            fr = {"type": "stop", "matched": tail.response_ids[-1]}
        else:
            fr = {"type": "length", "length": len(ids)}
        spans = [dict(x, end=min(x["end"], k)) for x in spans if x["start"] < k]
        spans.append({"version": version, "start": k, "end": len(ids)})
        new_meta = dict(meta, finish_reason=fr, completion_tokens=len(ids), weight_version=version,
                        weight_versions=spans)
        if return_logprob:
            new_meta["output_token_logprobs"] = head_lps + [[lp, t, None] for lp, t in
                                                            zip(tail.response_logprobs, tail.response_ids)]
        if routed is not None:
            new_meta["routed_experts"] = routed
        tok = self.engine.tokenizer
        return {"text": tok.decode(ids) if tok is not None else "", "output_ids": ids, "meta_info": new_meta}

    def _writer(self) -> bool:
        """A weight update's model_update_lock.writer_lock: wait for the requests in flight, unless
        generation is paused. False after writer_timeout_s."""
        with self._flow:
            return self._flow.wait_for(lambda: self._paused is not None or self._inflight == 0,
                                       timeout=self.writer_timeout_s)

    def pause_generation(self, body: dict) -> tuple[int, Any]:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):  # PauseGenerationReqInput.mode: a Literal
            return 422, {"detail": [{"type": "literal_error", "loc": ["body", "mode"],
                                     "msg": "Input should be 'abort', 'retract' or 'in_place'"}]}
        if mode == "in_place":  # the engine never sends it: continued tokens would attend to old KV
            return 400, {"detail": "the test double does not model pause mode in_place"}
        with self._flow:
            waits = self.faults.pause_waits_for_requests
            need = waits[self._pause_calls] if self._pause_calls < len(waits) else 0
            self._pause_calls += 1
            if not self._flow.wait_for(lambda: self._admitted >= need, timeout=self.faults.pause_wait_s):
                self.waits_timed_out += 1
            if self._paused is None:
                self._pause_t = time.monotonic()
            self._paused = mode
            if mode == "retract":  # every running request is set aside now, at the step it reached
                for st in self._decoding:
                    st.retract(self._pause_t)
            self._flow.notify_all()
        if mode == "abort":  # tokenizer_manager.py pause_generation: abort all, wait until none runs
            with self._meta:
                self._abort_epoch += 1
            with self._flow:
                self._flow.wait_for(lambda: self._inflight == 0, timeout=600)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> tuple[int, Any]:
        with self._flow:
            if self._paused is not None:
                self._pauses += 1
            self._paused = None
            self._flow.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _misbehave(self, out: list[dict], sps: list[dict]) -> None:
        """Faults overlong / nan_logprobs / oov_ids (one response each per unit)."""
        over, nan, oov = self.take("overlong"), self.take("nan_logprobs"), self.take("oov_ids")
        for o, sp in zip(out, sps):
            meta = o["meta_info"]
            lps = meta.get("output_token_logprobs")
            if over:
                extra = int(sp.get("max_new_tokens", 128)) - len(o["output_ids"]) + int(self.faults.overlong_by)
                last = o["output_ids"][-1] if o["output_ids"] else 0
                o["output_ids"] = o["output_ids"] + [last] * extra
                if lps is not None:
                    lps.extend([[-0.5, last, None] for _ in range(extra)])
                meta["completion_tokens"] = len(o["output_ids"])
            if nan and lps:
                lps[-1][0] = None if self.faults.nan_as == "null" else float("nan")
            if oov and o["output_ids"]:
                bad = int(self.engine.model.config.vocab_size) + 3
                o["output_ids"][-1] = bad
                if lps:
                    lps[-1][1] = bad

    def _is_aborted(self, epoch: int, rids) -> bool:
        return self._abort_epoch != epoch or any(r in self._aborted_rids for r in rids)

    @staticmethod
    def _cut(row: dict, done: int) -> dict:
        """A running request aborted after `done` decode steps: SGLang 0.5.23 answers HTTP 200 with
        the tokens (and log-probs) generated so far and FINISH_ABORT().to_json() (status_code None;
        managers/scheduler.py abort_request, schedule_batch.py FINISH_ABORT)."""
        meta = row["meta_info"]
        if meta["completion_tokens"] <= done:
            return row  # it had finished before the abort
        meta = dict(meta, completion_tokens=done,
                    finish_reason={"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
        if "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:done]
        if "weight_versions" in meta:  # weight_versions.py add_weight_versions_to_meta_info: cut at the tokens
            spans = [dict(x, end=min(x["end"], done)) for x in meta["weight_versions"]
                     if x["start"] < done or x["start"] == 0]
            meta["weight_versions"], meta["weight_version"] = spans, spans[-1]["version"]
        meta.pop("routed_experts", None)
        return {"text": "", "output_ids": row["output_ids"][:done], "meta_info": meta}

    def _abort_row(self, prompt, rid) -> dict:
        return {"text": "", "output_ids": [], "meta_info": {
            "id": rid, "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "prompt_tokens": len(prompt), "completion_tokens": 0, "output_token_logprobs": [],
            "weight_version": self.weight_version,
            "weight_versions": [{"version": self.weight_version, "start": 0, "end": 0}]}}

    def _generate_rows(self, rows, sps, rids, return_logprob, routing_start: int | None = None):
        from gspo_megatron.rollout.base import SamplingParams

        out: list[dict | None] = [None] * len(rows)
        by_params: dict[str, list[int]] = {}
        for i, sp in enumerate(sps):
            by_params.setdefault(json.dumps(sp, sort_keys=True), []).append(i)
        for key, idx in by_params.items():
            sp = json.loads(key)
            unknown = set(sp) - _SAMPLING_KEYS
            if unknown:
                return 400, {"error": {"message": f"unknown sampling params {sorted(unknown)}"}}
            stop = sp.get("stop") or ()
            params = SamplingParams(
                temperature=float(sp.get("temperature", 1.0)), top_p=float(sp.get("top_p", 1.0)),
                top_k=int(sp.get("top_k", -1)), max_new_tokens=int(sp.get("max_new_tokens", 128)),
                stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
                stop=(stop,) if isinstance(stop, str) else tuple(stop),
            )
            with self._lock:
                if self.memory_released:
                    return 400, {"error": {"message": "memory released: resume_memory_occupation first"}}
                samples = (self._canned([rows[i] for i in idx], [rids[i] for i in idx], params)
                           if self.faults.canned else self.engine.generate([rows[i] for i in idx], 1, params))
                version = self.weight_version
                routed = ([self._routed_experts(s, routing_start) for s in samples]
                          if routing_start is not None else [None] * len(samples))
            for i, s, re_ in zip(idx, samples, routed):
                if s.finish_reason == "stop":
                    fr = {"type": "stop", "matched": s.response_ids[-1]}
                else:
                    fr = {"type": "length", "length": len(s.response_ids)}
                meta = {"id": rids[i], "finish_reason": fr, "prompt_tokens": len(rows[i]),
                        "completion_tokens": len(s.response_ids), "cached_tokens": 0,
                        "weight_version": version,
                        # every finished request's spans (output_streamer.py: compute_weight_version_spans)
                        "weight_versions": [{"version": version, "start": 0, "end": len(s.response_ids)}]}
                if return_logprob:
                    f = self.faults
                    lps = [lp + f.logprob_offset if f.logprob_offset and k % f.logprob_offset_every == 0 else lp
                           for k, lp in enumerate(s.response_logprobs)]
                    meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, s.response_ids)]
                if re_ is not None:
                    meta["routed_experts"] = re_
                out[i] = {"text": s.text or "", "output_ids": list(s.response_ids), "meta_info": meta}
        return out

    def _canned(self, rows, rids, params):
        import math
        import random
        import zlib

        from gspo_megatron.rollout.base import Sample

        tok = self.engine.tokenizer
        vocab = int(self.engine.model.config.vocab_size)
        specials = set(tok.all_special_ids) if tok is not None else set()
        pool = [t for t in range(min(vocab, 512)) if t not in specials]
        out = []
        for i, (row, rid) in enumerate(zip(rows, rids)):
            rng = random.Random(zlib.crc32(str(rid).encode()))
            ids = [rng.choice(pool) for _ in range(params.max_new_tokens)]
            out.append(Sample(i, list(row), ids, [-math.log(vocab)] * len(ids), "length", self.weight_version,
                              text=tok.decode(ids) if tok is not None else None))
        return out

    def route_experts(self, ids: list[int]):
        """int32 [len(ids), num_hidden_layers, num_experts_per_tok]: the experts the served model's
        routers pick at every position of `ids` (one forward, hooks on each layer's mlp.gate;
        a layer without a router, e.g. a dense one, keeps zeros). Caller holds self._lock."""
        import torch

        model = self.engine.model
        cfg = getattr(model.config, "text_config", None) or model.config
        layers, k = model.model.layers, int(cfg.num_experts_per_tok)
        got: dict[int, torch.Tensor] = {}
        hooks = [layer.mlp.gate.register_forward_hook(
                     lambda mod, args, out, i=i: got.__setitem__(i, out[2].detach()))  # (logits, scores, indices)
                 for i, layer in enumerate(layers) if getattr(layer.mlp, "gate", None) is not None]
        try:
            with torch.no_grad():
                model(torch.tensor([list(ids)], device=self.engine.device))
        finally:
            for h in hooks:
                h.remove()
        res = torch.zeros((len(ids), len(layers), k), dtype=torch.int32)
        for i, idx in got.items():
            res[:, i, :] = idx.reshape(len(ids), k).to(device="cpu", dtype=torch.int32)
        return res

    def _routed_experts(self, s, start_len: int) -> str:
        """SGLang's meta_info.routed_experts of a generated sample: rows start_len .. seqlen - 2."""
        import base64

        import torch

        seq = list(s.prompt_ids) + list(s.response_ids)
        routed = getattr(s, "routed_experts", None)  # an HFEngine that records routing, else compute it
        if routed is None:
            routed = self.route_experts(seq)[: len(seq) - 1]
        start = min(start_len, len(seq) - 1)  # state_capturer/base.py get_topk
        arr = routed[start : len(seq) - 1].to(torch.int32).contiguous()
        if self.take("routed_experts_extra_row"):
            arr = torch.cat([arr, arr[-1:] if len(arr) else torch.zeros((1, *arr.shape[1:]), dtype=torch.int32)])
        data = arr.numpy().tobytes()  # detokenizer_manager.py: pybase64.b64encode(item.numpy().tobytes())
        if self.take("routed_experts_short"):
            data = data[:-4]
        return base64.b64encode(data).decode("utf-8")

    def abort_request(self, body: dict) -> tuple[int, Any]:
        need = self.faults.abort_all_waits_for_holding
        if body.get("abort_all") and need:
            with self._flow:
                if self._flow.wait_for(lambda: self.holding >= need or not self.faults.abort_all_waits_for_holding,
                                       timeout=self.faults.pause_wait_s):
                    self.faults.abort_all_waits_for_holding = 0  # seen: later aborts go at once
                    self._flow.notify_all()
                else:
                    self.waits_timed_out += 1
        with self._meta:
            if body.get("abort_all"):
                self._abort_epoch += 1
            elif body.get("rid"):
                self._aborted_rids.add(body["rid"])
        return 200, None

    def flush_cache(self) -> tuple[int, str]:
        with self._flow:  # requests running and not paused: SGLang refuses (scheduler.py flush_cache)
            busy = self._paused is None and self._inflight > 0
        if busy or self.take("flush_busy"):
            return 400, ("Cache not flushed. Please check backend logs for more details. (When there are "
                         "running or waiting requests, the operation will not be performed.)\n")
        return 200, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"

    def _copy_weights(self, named, complete: bool) -> None:
        import torch

        from gspo_megatron.rollout.hf_engine import hub_weight_targets

        targets = hub_weight_targets(self.engine.model)
        seen = set()
        f = self.faults
        self._weight_updates = getattr(self, "_weight_updates", 0) + 1
        corrupt = f.scale_tensor and self._weight_updates > f.scale_from_update
        # DeepSeek's MLA with a q latent: SGLang fuses q_a_proj + kv_a_proj_with_mqa into one
        # parameter and writes it only when both came in this call (deepseek_weight_loader.py
        # do_load_weights, `cached_a_proj`, local to the call); a lone one is dropped without a
        # word (tests/test_sglang_contract.py pins those lines)
        fused_a = getattr(self.engine.model.config, "q_lora_rank", None) is not None
        cached_a: dict[str, Any] = {}
        with torch.no_grad():
            for name, t in named:
                tgt = targets.get(name)
                if tgt is None:
                    raise ValueError(f"unknown parameter {name}")
                if tuple(t.shape) != tgt.shape:
                    raise ValueError(f"{name}: shape {tuple(t.shape)} != {tgt.shape}")
                if corrupt and name == f.scale_tensor:
                    t = t * f.scale_by
                pairs = [(name, tgt, t)]
                if fused_a and ("q_a_proj" in name or "kv_a_proj_with_mqa" in name):
                    cached_a[name] = (tgt, t)
                    q = name if "q_a_proj" in name else name.replace("kv_a_proj_with_mqa", "q_a_proj")
                    kv = q.replace("q_a_proj", "kv_a_proj_with_mqa")
                    if q not in cached_a or kv not in cached_a:
                        continue
                    pairs = [(n, *cached_a.pop(n)) for n in (q, kv)]
                for _, tgt_, t_ in pairs:
                    if not f.stale_weights:
                        tgt_.get().copy_(t_)
                    seen.add(tgt_.key)
        missing = {t.key for t in targets.values()} - seen
        if complete and missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[0]}")

    def update_weights_from_disk(self, body: dict) -> tuple[int, Any]:
        import glob

        from safetensors import safe_open

        path = body.get("model_path")
        try:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no safetensors files in {path}")

            def it():
                for fn in files:
                    with safe_open(fn, "pt") as fh:
                        for k in fh.keys():
                            yield k, fh.get_tensor(k)

            with self._lock:
                self._copy_weights(it(), complete=True)
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
                self.model_path = path
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def init_weights_update_group(self, body: dict) -> tuple[int, Any]:
        from gspo_megatron.rollout.weight_sync import init_weight_update_group

        if self.tp_size != 1:
            return 400, {"success": False, "message": "the double joins weight-update groups with tp_size=1 only"}
        name = body["group_name"]
        try:
            self._groups[name] = init_weight_update_group(
                master_address=body["master_address"], master_port=int(body["master_port"]),
                rank=int(body["rank_offset"]) + 0, world_size=int(body["world_size"]),
                group_name=name, backend=body.get("backend", "gloo"), timeout_s=60,
            )
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict) -> tuple[int, Any]:
        import torch
        import torch.distributed as dist

        pg = self._groups.get(body.get("group_name"))
        if pg is None:
            return 400, {"success": False, "message": f"no weight-update group {body.get('group_name')!r}"}
        try:
            named = []
            works = []
            for name, dt, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                t = torch.empty(shape, dtype=getattr(torch, dt))
                works.append(dist.broadcast(t, group_src=0, group=pg, async_op=True))
                named.append((name, t))
            for w in works:
                w.wait()
            with self._lock:
                self._copy_weights(named, complete=False)
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to update parameter online: {e}"}
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def destroy_weights_update_group(self, body: dict) -> tuple[int, Any]:
        pg = self._groups.pop(body.get("group_name"), None)
        if pg is None:
            return 400, {"success": False, "message": "The group to be destroyed does not exist."}
        _destroy_group(pg)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_tensor(self, body: dict) -> tuple[int, Any]:

        sers = body.get("serialized_named_tensors")
        if not isinstance(sers, list) or len(sers) != self.tp_size:
            return 400, {"success": False, "message": f"serialized_named_tensors must have one entry per TP rank ({self.tp_size})"}
        try:
            per_rank = [deserialize_named_tensors(x) for x in sers]  # every TP rank loads its own entry
            if any([n for n, _ in r] != [n for n, _ in per_rank[0]] for r in per_rank):
                raise ValueError("the TP ranks' payloads name different tensors")
            named = per_rank[0]
            with self._lock:
                self._copy_weights(named, complete=False)
                if body.get("weight_version") is not None:
                    self.weight_version = str(body["weight_version"])
        except Exception as e:
            return 400, {"success": False, "message": f"Failed to update weights from tensor: {e}"}
        return 200, {"success": True, "message": "Success"}

    # weight-update sessions (SGLang 0.5.23, scheduler_components/weight_updater.py)
    def begin_weight_update(self, body: dict) -> tuple[int, Any]:
        with self._meta:
            if self.session_open:
                return 400, {"success": False, "message": "a weight-update session is already open; "
                                                          "call end_weight_update() first"}
            self.session_open = True
        return 200, {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> tuple[int, Any]:
        with self._meta:
            if not self.session_open:
                return 400, {"success": False,
                             "message": "no weight-update session is open; call begin_weight_update() first"}
            self.session_open = False
        return 200, {"success": True, "message": "Success"}

    def model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "weight_version": self.weight_version, "model_type": self._model_type()}

    def _model_type(self) -> str:
        """What the served checkpoint's config.json says (SGLang answers its hf_config's model_type)."""
        try:
            with open(os.path.join(self.model_path, "config.json"), encoding="utf-8") as f:
                return json.load(f).get("model_type", "")
        except (OSError, ValueError):
            return ""

    def server_info(self) -> dict:
        return {"model_path": self.model_path, "tp_size": self.tp_size, "dp_size": self.dp_size,
                "pp_size": 1, "enable_dp_attention": False, "weight_version": self.weight_version,
                "enable_return_routed_experts": self.enable_return_routed_experts, "version": self.version}

    def route(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """(status, payload); payload None -> empty body, str -> text, else JSON."""
        if self.print_requests and not path.startswith("/_double"):
            print(f"[request] {method} {path}", flush=True)
        if path == "/_double/records":
            with self._meta:
                return 200, [asdict(r) for r in self.records]
        if path == "/_double/faults":
            with self._meta:
                for k, v in (body or {}).items():
                    setattr(self.faults, k, v)
                return 200, asdict(self.faults)
        if path in ("/health", "/health_generate"):
            if self.faults.never_ready:
                return 503, {"error": "not ready (test double: never_ready)"}
            return 200, None
        if self.router_of:
            return self._route_router(method, path, body)
        if path == "/generate":
            return self.generate(body or {})
        ep = ENDPOINTS.get(path)
        if ep is not None and ep.request_class is not None:
            unknown = sorted(set(body or {}) - ep.fields)
            if unknown:
                return 422, {"detail": [{"type": "extra_forbidden", "loc": ["body", k],
                                         "msg": f"not a field of {ep.request_class} this client may send"}
                                        for k in unknown]}
        if self.dp_size > 1 and path in DP1_ONLY:
            return 500, {"detail": f"AssertionError: data-parallel replicas are not supported for {path}"}
        if path in ("/model_info", "/get_model_info"):
            return 200, self.model_info()
        if path in ("/get_server_info", "/server_info"):
            return 200, self.server_info()
        if path == "/begin_weight_update":
            return self.begin_weight_update(body or {})
        if path == "/end_weight_update":
            return self.end_weight_update(body or {})
        if self.memory_released and (path == "/generate" or path.startswith("/update_weights")):
            return 500, {"detail": f"{path}: the weights and KV cache are released "
                                   "(/release_memory_occupation); resume first"}
        if path in SESSION_ROUTES and not self.session_open:
            what = path.lstrip("/")
            return 400, {"success": False,
                         "message": f"{what} must run between begin_weight_update() and end_weight_update()"}
        if path == "/flush_cache":
            return self.flush_cache()
        if path == "/abort_request":
            return self.abort_request(body or {})
        if path == "/release_memory_occupation":
            # SGLang releases only with --enable-memory-saver (its TorchMemorySaverAdapter is a no-op
            # otherwise, managers/scheduler.py:1490)
            self.memory_released = self.memory_saver
            return 200, None
        if path == "/resume_memory_occupation":
            self.memory_released = False
            return 200, None
        if path == "/pause_generation":
            return self.pause_generation(body or {})
        if path == "/continue_generation":
            return self.continue_generation(body or {})
        if path.startswith("/update_weights") and not self._writer():
            return 500, {"detail": f"{path}: requests in flight held the model update lock for "
                                   f"{self.writer_timeout_s:g} s"}
        handler = {
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/init_weights_update_group": self.init_weights_update_group,
            "/update_weights_from_distributed": self.update_weights_from_distributed,
            "/destroy_weights_update_group": self.destroy_weights_update_group,
            "/update_weights_from_tensor": self.update_weights_from_tensor,
        }.get(path)
        if handler is None:
            return 404, {"detail": "Not Found"}
        return handler(body or {})

    def _route_router(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/list_workers":
            return 200, {"urls": list(self.router_of)}
        if path == "/generate":
            from gspo_megatron.rollout.sglang_server import ServerClient

            with self._meta:
                url = self.router_of[self._rr % len(self.router_of)]
                self._rr += 1
            status, data = ServerClient(url, api_key=self.api_key).request_once("POST", path, body)
            return status, _Raw(data)
        return 404, {"detail": "Not Found"}


# routes SGLang 0.5.23 asserts dp_size == 1 for (managers/tokenizer_control_mixin.py)
DP1_ONLY = frozenset({"/init_weights_update_group", "/destroy_weights_update_group",
                      "/update_weights_from_distributed", "/update_weights_from_tensor"})


class _Raw(bytes):
    pass


_SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids", "no_stop_trim",
                  "skip_special_tokens", "min_p", "n", "ignore_eos", "spaces_between_special_tokens"}


def _destroy_group(pg) -> None:
    try:
        import torch.distributed as dist

        dist.destroy_process_group(pg)
    except Exception:
        pass


class _Handler(BaseHTTPRequestHandler):
    double: SGLangDouble
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _handle(self, method: str) -> None:
        d = self.double
        path = self.path.split("?", 1)[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._send(400, {"error": "request body is not JSON"})
        if not path.startswith("/_double/"):
            with d._meta:
                d.records.append(Record(method, path, body))
        if d.api_key and not path.startswith("/_double/") and path not in ("/health", "/health_generate"):
            if self.headers.get("Authorization") != f"Bearer {d.api_key}":
                return self._send(401, {"error": "Unauthorized"})
        if path == d.faults.fault_path:
            if d.take("drop"):
                self.close_connection = True
                try:
                    self.connection.shutdown(2)
                except OSError:
                    pass
                return
            if d.take("fail_5xx"):
                return self._send(500, {"error": {"message": "injected failure (test double)"}})
            if d.take("malformed"):
                return self._send(200, "{'this is': not json", ctype="application/json")
            if d.take("missing_fields"):
                return self._send(200, [{"text": "x"}])
        try:
            status, payload = d.route(method, path, body)
        except Exception as e:  # a bug in the double: say so as a 500
            import traceback

            traceback.print_exc()
            return self._send(500, {"error": {"message": f"test double error: {e}"}})
        self._send(status, payload)

    def _send(self, status: int, payload: Any, ctype: str | None = None) -> None:
        if isinstance(payload, _Raw):
            data, ctype = bytes(payload), ctype or "application/json"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), ctype or "text/plain"
        elif payload is None:
            data, ctype = b"", ctype or "application/json"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass
        self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")


# ------------------------------------------------------------------------------ helpers for tests
def deserialize_named_tensors(data: str | bytes) -> list:
    """What an SGLang server does with an update_weights_from_tensor payload (the trainer only
    serializes, rollout/weight_sync.py): unpickle with torch's rebuild functions. Server side
    only: it trusts the trainer that sent it, as SGLang does."""
    import base64
    import pickle

    import torch.multiprocessing  # noqa: F401  (rebuild functions)

    raw = base64.b64decode(data) if isinstance(data, str) else data
    return pickle.loads(raw)


@contextlib.contextmanager
def start_double_and_engine(model_dir: str, *, faults: Faults | None = None, double_kw: dict | None = None,
                            **engine_kw):
    """A running in-process double on `model_dir` and an `SGLangEngine` attached to it.

    engine_kw: rollout.sglang fields and SGLangEngine keywords (defaults suited to tests: short
    timeouts, fast backoff, shared_dir must be given for disk sync)."""
    from gspo_megatron.rollout.sglang_engine import SGLangEngine

    with SGLangDouble(model_dir, faults=faults, **(double_kw or {})) as d:
        kw = dict(request_timeout_s=60.0, ready_timeout_s=30.0, max_retries=2, retry_backoff_s=0.02,
                  concurrency=8, model_path=model_dir)
        kw.update(engine_kw)
        eng = SGLangEngine({"urls": [d.url]}, **kw)
        try:
            yield d, eng
        finally:
            eng.close()


def sglang_overrides(*urls: str, weight_sync: str = "disk", **fields) -> list[str]:
    """Dotted config overrides selecting the SGLang backend on running servers (e.g. doubles):
    ``load_config(path, [..., *sglang_overrides(double.url)])``. Short timeouts suit tests."""
    out = ["rollout.backend=sglang", f"rollout.sglang.urls=[{','.join(urls)}]",
           f"rollout.sglang.weight_sync={weight_sync}", "rollout.sglang.request_timeout_s=60",
           "rollout.sglang.ready_timeout_s=30", "rollout.sglang.max_retries=2"]
    out += [f"rollout.sglang.{k}={v}" for k, v in fields.items()]
    return out


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float):
    """log_softmax(logits / T) of `response` given `prompt` (T <= 0: T = 1), fp32."""
    import torch

    t = temperature if temperature > 0 else 1.0
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(response)])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / t, dim=-1)
    return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1)


# ------------------------------------------------------------------------------ as a process
def _merge_config(argv: list[str]) -> list[str]:
    """`--config <file>` as SGLang 0.5.23 reads it (server_args.py:683-689,
    utils/server_args_config_parser.py ConfigArgumentMerger): one file, .yaml/.yml only, a mapping
    whose entries become leading `--key value` arguments (the command line's own follow, so they
    win). What it refuses, this refuses (tests/test_sglang_contract.py reads the real source)."""
    if "--config" not in argv:
        return argv
    import yaml

    if argv.count("--config") > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    i = argv.index("--config")
    if i == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    path = argv[i + 1]
    if os.path.splitext(path)[1].lower() not in (".yaml", ".yml"):
        raise ValueError(f"Config file must be YAML format, got: {os.path.splitext(path)[1]}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    merged: list[str] = []
    for k, v in data.items():
        if isinstance(v, bool):
            merged += [f"--{k}"] if v else []
        elif isinstance(v, list):
            merged += [f"--{k}", *map(str, v)] if v else []
        else:
            merged += [f"--{k}", str(v)]
    return merged + argv[:i] + argv[i + 2:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="SGLang HTTP test double (NOT SGLang)")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--tp-size", "--tp", type=int, default=1)
    ap.add_argument("--dp-size", "--dp", type=int, default=1)
    ap.add_argument("--ep-size", "--ep", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--enable-memory-saver", action="store_true")
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    ap.add_argument("--double-never-ready", action="store_true")
    ap.add_argument("--double-per-token-s", type=float, default=0.0, help="seconds per generated token")
    ap.add_argument("--double-exit-code", type=int, default=None, help="exit at once with this code")
    ap.add_argument("--double-stale-weights", action="store_true", help="accept weight updates, keep the old weights")
    ap.add_argument("--double-fail-path", default="/generate", help="the endpoint --double-fail-5xx applies to")
    ap.add_argument("--double-fail-5xx", type=int, default=0, help="answer HTTP 500 this many times there")
    args, unknown = ap.parse_known_args(_merge_config(list(sys.argv[1:] if argv is None else argv)))
    print(f"[sglang test double] pid={os.getpid()} args={vars(args)} ignored={unknown}", flush=True)
    print(f"[sglang test double] SGLANG_RETURN_ORIGINAL_LOGPROB={os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB')}",
          flush=True)
    if args.double_exit_code is not None:
        print("[sglang test double] exiting as asked", flush=True)
        return args.double_exit_code
    if not os.path.isdir(args.model_path):
        print(f"[sglang test double] model path not found: {args.model_path}", file=sys.stderr, flush=True)
        return 2
    import signal

    if not args.double_never_ready:
        import torch

        torch.set_num_threads(1)
    d = SGLangDouble(None if args.double_never_ready else args.model_path, host=args.host, port=args.port,
                     tp_size=args.tp_size, dp_size=args.dp_size, api_key=args.api_key, dtype=args.dtype,
                     memory_saver=args.enable_memory_saver,
                     enable_return_routed_experts=args.enable_return_routed_experts,
                     faults=Faults(never_ready=args.double_never_ready, per_token_s=args.double_per_token_s,
                                   stale_weights=args.double_stale_weights, fault_path=args.double_fail_path,
                                   fail_5xx=args.double_fail_5xx))
    d.print_requests = True
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    d.start()
    print(f"[sglang test double] serving on {d.url}", flush=True)
    try:
        while not stop.wait(0.2):
            pass
    finally:
        d.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
