"""Checkpoint directories that appear all at once: built in a hidden temporary directory beside the
target and renamed into place, so a crash or an error never leaves something at the target path
that looks like a checkpoint. Collective versions for torch.distributed (rank 0 owns the rename)."""
from __future__ import annotations

import os

from gspo_megatron.errors import InputError
from gspo_megatron.fsutil import (  # noqa: F401  (re-exported)
    NotOurOutputError, TargetExistsError, check_replaceable, current_command, discard, make_tmp, publish,
)


def dist_or_none():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world() -> tuple[int, int]:
    d = dist_or_none()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def check_target(out_dir: str, overwrite: bool, *, command: str | None = None) -> str:
    """Absolute target path; refuses an existing target unless `overwrite`, and then unless it is
    an earlier output of `command` (default: the enclosing fsutil.output_of's; none: anything),
    before any work (publish checks again when it replaces)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.lexists(out_dir):
        if not overwrite:
            raise InputError(f"{out_dir}: already exists (pass --overwrite to replace it)")
        command = command or current_command()
        if command:
            check_replaceable(out_dir, command)
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise InputError(f"{out_dir}: parent directory {parent} does not exist")
    return out_dir


def make_tmp_collective(out_dir: str, d=None) -> str:
    """Rank 0 creates the temporary directory; every rank gets its path. `d`: the collectives to
    use (parallel/state.py GroupOps for a background writer's own group); default the world's."""
    d = d if d is not None else dist_or_none()
    rank = d.get_rank() if d is not None else 0
    path = [make_tmp(out_dir) if rank == 0 else None]
    if d is not None:
        d.broadcast_object_list(path, src=0)
    return path[0]


