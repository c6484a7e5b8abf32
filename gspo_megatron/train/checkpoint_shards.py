"""Which rank writes which regions of a trainer checkpoint when Megatron's DistributedOptimizer is
on: every rank writes the part of the model and of the optimizer state that its own DP shard holds,
straight from the tensors it already has. No gather, no copy.

What is written is exactly Megatron's `fully_reshardable` checkpoint (the same global tensors under
the same keys, the same common.pt): the model's ShardedTensors and, per parameter,
`optimizer.state.{param,exp_avg,exp_avg_sq}.<parameter key>` with the parameter's global shape.
Only the chunking inside the DCP files differs, which no reader depends on (a DCP chunk is any box
of a global tensor; readers take whatever chunks overlap the region they need).

Why not Megatron's own save: `DistributedOptimizer.sharded_param_state_fully_reshardable`
(megatron/core/optimizer/distrib_optimizer.py) first calls `get_parameter_state_dp_zero`, which
allocates zero-filled buffers of the whole (TP/PP/EP) model shard for the master weights and both
moments on every DP rank and all-gathers every rank's shard into them; only then are the tensors
cut into parameters. On a 1 GB model that was 67% of the save time and ~6 GB of extra peak memory
per rank (bench/bench_checkpoint.py). Here each DP rank instead declares, for every parameter it
has a range of, the boxes of the global tensor that range covers:

    the optimizer partitions every DDP buffer over its DP group into contiguous element ranges;
    a parameter's range [start, end) in its local (TP/EP) tensor is a run of consecutive elements
    in row-major order; `flat_boxes` cuts such a run into at most 2*ndim - 1 rectangular boxes,
    each contiguous in memory, so each box is a view of the rank's own flat shard (no copy).

The DP ranks' ranges partition each parameter, so the boxes of one ShardedTensor tile it exactly;
ShardedTensors that other TP ranks replicate (replica_id (PP, TP, DP) with a non-zero PP or TP
coordinate) are left to the main replica, as Megatron's `keep_only_main_replica` does. A parameter
no rank has a range of (not in a DDP buffer) and a non-parameter tensor are written whole by their
main replica. The model weights are written from the same ranges, so the DP replicas split them
too (Megatron's FullyParallelSaveStrategyWrapper balances them by size instead).

tests/test_checkpoint.py compares this writer with Megatron's own save tensor by tensor, bit for
bit, at TP2+SP, EP2 and DP2, in fp32 and bf16, and common.pt as a whole.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")  # sharded_param_state_fully_reshardable's names


def flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The elements [start, end) (row-major flat positions) of a tensor of `shape`, as boxes
    (offsets, sizes) in flat order; each box is a contiguous run of the flat tensor."""
    if not 0 <= start <= end:
        raise ValueError(f"flat_boxes: bad range [{start}, {end})")
    if start == end:
        return []
    if len(shape) <= 1:
        if shape and end > shape[0]:
            raise ValueError(f"flat_boxes: range [{start}, {end}) outside shape {list(shape)}")
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = 1
    for s in shape[1:]:
        inner *= s
    first, last = start // inner, (end - 1) // inner
    if last >= shape[0]:
        raise ValueError(f"flat_boxes: range [{start}, {end}) outside shape {list(shape)}")
    out = []

    def row(r: int, lo: int, hi: int) -> None:
        out.extend(((r, *o), (1, *s)) for o, s in flat_boxes(shape[1:], lo, hi))

    if first == last:
        row(first, start - first * inner, end - first * inner)
        return out
    full_from, full_to = first, last + 1  # rows [full_from, full_to) are whole unless trimmed below
    if start % inner:
        row(first, start % inner, inner)
        full_from = first + 1
    tail = end % inner
    if tail:
        full_to = last
    if full_to > full_from:
        out.append(((full_from, *(0,) * (len(shape) - 1)), (full_to - full_from, *shape[1:])))
    if tail:
        row(last, 0, tail)
    return out


@dataclass(frozen=True)
class _Piece:
    """One ShardedTensor of a parameter: its elements [base, base + numel) of the parameter's flat
    local tensor are the box `local_shape` at `global_offset` of global tensor `key`."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    prepend: int
    local_shape: tuple[int, ...]
    base: int
    numel: int
    main: bool  # this rank writes it (for its DP range): main replica but for the DP coordinate
    whole_main: bool  # main replica in every coordinate (DP included)


def _is_main(replica_id, *, ignore_dp: bool) -> bool:
    if isinstance(replica_id, int):
        return replica_id == 0
    rid = tuple(replica_id)
    if ignore_dp:
        if len(rid) != 3:  # Megatron's (PP, TP, DP); sharded_param_state_fs_model_space asserts it too
            raise ValueError(f"replica_id {rid}: expected (PP, TP, DP)")
        rid = rid[:2]
    return all(r == 0 for r in rid)


def _pieces(sh, param: torch.Tensor) -> list[_Piece]:
    """The ShardedTensors `sh` (a ShardedTensor or a ShardedTensorFactory) stands for, located in
    the parameter's flat local tensor. A factory (e.g. Megatron's SwiGLU split of fc1 under TP) is
    built over an index tensor, so each ShardedTensor it makes says which elements it holds."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(sh, ShardedTensorFactory):
        index = torch.arange(param.numel(), dtype=torch.int64).view(param.shape)
        built = replace(sh, data=index).build()
        parts = [x for x in nested_values(built if isinstance(built, dict) else {"_": built})
                 if isinstance(x, ShardedTensor)]
    else:
        index, parts = None, [sh]
    out = []
    for x in parts:
        if x.flattened_range is not None:
            raise ValueError(f"{x.key}: flattened ShardedTensors are not supported")
        if index is None:
            base = 0
            if x.data is not param and x.data.data_ptr() != param.data_ptr():
                raise ValueError(f"{x.key}: the ShardedTensor's data is not its parameter")
        else:
            if not x.data.is_contiguous() or x.data.untyped_storage().data_ptr() != index.untyped_storage().data_ptr():
                raise ValueError(f"{x.key}: a ShardedTensorFactory piece that is not a contiguous run of its parameter")
            base = (x.data.data_ptr() - index.data_ptr()) // index.element_size()
        out.append(_Piece(x.key, tuple(x.global_shape), tuple(x.global_offset), x.prepend_axis_num,
                          tuple(x.data.shape), base, x.data.numel(), _is_main(x.replica_id, ignore_dp=True),
                          _is_main(x.replica_id, ignore_dp=False)))
    return out


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` (a contiguous CPU view into a larger tensor) as a tensor whose storage is exactly its
    own bytes, sharing memory: PyTorch's DCP writer clones any tensor whose storage is larger than
    itself (filesystem.py, _SerialCpuLoader: torch.save would write the whole storage), and the
    parameters and optimizer shards are views into DDP's and the optimizer's flat buffers.
    torch.from_numpy makes a storage of the array's own extent. Other tensors are returned as is."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.untyped_storage().nbytes() == t.nbytes or t.numel() == 0:
        return t
    raw = t.reshape(-1).view(torch.uint8)
    return torch.from_numpy(raw.numpy()).view(t.dtype).view(t.shape)


def _is_plain_distopt(opt) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return (isinstance(opt, DistributedOptimizer)
            and not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
            and not opt.ddp_config.use_megatron_fsdp)


def distributed_optimizer_plan(optimizer, model_state: dict):
    """(chunks, common optimizer state) for this rank, or None when `optimizer` is not (only)
    Megatron's DistributedOptimizer over torch/TE Adam state with master weights, or has never
    stepped (no moments yet): the caller then uses Megatron's own save.

    chunks: gspo_megatron.checkpoint.dcp_io.Chunk per box (model weights and optimizer state); the
    common state is what Megatron's save would put in common.pt for `optimizer.sharded_state_dict(model_state,
    metadata={"distrib_optim_sharding_type": "fully_reshardable", ...})`: per inner optimizer its
    `state_dict()` (param groups, step, grad scaler) and the sharding type, keyed by the inner
    optimizer's index when there are several (ChainedOptimizer.sharded_state_dict)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from gspo_megatron.checkpoint.dcp_io import Chunk
    from gspo_megatron.train.optim import inner_optimizers

    inner = inner_optimizers(optimizer)
    if not inner or not all(_is_plain_distopt(o) for o in inner):
        return None
    for opt in inner:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                if "exp_avg" not in opt.optimizer.state.get(p, {}):
                    return None
    if len(inner) > 1:
        optimizer._synchronize_steps()  # as ChainedOptimizer.sharded_state_dict does
    commons = []
    for opt in inner:
        st = opt.state_dict()
        st["param_state_sharding_type"] = "fully_reshardable"
        commons.append(st)
    common = commons[0] if len(commons) == 1 else dict(enumerate(commons))

    shards = {v.data: v for v in nested_values(model_state) if isinstance(v, (ShardedTensor, ShardedTensorFactory))}
    chunks: list = []
    covered = set()

    def add(key, piece: _Piece, box_off, box_size, dtype, src: torch.Tensor, flat_lo: int):
        n = 1
        for s in box_size:
            n *= s
        sizes = (1,) * piece.prepend + tuple(box_size)
        offsets = tuple(piece.global_offset[: piece.prepend]) + tuple(
            g + o for g, o in zip(piece.global_offset[piece.prepend:], box_off))
        view = src.detach().reshape(-1)[flat_lo:flat_lo + n].view(sizes)
        chunks.append(Chunk(key, piece.global_shape, offsets, sizes, dtype, partial(own_storage, view)))

    for opt in inner:
        for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
            for buckets in gbuf_range_maps.values():
                ranges = {}
                for b in buckets:
                    ranges.update(b["param_map"])
                for p in opt.buffers[gbuf_idx].param_index_map:
                    covered.add(p)
                    if p not in ranges:
                        continue
                    sh = shards.get(p)
                    if sh is None:
                        raise ValueError(f"a parameter of shape {list(p.shape)} has no ShardedTensor in the model's "
                                         "sharded state dict")
                    rng = ranges[p]["param"]
                    states = opt._get_main_param_and_optimizer_states(p)
                    for piece in _pieces(sh, p):
                        if not piece.main:
                            continue
                        lo, hi = max(rng.start, piece.base), min(rng.end, piece.base + piece.numel)
                        if lo >= hi:
                            continue
                        flat = lo
                        for off, size in flat_boxes(piece.local_shape, lo - piece.base, hi - piece.base):
                            add(piece.key, piece, off, size, p.dtype, p, flat)
                            for kind in STATE_KINDS:
                                t = states[kind]
                                add(f"optimizer.state.{kind}.{piece.key}", piece, off, size, t.dtype, t,
                                    flat - rng.start)
                            n = 1
                            for s in size:
                                n *= s
                            flat += n
    for data, sh in shards.items():  # tensors no optimizer covers: whole, by the main replica
        if data in covered:
            continue
        for piece in _pieces(sh, data):
            if piece.whole_main:
                add(piece.key, piece, (0,) * len(piece.local_shape), piece.local_shape, data.dtype, data, 0)
    return chunks, common
