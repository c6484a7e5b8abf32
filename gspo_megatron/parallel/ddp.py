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
    skip_single_rank_collectives()
    wrapped = [
        DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c, disable_bucketing=False)
        for c in chunks
    ]
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.no_sync_func = [w.no_sync for w in wrapped] if len(wrapped) > 1 else wrapped[0].no_sync
    return wrapped


def release_model(wrapped: list[torch.nn.Module]) -> None:
    """Let the run's model be freed when the run ends, not when the process does. Megatron's DDP
    registers a backward hook on every parameter's gradient accumulator
    (distributed/distributed_data_parallel.py:336-345), and the hook's closure holds the DDP
    module. Any autograd graph still alive after the last step reaches those accumulators; the MoE
    token dispatcher keeps one, the last forward's routing probabilities (`self.probs`,
    moe/token_dispatcher.py, set in dispatch_preprocess): dispatcher -> probs -> graph ->
    accumulator (a C++ node) -> hook -> DDP -> model -> dispatcher, a cycle through C++ that
    Python's collector cannot see. The model, its gradient buffers, the optimizer and every process
    group they hold (with gloo's threads, ~60 per rank per run) then lived until exit: a process
    that trains again (sweeps, a notebook, the pooled test ranks) kept one of each per run.
    Dropping the accumulators and every module's cached graph tensors breaks it; the chunks are
    not trained after this."""
    for w in wrapped:
        accs = getattr(w, "grad_accs", None)
        if accs is not None:
            accs.clear()
        for m in w.modules():
            # the module and the plain objects it holds (the dispatcher is not a Module)
            for owner in [m, *(v for v in vars(m).values() if _plain_object(v))]:
                for name, v in list(vars(owner).items()):
                    if isinstance(v, torch.Tensor) and v.grad_fn is not None:  # an activation, not state
                        setattr(owner, name, None)


def _plain_object(v) -> bool:
    return (hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))
            and type(v).__module__.startswith(("megatron.", "gspo_megatron.")))


def zero_grads(wrapped: list[torch.nn.Module]) -> None:
    for w in wrapped:
        w.zero_grad_buffer()


# ---- gradient and parameter buffers: no collectives on groups of one rank ------------------------
#
# Megatron-Core 0.16.1 reduce-scatters every gradient bucket and all-gathers every parameter bucket
# of the distributed optimizer over the data-parallel (x CP) group whatever its size
# (distributed/param_and_grad_buffer.py:250-300 start_param_sync, :364-510 start_grad_sync), inside
# torch's _coalescing_manager. With one rank in that group (TP1 or TP2 alone, every DP=1 layout) the
# shard is the whole bucket and both collectives are copies of a buffer onto itself, yet through
# gloo each costs a round trip to its worker thread: ~3 ms of a 10 ms optimizer step on the CPU
# demo (bench/bench_trainer.py profile). The names that module bound at import are rebound to
# versions that do nothing for a one-rank group (the data is already where it belongs) and call
# torch's function otherwise. Any device: NCCL's one-rank collectives are cheap but not free.

_SINGLE_RANK_OPS = ("SUM", "AVG", "MAX", "MIN")  # a one-rank reduction of these returns its input


class _NoWork:
    """The handle of a collective that had nothing to do (Megatron waits on it when async)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _alone(group) -> bool:
    import torch.distributed as dist

    return (group.size() if group is not None else dist.get_world_size()) == 1


def _local_copy(out: torch.Tensor, inp: torch.Tensor, async_op: bool):
    if out.data_ptr() != inp.data_ptr() or out.shape != inp.shape:
        out.copy_(inp.view_as(out))
    return _NoWork() if async_op else None


def _single_rank_all_gather(real):
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        if _alone(group):
            return _local_copy(output_tensor, input_tensor, async_op)
        return real(output_tensor, input_tensor, group=group, async_op=async_op)

    all_gather_into_tensor._gspo_single_rank = real
    return all_gather_into_tensor


def _single_rank_reduce_scatter(real):
    import torch.distributed as dist

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if _alone(group) and any(op == getattr(dist.ReduceOp, n) for n in _SINGLE_RANK_OPS):
            return _local_copy(output, input, async_op)
        return real(output, input, op=op, group=group, async_op=async_op)

    reduce_scatter_tensor._gspo_single_rank = real
    return reduce_scatter_tensor


def _single_rank_coalescing(real):
    import contextlib

    @contextlib.contextmanager
    def _coalescing_manager(group=None, device=None, async_ops=False):
        # synchronous only: an async block may hold collectives that are not shortcuts (the
        # non-distributed optimizer's all_reduce), whose handles only the real manager waits on
        if not async_ops and _alone(group):
            yield _NoWork()
            return
        with real(group, device, async_ops) as cm:
            yield cm

    _coalescing_manager._gspo_single_rank = real
    return _coalescing_manager


def skip_single_rank_collectives() -> None:
    """Rebind param_and_grad_buffer's collectives to the one-rank shortcuts (idempotent)."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    for name, make in (("dist_all_gather_func", _single_rank_all_gather),
                       ("dist_reduce_scatter_func", _single_rank_reduce_scatter),
                       ("_coalescing_manager", _single_rank_coalescing)):
        current = getattr(pgb, name, None)
        if current is None:
            raise RuntimeError(f"megatron.core.distributed.param_and_grad_buffer.{name} is gone: "
                               "megatron-core changed, revisit gspo_megatron/parallel/ddp.py")
        if not hasattr(current, "_gspo_single_rank"):
            setattr(pgb, name, make(current))
