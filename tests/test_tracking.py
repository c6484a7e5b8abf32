"""W&B tracking (train/tracking.py) in offline mode, no network: the run file's history holds the
numbers of metrics.jsonl, row for row (warm-start rows, GSPO steps, two held-out sets), and a run
killed with kill -9 and resumed continues the same W&B run id, its two run files together holding
exactly the final metrics.jsonl. The reference is metrics.jsonl; the run files are read with
tests/wandb_history.py (wandb's own protobuf records)."""
from __future__ import annotations

import glob
import json
import math

import pytest

wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")

from test_train_loop import kill9_after_checkpoint, run_train  # noqa: E402
from wandb_history import history, run_id  # noqa: E402


@pytest.fixture
def quiet_wandb(tmp_path, monkeypatch):
    """Everything wandb writes outside the run directory goes under tmp_path; no console capture,
    no system-metrics process, no git probing."""
    for k, v in {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB__DISABLE_STATS": "true",
                 "WANDB_DISABLE_GIT": "true", "WANDB__SAVE_REQUIREMENTS": "false",
                 "WANDB_CACHE_DIR": str(tmp_path / "wandb_cache"), "WANDB_CONFIG_DIR": str(tmp_path / "wandb_config"),
                 "WANDB_DATA_DIR": str(tmp_path / "wandb_data")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


COMMON = ["logging.wandb.mode=offline", "logging.wandb.project=test", "logging.progress_bar=false",
          "logging.plot=false", "checkpoint.export_hf=false", "train.sft_warmup_steps=2",
          "eval.interval=2", "eval.num_prompts=8", "eval.samples_per_prompt=2",
          "eval.extra_sets=[{name: other, seed: 77, num_prompts: 4}]", "checkpoint.keep_last=0"]


def _numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float))}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) if isinstance(a[k], float) and math.isnan(a[k]) else a[k] == b[k]
        for k in a)


def _metrics(out) -> list[dict]:
    return [json.loads(x) for x in open(out / "metrics.jsonl") if x.strip()]


def _run_files(out) -> list[str]:
    return sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb")))


@pytest.mark.timeout(600)
def test_offline_history_equals_metrics_and_resume_keeps_the_run(tmp_path, quiet_wandb):
    """A run killed with kill -9 after its step-2 checkpoint and resumed (resume=auto): the same
    W&B run id in both offline run files (wandb's offline mode starts a new directory for a resumed
    id), and the two files together hold exactly the final metrics.jsonl, row for row: the first
    up to the resumed step (every row up to a checkpoint reached the file before the checkpoint
    existed), then the second."""
    out = tmp_path / "killed"
    args = [*COMMON, "train.max_steps=6", "checkpoint.interval=2"]
    at = kill9_after_checkpoint(out, 2, *args, timeout_s=300)
    assert 2 <= at < 6, at
    run_train(out, *args)
    files = _run_files(out)
    assert len(files) == 2, files
    first, second = sorted(files, key=lambda f: min(h["step"] for h in history(f)))
    assert run_id(first) == run_id(second)
    rows = _metrics(out)
    phases = [r["phase"] for r in rows]
    assert phases.count("sft") >= 1 and phases.count("gspo") == 6 and phases.count("eval") == 4  # 0, 2, 4, 6
    assert "eval/other/pass@1" in rows[-1] and "eval/heldout/pass@2" in rows[-1]  # both held-out sets
    merged = [h for h in history(first) if h["step"] <= at] + history(second)
    final = [_numbers(r) for r in rows]
    assert [r["step"] for r in final] == [h["step"] for h in merged]
    bad = [i for i, (r, h) in enumerate(zip(final, merged)) if not _same(r, h)]
    assert not bad, (bad[:3], final[bad[0]] if bad else None, merged[bad[0]] if bad else None)


def test_wandb_config_checks(tmp_path):
    from test_config import err, minimal

    assert "logging.wandb.mode must be one of disabled|offline|online" in err(minimal(tmp_path), ["logging.wandb.mode=on"])
    assert "held-out set names must differ; heldout" in err(
        minimal(tmp_path), ["eval.interval=1", "eval.extra_sets=[{name: heldout}]"])
    assert "eval.extra_sets[].source=file needs" in err(minimal(tmp_path), ["eval.extra_sets=[{name: b, source: file}]"])
