"""Shared pieces of the Megatron-side tests: a tiny random model of each family saved with
save_pretrained, and reference log-probs / gradients computed with transformers' model of it."""
from __future__ import annotations

import torch


def tiny_hf_config(**over):
    from transformers import Qwen3MoeConfig

    kw = dict(
        vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    kw.update(over)
    return Qwen3MoeConfig(**kw)


# The families the Megatron-side tests run (tests/test_model_families.py checks this list against the
# registry): each family's tiny test model has every feature it maps to Megatron options.
FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3")


def tiny_glm_config(**over):
    """GLM-4.5 MoE's features on a tiny model: first layer dense, one shared expert, sigmoid routing
    (with a non-zero expert bias, set by make_tiny_hf) and a scaling factor, partial RoPE, QKV bias."""
    from transformers import Glm4MoeConfig

    kw = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, n_group=1, topk_group=1,
        norm_topk_prob=True, attention_bias=True, use_qk_norm=False, num_nextn_predict_layers=0,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    kw.update(over)
    return Glm4MoeConfig(**kw)


def tiny_deepseek_v3_config(**over):
    """DeepSeek-V3's features on a tiny model: multi-latent attention (q and kv latents with their
    norms, a RoPE part, a value head dim unlike q/k's), YaRN RoPE with both mscales, the first two
    layers dense, a shared expert, sigmoid routing (with a non-zero expert bias, set by
    make_tiny_hf) in 4 groups of which 2 are kept (top-2 of 8: top-k / topk_group = 1, where
    Megatron's group score differs from transformers'), a scaling factor."""
    from transformers import DeepseekV3Config

    kw = dict(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=2, routed_scaling_factor=2.5, n_group=4, topk_group=2,
        norm_topk_prob=True, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, num_nextn_predict_layers=0, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    )
    kw.update(over)
    return DeepseekV3Config(**kw)


def make_tiny_hf(path, seed: int = 0, dtype=torch.float32, max_shard_size="200KB", family: str = "qwen3_moe",
                 **over):
    """Random tiny model of `family` written as a sharded safetensors checkpoint; returns the model."""
    import transformers

    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(tiny_hf_config(**over)).eval()
    elif family == "glm4_moe":
        model = transformers.Glm4MoeForCausalLM(tiny_glm_config(**over)).eval()
    elif family == "deepseek_v3":
        model = transformers.DeepseekV3ForCausalLM(tiny_deepseek_v3_config(**over)).eval()
    else:
        raise ValueError(family)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)  # larger than the default init: non-trivial routing and attention
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)  # a bias that changes which experts are chosen
    model.to(dtype).save_pretrained(str(path), max_shard_size=max_shard_size)
    return model


def add_mtp_layer(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Give the tiny checkpoint at `path` one multi-token-prediction layer as DeepSeek-V3 and GLM-4.5
    ship it (transformers builds none): tensors under model.layers.{num_hidden_layers}. in a shard
    of their own, in the dtypes of the real ones (FP8 weights with their fp32 scales, bf16 norms,
    an fp32 projection), listed in the index; config.json declares num_nextn_predict_layers=1.
    Returns the tensors added."""
    import json
    import os

    from safetensors.torch import save_file

    cfg_path = os.path.join(str(path), "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    p = f"model.layers.{L}."
    t = {
        p + "enorm.weight": torch.randn(H, generator=g).to(torch.bfloat16),
        p + "hnorm.weight": torch.randn(H, generator=g).to(torch.bfloat16),
        p + "eh_proj.weight": torch.randn(H, 2 * H, generator=g),
        p + "shared_head.norm.weight": torch.randn(H, generator=g).to(torch.bfloat16),
        p + "mlp.experts.0.down_proj.weight": torch.randn(H, 32, generator=g).to(torch.float8_e4m3fn),
        p + "mlp.experts.0.down_proj.weight_scale_inv": torch.rand(1, 1, generator=g),
    }
    save_file(t, os.path.join(str(path), "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(str(path), "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"].update({k: "model-mtp.safetensors" for k in t})
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2)
    cfg["num_nextn_predict_layers"] = 1
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return t


def random_sequences(vocab: int, lengths, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_token_logprobs(model, seqs) -> list[torch.Tensor]:
    out = []
    for s in seqs:
        logits = model(torch.tensor([s])).logits[0].float()
        out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def hf_mean_nll_grads(model, seqs) -> dict[str, torch.Tensor]:
    """Gradients (Hub names) of the mean token NLL over all sequences; experts split per expert."""
    model.zero_grad()
    lps = hf_token_logprobs(model, seqs)
    n = sum(len(x) for x in lps)
    loss = -sum(x.sum() for x in lps) / n
    loss.backward()
    grads = hub_named_grads(model)
    model.zero_grad()
    return grads


def hub_named_grads(model) -> dict[str, torch.Tensor]:
    """Gradients under Hub names: transformers 5 fuses experts in memory ([E, 2I, H] gate_up with
    gate first, [E, H, I] down); checkpoints and our exporter name them per expert."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(g.shape[0]):
                grads[f"{base}{e}.gate_proj.weight"], grads[f"{base}{e}.up_proj.weight"] = g[e].chunk(2, 0)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                grads[f"{base}{e}.down_proj.weight"] = g[e]
        else:
            grads[name] = g
    return grads


def dcp_tensors(d, part: str = "") -> dict[str, torch.Tensor]:
    """Every global tensor of a torch_dist checkpoint directory whose key contains `part`."""
    from gspo_megatron.checkpoint.dcp_io import DcpReader

    r = DcpReader(str(d))
    try:
        return {k: r.read(k, [0] * len(r.shape(k)), list(r.shape(k))) for k in sorted(r.keys()) if part in k}
    finally:
        r.close()


class GroupStandIn:
    """What Megatron's RoPE code asks of a process group (size and rank), without one."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def lora_leaves(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float64 leaves requiring grad for PEFT-named adapters, one per distinct tensor: an A that
    the adapted model shares (q/k/v's, gate/up's) is one variable under each of its names."""
    leaves = {}
    for t in adapters.values():
        leaves.setdefault(id(t), t.double().requires_grad_())
    return {k: leaves[id(t)] for k, t in adapters.items()}


def lora_merged_params(model, leaf: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """transformers' parameters of `model` with W + scale B A wherever `leaf` has an adapter (the
    paper's definition; the experts' stacked gate_up / down tensors one expert at a time)."""
    def delta(module: str) -> torch.Tensor:
        return scale * leaf[f"{module}.lora_B.weight"] @ leaf[f"{module}.lora_A.weight"]

    params = {}
    for name, p in model.named_parameters():
        w = p.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            w = torch.stack([w[e] + torch.cat([delta(f"{base}{e}.gate_proj"), delta(f"{base}{e}.up_proj")], 0)
                             for e in range(w.shape[0])])
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            w = torch.stack([w[e] + delta(f"{base}{e}.down_proj") for e in range(w.shape[0])])
        elif name.endswith(".weight") and f"{name[:-len('.weight')]}.lora_A.weight" in leaf:
            w = w + delta(name[: -len(".weight")])
        params[name] = w
    return params


def random_lora_adapters(cfg, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Random rank-`rank` adapters in PEFT's names and HF layout (A r x in, B out x r) on every
    attention projection and MLP of a tiny HF config (Qwen3-MoE's, GLM-4.5's: its dense first
    layers and shared experts too), tied as the Megatron model fuses them: q/k/v one A, gate/up
    one A. B is not zero, so every gradient is non-trivial."""
    g = torch.Generator().manual_seed(seed)
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    out: dict[str, torch.Tensor] = {}

    def a(n_in):
        return (torch.rand(rank, n_in, generator=g) * 2 - 1) / n_in ** 0.5

    def b(n_out):
        return torch.randn(n_out, rank, generator=g) * 0.2

    def mlp(prefix, inter):
        shared = a(H)
        for name in ("gate_proj", "up_proj"):
            out[f"{prefix}{name}.lora_A.weight"] = shared
            out[f"{prefix}{name}.lora_B.weight"] = b(inter)
        out[f"{prefix}down_proj.lora_A.weight"] = a(inter)
        out[f"{prefix}down_proj.lora_B.weight"] = b(H)

    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shared = a(H)
        for name, n_out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"{p}self_attn.{name}.lora_A.weight"] = shared
            out[f"{p}self_attn.{name}.lora_B.weight"] = b(n_out)
        out[f"{p}self_attn.o_proj.lora_A.weight"] = a(q)
        out[f"{p}self_attn.o_proj.lora_B.weight"] = b(H)
        if layer < getattr(cfg, "first_k_dense_replace", 0):
            mlp(f"{p}mlp.", cfg.intermediate_size)
            continue
        if getattr(cfg, "n_shared_experts", 0):
            mlp(f"{p}mlp.shared_experts.", cfg.moe_intermediate_size * cfg.n_shared_experts)
        for e in range(getattr(cfg, "n_routed_experts", None) or cfg.num_experts):
            mlp(f"{p}mlp.experts.{e}.", cfg.moe_intermediate_size)
    return out
