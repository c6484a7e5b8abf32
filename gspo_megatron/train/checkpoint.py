"""Trainer checkpoints in Megatron-Core's `dist_checkpointing` (torch_dist) format: resharding on load.

Layout: <out_dir>/checkpoints/ is a Megatron-LM checkpoint root (checkpoint/megatron_dirs.py; paths
here are under gspo_megatron/): <out_dir>/checkpoints/iter_0000010/ is one torch_dist checkpoint
directory —

    metadata.json, .metadata, __*.distcp   global tensors: the model (checkpoint/layout.py keys, the
                                           ones `gspo-convert` reads and writes) and the optimizer's
                                           sharded state (`optimizer.sharded_state_dict`, fully
                                           reshardable: fp32 masters and Adam moments per parameter
                                           with the parameter's global shape)
    common.pt                              rank 0's plain state: {"trainer": scheduler, loop and
                                           data-stream state, layout}, the optimizer's param groups
    rng/rank_<r>.pt                        each rank's RNG state (restored when the layout is the same)
    hf_config/                             the HF config (+ tokenizer): `gspo-convert mcore-to-hf
                                           --load <dir>` and `model.load=<dir>` need nothing else
    run_config.yaml, _extra_state entries  what Megatron-Bridge's loaders ask for (megatron_dirs)

plus <out_dir>/checkpoints/latest_checkpointed_iteration.txt, the newest complete iteration
(Megatron-LM's tracker; runs of earlier versions wrote `latest` with a step_* name, still read).
Every rank writes its regions into a hidden temporary directory; after a barrier rank 0 renames it
into place and only then rewrites the tracker (temp file + rename), so a crash leaves the previous
checkpoint or the new one, never half of one.

With the distributed optimizer each DP rank writes the regions its own optimizer shard covers,
of the model and of the optimizer state, straight from its tensors (train/checkpoint_shards.py):
the same checkpoint as Megatron's fully_reshardable save, without the gather of the whole optimizer
state onto every DP rank that Megatron's save does first (on a 1 GB model Megatron's save was
4.4-5.6x slower and took ~5.5-6 GB more peak memory per rank; bench/bench_checkpoint.py,
docs/benchmarks.md). Other optimizers go through Megatron's save.

Resume works at another layout (TP, PP, EP, ETP, DP may all change): each rank reads the regions of
the global tensors its parameters and optimizer shards cover. The optimizer state is loaded into
the optimizer (masters included), so nothing has to be re-derived from the 16-bit weights. RNG
states are per rank and only meaningful for the same layout; at another layout the generators are
re-seeded from train.seed and the step (logged).

Departure from Megatron-LM: it stores the RNG state as a ShardedObject (pickled bytes inside the
data files, unpickled by PyTorch's DCP planner with weights_only=False); here it is a per-rank file
read with the project's restricted unpickler (checkpoint/safe_torch.py, as common.pt is), and
loading refuses ShardedObjects altogether.

Asynchronous saves (`checkpoint.async_save=true`, with the distributed optimizer): the step blocks
only to snapshot this rank's chunks and plain state into host memory; the same writer then runs
in a background thread on a group of its own (train/async_save.py says what overlaps and what is
guaranteed). The files are those of a synchronous save.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections import ChainMap

import torch
import torch.distributed as dist

log = logging.getLogger("gspo_megatron.train")

LATEST = "latest"  # the tracker of earlier versions (a step_* directory name), read for old runs
FORMAT_VERSION = 2  # 1: per-rank torch.save shards (before dist_checkpointing); not readable now
# fully_reshardable: every parameter's optimizer state in model space with its global shape, so
# TP/PP/EP/DP may all change on load (megatron/core/optimizer/distrib_optimizer.py,
# sharded_param_state_fully_reshardable). The plain optimizers ignore the key.
# chained_optim_avoid_prefix: the keys do not depend on how many optimizers Megatron chains (dense,
# experts), as in Megatron-LM's fully reshardable checkpoints (optimizer.py, ChainedOptimizer).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Optimizer state is read in pieces of about this many bytes per rank (see _load_param_state).
LOAD_CHUNK_BYTES = 256 * 1024**2


def ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def _step_name(step: int) -> str:
    from gspo_megatron.checkpoint.megatron_dirs import iter_name

    return iter_name(step)


def rng_state() -> dict:
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    state = {"torch": torch.get_rng_state(), "tracker": tracker.get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    torch.set_rng_state(state["torch"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def layout_of(ctx) -> dict:
    """What must be equal for a rank's saved RNG state to be this rank's: the parallel layout and
    the device type (a CPU run's tracker holds CPU generator states, a CUDA run's CUDA ones:
    loading one into the other fails with "RNG state is wrong size")."""
    p = ctx.parallel
    return {"world_size": ctx.world_size, "tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp, "cp": p.cp,
            "sequence_parallel": p.sequence_parallel, "device": ctx.device.type}


def same_layout(saved: dict, here: dict, rng: dict | None = None) -> bool:
    """Whether a checkpoint saved at `saved` restores its RNG states at `here`. Checkpoints from
    before the device was recorded: the device is read off their RNG file (a CUDA-capable saver
    also stored the CUDA generator, rng_state below) when given, else taken as different."""
    saved = dict(saved)
    if "device" not in saved:
        if rng is None:
            return False
        saved["device"] = "cuda" if "cuda" in rng else "cpu"
    return saved == here


def _rng_path(directory: str, rank: int) -> str:
    return os.path.join(directory, "rng", f"rank_{rank:05d}.pt")


def optimizer_state(optimizer, model_state: dict, *, is_loading: bool) -> dict:
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))


def save(out_dir: str, step: int, model, optimizer, scheduler, loop_state: dict, ctx, *, hf_config: dict,
         keep_last: int = 0, tokenizer=None, writer: str = "auto", background=None, carried_tensors=None,
         lora: dict | None = None) -> str:
    """Collective: every rank calls it. Returns the final directory.

    writer: "auto" — the distributed optimizer's state and the model are written by each DP rank
    from its own shard (train/checkpoint_shards.py), any other optimizer through Megatron's save;
    "megatron" — Megatron's save always (its fully_reshardable path gathers the optimizer state
    on every DP rank first). Both write the same checkpoint (tests/test_checkpoint.py).
    background: a train/async_save.py BackgroundSaves: with the direct writer, snapshot and return
    while its thread writes (the directory and the tracker appear when the write is done: wait()).
    carried_tensors: checkpoint/carried.py CarriedTensors stored unchanged (rank 0 writes them).
    lora: a LoRA policy's settings and base (RunParts.lora_meta): the checkpoint is adapter-only -
    the adapters and their optimizer state; the frozen base is read again from its own source on
    resume (model.hf_dir / model.load), and recorded here for gspo-convert's exports."""
    from gspo_megatron.checkpoint.mcore import model_sharded_state_dict

    if writer not in ("auto", "megatron"):
        raise ValueError(f"checkpoint.save: writer={writer!r}, expected 'auto' or 'megatron'")

    root = ckpt_root(out_dir)
    final = os.path.join(root, _step_name(step))
    if background is not None:  # at most one write in flight; its error surfaces here
        _wrap_write_errors(final, lambda: background.wait(f"before saving {_step_name(step)}"))
    else:  # (a background write checks the snapshot it writes instead: _refuse_non_finite_chunks)
        _refuse_non_finite(final, model, optimizer, ctx)  # before anything is written
    os.makedirs(root, exist_ok=True)
    from gspo_megatron.model.arch import MoeArch

    model_state = model_sharded_state_dict(model, MoeArch.from_hf_dict(hf_config, source="checkpoint.save(hf_config=...)"),
                                           trainable_only=lora is not None)
    trainer = {"format": FORMAT_VERSION, "step": step, "scheduler": scheduler.state_dict(), "loop": loop_state,
               "layout": layout_of(ctx)}
    if lora is not None:
        trainer["lora"] = dict(lora)
    return _wrap_write_errors(final, lambda: _save_collective(
        root, final, step, model, optimizer, model_state, trainer, hf_config, ctx, keep_last, tokenizer, writer,
        background, carried_tensors))


def _wrap_write_errors(final: str, fn):
    try:
        return fn()
    except (OSError, RuntimeError) as e:
        # a file-size limit (ulimit -f: EFBIG), a full disk or quota: torch reports it as an OSError,
        # or as "unexpected pos N vs M" from its zip writer (Megatron's save); one line naming the
        # target instead of a traceback (the temporary directory is removed by the writer)
        import errno

        code = getattr(e, "errno", None)
        if code in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT) or "unexpected pos" in str(e):
            from gspo_megatron.errors import CheckpointError

            why = {errno.EFBIG: "a file exceeds the process's file-size limit (ulimit -f)",
                   errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}.get(
                code, f"a write stopped short ({str(e).splitlines()[0]}): file-size limit (ulimit -f) or a full disk?")
            raise CheckpointError(f"cannot write checkpoint {final}: {why}") from None
        raise


def _refuse_non_finite(final: str, model, optimizer, ctx) -> None:
    """Collective: no checkpoint holds a NaN or inf. Every rank checks its model parameters and
    its optimizer's fp32 main parameters and Adam moments (one flag per tensor, one device sync,
    one all-reduce); any non-finite value is one CheckpointError line on every rank naming the
    first such tensor (rank order), before anything is written: the previous checkpoint and the
    tracker stay as they were. The loop skips non-finite steps (train/loop.py); this is the last
    line of defence (a checkpoint of NaN weights would be resumed from and exported)."""
    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.train.optim import inner_optimizers

    named: list[tuple[str, torch.Tensor]] = []
    for chunk in model:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:  # frozen (a LoRA base): never written, unchanged since it was loaded
                continue
            while name.startswith("module."):  # DDP / Float16Module wrappers
                name = name[len("module."):]
            named.append((f"parameter {name}", p))
    for i, opt in enumerate(inner_optimizers(optimizer)):
        inner = getattr(opt, "optimizer", None)
        for g, group in enumerate(getattr(inner, "param_groups", [])):
            for j, p in enumerate(group["params"]):
                where = f"optimizer {i} group {g} parameter {j} (shape {list(p.shape)})"
                named.append((f"the fp32 main copy of {where}", p))
                for kind, st in inner.state.get(p, {}).items():
                    if isinstance(st, torch.Tensor) and st.is_floating_point():
                        named.append((f"the {kind} of {where}", st))

    def finite(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().reshape(-1)
        if not t.is_floating_point() or t.numel() == 0:
            return torch.ones((), dtype=torch.bool, device=ctx.device)
        # in slices: the boolean temporary stays small for a large embedding
        return torch.stack([torch.isfinite(x).all() for x in t.split(1 << 26)]).all().to(ctx.device)

    flags = [finite(t) for _, t in named]
    ok = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=ctx.device)
    flag = ok.to(torch.int32).reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if int(flag):
        return
    mine = next((name for (name, _), f in zip(named, flags) if not bool(f)), None)
    found: list = [None] * ctx.world_size
    dist.all_gather_object(found, mine)
    rank, name = next((r, n) for r, n in enumerate(found) if n is not None)
    raise CheckpointError(f"refusing to save checkpoint {final}: {name} is not finite (NaN or inf) on rank {rank}; "
                          "nothing was written, the previous checkpoint and the tracker are unchanged")


def _refuse_non_finite_chunks(final: str, chunks: list, d) -> None:
    """_refuse_non_finite for a background write, on the snapshot it is about to write (the
    model's weights and the optimizer's masters and moments of this rank's shard: every rank's
    chunks together cover what _refuse_non_finite checks), collective on the writer's group `d`,
    so the step does not wait for it. Raises the same one line."""
    from gspo_megatron.errors import CheckpointError

    mine = next((f"{c.key} (the chunk at offsets {list(c.offsets)})" for c in chunks
                 if c.dtype.is_floating_point and not bool(torch.isfinite(c.produce()).all())), None)
    found: list = [None] * d.get_world_size()
    d.all_gather_object(found, mine)
    bad = next(((r, n) for r, n in enumerate(found) if n is not None), None)
    if bad is not None:
        raise CheckpointError(f"refusing to save checkpoint {final}: {bad[1]} is not finite (NaN or inf) on rank "
                              f"{bad[0]}; nothing was written, the previous checkpoint and the tracker are unchanged")


def _save_collective(root, final, step, model, optimizer, model_state, trainer, hf_config, ctx, keep_last, tokenizer,
          writer, background=None, carried_tensors=None) -> str:
    from gspo_megatron.checkpoint.mcore import model_extra_state_keys, save_mcore_checkpoint
    from gspo_megatron.train.checkpoint_shards import distributed_optimizer_plan

    rng = rng_state()  # now: a background write runs while the next steps draw from the generators

    def rank_files(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(rng, _rng_path(tmp, ctx.rank))
        if ctx.rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "hf_config"))

    plan = distributed_optimizer_plan(optimizer, model_state) if writer == "auto" else None
    # every rank must take the same path (both are collective)
    direct = torch.tensor([int(plan is not None)], device=ctx.device)
    dist.all_reduce(direct, op=dist.ReduceOp.MIN)
    if int(direct) and background is not None:
        chunks, common = plan
        allocations = background.host.allocations
        chunks, state = _snapshot(chunks, {"optimizer": common, "trainer": trainer}, ctx.device, background.host)
        if background.host.allocations != allocations:  # a new layout: say what it holds (bench/gpu_check.py reads it)
            _log_snapshot_memory(chunks, background.host, ctx.device)
        if background.extra_state_keys is None:  # the modules' entries: fixed for the run
            background.extra_state_keys = model_extra_state_keys(model)
        keys, ops = background.extra_state_keys, background.ops

        def write() -> None:
            _refuse_non_finite_chunks(final, chunks, ops)
            save_mcore_checkpoint(model, final, hf_config, model_state=model_state, write_rank_files=rank_files,
                                  tensor_chunks=chunks, common_state=state, thread_count=1, checksums=False,
                                  collectives=ops, extra_state_keys=keys, carried_tensors=carried_tensors)
            _publish(root, final, step, keep_last, ops)

        background.submit(_step_name(step), lambda: _wrap_write_errors(final, write))
        return final
    if background is not None:
        _refuse_non_finite(final, model, optimizer, ctx)
    if background is not None and ctx.rank == 0:
        log.info("checkpoint %s: written synchronously (the direct writer needs the distributed optimizer's "
                 "Adam moments, which exist after the first optimizer step)", _step_name(step))
    if int(direct):
        chunks, common = plan
        save_mcore_checkpoint(model, final, hf_config, model_state=model_state, write_rank_files=rank_files,
                              tensor_chunks=chunks, common_state={"optimizer": common, "trainer": trainer},
                              thread_count=1, checksums=False, carried_tensors=carried_tensors)
    else:
        save_mcore_checkpoint(
            model, final, hf_config, model_state=model_state, write_rank_files=rank_files,
            extra_sharded_state={"optimizer": optimizer_state(optimizer, model_state, is_loading=False),
                                 "trainer": trainer},
            checksums=False, carried_tensors=carried_tensors,
        )
    _publish(root, final, step, keep_last, dist)
    return final


def _publish(root: str, final: str, step: int, keep_last: int, d) -> None:
    """Collective on `d` (torch.distributed, or a background group's GroupOps): checksums of the
    published directory, then the tracker names it (rank 0), then older iterations are pruned."""
    d.barrier()  # the directory is in place on every rank's view
    _write_checksums(final, d)
    if d.get_rank() == 0:
        from gspo_megatron.checkpoint.megatron_dirs import write_tracker

        write_tracker(root, step)
        _prune(root, keep_last, step)
    d.barrier()


def _snapshot(chunks: list, state: dict, device: torch.device, host=None) -> tuple[list, dict]:
    """A copy in host memory of what a background write needs, taken while the step waits: every
    chunk's tensor (views into the parameters and the optimizer's buffers, which the next steps
    overwrite) and the plain state (param groups, step counters, loop state). `host`: the run's
    train/async_save.py HostSnapshot (one allocation for the whole snapshot, reused by every save
    of the same layout, page-locked once on CUDA; None: a fresh one). On CUDA the copies are issued
    without a sync each and synchronized once (a GPU run's branch, `make gpu-check`; CPU runs take
    the other, in the suite)."""
    import copy
    from dataclasses import replace

    from gspo_megatron.train.async_save import HostSnapshot

    cuda = device.type == "cuda"
    host = HostSnapshot() if host is None else host
    views = host.take([(tuple(c.sizes), c.dtype) for c in chunks])  # declared: nothing produced yet
    out = []
    for c, h in zip(chunks, views):
        t = c.produce()  # one chunk at a time (a producer's temporaries live for its copy only)
        h.copy_(t.detach(), non_blocking=cuda and t.is_cuda)
        out.append(replace(c, produce=(lambda h=h: h)))
    if cuda:
        torch.cuda.synchronize(device)
    return out, copy.deepcopy(state)


def _log_snapshot_memory(chunks: list, host, device: torch.device) -> None:
    """One line per new snapshot layout: its bytes, the page-locked bytes, and (CUDA) what torch's
    own pinned allocator holds, which the snapshot no longer uses (issue 52: `make gpu-check`
    asserts page-locked <= 1.05x the snapshot and the allocator under the snapshot's size)."""
    torch_pinned = 0
    if device.type == "cuda":
        torch_pinned = int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))
    log.info("checkpoint snapshot: %d chunks, %d bytes in one host allocation, %d page-locked, %d in torch's "
             "pinned allocator", len(chunks), sum(c.nbytes for c in chunks), host.pinned_bytes, torch_pinned)


def _write_checksums(directory: str, d) -> None:
    """Every rank hashes its share of the files; rank 0 writes checksums.json (before the tracker
    names the checkpoint, so a tracked checkpoint always has them). `d`: the collectives."""
    from gspo_megatron.checkpoint import integrity

    integrity.record(directory, d)


def verify_checksums(directory: str, ctx, require: bool = False) -> bool:
    """Collective: every rank checks its share of the files against checksums.json; any mismatch
    is one CheckpointError line naming the file, raised on every rank. False when the checkpoint
    has no checksums (saved by an earlier version: a warning naming it; refused with `require`)."""
    from gspo_megatron.checkpoint import integrity

    return integrity.verify_before_parse(directory, data=True, require=require, dist=dist)


def _prune(root: str, keep_last: int, just_written: int) -> None:
    """Keep the newest `keep_last` iterations up to the one just written; never delete a newer
    one (a run that resumed from an older checkpoint — tracker lost — must not delete the
    newer ones, nor count them and delete what it just wrote)."""
    from gspo_megatron.checkpoint.megatron_dirs import iterations

    if keep_last <= 0:
        return
    upto = [d for d in iterations(root) if int(d.split("_")[-1]) <= just_written]
    for d in upto[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def is_trainer_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, "common.pt"))


def find_latest(out_dir: str) -> str | None:
    """The checkpoint `checkpoint.resume=auto` continues from: what the tracker names when that is a
    complete trainer checkpoint; otherwise (tracker deleted, unreadable, or naming a directory that
    is missing or incomplete) the newest complete iter_* directory, with a log line saying so. None
    when there is no checkpoint at all; one CheckpointError line when there are iter_* directories
    but none is usable (nothing is deleted: the run would otherwise start over and prune them).

    "Complete" is decided from which files exist, never by parsing them: no file of a checkpoint is
    parsed before its checksums are verified (load). A complete newest iteration whose files are
    corrupted is therefore refused by load() in one line naming the file; it is never taken for an
    incomplete one and passed over for an older iteration, whose resume would then save over it."""
    from gspo_megatron.checkpoint.megatron_dirs import iterations, read_tracker

    from gspo_megatron.errors import CheckpointError

    root = ckpt_root(out_dir)
    if not os.path.isdir(root):
        return None
    try:
        name = read_tracker(root)
    except CheckpointError as e:  # an unreadable tracker is a missing one: scan
        log.warning("%s; looking for the newest complete checkpoint instead", e)
        name = None
    if name is None and os.path.isfile(os.path.join(root, LATEST)):  # a run of an earlier version
        with open(os.path.join(root, LATEST), "rb") as f:
            name = f.read().decode("utf-8", "replace").strip() or None
    if name is not None:
        d = os.path.join(root, name)
        if os.path.isfile(os.path.join(d, "meta.json")) and not is_trainer_checkpoint(d):
            raise CheckpointError(f"{d}: a checkpoint of the earlier per-rank format, which this version cannot "
                                  "resume; remove it (or set checkpoint.resume=never) to start over")
        if _complete(d):
            return d
    candidates = iterations(root)
    for it in reversed(candidates):
        d = os.path.join(root, it)
        if _complete(d):
            why = "no tracker" if name is None else f"the tracker names {name}, which is not a complete checkpoint"
            log.warning("checkpoints in %s: %s; resuming from the newest complete one, %s", root, why, it)
            return d
    if candidates:
        raise CheckpointError(f"{root}: {len(candidates)} checkpoint director{'y' if len(candidates) == 1 else 'ies'} "
                              f"({candidates[0]} .. {candidates[-1]}) but none complete (metadata.json, .metadata and "
                              "common.pt); nothing was deleted: fix or move them, or set "
                              "checkpoint.resume=never with another out_dir")
    return None


def _complete(d: str) -> bool:
    """A trainer checkpoint directory holding the files a resume reads first (nothing is parsed:
    see find_latest; a save publishes a directory whole, so only a hand-made change leaves one
    incomplete)."""
    return is_trainer_checkpoint(d) and os.path.isfile(os.path.join(d, ".metadata"))


def resolve_resume(resume: str, out_dir: str) -> str | None:
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(out_dir)
    from gspo_megatron.checkpoint.megatron_dirs import is_root, resolve

    return resolve(resume) if is_root(resume) else resume  # a root resumes from what its tracker names


def agree_on_resume(resume: str, out_dir: str, ctx) -> str | None:
    """Collective: rank 0 resolves the checkpoint to resume from and every rank takes its answer
    (each rank resolving on its own could load different iterations while another job writes).
    Rank 0 also removes temporary directories of saves that never finished (the run lock,
    train/runlock.py, guarantees no other job is writing them). A CheckpointError on rank 0 is
    raised on every rank."""
    from gspo_megatron.errors import CheckpointError

    box: list = [None, None]
    if ctx.rank == 0:
        try:
            _clean_stale_temps(ckpt_root(out_dir))
            box = [resolve_resume(resume, out_dir), None]
        except CheckpointError as e:
            box = [None, str(e)]
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointError(box[1])
    return box[0]


def _clean_stale_temps(root: str) -> None:
    """Hidden `.iter_*.tmp-*` directories of interrupted saves (each one a full checkpoint's size),
    and `.iter_*.old-*` ones of an interrupted replacement: deleted when iter_* exists, restored
    when it is missing (fsutil.recover_all), before the resume is resolved."""
    if not os.path.isdir(root):
        return
    from gspo_megatron.fsutil import recover_all

    recover_all(root)
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(".") and ".tmp" in name and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed %s, the temporary directory of a save that never finished", path)


def read_trainer_state(path: str, require_checksums: bool = False) -> dict:
    """The checkpoint's plain trainer state (common.pt, read with the restricted unpickler, after the
    checkpoint's small files are verified against its checksums)."""
    return _read_common(path, require_checksums)["trainer"]


def _read_common(path: str, require_checksums: bool = False) -> dict:
    """common.pt of a trainer checkpoint (read once per load): {"trainer": ..., "optimizer": ...}."""
    from gspo_megatron.checkpoint import integrity
    from gspo_megatron.checkpoint.megatron_load import load_common_state_dict
    from gspo_megatron.errors import CheckpointError

    if not is_trainer_checkpoint(path):
        raise CheckpointError(f"{path}: not a trainer checkpoint (no metadata.json/common.pt; written by an "
                              "older version, or not a checkpoint directory)")
    # verified before parsed (cheap: every file but the tensor data; load() has verified them all)
    integrity.verify_before_parse(path, data=False, require=require_checksums)
    common = load_common_state_dict(path)  # checkpoint/safe_torch.py: never torch.load
    trainer = common.get("trainer") if isinstance(common, dict) else None
    if not isinstance(trainer, dict) or trainer.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: common.pt holds no trainer state of format {FORMAT_VERSION} "
                              "(a converted model checkpoint? start from it with model.load=)")
    return common


def load(path: str, model, optimizer, scheduler, ctx, *, seed: int = 0,
         chunk_bytes: int = LOAD_CHUNK_BYTES, arch=None, require_checksums: bool = False,
         lora: dict | None = None) -> dict:
    """Restore model, optimizer, scheduler and RNG at this run's layout (any); returns the loop state.

    Every file of the checkpoint is verified against its checksums.json first (collective), before
    any is parsed: a corrupted one is one CheckpointError line naming it, and nothing is loaded.
    Without checksums.json: a warning naming the folder, or refused with `require_checksums`.
    The model first (its temporary tensors are freed before the optimizer's are read), then the
    optimizer: the distributed optimizer's state piece by piece (_load_distributed_optimizer),
    any other through Megatron's sharded_state_dict in one load. `lora`: this run's LoRA settings
    (save's): an adapter-only checkpoint resumes only into the same adapters (check_lora)."""
    from gspo_megatron.checkpoint import integrity
    from gspo_megatron.checkpoint.mcore import (load_mcore_into_model, load_sharded, model_sharded_state_dict,
                                                read_mcore_arch)
    from gspo_megatron.checkpoint.safe_torch import load_torch_file

    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.train.optim import fuse_cpu_adam

    try:
        if require_checksums:  # a checkpoint without checksums.json: refused before anything is read
            integrity.verify_before_parse(path, data=False, require=True)
        verify_checksums(path, ctx)  # before anything is parsed: a corrupted file is one line naming it
    except CheckpointError as e:
        # never an older iteration instead: its resume would save over this one (find_latest)
        raise CheckpointError(f"{e}; nothing was loaded or changed: move {path} aside to resume from the "
                              "checkpoint before it, or set checkpoint.resume to another one") from None
    common = _read_common(path)
    if arch is not None:
        check_architecture(path, arch)
    trainer, saved_optimizer = common["trainer"], common.get("optimizer") or {}
    _check_optimizer_kind(path, saved_optimizer, optimizer)
    check_lora(path, trainer.get("lora"), lora)
    adapters_only = lora is not None
    load_mcore_into_model(model, path, verify_data=False, trainable_only=adapters_only)  # verified above
    # a fresh model state: the load above replaced the tensors of the one it used
    model_state = model_sharded_state_dict(model, arch if arch is not None else read_mcore_arch(path),
                                           trainable_only=adapters_only)
    if not _load_distributed_optimizer(optimizer, saved_optimizer, model_state, path, chunk_bytes, ctx.device):
        opt_state = optimizer_state(optimizer, model_state, is_loading=True)
        optimizer.load_state_dict(load_sharded({"optimizer": opt_state}, path)["optimizer"])
    fuse_cpu_adam(optimizer, model)  # the Adam kernel is this run's choice, not the saved groups' (optim.py)
    scheduler.load_state_dict(trainer["scheduler"])
    saved, here = trainer["layout"], layout_of(ctx)
    rng = load_torch_file(_rng_path(path, ctx.rank)) if os.path.exists(_rng_path(path, ctx.rank)) else None
    if rng is not None and same_layout(saved, here, rng):
        set_rng_state(rng)
    else:
        from gspo_megatron.parallel.state import seed_rng

        seed_rng(ctx, seed + 1000003 * int(trainer["step"]))
        if ctx.rank == 0:
            log.info("resharding %s: saved at %s, loaded at %s; RNG re-seeded", path, saved, here)
    return trainer["loop"]


LORA_FIXED = ("rank", "alpha", "target_modules")  # what the saved adapters are; dropout and the base may move


def check_lora(path: str, saved: dict | None, here: dict | None) -> None:
    """An adapter-only checkpoint (saved with LoRA) resumes only into a run with the same adapters,
    and a full-parameter one only without LoRA: one CheckpointError line saying which. A base read
    from elsewhere than the saved one is a warning (a moved copy of the same checkpoint is fine)."""
    from gspo_megatron.errors import CheckpointError

    if saved is None and here is None:
        return
    if here is None:
        raise CheckpointError(f"{path} is an adapter-only LoRA checkpoint (lora.rank={saved['rank']}); resume it "
                              "with the same lora settings, or export it (gspo-convert lora-to-peft / lora-merge)")
    if saved is None:
        raise CheckpointError(f"{path} is a full-parameter checkpoint and this run trains LoRA adapters: start from it "
                              f"with model.load={path} and checkpoint.resume=never (or set lora.rank=0 to resume it)")
    diff = [f"lora.{k}: saved {saved.get(k)!r}, here {here.get(k)!r}" for k in LORA_FIXED if saved.get(k) != here.get(k)]
    if diff:
        raise CheckpointError(f"{path}: its adapters do not fit this run's ({'; '.join(diff)})")
    if saved.get("base") != here.get("base") and dist.get_rank() == 0:
        log.warning("%s: adapters trained on base %s, resumed on base %s", path, saved.get("base"), here.get("base"))


def check_architecture(path: str, arch) -> None:
    """The run's architecture equals the one the checkpoint was trained with (its hf_config/),
    field by field: a changed rope_theta or rms_norm_eps loads every tensor without complaint and
    trains a different function. One CheckpointError line naming the fields."""
    import dataclasses
    import json

    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.model.arch import MoeArch

    cfg_path = os.path.join(path, "hf_config", "config.json")
    if not os.path.isfile(cfg_path):
        return  # written without it (nothing to compare with)
    try:
        with open(cfg_path, encoding="utf-8") as f:
            saved_cfg = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{cfg_path}: invalid JSON ({str(e).splitlines()[0]})") from None
    saved = MoeArch.from_hf_dict(saved_cfg, source=cfg_path)
    # max_position_embeddings only bounds the RoPE table (no effect on the math of a sequence);
    # MTP layers are never part of the policy (checkpoints declare none)
    diff = [f"{f.name} {getattr(saved, f.name)!r} -> {getattr(arch, f.name)!r}" for f in dataclasses.fields(saved)
            if f.name not in ("max_position_embeddings", "mtp_layers")
            and getattr(saved, f.name) != getattr(arch, f.name)]
    if diff:
        raise CheckpointError(f"{path}: this run's architecture differs from the checkpoint's ({cfg_path}): "
                              f"{', '.join(diff)}; resume with the model it was trained as")


def _check_optimizer_kind(path: str, common: dict, optimizer) -> None:
    """Megatron's plain and distributed optimizers keep different plain state (param groups vs
    per-optimizer dicts with a sharding type): a checkpoint loads into the kind that wrote it."""
    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.train.optim import inner_optimizers

    first = common.get(0, common) if isinstance(common, dict) else {}
    saved = isinstance(first, dict) and "param_state_sharding_type" in first
    here = type(inner_optimizers(optimizer)[0]).__name__ == "DistributedOptimizer"
    if saved != here:
        raise CheckpointError(
            f"{path}: written with optimizer.use_distributed_optimizer={str(saved).lower()}, this run has "
            f"{str(here).lower()}; resume with the setting that wrote it (any parallel layout works)")


def _load_distributed_optimizer(optimizer, common: dict, model_state: dict, path: str, chunk_bytes: int,
                                device) -> bool:
    """Megatron's fully_reshardable load of the DistributedOptimizer(s), with bounded memory;
    False (nothing done) when `optimizer` or the checkpoint is something else.

    Megatron's way — sharded_state_dict(is_loading=True), one dist_checkpointing.load, then
    load_parameter_state_from_fully_reshardable — first allocates zero-filled fp32 buffers of the
    whole model shard for the master, exp_avg and exp_avg_sq (get_parameter_state_dp_zero), reads
    every parameter's whole state into them (a superset of the rank's DP shard: "each rank loads a
    superset", distrib_optimizer.py, sharded_param_state_fully_reshardable) and only then keeps
    the rank's range of each. Measured on a 1 GB model: resuming cost 2.7x the rank's share of
    memory (bench/bench_checkpoint.py). Here, with the same keys, ranges and order:
      1. the plain part (param groups, steps) from common.pt through load_state_dict, which also
         allocates Adam's state for the rank's ranges (distrib_optimizer.py, load_state_dict);
      2. for the parameters the rank has a range of, in pieces of ~`chunk_bytes`: the saved
         tensors (key optimizer.state.<kind>.<parameter key>, the parameter's sharding) into fresh
         tensors, the range copied into the main parameter and moments, the piece freed.
    tests/test_checkpoint.py reloads bit for bit with one and with many pieces."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from gspo_megatron.train.optim import inner_optimizers

    inner = inner_optimizers(optimizer)
    if not all(isinstance(o, DistributedOptimizer) and not o.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
               for o in inner):
        return False
    states = [common] if len(inner) == 1 else [common.get(i) for i in range(len(inner))]
    if not all(isinstance(st, dict) and st.get("param_state_sharding_type") == "fully_reshardable" for st in states):
        return False
    optimizer.load_state_dict(common)
    params = {sh.data: sh for sh in _sharded_tensors_and_factories(model_state)}
    for opt in inner:
        _load_param_state(opt, params, path, chunk_bytes, device)
    return True


def _sharded_tensors_and_factories(sd: dict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return [v for v in nested_values(sd) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]


STATE_KINDS = ("param", "exp_avg", "exp_avg_sq")  # as sharded_param_state_fully_reshardable names them


def _load_param_state(opt, params: dict, path: str, chunk_bytes: int, device) -> None:
    from dataclasses import replace

    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from gspo_megatron.checkpoint.mcore import load_sharded

    owned = []  # (model_param, its range) for the parameters this rank has a range of
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for buckets in gbuf_range_maps.values():
            ranges = ChainMap(*(b["param_map"] for b in buckets))
            owned += [(p, ranges[p]["param"]) for p in opt.buffers[gbuf_idx].param_index_map if p in ranges]
    pieces, piece, size = [], [], 0
    for item in owned:
        piece.append(item)
        size += len(STATE_KINDS) * 4 * item[0].numel()
        if size >= chunk_bytes:
            pieces.append(piece)
            piece, size = [], 0
    if piece:
        pieces.append(piece)
    # every dist_checkpointing.load is collective (DCP plans globally): all ranks make as many calls
    n = torch.tensor([len(pieces)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    pieces += [[] for _ in range(int(n) - len(pieces))]
    from gspo_megatron.checkpoint.safe_metadata import read_dcp_metadata

    metadata = read_dcp_metadata(path)  # once (restricted unpickler), not once per piece
    for piece in pieces:
        request = {}
        for i, (p, _) in enumerate(piece):
            sh = params[p]
            request[i] = {}
            for kind in STATE_KINDS:
                kw = dict(key=f"optimizer.state.{kind}.{sh.key}", data=torch.empty(p.shape, dtype=torch.float32))
                if not isinstance(sh, ShardedTensorFactory):
                    kw["dtype"] = torch.float32
                request[i][kind] = replace(sh, **kw)
        loaded = load_sharded(request, path, partial=True, metadata=metadata)
        with torch.no_grad():  # fp32 main params are views of the model's parameters
            for i, (p, rng) in enumerate(piece):
                dst = opt._get_main_param_and_optimizer_states(p)
                for kind in STATE_KINDS:
                    dst[kind].copy_(loaded[i][kind].flatten()[rng.start:rng.end])
        del loaded, request
