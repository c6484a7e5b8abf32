"""Rollout capacity that changes while the run goes on: servers listed in a file
(rollout.<engine>.urls_file, `Membership`) and launched replicas (rollout.vllm.replicas_file,
`Replicas`, at the end).

The file lists the servers, one URL per line (blank lines and `#` comments ignored); whoever
scales the rollout fleet (an autoscaler, a person, a job script) rewrites it (write a temp file
and rename it over: a reader never sees half a list). The engine re-reads it when it changes:
at the start of every generate() and every round of its supervisor (rollout/supervision.py).

  * A server that appears joins only once it answers its health check and reports the engine
    version the project speaks, and only after a catch-up: it loads the weights the others serve
    (the last pushed version directory: disk sync, which the config requires with a urls_file) and
    is labelled with their version. Joining waits for a push under way, never overlaps one, so
    the first answer of a new server carries the trainer's current version: staleness stays
    exact. A listed server that is not ready yet is tried again at the next read.
  * A server that disappears leaves at once: no new request goes to it, pushes skip it, the
    supervisor stops watching it, and its requests in flight are cut and sent again to the others
    (one retry each): whoever removed it may stop it at once, and no sample is lost.
    A list that would leave no server is refused (warned, the current servers kept).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from gspo_megatron.errors import InputError

from .supervision import first_line

log = logging.getLogger("gspo_megatron.rollout")


def file_stamp(path: str) -> tuple | None:
    """What changes when a watched file is rewritten (renamed over, or edited); None if absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def read_urls_file(path: str) -> list[str]:
    """The URLs a servers file lists, in order, duplicates dropped; a bad line is one line naming
    the file and the line (InputError)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the servers file: {first_line(e)}") from e
    out: list[str] = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            p = urlsplit(line)
            ok = p.scheme in ("http", "https") and bool(p.hostname) and p.port is not None and p.path in ("", "/")
        except ValueError:
            ok = False
        if not ok:
            raise InputError(f"{path}:{n}: not a server URL (http://host:port): {line[:200]!r}")
        url = line.rstrip("/")
        if url not in out:
            out.append(url)
    return out


class Membership:
    """The servers file of one engine (module docstring). The engine provides `servers`,
    `_join(url, block) -> bool` and `_leave(server)`."""

    def __init__(self, engine: Any, path: str):
        self.engine, self.path = engine, os.path.abspath(path)
        self._seen: tuple | None = None  # (mtime_ns, size) of the version of the file fully applied
        self._lock = threading.Lock()
        self._warned: str | None = None

    def initial(self) -> list[str]:
        """The servers the file lists at start (at least one, else one line)."""
        urls = read_urls_file(self.path)
        if not urls:
            raise InputError(f"{self.path}: the servers file lists no server")
        self._seen = self._stamp()
        return urls

    def _stamp(self) -> tuple | None:
        return file_stamp(self.path)

    def refresh(self, block: bool) -> None:
        """Apply the file's changes since the last read. `block`: wait for a push under way before
        a join (generate(): its requests then go to the new server too); else try again later."""
        stamp = self._stamp()
        if stamp is None or stamp == self._seen:
            return
        if not self._lock.acquire(blocking=block):
            return
        try:
            self._apply(stamp, block)
        finally:
            self._lock.release()

    def _apply(self, stamp: tuple, block: bool) -> None:
        try:
            urls = read_urls_file(self.path)
        except InputError as e:
            self._warn(f"{e}; the servers stay as they are")
            return
        if not urls:
            self._warn(f"{self.path} lists no server; the current ones are kept")
            return
        eng = self.engine
        listed = set(urls)
        for s in [s for s in eng.servers if s.url not in listed]:
            eng._leave(s)
        have = {s.url for s in eng.servers}
        pending = [u for u in urls if u not in have and not eng._join(u, block)]
        if pending:  # not ready (or a push under way): the same file is read again next time
            return
        self._seen = stamp
        self._warned = None

    def _warn(self, msg: str) -> None:
        if msg != self._warned:
            self._warned = msg
            log.warning("%s", msg)


def read_replicas_file(path: str) -> int:
    """The number of launched servers a replicas file asks for (one integer; `#` comments and
    blank lines ignored); a bad file is one line naming it (InputError)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(4096)
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: cannot read the replicas file: {first_line(e)}") from e
    words = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
    words = [w for w in words if w]
    if len(words) != 1 or not words[0].isdigit():
        raise InputError(f"{path}: a replicas file holds one number (the launched servers wanted), got "
                         f"{text.strip()[:100]!r}")
    return int(words[0])


class Replicas:
    """The launched servers of one engine, as many as a replicas file asks for (rollout.vllm.
    replicas_file), changed only in the engine's supervisor thread (its tick), so a change never
    overlaps a restart of the same server:

      * more: the next servers start (ServerProcesses.add: port + i, their own GPUs on CUDA) and
        each joins once it answers its health check, after the catch-up every joining server gets
        (HTTPEngine._join: the last pushed weights and their version label, under the push lock),
        so its first answer carries the trainer's version. One that dies or is not ready within
        the engine's ready_timeout_s is stopped with its cause in one warning, and not started
        again until the file changes.
      * fewer: the servers with the highest indices leave first (HTTPEngine._leave: no new request,
        their requests in flight sent to the others: no sample lost) and are then stopped. A
        server being restarted by the supervisor leaves after its recovery.
      * a count outside [1, max_replicas] or an unreadable file: warned, the fleet kept.
    """

    def __init__(self, engine: Any, path: str, max_replicas: int):
        self.engine, self.path, self.max = engine, os.path.abspath(path), int(max_replicas)
        self._seen: tuple | None = None
        self.want = 0
        self._started: dict[int, float] = {}  # index -> when a replica not joined yet was started
        self._given_up: tuple | None = None  # the file version whose replicas failed to start
        self._warned: str | None = None

    def initial(self, default: int) -> int:
        """How many servers to launch: the file's number when it exists (a resumed run keeps its
        fleet), else `default` (rollout.vllm.replicas)."""
        self._seen = self._stamp()
        self.want = int(default)
        if self._seen is not None:
            self._read()
        return self.want

    def _stamp(self) -> tuple | None:
        return file_stamp(self.path)

    def _read(self) -> None:
        try:
            n = read_replicas_file(self.path)
        except InputError as e:
            return self._warn(f"{e}; the launched servers stay as they are")
        if not 1 <= n <= self.max:
            return self._warn(f"{self.path} asks for {n} launched servers: it must be in [1, {self.max}] "
                              f"({self.engine.CONFIG}.max_replicas); the servers stay as they are")
        self.want, self._warned = n, None

    def refresh(self) -> None:
        """One round (the supervisor's tick): read the file if it changed, then start, join or
        stop servers toward the number it asks for."""
        stamp = self._stamp()
        if stamp is not None and stamp != self._seen:
            self._seen = stamp
            self._read()
        procs = self.engine.procs
        if procs is None:
            return
        if self._given_up is None or self._given_up != self._seen:
            self._given_up = None
            while len(procs.procs) < self.want:
                try:
                    i = procs.add()
                except InputError as e:  # no room for it (vLLM on CUDA: no GPUs of its own left)
                    log.warning("%s; the fleet stays at %d until %s changes", e, len(procs.procs), self.path)
                    self._given_up = self._seen
                    break
                self._started[i] = time.monotonic()
                log.warning("%s server %d started (%s): it joins once it is ready", self.engine.NAME, i,
                            procs.spec.url(i))
        self._join_started(procs)
        self._shrink(procs)

    def _join_started(self, procs: Any) -> None:
        eng = self.engine
        joined = {s.url for s in eng.servers}
        for i in sorted(self._started):
            url = procs.spec.url(i)
            if url in joined or i >= len(procs.procs):
                self._started.pop(i, None)
                continue
            dead = procs.dead(i)
            late = time.monotonic() - self._started[i] > eng.ready_timeout_s
            if dead is not None or late:
                why = dead.splitlines()[0] if dead else f"not ready after {eng.ready_timeout_s:g} s"
                log.warning("%s server %d (%s) %s: stopped; the fleet stays at %d until %s changes", eng.NAME, i, url,
                            why, i, self.path)
                while len(procs.procs) > i:
                    procs.stop_last(grace_s=5.0)
                self._started = {j: t for j, t in self._started.items() if j < i}
                self._given_up = self._seen
                return
            if eng._join(url, block=False, launched=i):
                self._started.pop(i)

    def _shrink(self, procs: Any) -> None:
        eng = self.engine
        while len(procs.procs) > max(self.want, 1):
            i = len(procs.procs) - 1
            url = procs.spec.url(i)
            server = next((s for s in eng.servers if s.url == url), None)
            if server is not None:
                if len(eng.servers) <= 1:
                    return
                eng._leave(server, f"the launched servers shrank to {self.want} ({self.path})")
            self._started.pop(i, None)
            procs.stop_last()
            log.warning("%s server %d (%s) stopped (%d launched)", eng.NAME, i, url, len(procs.procs))

    def _warn(self, msg: str) -> None:
        if msg != self._warned:
            self._warned = msg
            log.warning("%s", msg)
