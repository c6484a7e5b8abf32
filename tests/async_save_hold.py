"""The trainer (python -m gspo_megatron.train's main) with one background checkpoint write held open,
for tests/test_async_save.py: a kill or a signal then lands while that write is in flight by
construction, not by timing.

HOLD_DIR, HOLD_ITER (e.g. iter_0000004): when the background writer of that iteration has written
and renamed the directory (the tracker not moved yet, no checksums.json), each rank creates
HOLD_DIR/reached.<rank> and waits for HOLD_DIR/release (at most 600 s, then the write fails).
Other saves, and writes on the training thread, are not held.
"""
from __future__ import annotations

import os
import sys
import threading
import time

from gspo_megatron.train import checkpoint

_HOLD, _ITER = os.environ["HOLD_DIR"], os.environ["HOLD_ITER"]
_write_checksums = checkpoint._write_checksums


def _held(directory: str, d) -> None:
    if threading.current_thread().name.startswith("checkpoint-writer") and os.path.basename(directory) == _ITER:
        with open(os.path.join(_HOLD, f"reached.{os.environ.get('RANK', '0')}"), "w"):
            pass
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(_HOLD, "release")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"async_save_hold: {_HOLD}/release did not appear within 600 s")
            time.sleep(0.05)
    _write_checksums(directory, d)


checkpoint._write_checksums = _held

if __name__ == "__main__":
    from gspo_megatron.train.__main__ import main

    sys.exit(main(sys.argv[1:]))
