"""Step metrics: one JSON line per step (rank 0), optional TensorBoard and W&B (train/tracking.py),
a PNG plot at the end."""
from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Row keys read off the wall clock besides the t_* timers: two runs of the same steps log the same
# values for every other key (what resume tests compare), never for these
WALL_CLOCK_KEYS = frozenset({"tokens_per_s", "overlap_efficiency"})


def wall_clock(key: str) -> bool:
    """Whether a metrics row's `key` is a wall-clock measurement (t_*, throughput, overlap)."""
    return key.startswith("t_") or key in WALL_CLOCK_KEYS


def reduce_report(reports: list[dict], reporter: bool, keys: tuple[str, ...],
                  device: torch.device | str = "cpu") -> dict[str, float]:
    """Sum microbatch reports over this rank's microbatches and over all reporting ranks.

    Only one rank per (DP shard) reports (last PP stage, TP rank 0, CP rank 0); the others add
    zeros. Collective over the world group: every rank must call it with the same `keys`, and
    `device` must be the rank's device (NCCL takes CUDA tensors only).
    """
    vec = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if reporter:
        for r in reports:
            for i, k in enumerate(keys):
                if k in r:
                    vec[i] += float(r[k])
    if dist.get_world_size() > 1:  # one rank: nothing to add (a gloo round trip saved, 5 a step)
        dist.all_reduce(vec)
    return dict(zip(keys, vec.tolist()))


def reduce_max(reports: list[dict], reporter: bool, keys: tuple[str, ...],
                device: torch.device | str = "cpu") -> dict[str, float]:
    """Like reduce_report, with the maximum instead of the sum (for non-negative metrics: the
    ranks that do not report add zeros)."""
    vec = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if reporter:
        for r in reports:
            for i, k in enumerate(keys):
                if k in r:
                    vec[i] = max(vec[i], float(r[k]))
    if dist.get_world_size() > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.MAX)
    return dict(zip(keys, vec.tolist()))


class MetricsWriter:
    def __init__(self, out_dir: str, *, tensorboard: bool, resume_step: int = 0, tracker=None):
        self.path = os.path.join(out_dir, "metrics.jsonl")
        os.makedirs(out_dir, exist_ok=True)
        if os.path.exists(self.path):
            # Drop lines past the resumed step: a run killed after logging step k but before its
            # checkpoint repeats those steps.
            with open(self.path) as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= resume_step]
            with open(self.path, "w") as f:
                f.writelines(keep)
        self.tracker = tracker  # a WandbRun (or anything with log(row) / close())
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(out_dir, "tb"))
            except Exception as e:  # tensorboard is optional
                log.warning("TensorBoard unavailable (%s); metrics.jsonl only", e)

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, row["step"])
        if self.tracker is not None:
            self.tracker.log(row)

    def before_checkpoint(self) -> None:
        """The rows so far reach the trackers' files before a checkpoint says they happened."""
        if self.tracker is not None:
            self.tracker.before_checkpoint()

    def close(self) -> None:
        """Idempotent (the loop also calls it when a run fails)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None


def plot(metrics_path: str, png_path: str) -> bool:
    """Reward (and held-out pass@1) and clip fraction over steps; False if matplotlib is unavailable."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    all_rows = [json.loads(ln) for ln in open(metrics_path) if ln.strip()]
    rows = [r for r in all_rows if r.get("phase") == "gspo"]
    if not rows:
        return False
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, [r["reward_mean"] for r in rows], marker=".", label="training reward")
    evals = [r for r in all_rows if r.get("phase") == "eval"]
    for key in sorted({k for r in evals for k in r if k.endswith("/pass@1")}):
        pts = [(r["step"], r[key]) for r in evals if key in r]
        ax[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{key} (held out)")
    ax[0].set_title("reward (mean over samples) and held-out pass@1")
    ax[0].legend(fontsize=7)
    ax[0].set_xlabel("step")
    ax[1].plot(steps, [r["clip_frac"] for r in rows], marker=".", color="tab:red")
    ax[1].set_title("clip fraction (sequences)")
    ax[1].set_xlabel("step")
    fig.tight_layout()
    tmp = png_path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)
    return True
