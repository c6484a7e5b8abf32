"""GLM-4.5 / 4.6 MoE (transformers `Glm4MoeForCausalLM`, model_type `glm4_moe`): the second family.

Dense first layers, one shared expert, sigmoid routing with a fixed expert bias and a scaling
factor, partial RoPE, QKV biases; each maps to a Megatron-Core option (`megatron_options`). The
reader (config.py) says where transformers and Megatron differ and what is refused.
"""
from __future__ import annotations

from typing import Any

from gspo_megatron.model import family, mapping
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.families.glm4_moe import config as _config


class Glm4MoeFamily(family.StandardDecoder):
    model_type = _config.MODEL_TYPE
    display_name = "GLM-4.5 MoE"
    hf_architecture = _config.HF_ARCHITECTURE
    inline_keys = _config.INLINE_KEYS
    required_inline_keys = _config.REQUIRED_INLINE_KEYS

    def read_config(self, hf: dict[str, Any], source: str = "config") -> MoeArch:
        return _config.read_config(hf, source)

    def rules(self, arch: MoeArch) -> tuple:
        # GQA (QKV biases, q/k norms as configured), MoE layers routed with a selection bias and a
        # shared expert, the first layers dense
        return (*mapping.embedding_rules(), *mapping.layer_norm_rules(),
                *mapping.gqa_attention_rules(qk_norm=arch.qk_norm, qkv_bias=arch.qkv_bias),
                *mapping.routed_expert_rules(selection_bias=True),
                *(mapping.shared_expert_rules() if arch.shared_expert_intermediate_size else ()),
                *(mapping.dense_mlp_rules() if arch.dense_layers else ()))

    def megatron_options(self, arch: MoeArch) -> dict[str, Any]:
        opts = dict(
            qk_layernorm=arch.qk_norm,
            add_qkv_bias=arch.qkv_bias,
            ffn_hidden_size=arch.dense_intermediate_size,  # the dense first layers
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            # The expert bias stays what the checkpoint says: Megatron would otherwise move it after
            # every step toward balanced loads (finalize_model_grads.py:476 ->
            # moe_utils.py:1052-1075, rate 1e-3 by default); transformers and the engines treat it as
            # a fixed buffer, and an RL step must not change the routing the engine reproduces.
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=arch.routed_scaling_factor,
        )
        if arch.shared_expert_intermediate_size:
            opts["moe_shared_expert_intermediate_size"] = arch.shared_expert_intermediate_size
        return opts

    def hf_config(self, hf: dict[str, Any], mtp_layers: int = 0) -> dict[str, Any]:
        """The MTP layers declared are the ones the writer carries (none unless it says)."""
        out = {**hf, "model_type": self.model_type, "architectures": [self.hf_architecture]}
        for k in ("num_nextn_predict_layers", "num_mtp_layers"):
            if k in out:
                out[k] = mtp_layers
        if mtp_layers:
            out["num_nextn_predict_layers"] = mtp_layers
        return out

    def bridge_run_config(self, arch: MoeArch, dtype: str = "bfloat16") -> dict | None:
        return None  # no Megatron-Bridge table yet: checkpoints carry hf_config/, which every reader uses

    def bridge_provider(self) -> str | None:
        return None

    def hf_from_provider_fields(self, m: dict, path: str, prefix: str, *, provider_defaults: bool) -> dict:
        from gspo_megatron.errors import ModelConfigError

        raise ModelConfigError(f"{path}: {self.display_name} checkpoints are read with their hf_config/ only")

    def reference_model(self, hf: dict[str, Any]):
        from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

        return Glm4MoeForCausalLM(Glm4MoeConfig(**{k: v for k, v in hf.items() if k != "model_type"}))


FAMILY = Glm4MoeFamily()
