"""Checkpoint directories that appear all at once: built in a hidden temporary directory beside the
target and renamed into place, so a crash or an error never leaves something at the target path
that looks like a checkpoint. Collective versions for torch.distributed (rank 0 owns the rename)."""
from __future__ import annotations

import os
import shutil
import tempfile

from gspo_megatron.cli_util import InputError


def dist_or_none():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank_world() -> tuple[int, int]:
    d = dist_or_none()
    return (d.get_rank(), d.get_world_size()) if d else (0, 1)


def check_target(out_dir: str, overwrite: bool) -> str:
    """Absolute target path; refuses an existing target unless `overwrite`."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and not overwrite:
        raise InputError(f"{out_dir}: already exists (pass --overwrite to replace it)")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise InputError(f"{out_dir}: parent directory {parent} does not exist")
    return out_dir


def make_tmp(out_dir: str) -> str:
    """A fresh hidden directory beside `out_dir` (same filesystem, so the final rename is atomic)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    path = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp's 0700 would stick to the published checkpoint
    return path


def make_tmp_collective(out_dir: str) -> str:
    """Rank 0 creates the temporary directory; every rank gets its path."""
    d = dist_or_none()
    rank, _ = rank_world()
    path = [make_tmp(out_dir) if rank == 0 else None]
    if d is not None:
        d.broadcast_object_list(path, src=0)
    return path[0]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: str, out_dir: str, *, overwrite: bool) -> None:
    """Rename the finished `tmp` to `out_dir` (replacing an old one as one step if allowed)."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    _fsync_dir(tmp)
    if os.path.exists(out_dir):
        if not overwrite:
            raise InputError(f"{out_dir}: appeared while converting (pass --overwrite to replace it)")
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
        os.rmdir(old)
        os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)
    _fsync_dir(parent)


def discard(tmp: str | None) -> None:
    if tmp and os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
