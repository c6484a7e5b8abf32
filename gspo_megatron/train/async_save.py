"""Checkpoint writes in the background (`checkpoint.async_save=true`).

What overlaps with what: the training thread blocks only while the step's checkpoint is
*snapshotted* — the non-finite check (one all-reduce), this rank's shard of the model and of the
optimizer state copied into host memory (train/checkpoint.py `_snapshot`), the plain state
(scheduler, loop, RNG) copied. A writer thread then does everything else: the DCP files, common.pt,
the per-rank RNG files, hf_config/, checksums.json, the rename into place, the tracker, pruning.
The next steps (rollout, training, weight pushes) run meanwhile.

Guarantees, by construction:
* the tracker names an iteration only after its directory is complete and checksummed (the writer
  moves it last, as the synchronous save does), so a kill -9 during a background write resumes
  from the previous tracked checkpoint (what the write left is a hidden temporary directory);
* at most one write is in flight: a save, a preemption, the end of the run or an error first waits
  for the previous write (and says so when it has to wait);
* the writer's collectives (DCP's plan exchange, barriers, the checksum gather) run on a gloo group
  of their own (parallel/state.py `background_group`): the training thread's collectives on the
  world's groups never interleave with them;
* every wait is bounded (`WAIT_TIMEOUT_S`, the collectives' timeout): a writer that does not finish
  is one CheckpointError line, and an error inside the writer is raised in the training thread at
  the next wait, naming the iteration.

Megatron's own asynchronous strategy (FileSystemWriterAsync: forked writer processes, CUDA
streams) serves only Megatron's save path; the trainer writes its distributed-optimizer shards
itself (train/checkpoint_shards.py), so async saves go through this writer and need
`optimizer.use_distributed_optimizer=true` (config.py refuses the other combination). A checkpoint
the direct writer cannot take (no optimizer step yet, so no Adam moments) is written synchronously.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("gspo_megatron.train")

# The longest a save, the end of the run or a preemption waits for the previous background write
# (the background group's collectives have the same bound: parallel/state.py DEFAULT_TIMEOUT_S).
WAIT_TIMEOUT_S = 30 * 60.0


def bind_device(device) -> None:
    """Make `device` (a torch.device, or None) current in this thread when it is a CUDA device."""
    import torch

    if isinstance(device, torch.device) and device.type == "cuda":
        torch.cuda.set_device(device)


class BackgroundSaves:
    """One writer thread at a time. `ops`: the background group's collectives (GroupOps)."""

    def __init__(self, ops, *, timeout_s: float = WAIT_TIMEOUT_S, device=None):
        self.ops = ops
        self.timeout_s = timeout_s
        # the rank's device: the writer thread makes it current before anything else. A new thread
        # starts on CUDA device 0, and DCP's writer synchronises the thread's current stream
        # (torch/distributed/checkpoint/filesystem.py _OverlappingCpuLoader): without this every
        # rank's writer creates a context on GPU 0 (>= 0.5 GiB each; on exclusive-process GPUs the
        # save fails). Runs on GPU only: `make gpu-check` (bench/gpu_check.py background_save);
        # tests/test_async_save.py checks the call on CPU.
        self.device = device
        self._thread: threading.Thread | None = None
        self._label = ""
        self._error: BaseException | None = None
        self._t_write = 0.0
        self.last: dict = {}  # {"label", "t_write"} of the last write that finished
        # the snapshot's host tensors, reused by the next save (train/checkpoint.py _snapshot): one
        # copy of the rank's shard stays allocated for the run
        self.buffers: dict = {}
        self.extra_state_keys: list | None = None  # the model's `_extra_state` entries, read once

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, label: str, write: Callable[[], None]) -> None:
        """Start `write` (the rest of a save) in the writer thread, after the previous one."""
        self.wait(f"before writing {label}")
        self._label, self._error = label, None

        def run() -> None:
            t0 = time.perf_counter()
            try:
                bind_device(self.device)
                write()
            except BaseException as e:  # raised in the training thread at the next wait
                self._error = e
            finally:
                self._t_write = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name=f"checkpoint-writer {label}", daemon=True)
        self._thread.start()

    def wait(self, why: str = "") -> float:
        """Block until the write in flight (if any) is finished; seconds waited. Raises the
        writer's error, or a CheckpointError when it does not finish within the timeout."""
        if self._thread is None:
            return 0.0
        from gspo_megatron.errors import CheckpointError

        t0 = time.perf_counter()
        if self._thread.is_alive() and why:
            log.info("waiting for the background write of %s %s", self._label, why)
        self._thread.join(self.timeout_s)
        waited = time.perf_counter() - t0
        if self._thread.is_alive():
            raise CheckpointError(f"the background write of {self._label} did not finish within {self.timeout_s:.0f} s; "
                                  "the tracker still names the previous checkpoint")
        self._thread, label, err = None, self._label, self._error
        self._error = None
        if err is not None:
            if isinstance(err, CheckpointError):
                raise err
            raise CheckpointError(f"the background write of {label} failed: {type(err).__name__}: {err}; the tracker "
                                  "still names the previous checkpoint") from err
        self.last = {"label": label, "t_write": self._t_write}
        log.info("checkpoint %s written in the background in %.2f s", label, self._t_write)
        return waited
