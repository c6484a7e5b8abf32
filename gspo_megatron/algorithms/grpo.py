"""GRPO / PPO-clip token-level baseline.

``r_t = pi_theta(y_t) / pi_old(y_t)`` per token (log-ratio clamped to +-MAX_LOG_RATIO before
exp), ``l_i = -(1/|y_i|) sum_t min(r_t A_i,t, clip(r_t, 1 - eps_low, 1 + eps_high) A_i,t)``,
``loss = sum_i l_i / num_sequences`` - the same sequence-mean-of-token-means aggregation as GSPO,
so the two losses differ only in where the ratio and clip live. Default clip range 0.2 / 0.27
(PPO's 0.2 with a slightly raised upper bound, "clip-higher"). Truncated importance sampling is
token-level here: ``w_t = min(pi_old(y_t) / pi_engine(y_t), tis_cap)``, detached.

Empty sequences and ``num_sequences`` behave as in GSPO (excluded from the default denominator;
pass the minibatch-global count for micro-batch / DP splitting). Under context parallelism pass
``token_count`` = the global |y_i| [B] (e.g. from the rollout lengths or a CP all-reduce); each CP
rank then returns its share of the loss and the shares (and gradients) sum to the full values.
"""
from __future__ import annotations

import torch

from .common import (
    GRPO_OPTIONS,
    MAX_LOG_RATIO,
    LossOptions,
    check_eps,
    clip_fraction,
    masked,
    ratio_metrics,
    tis_weight_from_log,
    token_inputs,
    token_loss_metrics,
    token_loss_with_penalties,
    vmean,
)

__all__ = ["grpo_loss"]


def grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.27,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO-clip loss.

    Args:
        log_probs, old_log_probs, loss_mask: [B, T] (as :func:`gspo_loss`).
        advantages: [B] or [B, T].
        eps_low, eps_high: token-ratio clip range.
    Options: ref_log_probs + kl_coef, entropy + entropy_coef, engine_log_probs + tis_cap
        (token-level), num_sequences, token_count ([B] global |y_i| under CP).

    Returns:
        (loss, metrics): token-level ``clip_frac`` (fraction of loss tokens clipped on the
        gradient-zeroing side), ``ratio_mean``/``ratio_min``/``ratio_max`` over loss tokens,
        ``approx_kl`` (token mean of k3 = r - 1 - log r), ``pg_loss``, ``sequences``,
        ``tokens``, and when enabled ``kl_ref``, ``entropy``, ``engine_log_ratio``,
        ``tis_weight_mean``, ``tis_clip_frac``.
    """
    opts = LossOptions.parse(options, GRPO_OPTIONS, "grpo_loss")
    check_eps(eps_low, eps_high)
    dtype, mask, lp, old, adv_t, count, valid, n = token_inputs(
        log_probs, old_log_probs, advantages, loss_mask, opts, ("token_count",))

    log_r = (lp - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    r = torch.exp(log_r)
    surrogate = torch.minimum(r * adv_t, r.clamp(1.0 - eps_low, 1.0 + eps_high) * adv_t)
    pg_tok = -surrogate
    w = tis_log = None
    if opts.engine_log_probs is not None:
        tis_log = old - masked(opts.engine_log_probs.detach().to(dtype), mask)
    if opts.tis_cap is not None:
        w = tis_weight_from_log(tis_log, opts.tis_cap)
        pg_tok = pg_tok * w
    loss, denom, kl_tok, ent_tok = token_loss_with_penalties(pg_tok, lp, mask, n, valid, opts, dtype)

    with torch.no_grad():
        r_d, log_r_d = r.detach(), log_r.detach()
        metrics = {
            "clip_frac": clip_fraction(r_d, adv_t, mask, eps_low, eps_high),
            **ratio_metrics(r_d, log_r_d, mask),
            **token_loss_metrics(pg_tok, kl_tok, ent_tok, mask, n, valid, denom, dtype),
        }
        if tis_log is not None:
            metrics["engine_log_ratio"] = vmean(tis_log, mask)
        if w is not None:
            metrics["tis_weight_mean"] = vmean(w, mask)
            metrics["tis_clip_frac"] = vmean(w >= opts.tis_cap * (1 - 1e-6), mask)
    return loss, metrics
