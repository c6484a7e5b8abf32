"""The Hugging Face <-> Megatron-Core name/shape map: the generic machinery every family uses.

Declarative: a family's rules (`ModelFamily.rules(arch)`, composed in the family's folder of the
rule blocks below, for the HF naming transformers' decoder families share, and of blocks of its
own) pair a Megatron parameter-name template with the HF tensor name(s) it is made of and a `Kind`
saying how the tensors combine and how the result is split across ranks. Loading (HF -> sharded model), conversion (both directions) and weight sync
(sharded model -> HF) all go through the helpers below; nothing else in the project spells these
names.

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
from typing import Callable, Iterator, Sequence

import torch

from gspo_megatron.model.arch import MoeArch


class Kind(enum.Enum):
    REPLICATED = "replicated"  # same on every rank (norms, router)
    VOCAB = "vocab"  # rows = vocab, padded, split on dim 0 across TP
    QKV = "qkv"  # q,k,v merged per query group, split on dim 0 across TP (by groups)
    ROW = "row"  # split on dim 1 across TP (attention output projection)
    EXPERT_FC1 = "expert_fc1"  # [gate; up] of one expert, split across expert-TP as [gate_i; up_i]
    EXPERT_FC2 = "expert_fc2"  # down projection of one expert, split on dim 1 across expert-TP
    DENSE_FC1 = "dense_fc1"  # [gate; up] of a dense or shared-expert MLP, split across TP as [gate_i; up_i]
    COLUMN = "column"  # one projection, rows split on dim 0 across TP (a column-parallel linear)

    @property
    def is_expert(self) -> bool:
        return self in (Kind.EXPERT_FC1, Kind.EXPERT_FC2)


@dataclass(frozen=True)
class Rule:
    mcore: str  # Megatron name template; {layer} is the local (per-stage) index, {expert} local
    hf: tuple[str, ...]  # HF name templates; {layer}/{expert} are global indices
    kind: Kind
    # The HF shape of each tensor in `hf`, from the architecture.
    shapes: Callable[[MoeArch], tuple[tuple[int, ...], ...]] = field(compare=False, repr=False, default=None)
    # Which decoder layers hold it: "all", "moe" (MoE layers) or "dense" (dense-MLP layers).
    layers: str = "all"
    # Megatron keeps it as a buffer, not a parameter (the router's expert bias).
    buffer: bool = False
    # The Transformer Engine module (path in the layer) whose `_extra_state` Megatron's checkpoints
    # store beside this tensor, one per expert for expert kinds (checkpoint/megatron_dirs.py writes
    # them, empty, into converted checkpoints), and the layers whose TE spec has it when fewer than
    # `layers` (the pre-MLP norm: fused into linear_fc1 in a dense layer).
    extra_state: str = ""
    extra_state_layers: str = ""
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

    @property
    def is_embedding(self) -> bool:
        return self.mcore == EMBEDDING

    @property
    def is_output(self) -> bool:
        """The output layer (absent from checkpoints of a model with tied embeddings)."""
        return self.mcore == OUTPUT_LAYER

    def in_layer(self, arch: MoeArch, layer: int) -> bool:
        return in_scope(self.layers, arch, layer)

    def extra_state_in_layer(self, arch: MoeArch, layer: int) -> bool:
        return bool(self.extra_state) and in_scope(self.extra_state_layers or self.layers, arch, layer)

    def layer_indices(self, arch: MoeArch) -> list[int]:
        return [i for i in range(arch.num_layers) if self.in_layer(arch, i)]


def in_scope(layers: str, arch: MoeArch, layer: int) -> bool:
    """Whether decoder layer `layer` is in a rule's scope: "all", "moe" or "dense" layers."""
    if layers == "all":
        return True
    return arch.is_moe_layer(layer) == (layers == "moe")


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
EMBEDDING = "embedding.word_embeddings.weight"  # Megatron's names, the same for every family
OUTPUT_LAYER = "output_layer.weight"


# ---- rule blocks: what one kind of module names, in transformers' common decoder naming ------
# (`model.embed_tokens`, `model.layers.N.self_attn.*`, `mlp.gate`, `mlp.experts.E.*_proj`,
# `lm_head`). A family composes the blocks its modules are made of, in its own folder
# (model/families/<name>/); a module this file has no block for (another attention) is a block of
# the family's own, built from `Rule` and `Kind`. Local-spec and TE-spec Megatron names of one HF
# tensor are separate rules with the same `hf` (the exporter and the checkpoint layout collapse
# them); the first listed covers every layer holding the tensor (hf_rules).

def _vec(f):
    return lambda a: ((f(a),),)


def _fc1_shape(width):
    return lambda a: ((width(a), a.hidden_size),) * 2


def _fc2_shape(width):
    return lambda a: ((a.hidden_size, width(a)),)


def _hidden(a):
    return a.hidden_size


def embedding_rules() -> list[Rule]:
    """The token embedding, the output layer (absent from the files when tied) and the final norm."""
    return [
        Rule(EMBEDDING, ("model.embed_tokens.weight",), Kind.VOCAB, lambda a: ((a.vocab_size, a.hidden_size),)),
        Rule(OUTPUT_LAYER, ("lm_head.weight",), Kind.VOCAB, lambda a: ((a.vocab_size, a.hidden_size),)),
        Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.REPLICATED, _vec(_hidden)),
    ]


def layer_norm_rules() -> list[Rule]:
    """A decoder layer's two RMSNorms as the portable (local) spec names them: before attention and
    before the MLP. The TE spec fuses them into the next linear layer: the attention and dense-MLP
    blocks name those variants."""
    return [
        Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), Kind.REPLICATED, _vec(_hidden)),
        Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), Kind.REPLICATED,
             _vec(_hidden), extra_state="pre_mlp_layernorm", extra_state_layers="moe"),
    ]


def gqa_attention_rules(*, qk_norm: bool, qkv_bias: bool) -> list[Rule]:
    """Grouped-query attention: separate q/k/v projections (HF) merged per query group into
    Megatron's linear_qkv, the output projection, optional per-head q/k RMSNorms and q/k/v biases;
    the TE spec's input norm fused into linear_qkv."""
    def q(a):
        return a.num_attention_heads * a.head_dim

    def kv(a):
        return a.num_key_value_heads * a.head_dim

    rules = [
        Rule(_L + "self_attention.linear_qkv.layer_norm_weight", (_H + "input_layernorm.weight",),
             Kind.REPLICATED, _vec(_hidden)),
        Rule(_L + "self_attention.linear_qkv.weight",
             (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
             Kind.QKV, lambda a: ((q(a), a.hidden_size), (kv(a), a.hidden_size), (kv(a), a.hidden_size)),
             extra_state="self_attention.linear_qkv"),
        Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), Kind.ROW,
             lambda a: ((a.hidden_size, q(a)),), extra_state="self_attention.linear_proj"),
    ]
    if qk_norm:
        rules += [
            Rule(_L + "self_attention.q_layernorm.weight", (_H + "self_attn.q_norm.weight",), Kind.REPLICATED,
                 lambda a: ((a.head_dim,),), extra_state="self_attention.q_layernorm"),
            Rule(_L + "self_attention.k_layernorm.weight", (_H + "self_attn.k_norm.weight",), Kind.REPLICATED,
                 lambda a: ((a.head_dim,),), extra_state="self_attention.k_layernorm"),
        ]
    if qkv_bias:
        rules.append(Rule(
            _L + "self_attention.linear_qkv.bias",
            (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
            Kind.QKV, lambda a: ((q(a),), (kv(a),), (kv(a),))))
    return rules


def routed_expert_rules(*, selection_bias: bool) -> list[Rule]:
    """A MoE layer's router and its routed experts (per-expert gate/up/down in HF; Megatron's
    SequentialMLP of the portable spec and TEGroupedMLP of the GPU spec name them differently);
    `selection_bias`: a per-expert bias of the router used for the choice only (a buffer on both
    sides, never trained by the policy gradient: model/spec.py)."""
    exp_fc1 = (_H + "mlp.experts.{expert}.gate_proj.weight", _H + "mlp.experts.{expert}.up_proj.weight")
    exp_fc2 = (_H + "mlp.experts.{expert}.down_proj.weight",)

    def width(a):
        return a.moe_intermediate_size

    rules = [
        Rule(_L + "mlp.router.weight", (_H + "mlp.gate.weight",), Kind.REPLICATED,
             lambda a: ((a.num_experts, a.hidden_size),), layers="moe"),
        Rule(_L + "mlp.experts.local_experts.{expert}.linear_fc1.weight", exp_fc1, Kind.EXPERT_FC1,
             _fc1_shape(width), layers="moe"),
        Rule(_L + "mlp.experts.local_experts.{expert}.linear_fc2.weight", exp_fc2, Kind.EXPERT_FC2,
             _fc2_shape(width), layers="moe"),
        Rule(_L + "mlp.experts.linear_fc1.weight{expert}", exp_fc1, Kind.EXPERT_FC1, _fc1_shape(width), layers="moe",
             extra_state="mlp.experts.experts.linear_fc1"),
        Rule(_L + "mlp.experts.linear_fc2.weight{expert}", exp_fc2, Kind.EXPERT_FC2, _fc2_shape(width), layers="moe",
             extra_state="mlp.experts.experts.linear_fc2"),
    ]
    if selection_bias:
        rules.append(Rule(_L + "mlp.router.expert_bias", (_H + "mlp.gate.e_score_correction_bias",),
                          Kind.REPLICATED, lambda a: ((a.num_experts,),), layers="moe", buffer=True))
    return rules


def shared_expert_rules() -> list[Rule]:
    """The always-on shared expert(s) of every MoE layer, one gated MLP of
    `shared_expert_intermediate_size`."""
    def width(a):
        return a.shared_expert_intermediate_size

    return [
        Rule(_L + "mlp.shared_experts.linear_fc1.weight",
             (_H + "mlp.shared_experts.gate_proj.weight", _H + "mlp.shared_experts.up_proj.weight"),
             Kind.DENSE_FC1, _fc1_shape(width), layers="moe", extra_state="mlp.shared_experts.linear_fc1"),
        Rule(_L + "mlp.shared_experts.linear_fc2.weight", (_H + "mlp.shared_experts.down_proj.weight",),
             Kind.ROW, _fc2_shape(width), layers="moe", extra_state="mlp.shared_experts.linear_fc2"),
    ]


def dense_mlp_rules() -> list[Rule]:
    """The gated MLP of the dense layers (`dense_intermediate_size`); the TE spec fuses their
    pre-MLP norm into linear_fc1 (TE's LayerNormColumnParallelLinear; gpt_layer_specs.py
    get_mlp_module_spec_for_backend), the portable spec keeps pre_mlp_layernorm (layer_norm_rules)."""
    def width(a):
        return a.dense_intermediate_size

    return [
        Rule(_L + "mlp.linear_fc1.layer_norm_weight", (_H + "post_attention_layernorm.weight",), Kind.REPLICATED,
             _vec(_hidden), layers="dense"),
        Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"),
             Kind.DENSE_FC1, _fc1_shape(width), layers="dense", extra_state="mlp.linear_fc1"),
        Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), Kind.ROW, _fc2_shape(width),
             layers="dense", extra_state="mlp.linear_fc2"),
    ]


def hf_rules(rules: Sequence[Rule]) -> tuple[Rule, ...]:
    """One rule per distinct HF tensor group (the TE/local variants collapse), the first listed: the
    one whose `layers` covers every layer holding the tensor (a TE-only variant may cover fewer)."""
    out: dict[tuple[str, ...], Rule] = {}
    for r in rules:
        out.setdefault(r.hf, r)
    return tuple(out.values())


def embedding_rule(arch: MoeArch) -> Rule:
    return next(r for r in arch.family.rules(arch) if r.is_embedding)


def output_rule(arch: MoeArch) -> Rule:
    return next(r for r in arch.family.rules(arch) if r.is_output)


class MappingError(ValueError):
    pass


@dataclass(frozen=True)
class Match:
    rule: Rule
    layer: int | None  # local layer index (per PP stage)
    expert: int | None  # local expert index (per EP rank)


def match(mcore_name: str, arch: MoeArch) -> Match:
    """Which of `arch`'s family's rules produces this Megatron parameter (exact match; names never
    overlap)."""
    m = match_or_none(mcore_name, arch)
    if m is None:
        raise MappingError(f"no HF mapping for Megatron parameter {mcore_name!r}")
    return m


def match_or_none(mcore_name: str, arch: MoeArch) -> Match | None:
    """`match`, or None for a name no rule produces."""
    name = mcore_name[len("module."):] if mcore_name.startswith("module.") else mcore_name
    hits = [(r, m) for r in arch.family.rules(arch) if (m := r._regex.fullmatch(name))]
    if not hits:
        return None
    if len(hits) > 1:  # a bug in the rules, not in the input
        raise AssertionError(f"ambiguous mapping rules for {mcore_name!r}")
    rule, m = hits[0]
    gd = m.groupdict()
    return Match(rule, int(gd["layer"]) if "layer" in gd else None, int(gd["expert"]) if "expert" in gd else None)


def is_mapped_buffer(name: str, arch: MoeArch) -> bool:
    """A module buffer that is part of the model's weights (a rule with buffer=True names it)."""
    n = name[len("module."):] if name.startswith("module.") else name
    return any(r.buffer and r._regex.fullmatch(n) for r in arch.family.rules(arch))


def expected_hf_names(arch: MoeArch) -> list[str]:
    """Every tensor name a Hub checkpoint of `arch` holds (lm_head absent when tied)."""
    names: list[str] = []
    for r in hf_rules(arch.family.rules(arch)):
        if r.is_output and arch.tie_word_embeddings:
            continue
        layers = r.layer_indices(arch) if r.per_layer else [None]
        experts = range(arch.num_experts) if r.kind.is_expert else [None]
        for layer in layers:
            for e in experts:
                names.extend(r.hf_names(layer, e))
    return names


def iter_hf_shapes(arch: MoeArch) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every expected HF tensor, lazily: a reader comparing a config with the
    files stops as soon as the files run out, however many layers or experts the config claims."""
    for r in hf_rules(arch.family.rules(arch)):
        if r.is_output and arch.tie_word_embeddings:
            continue
        shapes = r.shapes(arch)
        layers = (i for i in range(arch.num_layers) if r.in_layer(arch, i)) if r.per_layer else [None]
        for layer in layers:
            for e in (range(arch.num_experts) if r.kind.is_expert else [None]):
                yield from zip(r.hf_names(layer, e), shapes)


def hf_shapes(arch: MoeArch) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor shapes, for validating checkpoints before any heavy work. Enumerates
    every name: for a config not yet checked against files, iter_hf_shapes."""
    return dict(iter_hf_shapes(arch))


# ----------------------------------------------------------------------------------------------
# HF tensors <-> full Megatron tensor


def hf_to_full(rule: Rule, tensors: Sequence[torch.Tensor], arch: MoeArch, padded_vocab: int) -> torch.Tensor:
    k = rule.kind
    if k is Kind.VOCAB:
        (t,) = tensors
        if padded_vocab > t.shape[0]:
            pad = t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])
            t = torch.cat([t, pad], 0)
        return t
    if k is Kind.QKV:
        q, kk, v = tensors
        g, D, rest = arch.num_key_value_heads, arch.head_dim, tuple(q.shape[1:])  # rest: (H,) or () (bias)
        q = q.reshape(g, arch.q_per_group * D, *rest)
        kk = kk.reshape(g, D, *rest)
        v = v.reshape(g, D, *rest)
        return torch.cat([q, kk, v], 1).reshape(-1, *rest)
    if k in (Kind.EXPERT_FC1, Kind.DENSE_FC1):
        gate, up = tensors
        return torch.cat([gate, up], 0)
    (t,) = tensors
    return t


def full_to_hf(rule: Rule, full: torch.Tensor, arch: MoeArch) -> tuple[torch.Tensor, ...]:
    k = rule.kind
    if k is Kind.VOCAB:
        return (full[: arch.vocab_size],)
    if k is Kind.QKV:
        g, D, rest = arch.num_key_value_heads, arch.head_dim, tuple(full.shape[1:])
        x = full.reshape(g, (arch.q_per_group + 2) * D, *rest)
        q, kk, v = torch.split(x, [arch.q_per_group * D, D, D], 1)
        return (q.reshape(-1, *rest), kk.reshape(-1, *rest), v.reshape(-1, *rest))
    if k in (Kind.EXPERT_FC1, Kind.DENSE_FC1):
        gate, up = full.chunk(2, 0)
        return (gate, up)
    return (full,)


# ----------------------------------------------------------------------------------------------
# full Megatron tensor <-> local shard


def split_dim(kind: Kind) -> int | None:
    return {Kind.VOCAB: 0, Kind.QKV: 0, Kind.ROW: 1, Kind.EXPERT_FC1: 0, Kind.EXPERT_FC2: 1,
            Kind.DENSE_FC1: 0, Kind.COLUMN: 0}.get(kind)


def shard(rule: Rule, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's piece. `rank/size` are TP for dense kinds, expert-TP for expert kinds."""
    d = split_dim(rule.kind)
    if d is None or size == 1:
        return full
    if rule.kind in (Kind.EXPERT_FC1, Kind.DENSE_FC1):
        gate, up = full.chunk(2, 0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], 0)
    if full.shape[d] % size:
        raise MappingError(f"{rule.mcore}: dim {d} of size {full.shape[d]} does not split into {size}")
    return full.chunk(size, d)[rank]


def unshard(rule: Rule, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    d = split_dim(rule.kind)
    if d is None or len(pieces) == 1:
        return pieces[0]
    if rule.kind in (Kind.EXPERT_FC1, Kind.DENSE_FC1):
        halves = [p.chunk(2, 0) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    return torch.cat(list(pieces), d)
