"""Pure loss math for GSPO post-training (no ranks, no Megatron): shapes in the docstrings.

Public API:
    gspo_loss, gspo_token_loss, grpo_loss,
    cispo_loss                                 -> (loss, metrics)
    gspo_sequence_stats, gspo_loss_from_stats  -> the two halves of gspo_loss, for CP/DP splitting
    SequenceStats                              -> per-sequence sums with a one-collective reduce()
    group_advantages                           -> [B] group-normalised advantages
    MAX_LOG_RATIO                              -> the clamp applied to log-ratios before exp
"""
from .advantages import group_advantages
from .cispo import cispo_loss
from .common import MAX_LOG_RATIO
from .grpo import grpo_loss
from .gspo import SequenceStats, gspo_loss, gspo_loss_from_stats, gspo_sequence_stats, gspo_token_loss

__all__ = [
    "MAX_LOG_RATIO",
    "SequenceStats",
    "cispo_loss",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_loss_from_stats",
    "gspo_sequence_stats",
    "gspo_token_loss",
]
