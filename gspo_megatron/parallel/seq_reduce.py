"""Per-sequence reductions over packed (THD) batches and Megatron's context-parallel layout.

Three kinds of helpers live here, none of which knows about GSPO:

* **Packed sums.** A packed THD micro-batch holds ``S`` sequences back to back in one token
  dimension (``[total]`` or Megatron's ``[1, total]``), delimited by ``cu_seqlens`` (``[S+1]``,
  ``cu_seqlens[0] == 0``). :func:`packed_sequence_sum` reduces a per-token tensor to ``[S]``
  per-sequence sums (differentiable). :func:`packed_to_padded` / :func:`padded_to_packed` move
  per-token values between the packed and the padded ``[S, T_max]`` layout (differentiable), for
  losses written over ``[B, T]``.

* **CP all-reduce.** :func:`cp_all_reduce_sum` sums a small per-sequence tensor over the
  context-parallel group: forward SUM all-reduce, backward *identity*. See its docstring for why
  identity (and not the all-reduce a plain autograd of ``all_reduce`` would give) is right.

* **Zigzag CP layout.** Megatron balances causal attention across CP ranks by cutting each
  sequence (padded to a multiple of ``2*cp``) into ``2*cp`` equal chunks; rank ``r`` holds chunks
  ``r`` and ``2*cp-1-r`` in that order. For packed batches each sequence is cut separately and the
  local pieces are concatenated in sequence order, so the local ``cu_seqlens`` is the padded
  global one divided by ``cp`` (this is the layout of TE's ``thd_get_partitioned_indices`` that
  Megatron uses for THD + CP). :func:`zigzag_split` / :func:`zigzag_merge` handle one dimension
  of a padded batch (BSHD), :func:`zigzag_packed_indices` / :func:`zigzag_split_packed` /
  :func:`zigzag_merge_packed` handle packed batches.

Process groups are always passed explicitly; ``group=None`` means "no parallelism" (the
functions become local no-ops), never the default world group.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "group_size",
    "sequence_ids",
    "packed_sequence_sum",
    "packed_to_padded",
    "padded_to_packed",
    "cp_all_reduce_sum",
    "cp_all_reduce_sum_many",
    "padded_length",
    "pad_cu_seqlens",
    "pack_sequences",
    "zigzag_positions",
    "zigzag_split",
    "zigzag_merge",
    "zigzag_packed_indices",
    "zigzag_split_packed",
    "zigzag_merge_packed",
]


def group_size(group) -> int:
    """World size of ``group``; 1 for ``group=None`` or when torch.distributed is not initialised."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Packed (THD) sums and layout changes
# ---------------------------------------------------------------------------------------------


def _check_cu(cu_seqlens: torch.Tensor) -> torch.Tensor:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [S+1], got shape {tuple(cu_seqlens.shape)}")
    return cu_seqlens.long()


def _flat_tokens(values: torch.Tensor, total: int) -> torch.Tensor:
    """[total] / [1, total] / [total, 1] -> [total'] with total' >= cu_seqlens[-1]."""
    flat = values.reshape(-1)
    if flat.numel() < total:
        raise ValueError(f"values hold {flat.numel()} tokens but cu_seqlens ends at {total}")
    return flat


def sequence_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence index of every token in ``[0, cu_seqlens[-1])``: LongTensor [cu_seqlens[-1]]."""
    cu = _check_cu(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    if (lengths < 0).any():
        raise ValueError("cu_seqlens must be non-decreasing")
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)


def packed_sequence_sum(
    values: torch.Tensor, cu_seqlens: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-sequence (masked) sums of a packed per-token tensor.

    Args:
        values: [total] or [1, total] (Megatron THD) or [total, 1]; tokens at or after
            ``cu_seqlens[-1]`` (trailing padding) are ignored.
        cu_seqlens: [S+1] cumulative token offsets, ``cu_seqlens[0] == 0``.
        mask: optional, same number of tokens as ``values``; only tokens with a true/non-zero
            mask are summed. Masked-out tokens may hold inf/NaN: they are *selected away*
            (``torch.where``), not multiplied by zero, so they reach neither the sum nor the
            gradient.

    Returns:
        [S] sums in ``values``' dtype; differentiable w.r.t. ``values``. An empty or fully
        masked sequence sums to 0 with zero gradient.
    """
    cu = _check_cu(cu_seqlens)
    total = int(cu[-1])
    flat = _flat_tokens(values, total)[:total]
    if mask is not None:
        m = _flat_tokens(mask, total)[:total].bool()
        flat = torch.where(m, flat, torch.zeros((), dtype=flat.dtype, device=flat.device))
    ids = sequence_ids(cu)
    out = torch.zeros(cu.numel() - 1, dtype=flat.dtype, device=flat.device)
    return out.index_add(0, ids, flat)


def packed_to_padded(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor,
    pad_value: float = 0.0,
    max_seqlen: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed per-token values -> ([S, T_max] padded, [S, T_max] bool validity mask).

    Differentiable w.r.t. ``values`` (gradients at padding positions are dropped). Use it to feed
    the token-level losses, which are written over ``[B, T]``, from a THD micro-batch; the extra
    memory is a few bytes per token.
    """
    cu = _check_cu(cu_seqlens)
    total = int(cu[-1])
    flat = _flat_tokens(values, total)[:total]
    lengths = cu[1:] - cu[:-1]
    if max_seqlen is None:
        max_seqlen = int(lengths.max()) if lengths.numel() else 0
    t_max = int(max_seqlen)
    pos = torch.arange(t_max, device=cu.device)
    valid = pos[None, :] < lengths[:, None]
    padded = torch.full((lengths.numel(), t_max), pad_value, dtype=flat.dtype, device=flat.device)
    padded = padded.masked_scatter(valid, flat)
    return padded, valid


def padded_to_packed(padded: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`packed_to_padded`: [S, T_max] -> [cu_seqlens[-1]] (differentiable)."""
    cu = _check_cu(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    pos = torch.arange(padded.shape[1], device=padded.device)
    valid = pos[None, :] < lengths[:, None].to(padded.device)
    return padded[valid]


# ---------------------------------------------------------------------------------------------
# Context-parallel all-reduce of per-sequence statistics
# ---------------------------------------------------------------------------------------------


class _CPAllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def cp_all_reduce_sum(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``x`` (per-sequence statistics, e.g. [S] or [S, K]) over the CP group.

    Forward: SUM all-reduce (a copy; ``x`` is not modified). Backward: **identity**.

    Why identity. Each CP rank ``r`` holds a slice of every sequence and contributes a partial
    sum ``x_r`` (a function of its own tokens only). After the all-reduce every rank holds the
    same global ``X = sum_r x_r`` and computes the *same* loss ``L(X)`` from it - the loss is
    replicated across CP, not split. The true parameter gradient is
    ``dL/dtheta = sum_r dL/dX * dx_r/dtheta``. Rank ``r`` can only back-propagate through its own
    ``x_r``, and the factor it needs there is exactly ``dL/dX``, which it already has locally:
    so the backward is the identity, and summing the parameter gradients over CP ranks (which
    Megatron's gradient reduction over the data-parallel-with-CP group does) yields the exact
    gradient. A SUM all-reduce in backward (the adjoint of all-reduce when each rank's loss is a
    *different* term of a summed loss) would multiply the gradient by ``cp``.

    Consequences for the caller: (1) the value returned by the loss on each CP rank is the full
    loss (do not add the CP ranks' loss values when reporting); (2) the gradients must be summed,
    not averaged, over CP - if the DDP wrapper averages over dp*cp, scale accordingly.

    ``group=None`` or a group of size 1: returns ``x`` unchanged.
    """
    if group_size(group) == 1:
        return x
    return _CPAllReduceSum.apply(x, group)


def cp_all_reduce_sum_many(tensors: Sequence[torch.Tensor], group=None) -> list[torch.Tensor]:
    """:func:`cp_all_reduce_sum` of several same-shaped [S] tensors with ONE collective.

    The tensors are stacked to [S, K] (promoted to a common floating dtype), reduced, unstacked.
    """
    tensors = list(tensors)
    if group_size(group) == 1 or not tensors:
        return tensors
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    stacked = torch.stack([t.to(dtype) for t in tensors], dim=-1)
    reduced = cp_all_reduce_sum(stacked, group)
    return [r.to(t.dtype) if t.dtype != dtype else r for r, t in zip(reduced.unbind(-1), tensors)]


# ---------------------------------------------------------------------------------------------
# Zigzag (load-balanced) CP layout
# ---------------------------------------------------------------------------------------------


def padded_length(length: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``length``."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-int(length) // multiple) * multiple


def pad_cu_seqlens(cu_seqlens: torch.Tensor, multiple: int) -> torch.Tensor:
    """cu_seqlens of the true lengths -> cu_seqlens with every sequence padded to ``multiple``.

    For CP use ``multiple = 2*cp`` (times tp under sequence parallelism, as Megatron requires).
    """
    cu = _check_cu(cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    padded = -(-lengths // multiple) * multiple
    return torch.cat([cu.new_zeros(1), torch.cumsum(padded, 0)])


def pack_sequences(
    seqs: Sequence[torch.Tensor], multiple: int = 1, pad_value=0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pack 1-D sequences into one buffer, each padded at its end to a multiple of ``multiple``.

    Returns ``(packed [total_padded], cu_seqlens [S+1], cu_seqlens_padded [S+1])``: the true
    lengths (Megatron's ``cu_seqlens_q``) and the offsets in the padded buffer
    (``cu_seqlens_q_padded``).
    """
    if not seqs:
        raise ValueError("pack_sequences needs at least one sequence")
    lengths = torch.tensor([s.numel() for s in seqs], dtype=torch.long)
    cu = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    cu_pad = pad_cu_seqlens(cu, multiple)
    packed = torch.full((int(cu_pad[-1]),), pad_value, dtype=seqs[0].dtype, device=seqs[0].device)
    for i, s in enumerate(seqs):
        start = int(cu_pad[i])
        packed[start : start + s.numel()] = s.reshape(-1)
    return packed, cu, cu_pad


def _zigzag_chunks(cp_size: int, cp_rank: int) -> tuple[int, int]:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} out of range for cp_size {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def zigzag_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions ``[0, length)`` of one sequence that CP rank ``cp_rank`` holds, in its local
    order (``arange(length)`` when ``cp_size == 1``): what :func:`zigzag_split` takes. The trainer
    builds targets and masks on the full sequence and then indexes them with these
    (train/batch.py); Megatron's RoPE slices its table the same way (rope_utils.py,
    get_pos_emb_on_this_cp_rank)."""
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ValueError(f"sequence length {length} is not a multiple of 2*cp = {2 * cp_size}")
    a, b = _zigzag_chunks(cp_size, cp_rank)
    c = length // (2 * cp_size)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def zigzag_split(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1) -> torch.Tensor:
    """This CP rank's part of ``x`` along ``dim`` (a padded, BSHD-style sequence dimension).

    ``x.size(dim)`` must be a multiple of ``2*cp_size``; the result holds chunks ``cp_rank`` and
    ``2*cp_size-1-cp_rank`` concatenated (length ``size/cp_size``). Differentiable.
    """
    if cp_size == 1:
        return x
    n = x.size(dim)
    if n % (2 * cp_size):
        raise ValueError(f"length {n} along dim {dim} is not a multiple of 2*cp = {2 * cp_size}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    a, b = _zigzag_chunks(cp_size, cp_rank)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def zigzag_merge(parts: Sequence[torch.Tensor], dim: int = -1) -> torch.Tensor:
    """Inverse of :func:`zigzag_split`: ``parts[r]`` is rank r's piece; returns the full tensor."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for r, p in enumerate(parts):
        lo, hi = p.chunk(2, dim=dim)
        a, b = _zigzag_chunks(cp_size, r)
        chunks[a], chunks[b] = lo, hi
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def zigzag_packed_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global token positions a CP rank holds in a packed batch, in local order: LongTensor.

    Every sequence ``[cu[i], cu[i+1])`` (length a multiple of ``2*cp_size``) is cut into
    ``2*cp_size`` chunks; the rank takes chunks ``cp_rank`` and ``2*cp_size-1-cp_rank``; the
    pieces of consecutive sequences follow each other. The rank's local ``cu_seqlens_padded`` is
    ``cu_seqlens_padded // cp_size``.
    """
    cu = _check_cu(cu_seqlens_padded)
    lengths = cu[1:] - cu[:-1]
    if (lengths % (2 * cp_size)).any():
        raise ValueError(f"every padded sequence length must be a multiple of 2*cp = {2 * cp_size}")
    a, b = _zigzag_chunks(cp_size, cp_rank)
    pieces = []
    for start, length in zip(cu[:-1].tolist(), lengths.tolist()):
        c = length // (2 * cp_size)
        pieces.append(torch.arange(start + a * c, start + (a + 1) * c))
        pieces.append(torch.arange(start + b * c, start + (b + 1) * c))
    if not pieces:
        return torch.zeros(0, dtype=torch.long, device=cu.device)
    return torch.cat(pieces).to(cu.device)


def zigzag_split_packed(
    values: torch.Tensor, cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int, dim: int = -1
) -> torch.Tensor:
    """This CP rank's tokens of a packed tensor (token dimension ``dim``). Differentiable."""
    if cp_size == 1:
        return values
    idx = zigzag_packed_indices(cu_seqlens_padded, cp_size, cp_rank).to(values.device)
    return values.index_select(dim, idx)


def zigzag_merge_packed(
    parts: Sequence[torch.Tensor], cu_seqlens_padded: torch.Tensor, dim: int = -1
) -> torch.Tensor:
    """Inverse of :func:`zigzag_split_packed`: ``parts[r]`` is rank r's local tensor."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    total = int(_check_cu(cu_seqlens_padded)[-1])
    shape = list(parts[0].shape)
    d = dim % len(shape)
    shape[d] = total
    out = parts[0].new_zeros(shape)
    for r, p in enumerate(parts):
        idx = zigzag_packed_indices(cu_seqlens_padded, cp_size, r).to(p.device)
        out = out.index_copy(d, idx, p)
    return out
