"""Rollout capacity that changes while the run goes on (rollout.<engine>.urls_file).

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
from typing import Any
from urllib.parse import urlsplit

from gspo_megatron.errors import InputError

from .supervision import first_line

log = logging.getLogger("gspo_megatron.rollout")


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
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

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
