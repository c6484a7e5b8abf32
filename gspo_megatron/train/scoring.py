"""Forward-only per-token log-probs through Megatron's schedules (scoring, reference/old log-probs).

Sequences are split across data-parallel ranks in contiguous blocks, right-padded into
microbatches (causal attention makes right padding harmless to earlier tokens), run through
`get_forward_backward_func()` (which handles pipeline stages), and the last stage turns its
vocab-sharded logits into token log-probs with vocab-parallel reductions: the full vocabulary is
never gathered. Results are collected on global rank 0 in input order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from gspo_megatron.parallel.logprobs import vocab_parallel_log_probs


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [b, s] int64, right-padded
    lengths: torch.Tensor  # [b] valid lengths (0 for filler rows)
    index: list[int]  # global sequence index per row (-1 for filler rows)


def pad_multiple(parallel) -> int:
    """Sequence length granularity: SP splits the sequence over TP, CP into 2*cp chunks."""
    m = parallel.tp if parallel.sequence_parallel else 1
    return m * (2 * parallel.cp if parallel.cp > 1 else 1)


def dp_shard(n: int, dp: int, dp_rank: int) -> range:
    per = -(-n // dp)
    return range(min(n, dp_rank * per), min(n, (dp_rank + 1) * per))


def make_microbatches(
    sequences: Sequence[Sequence[int]], indices: Sequence[int], micro_batch_size: int, n_micro: int, multiple: int
) -> list[MicroBatch]:
    """`n_micro` microbatches (filler rows/microbatches keep every rank's schedule the same length,
    which expert-parallel collectives across DP ranks require)."""
    out = []
    for m in range(n_micro):
        rows = list(range(m * micro_batch_size, min(len(indices), (m + 1) * micro_batch_size)))
        seqs = [sequences[indices[r]] for r in rows]
        longest = max([len(s) for s in seqs] + [1])
        s_len = -(-longest // multiple) * multiple
        tokens = torch.zeros(micro_batch_size, s_len, dtype=torch.long)
        lengths = torch.zeros(micro_batch_size, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            lengths[i] = len(s)
        idx = [indices[r] for r in rows] + [-1] * (micro_batch_size - len(rows))
        out.append(MicroBatch(tokens, lengths, idx))
    return out


def forward_logits_step(ctx, vocab_size: int, temperature: float = 1.0):
    """Megatron forward_step_func computing token log-probs on the last stage."""

    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator)
        tokens = mb.tokens.to(ctx.device)
        b, s = tokens.shape
        position_ids = torch.arange(s, device=ctx.device).unsqueeze(0).expand(b, s)
        output = model(tokens, position_ids, None)

        def loss_func(logits):  # logits: [b, s, V/tp] on the last stage
            targets = torch.roll(tokens, -1, dims=1)  # target of position t is token t+1
            # vocab_size excludes Megatron's padding rows, which HF's softmax never sees.
            lp = vocab_parallel_log_probs(
                logits, targets, group=ctx.tp_group, temperature=temperature, vocab_size=vocab_size
            )
            result = [lp[i, : max(int(mb.lengths[i]) - 1, 0)].detach().cpu() for i in range(b)]
            return torch.zeros((), device=ctx.device), {"logprobs": result, "index": mb.index}

        return output, loss_func

    return forward_step


def score_sequences(
    models: list[torch.nn.Module],
    ctx,
    sequences: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    micro_batch_size: int = 4,
    temperature: float = 1.0,
) -> list[list[float]] | None:
    """Token log-probs for each sequence (len-1 floats each) on global rank 0; None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    n = len(sequences)
    mine = list(dp_shard(n, ctx.dp, ctx.dp_rank))
    n_micro = max(1, -(-(-(-n // ctx.dp)) // micro_batch_size))
    mbs = make_microbatches(sequences, mine, micro_batch_size, n_micro, pad_multiple(ctx.parallel))
    for m in models:
        m.eval()
    fb = get_forward_backward_func()
    with torch.no_grad():
        store = fb(
            forward_step_func=forward_logits_step(ctx, vocab_size, temperature),
            data_iterator=iter(mbs),
            model=models,
            num_microbatches=len(mbs),
            seq_length=max(mb.tokens.shape[1] for mb in mbs),
            micro_batch_size=micro_batch_size,
            forward_only=True,
        )
    local: dict[int, list[float]] = {}
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0:
        for item in store:
            for idx, lp in zip(item["index"], item["logprobs"]):
                if idx >= 0:
                    local[idx] = lp.tolist()
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if ctx.rank != 0:
        return None
    merged: dict[int, list[float]] = {}
    for part in gathered:
        merged.update(part)
    missing = [i for i in range(n) if i not in merged]
    if missing:
        raise RuntimeError(f"scoring lost sequences {missing[:5]} (internal error)")
    return [merged[i] for i in range(n)]
