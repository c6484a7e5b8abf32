"""Where each HF tensor lives in a Megatron `torch_dist` checkpoint, derived from `model/mapping.py`.

torch_dist stores every parameter as one *global* tensor under a key that Megatron's
`sharded_state_dict()` chooses:

  * decoder parameters are stacked over layers: the key drops the layer index
    (`decoder.layers.{layer}.X` -> `decoder.layers.X`) and the global shape gains a leading
    [num_layers] axis;
  * expert parameters are stacked over layers and experts: SequentialMLP's
    `mlp.experts.local_experts.{expert}.X` and TEGroupedMLP's `mlp.experts.X{expert}` both become
    `mlp.experts.experts.X`, with a leading [num_layers, num_experts];
  * every tensor is keyed by its Transformer Engine spec name whatever spec wrote it: where the TE
    spec fuses a norm into the next linear layer (GQA's input norm into linear_qkv, MLA's q/kv
    latent norms into its up projections, a dense layer's pre-MLP norm into linear_fc1) the fused
    `....layer_norm_weight` name, a rule of the family beside the local spec's (`checkpoint_key`);
    `canonical_key` turns the keys Megatron's local spec chooses into these;
  * the per-layer/per-expert slice is the "full" Megatron tensor of `mapping.hf_to_full` (QKV
    grouped per query group, fc1 = [gate; up]); vocab tensors are stored with exactly the HF
    vocabulary's rows (loaders zero the padding rows a layout needs; Megatron marks these tensors
    `allow_shape_mismatch`), so the checkpoint does not depend on the TP size it was written for.

A model whose dense and MoE layers mix (GLM-4.5's first dense layers) is keyed per layer instead:
Megatron sets `non_homogeneous_layers` whenever `moe_layer_freq` is a list
(transformer_block.py:830-834) and every key keeps its global layer index
(`decoder.layers.3.self_attention.linear_qkv.weight`, no [num_layers] axis; experts
`decoder.layers.3.mlp.experts.experts.linear_fc1.weight` with a leading [num_experts]). There a
dense layer's pre-MLP norm is stored under TE's fused name `decoder.layers.N.mlp.linear_fc1.layer_norm_weight`
and an MoE layer's under `pre_mlp_layernorm.weight` (the fused rule's scope is the dense layers).

`tests/test_converters.py` checks these keys and shapes against the `sharded_state_dict()` of
models built at several layouts, for every family, and tests/test_model_families.py checks them
against the parameter names of each family's GPU (TE) layer spec as Megatron builds it, so this
module and Megatron cannot drift apart silently.
Nothing here names an HF tensor: the HF side is entirely the family's rules (`arch.family.rules`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from gspo_megatron.model import mapping
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.mapping import Rule

# A layer's pre-MLP norm: its own module (TE spec, MoE layer) or fused into linear_fc1 (TE's
# LayerNormColumnParallelLinear in a dense layer; the local GQA spec's name for every layer).
_MOE_PRE_MLP_NORM = "pre_mlp_layernorm.weight"
_DENSE_PRE_MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
_PER_LAYER_MOE_NORM = re.compile(r"decoder\.layers\.(\d+)\." + re.escape(_MOE_PRE_MLP_NORM))
_GLOBAL_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
# The Transformer Engine spec fuses a norm into the linear layer after it (TE's
# LayerNormColumnParallelLinear): the fused norm's parameter is that linear's `layer_norm_weight`.
_FUSED_NORM = ".layer_norm_weight"


# Keys other writers use for a tensor we store under another name. Megatron-Bridge and Megatron-LM
# runs without Transformer Engine (the local spec) save the MoE pre-MLP norm under the local spec's
# name; readers accept it when the TE name is absent.
KEY_ALIASES = {
    "decoder.layers.pre_mlp_layernorm.weight": ("decoder.layers.mlp.linear_fc1.layer_norm_weight",),
}


def stored_key(key: str, stored) -> str:
    """The key `key`'s tensor is stored under in a checkpoint holding the keys `stored`."""
    if key in stored:
        return key
    aliases = KEY_ALIASES.get(key, ())
    m = _PER_LAYER_MOE_NORM.fullmatch(key)
    if m is not None:  # per-layer keys: the local spec's name of that layer's MoE pre-MLP norm
        aliases = (f"decoder.layers.{m.group(1)}.{_DENSE_PRE_MLP_NORM}",)
    return next((a for a in aliases if a in stored), key)


def per_layer_keys(arch: MoeArch) -> bool:
    """Whether Megatron keys every layer apart (dense and MoE layers mixed: model/spec.py passes
    `moe_layer_freq` as a list, which sets non_homogeneous_layers, transformer_block.py:830-834)."""
    return bool(arch.dense_layers)


def dist_key(rule: Rule, layer: int | None = None) -> str:
    """The torch_dist key of the global tensor holding `rule`'s parameter, from its Megatron name:
    for all layers/experts (stacked), or, with `layer` (a per-layer checkpoint, `per_layer_keys`),
    for that global layer. Which of a tensor's sibling rules names it: `checkpoint_key`."""
    if layer is None:
        k = rule.mcore.replace("decoder.layers.{layer}.", "decoder.layers.")
    else:
        k = rule.mcore.replace("decoder.layers.{layer}.", f"decoder.layers.{layer}.")
    k = k.replace("mlp.experts.local_experts.{expert}.", "mlp.experts.experts.")  # SequentialMLP
    k = re.sub(r"mlp\.experts\.(linear_fc[12]\.weight)\{expert\}$", r"mlp.experts.experts.\1", k)  # TEGroupedMLP
    if "{" in k:
        raise AssertionError(f"layout: cannot derive a torch_dist key from {rule.mcore!r}")
    return k


def fused_norm_siblings(rules) -> dict[Rule, tuple[Rule, ...]]:
    """For each rule, the rules of the same HF tensor that the Transformer Engine spec names as a
    norm fused into the next linear layer (`..._proj.layer_norm_weight`, `linear_fc1.layer_norm_weight`)."""
    fused = [r for r in rules if r.mcore.endswith(_FUSED_NORM)]
    return {r: tuple(f for f in fused if f.hf == r.hf) for r in rules}


def checkpoint_key(rule: Rule, arch: MoeArch, layer: int | None = None, siblings=None) -> str:
    """The key a checkpoint stores `rule`'s tensor under (at global `layer` when every layer is keyed
    apart): the Transformer Engine spec's name, whichever spec the model was built with, so a
    checkpoint written on CPU (local spec) loads on GPU (TE spec) and back. Where the TE spec fuses
    the norm into the next linear layer in the layers concerned, that fused name (a rule of the
    family sharing the HF tensor, mcore `....layer_norm_weight`); otherwise the rule's own name. With
    no `layer` (stacked keys) the fused rule must cover every layer the rule does."""
    if siblings is None:
        siblings = fused_norm_siblings(arch.family.rules(arch))
    layers = [layer] if layer is not None else rule.layer_indices(arch) if rule.per_layer else []
    for f in siblings.get(rule, ()):
        if layers and all(f.in_layer(arch, i) for i in layers):
            rule = f
            break
    return dist_key(rule, layer)


def _check_rules(rules, arch: MoeArch) -> None:
    # The local- and TE-spec variants of one HF tensor must share a key, or the spec would leak
    # into the checkpoint format.
    siblings = fused_norm_siblings(rules)
    by_hf: dict[tuple, str] = {}
    for r in rules:
        k = checkpoint_key(r, arch, siblings=siblings)
        if by_hf.setdefault(r.hf, k) != k:
            raise AssertionError(f"layout: {r.mcore!r} and its sibling rule map to different keys")


def canonical_key(state_dict_name: str, sharded_key: str, arch: MoeArch) -> str:
    """The checkpoint key for the ShardedTensor `state_dict_name` of Megatron's `sharded_state_dict()`
    (whose `sharded_key` Megatron chose): `checkpoint_key` of the family rule that names the
    parameter, at the global layer the sharded key holds when every layer is keyed apart
    (transformer_block.py:830-834). This undoes what the local spec names its own way: GQA's local
    spec renames every pre-MLP norm to the fused `mlp.linear_fc1.layer_norm_weight` although an MoE
    layer has no linear_fc1 to fuse into (gpt_layer_specs.py:417-420); MLA's local spec keeps its
    q/kv latent norms and a dense layer's pre-MLP norm apart where the TE spec fuses them
    (gpt_layer_specs.py:233-268 against 365-389). A parameter no rule names keeps its key."""
    m = mapping.match_or_none(state_dict_name, arch)
    if m is None:
        return sharded_key
    layer = None
    if m.rule.per_layer and per_layer_keys(arch):
        g = _GLOBAL_LAYER.match(sharded_key)
        if g is None:
            raise AssertionError(f"layout: {state_dict_name!r}: per-layer key {sharded_key!r} names no layer")
        layer = int(g.group(1))
    return checkpoint_key(m.rule, arch, layer)


def prepend_dims(rule: Rule, arch: MoeArch) -> tuple[int, ...]:
    """The leading axes of `rule`'s global tensor: [layers] and/or [experts] (stacked), [experts]
    only when every layer is keyed apart."""
    layers = () if per_layer_keys(arch) else (arch.num_layers,)
    if rule.kind.is_expert:
        return layers + (arch.num_experts,)
    if rule.per_layer:
        return layers
    return ()


def full_shape(rule: Rule, arch: MoeArch) -> tuple[int, ...]:
    """Shape of one full Megatron tensor (one layer / one expert), vocab unpadded."""
    if rule.kind is mapping.Kind.VOCAB:  # lm_head has no entry in hf_shapes when tied
        metas = [torch.empty(arch.vocab_size, arch.hidden_size, device="meta")]
    else:
        shapes = mapping.hf_shapes(arch)
        layer = rule.layer_indices(arch)[0] if rule.per_layer else None  # a layer that holds it
        metas = [torch.empty(shapes[n], device="meta") for n in rule.hf_names(layer, 0)]
    return tuple(mapping.hf_to_full(rule, metas, arch, padded_vocab=0).shape)


@dataclass(frozen=True)
class Item:
    """One chunk of the checkpoint: one full Megatron tensor (a layer's, or an expert's)."""

    rule: Rule  # one of mapping.hf_rules(the family's rules)
    layer: int | None  # global layer
    expert: int | None  # global expert
    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    lead: int  # leading axes of size 1 before the full tensor (layer and/or expert)

    @property
    def full_shape(self) -> tuple[int, ...]:
        return self.sizes[self.lead:]

    def hf_names(self) -> tuple[str, ...]:
        return self.rule.hf_names(self.layer, self.expert)

    def nbytes(self, element_size: int) -> int:
        n = element_size
        for s in self.sizes:
            n *= s
        return n


def _rules_in_order(arch: MoeArch) -> list[Rule]:
    rules = arch.family.rules(arch)
    if not per_layer_keys(arch):
        _check_rules(rules, arch)
    out = []
    for r in mapping.hf_rules(rules):
        if r.is_output and arch.tie_word_embeddings:
            continue  # tied: Megatron's output layer reads the embedding's key
        out.append(r)
    return out


def plan_items(arch: MoeArch) -> list[Item]:
    """Every chunk of a converted checkpoint, in HF order (embedding, layer by layer, head)."""
    rules = _rules_in_order(arch)
    head = [r for r in rules if r.is_embedding]
    tail = [r for r in rules if not r.per_layer and r not in head]
    per_layer = [r for r in rules if r.per_layer]
    dense = [r for r in per_layer if not r.kind.is_expert]
    experts = [r for r in per_layer if r.kind.is_expert]
    apart = per_layer_keys(arch)
    items: list[Item] = []
    shapes = {r: (prepend_dims(r, arch), full_shape(r, arch)) for r in rules}
    siblings = fused_norm_siblings(arch.family.rules(arch))
    keys = {} if apart else {r: checkpoint_key(r, arch, siblings=siblings) for r in rules}

    def add(rule, layer, expert):
        pre, full = shapes[rule]
        idx = tuple(i for i in ((None if apart else layer), expert) if i is not None)
        key = keys.get(rule) or checkpoint_key(rule, arch, layer if apart else None, siblings)
        items.append(Item(rule, layer, expert, key, pre + full, idx + (0,) * len(full),
                          (1,) * len(idx) + full, len(idx)))

    for r in head:
        add(r, None, None)
    for layer in range(arch.num_layers):
        for r in dense:
            if r.in_layer(arch, layer):
                add(r, layer, None)
        for e in range(arch.num_experts):
            for r in experts:
                if r.in_layer(arch, layer):
                    add(r, layer, e)
    for r in tail:
        add(r, None, None)
    return items


def expected_keys(arch: MoeArch) -> dict[str, tuple[int, ...]]:
    """torch_dist key -> global shape (vocab rows = HF vocab) of a checkpoint of `arch`."""
    return {it.key: it.global_shape for it in plan_items(arch)}


def is_vocab_key(key: str, arch: MoeArch) -> bool:
    return any(dist_key(r) == key for r in arch.family.rules(arch) if r.kind is mapping.Kind.VOCAB)
