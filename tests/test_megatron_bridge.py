"""Checkpoints both ways with NVIDIA Megatron-Bridge 0.3.1 (the ecosystem's HF <-> Megatron
converter and trainer), on a tiny Qwen3-MoE, fp32, CPU.

Megatron-Bridge runs in subprocesses (tests/bridge_driver.py) from a --no-deps install
(tests/bridge_env.py: skipped with one line where it cannot be installed), with a CPU stand-in for
Transformer Engine's import and CUDA's RNG calls kept inside the driver. References are
independent: the HF safetensors the model came from, and Bridge's own HF -> Megatron import of the
same HF directory.

- Bridge saves (its `save_megatron_model`: a Megatron-LM root, run_config.yaml, no hf_config/):
  `gspo-convert mcore-to-hf --load <root>` with no flags gives the HF weights back bit for bit, and
  the trainer starts from `model.load=<root>` (architecture from the run_config) and trains one
  step; its learning rate (1e-30) moves no fp32 weight, so the exported policy must equal the
  Bridge checkpoint's weights bit for bit.
- We save (`gspo-convert hf-to-mcore`, and that run's trainer checkpoint root): Bridge's
  low-level weights loader, its training loader (`load_checkpoint`, finetune) and
  `AutoBridge.load_megatron_model` (which builds the model from our run_config.yaml) load them,
  every one given the root, and every parameter equals Bridge's own import of the HF checkpoint
  bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from bridge_env import bridge_pythonpath
from test_converters import assert_bit_exact, hf_tensors
from test_train_loop import REPO, run_train
from test_train_sglang import _tiny_hf_dir

DRIVER = os.path.join(REPO, "tests", "bridge_driver.py")


@pytest.fixture(scope="module")
def bridge_path():
    path, why = bridge_pythonpath()
    if path is None:
        pytest.skip(why)
    return path


def _run_driver(bridge_path, *args, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([bridge_path, REPO]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, DRIVER, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=REPO)


def _driver(bridge_path, *args, timeout=300) -> dict:
    r = _run_driver(bridge_path, *args, timeout=timeout)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert r.returncode == 0 and lines, f"bridge_driver {args[0]} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.timeout(900)
def test_checkpoints_round_trip_with_megatron_bridge(bridge_path, tmp_path):
    hf = _tiny_hf_dir(tmp_path / "hf")  # the demo's architecture and the project's tokenizer, fp32

    # Megatron-Bridge saves -> we read it and train from it
    broot = tmp_path / "bridge_ckpt"
    saved = _driver(bridge_path, "save", "--hf", hf, "--out", str(broot))
    assert (broot / "latest_checkpointed_iteration.txt").is_file() and saved["keys"]
    from converters.cli import main as convert

    assert convert(["mcore-to-hf", "--load", str(broot), "--out", str(tmp_path / "from_bridge"), "--no-progress"]) == 0
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "from_bridge"))

    run = tmp_path / "run"
    run_train(run, f"model.load={broot}", "model.hf_config=null", "train.max_steps=1", "train.sft_warmup_steps=0",
              "optimizer.lr=1e-30", "checkpoint.interval=0", "checkpoint.export_hf=true",
              "logging.progress_bar=false", "logging.plot=false")
    rows = [json.loads(x) for x in open(run / "metrics.jsonl") if '"gspo"' in x]
    assert [r["step"] for r in rows] == [1] and rows[0]["loss"] == rows[0]["loss"]
    exported = hf_tensors(run / "hf")
    assert_bit_exact(hf_tensors(hf), exported)  # what was loaded is Bridge's checkpoint, untouched

    # we save -> Megatron-Bridge loads it: the converter's root and the trainer's checkpoint root,
    # each given as the root (AutoBridge.load_megatron_model takes the newest iter_* directory,
    # auto_bridge.py:662-675: the converter writes iteration 0 as Bridge's own save does)
    ours = tmp_path / "ours"
    assert convert(["hf-to-mcore", "--hf-dir", hf, "--out", str(ours), "--no-progress"]) == 0
    # the control: without Bridge's latest_train_state.pt its training loader falls back to the
    # Megatron-LM tracker, whose reader in Bridge 0.3.1 refuses iteration 0 (the converter writes
    # that file for this reason, as Bridge's own save does)
    bare = tmp_path / "ours_without_train_state"
    shutil.copytree(ours, bare)
    (bare / "latest_train_state.pt").unlink()
    # every load in one driver process (one Bridge import and reference model), the control last
    pairs = [(ours, "lowlevel"), (ours, "training"), (ours, "highlevel"),
             (run / "checkpoints", "training"), (run / "checkpoints", "highlevel"), (bare, "training")]
    r = _run_driver(bridge_path, "load", "--hf", hf, *(a for c, lo in pairs for a in ("--ckpt", str(c), "--loader", lo)),
                    timeout=600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"bridge_driver load exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    loads = json.loads(lines[-1])["loads"]
    assert [x["loader"] for x in loads] == [lo for _, lo in pairs], loads
    for (ckpt, loader), got in zip(pairs[:-1], loads):
        print(ckpt.name, loader, got)
        assert "error" not in got and got["tensors"] > 0 and not got["differ"] and not got["missing"], got
    assert r.returncode == 1 and "error parsing metadata file" in loads[-1].get("error", ""), loads[-1]
