"""RolloutEngine over vLLM's HTTP API (vLLM 0.32.0; servers started as rollout/vllm_server.py says).

Generation: one ``POST /inference/v1/generate`` per prompt group (token ids in, ``n`` choices out,
each with its ``token_ids``, the processed, i.e. tempered, log-prob of every sampled token and the
``weight_versions`` spans that produced them), at most ``concurrency`` in flight over the servers,
retried on connection errors / 5xx with backoff, each request bounded by ``request_timeout_s``
(a deadline for the whole exchange) and a byte cap derived from the request (rollout/http_servers.py
`generate_response_cap`). Every choice is checked at the boundary (rollout/validate.py
`check_response`: at most max_tokens tokens, ids in [0, vocab_size), one finite log-prob <= 0 per
token); a violating answer is logged naming the server and retried like a failed request, and if the
last attempt still violates, its violating choices come back as rejected samples (no tokens,
``meta["rejected"]`` the reason naming the server) counted in ``metrics["rejected"]``.

Weights (``weight_sync=disk``): the pushed tensors are written once as an HF checkpoint in
``<shared_dir>/v<version>``; every server then pauses (``/pause?mode=wait``: requests in flight
finish, new ones queue), reloads them in place through the project's worker extension
(``/collective_rpc gspo_reload_weights``: vLLM's own reload leaves CPU MoE experts unpacked,
rollout/vllm_worker.py), sets its weight version (``/update_weight_version``) and resumes. A
server that fails the reload fails the push (the engine then refuses to generate until a complete
push succeeds: servers would hold different weights).

Partial rollouts: `interrupt()` pauses every server with ``mode=abort`` — requests in flight
return at once with the tokens so far and ``finish_reason: abort`` — and later generate() calls
return empty aborted rows without asking (a paused vLLM queues new requests instead of refusing
them); the next push resumes the servers.

Weights (``weight_sync=nccl``, GPUs): vLLM's own NCCL weight transfer, trainer rank 0 broadcasting
to every server worker (rollout/vllm_nccl.py; the servers run with ``--weight-transfer-config
'{"backend": "nccl"}'``). Same pause / version / resume around it; a failed transfer leaves the
group unusable and the engine refusing to generate.

Departures from SGLangEngine: no routed experts (vLLM 0.32 returns them only with Model Runner V2,
not on CPU; the config refuses the option), ``top_p < 1`` / ``top_k`` are refused (vLLM reports
log-probs renormalised over the truncated distribution), no CUDA-IPC (``tensor``) sync for
colocated servers.
"""
from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .base import (NamedTensors, RolloutEngine, Sample, SamplingParams, WeightVerificationError, check_generate_args,
                   cut_at_stop_string)
from .http_servers import (EngineError, EngineProtocolError, EngineServerError, RetryableHTTPError,
                           generate_response_cap, parse_json, secret_from_env)
from .validate import check_response, rejected_sample, vocab_size_of
from .vllm_api import (GENERATE, LOAD_LORA, LORA_BOUND_METHOD, LORA_NAME, RELOAD_METHOD, VLLM_VERSION,
                       lora_bound_modules, lora_server_args, version_matches)
from .http_engine import EngineVersionError, HTTPEngine
from .supervision import restarts_default
from .vllm_server import ServerClient, VLLMLaunchSpec, launch

log = logging.getLogger("gspo_megatron.rollout")


class VLLMVersionError(EngineVersionError):
    """A server runs another vLLM than VLLM_VERSION (one line, as SGLang's)."""


class LoraBindError(EngineError):
    """A pushed LoRA adapter that a server bound to another number of modules than the trainer's
    adapters stand on (a served model whose modules the adapter misses trains blind)."""


class WeightMismatchError(EngineError, WeightVerificationError):
    """A verified push (rollout.verify_weights, disk sync): what a server worker read is not what
    the trainer wrote."""


# Relative tolerance of a digest comparison: both sides sum the same values in float64, in
# possibly different orders (another device, another reduction); a changed tensor moves its sum of
# squares by far more (one expert scaled by 1.01: 2e-2).
DIGEST_RTOL = 1e-6


def _tee_digests(named_tensors, into: dict, dtype: torch.dtype | None):
    """The stream, unchanged, recording each tensor's digest as written (cast to the sync dtype,
    as the HF writer does)."""
    from .vllm_worker import tensor_digest

    for name, t in named_tensors:
        into[name] = tensor_digest(t.to(dtype) if dtype is not None else t)
        yield name, t


def check_digests(url: str, results: list, sent: dict[str, list[float]], version: int) -> int:
    """Compare every worker's digests with the trainer's; one WeightMismatchError line naming the
    first tensor that differs, is missing or is extra, and the server. Returns tensors checked."""
    for w, res in enumerate(results):
        got = res.get("digests")
        if not isinstance(got, dict):
            raise EngineProtocolError(f"vLLM server {url}: worker {w} sent no digests for weight version {version} "
                                      "(is its worker extension this project's?)")
        missing, extra = sorted(set(sent) - set(got)), sorted(set(got) - set(sent))
        if missing or extra:
            what = f"never read {missing[0]}" if missing else f"read {extra[0]}, which the trainer did not write"
            raise WeightMismatchError(f"weight version {version} on vLLM server {url} (worker {w}): it {what} "
                                      f"({len(missing)} missing, {len(extra)} extra)")
        for name, (s, ss) in sent.items():
            gs, gss = got[name]
            if not (math.isclose(gs, s, rel_tol=DIGEST_RTOL, abs_tol=1e-9) and
                    math.isclose(gss, ss, rel_tol=DIGEST_RTOL, abs_tol=1e-9)):
                raise WeightMismatchError(
                    f"weight version {version} on vLLM server {url} (worker {w}): {name} differs from the trainer's "
                    f"(sum {gs:.9g} vs {s:.9g}, sum of squares {gss:.9g} vs {ss:.9g})")
    return len(sent)


def _cfg_dict(cfg: Any) -> dict:
    from dataclasses import asdict, is_dataclass

    if cfg is None:
        return {}
    return asdict(cfg) if is_dataclass(cfg) else dict(cfg)


def _defaults() -> dict:
    from gspo_megatron.config import VLLMConfig

    # + "api_key": the key itself (not a config field; the config names its variable, api_key_env):
    # what a caller holding one passes in-process (colocated or test servers)
    return {**_cfg_dict(VLLMConfig()), "api_key": None}


def _response_cap(method: str, path: str, payload: Any) -> int | None:
    """Byte cap of the answer to a generate request (n choices of at most max_tokens tokens, and
    with a probe's prompt_logprobs a dict per prompt token); a weight reload's (per worker, a
    digest per tensor with rollout.verify_weights: ~100 bytes each, tens of thousands of tensors
    for the largest MoE models) 256 MiB; None (the client's default) for the other routes."""
    if path == "/collective_rpc":
        return 256 << 20
    if path != GENERATE or not isinstance(payload, dict) or not isinstance(payload.get("sampling_params"), dict):
        return None
    sp = payload["sampling_params"]
    cap = generate_response_cap(int(sp.get("n") or 1), int(sp.get("max_tokens") or 1))
    if sp.get("prompt_logprobs") is not None:  # a probe (probe_logprobs): a log-prob dict per prompt token
        cap += 256 * len(payload.get("token_ids") or ())
    return cap


def _version_of(label: Any, fallback: int) -> int:
    """Our versions are decimal strings; a server's own "default" label means: what it loaded at start."""
    try:
        return int(str(label))
    except (TypeError, ValueError):
        return fallback


class VLLMEngine(HTTPEngine):
    """cfg: the ``rollout.vllm`` fields (VLLMConfig or dict). hf_config: the policy's HF config dict
    (written as config.json with every push). sync_dtype: dtype of the pushed tensors (default:
    as given). server_env / log_dir: of a launched server. weight_version: what the servers hold at
    start when known. vocab_size: bound of every returned token id (default: hf_config's; unknown:
    ids are checked for >= 0 only)."""

    # the shared HTTP engine's settings (rollout/http_engine.py): GET /version, GET /weight_info
    NAME, CONFIG, VERSION_PATH, WEIGHT_VERSION_PATH = "vLLM", "rollout.vllm", "/version", "/weight_info"
    SPOKEN_VERSION, API_MODULE, VERSION_ERROR = VLLM_VERSION, "rollout/vllm_api.py", VLLMVersionError
    version_matches = staticmethod(version_matches)
    CLIENT = ServerClient

    @property
    def ready_timeout_s(self) -> float:
        return float(self.cfg["ready_timeout_s"])

    @property
    def workers(self) -> list[ServerClient]:
        return self.servers

    @property
    def capabilities(self):
        # lost servers are brought back with the last weights (rollout/supervision.py) where the
        # weights can be re-sent: disk sync (its last version directory)
        import dataclasses

        return dataclasses.replace(super().capabilities, supervised_restarts=self._nccl is None,
                                   lora_targets=self._lora_groups)

    supports_interrupt = True
    # disk sync: the worker extension digests every tensor it reads (vllm_worker.py); the NCCL
    # transfer has no such hook, so those pushes are checked by the log-prob probe alone
    @property
    def supports_weight_digests(self) -> bool:
        return self._nccl is None

    def __init__(self, cfg: Any = None, *, hf_config: dict | None = None, sync_dtype: torch.dtype | None = None,
                 server_env: dict[str, str] | None = None, log_dir: str | None = None, weight_version: int = 0,
                 retry_backoff_s: float = 0.5, wait_ready: bool = True, nccl_backend=None,
                 sync_device: torch.device | str | None = None, tokenizer=None, vocab_size: int | None = None,
                 lora: dict | None = None, **overrides):
        c = _defaults()
        c.update(_cfg_dict(cfg))
        unknown = sorted(set(overrides) - set(c))
        if unknown:
            raise TypeError(f"VLLMEngine: unknown option(s) {unknown}; rollout.vllm fields are {sorted(c)}")
        c.update(overrides)
        if bool(c["urls"]) + bool(c["launch"]) + bool(c.get("urls_file")) != 1:
            raise ValueError("VLLMEngine: give one of urls (running servers), urls_file (a file listing them, "
                             "watched) or launch=true")
        self.cfg = c
        self.tokenizer = tokenizer  # for stop strings (agents' session.generate(stop=...)), matched here
        self.hf_config = dict(hf_config) if hf_config else None
        self.vocab_size = int(vocab_size) if vocab_size is not None else vocab_size_of(self.hf_config)
        self.sync_dtype = sync_dtype
        self.concurrency = int(c["concurrency"])
        self.max_retries = int(c["max_retries"])
        self.request_timeout_s = float(c["request_timeout_s"])
        self.retry_backoff_s = float(retry_backoff_s)
        self._weight_version = int(weight_version)
        self._synced = False
        self._inconsistent: str | None = None
        self._interrupted = threading.Event()
        self._lock = threading.Lock()
        self._written: list[str] = []
        self._closed = False
        # LoRA adapters on their own (rollout/lora_push.py): `lora` = {"rank", "groups"} of the
        # trainer's policy; served for the groups the model family says vLLM takes as LoRA
        # (ModelFamily.vllm_lora_modules), with disk sync (the adapter folder sits beside the
        # version folders)
        self._lora_rank = int(lora["rank"]) if lora else 0
        served = _lora_modules(self.hf_config) if lora and c["weight_sync"] == "disk" else {}
        self._lora_groups = tuple(g for g in lora.get("groups", ()) if g in served) if lora else ()
        self._lora_modules = [m for g in self._lora_groups for m in served[g]]
        self._adapter: tuple[str, int] | None = None  # (folder, modules bound) of the adapter served
        self.metrics: dict[str, float] = {"requests": 0, "retries": 0, "weight_syncs": 0, "last_sync_s": 0.0,
                                          "interrupted_rows": 0, "rejected": 0}
        self.procs = None
        self._nccl = None
        self.metrics["restarts"] = 0
        if c["weight_sync"] not in ("disk", "nccl"):
            raise ValueError(f"VLLMEngine: weight_sync must be disk or nccl, got {c['weight_sync']!r}")
        if c["weight_sync"] == "nccl" and nccl_backend is None and not torch.cuda.is_available():
            raise EngineError("rollout.vllm.weight_sync=nccl needs a CUDA device on trainer rank 0 (vLLM's NCCL "
                              "weight transfer); on CPU use weight_sync=disk")
        api_key = c["api_key"] if c["api_key"] is not None else \
            secret_from_env(c["api_key_env"], "rollout.vllm.api_key_env")
        try:
            if c["launch"]:
                model = c["model_path"]
                if not model:
                    raise ValueError("VLLMEngine launch=true needs model_path")
                api_key = api_key or secrets.token_hex(16)
                cmd = list(c["server_command"]) or None
                python = "python3"
                if cmd is None:
                    from .vllm_env import default_dir, is_ready, venv_python

                    if not is_ready(default_dir()):
                        raise EngineError(f"no vLLM environment at {default_dir()}: build it with `python -m "
                                          "gspo_megatron.rollout.vllm_env` or set rollout.vllm.server_command")
                    python = venv_python(default_dir())
                replicas = int(c["replicas"])
                if c.get("replicas_file"):  # its number, when the file exists, replaces replicas
                    replicas = self._replicas_from_file(c["replicas_file"], replicas, int(c["max_replicas"]))
                extra = list(c["extra_args"] or [])
                if self._lora_groups:  # LoRA on the modules of those groups only, loadable at run time
                    extra += lora_server_args(self._lora_rank, self._lora_modules)
                    server_env = {**(server_env or {}), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
                spec = VLLMLaunchSpec(model_path=model, port=int(c["port"]), host=c["host"], api_key=api_key,
                                      dtype=c["dtype"], max_model_len=c["max_model_len"],
                                      cpu_kv_cache_mb=c["cpu_kv_cache_mb"], extra_args=extra,
                                      command=cmd, python=python, env=server_env, log_dir=log_dir,
                                      env_vars=tuple(c["env_vars"]),
                                      weight_transfer="nccl" if c["weight_sync"] == "nccl" else None,
                                      trainer_dtype=self.sync_dtype, gpus=list(c.get("gpus") or []),
                                      num_servers=replicas)
                self.procs = launch(spec)
                urls = self.procs.urls
            elif c.get("urls_file"):
                urls = self._urls_from_file(c["urls_file"])
            else:
                urls = list(c["urls"])
            self._client_kw = dict(api_key=api_key, timeout_s=self.request_timeout_s, max_retries=self.max_retries,
                                   backoff_s=self.retry_backoff_s, response_cap=_response_cap)
            self._set_servers([self._make_client(u) for u in urls])
            if c["weight_sync"] == "nccl":
                from .vllm_nccl import NcclWeightSync

                device = torch.device(sync_device) if sync_device is not None else torch.device(
                    "cuda", torch.cuda.current_device())
                self._nccl = NcclWeightSync(self.servers, device=device, timeout_s=self.request_timeout_s,
                                            backend=nccl_backend)
            if wait_ready:
                self.wait_ready()
                self.check_version(strict=bool(c["check_version"]))
                if self._lora_groups and not c["launch"] and not all(self._serves_lora(s) for s in self.servers):
                    log.info("vLLM servers %s have no LoRA-enabled module (started without --enable-lora): the "
                             "adapters are pushed merged into their weights", [s.url for s in self.servers])
                    self._lora_groups = ()
            # every server health-checked; a lost one restarted (launched) or waited for (urls) and
            # re-synced, at most max_restarts times (0: a dead server fails the run fast)
            self._supervise(restarts_default(c), float(c["health_interval_s"]), float(c["lost_timeout_s"]))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, config, *, hf_config: dict | None = None, **kw) -> "VLLMEngine":
        """From the trainer's whole Config: model_path defaults to model.hf_dir, shared_dir to
        <out_dir>/weight_sync, the pushed dtype to model.dtype; hf_config: the run's architecture."""
        from gspo_megatron.model.factory import parse_dtype

        v = _cfg_dict(config.rollout.vllm)
        if v.get("model_path") is None:
            v["model_path"] = config.model.hf_dir
        if v.get("shared_dir") is None:
            v["shared_dir"] = os.path.join(config.out_dir, "weight_sync")
        kw.setdefault("log_dir", os.path.join(config.out_dir, "vllm_logs"))
        kw.setdefault("sync_dtype", parse_dtype(config.model.dtype))
        if config.lora.rank:
            kw.setdefault("lora", {"rank": config.lora.rank, "groups": list(config.lora.target_modules)})
        return cls(v, hf_config=hf_config, **kw)

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> int:
        return self._weight_version

    def interrupt(self) -> None:
        self._interrupted.set()
        for s in self.servers:  # in-flight requests return their tokens so far (finish_reason abort)
            try:
                s.post("/pause?mode=abort", {}, timeout_s=30, retries=1, expect_json=False)
            except EngineError as e:
                log.warning("vLLM server %s: pause failed: %s", s.url, e)

    def resume(self) -> None:
        self._interrupted.clear()
        for s in self.servers:
            s.post("/resume", {}, timeout_s=30, retries=1, expect_json=False)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, *,
                 seed: int | None = None) -> list[Sample]:
        self._check_open()
        self._refresh_members()  # servers that joined or left the urls_file
        if self._inconsistent is not None:
            raise EngineError(f"vLLM servers hold different weights after a failed push ({self._inconsistent}); "
                              "push a complete update first")
        check_generate_args(prompts, n, sampling)
        if sampling.top_p != 1.0 or sampling.top_k != -1:
            raise ValueError("VLLMEngine: top_p must be 1 and top_k -1 (vLLM reports log-probs renormalised "
                             "over the truncated distribution)")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("VLLMEngine: stop strings need a tokenizer (pass tokenizer=)")
        if not prompts:
            return []
        sp = {"n": n, "temperature": sampling.temperature, "top_p": 1.0, "top_k": -1,
              "max_tokens": sampling.max_new_tokens, "stop_token_ids": list(sampling.stop_token_ids),
              "logprobs": 0, "detokenize": False}
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts)), thread_name_prefix="vllm-gen") as pool:
            futs = [pool.submit(self._run_group, gi, [int(t) for t in p], n,
                                dict(sp, seed=None if seed is None else (seed * 1000003 + gi) % (2 ** 31)))
                    for gi, p in enumerate(prompts)]
            out = [s for f in futs for s in f.result()]
        if sampling.stop:  # the route generates token ids without detokenizing: stop strings are cut here
            out = [cut_at_stop_string(s, self.tokenizer, tuple(sampling.stop)) for s in out]
        return out

    def _probe_rows(self, server: ServerClient, ids: list[int]) -> Any:
        """The probe (HTTPEngine.probe_logprobs) as vLLM answers it: the prompt log-probs of `ids`
        (sampling_params.prompt_logprobs=0: the given token's own; the answer's prompt_logprobs
        holds None for the first token and a {token id: {logprob, ...}} dict for every later one,
        token_in_token_out/protocol.py:507; -inf is clamped to -9999, serving.py:498)."""
        sp = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 1, "logprobs": 0,
              "prompt_logprobs": 0, "detokenize": False, "seed": 0}
        body = self._with_adapter({"request_id": uuid.uuid4().hex, "token_ids": ids, "sampling_params": sp})
        r = server.post(GENERATE, body, timeout_s=self.request_timeout_s, retries=self.max_retries)
        return r.get("prompt_logprobs") if isinstance(r, dict) else r

    def _with_adapter(self, body: dict) -> dict:
        """A generate request body, served with the pushed LoRA adapter once there is one."""
        if self._adapter is not None:
            body["model"] = LORA_NAME
        return body

    def _probe_logprob(self, server: ServerClient, row: Any, token: int) -> float:
        got = row.get(str(int(token))) if isinstance(row, dict) else None
        if not isinstance(got, dict) or not isinstance(got.get("logprob"), (int, float)):
            raise EngineProtocolError(f"vLLM server {server.url}: prompt_logprobs lack token {token}: {str(row)[:200]}")
        return float(got["logprob"])

    def _empty_rows(self, gi: int, prompt: list[int], n: int) -> list[Sample]:
        self._inc("interrupted_rows", n)
        return [Sample(gi, list(prompt), [], [], "abort", self._weight_version, text="") for _ in range(n)]

    def _run_group(self, gi: int, prompt: list[int], n: int, sp: dict) -> list[Sample]:
        """_attempts, and with a supervisor a fresh budget of attempts after each restart of a
        server that happened during them (restarts are bounded: rollout.vllm.max_restarts)."""
        while True:
            restarts = self.metrics.get("restarts", 0)
            try:
                return self._attempts(gi, prompt, n, sp)
            except EngineServerError:
                sup = self._supervisor
                if sup is None or sup.failed is not None or self.metrics.get("restarts", 0) == restarts:
                    raise
                log.warning("vLLM %s for prompt %d: sent again after the server restart", GENERATE, gi)

    def _attempts(self, gi: int, prompt: list[int], n: int, sp: dict) -> list[Sample]:
        last: BaseException | None = None
        for attempt in range(self.max_retries + 1):
            if self._interrupted.is_set():
                return self._empty_rows(gi, prompt, n)
            if attempt:
                self._inc("retries")
                log.warning("vLLM %s for prompt %d: retry %d of %d after %s", GENERATE, gi, attempt, self.max_retries,
                            str(last).splitlines()[0] if str(last) else type(last).__name__)
                time.sleep(self.servers[0].backoff(attempt))
            # not to a server being brought back (all of them: waited for, bounded)
            server = min(self._in_service(), key=lambda s: s.inflight)
            self._inc("requests")
            body = self._with_adapter({"request_id": uuid.uuid4().hex, "token_ids": prompt, "sampling_params": sp})
            try:
                status, data = server.request_once("POST", GENERATE, body, timeout_s=self.request_timeout_s)
            except RetryableHTTPError as e:
                last = e
                self._settle(server)  # dead or alive? let its health checks say, then retry
                continue
            if status >= 500:
                last = EngineServerError(f"vLLM server {server.url}: HTTP {status}: {data[:300]!r}", url=server.url,
                                         status=status)
                self._settle(server)
                continue
            if status != 200:
                raise EngineServerError(f"vLLM server {server.url}: POST {GENERATE} returned HTTP {status}: "
                                        f"{data[:300].decode('utf-8', 'replace')}", url=server.url, status=status)
            samples = self._parse(parse_json(data, server.url, GENERATE, "vLLM server"), gi, prompt, n, server.url)
            bad = {}
            for r, s in enumerate(samples):
                why = check_response(s.response_ids, s.response_logprobs, max_new_tokens=int(sp["max_tokens"]),
                                     vocab_size=self.vocab_size)
                if why is not None:
                    bad[r] = f"vLLM server {server.url}: {GENERATE} for prompt {gi}, choice {r}: {why}"
                    log.warning("%s", bad[r])
            if bad:
                if attempt < self.max_retries:  # retried like a failed request
                    last = EngineServerError(next(iter(bad.values())), url=server.url)
                    continue
                self._inc("rejected", len(bad))
                log.warning("vLLM %s for prompt %d: %d of %d choice(s) rejected after %d attempt(s): %s", GENERATE, gi,
                            len(bad), n, self.max_retries + 1, next(iter(bad.values())))
                return [rejected_sample(s, bad[r]) if r in bad else s for r, s in enumerate(samples)]
            if any(s.finish_reason == "abort" for s in samples):
                if self._interrupted.is_set():  # partial rows, continued after the push
                    self._inc("interrupted_rows", sum(s.finish_reason == "abort" for s in samples))
                    return samples
                last = EngineServerError(f"vLLM server {server.url} aborted the request", url=server.url)
                continue
            return samples
        raise EngineServerError(f"vLLM POST {GENERATE} for prompt {gi} failed after {self.max_retries + 1} "
                                f"attempt(s); last error: {last}") from last

    def _parse(self, body: Any, gi: int, prompt: list[int], n: int, url: str) -> list[Sample]:
        def bad(msg: str) -> EngineProtocolError:
            return EngineProtocolError(f"vLLM server {url}: {GENERATE} answered {msg}: {str(body)[:300]}")

        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n:
            raise bad(f"{len(choices) if isinstance(choices, list) else 'no'} choices for n={n}")
        out = []
        if not all(isinstance(c, dict) for c in choices):
            raise bad("a choice that is not an object")
        for ch in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c.get("index", 0), int) else 0):
            ids = ch.get("token_ids")
            logprobs = ch.get("logprobs")
            content = logprobs.get("content") if isinstance(logprobs, dict) else None
            if not isinstance(ids, list) or not isinstance(content, list) \
                    or not all(isinstance(c, dict) and "logprob" in c for c in content):
                raise bad("a choice without token_ids and logprobs.content entries")
            # Counts, id ranges and values are the boundary check's (rollout/validate.py: a violating
            # choice is retried, then rejected); what is checked here is that the log-probs are the
            # sampled tokens' at all. A null log-prob is kept for that check (NaN / inf as null).
            if any(c.get("token_id") != t for c, t in zip(content, ids)):
                raise bad("log-probs of other tokens than the sampled ones")
            lps = [c["logprob"] if c["logprob"] is None or isinstance(c["logprob"], bool)
                   or not isinstance(c["logprob"], (int, float)) else float(c["logprob"]) for c in content]
            reason = ch.get("finish_reason")
            if reason not in ("stop", "length", "abort"):
                raise bad(f"finish_reason {reason!r}")
            spans = ch.get("weight_versions") or []
            try:
                versions = [(_version_of(s.get("version"), self._weight_version), int(s.get("start", 0)),
                             int(s.get("end", 0))) for s in spans]
            except (AttributeError, TypeError, ValueError):
                raise bad(f"weight_versions {spans!r:.200} are not [{{version, start, end}}, ...]") from None
            token_versions = None
            if len({v for v, _, _ in versions}) > 1:
                token_versions = [self._weight_version] * len(ids)
                for v, a, b in versions:
                    token_versions[a:b] = [v] * max(0, min(b, len(ids)) - a)
            version = min((v for v, _, _ in versions), default=self._weight_version)
            out.append(Sample(gi, list(prompt), list(ids), lps, reason, version,
                              token_versions=token_versions, meta={"server": url}))
        return out

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None, adapter=None) -> None:
        """disk: write the tensors once as <shared_dir>/v<version>, then every server reloads them in
        place (paused meanwhile: /pause?mode=wait lets the requests in flight finish first) and
        labels its weights `version`. nccl: broadcast them to every server worker
        (rollout/vllm_nccl.py), same pause and label. `adapter`: a rollout/lora_push.py AdapterPush
        for the groups in capabilities.lora_targets, written as a PEFT folder <shared_dir>/lora-v<version>
        and loaded by every server after its weights, before the label (_load_adapter)."""
        self._update(named_tensors, version, "wait", adapter)

    @property
    def supports_push_mid_generation(self) -> bool:
        return bool(self.cfg["push_mid_generation"])

    def update_weights_mid_generation(self, named_tensors: NamedTensors, version: int | None = None,
                                      adapter=None) -> None:
        """update_weights without waiting for the requests in flight (rollout.vllm.push_mid_generation):
        every server pauses with mode=keep (the scheduler stops stepping and freezes its requests;
        /pause returns without waiting for them), reloads, labels the new version and resumes; the
        frozen requests continue under the new weights and their answers say which version produced
        which tokens (weight_versions spans: Sample.token_versions).

        Their prefixes are recomputed with the new weights, as SGLang's retract pause does: the
        route's clear_cache (default true; its docstring says "ignored when mode=keep", but vLLM
        0.32's engine core finishes every pause with _finish_pause(clear_cache), v1/engine/core.py
        :2097, whose _reset_caches preempts the running requests and drops their KV cache,
        core.py:906 -> v1/core/sched/scheduler.py:2858). tests/test_vllm_contract.py reads that
        source; tests/test_vllm.py measures the continued tokens at the new weights' log-probs."""
        self._update(named_tensors, version, "keep", adapter)

    def _update(self, named_tensors: NamedTensors, version: int | None, pause: str, adapter=None) -> None:
        self._check_open()
        version = self._weight_version + 1 if version is None else int(version)
        if adapter is not None and set(adapter.groups) - set(self._lora_groups):
            raise ValueError(f"VLLMEngine: adapters of {sorted(set(adapter.groups) - set(self._lora_groups))} pushed on "
                             f"their own; this engine takes {list(self._lora_groups)} (capabilities.lora_targets)")
        if self._supervisor is not None:
            self._supervisor.wait_all_healthy()
        with self._pushing_weights():
            self._push(named_tensors, version, pause, adapter)

    def _push(self, named_tensors: NamedTensors, version: int, pause: str = "wait", adapter=None) -> None:
        from .weight_sync import prune_versions, version_dir

        if self._nccl is not None:
            t0 = time.perf_counter()
            try:
                self._nccl.push(named_tensors, version, dtype=self.sync_dtype, resume=not self._interrupted.is_set(),
                                pause=pause)
            except BaseException as e:
                self._inconsistent = f"NCCL push of version {version} failed: {str(e).splitlines()[0] if str(e) else e!r}"
                raise
            self._inconsistent = None
            self._weight_version = version
            self._synced = True
            self._inc("weight_syncs")
            self.metrics["last_sync_s"] = time.perf_counter() - t0
            return
        shared = self.cfg["shared_dir"]
        if not shared:
            raise ValueError("VLLMEngine weight_sync=disk needs shared_dir (visible to trainer and servers)")
        if not self.hf_config:
            raise ValueError("VLLMEngine weight_sync=disk needs hf_config (written as the servers' config.json)")
        t0 = time.perf_counter()
        path = version_dir(os.path.abspath(shared), version)
        verify = bool(self.digest_next_push)
        sent: dict[str, list[float]] = {}
        if verify:
            named_tensors = _tee_digests(named_tensors, sent, self.sync_dtype)
        self._write_push(named_tensors, path)
        kwargs = {"weights_dir": path, **({"digests": True} if verify else {})}
        served = None
        if adapter is not None:  # beside the version folder, a new path per version (vllm_api.LOAD_LORA)
            folder = adapter.save(os.path.join(os.path.abspath(shared), f"lora-v{version}"), self.cfg["model_path"])
            served = (folder, lora_bound_modules(adapter.tensors))
        done = []
        try:
            for s in self.servers:
                for tries in range(2):
                    try:
                        self._reload_on(s, kwargs, verify, sent, version, pause, served)
                        break
                    except EngineServerError:
                        # a supervised server that died under the push: once it is back (restarted
                        # with the previous version's weights), push this version to it again
                        if self._supervisor is None or tries:
                            raise
                        restarts = self.metrics.get("restarts", 0)
                        self._supervisor.settle(s)
                        if self.metrics.get("restarts", 0) == restarts:
                            raise
                done.append(s.url)
        except BaseException as e:
            if done or len(self.servers) > 1:
                self._inconsistent = f"pushed to {done or 'none'}, failed at another server: {e}"
            raise
        self._inconsistent = None
        self._written.append(path)
        self._written = self._written[-1:]
        prune_versions(os.path.abspath(shared), self._written)
        if served is not None or self._adapter is not None:
            self._adapter = served
            _prune_adapters(os.path.abspath(shared), served[0] if served else None)
        self._weight_version = version
        self._synced = True
        self._inc("weight_syncs")
        self.metrics["last_sync_s"] = time.perf_counter() - t0

    def _reload_on(self, s: ServerClient, kwargs: dict, verify: bool, sent: dict, version: int,
                   pause: str = "wait", adapter: tuple[str, int] | None = None) -> None:
        """One server of a disk push: pause (`pause`: wait for the requests in flight, or keep them
        frozen), reload from the version directory (digests checked before the version is labelled
        and served), load the adapter (its bound modules checked), label, resume."""
        s.post(f"/pause?mode={pause}", {}, timeout_s=self.request_timeout_s, retries=1, expect_json=False)
        r = s.post("/collective_rpc", {"method": RELOAD_METHOD, "kwargs": kwargs},
                   timeout_s=self.request_timeout_s, retries=0)
        results = r.get("results") if isinstance(r, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(x, dict) for x in results):
            raise EngineProtocolError(f"vLLM server {s.url}: /collective_rpc {RELOAD_METHOD} answered {str(r)[:300]}")
        if verify:
            self.metrics["verified_tensors"] = check_digests(s.url, results, sent, version)
        if adapter is not None:
            self._load_adapter(s, adapter, version)
        s.post("/update_weight_version", {"new_version": str(version)}, timeout_s=60, retries=1, expect_json=False)
        if not self._interrupted.is_set():
            s.post("/resume", {}, timeout_s=60, retries=1, expect_json=False)

    @staticmethod
    def _serves_lora(s: ServerClient) -> bool:
        """Whether a running server (urls) has LoRA-enabled modules (vllm_worker.py gspo_lora_bound)."""
        r = s.post("/collective_rpc", {"method": LORA_BOUND_METHOD}, timeout_s=60, retries=1)
        results = r.get("results") if isinstance(r, dict) else None
        return isinstance(results, list) and bool(results) and all(
            isinstance(x, dict) and int(x.get("modules") or 0) > 0 for x in results)

    def _load_adapter(self, s: ServerClient, adapter: tuple[str, int], version: int) -> None:
        """Load the adapter folder in place under LORA_NAME, then ask every worker of the server
        how many modules it set weights on (vllm_worker.py gspo_lora_bound): a count unlike the
        modules the trainer's adapters stand on is one LoraBindError line naming the server."""
        folder, want = adapter
        s.post(LOAD_LORA, {"lora_name": LORA_NAME, "lora_path": folder, "load_inplace": True},
               timeout_s=self.request_timeout_s, retries=1, expect_json=False)
        r = s.post("/collective_rpc", {"method": LORA_BOUND_METHOD}, timeout_s=60, retries=1)
        results = r.get("results") if isinstance(r, dict) else None
        if not isinstance(results, list) or not results or not all(isinstance(x, dict) for x in results):
            raise EngineProtocolError(f"vLLM server {s.url}: /collective_rpc {LORA_BOUND_METHOD} answered {str(r)[:300]}")
        for worker, res in enumerate(results):
            counts = list((res.get("adapters") or {}).values())
            got = max(counts) if counts else 0
            if len(counts) > 1 or got != want:
                raise LoraBindError(f"vLLM server {s.url}: the LoRA adapter of weight version {version} bound to {got} "
                                    f"module(s) on worker {worker} (of {res.get('modules')} LoRA-enabled, "
                                    f"{len(counts)} adapter(s) loaded); the trainer's adapters stand on {want}: the "
                                    "server's --lora-target-modules or its model differ from the trainer's")
        self.metrics["lora_bound_modules"] = want
        self._inc("lora_bind_checks")

    def _write_push(self, named_tensors, path: str) -> None:
        """The disk push's files (one method, so that a test can corrupt what reaches the disk)."""
        from .weight_sync import _save_hf

        _save_hf(named_tensors, path, self.hf_config, self.sync_dtype, self.cfg["model_path"])

    # ------------------------------------------------------------------ misc
    # ------------------------------------------------------------------ supervision (rollout/supervision.py)
    def _resync_refusal(self) -> str | None:
        if self._nccl is not None and self._synced:
            return ("with rollout.vllm.weight_sync=nccl a restarted server cannot get the pushed weights back "
                    "(use weight_sync=disk for restarts)")
        return None

    def _resync_server(self, s: ServerClient) -> None:
        """A server back after a loss (or joining): the last pushed weights (their version
        directory, which the engine keeps), labelled with their version, before anything is sent to it."""
        if not self._written:
            return  # nothing pushed yet: it serves what it started from, as before
        r = s.post("/collective_rpc", {"method": RELOAD_METHOD, "kwargs": {"weights_dir": self._written[-1]}},
                   timeout_s=self.request_timeout_s, retries=1)
        if not isinstance(r, dict) or not r.get("results"):
            raise EngineProtocolError(f"vLLM server {s.url}: reload after the restart answered {str(r)[:200]}")
        if self._adapter is not None:
            self._load_adapter(s, self._adapter, self._weight_version)
        s.post("/update_weight_version", {"new_version": str(self._weight_version)}, timeout_s=60, retries=1,
               expect_json=False)


def _lora_modules(hf_config: dict | None) -> dict[str, tuple[str, ...]]:
    """The model family's groups vLLM serves as LoRA, with their modules; {} without a config."""
    if not hf_config:
        return {}
    from gspo_megatron.model.family import family_for

    fam = family_for(hf_config)
    return fam.vllm_lora_modules(fam.hf_config(dict(hf_config)))


def _prune_adapters(shared: str, keep: str | None) -> None:
    """Remove the adapter folders of earlier versions (lora-v<N> in `shared`), keeping `keep`."""
    import re
    import shutil

    for name in os.listdir(shared):
        path = os.path.join(shared, name)
        if re.fullmatch(r"lora-v\d+", name) and os.path.abspath(path) != (os.path.abspath(keep) if keep else None):
            shutil.rmtree(path, ignore_errors=True)
