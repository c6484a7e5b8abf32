"""RMSNorm usable in Megatron specs under sequence parallelism (the portable/CPU spec)."""
from __future__ import annotations

import torch


class SPRMSNorm(torch.nn.Module):
    """RMSNorm with Megatron's norm constructor signature.

    Megatron's local spec builds torch.nn.RMSNorm through WrappedTorchNorm, which asserts
    `not config.sequence_parallel`. The math of a norm is per token, so it is already correct on a
    sequence shard; the one thing sequence parallel needs is that the weight's gradient (a partial
    sum over this rank's tokens) is all-reduced across TP. Megatron's finalize_model_grads does
    that for parameters carrying `sequence_parallel=True`, which this module sets.

    Computed in fp32 and cast back, like transformers' RMSNorm of every family here, so fp32 runs agree with
    the reference to rounding.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's rms_norm: the same operations in the same order (bitwise equal in fp32,
            # tests/test_megatron_parity.py), ~10% cheaper on CPU. In 16 bits HF casts back before
            # the weight multiply and rms_norm does not, so those keep the formula below.
            return torch.nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
