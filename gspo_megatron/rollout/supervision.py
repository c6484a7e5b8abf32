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


class _Watch:
    """One supervised server: in service (healthy), health checks failed in a row, checks done."""

    def __init__(self, launched_index: int | None):
        self.healthy = threading.Event()
        self.healthy.set()
        self.fails = 0
        self.checks = 0
        self.launched = launched_index  # its index in engine.procs, when the engine launched it


class ServerSupervisor:
    """Health, restarts and re-syncs of the engine's workers (module docstring), and the servers
    that join or leave while the run goes on (`add` / `remove`: rollout/membership.py). The
    engine provides: NAME, CONFIG, HEALTH_PATH, `workers`, `procs` (its launched ServerProcesses, or
    None), `metrics`, `_inc`, `weight_version`, `_resync_server(server)`,
    `_served_version_ok(server)` (None: not checkable now) and `_resync_refusal()`."""

    FAILURES = 3

    def __init__(self, engine: Any, *, max_restarts: int, interval_s: float, lost_timeout_s: float,
                 ready_timeout_s: float, tick: Any = None):
        self.engine = engine
        self.max_restarts, self.interval_s = int(max_restarts), float(interval_s)
        self.lost_timeout_s, self.ready_timeout_s = float(lost_timeout_s), float(ready_timeout_s)
        launched = engine.procs is not None
        self._watch: dict[Any, _Watch] = {s: _Watch(i if launched else None) for i, s in enumerate(engine.workers)}
        self.failed: str | None = None
        self._tick = tick  # called once per round, in this thread (membership changes)
        engine.metrics.setdefault("restarts", 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{engine.NAME.lower()}-supervisor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ membership
    def add(self, server: Any, launched_index: int | None = None) -> None:
        """A server that joined (already re-synced by the caller): watched from now on; a launched
        replica (its index in engine.procs) is restarted if lost, others waited for."""
        self._watch = {**self._watch, server: _Watch(launched_index)}

    def remove(self, server: Any) -> None:
        """A server that left: no longer watched (its requests in flight finish or fail over)."""
        self._watch = {s: w for s, w in self._watch.items() if s is not server}

    def watches(self, server: Any) -> bool:
        return server in self._watch

    def in_service(self, servers: list) -> list:
        """Of `servers`, the ones not being brought back (unwatched ones count as in service)."""
        w = self._watch
        return [s for s in servers if s not in w or w[s].healthy.is_set()]

    # ------------------------------------------------------------------ what callers wait on
    def stop(self) -> None:
        self._stop.set()
        for w in self._watch.values():
            w.healthy.set()
        self._thread.join(timeout=30)

    def _bound_s(self) -> float:
        """The longest a server may be out of service: its restart or its return, and its re-sync."""
        return max(self.ready_timeout_s, self.lost_timeout_s) + 60

    def wait_all_healthy(self) -> None:
        """Until no server is out of service (bounded), or one line if the engine failed."""
        deadline = time.monotonic() + self._bound_s()
        for w in list(self._watch.values()):
            while not w.healthy.wait(timeout=1.0):
                if time.monotonic() > deadline:
                    raise EngineError(f"{self.engine.NAME} server recovery did not complete within "
                                      f"{self._bound_s():.0f} s")
        if self.failed is not None:
            raise EngineError(self.failed)

    def settle(self, server: Any) -> None:
        """After a failed request to `server`: wait until the supervisor has checked it since
        (healthy: the caller retries) or, found lost, has brought it back (bounded either way).
        A server no longer watched (it left) is not waited for."""
        w = self._watch.get(server)
        if w is None:
            return
        if w.healthy.is_set() and self._answers_now(server):
            return  # alive and serving the pushed weights: a transient failure, retried at once
        c0 = w.checks
        deadline = time.monotonic() + (self.FAILURES + 1) * (self.interval_s + self._health_timeout()) + 5
        while time.monotonic() < deadline and not self._stop.is_set() and self.failed is None:
            if server not in self._watch:
                return
            if not w.healthy.is_set():
                self.wait_all_healthy()
                return
            if w.checks >= c0 + 2 and w.fails == 0:  # a whole check after the failure passed
                return
            time.sleep(0.05)
        if self.failed is not None:
            raise EngineError(self.failed)

    def _answers_now(self, server: Any) -> bool:
        """One health check of `server` now, and its weight version where it can be told: a
        request that failed on a server that still answers needs no supervisor round to retry."""
        try:
            status, _ = server.request_once("GET", self.engine.HEALTH_PATH, timeout_s=self._health_timeout())
        except EngineError:
            return False
        return status == 200 and self.engine._served_version_ok(server) is not False

    # ------------------------------------------------------------------ the thread
    def _health_timeout(self) -> float:
        return max(5.0, 2 * self.interval_s)

    def _lost(self, s: Any, w: _Watch) -> str | None:
        """Why server s is out of service, or None while it is fine (and counts its checks)."""
        eng = self.engine
        if w.launched is not None:
            rc = eng.procs.procs[w.launched].poll()
            if rc is not None:
                return f"its process exited with code {rc}"
        status = None
        try:
            status, _ = s.request_once("GET", eng.HEALTH_PATH, timeout_s=self._health_timeout())
        except EngineError as e:
            why = first_line(e)
        else:
            why = f"GET {eng.HEALTH_PATH} answered HTTP {status}"
        if status != 200:
            w.fails += 1
            w.checks += 1
            return f"{w.fails} health checks failed in a row (last: {why})" if w.fails >= self.FAILURES else None
        w.fails = 0
        if eng._served_version_ok(s) is False:
            w.healthy.clear()  # before the check counts: settle() then waits for the recovery
            w.checks += 1
            return "it answers with other weights than the pushed ones (restarted)"
        w.checks += 1
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self.failed is not None:
                continue
            if self._tick is not None:
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001 - a membership change is tried again next round
                    log.warning("%s servers: membership change failed: %s", self.engine.NAME, first_line(e))
            for s, w in list(self._watch.items()):
                if self._stop.is_set():
                    return
                if s not in self._watch:
                    continue
                try:
                    why = self._lost(s, w)
                    if why is not None:
                        self._recover(s, w, why)
                        w.fails = 0
                except Exception as e:  # the supervisor itself must not die: fail the engine instead
                    self._fail(s, w, f"{self.engine.NAME} server {s.url}: recovery failed: {first_line(e)}")

    def _fail(self, s: Any, w: _Watch, msg: str) -> None:
        self.failed = msg
        log.error("%s", msg)
        s.cut_inflight(msg)
        w.healthy.set()

    def _recover(self, s: Any, w: _Watch, why: str) -> None:
        eng = self.engine
        done = int(eng.metrics.get("restarts", 0))
        refusal = eng._resync_refusal()
        if refusal is not None:  # checked before a restart, not after one: a restart would only burn a start
            return self._fail(s, w, f"{eng.NAME} server {s.url} is dead ({why}); {refusal}")
        if done >= self.max_restarts:
            return self._fail(s, w, f"{eng.NAME} server {s.url} is dead ({why}) and {eng.CONFIG}.max_restarts="
                                    f"{self.max_restarts} restarts are used up")
        w.healthy.clear()
        cut = s.cut_inflight(f"the server was found dead ({why}) and is being brought back")
        t0 = time.perf_counter()
        if w.launched is not None:
            i = w.launched
            log.warning("%s server %s is dead (%s): restarting it (%d of at most %d)", eng.NAME, s.url, why, done + 1,
                        self.max_restarts)
            eng.procs.restart(i)
            wait_until_ready([s], self.ready_timeout_s, alive=lambda j: eng.procs.dead(i), path=eng.HEALTH_PATH)
        else:
            log.warning("%s server %s is lost (%s): waiting up to %.0f s (%s.lost_timeout_s) for it to answer again "
                        "(%d of at most %d)", eng.NAME, s.url, why, self.lost_timeout_s, eng.CONFIG, done + 1,
                        self.max_restarts)
            self._wait_back(s)
        eng._resync_server(s)
        eng._inc("restarts")
        log.warning("%s server %s restarted in %.1f s (%d request(s) cut and re-sent), weights version %d reloaded",
                    eng.NAME, s.url, time.perf_counter() - t0, cut, eng.weight_version)
        w.healthy.set()

    def _wait_back(self, s: Any) -> None:
        """Until server s answers its health check again (bounded by lost_timeout_s; a stop ends it)."""
        path = self.engine.HEALTH_PATH
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
