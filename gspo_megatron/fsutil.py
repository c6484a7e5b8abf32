"""Directories that appear all at once: built in a hidden temporary directory beside the target
and renamed into place, so a crash or an error never leaves something at the target path that
looks like a complete checkpoint/export.

Replacing a directory deletes it, so a command replaces only what it can prove it wrote: its
output carries a marker (MARKER: the command, and every entry it wrote), and `publish(...,
command=)` replaces an existing target only when the target's marker names that command and the
target holds nothing else (check_replaceable). Directories without a marker (a user's folder, a
run's checkpoints, an output of a version before markers) are refused with one line naming what
would have been deleted.

A replacement renames the old target aside (`.<name>.old-XXXXXXXX`), renames the new one in and
deletes the old one; recover_replaced finishes or undoes one that was interrupted.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
import shutil
import tempfile

from gspo_megatron.errors import InputError

log = logging.getLogger(__name__)

MARKER = ".gspo-output.json"
MARKER_FORMAT = 1
# the command whose outputs publish() marks and replaces, when its caller does not say (output_of)
_COMMAND: contextvars.ContextVar[str | None] = contextvars.ContextVar("gspo_output_command", default=None)
# `.<name>.old-` + tempfile.mkdtemp's 8 characters (tempfile._RandomNameSequence)
_OLD = re.compile(r"^\.(?P<name>.+)\.old-[a-z0-9_]{8}$")


class TargetExistsError(InputError):
    """The target appeared while writing and overwriting was not allowed (a user error)."""


class NotOurOutputError(InputError):
    """The target is not (only) an earlier output of the command replacing it (a user error)."""


@contextlib.contextmanager
def output_of(command: str):
    """Inside, publish() calls that name no command write and replace outputs of `command` (an
    entry point naming itself for the library functions it calls, e.g. the converter CLI)."""
    token = _COMMAND.set(command)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def current_command() -> str | None:
    return _COMMAND.get()


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


def _entries(directory: str) -> list[str]:
    """Every file, directory and link under `directory` ('/'-separated paths relative to it), the
    marker excepted; links are not followed."""
    out = []
    for root, dirs, files in os.walk(directory):
        rel = os.path.relpath(root, directory)
        for n in dirs + files:
            p = n if rel == "." else f"{rel}/{n}".replace(os.sep, "/")
            if p != MARKER:
                out.append(p)
    return sorted(out)


def write_marker(directory: str, command: str) -> None:
    """Mark `directory` (complete, not yet published) as `command`'s output."""
    from gspo_megatron import __version__

    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump({"written_by": command, "format": MARKER_FORMAT, "gspo_megatron": __version__,
                   "entries": _entries(directory)}, f, indent=1)


def read_marker(directory: str) -> dict | None:
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _few(directory: str, entries: list[str], n: int = 3) -> str:
    """The top-most of `entries` (a directory stands for what it holds), at most `n` named."""
    top = [e for e in entries if "/" not in e or e.rsplit("/", 1)[0] not in entries]
    top.sort(key=lambda e: (e.count("/"), e))
    named = [e + ("/" if os.path.isdir(os.path.join(directory, e)) and not os.path.islink(os.path.join(directory, e))
                  else "") for e in top[:n]]
    return ", ".join(named) + (f" (+{len(top) - n} more)" if len(top) > n else "") if named else "nothing"


def check_replaceable(path: str, command: str, *, tolerate: tuple[str, ...] = ()) -> None:
    """Refuse (NotOurOutputError, one line) unless `path` is a directory that `command` wrote:
    its marker names `command` and it holds no entry the marker does not list, save top-level
    names in `tolerate` (files the command's caller adds after publishing)."""
    what = f"{path}: {command} replaces only a previous {command} output"
    if os.path.islink(path) or not os.path.isdir(path):
        raise NotOurOutputError(f"{what}, and this is not a directory; remove it yourself or choose another output")
    entries = _entries(path)
    marker = read_marker(path)
    if marker is None or marker.get("written_by") != command:
        why = (f"its {MARKER} names {marker.get('written_by')!r}" if marker is not None
               else f"it has no {MARKER} (nor have outputs of earlier versions)")
        raise NotOurOutputError(f"{what}, and {why}: replacing it would delete {_few(path, entries)}; "
                                "delete it yourself if it may go, or choose another output")
    listed = set(marker.get("entries") or ())
    extra = [e for e in entries if e not in listed and e.split("/", 1)[0] not in tolerate]
    if extra:
        raise NotOurOutputError(f"{what}, and this one also holds {_few(path, extra)}, which {command} did not "
                                "write; move them out (or delete the folder yourself), or choose another output")


def recover_replaced(out_dir: str) -> None:
    """Finish or undo an interrupted replacement of `out_dir`: a leftover `.<name>.old-*` beside
    it is deleted when `out_dir` is in place (killed while deleting the old one), or renamed back
    to `out_dir` when it is not (killed between the two renames; the newest leftover is the
    latest output). Each with a log line."""
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    try:
        names = os.listdir(parent)
    except OSError:
        return
    olds = [os.path.join(parent, n) for n in names if (m := _OLD.match(n)) and m["name"] == name]
    for old in sorted(olds, key=lambda p: os.lstat(p).st_ctime, reverse=True):  # a rename sets ctime
        if os.path.lexists(out_dir):
            shutil.rmtree(old, ignore_errors=True)
            log.warning("removed %s: the previous %s, left by a replacement interrupted after the new one "
                        "was in place", old, out_dir)
        else:
            os.rename(old, out_dir)
            log.warning("restored %s from %s: a replacement was interrupted before the new one was in place",
                        out_dir, old)


def recover_all(directory: str) -> None:
    """recover_replaced for every leftover `.<name>.old-*` in `directory`."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in sorted({m["name"] for n in names if (m := _OLD.match(n))}):
        recover_replaced(os.path.join(directory, name))


def publish(tmp: str, out_dir: str, *, overwrite: bool, command: str | None = None,
            tolerate: tuple[str, ...] = ()) -> None:
    """Rename the finished `tmp` to `out_dir` (replacing an old one if allowed).

    `command` (default: the enclosing output_of's): marks `tmp` as its output, and replaces an
    existing `out_dir` only if check_replaceable proves it an earlier output of `command`.
    Without one (the trainer's own iteration directories, under its run lock) an existing
    `out_dir` is replaced as it is."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    command = command or current_command()
    recover_replaced(out_dir)
    if command:
        write_marker(tmp, command)
    _fsync_dir(tmp)
    if os.path.lexists(out_dir):
        if not overwrite:
            raise TargetExistsError(f"{out_dir}: appeared while writing (pass --overwrite to replace it)")
        if command:
            check_replaceable(out_dir, command, tolerate=tolerate)
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
