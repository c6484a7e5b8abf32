"""The CPU half of bench/gpu_check.py: the same seven steps as on a GPU (bf16 parameters with fp32
masters, the distributed optimizer at DP2, SFT warm start, checkpoint, resume, HF export,
mcore-to-hf == export), on gloo. On a GPU machine run `make gpu-check`."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(600)
def test_gpu_check_cpu_half(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_check.py"), "--device", "cpu", "--nproc", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=560, env=env, cwd=REPO)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "7 passed, 0 failed" in r.stdout
    for step in ("environment", "train", "resume", "metrics", "export", "mcore-to-hf", "checkpoint"):
        assert any(line.split()[1:3] == [step, "PASS"] for line in r.stdout.splitlines() if line[:1].isdigit()), step
