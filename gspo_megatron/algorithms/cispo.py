"""CISPO: clipped importance-sampling-weight policy optimisation (MiniMax-M1, Chen et al. 2025, eq. 4).

``r_t = pi_theta(y_t) / pi_old(y_t)`` per token (log-ratio clamped to +-MAX_LOG_RATIO before
exp), ``w_t = sg(clip(r_t, 1 - eps_low, 1 + eps_high))``, and::

    J = (1 / sum_i |y_i|) sum_i sum_t w_t A_i log pi_theta(y_t),     loss = -J

The weight, not the update, is clipped and carries no gradient, so every token keeps the
REINFORCE gradient A_i * grad log pi scaled by its weight: unlike PPO/GRPO/GSPO clipping, a token
whose ratio left the range (often a rare "fork" token) still contributes. The paper sets no lower
bound (eps_low large) and tunes eps_high only.

Conventions, and where they differ from peers':

* Defaults eps_low = 1.0 (lower bound 0: none, as the paper) and eps_high = 0.28: Trinity-RFT's
  CISPOPolicyLossFn defaults (clip_range_low 1.0, clip_range_high 0.28); the paper does not
  publish its eps_high.
* Token-level aggregation as the paper: the sum over every loss token of the minibatch divided by
  their number (``num_tokens``; default: this call's loss tokens). Sequence-mean losses
  (GSPO/GRPO here) weight each sequence equally instead; long responses weigh more under CISPO.
* Penalties (k3 KL to a reference, entropy bonus) and token-level TIS are per token with the same
  aggregation. The reported ``entropy`` / ``kl_ref`` metrics are, as for the other losses, means
  over sequences of per-sequence token means, so runs with different losses compare.
* ``clip_frac`` is the fraction of loss tokens whose weight was clipped (either side); a clipped
  token still has a gradient here, unlike GRPO's clip_frac.
"""
from __future__ import annotations

import torch

from .common import (
    MAX_LOG_RATIO,
    LossOptions,
    masked,
    ratio_metrics,
    tis_weight_from_log,
    token_inputs,
    token_penalties,
    vmean,
)

__all__ = ["cispo_loss", "CISPO_OPTIONS"]

# token_count: the global |y_i| [B] under CP, for the per-sequence metrics only (the loss is a token sum)
CISPO_OPTIONS = ("ref_log_probs", "kl_coef", "entropy", "entropy_coef", "engine_log_probs", "tis_cap", "token_count")


def _check_eps(eps_low: float, eps_high: float) -> None:
    if not eps_low >= 0.0:
        raise ValueError(f"cispo eps_low must be >= 0 (>= 1: no lower bound), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"cispo eps_high must be >= 0, got {eps_high}")


def cispo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.28,
    num_tokens=None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level CISPO loss.

    Args:
        log_probs, old_log_probs, loss_mask: [B, T] (as :func:`gspo_loss`); only ``log_probs``
            carries gradient.
        advantages: [B] or [B, T].
        eps_low, eps_high: the IS weight is clipped to [max(0, 1 - eps_low), 1 + eps_high].
        num_tokens: the denominator (the minibatch's loss tokens when the loss is split over
            microbatches and ranks); default the loss tokens of this call, never below 1.
    Options: ref_log_probs + kl_coef, entropy + entropy_coef, engine_log_probs + tis_cap,
        token_count ([B] global |y_i| under CP: the per-sequence metrics' denominators).

    Returns:
        (loss, metrics): ``clip_frac``, ``ratio_mean``/``ratio_min``/``ratio_max``, ``approx_kl``,
        ``is_weight_mean``, ``pg_loss``, ``sequences``, ``tokens`` and when enabled ``kl_ref``,
        ``entropy``, ``engine_log_ratio``, ``tis_weight_mean``.
    """
    opts = LossOptions.parse(options, CISPO_OPTIONS, "cispo_loss")
    _check_eps(eps_low, eps_high)
    dtype, mask, lp, old, adv_t, count, valid, n = token_inputs(log_probs, old_log_probs, advantages, loss_mask,
                                                                opts, ("token_count",))
    log_r = (lp.detach() - old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    r = torch.exp(log_r)
    lo, hi = max(0.0, 1.0 - eps_low), 1.0 + eps_high
    w = r.clamp(lo, hi)  # detached: lp entered detached
    tok = -(w * adv_t) * lp
    tis_log = w_tis = None
    if opts.engine_log_probs is not None:
        tis_log = old - masked(opts.engine_log_probs.detach().to(dtype), mask)
    if opts.tis_cap is not None:
        w_tis = tis_weight_from_log(tis_log, opts.tis_cap)
        tok = tok * w_tis
    pg_tok = tok
    tok, kl_tok, ent_tok = token_penalties(pg_tok, lp, mask, opts, dtype)
    denom = (mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=mask.device)).to(dtype)
    denom = denom.clamp_min(1.0)
    loss = masked(tok, mask).sum() / denom

    with torch.no_grad():
        metrics = {
            "clip_frac": vmean((r < lo) | (r > hi), mask),
            **ratio_metrics(r, log_r, mask),
            "is_weight_mean": vmean(w, mask),
            "pg_loss": masked(pg_tok.detach(), mask).sum() / denom,
            "sequences": valid.sum().to(dtype),
            "tokens": mask.sum().to(dtype),
        }
        if kl_tok is not None:
            metrics["kl_ref"] = vmean(masked(kl_tok.detach(), mask).sum(-1) / n, valid)
        if ent_tok is not None:
            metrics["entropy"] = vmean(ent_tok.detach().sum(-1) / n, valid)
        if tis_log is not None:
            metrics["engine_log_ratio"] = vmean(tis_log, mask)
        if w_tis is not None:
            metrics["tis_weight_mean"] = vmean(w_tis, mask)
    return loss, metrics
