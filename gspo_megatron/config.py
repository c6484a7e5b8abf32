"""Typed configuration. Pure Python: validated before any process group exists."""
from __future__ import annotations

import difflib
import json
import math
import os
import re
import types
import typing
import urllib.parse
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Literal, Optional

import yaml

from gspo_megatron.errors import ConfigError


# Process-group timeout when no setting bounds rank 0's waits (Config.collective_timeout_s), and
# the margin added to the longest bounded wait.
DEFAULT_COLLECTIVE_TIMEOUT_S = 30 * 60.0
COLLECTIVE_TIMEOUT_MARGIN_S = 10 * 60.0


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron-Core parallel layout. dp is derived: world = tp * cp * pp * dp.

    Experts are carved out of the same ranks the way Megatron does it: per pipeline stage the
    tp*cp*dp ranks are re-divided into etp * ep * edp, so ep*etp must divide tp*cp*dp.
    """

    # Tensor parallel size (attention heads, FFN columns and the vocabulary split over tp ranks).
    tp: int = 1
    # Pipeline parallel size (layers split into pp stages).
    pp: int = 1
    # Expert parallel size (each rank holds 1/ep of the experts of every MoE layer).
    ep: int = 1
    # Expert tensor parallel size (each expert's FFN split over etp ranks).
    etp: int = 1
    # Context parallel size (each sequence split over cp ranks in Megatron's zigzag layout; TE
    # attention on GPU, the CPU runtime's attention on CPU).
    cp: int = 1
    # Sequence parallelism inside the TP group (norms / dropout on 1/tp of the tokens); needs tp > 1.
    sequence_parallel: bool = False
    # "auto": cuda when available, else cpu. Backend follows: nccl on cuda, gloo (or shm) on cpu.
    device: str = "auto"
    # Collectives between CPU ranks: "shm" = shared memory for all-gather / reduce-scatter /
    # all-reduce / broadcast / barrier (parallel/shm_collectives.py; ~20x lower latency than gloo's
    # loopback TCP), gloo for the rest; it falls back to gloo where unsupported (not x86-64 Linux).
    # "gloo" = gloo for everything. CUDA runs use NCCL either way.
    cpu_collectives: str = "shm"
    # The number of GPUs (processes) the config is written for; null = any. `--dry-run` and the
    # planner plan for it when no size is given; a run launched on another number says so at
    # start and goes on (checkpoints reshard; only the memory plan was made for this size).
    world_size: Optional[int] = None

    def __post_init__(self):
        for k in ("tp", "pp", "ep", "etp", "cp"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{k} must be a positive integer, got {v!r}")
        w = self.world_size
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise ConfigError(f"parallel.world_size must be a positive integer or null, got {w!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"parallel.device must be auto|cpu|cuda, got {self.device!r}")
        if self.cpu_collectives not in ("shm", "gloo"):
            raise ConfigError(f"parallel.cpu_collectives must be shm|gloo, got {self.cpu_collectives!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")

    def dp(self, world_size: int) -> int:
        self.check_world(world_size)
        return world_size // (self.tp * self.cp * self.pp)

    def edp(self, world_size: int) -> int:
        return (world_size // self.pp) // (self.ep * self.etp)

    def check_world(self, world_size: int) -> None:
        mp = self.tp * self.cp * self.pp
        if world_size % mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {mp}"
            )
        per_stage = world_size // self.pp
        if per_stage % (self.ep * self.etp):
            raise ConfigError(
                f"parallel.ep*etp = {self.ep}*{self.etp} must divide the {per_stage} ranks of a "
                f"pipeline stage (world {world_size} / pp {self.pp})"
            )

    def check_model(
        self,
        *,
        layers: int,
        heads: int,
        kv_heads: int,
        experts: int,
        expert_width: int | None = None,
        training: bool = True,
    ) -> None:
        """The layout against the model's sizes (MoeArch.dims_for_validation gives them)."""
        if heads % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} does not divide the model's {heads} attention heads")
        if kv_heads % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp} does not divide the model's {kv_heads} key/value heads"
            )
        if experts % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide the model's {experts} experts")
        if expert_width is not None and expert_width % self.etp:
            raise ConfigError(
                f"parallel.etp={self.etp} does not divide the experts' width {expert_width}"
            )
        if layers % self.pp:
            raise ConfigError(f"parallel.pp={self.pp} does not divide the model's {layers} layers")
        if training and experts > 0 and self.tp > 1 and not self.sequence_parallel:
            raise ConfigError(
                "MoE training with parallel.tp > 1 requires parallel.sequence_parallel=true "
                "(Megatron-Core's MoE layer assumes sequence-parallel activations under TP)"
            )

    def validate(self, world_size: int, **model_dims) -> None:
        self.check_world(world_size)
        if model_dims:
            self.check_model(**model_dims)


# --------------------------------------------------------------------------------------------
# Everything below: the rest of the typed config, YAML + dotted overrides, validation.
# --------------------------------------------------------------------------------------------


class ConfigWarning(UserWarning):
    """A configuration that works but is probably not what was meant."""


DTYPES = ("float32", "bfloat16", "float16")
LOSS_TYPES = ("gspo", "gspo_token", "grpo", "cispo")
# Clip ranges when the user sets none: GSPO clips a length-normalised sequence ratio, so its
# ranges are ~3 orders of magnitude tighter than GRPO's per-token ones (GSPO paper; verl/TRL).
DEFAULT_EPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27),
               # cispo clips no ratio (loss.cispo_eps_low / _high clip its IS weight): unused
               "cispo": (0.2, 0.27)}
GSPO_EPS_WARN = 0.05  # a GSPO clip range this wide is GRPO-sized: almost nothing gets clipped
GRPO_EPS_WARN = 0.01  # a GRPO clip range this narrow is GSPO-sized: almost everything gets clipped

_REWARD_FN_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _check_urls_file(key: str, section, other_sync: str) -> None:
    """A urls_file: a joining server catches up from the last pushed version directory (disk)."""
    _check_joining_file(f"{key}.urls_file", section.urls_file, section.weight_sync, other_sync)


def _check_joining_file(key: str, path, weight_sync: str, other_sync: str) -> None:
    """A watched file through which servers join mid-run (urls_file, replicas_file): a path, and
    disk sync, since a joining server catches up from the last pushed version directory."""
    if path is None:
        return
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key} must be a path, got {path!r}")
    if weight_sync != "disk":
        raise ConfigError(f"{key} with weight_sync={weight_sync}: a server that joins catches up from the last "
                          f"pushed version directory, which only disk sync writes ({other_sync} sync sends weights "
                          "only from the trainer, to the servers of its group)")


def _check_replicas(v) -> None:
    """rollout.vllm.replicas / replicas_file / max_replicas: launched servers, a count in
    [1, max_replicas]; a replica added mid-run catches up from the last version directory (disk)."""
    _positive("rollout.vllm.replicas", v.replicas)
    _positive("rollout.vllm.max_replicas", v.max_replicas)
    if v.replicas > v.max_replicas:
        raise ConfigError(f"rollout.vllm.replicas={v.replicas} is more than rollout.vllm.max_replicas={v.max_replicas}")
    if (v.replicas != 1 or v.replicas_file is not None) and not v.launch:
        raise ConfigError("rollout.vllm.replicas and replicas_file count launched servers (rollout.vllm.launch=true); "
                          "servers already running are listed in rollout.vllm.urls or urls_file")
    _check_joining_file("rollout.vllm.replicas_file", v.replicas_file, v.weight_sync, "nccl")


def _check_supervision(key: str, section, other_syncs: str) -> None:
    """A rollout.<engine> section's max_restarts, health_interval_s and lost_timeout_s: a server
    brought back must get the pushed weights again, which only disk sync can send to one server
    (its last version directory) while the trainer is busy."""
    if section.max_restarts is not None:
        _positive(f"{key}.max_restarts", section.max_restarts, allow_zero=True)
        if section.max_restarts > 0 and section.weight_sync != "disk":
            raise ConfigError(f"{key}.max_restarts={section.max_restarts} with weight_sync={section.weight_sync}: a "
                              f"restarted server cannot get the pushed weights back ({other_syncs} sync re-sends them "
                              "only from the trainer); use weight_sync=disk for restarts, or max_restarts=0")
    _positive(f"{key}.health_interval_s", section.health_interval_s)
    _positive(f"{key}.lost_timeout_s", section.lost_timeout_s)


def _positive(key: str, v, allow_zero: bool = False) -> None:
    # written so that NaN fails too (every comparison with NaN is false)
    if not (v > 0 or (allow_zero and v == 0)) or (isinstance(v, float) and not math.isfinite(v)):
        raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")


@dataclass(frozen=True)
class ModelConfig:
    # HF checkpoint directory (config.json + safetensors) to start from; null = random init.
    hf_dir: Optional[str] = None
    # Megatron torch_dist checkpoint directory to load weights from (overrides hf_dir weights): a
    # `gspo-convert hf-to-mcore` output or a trainer checkpoint. Its hf_config/ (config.json and
    # tokenizer files) is the architecture and the tokenizer; nothing else needs to be set.
    load: Optional[str] = None
    # Inline HF config fields for a random init when hf_dir/load are unset: the family's config
    # class arguments (model_type picks the family; none: the first family), checked where the
    # config is resolved (gspo_megatron/resolve.py). When a checkpoint gives the architecture,
    # every field listed here must agree with it.
    hf_config: Optional[dict] = None
    # Tokenizer directory; null = load's hf_config/ or hf_dir when they have tokenizer files, else
    # the synthetic task's built-in tokenizer.
    tokenizer: Optional[str] = None
    # Parameter / compute dtype of the policy (Megatron keeps fp32 master weights for 16-bit;
    # float16 adds dynamic loss scaling from 2^16).
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # Seed of the random init (used only without hf_dir / load).
    init_seed: int = 1234
    # MoE load-balancing aux-loss coefficient; 0 = off (what RL peers use).
    moe_aux_loss_coef: float = 0.0
    # Token log-probs straight from the final hidden states and the output-layer shard, never
    # materialising the [tokens, vocab/tp] logits (recomputed block by block in backward): extra
    # memory < 10% of the logits, ~1.15x the time of the unfused head in bf16 (bench_logprobs).
    fused_logprobs: bool = False

    def __post_init__(self):
        _positive("model.moe_aux_loss_coef", self.moe_aux_loss_coef, allow_zero=True)
        if self.hf_dir is None and self.hf_config is None and self.load is None:
            raise ConfigError(
                "model: no architecture: set model.load (a gspo-convert or trainer checkpoint), model.hf_dir "
                "(HF checkpoint dir) or model.hf_config (inline HF config fields)"
            )


@dataclass(frozen=True)
class LoadSource:
    """What model.load's checkpoint holds, read from disk where the run is set up
    (gspo_megatron/resolve.py read_load_source), before any model is built. This module parses
    and validates; it reads no checkpoint format (Megatron-LM roots and trackers, Megatron-Bridge's
    run_config.yaml, Megatron-LM's run arguments are gspo_megatron/checkpoint/'s): importing that
    package from here closed an import circle (config -> checkpoint -> model -> config)."""
    # The torch_dist directory model.load stands for (a Megatron-LM root: the iteration its
    # tracker names, else its newest iter_*).
    directory: str
    # Its hf_config/ (config.json, maybe tokenizer files), when present.
    hf_config_dir: Optional[str] = None
    # (HF config dict, source path) from Megatron-Bridge's run_config.yaml or Megatron-LM's run
    # arguments, for a checkpoint without hf_config/; None when it carries neither.
    carried: Optional[tuple] = None


def _read_json_object(path: str, option: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{option}: {path} does not exist") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{option}: cannot read {path}: {e}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{option}: {path} is not a JSON object")
    return obj


@dataclass(frozen=True)
class LossConfig:
    # gspo: sequence-level ratio, gradient through the sequence mean (paper); gspo_token: verl's
    # token form with the sequence ratio's value; grpo: per-token ratio; cispo: MiniMax-M1's
    # clipped, stop-gradient per-token IS weight times log π, token-level aggregation
    # (algorithms/cispo.py).
    type: Literal["gspo", "gspo_token", "grpo", "cispo"] = "gspo"
    # Clip range [1 - eps_low, 1 + eps_high] of the importance ratio. null = the loss's default:
    # 3e-4 / 4e-4 for gspo and gspo_token, 0.2 / 0.27 for grpo (not used by cispo).
    eps_low: Optional[float] = None
    eps_high: Optional[float] = None
    # KL(π || π_ref) penalty coefficient; > 0 needs a reference model (honoured for every loss).
    kl_coef: float = 0.0
    # Entropy bonus coefficient (added as -coef * entropy to the loss).
    entropy_coef: float = 0.0
    # Where π_old comes from: "engine" = the rollout engine's log-probs (GSPO paper §5.4);
    # "recompute" = one forward-only Megatron pass before the step's first update (the first
    # minibatch takes it from its own update's forward: the same weights, bit for bit). null =
    # recompute for the synchronous loop, engine with rollout.async_steps > 0 (there the engine's
    # log-probs are the behaviour policy's, which a recompute with newer weights is not).
    old_logprobs: Optional[Literal["engine", "recompute"]] = None
    # Truncated importance sampling cap on π_old / π_engine per token; null = off.
    tis_cap: Optional[float] = None
    # Sequence-level mismatch masking [low, high]: a sequence whose mean token log-ratio
    # log π_old - log π_engine (trainer vs rollout engine on the same tokens) lies outside the
    # band leaves the loss (its terms are zeroed; the normaliser stays the minibatch's sequence
    # count); counted in mis_masked. null = off. Needs old_logprobs=recompute. E.g. [-0.05, 0.05].
    mis: Optional[list[float]] = None
    # Async / partial rollouts: response tokens generated more than this many weight versions
    # before the training step leave the loss (masked like prompt tokens; a sequence ratio then
    # averages its remaining tokens). null = keep every token (the sample bound async_steps holds).
    max_token_age: Optional[int] = None
    # loss.type=cispo: its IS weight is clipped to [max(0, 1 - cispo_eps_low), 1 + cispo_eps_high]
    # (stop-gradient). Defaults: no lower bound (the paper) and 0.28 (Trinity-RFT's default).
    cispo_eps_low: float = 1.0
    cispo_eps_high: float = 0.28
    # IcePop [alpha, beta]: a loss token whose train/inference probability ratio π_old / π_engine
    # (trainer vs rollout engine, same tokens) lies outside the band leaves the loss, for every
    # loss type (masked like a prompt token: a sequence ratio averages its other tokens);
    # counted in icepop_masked_frac. null = off. Needs old_logprobs=recompute. E.g. [0.5, 5.0].
    icepop: Optional[list[float]] = None

    def __post_init__(self):
        if self.type == "cispo" and (self.eps_low is not None or self.eps_high is not None):
            raise ConfigError("loss.eps_low / loss.eps_high clip the ratio of gspo, gspo_token and grpo; "
                              "loss.type=cispo clips its IS weight with loss.cispo_eps_low / loss.cispo_eps_high")
        lo_d, hi_d = DEFAULT_EPS[self.type]
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", lo_d)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", hi_d)
        if not 0 < self.eps_low < 1:
            raise ConfigError(f"loss.eps_low must be in (0, 1), got {self.eps_low!r}")
        _positive("loss.eps_high", self.eps_high)
        _positive("loss.kl_coef", self.kl_coef, allow_zero=True)
        if self.max_token_age is not None:
            _positive("loss.max_token_age", self.max_token_age, allow_zero=True)
        if self.tis_cap is not None:
            _positive("loss.tis_cap", self.tis_cap)
        if self.mis is not None and (len(self.mis) != 2 or not self.mis[0] < self.mis[1]):
            raise ConfigError(f"loss.mis must be [low, high] with low < high, got {self.mis!r}")
        _positive("loss.cispo_eps_low", self.cispo_eps_low, allow_zero=True)
        _positive("loss.cispo_eps_high", self.cispo_eps_high, allow_zero=True)
        if self.icepop is not None:
            ok = (isinstance(self.icepop, (list, tuple)) and len(self.icepop) == 2
                  and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                          for x in self.icepop)
                  and 0 < self.icepop[0] <= 1 <= self.icepop[1])
            if not ok:
                raise ConfigError(f"loss.icepop must be [alpha, beta] with 0 < alpha <= 1 <= beta (bounds on the "
                                  f"probability ratio π_old / π_engine), got {self.icepop!r}")
        if self.old_logprobs is not None:
            self.check_old_logprobs()
        if self.type in ("gspo", "gspo_token") and max(self.eps_low, self.eps_high) >= GSPO_EPS_WARN:
            warnings.warn(
                f"loss.type={self.type} with eps_low={self.eps_low}, eps_high={self.eps_high}: "
                f"GSPO clips a sequence-level ratio; GRPO-sized ranges (>= {GSPO_EPS_WARN}) clip "
                "almost nothing (the paper uses 3e-4 / 4e-4)",
                ConfigWarning,
                stacklevel=2,
            )
        if self.type == "grpo" and max(self.eps_low, self.eps_high) < GRPO_EPS_WARN:
            warnings.warn(
                f"loss.type=grpo with eps_low={self.eps_low}, eps_high={self.eps_high}: GSPO-sized "
                "clipping of per-token ratios clips almost every token (GRPO uses ~0.2)",
                ConfigWarning,
                stacklevel=2,
            )

    def check_old_logprobs(self) -> None:
        """The checks that depend on old_logprobs (run once it is resolved: Config)."""
        if self.tis_cap is not None and self.old_logprobs == "engine":
            raise ConfigError(
                "loss.tis_cap needs loss.old_logprobs=recompute (TIS reweights by "
                "π_old/π_engine, which is 1 when π_old is the engine's)"
            )
        if self.icepop is not None and self.old_logprobs == "engine":
            raise ConfigError("loss.icepop needs loss.old_logprobs=recompute (it masks by π_old / π_engine, which is 1 "
                              "when π_old is the engine's)")
        if self.mis is not None and self.old_logprobs == "engine":
            raise ConfigError("loss.mis needs loss.old_logprobs=recompute (it masks by log π_old - log π_engine, "
                              "which is 0 when π_old is the engine's)")
        if self.type == "grpo" and self.old_logprobs == "engine":
            warnings.warn(
                "loss.type=grpo with old_logprobs=engine: token-level ratios are sensitive to "
                "engine/trainer mismatch (MoE routing differs on ~10% of routers); consider "
                "old_logprobs=recompute",
                ConfigWarning,
                stacklevel=2,
            )


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SECRET_PARTS = frozenset({"KEY", "KEYS", "APIKEY", "TOKEN", "TOKENS", "SECRET", "SECRETS", "PASSWORD", "PASSWD",
                           "CREDENTIAL", "CREDENTIALS", "AUTH", "COOKIE", "PRIVATE"})


def secret_like(name: str) -> bool:
    """A variable name with a part (split at '_') that says it holds a secret: HF_TOKEN,
    WANDB_API_KEY, AWS_SECRET_ACCESS_KEY; not TOKENIZERS_PARALLELISM. Asked by the checks below
    and by the launched servers' environment (rollout/http_servers.py server_environment)."""
    return any(part in _SECRET_PARTS for part in name.upper().split("_"))


def _check_env_names(prefix: str, api_key_env: Optional[str], env_vars: list[str]) -> None:
    """`<prefix>.api_key_env` and `<prefix>.env_vars` name environment variables. A value that is
    not a name (a key pasted in by mistake) is refused without being shown; a secret-like name in
    env_vars is refused (a key reaches a server only through api_key_env)."""
    if api_key_env is not None and not _ENV_NAME.match(str(api_key_env)):
        raise ConfigError(f"{prefix}.api_key_env must name an environment variable (letters, digits, '_'); "
                          "the value given is not a name (not shown: is it the key itself?)")
    for name in env_vars:
        if not _ENV_NAME.match(str(name)):
            raise ConfigError(f"{prefix}.env_vars: {str(name)[:40]!r} is not an environment variable name")
        if secret_like(str(name)):
            raise ConfigError(f"{prefix}.env_vars: {name} looks like a secret (KEY/TOKEN/SECRET/...): launched "
                              f"servers get a key only through {prefix}.api_key_env")


def _check_urls(key: str, urls: list[str]) -> None:
    for i, u in enumerate(urls):
        p = urllib.parse.urlsplit(u)
        try:
            port = p.port
        except ValueError:
            port = None
        if p.scheme not in ("http", "https") or not p.hostname or port is None:
            raise ConfigError(f"{key}[{i}] must look like http://host:port, got {u!r}")


@dataclass(frozen=True)
class SGLangConfig:
    # Base URLs of running SGLang servers (http://host:port); used when launch is false.
    urls: list[str] = field(default_factory=list)
    # Instead of urls: a file listing the servers, one URL per line (# comments), watched while the
    # run goes on: a server added joins after a catch-up to the current weights and their version,
    # a server removed gets no new request (its requests in flight finish or fail over); disk sync
    # only (rollout/membership.py). Rewrite it with a rename, never in place.
    urls_file: Optional[str] = None
    # Colocated engines instead of urls: every node's local rank 0 starts GPUs-per-node / (tp*dp)
    # servers on the trainer's own GPUs (--enable-memory-saver); their memory is released while the
    # trainer trains and resumed for the weight push and generation (rollout/colocate.py).
    launch: bool = False
    # Model the servers load at start; null = model.hf_dir.
    model_path: Optional[str] = None
    # Per-server tensor parallel size, data-parallel replicas, expert parallel size (launch only).
    tp: int = 1
    dp: int = 1
    ep: int = 1
    # --mem-fraction-static: fraction of GPU memory for weights + KV cache (launch only).
    mem_fraction: float = 0.7
    # First port of launched servers (server i listens on port + i) and the address they bind.
    port: int = 30000
    host: str = "127.0.0.1"
    # Name of the environment variable holding the Bearer token sent to the servers (and given to
    # launched ones in a file only this user reads, never in their argv); null = none (launched
    # servers bound beyond loopback then get a generated one). A name, never the key: a key in a
    # config would reach config.yaml, the W&B config and the servers' command lines.
    api_key_env: Optional[str] = None
    # More of the trainer's environment variables a launched server inherits, by name, beyond what
    # every server gets (paths, locale, CUDA/NCCL/threads/caches, SGLANG_*: rollout/http_servers.py
    # SERVER_ENV_NAMES / SERVER_ENV_PREFIXES); the rest (keys, W&B, cloud credentials) stays here.
    env_vars: list[str] = field(default_factory=list)
    # Refuse servers whose /server_info "version" is not the SGLang version this project speaks
    # (rollout/sglang_api.py SGLANG_VERSION); false = warn and go on.
    check_version: bool = True
    # How new policy weights reach the servers: "disk" (HF safetensors in shared_dir +
    # update_weights_from_disk), "distributed" (NCCL broadcast group), "tensor" (CUDA IPC
    # handles; servers on the trainer's node).
    weight_sync: Literal["disk", "distributed", "tensor"] = "disk"
    # Weight-sync bucket size, MiB (distributed / tensor).
    bucket_mb: int = 512
    # Timeout of one HTTP request, seconds (generation of a whole batch included).
    request_timeout_s: float = 600.0
    # How long to wait for the servers' /health_generate, seconds.
    ready_timeout_s: float = 900.0
    # Retries of a failed/aborted request before the step fails.
    max_retries: int = 3
    # Concurrent in-flight HTTP requests across all servers.
    concurrency: int = 64
    # Directory visible to trainer and servers for disk sync; null = <out_dir>/weight_sync.
    shared_dir: Optional[str] = None
    # weight_sync=distributed: the TCP store of the weight-update group, hosted by trainer rank 0,
    # which every server rank connects to. null address = the trainer's address on the route to
    # the first server; port 0 = a free port picked at run time (open a fixed one in a firewall).
    sync_address: Optional[str] = None
    sync_port: int = 0
    # Extra command-line arguments for `python -m sglang.launch_server` (launch only).
    extra_args: list[str] = field(default_factory=list)
    # Command that starts one server instead of [this python, -m, sglang.launch_server] (launch
    # only), e.g. [/opt/sglang-venv/bin/python, -m, sglang.launch_server]; the server arguments follow.
    server_command: list[str] = field(default_factory=list)
    # Supervision (rollout/supervision.py): every server is health-checked (GET /health every
    # health_interval_s, and its weight version once weights were pushed). A lost one is restarted
    # (launched servers: by their node's local rank 0) or waited for up to lost_timeout_s (urls),
    # then re-synced (the last pushed weights, labelled with their version) before it serves
    # again, at most max_restarts times per run. null = 3 with weight_sync=disk, else 0 (a lost
    # server stops the run in one line: distributed and tensor sync re-send weights only from the
    # trainer, and an explicit max_restarts > 0 is refused with them).
    max_restarts: Optional[int] = None
    health_interval_s: float = 2.0
    lost_timeout_s: float = 300.0


@dataclass(frozen=True)
class VLLMConfig:
    # Base URLs of running vLLM servers (http://host:port, started with the flags of
    # rollout/vllm_server.py VLLMLaunchSpec); used when launch is false.
    urls: list[str] = field(default_factory=list)
    # Instead of urls: a file listing the servers, watched (as rollout.sglang.urls_file).
    urls_file: Optional[str] = None
    # Start the vLLM server(s) ourselves (trainer rank 0, on its node) and stop them on every exit.
    launch: bool = False
    # Launched servers: how many (server i listens on port + i; on CUDA each takes its own GPUs,
    # its tensor x pipeline x data parallel sizes of them, from rollout.vllm.gpus or else the GPUs
    # after the trainer's), and a file holding the number wanted, watched while the run goes on
    # (rollout/membership.py Replicas): servers added start, then join after a catch-up to the
    # current weights and their version; servers removed leave from the highest index (their
    # requests in flight sent to the others), then stop. The file's number, when it exists at
    # start, replaces replicas; it must stay in [1, max_replicas]. replicas_file: disk sync only.
    replicas: int = 1
    replicas_file: Optional[str] = None
    max_replicas: int = 8
    # Model the servers load at start; null = model.hf_dir.
    model_path: Optional[str] = None
    # Command that starts the server, the arguments follow; empty = the python of the venv that
    # `python -m gspo_megatron.rollout.vllm_env` builds, -m vllm.entrypoints.openai.api_server.
    server_command: list[str] = field(default_factory=list)
    # Port and address of a launched server. vLLM 0.32's --api-key guards only /v1, /v2 and
    # /inference: its control routes (pause, weight reload) are open, so launch binds loopback only.
    port: int = 8000
    host: str = "127.0.0.1"
    # Name of the environment variable holding the Bearer token sent to the servers (and given to a
    # launched one as its VLLM_API_KEY, never in its argv); null = a generated one for a launched
    # server, none for urls. A name, never the key (as rollout.sglang.api_key_env).
    api_key_env: Optional[str] = None
    # More of the trainer's environment variables a launched server inherits, by name (as
    # rollout.sglang.env_vars; VLLM_* are passed already).
    env_vars: list[str] = field(default_factory=list)
    # Refuse servers whose GET /version is not the vLLM version this project speaks
    # (rollout/vllm_api.py VLLM_VERSION); false = warn and go on.
    check_version: bool = True
    # How new policy weights reach the servers: "disk" (HF safetensors in shared_dir, reloaded by
    # the servers through the project's worker extension, rollout/vllm_worker.py; CPU and GPU);
    # "nccl" (vLLM's own weight-transfer engine: trainer rank 0 broadcasts HF-named tensors to
    # every server worker over NCCL; GPUs only, servers started with
    # --weight-transfer-config '{"backend": "nccl"}'; rollout/vllm_nccl.py).
    weight_sync: Literal["disk", "nccl"] = "disk"
    # Directory visible to trainer and servers for disk sync; null = <out_dir>/weight_sync.
    shared_dir: Optional[str] = None
    # Launched server: vLLM's --dtype (auto = the trainer's model.dtype; vLLM's own auto would serve
    # a float32 checkpoint in bfloat16; another dtype than the trainer's is served with a warning),
    # --max-model-len (null = the model's), and on CPU the KV cache size in MiB
    # (--kv-cache-memory-bytes, with --enforce-eager; null = room for 4 sequences of max-model-len
    # tokens, at least 32 MiB: vLLM would take most of the host's memory; ignored on GPUs).
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    max_model_len: Optional[int] = None
    cpu_kv_cache_mb: Optional[int] = None
    # GPUs of a launched server on CUDA (indices as the trainer sees them); they must be disjoint
    # from the trainer's (local rank r holds GPU r). Empty = the GPUs after the trainer's; when the
    # trainer holds every GPU of the node, the launch is refused.
    gpus: list[int] = field(default_factory=list)
    # Timeout of one HTTP request, seconds; how long to wait for the servers' /health; retries of
    # a failed request before the step fails; concurrent in-flight requests across all servers.
    request_timeout_s: float = 600.0
    ready_timeout_s: float = 900.0
    max_retries: int = 3
    concurrency: int = 64
    # A server that exits or fails 3 health checks in a row (GET /health every health_interval_s,
    # also while requests are in flight), or answers with other weights than the pushed ones, is
    # restarted (launched) or waited for up to lost_timeout_s (urls): its requests in flight are
    # cut and re-sent, the last pushed weights reloaded and labelled (rollout/supervision.py). At
    # most max_restarts per run (0 = never: a lost server stops the run in one line); null = 3
    # with weight_sync=disk, 0 with nccl (a restarted server cannot get the weights back over
    # NCCL: an explicit max_restarts > 0 is refused with it).
    max_restarts: Optional[int] = None
    health_interval_s: float = 2.0
    lost_timeout_s: float = 300.0
    # Asynchronous rollouts (rollout.async_steps > 0): a push freezes the requests in flight
    # (/pause?mode=keep), reloads, and continues them under the new weights (their prefixes
    # recomputed, their tokens carrying each version) instead of waiting for them. false = every
    # push waits for the generation in flight (mode=wait).
    push_mid_generation: bool = True
    # More arguments for the launched server (e.g. [--tensor-parallel-size, "4"]).
    extra_args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RolloutConfig:
    # Rollout engine: "hf" = in-process transformers generate (CPU/small); "sglang" = SGLang HTTP;
    # "vllm" = vLLM HTTP (rollout/vllm_engine.py).
    backend: Literal["hf", "sglang", "vllm"] = "hf"
    # Prompts per GSPO step (P) and samples per prompt (G, the group size).
    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    # Sampling settings; top_k = -1 disables top-k.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Maximum response length, tokens.
    max_new_tokens: int = 64
    # Drop groups whose rewards all agree (zero advantage) and over-sample prompts to refill.
    dynamic_sampling: bool = False
    # Extra sampling rounds dynamic sampling may run per step before training on what it has.
    max_oversample_rounds: int = 3
    # Asynchronous rollouts: the batches of up to this many later steps are generated while the
    # current step trains (rank 0's rollout thread); a sample is never more than async_steps
    # weight versions old (older ones are dropped and counted). 0 = the synchronous loop.
    async_steps: int = 0
    # Bound on the trainer's wait for an async batch, seconds (a hung engine fails the run).
    async_timeout_s: float = 3600.0
    # Partial rollouts (needs async_steps >= 1): a weight push interrupts the generation in
    # progress instead of waiting for it; unfinished responses continue from their partial output
    # with the new weights. Every token records the version that generated it and its engine
    # log-prob under that policy (rollout/partial.py).
    partial: bool = False
    # The engine returns the experts it routed every token to (SGLang: --enable-return-routed-experts);
    # the trainer then reports routing_agreement every step. Implied by train.routing_replay=rollout.
    return_routing: bool = False
    # Multi-turn / agentic rollouts: "package.module:function" called once per sample with the
    # prompt's record and a session (rollout/agent.py: session.generate() continues the session's
    # token ids, session.append() adds environment tokens that are never trained on); it returns
    # the reward, or None to score the session's text with reward.fn. null = single-turn.
    agent: Optional[str] = None
    # What one step's rollout does: "package.module:function" called on rank 0 once per step with a
    # RolloutContext and the step, returning a RolloutBatch (rollout/drivers.py; docs/rollout_drivers.md).
    # null = the built-in one: gspo_megatron.rollout.drivers:agent when rollout.agent is set, else
    # gspo_megatron.rollout.drivers:single_turn. async_steps and partial apply to any driver.
    driver: Optional[str] = None
    # An agent session's total response budget in tokens (policy + environment tokens); reaching it
    # ends the session with finish_reason "length". null = max_new_tokens. Each session.generate()
    # call samples at most max_new_tokens.
    max_response_tokens: Optional[int] = None
    # Agent sessions running at once (each in its own thread; their engine requests are batched).
    agent_concurrency: int = 64
    # A session running longer than this (agent or tool hung) gets reward 0, counted in agent_errors.
    agent_timeout_s: float = 600.0
    # How agent sessions' engine requests are batched. null (default): a turn goes to the engine
    # once every running session waits for it or has ended, so the batches, and with the run's seed
    # the samples, are the same in every run on any machine; a slow tool holds the turn back (up to
    # agent_timeout_s). A number of seconds: a batch also goes once its oldest request has waited
    # that long, so a slow tool does not hold the others back, and the batches then depend on
    # timing (a loaded machine samples other tokens).
    agent_linger_s: Optional[float] = None
    # Engine responses are checked at the boundary (at most max_new_tokens tokens, ids in the
    # vocabulary, one finite log-prob <= 0 per token); a violating one is dropped and counted in
    # engine_rejected. A step that loses more than this fraction of its samples so stops the run
    # with one line naming the server.
    max_rejected_frac: float = 0.5
    # Verified refits (train/refit_check.py): after each checked weight push, every engine server
    # scores a fixed probe sequence and its log-probs are compared with the trainer's of the same
    # tokens; a mean |difference| above verify_logprob_tol stops the run in one line naming the
    # server. Engines that can also digest what they loaded (vLLM with weight_sync=disk) check
    # every tensor, and a mismatch names it. Checked: the run's first push and then every
    # verify_every-th weight version.
    verify_weights: bool = False
    verify_every: int = 1
    # Mean |engine - trainer| log-prob over the probe's tokens. Both sides in float32 agree to ~1e-6;
    # a bf16 engine against the trainer's bf16 model differs by ~1e-2 on real models (round-off),
    # a wrong or missing tensor by far more.
    verify_logprob_tol: float = 0.05
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    @property
    def driver_spec(self) -> str:
        """The rollout driver this run calls (rollout.driver, else the built-in one)."""
        if self.driver is not None:
            return self.driver
        return f"gspo_megatron.rollout.drivers:{'agent' if self.agent else 'single_turn'}"

    def __post_init__(self):
        _positive("rollout.prompts_per_step", self.prompts_per_step)
        if self.samples_per_prompt < 2:
            raise ConfigError(
                f"rollout.samples_per_prompt must be >= 2 (advantages are normalised within a "
                f"group), got {self.samples_per_prompt}"
            )
        _positive("rollout.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ConfigError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        _positive("rollout.max_new_tokens", self.max_new_tokens)
        _positive("rollout.max_oversample_rounds", self.max_oversample_rounds, allow_zero=True)
        _positive("rollout.async_steps", self.async_steps, allow_zero=True)
        _positive("rollout.async_timeout_s", self.async_timeout_s)
        if self.agent is not None and (not isinstance(self.agent, str) or self.agent.count(":") != 1):
            raise ConfigError(f"rollout.agent must look like 'package.module:function', got {self.agent!r}")
        if self.driver is not None and (not isinstance(self.driver, str) or self.driver.count(":") != 1):
            raise ConfigError(f"rollout.driver must look like 'package.module:function', got {self.driver!r}")
        if self.max_response_tokens is not None:
            _positive("rollout.max_response_tokens", self.max_response_tokens)
        _positive("rollout.agent_concurrency", self.agent_concurrency)
        _positive("rollout.agent_timeout_s", self.agent_timeout_s)
        if self.agent_linger_s is not None:
            _positive("rollout.agent_linger_s", self.agent_linger_s)
        _positive("rollout.verify_every", self.verify_every)
        _positive("rollout.verify_logprob_tol", self.verify_logprob_tol)
        if not 0 <= self.max_rejected_frac <= 1:
            raise ConfigError(f"rollout.max_rejected_frac must be in [0, 1], got {self.max_rejected_frac!r}")
        if self.partial and not self.async_steps:
            raise ConfigError("rollout.partial needs rollout.async_steps >= 1 (weight pushes interrupt the "
                              "generations of the rollout thread; the synchronous loop never pushes mid-generation)")
        if self.backend == "sglang":
            self._check_sglang()
        if self.backend == "vllm":
            self._check_vllm()

    @property
    def response_budget(self) -> int:
        """Longest response in tokens: max_new_tokens, or an agent session's max_response_tokens."""
        if self.agent and self.max_response_tokens is not None:
            return self.max_response_tokens
        return self.max_new_tokens

    def _check_vllm(self):
        v = self.vllm
        if bool(v.urls) + bool(v.launch) + bool(v.urls_file) != 1:
            raise ConfigError("rollout.backend=vllm needs one of rollout.vllm.urls=[http://host:port,...] (running "
                              "servers), rollout.vllm.urls_file (a file listing them, watched) or "
                              "rollout.vllm.launch=true, not both")
        _check_urls_file("rollout.vllm", v, "nccl")
        _check_replicas(v)
        _check_urls("rollout.vllm.urls", v.urls)
        _check_env_names("rollout.vllm", v.api_key_env, v.env_vars)
        if v.launch and v.host not in ("127.0.0.1", "localhost", "::1"):
            raise ConfigError(f"rollout.vllm.host={v.host!r}: a launched vLLM server binds loopback only (vLLM 0.32's "
                              "--api-key leaves its pause / weight-reload routes open)")
        if not 1 <= v.port <= 65535:
            raise ConfigError(f"rollout.vllm.port must be in [1, 65535], got {v.port!r}")
        for k in ("concurrency",):
            _positive(f"rollout.vllm.{k}", getattr(v, k))
        _positive("rollout.vllm.request_timeout_s", v.request_timeout_s)
        _positive("rollout.vllm.ready_timeout_s", v.ready_timeout_s)
        _positive("rollout.vllm.max_retries", v.max_retries, allow_zero=True)
        _check_supervision("rollout.vllm", v, "nccl")
        for k in ("max_model_len", "cpu_kv_cache_mb"):
            if getattr(v, k) is not None:
                _positive(f"rollout.vllm.{k}", getattr(v, k))
        if v.gpus and not v.launch:
            raise ConfigError("rollout.vllm.gpus places a launched server (rollout.vllm.launch=true); running servers "
                              "(rollout.vllm.urls) choose their own GPUs")
        bad_gpu = any(isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in v.gpus)
        if bad_gpu or len(set(v.gpus)) < len(v.gpus):
            raise ConfigError(f"rollout.vllm.gpus must be distinct GPU indices >= 0, got {list(v.gpus)!r}")
        # vLLM reports processed log-probs after top-p / top-k renormalisation (v1/sample/ops/
        # topk_topp_sampler.py): they would no longer be log_softmax(logits / T), which the
        # trainer's π_old and mismatch metrics compare against
        if self.top_p != 1.0 or self.top_k != -1:
            raise ConfigError("rollout.backend=vllm needs rollout.top_p=1 and rollout.top_k=-1 (vLLM reports "
                              "log-probs renormalised over the truncated distribution)")
        if self.return_routing:
            raise ConfigError("rollout.return_routing with rollout.backend=vllm: vLLM 0.32 returns routed experts "
                              "only with Model Runner V2 (not on CPU); use sglang, or leave routing to the trainer")

    def _check_sglang(self):
        s = self.sglang
        if bool(s.urls) + bool(s.launch) + bool(s.urls_file) > 1:
            raise ConfigError(
                "rollout.sglang: set one of urls (servers already running), urls_file (a file listing them, "
                "watched) or launch=true (start them ourselves), not both"
            )
        if not s.urls and not s.launch and not s.urls_file:
            raise ConfigError(
                "rollout.backend=sglang needs rollout.sglang.urls=[http://host:port,...], "
                "rollout.sglang.urls_file or rollout.sglang.launch=true"
            )
        _check_urls_file("rollout.sglang", s, "distributed")
        _check_urls("rollout.sglang.urls", s.urls)
        _check_env_names("rollout.sglang", s.api_key_env, s.env_vars)
        for k in ("tp", "dp", "ep", "bucket_mb", "concurrency"):
            _positive(f"rollout.sglang.{k}", getattr(s, k))
        if not 0 < s.mem_fraction < 1:
            raise ConfigError(f"rollout.sglang.mem_fraction must be in (0, 1), got {s.mem_fraction!r}")
        if not 1 <= s.port <= 65535:
            raise ConfigError(f"rollout.sglang.port must be in [1, 65535], got {s.port!r}")
        if not 0 <= s.sync_port <= 65535:
            raise ConfigError(f"rollout.sglang.sync_port must be 0 (a free port) or in [1, 65535], got {s.sync_port!r}")
        _positive("rollout.sglang.request_timeout_s", s.request_timeout_s)
        _positive("rollout.sglang.ready_timeout_s", s.ready_timeout_s)
        _positive("rollout.sglang.max_retries", s.max_retries, allow_zero=True)
        _check_supervision("rollout.sglang", s, "distributed or tensor")
        if s.weight_sync == "tensor" and not s.launch:
            raise ConfigError(
                "rollout.sglang.weight_sync=tensor passes CUDA IPC handles and needs colocated "
                "servers (rollout.sglang.launch=true); use disk or distributed for remote urls"
            )
        if s.weight_sync == "distributed" and s.launch:
            # rank 0's GPU is also server 0's TP rank 0: one NCCL communicator cannot hold a GPU
            # twice ("Duplicate GPU detected"; SGLang's weight-update group joins the trainer's
            # rank 0 with every server rank, weight_updater.py init_weights_update_group)
            raise ConfigError(
                "rollout.sglang.weight_sync=distributed cannot work with colocated servers "
                "(rollout.sglang.launch=true: trainer rank 0 and server 0 share a GPU, which one NCCL group "
                "refuses); use weight_sync=tensor (CUDA IPC, one node) or disk (a shared filesystem, any nodes)"
            )


@dataclass(frozen=True)
class DataConfig:
    # Prompt source: "synthetic" (generated task, verifiable answers) or "file" (JSONL/parquet).
    source: Literal["synthetic", "file"] = "synthetic"
    # Dataset file for source=file (relative paths are relative to the working directory); set
    # with source=synthetic it is an error, not ignored.
    path: Optional[str] = None
    # Record fields holding the prompt and the reference answer (source=file).
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # Synthetic task name (source=synthetic).
    task: str = "sort"
    # Seed of prompt generation / shuffling.
    seed: int = 0
    # Longest prompt in tokens (after the chat template); null = the model's maximum
    # positions - rollout.max_new_tokens.
    max_prompt_tokens: Optional[int] = None
    # What happens to a longer prompt: "skip" it (counted in data_skipped) or "truncate" it to its
    # last max_prompt_tokens tokens (the chat template's generation prompt is at the end).
    long_prompts: Literal["skip", "truncate"] = "skip"
    # A record larger than this many bytes (its JSONL line; a parquet row's or JSON-array element's
    # prompt + answer text in UTF-8) is skipped (counted in data_skipped) before it is parsed or
    # tokenized; --dry-run names it with its file and line.
    max_record_bytes: int = 4 * 1024 * 1024

    def __post_init__(self):
        _positive("data.max_record_bytes", self.max_record_bytes)
        if self.max_prompt_tokens is not None:
            _positive("data.max_prompt_tokens", self.max_prompt_tokens)
        if self.source == "file" and not self.path:
            raise ConfigError("data.source=file needs data.path")
        if self.source == "synthetic" and self.path:
            raise ConfigError(f"data.path={self.path} is set but data.source=synthetic (the default): set "
                              "data.source=file to train on it, or drop data.path")
        for k in ("prompt_key", "answer_key", "task"):
            if not getattr(self, k):
                raise ConfigError(f"data.{k} must be a non-empty string")


@dataclass(frozen=True)
class RewardServerConfig:
    # A reward server the trainer launches (reward.judge.launch, reward.model.launch): a vLLM
    # server of the project's vLLM venv (rollout/reward_servers.py) on 127.0.0.1 at this port,
    # with a generated key; vLLM's --dtype, --max-model-len (null = the model's) and on CPU its KV
    # cache in MiB (null = as rollout.vllm.cpu_kv_cache_mb's default).
    port: int = 8100
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = "auto"
    max_model_len: Optional[int] = None
    cpu_kv_cache_mb: Optional[int] = None
    # More arguments for the server; the command that starts it instead of the venv's python
    # -m vllm.entrypoints.openai.api_server (the arguments follow).
    extra_args: list[str] = field(default_factory=list)
    server_command: list[str] = field(default_factory=list)
    # How long to wait for it to answer GET /health, seconds; it is health-checked every
    # health_interval_s and restarted when it exits or stops answering, at most max_restarts times
    # (rollout/supervision.py: the engines' supervisor).
    ready_timeout_s: float = 900.0
    health_interval_s: float = 2.0
    max_restarts: int = 3

    def check(self, key: str) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"{key}.port must be in [1, 65535], got {self.port!r}")
        for k in ("max_model_len", "cpu_kv_cache_mb"):
            if getattr(self, k) is not None:
                _positive(f"{key}.{k}", getattr(self, k))
        _positive(f"{key}.ready_timeout_s", self.ready_timeout_s)
        _positive(f"{key}.health_interval_s", self.health_interval_s)
        _positive(f"{key}.max_restarts", self.max_restarts, allow_zero=True)


def _check_reward_server(key: str, url, launch: bool, model_path, server: RewardServerConfig) -> None:
    if url is not None and launch:
        raise ConfigError(f"{key}: set url (a running server) or launch=true (the trainer starts one), not both")
    if launch:
        if not model_path:
            raise ConfigError(f"{key}.launch=true needs {key}.model_path (the model the server loads)")
        server.check(f"{key}.server")


@dataclass(frozen=True)
class JudgeConfig:
    # An LLM judge behind an OpenAI-compatible chat API (rollout/judge.py): the server's root URL
    # (POST <url>/v1/chat/completions), e.g. a vLLM or SGLang server. null = no judge (unless launch).
    url: Optional[str] = None
    # Instead of url: the trainer starts the judge, a vLLM server on model_path (reward.judge.server),
    # supervised like an engine's.
    launch: bool = False
    model_path: Optional[str] = None
    server: RewardServerConfig = field(default_factory=lambda: RewardServerConfig(port=8200))
    # The "model" field of every request (the served model's name).
    model: str = "judge"
    # Name of the environment variable holding the API key (sent as a Bearer token); null = none.
    api_key_env: Optional[str] = None
    # The user message: {prompt}, {response} and {answer} are replaced by the record's prompt, the
    # sampled response and the record's answer.
    template: str = ("Rate the response to the question from 0 to 10. Answer with the number only.\n"
                     "Question: {prompt}\nReference answer: {answer}\nResponse: {response}\nScore:")
    # The score: the first match of score_regex in the answer (its first group, else the whole
    # match), or with score_json_field the answer parsed as JSON and that field.
    # The default reads a decimal number with an optional exponent ("8.5e-1" is 0.85, "1e309" is
    # not finite: a failed sample, as every non-finite score is).
    score_regex: str = "(-?\\d+(?:\\.\\d+)?(?:[eE][-+]?\\d+)?)"
    score_json_field: Optional[str] = None
    # Requests in flight at once; the budget of one sample's attempts together, seconds; retries
    # of a connection error, timeout, HTTP 429 or 5xx within it.
    max_concurrency: int = 8
    timeout_s: float = 60.0
    retries: int = 2
    # The judge's answer length in tokens (temperature 0).
    max_tokens: int = 16
    # More request fields, as a JSON object merged into every request (the OpenAI clients'
    # extra_body), e.g. '{"structured_outputs": {"regex": "[0-9]"}}' to make a vLLM judge answer a
    # digit (on the command line, quote it: reward.judge.extra_body='{...}'). null = none.
    extra_body: Optional[str] = None
    # reward = reward.fn_weight * reward.fn + weight * judge score.
    weight: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.url is not None or self.launch

    def __post_init__(self):
        _check_reward_server("reward.judge", self.url, self.launch, self.model_path, self.server)
        if not self.enabled:
            return
        if self.url is not None:
            _check_urls("reward.judge.url", [self.url])
        _check_env_names("reward.judge", self.api_key_env, [])
        _positive("reward.judge.max_concurrency", self.max_concurrency)
        _positive("reward.judge.timeout_s", self.timeout_s)
        _positive("reward.judge.retries", self.retries, allow_zero=True)
        _positive("reward.judge.max_tokens", self.max_tokens)
        if not math.isfinite(self.weight):
            raise ConfigError(f"reward.judge.weight must be finite, got {self.weight!r}")
        if not any(k in self.template for k in ("{response}",)):
            raise ConfigError("reward.judge.template must contain {response} (the sampled response to judge)")
        if self.extra_body is not None:
            try:
                extra = json.loads(self.extra_body)
            except ValueError as e:
                raise ConfigError(f"reward.judge.extra_body is not JSON: {e}") from None
            if not isinstance(extra, dict):
                raise ConfigError(f"reward.judge.extra_body must be a JSON object, got {self.extra_body!r}")
            clash = sorted(set(extra) & {"model", "messages"})
            if clash:
                raise ConfigError(f"reward.judge.extra_body cannot set {clash} (the judge sends them)")
        if self.score_json_field is None:
            try:
                re.compile(self.score_regex)
            except re.error as e:
                raise ConfigError(f"reward.judge.score_regex {self.score_regex!r} is not a regular expression: {e}")


@dataclass(frozen=True)
class RewardModelConfig:
    # A served sequence-classification reward model (rollout/reward_servers.py): the server's root
    # URL (vLLM: POST <url>/classify). null = none (unless launch).
    url: Optional[str] = None
    # Instead of url: the trainer starts it, a vLLM pooling server on model_path
    # (reward.model.server), supervised like an engine's.
    launch: bool = False
    model_path: Optional[str] = None
    server: RewardServerConfig = field(default_factory=RewardServerConfig)
    # The "model" field of every request (the served model's name; a launched server serves
    # model_path under it).
    model: str = "reward"
    # Name of the environment variable holding the API key (sent as a Bearer token); null = none.
    api_key_env: Optional[str] = None
    # The text scored: {prompt}, {response} and {answer} are replaced by the record's prompt, the
    # sampled response and the record's answer.
    template: str = "{prompt}{response}"
    # The output of the classifier that is the reward (its raw value: use_activation=false); a
    # reward model has one (0).
    label: int = 0
    # Texts per request; requests in flight at once; the budget of one request's attempts
    # together, seconds; retries of a connection error, timeout, HTTP 429 or 5xx within it.
    batch_size: int = 32
    max_concurrency: int = 4
    timeout_s: float = 60.0
    retries: int = 2
    # reward = reward.fn_weight * reward.fn + reward.judge.weight * judge + weight * this model's score.
    weight: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.url is not None or self.launch

    def __post_init__(self):
        _check_reward_server("reward.model", self.url, self.launch, self.model_path, self.server)
        if not self.enabled:
            return
        if self.url is not None:
            _check_urls("reward.model.url", [self.url])
        _check_env_names("reward.model", self.api_key_env, [])
        for k in ("batch_size", "max_concurrency", "timeout_s"):
            _positive(f"reward.model.{k}", getattr(self, k))
        _positive("reward.model.retries", self.retries, allow_zero=True)
        _positive("reward.model.label", self.label, allow_zero=True)
        if not math.isfinite(self.weight):
            raise ConfigError(f"reward.model.weight must be finite, got {self.weight!r}")
        if "{response}" not in self.template:
            raise ConfigError("reward.model.template must contain {response} (the sampled response to score)")


@dataclass(frozen=True)
class RewardConfig:
    # null = the synthetic task's own reward; "math" = built-in math-verify reward;
    # otherwise "package.module:function" (imported by the trainer).
    fn: Optional[str] = None
    # Worker processes scoring in parallel (0 = one call at a time in a helper thread of rank 0).
    workers: int = 0
    # Bound on one reward call, seconds: a call past it scores 0 (and counts as failed).
    timeout_s: float = 60.0
    # Largest fraction of a rollout's samples whose reward call may fail (raise, return a
    # non-number, time out) before the run stops with one line naming the first failure.
    max_error_frac: float = 0.5
    # An LLM judge as a reward source (rollout/judge.py).
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    # A served reward model as a reward source (rollout/reward_servers.py).
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    # Weight of reward.fn (or the task's reward) in the sum with the judge's and the reward
    # model's. null = 1 without either, 0 with one (they replace it; the function is then not called).
    fn_weight: Optional[float] = None

    @property
    def served(self) -> bool:
        """A judge or a reward model scores the samples."""
        return self.judge.enabled or self.model.enabled

    def __post_init__(self):
        if self.fn_weight is not None and not math.isfinite(self.fn_weight):
            raise ConfigError(f"reward.fn_weight must be finite, got {self.fn_weight!r}")
        if self.fn_weight is not None and self.fn_weight != 0 and not self.served and self.fn_weight != 1:
            warnings.warn("reward.fn_weight without reward.judge or reward.model only scales the rewards (advantages are "
                          "normalised per group: it changes nothing)", ConfigWarning, stacklevel=2)
        _positive("reward.workers", self.workers, allow_zero=True)
        _positive("reward.timeout_s", self.timeout_s)
        if not 0 <= self.max_error_frac <= 1:
            raise ConfigError(f"reward.max_error_frac must be in [0, 1], got {self.max_error_frac!r}")
        if self.fn is not None and self.fn != "math" and not _REWARD_FN_RE.match(self.fn):
            raise ConfigError(
                f"reward.fn must be null, 'math' or 'module.path:function', got {self.fn!r}"
            )


@dataclass(frozen=True)
class OptimizerConfig:
    # Adam learning rate after warmup.
    lr: float = 1e-6
    # Floor of the decay schedule (linear / cosine decay to it at train.max_steps).
    min_lr: float = 0.0
    # LR schedule after warmup: constant | linear | cosine (decays to min_lr at train.max_steps).
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    # Decoupled weight decay (AdamW).
    weight_decay: float = 0.01
    # Adam's first-moment decay.
    adam_beta1: float = 0.9
    # Adam's second-moment decay.
    adam_beta2: float = 0.98
    # Adam's denominator epsilon.
    adam_eps: float = 1e-8
    # Global gradient-norm clip; 0 = off.
    clip_grad: float = 1.0
    # Linear LR warmup, optimizer steps.
    warmup_steps: int = 0
    # Shard fp32 master weights and Adam states over the data-parallel ranks (Megatron's
    # distributed optimizer / ZeRO-1).
    use_distributed_optimizer: bool = True
    # Keep main gradients and their DP reduction in fp32 (false halves gradient memory).
    grad_reduce_in_fp32: bool = True

    def __post_init__(self):
        _positive("optimizer.lr", self.lr)
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"optimizer.min_lr must be in [0, lr={self.lr}], got {self.min_lr!r}")
        _positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        for k in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, k) < 1:
                raise ConfigError(f"optimizer.{k} must be in [0, 1), got {getattr(self, k)!r}")
        _positive("optimizer.adam_eps", self.adam_eps)
        _positive("optimizer.clip_grad", self.clip_grad, allow_zero=True)
        _positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)


@dataclass(frozen=True)
class TrainConfig:
    # GSPO steps (one rollout batch each).
    max_steps: int = 100
    # Optimizer steps per rollout batch (the GSPO paper uses 4).
    minibatches_per_step: int = 4
    # Token budget of one packed microbatch (per data-parallel rank, before the CP split).
    micro_batch_tokens: int = 8192
    # Seed of sampling, shuffling and dropout.
    seed: int = 42
    # Supervised warm start on the task's demonstrations before GSPO, optimizer steps; 0 = off.
    sft_warmup_steps: int = 0
    # Learning rate of the SFT warm start.
    sft_lr: float = 1e-4
    # Activation recompute: none; selective (Megatron selective recompute of core attention,
    # MoE activation and layernorms); full (each layer recomputed from its input).
    recompute: Literal["none", "selective", "full"] = "none"
    # Pack each microbatch's sequences into one THD row (attention stays within each sequence;
    # padding only to what CP and SP need); false = right-padded [b, s] rows.
    packing: bool = True
    # MoE routing replay (Megatron's RouterReplay): none; old (R2: the π_old pass records each
    # layer's top-k experts, the updates on the same samples replay them); rollout (R3: the
    # rollout engine's experts are replayed in the π_old pass and the updates).
    routing_replay: Literal["none", "old", "rollout"] = "none"
    # An optimizer step (update) whose loss or gradient norm is not finite is skipped: the weights,
    # Adam's moments and the LR schedule stay as they were (counted per GSPO step in
    # skipped_updates; a GSPO step makes minibatches_per_step updates; with model.dtype=float16 an
    # update whose scaled gradient overflowed is one, while the loss scale backs off). This many skipped in a row
    # stop the run with one line; the last checkpoint holds nothing non-finite, resume from it.
    max_skipped_steps: int = 10

    def __post_init__(self):
        _positive("train.max_steps", self.max_steps, allow_zero=True)
        _positive("train.max_skipped_steps", self.max_skipped_steps)
        _positive("train.minibatches_per_step", self.minibatches_per_step)
        _positive("train.micro_batch_tokens", self.micro_batch_tokens)
        _positive("train.sft_warmup_steps", self.sft_warmup_steps, allow_zero=True)
        _positive("train.sft_lr", self.sft_lr)


@dataclass(frozen=True)
class CheckpointConfig:
    # Save every `interval` steps (and at the end); 0 = only at the end.
    interval: int = 50
    # "auto": resume from the latest checkpoint in out_dir if any; "never"; or a checkpoint path.
    resume: str = "auto"
    # Checkpoints kept in out_dir (older ones deleted after a successful save); 0 = keep all.
    keep_last: int = 2
    # Export the final policy as an HF checkpoint to <out_dir>/hf.
    export_hf: bool = False
    # Signals that make the run save a checkpoint at the end of the step in progress and exit
    # with status 143 (preemption: Slurm sends them ahead of the kill; the launch scripts forward
    # them through torchrun); [] = die at once as before.
    save_on_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])
    # A checkpoint without checksums.json (saved by an earlier version, or by another tool) is
    # loaded with a warning naming the folder; true = refused. Checksums are verified before any
    # file of the folder is parsed, by every loader (resume, model.load, score --load, mcore-to-hf).
    require_checksums: bool = False
    # Write checkpoints in the background: the step blocks only while this rank's shard is copied
    # into host memory (one extra copy of it at most: one write in flight); the tracker names a
    # checkpoint once its write is complete. Needs optimizer.use_distributed_optimizer=true
    # (train/async_save.py; docs/checkpoints.md).
    async_save: bool = False

    def __post_init__(self):
        _positive("checkpoint.interval", self.interval, allow_zero=True)
        _positive("checkpoint.keep_last", self.keep_last, allow_zero=True)
        import signal

        for name in self.save_on_signals:
            if name not in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP") or not hasattr(signal, name):
                raise ConfigError(f"checkpoint.save_on_signals: {name!r} is not one of SIGTERM, SIGUSR1, SIGUSR2, "
                                  "SIGINT, SIGHUP")
        if not self.resume:
            raise ConfigError("checkpoint.resume must be auto, never or a checkpoint path")


@dataclass(frozen=True)
class WandbConfig:
    # Weights & Biases tracking (the optional `wandb` extra: pip install -e ".[wandb]"):
    # disabled | offline (a run directory under <out_dir>/wandb, `wandb sync` it later) | online.
    mode: Literal["disabled", "offline", "online"] = "disabled"
    # W&B project.
    project: str = "gspo-megatron"
    # W&B entity (team or user); null = the account's default.
    entity: Optional[str] = None
    # Display name of the run; null = the name of out_dir.
    name: Optional[str] = None

    def __post_init__(self):
        if not self.project:
            raise ConfigError("logging.wandb.project must be a non-empty name")


@dataclass(frozen=True)
class LoggingConfig:
    # TensorBoard event files in <out_dir>/tb.
    tensorboard: bool = False
    # A tqdm progress bar on rank 0.
    progress_bar: bool = True
    # Plot reward / loss curves to <out_dir>/metrics.png at the end.
    plot: bool = False
    # Write each step's trained prompts (their text, one per kept group) into metrics.jsonl
    # under "prompts" (data audits: which records a run trained on, across resumes).
    prompts: bool = False
    # Every metrics.jsonl row (its numbers) also goes to W&B, x-axis "step"; the run id is kept in
    # the checkpoint, so a resumed run continues the same W&B run (train/tracking.py).
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(frozen=True)
class EvalSetConfig:
    # One more held-out set (eval.extra_sets): the same keys as the first set's in `eval:`.
    name: str
    source: Literal["synthetic", "file"] = "synthetic"
    path: Optional[str] = None
    seed: int = 1000003
    num_prompts: int = 32

    def __post_init__(self):
        _check_eval_set(self, "eval.extra_sets[]")


def _check_eval_set(e, key: str) -> None:
    _positive(f"{key}.num_prompts", e.num_prompts)
    if e.source == "file" and not e.path:
        raise ConfigError(f"{key}.source=file needs {key}.path")
    if e.source == "synthetic" and e.path:
        raise ConfigError(f"{key}.path={e.path} is set but {key}.source=synthetic: set {key}.source=file")
    if not e.name or "/" in e.name:
        raise ConfigError(f"{key}.name must be a non-empty name without '/', got {e.name!r}")


@dataclass(frozen=True)
class EvalConfig:
    # Held-out evaluation every this many GSPO steps, and at step 0 and the end; 0 = off.
    interval: int = 0
    # Samples per prompt (n): pass@k is reported for k = 1, 2, 4, ... < n and n.
    samples_per_prompt: int = 4
    # Sampling temperature of evaluation (its log-probs are not used).
    temperature: float = 1.0
    # Name of the set in the metric keys: eval/<name>/pass@1.
    name: str = "heldout"
    # Held-out prompts: "synthetic" = data.task drawn with eval.seed (not data.seed); "file" =
    # the first num_prompts usable records of eval.path (same formats, keys and checks as
    # data.path; the records training would skip are skipped and named in a warning).
    source: Literal["synthetic", "file"] = "synthetic"
    path: Optional[str] = None
    # Seed of the held-out synthetic prompts and of evaluation's sampling (never the training RNG).
    seed: int = 1000003
    # Prompts evaluated each time.
    num_prompts: int = 32
    # A sample is correct when its reward reaches this (the synthetic tasks and reward.fn=math
    # give 1.0 for a correct answer).
    correct_threshold: float = 1.0
    # More held-out sets, each {name, source, path, seed, num_prompts}, evaluated at the same
    # steps with the same samples_per_prompt / temperature, reported under eval/<name>/.
    extra_sets: list[EvalSetConfig] = field(default_factory=list)

    def __post_init__(self):
        _positive("eval.interval", self.interval, allow_zero=True)
        _positive("eval.samples_per_prompt", self.samples_per_prompt)
        if self.temperature < 0:
            raise ConfigError(f"eval.temperature must be >= 0, got {self.temperature}")
        _check_eval_set(self, "eval")
        names = [self.name, *(x.name for x in self.extra_sets)]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"eval: held-out set names must differ; {', '.join(dup)} appears more than once")


LORA_TARGETS = ("attention", "mlp", "shared_experts", "experts")  # model/lora.py TARGETS


@dataclass(frozen=True)
class LoraConfig:
    # LoRA rank r of every adapter; 0 = off (full-parameter training). On: the policy's weights are
    # frozen and only the adapters W x + (alpha / r) B A x train (model/lora.py; docs/lora.md).
    rank: int = 0
    # Scale numerator: an adapter adds (alpha / rank) B A.
    alpha: float = 32.0
    # Dropout on an adapter's input (training passes only; the log-probs of pi_old, the reference
    # and the engine see none).
    dropout: float = 0.0
    # Which linears get adapters: attention (every projection of self-attention), mlp (dense
    # layers' MLP), shared_experts, experts (one adapter per routed expert). Routers never.
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))

    def __post_init__(self):
        _positive("lora.rank", self.rank, allow_zero=True)
        if not self.rank:
            return
        _positive("lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if not self.target_modules:
            raise ConfigError(f"lora.target_modules is empty; one or more of {list(LORA_TARGETS)}")
        for t in self.target_modules:
            if t not in LORA_TARGETS:
                why = " (routers are never adapted: their top-k would change under the rollout engine)" \
                    if "router" in str(t) or "gate" == t else ""
                raise ConfigError(f"lora.target_modules: {t!r} is not one of {list(LORA_TARGETS)}{why}")
        dup = sorted({t for t in self.target_modules if self.target_modules.count(t) > 1})
        if dup:
            raise ConfigError(f"lora.target_modules: {', '.join(dup)} appears more than once")


@dataclass(frozen=True)
class ScaleConfig:
    # What `--simulate` (train/simulate.py) checks a layout against; training never reads it.
    # GPUs per node: the per-node totals, and which transfers of a weight push stay inside a node.
    gpus_per_node: int = 8
    # Budgets per node, GiB: --simulate fails in one line when a node's GPU memory (weights,
    # gradients, optimizer, digest and push peaks, the planner's activations; each GPU also within
    # its share, this / gpus_per_node) or host memory (the background save's snapshot) is over;
    # null = not checked.
    gpu_gib_per_node: Optional[float] = None
    host_gib_per_node: Optional[float] = None
    # The weight push's bandwidth model, GB/s per GPU and direction: inside a node (NVLink),
    # across nodes (InfiniBand), and the shared file system per node (weight_sync=disk).
    nvlink_gbs: float = 400.0
    ib_gbs: float = 50.0
    disk_gbs: float = 5.0

    def __post_init__(self):
        _positive("scale.gpus_per_node", self.gpus_per_node)
        for k in ("gpu_gib_per_node", "host_gib_per_node"):
            if getattr(self, k) is not None:
                _positive(f"scale.{k}", getattr(self, k))
        for k in ("nvlink_gbs", "ib_gbs", "disk_gbs"):
            _positive(f"scale.{k}", getattr(self, k))


@dataclass(frozen=True)
class Config:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    # Run directory: resolved config, metrics, checkpoints, exports.
    out_dir: str = "runs/gspo"

    def __post_init__(self):
        if not self.out_dir:
            raise ConfigError("out_dir must be a non-empty path")
        if self.loss.old_logprobs is None:  # the loop's default (LossConfig's comment)
            object.__setattr__(self.loss, "old_logprobs", "engine" if self.rollout.async_steps else "recompute")
            self.loss.check_old_logprobs()
        samples = self.rollout.prompts_per_step * self.rollout.samples_per_prompt
        if samples % self.train.minibatches_per_step:
            raise ConfigError(
                f"rollout.prompts_per_step * samples_per_prompt = {self.rollout.prompts_per_step}"
                f" * {self.rollout.samples_per_prompt} = {samples} is not divisible by "
                f"train.minibatches_per_step = {self.train.minibatches_per_step}"
            )
        if self.train.micro_batch_tokens <= self.rollout.response_budget:
            key = "max_response_tokens" if self.rollout.agent else "max_new_tokens"
            raise ConfigError(
                f"train.micro_batch_tokens={self.train.micro_batch_tokens} must exceed "
                f"rollout.{key}={self.rollout.response_budget} (a whole sample, prompt "
                "included, must fit in one microbatch)"
            )
        if self.rollout.agent and (self.train.routing_replay == "rollout" or self.rollout.return_routing):
            raise ConfigError("rollout.agent with train.routing_replay=rollout (or rollout.return_routing) is not supported: a multi-turn sample's "
                              "routing would come from several engine calls and its environment tokens should take "
                              "the trainer's own; use train.routing_replay=old (routing recorded by the π_old pass)")
        if self.loss.max_token_age is not None and not self.rollout.async_steps:
            raise ConfigError("loss.max_token_age needs rollout.async_steps >= 1 (synchronous rollouts are never stale)")
        if self.rollout.async_steps and self.rollout.backend == "sglang" and self.rollout.sglang.launch:
            raise ConfigError("rollout.async_steps > 0 with colocated SGLang engines (rollout.sglang.launch=true): "
                              "the engines and the trainer share the GPUs, nothing can overlap; give the servers "
                              "their own GPUs (rollout.sglang.urls) or set rollout.async_steps=0")
        if self.train.routing_replay == "old" and self.loss.old_logprobs != "recompute":
            raise ConfigError("train.routing_replay=old needs loss.old_logprobs=recompute (the π_old pass records "
                              "the routing the updates replay)")
        if self.train.routing_replay != "none" and self.train.recompute == "full" and self.parallel.pp > 1:
            raise ConfigError("train.routing_replay with train.recompute=full and parallel.pp > 1 is not supported: "
                              "1F1B interleaves microbatches, so a layer recomputed in backward would replay another "
                              "microbatch's experts (use train.recompute=selective, or pp=1)")
        if self.checkpoint.async_save and not self.optimizer.use_distributed_optimizer:
            raise ConfigError("checkpoint.async_save=true needs optimizer.use_distributed_optimizer=true (the background "
                              "writer writes the distributed optimizer's shards; the plain optimizer's checkpoints go "
                              "through Megatron's synchronous save)")
        if self.data.source == "file" and self.reward.fn is None:
            raise ConfigError(
                "data.source=file needs reward.fn ('math' or 'module:function'); null means the "
                "synthetic task's reward"
            )
        if self.train.routing_replay == "rollout" and self.rollout.backend == "vllm":
            raise ConfigError("train.routing_replay=rollout needs the engine's experts, which vLLM 0.32 cannot return "
                              "on this path: use rollout.backend=sglang or train.routing_replay=old")
        v = self.rollout.vllm
        if (self.rollout.backend == "vllm" and v.launch and v.model_path is None and self.model.hf_dir is None
                and self.model.hf_config is None and self.model.load is None):
            raise ConfigError("rollout.vllm.launch=true needs rollout.vllm.model_path, model.hf_dir, model.hf_config or "
                              "model.load (vLLM starts from a checkpoint directory, or from the architecture with dummy "
                              "weights)")
        s = self.rollout.sglang
        if (
            self.rollout.backend == "sglang"
            and s.launch
            and s.model_path is None
            and self.model.hf_dir is None
        ):
            raise ConfigError(
                "rollout.sglang.launch=true needs rollout.sglang.model_path or model.hf_dir "
                "(SGLang cannot start from an inline hf_config)"
            )
        if self.loss.kl_coef > 0 and self.model.hf_dir is None and self.model.load is None:
            warnings.warn(
                "loss.kl_coef > 0 with a random init: the reference policy is the random "
                "initial model",
                ConfigWarning,
                stacklevel=2,
            )

    def collective_timeout_s(self) -> tuple[float, dict]:
        """Timeout of every process group, seconds, and the waits it covers.

        Rank 0 alone talks to the rollout engine (start, weight pushes, generation, held-out
        evaluation) while every other rank already waits in the next collective, so the timeout
        must outlast the longest such wait the config allows, or NCCL's watchdog kills a healthy
        run. Bounds, from the settings that bound them (SGLang):
          one request        (max_retries + 1) * request_timeout_s + the retry back-offs
                             (rollout/sglang_engine.py: 0.5 s doubling, capped at 8 s)
          one generate call  ceil(prompts / concurrency) requests one after another (one request
                             per prompt group, at most `concurrency` in flight)
          a step (sync)      a weight push (one request) + the rollout's sampling rounds (1, or
                             1 + max_oversample_rounds with dynamic sampling) + a held-out
                             evaluation (every set)
          a step (async)     a weight push + async_timeout_s (the wait for the producer's batch)
          engine start       ready_timeout_s (SGLang's /health_generate)
        The in-process engine (rollout.backend=hf) generates on the trainer's own device: no
        setting bounds it, and the default DEFAULT_COLLECTIVE_TIMEOUT_S applies. The result is the
        largest of the default and the longest wait plus COLLECTIVE_TIMEOUT_MARGIN_S. A worst
        case: a crashed rank is still noticed at once (torchrun tears the job down); the bound
        only lets a *hung* rank 0 hold the others that long."""
        waits: dict[str, float] = {}
        r = self.rollout
        if r.backend in ("sglang", "vllm"):
            sg = r.sglang if r.backend == "sglang" else r.vllm  # the same timeout / retry fields
            backoff = sum(min(0.5 * 2 ** k, 8.0) for k in range(sg.max_retries))
            request = (sg.max_retries + 1) * sg.request_timeout_s + backoff

            def call(prompts: int) -> float:
                return request * math.ceil(prompts / sg.concurrency)

            waits["engine start"] = sg.ready_timeout_s
            if r.async_steps:
                waits["async step (push + producer wait)"] = request + r.async_timeout_s
            else:
                rounds = 1 + (r.max_oversample_rounds if r.dynamic_sampling else 0)
                step = request + rounds * call(r.prompts_per_step)
                if self.eval.interval:
                    step += sum(call(n) for n in [self.eval.num_prompts] + [x.num_prompts for x in self.eval.extra_sets])
                waits[f"step (push + {rounds} rollout round(s){' + eval' if self.eval.interval else ''})"] = step
        elif r.async_steps:
            waits["async step (producer wait)"] = r.async_timeout_s
        longest = max(waits.values(), default=0.0)
        return max(DEFAULT_COLLECTIVE_TIMEOUT_S, longest + COLLECTIVE_TIMEOUT_MARGIN_S), waits

    @property
    def engine_routing(self) -> bool:
        """Whether the rollout engine must return the experts it routed each token to."""
        return self.rollout.return_routing or self.train.routing_replay == "rollout"

    # ---- architecture -------------------------------------------------------------------

    def _need_load_source(self, load: "LoadSource | None") -> None:
        if self.model.load is not None and load is None:  # a caller's bug, not bad input
            raise ValueError("model.load is set: its checkpoint is read where the run is set up "
                             "(gspo_megatron.resolve.read_load_source(cfg)); pass that here")

    def model_sources(self, load: "LoadSource | None" = None) -> list[tuple[str, str]]:
        """(option, directory) of the checkpoints that carry an HF config (and maybe tokenizer
        files), in the order of precedence: model.load's hf_config/ (when present), then
        model.hf_dir. `load`: what model.load's checkpoint holds (needed when model.load is set)."""
        self._need_load_source(load)
        out = []
        if load is not None and load.hf_config_dir is not None:
            out.append(("model.load", load.hf_config_dir))
        if self.model.hf_dir is not None:
            out.append(("model.hf_dir", self.model.hf_dir))
        return out

    def config_sources(self, load: "LoadSource | None") -> list[tuple[str, str, dict]]:
        """(option, path, config dict) of every checkpoint config, in model_sources' order; a
        model.load without hf_config/ but with Megatron-Bridge's run_config.yaml (or Megatron-LM's
        run arguments) gives that."""
        out = [(opt, os.path.join(d, "config.json"), _read_json_object(os.path.join(d, "config.json"), opt))
               for opt, d in self.model_sources(load)]
        if load is not None and load.hf_config_dir is None and load.carried is not None:
            out.insert(0, ("model.load", load.carried[1], load.carried[0]))
        return out

    def check_paths(self) -> None:
        """Checks that read the filesystem (run by load_config)."""
        if self.data.source == "file" and not os.path.exists(self.data.path):
            raise ConfigError(f"data.path: {self.data.path} does not exist")
        if self.model.load is not None and not os.path.isdir(self.model.load):
            raise ConfigError(f"model.load: {self.model.load} is not a directory")
        if self.model.tokenizer is not None and not os.path.exists(self.model.tokenizer):
            raise ConfigError(f"model.tokenizer: {self.model.tokenizer} does not exist")
        r = self.checkpoint.resume
        if r not in ("auto", "never") and not os.path.exists(r):
            raise ConfigError(f"checkpoint.resume: {r} does not exist (use auto, never or a path)")

    # ---- serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)

    def dump_yaml(self, path: str) -> None:
        """Write the resolved config (atomically) so that load_config(path, []) reproduces it."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_yaml())
        os.replace(tmp, path)

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        """Build and validate (without filesystem checks) from a plain nested dict."""
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
        return _build(cls, data, "")


# ---- building dataclasses from plain data --------------------------------------------------


def _to_plain(obj):
    if is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _suggest(name: str, valid, parent: str = "") -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f" (did you mean '{parent}{close[0]}'?)" if close else ""


def _unknown_key(key: str, name: str, valid: list[str]) -> ConfigError:
    parent = key.rpartition(".")[0]
    where = f"in '{parent}'" if parent else "at the top level"
    return ConfigError(
        f"unknown config key '{key}'{_suggest(name, valid, parent + '.' if parent else '')}; valid keys {where}: {', '.join(valid)}"
    )


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is dict or origin is dict:
        return "a mapping"
    if is_dataclass(tp):
        return "a section (mapping)"
    return getattr(tp, "__name__", str(tp))


def _coerce(value, tp, key: str):
    origin = typing.get_origin(tp)
    bad = ConfigError(
        f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"[:300]
    )
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        assert len(args) == 1, tp
        return _coerce(value, args[0], key)
    if value is None:
        raise bad
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool):
            raise ConfigError(f"{key} must be one of {'|'.join(map(str, choices))}, got {value!r}")
        return value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad
        return _build(tp, value, key + ".")
    if origin is list:
        (elem,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [value]  # a single item for a list field
        if not isinstance(value, (list, tuple)):
            raise bad
        return [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is dict:
        if not isinstance(value, dict):
            raise bad
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return value
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise bad from None
        if not isinstance(value, (int, float)):
            raise bad
        # .nan / .inf are YAML floats: an infinite LR saves NaN weights, a NaN timeout disables
        # the timeout (every comparison with NaN is false). No config float means "unbounded".
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise bad
        return str(value)
    raise TypeError(f"unsupported config type {tp!r} at {key}")


# Keys that were options once and are refused with the reason (not "unknown key").
_SECRET_IN_CONFIG = ("keys are given by environment variable name, never in a config (it would reach config.yaml, "
                     "the W&B config and the servers' command lines): set {p}api_key_env=<VARIABLE> instead")
MOVED = {"rollout.sglang.api_key": _SECRET_IN_CONFIG.format(p="rollout.sglang."),
         "rollout.vllm.api_key": _SECRET_IN_CONFIG.format(p="rollout.vllm."),
         "reward.judge.api_key": _SECRET_IN_CONFIG.format(p="reward.judge."),
         "reward.model.api_key": _SECRET_IN_CONFIG.format(p="reward.model.")}


def _build(cls, data: dict, prefix: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for k in data:
        if k not in names:
            if f"{prefix}{k}" in MOVED:
                raise ConfigError(f"{prefix}{k}: {MOVED[f'{prefix}{k}']}")
            raise _unknown_key(f"{prefix}{k}", str(k), names)
    kwargs = {}
    for f in fields(cls):
        if f.name in data:
            v = data[f.name]
            if v is None and is_dataclass(hints[f.name]):
                v = {}  # an empty section ("parallel:" with everything commented out)
            kwargs[f.name] = _coerce(v, hints[f.name], prefix + f.name)
    if cls is Config and "model" not in kwargs:
        kwargs["model"] = _build(ModelConfig, {}, "model.")
    return cls(**kwargs)


# ---- YAML + overrides -----------------------------------------------------------------------


def parse_override(item: str) -> tuple[list[str], object]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value parsed as a YAML scalar/list)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not key or any(not p for p in parts):
        raise ConfigError(f"override {item!r}: bad key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: keep the literal string (the field type decides)
    # A text field keeps the text the user typed: `reward.judge.score_regex=Score: ([0-9.]+)` is a
    # YAML mapping and `reward.judge.model=1e3` a float, neither what was meant. YAML still removes
    # quotes around a string, and null / ~ / nothing is None where the field admits it.
    if value is not None and not isinstance(value, str) and _is_text_field(parts):
        value = raw.strip()
    return parts, value


def _is_text_field(parts: list[str]) -> bool:
    """Whether `parts` names a text field of Config (str or Optional[str], not a Literal); not a
    section, a number, a list, a free-form dict's entry, or an unknown key."""
    cls = Config
    for i, p in enumerate(parts):
        if not is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if p not in hints:
            return False
        tp = hints[p]
        args = typing.get_args(tp)
        if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
            tp = next(a for a in args if a is not type(None))
        if i == len(parts) - 1:
            return tp is str
        cls = tp
    return False


def _deep_merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v
    return dst


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            elif not isinstance(nxt, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[: i + 1])} is not a section"
                )
            node = nxt
        last = parts[-1]
        if isinstance(value, dict) and isinstance(node.get(last), dict):
            _deep_merge(node[last], value)
        else:
            node[last] = value
    return data


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or none: defaults) + dotted overrides -> a Config validated as a schema (the
    model is not read: gspo_megatron/resolve.py load_config adds that). Raises ConfigError."""
    data: dict = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except yaml.YAMLError as e:
            msg = " ".join(str(e).split())
            raise ConfigError(f"config file {path} is not valid YAML: {msg}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping, got {type(loaded).__name__}")
        data = loaded or {}
    data = apply_overrides(data, list(overrides or ()))
    cfg = Config.from_dict(data)
    cfg.check_paths()
    # The model is checked where the config is resolved (gspo_megatron/resolve.py load_config):
    # this module knows no model family.
    return cfg
