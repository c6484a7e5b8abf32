"""What a failed subprocess run said, for an assertion message.

A two-rank torchrun that fails prints the failing rank's one error line first, then the other
rank's traceback from the collective that lost its peer, then torchrun's own summary: the tail of
stderr that tests used to show (``r.stderr[-4000:]``) held only the last two, and the cause was cut
(fresh-clone run 10's test_async_pushes_land_mid_generation_without_waiting). `explain` puts every
error line first, each once, in the order printed, then the tail.
"""
from __future__ import annotations

import re

# an exception line (``KeyError: 'a'``, ``[rank0]: RuntimeError: ...``) or one of our one-line errors
# (``gspo_megatron.train: error: ...``); torchrun's ChildFailedError summary says nothing new
_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception|Exit)\b.*|[\w.]+: error: .*)$")


def error_lines(text: str, limit: int = 20) -> list[str]:
    seen: dict[str, None] = {}
    for line in text.splitlines():
        s = line.strip()
        if _ERROR.match(s) and "ChildFailedError" not in s and s not in seen:
            seen[s] = None
            if len(seen) == limit:
                break
    return list(seen)


def explain(stderr: str, tail: int = 3000) -> str:
    lines = error_lines(stderr or "")
    head = "error lines, in order:\n" + "\n".join(lines) + "\n--- tail ---\n" if lines else ""
    return head + (stderr or "")[-tail:]
