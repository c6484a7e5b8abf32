"""Megatron forward_step / loss_func pairs for `get_forward_backward_func()`.

Normalisation (why the gradient equals the single-process full-batch gradient for any layout and
microbatch count): the model is wrapped with `calculate_per_token_loss=True` (parallel/ddp.py), so
Megatron neither divides a loss by the number of microbatches nor averages gradients over DP/CP;
it sums them and finally divides every gradient by the global sum of the counts our loss
functions return. Each loss function returns the SUM of its per-sequence losses and, as count,
its number of non-empty sequences — reported on CP rank 0 only, because Megatron all-reduces the
count over the DP x CP group and every CP rank holds the same sequences. The result is exactly
mean over the minibatch's sequences of the per-sequence loss (GSPO's aggregation), i.e. the
paper's objective, whatever the DP/CP/PP/TP/EP split or microbatching.

CISPO aggregates per token instead (MiniMax-M1: the minibatch's token sum over its token count):
its loss function returns the sum of its tokens' losses and, as count, its loss tokens on every
CP rank (each holds its own tokens), so the same division yields the minibatch's token mean. The
reports carry `loss_norm` (sequences, or tokens for CISPO) for the logged loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gspo_megatron.algorithms import gspo_loss_from_stats, gspo_sequence_stats, gspo_token_loss, grpo_loss
from gspo_megatron.algorithms.cispo import cispo_loss
from gspo_megatron.algorithms.mismatch import (icepop_keep, mismatch_report, mismatch_row_sums,
                                               sequence_mismatch_keep)
from gspo_megatron.parallel.fused_head import head_weight
from gspo_megatron.parallel.logprobs import fused_vocab_parallel_log_probs, vocab_parallel_log_probs
from gspo_megatron.parallel.seq_reduce import cp_all_reduce_sum, cp_all_reduce_sum_many
from gspo_megatron.train.batch import MicroBatch

# Metrics summed over microbatches/ranks, each weighted by the microbatch's count of sequences in
# the loss ("metric_weight": all of them unless loss.mis masks some), then divided by the total.
WEIGHTED_METRICS = ("clip_frac", "ratio_mean", "approx_kl", "entropy", "kl_ref", "tis_weight_mean")


@dataclass(frozen=True)
class LossSettings:
    type: str
    eps_low: float
    eps_high: float
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    tis_cap: float | None = None
    temperature: float = 1.0  # the rollout's sampling temperature: π_θ is the tempered policy
    mis: tuple[float, float] | None = None  # sequence-level mismatch band (algorithms/mismatch.py)
    icepop: tuple[float, float] | None = None  # token-level band on π_old / π_engine (algorithms/mismatch.py)
    cispo_eps: tuple[float, float] = (1.0, 0.28)  # loss.cispo_eps_low / _high (algorithms/cispo.py)


def _gspo(lp, mb: MicroBatch, stats, s: LossSettings, entropy):
    return gspo_loss_from_stats(
        advantages=mb.advantages, eps_low=s.eps_low, eps_high=s.eps_high, num_sequences=1,
        kl_coef=s.kl_coef, entropy_coef=s.entropy_coef, tis_cap=s.tis_cap, **stats.fields(),
    )


def _token_options(mb: MicroBatch, stats, s: LossSettings, entropy) -> dict:
    opts = dict(num_sequences=1, token_count=stats.token_count, entropy=entropy, entropy_coef=s.entropy_coef)
    if mb.ref_logprobs is not None:
        opts.update(ref_log_probs=mb.ref_logprobs, kl_coef=s.kl_coef)
    if s.tis_cap is not None:
        opts.update(engine_log_probs=mb.engine_logprobs, tis_cap=s.tis_cap)
    return opts


def _gspo_token(lp, mb: MicroBatch, stats, s: LossSettings, entropy):
    opts = _token_options(mb, stats, s, entropy)
    opts.update(logratio_sum=stats.logratio_sum.detach())
    if s.tis_cap is not None:
        opts.update(tis_logratio_sum=stats.tis_logratio_sum)
    return gspo_token_loss(lp, mb.old_logprobs, mb.advantages, mb.loss_mask, eps_low=s.eps_low,
                           eps_high=s.eps_high, **opts)


def _grpo(lp, mb: MicroBatch, stats, s: LossSettings, entropy):
    return grpo_loss(lp, mb.old_logprobs, mb.advantages, mb.loss_mask, eps_low=s.eps_low, eps_high=s.eps_high,
                     **_token_options(mb, stats, s, entropy))


def _cispo(lp, mb: MicroBatch, stats, s: LossSettings, entropy):
    opts = _token_options(mb, stats, s, entropy)
    del opts["num_sequences"]  # a token sum: Megatron divides by the loss tokens (the count below)
    return cispo_loss(lp, mb.old_logprobs, mb.advantages, mb.loss_mask, eps_low=s.cispo_eps[0],
                      eps_high=s.cispo_eps[1], num_tokens=1, **opts)


LOSSES: dict[str, Callable] = {"gspo": _gspo, "gspo_token": _gspo_token, "grpo": _grpo, "cispo": _cispo}


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    b, s = tokens.shape
    return torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)


def forward_model(ctx, model, mb: MicroBatch):
    """The model's forward on a microbatch: padded [b, s], or packed THD with PackedSeqParams
    (the position ids are unused: RoPE positions come from the sequence, or from cu_seqlens)."""
    params = mb.packed_seq_params(ctx.cp_group)
    if params is None:
        return model(mb.tokens, _positions(mb.tokens), None)
    return model(mb.tokens, _positions(mb.tokens), None, packed_seq_params=params)


def token_logprobs(ctx, model, output, targets, vocab_size: int, temperature: float = 1.0,
                   entropy: bool = False):
    """log p(targets | prefix) in the model input's layout (and entropy) from the last stage's
    output: the logits shard, or the final hidden states when the model has the hidden head
    (model.fused_logprobs). `targets` are built on the full sequence (train/batch.py), so they
    are right under context parallelism, where a rank's next position is often another rank's."""
    kw = dict(group=ctx.tp_group, temperature=temperature, vocab_size=vocab_size, return_entropy=entropy)
    weight = head_weight(model)
    if weight is None:
        return vocab_parallel_log_probs(output, targets, **kw)
    return fused_vocab_parallel_log_probs(output, weight, targets, **kw)


def _forward(ctx, model, mb: MicroBatch, routing):
    """The model's forward with the routers under `routing`'s control (parallel/routing_replay.py)."""
    if routing is not None:
        routing.before(mb, model)
    output = forward_model(ctx, model, mb)
    if routing is not None:
        routing.after(mb, model)
    return output


def policy_loss_step(ctx, vocab_size: int, settings: LossSettings, routing=None):
    """forward_step for one GSPO/GRPO update over MicroBatches carrying old (and ref) log-probs.

    The sequence statistics (log-ratio sums, token counts, ...) are per row of this rank's
    positions; under CP they are summed over the CP group (two scalars per sequence), so every
    CP rank computes the same per-sequence loss and back-propagates through its own tokens; the
    sequence count is reported by CP rank 0 only (Megatron sums counts over DP x CP)."""
    loss_impl = LOSSES[settings.type]

    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator).to_(ctx.device)
        output = _forward(ctx, model, mb, routing)

        def loss_func(output):
            lp, ent = token_logprobs(ctx, model, output, mb.targets, vocab_size, settings.temperature, entropy=True)
            lp, ent = mb.to_rows(lp), mb.to_rows(ent)
            ent = ent if settings.entropy_coef else ent.detach()
            pi_old_report = {}
            if mb.extras.get(PI_OLD_IS_CURRENT):
                # the forward-only π_old pass would compute exactly these numbers (same weights,
                # same microbatch, no dropout): take them and skip that forward
                mb.old_logprobs = lp.detach().float()
                pi_old_report = _engine_mismatch(ctx, mb, mb.old_logprobs)
            batch, masked, ice = mb, None, None
            if settings.mis is not None:
                batch, masked = _mask_mismatched(ctx, mb, settings.mis)
            if settings.icepop is not None:
                batch, ice = _icepop(ctx, batch, settings.icepop)
            stats = gspo_sequence_stats(
                lp, batch.old_logprobs, batch.loss_mask, ref_log_probs=batch.ref_logprobs, entropy=ent,
                engine_log_probs=batch.engine_logprobs if settings.tis_cap is not None else None,
            )
            if ctx.parallel.cp > 1:
                stats = stats.reduce(lambda t: cp_all_reduce_sum(t, ctx.cp_group))
            loss, metrics = loss_impl(lp, batch, stats, settings, ent)
            reported = loss.detach()
            if ctx.parallel.cp > 1 and settings.type != "gspo":
                reported, metrics = _cp_token_loss_report(ctx, settings.type, reported, metrics, batch.loss_mask)
            n = mb.num_sequences
            # metrics are means over the sequences in the loss: weighted by their number
            w = n - masked if masked is not None else torch.tensor(float(n), device=ctx.device)
            report = {k: metrics[k].detach() * w for k in WEIGHTED_METRICS if k in metrics}
            report["metric_weight"] = w
            if masked is not None:
                report["mis_masked"] = masked
            if ice is not None:
                report["icepop_masked"], report["icepop_tokens"] = ice[0], ice[1]
            report.update(pi_old_report)
            report["loss"] = reported
            report["sequences"] = torch.tensor(float(n), device=ctx.device)
            if settings.type == "cispo":  # token-level: every CP rank counts its own loss tokens
                report["loss_norm"] = metrics["tokens"]  # CP-summed by _cp_token_loss_report
                count = batch.loss_mask.sum().to(torch.int)
            else:
                report["loss_norm"] = report["sequences"]
                count = torch.tensor(n if ctx.cp_rank == 0 else 0, dtype=torch.int, device=ctx.device)
            return loss, count, report

        return output, loss_func

    return forward_step


# Token-level losses under CP: each CP rank's loss and metrics cover its own tokens only (the
# gradient is right: every rank back-propagates its share). For the report, the per-sequence
# token-mean terms (the loss, entropy, kl_ref) are partial sums over the same global token counts,
# so they add up over CP; the token fractions/means of `TOKEN_MEANS` combine weighted by each
# rank's token count. Sequence-level metrics (from the CP-reduced stats) are already whole.
TOKEN_MEANS = {"grpo": ("clip_frac", "ratio_mean", "approx_kl", "tis_weight_mean"), "gspo_token": ("clip_frac",),
               "cispo": ("clip_frac", "ratio_mean", "approx_kl", "tis_weight_mean", "is_weight_mean")}
CP_SUMMED = ("entropy", "kl_ref")


def _cp_token_loss_report(ctx, loss_type: str, loss: torch.Tensor, metrics: dict, loss_mask: torch.Tensor):
    import torch.distributed as dist

    summed = [k for k in CP_SUMMED if k in metrics]
    means = [k for k in TOKEN_MEANS[loss_type] if k in metrics]
    tokens = loss_mask.sum().to(torch.float64)
    vec = torch.stack([loss.to(torch.float64)] + [metrics[k].detach().to(torch.float64) for k in summed]
                      + [metrics[k].detach().to(torch.float64) * tokens for k in means] + [tokens])
    dist.all_reduce(vec, group=ctx.cp_group)
    out = dict(metrics)
    for i, k in enumerate(summed):
        out[k] = vec[1 + i]
    for i, k in enumerate(means):
        out[k] = vec[1 + len(summed) + i] / vec[-1].clamp(min=1)
    out["tokens"] = vec[-1]  # the loss tokens of every CP rank
    return vec[0].to(loss.dtype), out


def _mask_mismatched(ctx, mb: MicroBatch, band):
    """`mb` with the sequences outside the mismatch band taken out of the loss (loss mask and
    advantage zeroed: every term of theirs vanishes, for every loss type), and how many there
    were. The band applies to the whole sequence's mean log π_old - log π_engine, so under CP the
    two per-sequence sums are reduced first (every CP rank then drops the same sequences)."""
    import dataclasses

    mask = mb.loss_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    d_sum = torch.where(mask, mb.old_logprobs.float() - mb.engine_logprobs.float(), zero).sum(-1)
    count = mask.sum(-1).float()
    if ctx.parallel.cp > 1:
        d_sum, count = cp_all_reduce_sum_many([d_sum, count], ctx.cp_group)
    keep = sequence_mismatch_keep(d_sum, count, band[0], band[1])
    masked = (~keep & (count > 0)).sum().float()
    return dataclasses.replace(mb, loss_mask=mb.loss_mask & keep[:, None],
                               advantages=torch.where(keep, mb.advantages, torch.zeros_like(mb.advantages))), masked


def _icepop(ctx, mb: MicroBatch, band):
    """`mb` with IcePop's token mask (loss.icepop): loss tokens whose π_old / π_engine lies outside
    [alpha, beta] leave the loss (algorithms/mismatch.py icepop_keep), and float64 [masked, loss
    tokens before the mask], summed over the CP group (a token-level decision: each CP rank masks
    its own tokens; the sums make the reporter's counts whole)."""
    import dataclasses

    mask = mb.loss_mask.bool()
    keep = icepop_keep(mb.old_logprobs, mb.engine_logprobs, mask, band[0], band[1])
    counts = torch.stack([(mask & ~keep).sum(), mask.sum()]).to(torch.float64)
    if ctx.parallel.cp > 1:
        import torch.distributed as dist

        dist.all_reduce(counts, group=ctx.cp_group)
    return dataclasses.replace(mb, loss_mask=mb.loss_mask & keep), counts


def fill_logprobs_step(ctx, vocab_size: int, temperature: float, attr: str, *, compare_engine: bool = False,
                       routing=None):
    """Forward-only step storing token log-probs (rows layout) on each MicroBatch as `attr`
    (last stage). With compare_engine, each microbatch also reports the train-inference mismatch
    of these log-probs against the engine's (algorithms/mismatch.py): sums for reduce_report and
    maxima for reduce_max, CP-reduced so the CP-rank-0 reporter holds whole sequences'. `routing`
    (a parallel/routing_replay.RoutingPass) records or replays the routers' experts."""

    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator).to_(ctx.device)
        output = _forward(ctx, model, mb, routing)

        def loss_func(output):
            lp = token_logprobs(ctx, model, output, mb.targets, vocab_size, temperature)
            rows = mb.to_rows(lp.detach().float())
            setattr(mb, attr, rows)
            report = _engine_mismatch(ctx, mb, rows) if compare_engine else {}
            return torch.zeros((), device=ctx.device), report

        return output, loss_func

    return forward_step


def _engine_mismatch(ctx, mb: MicroBatch, rows: torch.Tensor) -> dict:
    """The microbatch's train-inference mismatch report for π_old log-probs `rows` (rows layout)
    against the engine's; under CP the per-sequence sums are reduced over the CP group."""
    sums = mismatch_row_sums(rows, mb.engine_logprobs, mb.loss_mask)
    if ctx.parallel.cp > 1:
        import torch.distributed as dist

        part, top = sums[:, :4].contiguous(), sums[:, 4].contiguous()
        dist.all_reduce(part, group=ctx.cp_group)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ctx.cp_group)
        sums = torch.cat([part, top[:, None]], -1)
    return mismatch_report(sums)


# MicroBatch.extras key: this microbatch's π_old is the policy of this very forward (the step's
# first minibatch, before any update: loop.gspo_step), so the loss takes it from here
PI_OLD_IS_CURRENT = "pi_old_is_current"


def sft_loss_step(ctx, vocab_size: int):
    """Supervised warm start: token NLL on the loss mask; count = tokens (per-token mean). Under
    CP each rank counts its own tokens (Megatron sums the counts over DP x CP); the reported sums
    are CP-reduced so the CP-rank-0 reporter has the whole sequences'."""

    def forward_step(data_iterator, model):
        mb: MicroBatch = next(data_iterator).to_(ctx.device)
        output = forward_model(ctx, model, mb)

        def loss_func(output):
            lp = mb.to_rows(token_logprobs(ctx, model, output, mb.targets, vocab_size))
            mask = mb.loss_mask
            nll = -(lp * mask).sum()
            n = int(mask.sum())
            count = torch.tensor(n, dtype=torch.int, device=ctx.device)
            sums = torch.stack([nll.detach(), torch.tensor(float(n), device=ctx.device, dtype=nll.dtype)])
            if ctx.parallel.cp > 1:
                import torch.distributed as dist

                sums = sums.clone()
                dist.all_reduce(sums, group=ctx.cp_group)
            return nll, count, {"nll_sum": sums[0], "tokens": sums[1]}

        return output, loss_func

    return forward_step
