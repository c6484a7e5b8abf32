"""Trainer checkpoint save and resume: throughput against a plain copy, resume memory per rank.

    python bench/bench_checkpoint.py                      # ~1 GiB fp32 model, layouts tp2 and dp2
    python bench/bench_checkpoint.py --size-gb 0.1        # quick
    python bench/bench_checkpoint.py --layouts dp2 --keep --json out.json
    python bench/bench_checkpoint.py --size-gb 0.3 --profile 40   # where rank 0's save / load time goes
    python bench/bench_checkpoint.py --smoke                      # smallest model, dp2: does it run (~1 min)

The model is the synthetic Qwen3-MoE of bench/bench_load.py (`choose_config`: hidden 1024, 16/4
heads, 32 experts, vocab 32000; layers and moe_intermediate_size chosen so that the fp32
parameters are --size-gb GiB), built with Megatron's random init: no HF checkpoint is written.
The checkpoint is the trainer's own (gspo_megatron/train/checkpoint.py: one Megatron
dist_checkpointing torch_dist directory with the model, the distributed optimizer's fully
reshardable state, common.pt, per-rank RNG files and hf_config/).

Layouts (2 gloo processes each, 1 thread per process, spawned by tests/dist_utils.py):
  tp2   TP2 + sequence parallel, DP1 (the experts are replicated on both TP ranks: ETP1, EP1)
  dp2   TP1, DP2: both ranks hold the whole model; the distributed optimizer shards the Adam state
        over DP

For each layout, in order:
  SAVE run    (--writer auto: each DP rank writes its own shard, train/checkpoint_shards.py; --writer
              megatron: Megatron's save, which gathers the optimizer state first)
              one spawn: init_parallel(ParallelConfig(tp, ep, sequence_parallel=tp>1, device="cpu")),
              build_policy(ctx, arch, dtype=float32), wrap_ddp(use_distributed_optimizer=True),
              build_optimizer(OptimizerConfig(lr=1e-4)), ONE optimizer step on 2 sequences of 16
              tokens (token NLL, as tests/test_dist_optimizer.py does) so that Adam's moments exist,
              then train.checkpoint.save(...). "save s": wall seconds on rank 0 between a barrier
              before and one after the call; "bytes": the size of the written step directory (all
              files); "save GB/s" = bytes / save s (GB = 1e9). "save peak": VmHWM after the save,
              reset (bench/common.py reset_peak) right before it, max over ranks; "save ovh" = save
              peak - VmRSS before the save; "written": wchar of /proc/self/io during the save (bytes
              through write system calls: the rank's checkpoint files, plus socket traffic if gloo
              sends with write). Each rank also sends checksums of its parameters and of its Adam
              moments (float64 sum and sum of squares).
  COPY        the step directory copied file by file (shutil.copyfile, i.e. sendfile) into another
              directory of the same filesystem, each file fsync'ed (DCP's FileSystemWriter fsyncs
              every file it writes); "copy GB/s" = bytes / seconds; "save/copy" = save GB/s / copy
              GB/s (target: >= 0.50). The source files are in the page cache (just written).
              Measured twice: by rank 0 inside the save run right after the save, while every rank
              is alive and holds its memory (the other ranks wait at a barrier): "copy GB/s", the
              target's reference; and by the bench's own process after the ranks have exited:
              "copy GB/s (exited)". They differ on this machine (a Firecracker VM): writing into
              the page cache is 2-5x faster into memory that was freed a moment ago (here: the
              exited ranks' ~7 GB) than into memory that has been free for a while (the guest
              appears to hand free memory back to the host, so it is faulted in again on first
              use; a 2-process test writing the same 2 GB per rank from the same tensors measured
              0.38 GB/s per rank into long-free memory, 1.3 GB/s after 4 GB had just been freed).
  WARM        so right before the save each rank touches and frees its share of 1.2 x (4 x the fp32
              parameter bytes: the checkpoint's size), and rank 0 the whole of it right before the
              in-run copy: both then write into just-freed memory, like the copy after exit (and
              like a save that follows other work on a long-running trainer). --no-warm turns it
              off: then the in-run copy measured 0.40 GB/s against 1.65-2.03 GB/s after exit, and
              after Megatron's save (whose gather buffers, ~6 GB per rank, were freed just
              before) 1.5-1.8 GB/s — the reference moves with whatever ran before it.
  RESUME run  a second spawn (new processes: tests/dist_utils.py run_distributed(fresh=True)), so
              that the save's high-water mark is not in it: per rank
                baseline    VmRSS after the imports (torch, megatron, the project's modules) and
                            init_parallel;
                build       the same model + DDP + optimizer, no step ("after build": VmRSS);
                load        reset_peak(), then train.checkpoint.load(path, model, optimizer,
                            scheduler, ctx) timed like the save ("load s");
              "peak": VmHWM after the load; "resume mem" = peak - baseline: everything resuming
              costs on top of a bare process (the model, the buffers, the optimizer state and
              whatever the load needs on the way). It is compared with
                rank share  the bytes a rank must hold anyway after resuming: its parameters
                            (sum of p.numel() over the chunks' parameters, fp32) + its DDP gradient
                            buffers (grad_data of every DDP buffer, fp32: the parameters' numel plus
                            bucket padding) + its optimizer state, measured from the tensors: every
                            tensor in `inner.optimizer.state` of every inner optimizer
                            (`chained_optimizers`), storage shared with the parameters (fp32
                            "masters" are views of the fp32 parameters) excluded: Adam's exp_avg
                            and exp_avg_sq of the rank's DP shard.
              "resume/share" = resume mem / rank share, worst rank (target: <= 1.25). "load ovh" =
              peak - after build: what the load itself needs on top of the built trainer. "read":
              rchar of /proc/self/io during the load (bytes through read system calls, mostly the
              checkpoint files: how much of the checkpoint this rank reads).
              verified: after the load, each rank's parameter and Adam-moment checksums equal the
              ones the same rank sent from the save run (same layout, so the same shards); the bench
              fails otherwise.

CHECKSUMS   save and load with and without the per-file SHA-256 checksums (checkpoint/integrity.py;
            train/checkpoint.py save() hashes the published directory in `_write_checksums`, every rank
            its share of the files, rank 0 writes checksums.json; load() runs `verify_checksums` before
            anything is read). In the same two runs, after the measured save (and copy) and after the
            measured load and its memory readings, --ck-reps N (default 2) pairs of arms, the order
            alternating (off, on), (on, off), ... so that neither arm is always the earlier one:
              save  the same model and optimizer saved again into a new directory (deleted right after
                    the arm), warmed as above; "off": `_write_checksums` replaced by a no-op
                    (bench's ChecksumMeter), "on": the trainer's save as is
              load  the checkpoint just loaded loaded again into the same trainer; "off":
                    `verify_checksums` replaced by a no-op; the parameters and Adam moments after the
                    last arm must equal the ones after the measured load
            "s without" / "s with": rank 0's wall seconds between barriers (median over the arms),
            "with/without" their ratio. Because one repetition of each is noisy on a shared machine,
            the checksum call is also timed inside the "on" arms: "checksum s" (rank 0, wall, all
            ranks hashing their files in parallel then an all_gather), "with/(with-checksum)" = the
            ratio that call alone makes (median over the "on" arms of s / (s - call s): no
            between-arm noise), "checksum share" = checksum s / s with; "checksum MB/s" = all the
            checkpoint's bytes (each file hashed once, by one rank) / checksum s; "SHA-256 MB/s per
            rank" = the bytes a rank hashed / its seconds in `integrity.digest`. The files are read
            from the page cache (just written); a load after a restart reads them from disk for the
            checksums, and the state then from the page cache where memory allows, so there the
            checksums cost about one read of the files. "first (cold)": the main table's save /
            load (checksums on) and the seconds of the checksum call inside them. Peak RSS per arm:
            VmHWM after a reset right before it, max over ranks.

Memory is VmHWM / VmRSS of each rank (bench/common.py explains them; ru_maxrss is printed as a
cross-check). "after save" / "after load" is VmRSS once the phase is over and gc.collect() ran;
"trimmed" the same after glibc's malloc_trim(0): what is still resident then is held by live
objects, the difference was free memory the allocator had kept. With --profile N rank 0 runs the
save and the load under cProfile (slower) and the top N entries are printed.

The checkpoint files are read back from the page cache (this bench just wrote them): load times are
CPU/memcpy bound, not disk bound. Everything written goes into --workdir (default: a new temporary
directory) and is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, os.path.join(_ROOT, "tests"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from bench_load import checkpoint_bytes, choose_config  # noqa: E402
from common import format_table, mib, peak_rss, proc_status, reset_peak, ru_maxrss  # noqa: E402

GB = 1e9
LAYOUTS = {  # name -> (ParallelConfig kwargs, world size)
    "tp2": (dict(tp=2, ep=1), 2),
    "dp2": (dict(tp=1, ep=1), 2),
}
STEP = 1
SAVE_TARGET = 0.50  # save throughput / copy throughput, at least
RESUME_TARGET = 1.25  # resume memory / rank share, at most


# ----------------------------------------------------------------------------------------------
# inside a rank


def _init(layout: dict, cfg: dict):
    """Imports everything both runs use (so the baseline includes the modules), then the groups."""
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core  # noqa: F401
    import megatron.core.dist_checkpointing  # noqa: F401
    import torch
    import torch.distributed.checkpoint  # noqa: F401

    import gspo_megatron.checkpoint.mcore  # noqa: F401
    import gspo_megatron.model.factory  # noqa: F401
    import gspo_megatron.parallel.ddp  # noqa: F401
    import gspo_megatron.train.checkpoint  # noqa: F401
    import gspo_megatron.train.optim  # noqa: F401
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import init_parallel

    torch.set_num_threads(1)
    arch = MoeArch.from_hf_dict(cfg, source="bench_checkpoint config")
    par = ParallelConfig(tp=layout["tp"], ep=layout["ep"], sequence_parallel=layout["tp"] > 1, device="cpu")
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    return ctx, arch


def _build(ctx, arch):
    import torch

    from gspo_megatron.config import OptimizerConfig
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.train.optim import build_optimizer

    chunks, tcfg = build_policy(ctx, arch, dtype=torch.float32)
    model = wrap_ddp(chunks, tcfg, use_distributed_optimizer=True)
    opt, sched = build_optimizer(OptimizerConfig(lr=1e-4), model, total_steps=10, dtype=torch.float32)
    return model, opt, sched


def _train_one_step(ctx, arch, model, opt, sched) -> int:
    """One real optimizer step (tests/test_dist_optimizer.py::_train) on 2 x 16 tokens."""
    from types import SimpleNamespace

    import torch

    from gspo_megatron.train.batch import TrainSample, plan_minibatch
    from gspo_megatron.train.loop import _optimizer_step
    from gspo_megatron.train.loss import sft_loss_step
    from gspo_megatron.train.scoring import pad_multiple

    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, arch.vocab_size, (16,), generator=g).tolist() for _ in range(2)]
    samples = [TrainSample(s[:4], s[4:], 0.0) for s in seqs]
    mbs, _ = plan_minibatch(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=32,
                            multiple=pad_multiple(ctx.parallel), pad_id=0)
    _optimizer_step(SimpleNamespace(model=model), opt, sched, sft_loss_step(ctx, arch.vocab_size), mbs)
    return len(mbs)


def _inner(opt) -> list:
    return list(getattr(opt, "chained_optimizers", [opt]))


def _shares(model, opt) -> dict:
    """This rank's parameter, gradient-buffer and optimizer-state bytes, measured from the tensors."""
    import torch

    params = [p for m in model for p in m.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size()
                     for m in model for b in list(m.buffers) + list(m.expert_parallel_buffers)
                     if b.grad_data is not None)
    seen, state_bytes, aliased = set(), 0, 0
    for inner in _inner(opt):
        for st in inner.optimizer.state.values():
            for v in st.values():
                if not torch.is_tensor(v):
                    continue
                key = (v.data_ptr(), v.numel(), v.dtype)
                if key in seen:
                    continue
                seen.add(key)
                nb = v.numel() * v.element_size()
                if v.untyped_storage().data_ptr() in param_storages:
                    aliased += nb  # fp32 "masters": views of the parameters, no memory of their own
                else:
                    state_bytes += nb
    return dict(param_bytes=param_bytes, grad_bytes=grad_bytes, state_bytes=state_bytes, state_aliased=aliased,
                share=param_bytes + grad_bytes + state_bytes)


def _checksums(model, opt) -> dict:
    """float64 sum and sum of squares of the parameters and of each kind of Adam state, in a fixed
    order (param_groups, not the state dict's insertion order)."""
    import torch

    out = {}

    def add(k, t):
        d = t.detach().double()
        s, q = out.get(k, (0.0, 0.0))
        out[k] = (s + float(d.sum()), q + float((d * d).sum()))

    with torch.no_grad():
        for m in model:
            for p in m.parameters():
                add("params", p)
        for inner in _inner(opt):
            for group in inner.optimizer.param_groups:
                for p in group["params"]:
                    for k, v in inner.optimizer.state.get(p, {}).items():
                        if torch.is_tensor(v) and v.numel() > 1:
                            add(k, v)
    return out


def proc_io() -> dict[str, int]:
    """/proc/self/io of this process (all its threads): rchar / wchar are the bytes passed to read
    and write system calls (page-cache hits included), read_bytes / write_bytes what reached the
    block layer."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return out


def malloc_trim() -> bool:
    """Give free heap memory back to the kernel (glibc); False where unavailable."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


class _Profile:
    """cProfile of one phase on rank 0 when n > 0 (the top n entries by cumulative time)."""

    def __init__(self, n: int, rank: int):
        self.n, self.on, self.text = n, n > 0 and rank == 0, ""

    def __enter__(self):
        if self.on:
            import cProfile

            self.prof = cProfile.Profile()
            self.prof.enable()
        return self

    def __exit__(self, *exc):
        if self.on:
            import io
            import pstats

            self.prof.disable()
            s = io.StringIO()
            pstats.Stats(self.prof, stream=s).sort_stats("cumulative").print_stats(self.n)
            self.text = s.getvalue()


def warm_free_memory(nbytes: int) -> None:
    """Touch and free `nbytes` of memory, so that what is written next goes into memory that was
    just freed (see WARM in the module docstring). A large allocation is its own mmap: freed at once."""
    import torch

    if nbytes > 0:
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(1)
        del t


class ChecksumMeter:
    """The arms of the checksum comparison (CHECKSUMS in the module docstring).

    `with meter.arm(True):` times each call of train/checkpoint.py `_write_checksums` (save) and
    `verify_checksums` (load) on this rank, wall seconds including their all_gather (so rank 0's
    value is the phase's wall time), and the SHA-256 work inside them: seconds and bytes of every
    `integrity.digest` this rank ran. `with meter.arm(False):` replaces both calls with no-ops: a
    save that writes no checksums.json, a load that verifies nothing; everything else is the
    trainer's code path. The module attributes are patched (save() and load() look them up at call
    time) and restored on exit."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.call_s, self.calls, self.hash_s, self.hash_bytes = 0.0, 0, 0.0, 0

    def result(self) -> dict:
        return dict(call_s=self.call_s, calls=self.calls, hash_s=self.hash_s, hash_bytes=self.hash_bytes)

    def arm(self, enabled: bool):
        from contextlib import contextmanager

        from gspo_megatron.checkpoint import integrity
        from gspo_megatron.train import checkpoint

        @contextmanager
        def patched():
            orig = (checkpoint._write_checksums, checkpoint.verify_checksums, integrity.digest)
            self.reset()

            def timed(fn):
                def wrapper(*a, **k):
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **k)
                    finally:
                        self.call_s += time.perf_counter() - t0
                        self.calls += 1
                return wrapper

            def digest(path):
                t0 = time.perf_counter()
                out = orig[2](path)
                self.hash_s += time.perf_counter() - t0
                self.hash_bytes += os.path.getsize(path)
                return out

            if enabled:
                checkpoint._write_checksums, checkpoint.verify_checksums = timed(orig[0]), timed(orig[1])
                integrity.digest = digest
            else:
                checkpoint._write_checksums = lambda directory, ctx: None
                checkpoint.verify_checksums = lambda directory, ctx: False
            try:
                yield self
            finally:
                checkpoint._write_checksums, checkpoint.verify_checksums, integrity.digest = orig

        return patched()


def _arm_order(rep: int) -> tuple[str, str]:
    """off/on alternating over repetitions, so neither arm is always the first."""
    return ("off", "on") if rep % 2 == 0 else ("on", "off")


def _save_rank(rank: int, world: int, layout: dict, cfg: dict, out_dir: str, profile: int = 0,
               writer: str = "auto", warm_bytes: int = 0, ck_reps: int = 1) -> dict:
    import gc

    import torch.distributed as dist

    from gspo_megatron.parallel.state import destroy_parallel
    from gspo_megatron.train import checkpoint

    ctx, arch = _init(layout, cfg)
    try:
        model, opt, sched = _build(ctx, arch)
        n_micro = _train_one_step(ctx, arch, model, opt, sched)
        out = {"rank": rank, "n_micro": n_micro, "shares": _shares(model, opt), "sums": _checksums(model, opt)}
        gc.collect()
        warm_free_memory(warm_bytes // world)
        dist.barrier()
        out["before"] = proc_status()
        out["reset_ok"] = reset_peak()
        io0 = proc_io()
        dist.barrier()
        meter = ChecksumMeter()
        t0 = time.perf_counter()
        with _Profile(profile, rank) as prof, meter.arm(True):
            path = checkpoint.save(out_dir, STEP, model, opt, sched, {"step": STEP, "bench": True}, ctx,
                                   hf_config=cfg, writer=writer)
        dist.barrier()
        out["save_s"] = time.perf_counter() - t0
        out["save_ck"] = meter.result()
        out["peak"] = peak_rss()
        out["ru_maxrss"] = ru_maxrss()
        io1 = proc_io()
        out["wchar"] = io1["wchar"] - io0["wchar"]
        # the plain copy under the same conditions as the save: ranks alive, same free memory
        # (see "COPY" in the module docstring); rank 0 copies while the others wait
        if rank == 0:
            warm_free_memory(warm_bytes)
            out["copy_s"] = plain_copy(path, out_dir + ".copy-in-run")
            shutil.rmtree(out_dir + ".copy-in-run")
        dist.barrier()
        gc.collect()
        out["after_save"] = proc_status()
        malloc_trim()
        out["after_trim"] = proc_status()
        out["path"] = path
        out["profile"] = prof.text
        # CHECKSUMS: the same save again, without and with checksums, each into its own directory
        # (deleted right after: the page cache and the disk hold one extra checkpoint at a time)
        out["ck_arms"] = []
        for rep in range(ck_reps):
            for arm in _arm_order(rep):
                arm_dir = f"{out_dir}.ck-{arm}{rep}"
                gc.collect()
                warm_free_memory(warm_bytes // world)
                dist.barrier()
                before = proc_status()["VmRSS"]
                reset_peak()
                dist.barrier()
                t0 = time.perf_counter()
                with meter.arm(arm == "on"):
                    checkpoint.save(arm_dir, STEP, model, opt, sched, {"step": STEP, "bench": True}, ctx,
                                    hf_config=cfg, writer=writer)
                dist.barrier()
                out["ck_arms"].append(dict(arm=arm, rep=rep, s=time.perf_counter() - t0, peak=peak_rss(),
                                           before=before, **meter.result()))
                if rank == 0:
                    shutil.rmtree(arm_dir)
                dist.barrier()
        return out
    finally:
        destroy_parallel()


def _load_rank(rank: int, world: int, layout: dict, cfg: dict, path: str, profile: int = 0,
               ck_reps: int = 1) -> dict:
    import gc

    import torch.distributed as dist

    from gspo_megatron.parallel.state import destroy_parallel
    from gspo_megatron.train import checkpoint

    ctx, arch = _init(layout, cfg)
    try:
        gc.collect()
        out = {"rank": rank, "baseline": proc_status()}
        model, opt, sched = _build(ctx, arch)
        gc.collect()
        out["after_build"] = proc_status()
        dist.barrier()
        out["reset_ok"] = reset_peak()
        io0 = proc_io()
        dist.barrier()
        meter = ChecksumMeter()
        t0 = time.perf_counter()
        with _Profile(profile, rank) as prof, meter.arm(True):
            loop = checkpoint.load(path, model, opt, sched, ctx)
        dist.barrier()
        out["load_s"] = time.perf_counter() - t0
        out["load_ck"] = meter.result()
        out["peak"] = peak_rss()
        out["ru_maxrss"] = ru_maxrss()
        io1 = proc_io()
        out["rchar"] = io1["rchar"] - io0["rchar"]
        gc.collect()
        out["after_load"] = proc_status()
        malloc_trim()
        out["after_trim"] = proc_status()
        out["profile"] = prof.text
        out["loop"] = loop
        out["shares"] = _shares(model, opt)
        out["sums"] = _checksums(model, opt)
        # CHECKSUMS: the same load again into the same trainer, without and with verification
        out["ck_arms"] = []
        for rep in range(ck_reps):
            for arm in _arm_order(rep):
                gc.collect()
                malloc_trim()
                dist.barrier()
                before = proc_status()["VmRSS"]
                reset_peak()
                dist.barrier()
                t0 = time.perf_counter()
                with meter.arm(arm == "on"):
                    loop2 = checkpoint.load(path, model, opt, sched, ctx)
                dist.barrier()
                out["ck_arms"].append(dict(arm=arm, rep=rep, s=time.perf_counter() - t0, peak=peak_rss(),
                                           before=before, loop_ok=loop2 == loop, **meter.result()))
        if ck_reps:
            out["ck_sums_ok"] = _checksums(model, opt) == out["sums"]
        return out
    finally:
        destroy_parallel()


# ----------------------------------------------------------------------------------------------
# driver


def dir_bytes(path: str) -> tuple[int, int]:
    """(total bytes, number of files) under path."""
    total = n = 0
    for d, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(d, f))
            n += 1
    return total, n


def plain_copy(src: str, dst: str) -> float:
    """Copy src into dst (a new directory) file by file, fsync'ing each file; returns seconds."""
    t0 = time.perf_counter()
    for d, _, files in os.walk(src):
        target = os.path.join(dst, os.path.relpath(d, src))
        os.makedirs(target, exist_ok=True)
        for f in files:
            out = os.path.join(target, f)
            shutil.copyfile(os.path.join(d, f), out)
            fd = os.open(out, os.O_WRONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - t0


def run_layout(name: str, cfg: dict, workdir: str, args) -> dict:
    from dist_utils import run_distributed

    layout, world = LAYOUTS[name]
    base = os.path.join(workdir, name)
    os.makedirs(base, exist_ok=False)
    try:
        t0 = time.perf_counter()
        saved = run_distributed(_save_rank, world, layout, cfg, os.path.join(base, "run"), args.profile,
                                args.writer, 0 if args.no_warm else int(1.2 * checkpoint_bytes(cfg) * 4),
                                args.ck_reps, timeout=args.timeout, fresh=True)
        path = saved[0]["path"]
        nbytes, nfiles = dir_bytes(path)
        print(f"  {name}: save run done in {time.perf_counter() - t0:.0f} s (spawn + build + step + save); "
              f"{mib(nbytes)} MiB in {nfiles} files", flush=True)

        copy_dir = os.path.join(base, "copy")
        copy_s = plain_copy(path, copy_dir)
        copied, _ = dir_bytes(copy_dir)
        assert copied == nbytes, (copied, nbytes)
        shutil.rmtree(copy_dir)
        print(f"  {name}: plain copy {saved[0]['copy_s']:.2f} s with the ranks alive, {copy_s:.2f} s after they "
              "exited", flush=True)

        t0 = time.perf_counter()
        loaded = run_distributed(_load_rank, world, layout, cfg, path, args.profile, args.ck_reps,
                                 timeout=args.timeout, fresh=True)
        print(f"  {name}: resume run done in {time.perf_counter() - t0:.0f} s (spawn + build + load)", flush=True)
        for what, res in (("save", saved), ("load", loaded)):
            if res[0]["profile"]:
                print(f"--- {name}: rank 0 {what} profile (cumulative) ---\n{res[0]['profile']}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    bad = []
    for s, l in zip(saved, loaded):
        if s["sums"] != l["sums"]:
            bad.append(f"rank {s['rank']}: saved {s['sums']} loaded {l['sums']}")
        if l["loop"] != {"step": STEP, "bench": True}:
            bad.append(f"rank {s['rank']}: loop state {l['loop']}")
        if not l.get("ck_sums_ok", True) or not all(a["loop_ok"] for a in l["ck_arms"]):
            bad.append(f"rank {s['rank']}: the state after the checksum comparison's loads differs")
    if bad:
        raise AssertionError(f"{name}: the resumed state differs from the saved one:\n" + "\n".join(bad))
    return dict(layout=name, world=world, bytes=nbytes, files=nfiles, copy_s=saved[0]["copy_s"],
                copy_after_exit_s=copy_s, save=saved, load=loaded,
                path=path if args.keep else None)


def summarize(r: dict) -> dict:
    save_s = r["save"][0]["save_s"]
    load_s = r["load"][0]["load_s"]
    save_bw, copy_bw = r["bytes"] / save_s / GB, r["bytes"] / r["copy_s"] / GB
    copy_exit_bw = r["bytes"] / r["copy_after_exit_s"] / GB
    per_rank = []
    for s, l in zip(r["save"], r["load"]):
        resume = l["peak"] - l["baseline"]["VmRSS"]
        share = l["shares"]["share"]
        per_rank.append(dict(rank=s["rank"], save_before=s["before"]["VmRSS"], save_peak=s["peak"],
                             save_ovh=s["peak"] - s["before"]["VmRSS"], baseline=l["baseline"]["VmRSS"],
                             after_build=l["after_build"]["VmRSS"], load_peak=l["peak"],
                             load_ru_maxrss=l["ru_maxrss"], load_ovh=l["peak"] - l["after_build"]["VmRSS"],
                             after_load=l["after_load"]["VmRSS"], after_load_trim=l["after_trim"]["VmRSS"],
                             after_save=s["after_save"]["VmRSS"], after_save_trim=s["after_trim"]["VmRSS"],
                             wchar=s["wchar"], rchar=l["rchar"], resume=resume, share=share,
                             resume_ratio=resume / share, **{k: l["shares"][k] for k in
                                                            ("param_bytes", "grad_bytes", "state_bytes")}))
    worst = max(per_rank, key=lambda x: x["resume_ratio"])
    return dict(layout=r["layout"], bytes=r["bytes"], files=r["files"], save_s=save_s, save_gbps=save_bw,
                copy_s=r["copy_s"], copy_gbps=copy_bw, save_over_copy=save_bw / copy_bw,
                copy_exit_gbps=copy_exit_bw, save_over_copy_exit=save_bw / copy_exit_bw,
                save_peak_max=max(x["save_peak"] for x in per_rank), load_s=load_s,
                resume_max=worst["resume"], share_of_worst=worst["share"], resume_ratio=worst["resume_ratio"],
                save_ok=save_bw / copy_bw >= SAVE_TARGET, resume_ok=worst["resume_ratio"] <= RESUME_TARGET,
                per_rank=per_rank)


def summarize_checksums(r: dict) -> list[dict]:
    """Per phase (save, load): the arms without / with checksums (medians over --ck-reps), rank 0's
    wall seconds; SHA-256 bytes and seconds per rank."""
    import statistics

    out = []
    for phase, res, first_key in (("save", r["save"], "save_ck"), ("load", r["load"], "load_ck")):
        arms = [{a: [x for x in rk["ck_arms"] if x["arm"] == a] for a in ("off", "on")} for rk in res]
        if not arms[0]["off"] or not arms[0]["on"]:
            continue
        off_s = statistics.median(x["s"] for x in arms[0]["off"])
        on_s = statistics.median(x["s"] for x in arms[0]["on"])
        ck_s = statistics.median(x["call_s"] for x in arms[0]["on"])
        hashed = sum(a["on"][0]["hash_bytes"] for a in arms)  # every file once, over the ranks
        per_rank = [sum(x["hash_bytes"] for x in a["on"]) / max(1e-9, sum(x["hash_s"] for x in a["on"])) / 1e6
                    for a in arms]
        out.append(dict(layout=r["layout"], phase=phase, bytes=r["bytes"], off_s=off_s, on_s=on_s,
                        off_runs=[x["s"] for x in arms[0]["off"]], on_runs=[x["s"] for x in arms[0]["on"]],
                        ratio=on_s / off_s, ck_s=ck_s, ck_share=ck_s / on_s, hashed=hashed,
                        ratio_call=statistics.median(x["s"] / (x["s"] - x["call_s"]) for x in arms[0]["on"]),
                        ck_mbps=hashed / ck_s / 1e6, hash_mbps_min=min(per_rank), hash_mbps_max=max(per_rank),
                        hash_bytes_max=max(a["on"][0]["hash_bytes"] for a in arms),
                        peak_off=max(x["peak"] for a in arms for x in a["off"]),
                        peak_on=max(x["peak"] for a in arms for x in a["on"]),
                        ovh_off=max(x["peak"] - x["before"] for a in arms for x in a["off"]),
                        ovh_on=max(x["peak"] - x["before"] for a in arms for x in a["on"]),
                        first_ck_s=res[0][first_key]["call_s"], first_s=res[0][f"{phase}_s"]))
    return out


def report_checksums(rows: list[dict], reps: int) -> str:
    headers = ["layout", "phase", "s without", "s with", "with/without", "checksum s", "with/(with-checksum)",
               "checksum share",
               "hashed MiB", "checksum MB/s", "SHA-256 MB/s per rank", "peak RSS without", "peak RSS with",
               "first (cold) s", "of which checksum s"]
    trows = [[r["layout"], r["phase"], f"{r['off_s']:.2f}", f"{r['on_s']:.2f}", f"{r['ratio']:.2f}",
              f"{r['ck_s']:.2f}", f"{r['ratio_call']:.2f}", f"{100 * r['ck_share']:.0f}%", mib(r["hashed"]),
              f"{r['ck_mbps']:,.0f}",
              f"{r['hash_mbps_min']:,.0f}-{r['hash_mbps_max']:,.0f}", mib(r["peak_off"]), mib(r["peak_on"]),
              f"{r['first_s']:.2f}", f"{r['first_ck_s']:.2f}"] for r in rows]
    title = (f"Checksums (SHA-256 of every file; train/checkpoint.py _write_checksums on save, verify_checksums "
             f"on load), {'median of ' + str(reps) + ' ' if reps > 1 else ''}off/on pair{'s' if reps > 1 else ''} "
             "per phase after the measured save / load; seconds on rank 0, memory in MiB (max rank)")
    out = ["", format_table(headers, trows, title), "",
           "s without / s with = the save (load) with the checksum call replaced by a no-op / the trainer's own;",
           "  with/without = their ratio (two arms: includes their run-to-run noise); checksum s = wall seconds of the",
           "  checksum call in the 'with' arm (all ranks hash their share of the files in parallel, then all_gather);",
           "  with/(with-checksum) = the ratio from the timed call alone (per 'with' arm, median): the cost without",
           "  the between-arm noise; checksum share = checksum s / s with;",
           "  checksum MB/s = hashed bytes (every file of the checkpoint once) / checksum s; SHA-256 MB/s per rank =",
           "  the rank's hashed bytes / its seconds in integrity.digest (min-max over ranks); files are read from",
           "  the page cache (just written). first (cold): the main table's save / load (checksums on) and the",
           "  checksum call's seconds inside it. Details: CHECKSUMS in the module docstring."]
    for r in rows:
        if len(r["off_runs"]) > 1:
            out.append(f"{r['layout']} {r['phase']}: without {', '.join(f'{x:.2f}' for x in r['off_runs'])} s; "
                       f"with {', '.join(f'{x:.2f}' for x in r['on_runs'])} s")
    return "\n".join(out)


def report(summ: list[dict], cfg: dict, param_total: int) -> str:
    headers = ["layout", "bytes MiB", "save s", "save GB/s", "copy GB/s", "save/copy", "copy GB/s (exited)",
               "save/copy (exited)", "save peak (max rank)", "load s", "resume mem (max rank)", "rank share",
               "resume/share"]
    rows = [[s["layout"], mib(s["bytes"]), f"{s['save_s']:.2f}", f"{s['save_gbps']:.3f}", f"{s['copy_gbps']:.3f}",
             f"{s['save_over_copy']:.2f}", f"{s['copy_exit_gbps']:.3f}", f"{s['save_over_copy_exit']:.2f}",
             mib(s["save_peak_max"]), f"{s['load_s']:.2f}", mib(s["resume_max"]),
             mib(s["share_of_worst"]), f"{s['resume_ratio']:.2f}"] for s in summ]
    title = (f"Trainer checkpoint, {mib(param_total)} MiB of fp32 parameters (layers {cfg['num_hidden_layers']}, "
             f"experts {cfg['num_experts']} x moe_intermediate {cfg['moe_intermediate_size']}, vocab "
             f"{cfg['vocab_size']}); 2 gloo ranks per layout; memory in MiB, GB = 1e9 bytes")
    out = ["", format_table(headers, rows, title), ""]
    dh = ["layout/rank", "params", "grads", "opt state", "share", "save before", "save peak", "save ovh",
          "after save", "trimmed", "written", "baseline", "after build", "load peak", "ru_maxrss", "load ovh",
          "after load", "trimmed", "read", "resume mem", "/share"]
    drows = []
    for s in summ:
        for x in s["per_rank"]:
            drows.append([f"{s['layout']}/{x['rank']}", mib(x["param_bytes"]), mib(x["grad_bytes"]),
                          mib(x["state_bytes"]), mib(x["share"]), mib(x["save_before"]), mib(x["save_peak"]),
                          mib(x["save_ovh"]), mib(x["after_save"]), mib(x["after_save_trim"]), mib(x["wchar"]),
                          mib(x["baseline"]), mib(x["after_build"]), mib(x["load_peak"]), mib(x["load_ru_maxrss"]),
                          mib(x["load_ovh"]), mib(x["after_load"]), mib(x["after_load_trim"]), mib(x["rchar"]),
                          mib(x["resume"]),
                          f"{x['resume_ratio']:.2f}"])
    out.append(format_table(dh, drows, "Per rank (MiB)"))
    out += [
        "",
        "save/copy = save GB/s / copy GB/s (target >= %.2f); resume/share = (load peak - baseline) / (params +"
        % SAVE_TARGET,
        "  grads + opt state) of the worst rank (target <= %.2f); load ovh = load peak - after build;" % RESUME_TARGET,
        "  save ovh = save peak - VmRSS before the save; after save / after load: VmRSS after the phase and a",
        "  gc.collect(), trimmed: then after glibc malloc_trim(0) (what is left is held by live objects); written /",
        "  read: wchar / rchar of /proc/self/io during the phase (bytes through write / read system calls).",
        "  Details: the module docstring.",
    ]
    for s in summ:
        out.append(f"{s['layout']}: save/copy {s['save_over_copy']:.2f} "
                   f"{'MET' if s['save_ok'] else 'NOT MET'} (>= {SAVE_TARGET}); resume/share "
                   f"{s['resume_ratio']:.2f} {'MET' if s['resume_ok'] else 'NOT MET'} (<= {RESUME_TARGET}); "
                   f"verified: parameters and Adam moments after load == saved (checksums, every rank)")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="fp32 parameter size in GiB, approximate")
    ap.add_argument("--layouts", default="tp2,dp2", help=f"comma list of {','.join(LAYOUTS)}")
    ap.add_argument("--workdir", default=None, help="where to write (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per spawned run (all ranks)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--writer", default="auto", choices=("auto", "megatron"),
                    help="train.checkpoint.save(writer=...): auto = each DP rank writes its own shard "
                         "(train/checkpoint_shards.py); megatron = Megatron's save (gathers the optimizer state)")
    ap.add_argument("--no-warm", action="store_true", help="do not warm free memory before the save and the "
                    "in-run copy (see WARM in the docstring)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="cProfile rank 0's save and load, print the top N entries (slows them down)")
    ap.add_argument("--ck-reps", type=int, default=2, metavar="N",
                    help="off/on pairs of the checksum comparison per phase (0: none; see CHECKSUMS)")
    ap.add_argument("--smoke", action="store_true",
                    help="the smallest model (~53 MiB), layout dp2, one pair: a check that the bench runs (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gb, args.layouts, args.ck_reps = 0.05, "dp2", 1
        args.timeout = min(args.timeout, 300)
    if args.ck_reps < 0:
        ap.error("--ck-reps must be >= 0")
    layouts = [x for x in args.layouts.split(",") if x]
    bad = [x for x in layouts if x not in LAYOUTS]
    if bad or not layouts:
        ap.error(f"--layouts: unknown {bad}; choose from {list(LAYOUTS)}")
    if args.size_gb <= 0:
        ap.error("--size-gb must be > 0")

    cfg = choose_config(args.size_gb * 2**30)
    param_total = checkpoint_bytes(cfg)
    created = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="gspo-bench-ckpt-") if created else args.workdir
    os.makedirs(workdir, exist_ok=True)
    print(f"model: {mib(param_total)} MiB fp32 parameters (layers {cfg['num_hidden_layers']}, hidden "
          f"{cfg['hidden_size']}, experts {cfg['num_experts']} x moe_intermediate {cfg['moe_intermediate_size']}, "
          f"vocab {cfg['vocab_size']}); workdir {workdir}", flush=True)

    results = []
    try:
        for name in layouts:
            results.append(run_layout(name, cfg, workdir, args))
    finally:
        if not args.keep:
            if created:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                try:
                    os.rmdir(workdir)
                except OSError:
                    pass

    summ = [summarize(r) for r in results]
    print(report(summ, cfg, param_total))
    ck = [row for r in results for row in summarize_checksums(r)]
    if ck:
        print(report_checksums(ck, args.ck_reps))
    if any(not r["reset_ok"] for res in results for r in res["save"] + res["load"]):
        print("WARNING: /proc/self/clear_refs not writable: peaks include everything before the measured phase")
    if args.keep:
        print("kept: " + ", ".join(r["path"] for r in results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=cfg, param_bytes=param_total, layouts=summ, checksums=ck, raw=results), f,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
