"""The training loop with rollout.backend=sglang, weight_sync=disk, against the SGLang test
double (tests/sglang_double.py: it generates with transformers and reloads weights on
update_weights_from_disk). Two trainer processes (TP2+SP) on CPU."""
from __future__ import annotations

import os
import subprocess

import pytest

from sglang_double import SGLangDouble, sglang_overrides
from test_train_loop import REPO, TINY, _env, gspo_rows, torchrun_cmd

STEPS = 3


def _tiny_hf_dir(path):
    import yaml
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    with open(TINY) as f:
        hf = yaml.safe_load(f)["model"]["hf_config"]
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).save_pretrained(str(path))
    build_tokenizer(str(path))
    return str(path)


@pytest.mark.timeout(600)
def test_training_loop_with_sglang_disk_sync(tmp_path):
    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    with SGLangDouble(hf_dir) as server:
        out = tmp_path / "run"
        args = ["--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                f"train.max_steps={STEPS}", "train.sft_warmup_steps=2", "checkpoint.interval=0",
                "logging.progress_bar=false", "logging.plot=false", "checkpoint.export_hf=false",
                *sglang_overrides(server.url, weight_sync="disk", shared_dir=str(tmp_path / "sync"))]
        r = subprocess.run(torchrun_cmd(2, *args), capture_output=True, text=True, timeout=560, env=_env(), cwd=REPO)
        assert r.returncode == 0, r.stderr[-4000:]
        records = list(server.records)
    gens = [x for x in records if x.path == "/generate"]
    updates = [x.body for x in records if x.path == "/update_weights_from_disk"]
    assert len(gens) >= STEPS * 8  # one request per prompt, 8 prompts per step
    # the run pushes its weights before the first rollout, then once after every step
    assert len(updates) == STEPS + 1
    versions = [int(u["weight_version"]) for u in updates]
    print("weight versions pushed:", versions)
    assert versions == list(range(STEPS + 1))  # +1 per update, starting from the run's step
    assert all(os.path.isabs(u["model_path"]) or u["model_path"] for u in updates)
    # generations after each update carried the new version
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    assert any(x.path == "/flush_cache" for x in records)
