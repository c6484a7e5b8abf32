"""What keeps a launched server from outliving the trainer that started it, whichever process dies
first and however (SIGKILL included, where no stop() or atexit hook runs).

Each started server is three processes of ours around the server's own:

    trainer ──> shim (group leader, new session) ──> server ──> its children (engine core, schedulers)
            └─> watchdog (a session of its own)

- The **shim** is the server's parent and the leader of its process group (the group every stop
  and restart signals). It passes on every signal but SIGKILL by ignoring SIGTERM/SIGINT/SIGHUP
  itself (a group SIGTERM reaches the server; the shim waits for it), exits as the server did (the
  same code, or the same signal: `Popen.returncode` is what the server's would be), and is a child
  subreaper (the server's orphans are reparented to it and reaped). The server is started with
  PR_SET_PDEATHSIG = SIGKILL towards the shim: if the shim dies, by whatever signal, the kernel
  kills the server at once, stopped (SIGSTOP) or stuck in its shutdown. When the trainer is gone
  (the shim's parent changes) the shim stops the group: SIGTERM, then SIGKILL after the grace.
- The **watchdog** watches the trainer and the shim: once either is gone it stops the group the
  same way. A shim killed alone takes the server with it (kernel) and the watchdog then takes the
  server's children; a watchdog killed alone leaves the shim to do it.

So a server outlives its trainer only if the shim *and* the watchdog were killed before it (the
degraded case of issue 52 killed the watchdog and then the trainer: the server had only the
trainer's PR_SET_PDEATHSIG SIGTERM, which a stopped or shutdown-stuck server never acts on). The
server's command line goes to the shim on its stdin, not in its argv: the shim's command line
names nothing of the server's (`ps`, and tests that find a server by its command line, see the
server once)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Mapping, Sequence

# The shim: stdlib only, started with -I -S (no site, no PYTHON* variables of the server's
# environment: a PYTHONPATH meant for the server cannot shadow the stdlib here).
_SHIM = r"""
import ctypes, json, os, signal, sys, time
owner, grace = int(sys.argv[1]), float(sys.argv[2])
argv = json.loads(sys.stdin.buffer.read())
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    prctl = None
if prctl is not None:
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
PASSED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
for s in PASSED:
    signal.signal(s, signal.SIG_IGN)
me = os.getpid()
server = os.fork()
if server == 0:
    try:
        for s in PASSED:
            signal.signal(s, signal.SIG_DFL)  # an ignored signal would stay ignored across exec
        if prctl is not None:
            prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != me:  # the shim died before the line above
            os._exit(137)
        os.execvp(argv[0], argv)
    except BaseException as e:
        os.write(2, ("cannot start %s: %s\n" % (argv[0], e)).encode())
    os._exit(127)
status = None
def reap():
    global status
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False  # no child left: the server and every orphan of its are gone
        if pid == 0:
            return True
        if pid == server:
            status = st
while os.getppid() == owner:
    reap()
    if status is not None:
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
            os.kill(me, sig)
            time.sleep(1)
            os._exit(128 + sig)
        os._exit(os.WEXITSTATUS(status))
    time.sleep(0.1)
os.killpg(0, signal.SIGTERM)  # the trainer is gone: the group (this shim ignores it)
end = time.monotonic() + grace
while time.monotonic() < end and reap():
    time.sleep(0.1)
os.killpg(0, signal.SIGKILL)  # this shim included
"""

# The watchdog (a session of its own): stops the group once the trainer or the shim is gone. It
# exits by itself once the group is gone (a normal stop()).
_WATCHDOG = r"""
import os, signal, sys, time
owner, pgid, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def group_alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
def shim_gone():
    try:
        with open("/proc/%d/stat" % pgid, "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] in (b"Z", b"X")  # exited, not yet reaped
while os.getppid() == owner and not shim_gone():
    if not group_alive():
        sys.exit(0)
    time.sleep(0.2)
try:
    os.killpg(pgid, signal.SIGTERM)
except ProcessLookupError:
    sys.exit(0)
end = time.monotonic() + grace
while time.monotonic() < end and group_alive():
    time.sleep(0.2)
try:
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""

# SIGTERM first, SIGKILL after this many seconds, when the trainer is gone. A module value (not a
# config field): the test that kills the guards sets it short in the process it starts.
GRACE_S = 10.0


def spawn_guarded(argv: Sequence[str], env: Mapping[str, str], stdout, grace_s: float | None = None
                  ) -> subprocess.Popen:
    """Start `argv` under a shim (module docstring) in a new session; the shim's Popen (its pid is
    the group's id). `stdout`: a file or subprocess.PIPE (stderr goes to the same place)."""
    p = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _SHIM, str(os.getpid()), str(GRACE_S if grace_s is None else grace_s)],
        stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True,
        close_fds=True)
    try:
        p.stdin.write(json.dumps(list(argv)).encode())
        p.stdin.close()
    except BrokenPipeError:  # the shim died at once: its exit code and log say so
        pass
    return p


def watch(pgid: int, grace_s: float | None = None) -> subprocess.Popen:
    """The watchdog of group `pgid` (module docstring)."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), str(pgid),
                             str(GRACE_S if grace_s is None else grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)
