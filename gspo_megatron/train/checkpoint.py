"""Trainer checkpoints in Megatron-Core's `dist_checkpointing` (torch_dist) format: resharding on load.

Layout: <out_dir>/checkpoints/step_00000010/ is one torch_dist checkpoint directory —

    metadata.json, .metadata, __*.distcp   global tensors: the model (converters/layout.py keys, the
                                           ones `gspo-convert` reads and writes) and the optimizer's
                                           sharded state (`optimizer.sharded_state_dict`, fully
                                           reshardable: fp32 masters and Adam moments per parameter
                                           with the parameter's global shape)
    common.pt                              rank 0's plain state: {"trainer": scheduler, loop and
                                           data-stream state, layout}, the optimizer's param groups
    rng/rank_<r>.pt                        each rank's RNG state (restored when the layout is the same)
    hf_config/                             the HF config (+ tokenizer): `gspo-convert mcore-to-hf
                                           --load <dir>` and `model.load=<dir>` need nothing else

plus <out_dir>/checkpoints/latest, the newest complete directory's name. Every rank writes its
regions into a hidden temporary directory; after a barrier rank 0 renames it into place and only
then rewrites `latest` (temp file + rename), so a crash leaves the previous checkpoint or the new
one, never half of one.

Resume works at another layout (TP, PP, EP, ETP, DP may all change): each rank reads the regions of
the global tensors its parameters and optimizer shards cover. The optimizer state is loaded into
the optimizer (masters included), so nothing has to be re-derived from the 16-bit weights. RNG
states are per rank and only meaningful for the same layout; at another layout the generators are
re-seeded from train.seed and the step (logged).

Departure from Megatron-LM: it stores the RNG state as a ShardedObject (pickled bytes inside the
data files, unpickled by PyTorch's DCP planner with weights_only=False); here it is a per-rank file
read with torch.load(weights_only=True), and loading refuses ShardedObjects altogether.

Async save (Megatron's FileSystemWriterAsync with forked writer processes) is not used: it calls
torch.cuda.synchronize() and its fork needs CUDA; saves are synchronous (converters/mcore.py).
"""
from __future__ import annotations

import logging
import os
import shutil

import torch
import torch.distributed as dist

log = logging.getLogger("gspo_megatron.train")

LATEST = "latest"
FORMAT_VERSION = 2  # 1: per-rank torch.save shards (before dist_checkpointing); not readable now
# fully_reshardable: every parameter's optimizer state in model space with its global shape, so
# TP/PP/EP/DP may all change on load (megatron/core/optimizer/distrib_optimizer.py,
# sharded_param_state_fully_reshardable). The plain optimizers ignore the key.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


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
    p = ctx.parallel
    return {"world_size": ctx.world_size, "tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp, "cp": p.cp,
            "sequence_parallel": p.sequence_parallel}


def _rng_path(directory: str, rank: int) -> str:
    return os.path.join(directory, "rng", f"rank_{rank:05d}.pt")


def optimizer_state(optimizer, model_state: dict, *, is_loading: bool) -> dict:
    return optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))


def save(out_dir: str, step: int, model, optimizer, scheduler, loop_state: dict, ctx, *, hf_config: dict,
         keep_last: int = 0, tokenizer=None) -> str:
    """Collective: every rank calls it. Returns the final directory."""
    from converters.mcore import model_sharded_state_dict, save_mcore_checkpoint

    root = ckpt_root(out_dir)
    final = os.path.join(root, _step_name(step))
    os.makedirs(root, exist_ok=True)
    model_state = model_sharded_state_dict(model)
    trainer = {"format": FORMAT_VERSION, "step": step, "scheduler": scheduler.state_dict(), "loop": loop_state,
               "layout": layout_of(ctx)}

    def rank_files(tmp: str) -> None:
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
        torch.save(rng_state(), _rng_path(tmp, ctx.rank))
        if ctx.rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "hf_config"))

    save_mcore_checkpoint(
        model, final, hf_config, model_state=model_state, write_rank_files=rank_files,
        extra_sharded_state={"optimizer": optimizer_state(optimizer, model_state, is_loading=False),
                             "trainer": trainer},
    )
    if ctx.rank == 0:
        _write_latest(root, _step_name(step))
        _prune(root, keep_last)
    dist.barrier()
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))


def _prune(root: str, keep_last: int) -> None:
    if keep_last <= 0:
        return
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and "." not in d)
    for d in steps[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def is_trainer_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "metadata.json")) and os.path.isfile(os.path.join(path, "common.pt"))


def find_latest(out_dir: str) -> str | None:
    root = ckpt_root(out_dir)
    p = os.path.join(root, LATEST)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    d = os.path.join(root, name)
    return d if is_trainer_checkpoint(d) else None


def resolve_resume(resume: str, out_dir: str) -> str | None:
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(out_dir)
    return resume


def read_trainer_state(path: str) -> dict:
    """The checkpoint's plain trainer state (common.pt, read with weights_only=True)."""
    from megatron.core import dist_checkpointing

    from gspo_megatron.model.hf_io import CheckpointError

    if not is_trainer_checkpoint(path):
        raise CheckpointError(f"{path}: not a trainer checkpoint (no metadata.json/common.pt; written by an "
                              "older version, or not a checkpoint directory)")
    common = dist_checkpointing.load_common_state_dict(path)
    trainer = common.get("trainer") if isinstance(common, dict) else None
    if not isinstance(trainer, dict) or trainer.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: common.pt holds no trainer state of format {FORMAT_VERSION} "
                              "(a converted model checkpoint? start from it with model.load=)")
    return trainer


def load(path: str, model, optimizer, scheduler, ctx, *, seed: int = 0) -> dict:
    """Restore model, optimizer, scheduler and RNG at this run's layout (any); returns the loop state."""
    from converters.mcore import load_mcore_into_model, model_sharded_state_dict

    trainer = read_trainer_state(path)
    model_state = model_sharded_state_dict(model)
    loaded = load_mcore_into_model(
        model, path, model_state=model_state,
        extra_sharded_state={"optimizer": optimizer_state(optimizer, model_state, is_loading=True)},
    )
    optimizer.load_state_dict(loaded["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    saved, here = trainer["layout"], layout_of(ctx)
    if saved == here:
        set_rng_state(torch.load(_rng_path(path, ctx.rank), weights_only=True, map_location="cpu"))
    else:
        from gspo_megatron.parallel.state import seed_rng

        seed_rng(ctx, seed + 1000003 * int(trainer["step"]))
        if ctx.rank == 0:
            log.info("resharding %s: saved at %s, loaded at %s; RNG re-seeded", path, saved, here)
    return trainer["loop"]
