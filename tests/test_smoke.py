"""The cluster pre-flight check (`python -m gspo_megatron.train --config C --smoke`, train/smoke.py)
against the SGLang test double, the CPU half of what an operator runs before a long job.

The trainer starts from a Megatron checkpoint (`model.load=<converted root>`, `model.hf_config=null`,
no model.hf_dir: the architecture comes from the checkpoint alone) while the double was started on
*another* random model of the same architecture, as servers started from a base model meet a
trainer resuming from its own checkpoint. With weight_sync=disk the push writes the run's
architecture as the servers' config.json (issue 31 item 2: this exact configuration used to stop at
launch with "weight_sync=disk needs hf_config"). After the push a faithful double serves the
trainer's weights (fp32: log-probs agree to ~1e-6, PASS); a double that accepts the push but keeps
its old weights fails the log-prob row with one line (exit 1)."""
from __future__ import annotations

import os

import pytest

from sglang_double import Faults, SGLangDouble, sglang_overrides
from test_train_loop import TINY
from testlib import train_pooled


def _tiny_hf(path, seed: int) -> str:
    import torch
    import yaml
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    with open(TINY) as f:
        hf = yaml.safe_load(f)["model"]["hf_config"]
    torch.manual_seed(seed)
    # initializer_range 0.1: peaked enough that two random models' log-probs differ by ~0.5 a token
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf, initializer_range=0.1)).save_pretrained(str(path))
    build_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from converters.cli import main as convert

    root = tmp_path_factory.mktemp("smoke")
    policy = _tiny_hf(root / "policy_hf", seed=1)
    assert convert(["hf-to-mcore", "--hf-dir", policy, "--out", str(root / "policy_mcore"), "--no-progress"]) == 0
    served = _tiny_hf(root / "served_hf", seed=2)  # what the servers were started with
    return root, str(root / "policy_mcore"), served


def _smoke(out, load: str, url: str, *, nproc: int = 1, timeout: int = 300):
    """nproc 1: one process at TP1; 2: TP2 + SP as the config says (rank 1 takes part in the push's
    gathers, the sample distribution and the log-prob pass). The trainer's own command-line main in
    pooled ranks (tests/testlib.py: status and streams as torchrun gives them)."""
    args = ["--config", TINY, "--smoke", f"out_dir={out}",
            f"model.load={load}", "model.hf_config=null", "model.hf_dir=null", "logging.progress_bar=false",
            *sglang_overrides(url, weight_sync="disk", shared_dir=str(out / "sync"))]
    if nproc == 1:
        args += ["parallel.tp=1", "parallel.sequence_parallel=false"]
    return train_pooled(nproc, *args, timeout=timeout)


@pytest.mark.timeout(400)
def test_smoke_passes_when_the_servers_take_the_push(models):
    root, load, served = models
    with SGLangDouble(served) as d:
        r = _smoke(root / "ok", load, d.url, nproc=2)
        pushes = d.calls("/update_weights_from_disk")
        gens = d.calls("/generate")
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[-1] == "smoke: PASS"
    assert "(sglang engine, 2 process(es))" in r.stdout
    table = {ln.split()[0]: ln for ln in lines if ln.startswith("  ")}
    for row in ("servers", "weights", "generate", "log-probs"):
        assert " PASS " in table[row], (row, table)
    # one push (version 0: a fresh run), then generation with it
    assert len(pushes) == 1 and str(pushes[0]["weight_version"]) == "0"
    assert gens
    # the pushed directory carries the architecture read from model.load (no hf_dir, no inline config)
    import json

    with open(os.path.join(pushes[0]["model_path"], "config.json")) as f:
        cfg = json.load(f)
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8 and cfg["hidden_size"] == 64
    # fp32 on both sides, same weights after the push: far inside the tolerance
    mean = float(table["log-probs"].split("mean |Δ| ")[1].split()[0])
    assert mean < 1e-4, table["log-probs"]
    # nothing of a training run was written
    assert not (root / "ok" / "checkpoints").exists() and not (root / "ok" / "metrics.jsonl").exists()


@pytest.mark.timeout(400)
def test_smoke_fails_in_one_line_when_a_server_keeps_stale_weights(models):
    root, load, served = models
    with SGLangDouble(served, faults=Faults(stale_weights=True)) as d:
        r = _smoke(root / "stale", load, d.url)
        assert len(d.calls("/update_weights_from_disk")) == 1  # the push was answered 200 ...
    print(r.stdout[-3000:])
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    last = r.stdout.splitlines()[-1]
    # ... and the served weights are not the trainer's: the log-prob comparison says so
    assert last.startswith("smoke: FAIL - log-probs: mean |Δ| "), last
    mean = float(last.split("mean |Δ| ")[1].split()[0])
    assert mean > 0.05, last
    assert "Traceback" not in r.stderr
