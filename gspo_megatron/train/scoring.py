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
    packed: bool = True,
    routed_experts: Sequence[torch.Tensor] | None = None,
) -> list[list[float]] | None:
    """Token log-probs for each sequence (len-1 floats each) on global rank 0; None elsewhere.
    Under context parallelism every CP rank scores its zigzag chunks of each sequence; rank 0
    puts them back in order by position. `routed_experts` (one int [len - 1, layers, top_k] per
    sequence) forces every MoE layer's experts (the models need RouterReplay: build_policy's
    routing_replay=True)."""
    multiple = pad_multiple(ctx.parallel)
    routes = routed_experts if routed_experts is not None else [None] * len(sequences)
    samples = [TrainSample(list(s[:1]), list(s[1:]), 0.0, routing=r) for s, r in zip(sequences, routes)]
    groups, mbs = plan_microbatches(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=micro_batch_tokens,
                                    multiple=multiple, cp=ctx.parallel.cp, cp_rank=ctx.cp_rank, packed=packed)
    routing = None
    if routed_experts is not None:
        from gspo_megatron.parallel.routing_replay import RoutingPass

        routing = RoutingPass(ctx, "rollout", int(routed_experts[0].shape[-1]))
    logprob_pass(models, ctx, mbs, vocab_size=vocab_size, temperature=temperature, routing=routing)
    return collect_logprobs(ctx, groups, mbs, sequences)


def logprob_pass(models, ctx, mbs, *, vocab_size: int, temperature: float = 1.0, routing=None) -> list[dict]:
    """One forward-only pass storing each microbatch's token log-probs as `old_logprobs` (last
    stage); `routing` (parallel/routing_replay.RoutingPass) controls the routers. Returns the
    schedule's reports."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in models:
        m.eval()
    try:
        with torch.no_grad():
            return get_forward_backward_func()(
                forward_step_func=fill_logprobs_step(ctx, vocab_size, temperature, "old_logprobs", routing=routing),
                data_iterator=iter(mbs), model=models, num_microbatches=len(mbs),
                seq_length=max(mb.seq_length for mb in mbs), micro_batch_size=mbs[0].micro_batch_size,
                forward_only=True,
            )
    finally:
        if routing is not None:
            routing.close(models)


def collect_logprobs(ctx, groups, mbs, sequences) -> list[list[float]] | None:
    """The `old_logprobs` of scored microbatches (plan_microbatches' groups) back in input order
    on global rank 0 (collective); None elsewhere."""
    local: dict[int, tuple[list[int], list[float]]] = {}
    if ctx.is_last_stage and ctx.tp_rank == 0:
        for g, mb in zip(groups, mbs):
            for row, idx in enumerate(g):
                m = mb.loss_mask[row].cpu()
                local[idx] = (mb.positions[row].cpu()[m].tolist(), mb.old_logprobs[row].cpu()[m].tolist())
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if ctx.rank != 0:
        return None
    merged: dict[int, dict[int, float]] = {}
    for part in gathered:
        for idx, (pos, lps) in part.items():
            merged.setdefault(idx, {}).update(zip(pos, lps))
    out = []
    for i, seq in enumerate(sequences):
        got = merged.get(i, {})
        if sorted(got) != list(range(len(seq) - 1)):
            raise RuntimeError(f"scoring lost positions of sequence {i} (internal error)")
        out.append([got[t] for t in range(len(seq) - 1)])
    return out
