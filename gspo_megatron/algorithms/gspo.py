"""GSPO (sequence-level importance ratio) and GSPO-token losses.

Notation: B sequences (responses), T token positions, ``loss_mask[i, t]`` true on the response
tokens that are trained on, ``|y_i| = sum_t loss_mask[i, t]``.

GSPO (Zheng et al., 2025, eq. 5-7)::

    log s_i = (1/|y_i|) sum_t mask * (log pi_theta(y_i,t) - log pi_old(y_i,t))
    s_i     = exp(log s_i)
    J       = mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i),   loss = -J

The gradient flows through the whole length-normalised sum (the paper's GSPO, not a stop-gradient
variant). ``pi_old`` is whatever the caller passes as ``old_log_probs``: a forward-only pass of the
trainer before the first update, or the rollout engine's own log-probs (paper section 5.4 trains
directly on the inference engine's likelihoods) - then simply pass the engine's log-probs as
``old_log_probs``.

Where this code departs from the paper, and why:

* The sequence log-ratio is clamped to +-:data:`MAX_LOG_RATIO` before ``exp`` (float32 overflow
  guard; zero gradient beyond, only for sequences far outside any clip range).
* A sequence whose mask is all zero (nothing to train on: e.g. a response cut to nothing)
  contributes zero loss and zero gradient and is **excluded from the mean's denominator**: by
  default the loss is divided by the number of sequences with at least one loss token. The paper
  has no such sequences. (Zero-*advantage* sequences, e.g. groups with equal rewards, are
  ordinary sequences and do count.)
* ``num_sequences`` replaces that denominator by a caller-given global count, so the loss can be
  split over micro-batches and data-parallel ranks (see "Distributed use" below).
* Options the paper does not use, all off by default: a k3 KL penalty to a reference policy,
  an entropy metric / bonus, and truncated importance sampling (TIS) for the mismatch between
  the rollout engine and the trainer.

Distributed use (what the trainer's Megatron ``loss_func`` does)::

    stats = gspo_sequence_stats(logp, old, mask, sum_fn=...)   # local partial sums, [S] each
    stats = stats.reduce(lambda t: cp_all_reduce_sum(t, cp_group))   # ONE collective over CP
    loss, metrics = gspo_loss_from_stats(advantages=adv, num_sequences=N_global, **stats.fields())

* ``sum_fn`` turns a masked per-token tensor into per-sequence sums: the default sums the last
  dim of ``[B, T]``; for a THD micro-batch use
  ``functools.partial(packed_sequence_sum, cu_seqlens=cu_seqlens_local_padded)``.
* After the CP reduction every CP rank holds the same global sums and returns the same (full)
  micro-batch loss; the backward of the reduction is the identity, so the parameter gradient of
  the loss is the SUM of the CP ranks' local gradients (see ``parallel.seq_reduce``).
* ``N_global`` = number of sequences with at least one loss token in the whole *minibatch* (all
  micro-batches, all DP ranks) - one optimizer step. Then summing the micro-batch losses and
  summing the gradients over DP (and CP) ranks gives exactly the gradient of the full-batch mean.
  Megatron-Core 0.16 does not simply sum; two exact recipes:

  - 2-tuple ``loss_func`` return (default ``calculate_per_token_loss=False``): the schedule
    multiplies the loss by cp and divides it by the number of micro-batches M, the DDP scales
    the gradients by 1/(dp*cp) before summing: a net 1/(M*dp). Pass
    ``num_sequences = N_global / (M * dp)``.
  - 3-tuple ``(loss, count, report)`` with ``calculate_per_token_loss=True``: nothing is scaled
    except a final division by the sum of ``count`` over micro-batches and the dp*cp group.
    Pass ``num_sequences=1`` (a plain sum) and let ``count`` be this rank's non-empty sequences
    on CP rank 0 and 0 on the other CP ranks (they hold the same sequences; counting them on
    every CP rank would divide by cp too much).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Callable

import torch

from .common import (
    GSPO_OPTIONS,
    GSPO_TOKEN_OPTIONS,
    MAX_LOG_RATIO,
    LossOptions,
    check_bt,
    check_eps,
    clip_fraction,
    float_dtype,
    k3,
    masked,
    normaliser,
    ratio_metrics,
    tis_weight_from_log,
    token_inputs,
    token_loss_metrics,
    token_loss_with_penalties,
    vmean,
)

__all__ = [
    "SequenceStats",
    "gspo_sequence_stats",
    "gspo_loss_from_stats",
    "gspo_loss",
    "gspo_token_loss",
]

SumFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SequenceStats:
    """Per-sequence sums [S] that are additive over the tokens, hence over CP ranks.

    ``logratio_sum``   sum_t mask * (log pi - log pi_old)           differentiable
    ``token_count``    sum_t mask                                   constant
    ``kl_sum``         sum_t mask * k3(log ref - log pi)            differentiable, optional
    ``entropy_sum``    sum_t mask * H_t                             as ``entropy``, optional
    ``tis_logratio_sum`` sum_t mask * (log pi_old - log pi_engine)  detached, optional
    """

    logratio_sum: torch.Tensor
    token_count: torch.Tensor
    kl_sum: torch.Tensor | None = None
    entropy_sum: torch.Tensor | None = None
    tis_logratio_sum: torch.Tensor | None = None

    def fields(self) -> dict[str, torch.Tensor]:
        """The present fields by name (keyword arguments of :func:`gspo_loss_from_stats`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def reduce(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "SequenceStats":
        """Apply ``fn`` (e.g. a CP all-reduce) once to all present fields stacked as [S, K]."""
        present = self.fields()
        names = list(present)
        stacked = torch.stack([present[n] for n in names], dim=-1)
        out = fn(stacked)
        return SequenceStats(**dict(zip(names, out.unbind(-1))))


def _default_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=-1)


def gspo_sequence_stats(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    engine_log_probs: torch.Tensor | None = None,
    sum_fn: SumFn | None = None,
) -> SequenceStats:
    """Per-sequence partial sums for GSPO from this rank's tokens.

    Args:
        log_probs: [B, T] (or any token layout ``sum_fn`` understands, e.g. THD [1, total])
            log pi_theta of the sampled tokens; the only input that carries gradient.
        old_log_probs: same shape, log pi_old (detached).
        loss_mask: same shape, bool; positions outside it may hold anything, even inf/NaN.
        ref_log_probs / entropy / engine_log_probs: optional, same shape (see
            :func:`gspo_loss`).
        sum_fn: per-token tensor -> [S] per-sequence sums; default ``x.sum(-1)``.

    Returns:
        :class:`SequenceStats` with [S] tensors in float32 (float64 if the inputs are float64).
    """
    shape = log_probs.shape
    for name, t in (("old_log_probs", old_log_probs), ("loss_mask", loss_mask),
                    ("ref_log_probs", ref_log_probs), ("entropy", entropy),
                    ("engine_log_probs", engine_log_probs)):
        check_bt(name, t, shape)
    sum_fn = sum_fn or _default_sum
    dtype = float_dtype(log_probs)
    mask = loss_mask.bool()
    lp = masked(log_probs.to(dtype), mask)
    old = masked(old_log_probs.detach().to(dtype), mask)
    stats = SequenceStats(logratio_sum=sum_fn(masked(lp - old, mask)), token_count=sum_fn(mask.to(dtype)))
    if ref_log_probs is not None:
        ref = masked(ref_log_probs.detach().to(dtype), mask)
        stats.kl_sum = sum_fn(masked(k3(ref - lp), mask))
    if entropy is not None:
        stats.entropy_sum = sum_fn(masked(entropy.to(dtype), mask))
    if engine_log_probs is not None:
        eng = masked(engine_log_probs.detach().to(dtype), mask)
        stats.tis_logratio_sum = sum_fn(masked(old - eng, mask)).detach()
    return stats


def gspo_loss_from_stats(
    logratio_sum: torch.Tensor,
    token_count: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    num_sequences=None,
    kl_sum: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_sum: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    tis_logratio_sum: torch.Tensor | None = None,
    tis_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss from (globally reduced) per-sequence sums.

    Args:
        logratio_sum, token_count, kl_sum, entropy_sum, tis_logratio_sum: [S] sums over *all*
            tokens of each sequence (reduce over CP first); see :class:`SequenceStats`.
        advantages: [S] sequence advantages (detached).
        eps_low, eps_high: clip range ``[1 - eps_low, 1 + eps_high]`` on s_i (paper: 3e-4 / 4e-4).
        num_sequences: denominator; default: number of sequences with token_count > 0.
        kl_coef: weight of the mean per-token k3 KL to the reference (needs ``kl_sum``).
        entropy_coef: entropy bonus weight (needs ``entropy_sum``); the loss decreases with
            entropy.
        tis_cap: truncated importance sampling; the policy-gradient term of sequence i is
            multiplied by ``min(exp(tis_logratio_sum_i / |y_i|), tis_cap)`` (detached): the
            geometric mean over tokens of pi_old / pi_engine, capped. Per-token means - never
            exp of the raw sum, which collapses on long sequences. The KL/entropy terms are not
            reweighted.

    Per-sequence loss ``l_i = -w_i * min(s_i A_i, clip(s_i) A_i) + kl_coef * KL_i
    - entropy_coef * H_i`` (``KL_i``, ``H_i`` token means), zero for empty sequences;
    ``loss = sum_i l_i / num_sequences``.

    Returns:
        (loss 0-dim, metrics): detached 0-dim tensors, means over the non-empty sequences of this
        call: ``clip_frac`` (fraction clipped on the side that zeroes the gradient: A>0 and
        s>1+eps_high, or A<0 and s<1-eps_low), ``ratio_mean``/``ratio_min``/``ratio_max`` (of
        s_i), ``approx_kl`` (k3 of the sequence log-ratio: s - 1 - log s, a per-token-scale
        estimate of KL(pi_old || pi_theta)), ``pg_loss`` (policy-gradient part of the loss,
        same normalisation), ``sequences`` (count of non-empty sequences, for weighting when
        aggregating), and when enabled ``kl_ref``, ``entropy``, ``tis_weight_mean``,
        ``tis_clip_frac``.
    """
    check_eps(eps_low, eps_high)
    if kl_coef and kl_sum is None:
        raise ValueError(f"gspo_loss_from_stats: kl_coef={kl_coef} needs kl_sum (ref_log_probs)")
    if entropy_coef and entropy_sum is None:
        raise ValueError(f"gspo_loss_from_stats: entropy_coef={entropy_coef} needs entropy_sum")
    if tis_cap is not None and (tis_logratio_sum is None or not tis_cap > 0):
        raise ValueError("gspo_loss_from_stats: tis_cap must be > 0 and needs tis_logratio_sum")
    if logratio_sum.dim() != 1:
        raise ValueError(f"logratio_sum must be [S], got {tuple(logratio_sum.shape)}")
    check_bt("token_count", token_count, logratio_sum.shape)
    check_bt("advantages", advantages, logratio_sum.shape)
    dtype = float_dtype(logratio_sum)
    count = token_count.detach().to(dtype)
    valid = count > 0
    n = count.clamp_min(1.0)
    adv = advantages.detach().to(dtype)

    log_s = (logratio_sum.to(dtype) / n).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    s = torch.exp(log_s)
    surrogate = torch.minimum(s * adv, s.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    pg = -surrogate
    w = None
    if tis_cap is not None:
        w = tis_weight_from_log(tis_logratio_sum.to(dtype) / n, tis_cap)
        pg = pg * w
    per_seq = pg
    kl_seq = ent_seq = None
    if kl_sum is not None:
        kl_seq = kl_sum.to(dtype) / n
        if kl_coef:
            per_seq = per_seq + kl_coef * kl_seq
    if entropy_sum is not None:
        ent_seq = entropy_sum.to(dtype) / n
        if entropy_coef:
            per_seq = per_seq - entropy_coef * ent_seq
    denom = normaliser(num_sequences, valid, dtype)
    loss = masked(per_seq, valid).sum() / denom

    with torch.no_grad():
        s_d, log_s_d = s.detach(), log_s.detach()
        metrics = {
            "clip_frac": clip_fraction(s_d, adv, valid, eps_low, eps_high),
            **ratio_metrics(s_d, log_s_d, valid),
            "pg_loss": masked(pg.detach(), valid).sum() / denom,
            "sequences": valid.sum().to(dtype),
        }
        if kl_seq is not None:
            metrics["kl_ref"] = vmean(kl_seq.detach(), valid)
        if ent_seq is not None:
            metrics["entropy"] = vmean(ent_seq.detach(), valid)
        if tis_logratio_sum is not None:
            tis_mean = tis_logratio_sum.detach().to(dtype) / n
            metrics["engine_log_ratio"] = vmean(tis_mean, valid)
        if w is not None:
            metrics["tis_weight_mean"] = vmean(w, valid)
            metrics["tis_clip_frac"] = vmean(tis_mean >= math.log(tis_cap), valid)
    return loss, metrics


def gspo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO loss over a padded batch (single process, or one micro-batch without CP).

    Args:
        log_probs: [B, T] float, log pi_theta(y_i,t) (carries the gradient).
        old_log_probs: [B, T] log pi_old - the trainer's own forward-only pass, or the rollout
            engine's log-probs (paper section 5.4) passed here directly.
        advantages: [B] sequence advantages, e.g. :func:`group_advantages`.
        loss_mask: [B, T] bool, the response tokens to train on.
        eps_low, eps_high: sequence-ratio clip range (paper 3e-4 / 4e-4 - not PPO's 0.2).

    Options (keyword, off by default):
        ref_log_probs [B, T] and kl_coef: k3 KL penalty to a reference policy (per-token k3,
            token mean per sequence). ``ref_log_probs`` alone only reports ``kl_ref``;
            ``kl_coef`` without it raises.
        entropy [B, T] and entropy_coef: entropy metric / bonus (``entropy`` from
            ``parallel.logprobs`` with ``return_entropy=True``; differentiable).
        engine_log_probs [B, T] and tis_cap: truncated importance sampling for the
            inference/training mismatch, sequence-level (see :func:`gspo_loss_from_stats`).
            ``engine_log_probs`` alone only reports ``engine_log_ratio`` (mean per-token
            log pi_old - log pi_engine), a mismatch indicator.
        num_sequences: global denominator for micro-batch / DP splitting (default: non-empty
            sequences here).

    Returns:
        (loss, metrics) - see :func:`gspo_loss_from_stats`. Implemented as
        ``gspo_loss_from_stats(**gspo_sequence_stats(...).fields())``.
    """
    opts = LossOptions.parse(options, GSPO_OPTIONS, "gspo_loss")
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got {tuple(log_probs.shape)}")
    check_bt("advantages", advantages, log_probs.shape[:1])
    stats = gspo_sequence_stats(
        log_probs, old_log_probs, loss_mask, ref_log_probs=opts.ref_log_probs, entropy=opts.entropy,
        engine_log_probs=opts.engine_log_probs,
    )
    return gspo_loss_from_stats(
        advantages=advantages, eps_low=eps_low, eps_high=eps_high, num_sequences=opts.num_sequences,
        kl_coef=opts.kl_coef, entropy_coef=opts.entropy_coef, tis_cap=opts.tis_cap, **stats.fields(),
    )


def gspo_token_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (paper eq. 13-17): token-wise advantages on top of the sequence ratio.

    ``s_i,t = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]`` - numerically s_i, with the
    gradient of one token. Per sequence ``l_i = -(1/|y_i|) sum_t min(s_i,t A_i,t,
    clip(s_i,t) A_i,t)``; ``loss = sum_i l_i / num_sequences``. With ``A_i,t = A_i`` for all t
    this equals :func:`gspo_loss` in value and gradient, including beyond the log-ratio clamp
    (where the token factor is made constant so the gradient is zero, as in GSPO).

    Args: as :func:`gspo_loss`, except ``advantages`` is [B] or [B, T].

    Extra options for context parallelism (each [B], reduced over CP by the caller; default:
    computed from the local tokens):
        logratio_sum: global sum_t mask (log pi - log pi_old) per sequence (only its value is
            used: it sits under the stop-gradient).
        token_count: global |y_i|.
        tis_logratio_sum: global sum_t mask (log pi_old - log pi_engine) for sequence-level TIS.
    The token terms themselves stay local: with these options each CP rank returns its *share*
    of the micro-batch loss (the shares sum to the full loss; their gradients sum to the full
    gradient) - unlike :func:`gspo_loss_from_stats`, whose value is replicated on all CP ranks.

    TIS (``tis_cap``) is sequence-level as in GSPO. ``clip_frac`` is a token fraction (10-30%
    is normal for GSPO-token, because a clipped sequence clips all its tokens at once); the
    ``ratio_*`` metrics are over sequences. Metrics also carry ``tokens`` (local loss tokens).
    """
    opts = LossOptions.parse(options, GSPO_TOKEN_OPTIONS, "gspo_token_loss")
    check_eps(eps_low, eps_high)
    dtype, mask, lp, old, adv_t, count, valid, n = token_inputs(
        log_probs, old_log_probs, advantages, loss_mask, opts,
        ("logratio_sum", "token_count", "tis_logratio_sum"))
    lr_sum = opts.logratio_sum if opts.logratio_sum is not None else masked(lp - old, mask).sum(-1)
    log_s_raw = lr_sum.detach().to(dtype) / n
    inside = log_s_raw.abs() <= MAX_LOG_RATIO
    log_s = log_s_raw.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    s_seq = torch.exp(log_s)
    one = torch.ones((), dtype=dtype, device=lp.device)
    token_factor = torch.where(inside[:, None], torch.exp(lp - lp.detach()), one)
    s_tok = s_seq[:, None] * token_factor
    surrogate = torch.minimum(s_tok * adv_t, s_tok.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_t)
    pg_tok = -surrogate

    w = tis_sum = None
    if opts.tis_logratio_sum is not None:
        tis_sum = opts.tis_logratio_sum.detach().to(dtype)
    elif opts.engine_log_probs is not None:
        eng = masked(opts.engine_log_probs.detach().to(dtype), mask)
        tis_sum = masked(old - eng, mask).sum(-1)
    if opts.tis_cap is not None:
        w = tis_weight_from_log(tis_sum / n, opts.tis_cap)
        pg_tok = pg_tok * w[:, None]
    loss, denom, kl_tok, ent_tok = token_loss_with_penalties(pg_tok, lp, mask, n, valid, opts, dtype)

    with torch.no_grad():
        metrics = {
            "clip_frac": clip_fraction(s_tok.detach(), adv_t, mask, eps_low, eps_high),
            **ratio_metrics(s_seq, log_s, valid),
            **token_loss_metrics(pg_tok, kl_tok, ent_tok, mask, n, valid, denom, dtype),
        }
        if tis_sum is not None:
            metrics["engine_log_ratio"] = vmean(tis_sum / n, valid)
        if w is not None:
            metrics["tis_weight_mean"] = vmean(w, valid)
    return loss, metrics
