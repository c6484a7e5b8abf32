"""Token log-probabilities (and entropy) from vocab-parallel logits, chunked and fused.

Under tensor parallelism Megatron's output layer is column-parallel: rank ``r`` of the TP group
holds vocab rows ``[vocab_start, vocab_start + V/tp)`` of the output weight and produces the
matching slice of the logits. The log-prob of target ``y`` needs the log-partition over the full
vocabulary; it is assembled from per-rank statistics with two collectives:

* MAX all-reduce of the per-token local max ``m_r``;
* one SUM all-reduce of a stacked [N, 2 or 3] tensor: the local ``sum exp(x - m)`` (rescaled
  from ``m_r`` to the global ``m``), the target logit (zero on ranks that do not own ``y``), and
  for entropy ``sum exp(x - m) * (x - m)``.

Then ``log p(y) = x_y - m - log S`` and ``H = log S - A / S``. The backward is local to each rank:
``d log p(y) / dx = onehot(y) - softmax(x)`` and ``dH / dx = -softmax(x) * (log softmax(x) + H)``,
both divided by the temperature. Everything is computed in float32 (float64 for float64 inputs)
whatever the logits' dtype, and the outputs have that dtype.

Two entry points:

* :func:`vocab_parallel_log_probs` takes the logits shard ``[..., V/tp]``. It works in chunks of
  tokens so that the float32 temporaries stay bounded (a chunk of ``chunk_size`` tokens times the
  local vocab; by default at most :data:`DEFAULT_CHUNK_ELEMENTS` elements and 1/64 of the
  logits); the logits are saved (not copied) for backward, which recomputes the softmax chunk by
  chunk and writes the gradient straight into its output. Unlike Megatron's
  ``vocab_parallel_cross_entropy`` it never modifies the logits in place (they may feed other
  terms), at the price of a second ``exp`` pass in backward.

* :func:`fused_vocab_parallel_log_probs` takes the final hidden states ``[..., H]`` and the
  output-layer weight shard ``[V/tp, H]`` and never materialises the ``[N, V/tp]`` logits: it
  walks the local vocabulary in blocks of ``chunk_size`` rows of the weight (matmul, online
  log-sum-exp), and recomputes each block's logits in backward, where it writes that block of
  the weight gradient with one matmul and accumulates the hidden gradient in float32. Logits are
  rounded to the weight's dtype exactly like the unfused output layer would produce them.

  The hidden-state gradient it returns is **this rank's partial contribution** (the logits of the
  other vocab shards also depend on the hidden state). The caller must sum it over the TP group.
  In Megatron that is what the region wrappers around the output layer's input already do:
  ``copy_to_tensor_model_parallel_region(hidden, group=tp_group)`` (identity forward, all-reduce
  backward) without sequence parallelism, or ``gather_from_sequence_parallel_region`` (all-gather
  forward, reduce-scatter backward) with it. Pass the *wrapped* hidden state to this function.

Process groups are explicit: ``group=None`` means no tensor parallelism (the rank holds the whole
vocabulary), never the default world group. Nothing here reads Megatron's global state.

Padded vocabularies: Megatron pads the vocabulary to a multiple of 128*tp (151,936 -> 152,064 at
TP2). Pass the true ``vocab_size`` to exclude the padding columns from the softmax, so that the
log-probs match the unpadded model (and the inference engine); their gradient is zero.

Targets at positions the loss masks out (prompt, padding) may be any id (even negative): they
yield a finite, meaningless value there.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .seq_reduce import group_size

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "vocab_parallel_log_probs",
    "fused_vocab_parallel_log_probs",
]

#: Default cap on the elements of one chunk temporary (16 MiB of float32); a chunk needs 2-3 of
#: them. Chunks are also kept below 1/:data:`CHUNK_FRACTION` of the local logits' bytes, so that
#: the extra memory stays a small fraction of the logits at any size.
DEFAULT_CHUNK_ELEMENTS = 1 << 22
CHUNK_FRACTION = 64
#: ... but never below this many elements (1 MiB of float32): under it the fraction rule only
#: multiplies the per-chunk Python and dispatch cost (at the demo's 600 tokens x vocab 98 it made
#: 64 chunks of 9 rows) for memory that does not matter.
MIN_CHUNK_ELEMENTS = 1 << 18


def _chunk_budget(n: int, v: int, itemsize: int = 4) -> int:
    """Elements per chunk: at most DEFAULT_CHUNK_ELEMENTS and 1/CHUNK_FRACTION of the bytes of the
    local logits (itemsize = their element size; the temporaries are float32), at least
    MIN_CHUNK_ELEMENTS."""
    return max(MIN_CHUNK_ELEMENTS, min(DEFAULT_CHUNK_ELEMENTS, (n * v * itemsize) // (4 * CHUNK_FRACTION)))


def _vocab_range(group, vocab_local: int, vocab_start: int | None, vocab_size: int | None):
    """(first global id of this shard, number of non-padding columns in this shard)."""
    tp = group_size(group)
    if vocab_start is None:
        vocab_start = (dist.get_rank(group) if tp > 1 else 0) * vocab_local
    valid = vocab_local if vocab_size is None else max(0, min(vocab_local, vocab_size - vocab_start))
    return int(vocab_start), int(valid)


def _target_index(targets: torch.Tensor, vocab_start: int, valid: int):
    local = targets - vocab_start
    owned = (local >= 0) & (local < valid)
    return local, owned


def _combine(m_loc, s_loc, a_loc, tgt, group, want_entropy: bool):
    """Per-rank (max, sum exp(x-m_r), sum exp(x-m_r)(x-m_r), target logit) -> (logZ, logp, H).

    One collective: every rank's statistics are all-gathered ([tp, k, n], a few floats a token)
    and each rank combines them in rank order, instead of an all-reduce MAX of the maxima and
    then an all-reduce SUM of the rescaled sums: the forward of every microbatch waited on two
    round trips (at TP2 on gloo, ~30 ms of a 0.66 s CPU demo step). Each rank sums the same
    gathered values in the same order, so every rank gets the same bits."""
    tp = group_size(group)
    local = torch.stack([m_loc, s_loc, tgt] + ([a_loc] if want_entropy else []), dim=0)  # [k, n]
    if tp > 1:
        stats = torch.empty((tp * local.shape[0], local.shape[1]), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(stats, local, group=group)  # concatenated along dim 0 (gloo: 2-d)
        stats = stats.view(tp, *local.shape)
    else:
        stats = local.unsqueeze(0)
    m_r, s_r = stats[:, 0], stats[:, 1]
    m = m_r.amax(dim=0)
    has = s_r > 0  # a shard with no valid column has m_r = -inf and S_r = 0
    zero = torch.zeros((), dtype=m.dtype, device=m.device)
    diff = torch.where(has, m_r - m, zero)
    scale = torch.where(has, torch.exp(diff), zero)
    s = (s_r * scale).sum(dim=0)
    log_s = torch.log(s)
    log_z = m + log_s
    logp = stats[:, 2].sum(dim=0) - log_z
    ent = None
    if want_entropy:
        a = torch.where(has, (stats[:, 3] + diff * s_r) * scale, zero).sum(dim=0)
        ent = log_s - a / s
    return log_z, logp, ent


class _Buffers:
    """Flat scratch buffers reused by every chunk: allocating a fresh chunk-sized tensor per
    chunk costs page faults on CPU and allocator churn on GPU."""

    def __init__(self, numel: int, device):
        self.numel, self.device, self.flat = numel, device, {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.flat.get(name)
        if buf is None:
            size = max(self.numel, rows * cols)
            buf = self.flat[name] = torch.empty(size, dtype=dtype, device=self.device)
        return buf[: rows * cols].view(rows, cols)


def _shift_scale(raw, shift, inv_t, out):
    """``out = raw * inv_t - shift[:, None]`` in ``out``'s dtype, one pass when the dtypes agree.

    (A mixed-dtype elementwise op is several times slower on CPU than a conversion copy followed
    by a same-dtype op, so bf16 blocks are first copied into ``out``.)"""
    if raw.dtype != out.dtype:
        raw = out.copy_(raw)
    return torch.add(-shift[:, None], raw, alpha=inv_t, out=out)


def _block_stats(raw, bufs, inv_t, cdt, want_entropy):
    """Local softmax statistics of a block of *raw* logits ``raw`` [r, c] (any dtype; only read,
    unless it is itself the "x" scratch buffer), scaled by ``inv_t = 1/temperature``.

    Returns (max [r], sum exp(z) [r], sum exp(z) * z [r] or None) with z = raw/T - max, in
    ``cdt``. Passes over the block: max, shift+scale (one add; plus a copy for bf16), exp, sum.
    """
    mx = raw.amax(dim=1).to(cdt) * inv_t  # T > 0: max(raw / T) = max(raw) / T
    z = _shift_scale(raw, mx, inv_t, bufs.get("x", raw.shape[0], raw.shape[1], cdt))
    if want_entropy:
        e = torch.exp(z, out=bufs.get("e", z.shape[0], z.shape[1], cdt))
        s = e.sum(dim=1)
        return mx, s, e.mul_(z).sum(dim=1)
    return mx, z.exp_().sum(dim=1), None


def _grad_block(raw, bufs, cdt, log_z, ent, g_lp, g_ent, local_t, in_blk, inv_t, out=None):
    """d(loss)/d(raw logits) of a block, from the *raw* logits ``raw`` [r, c] (only read, unless
    it is the "x" scratch buffer):

        d/dx [g * log p_y + gH * H] = (g * (onehot - p) - gH * p * (log p + H)) / T

    Written into ``out`` when given and of dtype ``cdt`` (the gradient tensor itself), else into
    a scratch buffer, which is returned. The onehot term is added in ``cdt`` (never after
    rounding to a low-precision dtype: 1 - p cancels for confident tokens).
    """
    r, c = raw.shape
    logp = _shift_scale(raw, log_z, inv_t, bufs.get("x", r, c, cdt))
    direct = out is not None and out.dtype == cdt
    if g_ent is not None:
        p = torch.exp(logp, out=bufs.get("e", r, c, cdt))
        q = logp.add_(ent[:, None]).mul_((-g_ent * inv_t)[:, None])  # -gH (log p + H) / T
        if g_lp is not None:
            q.sub_((g_lp * inv_t)[:, None])
        res = torch.mul(p, q, out=out if direct else p)
    else:
        p = logp.exp_()
        res = torch.mul(p, (-g_lp * inv_t)[:, None], out=out if direct else p)
    if g_lp is not None:
        idx = torch.where(in_blk, local_t, torch.zeros_like(local_t))
        res.scatter_add_(1, idx[:, None], torch.where(in_blk, g_lp * inv_t, torch.zeros_like(g_lp))[:, None])
    return res


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, vocab_size, temperature, chunk, want_entropy):
        n, v_local = logits.shape
        cdt = torch.promote_types(logits.dtype, torch.float32)
        inv_t = 1.0 / temperature
        start, valid = _vocab_range(group, v_local, vocab_start, vocab_size)
        local_t, owned = _target_index(targets, start, valid)
        idx = torch.where(owned, local_t, torch.zeros_like(local_t))
        f32 = dict(dtype=cdt, device=logits.device)
        m_loc = torch.full((n,), -math.inf, **f32)
        s_loc = torch.zeros(n, **f32)
        a_loc = torch.zeros(n, **f32) if want_entropy else None
        tgt = torch.zeros(n, **f32)
        rows = chunk or max(1, _chunk_budget(n, valid, logits.element_size()) // max(valid, 1))
        if valid > 0:
            bufs = _Buffers(min(rows, n) * valid, logits.device)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                raw = logits[r0:r1, :valid]
                tgt[r0:r1] = raw.gather(1, idx[r0:r1, None]).squeeze(1).to(cdt) * inv_t
                mx, sm, am = _block_stats(raw, bufs, inv_t, cdt, want_entropy)
                m_loc[r0:r1], s_loc[r0:r1] = mx, sm
                if want_entropy:
                    a_loc[r0:r1] = am
            del bufs
        tgt = torch.where(owned, tgt, torch.zeros_like(tgt))
        log_z, logp, ent = _combine(m_loc, s_loc, a_loc, tgt, group, want_entropy)
        ctx.save_for_backward(logits, local_t, owned, log_z, ent if want_entropy else log_z)
        ctx.cfg = (valid, inv_t, rows, want_entropy)
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ent = logp.new_empty(0)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        logits, local_t, owned, log_z, ent = ctx.saved_tensors
        valid, inv_t, rows, want_entropy = ctx.cfg
        if not want_entropy:
            g_ent = None
        if g_lp is None and g_ent is None:
            return (None,) * 8
        n, v_local = logits.shape
        cdt = torch.promote_types(logits.dtype, torch.float32)
        g_lp = g_lp.to(cdt) if g_lp is not None else None
        g_ent = g_ent.to(cdt) if g_ent is not None else None
        grad = (torch.zeros_like if valid < v_local else torch.empty_like)(logits)
        if valid > 0:
            bufs = _Buffers(min(rows, n) * valid, logits.device)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                dst = grad[r0:r1, :valid]
                res = _grad_block(
                    logits[r0:r1, :valid], bufs, cdt, log_z[r0:r1],
                    ent[r0:r1] if g_ent is not None else None,
                    g_lp[r0:r1] if g_lp is not None else None,
                    g_ent[r0:r1] if g_ent is not None else None,
                    local_t[r0:r1], owned[r0:r1], inv_t, out=dst,
                )
                if res is not dst:
                    dst.copy_(res)
        return grad, None, None, None, None, None, None, None


class _FusedVocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def _logits_block(hidden, w_blk, bufs, cdt):
        """Raw logits of one vocab block, in the model dtype (rounded exactly like the unfused
        output layer's logits), in a reused [N, c] buffer: "x" (already ``cdt``) or "mm"."""
        n, c = hidden.shape[0], w_blk.shape[0]
        name = "x" if hidden.dtype == cdt else "mm"
        return torch.mm(hidden, w_blk.t(), out=bufs.get(name, n, c, hidden.dtype))

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, vocab_size, temperature, chunk, want_entropy):
        n = hidden.shape[0]
        v_local = weight.shape[0]
        inv_t = 1.0 / temperature
        start, valid = _vocab_range(group, v_local, vocab_start, vocab_size)
        local_t, owned = _target_index(targets, start, valid)
        cdt = torch.promote_types(weight.dtype, torch.float32)
        f32 = dict(dtype=cdt, device=hidden.device)
        m = torch.full((n,), -math.inf, **f32)
        s = torch.zeros(n, **f32)
        a = torch.zeros(n, **f32) if want_entropy else None
        tgt = torch.zeros(n, **f32)
        cols = chunk or max(128, _chunk_budget(n, valid, weight.element_size()) // max(n, 1))
        zero = torch.zeros((), **f32)
        bufs = _Buffers(n * min(cols, max(valid, 1)), hidden.device)
        for c0 in range(0, valid, cols):
            c1 = min(valid, c0 + cols)
            raw = _FusedVocabParallelLogProbs._logits_block(hidden, weight[c0:c1], bufs, cdt)
            in_blk = owned & (local_t >= c0) & (local_t < c1)
            bidx = torch.where(in_blk, local_t - c0, torch.zeros_like(local_t))
            tgt += torch.where(in_blk, raw.gather(1, bidx[:, None]).squeeze(1).to(cdt) * inv_t, zero)
            bm, bs, ba = _block_stats(raw, bufs, inv_t, cdt, want_entropy)
            new_m = torch.maximum(m, bm)
            alpha = torch.exp(m - new_m)  # 0 on the first block (m = -inf)
            beta = torch.exp(bm - new_m)
            if want_entropy:
                # re-centre both running sums on new_m: sum e^(x-M)(x-M) = e^(m-M)(A + (m-M) S)
                da = torch.where(s > 0, m - new_m, zero)
                a = alpha * (a + da * s) + beta * (ba + (bm - new_m) * bs)
            s = s * alpha + bs * beta
            m = new_m
        del bufs
        log_z, logp, ent = _combine(m, s, a, tgt, group, want_entropy)
        ctx.save_for_backward(hidden, weight, local_t, owned, log_z, ent if want_entropy else log_z)
        ctx.cfg = (valid, inv_t, cols, want_entropy)
        ctx.set_materialize_grads(False)
        if not want_entropy:
            ent = logp.new_empty(0)
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, local_t, owned, log_z, ent = ctx.saved_tensors
        valid, inv_t, cols, want_entropy = ctx.cfg
        if not want_entropy:
            g_ent = None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return (None,) * 9
        n = hidden.shape[0]
        cdt = torch.promote_types(weight.dtype, torch.float32)
        g_lp = g_lp.to(cdt) if g_lp is not None else None
        g_ent = g_ent.to(cdt) if g_ent is not None else None
        grad_h = torch.zeros(hidden.shape, dtype=cdt, device=hidden.device) if need_h else None
        grad_w = None
        if need_w:
            grad_w = (torch.zeros_like if valid < weight.shape[0] else torch.empty_like)(weight)
        bufs = _Buffers(n * min(cols, max(valid, 1)), hidden.device)
        for c0 in range(0, valid, cols):
            c1 = min(valid, c0 + cols)
            w_blk = weight[c0:c1]
            raw = _FusedVocabParallelLogProbs._logits_block(hidden, w_blk, bufs, cdt)
            in_blk = owned & (local_t >= c0) & (local_t < c1)
            g = _grad_block(raw, bufs, cdt, log_z, ent if g_ent is not None else None, g_lp, g_ent,
                            local_t - c0, in_blk, inv_t)
            if g.dtype != weight.dtype:  # raw (in "mm") is no longer needed: reuse its buffer
                g = bufs.get("mm", n, c1 - c0, weight.dtype).copy_(g)
            if need_w:
                torch.mm(g.t(), hidden, out=grad_w[c0:c1])
            if need_h:
                if g.dtype == grad_h.dtype:
                    grad_h.addmm_(g, w_blk)
                else:  # model-dtype product, float32 accumulation; scratch no larger than a block
                    # The product is widened into the free "x" buffer before the add: an add
                    # of mixed dtypes (float32 += bf16) is ~5x slower on CPU than copy + add,
                    # and at full size that was the whole gap between this path and its matmuls.
                    hd = hidden.shape[1]
                    step = max(1, min(n, bufs.numel // hd))
                    for r0 in range(0, n, step):
                        r1 = min(n, r0 + step)
                        prod = torch.mm(g[r0:r1], w_blk, out=bufs.get("gh", r1 - r0, hd, weight.dtype))
                        grad_h[r0:r1] += bufs.get("x", r1 - r0, hd, cdt).copy_(prod)
        del bufs
        if need_h:
            grad_h = grad_h.to(hidden.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _apply(fn, x, extra, targets, group, temperature, vocab_start, vocab_size, chunk_size, return_entropy):
    """Check, flatten ``x`` [..., D] to [N, D], run the autograd function, restore the leading
    shape of ``targets``."""
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"targets shape {tuple(targets.shape)} != leading shape {tuple(x.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = targets.shape
    logp, ent = fn.apply(
        x.reshape(-1, x.shape[-1]), *extra, targets.reshape(-1).long(), group, vocab_start, vocab_size,
        float(temperature), chunk_size, bool(return_entropy),
    )
    if return_entropy:
        return logp.view(lead), ent.view(lead)
    return logp.view(lead)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    group=None,
    temperature: float = 1.0,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    return_entropy: bool = False,
):
    """log softmax(logits / T)[target] over a vocab-sharded logits tensor; optionally the entropy.

    Args:
        logits: [..., V/tp] this rank's vocab slice (any float dtype; Megatron gives [s, b, V/tp]).
        targets: [...] global token ids (long).
        group: the TP process group, or None for no TP.
        temperature: logits are divided by it (the sampling temperature of the rollout).
        vocab_start: first global id of this shard; default ``rank * V/tp`` (Megatron's layout).
        vocab_size: true (unpadded) global vocabulary size; ids >= it are excluded.
        chunk_size: tokens per chunk; by default a chunk holds at most ``DEFAULT_CHUNK_ELEMENTS``
            float32 elements and 1/64 of the logits' bytes.
        return_entropy: also return the per-token entropy of softmax(logits / T).

    Returns:
        log_probs [...] float32 (float64 for float64 logits), or (log_probs, entropy). Both
        differentiable
        w.r.t. ``logits`` (the gradient has ``logits``' dtype and shape).
    """
    return _apply(_VocabParallelLogProbs, logits, (), targets, group, temperature, vocab_start, vocab_size,
                  chunk_size, return_entropy)


def fused_vocab_parallel_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    group=None,
    temperature: float = 1.0,
    vocab_start: int | None = None,
    vocab_size: int | None = None,
    chunk_size: int | None = None,
    return_entropy: bool = False,
):
    """Token log-probs (and entropy) of ``hidden @ weight.T`` without materialising the logits.

    Args:
        hidden: [..., H] final hidden states, identical on all TP ranks (already passed through
            ``copy_to_tensor_model_parallel_region`` / ``gather_from_sequence_parallel_region``;
            see the module docstring: the hidden gradient returned here is a partial sum that
            those wrappers all-reduce / reduce-scatter over TP).
        weight: [V/tp, H] this rank's rows of the output-layer weight (no bias: Qwen3 has none).
        targets: [...] global token ids.
        group, temperature, vocab_start, vocab_size, return_entropy: as in
            :func:`vocab_parallel_log_probs`.
        chunk_size: vocab rows per block (at least 128 by default); by default a block holds at
            most ``DEFAULT_CHUNK_ELEMENTS`` float32 elements and 1/64 of the logits' bytes. Extra
            memory: ~2 blocks of N*chunk_size float32 (3 with entropy; plus one in the model dtype
            for bf16) and an [N, H] float32 accumulator for the hidden gradient (for bf16 models
            this accumulator, 2*H*tp/V of the bf16 logits' size, dominates at TP >= 2).

    Returns:
        log_probs [...] float32, or (log_probs, entropy). Gradients flow to ``hidden`` (partial
        over TP, see above) and to ``weight`` (complete for this shard).
    """
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V/tp, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    return _apply(_FusedVocabParallelLogProbs, hidden, (weight,), targets, group, temperature, vocab_start,
                  vocab_size, chunk_size, return_entropy)
