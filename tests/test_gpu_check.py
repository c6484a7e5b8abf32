"""The CPU half of bench/gpu_check.py, run as a GPU machine would: from a Python that has torch and
transformers and nothing else of this project's (tests/bare_env.py; the project not installed, no
megatron-core, no PYTHONPATH, cwd outside the repo), with --wheels = what `make gpu-wheels` fetches.
The check installs megatron-core from those wheels into a venv of its own under --out and re-runs
itself there, then the same seven steps as on a GPU (bf16 parameters with fp32 masters, the
distributed optimizer at DP2, SFT warm start, checkpoint, resume == uninterrupted run bit for bit,
HF export scoring like the trainer, mcore-to-hf == export), on gloo. On a GPU machine run
`make gpu-check`.

First run: the bare venv and the wheels are made once into the cache (bare_env.py; 1.5-3 minutes
with a local torch wheel, 1.2 GB); every run: the check itself, 2-3 minutes on 2 cores."""
from __future__ import annotations

import os
import subprocess

import pytest

from bare_env import BareEnvError, bare_python, carried_wheels
from run_output import explain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_TIMEOUT_S = 900
STEPS = ("environment", "train", "resume", "metrics", "export", "mcore-to-hf", "checkpoint", "vllm-nccl")


def _run_check(cmd, **kw) -> subprocess.CompletedProcess:
    """Run the check; on timeout SIGTERM first: the check then kills its launch in flight (which runs
    in a session of its own, out of reach of a plain kill of the check)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate(timeout=60)
        pytest.fail(f"bench/gpu_check.py did not finish in {CHECK_TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _has_megatron(py: str, cwd) -> bool:
    r = subprocess.run([py, "-c", "import importlib.util as u; print(bool(u.find_spec('megatron')))"],
                       capture_output=True, text=True, timeout=120, cwd=cwd,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, explain(r.stderr)
    return r.stdout.strip() == "True"


@pytest.mark.timeout(3000)  # first run: venv (<= 900 s of pip) + wheels (<= 900 s) + the check
def test_gpu_check_cpu_half_from_a_bare_python(tmp_path):
    try:
        py, skip = bare_python()
        wheels, skip2 = carried_wheels() if py else (None, None)
    except BareEnvError as e:
        pytest.fail(str(e))
    if not (py and wheels):
        pytest.skip(skip or skip2)
    assert not _has_megatron(py, tmp_path)  # megatron-core can only come from the wheels

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GSPO_GPU_CHECK_VENV")}
    env["OMP_NUM_THREADS"] = "1"
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    out = tmp_path / "out"
    r = _run_check([py, os.path.join(REPO, "bench", "gpu_check.py"), "--device", "cpu", "--nproc", "2",
                    "--wheels", wheels, "--out", str(out)], env=env, cwd=tmp_path)
    print(r.stdout[-4000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    assert "8 passed, 0 failed" in r.stdout
    rows = {line.split()[1]: line for line in r.stdout.splitlines()
            if line[:1].isdigit() and len(line.split()) > 2 and line.split()[2] in ("PASS", "FAIL")}
    assert list(rows) == list(STEPS), list(rows)
    for step in STEPS:
        assert rows[step].split()[2] == "PASS", rows[step]
    assert f"into {out / 'venv'}" in rows["environment"]  # the install path was the one taken
    assert "bit-identical" in rows["resume"]  # CPU: the resumed step 3 == the uninterrupted one exactly
    assert "log-probs == trainer's" in rows["export"]
    assert "4 bf16 tensors broadcast" in rows["vllm-nccl"] and rows["vllm-nccl"].rstrip().endswith("then aborted"), rows["vllm-nccl"]
    assert not _has_megatron(py, tmp_path)  # the interpreter itself was not written to
