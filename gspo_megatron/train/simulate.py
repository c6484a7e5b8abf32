"""--simulate: a GPU preset's ranks built by the real code, on the meta device, under a fake process
group of the real world size (issue 56). What a rank holds is then measured, not estimated.

    python -m gspo_megatron.train --config FILE.yaml --simulate [--world-size N] [--ranks 0,17]
        [--engines 1x8,4x8] [--json]

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
torch 2.13's headers; `MetaDevice` counts a `pin_memory=True` allocation that way); on rank 0 the
host memory of an HF export / disk push of the same stream (`_ShardPeak`) and the peak extra
memory of the verified push's digest (rollout/vllm_worker.py tensor_digest) of its largest tensor;
and the weight push as the trainer runs it: the real export (model/export.py, its point-to-point
transfers recorded with their peers, inside or across nodes) drained on every rank, and on rank 0
the engine's buckets (rollout/weight_sync.py iter_buckets) with the peak extra memory
(`LiveBytes`). From rank 0's transfers and pushed bytes, the refit plan per weight-sync mode and
engine layout (`--engines`, default the config's) with a push time under the config's bandwidth
model (`scale`): `refit_plan` says what each side does and how the time is counted.

Per node: each rank is represented by the simulated rank of its pipeline stage (ranks of one stage
hold the same shapes; the distributed optimizer's shards differ by padding only), plus the dry-run
planner's activation estimate of the stage; `scale.gpu_gib_per_node` / `host_gib_per_node` are
checked against the fullest node and GPU (one line naming the budget and its largest item).

Assumed, not simulated: `all_gather_object` returns this rank's object for every rank (Megatron
gathers parameter-group keys to check they agree: they do in a symmetric layout); activations are
the dry-run planner's estimate; CUDA context, NCCL buffers and allocator fragmentation are not
counted.
"""
from __future__ import annotations

import argparse
import json
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
    flags a collective carries, read back with `.item()`) stay real CPU tensors. `pinned`: the bytes
    torch's pinned allocator would hold for each `pin_memory=True` allocation or `pin_memory()`
    call under the block (rounded up to a power of two, as its CachingHostAllocator does)."""

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
        if func in _CATS and args and all(isinstance(t, torch.Tensor) and t.is_meta for t in args[0]):
            return _meta_cat(args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0))
        if func in _FROM_DATA:  # small by nature, and read back (`.item()`): real CPU tensors
            return func(*args, **kwargs)
        if func in _FACTORIES or kwargs.get("device") is not None:
            kwargs["device"] = META
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor}
_CATS = {torch.cat, torch.concat, torch.concatenate}


def _meta_cat(tensors, dim: int) -> torch.Tensor:
    """torch.cat of meta tensors by shape alone: the meta kernel runs torch's Python reference
    (~5 ms a call), and the export and Megatron's initialisation concatenate ~10^4 times a rank."""
    parts = [t for t in tensors if not (t.dim() == 1 and t.numel() == 0)]  # cat's legacy empty skip
    if not parts:
        return torch.cat(list(tensors), dim)
    shape = list(parts[0].shape)
    d = dim % len(shape)
    shape[d] = sum(t.shape[d] for t in parts)
    dtype = parts[0].dtype
    for t in parts[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.empty(shape, dtype=dtype, device=META)


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
    refit: dict  # the weight push: bytes sent / received in and across nodes; rank 0: tensors, buckets
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


class _ShardPeak:
    """The host memory of an HF export of the same stream (train/setup.py export_hf and disk weight
    sync write it with model/hf_writer.py HFShardWriter): the real writer, its shard write recorded
    instead of performed. safetensors 0.8 writes a shard from the tensors' own memory
    (safetensors/torch.py save_file: _flatten_as_ptr), so the peak is the largest pending shard."""

    def __init__(self):
        from gspo_megatron.model.hf_writer import HFShardWriter

        self.writer = HFShardWriter(directory="")
        self.writer._flush = self._flush
        self.peak = 0
        self.shards = 0

    def _flush(self) -> None:
        w = self.writer
        self.peak = max(self.peak, w._pending_bytes)
        self.shards += 1
        w._pending, w._pending_bytes = {}, 0

    def tee(self, stream):
        for name, t in stream:
            self.writer.add(name, t)
            yield name, t

    def finish(self) -> None:
        if self.writer._pending:
            self._flush()


def _refit(chunks, ctx, arch, cfg, dtype, p2p: list, nproc_per_node: int) -> dict:
    """The weight push as the trainer runs it (train/loop.py push_weights): the real export
    (model/export.py iter_hf_tensors: point-to-point gathers to global rank 0) drained on every
    rank, and on rank 0 grouped into the engine's buckets by the real rollout/weight_sync.py
    iter_buckets. Bytes each rank sends and receives (inside its node / across nodes), and on rank
    0 the pushed tensors, bytes, buckets and the peak extra memory while pushing."""
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.rollout.weight_sync import drain, iter_buckets

    from gspo_megatron.rollout.vllm_nccl import DEFAULT_BUCKET_BYTES

    # the bucket size the run's engine pushes with: SGLang's configured one; vLLM's NCCL push (and
    # the in-process engine, which takes no push) the fixed default
    bucket_bytes = cfg.rollout.sglang.bucket_mb << 20 if cfg.rollout.backend == "sglang" else DEFAULT_BUCKET_BYTES
    start = len(p2p)
    out = {"bucket_bytes": bucket_bytes}
    with LiveBytes() as live:
        stream = iter_hf_tensors(chunks, ctx, arch, dtype=dtype)
        if ctx.rank == 0:
            tensors = nbytes = buckets = largest = largest_tensor = 0
            writer = _ShardPeak()
            for bucket in iter_buckets(writer.tee(stream), bucket_bytes, dtype=dtype, device=META):
                sizes = [t.numel() * t.element_size() for _, t in bucket]
                tensors, nbytes, buckets = tensors + len(bucket), nbytes + sum(sizes), buckets + 1
                largest, largest_tensor = max(largest, sum(sizes)), max(largest_tensor, *sizes)
                del bucket
            writer.finish()
            out.update(tensors=tensors, push_bytes=nbytes, buckets=buckets, largest_bucket=largest,
                       largest_tensor=largest_tensor, hf_export_host_peak=writer.peak, hf_export_shards=writer.shards)
        else:
            drain(stream)
    out["peak_extra_bytes"] = live.peak
    node = ctx.rank // nproc_per_node
    for op in ("send", "recv"):
        for where, same in (("intra", True), ("inter", False)):
            out[f"{op}_{where}"] = sum(n for o, n, peer in p2p[start:] if o == op and (peer // nproc_per_node == node) == same)
    out["p2p_ops"] = len(p2p) - start
    return out


def simulate_rank(cfg, inputs, world: int, rank: int, *, snapshot=None, nproc_per_node: int = 8) -> RankReport:
    """One rank's objects, built and measured (see the module docstring). `snapshot`: a stand-in
    for train/checkpoint.py's `_snapshot` host allocation (tests: the c651b52 per-chunk buffers)."""
    from gspo_megatron.model.factory import build_policy, parse_dtype
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import init_parallel, simulated_world
    from gspo_megatron.train.optim import build_optimizer

    t0 = time.perf_counter()
    dtype = parse_dtype(cfg.model.dtype)
    with simulated_world(rank, world) as p2p:
        ctx = init_parallel(cfg.parallel, seed=cfg.model.init_seed)
        import torch.distributed as dist

        coords = dict(tp=ctx.tp_rank, cp=ctx.cp_rank, ep=ctx.ep_rank, etp=ctx.etp_rank, dp=ctx.dp_rank, pp=ctx.pp_rank,
                      edp=dist.get_rank(ctx.edp_group))
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
            if cfg.rollout.verify_weights and ctx.rank == 0:  # the trainer digests what it pushes on rank 0
                gpu["digest_peak"] = _digest_peak(*largest)
            refit = _refit(chunks, ctx, inputs.arch, cfg, dtype, p2p, nproc_per_node)
            if "hf_export_host_peak" in refit:
                host["hf_export"] = refit["hf_export_host_peak"]
        del model, optimizer, chunks
    return RankReport(rank=rank, coords=coords, params=params, gpu=gpu, host=host, refit=refit,
                      seconds=round(time.perf_counter() - t0, 2), notes=notes)


def simulate(cfg, world: int, ranks: list[int] | None = None, inputs=None, **kw) -> list[RankReport]:
    from gspo_megatron.train.setup import check_inputs

    inputs = inputs or check_inputs(cfg, world_size=world)
    ranks = default_ranks(world, cfg.parallel.pp) if ranks is None else ranks
    for r in ranks:
        if not 0 <= r < world:
            raise ValueError(f"--ranks: rank {r} is outside the world of {world}")
    return [simulate_rank(cfg, inputs, world, r, **kw) for r in ranks]


def node_totals(reports: list[RankReport], world: int, pp: int, gpus_per_node: int,
                activations: dict | None = None) -> list[dict]:
    """Bytes of every node: each of its ranks represented by the simulated rank of its pipeline
    stage (rank 0 by itself: it alone pushes and digests), plus the planner's activation estimate per
    stage (`activations`: {stage: bytes}). Needs a simulated rank of every stage."""
    per_stage = world // pp
    by_stage = {r.coords["pp"]: r for r in reports if r.rank != 0}
    by_stage.update({r.coords["pp"]: r for r in reports if r.rank == 0 and r.coords["pp"] not in by_stage})
    rank0 = next((r for r in reports if r.rank == 0), None)
    only_rank0 = ("digest_peak",)  # what rank 0 alone holds: a stand-in of another rank leaves it out
    nodes = []
    for n in range(-(-world // gpus_per_node)):
        gpu: dict = {}
        host: dict = {}
        largest = (0, -1)
        for rank in range(n * gpus_per_node, min(world, (n + 1) * gpus_per_node)):
            stage = rank // per_stage
            rep = rank0 if rank == 0 and rank0 is not None else by_stage.get(stage)
            if rep is None:
                raise ValueError(f"rank {rank}'s pipeline stage {stage} was not simulated")
            mine = {k: v for k, v in rep.gpu.items() if rank == 0 or k not in only_rank0}
            # the push's peak on the simulated ranks themselves (the stage roots and rank 0 hold the
            # gathered items; which other ranks hold some depends on their coordinates, not the stage)
            mine["push_peak"] = rep.refit.get("peak_extra_bytes", 0) if rank == rep.rank else 0
            if activations:
                mine["activations (planned)"] = activations.get(stage, 0)
            for k, v in mine.items():
                gpu[k] = gpu.get(k, 0) + v
            largest = max(largest, (sum(mine.values()), rank))
            snap = max(rep.host.get("checkpoint_snapshot", 0), rep.host.get("checkpoint_pinned", 0))
            if snap:
                host["checkpoint_snapshot"] = host.get("checkpoint_snapshot", 0) + snap
            if rank == 0 and rep.host.get("hf_export"):  # rank 0 writes the HF export / disk push
                host["hf_export"] = rep.host["hf_export"]
        nodes.append({"node": n, "gpu": gpu, "host": host, "largest_gpu": {"rank": largest[1], "bytes": largest[0]}})
    return nodes


def check_budgets(nodes: list[dict], scale) -> None:
    """One line (ConfigError) naming the budget a node or one of its GPUs is over, and its largest item."""
    from gspo_megatron.errors import ConfigError

    for kind, budget in (("gpu", scale.gpu_gib_per_node), ("host", scale.host_gib_per_node)):
        if budget is None:
            continue
        worst = max(nodes, key=lambda n: sum(n[kind].values()))
        total = sum(worst[kind].values())
        if total > budget * GIB:
            top = max(worst[kind].items(), key=lambda kv: kv[1])
            raise ConfigError(f"scale.{kind}_gib_per_node={budget:g}: node {worst['node']} needs {total / GIB:.1f} GiB "
                              f"of {kind.upper() if kind == 'gpu' else kind} memory (largest: {top[0]} "
                              f"{top[1] / GIB:.1f} GiB)")
        if kind == "gpu":
            share = budget / scale.gpus_per_node
            big = max(nodes, key=lambda n: n["largest_gpu"]["bytes"])["largest_gpu"]
            if big["bytes"] > share * GIB:
                raise ConfigError(f"scale.gpu_gib_per_node={budget:g}: rank {big['rank']} needs "
                                  f"{big['bytes'] / GIB:.1f} GiB, over its GPU's share of {share:.1f} GiB")


@dataclass(frozen=True)
class EngineLayout:
    """The rollout engine's servers and the GPUs (ranks) of each: `servers` x `ranks` (SGLang's
    tp_size; vLLM's tensor x pipeline x data parallel world of one server), packed on nodes of
    `gpus_per_node`: servers smaller than a node share one, a larger one spans ranks / gpus_per_node."""
    servers: int
    ranks: int

    @classmethod
    def parse(cls, text: str) -> "EngineLayout":
        s, x, r = text.strip().lower().partition("x")
        if not (x and s.isdigit() and r.isdigit() and int(s) > 0 and int(r) > 0):
            raise ValueError(f"--engines: {text!r} is not SERVERSxRANKS (e.g. 2x8: two servers of 8 GPUs)")
        return cls(int(s), int(r))

    def __str__(self) -> str:
        return f"{self.servers}x{self.ranks}"

    @property
    def engine_ranks(self) -> int:
        return self.servers * self.ranks

    def nodes(self, gpus_per_node: int) -> int:
        if self.ranks >= gpus_per_node:
            return self.servers * -(-self.ranks // gpus_per_node)
        return -(-self.servers // (gpus_per_node // self.ranks))


def engine_modes(backend: str) -> tuple[str, ...]:
    """The weight-sync modes a config can choose for `backend` (the Literal of
    rollout.<backend>.weight_sync, so a new mode joins the refit plan or fails it); none for the
    in-process engine."""
    import typing

    from gspo_megatron.config import SGLangConfig, VLLMConfig

    cls = {"sglang": SGLangConfig, "vllm": VLLMConfig}.get(backend)
    return typing.get_args(typing.get_type_hints(cls)["weight_sync"]) if cls else ()


def config_layout(cfg, world: int, gpus_per_node: int) -> EngineLayout | None:
    """The engine layout the config describes: SGLang's tp per server, and its servers (colocated:
    every trainer node's GPUs split into engines of tp x dp, rollout/colocate.py engines_per_node;
    else its urls, one where a file lists them); vLLM's parallel world per server
    (rollout/vllm_server.py parallel_size) and its replicas (launched) or urls. None for the
    in-process engine (no push)."""
    r = cfg.rollout
    if r.backend == "sglang":
        sg = r.sglang
        if sg.launch:
            from gspo_megatron.rollout.colocate import engines_per_node

            return EngineLayout(-(-world // gpus_per_node) * engines_per_node(gpus_per_node, sg.tp, sg.dp), sg.tp)
        return EngineLayout(max(1, len(sg.urls)), sg.tp)
    if r.backend == "vllm":
        from gspo_megatron.rollout.vllm_server import parallel_size

        v = r.vllm
        return EngineLayout(v.replicas if v.launch else max(1, len(v.urls)), parallel_size(v.extra_args))
    return None


def refit_plan(refit0: dict, backend: str, layouts: list[EngineLayout], links, world: int) -> list[dict]:
    """The weight push per weight-sync mode of `backend` and engine layout: from rank 0's measured
    export (`refit0`: what it gathers, pushes, in how many buckets, its peak), the bytes and
    requests on each side, the collectives, the engines' peak extra memory, and a predicted time.

    What each side does, from the engines' source (SGLang 0.5.23, vLLM 0.32.0):
    * `distributed` (SGLang) and `nccl` (vLLM): one group of rank 0 and every engine rank, one
      broadcast per tensor from rank 0 (rollout/weight_sync.py DistributedSync, rollout/vllm_nccl.py).
      SGLang allocates every tensor of a request before loading any
      (model_runner_components/weight_updater.py:286 `torch.empty` per name, waited at :297): a
      bucket extra on every engine rank. vLLM receives and loads one tensor at a time
      (distributed/weight_transfer/nccl_engine.py:223-228): the largest tensor extra. Time: the
      pushed bytes once over rank 0's NIC (a ring broadcast is pipelined: the slowest link, not the
      receivers, sets it); every engine node receives them once across the network.
    * `tensor` (SGLang, colocated): CUDA IPC handles of rank 0's bucket, one payload per engine rank;
      each rank maps it and copies it whole to its own GPU before loading
      (weight_updater.py:447 `tensor.to(device)`): a bucket extra per engine rank, and every byte
      read out of GPU 0 by each engine rank but the one on GPU 0 (its NVLink, one after another).
      Refused when the trainer spans more than one node (rollout/colocate.py check_colocated).
    * `disk`: rank 0 writes the HF checkpoint (its host peak: the export's shard), every server
      rank reads every file (the loaders iterate the whole checkpoint one tensor at a time off a
      memory map: SGLang's model_loader/weight_utils.py:1177-1179 and, by default, vLLM's
      model_executor/model_loader/weight_utils.py safetensors_weights_iterator, which
      rollout/vllm_worker.py reloads through: the largest tensor on the host per rank, copied into
      the parameters); a node's ranks share its page cache, so the file system serves the bytes
      once per engine node, nodes in parallel.
      Time: written once and read once at the file system's per-node bandwidth.
    The gather into rank 0 (its receives inside / across its node) comes first in every mode."""
    gb = 1e9
    push, n_t, n_b = refit0["push_bytes"], refit0["tensors"], refit0["buckets"]
    gather = refit0["recv_intra"] / (links.nvlink_gbs * gb) + refit0["recv_inter"] / (links.ib_gbs * gb)
    trainer_nodes = -(-world // links.gpus_per_node)
    rows = []
    for mode in engine_modes(backend):
        for lay in layouts:
            n, nodes = lay.engine_ranks, lay.nodes(links.gpus_per_node)
            row = {"mode": mode, "layout": str(lay), "engine_ranks": n, "engine_nodes": nodes, "gather_s": gather,
                   "trainer_peak_gpu": refit0["peak_extra_bytes"], "trainer_host_peak": 0, "engine_host_peak": 0,
                   "refused": None}
            if mode in ("distributed", "nccl"):
                row.update(collectives=f"{n_t} broadcasts, group of {1 + n}", requests=n_b * lay.servers,
                           trainer_sends=push, engine_rank_receives=push, network_bytes=push * nodes,
                           engine_peak_gpu=refit0["largest_bucket"] if mode == "distributed" else refit0["largest_tensor"],
                           push_s=push / (links.ib_gbs * gb))
            elif mode == "tensor":
                readers = n - 1  # the engine rank on GPU 0 reads its own memory
                row.update(collectives=f"{n_t * n} IPC handles", requests=n_b * lay.servers,
                           trainer_sends=push * readers, engine_rank_receives=push, network_bytes=0,
                           engine_peak_gpu=refit0["largest_bucket"], push_s=push * readers / (links.nvlink_gbs * gb))
                if trainer_nodes > 1:
                    row["refused"] = (f"trainer on {trainer_nodes} nodes, CUDA IPC reaches rank 0's node only "
                                      "(rollout/colocate.py check_colocated)")
                elif n > links.gpus_per_node:
                    row["refused"] = f"{n} engine ranks do not fit on rank 0's node"
            elif mode == "disk":
                row.update(collectives="none", requests=lay.servers, trainer_sends=push, engine_rank_receives=push,
                           network_bytes=push * (1 + nodes), engine_peak_gpu=0, engine_host_peak=refit0["largest_tensor"],
                           trainer_host_peak=refit0.get("hf_export_host_peak", 0),
                           push_s=2 * push / (links.disk_gbs * gb))
            else:
                raise ValueError(f"refit_plan: {backend} weight_sync={mode} is not modelled")
            row["total_s"] = gather + row["push_s"]
            rows.append(row)
    return rows


def _fmt(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def main(argv=None) -> int:
    from gspo_megatron.cli_util import user_errors
    from gspo_megatron.errors import ConfigError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.http_servers import EngineError

    ap = argparse.ArgumentParser(prog="gspo_megatron.train --simulate", description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--world-size", type=int, default=None)
    ap.add_argument("--ranks", default=None, help="comma-separated global ranks (default: each stage's first, the last)")
    ap.add_argument("--engines", default=None,
                    help="engine layouts for the refit plan, SERVERSxRANKS comma-separated (default: the config's)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)
    with user_errors("gspo_megatron.train --simulate"):
        cfg = load_config(args.config, [*args.overrides, "parallel.device=cpu"])
        world = args.world_size or cfg.parallel.world_size
        if world is None:
            raise ConfigError("--simulate needs --world-size (the config sets no parallel.world_size)")
        ranks = None if args.ranks is None else [int(x) for x in args.ranks.split(",") if x.strip()]
        scale = cfg.scale
        try:
            layouts = ([EngineLayout.parse(x) for x in args.engines.split(",") if x.strip()] if args.engines else
                       [x for x in [config_layout(cfg, world, scale.gpus_per_node)] if x is not None])
        except (ValueError, EngineError) as e:  # a bad --engines; colocated engines that do not split a node
            raise ConfigError(str(e)) from None
        from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

        skip_compiled_fusions()
        reports = simulate(cfg, world, ranks, nproc_per_node=scale.gpus_per_node)
        nodes = None
        if ranks is None:  # every stage simulated: every node's totals, checked against the budgets
            from gspo_megatron.planner import plan

            acts = {st["pp_rank"]: int(st["memory_gib"]["activations"] * GIB) for st in plan(cfg, world)["stages"]}
            nodes = node_totals(reports, world, cfg.parallel.pp, scale.gpus_per_node, acts)
        rank0 = next((r for r in reports if r.rank == 0), None)
        plan = refit_plan(rank0.refit, cfg.rollout.backend, layouts, scale, world) if rank0 is not None else None
        out = {"world_size": world, "ranks": [asdict(r) for r in reports], "nodes": nodes, "refit_plan": plan,
               "backend": cfg.rollout.backend, "scale": asdict(scale)}
        _print(args, out, reports)
        if nodes is not None:
            check_budgets(nodes, scale)
    return 0


def _print(args, out: dict, reports: list[RankReport]) -> None:
    if args.json:
        print(json.dumps(out))
        return
    world, plan, nodes, scale = out["world_size"], out["refit_plan"], out["nodes"], out["scale"]
    print(f"gspo-megatron simulate: {args.config}, world size {world} (meta device, fake process group)")
    for r in reports:
        c = r.coords
        print(f"rank {r.rank} (pp {c['pp']} tp {c['tp']} ep {c['ep']} etp {c['etp']} dp {c['dp']} cp {c['cp']}): "
              f"{r.params:,} parameters in {r.seconds:.1f} s")
        print("  GPU:  " + " | ".join(f"{k} {_fmt(v)}" for k, v in r.gpu.items()) + f" | total {_fmt(r.gpu_total)}")
        if r.host:
            print("  host: " + " | ".join(f"{k} {_fmt(v)}" for k, v in r.host.items()))
        f = r.refit
        print(f"  push: sends {_fmt(f['send_intra'])} in node + {_fmt(f['send_inter'])} across, receives "
              f"{_fmt(f['recv_intra'])} + {_fmt(f['recv_inter'])} ({f['p2p_ops']} transfers); peak extra "
              f"{_fmt(f['peak_extra_bytes'])}" + (f"; to the engine {f['tensors']} tensors, {_fmt(f['push_bytes'])} "
                                                  f"in {f['buckets']} buckets (largest {_fmt(f['largest_bucket'])})"
                                                  if "push_bytes" in f else ""))
        for n in r.notes:
            print("  " + n)
    if plan:
        print(f"refit plan ({out['backend']}; NVLink {scale['nvlink_gbs']:g} GB/s, InfiniBand {scale['ib_gbs']:g} GB/s, "
              f"file system {scale['disk_gbs']:g} GB/s per node; engines SERVERSxRANKS):")
        for p in plan:
            print(f"  {p['mode']} {p['layout']}: " + (f"refused: {p['refused']}" if p["refused"] else (
                f"{p['total_s']:.1f} s (gather {p['gather_s']:.1f} + push {p['push_s']:.1f}); rank 0 sends "
                f"{_fmt(p['trainer_sends'])}, each of {p['engine_ranks']} engine ranks receives "
                f"{_fmt(p['engine_rank_receives'])} (peak extra GPU {_fmt(p['engine_peak_gpu'])}, host "
                f"{_fmt(p['engine_host_peak'])}); {p['collectives']}, "
                f"{p['requests']} requests; {_fmt(p['network_bytes'])} across the network")))
    if nodes:
        worst = max(nodes, key=lambda n: sum(n["gpu"].values()))
        for n in dict.fromkeys([0, worst["node"]]):
            node = nodes[n]
            print(f"node {n} ({scale['gpus_per_node']} GPUs): GPU {_fmt(sum(node['gpu'].values()))} ("
                  + " | ".join(f"{k} {_fmt(v)}" for k, v in node["gpu"].items()) + ")"
                  + (f"; host {_fmt(sum(node['host'].values()))}" if node["host"] else ""))
        for kind in ("gpu", "host"):
            budget = scale[f"{kind}_gib_per_node"]
            if budget is not None:
                need = max(sum(n[kind].values()) for n in nodes)
                print(f"{kind} budget per node {budget:g} GiB: the fullest node needs {_fmt(need)}")

if __name__ == "__main__":
    sys.exit(main())
