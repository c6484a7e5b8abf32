"""Train-inference mismatch: how far the rollout engine's token log-probs are from the trainer's
on the same tokens (both of the policy that generated them), and the sequence-level mask built
on it.

Notation: for a response token t of sequence i, d_it = log pi_train(y_t) - log pi_engine(y_t)
(same weights, same temperature; they differ by kernels, precision, batching and - for MoE -
by which experts each side routed the token to).

- mean |d| over tokens                                   -> ``mismatch_logprob_abs``
- mean k3 = exp(d) - 1 - d over tokens                    -> ``mismatch_k3``: the k3 estimator of
  KL(pi_engine || pi_train) from tokens sampled by the engine (Schulman, "Approximating KL")
- max over sequences of |mean_t d_it|                     -> ``mismatch_seq_ratio_max``: the
  log of the sequence-level ratio GSPO would see if pi_old were the engine's
- max over tokens of |d|                                  -> ``mismatch_logprob_max``

Token-level masking (``loss.icepop``, IcePop: Ling team, "Small Leak Can Sink a Great Ship",
2025): a token whose probability ratio pi_train(y_t) / pi_engine(y_t) = exp(d_it) falls outside
[alpha, beta] leaves the loss, whatever the loss type; its neighbours keep their gradient. The
MoE guard that needs no routing replay (docs/moe-mismatch.md).

Sequence-level masking (``loss.mis``): GSPO's natural counterpart of token-level importance
sampling corrections (TIS/MIS) is to drop the *sequences* whose engine/trainer sequence log-ratio
mean_t d_it falls outside a band [low, high]; they leave both the loss and its normaliser.
"""
from __future__ import annotations

import torch

SUM_KEYS = ("mm_abs_sum", "mm_k3_sum", "mm_tokens")
MAX_KEYS = ("mm_tok_max", "mm_seq_max")


def mismatch_row_sums(train_log_probs: torch.Tensor, engine_log_probs: torch.Tensor,
                      loss_mask: torch.Tensor) -> torch.Tensor:
    """[S, 5] per-row partial sums over this rank's tokens of one sequence per row:
    (sum d, sum |d|, sum k3, token count, max |d|). Sum the first four over ranks that hold other
    tokens of the same rows (CP); the last is a max."""
    mask = loss_mask.bool()
    d = torch.where(mask, train_log_probs.double() - engine_log_probs.double(), torch.zeros((), dtype=torch.float64,
                                                                                            device=mask.device))
    k3 = torch.expm1(d) - d  # exp(d) - 1 - d, exact near 0
    tok_max = d.abs().amax(-1) if d.shape[-1] else torch.zeros(d.shape[0], dtype=d.dtype, device=d.device)
    return torch.stack([d.sum(-1), d.abs().sum(-1), k3.sum(-1), mask.sum(-1).double(), tok_max], -1)


def mismatch_report(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """The microbatch's report from (CP-reduced) row sums: summed keys and max keys."""
    has = sums[:, 3] > 0
    seq = (sums[:, 0] / sums[:, 3].clamp(min=1)).abs()
    zero = torch.zeros((), dtype=sums.dtype, device=sums.device)
    return {"mm_abs_sum": sums[:, 1].sum(), "mm_k3_sum": sums[:, 2].sum(), "mm_tokens": sums[:, 3].sum(),
            "mm_tok_max": sums[:, 4].max() if len(sums) else zero,
            "mm_seq_max": torch.where(has, seq, zero).max() if len(sums) else zero}


def mismatch_metrics(sums: dict[str, float], maxes: dict[str, float]) -> dict[str, float]:
    """Step metrics from the world-reduced sums and maxima."""
    n = max(sums["mm_tokens"], 1.0)
    return {"mismatch_logprob_abs": sums["mm_abs_sum"] / n, "mismatch_k3": sums["mm_k3_sum"] / n,
            "mismatch_seq_ratio_max": maxes["mm_seq_max"], "mismatch_logprob_max": maxes["mm_tok_max"]}


def sequence_mismatch_keep(logratio_sum: torch.Tensor, token_count: torch.Tensor, low: float,
                           high: float) -> torch.Tensor:
    """[S] bool: sequences whose mean log-ratio (trainer pi_old - engine) lies in [low, high]
    (empty sequences are kept: they carry no loss anyway)."""
    mean = logratio_sum / token_count.clamp(min=1)
    return ((mean >= low) & (mean <= high)) | (token_count == 0)


def icepop_keep(train_log_probs: torch.Tensor, engine_log_probs: torch.Tensor, loss_mask: torch.Tensor,
                alpha: float, beta: float) -> torch.Tensor:
    """[B, T] bool: the loss tokens whose ratio pi_train / pi_engine lies in [alpha, beta]
    (compared as log-ratios in float64: log alpha <= d <= log beta; the bounds are kept)."""
    import math

    mask = loss_mask.bool()
    d = train_log_probs.double() - engine_log_probs.double()
    return mask & (d >= math.log(alpha)) & (d <= math.log(beta))
