"""One run per out_dir: a lock file that rank 0 takes before anything is written there.

Two jobs on one out_dir overwrite each other's metrics and checkpoints, and their ranks may load
different iterations. `<out_dir>/.gspo-run.lock` holds the owner: host, pid (and its start time),
the boot and PID namespace it runs in, Slurm job and step, a random token and the start. It
appears complete in one step (a hard link of a written file, which fails if the lock exists), is
refreshed by a heartbeat thread (mtime every HEARTBEAT_S) and removed when the run ends, by the
process whose token it holds.

A lock is stale — taken over, with a log line — only on proof that its owner is gone:
  * its process is dead (or its pid now names another process: another start time), judged only
    in the owner's own PID namespace: same host name, boot and namespace. A pid means nothing in
    another namespace: two containers with one host name each have their own pid 7;
  * its heartbeat stopped: older than STALE_S (another job, maybe on a host whose clock differs),
    or, for a lock of this Slurm job (a requeued job, or another `srun` step of it), older than
    JOB_STALE_BEATS heartbeats; acquire waits that long for a lock of this job to go quiet, so a
    requeue resumes while another live step is refused.
Locks of earlier versions (no token) name no namespace: there the host name stands for it, as
it did. Otherwise the second run stops with one line.

Taking over is atomic: every process that judged the same lock stale competes for one claim file
named after that lock's content, created as the lock is (exactly one creates it), and the
claimant replaces the lock only if it still holds what was judged; the others look again and
find the new owner.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from gspo_megatron.errors import InputError

log = logging.getLogger("gspo_megatron.train")

LOCK_FILE = ".gspo-run.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0
JOB_STALE_BEATS = 3  # missed heartbeats after which a lock of this Slurm job is stale
CLAIM_ROUNDS = 8  # claims of one stale lock whose claimant died mid-takeover, before giving up
CONTENDED_TRIES = 200  # looks at a lock another process is taking over (50 ms apart)


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat); None if unknown."""
    stat = _read_text(f"/proc/{pid}/stat")
    try:  # field 2, the command, may hold spaces and ')': the fields after it follow the last ')'
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (AttributeError, IndexError, ValueError):
        return None


def _namespace() -> dict:
    """What makes a pid meaningful: the boot and the PID namespace (None where /proc lacks them)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


def _owner() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _start_time(pid), **_namespace(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "slurm_step": os.environ.get("SLURM_STEP_ID"),
            "token": uuid.uuid4().hex, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _alive(pid: int) -> bool:
    """Whether `pid` is a running process here. A zombie (killed or exited, not yet reaped by its
    parent: state Z, or X while it goes) is not: it holds no file and never writes again, yet
    os.kill(pid, 0) succeeds on it. A run killed with kill -9 under torchrun stays one until its
    new parent, init, reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    stat = _read_text(f"/proc/{pid}/stat")
    try:
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (AttributeError, IndexError):
        return True  # no /proc: os.kill's answer


def _same_namespace(holder: dict, me: dict) -> bool:
    """Whether `holder`'s pid can be looked up here."""
    if holder.get("host") != me["host"]:
        return False
    if "token" not in holder:  # an earlier version's lock: the host name is all it recorded
        return True
    return holder.get("boot_id") == me["boot_id"] and holder.get("pidns") == me["pidns"]


def _process_gone(holder: dict) -> bool:
    """Whether `holder`'s process is provably not running (call only in its namespace)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:  # os.kill(-1, 0) would ask about every process
        return False
    if not _alive(pid):
        return True
    start = holder.get("pid_start")
    return start is not None and _start_time(pid) not in (None, start)


def _same_job(holder: dict, me: dict) -> bool:
    return bool(holder.get("slurm_job")) and holder.get("slurm_job") == me.get("slurm_job")


def stale_reason(holder: dict, age_s: float, me: dict) -> str | None:
    """Why a lock held by `holder` (heartbeat `age_s` old) may be taken over, or None."""
    if _same_namespace(holder, me) and _process_gone(holder):
        return f"its process {holder.get('pid')} on this host is gone"
    if _same_job(holder, me) and age_s > JOB_STALE_BEATS * HEARTBEAT_S:
        return (f"its heartbeat stopped {age_s:.0f} s ago (this Slurm job {holder['slurm_job']}, step "
                f"{holder.get('slurm_step') or '-'}: requeued, or that step ended)")
    if age_s > STALE_S:
        return f"its heartbeat stopped {age_s:.0f} s ago"
    return None


def _create_new(path: str, data: bytes) -> bool:
    """Create `path` holding `data` unless it exists, as one step: a reader never sees it empty."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)  # fails if `path` exists, on NFS too
            return True
        except FileExistsError:
            return False
        except OSError:  # a filesystem without hard links: O_EXCL (empty for a moment)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _read(path: str) -> tuple[bytes, dict, float] | None:
    """(content, parsed owner, heartbeat age in s) of a lock or claim file; None if there is none."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
            age = time.time() - os.fstat(f.fileno()).st_mtime  # of the file just read, not a successor
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    return raw, holder if isinstance(holder, dict) else {}, age


class RunLock:
    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, LOCK_FILE)
        self.me = _owner()
        self._data = json.dumps(self.me).encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunLock":
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        deadline = None  # of the wait for a lock of this Slurm job to go quiet
        for _ in range(CONTENDED_TRIES):
            if _create_new(self.path, self._data):
                break
            seen = _read(self.path)
            if seen is None:
                continue  # released meanwhile: create it again
            raw, holder, age = seen
            why = stale_reason(holder, age, self.me)
            if why is None:
                if _same_job(holder, self.me):
                    wait = (JOB_STALE_BEATS + 1) * HEARTBEAT_S
                    if deadline is None:
                        deadline = time.monotonic() + wait
                        log.warning("%s is held by this Slurm job (%s); waiting up to %.0f s for its heartbeat to "
                                    "stop", self.path, _describe(holder), wait)
                    if time.monotonic() < deadline:
                        time.sleep(HEARTBEAT_S / 4)
                        continue
                raise InputError(f"{os.path.dirname(self.path)} is in use by another run ({_describe(holder)}); "
                                 f"use another out_dir, or remove {self.path} if that run is gone")
            if self._take_over(raw, why):
                break
            time.sleep(0.05)  # another process is taking it over: look again
        else:
            raise InputError(f"{self.path}: could not take the run lock (other processes kept taking it)")
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _take_over(self, raw: bytes, why: str) -> bool:
        """Replace the stale lock whose content is `raw`; whether this process did.

        Claims are numbered rounds of one name derived from `raw`: round r+1 is tried only when
        round r's claimant is provably gone or its claim STALE_S old (it died between claiming and
        replacing, a few system calls), so no claim is ever removed while another process may
        hold it. A claimant replaces the lock only if the lock still holds `raw` and no later
        round superseded it; a racer claiming after the winner cleaned up finds the winner's lock."""
        tag = hashlib.sha256(raw).hexdigest()[:16]
        claims = [f"{self.path}.takeover-{tag}.{r}" for r in range(CLAIM_ROUNDS)]
        for r, claim in enumerate(claims):
            if _create_new(claim, self._data):
                break
            if not self._claim_abandoned(claim):
                return False  # being taken over right now
        else:
            raise InputError(f"{self.path}: {CLAIM_ROUNDS} takeovers of this stale run lock were abandoned half-way; "
                             f"remove {self.path} and {self.path}.takeover-* if no run uses "
                             f"{os.path.dirname(self.path)}")
        try:
            now = _read(self.path)
            if now is None or now[0] != raw or (r + 1 < CLAIM_ROUNDS and os.path.exists(claims[r + 1])):
                return False  # released, taken over already, or this claim judged abandoned
            tmp = f"{self.path}.{self.me['token']}.tmp"
            with open(tmp, "wb") as f:
                f.write(self._data)
            os.replace(tmp, self.path)
        finally:
            for c in claims[: r + 1]:  # this round's and abandoned earlier ones
                try:
                    os.unlink(c)
                except OSError:
                    pass
        log.warning("took over the run lock %s: %s", self.path, why)
        return True

    def _claim_abandoned(self, claim: str) -> bool:
        seen = _read(claim)
        if seen is None:
            return False  # finished meanwhile: look at the lock again
        _, claimant, age = seen
        return (_same_namespace(claimant, self.me) and _process_gone(claimant)) or age > STALE_S

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            seen = _read(self.path)
            if seen is None or seen[1].get("token") != self.me["token"]:
                log.error("the run lock %s is no longer this run's (%s); another run may be writing to %s",
                          self.path, _describe(seen[1]) if seen else "removed", os.path.dirname(self.path))
                return
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock if it is still this process's (a successor's is left alone)."""
        self._stop.set()
        seen = _read(self.path)
        if seen is not None and seen[1].get("token") == self.me["token"]:
            try:
                os.remove(self.path)
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _describe(holder: dict) -> str:
    step = holder.get("slurm_step")
    return (f"host {holder.get('host')}, pid {holder.get('pid')}, Slurm job {holder.get('slurm_job') or '-'}"
            + (f" step {step}" if step not in (None, "") else "") + f", since {holder.get('started')}")
