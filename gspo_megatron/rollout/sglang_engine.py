"""Rollouts on SGLang servers over HTTP (the cluster engine).

Construction
    ``SGLangEngine(cfg, ...)`` with ``cfg`` the ``rollout.sglang`` section (`SGLangConfig` or a plain
    dict of its fields), or ``SGLangEngine.from_config(config)`` from the whole trainer `Config`
    (resolves ``model_path`` = model.hf_dir, ``shared_dir`` = <out_dir>/weight_sync, the HF config).
    Servers are either ``cfg.urls`` (already running; one URL may be an sglang-router, whose
    workers are then found with ``GET /list_workers`` or ``/workers``: generation goes through the
    router, weight sync / flush / abort go to every worker) or launched by us
    (``cfg.launch=true``: `sglang_server.ServerProcesses`, stopped by `close()`). The constructor
    waits for every server's ``/health_generate`` up to ``ready_timeout_s``.

Generation (`generate`)
    One ``POST /generate`` per prompt group: ``input_ids`` = the prompt repeated n times (SGLang's
    ``sampling_params.n`` exists too, but how its outputs of a batched request are ordered is an
    implementation detail; explicit rows keep the grouping exact, and the radix cache shares the
    prompt prefix anyway), ``sampling_params`` {temperature, top_p, top_k, max_new_tokens, stop,
    stop_token_ids, no_stop_trim: true, skip_special_tokens: true}, ``return_logprob: true``,
    ``rid`` per row. Response tokens and log-probs are read from
    ``meta_info.output_token_logprobs`` ([logprob, token_id, text] per generated token, the stop
    token included), ``meta_info.finish_reason.type`` and ``meta_info.weight_version``. Samples come
    back grouped per prompt in prompt order (base.py's contract).

    At most ``concurrency`` requests are in flight; each goes to the least-loaded server (ties
    round-robin) and has ``request_timeout_s`` as a deadline for the whole exchange, and a byte
    cap on the answer derived from the request (rollout/http_servers.py `generate_response_cap`,
    plus the routed experts' size with return_routing); connection errors, timeouts, HTTP 5xx and
    responses aborted by the server are retried ``max_retries`` times with exponential backoff
    (on another server when there is one), then `SGLangServerError` names the server. Malformed
    responses raise `SGLangProtocolError` at once.

    Every row is checked at the boundary (rollout/validate.py `check_response`): at most
    max_new_tokens tokens, ids in [0, vocab_size) (``vocab_size=``, default the HF config's),
    finite log-probs <= 0 (a null log-prob, how orjson writes NaN / inf, is one of those). A
    violating response is logged with its server and retried like a failed request; if the last
    attempt still violates, its violating rows come back as rejected samples (no tokens,
    ``meta["rejected"]`` the reason naming the server; validate.rejected_sample) and
    ``metrics["rejected"]`` counts them. generate() still returns n samples per prompt, in order.

    Over-sampling: ``generate(..., stop_after_groups=k)`` returns as soon as k groups are complete:
    requests not yet sent are dropped, ``POST /abort_request {"abort_all": true}`` goes to every
    server (repeated while answers are outstanding), and groups cut by the abort are discarded. The
    result holds every group that completed (>= k unless fewer prompts; a few more if they finished
    while the abort was on its way), in prompt order; ``Sample.prompt_index`` says which prompt.
    ``metrics["dropped_groups"]`` counts the groups left out (never sent, or aborted).

Routed experts (``return_routing=True``)
    Every /generate request also sets ``return_routed_experts: true`` (``routed_experts_start_len``
    stays 0: the whole sequence), and each sample's ``meta_info.routed_experts`` is decoded into
    ``Sample.routed_experts``: torch.int32 [P + R - 1, num_hidden_layers, num_experts_per_tok]
    (P prompt tokens, R response tokens as SGLang returned them; the engine trims nothing), the
    experts SGLang routed positions 0 .. P + R - 2 to: every token it fed through the model. The
    wire format (SGLang 0.5.23): standard base64 of the raw bytes of a C-order int32 array of
    shape [seqlen - 1 - start_len, L, k], seqlen = prompt + output tokens through the stop
    (scheduler_components/batch_result_processor.py `_maybe_collect_routed_experts`,
    state_capturer/base.py `get_topk`, detokenizer_manager.py `_b64_encode_per_request`). L and k
    come from the model's HF config (``text_config`` if it has one, as SGLang's hf_text_config).
    A payload whose size is not rows x L x k int32 values, or whose rows are not P + R - 1, is a
    `SGLangProtocolError` naming the server and the field. SGLang answers such requests WITHOUT
    the field unless the server was launched with ``--enable-return-routed-experts`` (launched
    servers get the flag); a missing field, or a worker whose ``/server_info`` reports
    ``enable_return_routed_experts: false`` (checked at construction), is a one-line
    `SGLangRoutingNotEnabledError`. Aborted rows carry no routing (they are retried or dropped).

Log-probs
    SGLang's ``output_token_logprobs`` are ``log_softmax(logits / T)`` of the sampled token, after
    temperature and before top-k / top-p / min-p filtering — the untruncated tempered distribution
    the trainer recomputes (and what `HFEngine` reports). This holds with SGLang's default sampler
    settings; the environment variable ``SGLANG_RETURN_ORIGINAL_LOGPROB`` must NOT be set on the
    servers (it switches to T = 1 log-probs); launched servers get it removed from their
    environment (`LaunchSpec.unset_env`). Greedy (T = 0) reports T = 1 log-probs, as HFEngine
    does. Logit penalties (repetition/frequency) would change the distribution: we never send them.

Weights (`update_weights(named_tensors, version)`)
    ``weight_sync`` = disk | distributed | tensor (see `weight_sync.py`), then ``POST /flush_cache``
    on every server, retried while requests are pending. ``version`` must exceed the current
    version; the trainer passes ``engine.weight_version + 1`` (or its step), so versions rise by one
    per update. Before the first rollout of a run (fresh or resumed) the trainer pushes its current
    weights: ``engine.update_weights(iter_hf_tensors(chunks, ctx, arch), version=step)`` on global
    rank 0, ``weight_sync.drain(iter_hf_tensors(...))`` on the other ranks. Until that first push,
    responses are not version-checked (the servers run whatever they loaded) and a warning says so.

Interrupting (partial rollouts, rollout/partial.py)
    ``interrupt()`` (from another thread) sets a flag and sends ``POST /abort_request {"abort_all":
    true}`` to every server; the trainer repeats it until it holds the engine, so a request that
    arrived after one abort meets the next. SGLang 0.5.23 answers a running request aborted this
    way with HTTP 200, the tokens and log-probs generated so far and finish_reason {"type":
    "abort", "status_code": null} (managers/scheduler.py `abort_request`: ``FINISH_ABORT()``;
    schedule_batch.py `FINISH_ABORT.to_json`). While the flag is set such rows are returned as
    partial samples (finish_reason "abort") instead of being retried, requests not yet sent are not
    sent (their rows come back empty), and an error answer counts as an empty partial row.
    ``resume()`` clears the flag. `/pause_generation` is not used: in its default "abort" mode a
    request that arrives after it waits inside the server until `/continue_generation`
    (tokenizer_manager.py `generate_request`, ``is_pause_cond``), which would deadlock a producer
    that holds the engine; "in_place" keeps the old KV cache, so the continued tokens' log-probs
    would not be any one policy's.

Stale versions
    After an update to version v, every response must carry ``weight_version == "v"``. Anything
    else means a server missed an update (restarted, or a sync went to the wrong place): with
    ``on_stale="error"`` (default) `SGLangStaleWeightsError` names the server and both versions;
    with ``on_stale="count"`` the samples are kept, tagged with the version they report, and
    ``metrics["stale_samples"]`` counts them. A server that reports no weight_version at all (an
    SGLang predating the field) cannot be checked: a warning, and ``metrics["unversioned_samples"]``.

Colocated memory
    `sleep()` flushes the cache and ``POST /release_memory_occupation`` (servers need
    ``--enable-memory-saver``); `wake(tags=None)` ``POST /resume_memory_occupation``. The trainer
    calls sleep() after a rollout and wake() before the next weight sync.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
import uuid
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Mapping

import torch

from gspo_megatron.errors import InputError

from .base import FINISH_REASONS, Capabilities, NamedTensors, RolloutEngine, Sample, SamplingParams, check_generate_args
from .http_engine import EngineVersionError, HTTPEngine
from .supervision import restarts_default
from .http_servers import generate_response_cap, loads_answer, secret_from_env
from .sglang_api import ROUTED_EXPERTS_FLAG, ROUTED_EXPERTS_SERVER_ARG, SGLANG_VERSION, version_matches
from .sglang_api import payload as api_payload
from .sglang_server import (
    LaunchSpec,
    RetryableHTTPError,
    SGLangError,
    SGLangNotReadyError,
    SGLangProtocolError,
    SGLangServerError,
    ServerClient,
    ServerProcesses,
    check_not_failed,
    local_address_towards,
    parse_json,
    wait_until_ready,
)
from .validate import check_response, rejected_sample, vocab_size_of
from .weight_sync import (
    WEIGHT_SYNC_MODES,
    DiskSync,
    DistributedSync,
    LoadedTogether,
    TensorSync,
    flush_cache,
    parse_dtype,
)

__all__ = [
    "SGLangEngine", "SGLangError", "SGLangServerError", "SGLangProtocolError", "SGLangNotReadyError",
    "SGLangStaleWeightsError", "SGLangRoutingNotEnabledError", "sampling_to_sglang", "routing_shape",
]

log = logging.getLogger("gspo_megatron.rollout")


class SGLangStaleWeightsError(SGLangError):
    pass


class SGLangVersionError(EngineVersionError, SGLangProtocolError):
    """The server reports another SGLang version than the one the engine speaks (one line)."""


class SGLangRoutingNotEnabledError(SGLangProtocolError, InputError):
    """return_routing asked for routed experts, but the server was launched without
    --enable-return-routed-experts (SGLang then silently omits them). Also an InputError: the
    entry points report it as one line."""


def routing_shape(hf_config: Mapping | None) -> tuple[int, int]:
    """(num_hidden_layers, num_experts_per_tok) of a model's HF config dict: the last two dims of
    SGLang's routed-experts array (RoutedExpertsCapturer reads them from hf_text_config,
    state_capturer/routed_experts.py)."""
    cfg = hf_config or {}
    if isinstance(cfg.get("text_config"), Mapping):
        cfg = cfg["text_config"]
    try:
        layers, top_k = int(cfg["num_hidden_layers"]), int(cfg["num_experts_per_tok"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("return_routing needs num_hidden_layers and num_experts_per_tok in the model's HF "
                         "config (hf_config= or <model_path>/config.json); "
                         f"got {'no config' if not hf_config else 'a config without them'}") from None
    if layers < 1 or top_k < 1:
        raise ValueError(f"return_routing: num_hidden_layers={layers}, num_experts_per_tok={top_k} must be >= 1")
    return layers, top_k


class _Aborted(Exception):
    """A group's request came back aborted after we asked for it (over-sampling)."""


def sampling_to_sglang(sp: SamplingParams) -> dict:
    """SamplingParams -> SGLang's sampling_params (greedy: temperature 0)."""
    greedy = sp.temperature <= 0 or sp.top_k == 1
    out = {
        "temperature": 0.0 if greedy else float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": int(sp.top_k) if sp.top_k > 0 else -1,
        "max_new_tokens": int(sp.max_new_tokens),
        "no_stop_trim": True,  # keep the stop token/string in the output (the trainer scores it)
        "skip_special_tokens": True,  # affects `text` only
    }
    if sp.stop:
        out["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in sp.stop_token_ids]
    return out


def _cfg_dict(cfg: Any) -> dict:
    if cfg is None:
        return {}
    if dataclasses.is_dataclass(cfg):
        return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    raise TypeError(f"SGLangEngine config must be an SGLangConfig or a dict, got {type(cfg).__name__}")


def _defaults() -> dict:
    from gspo_megatron.config import SGLangConfig  # the one place the fields and defaults live

    # + "api_key": the key itself (not a config field; the config names its variable, api_key_env):
    # what a caller holding one passes in-process (colocated servers' generated key, tests)
    return {**_cfg_dict(SGLangConfig()), "api_key": None}


_DEFAULTS = _defaults()


class SGLangEngine(HTTPEngine):
    """RolloutEngine over SGLang's HTTP API. See the module docstring for the semantics.

    cfg: the ``rollout.sglang`` fields (SGLangConfig or dict; missing keys take SGLangConfig's
        defaults).
    hf_config: the policy's HF config dict (disk sync writes it as config.json); default: read
        from ``<model_path>/config.json``.
    num_servers: servers to launch (launch mode); server i listens on port + i.
    server_module / server_command: what to launch instead of ``python -m sglang.launch_server``.
    server_env: extra environment of launched servers. log_dir: their logs (default: a temp dir).
    sync_dtype: cast floating weights to this dtype before sending (e.g. torch.bfloat16).
    sync_device: where tensors go for distributed/tensor sync (default cuda if available, else cpu).
    sync_master_address / sync_master_port / sync_backend / sync_group_name: the distributed
        weight-update group (defaults: the config's sync_address / sync_port, else the local
        address routing to the first server and a free port; nccl with CUDA else gloo,
        "gspo_weight_sync").
    on_stale: "error" | "count" (see the module docstring).
    weight_version: the version the servers hold at start, when known (0 = unknown).
    retry_backoff_s: first retry delay (doubles per retry, capped at 8 s).
    wait_ready: wait for /health_generate in the constructor (default True).
    return_routing: ask every /generate for the routed experts and fill Sample.routed_experts
        (see the module docstring); launched servers get --enable-return-routed-experts. Default:
        the config's ``return_routing`` if it has one, else False.
    vocab_size: the model's vocabulary size, the bound of every returned token id (default: the
        HF config's vocab_size; unknown: ids are checked for >= 0 only, with a warning).
    """

    # the shared HTTP engine's settings (rollout/http_engine.py): /server_info reports "version"
    # (http_server.py server_info), /model_info "weight_version" (there is no /get_weight_version)
    NAME, CONFIG, VERSION_PATH, WEIGHT_VERSION_PATH = "SGLang", "rollout.sglang", "/server_info", "/model_info"
    SPOKEN_VERSION, API_MODULE, VERSION_ERROR = SGLANG_VERSION, "rollout/sglang_api.py", SGLangVersionError
    version_matches = staticmethod(version_matches)
    CLIENT = ServerClient

    @property
    def capabilities(self) -> Capabilities:
        # memory release/resume (colocation: sleep/wake) and the routed experts of every token
        # (return_routed_experts, with the server flag) beside the supports_* flags
        # a lost server brought back with the last weights (rollout/supervision.py): disk sync only
        # No lora_targets: a LoRA policy's adapters reach SGLang merged into their weights. SGLang
        # 0.5.23 loads adapters (/load_lora_adapter), but its answer holds success, an error and
        # the adapter names only (managers/io_struct.py:2572-2580 LoRAUpdateOutput): nothing says
        # how many modules an adapter bound to, which every adapter push must check (issue 55).
        return dataclasses.replace(super().capabilities, sleep_wake=True, routing_return=True,
                                   supervised_restarts=self.cfg["weight_sync"] == "disk")

    def __init__(
        self,
        cfg: Any = None,
        *,
        hf_config: dict | None = None,
        num_servers: int = 1,
        server_module: str = "sglang.launch_server",
        server_command: list[str] | None = None,
        server_env: dict[str, str] | None = None,
        log_dir: str | None = None,
        sync_dtype: torch.dtype | str | None = None,
        sync_device: str | torch.device | None = None,
        sync_master_address: str | None = None,
        sync_master_port: int | None = None,
        sync_backend: str | None = None,
        sync_group_name: str = "gspo_weight_sync",
        on_stale: str = "error",
        weight_version: int = 0,
        retry_backoff_s: float = 0.5,
        wait_ready: bool = True,
        return_routing: bool | None = None,
        vocab_size: int | None = None,
        **overrides,
    ):
        c = dict(_DEFAULTS)
        c.update(_cfg_dict(cfg))
        unknown = sorted(set(overrides) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"SGLangEngine: unknown option(s) {unknown}; rollout.sglang fields are {sorted(_DEFAULTS)}")
        c.update(overrides)
        self.cfg = c
        if c["weight_sync"] not in WEIGHT_SYNC_MODES:
            raise ValueError(f"weight_sync must be one of {WEIGHT_SYNC_MODES}, got {c['weight_sync']!r}")
        if bool(c["urls"]) + bool(c["launch"]) + bool(c.get("urls_file")) != 1:
            raise ValueError("SGLangEngine: give one of urls (running servers), urls_file (a file listing them, "
                             "watched) or launch=true")
        if on_stale not in ("error", "count"):
            raise ValueError(f"on_stale must be 'error' or 'count', got {on_stale!r}")
        for k in ("concurrency", "bucket_mb"):
            if not c[k] or float(c[k]) <= 0 or (k == "concurrency" and int(c[k]) < 1):
                raise ValueError(f"{k} must be >= 1, got {c[k]!r}")
        self.on_stale = on_stale
        self.concurrency = int(c["concurrency"])
        self.max_retries = int(c["max_retries"])
        self.request_timeout_s = float(c["request_timeout_s"])
        self.ready_timeout_s = float(c["ready_timeout_s"])
        self.retry_backoff_s = float(retry_backoff_s)
        self.model_path = c["model_path"]
        self._hf_config = hf_config
        self._weight_version = int(weight_version)
        self._synced = False  # True after our first successful update_weights
        self._inconsistent: str | None = None
        self._pushing: int | None = None  # the version a mid-generation push is installing
        self._warned_unsynced = False
        self._warned_unversioned = False
        self._warned_vocab = False
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._interrupted = threading.Event()
        self._closed = False
        self._asleep = False  # memory released (sleep) and not yet re-taken (wake)
        self.metrics: dict[str, float] = {
            "restarts": 0, "requests": 0, "retries": 0, "dropped_groups": 0, "stale_samples": 0, "abort_calls": 0,
            "weight_syncs": 0, "last_sync_s": 0.0, "last_sync_bytes": 0, "flush_attempts": 0,
            "unversioned_samples": 0, "interrupted_rows": 0, "rejected": 0,
        }
        self.procs: ServerProcesses | None = None
        self._syncer = None
        self.sync_dtype = parse_dtype(sync_dtype) if sync_dtype is not None else None
        self.sync_device = torch.device(sync_device) if sync_device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        self.sync_backend = sync_backend or ("nccl" if self.sync_device.type == "cuda" else "gloo")
        self.sync_group_name = sync_group_name
        # keywords first, then rollout.sglang.sync_address / sync_port (null / 0: picked at run time)
        self._sync_master_address = sync_master_address or c.get("sync_address") or None
        self._sync_master_port = sync_master_port or int(c.get("sync_port") or 0) or None
        if return_routing is None:
            return_routing = bool(c.get("return_routing", False))
        self.return_routing = bool(return_routing)
        # (num_hidden_layers, num_experts_per_tok): checked before any server is started
        self.routing_shape: tuple[int, int] | None = routing_shape(self.hf_config) if self.return_routing else None
        # the bound of returned token ids (rollout/validate.py); None: warned at the first generate
        self.vocab_size = int(vocab_size) if vocab_size is not None else vocab_size_of(self.hf_config)

        api_key = c["api_key"] if c["api_key"] is not None else \
            secret_from_env(c["api_key_env"], "rollout.sglang.api_key_env")
        try:
            if c["launch"]:
                if not self.model_path:
                    raise ValueError("SGLangEngine launch=true needs model_path")
                env = dict(server_env or {})
                if "SGLANG_RETURN_ORIGINAL_LOGPROB" in env:
                    raise ValueError("server_env must not set SGLANG_RETURN_ORIGINAL_LOGPROB (SGLang would "
                                     "then report T=1 log-probs, not the tempered ones the trainer uses)")
                spec = LaunchSpec(
                    model_path=self.model_path, tp=int(c["tp"]), dp=int(c["dp"]), ep=int(c["ep"]),
                    mem_fraction=float(c["mem_fraction"]), port=int(c["port"]), host=c["host"],
                    api_key=api_key, env_vars=tuple(c["env_vars"]), extra_args=list(c["extra_args"] or []),
                    num_servers=num_servers, module=server_module, command=server_command,
                    env=env, log_dir=log_dir, return_routed_experts=self.return_routing,
                )
                self.procs = ServerProcesses(spec)
                urls = self.procs.start()
            elif c.get("urls_file"):
                urls = self._urls_from_file(c["urls_file"])
            else:
                urls = list(c["urls"])
            self._client_kw = dict(api_key=api_key, timeout_s=self.request_timeout_s, max_retries=self.max_retries,
                                   backoff_s=self.retry_backoff_s, response_cap=self._response_cap)
            self._set_servers([self._make_client(u) for u in urls])
            if wait_ready:
                self.wait_ready()
            # one URL may be an sglang-router: generation via it, control to its workers
            if len(self.servers) == 1 and c["urls"]:
                workers = self._router_workers(self.servers[0])
                if workers:
                    self.workers = [self._make_client(u) for u in workers]
                    if wait_ready:
                        wait_until_ready(self.workers, self.ready_timeout_s)
            if wait_ready:
                self.check_version(strict=bool(c.get("check_version", True)))
            if self.return_routing and wait_ready:
                self.check_routing_enabled()
            if wait_ready:  # every worker health-checked; a lost one restarted or waited for, and re-synced
                self._supervise(restarts_default(c), float(c["health_interval_s"]), float(c["lost_timeout_s"]))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_config(cls, config, *, sglang_overrides: dict | None = None, **kw) -> "SGLangEngine":
        """From the trainer's whole `Config`: model_path defaults to model.hf_dir, shared_dir to
        <out_dir>/weight_sync, the HF config (kw hf_config: the trainer passes the run's resolved
        architecture, whatever its source) to hf_dir/config.json or model.hf_config,
        return_routing to config.engine_routing / rollout.return_routing (when the config has them).
        `sglang_overrides`: fields of rollout.sglang replaced for this engine only (colocated
        servers: their urls and key; a frozen config re-validated with launch=false would refuse
        the weight_sync=tensor that colocation needs)."""
        s = _cfg_dict(config.rollout.sglang)
        s.update(sglang_overrides or {})
        if s.get("model_path") is None:
            s["model_path"] = config.model.hf_dir
        if s.get("shared_dir") is None:
            s["shared_dir"] = os.path.join(config.out_dir, "weight_sync")
        if "hf_config" not in kw:
            hf = None
            if config.model.hf_dir and os.path.isfile(os.path.join(config.model.hf_dir, "config.json")):
                with open(os.path.join(config.model.hf_dir, "config.json")) as f:
                    hf = json.load(f)
            elif config.model.hf_config:
                from gspo_megatron.model.family import family_for

                hf = family_for(config.model.hf_config).hf_config(dict(config.model.hf_config))
            kw["hf_config"] = hf
        kw.setdefault("sync_dtype", getattr(config.model, "dtype", None))
        # Config.engine_routing (rollout.return_routing, or routing replay of the rollout's experts)
        # when the config has it, else rollout.return_routing, else off
        routing = getattr(config, "engine_routing", None)
        if routing is None:
            routing = getattr(config.rollout, "return_routing", False)
        kw.setdefault("return_routing", bool(routing))
        return cls(s, **kw)

    def check_routing_enabled(self) -> None:
        """Fail with one line if a worker's GET /server_info reports enable_return_routed_experts
        false (SGLang 0.5.23 reports every server argument there, srt/utils/common.py
        build_server_info). A worker that does not answer, or does not report the field, is
        left to the per-response check."""
        for s in self.workers:
            try:
                info = s.get("/server_info", timeout_s=30, retries=1)
            except SGLangError:
                continue
            if isinstance(info, dict) and ROUTED_EXPERTS_SERVER_ARG in info and not info[ROUTED_EXPERTS_SERVER_ARG]:
                raise SGLangRoutingNotEnabledError(
                    f"SGLang server {s.url} reports {ROUTED_EXPERTS_SERVER_ARG}=false (/server_info): "
                    f"return_routing needs servers launched with {ROUTED_EXPERTS_FLAG}")

    @staticmethod
    def _router_workers(server: ServerClient) -> list[str]:
        for path, key in (("/list_workers", "urls"), ("/workers", "workers")):
            try:
                status, data = server.request_once("GET", path, timeout_s=10)
            except RetryableHTTPError:
                continue
            if status != 200:
                continue
            try:
                body = loads_answer(data)
            except ValueError:
                continue
            items = body.get(key) if isinstance(body, dict) else None
            if isinstance(items, list) and items:
                return [i["url"] if isinstance(i, dict) else str(i) for i in items]
        return []

    @property
    def hf_config(self) -> dict | None:
        if self._hf_config is None and self.model_path:
            p = os.path.join(self.model_path, "config.json")
            if os.path.isfile(p):
                with open(p) as f:
                    self._hf_config = json.load(f)
        return self._hf_config

    # ------------------------------------------------------------------ RolloutEngine
    @property
    def weight_version(self) -> int:
        return self._weight_version

    supports_interrupt = True

    def interrupt(self) -> None:
        self._interrupted.set()
        self._abort_all()

    def resume(self) -> None:
        self._interrupted.clear()

    def _empty_rows(self, gi: int, prompt: list[int], n: int) -> list[Sample]:
        """n partial samples with no tokens (an interrupted group that got no answer)."""
        self._inc("interrupted_rows", n)
        return [Sample(prompt_index=gi, prompt_ids=list(prompt), response_ids=[], response_logprobs=[],
                       finish_reason="abort", weight_version=self._weight_version, text="",
                       meta={"finish_reason": {"type": "abort"}}) for _ in range(n)]

    @property
    def synced(self) -> bool:
        """True once update_weights succeeded (responses are version-checked from then on)."""
        return self._synced

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        *,
        stop_after_groups: int | None = None,
        seed: int | None = None,  # accepted for the RolloutEngine contract; SGLang servers sample
        # with their own generators (per-request seeds are not reproducible across server layouts)
    ) -> list[Sample]:
        self._check_open()
        self._refresh_members()  # servers that joined or left the urls_file
        # during a mid-generation push the servers are paused: a request waits there for the new
        # weights (tokenizer_manager.py generate_request waits on is_pause_cond)
        if self._inconsistent is not None and self._pushing is None:
            raise SGLangError(
                f"SGLang servers hold partially updated weights after a failed update_weights "
                f"({self._inconsistent}); send a complete update first"
            )
        check_generate_args(prompts, n, sampling)
        if stop_after_groups is not None and stop_after_groups < 1:
            raise ValueError(f"stop_after_groups must be >= 1, got {stop_after_groups}")
        if not prompts:
            return []
        if not self._synced and not self._warned_unsynced:
            self._warned_unsynced = True
            warnings.warn(
                "SGLangEngine.generate before any update_weights: the servers run the weights they "
                "loaded at start; push the policy first (engine.update_weights(...)) so rollouts "
                "are on-policy and version-checked",
                stacklevel=2,
            )
        if self.vocab_size is None and not self._warned_vocab:
            self._warned_vocab = True
            warnings.warn("SGLangEngine: no vocabulary size (vocab_size=, hf_config= or <model_path>/config.json): "
                          "returned token ids are checked for >= 0 only", stacklevel=2)
        sp = sampling_to_sglang(sampling)
        cancel = threading.Event()
        groups: dict[int, list[Sample]] = {}
        want = len(prompts) if stop_after_groups is None else min(stop_after_groups, len(prompts))
        pool = ThreadPoolExecutor(max_workers=min(self.concurrency, len(prompts)),
                                  thread_name_prefix="sglang-gen")
        futs: dict[Future, int] = {}
        try:
            for gi, p in enumerate(prompts):
                futs[pool.submit(self._run_group, gi, [int(t) for t in p], n, sp, cancel)] = gi
            pending = set(futs)
            error: BaseException | None = None
            while pending:
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for f in done:
                    if f.cancelled():
                        continue
                    exc = f.exception()
                    if isinstance(exc, _Aborted):
                        pass
                    elif exc is not None:
                        error = error or exc
                    else:
                        groups[futs[f]] = f.result()
                if error is not None or (len(groups) >= want and pending):
                    if not cancel.is_set():
                        cancel.set()
                        for f in pending:
                            f.cancel()  # not started yet: never sent
                        pending = {f for f in pending if not f.cancelled()}
                        self._abort_all()
                    elif pending and done == set():
                        self._abort_all()  # keep asking while answers are outstanding
            if error is not None:
                raise error
            self._inc("dropped_groups", len(prompts) - len(groups))
        finally:
            cancel.set()
            pool.shutdown(wait=True, cancel_futures=True)
        return [s for gi in sorted(groups) for s in groups[gi]]

    def _run_group(self, gi: int, prompt: list[int], n: int, sp: dict, cancel: threading.Event) -> list[Sample]:
        extra = {"return_routed_experts": True} if self.return_routing else {}
        payload = api_payload("/generate", input_ids=[prompt] * n, sampling_params=sp, return_logprob=True,
                              rid=[uuid.uuid4().hex for _ in range(n)], **extra)
        tried: list[str] = []
        last: BaseException | None = None
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            if cancel.is_set():
                raise _Aborted()
            if self._interrupted.is_set():
                return self._empty_rows(gi, prompt, n)
            if attempt:
                self._inc("retries")  # per step: rollout_retries in metrics.jsonl (train/loop.py)
                log.warning("SGLang /generate for prompt %d: retry %d of %d after %s", gi, attempt, attempts - 1,
                            str(last).splitlines()[0] if last is not None and str(last) else type(last).__name__)
                time.sleep(self.servers[0].backoff(attempt))
                if cancel.is_set():
                    raise _Aborted()
            server = self._pick_server(avoid=tried[-1] if tried else None)
            tried.append(server.url)
            self._inc("requests")
            sent = self._weight_version  # the oldest version the answer may carry
            try:
                status, data = server.request_once("POST", "/generate", payload, timeout_s=self.request_timeout_s)
            except RetryableHTTPError as e:
                if cancel.is_set():
                    raise _Aborted() from e
                if self._interrupted.is_set():
                    return self._empty_rows(gi, prompt, n)
                last = e
                self._settle(server)  # dead or alive? the supervisor's checks say, then retry
                continue
            if status != 200 and cancel.is_set():
                raise _Aborted()  # whatever an aborted request answers, we no longer need it
            if status != 200 and self._interrupted.is_set():
                return self._empty_rows(gi, prompt, n)
            if status >= 500:
                last = SGLangServerError(f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}",
                                         url=server.url, status=status)
                self._settle(server)
                continue
            if status != 200:
                raise SGLangServerError(
                    f"SGLang server {server.url}: POST /generate returned HTTP {status}: "
                    f"{data[:300].decode('utf-8', 'replace')}", url=server.url, status=status,
                )
            rows = parse_json(data, server.url, "/generate")
            try:
                samples = self._parse_generate(rows, gi, prompt, n, server.url, sent=sent)
            except SGLangStaleWeightsError as e:
                # a supervised server restarted between two of its checks serves the weights it
                # started from (it says so: /model_info): the supervisor finds it by that version
                # and re-syncs it, and the request is sent again. A server that claims the pushed
                # version but answers with another one is refused as before.
                if attempt == attempts - 1 or not self._restarted_unseen(server):
                    raise
                last = e
                self._settle(server)
                continue
            if any(s.finish_reason == "abort" for s in samples) and cancel.is_set():
                raise _Aborted()
            bad = self._violations(samples, sp["max_new_tokens"], server.url, gi)
            if bad:
                if attempt < attempts - 1:  # retried like a failed request
                    last = SGLangServerError(next(iter(bad.values())), url=server.url)
                    continue
                self._inc("rejected", len(bad))
                log.warning("SGLang /generate for prompt %d: %d of %d row(s) rejected after %d attempt(s): %s",
                            gi, len(bad), n, attempts, next(iter(bad.values())))
                return [rejected_sample(s, bad[r]) if r in bad else s for r, s in enumerate(samples)]
            if any(s.finish_reason == "abort" for s in samples):
                if cancel.is_set():
                    raise _Aborted()
                if self._interrupted.is_set():  # partial rows, continued after the weight push
                    self._inc("interrupted_rows", sum(s.finish_reason == "abort" for s in samples))
                    return samples
                last = SGLangServerError("the server aborted the request", url=server.url)
                continue
            return samples
        raise SGLangServerError(
            f"SGLang server {tried[-1]}: POST /generate for prompt {gi} failed after {attempts} "
            f"attempt(s) (servers tried: {', '.join(dict.fromkeys(tried))}); last error: {last}",
            url=tried[-1], status=getattr(last, "status", None),
        ) from last

    def _response_cap(self, method: str, path: str, payload: Any) -> int | None:
        """Byte cap of the answer to a request (ServerClient.response_cap): for /generate, from its
        rows and max_new_tokens, plus with return_routing the routed experts' base64 (4 bytes per
        3 of int32 [prompt + max_new_tokens - 1, layers, top_k]) per row; None (the client's
        default) for every other route."""
        if path != "/generate" or not isinstance(payload, dict):
            return None
        rows = payload.get("input_ids") or []
        rows = [rows] if rows and isinstance(rows[0], int) else rows
        sp = payload.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 0) if isinstance(sp, dict) else 0) or 1
        extra = 0
        if payload.get("logprob_start_len") is not None:  # a probe: an input log-prob per prompt token
            longest = max((len(r) for r in rows), default=0)
            extra += 96 * longest
        if payload.get("return_routed_experts") and self.routing_shape is not None:
            layers, top_k = self.routing_shape
            longest = max((len(r) for r in rows), default=0)
            raw = (longest + max_new - 1) * layers * top_k * 4
            extra += 4 * ((raw + 2) // 3)
        return generate_response_cap(len(rows), max_new, extra_row_bytes=extra)

    def _probe_rows(self, server: ServerClient, ids: list[int]) -> Any:
        """The probe (HTTPEngine.probe_logprobs) as SGLang answers it: /generate with return_logprob
        and logprob_start_len 0, one new token at temperature 1; meta_info.input_token_logprobs
        holds [logprob, token id, text] per prompt token, None for the first
        (scheduler_components/logprob_result_processor.py:37-38)."""
        body = api_payload("/generate", input_ids=ids, return_logprob=True, logprob_start_len=0,
                           sampling_params={"temperature": 1.0, "max_new_tokens": 1})
        r = server.post("/generate", body, timeout_s=self.request_timeout_s, retries=self.max_retries)
        return (r.get("meta_info") or {}).get("input_token_logprobs") if isinstance(r, dict) else r

    def _probe_logprob(self, server: ServerClient, row: Any, token: int) -> float:
        ok = isinstance(row, (list, tuple)) and len(row) >= 2 and isinstance(row[0], (int, float))
        if not ok or int(row[1]) != token:
            raise SGLangProtocolError(f"SGLang server {server.url}: input_token_logprobs entry {row!r} is not "
                                      f"[logprob, {token}, ...]")
        return float(row[0])

    def _restarted_unseen(self, server: ServerClient) -> bool:
        """Whether a supervised `server` reports serving other weights than the engine pushed."""
        sup = self._supervisor
        return sup is not None and sup.watches(server) and self._served_version_ok(server) is False

    def _pick_server(self, avoid: str | None = None) -> ServerClient:
        servers = self._in_service()
        if len(servers) > 1 and avoid is not None:
            servers = [s for s in servers if s.url != avoid] or servers
        k = next(self._rr)
        order = servers[k % len(servers):] + servers[: k % len(servers)]
        return min(order, key=lambda s: s.inflight)

    def _violations(self, samples: list[Sample], max_new_tokens: int, url: str, gi: int) -> dict[int, str]:
        """Row -> why it breaks the response contract (rollout/validate.py), each logged naming the server."""
        out = {}
        for r, s in enumerate(samples):
            why = check_response(s.response_ids, s.response_logprobs, max_new_tokens=int(max_new_tokens),
                                 vocab_size=self.vocab_size)
            if why is not None:
                out[r] = f"SGLang server {url}: /generate for prompt {gi}, row {r}: {why}"
                log.warning("%s", out[r])
        return out

    def _parse_generate(self, rows: Any, gi: int, prompt: list[int], n: int, url: str,
                        sent: int | None = None) -> list[Sample]:
        def bad(msg: str) -> SGLangProtocolError:
            return SGLangProtocolError(f"SGLang server {url}: malformed /generate response: {msg}")

        if isinstance(rows, dict) and n == 1:
            rows = [rows]
        if not isinstance(rows, list) or len(rows) != n:
            got = f"a list of {len(rows)}" if isinstance(rows, list) else type(rows).__name__
            raise bad(f"expected a list of {n} results, got {got}")
        out = []
        for r, row in enumerate(rows):
            if not isinstance(row, dict) or not isinstance(row.get("meta_info"), dict):
                raise bad(f"result {r} has no meta_info object")
            meta = row["meta_info"]
            fr = meta.get("finish_reason")
            ftype = fr.get("type") if isinstance(fr, dict) else fr
            if ftype not in FINISH_REASONS:
                raise bad(f"result {r} finish_reason {fr!r} is not one of {FINISH_REASONS}")
            triples = meta.get("output_token_logprobs")
            if triples is None and ftype == "abort":
                triples = []  # aborted before any logprob was recorded
            if not isinstance(triples, list):
                raise bad(f"result {r} lacks meta_info.output_token_logprobs (return_logprob ignored?)")
            ids, lps = [], []
            for t in triples:
                # a null log-prob is kept for the boundary check (orjson writes NaN / inf as null);
                # ids stay as sent (an int subclass such as bool is refused there, not coerced)
                if not isinstance(t, (list, tuple)) or len(t) < 2 or not isinstance(t[1], int) \
                        or not (t[0] is None or isinstance(t[0], (int, float))) or isinstance(t[0], bool):
                    raise bad(f"result {r} output_token_logprobs entry {t!r} is not [logprob, token_id, text]")
                lps.append(t[0] if t[0] is None else float(t[0]))
                ids.append(t[1])
            if ftype != "abort" and not ids:
                raise bad(f"result {r} finished ({ftype}) with no tokens")
            # the response is used as SGLang returned it (no client-side trimming), so the routing
            # must cover exactly prompt + response - 1 positions; aborted rows are never kept
            routed = (self._routed_experts(meta, r, len(prompt), len(ids), url)
                      if self.return_routing and ftype != "abort" else None)
            spans = meta.get("weight_versions")
            if spans is not None and self._synced:  # each span's version checked
                token_versions, span_versions = self._token_versions(spans, len(ids), url, r, sent)
                version = min(token_versions) if token_versions else span_versions[-1]  # no tokens: the last span's
                if len(set(token_versions)) < 2:
                    token_versions = None
            else:
                version = self._check_version(meta.get("weight_version"), url, len(ids), sent)
                token_versions = None
            out.append(Sample(
                prompt_index=gi, prompt_ids=list(prompt), response_ids=ids, response_logprobs=lps,
                finish_reason=ftype, weight_version=version, text=row.get("text"),
                meta={"server": url, "finish_reason": fr, "rid": meta.get("id")},
                routed_experts=routed, token_versions=token_versions,
            ))
        return out

    def _token_versions(self, spans: Any, ntok: int, url: str, r: int,
                        sent: int | None) -> tuple[list[int], list[int]]:
        """meta_info.weight_versions ([{version, start, end}], SGLang 0.5.23 weight_versions.py
        add_weight_versions_to_meta_info: contiguous spans from token 0) -> (each token's version,
        each span's version), each version checked once as weight_version is."""
        def bad(msg: str) -> SGLangProtocolError:
            return SGLangProtocolError(f"SGLang server {url}: malformed /generate response: result {r} "
                                       f"meta_info.weight_versions {msg}")

        if not isinstance(spans, list) or not spans:
            raise bad(f"is {str(spans)[:100]!r}, not a list of spans")
        out: list[int] = []
        checked: list[int] = []  # each span's version, checked once
        for span in spans:
            if not isinstance(span, dict) or not all(isinstance(span.get(k), int) and not isinstance(span.get(k), bool)
                                                     for k in ("start", "end")):
                raise bad(f"entry {str(span)[:100]!r} is not {{version, start, end}}")
            if span["start"] != len(out) or span["end"] < span["start"]:
                raise bad(f"are not contiguous from token 0: {str(spans)[:200]}")
            v = self._check_version(span.get("version"), url, ntok, sent)
            checked.append(v)
            out += [v] * (span["end"] - span["start"])
        if len(out) != ntok:
            raise bad(f"cover {len(out)} tokens of {ntok}")
        return out, checked

    def _routed_experts(self, meta: dict, r: int, n_prompt: int, n_response: int, url: str) -> torch.Tensor:
        """meta_info.routed_experts -> int32 [n_prompt + n_response - 1, L, k] (start_len 0)."""
        field = "meta_info.routed_experts"

        def bad(msg: str) -> SGLangProtocolError:
            return SGLangProtocolError(f"SGLang server {url}: malformed /generate response: result {r} {field} {msg}")

        raw = meta.get("routed_experts")
        if raw is None:  # SGLang omits it (no error) on a server without the flag
            raise SGLangRoutingNotEnabledError(
                f"SGLang server {url}: /generate returned no {field} though return_routed_experts was "
                f"requested; the server must be launched with {ROUTED_EXPERTS_FLAG}")
        if not isinstance(raw, str):
            raise bad(f"is a {type(raw).__name__}, not a base64 string")
        try:
            data = base64.b64decode(raw, validate=True)  # SGLang: pybase64.b64encode (standard alphabet)
        except (binascii.Error, ValueError):
            raise bad("is not valid base64") from None
        layers, top_k = self.routing_shape
        row_bytes = layers * top_k * 4  # int32
        rows = n_prompt + n_response - 1
        if len(data) % row_bytes:
            raise bad(f"has {len(data)} bytes, not a whole number of positions of {layers} layers x {top_k} "
                      f"experts x int32 ({row_bytes} bytes each)")
        if len(data) // row_bytes != rows:
            raise bad(f"covers {len(data) // row_bytes} positions, expected prompt {n_prompt} + response "
                      f"{n_response} - 1 = {rows} ({len(data)} bytes of {layers} layers x {top_k} experts x int32)")
        # the server's native byte order: little-endian on every platform SGLang runs on (and here)
        return torch.frombuffer(bytearray(data), dtype=torch.int32).view(rows, layers, top_k)

    def _check_version(self, reported: Any, url: str, ntok: int, sent: int | None = None) -> int:
        """The version a server reported, checked: between the version held when the request was
        sent (`sent`) and the newest installed or being installed (a push mid-generation: answers
        finished before it carry the old version, later ones the new)."""
        parsed: int | None
        if reported is None and self._synced:
            # an SGLang without weight_version in meta_info: nothing to check against
            self._inc("unversioned_samples")
            if not self._warned_unversioned:
                self._warned_unversioned = True
                warnings.warn(f"SGLang server {url} reports no meta_info.weight_version (SGLang too old?); "
                              "stale weights cannot be detected", stacklevel=3)
            return self._weight_version
        try:
            parsed = int(reported)
        except (TypeError, ValueError):
            parsed = None
        if not self._synced:
            return parsed if parsed is not None else self._weight_version
        pushing = self._pushing
        lo = self._weight_version if sent is None else sent
        hi = max(self._weight_version, pushing if pushing is not None else self._weight_version)
        if parsed is not None and lo <= parsed <= hi:
            return parsed
        if self.on_stale == "error":
            want = f"{lo}" if lo == hi else f"{lo}..{hi}"
            raise SGLangStaleWeightsError(
                f"SGLang server {url} answered with weight_version={reported!r}, expected "
                f"{want} (the server missed a weight update?)"
            )
        self._inc("stale_samples")
        return parsed if parsed is not None else -1

    def _abort_all(self) -> None:
        self._inc("abort_calls")

        def one(s: ServerClient):
            try:
                s.request_once("POST", "/abort_request", api_payload("/abort_request", abort_all=True), timeout_s=10)
            except RetryableHTTPError:
                pass

        for s in self.workers:
            one(s)

    def abort(self) -> None:
        """Abort every request on every server (public for callers running their own loops)."""
        self._abort_all()

    # ------------------------------------------------------------------ weights
    def _make_syncer(self):
        mode = self.cfg["weight_sync"]
        bucket = max(1, int(float(self.cfg["bucket_mb"]) * (1 << 20)))
        timeout = self.request_timeout_s
        if mode == "disk":
            shared = self.cfg["shared_dir"]
            if not shared:
                raise ValueError("weight_sync=disk needs shared_dir (visible to trainer and servers)")
            if self.hf_config is None:
                raise ValueError("weight_sync=disk needs hf_config (or model_path/config.json)")
            return DiskSync(self.workers, shared_dir=shared, hf_config=self.hf_config,
                            dtype=self.sync_dtype, copy_from=self.model_path, timeout_s=timeout)
        ranks = self._ranks_per_server()
        together = self._loaded_together()
        if mode == "distributed":
            addr = self._sync_master_address or local_address_towards(self.workers[0].url)
            port = self._sync_master_port or 0  # 0: the trainer binds a free port when it hosts the store
            return DistributedSync(
                self.workers, ranks_per_server=ranks, master_address=addr, master_port=port,
                backend=self.sync_backend, group_name=self.sync_group_name, bucket_bytes=bucket,
                dtype=self.sync_dtype, device=self.sync_device, timeout_s=timeout, together=together,
            )
        return TensorSync(self.workers, ranks_per_server=ranks, bucket_bytes=bucket,
                          dtype=self.sync_dtype, device=self.sync_device, timeout_s=timeout, together=together)

    def _loaded_together(self) -> LoadedTogether:
        """The tensors SGLang fuses only when one request brings them all (the model's family says
        which: ModelFamily.weights_loaded_together); none without a config to read the model from
        (a push by tensors needs none otherwise)."""
        if not self.hf_config:
            return LoadedTogether()
        from gspo_megatron.model.arch import MoeArch

        arch = MoeArch.from_hf_dict(self.hf_config, source="the SGLang engine's hf_config")
        return LoadedTogether(arch.family.weights_loaded_together(arch))

    def _ranks_per_server(self) -> list[int]:
        """Each server's TP size (its ranks in the weight-update group), from /server_info
        (/get_server_info is deprecated in SGLang 0.5.23)."""
        out = []
        for s in self.workers:
            tp, dp, dp_attn, pp = int(self.cfg["tp"]), int(self.cfg["dp"]), False, 1
            try:
                info = s.get("/server_info", timeout_s=30, retries=1)
                if isinstance(info, dict):
                    tp = int(info.get("tp_size", tp))
                    dp = int(info.get("dp_size", dp) or 1)
                    pp = int(info.get("pp_size", 1) or 1)
                    dp_attn = bool(info.get("enable_dp_attention", False))
            except SGLangError:
                pass  # fall back to the config's sizes
            if pp > 1:
                raise SGLangError(f"SGLang server {s.url}: weight sync to pipeline-parallel servers is unsupported")
            if dp > 1 and not dp_attn:
                raise SGLangError(
                    f"SGLang server {s.url} runs dp_size={dp} replicas in one server; "
                    f"weight_sync={self.cfg['weight_sync']} needs one replica per server "
                    "(launch dp servers with dp=1, behind a router if wanted)"
                )
            out.append(tp)
        return out

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Push HF-named full tensors (consumed once) to every server as `version` (default:
        current + 1; must exceed the current version), then flush their caches."""
        self._check_open()
        if version is None:
            version = self._weight_version + 1
        version = int(version)
        if version <= self._weight_version and self._synced:
            raise ValueError(
                f"update_weights: version {version} does not exceed the current version "
                f"{self._weight_version}"
            )
        if self._syncer is None:
            self._syncer = self._make_syncer()
        if self._supervisor is not None:  # a server being brought back gets this push too
            self._supervisor.wait_all_healthy()
        t0 = time.perf_counter()
        self._inconsistent = "update in progress"
        try:
            with self._pushing_weights():
                stats = self._sync(named_tensors, version)
                attempts = 0
                for s in self.workers:
                    attempts += flush_cache(s, timeout_s=self.request_timeout_s)
        except BaseException as e:
            self._inconsistent = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise
        self._inconsistent = None
        self._weight_version = version
        self._synced = True
        self.metrics["weight_syncs"] += 1
        self.metrics["flush_attempts"] = attempts
        self.metrics["last_sync_s"] = time.perf_counter() - t0
        self.metrics["last_sync_bytes"] = stats.get("bytes", 0)

    def _sync(self, named_tensors: NamedTensors, version: int) -> dict:
        """The syncer's push; a supervised server lost under it (disk sync: the version is written
        once) is waited for, brought back with the previous version, then loads this one."""
        restarts = self.metrics["restarts"]
        try:
            return self._syncer.update(named_tensors, version)
        except SGLangError as e:
            pending = self._syncer.pending if isinstance(self._syncer, DiskSync) else None
            if self._supervisor is None or pending is None:
                raise
            bad = [s for s in self.workers if s.url == getattr(e, "url", None)]
            for s in bad:
                self._settle(s)
            self._supervisor.wait_all_healthy()
            if self.metrics["restarts"] == restarts:
                raise
            log.warning("SGLang weight push of version %d: loaded again after a server was brought back", version)
            return self._syncer.retry_pending()

    supports_push_mid_generation = True

    def update_weights_mid_generation(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """update_weights while generate() may run in another thread, without waiting for it:
        every server is paused in "retract" mode (its running requests go back to the queue, their
        KV freed), updated (a paused server skips the model-update lock that waits for running
        requests: tokenizer_manager.py update_weights_from_disk, tokenizer_control_mixin.py for the
        other routes), its cache flushed (allowed while paused with requests queued: scheduler.py
        flush_cache `is_fully_idle(ignore_waiting=self._engine_paused)`), and continued: the
        retracted requests recompute their prefixes under the new weights and go on, each token's
        version reported in meta_info.weight_versions (recorded for every live request when the
        version changes: scheduler.py record_weight_version_change). Requests sent meanwhile wait in
        the paused server. Servers are continued even when the update fails (which is raised)."""
        self._check_open()
        version = int(self._weight_version + 1 if version is None else version)
        self._pushing = version
        paused: list[ServerClient] = []
        unpaused: BaseException | None = None
        try:
            for s in self.workers:
                self._control(s, "/pause_generation", api_payload("/pause_generation", mode="retract"))
                paused.append(s)
            self.update_weights(named_tensors, version)
        finally:
            for s in paused:  # every paused server, whatever failed
                try:
                    self._control(s, "/continue_generation", api_payload("/continue_generation"))
                except BaseException as e:  # noqa: BLE001 - the others are continued first
                    log.error("SGLang server %s: /continue_generation failed: %s", s.url, e)
                    unpaused = unpaused or e
            self._pushing = None
        if unpaused is not None:  # the update went in, but a server stays paused: generation would hang
            self._inconsistent = f"a server was not continued after the push: {unpaused}"
            raise unpaused

    # ------------------------------------------------------------------ supervision (rollout/supervision.py)
    def _set_servers(self, servers: list) -> None:
        # no router here (urls_file lists servers): the servers are the workers, and the disk
        # sync's list follows (a leaving server gets no more pushes, a joining one every next one)
        super()._set_servers(servers)
        self.workers = self.servers
        if self._syncer is not None:
            self._syncer.servers = list(self.servers)

    def _resync_refusal(self) -> str | None:
        if self._synced and self.cfg["weight_sync"] != "disk":
            return (f"with rollout.sglang.weight_sync={self.cfg['weight_sync']} a restarted server cannot get the "
                    "pushed weights back (use weight_sync=disk for restarts)")
        return None

    def _resync_server(self, s: ServerClient) -> None:
        """A worker back after a loss (or joining): the last pushed version directory reloaded and
        labelled, its cache flushed, and its memory released again while the engines sleep (colocated)."""
        if self._synced:
            self._syncer.reload(s, self._weight_version)
            flush_cache(s, timeout_s=self.request_timeout_s)
        if self._asleep:
            self._release_memory(s, None)

    def _control(self, s: ServerClient, path: str, body: dict) -> None:
        status, data = s.request_once("POST", path, body, timeout_s=self.request_timeout_s)
        if status != 200:
            raise SGLangServerError(f"SGLang server {s.url}: POST {path} returned HTTP {status}: "
                                    f"{data[:300].decode('utf-8', 'replace')}", url=s.url, status=status)

    # ------------------------------------------------------------------ colocated memory
    def sleep(self, tags: list[str] | None = None) -> None:
        """Free GPU memory on every server (weights + KV cache unless `tags` narrows it)."""
        self._check_open()
        for s in self.workers:
            self._on_recovered(s, lambda s=s: self._release_memory(s, tags))
        self._asleep = True

    def _on_recovered(self, s: ServerClient, call) -> None:
        """call(); if it fails on a server the supervisor watches (killed under it), once more after
        the supervisor's verdict: a server brought back was re-synced (and, while the engines
        sleep, released again: _resync_server), so the call applies to it as to the others."""
        try:
            call()
        except SGLangError:
            if self._supervisor is None or not self._supervisor.watches(s):
                raise
            self._settle(s)
            call()

    def _release_memory(self, s: ServerClient, tags: list[str] | None) -> None:
        flush_cache(s, timeout_s=self.request_timeout_s)
        r = s.post("/release_memory_occupation", api_payload("/release_memory_occupation", tags=tags),
                   timeout_s=self.request_timeout_s,
                   expect_json=False, ok_statuses=(200, 400))
        check_not_failed(_lenient_json(r), s.url, "/release_memory_occupation")

    def wake(self, tags: list[str] | None = None) -> None:
        """Re-allocate what sleep() released (all of it unless `tags`, e.g. ["weights"] before a
        weight sync, then ["kv_cache"] after it)."""
        self._check_open()
        for s in self.workers:
            self._on_recovered(s, lambda s=s: self._resume_memory(s, tags))
        self._asleep = False

    def _resume_memory(self, s: ServerClient, tags: list[str] | None) -> None:
        r = s.post("/resume_memory_occupation", api_payload("/resume_memory_occupation", tags=tags),
                   timeout_s=self.request_timeout_s,
                   expect_json=False, ok_statuses=(200, 400))
        check_not_failed(_lenient_json(r), s.url, "/resume_memory_occupation")

    # ------------------------------------------------------------------ lifecycle
    def _release(self) -> None:
        if self._syncer is not None:
            try:
                self._syncer.close()
            except Exception:
                pass


def _lenient_json(text: str) -> Any:
    try:
        return loads_answer(text) if text.strip() else None
    except ValueError:
        return text
