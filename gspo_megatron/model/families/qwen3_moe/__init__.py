"""Qwen3-MoE (transformers `Qwen3MoeForCausalLM`, model_type `qwen3_moe`): the first family.

Every layer is MoE (softmax routing over all experts, top-k, renormalised when norm_topk_prob),
per-head RMSNorm on q and k, full RoPE, no biases, no shared experts.
"""
from __future__ import annotations

from typing import Any

from gspo_megatron.model import family, mapping
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.families.qwen3_moe import config as _config


class Qwen3MoeFamily(family.StandardDecoder):
    model_type = _config.MODEL_TYPE
    display_name = "Qwen3-MoE"
    hf_architecture = _config.HF_ARCHITECTURE
    inline_keys = _config.INLINE_KEYS
    required_inline_keys = _config.REQUIRED_INLINE_KEYS
    # every layer: GQA with per-head q/k norms, no biases, then a softmax-routed MoE (no shared
    # expert, no selection bias)
    _rules = (*mapping.embedding_rules(), *mapping.layer_norm_rules(),
              *mapping.gqa_attention_rules(qk_norm=True, qkv_bias=False),
              *mapping.routed_expert_rules(selection_bias=False))

    def read_config(self, hf: dict[str, Any], source: str = "config") -> MoeArch:
        return _config.read_config(hf, source)

    def rules(self, arch: MoeArch) -> tuple:
        return self._rules

    def megatron_options(self, arch: MoeArch) -> dict[str, Any]:
        return dict(
            qk_layernorm=True,
            add_qkv_bias=False,
            ffn_hidden_size=arch.moe_intermediate_size,  # unused by MoE layers; set for validation
            moe_router_score_function="softmax",
            # HF: softmax over all experts, top-k, renormalise if norm_topk_prob. Megatron with
            # pre_softmax=False: top-k logits, then softmax over them == the renormalised version.
            moe_router_pre_softmax=not arch.norm_topk_prob,
        )

    def hf_config(self, hf: dict[str, Any], mtp_layers: int = 0) -> dict[str, Any]:
        if mtp_layers:
            raise ValueError(f"{self.display_name} has no multi-token-prediction layers")
        return {**hf, "model_type": self.model_type, "architectures": [self.hf_architecture]}

    def bridge_run_config(self, arch: MoeArch, dtype: str = "bfloat16") -> dict | None:
        from gspo_megatron.model.families.qwen3_moe.bridge import bridge_run_config

        return bridge_run_config(arch, dtype)

    def bridge_provider(self) -> str | None:
        from gspo_megatron.model.families.qwen3_moe.bridge import PROVIDER

        return PROVIDER

    def hf_from_provider_fields(self, m: dict, path: str, prefix: str, *, provider_defaults: bool) -> dict:
        from gspo_megatron.model.families.qwen3_moe import bridge

        if provider_defaults:
            m = {**bridge.PROVIDER_DEFAULTS, **{k: v for k, v in m.items() if v is not None}}
        return bridge.hf_from_provider_fields(m, path, prefix)

    def reference_model(self, hf: dict[str, Any]):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in hf.items() if k != "model_type"}))


FAMILY = Qwen3MoeFamily()
