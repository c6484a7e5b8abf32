"""vLLM servers as seen from the trainer: how one is launched (the engine-independent client and
process management are rollout/http_servers.py's).

A server the vLLM engine can drive needs (vLLM 0.32.0, read in its source):
* ``--enable-scale-out``: the token-in/token-out route ``POST /inference/v1/generate``, which
  returns every choice's ``token_ids``, per-token ``logprobs`` and ``weight_versions``;
* ``--logprobs-mode processed_logprobs``: the log-probs of the distribution actually sampled,
  i.e. after temperature (the default ``raw_logprobs`` are taken before it:
  config/model.py ``logprobs_mode``, v1/sample/ops/topk_topp_sampler.py);
* ``VLLM_SERVER_DEV_MODE=1``: the RL control routes (``/pause``, ``/resume``,
  ``/update_weight_version``, ``/collective_rpc``; entrypoints/launchers/api_server/routers.py);
* ``--worker-extension-cls gspo_megatron.rollout.vllm_worker.GSPOWorkerExtension`` with this
  repository on the server's PYTHONPATH: the weight reload that is exact on CPU MoE
  (rollout/vllm_worker.py explains vLLM's repack bug);
* on CPU ``--enforce-eager`` and ``--kv-cache-memory-bytes`` (otherwise the KV cache is sized from
  most of the host's memory, v1/worker/cpu_worker.py), ``VLLM_CPU_OMP_THREADS_BIND=nobind``.

What a launched server is given follows the run (`prepare`, called by `launch`), not a preset:
* on CPU the flags above by default, the KV cache sized from the model (`default_cpu_kv_cache_mb`)
  unless rollout.vllm.cpu_kv_cache_mb says otherwise;
* ``--dtype`` the trainer's model.dtype when rollout.vllm.dtype is auto: vLLM's own auto serves a
  float32 checkpoint in bfloat16 (config/model.py ``_resolve_auto_dtype``: "Downcast for float32
  models"), and the trainer's log-probs would then differ from the engine's by ~1e-1; an explicit
  dtype other than the trainer's is kept, with one warning line;
* on CUDA GPUs of its own (`server_gpus`): trainer local rank r holds the node's visible GPU r
  (parallel/state.py set_device(LOCAL_RANK)), so the server gets rollout.vllm.gpus or the GPUs
  after the trainer's through CUDA_VISIBLE_DEVICES, or the launch is refused in one line.
The control routes are not covered by ``--api-key`` (it guards /v1, /v2, /inference only:
entrypoints/serve/middleware/authenticate.py), so a launched server binds loopback.
"""
from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from gspo_megatron.errors import InputError

from . import http_servers as _http
from .colocate import TORCHRUN_ENV
from .vllm_api import API_SERVER_MODULE, WORKER_EXTENSION

log = logging.getLogger("gspo_megatron.rollout")

# vLLM 0.32's --dtype choices (config/model.py ModelDType) and the dtype each names
VLLM_DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
               "float32": "float32"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Default CPU KV cache: room for this many sequences of max_model_len tokens at once. vLLM refuses
# to start below one (v1/core/kv_cache_utils.py _check_enough_kv_cache_memory: "To serve at least
# one request with the model's max seq len"); a few let a batch of short rollouts run together
# without reserving the host's memory. Never below CPU_KV_CACHE_MIN_MB (the CPU preset's 32 MiB:
# the tiny model's 4 sequences need 2 MiB, and the cache's own blocks round up).
CPU_KV_CACHE_SEQS = 4
CPU_KV_CACHE_MIN_MB = 32
# When the model's config.json cannot be read (a hub id, an unusual layout): a fixed bounded cache.
CPU_KV_CACHE_FALLBACK_MB = 1024


class VLLMLaunchError(_http.EngineError, InputError):
    """A launch this run cannot make (one line; an InputError, so entry points print just it)."""

# the repository root: the server imports the worker extension from it
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerClient(_http.ServerClient):
    label = "vLLM server"


@dataclass
class VLLMLaunchSpec:
    model_path: str
    port: int = 8000
    host: str = "127.0.0.1"
    # the key: never in argv (`ps`, the log's first line); the server reads it from VLLM_API_KEY
    # (vllm/entrypoints/serve/middleware/register.py:32-33: --api-key, else envs.VLLM_API_KEY)
    api_key: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    cpu_kv_cache_mb: int | None = None  # set: a CPU server (eager mode, a bounded KV cache)
    extra_args: list[str] = field(default_factory=list)
    command: list[str] | None = None  # [python, -m, vllm.entrypoints.openai.api_server] by default
    python: str = "python3"
    env: dict[str, str] | None = None
    env_vars: tuple[str, ...] = ()  # rollout.*.env_vars: more of the trainer's variables passed on
    log_dir: str | None = None
    # "nccl": the server takes vLLM's NCCL weight transfer (rollout.vllm.weight_sync=nccl)
    weight_transfer: str | None = None
    num_servers: int = 1
    log_name: str = "vllm_server"
    health_path: str = "/health"
    # the trainer's variables are not the server's (vLLM reads LOCAL_RANK, envs.py); colocate.py
    unset_env: tuple[str, ...] = TORCHRUN_ENV
    # What `prepare` decides from (None: found out there). device: "cpu" or "cuda" (default: cuda
    # when torch sees one, as parallel.device=auto resolves). trainer_dtype: model.dtype (a name or a
    # torch.dtype), what dtype=auto serves in. gpus: rollout.vllm.gpus. node_gpus / trainer_gpus:
    # the GPUs this process sees / the trainer's local ranks hold (default torch.cuda.device_count()
    # / LOCAL_WORLD_SIZE).
    device: str | None = None
    trainer_dtype: Any = None
    gpus: list[int] = field(default_factory=list)
    node_gpus: int | None = None
    trainer_gpus: int | None = None
    prepared: bool = False
    # on CUDA, set by `prepare`: the GPUs servers may take (rollout.vllm.gpus, else every GPU after
    # the trainer's), as CUDA_VISIBLE_DEVICES entries, and how many one server takes: server i
    # takes entries [i * per_server, (i + 1) * per_server) (replica_env)
    gpu_pool: list[str] = field(default_factory=list)
    gpus_per_server: int = 0

    def _cpu(self) -> bool:
        """A CPU server with its KV cache size (after `prepare`, every CPU server has one)."""
        return bool(self.cpu_kv_cache_mb) and self.device != "cuda"

    def url(self, i: int) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "localhost") else self.host
        return f"http://{host}:{self.port + i}"

    def argv(self, i: int) -> list[str]:
        prefix = list(self.command) if self.command else [self.python, "-m", API_SERVER_MODULE]
        args = ["--model", str(self.model_path), "--host", self.host, "--port", str(self.port + i),
                "--dtype", self.dtype, "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
                "--max-logprobs", "0", "--worker-extension-cls", WORKER_EXTENSION]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self._cpu():
            args += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(self.cpu_kv_cache_mb) << 20)]
        if self.weight_transfer:
            args += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        return prefix + args + [str(a) for a in self.extra_args]

    def replica_env(self, i: int) -> dict[str, str]:
        """Server i's own devices: on CUDA its slice of the GPU pool (CUDA_VISIBLE_DEVICES), a
        VLLMLaunchError line when the pool has no room for it; nothing on CPU."""
        if not self.gpus_per_server:
            return {}
        k = self.gpus_per_server
        take = self.gpu_pool[i * k:(i + 1) * k]
        if len(take) < k:
            raise VLLMLaunchError(f"vLLM server {i}: needs {k} GPU(s) of its own, and the {len(self.gpu_pool)} GPU(s) "
                                  f"servers may take here ({','.join(self.gpu_pool)}: rollout.vllm.gpus, else the GPUs "
                                  f"after the trainer's) hold {len(self.gpu_pool) // k} server(s)")
        return {"CUDA_VISIBLE_DEVICES": ",".join(take)}

    def secret_env(self) -> dict[str, str]:
        """The key, as the server's own environment variable (http_servers.ServerProcesses)."""
        return {"VLLM_API_KEY": self.api_key} if self.api_key else {}

    def secret_args(self, private_dir: str) -> list[str]:
        return []  # the key travels in secret_env

    def server_env(self) -> dict[str, str]:
        """What a launched server needs in its environment besides ours."""
        path = os.environ.get("PYTHONPATH")
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": REPO_ROOT + (os.pathsep + path if path else "")}
        if self._cpu():
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env.update(self.env or {})
        return env


def dtype_name(dtype: Any) -> str | None:
    """"float32" / "bfloat16" / "float16" for a torch.dtype or a dtype name (vLLM's or torch's);
    None for None or auto."""
    if dtype is None:
        return None
    name = str(dtype).strip().lower()
    name = name[len("torch."):] if name.startswith("torch.") else name
    if name not in VLLM_DTYPES:
        raise VLLMLaunchError(f"rollout.vllm.dtype={dtype!r}: vLLM 0.32 takes one of {sorted(VLLM_DTYPES)}")
    return VLLM_DTYPES[name]


def served_dtype(requested: str, trainer_dtype: Any) -> tuple[str, str | None]:
    """The launched server's --dtype and a warning line or None: `requested` (rollout.vllm.dtype),
    auto meaning the trainer's dtype when it is known; the warning when the server's differs from
    the trainer's."""
    want, trainer = dtype_name(requested), dtype_name(trainer_dtype)
    if want is None:  # auto
        return (trainer or "auto"), None
    if trainer is not None and want != trainer:
        return want, (f"rollout.vllm.dtype={requested}: the launched vLLM server computes in {want} while the trainer "
                      f"computes in {trainer} (model.dtype); their log-probs differ accordingly (mismatch_logprob_*). "
                      "rollout.vllm.dtype=auto serves in the trainer's dtype")
    return want, None


def _model_config(model_path: str) -> dict | None:
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def default_cpu_kv_cache_mb(hf_config: dict | None, max_model_len: int | None, dtype: str) -> tuple[int, str]:
    """A bounded CPU KV cache in MiB and why: CPU_KV_CACHE_SEQS sequences of max_model_len (default
    the model's max_position_embeddings) tokens at the KV bytes per token its family gives
    (ModelFamily.kv_cache_bytes_per_token: the family knows its attention), at least
    CPU_KV_CACHE_MIN_MB; a fixed CPU_KV_CACHE_FALLBACK_MB when the config is not one a family reads."""
    from gspo_megatron.errors import ModelConfigError
    from gspo_megatron.model.registry import arch_from_hf_dict

    try:
        arch = arch_from_hf_dict(hf_config or {}, "the served model's config.json")
    except ModelConfigError:
        return CPU_KV_CACHE_FALLBACK_MB, "a fixed default: the model's config.json does not give its KV size"
    tokens = int(max_model_len or arch.max_position_embeddings)
    per_token = arch.family.kv_cache_bytes_per_token(arch, _DTYPE_BYTES.get(dtype, 4))
    mb = max(CPU_KV_CACHE_MIN_MB, math.ceil(CPU_KV_CACHE_SEQS * tokens * per_token / (1 << 20)))
    return mb, f"{CPU_KV_CACHE_SEQS} sequences of {tokens} tokens at {per_token} B per token"


def parallel_size(extra_args: Sequence[str]) -> int:
    """The GPUs one server takes: vLLM's tensor x pipeline x data parallel sizes in `extra_args`
    (--tensor-parallel-size / -tp, --pipeline-parallel-size / -pp, --data-parallel-size / -dp,
    as "--flag N" or "--flag=N"; default 1 each)."""
    names = {"--tensor-parallel-size": 0, "-tp": 0, "--pipeline-parallel-size": 1, "-pp": 1,
             "--data-parallel-size": 2, "-dp": 2}
    sizes = [1, 1, 1]
    args = [str(a) for a in extra_args]
    for i, a in enumerate(args):
        flag, eq, val = a.partition("=")
        if flag in names:
            val = val if eq else (args[i + 1] if i + 1 < len(args) else "")
            try:
                sizes[names[flag]] = int(val)
            except ValueError:
                raise VLLMLaunchError(f"rollout.vllm.extra_args: {flag} needs an integer, got {val!r}") from None
    return sizes[0] * sizes[1] * sizes[2]


def server_gpus(requested: Sequence[int], *, node_gpus: int, trainer_gpus: int, needed: int) -> list[int]:
    """The visible GPU indices a launched server on this node takes, disjoint from the trainer's
    (local ranks hold GPUs 0 .. trainer_gpus-1): `requested` (rollout.vllm.gpus) when given, else
    the first `needed` after the trainer's. A VLLMLaunchError (one line) when that cannot be."""
    held = f"GPUs 0-{trainer_gpus - 1}" if trainer_gpus > 1 else "GPU 0"
    if requested:
        gpus = [int(g) for g in requested]
        bad = [g for g in gpus if not 0 <= g < node_gpus]
        if bad:
            raise VLLMLaunchError(f"rollout.vllm.gpus={gpus}: GPU(s) {bad} do not exist here ({node_gpus} visible)")
        shared = sorted(set(gpus) & set(range(trainer_gpus)))
        if shared:
            raise VLLMLaunchError(f"rollout.vllm.gpus={gpus}: GPU(s) {shared} are the trainer's (its {trainer_gpus} "
                                  f"local rank(s) hold {held}); list GPUs >= {trainer_gpus}")
        if len(gpus) < needed:
            raise VLLMLaunchError(f"rollout.vllm.gpus={gpus}: the launch needs {needed} GPUs (tensor x pipeline x "
                                  "data parallel sizes in rollout.vllm.extra_args, times rollout.vllm.replicas)")
        return gpus
    free = list(range(trainer_gpus, node_gpus))
    if len(free) < needed:
        raise VLLMLaunchError(
            f"rollout.vllm.launch=true on CUDA: the trainer's {trainer_gpus} local rank(s) hold {held} of the "
            f"{node_gpus} this node shows, and the server(s) need {needed} GPU(s) of their own (vLLM would otherwise "
            "share trainer rank 0's); run fewer trainer processes per node, or start servers elsewhere and set "
            "rollout.vllm.urls")
    return free[:needed]


def cuda_visible_devices(gpus: Sequence[int], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for a server taking visible indices `gpus` of a process whose own
    CUDA_VISIBLE_DEVICES is `parent` (indices are into that list when it is set)."""
    if parent is None or not parent.strip():
        return ",".join(str(g) for g in gpus)
    ids = [p.strip() for p in parent.split(",") if p.strip()]
    return ",".join(ids[g] for g in gpus)


def prepare(spec: VLLMLaunchSpec) -> VLLMLaunchSpec:
    """Fill in what the run decides (device, dtype, CPU KV cache, GPUs) and log what was chosen;
    idempotent. Raises VLLMLaunchError for a launch that cannot be made."""
    if spec.prepared:
        return spec
    if spec.device is None:
        import torch

        spec.device = "cuda" if torch.cuda.is_available() else "cpu"
    if spec.device not in ("cpu", "cuda"):
        raise VLLMLaunchError(f"vLLM launch: device must be cpu or cuda, got {spec.device!r}")
    spec.dtype, warning = served_dtype(spec.dtype, spec.trainer_dtype)
    if warning:
        log.warning(warning)
    env = dict(spec.env or {})
    if spec.device == "cpu":
        if spec.gpus:
            raise VLLMLaunchError(f"rollout.vllm.gpus={list(spec.gpus)}: this run's server is a CPU one (no CUDA here)")
        if not spec.cpu_kv_cache_mb:
            hf = _model_config(str(spec.model_path))
            # auto (no trainer dtype known): sized for float32, the most vLLM's auto can serve in
            kv_dtype = dtype_name(spec.dtype) or "float32"
            spec.cpu_kv_cache_mb, why = default_cpu_kv_cache_mb(hf, spec.max_model_len, kv_dtype)
            log.info("vLLM server on CPU: KV cache %d MiB (%s; rollout.vllm.cpu_kv_cache_mb sets it)",
                     spec.cpu_kv_cache_mb, why)
    else:
        if spec.cpu_kv_cache_mb:
            log.warning("rollout.vllm.cpu_kv_cache_mb=%s is for CPU servers: ignored on CUDA (vLLM sizes the cache "
                        "with --gpu-memory-utilization, settable in rollout.vllm.extra_args)", spec.cpu_kv_cache_mb)
        import torch

        node = torch.cuda.device_count() if spec.node_gpus is None else int(spec.node_gpus)
        trainer = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if spec.trainer_gpus is None else int(spec.trainer_gpus)
        need = parallel_size(spec.extra_args)
        # every server its own GPUs: the first num_servers slices of the pool, checked here; a
        # replica added later (rollout.vllm.replicas_file) takes the next slice (replica_env)
        server_gpus(spec.gpus, node_gpus=node, trainer_gpus=trainer, needed=need * spec.num_servers)
        pool = [int(g) for g in spec.gpus] if spec.gpus else list(range(trainer, node))
        spec.gpu_pool = cuda_visible_devices(pool, os.environ.get("CUDA_VISIBLE_DEVICES")).split(",")
        spec.gpus_per_server = need
        env.update(spec.replica_env(0))  # server 0's, as the one-server launch always had
        log.info("vLLM server(s) on CUDA: %d GPU(s) each from GPUs %s of this node (the trainer holds 0-%d)", need,
                 pool, trainer - 1)
    spec.extra_args = list(spec.extra_args) + family_server_args(_model_config(str(spec.model_path)), spec)
    spec.env = env
    spec.prepared = True
    return spec


def family_server_args(hf_config: dict | None, spec: VLLMLaunchSpec) -> list[str]:
    """What the served model's family needs on this device (ModelFamily.vllm_server_args and its
    engine_config_overrides as --hf-overrides), minus
    the flags rollout.vllm.extra_args already sets; a VLLMLaunchError line when vLLM cannot serve
    it there. Nothing for a config no family reads (vLLM's own error then)."""
    from gspo_megatron.errors import ModelConfigError
    from gspo_megatron.model.registry import arch_from_hf_dict

    try:
        arch = arch_from_hf_dict(hf_config or {}, "the served model's config.json")
    except ModelConfigError:
        return []
    try:
        args = arch.family.vllm_server_args(arch, spec.device, dtype_name(spec.dtype))
    except ModelConfigError as e:
        raise VLLMLaunchError(str(e)) from None
    overrides = arch.family.engine_config_overrides(arch)
    if overrides:  # what transformers' class implies and its saved config.json may not say
        args = ["--hf-overrides", json.dumps(overrides, sort_keys=True)] + list(args)
    given = {str(a).partition("=")[0] for a in spec.extra_args if str(a).startswith("--")}
    out, i = [], 0
    while i < len(args):  # "--flag value" pairs and lone "--flag"s
        n = 2 if i + 1 < len(args) and not str(args[i + 1]).startswith("--") else 1
        if args[i] not in given:
            out += args[i:i + n]
        i += n
    return out


def launch(spec: VLLMLaunchSpec) -> _http.ServerProcesses:
    """Start the servers (their own process groups); the caller stops them (`.stop()`)."""
    prepare(spec)
    spec.env = spec.server_env()
    procs = _http.ServerProcesses(spec)
    procs.start()
    return procs
