"""Qwen3-MoE's Megatron-Bridge / Megatron-LM tables: its provider's fields <-> its HF config.

`checkpoint/megatron_dirs.py` reads run_config.yaml and Megatron-LM's run arguments (files) and
asks the family for the model; this module knows which fields make a Qwen3-MoE.
"""
from __future__ import annotations

from gspo_megatron.errors import ModelConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.families.qwen3_moe.config import HF_ARCHITECTURE, MODEL_TYPE, read_config
from gspo_megatron.model.family import as_float, as_int

_DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

PROVIDER = "megatron.bridge.models.qwen.qwen_provider.Qwen3MoEModelProvider"
# Qwen3MoEModelProvider's defaults that decide the architecture (models/qwen/qwen_provider.py:364-398),
# for a run_config that names that provider without listing them
PROVIDER_DEFAULTS = {"normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
                       "add_qkv_bias": False, "qk_layernorm": True, "position_embedding_type": "rope",
                       "layernorm_epsilon": 1e-6, "rotary_base": 1000000.0, "moe_router_pre_softmax": False,
                       "share_embeddings_and_output_weights": False}
# what a Qwen3-MoE must have; anything else is another architecture
REQUIRED_FIELDS = {"normalization": "RMSNorm", "gated_linear_unit": True, "add_bias_linear": False,
             "add_qkv_bias": False, "qk_layernorm": True, "position_embedding_type": "rope"}


def hf_from_provider_fields(m: dict, path: str, prefix: str) -> dict:
    """A Qwen3-MoE HF config dict from Megatron model-provider fields (checked to be Qwen3-MoE);
    errors name the file and the field (`prefix`: "model." for run_config.yaml, "args." for
    Megatron-LM's arguments; field names are the provider's)."""

    def req(key):
        if m.get(key) is None:
            raise ModelConfigError(f"{path}: {prefix}{key} is missing")
        return m[key]

    # every size and count an integer >= 1, every float finite, one line naming the field
    # (int() would read 64.5 as 64 and "64" as 64; float() "nan" as NaN: issue 52)
    def num(key, default=None, minimum=1):
        v = m.get(key) if m.get(key) is not None else default
        if v is None:
            return as_int(req(key), path, prefix + key, minimum)
        return as_int(v, path, prefix + key, minimum)

    def real(key):
        return as_float(req(key), path, prefix + key)

    for key, want in REQUIRED_FIELDS.items():
        if m.get(key) != want:
            raise ModelConfigError(f"{path}: {prefix}{key} is {m.get(key)!r}; a Qwen3-MoE has {want!r}")
    act = m.get("activation_func")
    target = act.get("_target_") if isinstance(act, dict) else act
    if target not in (None, "torch.nn.functional.silu"):
        raise ModelConfigError(f"{path}: {prefix}activation_func is {target!r}; a Qwen3-MoE uses silu")
    if m.get("moe_shared_expert_intermediate_size"):
        raise ModelConfigError(f"{path}: shared experts ({prefix}moe_shared_expert_intermediate_size) are not Qwen3-MoE")
    freq = m.get("moe_layer_freq", 1)
    if freq != 1 and not (isinstance(freq, list) and all(x == 1 for x in freq)):
        raise ModelConfigError(f"{path}: {prefix}moe_layer_freq={freq!r} mixes dense layers in (not supported)")
    heads = num("num_attention_heads")
    dtype = m.get("params_dtype")
    dtype = _DTYPES.get(dtype.get("_target_") if isinstance(dtype, dict) else dtype, "bfloat16")
    hf = {
        "model_type": MODEL_TYPE, "architectures": [HF_ARCHITECTURE],
        "vocab_size": num("vocab_size"), "hidden_size": num("hidden_size"),
        "intermediate_size": num("ffn_hidden_size", default=num("moe_ffn_hidden_size")),
        "moe_intermediate_size": num("moe_ffn_hidden_size"),
        "num_hidden_layers": num("num_layers"), "num_attention_heads": heads,
        "num_key_value_heads": num("num_query_groups", default=heads),
        "head_dim": num("kv_channels", default=num("hidden_size") // heads),
        "num_experts": num("num_moe_experts"), "num_experts_per_tok": num("moe_router_topk"),
        "norm_topk_prob": not bool(m.get("moe_router_pre_softmax", False)),
        "rms_norm_eps": real("layernorm_epsilon"),
        "rope_parameters": {"rope_type": "default", "rope_theta": real("rotary_base")},
        "max_position_embeddings": num("max_position_embeddings", default=m.get("seq_length") or 32768),
        "tie_word_embeddings": bool(m.get("share_embeddings_and_output_weights", False)),
        "hidden_act": "silu", "attention_bias": False, "dtype": dtype,
    }
    read_config(hf, source=path)
    return hf


def bridge_run_config(arch: MoeArch, dtype: str = "bfloat16", ffn_hidden_size: int | None = None) -> dict:
    """The run_config.yaml contents for a checkpoint of `arch`: the Qwen3-MoE provider with the
    architecture's fields (its defaults give RMSNorm, SwiGLU, QK norm, RoPE, no biases) and the
    checkpoint fields Bridge's training loader reads. TP/PP 1: a checkpoint is layout-free."""
    torch_dtype = {"float32": "torch.float32", "float16": "torch.float16"}.get(dtype, "torch.bfloat16")
    return {
        "model": {
            "_target_": PROVIDER,
            "num_layers": arch.num_layers, "hidden_size": arch.hidden_size,
            # the dense MLP width (HF intermediate_size; unused when every layer is MoE)
            "ffn_hidden_size": ffn_hidden_size or arch.moe_intermediate_size,
            "moe_ffn_hidden_size": arch.moe_intermediate_size,
            "num_attention_heads": arch.num_attention_heads, "num_query_groups": arch.num_key_value_heads,
            "kv_channels": arch.head_dim, "num_moe_experts": arch.num_experts, "moe_router_topk": arch.moe_topk,
            "moe_router_pre_softmax": not arch.norm_topk_prob,
            "vocab_size": arch.vocab_size, "seq_length": arch.max_position_embeddings,
            "max_position_embeddings": arch.max_position_embeddings, "layernorm_epsilon": arch.rms_norm_eps,
            "rotary_base": arch.rope_theta, "share_embeddings_and_output_weights": arch.tie_word_embeddings,
            "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
            "params_dtype": {"_target_": torch_dtype, "_call_": False},
            "bf16": torch_dtype == "torch.bfloat16", "fp16": torch_dtype == "torch.float16",
        },
        "checkpoint": {"save_rng": False, "save_optim": False, "fully_parallel_save": True},
    }
