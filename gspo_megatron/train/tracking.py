"""Experiment tracking on Weights & Biases (logging.wandb), next to metrics.jsonl and TensorBoard.

Every row the trainer writes to metrics.jsonl (supervised warm-start rows, GSPO steps, held-out
evaluations) becomes one W&B history row with the same names and numbers (strings and lists -
"phase", "prompts" - stay in metrics.jsonl). The x-axis is the trainer's own "step" metric
(`define_metric("*", step_metric="step")`), not W&B's internal step, because several rows share
a step (the warm start's rows are step 0; a held-out row follows its step's GSPO row) and a resumed
run logs again from its checkpoint's step.

Resume. The run id is stored in the checkpoint (the loop state) and a resumed run calls
``wandb.init(id=<that id>, resume="allow")``: online, W&B continues the same run; offline it writes
a new ``offline-run-*-<id>`` directory with the same id (wandb 0.31 offline mode does not know the
earlier directory), which ``wandb sync`` uploads into the one run.

kill -9. wandb-core writes the run file in 32 KiB blocks and flushes every 15 s by default, so a
killed trainer would lose its last rows: we set ``x_transaction_log_flush_interval`` to 0.25 s,
commit every row (W&B keeps an uncommitted row open until the next one), and before a checkpoint
is written wait until 4 flush intervals have passed since the last row (`before_checkpoint`;
wandb 0.31 has no public flush), so the rows up to a checkpoint's step are on disk once the
checkpoint exists and a resumed run, which logs from that step on, leaves no gap.

`wandb` is an optional extra (pip install -e ".[wandb]"), imported only when mode != disabled.
"""
from __future__ import annotations

import os
import time

from gspo_megatron.errors import InputError

FLUSH_INTERVAL_S = 0.25


class WandbRun:
    """Rank 0's W&B run. `run_id` goes into the checkpoint."""

    def __init__(self, cfg, *, out_dir: str, run_id: str | None, config: dict):
        w = cfg.logging.wandb
        try:
            import wandb
        except ImportError:
            raise InputError(f"logging.wandb.mode={w.mode} needs the wandb package: "
                             "pip install -e \".[wandb]\" (or set logging.wandb.mode=disabled)") from None
        self._wandb = wandb
        os.makedirs(out_dir, exist_ok=True)
        self.run = wandb.init(
            project=w.project, entity=w.entity, name=w.name or os.path.basename(os.path.abspath(out_dir)),
            mode=w.mode, dir=out_dir, id=run_id, resume="allow" if run_id else None, config=config,
            settings=wandb.Settings(x_transaction_log_flush_interval=FLUSH_INTERVAL_S),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id
        self._last_log = 0.0

    @property
    def run_file(self) -> str | None:
        """The run's transaction log (run-<id>.wandb) in offline mode."""
        return getattr(self.run.settings, "sync_file", None)

    def log(self, row: dict) -> None:
        data = {k: v for k, v in row.items() if _number(v)}
        self.run.log(data, commit=True)
        self._last_log = time.monotonic()

    def before_checkpoint(self) -> None:
        time.sleep(max(0.0, self._last_log + 4 * FLUSH_INTERVAL_S - time.monotonic()))

    def close(self) -> None:
        self.run.finish()


def _number(v) -> bool:
    return isinstance(v, (int, float))  # bools too; NaN / inf are logged as they are
