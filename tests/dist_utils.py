"""Spawn gloo ranks for multi-process tests.

Each call picks a free port in the parent (retried with a fresh one if it is taken before rank 0
binds it), runs the rank function on `world_size` processes started with the spawn method,
bounds the whole run with a timeout and terminates only the processes it started. Rank
functions must be module-level (picklable) and receive `(rank, world_size, *args)`; whatever rank
returns is sent back to the parent, which gets a list indexed by rank.

Worker reuse. Starting a rank costs ~6 s of imports (torch, Megatron, transformers) - more than
most tests' work - so by default the ranks of one world size are kept alive between calls (a
pool per world size, per pytest process): each call still gets its own port, its own process
group (destroyed after the call) and the rank function's own setup/teardown (init_parallel /
destroy_parallel). A call that fails or times out discards its pool (the next call starts fresh
processes), so one test's half-torn-down state cannot leak into the next; a pool whose processes
hold many threads (gloo's, alive while their process groups are) is collected and, if still over
the bound, replaced. A trainer run frees its process groups when it ends
(gspo_megatron/parallel/ddp.py release_model): a pool now serves many runs, where it was replaced
after every one or two (~80 pool starts a suite, ~7 s of CPU each).
GSPO_POOL_LOG=<file> appends a JSON line per pool start and per pool discarded (why, which test).
`fresh=True` runs on new processes (for tests about what a new process sees, e.g. test_cpu_runtime).
"""
from __future__ import annotations

import os
import pickle
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 300


from testlib import CleanExit, free_port  # noqa: E402,F401 - one copy (tests/testlib.py); imported from here too


def _cpu_imports() -> None:
    """What `python -m gspo_megatron.train` does on CPU before Megatron is imported: its fused
    kernels without torch.compile (parallel/cpu_runtime.py skip_compiled_fusions; ~1 s and
    ~110 MiB per process)."""
    import torch

    if not torch.cuda.is_available():
        from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

        skip_compiled_fusions()


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
    _cpu_imports()
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
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S, attempts: int = 3,
    fresh: bool = False,
) -> list[Any]:
    """Run `fn` on `world_size` gloo ranks; a rendezvous port taken by someone else in between
    is retried with a fresh port (up to `attempts` runs), any other failure is raised."""
    for attempt in range(attempts):
        try:
            if fresh:
                return _run_once(fn, world_size, args, timeout)
            return _pool(world_size).run(fn, args, timeout)
        except RuntimeError as e:
            if attempt + 1 == attempts or not port_collision(str(e)):
                raise


_POOLS: dict[int, "_Pool"] = {}  # world size -> live ranks of this pytest process
# Process groups that gloo tore down keep their "gloo_tcp_loop" threads, which poll: a pooled rank
# with hundreds of them burns the CPU the next tests need, so it is replaced beyond this count.
MAX_POOLED_THREADS = 150
FAILURE_GRACE_S = 10.0  # after a rank fails, how long the others may still report (see _Pool.run)


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _log(what, detail=None):
    path = os.environ.get("GSPO_POOL_LOG")
    if path:
        import json
        with open(path, "a") as f:
            f.write(json.dumps([what, os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_CURRENT_TEST"), detail]) + "\n")


def _pool(world_size: int) -> "_Pool":
    p = _POOLS.get(world_size)
    if p is None or not p.alive():
        _log("start", [world_size, p is not None])
        p = _POOLS[world_size] = _Pool(world_size)
    return p


def _collect(rank, world_size):
    """Free what finished tasks left: a rank function that wrapped a model in Megatron's DDP and
    returned without gspo_megatron.parallel.ddp.release_model (the trainer calls it; most test
    helpers build, step and return) leaves the model in a cycle through C++ that the collector
    cannot see, holding its process groups and their gloo threads. Release every such model still
    in the process, then collect (two passes: the first frees the cycles, their finalizers the rest)."""
    import gc

    from megatron.core.distributed import DistributedDataParallel

    from gspo_megatron.parallel.ddp import release_model

    gc.collect()
    release_model([o for o in gc.get_objects() if isinstance(o, DistributedDataParallel)])
    gc.collect()
    gc.collect()


def _serve(rank, world_size, tasks, results):
    """A pooled rank: run tasks until told to stop; each task sets its own rendezvous port."""
    _cpu_imports()
    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    while True:
        task = tasks.get()
        if task is None:
            return
        fn, port, args = task
        os.environ["MASTER_PORT"] = str(port)
        try:
            out = fn(rank, world_size, *args)
            results.put((rank, True, pickle.dumps(out)))
        except CleanExit:  # ok == None: failed, the process as clean as after a success
            results.put((rank, None, traceback.format_exc()))
        except BaseException:
            results.put((rank, False, traceback.format_exc()))
        finally:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, self.tasks[r], self.results), daemon=False)
                      for r in range(world_size)]
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, fn, args, timeout):
        import queue as _q
        import time

        port = free_port()
        for q in self.tasks:
            q.put((fn, port, args))
        results: dict[int, Any] = {}
        errors: list[str] = []
        clean = True  # every failure so far a CleanExit
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if errors:
                        break  # the grace after a failure is over: the others hang or are slow
                    raise TimeoutError(f"distributed test timed out after {timeout}s ({len(results)} ranks done)")
                try:
                    rank, ok, out = self.results.get(timeout=min(remaining, 5.0))
                except _q.Empty:
                    if not self.alive():
                        raise RuntimeError("a pooled rank process died") from None
                    continue
                if ok:
                    results[rank] = pickle.loads(out)
                else:
                    clean = clean and ok is None
                    errors.append(f"rank {rank}:\n{out}")
                    # the other ranks may now hang in a collective (the pool is discarded below),
                    # or be about to fail as well, with their own output: as torchrun gives its
                    # other workers a moment after the first failure, take what they report within
                    # FAILURE_GRACE_S (e.g. the one error line only rank 0 prints)
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        except BaseException:
            self.close()
            raise
        if errors:
            if not (clean and len(results) + len(errors) == self.world_size):
                _log("errors", [e[:200] for e in errors])
                self.close()  # a rank may hang in a collective or hold half-torn-down state
            raise RuntimeError("\n".join(sorted(errors, key=lambda e: int(e.split(":", 1)[0].split()[1]))))
        if max(_threads(p.pid) for p in self.procs) > MAX_POOLED_THREADS:
            # gloo's threads live as long as their process groups: a run's groups are freed by the
            # cyclic collector, which may not have run since (two passes: the first frees the run's
            # cycles, whose finalizers release the rest); only a pool still over the bound is replaced
            try:
                for q in self.tasks:
                    q.put((_collect, 0, ()))
                for _ in self.procs:
                    self.results.get(timeout=60)
            except Exception:
                self.close()
                return [results[r] for r in range(self.world_size)]
            if max(_threads(p.pid) for p in self.procs) > MAX_POOLED_THREADS:
                _log("threads", [_threads(p.pid) for p in self.procs])
                self.close()  # start afresh
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Terminate this pool's processes (bounded waits); the next call starts a new pool."""
        for q in self.tasks:
            try:
                q.put_nowait(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=2)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for w, pool in list(_POOLS.items()):
            if pool is self:
                del _POOLS[w]


def close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()


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
