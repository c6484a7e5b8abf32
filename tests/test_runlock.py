"""The run lock (gspo_megatron/train/runlock.py): one owner per out_dir.

What the tests show:
  * N processes that find the same dead owner at once (released together by a barrier): exactly
    one of them takes the lock over, in every trial, for a lock of this version and one written by
    an earlier version (no owner token); every other one stops with "in use" naming the winner;
  * a live owner is never taken over: another srun step of the same Slurm job (its heartbeat
    still beating), a process with the same host name in another PID namespace (a container) or
    after another boot; a requeued job whose previous owner's heartbeat stopped is taken over, and
    so is a dead process (or a reused pid) in this very namespace;
  * a process whose lock was taken over does not remove its successor's lock when it ends.
Lock files of other owners are simulated by writing their fields.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest

from gspo_megatron.errors import InputError
from gspo_megatron.train import runlock
from gspo_megatron.train.runlock import LOCK_FILE, RunLock

RACERS = 8
TRIALS = 5


@pytest.fixture(autouse=True)
def _outside_slurm(monkeypatch):
    for k in ("SLURM_JOB_ID", "SLURM_STEP_ID"):
        monkeypatch.delenv(k, raising=False)


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(timeout=60)
    return p.pid


def write_lock(d, holder: dict, age_s: float = 0.0) -> str:
    path = os.path.join(str(d), LOCK_FILE)
    with open(path, "w") as f:
        json.dump(holder, f)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def a_holder(**over) -> dict:
    """The fields a process of this version in this namespace writes, with `over` changed."""
    return {**runlock._owner(), "token": "0123456789abcdef", **over}


def _racer(d, start, judged, tried, reset, results, trials):
    # the worst interleaving, every time: nobody acts on its verdict before every racer has judged
    # the dead owner stale (on a busy machine the first racer could otherwise finish before the
    # others even look, and the race would be tried only now and then)
    judge = runlock.stale_reason
    first = [True]

    def judge_together(*args, **kwargs):
        why = judge(*args, **kwargs)
        if first[0]:
            first[0] = False
            judged.wait(timeout=120)
        return why

    runlock.stale_reason = judge_together
    for _ in range(trials):
        first[0] = True
        start.wait(timeout=120)
        lock = RunLock(d)
        try:
            lock.acquire()
            results.put((os.getpid(), True, ""))
        except InputError as e:
            lock = None
            results.put((os.getpid(), False, str(e)))
        tried.wait(timeout=120)  # the winner holds the lock until everyone has tried
        if lock is not None:
            lock.release()
        reset.wait(timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", ["this version", "earlier version"])
def test_racers_for_a_dead_owner_exactly_one_wins(tmp_path, fmt):
    """Before: each racer replaced the stale file and went on (9 of 10 trials had several owners)."""
    ctx = mp.get_context("spawn")  # the pytest process may hold threads (fork would copy their locks)
    start, tried, reset = (ctx.Barrier(RACERS + 1) for _ in range(3))
    judged = ctx.Barrier(RACERS)
    results = ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(str(tmp_path), start, judged, tried, reset, results, TRIALS), daemon=True)
             for _ in range(RACERS)]
    for p in procs:
        p.start()
    try:
        for trial in range(TRIALS):
            pid = dead_pid()
            if fmt == "this version":
                write_lock(tmp_path, a_holder(pid=pid))
            else:  # what earlier versions wrote: no token, no namespace
                write_lock(tmp_path, {"host": socket.gethostname(), "pid": pid, "slurm_job": None})
            start.wait(timeout=120)
            got = [results.get(timeout=120) for _ in range(RACERS)]
            winners = [g for g in got if g[1]]
            assert len(winners) == 1, (trial, got)
            for _, _, msg in (g for g in got if not g[1]):
                assert "in use by another run" in msg and f"pid {winners[0][0]}," in msg, (trial, msg)
            tried.wait(timeout=120)
            reset.wait(timeout=120)
            assert not os.path.exists(tmp_path / LOCK_FILE)  # the winner released it
    except BaseException:
        for b in (start, judged, tried, reset):  # the racers stop waiting at once
            b.abort()
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0] * RACERS
    assert not [f for f in os.listdir(tmp_path) if f != LOCK_FILE]  # no claim or temporary file left


def _refused(d) -> str:
    before = open(os.path.join(str(d), LOCK_FILE)).read()
    with pytest.raises(InputError) as e:
        RunLock(str(d)).acquire()
    assert open(os.path.join(str(d), LOCK_FILE)).read() == before  # untouched
    assert "in use by another run" in str(e.value) and "\n" not in str(e.value)
    return str(e.value)


def _taken_over(d, caplog) -> str:
    caplog.clear()
    lock = RunLock(str(d)).acquire()
    try:
        assert json.load(open(os.path.join(str(d), LOCK_FILE)))["pid"] == os.getpid()
    finally:
        lock.release()
    assert not os.path.exists(os.path.join(str(d), LOCK_FILE))
    lines = [r.getMessage() for r in caplog.records if "took over the run lock" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    return lines[0]


@pytest.mark.parametrize("field", ["pidns", "boot_id"])
def test_same_host_name_in_another_namespace_is_not_taken_over(tmp_path, field):
    """Before: same host name + no such pid here = taken over, but a container with the same host
    name (another PID namespace) or the same name after a reboot of another machine may run it."""
    write_lock(tmp_path, a_holder(pid=dead_pid(), **{field: "other"}))
    msg = _refused(tmp_path)
    assert socket.gethostname() in msg


def test_dead_or_reused_pid_in_this_namespace_is_taken_over(tmp_path, caplog):
    pid = dead_pid()
    write_lock(tmp_path, a_holder(pid=pid))
    assert f"its process {pid} on this host is gone" in _taken_over(tmp_path, caplog)
    # a live process that got the pid since (another start time): the owner is gone too
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        write_lock(tmp_path, a_holder(pid=child.pid, pid_start=runlock._start_time(child.pid) + 1))
        assert f"its process {child.pid} on this host is gone" in _taken_over(tmp_path, caplog)
        # ... and the process itself, alive: refused
        write_lock(tmp_path, a_holder(pid=child.pid, pid_start=runlock._start_time(child.pid)))
        assert f"pid {child.pid}," in _refused(tmp_path)
    finally:
        child.kill()
        child.wait(timeout=60)


def test_a_killed_owner_not_yet_reaped_is_taken_over(tmp_path, caplog):
    """A run killed with kill -9 whose parent has not reaped it yet (a zombie: its pid and start
    time are still in /proc, os.kill(pid, 0) succeeds) holds no file and never writes again: its
    lock is taken over. Before: refused as "in use by another run" until something reaped it (a
    torchrun killed first leaves its ranks to an init that may reap late; found when a resume
    right after kill -9 stopped in one line)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while runlock._read_text(f"/proc/{child.pid}/stat").rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.05)  # a poll interval: the state is the condition
    try:
        write_lock(tmp_path, a_holder(pid=child.pid, pid_start=runlock._start_time(child.pid)))
        assert f"its process {child.pid} on this host is gone" in _taken_over(tmp_path, caplog)
    finally:
        child.wait(timeout=60)


def test_another_srun_step_of_the_same_job_is_not_taken_over(tmp_path, monkeypatch, caplog):
    """Before: any lock of the same Slurm job was taken as left by a requeue, so a second `srun`
    step of a running job took over from the first."""
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "1")
    # the wait for the holder's heartbeat to stop (a few beats) made short; a heartbeat dated in
    # the future stays fresh however long the wait takes
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    write_lock(tmp_path, a_holder(host="node-7", pid=1234, slurm_job="4242", slurm_step="0"), age_s=-3600)
    msg = _refused(tmp_path)
    assert "Slurm job 4242" in msg and "node-7" in msg


def test_a_requeued_job_takes_over_once_the_old_heartbeat_stopped(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    # beats stopped 120 s ago: several heartbeats (30 s) missed, well under the 300 s a lock of
    # another job must wait
    write_lock(tmp_path, a_holder(host="node-7", pid=1234, slurm_job="4242", slurm_step="0"), age_s=120)
    assert "heartbeat stopped" in _taken_over(tmp_path, caplog)
    # a lock of another job on another host, as fresh: refused
    write_lock(tmp_path, a_holder(host="node-7", pid=1234, slurm_job="999", slurm_step="0"), age_s=120)
    _refused(tmp_path)


def test_a_taken_over_owner_leaves_its_successors_lock(tmp_path):
    lock = RunLock(str(tmp_path)).acquire()
    successor = a_holder(token="fedcba9876543210")  # same host and pid: only the token differs
    write_lock(tmp_path, successor)
    lock.release()
    assert json.load(open(tmp_path / LOCK_FILE)) == successor
