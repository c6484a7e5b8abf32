"""Small dependency-free helpers for the benchmarks: memory of this process, timing, tables.

Memory on Linux, all values in bytes:
  current   /proc/self/status: VmRSS (resident set) = RssAnon (heap, tensors) + RssFile
            (pages of mmap'ed files, e.g. safetensors shards opened with mmap, and of shared
            libraries) + RssShmem. These are current values.
  peak      VmHWM, the kernel's resident-set high-water mark. `reset_peak()` resets it to the
            current VmRSS by writing 5 to /proc/self/clear_refs (Linux >= 4.0), so the peak of
            one phase can be read without the phases before it. getrusage(RUSAGE_SELF).ru_maxrss
            is the same high-water mark (max with that of exited threads and of the pre-exec
            image, which is the *parent's* peak for a spawned child), so it is reset with it only
            as long as no thread exits; `ru_maxrss()` is reported next to VmHWM as a cross-check.
  anon peak There is no kernel high-water mark for RssAnon alone. `MemSampler` polls
            /proc/self/status from a thread (default every 1 ms) and keeps the maxima it saw:
            a lower bound of the true peak (short spikes between samples, or while the thread
            cannot get the GIL, are missed). Comparing its VmRSS maximum with VmHWM tells how
            much it missed.
"""
from __future__ import annotations

import resource
import threading
import time
from contextlib import contextmanager

MiB = 1024 * 1024
_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def proc_status() -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem, VmHWM of this process, in bytes (0 when absent)."""
    out = dict.fromkeys(_FIELDS, 0)
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in out:
                out[key] = int(rest.split()[0]) * 1024  # values are in kB
    return out


def rss() -> int:
    return proc_status()["VmRSS"]


def peak_rss() -> int:
    """VmHWM: the resident-set high-water mark since process start or the last reset_peak()."""
    return proc_status()["VmHWM"]


def ru_maxrss() -> int:
    """getrusage(RUSAGE_SELF).ru_maxrss in bytes (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Reset VmHWM (and ru_maxrss, see module doc) to the current VmRSS. False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemSampler:
    """Maxima of the /proc/self/status fields seen by a polling thread, while in a `with` block."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.max = dict.fromkeys(_FIELDS, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    def _sample(self) -> None:
        s = proc_status()
        for k, v in s.items():
            if v > self.max[k]:
                self.max[k] = v
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


@contextmanager
def timer():
    """`with timer() as t: ...` then t() is the elapsed wall seconds (frozen at block exit)."""
    t0 = time.perf_counter()
    end = []
    yield lambda: (end[0] if end else time.perf_counter()) - t0
    end.append(time.perf_counter())


def mib(n_bytes: float) -> str:
    return f"{n_bytes / MiB:,.0f}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def format_table(headers: list[str], rows: list[list], title: str | None = None) -> str:
    """Plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [title] if title else []
    out += [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)
