"""One run per out_dir: a lock file that rank 0 takes before anything is written there.

Two jobs on one out_dir overwrite each other's metrics and checkpoints, and their ranks may load
different iterations. `<out_dir>/.gspo-run.lock` holds the owner (host, pid, Slurm job, start);
it is created with O_EXCL, refreshed by a heartbeat thread (mtime every HEARTBEAT_S), and removed
when the run ends. A lock is stale — taken over, with a log line — when its owner is a dead
process on this host, the same Slurm job (a requeued job resuming), or its heartbeat is older
than STALE_S (a dead job on another host). Otherwise the second run stops with one line.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

from gspo_megatron.cli_util import InputError

log = logging.getLogger("gspo_megatron.train")

LOCK_FILE = ".gspo-run.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def stale_reason(holder: dict, age_s: float, me: dict) -> str | None:
    """Why a lock held by `holder` (heartbeat `age_s` old) may be taken over, or None."""
    if holder.get("slurm_job") and holder.get("slurm_job") == me.get("slurm_job"):
        return f"left by this Slurm job ({holder['slurm_job']}) before a requeue"
    if holder.get("host") == me["host"] and not _alive(int(holder.get("pid", -1))):
        return f"its process {holder.get('pid')} on this host is gone"
    if age_s > STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago"
    return None


class RunLock:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.me = _owner()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        for _ in range(3):  # a lock removed or replaced between our calls: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if self._take_over_if_stale():
                    break
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            break
        else:
            raise InputError(f"{self.path}: could not take the run lock")
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _take_over_if_stale(self) -> bool:
        try:
            with open(self.path) as f:
                holder = json.load(f)
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return False  # released meanwhile: try O_EXCL again
        except (OSError, ValueError):
            holder, age = {}, time.time() - os.path.getmtime(self.path)
        why = stale_reason(holder, age, self.me)
        if why is None:
            raise InputError(
                f"{os.path.dirname(self.path)} is in use by another run (host {holder.get('host')}, pid "
                f"{holder.get('pid')}, Slurm job {holder.get('slurm_job') or '-'}, since {holder.get('started')}); "
                f"use another out_dir, or remove {self.path} if that run is gone")
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.me, f)
        os.replace(tmp, self.path)
        log.warning("took over the run lock %s: %s", self.path, why)
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        self._stop.set()
        try:
            with open(self.path) as f:
                holder = json.load(f)
            if holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
                os.remove(self.path)
        except (OSError, ValueError):
            pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
