"""Trainer checkpoints: model, optimizer, scheduler, RNG and loop state, written atomically.

Layout: <out_dir>/checkpoints/step_00000010/{rank_00000.pt, ..., meta.json} plus
<out_dir>/checkpoints/latest (the step directory's name). Every rank writes its own shard into a
temporary directory; after a barrier rank 0 renames it into place and only then updates `latest`,
so a crash at any point leaves either the previous checkpoint or the new one, never half of one.
Resuming needs the same parallel layout (the shards are per rank); to change layout, export
(`gspo-convert` / `<out_dir>/hf`) and start from that.

Everything is loaded with torch.load(weights_only=True): tensors, numbers, strings and containers.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

LATEST = "latest"


def ckpt_root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _model_tensors(model) -> dict[str, torch.Tensor]:
    out = {}
    for i, chunk in enumerate(model):
        for name, p in chunk.named_parameters():
            out[f"{i}.{name}"] = p.detach().cpu().clone()
    return out


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


def save(out_dir: str, step: int, model, optimizer, scheduler, loop_state: dict, ctx, keep_last: int = 0) -> str:
    """Collective: every rank calls it. Returns the final directory."""
    root = ckpt_root(out_dir)
    final = os.path.join(root, _step_name(step))
    tmp = final + ".tmp"
    if ctx.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    shard = {
        "model": _model_tensors(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "loop": loop_state,
    }
    path = os.path.join(tmp, f"rank_{ctx.rank:05d}.pt")
    torch.save(shard, path + ".part")
    os.replace(path + ".part", path)
    dist.barrier()
    if ctx.rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": ctx.world_size, "layout": vars(ctx.parallel)}, f)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
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
    steps = sorted(d for d in os.listdir(root) if d.startswith("step_") and not d.endswith(".tmp"))
    for d in steps[:-keep_last]:
        shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def find_latest(out_dir: str) -> str | None:
    root = ckpt_root(out_dir)
    p = os.path.join(root, LATEST)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        name = f.read().strip()
    d = os.path.join(root, name)
    return d if os.path.isfile(os.path.join(d, "meta.json")) else None


def resolve_resume(resume: str, out_dir: str) -> str | None:
    if resume == "never":
        return None
    if resume == "auto":
        return find_latest(out_dir)
    return resume


def load(path: str, model, optimizer, scheduler, ctx) -> dict:
    """Restore this rank's shard; returns the loop state."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if meta["world_size"] != ctx.world_size or meta["layout"] != vars(ctx.parallel):
        raise ValueError(
            f"{path}: saved with world size {meta['world_size']} and layout {meta['layout']}, "
            f"this run has {ctx.world_size} and {vars(ctx.parallel)}; resume needs the same layout"
        )
    shard = torch.load(os.path.join(path, f"rank_{ctx.rank:05d}.pt"), weights_only=True, map_location="cpu")
    params = {f"{i}.{n}": p for i, chunk in enumerate(model) for n, p in chunk.named_parameters()}
    if set(params) != set(shard["model"]):
        missing = sorted(set(params) - set(shard["model"]))[:3]
        raise ValueError(f"{path}: checkpoint does not match the model (e.g. {missing})")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(shard["model"][n])
    optimizer.load_state_dict(shard["optimizer"])
    scheduler.load_state_dict(shard["scheduler"])
    set_rng_state(shard["rng"])
    return shard["loop"]
