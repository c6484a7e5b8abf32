"""DeepSeek-V3 (transformers `DeepseekV3ForCausalLM`, model_type `deepseek_v3`): the third family.

The architecture of DeepSeek-V3/V3.1/R1, Kimi-K2 and Moonlight: multi-head latent attention
(Megatron-Core's MLASelfAttention with MLATransformerConfig), YaRN RoPE, the first layers dense,
shared experts, sigmoid routing with a selection bias, node-limited groups and a routed scaling
factor. The reader (config.py) says where transformers and Megatron differ and what is refused;
megatron_patches.py changes Megatron's group scoring to transformers'.

Tensor-parallel layout of the attention, as Megatron's Transformer Engine spec builds it: the two
down projections (to the q latent, to the kv latent + RoPE key) are replicated on every TP rank
(TELinear 'duplicated'; on CPU the local `Linear` of megatron.core.post_training.modelopt, the
class multi_latent_attention.py accepts for it), the up projections column-parallel and the output
projection row-parallel. Megatron's local spec would make the down projections column-parallel
(ColumnParallelLinear), and then the RoPE key's gradient is wrong at TP > 1: its output is gathered
over TP (gather_from_tensor_model_parallel_region), whose backward keeps each rank's slice, but
every rank uses the whole RoPE key for its own heads only, so the slice misses the other ranks'
heads' share (multi_latent_attention.py:603-622; the duplicated branch gathers it over the
sequence, whose backward sums them). tests/test_megatron_parity.py[deepseek_v3-tp2-sp] fails
with the column-parallel layout (relative gradient errors 4e-2 to 8e-2) and passes with this one.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

from gspo_megatron.model import family, mapping
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.families.deepseek_v3 import config as _config
from gspo_megatron.model.mapping import Kind, Rule

_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_A = _L + "self_attention."
_HA = _H + "self_attn."


def _f(a: MoeArch) -> _config.DeepseekV3Fields:
    return a.family_fields


def mla_rules(arch: MoeArch) -> list[Rule]:
    """Multi-latent attention: HF's q_a_proj / q_a_layernorm / q_b_proj (or q_proj),
    kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj and o_proj as Megatron's MLASelfAttention names
    them (local spec; the TE spec fuses the two latent norms into the up projections)."""
    def q_out(a):
        return a.num_attention_heads * _f(a).q_head_dim

    rules = []
    if _f(arch).q_lora_rank is None:
        rules.append(Rule(_A + "linear_q_proj.weight", (_HA + "q_proj.weight",), Kind.COLUMN,
                          lambda a: ((q_out(a), a.hidden_size),), extra_state="self_attention.linear_q_proj"))
    else:
        def q_lora(a):
            return _f(a).q_lora_rank

        rules += [
            Rule(_A + "linear_q_down_proj.weight", (_HA + "q_a_proj.weight",), Kind.REPLICATED,
                 lambda a: ((q_lora(a), a.hidden_size),), extra_state="self_attention.linear_q_down_proj"),
            Rule(_A + "q_layernorm.weight", (_HA + "q_a_layernorm.weight",), Kind.REPLICATED,
                 lambda a: ((q_lora(a),),)),
            Rule(_A + "linear_q_up_proj.layer_norm_weight", (_HA + "q_a_layernorm.weight",), Kind.REPLICATED,
                 lambda a: ((q_lora(a),),)),
            Rule(_A + "linear_q_up_proj.weight", (_HA + "q_b_proj.weight",), Kind.COLUMN,
                 lambda a: ((q_out(a), q_lora(a)),), extra_state="self_attention.linear_q_up_proj"),
        ]

    def kv_lora(a):
        return _f(a).kv_lora_rank

    rules += [
        Rule(_A + "linear_kv_down_proj.weight", (_HA + "kv_a_proj_with_mqa.weight",), Kind.REPLICATED,
             lambda a: ((kv_lora(a) + _f(a).qk_rope_head_dim, a.hidden_size),),
             extra_state="self_attention.linear_kv_down_proj"),
        Rule(_A + "kv_layernorm.weight", (_HA + "kv_a_layernorm.weight",), Kind.REPLICATED,
             lambda a: ((kv_lora(a),),)),
        Rule(_A + "linear_kv_up_proj.layer_norm_weight", (_HA + "kv_a_layernorm.weight",), Kind.REPLICATED,
             lambda a: ((kv_lora(a),),)),
        Rule(_A + "linear_kv_up_proj.weight", (_HA + "kv_b_proj.weight",), Kind.COLUMN,
             lambda a: ((a.num_attention_heads * (_f(a).qk_nope_head_dim + _f(a).v_head_dim), kv_lora(a)),),
             extra_state="self_attention.linear_kv_up_proj"),
        Rule(_A + "linear_proj.weight", (_HA + "o_proj.weight",), Kind.ROW,
             lambda a: ((a.hidden_size, a.num_attention_heads * _f(a).v_head_dim),),
             extra_state="self_attention.linear_proj"),
    ]
    return rules


def _layer_norm_rules() -> list[Rule]:
    # MLA's TE spec keeps the input norm as a module of its own (TENorm, with an _extra_state),
    # where GQA's fuses it into linear_qkv
    return [dataclasses.replace(r, extra_state="input_layernorm") if r.mcore.endswith("input_layernorm.weight")
            else r for r in mapping.layer_norm_rules()]


class DeepseekV3Family:
    model_type = _config.MODEL_TYPE
    display_name = "DeepSeek-V3"
    hf_architecture = _config.HF_ARCHITECTURE
    inline_keys = _config.INLINE_KEYS
    required_inline_keys = _config.REQUIRED_INLINE_KEYS

    def read_config(self, hf: dict[str, Any], source: str = "config") -> MoeArch:
        return _config.read_config(hf, source)

    def rules(self, arch: MoeArch) -> tuple:
        return _rules(arch)

    # ---- the planner's counts ----------------------------------------------------------------
    def attention_params(self, arch: MoeArch, tp: int = 1) -> tuple[int, int]:
        """(q/kv up and output projections, split over TP; the down projections and the latent
        norms, whole on every TP rank)."""
        f, H, nh = _f(arch), arch.hidden_size, arch.num_attention_heads
        up = nh * f.q_head_dim * (H if f.q_lora_rank is None else f.q_lora_rank)
        up += f.kv_lora_rank * nh * (f.qk_nope_head_dim + f.v_head_dim) + nh * f.v_head_dim * H
        down = (0 if f.q_lora_rank is None else H * f.q_lora_rank) + H * (f.kv_lora_rank + f.qk_rope_head_dim)
        return up // tp, down + (f.q_lora_rank or 0) + f.kv_lora_rank

    def attention_activation_elements(self, arch: MoeArch, tp: int, selective: bool) -> float:
        """Per token on one TP rank: the latents before and after their norms (gathered: full
        width), the up projections' outputs, q and k after RoPE, and the attention output unless
        core attention is recomputed."""
        f, nh = _f(arch), arch.num_attention_heads
        latents = 2 * ((f.q_lora_rank or 0) + f.kv_lora_rank) + f.qk_rope_head_dim
        per_head = (f.q_head_dim + (f.qk_nope_head_dim + f.v_head_dim) + 2 * f.q_head_dim
                    + (0 if selective else f.v_head_dim))
        return latents + nh * per_head / tp

    def attention_summary(self, arch: MoeArch) -> str:
        f = _f(arch)
        q = "q full" if f.q_lora_rank is None else f"q rank {f.q_lora_rank}"
        return (f"MLA {arch.num_attention_heads} heads, {q}, kv rank {f.kv_lora_rank}, qk {f.qk_nope_head_dim}+"
                f"{f.qk_rope_head_dim} rope, v {f.v_head_dim}" + (", YaRN" if f.yarn else ""))

    def kv_cache_bytes_per_token(self, arch: MoeArch, dtype_bytes: int) -> int:
        """Engines cache MLA's latent and its RoPE key, one per token and layer, not per head."""
        f = _f(arch)
        return arch.num_layers * (f.kv_lora_rank + f.qk_rope_head_dim) * dtype_bytes

    def engine_config_overrides(self, arch: MoeArch) -> dict[str, Any]:
        """transformers' DeepseekV3 routes with sigmoid scores and the selection bias whatever the
        config says (DeepseekV3TopkRouter) and its config class has neither key; vLLM and SGLang
        read `scoring_func` (default softmax) and `topk_method` (the bias exists only for
        "noaux_tc"): vLLM models/deepseek_v2.py:327-332, 387; SGLang models/deepseek_v2.py:519-537,
        775. Without them a transformers-saved checkpoint is served with softmax routing, or not
        loaded (its e_score_correction_bias has no parameter)."""
        return {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}

    def vllm_lora_modules(self, arch: MoeArch) -> dict[str, tuple[str, ...]]:
        """None: vLLM fuses the q and kv down projections into one fused_qkv_a_proj, where the
        trainer's adapters on Megatron's two down projections are not what it binds; every
        adapter of this family is pushed merged."""
        return {}

    def vllm_server_args(self, arch: MoeArch, device: str, dtype: str | None) -> list[str]:
        """On CPU, vLLM 0.32 runs multi-latent attention with two backends whose kernels take a
        latent of kv_lora_rank + qk_rope_head_dim = 576 only (DeepSeek-V3's 512 + 64;
        v1/attention/backends/mla/cpu_mla.py and amx_mla.py get_supported_head_sizes): another
        size is refused here in one line. It picks AMX_MLA where the CPU has AMX tiles, which takes
        bfloat16 only (amx_mla.py supported_dtypes), else CPU_MLA (float32, bfloat16, float16;
        platforms/cpu.py get_attn_backend_cls): CPU_MLA is asked for, so every CPU serves alike.
        The reload of pushed weights re-derives MLA's absorbed projections (a CPU server matches
        the trainer to 5e-7 after pushes: tests/test_vllm_deepseek_v3.py)."""
        if device != "cpu":
            return []
        f = _f(arch)
        latent = f.kv_lora_rank + f.qk_rope_head_dim
        if latent != 576:
            from gspo_megatron.errors import ModelConfigError

            raise ModelConfigError(
                f"vLLM 0.32 on CPU serves multi-latent attention with kv_lora_rank + qk_rope_head_dim = 576 only "
                f"(its CPU MLA kernels); this model has {f.kv_lora_rank} + {f.qk_rope_head_dim} = {latent}: serve it "
                "with SGLang (rollout.backend=sglang), the in-process engine (rollout.backend=hf) or vLLM on GPU")
        return ["--attention-backend", "CPU_MLA"]

    def weights_loaded_together(self, arch: MoeArch) -> tuple[tuple[str, ...], ...]:
        """SGLang 0.5.23 fuses q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa (when
        q_lora_rank is set) and writes it only when both arrived in the same load_weights call: each
        is cached in a dict local to the call until its partner comes (deepseek_common/
        deepseek_weight_loader.py do_load_weights, `cached_a_proj`); a lone one is dropped without a
        word. (kv_b_proj may arrive in any request: post_load_weights recomputes the absorbed
        w_kc/w_vc of the layers whose kv_b_proj the call loaded.)"""
        if _f(arch).q_lora_rank is None:
            return ()
        return ((_HA + "q_a_proj.weight", _HA + "kv_a_proj_with_mqa.weight"),)

    def routers(self, model) -> list:
        # DeepseekV3TopkRouter returns (logits, weights, top-k indices) as the others' gates do
        return family.transformers_gate_routers(model)

    # ---- Megatron-Core ----------------------------------------------------------------------
    def megatron_config_class(self, arch: MoeArch) -> type:
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def megatron_options(self, arch: MoeArch) -> dict[str, Any]:
        f = _f(arch)
        y = f.yarn
        opts = dict(
            multi_latent_attention=True,
            q_lora_rank=f.q_lora_rank,
            kv_lora_rank=f.kv_lora_rank,
            qk_head_dim=f.qk_nope_head_dim,  # Megatron's qk_head_dim is the non-RoPE part
            qk_pos_emb_head_dim=f.qk_rope_head_dim,
            v_head_dim=f.v_head_dim,
            qk_layernorm=True,  # the q and kv latents' RMSNorms (MLA's q_layernorm / kv_layernorm)
            rotary_base=arch.rope_theta,
            # "rope": the softmax's mscale must be 1 (multi_latent_attention.py:125-126 applies
            # YaRN's mscale_all_dim whatever rope_type is), hence factor 1
            rope_type="yarn" if y else "rope",
            rotary_scaling_factor=y.factor if y else 1.0,
            original_max_position_embeddings=y.original_max_position_embeddings if y else arch.max_position_embeddings,
            beta_fast=y.beta_fast if y else 32.0,
            beta_slow=y.beta_slow if y else 1.0,
            mscale=y.mscale if y else 1.0,
            mscale_all_dim=y.mscale_all_dim if y else 0.0,
            ffn_hidden_size=arch.dense_intermediate_size,  # the dense first layers
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            # the expert bias stays what the checkpoint says (GLM-4.5's family says why)
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=arch.routed_scaling_factor,
        )
        if f.n_group > 1:
            opts.update(moe_router_num_groups=f.n_group, moe_router_group_topk=f.topk_group)
        if arch.shared_expert_intermediate_size:
            opts["moe_shared_expert_intermediate_size"] = arch.shared_expert_intermediate_size
        return opts

    def install_megatron_patches(self, arch: MoeArch) -> None:
        from gspo_megatron.model.families.deepseek_v3 import megatron_patches

        megatron_patches.install()

    def layer_spec(self, config, is_moe: bool, use_te: bool):
        from gspo_megatron.model.spec import megatron_layer_spec

        spec = megatron_layer_spec(config, is_moe, use_te, multi_latent_attention=True)
        if not use_te:  # replicated down projections, as the TE spec has them (module docstring)
            from megatron.core.post_training.modelopt.layers import Linear

            attn = spec.submodules.self_attention.submodules
            attn.linear_q_down_proj = Linear
            attn.linear_kv_down_proj = Linear
        return spec

    def gpt_model_options(self, arch: MoeArch) -> dict[str, Any]:
        # GPTModel builds no rotary table of its own for MLA (gpt_model.py:159): the attention's
        # RoPE (plain or YaRN) comes from megatron_options
        return dict(position_embedding_type="rope")

    # ---- HF configs, Megatron-Bridge, the reference -----------------------------------------
    def hf_config(self, hf: dict[str, Any], mtp_layers: int = 0) -> dict[str, Any]:
        """The router's method and scoring function as DeepSeek's own configs state them (vLLM and
        SGLang read them: their defaults are softmax routing); the MTP layers declared are the
        ones the writer carries (none unless it says)."""
        out = {**hf, "model_type": self.model_type, "architectures": [self.hf_architecture],
               **self.engine_config_overrides(None)}
        for k in ("num_nextn_predict_layers", "num_mtp_layers"):
            out[k] = mtp_layers
        return out

    def bridge_run_config(self, arch: MoeArch, dtype: str = "bfloat16") -> dict | None:
        return None  # checkpoints carry hf_config/, which every reader uses

    def bridge_provider(self) -> str | None:
        return None

    def hf_from_provider_fields(self, m: dict, path: str, prefix: str, *, provider_defaults: bool) -> dict:
        from gspo_megatron.errors import ModelConfigError

        raise ModelConfigError(f"{path}: {self.display_name} checkpoints are read with their hf_config/ only")

    def reference_model(self, hf: dict[str, Any]):
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        drop = {"model_type", "scoring_func", "topk_method"}
        return DeepseekV3ForCausalLM(DeepseekV3Config(**{k: v for k, v in hf.items() if k not in drop}))


@functools.lru_cache(maxsize=16)  # asked once per parameter (mapping.match); MoeArch is frozen
def _rules(arch: MoeArch) -> tuple:
    return (*mapping.embedding_rules(), *_layer_norm_rules(), *mla_rules(arch),
            *mapping.routed_expert_rules(selection_bias=True),
            *(mapping.shared_expert_rules() if arch.shared_expert_intermediate_size else ()),
            *(mapping.dense_mlp_rules() if arch.dense_layers else ()))


FAMILY = DeepseekV3Family()
