"""Group-normalised advantages (GRPO / GSPO)."""
from __future__ import annotations

import torch

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, *, unbiased: bool = True
) -> torch.Tensor:
    """``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` over consecutive groups of ``group_size``.

    Args:
        rewards: [B] finite rewards, the G samples of each prompt next to each other
            (``B = num_prompts * group_size``).
        group_size: G.
        eps: added to the standard deviation.
        unbiased: Bessel-corrected std (``torch.std``'s default, as GRPO implementations use).

    Returns:
        [B] advantages in float32 (float64 for float64 rewards), no gradient, always finite. A
        group whose rewards are all equal (including ``group_size == 1``) gets exactly zero -
        never NaN, and never the tiny noise ``(r - mean)`` leaves after rounding.

    Computed in float64 on each group's rewards divided by the group's largest magnitude: the
    formula does not change (``eps`` is divided too), and neither the sum behind the mean nor the
    squares behind the std can overflow. Without that, float32 rewards near the float32 limit
    (3e38 + 3e38 = inf) or float64 rewards near 1e300 gave inf and NaN advantages.

    Raises:
        ValueError: rewards not 1-D or not finite (naming the first such entry), ``group_size < 1``,
            or B not a multiple of ``group_size``.
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
    bad = ~torch.isfinite(rewards.detach())
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"rewards[{i}] is not finite ({rewards[i].item()}): advantages need finite rewards")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    r = rewards.detach().to(torch.float64).view(-1, group_size)
    scale = r.abs().amax(dim=1, keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
    x = r / scale
    mean = x.mean(dim=1, keepdim=True)
    if group_size > 1:
        std = x.std(dim=1, keepdim=True, unbiased=unbiased)
    else:
        std = torch.zeros_like(mean)
    # eps / scale is inf only for a subnormal scale; the advantage is then 0, as it is in the limit
    adv = (x - mean) / (std + eps / scale)
    equal = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(equal, torch.zeros_like(adv), adv)
    return adv.to(dtype).reshape(B)
