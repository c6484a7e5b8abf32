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


# Each chunk's offset in the snapshot's one allocation: a multiple of this (any dtype's alignment,
# and a cache line).
HOST_ALIGN = 64


def cuda_host_register(flat) -> Callable[[], None]:
    """Page-lock `flat`'s bytes, exactly those (cudaHostRegister, as torch's own DCP staging does:
    torch/distributed/checkpoint/_state_dict_stager.py, torch/cuda/_pin_memory_utils.py); the
    undo. A GPU run's branch: `make gpu-check` (bench/gpu_check.py background_save) measures it;
    tests/test_async_save.py runs the layout around it on CPU with a stand-in."""
    import torch

    cudart = torch.cuda.cudart()
    ptr, size = flat.data_ptr(), flat.numel() * flat.element_size()
    rc = int(cudart.cudaHostRegister(ptr, size, 0))
    if rc != 0:
        raise RuntimeError(f"cudaHostRegister of the checkpoint snapshot's {size} bytes failed (cudaError {rc})")
    return lambda: cudart.cudaHostUnregister(ptr)


class HostSnapshot:
    """The host memory a background save copies the rank's shard into (train/checkpoint.py
    `_snapshot`): one allocation for the whole snapshot, each chunk a view at a HOST_ALIGN-aligned
    offset, reused by every later save with the same layout (the caller waited for the previous
    write), so one copy of the shard stays allocated for the run.

    On CUDA the allocation is page-locked once, exactly its bytes, with `pin` (cuda_host_register),
    so the device-to-host copies are asynchronous. Not torch's pinned allocator
    (`torch.empty(pin_memory=True)`): its CachingHostAllocator rounds every allocation up to a power
    of two and keeps it for the process; one allocation per chunk was about 290 GB page-locked per
    8-GPU node for the 235B preset (issue 52). Here the page-locked bytes are the snapshot's plus at
    most HOST_ALIGN - 1 per chunk (`pinned_bytes`)."""

    def __init__(self, pin: Callable | None = None):
        self._pin = pin
        self._unpin: Callable[[], None] | None = None
        self.layout: tuple = ()
        self.flat = None
        self.views: list = []
        self.pinned_bytes = 0
        self.allocations = 0  # how many times a new layout had to be allocated (tests, gpu-check)

    def take(self, specs: list) -> list:
        """Host tensors for `specs` [(shape, dtype), ...], in order: the ones of the last call when
        the layout is the same."""
        import torch

        layout = tuple((tuple(shape), dtype) for shape, dtype in specs)
        if layout == self.layout and self.flat is not None:
            return self.views
        self.release()
        offsets, total = [], 0
        for shape, dtype in layout:
            total = -(-total // HOST_ALIGN) * HOST_ALIGN
            offsets.append(total)
            n = 1
            for d in shape:
                n *= int(d)
            total += n * dtype.itemsize
        flat = torch.empty(max(total, 1), dtype=torch.uint8)
        views = []
        for (shape, dtype), off in zip(layout, offsets):
            n = 1
            for d in shape:
                n *= int(d)
            views.append(flat[off:off + n * dtype.itemsize].view(dtype).view(shape))
        if self._pin is not None:
            self._unpin = self._pin(flat)
            self.pinned_bytes = flat.numel()
        self.flat, self.views, self.layout = flat, views, layout
        self.allocations += 1
        return views

    def release(self) -> None:
        """Unpin (before the memory can go back to the allocator) and drop the allocation."""
        if self._unpin is not None:
            unpin, self._unpin = self._unpin, None
            unpin()
        self.flat, self.views, self.layout, self.pinned_bytes = None, [], (), 0


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
        # the snapshot's host memory, reused by the next save (train/checkpoint.py _snapshot): one
        # copy of the rank's shard stays allocated for the run, page-locked on CUDA
        import torch

        cuda = isinstance(device, torch.device) and device.type == "cuda"
        self.host = HostSnapshot(pin=cuda_host_register if cuda else None)
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
