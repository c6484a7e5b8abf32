"""Inference servers over HTTP as the trainer sees them, whatever the engine (SGLang, vLLM).

* `ServerClient`: JSON over HTTP to one server (stdlib `http.client`; no extra dependency). Every
  request has a timeout; connection errors, timeouts and HTTP 5xx are retried with exponential
  backoff, then reported as `EngineServerError` naming the server and the endpoint. A body that
  is not the JSON the endpoint promises is an `EngineProtocolError` (not retried). An API key is
  sent as ``Authorization: Bearer <key>`` (SGLang's and vLLM's ``--api-key``).
* Every exchange is bounded (`ServerClient.request_once`, the one place both engines read
  through): its timeout is a deadline for the whole exchange (connect, send, status, headers,
  body), not per socket read (a server dribbling a byte every second would otherwise hold a
  request for ever), and the body has a byte cap: `response_cap(method, path, payload)` when the
  client was given one (the engines derive it from the request: `generate_response_cap`), else
  DEFAULT_MAX_RESPONSE_BYTES. Both failures are `RetryableHTTPError`s (`DeadlineExceededError`,
  `ResponseTooLargeError`): retried like a timeout, on another server when there is one.
* `wait_until_ready`: polls a health route on every server until all answer 200, or raises
  `EngineNotReadyError` ("server X not ready after N s") at the deadline; a launched process that
  dies while we wait is reported at once with the tail of its log.
* `ServerProcesses`: starts server processes from a launch spec (the engine's module, or any
  command prefix: the tests launch doubles), one per server, each in its own session; `stop()`
  terminates exactly the processes (and their process groups) it started, waits a grace period,
  then kills. An ``atexit`` hook stops them if the owner forgot to.
"""
from __future__ import annotations

import atexit
import http.client
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import weakref
from typing import Any, Callable, Iterable, Sequence

from gspo_megatron.errors import InputError
from gspo_megatron.config import secret_like
from gspo_megatron.rollout import process_guard

log = logging.getLogger("gspo_megatron.rollout")


class EngineError(RuntimeError):
    """Base class of every error of an engine behind HTTP (SGLang, vLLM)."""


class EngineServerError(EngineError):
    """A server failed a request (after the retries, when the failure was retryable)."""

    def __init__(self, msg: str, url: str | None = None, status: int | None = None):
        super().__init__(msg)
        self.url = url
        self.status = status


class EngineProtocolError(EngineError):
    """A server answered something that is not what its API promises (malformed JSON, fields)."""


class EngineNotReadyError(EngineError, InputError):
    """A server did not become healthy within the readiness timeout (or its process died). Also an
    InputError: at startup it usually means a wrong rollout.<engine>.urls / port, and entry points
    report it as one line (cli_util.user_errors)."""


class RetryableHTTPError(EngineServerError):
    """One attempt failed in a way worth retrying (connection error, timeout, 5xx)."""


RETRYABLE_OS_ERRORS = (
    ConnectionError,  # refused, reset, aborted, http.client.RemoteDisconnected
    TimeoutError,  # socket.timeout
    http.client.IncompleteRead,
    http.client.BadStatusLine,
    http.client.LineTooLong,
    OSError,  # unreachable host/network and the like
)


class DeadlineExceededError(RetryableHTTPError):
    """The whole exchange did not finish within the request's timeout (`received`: body bytes read)."""

    def __init__(self, msg: str, url: str | None = None, received: int = 0):
        super().__init__(msg, url=url)
        self.received = received


class ResponseTooLargeError(RetryableHTTPError):
    """The answer's body is larger than the cap derived from the request (nothing past it is read)."""


# Cap of a body when the client has no response_cap for the request: control routes answer a
# few KiB (/server_info, the weight-sync routes, /list_workers); 16 MiB is three orders above.
DEFAULT_MAX_RESPONSE_BYTES = 16 << 20
# generate_response_cap: a fixed floor (error pages, a small request's envelope), per row the
# envelope (meta_info, ids, finish reason: well under 16 KiB), and per generated token 1 KiB:
# SGLang's [logprob, token_id, null] triple (~40 B) + output_ids (~8 B) + the token's share of
# `text` (at most a few dozen UTF-8 bytes, six per character once escaped as \uXXXX), vLLM's
# {"token_id", "logprob", ...} entry (~100 B): over twice the worst honest answer, while a
# misbehaving server's answer is held to tens of MiB instead of the machine's memory.
RESPONSE_FLOOR_BYTES = 1 << 20
RESPONSE_ROW_BYTES = 16 << 10
RESPONSE_TOKEN_BYTES = 1 << 10


def generate_response_cap(rows: int, max_new_tokens: int, *, extra_row_bytes: int = 0) -> int:
    """Byte cap of a generation answer of `rows` rows of at most `max_new_tokens` tokens each;
    `extra_row_bytes`: what else a row carries whose size the request fixes (SGLang's routed
    experts: base64 of (prompt + max_new_tokens - 1) x layers x top_k int32)."""
    per_row = RESPONSE_ROW_BYTES + int(max_new_tokens) * RESPONSE_TOKEN_BYTES + int(extra_row_bytes)
    return RESPONSE_FLOOR_BYTES + max(int(rows), 1) * per_row


def _snippet(body: bytes | str, n: int = 300) -> str:
    s = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    s = s.strip().replace("\n", " ")
    return s if len(s) <= n else s[:n] + "..."


def release_check(got: Any, want: str) -> tuple[bool, str | None]:
    """Whether a server's reported version `got` is release `want`, and a note when it is with a
    local build label. PEP 440: a version is public[+local]; builds of one release differ in the
    local part only (vLLM's CUDA wheels report 0.32.0+cu130, SGLang's 0.5.23+cu129), and such a
    build speaks the release's API, so the public part is what is compared. Returns (True, None)
    for an exact match, (True, "<got> is <want> with the local build label +<local>") for a local
    build of the release, and (False, None) otherwise (a different release, an unparseable one)."""
    text = str(got).strip()
    public, plus, local = text.partition("+")
    normal = public.lower()
    normal = normal[1:] if normal.startswith("v") else normal  # PEP 440 allows a leading "v"
    if normal != want.lower() or (plus and not local):
        return False, None
    if not plus:
        return True, None
    return True, f"{text} is {want} with the local build label +{local}"


def normalize_url(url: str, label: str = "server") -> str:
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise ValueError(f"{label} URL must look like http://host:port, got {url!r}")
    return url.rstrip("/")


class ServerClient:
    """JSON requests to one inference server (thread-safe; one connection per request).

    `inflight` counts requests under way (least-loaded server choice). `label` names the server
    in every message ("SGLang server", "vLLM server"). `response_cap(method, path, payload)`:
    the byte cap of the answer to that request (None: DEFAULT_MAX_RESPONSE_BYTES).
    """

    label = "server"

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
        label: str | None = None,
        response_cap: Callable[[str, str, Any], int | None] | None = None,
    ):
        self.response_cap = response_cap
        if label is not None:
            self.label = label
        self.url = normalize_url(url, self.label)
        p = urllib.parse.urlsplit(self.url)
        self._https = p.scheme == "https"
        self._host = p.hostname
        self._port = p.port or (443 if self._https else 80)
        self._base_path = p.path.rstrip("/")
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self._lock = threading.Lock()
        self.inflight = 0
        self.requests = 0
        self.failures = 0
        self._cutters: set = set()  # the exchanges under way (cut_inflight)

    def __repr__(self) -> str:
        return f"ServerClient({self.url})"

    # ------------------------------------------------------------------ one attempt
    def request_once(
        self, method: str, path: str, payload: Any = None, *, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        """One HTTP exchange, bounded: `timeout_s` (default the client's) is a deadline for all of
        it and the body is capped (see the module docstring). Connection problems, the deadline
        and the cap raise `RetryableHTTPError`s naming the server."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        cap = self.response_cap(method, path, payload) if self.response_cap is not None else None
        cap = DEFAULT_MAX_RESPONSE_BYTES if cap is None else int(cap)
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=timeout)
        # Socket timeouts bound each recv/send, not the exchange: a watchdog shuts the socket down
        # at the deadline, which wakes a blocked read (it then sees EOF or an error) wherever it is,
        # in the status line, the headers or the body.
        # The socket is held here from the moment it is connected: http.client drops `conn.sock`
        # (HTTPConnection.getresponse calls self.close() when the answer will close the
        # connection: `Connection: close`, or no Content-Length and no chunking) and hands the
        # socket to the response, so a watchdog reading `conn.sock` found None and a
        # close-delimited answer dripping one byte a second was never cut.
        expired = threading.Event()
        cut: list[str] = []  # why cut_inflight() ended this exchange early
        held: list[socket.socket] = []

        def expire(reason: str | None = None) -> None:
            if reason is not None:
                cut.append(reason)
            expired.set()
            sock = held[0] if held else conn.sock
            if sock is not None:
                try:  # socket.socket's own shutdown: an SSLSocket's would tear down its SSL state
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(timeout, expire)
        watchdog.daemon = True
        received = 0

        def deadline(cause: str = "") -> RetryableHTTPError:
            if cut:  # not the deadline: cut_inflight()
                return RetryableHTTPError(f"{self.label} {self.url}: {method} {path} cut short: {cut[0]}",
                                          url=self.url)
            return DeadlineExceededError(
                f"{self.label} {self.url}: {method} {path} timed out: exceeded its deadline of {timeout:g} s for "
                f"the whole response ({received} body bytes received{cause})", url=self.url, received=received)

        with self._lock:
            self.inflight += 1
            self.requests += 1
            self._cutters.add(expire)
        watchdog.start()
        try:
            conn.connect()
            held.append(conn.sock)
            if expired.is_set():  # the deadline passed while connecting (no socket to shut down yet)
                raise deadline("; while connecting")
            conn.request(method, self._base_path + path, body=body, headers=headers)
            resp = conn.getresponse()
            declared = resp.getheader("Content-Length")
            if declared is not None and declared.strip().isdigit() and int(declared) > cap:
                raise ResponseTooLargeError(
                    f"{self.label} {self.url}: {method} {path} answered a {int(declared)}-byte body, over the "
                    f"cap of {cap} bytes for this request; not read", url=self.url)
            chunks = []
            while True:
                chunk = resp.read1(1 << 16)
                if not chunk:
                    break
                received += len(chunk)
                if received > cap:
                    raise ResponseTooLargeError(
                        f"{self.label} {self.url}: {method} {path} answered more than the cap of {cap} bytes "
                        "for this request; the rest is not read", url=self.url)
                chunks.append(chunk)
            if expired.is_set():
                raise deadline()
            if resp.length:  # EOF before the declared Content-Length
                raise http.client.IncompleteRead(b"", resp.length)
            return resp.status, b"".join(chunks)
        except ResponseTooLargeError:
            with self._lock:
                self.failures += 1
            raise
        except DeadlineExceededError:
            with self._lock:
                self.failures += 1
            raise
        except (*RETRYABLE_OS_ERRORS, ValueError, AttributeError) as e:
            # ValueError / AttributeError: what http.client may raise on a socket shut down under it
            with self._lock:
                self.failures += 1
            if cut:
                raise RetryableHTTPError(f"{self.label} {self.url}: {method} {path} cut short: {cut[0]}",
                                         url=self.url) from e
            # a socket timeout is the deadline too: one recv ran the whole timeout, so the exchange
            # is past its deadline even when the watchdog thread was not scheduled yet (under load)
            if expired.is_set() or isinstance(e, TimeoutError):
                raise deadline(f"; {type(e).__name__}") from e
            if not isinstance(e, RETRYABLE_OS_ERRORS):
                raise
            # The reason is one line of bounded length: an error such as BadStatusLine carries
            # whatever bytes the server sent (CR, LF, a whole banner).
            detail = " ".join(repr(str(e))[1:-1].split())[:200]
            kind = "timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {detail}"
            raise RetryableHTTPError(
                f"{self.label} {self.url}: {method} {path} failed ({kind})", url=self.url
            ) from e
        finally:
            watchdog.cancel()
            conn.close()
            with self._lock:
                self.inflight -= 1
                self._cutters.discard(expire)

    def cut_inflight(self, reason: str) -> int:
        """End every exchange under way with this server now (each raises a RetryableHTTPError
        naming `reason`): a server found dead by a health check does not keep its callers waiting
        for their deadlines. Returns how many were cut."""
        with self._lock:
            cutters = list(self._cutters)
        for c in cutters:
            c(reason)
        return len(cutters)

    def backoff(self, attempt: int) -> float:
        """Seconds to sleep before retry `attempt` (1-based): exponential with jitter, capped."""
        base = min(self.backoff_max_s, self.backoff_s * (2 ** (attempt - 1)))
        return base * (0.75 + 0.5 * random.random())

    # ------------------------------------------------------------------ with retries
    def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        retries: int | None = None,
        expect_json: bool = True,
        ok_statuses: Iterable[int] = (200,),
    ) -> Any:
        """Request with retries on connection errors / timeouts / 5xx. Returns parsed JSON (or
        the text when `expect_json` is false). Other statuses raise `EngineServerError` at once."""
        retries = self.max_retries if retries is None else int(retries)
        ok = set(ok_statuses)
        last: Exception | None = None
        for attempt in range(retries + 1):
            if attempt:
                log.warning("%s %s: %s %s, retry %d of %d after %s", self.label, self.url, method, path, attempt,
                            retries, str(last).splitlines()[0] if str(last) else type(last).__name__)
                time.sleep(self.backoff(attempt))
            try:
                status, data = self.request_once(method, path, payload, timeout_s=timeout_s)
            except RetryableHTTPError as e:
                last = e
                continue
            if status >= 500:
                last = RetryableHTTPError(
                    f"{self.label} {self.url}: {method} {path} returned HTTP {status}: {_snippet(data)}",
                    url=self.url, status=status,
                )
                continue
            if status not in ok:
                raise EngineServerError(
                    f"{self.label} {self.url}: {method} {path} returned HTTP {status}: {_snippet(data)}",
                    url=self.url, status=status,
                )
            return parse_json(data, self.url, path, self.label) if expect_json else data.decode("utf-8", "replace")
        raise EngineServerError(
            f"{self.label} {self.url}: {method} {path} failed after {retries + 1} attempt(s); "
            f"last error: {last}",
            url=self.url, status=getattr(last, "status", None),
        ) from last

    def get(self, path: str, **kw) -> Any:
        return self.request("GET", path, **kw)

    def post(self, path: str, payload: Any = None, **kw) -> Any:
        return self.request("POST", path, {} if payload is None else payload, **kw)


def loads_answer(data: bytes | str) -> Any:
    """`json.loads` of a server's answer, every way it can fail as a ValueError: besides malformed
    text, json.loads raises RecursionError on nesting deeper than the interpreter's recursion limit
    (a few kilobytes of "[" do it, far inside any response cap) and MemoryError on a body within the
    cap that expands past memory. Callers count a ValueError as a failed sample, not a crash."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply to parse") from None
    except MemoryError:
        raise ValueError(f"JSON of {len(data)} bytes too large to parse") from None


def header_safe_secret(value: str, where: str) -> str:
    """`value` (a key read from the environment variable `where` names) if an HTTP header can carry
    it: visible ASCII only. An env file written on Windows leaves a trailing CR, which http.client
    refuses with an error that prints the whole header, key included. The message names `where`,
    never the value."""
    bad = next((i for i, ch in enumerate(value) if not 0x21 <= ord(ch) <= 0x7E), None)
    if bad is not None:
        what = {"\r": "a carriage return (an env file with CRLF line ends?)", "\n": "a line feed",
                " ": "a space", "\t": "a tab"}.get(value[bad], f"character U+{ord(value[bad]):04X}")
        raise InputError(f"{where}: the key holds {what} at position {bad} of {len(value)}; "
                         "an HTTP header carries visible ASCII only (the value is not shown)")
    return value


def secret_from_env(name: str | None, where: str) -> str | None:
    """The key held by the environment variable `name` (None when no name is given), checked for
    an HTTP header (header_safe_secret). Keys are named, never written: a config holds the
    variable's name, so the key never reaches config.yaml, the W&B config, a log or an argv.
    `where`: the config key that named the variable (in errors, with the name, never the value)."""
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise InputError(f"{where}={name}: that environment variable is not set")
    return header_safe_secret(value, f"{where}={name}")


# What a launched server inherits from the trainer's environment: what an engine needs to find its
# libraries, devices, caches and threads, and nothing else. Everything else stays in the trainer
# (the judge key's variable, WANDB_API_KEY, cloud credentials): a server's environment is readable
# by anything of its user (/proc/<pid>/environ) and is dumped by crash reporters.
# rollout.sglang.env_vars / rollout.vllm.env_vars name more. A name with a secret-like part (KEY, TOKEN, SECRET, ...:
# HF_TOKEN, an inherited VLLM_API_KEY) is not passed even under an admitted prefix.
SERVER_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "TERM", "HOSTNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TMP", "TEMP",
    "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "VIRTUAL_ENV",
    "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "CC", "CXX", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    "NO_PROXY", "no_proxy"})
SERVER_ENV_PREFIXES = ("LC_", "XDG_", "CUDA_", "NCCL_", "NVIDIA_", "CUDNN_", "NVTE_", "TORCH_", "TORCHINDUCTOR_",
                       "PYTORCH_", "TRITON_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "HF_", "TRANSFORMERS_",
                       "TOKENIZERS_", "VLLM_", "SGLANG_", "FLASHINFER_", "GLOO_", "UCX_", "NVSHMEM_", "FI_")


def server_environment(extra_names: Iterable[str] = (), unset: Iterable[str] = ()) -> dict[str, str]:
    """The part of this process's environment a launched server inherits: SERVER_ENV_NAMES,
    SERVER_ENV_PREFIXES and `extra_names` (rollout.*.env_vars), less `unset` and every
    secret-like name (a key reaches a server only as the launch spec's own secret)."""
    extra, unset = set(extra_names), set(unset)
    return {k: v for k, v in os.environ.items()
            if (k in SERVER_ENV_NAMES or k.startswith(SERVER_ENV_PREFIXES) or k in extra)
            and k not in unset and not secret_like(k)}


def parse_json(data: bytes, url: str, path: str, label: str = "server") -> Any:
    try:
        return loads_answer(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise EngineProtocolError(
            f"{label} {url}: {path} answered malformed JSON ({e}): {_snippet(data)!r}"
        ) from None


# ---------------------------------------------------------------------------------- readiness
def wait_until_ready(
    clients: Sequence[ServerClient],
    timeout_s: float,
    *,
    poll_s: float = 0.5,
    alive: Callable[[int], str | None] | None = None,
    path: str = "/health",
) -> float:
    """Wait until every server answers 200 on `path`; returns the seconds waited.

    `alive(i)`: None while server i's process runs, else a description of its death (checked
    every poll, so a crashed launch fails fast instead of waiting out the timeout).
    """
    t0 = time.monotonic()
    deadline = t0 + float(timeout_s)
    pending = list(range(len(clients)))
    last_err: dict[int, str] = {}
    # the last non-200 answer: a later probe that times out (the last one has only what is left
    # of the wait) must not hide that the server is up and answering (e.g. 503 while loading)
    last_answer: dict[int, str] = {}
    while pending:
        for i in list(pending):
            if alive is not None:
                dead = alive(i)
                if dead is not None:
                    raise EngineNotReadyError(f"{clients[i].label} {clients[i].url} {dead}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                status, data = clients[i].request_once("GET", path, timeout_s=max(0.1, min(10.0, remaining)))
            except RetryableHTTPError as e:
                last_err[i] = str(e.__cause__ or e)
                continue
            if status == 200:
                pending.remove(i)
            else:
                last_err[i] = last_answer[i] = f"HTTP {status}: {_snippet(data, 120)}"
        if not pending:
            break
        if time.monotonic() >= deadline:
            i = pending[0]
            raise EngineNotReadyError(
                f"{clients[i].label} {clients[i].url} not ready after {timeout_s:g} s "
                f"(GET {path}; last error: {last_err.get(i, 'none')}"
                + (f"; last answer: {last_answer[i]}" if last_answer.get(i, last_err.get(i)) != last_err.get(i) else "")
                + ")"
                + (f"; {len(pending) - 1} more server(s) not ready" if len(pending) > 1 else "")
            )
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    return time.monotonic() - t0


# How much of a dead server's log is scanned for its root cause: a failed start logs well under
# 1 MiB (vLLM's banner, arguments, one traceback per process); the bound keeps a huge log cheap.
ROOT_CAUSE_SCAN_BYTES = 4 << 20
# An exception line of a Python traceback: the exception's (optionally dotted) name at the start of
# the line, after vLLM's per-process prefix "(EngineCore_DP0 pid=123) " when there is one; log
# lines that merely mention an error ("WARNING ... like `OSError: ...`") start otherwise.
_EXCEPTION_LINE = re.compile(r"^(?:\([^)]*\)\s+)?((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)(?::\s.*)?)$")


def root_cause(log_text: str) -> str | None:
    """The first exception line of a server's log ("ValueError: Available memory ..."), without
    the process prefix; None when there is none. A server that dies at start reports the cause
    first (its engine process's traceback) and its consequences after it."""
    for line in log_text.splitlines():
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            return m.group(1).strip()
    return None


_LIVE: "weakref.WeakSet[ServerProcesses]" = weakref.WeakSet()


def _redacting_pump(src, dst, lock: threading.Lock, secrets: list[bytes]) -> None:
    """Copy a server's output to its log line by line, each secret replaced (a key holds no line
    break: header_safe_secret), until the server's group closes the pipe."""
    try:
        for line in iter(src.readline, b""):
            for s in secrets:
                line = line.replace(s, b"<redacted>")
            with lock:
                dst.write(line)
                dst.flush()
    except (OSError, ValueError):  # the log was closed under us (stop after its grace)
        pass
    finally:
        src.close()


@atexit.register
def _stop_all_at_exit() -> None:  # pragma: no cover - exercised only when an owner forgot close()
    for group in list(_LIVE):
        try:
            group.stop(grace_s=5.0)
        except Exception:
            pass


class ServerProcesses:
    """The server processes this trainer started (never anything else). `spec`: url(i), argv(i),
    replica_env(i), num_servers, env, env_vars, unset_env, log_dir, log_name, api_key, secret_env(),
    secret_args(private_dir) (sglang_server.LaunchSpec, vllm_server.VLLMLaunchSpec).

    Where a key may go, by construction: never into argv (the log's first line, `ps`), never into
    the environment a server inherits (server_environment: an allow-list, secret-like names
    dropped). A key reaches its server only through the spec's secret channel: an environment
    variable of the server's own (vLLM's VLLM_API_KEY) or a file only this user can read (SGLang's
    --config YAML, in a private directory removed at stop). The server's output goes through a
    pump that writes the log with every occurrence of the key replaced, since servers log their
    own arguments (SGLang 0.5.23 entrypoints/engine.py:311 logs server_args, api_key included)."""

    def __init__(self, spec: Any):
        if spec.num_servers < 1:
            raise ValueError(f"num_servers must be >= 1, got {spec.num_servers}")
        if not spec.argv(0):
            raise ValueError("LaunchSpec needs a module or a command")
        self.spec = spec
        self.procs: list[subprocess.Popen] = []
        self.log_paths: list[str] = []
        self._logs: list[Any] = []
        self._log_locks: list[threading.Lock] = []
        self._pumps: list[threading.Thread] = []
        self._watchdogs: list[subprocess.Popen] = []
        self._private_dir: str | None = None  # the secret files' directory (0700), removed at stop
        self._secrets = [spec.api_key.encode()] if spec.api_key else []

    @property
    def urls(self) -> list[str]:
        """The servers' URLs: num_servers before start, then every server started (`add` /
        `stop_last` change how many)."""
        return [self.spec.url(i) for i in range(len(self.procs) or self.spec.num_servers)]

    def start(self) -> list[str]:
        if self.procs:
            raise RuntimeError("servers already started")
        log_dir = self.spec.log_dir
        if log_dir is None:
            import tempfile

            log_dir = tempfile.mkdtemp(prefix=f"{getattr(self.spec, 'log_name', 'server')}-logs-")
        os.makedirs(log_dir, exist_ok=True)
        self._log_dir = log_dir
        _LIVE.add(self)
        try:
            for _ in range(self.spec.num_servers):
                self._start_next()
        except BaseException:
            self.stop(grace_s=2.0)
            raise
        return self.urls

    def _start_next(self) -> int:
        """Start server len(procs) (its log appended to: a replica started again keeps one log)."""
        i = len(self.procs)
        path = os.path.join(self._log_dir, f"{getattr(self.spec, 'log_name', 'server')}_{i}.log")
        self._logs.append(open(path, "ab"))
        self._log_locks.append(threading.Lock())
        self.log_paths.append(path)
        try:
            self.procs.append(self._spawn(i))
        except BaseException:
            self._logs.pop().close()
            self._log_locks.pop()
            self.log_paths.pop()
            raise
        return i

    def add(self) -> int:
        """One more server while the run goes on (a launched replica: url(i), the spec's
        replica_env(i)); its index. The caller waits for it and makes it join."""
        if not self.procs:
            raise RuntimeError("servers not started")
        return self._start_next()

    def stop_last(self, grace_s: float = 15.0) -> None:
        """Stop the last server started (SIGTERM its group, SIGKILL after `grace_s`) and forget it:
        the fleet shrinks from the top, so every other server keeps its index, port and log."""
        if len(self.procs) <= 1:
            raise RuntimeError("the last server is not stopped by stop_last (stop() ends them all)")
        p = self.procs[-1]
        _stop_group(p, grace_s)
        left = wait_group_gone(p.pid)
        if left:
            log.warning("server %d: %d process(es) still running after %.0f s (pids %s)", len(self.procs) - 1,
                        len(left), GROUP_EXIT_TIMEOUT_S, left[:5])
        self.procs.pop()  # only now: a caller that sees the fleet shrunk sees its processes gone
        lock = self._log_locks.pop()
        with lock:
            f = self._logs.pop()
            f.write(f"--- stopped by the trainer (the fleet shrank; exit code {p.poll()}) ---\n".encode())
            f.close()
        self.log_paths.pop()

    def _spawn(self, i: int) -> subprocess.Popen:
        env = server_environment(self.spec.env_vars, self.spec.unset_env)
        env.update(self.spec.env or {})
        env.update(self.spec.replica_env(i))  # server i's own devices (vLLM on CUDA: its GPUs)
        env.update(self.spec.secret_env())
        if self._secrets and self._private_dir is None:
            import tempfile

            self._private_dir = tempfile.mkdtemp(prefix="gspo-server-")  # mode 0700
        argv = self.spec.argv(i) + (self.spec.secret_args(self._private_dir) if self._secrets else [])
        line = ("$ " + " ".join(argv) + "\n").encode()
        if any(s in line for s in self._secrets):  # by construction never: argv holds paths, not keys
            raise RuntimeError(f"server {i}: a key in its command line (refused; the key is not shown)")
        logf = self._logs[i]
        with self._log_locks[i]:
            logf.write(line)
            logf.flush()
        # the server under its shim (process_guard: own session and group, so stop() reaches its
        # children; gone with the shim, and the group stopped once this process is gone)
        p = process_guard.spawn_guarded(argv, env, subprocess.PIPE if self._secrets else logf)
        if self._secrets:
            pump = threading.Thread(target=_redacting_pump, args=(p.stdout, logf, self._log_locks[i], self._secrets),
                                    name=f"server-{i}-log", daemon=True)
            pump.start()
            self._pumps = [t for t in self._pumps if t.is_alive()] + [pump]
        self._watchdogs = [w for w in self._watchdogs if w.poll() is None]
        try:
            self._watchdogs.append(process_guard.watch(p.pid))
        except OSError as e:  # the shim still stops the group once this process is gone
            log.warning("no watchdog for server %d (pid %d): %s", i, p.pid, e)
        return p

    def restart(self, i: int, grace_s: float = 5.0) -> None:
        """Stop server i's process group (SIGTERM, then SIGKILL after `grace_s`: a server stuck in
        its own shutdown does not hold the restart) and start it again, same argv, same log."""
        p = self.procs[i]
        _stop_group(p, grace_s)
        left = wait_group_gone(p.pid)  # its GPU memory is free only once every process has exited
        if left:
            log.warning("server %d: %d process(es) of the old server still running after %.0f s (pids %s); "
                        "starting the new one anyway", i, len(left), GROUP_EXIT_TIMEOUT_S, left[:5])
        with self._log_locks[i]:
            self._logs[i].write(f"--- restarted by the trainer (the previous process exited with {p.poll()}) ---\n"
                                .encode())
        self.procs[i] = self._spawn(i)

    def log_tail(self, i: int, n_bytes: int = 2000) -> str:
        try:
            with open(self.log_paths[i], "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n_bytes))
                return f.read().decode("utf-8", "replace")
        except (OSError, IndexError):
            return ""

    def dead(self, i: int) -> str | None:
        """None while server i runs, else why it is gone (exit code + log tail)."""
        if i >= len(self.procs):
            return None
        rc = self.procs[i].poll()
        if rc is None:
            return None
        tail = self.log_tail(i)
        last = next((ln.strip() for ln in reversed(tail.splitlines()) if ln.strip()), "")
        cause = root_cause(self.log_head(i))
        # the root cause and the last log line go on the first line: CLIs print only that one
        # (cli_util.user_errors). The last line alone often names only the consequence: vLLM's API
        # server ends with "RuntimeError: Engine core initialization failed. See root cause above."
        # while the cause (a ValueError from its engine core) is printed earlier.
        return (
            f"(pid {self.procs[i].pid}) exited with code {rc} before becoming ready"
            + (f": {cause[:300]}" if cause and cause not in last else "")
            + (f" (its log ends: {last[-300:]!r})" if last else "")
            + f"; log {self.log_paths[i]}:\n{tail}"
        )

    def log_head(self, i: int, n_bytes: int = ROOT_CAUSE_SCAN_BYTES) -> str:
        """The first `n_bytes` of server i's log (where the first exception of a failed start is)."""
        try:
            with open(self.log_paths[i], "rb") as f:
                return f.read(n_bytes).decode("utf-8", "replace")
        except (OSError, IndexError):
            return ""

    def wait_ready(self, clients: Sequence[ServerClient], timeout_s: float) -> float:
        return wait_until_ready(clients, timeout_s, alive=self.dead, path=getattr(self.spec, "health_path", "/health"))

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM each started process group, wait up to `grace_s`, then SIGKILL what is left."""
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            else:
                # the leader is gone; children it left in its group (SGLang schedulers, vLLM engine cores) go too
                _signal_group(p, signal.SIGKILL, leader_gone=True)
        for t in self._pumps:  # each ends at its server group's end of output (EOF)
            t.join(timeout=10)
        self._pumps = []
        for f in self._logs:
            try:
                f.close()
            except OSError:
                pass
        self._logs = []
        if self._private_dir is not None:
            import shutil

            shutil.rmtree(self._private_dir, ignore_errors=True)
            self._private_dir = None
        for w in self._watchdogs:  # they end once their server's group is gone; reap them
            try:
                w.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait(timeout=5)
        self._watchdogs = []
        _LIVE.discard(self)

    def __enter__(self) -> "ServerProcesses":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop_group(p: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `p`'s process group, SIGKILL it after `grace_s`, and SIGKILL what the leader left."""
    if p.poll() is None:
        _signal_group(p, signal.SIGTERM)
        try:
            p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            _signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    _signal_group(p, signal.SIGKILL, leader_gone=True)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`, from /proc (Linux); elsewhere the
    leader's pid while signal 0 reaches the group."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
            found.append(int(name))
    return found


# How long a restart waits for the old server's processes to be gone: a killed GPU process keeps
# its memory until the driver has torn its context down, and vLLM's start-up free-memory check
# then refuses the new server (issue 52).
GROUP_EXIT_TIMEOUT_S = 60.0


def wait_group_gone(pgid: int, timeout_s: float = GROUP_EXIT_TIMEOUT_S) -> list[int]:
    """Wait (bounded) until no live process of group `pgid` is left; those still left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def _signal_group(p: subprocess.Popen, sig: int, leader_gone: bool = False) -> None:
    """Signal the process group we created for `p` (its pgid is its pid: start_new_session)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        if not leader_gone:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def local_address_towards(url: str) -> str:
    """The address of this host's interface that routes to `url`'s host (for the servers to reach
    the trainer's weight-update rendezvous). No packet is sent (UDP connect)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    try:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
