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
from collections import ChainMap

import torch
import torch.distributed as dist

log = logging.getLogger("gspo_megatron.train")

LATEST = "latest"
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


def load(path: str, model, optimizer, scheduler, ctx, *, seed: int = 0,
         chunk_bytes: int = LOAD_CHUNK_BYTES) -> dict:
    """Restore model, optimizer, scheduler and RNG at this run's layout (any); returns the loop state.

    The model first (its temporary tensors are freed before the optimizer's are read), then the
    optimizer's plain state and any non-distributed optimizer's tensors, then the distributed
    optimizer's parameter state piece by piece (_load_param_state)."""
    from converters.mcore import load_mcore_into_model, load_sharded, model_sharded_state_dict

    trainer = read_trainer_state(path)
    load_mcore_into_model(model, path)
    # a fresh model state: the load above replaced the tensors of the one it used
    opt_state = optimizer_state(optimizer, model_sharded_state_dict(model), is_loading=True)
    pieces = _split_param_state(optimizer, opt_state)
    optimizer.load_state_dict(load_sharded({"optimizer": opt_state}, path)["optimizer"])
    for opt, param_state in pieces:
        _load_param_state(opt, param_state, path, chunk_bytes, ctx.device)
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


def _split_param_state(optimizer, opt_state: dict) -> list[tuple]:
    """Take the fully_reshardable parameter state of each DistributedOptimizer out of
    `opt_state` (DistributedOptimizer.load_state_dict then loads only its param groups and steps);
    returns [(that optimizer, {param_idx: {kind: ShardedTensor}})]."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from gspo_megatron.train.optim import inner_optimizers

    inner = inner_optimizers(optimizer)
    states = [opt_state] if len(inner) == 1 else [opt_state[i] for i in range(len(inner))]
    out = []
    for opt, st in zip(inner, states):
        if (isinstance(opt, DistributedOptimizer) and st.get("param_state_sharding_type") == "fully_reshardable"
                and not opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
            out.append((opt, st.pop("param_state")))
    return out


def _load_param_state(opt, param_state: dict, path: str, chunk_bytes: int, device) -> None:
    """Megatron's load_parameter_state_from_fully_reshardable, in pieces.

    Megatron asks for every parameter's whole state (fp32 master, exp_avg, exp_avg_sq) in the
    rank's model shard — a superset of its DP shard — all at once, then keeps its range of each
    (distrib_optimizer.py, sharded_param_state_fully_reshardable: "each rank loads a superset").
    Measured on a 1 GB model that made resuming cost 2.7x the rank's share of memory
    (bench/bench_checkpoint.py). Here: only the parameters this rank has a range of, about
    `chunk_bytes` at a time into fresh tensors, each range copied into the optimizer's main
    parameter and moments and the piece freed. Same values as Megatron's loader (same iteration
    order, same ranges; tests/test_checkpoint.py compares a reload bit for bit). `step` is not in
    the saved tensors: load_state_dict restored it from the param groups."""
    from converters.mcore import load_sharded

    owned = []  # (param_idx, model_param, range in the param) in Megatron's order
    param_idx = -1
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for buckets in gbuf_range_maps.values():
            ranges = ChainMap(*(b["param_map"] for b in buckets))
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                param_idx += 1
                if model_param in ranges:
                    owned.append((param_idx, model_param, ranges[model_param]["param"]))
    pieces, piece, size = [], [], 0
    for item in owned:
        piece.append(item)
        size += sum(sh.data.numel() * sh.data.element_size() for sh in param_state[item[0]].values())
        if size >= chunk_bytes:
            pieces.append(piece)
            piece, size = [], 0
    if piece:
        pieces.append(piece)
    # every dist_checkpointing.load is collective (DCP plans globally): all ranks make as many calls
    n = torch.tensor([len(pieces)], device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    pieces += [[] for _ in range(int(n) - len(pieces))]
    for piece in pieces:
        request = {}
        for idx, _, _ in piece:
            for sh in param_state[idx].values():
                # fresh storage, not a view of Megatron's (untouched) world-size buffer; works for
                # ShardedTensors and ShardedTensorFactories (fused expert fc1) alike
                sh.data = torch.empty(sh.data.shape, dtype=sh.data.dtype)
            request[idx] = param_state[idx]
        loaded = load_sharded(request, path, partial=True)
        with torch.no_grad():  # fp32 main params are views of the model's parameters
            for idx, model_param, rng in piece:
                dst = opt._get_main_param_and_optimizer_states(model_param)
                for kind, t in loaded[idx].items():
                    dst["param" if kind == "fp32_param" else kind].copy_(t.flatten()[rng.start:rng.end])
        del loaded, request
