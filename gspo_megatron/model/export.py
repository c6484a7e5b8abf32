"""Stream HF-named full tensors out of a sharded Megatron model (weight sync, HF export, grad checks).

Every rank runs the same loop over export items, derived from the architecture and layout alone, so
collectives line up without exchanging names. Per item the owning pipeline stage gathers TP shards
(and expert-TP shards, then all experts of the layer over EP), converts to HF tensors with the
shared mapping, and its representative rank (tp=dp=cp=0) sends them to global rank 0. Only global
rank 0 yields tensors; every other rank must still exhaust the iterator.

Memory: one item at a time (a dense tensor, or one layer's experts for one projection).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from gspo_megatron.model import mapping
from gspo_megatron.model.hf_io import layer_offset, named_local_params
from gspo_megatron.model.mapping import Kind, Rule
from gspo_megatron.model.qwen3_moe import Qwen3MoeArch


@dataclass(frozen=True)
class ExportItem:
    stage: int
    rule: Rule  # an HF_RULES entry
    layer: int | None  # global layer


def export_items(arch: Qwen3MoeArch, pp: int) -> list[ExportItem]:
    per = arch.num_layers // pp
    items = []
    for r in mapping.HF_RULES:
        if r.hf == ("lm_head.weight",) and arch.tie_word_embeddings:
            continue
        if r.per_layer:
            items += [ExportItem(layer // per, r, layer) for layer in range(arch.num_layers)]
        elif r.hf == ("model.embed_tokens.weight",):
            items.append(ExportItem(0, r, None))
        else:  # final norm, output layer
            items.append(ExportItem(pp - 1, r, None))
    return sorted(items, key=lambda it: (it.stage, -1 if it.layer is None else it.layer))


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    n = dist.get_world_size(group) if group is not None else 1
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=group)
    return out


def param_tensor(p: torch.nn.Parameter) -> torch.Tensor:
    return p.detach()


def grad_tensor(p: torch.nn.Parameter) -> torch.Tensor:
    g = getattr(p, "main_grad", None)
    if g is None:
        g = p.grad
    if g is None:
        return torch.zeros_like(p, dtype=torch.float32)
    return g.detach().float()


class _LocalIndex:
    """(rule hf-key, global layer, local expert) -> local parameter, for this rank's chunks."""

    def __init__(self, chunks):
        self.by_key: dict[tuple, torch.nn.Parameter] = {}
        for chunk in chunks:
            off = layer_offset(chunk)
            for name, p in named_local_params(chunk):
                m = mapping.match(name)
                layer = None if m.layer is None else m.layer + off
                self.by_key[(m.rule.hf, layer, m.expert)] = (m.rule, p)

    def get(self, rule: Rule, layer, expert=None):
        return self.by_key.get((rule.hf, layer, expert))


def iter_hf_tensors(
    chunks: list[torch.nn.Module],
    ctx,
    arch: Qwen3MoeArch,
    *,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = param_tensor,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) on global rank 0 (CPU tensors); nothing elsewhere."""
    index = _LocalIndex(chunks)
    pp = ctx.parallel.pp
    tp_group = ctx.tp_group if ctx.parallel.tp > 1 else None
    rep = ctx.tp_rank == 0 and ctx.dp_rank == 0 and ctx.cp_rank == 0
    n_local_experts = arch.num_experts // ctx.parallel.ep
    # global rank of each stage's representative, as seen from rank 0's pipeline group
    stage_src = [dist.get_global_rank(ctx.pp_group, s) if pp > 1 else 0 for s in range(pp)]

    for item in export_items(arch, pp):
        tensors: list[tuple[str, torch.Tensor]] | None = None
        if item.stage == ctx.pp_rank:
            if item.rule.kind.is_expert:
                tensors = _gather_experts(item, index, ctx, arch, n_local_experts, tensor_of)
            else:
                rule, p = index.get(item.rule, item.layer) or (None, None)
                if p is None:
                    raise RuntimeError(f"export: rank {ctx.rank} lacks {item.rule.mcore} (layer {item.layer})")
                local = tensor_of(p)
                size = ctx.parallel.tp if mapping.split_dim(rule.kind) is not None else 1
                pieces = _all_gather(local, tp_group) if size > 1 else [local]
                full = mapping.unshard(rule, pieces)
                names = item.rule.hf_names(item.layer)
                tensors = list(zip(names, mapping.full_to_hf(rule, full, arch)))
        if ctx.rank == 0:
            if item.stage != 0:
                tensors = _recv_item(item, arch, stage_src[item.stage], dtype_hint=_dtype_hint(chunks, tensor_of))
            for name, t in tensors:
                t = t.to("cpu")
                yield name, (t.to(dtype) if dtype is not None else t).contiguous()
        elif rep and item.stage == ctx.pp_rank and item.stage != 0:
            for _, t in tensors:
                dist.send(t.contiguous(), dst=0)


def _gather_experts(item, index, ctx, arch, n_local, tensor_of):
    """All experts of one layer for one projection: gather expert-TP shards, then over EP."""
    rule = None
    locals_ = []
    for e in range(n_local):
        rule, p = index.get(item.rule, item.layer, e) or (None, None)
        if p is None:
            raise RuntimeError(f"export: rank {ctx.rank} lacks expert {e} of layer {item.layer}")
        locals_.append(tensor_of(p))
    stacked = torch.stack(locals_)  # [E/ep, ...] this rank's expert-TP shards
    if ctx.parallel.etp > 1:
        parts = _all_gather(stacked, ctx.etp_group)
        stacked = torch.stack([mapping.unshard(rule, [pt[e] for pt in parts]) for e in range(n_local)])
    if ctx.parallel.ep > 1:
        stacked = torch.cat(_all_gather(stacked, ctx.ep_group), 0)  # [E, ...], contiguous blocks
    out = []
    for e in range(arch.num_experts):
        out += list(zip(item.rule.hf_names(item.layer, e), mapping.full_to_hf(rule, stacked[e], arch)))
    return out


def _dtype_hint(chunks, tensor_of) -> torch.dtype:
    for c in chunks:
        for p in c.parameters():
            return tensor_of(p).dtype
    return torch.float32


def _recv_item(item, arch, src, dtype_hint):
    shapes = mapping.hf_shapes(arch)
    experts = range(arch.num_experts) if item.rule.kind.is_expert else [None]
    out = []
    for e in experts:
        for name in item.rule.hf_names(item.layer, e):
            buf = torch.empty(shapes[name], dtype=dtype_hint)
            dist.recv(buf, src=src)
            out.append((name, buf))
    return out
