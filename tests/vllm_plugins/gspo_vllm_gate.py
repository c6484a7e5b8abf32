"""A gate inside a real vLLM server, for tests: hold the engine mid-generation until a pause request
has reached it, so that an interrupt lands between two tokens of a request by construction.

Loaded by the test's server only (``--scheduler-cls gspo_vllm_gate.HoldUntilPauseScheduler`` with
this folder on its PYTHONPATH, ``GSPO_VLLM_GATE_DIR`` naming a folder the test owns). It is vLLM's
own v1 ``Scheduler`` (what a CPU server runs: async scheduling is off there, platforms/cpu.py:331)
with one addition in ``schedule()``, which the engine core's busy-loop thread calls once per step.
A logits processor would not do: it runs in the worker process (the multiproc executor), which
cannot see the engine core's input queue.

Inert unless armed: a test creates ``<dir>/arm``. Armed, the first step at which some running
request has generated ``HOLD_AFTER`` tokens removes the arm file, writes ``<dir>/held`` and blocks
until the engine core's input queue holds a ``pause_scheduler`` utility call (the client's
``POST /pause``), or for ``TIMEOUT_S`` at most. Why the queue and not a file the test writes: the
busy loop (vllm/v1/engine/core.py:1547-1558) handles queued client requests only between steps,
and the socket thread enqueues them while a step runs (core.py:1931), so a pause seen in the queue
is handled right after this step, one token later. The reason for the release is written to
``<dir>/released`` ("pause" or "timeout"), for the test to assert on.

An arm file holding a port number arms only the server listening there (several servers may share
one gate folder: a trainer's launched replicas share their environment): the engine core reads its
port from its parent's command line (the API server's ``--port N``).
"""
from __future__ import annotations

import os
import sys
import time

from vllm.v1.core.sched.scheduler import Scheduler

HOLD_AFTER = 2
TIMEOUT_S = 60.0


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class HoldUntilPauseScheduler(Scheduler):
    def schedule(self, *args, **kwargs):
        gate = os.environ.get("GSPO_VLLM_GATE_DIR")
        if gate and _armed_here(os.path.join(gate, "arm")) \
                and any(r.num_output_tokens >= HOLD_AFTER for r in self.running):
            self._hold(gate)
        return super().schedule(*args, **kwargs)

    def _hold(self, gate: str) -> None:
        os.remove(os.path.join(gate, "arm"))
        _write(os.path.join(gate, "held"), str(max(r.num_output_tokens for r in self.running)))
        queue = _engine_input_queue()
        deadline = time.monotonic() + TIMEOUT_S
        reason = "timeout"
        while queue is not None and time.monotonic() < deadline:
            if _pause_queued(queue):
                reason = "pause"
                break
            time.sleep(0.002)
        _write(os.path.join(gate, "released"), reason if queue is not None else "no engine core input queue")


def _armed_here(arm: str) -> bool:
    """The arm file exists and names no port, or this server's."""
    try:
        with open(arm) as f:
            want = f.read().strip()
    except OSError:
        return False
    return not want or want == _my_port()


def _my_port() -> str | None:
    """The --port of the API server that started this engine core (its parent), else None."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return None
    return argv[argv.index("--port") + 1] if "--port" in argv[:-1] else None


def _engine_input_queue():
    """The input queue of the EngineCoreProc whose busy loop called us (up the stack)."""
    from vllm.v1.engine.core import EngineCoreProc

    f = sys._getframe(1)
    while f is not None:
        owner = f.f_locals.get("self")
        if isinstance(owner, EngineCoreProc):
            return owner.input_queue
        f = f.f_back
    return None


def _pause_queued(queue) -> bool:
    from vllm.v1.engine import EngineCoreRequestType

    with queue.mutex:  # a snapshot; the busy loop takes from the queue only after this step
        pending = list(queue.queue)
    return any(kind == EngineCoreRequestType.UTILITY and req[2] == "pause_scheduler" for kind, req in pending)
