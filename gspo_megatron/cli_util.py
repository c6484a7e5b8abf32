"""Shared CLI behaviour: bad input becomes one clear line on stderr and exit status 2."""
from __future__ import annotations

import contextlib
import os
import sys

from gspo_megatron.config import ConfigError

EXIT_BAD_INPUT = 2


class InputError(ValueError):
    """Bad user input (file, key, value) detected by an entry point."""


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InputError, FileNotFoundError, ValueError)


@contextlib.contextmanager
def user_errors(prog: str):
    """Turn user-input errors into `prog: error: <message>` and exit 2 (printed by rank 0 only)."""
    try:
        yield
    except USER_ERRORS as e:
        if int(os.environ.get("RANK", "0")) == 0:
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
