"""The trainer (python -m gspo_megatron.train's main) held at a step boundary until a preemption
signal has arrived, for tests/test_reliability.py: the signal then lands at a known step by
construction, not by racing a run that may finish first on a fast machine (fresh-clone run 15:
SIGTERM sent once step 2 was logged reached the worker after step 5 of 5).

HOLD_DIR, HOLD_METRICS (the run's metrics.jsonl), HOLD_WHEN ("gspo:2": a GSPO row of step >= 2;
"sft:11": a warm-start row of sft_step >= 11). At the first preemption point (StopFlag.requested,
train/preemption.py) at which the metrics file holds such a row, the process creates
HOLD_DIR/reached and waits until its signal handler has run (at most 600 s), then asks as usual.
Python runs the handler in the main thread between bytecodes, so the wait's sleep loop sees it.
"""
from __future__ import annotations

import json
import os
import sys
import time

from gspo_megatron.train import preemption

_DIR, _METRICS = os.environ["HOLD_DIR"], os.environ["HOLD_METRICS"]
_PHASE, _AT = os.environ["HOLD_WHEN"].split(":")
_KEY = {"gspo": "step", "sft": "sft_step"}[_PHASE]
_requested = preemption.StopFlag.requested
_held = [False]


def _due() -> bool:
    try:
        with open(_METRICS) as f:
            rows = [json.loads(x) for x in f if x.strip()]
    except (OSError, ValueError):
        return False
    return any(r.get("phase") == _PHASE and r.get(_KEY, 0) >= int(_AT) for r in rows)


def _requested_after_the_signal(self, device) -> bool:
    if not _held[0] and _due():
        _held[0] = True
        with open(os.path.join(_DIR, "reached"), "w"):
            pass
        deadline = time.monotonic() + 600
        while self.received is None:
            if time.monotonic() > deadline:
                raise TimeoutError("preempt_hold: no signal within 600 s")
            time.sleep(0.01)
    return _requested(self, device)


preemption.StopFlag.requested = _requested_after_the_signal

if __name__ == "__main__":
    from gspo_megatron.train.__main__ import main

    sys.exit(main(sys.argv[1:]))
