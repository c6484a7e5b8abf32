"""From samples to Megatron microbatches: minibatches, DP split balanced by tokens, token-budget
microbatches. Pure Python + torch; every rank computes the same plan from the same samples, so no
communication is needed to agree on it.

Layout of one training sequence (prompt p_0..p_{P-1}, response r_0..r_{R-1}):
    tokens    = p_0 .. p_{P-1} r_0 .. r_{R-1}
    position t predicts tokens[t+1]; loss_mask[t] = 1 for t in [P-1, P+R-2] (predicting r_j)
    old/engine log-probs live at the same positions.

Microbatches are right-padded [b, s] tensors. Packed THD batches need Transformer Engine's
attention; the portable CPU path uses padding, which is exact (causal attention, masked loss).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainSample:
    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    engine_logprobs: list[float] | None = None  # one per response token

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] long, right-padded
    loss_mask: torch.Tensor  # [b, s] bool, True where position t predicts a response token
    advantages: torch.Tensor  # [b] float32 (0 for filler rows)
    engine_logprobs: torch.Tensor  # [b, s] float32 (0 outside the mask)
    num_sequences: int  # rows with at least one loss token
    # Filled by forward-only passes before the update (on the last pipeline stage):
    old_logprobs: torch.Tensor | None = None  # [b, s]
    ref_logprobs: torch.Tensor | None = None  # [b, s]
    extras: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to_(self, device: torch.device) -> "MicroBatch":
        """Move every tensor field to `device` in place (the rank's device: these tensors meet
        the model's log-probs in the loss); returns self. No copy when already there."""
        for name in ("tokens", "loss_mask", "advantages", "engine_logprobs", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        return self


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


def pack_microbatches(lengths: list[int], indices: list[int], token_budget: int, multiple: int) -> list[list[int]]:
    """Group `indices` into microbatches whose padded size b * s stays within `token_budget`
    (a single longer sequence still gets its own microbatch)."""
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
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


def collate(samples: list[TrainSample], multiple: int, pad_id: int = 0, rows: int | None = None,
            s_len: int | None = None) -> MicroBatch:
    """Right-padded microbatch; `rows` > len(samples) adds filler rows (all-zero mask), `s_len`
    pads further to a given length."""
    rows = rows or max(1, len(samples))
    s_len = max(s_len or 0, _round_up(max([x.length for x in samples] + [2]), multiple))
    tokens = torch.full((rows, s_len), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, s_len, dtype=torch.bool)
    adv = torch.zeros(rows, dtype=torch.float32)
    eng = torch.zeros(rows, s_len, dtype=torch.float32)
    for i, x in enumerate(samples):
        p, r = len(x.prompt_ids), len(x.response_ids)
        tokens[i, : p + r] = torch.as_tensor(x.prompt_ids + x.response_ids, dtype=torch.long)
        if r:
            mask[i, p - 1 : p + r - 1] = True
            if x.engine_logprobs is not None:
                eng[i, p - 1 : p + r - 1] = torch.as_tensor(x.engine_logprobs, dtype=torch.float32)
        adv[i] = x.advantage
    n = int(mask.any(dim=1).sum())
    return MicroBatch(tokens, mask, adv, eng, n)


def plan_microbatches(
    samples: list[TrainSample], *, dp: int, dp_rank: int, token_budget: int, multiple: int, pad_id: int = 0
) -> tuple[list[list[int]], list[MicroBatch]]:
    """Sample indices and collated microbatches of this DP rank.

    Every DP rank gets the same number of microbatches, and the k-th microbatch has the same
    [b, s] shape on every DP rank (filler rows / microbatches with an empty mask): expert-parallel
    collectives span DP ranks, need every rank in each forward pass, and Megatron's allgather
    dispatcher (used for expert-TP > 1) needs equal token counts across them.
    """
    lengths = [x.length for x in samples]
    plans = [pack_microbatches(lengths, s, token_budget, multiple) for s in balance_dp(lengths, dp)]
    n_micro = max(1, max(len(p) for p in plans))
    plans = [p + [[] for _ in range(n_micro - len(p))] for p in plans]
    mbs = []
    for k, group in enumerate(plans[dp_rank]):
        rows = max(1, max(len(p[k]) for p in plans))
        s_len = max(_round_up(max([lengths[i] for i in p[k]] + [2]), multiple) for p in plans)
        mbs.append(collate([samples[i] for i in group], multiple, pad_id, rows=rows, s_len=s_len))
    return plans[dp_rank], mbs


def plan_minibatch(
    samples: list[TrainSample], *, dp: int, dp_rank: int, token_budget: int, multiple: int, pad_id: int = 0
) -> tuple[list[MicroBatch], int]:
    """This DP rank's microbatches for one minibatch, and the minibatch's global sequence count."""
    _, mbs = plan_microbatches(samples, dp=dp, dp_rank=dp_rank, token_budget=token_budget, multiple=multiple,
                               pad_id=pad_id)
    global_sequences = sum(1 for x in samples if x.response_ids)
    return mbs, global_sequences
