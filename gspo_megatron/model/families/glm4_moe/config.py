"""GLM-4.5 MoE's HF config (transformers `Glm4MoeConfig`): the one reader (-> MoeArch).

What it has beyond Qwen3-MoE, read from transformers 5.x models/glm4_moe/modeling_glm4_moe.py:
- the first `first_k_dense_replace` layers have a dense SwiGLU MLP of `intermediate_size`
  (Glm4MoeDecoderLayer.__init__, :404-407);
- every MoE layer adds `n_shared_experts` always-on experts as one MLP of n * moe_intermediate_size,
  with no gate (Glm4MoeMoE, :386-398);
- the router (Glm4MoeTopkRouter, :269-306): fp32 logits, sigmoid scores, the choice on scores +
  `e_score_correction_bias` (a buffer: not trained), the weights are the chosen experts' scores
  without the bias, renormalised when `norm_topk_prob` (+1e-20), then times
  `routed_scaling_factor`. Megatron-Core 0.16.1 (moe_utils.py:716-729) renormalises sigmoid
  scores whenever top-k > 1 and then scales: equal when norm_topk_prob is true (GLM-4.5's), so a
  config with it false is refused. Group-limited choice (n_group > 1) is refused too: HF scores a
  group by its top-2 experts, Megatron by its top (topk / group_topk) (moe_utils.py
  group_limited_topk); GLM-4.5 and -Air use n_group = topk_group = 1;
- RoPE on the first `partial_rotary_factor` of each head's dimensions, rotate-half layout
  (apply_rotary_pos_emb, :160-166) = Megatron's rotary_percent;
- q/k/v biases when `attention_bias` (o_proj has none, :188-197) = Megatron's add_qkv_bias;
- per-head q/k RMSNorm only when `use_qk_norm` (off in GLM-4.5).
- MTP layers (`num_nextn_predict_layers`, tensors under model.layers.{num_hidden_layers}...) are not
  part of the policy: the loader skips them with a warning and exports write the config with
  num_nextn_predict_layers = 0 (model/hf_io.py), so a round trip never drops them silently.
"""
from __future__ import annotations

from typing import Any

from gspo_megatron.errors import ModelConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.family import (COMMON_INLINE_KEYS, as_float, check_attention, float_field, int_field,
                                        rope_theta, sigmoid_moe_fields)

MODEL_TYPE = "glm4_moe"
HF_ARCHITECTURE = "Glm4MoeForCausalLM"

# transformers' Glm4MoeConfig arguments plus the keys real GLM-4.5 config.json files carry
INLINE_KEYS = COMMON_INLINE_KEYS | frozenset(
    "partial_rotary_factor n_shared_experts n_routed_experts routed_scaling_factor n_group topk_group "
    "first_k_dense_replace use_qk_norm num_nextn_predict_layers num_mtp_layers".split())
REQUIRED_INLINE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "n_routed_experts",
                        "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                        "n_shared_experts")


def partial_rotary_factor(d: dict, source: str = "config") -> float:
    rope = d.get("rope_parameters") or {}
    # transformers 5 keeps it in rope_parameters; config.json files carry it at the top level;
    # Glm4MoeConfig.__post_init__ defaults it to 0.5
    return as_float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5)), source,
                    "partial_rotary_factor")


def read_config(d: dict[str, Any], source: str = "config") -> MoeArch:
    """Validate a GLM-4.5 MoE HF config dict (config.json contents or an inline dict)."""
    mt = d.get("model_type")
    if mt != MODEL_TYPE:
        raise ModelConfigError(f"{source}: model_type is {mt!r}, expected {MODEL_TYPE!r}")

    def num(*keys, **kw):  # sizes and counts: integers >= 1 (family.int_field)
        return int_field(d, source, *keys, **kw)

    num_experts = num("n_routed_experts", "num_local_experts", minimum=0)
    if num_experts <= 0:
        raise ModelConfigError(f"{source}: n_routed_experts must be > 0")
    layers = num("num_hidden_layers")
    first_dense = num("first_k_dense_replace", default=1, minimum=0)
    if not 0 <= first_dense < layers:
        raise ModelConfigError(f"{source}: first_k_dense_replace={first_dense} must be in [0, num_hidden_layers)")
    topk = num("num_experts_per_tok")
    if not bool(d.get("norm_topk_prob", True)) and topk > 1:
        raise ModelConfigError(f"{source}: norm_topk_prob=false is not supported (Megatron-Core renormalises "
                               "sigmoid routing weights whenever num_experts_per_tok > 1)")
    if num("n_group", default=1, minimum=0) != 1 or num("topk_group", default=1, minimum=0) != 1:
        raise ModelConfigError(f"{source}: group-limited routing (n_group={d.get('n_group')}, topk_group="
                               f"{d.get('topk_group')}) is not supported (Megatron scores groups differently); "
                               "GLM-4.5 uses 1 and 1")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    prf = partial_rotary_factor(d, source)
    if not 0 < prf <= 1:
        raise ModelConfigError(f"{source}: partial_rotary_factor={prf} must be in (0, 1]")
    hidden = num("hidden_size")
    heads = num("num_attention_heads")
    head_dim = num("head_dim", default=hidden // heads)
    if (head_dim * prf) % 2:
        raise ModelConfigError(f"{source}: head_dim * partial_rotary_factor = {head_dim * prf} must be even")
    moe_i = num("moe_intermediate_size")
    arch = MoeArch(
        model_type=MODEL_TYPE,
        vocab_size=num("vocab_size"),
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=num("num_key_value_heads", default=heads),
        head_dim=head_dim,
        num_experts=num_experts,
        moe_topk=topk,
        moe_intermediate_size=moe_i,
        rms_norm_eps=float_field(d, source, "rms_norm_eps", 1e-5),
        rope_theta=rope_theta(d, source),
        max_position_embeddings=num("max_position_embeddings", default=131072),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        rotary_percent=prf,
        qkv_bias=bool(d.get("attention_bias", False)),
        qk_norm=bool(d.get("use_qk_norm", False)),
        **sigmoid_moe_fields(d, source, first_dense=first_dense, moe_intermediate=moe_i, scaling_default=1.0),
    )
    check_attention(arch, source)
    return arch

