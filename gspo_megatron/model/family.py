"""Model families: what one needs to provide, and the registry keyed by `model_type`.

A family (one folder in model/families/) owns everything that knows its Hugging Face config and
tensor names: its HF-config reader and validation (the one parser of that config: the planner, the
loader, the converter, the engines and `score` all get a `MoeArch` from it), its rules for the
shared HF <-> Megatron map (model/mapping.py), the Megatron-Core options its features map to
(model/spec.py builds the TransformerConfig and the layer specs from them), its Megatron-Bridge /
Megatron-LM argument table, and the transformers class that is its reference. Code outside the
families asks `family_for(hf_config)` or `arch.family`, never a literal model type.

"Adding a model family" in docs/design.md lists what a new family provides and the parametrized
suite it must pass (tests/test_model_families.py).
"""
from __future__ import annotations

import math
from typing import Any, Protocol

from gspo_megatron.errors import ModelConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.registry import (  # noqa: F401 (the registry's API, re-exported)
    DEFAULT_MODEL_TYPE, FAMILY_MODULES, arch_from_hf_dict, arch_from_hf_dir, family_for, family_of_type,
    read_hf_config_dir)


class ModelFamily(Protocol):
    model_type: str  # HF config's model_type
    display_name: str  # for messages: "Qwen3-MoE"
    hf_architecture: str  # config.json "architectures" entry: the transformers / vLLM / SGLang class
    # Keys an inline model.hf_config may hold (the HF config class's arguments and what real
    # config.json files carry; a typo would be silently ignored by transformers) and those it must
    # state (transformers' defaults are a big model's).
    inline_keys: frozenset[str]
    required_inline_keys: tuple[str, ...]

    def read_config(self, hf: dict[str, Any], source: str) -> MoeArch:
        """The one parser of this family's HF config: validated, or ModelConfigError naming
        `source` and the field."""

    def rules(self, arch: MoeArch) -> tuple:
        """mapping.Rule's for this architecture: model/mapping.py's rule blocks and the family's own."""

    def attention_params(self, arch: MoeArch, tp: int = 1) -> tuple[int, int]:
        """One layer's attention parameters on one TP rank: (those split over TP, those every TP
        rank holds whole: attention-internal norms, replicated projections): the planner's counts
        (MoeArch.layer_params)."""

    def attention_activation_elements(self, arch: MoeArch, tp: int, selective: bool) -> float:
        """Elements per token one layer's attention stores for the backward pass on one TP rank
        (its input norm aside), core attention recomputed when `selective`: the planner's
        activation memory (planner.py)."""

    def attention_summary(self, arch: MoeArch) -> str:
        """The attention in a few words, for the planner's report ("GQA 32 q / 4 kv heads x 128")."""

    def kv_cache_bytes_per_token(self, arch: MoeArch, dtype_bytes: int) -> int:
        """Bytes of KV cache one token takes in a serving engine, all layers: what an engine
        launch sizes its cache from (rollout/vllm_server.py)."""

    def routers(self, model) -> list:
        """(layer index, module, top-k indices of a forward's output) of every MoE layer's router
        of `model` (this family's transformers model): the in-process engine's routing capture
        (rollout/hf_engine.py return_routing)."""

    def megatron_config_class(self, arch: MoeArch) -> type:
        """The Megatron-Core config class of this family's models (model/spec.py fills it):
        TransformerConfig, or a subclass such as MLATransformerConfig."""

    def megatron_options(self, arch: MoeArch) -> dict[str, Any]:
        """TransformerConfig fields this family's features map to (model/spec.py adds the rest)."""

    def install_megatron_patches(self, arch: MoeArch) -> None:
        """Changes this family's models need in the pinned megatron-core where it computes
        something unlike the family's reference (transformers), each pinned by a test that reads
        the installed source; idempotent, before a model of `arch` is built (model/spec.py
        build_model_chunks). Most families need none (`no_megatron_patches`)."""

    def layer_spec(self, config, is_moe: bool, use_te: bool):
        """One decoder layer's Megatron ModuleSpec (MoE or dense): the Transformer Engine spec when
        `use_te`, else the local spec, into which model/spec.py's `cpu_layer_spec` puts the CPU
        runtime's modules (norms, core attention, experts) by class."""

    def gpt_model_options(self, arch: MoeArch) -> dict[str, Any]:
        """GPTModel arguments of this family's position embedding (type, base, rotary fraction)."""

    def engine_config_overrides(self, arch: MoeArch) -> dict[str, Any]:
        """HF config keys the serving engines read that this family's transformers class implies
        without writing them (a checkpoint saved by transformers lacks them, and the engines'
        defaults would serve another function): launched vLLM and SGLang servers get them
        (--hf-overrides, --json-model-override-args), the configs the trainer writes hold them
        (`hf_config`)."""

    def vllm_server_args(self, arch: MoeArch, device: str, dtype: str | None) -> list[str]:
        """vLLM 0.32 command-line arguments a server of this model needs on `device` ("cpu" or
        "cuda") computing in `dtype` (rollout/vllm_server.py prepare adds them); ModelConfigError
        (one line) when vLLM cannot serve the model there."""

    def vllm_lora_modules(self, arch: MoeArch) -> dict[str, tuple[str, ...]]:
        """The trainer's LoRA groups (config.py LORA_TARGETS) a vLLM 0.32 server of this model takes
        as a runtime-loaded adapter, each with the vLLM module suffixes that serve it
        (--lora-target-modules); the other groups' adapters are pushed merged into their weights
        (rollout/vllm_engine.py). Routed experts are never among them: vLLM 0.32's MoE LoRA runs
        on Triton kernels only."""

    def weights_loaded_together(self, arch: MoeArch) -> tuple[tuple[str, ...], ...]:
        """Groups of HF tensor name templates (`{layer}`: a decoder layer) that a serving engine
        fuses into one parameter only when it receives all of a group in one weight update (a push
        that splits a group between requests leaves the engine's old weights in place): the
        pushes' bucketing keeps each group whole (rollout/weight_sync.py iter_buckets). Most
        families have none."""

    def hf_config(self, hf: dict[str, Any], mtp_layers: int = 0) -> dict[str, Any]:
        """A config.json for `hf` (an inline or read config dict): model_type and architectures set,
        declaring `mtp_layers` multi-token-prediction layers (those the writer carries,
        checkpoint/carried.py; none by default)."""

    def bridge_run_config(self, arch: MoeArch, dtype: str = "bfloat16") -> dict | None:
        """Megatron-Bridge's run_config.yaml for a checkpoint of `arch`; None without a Bridge table
        (checkpoint/megatron_dirs.py then writes none)."""

    def bridge_provider(self) -> str | None:
        """The Megatron-Bridge model provider (`model._target_`) that names this family, or None."""

    def hf_from_provider_fields(self, m: dict, path: str, prefix: str, *, provider_defaults: bool) -> dict:
        """An HF config dict from Megatron-Bridge provider fields or Megatron-LM run arguments `m`
        (read from `path`), or ModelConfigError naming `path`, `prefix` and the field."""

    def reference_model(self, hf: dict[str, Any]):
        """transformers' model of this family for `hf` (random init): the reference of the tests
        and the in-process rollout engine."""


# ---- shared helpers for the families' readers ------------------------------------------------

# Keys every transformers decoder config of the families here has (PretrainedConfig's own and the
# common decoder arguments); a family's inline_keys are these plus its own.
COMMON_INLINE_KEYS = frozenset(
    """
    vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads head_dim hidden_act max_position_embeddings initializer_range rms_norm_eps
    use_cache tie_word_embeddings rope_theta rope_scaling rope_parameters attention_bias
    attention_dropout moe_intermediate_size num_experts_per_tok num_local_experts norm_topk_prob
    output_router_logits pad_token_id bos_token_id eos_token_id architectures model_type torch_dtype
    dtype transformers_version
    """.split()
)


def required(d: dict, source: str, *keys: str):
    """The first of `keys` that `d` holds (not None), else a one-line error naming the first."""
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    raise ModelConfigError(f"{source}: missing required field {keys[0]!r}")


_REQUIRED = object()


def as_int(v, source: str, key: str, minimum: int = 0) -> int:
    """`v` as an int if it is one (an integral float such as 64.0 too), >= minimum; else one line
    naming `source` and `key`. int() would read 64.5 as 64 and "64" as 64 (issue 52)."""
    ok = not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and math.isfinite(v)
                                                             and v.is_integer()))
    if not ok:
        raise ModelConfigError(f"{source}: {key} must be an integer, got {v!r}")
    if int(v) < minimum:
        raise ModelConfigError(f"{source}: {key} must be >= {minimum}, got {v!r}")
    return int(v)


def as_float(v, source: str, key: str) -> float:
    """`v` as a float if it is a finite number; else one line naming `source` and `key`."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ModelConfigError(f"{source}: {key} must be a finite number, got {v!r}")
    return float(v)


def int_field(d: dict, source: str, *keys: str, default=_REQUIRED, minimum: int = 1) -> int:
    """The first of `keys` that `d` holds (not None) as a checked int (as_int; sizes and counts:
    >= 1 unless `minimum` says otherwise); `default` when none is there (no default: required)."""
    v = next((d[k] for k in keys if k in d and d[k] is not None), None)
    if v is None:
        if default is _REQUIRED:
            raise ModelConfigError(f"{source}: missing required field {keys[0]!r}")
        return default
    return as_int(v, source, keys[0], minimum)


def float_field(d: dict, source: str, key: str, default: float) -> float:
    v = d.get(key)
    return default if v is None else as_float(v, source, key)


def sigmoid_moe_fields(d: dict, source: str, *, first_dense: int, moe_intermediate: int,
                       scaling_default: float) -> dict:
    """MoeArch fields of the MoE layout GLM-4.5 and DeepSeek-V3 share (their transformers configs
    name it alike): the first `first_dense` layers dense with `intermediate_size`, then MoE layers
    with `n_shared_experts` always-on experts of `moe_intermediate`, sigmoid routing with a
    selection bias (`e_score_correction_bias`), renormalised top-k weights (the readers refuse
    norm_topk_prob false), `routed_scaling_factor`, and the MTP layers the config declares."""
    return dict(
        norm_topk_prob=True,
        dense_layers=tuple(range(first_dense)),
        dense_intermediate_size=int_field(d, source, "intermediate_size"),
        shared_expert_intermediate_size=int_field(d, source, "n_shared_experts", default=1, minimum=0)
        * moe_intermediate,
        router_score="sigmoid",
        router_expert_bias=True,
        routed_scaling_factor=float_field(d, source, "routed_scaling_factor", scaling_default),
        mtp_layers=int_field(d, source, "num_nextn_predict_layers", "num_mtp_layers", default=0, minimum=0),
    )


def rope_theta(d: dict, source: str) -> float:
    """RoPE base of a config with plain RoPE (transformers 4.x `rope_theta`/`rope_scaling`, 5.x
    `rope_parameters`); scaled RoPE variants are refused."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise ModelConfigError(f"{source}: rope_type {rope_type!r} is not supported (default RoPE only)")
    return as_float(rope.get("rope_theta", d.get("rope_theta", 10000.0)), source, "rope_theta")


def transformer_config_class(arch: MoeArch) -> type:
    """ModelFamily.megatron_config_class of a model Megatron-Core's plain TransformerConfig holds."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig


def no_megatron_patches(arch: MoeArch) -> None:
    """ModelFamily.install_megatron_patches of a family Megatron-Core computes as its reference does."""


def standard_layer_spec(config, is_moe: bool, use_te: bool):
    """ModelFamily.layer_spec of a decoder Megatron's GPT layer specs build as they are (self-
    attention with optional q/k norms and QKV bias, routed experts, optional shared experts)."""
    from gspo_megatron.model.spec import megatron_layer_spec

    return megatron_layer_spec(config, is_moe, use_te)


def rope_model_options(arch: MoeArch) -> dict[str, Any]:
    """ModelFamily.gpt_model_options of plain RoPE on the first `rotary_percent` of each head."""
    base = arch.rope_theta
    return dict(position_embedding_type="rope", rotary_base=int(base) if float(base).is_integer() else base,
                rotary_percent=arch.rotary_percent)


def gqa_attention_params(arch: MoeArch, tp: int = 1) -> tuple[int, int]:
    """ModelFamily.attention_params of grouped-query attention: q/k/v and output projections (and
    their biases, `qkv_bias`) split over TP; per-head q/k norms (`qk_norm`) replicated."""
    H, D = arch.hidden_size, arch.head_dim
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    weights = H * nq * D + 2 * H * nkv * D + nq * D * H
    if arch.qkv_bias:
        weights += (nq + 2 * nkv) * D
    return weights // tp, (2 * D if arch.qk_norm else 0)


def gqa_attention_summary(arch: MoeArch) -> str:
    """ModelFamily.attention_summary of grouped-query attention."""
    return f"GQA {arch.num_attention_heads} q / {arch.num_key_value_heads} kv heads x {arch.head_dim}"


def gqa_attention_activation_elements(arch: MoeArch, tp: int, selective: bool) -> float:
    """ModelFamily.attention_activation_elements of grouped-query attention: the q/k/v projections'
    output, the rotary q/k, and the attention output unless core attention is recomputed."""
    nq, nkv, hd = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    return ((nq + 2 * nkv) + (nq + nkv) + (0 if selective else nq)) * hd / tp


def gqa_kv_cache_bytes_per_token(arch: MoeArch, dtype_bytes: int) -> int:
    """ModelFamily.kv_cache_bytes_per_token of grouped-query attention: K and V of every kv head,
    every layer (multi-token-prediction layers are not served)."""
    return 2 * arch.num_layers * arch.num_key_value_heads * arch.head_dim * dtype_bytes


def transformers_gate_routers(model) -> list:
    """ModelFamily.routers for transformers' MoE decoders whose layers hold `mlp.gate`, a router
    returning (logits, scores, top-k indices) (Qwen3-MoE, GLM-4.5 in transformers 5.x); dense
    layers have none."""
    return [(i, layer.mlp.gate, _third) for i, layer in enumerate(model.model.layers) if "gate" in layer.mlp._modules]


def _third(out):
    return out[2]


class StandardDecoder:
    """The ModelFamily methods of a decoder Megatron's GPT layer specs build as they are: grouped-
    query attention (its counts, activation elements, KV cache), transformers' gate routers, plain
    RoPE, Megatron's TransformerConfig, no Megatron patches. A family inherits them and writes what
    is its own (Qwen3-MoE, GLM-4.5); a family with another attention writes them all
    (DeepSeek-V3)."""

    def attention_params(self, arch: MoeArch, tp: int = 1) -> tuple[int, int]:
        return gqa_attention_params(arch, tp)

    def attention_activation_elements(self, arch: MoeArch, tp: int, selective: bool) -> float:
        return gqa_attention_activation_elements(arch, tp, selective)

    def attention_summary(self, arch: MoeArch) -> str:
        return gqa_attention_summary(arch)

    def kv_cache_bytes_per_token(self, arch: MoeArch, dtype_bytes: int) -> int:
        return gqa_kv_cache_bytes_per_token(arch, dtype_bytes)

    def routers(self, model) -> list:
        return transformers_gate_routers(model)

    def megatron_config_class(self, arch: MoeArch) -> type:
        return transformer_config_class(arch)

    def install_megatron_patches(self, arch: MoeArch) -> None:
        no_megatron_patches(arch)

    def layer_spec(self, config, is_moe: bool, use_te: bool):
        return standard_layer_spec(config, is_moe, use_te)

    def gpt_model_options(self, arch: MoeArch) -> dict[str, Any]:
        return rope_model_options(arch)

    def engine_config_overrides(self, arch: MoeArch) -> dict[str, Any]:
        return {}

    def vllm_server_args(self, arch: MoeArch, device: str, dtype: str | None) -> list[str]:
        return []  # vLLM's default attention backend serves GQA on CPU and GPU

    def vllm_lora_modules(self, arch: MoeArch) -> dict[str, tuple[str, ...]]:
        # GQA attention: vLLM's qkv_proj holds q/k/v (one adapter slice each, the trainer's fused
        # linear_qkv shares one A), o_proj the output projection
        return {"attention": ("qkv_proj", "o_proj")}

    def weights_loaded_together(self, arch: MoeArch) -> tuple[tuple[str, ...], ...]:
        # SGLang's and vLLM's GQA loaders place q/k/v and gate/up each into its own shard of the
        # fused parameter, one tensor at a time (stacked_params_mapping)
        return ()


def check_attention(arch: MoeArch, source: str) -> None:
    if arch.num_attention_heads % arch.num_key_value_heads:
        raise ModelConfigError(f"{source}: num_attention_heads not a multiple of num_key_value_heads")
    if not 0 < arch.moe_topk <= arch.num_experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok must be in [1, num_experts]")


def check_inline(hf: dict, family: ModelFamily, where: str, *, require: bool = True) -> None:
    """Key names (for an inline config) and the family's own validation, as ConfigError's naming
    `where`."""
    from gspo_megatron.errors import ConfigError

    if require:
        unknown = sorted(k for k in hf if k not in family.inline_keys)
        if unknown:
            import difflib

            close = difflib.get_close_matches(unknown[0], sorted(family.inline_keys), n=1)
            raise ConfigError(
                f"unknown key '{where}.{unknown[0]}'" + (f" (did you mean '{where}.{close[0]}'?)" if close else "")
                + f" for a {family.display_name} config; valid keys: {', '.join(sorted(family.inline_keys))}")
        missing = [k for k in family.required_inline_keys if k not in hf]
        if missing:
            raise ConfigError(f"{where} is missing required field(s): {', '.join(missing)}")
    for k, v in hf.items():
        if k.startswith(("num_", "n_")) or k.endswith(("_size", "_dim", "_replace")):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ConfigError(f"{where}.{k} must be a non-negative integer, got {v!r}")
    try:
        family.read_config(hf, where)
    except ModelConfigError as e:
        raise ConfigError(str(e)) from None
