"""Qwen3-MoE's HF config: the one reader (-> MoeArch) and what an inline config may hold."""
from __future__ import annotations

from typing import Any

from gspo_megatron.errors import ModelConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.family import (COMMON_INLINE_KEYS, check_attention, float_field, int_field,
                                        rope_theta)

MODEL_TYPE = "qwen3_moe"
HF_ARCHITECTURE = "Qwen3MoeForCausalLM"

# transformers' Qwen3MoeConfig arguments plus the keys real Qwen3 config.json files carry
INLINE_KEYS = COMMON_INLINE_KEYS | frozenset(
    "use_sliding_window sliding_window max_window_layers decoder_sparse_step num_experts router_aux_loss_coef "
    "mlp_only_layers".split())
REQUIRED_INLINE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


def read_config(d: dict[str, Any], source: str = "config") -> MoeArch:
    """Validate a Qwen3-MoE HF config dict (config.json contents or an inline dict)."""
    mt = d.get("model_type", MODEL_TYPE)
    if mt != MODEL_TYPE:
        raise ModelConfigError(f"{source}: model_type is {mt!r}, expected {MODEL_TYPE!r}")

    def num(*keys, **kw):  # sizes and counts: integers >= 1 (family.int_field)
        return int_field(d, source, *keys, **kw)

    num_experts = num("num_experts", "num_local_experts", minimum=0)
    if num_experts <= 0:
        raise ModelConfigError(f"{source}: num_experts must be > 0 for Qwen3-MoE")
    if d.get("shared_expert_intermediate_size"):
        raise ModelConfigError(f"{source}: shared experts are not supported (Qwen3-MoE has none)")
    if d.get("mlp_only_layers"):
        raise ModelConfigError(
            f"{source}: dense MLP layers mixed in (mlp_only_layers={d['mlp_only_layers']}) are not supported"
        )
    if num("decoder_sparse_step", default=1, minimum=0) != 1:
        raise ModelConfigError(f"{source}: decoder_sparse_step != 1 (dense layers mixed in) is not supported")
    if d.get("use_sliding_window"):
        raise ModelConfigError(f"{source}: sliding-window attention is not supported")
    if d.get("attention_bias"):
        raise ModelConfigError(f"{source}: attention_bias=true is not Qwen3-MoE and is not supported")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    hidden = num("hidden_size")
    heads = num("num_attention_heads")
    arch = MoeArch(
        model_type=MODEL_TYPE,
        vocab_size=num("vocab_size"),
        hidden_size=hidden,
        num_layers=num("num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=num("num_key_value_heads", default=heads),
        head_dim=num("head_dim", default=hidden // heads),
        num_experts=num_experts,
        moe_topk=num("num_experts_per_tok"),
        moe_intermediate_size=num("moe_intermediate_size"),
        rms_norm_eps=float_field(d, source, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta(d, source),
        max_position_embeddings=num("max_position_embeddings", default=32768),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        # intermediate_size (the dense MLP width) is unused: every layer is MoE
    )
    check_attention(arch, source)
    return arch
