"""Supervision of the servers behind an HTTP engine (SGLang, vLLM), written once for both.

A thread polls every server each `interval_s`:
  * liveness: the process, where the engine launched it (exited?), and GET <HEALTH_PATH> (FAILURES
    failures in a row: lost). Polling runs while requests are in flight, so a server whose API
    process lingers after its engine died (it then stops answering but keeps the connections of
    the requests under way) is found in seconds, not after request_timeout_s;
  * identity, once the engine has pushed weights and no push is under way: the weight version the
    server reports (GET <WEIGHT_VERSION_PATH>) is the one the engine pushed. A server restarted
    between two polls (by a node's keeper, an orchestrator, a person) answers its health checks
    but serves the weights it started from: it is found by this, and brought back like a lost one.

A lost server is taken out of service (its requests in flight are cut; they fail retryably and the
engine sends them again once it is back, or to another server), then
  * launched by the engine: its process group is stopped (SIGTERM, then SIGKILL: a server stuck in
    its own shutdown does not hold the restart) and started again with the same argv, and waited
    for up to the engine's ready_timeout_s;
  * given by URL (or launched by someone else: colocated servers are started by each node's local
    rank 0, rollout/colocate.py): waited for, up to `lost_timeout_s`, until it answers again;
then re-synced before it serves (engine._resync_server: the last pushed weights, labelled with
their version) and counted (metrics["restarts"]: `engine_restarts` in every metrics row).
Past `max_restarts`, when a server does not come back in time, or when its weights cannot be
re-synced, the engine is failed: every caller gets one line naming the server and why.

A server it restarts is guarded as the first one was (rollout/process_guard.py: its shim watches
the trainer process, not this thread).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .http_servers import EngineError, wait_until_ready

log = logging.getLogger("gspo_megatron.rollout")


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class ServerSupervisor:
    """Health, restarts and re-syncs of `engine.workers` (module docstring). The engine provides:
    NAME, CONFIG, HEALTH_PATH, `procs` (its launched ServerProcesses, or None), `metrics`,
    `_resync_server(i)`, `_served_version_ok(i)` (None: not checkable now) and a `_sync_lock`
    held through every push."""

    FAILURES = 3

    def __init__(self, engine: Any, *, max_restarts: int, interval_s: float, lost_timeout_s: float,
                 ready_timeout_s: float):
        self.engine = engine
        self.servers = list(engine.workers)
        self.max_restarts, self.interval_s = int(max_restarts), float(interval_s)
        self.lost_timeout_s, self.ready_timeout_s = float(lost_timeout_s), float(ready_timeout_s)
        self.healthy = [threading.Event() for _ in self.servers]
        for e in self.healthy:
            e.set()
        self.failed: str | None = None
        self.fails = [0] * len(self.servers)  # health checks failed in a row, per server
        self.checks = [0] * len(self.servers)  # health checks completed, per server
        engine.metrics.setdefault("restarts", 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{engine.NAME.lower()}-supervisor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ what callers wait on
    def stop(self) -> None:
        self._stop.set()
        for e in self.healthy:
            e.set()
        self._thread.join(timeout=30)

    def _bound_s(self) -> float:
        """The longest a server may be out of service: its restart or its return, and its re-sync."""
        return max(self.ready_timeout_s, self.lost_timeout_s) + 60

    def wait_all_healthy(self) -> None:
        """Until no server is out of service (bounded), or one line if the engine failed."""
        deadline = time.monotonic() + self._bound_s()
        for e in self.healthy:
            while not e.wait(timeout=1.0):
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.engine.NAME} server recovery did not complete within "
                                      f"{self._bound_s():.0f} s")
        if self.failed is not None:
            raise EngineError(self.failed)

    def settle(self, i: int) -> None:
        """After a failed request to server i: wait until the supervisor has checked it since
        (healthy: the caller retries) or, found lost, has brought it back (bounded either way)."""
        c0 = self.checks[i]
        deadline = time.monotonic() + (self.FAILURES + 1) * (self.interval_s + self._health_timeout()) + 5
        while time.monotonic() < deadline and not self._stop.is_set() and self.failed is None:
            if not self.healthy[i].is_set():
                self.wait_all_healthy()
                return
            if self.checks[i] >= c0 + 2 and self.fails[i] == 0:  # a whole check after the failure passed
                return
            time.sleep(0.05)
        if self.failed is not None:
            raise EngineError(self.failed)

    # ------------------------------------------------------------------ the thread
    def _health_timeout(self) -> float:
        return max(5.0, 2 * self.interval_s)

    def _lost(self, i: int) -> str | None:
        """Why server i is out of service, or None while it is fine (and counts its checks)."""
        eng = self.engine
        if eng.procs is not None:
            rc = eng.procs.procs[i].poll()
            if rc is not None:
                return f"its process exited with code {rc}"
        status = None
        try:
            status, _ = self.servers[i].request_once("GET", eng.HEALTH_PATH, timeout_s=self._health_timeout())
        except EngineError as e:
            why = first_line(e)
        else:
            why = f"GET {eng.HEALTH_PATH} answered HTTP {status}"
        if status != 200:
            self.fails[i] += 1
            self.checks[i] += 1
            return (f"{self.fails[i]} health checks failed in a row (last: {why})"
                    if self.fails[i] >= self.FAILURES else None)
        self.fails[i] = 0
        if eng._served_version_ok(i) is False:
            self.healthy[i].clear()  # before the check counts: settle() then waits for the recovery
            self.checks[i] += 1
            return "it answers with other weights than the pushed ones (restarted)"
        self.checks[i] += 1
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.failed is not None:
                continue
            for i in range(len(self.servers)):
                if self._stop.is_set():
                    return
                try:
                    why = self._lost(i)
                    if why is not None:
                        self._recover(i, why)
                        self.fails[i] = 0
                except Exception as e:  # the supervisor itself must not die: fail the engine instead
                    self._fail(i, f"{self.engine.NAME} server {self.servers[i].url}: recovery failed: {first_line(e)}")

    def _fail(self, i: int, msg: str) -> None:
        self.failed = msg
        log.error("%s", msg)
        self.servers[i].cut_inflight(msg)
        self.healthy[i].set()

    def _recover(self, i: int, why: str) -> None:
        eng, s = self.engine, self.servers[i]
        done = int(eng.metrics.get("restarts", 0))
        refusal = eng._resync_refusal()
        if refusal is not None:  # checked before a restart, not after one: a restart would only burn a start
            return self._fail(i, f"{eng.NAME} server {s.url} is dead ({why}); {refusal}")
        if done >= self.max_restarts:
            return self._fail(i, f"{eng.NAME} server {s.url} is dead ({why}) and {eng.CONFIG}.max_restarts="
                                 f"{self.max_restarts} restarts are used up")
        self.healthy[i].clear()
        cut = s.cut_inflight(f"the server was found dead ({why}) and is being brought back")
        t0 = time.perf_counter()
        if eng.procs is not None:
            log.warning("%s server %s is dead (%s): restarting it (%d of at most %d)", eng.NAME, s.url, why, done + 1,
                        self.max_restarts)
            eng.procs.restart(i)
            wait_until_ready([s], self.ready_timeout_s, alive=lambda j: eng.procs.dead(i), path=eng.HEALTH_PATH)
        else:
            log.warning("%s server %s is lost (%s): waiting up to %.0f s (%s.lost_timeout_s) for it to answer again "
                        "(%d of at most %d)", eng.NAME, s.url, why, self.lost_timeout_s, eng.CONFIG, done + 1,
                        self.max_restarts)
            self._wait_back(i)
        eng._resync_server(i)
        eng._inc("restarts")
        log.warning("%s server %s restarted in %.1f s (%d request(s) cut and re-sent), weights version %d reloaded",
                    eng.NAME, s.url, time.perf_counter() - t0, cut, eng.weight_version)
        self.healthy[i].set()

    def _wait_back(self, i: int) -> None:
        """Until server i answers its health check again (bounded by lost_timeout_s; a stop ends it)."""
        s, path = self.servers[i], self.engine.HEALTH_PATH
        deadline = time.monotonic() + self.lost_timeout_s
        while not self._stop.is_set():
            try:
                status, _ = s.request_once("GET", path, timeout_s=self._health_timeout())
                if status == 200:
                    return
            except EngineError:
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"it did not answer GET {path} again within {self.lost_timeout_s:.0f} s "
                                  f"({self.engine.CONFIG}.lost_timeout_s)")
            self._stop.wait(min(1.0, self.interval_s))
        raise EngineError("the engine was closed while waiting for it")


class ProcessKeeper:
    """Restarts the server processes of a ServerProcesses that exit (same argv, same log), at most
    `max_restarts` in all: for servers whose engine sits in another process (colocated SGLang:
    each node's local rank 0 starts its node's servers, global rank 0's engine drives them and
    re-syncs a returned one, ServerSupervisor). A server that hangs without exiting is the
    engine's to find; its process is restarted here only once it exits."""

    def __init__(self, procs: Any, *, max_restarts: int, interval_s: float, name: str = "server"):
        self.procs, self.max_restarts, self.interval_s, self.name = procs, int(max_restarts), float(interval_s), name
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for i, p in enumerate(list(self.procs.procs)):
                if self._stop.is_set():
                    return
                rc = p.poll()
                if rc is None:
                    continue
                if self.restarts >= self.max_restarts:
                    log.error("%s %d exited with code %s; the %d restart(s) allowed are used up", self.name, i, rc,
                              self.max_restarts)
                    self._stop.set()
                    return
                self.restarts += 1
                log.warning("%s %d exited with code %s: restarting it (%d of at most %d)", self.name, i, rc,
                            self.restarts, self.max_restarts)
                try:
                    self.procs.restart(i)
                except Exception as e:  # noqa: BLE001 - the engine then finds it lost and fails in one line
                    log.error("%s %d: restart failed: %s", self.name, i, first_line(e))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# restarts (or returns) per run where the engine's weight sync can re-send the weights to one
# server (disk: the last version directory); none where it cannot (a group broadcast needs the
# trainer, which is generating or training: the config refuses an explicit max_restarts there)
DEFAULT_RESTARTS = 3


def restarts_default(cfg: dict) -> int:
    """A rollout.<engine> section's max_restarts, null resolved: DEFAULT_RESTARTS with disk sync, else 0."""
    if cfg.get("max_restarts") is not None:
        return int(cfg["max_restarts"])
    return DEFAULT_RESTARTS if cfg.get("weight_sync", "disk") == "disk" else 0
