"""Forward-only per-token log-probs through Megatron's schedules (scoring, evaluation).

A sequence is scored as a training sample whose "prompt" is its first token: the loss mask then
covers exactly the positions 0..len-2, whose log-probs are log p(token t+1 | tokens <= t). The same
planning (DP split balanced by tokens, token-budget microbatches, equal microbatch counts on every
DP rank) and the same forward step as the trainer's π_old pass are used; the last stage turns its
vocab-sharded logits into log-probs with vocab-parallel reductions (the full vocabulary is never
gathered). Results are collected on global rank 0 in input order.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from gspo_megatron.train.batch import TrainSample, plan_microbatches
from gspo_megatron.train.loss import fill_logprobs_step


def pad_multiple(parallel) -> int:
    """Sequence length granularity: SP splits the sequence over TP, CP into 2*cp chunks."""
    m = parallel.tp if parallel.sequence_parallel else 1
    return m * (2 * parallel.cp if parallel.cp > 1 else 1)


def score_sequences(
    models: list[torch.nn.Module],
    ctx,
    sequences: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    micro_batch_tokens: int = 4096,
    temperature: float = 1.0,
) -> list[list[float]] | None:
    """Token log-probs for each sequence (len-1 floats each) on global rank 0; None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    multiple = pad_multiple(ctx.parallel)
    samples = [TrainSample(list(s[:1]), list(s[1:]), 0.0) for s in sequences]
    groups, mbs = plan_microbatches(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=micro_batch_tokens,
                                    multiple=multiple)
    for m in models:
        m.eval()
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=fill_logprobs_step(ctx, vocab_size, temperature, "old_logprobs"),
            data_iterator=iter(mbs), model=models, num_microbatches=len(mbs),
            seq_length=max(mb.tokens.shape[1] for mb in mbs), micro_batch_size=mbs[0].tokens.shape[0],
            forward_only=True,
        )
    local: dict[int, list[float]] = {}
    if ctx.is_last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0:
        for g, mb in zip(groups, mbs):
            for row, idx in enumerate(g):
                local[idx] = mb.old_logprobs[row][mb.loss_mask[row]].tolist()
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if ctx.rank != 0:
        return None
    merged: dict[int, list[float]] = {}
    for part in gathered:
        merged.update(part)
    missing = [i for i in range(len(sequences)) if i not in merged]
    if missing:
        raise RuntimeError(f"scoring lost sequences {missing[:5]} (internal error)")
    return [merged[i] for i in range(len(sequences))]
