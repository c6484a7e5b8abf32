"""A stand-in judge server for tests (NOT vLLM): started the way the trainer starts a judge
(reward.judge.launch with reward.judge.server.server_command = [python, this file]: vLLM's server
arguments follow, of which it reads --host and --port). GET /health answers 200; POST
/v1/chat/completions answers the score 7 as a chat completion. Its pid is its log's first line."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JSONHandler(BaseHTTPRequestHandler):
    """A quiet handler answering JSON (tests/test_reward_model.py's classifier stand-in too)."""

    def log_message(self, *a):
        pass

    def _send(self, status: int, obj) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _H(JSONHandler):
    def do_GET(self):
        self._send(200 if self.path == "/health" else 404, {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/chat/completions":
            return self._send(404, {})
        self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": "7"}}]})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    print(f"[judge stand-in] pid={os.getpid()}", flush=True)
    httpd = ThreadingHTTPServer((args.host, args.port), _H)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    stop.wait()
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
