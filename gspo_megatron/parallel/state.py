"""Process groups from a ParallelConfig. The only module that reads Megatron's global parallel state;
everything else receives a `ParallelContext` and passes its groups explicitly."""
from __future__ import annotations

import contextlib
import datetime
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gspo_megatron.config import ParallelConfig
from gspo_megatron.parallel import cpu_runtime, shm_collectives

# Every collective wait is bounded: a rank that died must not hang the others forever. Runs pass
# the config's bound (Config.collective_timeout_s: it outlasts rank 0's engine waits).
DEFAULT_TIMEOUT_S = 30 * 60.0


@dataclass
class ParallelContext:
    parallel: ParallelConfig
    device: torch.device
    world_size: int
    rank: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_rank: int
    etp_rank: int
    tp_group: Any
    pp_group: Any
    dp_group: Any  # pure data-parallel group (without CP)
    dp_cp_group: Any  # data x context parallel: where dense gradients are reduced
    cp_group: Any
    ep_group: Any
    etp_group: Any
    edp_group: Any
    mp_group: Any  # model-parallel (tp x pp) group

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pp - 1

    @property
    def use_cpu_runtime(self) -> bool:
        return self.device.type == "cpu"


def resolve_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        from gspo_megatron.errors import ConfigError

        raise ConfigError("parallel.device=cuda but CUDA is not available on this machine")
    return torch.device(requested)


def _env_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def init_parallel(
    parallel: ParallelConfig,
    *,
    seed: int = 1234,
    model_dims: dict | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelContext:
    """Validate the layout, start torch.distributed and Megatron's groups, seed model-parallel RNG.

    Works without torchrun: with no RANK/WORLD_SIZE in the environment it starts a one-process
    group on a free local port.
    """
    rank, world = _env_world()
    parallel.validate(world, **(model_dims or {}))
    device = resolve_device(parallel.device)
    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            if world != 1:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is unset: launch with torchrun")
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        backend = "nccl" if device.type == "cuda" else _cpu_backend(parallel.cpu_collectives, rank)
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    # every device: the TE/apex-absent shims apply to CUDA runs too; the CPU part only on CPU
    # (tests/test_cpu_runtime.py test_selection_* shows the CUDA selections)
    cpu_runtime.activate(device)

    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=max(1, math.ceil(timeout_s / 60)),  # Megatron's own groups
        create_gloo_process_groups=True,  # Megatron's optimizer asks for the gloo DP groups
    )
    ctx = ParallelContext(
        parallel=parallel,
        device=device,
        world_size=world,
        rank=rank,
        dp=parallel.dp(world),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        cp_group=ps.get_context_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        edp_group=ps.get_expert_data_parallel_group(),
        mp_group=ps.get_model_parallel_group(),
    )
    seed_rng(ctx, seed)
    return ctx


def _cpu_backend(choice: str, rank: int) -> str:
    """The default backend of a CPU run: shared-memory collectives where they work, else gloo.
    (CUDA runs take NCCL and never get here; the gloo groups Megatron's optimizer asks for stay gloo.)"""
    if choice != "shm":
        return "gloo"
    ok, why = shm_collectives.available()
    if not ok:
        if rank == 0:
            print(f"[parallel] parallel.cpu_collectives=shm: {why}; using gloo", flush=True)
        return "gloo"
    return shm_collectives.register()


def seed_rng(ctx: ParallelContext, seed: int) -> None:
    """Seed the default and model-parallel generators (Megatron's offsets)."""
    if ctx.device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    else:
        cpu_runtime.seed_model_parallel_rng(seed, ctx.tp_rank, ctx.ep_rank, ctx.etp_rank)


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` is true on any rank of the world (a collective: every rank calls it at the
    same point). The tensor lives on `device`, the rank's (NCCL takes CUDA tensors only); one
    process without a process group is its own world."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


class GroupOps:
    """The torch.distributed calls a checkpoint writer makes (rank, world size, barrier, object
    broadcast/gather), bound to one process group. A background checkpoint write runs its
    collectives on a group of its own (`background_group`) while the training thread runs its own
    on the default group: two threads must never share a group, whose collectives would interleave
    in a different order on different ranks."""

    def __init__(self, group):
        self.group = group

    def get_rank(self) -> int:
        return dist.get_rank(self.group)

    def get_world_size(self) -> int:
        return dist.get_world_size(self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def broadcast_object_list(self, objects: list, src: int = 0) -> None:
        dist.broadcast_object_list(objects, src=dist.get_global_rank(self.group, src), group=self.group)

    def all_gather_object(self, out: list, obj) -> None:
        dist.all_gather_object(out, obj, group=self.group)


def background_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> GroupOps:
    """A gloo group over the whole world for a background thread's collectives (a collective
    itself: every rank calls it, at the same point). gloo on every device: what it carries is
    plans, file lists and flags (CPU objects), and PyTorch's DCP asks for a CPU-capable group
    for its asynchronous saves (torch 2.13 torch/distributed/checkpoint/state_dict_saver.py:304)."""
    return GroupOps(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))


class _DoneWork:
    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def simulated_world(rank: int, world: int):
    """torch.distributed as `rank` of `world` with torch's "fake" backend (every collective returns
    at once, nothing is sent), for --simulate (train/simulate.py): init_parallel inside the block
    builds Megatron's real groups on it. Megatron also asks for gloo groups (its optimizer's) and
    gathers objects; inside the block a group of any backend is a fake one, and all_gather_object
    answers this rank's object for every rank. Point-to-point transfers (send, recv, isend, irecv:
    the weight export's) complete at once and are recorded in the yielded list as
    (op, bytes, peer global rank). Everything is torn down at the end."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulated_world: torch.distributed is already initialized in this process")
    real = {k: getattr(dist, k) for k in ("new_group", "all_gather_object", "send", "recv", "isend", "irecv")}
    p2p: list[tuple[str, int, int]] = []

    def new_group(*args, **kwargs):
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        return real["new_group"](*args, **kwargs)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj] * len(out)

    def point_to_point(op: str, blocking: bool):
        def fn(tensor, peer=None, group=None, tag=0, **kwargs):
            peer = kwargs.get("dst", kwargs.get("src", peer))
            p2p.append((op, tensor.numel() * tensor.element_size(), int(peer)))
            return None if blocking else _DoneWork()

        return fn

    saved = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dist.new_group, dist.all_gather_object = new_group, all_gather_object
    dist.send, dist.isend = point_to_point("send", True), point_to_point("send", False)
    dist.recv, dist.irecv = point_to_point("recv", True), point_to_point("recv", False)
    try:
        yield p2p
    finally:
        for k, v in real.items():
            setattr(dist, k, v)
        destroy_parallel()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def destroy_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
