"""DeepSeek-V3's HF config (transformers `DeepseekV3Config`): the one reader (-> MoeArch).

What it has beyond the other families, read from transformers 5.x
models/deepseek_v3/modeling_deepseek_v3.py and configuration_deepseek_v3.py:
- multi-head latent attention (DeepseekV3Attention): q through a low-rank `q_a_proj` (q_lora_rank),
  its RMSNorm and `q_b_proj` (or one `q_proj` when q_lora_rank is null); k/v through
  `kv_a_proj_with_mqa` (kv_lora_rank + qk_rope_head_dim: the latent and one shared RoPE key), the
  latent's RMSNorm and `kv_b_proj` (per head: qk_nope_head_dim of key, v_head_dim of value); RoPE
  only on the last qk_rope_head_dim of q and k, in the interleaved layout (`rope_interleave`,
  apply_rotary_pos_emb_interleave), which Megatron-Core's MLA applies as well (rope_utils.py
  _apply_rotary_pos_emb_bshd, its multi_latent_attention branch); `rope_interleave: false` is
  refused. num_key_value_heads must equal num_attention_heads (every head has its own k/v);
  attention_bias is refused (Megatron's MLA projections have none);
- YaRN RoPE (`rope_parameters` / `rope_scaling` type yarn) = Megatron's rope_type "yarn"; the
  attention factor and the softmax's mscale^2 (modeling_rope_utils.py _compute_yarn_parameters,
  yarn_apply_mscale) are Megatron's mscale / mscale_all_dim when both are set, and mscale 1 /
  mscale_all_dim 0 otherwise (transformers then ignores mscale); an explicit attention_factor
  and truncate=false are refused;
- the first `first_k_dense_replace` layers dense (intermediate_size), then MoE with
  `n_shared_experts` always-on experts as one MLP (DeepseekV3MoE);
- the router (DeepseekV3TopkRouter): sigmoid scores, `e_score_correction_bias` for the choice
  only, node-limited choice (`n_group` groups scored by the sum of their top-2 biased scores,
  the best `topk_group` kept), weights renormalised when norm_topk_prob, times
  routed_scaling_factor. Megatron-Core renormalises whenever top-k > 1 (norm_topk_prob false is
  refused) and scores a group by its top (topk / topk_group): the family patches that
  (megatron_patches.py);
- MTP layers (`num_nextn_predict_layers`): tensors under model.layers.{num_hidden_layers + i}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gspo_megatron.errors import ModelConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.family import COMMON_INLINE_KEYS, as_float, float_field, int_field, sigmoid_moe_fields

MODEL_TYPE = "deepseek_v3"
HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

# transformers' DeepseekV3Config arguments plus the keys real DeepSeek-V3 / Kimi-K2 config.json
# files carry (their remote-code configs name the router's method and scoring function)
INLINE_KEYS = COMMON_INLINE_KEYS | frozenset(
    "n_shared_experts n_routed_experts routed_scaling_factor kv_lora_rank q_lora_rank qk_rope_head_dim "
    "v_head_dim qk_nope_head_dim n_group topk_group first_k_dense_replace rope_interleave pretraining_tp "
    "num_nextn_predict_layers num_mtp_layers scoring_func topk_method moe_layer_freq ep_size "
    "aux_loss_alpha seq_aux auto_map quantization_config".split())
REQUIRED_INLINE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "first_k_dense_replace", "n_shared_experts", "kv_lora_rank", "q_lora_rank",
                        "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group")


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE as Megatron's MLATransformerConfig takes it (values transformers would use)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


@dataclass(frozen=True)
class DeepseekV3Fields:
    """MoeArch.family_fields of this family: what only multi-latent attention and node-limited
    routing have."""

    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    yarn: Yarn | None  # None: plain RoPE

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _rope(d: dict, source: str, max_pos: int) -> tuple[float, Yarn | None]:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ModelConfigError(f"{source}: rope_parameters must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = as_float(rope.get("rope_theta", d.get("rope_theta", 10000.0)), source, "rope_theta")
    if kind in ("default", None):
        return theta, None
    if kind != "yarn":
        raise ModelConfigError(f"{source}: rope_type {kind!r} is not supported (default or yarn)")
    if rope.get("attention_factor") is not None:
        raise ModelConfigError(f"{source}: rope_parameters.attention_factor is not supported (Megatron derives it "
                               "from mscale and mscale_all_dim)")
    if rope.get("truncate", True) is not True:
        raise ModelConfigError(f"{source}: rope_parameters.truncate=false is not supported (Megatron's MLA rounds "
                               "the YaRN correction range)")
    original = int_field(rope, source, "original_max_position_embeddings")
    factor = rope.get("factor")
    factor = max_pos / original if factor is None else as_float(factor, source, "rope_parameters.factor")
    if factor < 1:
        raise ModelConfigError(f"{source}: rope_parameters.factor must be >= 1, got {factor}")
    mscale = rope.get("mscale")
    mscale_all_dim = rope.get("mscale_all_dim")
    both = bool(mscale) and bool(mscale_all_dim)  # transformers uses them only together
    return theta, Yarn(
        factor=float(factor), original_max_position_embeddings=original,
        beta_fast=as_float(rope.get("beta_fast") or 32, source, "beta_fast"),
        beta_slow=as_float(rope.get("beta_slow") or 1, source, "beta_slow"),
        mscale=as_float(mscale, source, "mscale") if both else 1.0,
        mscale_all_dim=as_float(mscale_all_dim, source, "mscale_all_dim") if both else 0.0)


def read_config(d: dict[str, Any], source: str = "config") -> MoeArch:
    """Validate a DeepSeek-V3 HF config dict (config.json contents or an inline dict)."""
    mt = d.get("model_type")
    if mt != MODEL_TYPE:
        raise ModelConfigError(f"{source}: model_type is {mt!r}, expected {MODEL_TYPE!r}")

    def num(*keys, **kw):  # sizes and counts: integers >= 1 (family.int_field)
        return int_field(d, source, *keys, **kw)

    num_experts = num("n_routed_experts", "num_local_experts")
    layers = num("num_hidden_layers")
    first_dense = num("first_k_dense_replace", default=3, minimum=0)
    if not 0 <= first_dense < layers:
        raise ModelConfigError(f"{source}: first_k_dense_replace={first_dense} must be in [0, num_hidden_layers)")
    if d.get("moe_layer_freq", 1) != 1:
        raise ModelConfigError(f"{source}: moe_layer_freq={d.get('moe_layer_freq')} is not supported (1: every "
                               "layer after the dense ones is MoE)")
    topk = num("num_experts_per_tok", default=8)
    if not 0 < topk <= num_experts:
        raise ModelConfigError(f"{source}: num_experts_per_tok must be in [1, n_routed_experts]")
    if d.get("norm_topk_prob", True) is not True and topk > 1:
        raise ModelConfigError(f"{source}: norm_topk_prob=false is not supported (Megatron-Core renormalises "
                               "sigmoid routing weights whenever num_experts_per_tok > 1)")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if d.get(key, want) != want:
            raise ModelConfigError(f"{source}: {key}={d.get(key)!r} is not supported ({want!r} only)")
    n_group = num("n_group", default=8)
    topk_group = num("topk_group", default=4)
    if num_experts % n_group or num_experts // n_group < 2:
        raise ModelConfigError(f"{source}: n_group={n_group} must divide n_routed_experts={num_experts} into groups "
                               "of at least 2 experts (a group is scored by its top 2)")
    if topk_group > n_group or topk > topk_group * (num_experts // n_group):
        raise ModelConfigError(f"{source}: topk_group={topk_group} groups of {num_experts // n_group} experts cannot "
                               f"hold num_experts_per_tok={topk} (n_group={n_group})")
    if d.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (silu only)")
    if d.get("attention_bias", False):
        raise ModelConfigError(f"{source}: attention_bias=true is not supported (Megatron's MLA has no biases)")
    if d.get("rope_interleave", True) is not True:
        raise ModelConfigError(f"{source}: rope_interleave=false is not supported (Megatron-Core's MLA rotates "
                               "in the interleaved layout)")
    heads = num("num_attention_heads")
    kv_heads = num("num_key_value_heads", default=heads)
    if kv_heads != heads:
        raise ModelConfigError(f"{source}: num_key_value_heads={kv_heads} must equal num_attention_heads={heads} "
                               "(multi-latent attention expands k/v for every head)")
    q_lora = d.get("q_lora_rank", 1536)
    q_lora = None if q_lora is None else int_field(d, source, "q_lora_rank")
    rope_dim = num("qk_rope_head_dim", default=64)
    if rope_dim % 2:
        raise ModelConfigError(f"{source}: qk_rope_head_dim={rope_dim} must be even")
    if d.get("head_dim") not in (None, rope_dim):
        # transformers' rotary table has head_dim channels (modeling_deepseek_v3.py:86; its config
        # sets head_dim = qk_rope_head_dim unless given): any other value breaks the reference model
        raise ModelConfigError(f"{source}: head_dim={d.get('head_dim')} must equal qk_rope_head_dim={rope_dim} "
                               "(or be left out)")
    max_pos = num("max_position_embeddings", default=4096)
    theta, yarn = _rope(d, source, max_pos)
    fields = DeepseekV3Fields(
        q_lora_rank=q_lora, kv_lora_rank=num("kv_lora_rank", default=512),
        qk_nope_head_dim=num("qk_nope_head_dim", default=128), qk_rope_head_dim=rope_dim,
        v_head_dim=num("v_head_dim", default=128), n_group=n_group, topk_group=topk_group, yarn=yarn)
    moe_i = num("moe_intermediate_size")
    return MoeArch(
        model_type=MODEL_TYPE,
        vocab_size=num("vocab_size"),
        hidden_size=num("hidden_size"),
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=fields.q_head_dim,  # transformers' qk_head_dim; the family's own code reads `fields`
        num_experts=num_experts,
        moe_topk=topk,
        moe_intermediate_size=moe_i,
        rms_norm_eps=float_field(d, source, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=False,
        qk_norm=False,  # GQA's per-head q/k norms: none (MLA's latent norms are the family's own)
        family_fields=fields,
        **sigmoid_moe_fields(d, source, first_dense=first_dense, moe_intermediate=moe_i, scaling_default=2.5),
    )
