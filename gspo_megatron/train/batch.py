"""From samples to Megatron microbatches: minibatches, DP split balanced by tokens, token-budget
microbatches, context-parallel split. Pure Python + torch; every rank computes the same plan from
the same samples, so no communication is needed to agree on it.

Layout of one training sequence (prompt p_0..p_{P-1}, response r_0..r_{R-1}):
    tokens    = p_0 .. p_{P-1} r_0 .. r_{R-1}
    position t predicts targets[t] = tokens[t+1]; loss_mask[t] = 1 for t in [P-1, P+R-2]
    (predicting r_j); old/engine log-probs live at the same positions.

Two microbatch formats (MicroBatch.packed):
  packed (THD, the default: train.packing=true)   the sequences of a microbatch one after the
      other in a [1, T] row, with PackedSeqParams (cu_seqlens) so attention never crosses a
      sequence boundary; each sequence is padded only to a multiple of 2*cp (its CP chunks), plus
      one filler segment that makes T a multiple of what SP and CP need and equal across DP ranks.
  padded [b, s]   right-padded rows, exact under causal attention with a masked loss.
The model input (`tokens`, `targets`) is in the model's layout; everything the loss uses
(`loss_mask`, log-probs, advantages) is in the *rows* layout: one row per sequence, this CP rank's
positions of it, left-aligned. `MicroBatch.to_rows` moves model-layout log-probs there
(differentiably); for padded batches the two layouts are the same.

Context parallelism: targets and masks are built on the full sequence first, then each CP rank
keeps its zigzag chunks (parallel/seq_reduce.py zigzag_positions) of every tensor; `positions` records which global
positions a rank holds (scoring puts the pieces back together).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gspo_megatron.parallel.seq_reduce import zigzag_positions


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    engine_logprobs: list[float] | None = None  # one per response token
    routing: torch.Tensor | None = None  # the engine's experts: int [P + R - 1, layers, top_k] (rollout/base.py)
    token_mask: list[bool] | None = None  # per response token: False leaves it out of the loss (loss.max_token_age)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # model input, this CP rank's part: [b, s] padded or [1, t] packed (long)
    loss_mask: torch.Tensor  # [n, L] bool (rows layout): True where the position predicts a response token
    advantages: torch.Tensor  # [n] float32 (0 for filler rows)
    engine_logprobs: torch.Tensor  # [n, L] float32 (0 outside the mask)
    num_sequences: int  # rows with at least one loss token (in the whole sequence, all CP ranks)
    targets: torch.Tensor | None = None  # like tokens: the token each position predicts
    positions: torch.Tensor | None = None  # [n, L] long: position in its sequence of each rows-layout slot
    index: torch.Tensor | None = None  # [n, L] long: flat index into tokens of each slot, -1 if none (packed)
    cu_seqlens: torch.Tensor | None = None  # [k+1] int32, packed: cumulative padded lengths (all CP ranks)
    cu_seqlens_real: torch.Tensor | None = None  # [k+1] int32, packed: the same without per-sequence padding
    max_seqlen: int = 0  # packed: the longest padded segment (RoPE table length)
    seq_length: int = 0  # the full (all CP ranks) sequence length of the model input: Megatron's seq_length
    # Filled by forward-only passes before the update (on the last pipeline stage), rows layout:
    old_logprobs: torch.Tensor | None = None  # [n, L]
    ref_logprobs: torch.Tensor | None = None  # [n, L]
    # The engine's experts in the model layout: int [b, s, layers, top_k], -1 where none
    # (parallel/routing_replay.py maps it to each router's tokens); None without engine routing.
    routing: torch.Tensor | None = None
    extras: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def micro_batch_size(self) -> int:
        return self.tokens.shape[0]

    def to_(self, device: torch.device) -> "MicroBatch":
        """Move every tensor field to `device` in place (the rank's device: these tensors meet
        the model's log-probs in the loss); returns self. No copy when already there."""
        for name in ("tokens", "targets", "loss_mask", "advantages", "engine_logprobs", "old_logprobs",
                     "ref_logprobs", "positions", "index", "cu_seqlens", "cu_seqlens_real", "routing"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self

    def to_rows(self, t: torch.Tensor) -> torch.Tensor:
        """A model-layout tensor ([b, s] or [1, t]) in the rows layout [n, L] (0 where no token);
        differentiable. The identity for padded batches."""
        if self.index is None:
            return t
        flat = t.reshape(-1)
        picked = flat[self.index.clamp(min=0)]
        return torch.where(self.index >= 0, picked, torch.zeros((), dtype=t.dtype, device=t.device))

    def packed_seq_params(self, cp_group=None):
        """Megatron's PackedSeqParams for this packed microbatch (None for padded ones)."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens_real, cu_seqlens_kv=self.cu_seqlens_real,
                               cu_seqlens_q_padded=self.cu_seqlens, cu_seqlens_kv_padded=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen, cp_group=cp_group)


def split_minibatches(n: int, k: int) -> list[range]:
    """k contiguous, near-equal minibatches of n samples (samples are pre-shuffled by the caller)."""
    k = max(1, min(k, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k)]


def balance_dp(lengths: list[int], dp: int) -> list[list[int]]:
    """Indices per DP rank, greedy longest-first onto the rank with the fewest tokens."""
    shards: list[list[int]] = [[] for _ in range(dp)]
    loads = [0] * dp
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(dp), key=lambda r: (loads[r], len(shards[r]), r))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


def pack_microbatches(lengths: list[int], indices: list[int], token_budget: int, multiple: int,
                      packed: bool = False) -> list[list[int]]:
    """Group `indices` into microbatches within `token_budget` tokens (a single longer sequence
    still gets its own microbatch): padded, the size b * s; packed, the sum of the sequences'
    lengths rounded up to `multiple` each (longest first into the first group with room)."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    if packed:
        loads: list[int] = []
        for i in order:
            n = _round_up(max(lengths[i], 2), multiple)
            for g, load in enumerate(loads):
                if load + n <= token_budget:
                    groups[g].append(i)
                    loads[g] += n
                    break
            else:
                groups.append([i])
                loads.append(n)
        return groups
    cur: list[int] = []
    cur_max = 0
    for i in order:
        s = _round_up(max(cur_max, lengths[i]), multiple)
        if cur and s * (len(cur) + 1) > token_budget:
            groups.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, lengths[i])
    if cur:
        groups.append(cur)
    return groups


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _full_sequence(x: TrainSample, length: int, pad_id: int):
    """tokens, targets, loss mask, engine log-probs of one sample on its full (padded) length."""
    p, r = len(x.prompt_ids), len(x.response_ids)
    tokens = torch.full((length,), pad_id, dtype=torch.long)
    tokens[: p + r] = torch.as_tensor(x.prompt_ids + x.response_ids, dtype=torch.long)
    targets = torch.full((length,), pad_id, dtype=torch.long)
    targets[: p + r - 1] = tokens[1 : p + r]
    mask = torch.zeros(length, dtype=torch.bool)
    eng = torch.zeros(length, dtype=torch.float32)
    if r:
        mask[p - 1 : p + r - 1] = True if x.token_mask is None else torch.as_tensor(x.token_mask, dtype=torch.bool)
        if x.engine_logprobs is not None:
            eng[p - 1 : p + r - 1] = torch.as_tensor(x.engine_logprobs, dtype=torch.float32)
    return tokens, targets, mask, eng


def _routing_dims(samples: list[TrainSample]) -> tuple[int, int] | None:
    """(layers, top_k) when the samples carry engine routing (all or none of them must)."""
    have = [x.routing is not None for x in samples]
    if not any(have):
        return None
    if not all(have):
        raise ValueError("some samples carry engine routing and some do not")
    dims = {tuple(x.routing.shape[1:]) for x in samples}
    if len(dims) != 1:
        raise ValueError(f"engine routing of different shapes in one batch: {sorted(dims)}")
    return dims.pop()


def _full_routing(x: TrainSample | None, length: int, dims: tuple[int, int]) -> torch.Tensor:
    """[length, layers, top_k] routing of one sequence, -1 where the engine routed nothing."""
    out = torch.full((length, *dims), -1, dtype=torch.int32)
    if x is not None and x.routing is not None:
        n = min(len(x.routing), length)
        if len(x.routing) != x.length - 1:
            raise ValueError(f"engine routing has {len(x.routing)} positions for a sequence of {x.length} tokens "
                             f"(expected {x.length - 1})")
        out[:n] = torch.as_tensor(x.routing[:n], dtype=torch.int32)
    return out


@dataclass(frozen=True)
class BatchShape:
    """How microbatches are laid out: `multiple` = the granularity SP and CP need of the model
    input's length (train/scoring.py pad_multiple), `cp`/`cp_rank` = this rank's CP split,
    `packed` = THD packing."""

    multiple: int = 1
    pad_id: int = 0
    cp: int = 1
    cp_rank: int = 0
    packed: bool = False

    @property
    def per_sequence(self) -> int:
        """Packed: each sequence is padded to a multiple of this (its 2*cp CP chunks)."""
        return 2 * self.cp if self.cp > 1 else 1


def collate(samples: list[TrainSample], multiple: int, pad_id: int = 0, rows: int | None = None,
            s_len: int | None = None, cp: int = 1, cp_rank: int = 0) -> MicroBatch:
    """Right-padded microbatch ([b, s], this CP rank's zigzag positions of every row); `rows` >
    len(samples) adds filler rows (all-zero mask), `s_len` pads further to a given length."""
    rows = rows or max(1, len(samples))
    s_len = max(s_len or 0, _round_up(max([x.length for x in samples] + [2]), multiple))
    full = [_full_sequence(x, s_len, pad_id) for x in samples]
    empty = _full_sequence(TrainSample([pad_id], [], 0.0), s_len, pad_id)
    full += [empty] * (rows - len(samples))
    tokens, targets, mask, eng = (torch.stack([f[k] for f in full]) for k in range(4))
    pos = zigzag_positions(s_len, cp, cp_rank)
    adv = torch.zeros(rows, dtype=torch.float32)
    adv[: len(samples)] = torch.as_tensor([x.advantage for x in samples], dtype=torch.float32)
    n = int(mask.any(dim=1).sum())
    dims, routing = _routing_dims(samples), None
    if dims is not None:
        routing = torch.stack([_full_routing(x, s_len, dims) for x in samples]
                              + [_full_routing(None, s_len, dims)] * (rows - len(samples)))[:, pos]
    return MicroBatch(tokens[:, pos], mask[:, pos], adv, eng[:, pos], n, targets=targets[:, pos],
                      positions=pos.unsqueeze(0).expand(rows, -1).contiguous(), seq_length=s_len, routing=routing)


def collate_packed(samples: list[TrainSample], shape: BatchShape, total: int | None = None) -> MicroBatch:
    """Packed (THD) microbatch: each sample padded to a multiple of 2*cp, then one filler segment
    up to `total` (default: the smallest multiple of shape.multiple that holds them); this CP
    rank keeps its zigzag chunks of every segment (TE's partitioning of packed sequences)."""
    cp, rank = shape.cp, shape.cp_rank
    lengths = [_round_up(max(x.length, 2), shape.per_sequence) for x in samples]
    used = sum(lengths)
    total = max(total or 0, _round_up(max(used, 1), shape.multiple))
    if (total - used) % shape.per_sequence or total % shape.multiple:
        raise ValueError(f"packed microbatch: total {total} does not fit the layout (multiple {shape.multiple})")
    seg_len = lengths + ([total - used] if total > used else [])
    real_len = [x.length for x in samples] + ([total - used] if total > used else [])
    tok_parts, tgt_parts, route_parts = [], [], []
    dims = _routing_dims(samples)
    n = max(1, len(samples))
    width = max([ln // cp for ln in lengths] + [1])
    mask = torch.zeros(n, width, dtype=torch.bool)
    eng = torch.zeros(n, width, dtype=torch.float32)
    index = torch.full((n, width), -1, dtype=torch.long)
    positions = torch.zeros(n, width, dtype=torch.long)
    offset = 0
    for i, ln in enumerate(seg_len):
        pos = zigzag_positions(ln, cp, rank)
        if i < len(samples):
            t, g, m, e = _full_sequence(samples[i], ln, shape.pad_id)
            k = pos.numel()
            mask[i, :k], eng[i, :k] = m[pos], e[pos]
            index[i, :k] = torch.arange(offset, offset + k)
            positions[i, :k] = pos
        else:  # filler: pad tokens predicting pad tokens, no loss
            t = g = torch.full((ln,), shape.pad_id, dtype=torch.long)
        tok_parts.append(t[pos])
        tgt_parts.append(g[pos])
        if dims is not None:
            route_parts.append(_full_routing(samples[i] if i < len(samples) else None, ln, dims)[pos])
        offset += pos.numel()
    adv = torch.zeros(n, dtype=torch.float32)
    if samples:
        adv[: len(samples)] = torch.as_tensor([x.advantage for x in samples], dtype=torch.float32)
    cu = torch.tensor([0] + seg_len, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_real = torch.tensor([0] + real_len, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    n_seq = sum(1 for x in samples if x.response_ids)  # on the whole sequences, not this CP rank's part
    return MicroBatch(torch.cat(tok_parts).unsqueeze(0), mask, adv, eng, n_seq,
                      targets=torch.cat(tgt_parts).unsqueeze(0), positions=positions, index=index, cu_seqlens=cu,
                      cu_seqlens_real=cu_real, max_seqlen=max(seg_len), seq_length=total,
                      routing=torch.cat(route_parts).unsqueeze(0) if dims is not None else None)


def plan_microbatches(
    samples: list[TrainSample], *, dp: int, dp_rank: int, token_budget: int, multiple: int, pad_id: int = 0,
    cp: int = 1, cp_rank: int = 0, packed: bool = False,
) -> tuple[list[list[int]], list[MicroBatch]]:
    """Sample indices and collated microbatches of this DP rank (and CP rank).

    Every DP rank gets the same number of microbatches, and the k-th microbatch has the same
    shape on every DP rank (filler rows or a filler segment; microbatches with an empty mask):
    expert-parallel collectives span DP ranks, need every rank in each forward pass, and
    Megatron's allgather dispatcher (used for expert-TP > 1) needs equal token counts across them.
    """
    shape = BatchShape(multiple=multiple, pad_id=pad_id, cp=cp, cp_rank=cp_rank, packed=packed)
    lengths = [x.length for x in samples]
    granule = shape.per_sequence if packed else multiple
    plans = [pack_microbatches(lengths, s, token_budget, granule, packed) for s in balance_dp(lengths, dp)]
    n_micro = max(1, max(len(p) for p in plans))
    plans = [p + [[] for _ in range(n_micro - len(p))] for p in plans]
    mbs = []
    for k, group in enumerate(plans[dp_rank]):
        if packed:
            total = max(_round_up(max(sum(_round_up(max(lengths[i], 2), granule) for i in p[k]), 1), multiple)
                        for p in plans)
            mbs.append(collate_packed([samples[i] for i in group], shape, total))
            continue
        rows = max(1, max(len(p[k]) for p in plans))
        s_len = max(_round_up(max([lengths[i] for i in p[k]] + [2]), multiple) for p in plans)
        mbs.append(collate([samples[i] for i in group], multiple, pad_id, rows=rows, s_len=s_len, cp=cp,
                           cp_rank=cp_rank))
    return plans[dp_rank], mbs


def plan_minibatch(
    samples: list[TrainSample], *, dp: int, dp_rank: int, token_budget: int, multiple: int, pad_id: int = 0,
    cp: int = 1, cp_rank: int = 0, packed: bool = False,
) -> tuple[list[MicroBatch], int]:
    """This DP rank's microbatches for one minibatch, and the minibatch's global sequence count."""
    _, mbs = plan_microbatches(samples, dp=dp, dp_rank=dp_rank, token_budget=token_budget, multiple=multiple,
                               pad_id=pad_id, cp=cp, cp_rank=cp_rank, packed=packed)
    global_sequences = sum(1 for x in samples if x.response_ids)
    return mbs, global_sequences
