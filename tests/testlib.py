"""The suite's shared helpers: ports, process trees and run launching (one copy each).

* `free_port`, `vllm_port` - a port for a child to bind (dist_utils retries rendezvous collisions).
* `descendants`, `cmdline` - a process tree read from /proc (never by name).
* `torchrun_cmd`, `run_env`, `run_torchrun` - a real `torchrun ... -m gspo_megatron.train` launch, for
  what only a real launch shows: argument parsing by torchrun, signals, exit codes, kill -9.
* `train_pooled` - the same command line run by the trainer's own `main(argv)` inside the pooled
  gloo ranks of tests/dist_utils.py: every branch of the CLI after torchrun (config parsing, input
  checks, run lock, config dump, training, export, one-line errors and exit codes) without paying a
  torchrun, two interpreters and two Megatron imports (~13 s of CPU) per run. It returns what
  `subprocess.run` would (`returncode`, `stdout`, `stderr`), so a test reads the same either way.
"""
from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_trees(*roots: str):
    """(path relative to the repository, ast of the file) of every .py file under the repository's
    `roots` (e.g. "gspo_megatron"): the source checks that hold something by construction."""
    import ast

    for root in roots:
        for dirpath, _, files in os.walk(os.path.join(REPO, root)):
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    with open(path) as f:
                        yield os.path.relpath(path, REPO), ast.parse(f.read(), path)


def free_port() -> int:
    """A port the kernel says is free now (the caller's child binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_port() -> int:
    """A free port (and the next one: vLLM's data-parallel servers use port + i) for a server that
    binds only after loading its engine (tens of seconds), chosen below the kernel's ephemeral
    range: any process's outgoing connection takes its source port from that range, so a port the
    kernel handed out could be taken before the server binds it ("Address already in use")."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, max(low, 20002) - 1)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    return free_port()  # no free port below the range: the kernel's choice


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, parents before their children, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, seen, todo = [], set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in seen:
                seen.add(c)
                out.append(c)
                todo.append(c)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def still_running(pids, timeout_s: float) -> list[int]:
    """Those of `pids` still running (a zombie has no cmdline) once they are all gone or `timeout_s`
    has passed: a killed process, or a server stopped by its guards, exits asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = [q for q in pids if os.path.exists(f"/proc/{q}") and cmdline(q)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)  # a poll interval


def run_env(**extra: str) -> dict:
    """The environment of a launched run: ours, one thread per rank, no torchrun variables."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    return env


def torchrun_cmd(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            "--standalone", "-m", "gspo_megatron.train", *args]  # torchrun binds a free port itself


def run_torchrun(nproc: int, *args: str, timeout: float = 900, env: dict | None = None):
    return subprocess.run(torchrun_cmd(nproc, *args), capture_output=True, text=True, timeout=timeout,
                          env=env or run_env(), cwd=REPO)


@dataclass
class PooledRun:
    """What `subprocess.run(torchrun_cmd(...), capture_output=True)` gives, from pooled ranks:
    the first non-zero rank status (else 0), and the ranks' captured streams, rank 0 first."""
    returncode: int
    stdout: str
    stderr: str


_MAINS = {"gspo_megatron.train": "gspo_megatron.train.__main__", "gspo_megatron.score": "gspo_megatron.score"}


def _main_rank(rank, world, module, argv, env, cwd):
    """One pooled rank: `python -m <module> argv` as torchrun would run it here, with this call's
    environment and working directory, its streams captured and the process put back as it was
    (logging handlers, environment, cwd) for the next test."""
    import contextlib
    import importlib
    import io
    import logging

    main = importlib.import_module(_MAINS[module]).main

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out, err = io.StringIO(), io.StringIO()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as e:  # argparse and the one-line user errors exit 2
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        for h in root.handlers[:]:  # basicConfig bound them to this call's captured stream
            if h not in handlers:
                root.removeHandler(h)
        root.setLevel(level)
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    if rc != 0:
        # as torchrun does: a rank that exits non-zero stops the job. Raised, the pool stops waiting
        # for the other ranks (which may wait for this one in a rendezvous or a collective forever)
        # and discards them; main_pooled reads the status and streams back from the message.
        import json

        raise _RankExit(_EXIT_MARK + json.dumps([rank, rc, out.getvalue(), err.getvalue()]))
    return rc, out.getvalue(), err.getvalue()


_EXIT_MARK = "gspo-pooled-rank-exit:"


class CleanExit(Exception):
    """Raised by a pooled rank function (tests/dist_utils.py) that failed as a run fails, its own
    teardown done (the trainer's main returning non-zero: _RankExit): when every rank has reported
    and every failure is one of these, the pool's processes are as clean as after a success and
    are kept."""


class _RankExit(CleanExit):
    """A pooled main that returned non-zero (its run's teardown done): the pool keeps its ranks
    when every rank has reported (dist_utils.CleanExit)."""


def main_pooled(module: str, nproc: int, *argv: str, timeout: float = 900, env: dict | None = None,
                cwd: str = REPO) -> PooledRun:
    """`torchrun --nproc-per-node nproc -m <module> argv` (module: gspo_megatron.train or
    gspo_megatron.score) in the pooled ranks of dist_utils (see the module docstring). An exception
    that escapes main on a rank is raised here with every rank's traceback (the pool is then
    discarded, as dist_utils does for any failure)."""
    from dist_utils import run_distributed

    # what a launched child inherits: this process's environment now (a test's monkeypatch.setenv
    # included), less torchrun's variables (the pool sets its own), plus `env`
    env = run_env(**(env or {}))
    try:
        results = run_distributed(_main_rank, nproc, module, list(argv), env, cwd, timeout=timeout)
    except RuntimeError as e:
        run = pooled_exit(str(e))
        if run is None:
            raise
        return run
    return PooledRun(0, "".join(r[1] for r in results), "".join(r[2] for r in results))


def pooled_exit(text: str) -> PooledRun | None:
    """The PooledRun of a pool failure's message, when ranks exited non-zero (else None): every
    rank that did so within the pool's grace (dist_utils.FAILURE_GRACE_S), in rank order, the
    status of the lowest and the streams of all (torchrun shows them all)."""
    if _EXIT_MARK not in text:
        return None
    import json

    exits = sorted(json.loads(part.splitlines()[0]) for part in text.split(_EXIT_MARK)[1:])
    return PooledRun(exits[0][1], "".join(x[2] for x in exits), "".join(x[3] for x in exits))


def train_pooled(nproc: int, *argv: str, **kw) -> PooledRun:
    """`torchrun --nproc-per-node nproc -m gspo_megatron.train argv`, in pooled ranks."""
    return main_pooled("gspo_megatron.train", nproc, *argv, **kw)

