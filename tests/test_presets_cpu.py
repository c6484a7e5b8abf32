"""The Qwen3-30B-A3B preset scaled down to CPU size runs real GSPO steps (EP2, 2 processes)."""
from __future__ import annotations

import json
import math
import os

import pytest

from test_train_loop import REPO, _env, torchrun_cmd

SCALED = os.path.join(REPO, "launch", "configs", "qwen3_30b_a3b_cpu_scaled.yaml")


@pytest.mark.timeout(600)
def test_scaled_30b_preset_trains_on_cpu(tmp_path):
    import subprocess

    out = tmp_path / "scaled"
    # A length reward gives a random-init policy non-zero advantages, so every step has a real
    # policy gradient (the preset's own task reward is 0 everywhere before any training).
    r = subprocess.run(torchrun_cmd(2, "--config", SCALED, f"out_dir={out}", "reward.fn=tests.reward_fns:response_length"),
                       capture_output=True, text=True, timeout=580, env=_env(), cwd=REPO)
    assert r.returncode == 0, r.stderr[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl") if '"gspo"' in line]
    assert [x["step"] for x in rows] == [1, 2, 3]
    for x in rows:
        assert x["reward_std"] > 0
        assert x["grad_norm"] > 0 and math.isfinite(x["loss"])
        assert 0.0 <= x["clip_frac"] <= 1.0
