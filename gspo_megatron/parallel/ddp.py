"""Megatron DDP wrapping and gradient finalisation for training (applied apart from model math)."""
from __future__ import annotations

import torch


def wrap_ddp(chunks: list[torch.nn.Module], tconfig, *, use_distributed_optimizer: bool = False,
             grad_reduce_in_fp32: bool = True) -> list[torch.nn.Module]:
    """Wrap each chunk in Megatron's DistributedDataParallel and hook the schedule's grad syncs.

    `calculate_per_token_loss` is switched on: loss functions return (loss_sum, count, metrics) and
    Megatron sums gradients across DP/CP and divides once by the global count. GSPO passes the
    sequence count as "count", which makes the gradient the exact full-batch mean over sequences
    for any DP/CP split and microbatch count (see train/loss.py).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
        average_in_collective=False,
    )
    tconfig.calculate_per_token_loss = True
    wrapped = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c, disable_bucketing=False)
        for c in chunks
    ]
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def zero_grads(wrapped: list[torch.nn.Module]) -> None:
    for w in wrapped:
        w.zero_grad_buffer()
