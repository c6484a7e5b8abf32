"""Group-normalised advantages (GRPO / GSPO)."""
from __future__ import annotations

import torch

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *, unbiased: bool = True
) -> torch.Tensor:
    """``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over consecutive groups of ``group_size``.

    Args:
        rewards: [B] rewards, the G samples of each prompt next to each other
            (``B = num_prompts * group_size``).
        group_size: G.
        eps: added to the standard deviation.
        unbiased: Bessel-corrected std (``torch.std``'s default, as GRPO implementations use).

    Returns:
        [B] advantages in float32 (float64 for float64 rewards), no gradient. A group whose
        rewards are all equal (including ``group_size == 1``) gets exactly zero - never NaN, and
        never the tiny noise ``(r - mean)`` leaves after rounding.

    Raises:
        ValueError: rewards not 1-D, ``group_size < 1``, or B not a multiple of ``group_size``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    B = rewards.numel()
    if B % group_size:
        raise ValueError(
            f"batch of {B} rewards is not a multiple of group_size={group_size} "
            f"({B % group_size} left over)"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().to(dtype).view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    if group_size > 1:
        std = r.std(dim=1, keepdim=True, unbiased=unbiased)
    else:
        std = torch.zeros_like(mean)
    adv = (r - mean) / (std + eps)
    equal = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(equal, torch.zeros_like(adv), adv)
    return adv.reshape(B)
