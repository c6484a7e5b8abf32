"""Stream HF-named full tensors out of a sharded Megatron model (weight sync, HF export, grad checks).

Every rank runs the same loop over export items, derived from the architecture and layout alone, so
point-to-point transfers line up without exchanging names. Per item, only the ranks that hold the
first replica take part (dp = cp = 0; expert-dp = 0): TP shards are sent to the TP group's root
and received straight into slices of the full tensor; experts are sent to the EP group's root
(after an expert-TP gather when etp > 1). All transfers of an item are posted at once (isend /
irecv), so they stream back to back instead of paying a round trip each. Each stage's root
(tp = dp = cp = 0) then converts to HF tensors with the shared mapping and sends them to global
rank 0 when it is not on stage 0. Only global rank 0 yields tensors; every other rank must still
exhaust the iterator.

Point to point rather than all-gather: only the root needs the full tensor (an all-gather makes
every rank receive everything, and on gloo it is ~10x slower than send/recv), and DP replicas sit
idle instead of gathering copies nobody reads. Memory: one item at a time (a dense tensor, or one
layer's experts for one projection).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from gspo_megatron.model import mapping
from gspo_megatron.model.hf_io import layer_offset, named_local_params
from gspo_megatron.model.mapping import Kind, Rule
from gspo_megatron.model.arch import MoeArch


@dataclass(frozen=True)
class ExportItem:
    stage: int
    rule: Rule  # one of mapping.hf_rules(the family's rules)
    layer: int | None  # global layer


def export_items(arch: MoeArch, pp: int) -> list[ExportItem]:
    per = arch.num_layers // pp
    items = []
    for r in mapping.hf_rules(arch.family.rules(arch)):
        if r.is_output and arch.tie_word_embeddings:
            continue
        if r.per_layer:
            items += [ExportItem(layer // per, r, layer) for layer in r.layer_indices(arch)]
        elif r.is_embedding:
            items.append(ExportItem(0, r, None))
        else:  # final norm, output layer
            items.append(ExportItem(pp - 1, r, None))
    return sorted(items, key=lambda it: (it.stage, -1 if it.layer is None else it.layer))


def _gather_to_root(rule: Rule, local: torch.Tensor, group, my_rank: int, size: int) -> torch.Tensor | None:
    """Unsharded tensor on the group's rank 0 (None elsewhere), via send/recv."""
    if size == 1:
        return local
    root = dist.get_global_rank(group, 0)
    if my_rank != 0:
        dist.send(local.contiguous(), dst=root)
        return None
    d = mapping.split_dim(rule.kind)
    if d == 0 and rule.kind not in (Kind.EXPERT_FC1, Kind.DENSE_FC1):
        # shards are contiguous row blocks of the full tensor: receive in place
        full = torch.empty((local.shape[0] * size, *local.shape[1:]), dtype=local.dtype, device=local.device)
        n = local.shape[0]
        _recv_all([(full[r * n : (r + 1) * n], dist.get_global_rank(group, r)) for r in range(1, size)],
                  overlap=lambda: full[:n].copy_(local))
        return full
    pieces = [local] + [torch.empty_like(local) for _ in range(1, size)]
    _recv_all([(pieces[r], dist.get_global_rank(group, r)) for r in range(1, size)])
    return mapping.unshard(rule, pieces)


def _recv_all(bufs: list[tuple[torch.Tensor, int]], overlap: Callable[[], object] | None = None) -> None:
    """Post every receive at once (peers' sends then stream back to back instead of one round
    trip per message), run ``overlap`` while they are in flight, then wait for all."""
    works = [dist.irecv(buf, src=src) for buf, src in bufs]
    if overlap is not None:
        overlap()
    for w in works:
        w.wait()


def _send_all(tensors: list[torch.Tensor], dst: int) -> None:
    works = [dist.isend(t.contiguous(), dst=dst) for t in tensors]
    for w in works:
        w.wait()


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
    """(rule hf-key, global layer, local expert) -> local parameter, for this rank's chunks; and
    the linears that carry LoRA adapters (model/lora.py), by their weight."""

    def __init__(self, chunks, arch: MoeArch):
        from gspo_megatron.model import lora

        self.by_key: dict[tuple, torch.nn.Parameter] = {}
        self.adapted = {id(m.weight): m for _, m in lora.adapters(chunks)}
        for chunk in chunks:
            off = layer_offset(chunk)
            for name, p in named_local_params(chunk, arch):
                if lora.is_adapter_param(name):
                    continue  # not a weight of the model: exported merged into its linear's
                m = mapping.match(name, arch)
                layer = None if m.layer is None else m.layer + off
                self.by_key[(m.rule.hf, layer, m.expert)] = (m.rule, p)

    def get(self, rule: Rule, layer, expert=None):
        return self.by_key.get((rule.hf, layer, expert))


def iter_hf_tensors(
    chunks: list[torch.nn.Module],
    ctx,
    arch: MoeArch,
    *,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = param_tensor,
    dtype: torch.dtype | None = None,
    unmerged: tuple[str, ...] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) on global rank 0, on the model's device; nothing elsewhere. A
    policy with LoRA adapters (model/lora.py) yields its merged weights W + (alpha / r) B A, but
    the base W of the adapted linears in the `unmerged` groups (their adapters pushed on their
    own: rollout/lora_push.py).

    ``dtype`` casts floating tensors on the rank that holds each shard, before any transfer: the
    casts run in parallel and a narrower dtype moves fewer bytes (fp32 -> bf16 in
    bench_weight_sync: 17-18% of a bf16 memcpy, against 10-12% casting the gathered tensors on
    rank 0)."""
    index = _LocalIndex(chunks, arch)
    if index.adapted and tensor_of is param_tensor:  # a LoRA policy's weights: W + (alpha / r) B A
        from gspo_megatron.model.lora import merged_weight

        merged = {k: m for k, m in index.adapted.items() if m._lora["group"] not in unmerged}
        tensor_of = (lambda p, _plain=tensor_of: merged_weight(merged[id(p)]).detach()
                     if id(p) in merged else _plain(p))
    hint = _dtype_hint(chunks, tensor_of)
    if dtype is not None:
        tensor_of = _cast_to(tensor_of, dtype)
        hint = dtype if hint.is_floating_point else hint
    elif hint.is_floating_point:
        # one dtype on the wire: Megatron keeps the router's expert bias (a buffer) in float32
        # whatever the parameters' dtype (router.py _maintain_float32_expert_bias)
        tensor_of = _cast_to(tensor_of, hint)
    par = ctx.parallel
    pp = par.pp
    first_replica = ctx.dp_rank == 0 and ctx.cp_rank == 0
    stage_root = first_replica and ctx.tp_rank == 0
    edp_rank = dist.get_rank(ctx.edp_group) if par.ep * par.etp < ctx.world_size // pp else 0
    n_local_experts = arch.num_experts // par.ep
    # global rank of each stage's root, as seen from rank 0's pipeline group
    stage_src = [dist.get_global_rank(ctx.pp_group, s) if pp > 1 else 0 for s in range(pp)]

    for item in export_items(arch, pp):
        tensors: list[tuple[str, torch.Tensor]] | None = None
        if item.stage == ctx.pp_rank:
            if item.rule.kind.is_expert:
                if edp_rank == 0:
                    tensors = _gather_experts(item, index, ctx, arch, n_local_experts, tensor_of)
            elif first_replica:
                rule, p = index.get(item.rule, item.layer) or (None, None)
                if p is None:
                    raise RuntimeError(f"export: rank {ctx.rank} lacks {item.rule.mcore} (layer {item.layer})")
                size = par.tp if mapping.split_dim(rule.kind) is not None else 1
                full = _gather_to_root(rule, tensor_of(p), ctx.tp_group, ctx.tp_rank, size)
                if full is not None:
                    names = item.rule.hf_names(item.layer)
                    tensors = list(zip(names, mapping.full_to_hf(rule, full, arch)))
        if ctx.rank == 0:
            if item.stage != 0:
                tensors = _recv_item(item, arch, stage_src[item.stage], dtype_hint=hint, device=ctx.device)
            for name, t in tensors:
                yield name, t.contiguous()
        elif stage_root and item.stage == ctx.pp_rank and item.stage != 0:
            _send_all([t for _, t in tensors], dst=0)


def _gather_experts(item, index, ctx, arch, n_local, tensor_of):
    """All experts of one layer for one projection on the EP group's root (None elsewhere):
    expert-TP shards first go to each expert-TP root, then experts go one by one to the EP root."""
    par = ctx.parallel
    etp_rank = ctx.etp_rank
    ep_rank = ctx.ep_rank
    fulls = []
    rule = None
    for e in range(n_local):
        rule, p = index.get(item.rule, item.layer, e) or (None, None)
        if p is None:
            raise RuntimeError(f"export: rank {ctx.rank} lacks expert {e} of layer {item.layer}")
        fulls.append(_gather_to_root(rule, tensor_of(p), ctx.etp_group, etp_rank, par.etp))
    if etp_rank != 0:
        return None
    if ep_rank != 0:
        _send_all(fulls, dst=dist.get_global_rank(ctx.ep_group, 0))
        return None
    remote = {(src_ep, e): torch.empty_like(fulls[e]) for src_ep in range(1, par.ep) for e in range(n_local)}
    _recv_all([(buf, dist.get_global_rank(ctx.ep_group, src_ep)) for (src_ep, _), buf in remote.items()])
    out = []
    for src_ep in range(par.ep):
        for e_local in range(n_local):
            t = fulls[e_local] if src_ep == 0 else remote[(src_ep, e_local)]
            e = src_ep * n_local + e_local  # Megatron: contiguous expert blocks per EP rank
            out += list(zip(item.rule.hf_names(item.layer, e), mapping.full_to_hf(rule, t, arch)))
    return out


def _cast_to(tensor_of, dtype):
    def cast(p):
        t = tensor_of(p)
        return t.to(dtype) if t.is_floating_point() else t

    return cast


def _dtype_hint(chunks, tensor_of) -> torch.dtype:
    for c in chunks:
        for p in c.parameters():
            return tensor_of(p).dtype
    return torch.float32


def _recv_item(item, arch, src, dtype_hint, device):
    # the item's own rule gives its shapes (one per HF name, the same for every layer and expert):
    # mapping.hf_shapes would enumerate every name of the model once per item (quadratic in the
    # layers: ~56 CPU seconds a push of the 235B preset at PP 2, found by --simulate)
    shapes = item.rule.shapes(arch)
    experts = range(arch.num_experts) if item.rule.kind.is_expert else [None]
    out = [(name, torch.empty(shape, dtype=dtype_hint, device=device))
           for e in experts for name, shape in zip(item.rule.hf_names(item.layer, e), shapes, strict=True)]
    _recv_all([(buf, src) for _, buf in out])
    return out
