"""Shared pieces of the loss math: bounds, option parsing, masking, metric reductions."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import torch

#: Bound on every log-ratio before ``exp`` (sequence log-ratio of GSPO, token log-ratios of GRPO,
#: the reference-KL and TIS log-ratios). exp(20) ~ 4.9e8 keeps float32 finite even after
#: multiplying by advantages and summing; a sequence whose mean log-ratio reaches it is ~8 orders
#: of magnitude off-policy, far outside any clip range. Beyond the bound the gradient is zero
#: (``torch.clamp``'s gradient), which is the intended behaviour for such outliers.
MAX_LOG_RATIO = 20.0


@dataclass
class LossOptions:
    """Keyword options shared by the losses (all off by default)."""

    ref_log_probs: torch.Tensor | None = None  # [B, T] reference policy log-probs (for KL)
    kl_coef: float = 0.0
    entropy: torch.Tensor | None = None  # [B, T] per-token entropy of pi_theta (differentiable)
    entropy_coef: float = 0.0
    engine_log_probs: torch.Tensor | None = None  # [B, T] rollout engine's log-probs (for TIS)
    tis_cap: float | None = None
    num_sequences: Any = None  # global normaliser (int / float / 0-dim tensor)
    # Globally (CP-)reduced per-sequence quantities for the token-level losses, each [B]:
    logratio_sum: torch.Tensor | None = None
    token_count: torch.Tensor | None = None
    tis_logratio_sum: torch.Tensor | None = None

    @classmethod
    def parse(cls, options: Mapping[str, Any], allowed: tuple[str, ...], loss: str) -> "LossOptions":
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise TypeError(f"{loss}: unknown option(s) {unknown}; allowed: {sorted(allowed)}")
        opts = cls(**options)
        opts.validate(loss)
        return opts

    def validate(self, loss: str) -> None:
        # Never silently ignore a coefficient whose input is missing (a known pitfall in peers).
        if self.kl_coef and self.ref_log_probs is None:
            raise ValueError(f"{loss}: kl_coef={self.kl_coef} needs ref_log_probs")
        if self.entropy_coef and self.entropy is None:
            raise ValueError(f"{loss}: entropy_coef={self.entropy_coef} needs entropy")
        if self.tis_cap is not None:
            if self.engine_log_probs is None and self.tis_logratio_sum is None:
                raise ValueError(f"{loss}: tis_cap needs engine_log_probs")
            if not self.tis_cap > 0:
                raise ValueError(f"{loss}: tis_cap must be > 0, got {self.tis_cap}")


GSPO_OPTIONS = (
    "ref_log_probs", "kl_coef", "entropy", "entropy_coef", "engine_log_probs", "tis_cap",
    "num_sequences",
)
GSPO_TOKEN_OPTIONS = GSPO_OPTIONS + ("logratio_sum", "token_count", "tis_logratio_sum")
GRPO_OPTIONS = GSPO_OPTIONS + ("token_count",)


def check_eps(eps_low: float, eps_high: float) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not eps_high >= 0.0:
        raise ValueError(f"eps_high must be >= 0, got {eps_high}")


def float_dtype(t: torch.Tensor) -> torch.dtype:
    """Compute dtype: at least float32 (bf16/fp16 inputs are upcast), float64 stays float64."""
    return torch.promote_types(t.dtype, torch.float32)


def check_bt(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` else 0 - a select, so inf/NaN under the mask never leak (value or grad)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator ``exp(d) - d - 1`` of KL(pi || ref) with ``d = log ref - log pi``
    for samples of pi; non-negative; ``d`` clamped to +-MAX_LOG_RATIO."""
    d = log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1.0


def tis_weight_from_log(log_w: torch.Tensor, cap: float) -> torch.Tensor:
    """min(exp(log_w), cap), detached. The upper clamp at log(cap) is exact (exp is monotonic)."""
    hi = min(math.log(cap), MAX_LOG_RATIO)
    return torch.exp(log_w.detach().clamp(-MAX_LOG_RATIO, hi))


def normaliser(num_sequences, valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The denominator of the sequence mean: ``num_sequences`` if given, else the number of
    sequences with at least one loss token; never below 1 (an empty batch gives loss 0, not NaN)."""
    if num_sequences is None:
        n = valid.sum()
    else:
        n = torch.as_tensor(num_sequences, device=valid.device)
    return n.to(dtype).clamp_min(1.0)


def vmean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean of ``x`` over ``valid`` entries; 0 when there are none."""
    x = x.to(torch.float32) if not x.is_floating_point() else x
    return masked(x, valid).sum() / valid.sum().clamp_min(1)


def vmin(x: torch.Tensor, valid: torch.Tensor, empty: float = 1.0) -> torch.Tensor:
    """Min of ``x`` over ``valid`` entries; ``empty`` when there are none (no host sync)."""
    return _vext(x, valid, empty, torch.amin, math.inf)


def vmax(x: torch.Tensor, valid: torch.Tensor, empty: float = 1.0) -> torch.Tensor:
    """Max of ``x`` over ``valid`` entries; ``empty`` when there are none (no host sync)."""
    return _vext(x, valid, empty, torch.amax, -math.inf)


def _vext(x, valid, empty, op, fill):
    fallback = torch.tensor(empty, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return fallback
    return torch.where(valid.any(), op(torch.where(valid, x, torch.full_like(x, fill))), fallback)


class TokenInputs(NamedTuple):
    """The [B, T] inputs of a token-level loss, masked and in the compute dtype."""

    dtype: torch.dtype
    mask: torch.Tensor  # [B, T] bool
    lp: torch.Tensor  # [B, T] log pi_theta (carries the gradient), 0 off the mask
    old: torch.Tensor  # [B, T] log pi_old (detached), 0 off the mask
    adv_t: torch.Tensor  # [B, T] advantages (detached), broadcast from [B] if needed
    count: torch.Tensor  # [B] |y_i| (token_count option, else the local mask count)
    valid: torch.Tensor  # [B] bool: the sequence has loss tokens
    n: torch.Tensor  # [B] count clamped to >= 1 (a safe divisor)


def token_inputs(log_probs, old_log_probs, advantages, loss_mask, opts: "LossOptions",
                 seq_options: tuple[str, ...]) -> TokenInputs:
    """Shape checks and the shared preparation of GRPO and GSPO-token. ``seq_options`` names the
    [B] options the loss accepts (their shapes are checked here)."""
    if log_probs.dim() != 2:
        raise ValueError(f"log_probs must be [B, T], got {tuple(log_probs.shape)}")
    shape = log_probs.shape
    check_bt("old_log_probs", old_log_probs, shape)
    check_bt("loss_mask", loss_mask, shape)
    for name in ("ref_log_probs", "entropy", "engine_log_probs"):
        check_bt(name, getattr(opts, name), shape)
    for name in seq_options:
        check_bt(name, getattr(opts, name), shape[:1])
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B] or [B, T], got {tuple(advantages.shape)}")
    dtype = float_dtype(log_probs)
    mask = loss_mask.bool()
    adv = advantages.detach().to(dtype)
    count = (opts.token_count if opts.token_count is not None else mask.sum(-1)).detach().to(dtype)
    return TokenInputs(
        dtype=dtype, mask=mask,
        lp=masked(log_probs.to(dtype), mask),
        old=masked(old_log_probs.detach().to(dtype), mask),
        adv_t=adv[:, None].expand(shape) if adv.dim() == 1 else adv,
        count=count, valid=count > 0, n=count.clamp_min(1.0),
    )


def clip_fraction(ratio, adv, where, eps_low: float, eps_high: float) -> torch.Tensor:
    """Fraction of the ``where`` entries clipped on the side that zeroes their gradient:
    A > 0 and ratio > 1 + eps_high, or A < 0 and ratio < 1 - eps_low."""
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return vmean(clipped, where)


def ratio_metrics(ratio, log_ratio, where) -> dict[str, torch.Tensor]:
    """ratio_mean / ratio_min / ratio_max and approx_kl (k3 = r - 1 - log r) over ``where``."""
    return {
        "ratio_mean": vmean(ratio, where),
        "ratio_min": vmin(ratio, where),
        "ratio_max": vmax(ratio, where),
        "approx_kl": vmean(ratio - 1.0 - log_ratio, where),
    }


def token_penalties(pg_tok, lp, mask, opts: "LossOptions", dtype):
    """The per-token loss with the k3 KL (to ``ref_log_probs``, times kl_coef) and the entropy
    bonus (times entropy_coef) added: (tok, kl_tok or None, ent_tok or None)."""
    tok = pg_tok
    kl_tok = ent_tok = None
    if opts.ref_log_probs is not None:
        kl_tok = k3(masked(opts.ref_log_probs.detach().to(dtype), mask) - lp)
        if opts.kl_coef:
            tok = tok + opts.kl_coef * kl_tok
    if opts.entropy is not None:
        ent_tok = masked(opts.entropy.to(dtype), mask)
        if opts.entropy_coef:
            tok = tok - opts.entropy_coef * ent_tok
    return tok, kl_tok, ent_tok


def token_loss_with_penalties(pg_tok, lp, mask, n, valid, opts: "LossOptions", dtype):
    """Token-level losses' shared tail: add the k3 KL and entropy terms per token, take each
    sequence's token mean (divided by ``n`` = |y_i|) and sum over sequences / the normaliser.

    Returns (loss, denom, kl_tok or None, ent_tok or None); the per-token terms feed the metrics.
    """
    tok, kl_tok, ent_tok = token_penalties(pg_tok, lp, mask, opts, dtype)
    per_seq = masked(tok, mask).sum(-1) / n
    denom = normaliser(opts.num_sequences, valid, dtype)
    return masked(per_seq, valid).sum() / denom, denom, kl_tok, ent_tok


def token_loss_metrics(pg_tok, kl_tok, ent_tok, mask, n, valid, denom, dtype) -> dict:
    """Metrics the token-level losses share (detached): pg_loss with the loss's normalisation,
    counts, and the per-sequence-mean KL / entropy when those terms are present."""
    out = {
        "pg_loss": masked(masked(pg_tok.detach(), mask).sum(-1) / n, valid).sum() / denom,
        "sequences": valid.sum().to(dtype),
        "tokens": mask.sum().to(dtype),
    }
    if kl_tok is not None:
        out["kl_ref"] = vmean(masked(kl_tok.detach(), mask).sum(-1) / n, valid)
    if ent_tok is not None:
        out["entropy"] = vmean(ent_tok.detach().sum(-1) / n, valid)
    return out
