"""The one Hugging Face <-> Megatron-Core name/shape map for Qwen3-MoE.

Declarative: `RULES` pairs a Megatron parameter-name template with the HF tensor name(s) it is
made of and a `Kind` saying how the tensors combine and how the result is split across ranks.
Loading (HF -> sharded model), conversion (both directions) and weight sync (sharded model -> HF)
all go through the helpers below; nothing else in the project spells these names.

Three layouts appear:
  * HF tensors: what a Hub checkpoint stores (per-expert gate/up/down, separate q/k/v).
  * "full" Megatron tensor: the unsharded Megatron parameter (QKV grouped per query group,
    fc1 = [gate; up], vocab padded). This is also what torch_dist checkpoints store globally.
  * "local" shard: what one rank holds (QKV split by query groups, fc1 as [gate_i; up_i], ...).
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from gspo_megatron.model.qwen3_moe import Qwen3MoeArch


class Kind(enum.Enum):
    REPLICATED = "replicated"  # same on every rank (norms, router)
    VOCAB = "vocab"  # rows = vocab, padded, split on dim 0 across TP
    QKV = "qkv"  # q,k,v merged per query group, split on dim 0 across TP (by groups)
    ROW = "row"  # split on dim 1 across TP (attention output projection)
    EXPERT_FC1 = "expert_fc1"  # [gate; up] of one expert, split across expert-TP as [gate_i; up_i]
    EXPERT_FC2 = "expert_fc2"  # down projection of one expert, split on dim 1 across expert-TP

    @property
    def is_expert(self) -> bool:
        return self in (Kind.EXPERT_FC1, Kind.EXPERT_FC2)


@dataclass(frozen=True)
class Rule:
    mcore: str  # Megatron name template; {layer} is the local (per-stage) index, {expert} local
    hf: tuple[str, ...]  # HF name templates; {layer}/{expert} are global indices
    kind: Kind
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        pat = re.escape(self.mcore).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(
            r"\{expert\}", r"(?P<expert>\d+)"
        )
        object.__setattr__(self, "_regex", re.compile(pat))

    @property
    def per_layer(self) -> bool:
        return "{layer}" in self.mcore

    def hf_names(self, layer: int | None = None, expert: int | None = None) -> tuple[str, ...]:
        return tuple(t.format(layer=layer, expert=expert) for t in self.hf)


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_EXP_HF = (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight")
_DOWN_HF = (_H + "mlp.experts.{expert}.down_proj.weight",)

RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.VOCAB),
    Rule("output_layer.weight", ("lm_head.weight",), Kind.VOCAB),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.REPLICATED),
    # local spec: separate norm; TE spec: fused into linear_qkv
    Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), Kind.REPLICATED),
    Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",), Kind.REPLICATED),
    Rule(
        _L + "self_attention.linear_qkv.weight",
        (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        Kind.QKV,
    ),
    Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), Kind.REPLICATED),
    Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), Kind.REPLICATED),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Kind.ROW),
    Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), Kind.REPLICATED),
    Rule(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), Kind.REPLICATED),
    # SequentialMLP (portable spec) and TEGroupedMLP (GPU spec) name the same expert weights
    Rule(_L + "mlp.experts.local_experts.{expert}.linear_fc1.weight", _EXP_HF, Kind.EXPERT_FC1),
    Rule(_L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", _DOWN_HF, Kind.EXPERT_FC2),
    Rule(_L + "mlp.experts.linear_fc1.weight{expert}", _EXP_HF, Kind.EXPERT_FC1),
    Rule(_L + "mlp.experts.linear_fc2.weight{expert}", _DOWN_HF, Kind.EXPERT_FC2),
)

# The HF-side rules, one per distinct HF tensor group (TE/local variants collapse).
HF_RULES: tuple[Rule, ...] = tuple({r.hf: r for r in RULES}.values())


class MappingError(ValueError):
    pass


@dataclass(frozen=True)
class Match:
    rule: Rule
    layer: int | None  # local layer index (per PP stage)
    expert: int | None  # local expert index (per EP rank)


def match(mcore_name: str) -> Match:
    """Which rule produces this Megatron parameter (exact match; names never overlap)."""
    name = mcore_name[len("module."):] if mcore_name.startswith("module.") else mcore_name
    hits = [(r, m) for r in RULES if (m := r._regex.fullmatch(name))]
    if not hits:
        raise MappingError(f"no HF mapping for Megatron parameter {mcore_name!r}")
    if len(hits) > 1:  # a bug in RULES, not in the input
        raise AssertionError(f"ambiguous mapping rules for {mcore_name!r}")
    rule, m = hits[0]
    gd = m.groupdict()
    return Match(rule, int(gd["layer"]) if "layer" in gd else None, int(gd["expert"]) if "expert" in gd else None)


def expected_hf_names(arch: Qwen3MoeArch) -> list[str]:
    """Every tensor name a Hub checkpoint of `arch` holds (lm_head absent when tied)."""
    names: list[str] = []
    for r in HF_RULES:
        if r.hf == ("lm_head.weight",) and arch.tie_word_embeddings:
            continue
        layers = range(arch.num_layers) if r.per_layer else [None]
        experts = range(arch.num_experts) if r.kind.is_expert else [None]
        for layer in layers:
            for e in experts:
                names.extend(r.hf_names(layer, e))
    return names


def hf_shapes(arch: Qwen3MoeArch) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor shapes, for validating checkpoints before any heavy work."""
    H, D, I = arch.hidden_size, arch.head_dim, arch.moe_intermediate_size
    nq, nkv = arch.num_attention_heads, arch.num_key_value_heads
    by_suffix = {
        "embed_tokens.weight": (arch.vocab_size, H),
        "lm_head.weight": (arch.vocab_size, H),
        "model.norm.weight": (H,),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "q_proj.weight": (nq * D, H),
        "k_proj.weight": (nkv * D, H),
        "v_proj.weight": (nkv * D, H),
        "o_proj.weight": (H, nq * D),
        "q_norm.weight": (D,),
        "k_norm.weight": (D,),
        "mlp.gate.weight": (arch.num_experts, H),
        "gate_proj.weight": (I, H),
        "up_proj.weight": (I, H),
        "down_proj.weight": (H, I),
    }
    out = {}
    for n in expected_hf_names(arch):
        out[n] = next(v for k, v in by_suffix.items() if n.endswith(k))
    return out


# ----------------------------------------------------------------------------------------------
# HF tensors <-> full Megatron tensor


def hf_to_full(rule: Rule, tensors: Sequence[torch.Tensor], arch: Qwen3MoeArch, padded_vocab: int) -> torch.Tensor:
    k = rule.kind
    if k is Kind.VOCAB:
        (t,) = tensors
        if padded_vocab > t.shape[0]:
            pad = t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])
            t = torch.cat([t, pad], 0)
        return t
    if k is Kind.QKV:
        q, kk, v = tensors
        g, D, H = arch.num_key_value_heads, arch.head_dim, arch.hidden_size
        q = q.reshape(g, arch.q_per_group * D, H)
        kk = kk.reshape(g, D, H)
        v = v.reshape(g, D, H)
        return torch.cat([q, kk, v], 1).reshape(-1, H)
    if k is Kind.EXPERT_FC1:
        gate, up = tensors
        return torch.cat([gate, up], 0)
    (t,) = tensors
    return t


def full_to_hf(rule: Rule, full: torch.Tensor, arch: Qwen3MoeArch) -> tuple[torch.Tensor, ...]:
    k = rule.kind
    if k is Kind.VOCAB:
        return (full[: arch.vocab_size],)
    if k is Kind.QKV:
        g, D, H = arch.num_key_value_heads, arch.head_dim, arch.hidden_size
        x = full.reshape(g, (arch.q_per_group + 2) * D, H)
        q, kk, v = torch.split(x, [arch.q_per_group * D, D, D], 1)
        return (q.reshape(-1, H), kk.reshape(-1, H), v.reshape(-1, H))
    if k is Kind.EXPERT_FC1:
        gate, up = full.chunk(2, 0)
        return (gate, up)
    return (full,)


# ----------------------------------------------------------------------------------------------
# full Megatron tensor <-> local shard


def split_dim(kind: Kind) -> int | None:
    return {Kind.VOCAB: 0, Kind.QKV: 0, Kind.ROW: 1, Kind.EXPERT_FC1: 0, Kind.EXPERT_FC2: 1}.get(kind)


def shard(rule: Rule, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's piece. `rank/size` are TP for dense kinds, expert-TP for expert kinds."""
    d = split_dim(rule.kind)
    if d is None or size == 1:
        return full
    if rule.kind is Kind.EXPERT_FC1:
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    if full.shape[d] % size:
        raise MappingError(f"{rule.mcore}: dim {d} of size {full.shape[d]} does not split into {size}")
    return full.chunk(size, d)[rank]


def unshard(rule: Rule, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    d = split_dim(rule.kind)
    if d is None or len(pieces) == 1:
        return pieces[0]
    if rule.kind is Kind.EXPERT_FC1:
        halves = [p.chunk(2, 0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(list(pieces), d)
