"""--simulate: a GPU preset's ranks built by the real code, on the meta device, under a fake process
group of the real world size (issue 56). What a rank holds is then measured, not estimated.

    python -m gspo_megatron.train --config FILE.yaml --simulate [--world-size N] [--ranks 0,17] [--json]

For each chosen rank (default: the first rank of every pipeline stage and the last rank), in this
one process, one after another:
  * torch.distributed starts with torch's "fake" backend at the config's world size and this rank
    (every collective returns at once; parallel/state.py `simulated_world`), then Megatron's groups;
  * the trainer's own builders run under `MetaDevice`, a TorchFunctionMode that sends every tensor a
    factory or a move would put on a device to the meta device (shapes and dtypes, no memory):
    model/factory.py build_policy (the layer spec the CPU runtime uses: Megatron's own linears, the
    same shapes as Transformer Engine's), parallel/ddp.py wrap_ddp (the real parameter and gradient
    buffers, padding included), train/optim.py build_optimizer (the distributed optimizer's fp32
    master shards) with Adam's moments created as its first step creates them, and the background
    save's host snapshot from the real checkpoint plan (train/checkpoint_shards.py,
    train/async_save.py HostSnapshot);
  * bytes are read from those objects, per category.

Reported per rank: GPU bytes of weights, gradients, optimizer (fp32 masters + Adam moments); host
bytes of the background save's snapshot and of what it page-locks (with torch's pinned allocator a
request is rounded up to a power of two: aten/src/ATen/core/CachingHostAllocator.h, `roundSize`, in
torch 2.13's headers; `MetaDevice` counts a `pin_memory=True` allocation that way); and the peak
extra memory of the verified push's digest (rollout/vllm_worker.py tensor_digest) over the rank's
largest tensor. Per node: every rank of the first node stands in for by the simulated rank of its
pipeline stage (ranks of one stage hold the same shapes; the distributed optimizer's shards differ
by padding only).

Assumed, not simulated: `all_gather_object` returns this rank's object for every rank (Megatron
gathers parameter-group keys to check they agree: they do in a symmetric layout); activations,
CUDA context, NCCL buffers and allocator fragmentation are not counted (the dry-run planner
estimates activations).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")
GIB = 1 << 30


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class MetaDevice(TorchFunctionMode):
    """Every tensor a factory creates with or without a device, and every move (`to`, `cuda`,
    `cpu`, `pin_memory`), lands on the meta device: the code under it runs its own shapes and
    dtypes without memory. Tensors made from data (`torch.tensor`, `as_tensor`: step counters,
    flags a collective carries, read back with `.item()`) stay real CPU tensors. `pinned`: the bytes torch's pinned allocator would hold for each
    `pin_memory=True` allocation or `pin_memory()` call under the block (rounded up to a power of
    two, as its CachingHostAllocator does)."""

    _MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.pin_memory)

    def __init__(self):
        super().__init__()
        self.pinned: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._MOVES and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            if func is torch.Tensor.pin_memory:
                self.pinned.append(_pow2_ceil(t.numel() * t.element_size()))
            elif func is torch.Tensor.to:
                _, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                if dtype is not None and dtype != t.dtype:
                    t = torch.Tensor.to(t, dtype)
            return t if t.is_meta else torch.Tensor.to(t, META)
        if kwargs.pop("pin_memory", False):
            kwargs["device"] = META
            out = func(*args, **kwargs)
            self.pinned.append(_pow2_ceil(out.numel() * out.element_size()))
            return out
        if func in _FROM_DATA:  # small by nature, and read back (`.item()`): real CPU tensors
            return func(*args, **kwargs)
        if func in _FACTORIES or kwargs.get("device") is not None:
            kwargs["device"] = META
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor}
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn, torch.randint,
              torch.arange, torch.linspace, torch.eye, torch.randperm, torch.empty_strided}


class LiveBytes(TorchDispatchMode):
    """The peak of memory that the ops under the block allocate and still hold: each new output
    (not a view, not an in-place result) counts until its tensor is freed. On meta tensors a
    value read (`float(t)`) answers 0.0."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return 0.0
        out = func(*args, **(kwargs or {}))
        aliasing = func.is_view or any(r.alias_info is not None for r in func._schema.returns)
        if not aliasing:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    n = t.numel() * t.element_size()
                    self.live += n
                    weakref.finalize(t, self._free, n)
            self.peak = max(self.peak, self.live)
        return out


@dataclass
class RankReport:
    rank: int
    coords: dict
    params: int  # parameters this rank holds (numel)
    gpu: dict  # category -> bytes
    host: dict  # category -> bytes
    seconds: float
    notes: list = field(default_factory=list)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())


def default_ranks(world: int, pp: int) -> list[int]:
    """The first rank of every pipeline stage (Megatron's order tp-cp-ep-dp-pp puts pp outermost:
    stage s is ranks [s*world/pp, (s+1)*world/pp)) and the last rank."""
    per = world // pp
    return sorted({s * per for s in range(pp)} | {world - 1})


def _numel_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _model_bytes(model) -> tuple[int, int, int]:
    """(parameters, weight bytes, gradient bytes) of the DDP-wrapped chunks: the buffers' own
    sizes (padding included) where a buffer holds the parameters, the parameters' elsewhere."""
    params = weights = grads = 0
    for chunk in model:
        buffered = set()
        for b in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            grads += _numel_bytes(b.grad_data)
            if b.param_data is not None:
                weights += _numel_bytes(b.param_data)
                buffered.update(id(p) for p in b.params)
        for p in chunk.parameters():
            params += p.numel()
            if id(p) not in buffered:
                weights += _numel_bytes(p)
    return params, weights, grads


def _optimizer_bytes(optimizer) -> tuple[int, int]:
    """(fp32 master bytes, Adam state bytes) held by the inner optimizers."""
    from gspo_megatron.parallel.cpu_runtime import _init_adam_state
    from gspo_megatron.train.optim import inner_optimizers

    masters = moments = 0
    for opt in inner_optimizers(optimizer):
        for name in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, name, None) or ():
                masters += sum(_numel_bytes(p) for p in group)
        _init_adam_state(opt.optimizer)  # what the first step creates
        for state in opt.optimizer.state.values():
            moments += sum(_numel_bytes(v) for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
    return masters, moments


def _snapshot_bytes(model, optimizer, arch, hf_config) -> tuple[int, int, int] | None:
    """(snapshot bytes, page-locked bytes, chunks) of the background save's host copy, from the
    checkpoint plan a save of this rank builds; None when the run would save synchronously."""
    from gspo_megatron.checkpoint.mcore import model_sharded_state_dict
    from gspo_megatron.train.async_save import HostSnapshot
    from gspo_megatron.train.checkpoint_shards import distributed_optimizer_plan

    model_state = model_sharded_state_dict(model, arch)
    plan = distributed_optimizer_plan(optimizer, model_state)
    if plan is None:
        return None
    chunks, _ = plan
    host = HostSnapshot(pin=lambda flat: (lambda: None))  # the real code's page-locking call, recorded
    host.take([(tuple(c.sizes), c.dtype) for c in chunks])
    return sum(c.nbytes for c in chunks), host.pinned_bytes, len(chunks)


def _digest_peak(numel: int, dtype: torch.dtype) -> int:
    """Peak extra bytes of the verified push's digest of one tensor of `numel` elements."""
    from gspo_megatron.rollout.vllm_worker import tensor_digest

    t = torch.empty(numel, dtype=dtype, device=META)
    with LiveBytes() as live:
        tensor_digest(t)
    return live.peak


def simulate_rank(cfg, inputs, world: int, rank: int, *, snapshot=None) -> RankReport:
    """One rank's objects, built and measured (see the module docstring). `snapshot`: a stand-in
    for train/checkpoint.py's `_snapshot` host allocation (tests: the c651b52 per-chunk buffers)."""
    from gspo_megatron.model.factory import build_policy, parse_dtype
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import init_parallel, simulated_world
    from gspo_megatron.train.optim import build_optimizer

    t0 = time.perf_counter()
    dtype = parse_dtype(cfg.model.dtype)
    with simulated_world(rank, world):
        ctx = init_parallel(cfg.parallel, seed=cfg.model.init_seed)
        coords = dict(tp=ctx.tp_rank, cp=ctx.cp_rank, ep=ctx.ep_rank, etp=ctx.etp_rank, dp=ctx.dp_rank, pp=ctx.pp_rank)
        with MetaDevice() as meta:
            chunks, tconfig = build_policy(ctx, inputs.arch, dtype=dtype, recompute=cfg.train.recompute,
                                           fused_logprobs=cfg.model.fused_logprobs, local_spec=bool(cfg.lora.rank))
            if cfg.lora.rank:
                from gspo_megatron.model import lora

                lora.apply_lora(chunks, lora.LoraSpec.from_config(cfg.lora, cfg.model.init_seed), ep_rank=ctx.ep_rank)
            largest = max(((p.numel(), p.dtype) for c in chunks for p in c.parameters()), default=(0, dtype))
            model = wrap_ddp(chunks, tconfig, grad_reduce_in_fp32=cfg.optimizer.grad_reduce_in_fp32,
                             use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
            optimizer, _ = build_optimizer(cfg.optimizer, model, total_steps=max(1, cfg.train.max_steps), dtype=dtype)
            params, weights, grads = _model_bytes(model)
            masters, moments = _optimizer_bytes(optimizer)
            gpu = {"weights": weights, "gradients": grads, "optimizer": masters + moments}
            host, notes = {}, []
            if cfg.checkpoint.async_save:
                got = (snapshot or _snapshot_bytes)(model, optimizer, inputs.arch, inputs.hf_config)
                if got is None:
                    notes.append("background save: this optimizer saves synchronously (no host snapshot)")
                else:
                    host["checkpoint_snapshot"], pinned, _ = got
                    host["checkpoint_pinned"] = pinned + sum(meta.pinned)
            if cfg.rollout.verify_weights:
                gpu["digest_peak"] = _digest_peak(*largest)
        del model, optimizer, chunks
    return RankReport(rank=rank, coords=coords, params=params, gpu=gpu, host=host,
                      seconds=round(time.perf_counter() - t0, 2), notes=notes)


def simulate(cfg, world: int, ranks: list[int] | None = None, inputs=None, **kw) -> list[RankReport]:
    from gspo_megatron.train.setup import check_inputs

    inputs = inputs or check_inputs(cfg, world_size=world)
    ranks = default_ranks(world, cfg.parallel.pp) if ranks is None else ranks
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"--ranks: rank {r} is outside the world of {world}")
    return [simulate_rank(cfg, inputs, world, r, **kw) for r in ranks]


def node_totals(reports: list[RankReport], world: int, pp: int, nproc_per_node: int) -> dict:
    """Bytes of the first node: each of its ranks stands in for by the simulated rank of its stage."""
    per_stage = world // pp
    by_stage = {r.coords["pp"]: r for r in reports}
    gpu: dict = {}
    host: dict = {}
    for rank in range(min(nproc_per_node, world)):
        rep = by_stage.get(rank // per_stage)
        if rep is None:
            raise ValueError(f"rank {rank}'s pipeline stage was not simulated")
        for k, v in rep.gpu.items():
            gpu[k] = gpu.get(k, 0) + v
        for k, v in rep.host.items():
            host[k] = host.get(k, 0) + v
    return {"ranks": min(nproc_per_node, world), "gpu": gpu, "host": host}


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def main(argv=None) -> int:
    from gspo_megatron.cli_util import user_errors
    from gspo_megatron.errors import ConfigError
    from gspo_megatron.resolve import load_config

    ap = argparse.ArgumentParser(prog="gspo_megatron.train --simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--nproc-per-node", type=int, default=8, help="GPUs per node, for the per-node totals (8)")
    ap.add_argument("--ranks", default=None, help="comma-separated global ranks (default: each stage's first, the last)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    with user_errors("gspo_megatron.train --simulate"):
        cfg = load_config(args.config, [*args.overrides, "parallel.device=cpu"])
        world = args.world_size or cfg.parallel.world_size
        if world is None:
            raise ConfigError("--simulate needs --world-size (the config sets no parallel.world_size)")
        ranks = None if args.ranks is None else [int(x) for x in args.ranks.split(",") if x.strip()]
        from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

        skip_compiled_fusions()
        reports = simulate(cfg, world, ranks)
        node = node_totals(reports, world, cfg.parallel.pp, args.nproc_per_node) if ranks is None else None
    if args.json:
        print(json.dumps({"world_size": world, "ranks": [asdict(r) for r in reports], "node": node}))
        return 0
    print(f"gspo-megatron simulate: {args.config}, world size {world} (meta device, fake process group)")
    for r in reports:
        c = r.coords
        print(f"rank {r.rank} (pp {c['pp']} tp {c['tp']} ep {c['ep']} etp {c['etp']} dp {c['dp']} cp {c['cp']}): "
              f"{r.params:,} parameters in {r.seconds:.1f} s")
        print("  GPU:  " + " | ".join(f"{k} {_fmt(v)}" for k, v in r.gpu.items()) + f" | total {_fmt(r.gpu_total)}")
        if r.host:
            print("  host: " + " | ".join(f"{k} {_fmt(v)}" for k, v in r.host.items()))
        for n in r.notes:
            print("  " + n)
    if node is not None:
        print(f"first node ({node['ranks']} ranks): GPU " + " | ".join(f"{k} {_fmt(v)}" for k, v in node["gpu"].items())
              + (" ; host " + " | ".join(f"{k} {_fmt(v)}" for k, v in node["host"].items()) if node["host"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
