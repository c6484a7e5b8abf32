"""From samples to Megatron microbatches: minibatches, DP split balanced by tokens, token-budget
microbatches, context-parallel split. Pure Python + torch; every rank computes the same plan from
every sample's length, so no communication is needed to agree on it. A rank needs the content
only of its own DP rank's samples: the others may be RemoteSamples (their lengths), and the
training loop sends each DP rank only its share (`dp_owners`, `encode_shares` / `decode_share`,
moved by parallel/dataplane.py).

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

import numpy as np
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

    @property
    def has_response(self) -> bool:
        return bool(self.response_ids)

    @property
    def has_routing(self) -> bool:
        return self.routing is not None


@dataclass(frozen=True)
class RemoteSample:
    """Another DP rank's sample, on this rank: what planning needs of it (every DP rank's plan
    is computed everywhere, from every sample's length), without its content, which only the
    ranks of its DP rank receive (parallel/dataplane.py, `decode_share`)."""

    prompt_len: int
    response_len: int
    has_routing: bool = False

    @property
    def length(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def has_response(self) -> bool:
        return self.response_len > 0


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
    # packed: some sequence is padded inside its segment (cu_seqlens != cu_seqlens_real); decided
    # from the lengths at collation, so building PackedSeqParams never syncs with the device
    padded_segments: bool = False
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
        """Megatron's PackedSeqParams for this packed microbatch (None for padded ones).

        The `*_padded` boundaries only when a sequence is actually padded inside its segment: TE
        treats any given `cu_seqlens_q_padded` as a padded batch between sequences, which rules out
        its FlashAttention-2 backend (TE 2.x `dot_product_attention/utils.py`
        get_attention_backend: `pad_between_seqs`), so an unpadded batch must not pass them."""
        if not self.packed:
            return None
        from megatron.core.packed_seq_params import PackedSeqParams

        padded = self.cu_seqlens if self.padded_segments else None
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens_real, cu_seqlens_kv=self.cu_seqlens_real,
                               cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
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


def _list_tensor(values: list, dtype) -> torch.Tensor:
    """A flat Python list as a tensor through numpy: ~3x faster than torch.tensor(list), which
    converts element by element (the same values: both round a Python float to float32 to nearest)."""
    return torch.from_numpy(np.array(values, dtype=dtype))


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
    # Built as Python lists and turned into tensors once: per-sample tensor ops cost ~0.2 ms a
    # sample (a quarter of a 16-sample microbatch's forward on the CPU demo).
    dims = _routing_dims(samples)
    route_parts = []
    n = max(1, len(samples))
    width = max([ln // cp for ln in lengths] + [1])
    tok, tgt = [], []
    mask_rows, eng_rows, pos_rows = [], [], []
    for i, ln in enumerate(seg_len):
        pos = None if cp == 1 and dims is None else zigzag_positions(ln, cp, rank)
        where = range(ln) if cp == 1 else pos.tolist()
        if i < len(samples):
            x = samples[i]
            ids = x.prompt_ids + x.response_ids
            p, r = len(x.prompt_ids), len(x.response_ids)
            pad = [shape.pad_id] * (ln - len(ids))
            full_tok, full_tgt = ids + pad, ids[1:] + pad + [shape.pad_id]
            m = [False] * ln
            e = [0.0] * ln
            if r:  # the loss positions: the ones that predict response tokens
                for name in ("token_mask", "engine_logprobs"):
                    v = getattr(x, name)
                    if v is not None and len(v) != r:
                        raise ValueError(f"sample {i} of a microbatch: {name} has {len(v)} values for {r} "
                                         "response tokens")
                m[p - 1: p + r - 1] = [True] * r if x.token_mask is None else [bool(v) for v in x.token_mask]
                if x.engine_logprobs is not None:
                    e[p - 1: p + r - 1] = x.engine_logprobs
            if cp == 1:
                tok += full_tok
                tgt += full_tgt
                mask_rows.append(m)
                eng_rows.append(e)
                pos_rows.append(list(where))
            else:
                tok += [full_tok[j] for j in where]
                tgt += [full_tgt[j] for j in where]
                mask_rows.append([m[j] for j in where])
                eng_rows.append([e[j] for j in where])
                pos_rows.append(list(where))
        else:  # filler: pad tokens predicting pad tokens, no loss
            tok += [shape.pad_id] * len(where)
            tgt += [shape.pad_id] * len(where)
        if dims is not None:
            route_parts.append(_full_routing(samples[i] if i < len(samples) else None, ln, dims)[pos])
    # rows layout, padded to `width` in Python: one tensor per field, not four per row
    index_rows, offset = [], 0
    for row in pos_rows:
        index_rows.append(list(range(offset, offset + len(row))))
        offset += len(row)

    def rows_tensor(rows: list[list], fill, dtype) -> torch.Tensor:
        flat = [v for r in rows for v in (*r, *[fill] * (width - len(r)))] + [fill] * (width * (n - len(rows)))
        return _list_tensor(flat, dtype).view(n, width)

    mask = rows_tensor(mask_rows, False, np.bool_)
    eng = rows_tensor(eng_rows, 0.0, np.float32)
    index = rows_tensor(index_rows, -1, np.int64)
    positions = rows_tensor(pos_rows, 0, np.int64)
    adv = torch.zeros(n, dtype=torch.float32)
    if samples:
        adv[: len(samples)] = torch.as_tensor([x.advantage for x in samples], dtype=torch.float32)
    cu = torch.tensor([0] + seg_len, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_real = torch.tensor([0] + real_len, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    n_seq = sum(1 for x in samples if x.response_ids)  # on the whole sequences, not this CP rank's part
    return MicroBatch(_list_tensor(tok, np.int64).unsqueeze(0), mask, adv, eng, n_seq,
                      targets=_list_tensor(tgt, np.int64).unsqueeze(0), positions=positions, index=index, cu_seqlens=cu,
                      cu_seqlens_real=cu_real, padded_segments=seg_len != real_len, max_seqlen=max(seg_len),
                      seq_length=total,
                      routing=torch.cat(route_parts).unsqueeze(0) if dims is not None else None)


def plan_microbatches(
    samples: list[TrainSample | RemoteSample], *, dp: int, dp_rank: int, token_budget: int, multiple: int, pad_id: int = 0,
    cp: int = 1, cp_rank: int = 0, packed: bool = False,
) -> tuple[list[list[int]], list[MicroBatch]]:
    """Sample indices and collated microbatches of this DP rank (and CP rank). Other DP ranks'
    samples may be RemoteSamples: only their lengths are read.

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
        _here([samples[i] for i in group])
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
    samples: list[TrainSample | RemoteSample], *, dp: int, dp_rank: int, token_budget: int, multiple: int, pad_id: int = 0,
    cp: int = 1, cp_rank: int = 0, packed: bool = False,
) -> tuple[list[MicroBatch], int]:
    """This DP rank's microbatches for one minibatch, and the minibatch's global sequence count."""
    _, mbs = plan_microbatches(samples, dp=dp, dp_rank=dp_rank, token_budget=token_budget, multiple=multiple,
                               pad_id=pad_id, cp=cp, cp_rank=cp_rank, packed=packed)
    global_sequences = sum(1 for x in samples if x.has_response)
    return mbs, global_sequences


def _here(samples: list) -> None:
    """The samples this DP rank collates must be here, not another DP rank's (RemoteSample)."""
    if any(isinstance(x, RemoteSample) for x in samples):
        raise RuntimeError("this DP rank's plan holds a sample whose content went to another DP rank: the "
                           "samples were distributed for another minibatch count or DP size than they are "
                           "planned with (train/loop.py)")


# --------------------------------------------------------------------------------------------
# Distributing samples: which DP rank trains on each sample, and its content as bytes
# (parallel/dataplane.py moves them: the header to every rank, each share only to its DP rank)


def dp_owners(lengths: list[int], dp: int, minibatches: int) -> list[int]:
    """The DP rank that trains on each sample of a list split into `minibatches` minibatches
    (split_minibatches), each balanced over `dp` ranks (balance_dp): plan_microbatches' own split,
    so a DP rank can be sent its samples only."""
    owners = [0] * len(lengths)
    for idx in split_minibatches(len(lengths), minibatches):
        for r, shard in enumerate(balance_dp([lengths[i] for i in idx], dp)):
            for j in shard:
                owners[idx[j]] = r
    return owners


# One header row per sample, every rank receives all of them: what planning needs (lengths,
# owner, routing present) and how the owner's bytes are laid out (which fields, their wire types).
HEADER = ("prompt_len", "response_len", "owner", "logprobs", "mask", "routing_rows", "routing_layers",
          "routing_topk", "routing_dtype", "routing_wire", "token_wire")
_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # routing as the engine gave it
# Routing on the wire, per sample the narrowest that holds its values: uint8 for expert ids up to
# 254 (-1, "none", wraps to 255 on the way in and is mapped back on the way out), else signed.
# At 30B-A3B size (48 layers x top-8 of 128 experts) that is 384 bytes a token instead of the
# engine's int32 (1.5 kB) or int64.
_ROUTING_WIRE = (torch.uint8, torch.int16, torch.int32, torch.int64)
_TOKEN_WIRE = (torch.int32, torch.int64)
_ALIGN = 8  # every section starts 8-byte aligned: read back as typed views of the buffer, no copy


def _sections(row: list[int]) -> list[tuple[str, torch.dtype, int]]:
    """(field, wire dtype, elements) of one sample's bytes, in order."""
    p, r, _, lp, mask, rows, layers, topk, _, rwire, twire = row
    out = [("advantage", torch.float64, 1), ("tokens", _TOKEN_WIRE[twire], p + r)]
    if lp:
        out.append(("logprobs", torch.float32, r))  # what _full_sequence converts them to
    if mask:
        out.append(("mask", torch.bool, r))
    if rows >= 0:
        out.append(("routing", _ROUTING_WIRE[rwire], rows * layers * topk))
    return out


def _section_bytes(dtype: torch.dtype, n: int) -> int:
    return _round_up(n * dtype.itemsize, _ALIGN)


def _sample_bytes(row: list[int]) -> int:
    return sum(_section_bytes(dt, n) for _, dt, n in _sections(row))


def _fits(lo: int, hi: int, dtype: torch.dtype) -> bool:
    info = torch.iinfo(dtype)
    return info.min <= lo and hi <= info.max


def _header_row(x: TrainSample, owner: int, i: int) -> list[int]:
    if not isinstance(x, TrainSample):
        raise TypeError(f"sample {i}: a TrainSample is needed to send its content, got {type(x).__name__}")
    p, r = len(x.prompt_ids), len(x.response_ids)
    ids = x.prompt_ids + x.response_ids
    twire = 0 if not ids or _fits(min(ids), max(ids), torch.int32) else 1
    for name, v in (("engine_logprobs", x.engine_logprobs), ("token_mask", x.token_mask)):
        if v is not None and len(v) != r:
            raise ValueError(f"sample {i}: {len(v)} {name} for {r} response tokens")
    rows = layers = topk = dtype = rwire = 0
    if x.routing is None:
        rows = -1
    else:
        t = x.routing
        if not isinstance(t, torch.Tensor) or t.dtype not in _INT_DTYPES or t.dim() != 3:
            raise ValueError(f"sample {i}: routing must be an integer tensor [positions, layers, top_k], got "
                             f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}")
        rows, layers, topk = t.shape
        dtype = _INT_DTYPES.index(t.dtype)
        lo, hi = (int(v) for v in torch.aminmax(t)) if t.numel() else (0, 0)
        rwire = 0 if -1 <= lo and hi <= 254 else next(k for k in (1, 2, 3) if _fits(lo, hi, _ROUTING_WIRE[k]))
    return [p, r, owner, int(x.engine_logprobs is not None), int(x.token_mask is not None), rows, layers, topk,
            dtype, rwire, twire]


def encode_shares(samples: list[TrainSample], owners: list[int], dp: int
                  ) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
    """Rank 0: the header (int64 [n, len(HEADER)]) and each DP rank's share of the content, one
    uint8 buffer per DP rank holding its samples in list order (`decode_share` reads it back).
    The buffers are all as long as the longest share (the scatter's common size; `sizes` are the
    real ones)."""
    rows = [_header_row(x, o, i) for i, (x, o) in enumerate(zip(samples, owners))]
    nbytes = [_sample_bytes(row) for row in rows]
    sizes = [0] * dp
    for row, n in zip(rows, nbytes):
        sizes[row[2]] += n
    width = max(sizes, default=0)
    shares = [torch.empty(width, dtype=torch.uint8) for _ in range(dp)]
    offsets = [0] * dp
    for x, row in zip(samples, rows):
        buf, off = shares[row[2]], offsets[row[2]]
        for name, dt, n in _sections(row):
            end = off + _section_bytes(dt, n)
            buf[off + n * dt.itemsize: end].zero_()  # the alignment gap: no stale memory on the wire
            view = buf[off: off + n * dt.itemsize].view(dt)
            if name == "advantage":
                view[0] = float(x.advantage)
            elif name == "tokens":
                view.copy_(torch.as_tensor(x.prompt_ids + x.response_ids, dtype=dt))
            elif name == "logprobs":
                view.copy_(torch.as_tensor(x.engine_logprobs, dtype=torch.float32))
            elif name == "mask":
                view.copy_(torch.as_tensor(x.token_mask, dtype=torch.bool))
            else:  # integer conversion is modular: -1 becomes 255 in uint8
                view.view(x.routing.shape).copy_(x.routing)
            off = end
        offsets[row[2]] = off
    for d in range(dp):
        shares[d][sizes[d]:].zero_()  # padding up to the common size
    return torch.tensor(rows, dtype=torch.int64).view(len(rows), len(HEADER)), shares, sizes


def decode_share(header: torch.Tensor, share: torch.Tensor, dp_rank: int,
                 local: list[TrainSample] | None = None) -> list[TrainSample | RemoteSample]:
    """Every sample of the batch in header order: this DP rank's as TrainSamples read from its
    `share` (or, on rank 0, taken from `local`: the samples it encoded), every other one as a
    RemoteSample. Engine log-probs come back as float32 values (what collation uses), routing
    in the dtype the engine gave, -1 kept."""
    out: list[TrainSample | RemoteSample] = []
    off = 0
    for i, row in enumerate(header.tolist()):
        p, r, owner, _, _, routing_rows, layers, topk, dtype, rwire, _ = row
        if owner != dp_rank:
            out.append(RemoteSample(p, r, routing_rows >= 0))
            continue
        if local is not None:
            out.append(local[i])
            continue
        fields = {}
        for name, dt, n in _sections(row):
            fields[name] = share[off: off + n * dt.itemsize].view(dt)
            off += _section_bytes(dt, n)
        tokens = fields["tokens"].tolist()
        routing = None
        if "routing" in fields:
            wire = fields["routing"]
            routing = wire.to(_INT_DTYPES[dtype], copy=True).view(routing_rows, layers, topk)
            if rwire == 0:
                routing.view(-1).masked_fill_(wire == 255, -1)
        out.append(TrainSample(tokens[:p], tokens[p:], float(fields["advantage"][0]),
                               fields["logprobs"].tolist() if "logprobs" in fields else None, routing,
                               token_mask=fields["mask"].tolist() if "mask" in fields else None))
    if local is None and off != share.numel():
        raise RuntimeError(f"data plane: DP rank {dp_rank}'s share has {share.numel()} bytes, its header rows "
                           f"describe {off}")
    return out
