"""Shared CLI behaviour: bad input becomes one clear line on stderr and exit status 2."""
from __future__ import annotations

import contextlib
import os
import sys
import time

from gspo_megatron.errors import ConfigError, InputError

EXIT_BAD_INPUT = 2
# How long a rank other than 0 waits before printing its bad-input line (user_errors).
PEER_GRACE_S = 5.0


# Only the project's user-error types (errors.py; CheckpointError is an InputError) and a missing
# file: a bare ValueError from our code is a bug and keeps its traceback (exit 1), never a
# one-line "user error" (issue 43's review: any ValueError used to count).
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InputError, FileNotFoundError)


@contextlib.contextmanager
def user_errors(prog: str):
    """Turn user-input errors into `prog: error: <message>` and exit 2.

    Under torchrun every rank runs the same input checks, and torchrun stops all ranks as soon as
    one exits. Rank 0 says it at once. Any other rank first waits PEER_GRACE_S: had it exited
    at once, a rank 0 still on its way to the same error would be stopped before printing it (CI
    saw torchrun.sh end with no line). A rank still alive after the wait (rank 0 did not fail:
    the input is bad on that rank only) says it itself. So the operator gets the line once in
    the usual case, and always at least once."""
    try:
        yield
    except USER_ERRORS as e:
        if int(os.environ.get("RANK", "0")) != 0:
            time.sleep(PEER_GRACE_S)  # torchrun's SIGTERM ends this when rank 0 has failed
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        sys.exit(EXIT_BAD_INPUT)


def atomic_write_text(path: str, text: str) -> None:
    """Write to a temp file beside `path`, then rename: readers never see half a file."""
    d = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(d):
        raise InputError(f"{path}: output directory {d} does not exist")
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def quiet_known_warnings() -> None:
    """Silence third-party warnings that say nothing actionable on this path (printed once per
    rank per collective otherwise): torch's renamed collectives used inside Megatron, Megatron's
    notes that apex/TE are absent on CPU, and its CUDA_DEVICE_MAX_CONNECTIONS hint."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    for msg in (r".*(Apex|Transformer Engine).* not installed.*", r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
                r".*tensor model parallel size is 1\. Disabling sequence parallel.*",
                r".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=msg)
