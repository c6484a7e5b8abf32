"""What every engine behind HTTP servers shares (SGLang, vLLM): readiness, the version check, the
smoke check's server rows, the served weight versions, closing. What each engine can do beyond
that is declared (rollout/base.py Capabilities), never found out from its name or attributes.

An engine class says what differs in class attributes (its name, the route and field that report
its version and its weight version, the version it speaks, the hint of its config section) and
keeps what is its own (generation, weight sync, restarts). The same mismatch is then the same one
line from every engine (EngineVersionError: an InputError, which entry points print as one line).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Any, Callable, Iterator

from gspo_megatron.errors import InputError

from .base import RolloutEngine
from .http_servers import EngineError, EngineProtocolError, ServerClient, wait_until_ready

log = logging.getLogger("gspo_megatron.rollout")


class EngineVersionError(EngineProtocolError, InputError):
    """A server runs another engine version than the one the project speaks (one line)."""


class HTTPEngine(RolloutEngine):
    """Base of the engines whose servers speak HTTP. Subclasses set the class attributes below and
    `self.servers` (ServerClient per server), `self.procs` (the launched ServerProcesses or None),
    `self._closed`, `self.ready_timeout_s`."""

    NAME = "engine"  # "SGLang", "vLLM": in every message
    CONFIG = "rollout.<engine>"  # the config section, for hints
    VERSION_PATH = "/version"  # GET: a JSON object with "version"
    SPOKEN_VERSION = ""  # the version the project's API table is written against
    API_MODULE = ""  # that table, for messages
    WEIGHT_VERSION_PATH = "/weight_info"  # GET: the weight version the server serves
    HEALTH_PATH = "/health"
    VERSION_ERROR: type[EngineVersionError] = EngineVersionError
    CLIENT: type = ServerClient  # the engine's client class (its errors' names)
    _client_kw: dict  # the keywords of every client of the engine (set in its __init__)
    version_matches: Callable[[Any], tuple[bool, str | None]]  # the API module's release check

    servers: list  # what requests go to
    workers: list  # the servers behind them (SGLang's router aside: its workers; else `servers`)
    procs: Any = None
    _closed: bool = False
    _synced: bool = False  # True once the engine pushed weights
    _supervisor: Any = None  # rollout/supervision.py ServerSupervisor, once _supervise ran
    _push_seq: int = 0  # odd while a push is under way (pushes to one engine never overlap)
    _members: Any = None  # rollout/membership.py Membership, with a urls_file
    _replicas: Any = None  # rollout/membership.py Replicas, with a replicas_file

    def wait_ready(self, timeout_s: float | None = None) -> float:
        t = self.ready_timeout_s if timeout_s is None else timeout_s
        if self.procs is not None:
            return self.procs.wait_ready(self.servers, t)
        return wait_until_ready(self.servers, t, path=self.HEALTH_PATH)

    def _reported_version(self, server) -> str | None:
        info = server.get(self.VERSION_PATH, timeout_s=30, retries=1)
        return info.get("version") if isinstance(info, dict) else None

    def check_version(self, strict: bool = True) -> None:
        """Every worker's reported version is the one the project speaks (request fields and routes
        change between releases, and a mismatch otherwise shows up as odd 4xx errors in the middle
        of a run): one line (strict) or a warning. A worker that does not report it is left alone."""
        for s in self.workers:
            try:
                got = self._reported_version(s)
            except EngineError:
                continue
            if got is None:
                continue
            ok, note = type(self).version_matches(got)
            if ok:
                if note:
                    log.info("%s server %s: %s", self.NAME, s.url, note)
                continue
            msg = (f"{self.NAME} server {s.url} runs version {got}; this project speaks {self.SPOKEN_VERSION} "
                   f"({self.API_MODULE}): use that server version, or set {self.CONFIG}.check_version=false "
                   "to try anyway")
            if strict:
                raise self.VERSION_ERROR(msg)
            warnings.warn(msg, stacklevel=2)

    def server_software_checks(self) -> list[tuple[str, bool | None, str]]:
        """Every worker's reported version against the spoken one (check_version's test, reported
        per server; ok None when it differs: the engine refused it at start unless the config
        turned the check off)."""
        rows = []
        for s in self.workers:
            try:
                got = self._reported_version(s)
            except EngineError as e:
                rows.append((s.url, False, f"{self.VERSION_PATH} failed: {e}"))
                continue
            ok = got is not None and type(self).version_matches(got)[0]
            rows.append((s.url, True if ok else None, f"{self.NAME} {got or '(version not reported)'}"
                         + ("" if ok else f", the project speaks {self.SPOKEN_VERSION}")))
        return rows

    def server_weight_versions(self) -> dict[str, str | None]:
        """The weight version every worker serves (GET WEIGHT_VERSION_PATH); None where it fails."""
        out = {}
        for s in self.workers:
            try:
                r = s.get(self.WEIGHT_VERSION_PATH, timeout_s=10, retries=0)
                out[s.url] = r.get("weight_version", r.get("version")) if isinstance(r, dict) else r
            except EngineError:
                out[s.url] = None
        return out

    # ------------------------------------------------------------------ the refit probe
    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """Every worker's log-probs at temperature 1 of token_ids[1:], each given the tokens before
        it (train/refit_check.py): one request per worker (each holds its own copy of the
        weights), `_probe_rows` its per-position entries, `_probe_logprob` each entry's value."""
        self._check_open()
        ids = [int(t) for t in token_ids]
        out = {}
        for s in self.workers:
            rows = self._probe_rows(s, ids)
            if not isinstance(rows, list) or len(rows) != len(ids):
                raise EngineProtocolError(f"{self.NAME} server {s.url}: the log-prob probe answered no per-token "
                                          f"log-probs for {len(ids)} tokens: {str(rows)[:300]}")
            out[s.url] = [self._probe_logprob(s, row, t) for t, row in zip(ids[1:], rows[1:])]
        return out

    def _probe_rows(self, server, ids: list[int]) -> Any:
        """The per-position entries of one probe request (engine-specific route and field)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a probe sequence")

    def _probe_logprob(self, server, row: Any, token: int) -> float:
        """The log-prob of `token` in one entry (EngineProtocolError naming the server if absent)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ supervision
    def _supervise(self, max_restarts: int, interval_s: float, lost_timeout_s: float) -> None:
        """Watch every worker (rollout/supervision.py): a lost one is restarted (launched here) or
        waited for (given), and re-synced (`_resync_server`), at most max_restarts times."""
        from .supervision import ServerSupervisor

        tick = self._membership_tick if (self._members is not None or self._replicas is not None) else None
        self._supervisor = ServerSupervisor(self, max_restarts=max_restarts, interval_s=interval_s,
                                            lost_timeout_s=lost_timeout_s, ready_timeout_s=self.ready_timeout_s,
                                            tick=tick)

    @property
    def _push_lock(self) -> threading.Lock:
        return self.__dict__.setdefault("_push_lock_", threading.Lock())

    @contextlib.contextmanager
    def _pushing_weights(self) -> Iterator[None]:
        """Around a push: no server joins meanwhile (it would miss the push), and the supervisor
        does not read a server's weight version (the servers are relabelled one by one, before the
        engine's own version moves)."""
        with self._push_lock:
            self._push_seq += 1
            try:
                yield
            finally:
                self._push_seq += 1

    # ------------------------------------------------------------------ servers that come and go
    def _urls_from_file(self, path: str) -> list[str]:
        """The servers a urls_file lists now; the file is watched from here on (rollout/membership.py)."""
        from .membership import Membership

        self._members = Membership(self, path)
        return self._members.initial()

    def _membership_tick(self) -> None:
        """Once per supervisor round: the urls_file's and the replicas file's changes."""
        if self._members is not None:
            self._members.refresh(block=False)
        if self._replicas is not None:
            self._replicas.refresh()

    def _replicas_from_file(self, path: str, default: int, max_replicas: int) -> int:
        """How many servers to launch (a replicas file's number, else `default`); the file is
        watched from here on, in the supervisor's thread (rollout/membership.py Replicas)."""
        from .membership import Replicas

        self._replicas = Replicas(self, path, max_replicas)
        return self._replicas.initial(default)

    def _refresh_members(self) -> None:
        """The urls_file's changes, applied before a generation (waiting for a push under way)."""
        if self._members is not None:
            self._members.refresh(block=True)

    def _make_client(self, url: str):
        """A client of one server, as all of the engine's (CLIENT with `_client_kw`: key, timeouts,
        retries, caps)."""
        return self.CLIENT(url, **self._client_kw)

    def _set_servers(self, servers: list) -> None:
        """Replace the server list (a new list: readers iterate the one they took)."""
        self.servers = list(servers)
        self.metrics["servers"] = len(self.servers)

    def _join(self, url: str, block: bool, launched: int | None = None) -> bool:
        """Server `url` joins if it answers its health check and speaks the project's version,
        after a catch-up to the weights the others serve (under the push lock); False: not now.
        `launched`: its index in `procs` (a launched replica: restarted, not waited for, if lost)."""
        s = self._make_client(url)
        try:
            status, _ = s.request_once("GET", self.HEALTH_PATH, timeout_s=10)
        except EngineError:
            status = None
        if status != 200:
            return False
        try:
            got = self._reported_version(s)
        except EngineError:
            got = None
        if got is not None and not type(self).version_matches(got)[0]:
            log.warning("%s server %s runs version %s; this project speaks %s: it does not join", self.NAME, url, got,
                        self.SPOKEN_VERSION)
            return False
        if not self._push_lock.acquire(blocking=block):
            return False
        try:
            self._resync_server(s)  # the weights and version label the others serve
            self._set_servers(self.servers + [s])
            if self._supervisor is not None:
                self._supervisor.add(s, launched)
        finally:
            self._push_lock.release()
        self._inc("servers_joined")
        log.warning("%s server %s joined at weight version %d (%d servers)", self.NAME, url, self.weight_version,
                    len(self.servers))
        return True

    def _leave(self, server, why: str = "the server left the urls_file") -> None:
        """`server` leaves: no new request, no push, and its requests in flight are cut: they are
        sent again to the others (a retry each), so a server removed mid-generation loses no sample."""
        self._set_servers([s for s in self.servers if s is not server])
        if self._supervisor is not None:
            self._supervisor.remove(server)
        cut = server.cut_inflight(why)
        self._inc("servers_left")
        log.warning("%s server %s left (%d servers; %d request(s) of it sent to the others)", self.NAME, server.url,
                    len(self.servers), cut)

    def _served_version_ok(self, server) -> bool | None:
        """Whether `server` reports serving the weight version the engine pushed last; None when it
        cannot be told now (nothing pushed yet, a push under way, no answer, no version reported)."""
        seq = self._push_seq
        if not self._synced or seq % 2:
            return None
        try:
            r = server.get(self.WEIGHT_VERSION_PATH, timeout_s=10, retries=0)
        except EngineError:
            return None
        got = r.get("weight_version", r.get("version")) if isinstance(r, dict) else None
        if got is None or self._push_seq != seq:
            return None
        return str(got) == str(self.weight_version)

    def _resync_refusal(self) -> str | None:
        """Why a lost server could not get the pushed weights back (None: it can, _resync_server)."""
        return None

    def _resync_server(self, server) -> None:
        """`server`, back after a loss (or joining): the last pushed weights, labelled with their version."""
        raise NotImplementedError

    def _settle(self, server) -> None:
        """After a failed request to `server`: its supervisor's verdict (rollout/supervision.py)."""
        if self._supervisor is not None:
            self._supervisor.settle(server)

    def _in_service(self) -> list:
        """The servers requests may go to now: not those being brought back (when all are, the
        wait for them, bounded). Servers the supervisor does not watch (a router) always."""
        sup = self._supervisor
        if sup is None:
            return self.servers
        up = sup.in_service(self.servers)
        if not up:
            sup.wait_all_healthy()
            return self.servers
        return up

    def _inc(self, key: str, by: float = 1) -> None:
        """metrics[key] += by, under the engine's lock (`self._lock`: generation runs in threads)."""
        with self._lock:
            self.metrics[key] = self.metrics.get(key, 0) + by

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{type(self).__name__} is closed")

    def close(self) -> None:
        """Idempotent: the engine's own parts (`_release`), then the servers it launched."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._supervisor is not None:  # first: a server stopped below is not restarted
                self._supervisor.stop()
            self._release()
        finally:
            if self.procs is not None:
                self.procs.stop()
                self.procs = None

    def _release(self) -> None:
        """What the engine holds besides its launched servers and their supervisor (weight-sync groups)."""
