"""A stand-in HTTP server for the project's one HTTP client (rollout/http_servers.ServerClient, which
the judge, the SGLang and the vLLM engines all speak through): written on a raw socket, so that it
can answer in each framing HTTP/1.1 has and misbehave at each point of an answer.

framings:
  length    Content-Length, the connection kept open
  chunked   Transfer-Encoding: chunked, the connection kept open
  close     Connection: close and neither: the body ends where the connection does

behaviours (`how`):
  ok            the whole answer at once
  drip          status line and headers, then the body one byte every `every_s`
  stall_status  read the request, answer nothing
  stall_headers the status line and one header, then nothing
  stall_body    the headers and half the body, then nothing
  truncated     the headers and half the body, then the connection closed
  oversize      a body of `oversize` bytes (Content-Length declares it; the others stream it)
  garbage       a line that is not an HTTP status line

Each connection is served on a thread of its own; `close()` shuts every socket down and joins the
threads (bounded). `sent` counts the body bytes written, `requests` the (method, path, body) read.
"""
from __future__ import annotations

import json
import socket
import threading

FRAMINGS = ("length", "chunked", "close")
HOWS = ("ok", "drip", "stall_status", "stall_headers", "stall_body", "truncated", "oversize", "garbage")


class StandIn:
    def __init__(self, body: bytes | dict = b"{}", *, framing: str = "length", how: str = "ok",
                 every_s: float = 0.05, oversize: int = 1 << 22, status: int = 200):
        assert framing in FRAMINGS and how in HOWS, (framing, how)
        self.body = json.dumps(body).encode() if isinstance(body, dict) else bytes(body)
        self.framing, self.how, self.every_s, self.oversize, self.status = framing, how, every_s, oversize, status
        self.sent = 0
        self.requests: list[tuple[str, str, bytes]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._srv.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._srv.getsockname()[1]}"
        self._accept = threading.Thread(target=self._loop, daemon=True, name="standin-accept")
        self._accept.start()

    def __enter__(self) -> "StandIn":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ server side
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="standin-conn")
                self._threads.append(t)
            t.start()

    def _read_request(self, f) -> bool:
        line = f.readline(65537)
        if not line:
            return False
        method, path, _ = line.decode("latin-1").split(" ", 2)
        length = 0
        while True:
            h = f.readline(65537)
            if h in (b"\r\n", b"\n", b""):
                break
            k, _, v = h.decode("latin-1").partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        self.requests.append((method, path, f.read(length) if length else b""))
        return True

    def _send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)

    def _body_bytes(self, conn: socket.socket, data: bytes, *, chunked: bool, drip: bool) -> None:
        step = 1 if drip else max(1, len(data))
        for i in range(0, len(data), step):
            piece = data[i:i + step]
            if drip and self._stop.wait(self.every_s):
                return
            self._send(conn, (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece)
            self.sent += len(piece)

    def _serve(self, conn: socket.socket) -> None:
        try:
            f = conn.makefile("rb")
            while not self._stop.is_set() and self._read_request(f):
                if self._answer(conn):
                    return
        except OSError:
            pass  # the client went away (what a deadline does)
        finally:
            try:
                conn.close()
            except OSError:
                pass

    def _answer(self, conn: socket.socket) -> bool:
        """One answer; True when the connection is to be closed after it."""
        how, framing = self.how, self.framing
        if how == "stall_status":
            self._stop.wait(600)
            return True
        if how == "garbage":
            self._send(conn, b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            return True
        body = b"x" * self.oversize if how == "oversize" else self.body
        head = [f"HTTP/1.1 {self.status} OK", "Content-Type: application/json"]
        if framing == "length":
            head.append(f"Content-Length: {len(body)}")
        elif framing == "chunked":
            head.append("Transfer-Encoding: chunked")
        else:
            head.append("Connection: close")
        if how == "stall_headers":
            self._send(conn, (head[0] + "\r\n" + head[1] + "\r\n").encode())
            self._stop.wait(600)
            return True
        self._send(conn, ("\r\n".join(head) + "\r\n\r\n").encode())
        chunked = framing == "chunked"
        if how in ("stall_body", "truncated"):
            self._body_bytes(conn, body[:len(body) // 2], chunked=chunked, drip=False)
            if how == "stall_body":
                self._stop.wait(600)
            return True
        self._body_bytes(conn, body, chunked=chunked, drip=how == "drip")
        if chunked:
            self._send(conn, b"0\r\n\r\n")
        return framing == "close"

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        self._stop.set()
        try:
            self._srv.close()
        except OSError:
            pass
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._accept.join(10)
        for t in threads:
            t.join(10)
