"""Reward servers: a served sequence-classification reward model (reward.model), and the launch of a
reward server by the trainer (reward.model.launch, reward.judge.launch) under the engines'
supervision (rollout/supervision.py).

Reward model. Each sample's text is `template` with {prompt}, {response} and {answer} replaced
(plain replacement, as the judge's); the texts go in batches of `batch_size` to the server's
classification route (vLLM 0.32: ``POST /classify`` {"model", "input": [texts], "use_activation":
false}, entrypoints/pooling/classify/protocol.py; ``use_activation=false`` returns the classifier's
raw output, not its sigmoid/softmax) and the score is entry `label` of each answer's ``probs``
(a reward model has one label: entry 0). Batches run `max_concurrency` at a time; each has
`timeout_s` for all its attempts together; connection errors, timeouts, HTTP 429 and 5xx are
retried (at most `retries` times, with backoff) within it; a 4xx answer or an answer that is not a
classification of every text is not. A sample whose batch failed scores 0.0 and counts as raised,
like a judge's (rollout/judge.py CombinedScorer counts `model_errors`; reward.max_error_frac).

Launched servers. ``launch: true`` starts the server like an engine's (a vLLM server from the
project's vLLM venv, rollout/vllm_server.py, on loopback with a generated key, its log in
<out_dir>/reward_logs), waits for it, and watches it with the engines' supervisor: a server that
exits or stops answering is restarted (its weights are the ones it starts from: nothing to
re-sync), at most `max_restarts` times; a request that failed on it waits for the supervisor's
verdict before its retry.
"""
from __future__ import annotations

import logging
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from .http_servers import EngineError, RetryableHTTPError, ServerClient, loads_answer, secret_from_env

log = logging.getLogger("gspo_megatron.rollout")

CLASSIFY_ROUTE = "/classify"
# the request's fields (tests/test_vllm_contract.py checks them against vLLM's ClassificationCompletionRequest)
CLASSIFY_FIELDS = ("model", "input", "use_activation")


class RewardServer:
    """One reward server the trainer launched (or was given), watched by the engines' supervisor.
    What the supervisor reads of an engine (rollout/supervision.py ServerSupervisor) is here; the
    weights are the ones the server starts from, so a server back after a loss needs no re-sync."""

    NAME = "reward"
    CONFIG = "reward"
    HEALTH_PATH = "/health"
    weight_version = 0

    def __init__(self, name: str, config_key: str, client: ServerClient, procs: Any = None, *,
                 max_restarts: int = 0, interval_s: float = 2.0, ready_timeout_s: float = 900.0):
        self.NAME, self.CONFIG = name, config_key
        self.workers = [client]
        self.procs = procs
        self.metrics: dict[str, float] = {"restarts": 0}
        self._lock = threading.Lock()
        self.supervisor = None
        if procs is not None:
            from .supervision import ServerSupervisor

            self.supervisor = ServerSupervisor(self, max_restarts=max_restarts, interval_s=interval_s,
                                               lost_timeout_s=ready_timeout_s, ready_timeout_s=ready_timeout_s)

    @property
    def client(self) -> ServerClient:
        return self.workers[0]

    # what the supervisor asks
    def _inc(self, key: str, by: float = 1) -> None:
        with self._lock:
            self.metrics[key] = self.metrics.get(key, 0) + by

    def _resync_refusal(self) -> str | None:
        return None

    def _resync_server(self, server) -> None:
        """Nothing: a reward server serves the weights it starts from."""

    def _served_version_ok(self, server) -> bool | None:
        return None

    def settle(self) -> None:
        """After a failed request: the supervisor's verdict (bounded), when there is one."""
        if self.supervisor is not None:
            self.supervisor.settle(self.client)

    def close(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        if self.procs is not None:
            self.procs.stop()
            self.procs = None


def causes_text(causes: list[str]) -> str:
    """The failed attempts' causes in order, a run of equal ones once with its count:
    "HTTP 500: ... (x2); then: ... timed out ..."."""
    if not causes:
        return "no attempt"
    runs: list[list] = []
    for c in causes:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return "; then: ".join(c if k == 1 else f"{c} (x{k})" for c, k in runs)


class ServedScorer:
    """A reward source behind a server: given by URL (a client now) or launched by the trainer
    (`start`, on the rank that scores, once the run is set up). Subclasses set NAME and CONFIG and
    call `_serve(cfg)` in their __init__."""

    NAME = "reward server"
    CONFIG = "reward"
    POOLING = False  # a launched server runs vLLM's pooling runner (a classifier), else a generator
    server: RewardServer | None = None

    def _serve(self, cfg) -> None:
        self.cfg = cfg
        if not cfg.launch:
            key = secret_from_env(cfg.api_key_env, f"{self.CONFIG}.api_key_env")
            self.server = RewardServer(self.NAME, self.CONFIG, ServerClient(
                cfg.url, api_key=key, timeout_s=cfg.timeout_s, max_retries=cfg.retries, label=self.NAME))

    def start(self, log_dir: str) -> None:
        """The launched server (launch=true), started and supervised; nothing for a URL."""
        if self.server is None:
            self.server = launch_reward_server(self.NAME, self.CONFIG, self.cfg, pooling=self.POOLING, log_dir=log_dir)

    @property
    def client(self) -> ServerClient:
        if self.server is None:
            raise EngineError(f"{self.CONFIG}.launch=true: the server was not started (ServedScorer.start)")
        return self.server.client

    def exchange(self, route: str, body: dict) -> tuple[bytes | None, str | None]:
        """POST `body` to `route`, retried within one budget (cfg.timeout_s for all attempts
        together): connection errors, timeouts, HTTP 429 and 5xx are retried (cfg.retries, with
        backoff; a launched server's supervisor gives its verdict first); any other answer is
        final. Returns (the 200 answer's bytes, None) or (None, why)."""
        c, client = self.cfg, self.client
        deadline = time.monotonic() + c.timeout_s
        failed: list[str] = []  # every failed attempt's cause, in order: a late timeout must not hide a 500
        for attempt in range(c.retries + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if attempt:
                time.sleep(min(client.backoff(attempt), max(left - 0.05, 0.0)))
                left = deadline - time.monotonic()
                if left <= 0:
                    break
            try:
                status, data = client.request_once("POST", route, body, timeout_s=left)
            except RetryableHTTPError as e:
                failed.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
                self.settle()
                continue
            if status == 429 or status >= 500:
                failed.append(f"HTTP {status}: {data[:120].decode('utf-8', 'replace')}")
                self.settle()
                continue
            if status != 200:
                return None, f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}"
            return data, None
        return None, f"no answer within {self.CONFIG}.timeout_s={c.timeout_s:g} s ({causes_text(failed)})"

    def settle(self) -> None:
        """After a failed request: the supervisor's verdict on a launched server (bounded)."""
        try:
            if self.server is not None:
                self.server.settle()
        except EngineError as e:  # the server is gone for good: this request fails, counted
            log.warning("%s", e)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def launch_reward_server(name: str, config_key: str, section, *, log_dir: str, pooling: bool) -> RewardServer:
    """Start section.model_path as a vLLM server of the project's vLLM venv (or
    section.server.server_command), on loopback with a generated key (never in its argv), wait for
    it (section.server.ready_timeout_s) and supervise it."""
    from .vllm_env import default_dir, is_ready, venv_python
    from .vllm_server import VLLMLaunchSpec, launch

    srv = section.server
    cmd = list(srv.server_command) or None
    python = "python3"
    if cmd is None:
        if not is_ready(default_dir()):
            raise EngineError(f"{config_key}.launch=true: no vLLM environment at {default_dir()}: build it with "
                              f"`python -m gspo_megatron.rollout.vllm_env` or set {config_key}.server_command")
        python = venv_python(default_dir())
    key = secrets.token_hex(16)
    extra = list(srv.extra_args or [])
    if pooling and "--runner" not in extra:
        extra += ["--runner", "pooling"]
    if "--served-model-name" not in extra:  # the name requests carry (section.model)
        extra += ["--served-model-name", section.model]
    spec = VLLMLaunchSpec(model_path=section.model_path, port=int(srv.port), host="127.0.0.1", api_key=key,
                          dtype=srv.dtype, max_model_len=srv.max_model_len, cpu_kv_cache_mb=srv.cpu_kv_cache_mb,
                          extra_args=extra, command=cmd, python=python, log_dir=log_dir,
                          log_name=name.replace(" ", "_"))
    procs = launch(spec)
    try:
        client = ServerClient(procs.urls[0], api_key=key, timeout_s=section.timeout_s, max_retries=section.retries,
                              label=name)
        procs.wait_ready([client], float(srv.ready_timeout_s))
        log.info("%s server started: %s (%s)", name, procs.urls[0], section.model_path)
        return RewardServer(name, config_key, client, procs, max_restarts=int(srv.max_restarts),
                            interval_s=float(srv.health_interval_s), ready_timeout_s=float(srv.ready_timeout_s))
    except BaseException:
        procs.stop()
        raise


def render(template: str, text: str, example: dict, prompt_key: str, answer_key: str) -> str:
    """`template` with {prompt}, {response} and {answer} replaced (plain replacement: a template
    cannot reach attributes, as str.format could)."""
    out = template
    for k, v in (("{prompt}", example.get(prompt_key, "")), ("{answer}", example.get(answer_key, "")),
                 ("{response}", text)):
        out = out.replace(k, "" if v is None else str(v))
    return out


class RewardModelScorer(ServedScorer):
    """`scorer(texts, examples) -> (scores, raised)`; `last_errors` as the judge's (module docstring)."""

    name = "model"
    NAME, CONFIG, POOLING = "reward model", "reward.model", True

    def __init__(self, cfg, *, prompt_key: str = "prompt", answer_key: str = "answer"):
        self._serve(cfg)
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.last_errors: list[str | None] = []

    def render(self, text: str, example: dict) -> str:
        return render(self.cfg.template, text, example, self.prompt_key, self.answer_key)

    def parse(self, body: Any, n: int) -> list[float]:
        """The scores of a batch of n texts; ValueError naming what is wrong."""
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or len(data) != n or not all(isinstance(d, dict) for d in data):
            raise ValueError(f"not a classification of {n} texts: {str(body)[:200]!r}")
        out: list[float | None] = [None] * n
        for d in data:
            i, probs = d.get("index"), d.get("probs")
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n or out[i] is not None:
                raise ValueError(f"a classification with index {i!r} of {n} texts")
            label = int(self.cfg.label)
            if not isinstance(probs, list) or len(probs) <= label:
                raise ValueError(f"text {i}: no output {label} in {str(probs)[:80]!r} (reward.model.label)")
            v = probs[label]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or abs(v) > 3.0e38:
                raise ValueError(f"text {i}: the score {v!r} is not a finite float32")
            out[i] = float(v)
        return out  # type: ignore[return-value]

    def _batch(self, inputs: list[str]) -> tuple[list[float] | None, str | None]:
        data, why = self.exchange(CLASSIFY_ROUTE, {"model": self.cfg.model, "input": inputs, "use_activation": False})
        if data is None:
            return None, why
        try:
            return self.parse(loads_answer(data), len(inputs)), None
        except ValueError as e:
            return None, str(e)

    def __call__(self, texts: Sequence[str], examples: Sequence[dict]) -> tuple[list[float], list[bool]]:
        n = len(texts)
        scores, raised = [0.0] * n, [True] * n
        errors: list[str | None] = [None] * n
        inputs = [self.render(t, e) for t, e in zip(texts, examples)]
        size = int(self.cfg.batch_size)
        starts = list(range(0, n, size))
        if starts:
            with ThreadPoolExecutor(max_workers=min(int(self.cfg.max_concurrency), len(starts)),
                                    thread_name_prefix="reward-model") as pool:
                for a, (got, why) in zip(starts, pool.map(lambda a: self._batch(inputs[a:a + size]), starts)):
                    for j in range(a, min(a + size, n)):
                        if got is None:
                            errors[j] = f"reward model {self.client.url}: {why}"
                        else:
                            scores[j], raised[j] = got[j - a], False
        self.last_errors = errors
        return scores, raised
