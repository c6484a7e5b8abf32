"""Save on preemption: a signal (SIGTERM/SIGUSR1 by default, checkpoint.save_on_signals) asks the
run to checkpoint at the end of the step in progress and exit with status 143.

Every rank installs the handler (torchrun forwards the signal to every worker; Slurm may signal
them directly too); a handler only sets a flag. At each step boundary the ranks agree on it with
one tiny all-reduce (a rank that got the signal a moment later must not train on alone), then all
save together. The bound on the time from the signal to the exit is one step plus one save:
launch/ scripts give torchrun that much grace (--shutdown-timeout) and ask Slurm for the signal
that long before the time limit (--signal).
"""
from __future__ import annotations

import logging
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("gspo_megatron.train")

EXIT_PREEMPTED = 143  # 128 + SIGTERM: what a shell reports for a process ended by SIGTERM


class Preempted(SystemExit):
    """Raised after the preemption checkpoint is written: exit status EXIT_PREEMPTED."""

    def __init__(self, signame: str, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.signame, self.step = signame, step


class StopFlag:
    """Signal handlers that set a flag, and the collective question "did any rank get one?"."""

    def __init__(self, signals: list[str]):
        self.received: str | None = None
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread (in-process test ranks)
        for name in signals:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
            log.warning("%s received: saving a checkpoint at the end of this step, then exiting", self.received)

    def requested(self, device) -> bool:
        """Collective: whether any rank received one of the signals."""
        flag = torch.tensor([1 if self.received else 0], dtype=torch.int32, device=device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag) and self.received is None:
            self.received = "a signal on another rank"
        return bool(int(flag))

    def restore(self) -> None:
        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}
