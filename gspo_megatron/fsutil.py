"""Directories that appear all at once: built in a hidden temporary directory beside the target
and renamed into place, so a crash or an error never leaves something at the target path that
looks like a complete checkpoint/export."""
from __future__ import annotations

import os
import shutil
import tempfile


class TargetExistsError(ValueError):
    """The target appeared while writing and overwriting was not allowed (a user error)."""



def make_tmp(out_dir: str) -> str:
    """A fresh hidden directory beside `out_dir` (same filesystem, so the final rename is atomic)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    path = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)  # mkdtemp's 0700 would stick to the published checkpoint
    return path


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
            raise TargetExistsError(f"{out_dir}: appeared while writing (pass --overwrite to replace it)")
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
