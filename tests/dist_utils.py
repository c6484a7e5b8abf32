"""Spawn gloo ranks for multi-process tests.

Each test picks a free port in the parent (retried with a fresh one if it is taken before rank 0
binds it), starts `world_size` processes with the spawn method, bounds the whole run with a
timeout and terminates only the processes it started. Rank functions
must be module-level (picklable) and receive `(rank, world_size, *args)`; whatever rank returns is
sent back to the parent, which gets a list indexed by rank.
"""
from __future__ import annotations

import os
import pickle
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, queue):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        out = fn(rank, world_size, *args)
        # plain pickle to bytes: tensors must not travel as shared-memory handles that die with us
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report the traceback to the parent instead of dying silently
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


PORT_TAKEN = ("address already in use", "eaddrinuse")


def port_collision(text: str) -> bool:
    """Whether a failure is the port picked by free_port() being taken before its user bound it
    (the race between releasing the probe socket and the rendezvous binding the port)."""
    low = text.lower()
    return any(s in low for s in PORT_TAKEN)


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, attempts: int = 3
) -> list[Any]:
    """Run `fn` on `world_size` gloo ranks; a rendezvous port taken by someone else in between
    is retried with a fresh port (up to `attempts` runs), any other failure is raised."""
    for attempt in range(attempts):
        try:
            return _run_once(fn, world_size, args, timeout)
        except RuntimeError as e:
            if attempt + 1 == attempts or not port_collision(str(e)):
                raise


def with_free_port(run: Callable[[int], Any], attempts: int = 3, free: Callable[[], int] | None = None) -> Any:
    """run(port) with a port free now; when `run` reports that someone took the port before the
    process it started could bind it (an exception, or a CompletedProcess failing, whose text
    says so), again with a fresh port. For servers and rendezvous the test cannot bind itself."""
    for attempt in range(attempts):
        port = (free or free_port)()
        try:
            out = run(port)
        except Exception as e:
            if attempt + 1 == attempts or not port_collision(str(e)):
                raise
            continue
        failed = getattr(out, "returncode", 0) != 0
        if failed and attempt + 1 < attempts and port_collision(f"{out.stdout}{out.stderr}"):
            continue
        return out


def _run_once(fn, world_size, args, timeout):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, queue), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"distributed test timed out after {timeout}s ({len(results)} ranks done)")
            try:
                rank, ok, out = queue.get(timeout=min(remaining, 5.0))
            except _q.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and queue.empty():
                    raise RuntimeError(f"rank process died with exit code {dead[0].exitcode}")
                continue
            if ok:
                results[rank] = pickle.loads(out)
            else:
                errors.append(f"rank {rank}:\n{out}")
                break  # other ranks may now hang in a collective: stop them below
    finally:
        for p in procs:
            p.join(timeout=10 if not errors else 1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
