"""The architecture of a decoder-only MoE model, as every family's HF-config reader produces it.

One frozen record, family-neutral: the fields are the architecture features Megatron-Core has
options for (model/spec.py turns them into a TransformerConfig and layer specs), with the first
family's values (Qwen3-MoE: every layer MoE, softmax routing, QK-norm, full RoPE, no biases) as
defaults. A family (model/families/<name>/) reads its HF config into this record, validates what
it refuses, and names its HF tensors; nothing outside a family reads an HF config's fields.

The parameter counts here are the planner's (planner.py) and are checked against the built model
and transformers' model of each family (tests/test_model_families.py).
"""
from __future__ import annotations

from dataclasses import dataclass

# Megatron pads the vocabulary so each TP shard is a multiple of this (Megatron-LM's default
# make-vocab-size-divisible-by); exports slice back to the HF vocab size.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocabulary Megatron builds: each TP shard a multiple of VOCAB_PAD_MULTIPLE rows."""
    m = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab // m) * m


@dataclass(frozen=True)
class MoeArch:
    """What the backend uses of a model's HF config (model_type names its family)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    moe_topk: int
    moe_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    norm_topk_prob: bool
    # ---- features beyond the first family (defaults: absent) ----
    # Global indices of the layers whose MLP is dense (GLM-4.5: the first `first_k_dense_replace`).
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    # Width of the always-on shared expert(s) of every MoE layer (0: none).
    shared_expert_intermediate_size: int = 0
    # Router: "softmax" over all experts, or per-expert "sigmoid"; a fixed per-expert bias added to
    # the scores for the choice only; a factor applied to the chosen experts' weights.
    router_score: str = "softmax"
    router_expert_bias: bool = False
    routed_scaling_factor: float = 1.0
    # Fraction of each head's dimensions rotated by RoPE (the first ones, rotate-half layout).
    rotary_percent: float = 1.0
    qkv_bias: bool = False
    qk_norm: bool = True
    # Multi-token-prediction layers the config declares (tensors under model.layers.{num_layers + i});
    # not part of the policy: the loader skips them with a warning, exports declare none.
    mtp_layers: int = 0
    # What only this family has (a frozen, hashable record its folder defines: another attention's
    # ranks and head dims, scaled RoPE, group-limited routing); read by the family's own code only,
    # never by shared code, so a new family adds no field here.
    family_fields: object = None

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict, source: str = "config") -> "MoeArch":
        """Validate an HF config dict with its family's reader (model/family.py)."""
        from gspo_megatron.model.registry import arch_from_hf_dict

        return arch_from_hf_dict(d, source)

    @classmethod
    def from_hf_dir(cls, hf_dir: str) -> "MoeArch":
        from gspo_megatron.model.registry import arch_from_hf_dir

        return arch_from_hf_dir(hf_dir)

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab(self.vocab_size, tp)

    @property
    def q_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def family(self):
        """This architecture's ModelFamily (model/family.py)."""
        from gspo_megatron.model.registry import family_of_type

        return family_of_type(self.model_type)

    def dims_for_validation(self) -> dict[str, int]:
        """The sizes ParallelConfig.check_model checks a layout against."""
        return dict(
            layers=self.num_layers,
            heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads,
            experts=self.num_experts,
            expert_width=self.moe_intermediate_size if self.num_experts else None,
        )

    # ---- parameter counts (the planner's; real vocabulary, unsharded unless tp/ep/etp given) --
    def layer_params(self, layer: int, tp: int = 1, ep: int = 1, etp: int = 1) -> dict[str, int]:
        """One decoder layer's parameters on one rank (tp = ep = etp = 1: the whole layer)."""
        H = self.hidden_size
        split, whole = self.family.attention_params(self, tp)  # the family's attention: over TP, on every rank
        out = {"attention": split + whole, "norms": 2 * H, "router": 0, "router_bias": 0, "experts": 0,
               "shared_experts": 0, "dense_mlp": 0, "expert_active": 0}
        if self.is_moe_layer(layer):
            E, I = self.num_experts, self.moe_intermediate_size
            per_expert = 3 * H * I
            out["router"] = E * H
            # the selection bias: a buffer in Megatron (router.py register_buffer), not a parameter a
            # rank's buffers, gradients or optimizer hold (--simulate counts those: train/simulate.py)
            out["router_bias"] = E if self.router_expert_bias else 0
            out["experts"] = (E // ep) * per_expert // etp
            out["expert_active"] = self.moe_topk * per_expert
            out["shared_experts"] = 3 * H * self.shared_expert_intermediate_size // tp
        else:
            out["dense_mlp"] = 3 * H * self.dense_intermediate_size // tp
        return out

    def count_params(self) -> dict:
        """Total and active parameter counts of the unsharded model (real vocab); the router's
        expert bias is counted (a buffer in both transformers and Megatron, never trained here)."""
        V, H = self.vocab_size, self.hidden_size
        embed = V * H
        output = 0 if self.tie_word_embeddings else V * H
        br = {"embedding": embed, "output_layer": output, "final_norm": H, "attention": 0, "norms": 0,
              "router": 0, "experts": 0, "shared_experts": 0, "dense_mlp": 0}
        active = embed + output + H
        for i in range(self.num_layers):
            lp = self.layer_params(i)
            for k in ("attention", "norms", "router", "experts", "shared_experts", "dense_mlp"):
                br[k] += lp[k]
            br["router"] += lp["router_bias"]
            active += (lp["attention"] + lp["norms"] + lp["router"] + lp["router_bias"] + lp["shared_experts"]
                       + lp["dense_mlp"] + lp["expert_active"])
        return {"total": sum(br.values()), "active": active, "breakdown": br}
