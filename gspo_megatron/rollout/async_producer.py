"""Asynchronous rollouts: a producer thread (on the rank that owns the engine) generates the
batches of later steps while the trainer trains, with bounded staleness.

Versions. The trainer pushes weight version v after training step v - 1 (version 0 before the
first rollout), so training step s starts from version s. A batch generated with version v and
trained at step s is s - v versions old. The producer generates step t only once the engine
holds version >= t - max_ahead (so at most max_ahead + 1 batches exist ahead of the step being
trained), and no sample is ever more than max_ahead versions old; the trainer still checks each
sample's own version (engines report it per sample) and drops older ones (counted).

Engine access. Generation and weight pushes are serialized by `lock` (a Condition; the
in-process engine cannot update weights mid-generate): `push` waits for the generation in
progress to finish, and the next generation starts from the new weights. With partial rollouts
(`push(..., interrupt=engine)`) the push interrupts the generation instead; the producer's
`PartialGenerator` (rollout/partial.py) hands the engine over while it waits for the new weights,
then continues the interrupted rows with them. An engine that takes weights mid-generation
(`RolloutEngine.supports_push_mid_generation`: its servers set the requests in flight aside and
continue them under the new weights, reporting each token's version) is pushed to without the
lock (`push(..., concurrent=True)`): the push waits for nothing, and the generation in progress
goes on with the new weights.

Data stream. The producer draws prompts ahead of training. Each batch carries the prompt-stream
state right after its prompts were drawn; a checkpoint after step s stores batch s's, so a
resumed run regenerates the batches that were in flight (same prompts, same per-step seeds):
no prompt is trained twice or skipped.

Every wait has a timeout; a failure in the producer is raised in the trainer at its next get().
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


class _Interruptible(Protocol):
    def interrupt(self) -> None: ...
    def resume(self) -> None: ...


@dataclass
class Batch:
    step: int
    payload: Any  # what produce(step) returned
    version: int  # the engine's weight version when the batch's generation started
    data_state: dict = field(default_factory=dict)  # prompt-stream state after this batch's prompts
    t_generate: float = 0.0


class RolloutProducer:
    """Generates batches for steps start, start + 1, ..., end - 1 in a background thread.

    produce(step) -> payload runs under `lock`; version() gives the engine's current weight
    version; data_state() the prompt stream's state (taken right after produce)."""

    def __init__(self, produce: Callable[[int], Any], *, start: int, end: int, max_ahead: int,
                 version: Callable[[], int], data_state: Callable[[], dict], lock: threading.Condition,
                 timeout_s: float = 3600.0):
        if max_ahead < 1:
            raise ValueError(f"max_ahead must be >= 1, got {max_ahead}")
        self._produce, self._version, self._data_state = produce, version, data_state
        self.lock = lock
        self.max_ahead, self.timeout_s = max_ahead, timeout_s
        self._next, self._end = start, end
        self._ready: dict[int, Batch] = {}
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._stop = False
        self.t_wait_train = 0.0  # producer idle: ahead by max_ahead, or waiting for weights
        # seconds the last push waited for the generation in progress to let go of the engine
        # (with partial rollouts: for the interrupted generation to return)
        self.t_push_wait = 0.0
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    def _may_generate(self, t: int) -> bool:
        return self._version() >= t - self.max_ahead

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    t0 = time.perf_counter()
                    while not self._stop and self._next < self._end and not self._may_generate(self._next):
                        self._cv.wait(timeout=0.05)  # versions change under the lock of the pusher
                    self.t_wait_train += time.perf_counter() - t0
                    if self._stop or self._next >= self._end:
                        return
                    t = self._next
                t1 = time.perf_counter()
                with self.lock:
                    version = self._version()
                    payload = self._produce(t)
                    state = self._data_state()
                batch = Batch(t, payload, version, state, time.perf_counter() - t1)
                with self._cv:
                    self._ready[t] = batch
                    self._next = t + 1
                    self._cv.notify_all()
        except BaseException as e:  # reported to the trainer
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def get(self, step: int) -> tuple[Batch, float]:
        """The batch of `step` (blocking) and how long the trainer waited for it."""
        t0 = time.perf_counter()
        deadline = t0 + self.timeout_s
        with self._cv:
            while step not in self._ready:
                if self._error is not None:
                    raise RuntimeError(f"the rollout producer failed: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error
                if not self._thread.is_alive():
                    raise RuntimeError(f"the rollout producer stopped before step {step}")
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(f"no rollout batch for step {step} after {self.timeout_s:.0f} s")
                self._cv.wait(timeout=min(left, 1.0))
            batch = self._ready.pop(step)
        return batch, time.perf_counter() - t0

    @property
    def stopped(self) -> bool:
        return self._stop

    def push(self, update: Callable[[], None], *, interrupt: _Interruptible | None = None,
             concurrent: bool = False) -> None:
        """Run `update` (replace the engine's weights) while holding the engine, then wake the
        producer. With `interrupt` (partial rollouts) the generation in progress is interrupted
        rather than waited for; the interrupt is repeated while the engine is busy (a request sent
        after one abort meets the next) and lifted once the new weights are in. `concurrent`: the
        engine takes weights mid-generation (update is its update_weights_mid_generation), so the
        push runs beside the generation, without the engine's lock, and waits for nothing."""
        if concurrent:
            if interrupt is not None:
                raise ValueError("push: concurrent and interrupt exclude each other")
            self.t_push_wait = 0.0
            update()  # never takes self.lock: the producer holds it for the whole generation
            with self._cv:
                self._cv.notify_all()
            return
        deadline = time.monotonic() + self.timeout_s
        t0 = time.perf_counter()
        if interrupt is not None:
            interrupt.interrupt()
        while not self.lock.acquire(timeout=0.5):
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight push: the rollout engine stayed busy for {self.timeout_s:.0f} s")
            if interrupt is not None:
                interrupt.interrupt()
        self.t_push_wait = time.perf_counter() - t0
        try:
            try:
                update()
            finally:
                if interrupt is not None:
                    interrupt.resume()
            self.lock.notify_all()  # a PartialGenerator waiting for these weights
        finally:
            self.lock.release()
        with self._cv:
            self._cv.notify_all()

    def close(self, timeout_s: float = 600.0) -> None:
        """Stop after the generation in progress (bounded wait)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=timeout_s)
