"""The README's "Your own model and data" commands, run as written on a tiny model: convert,
dry run, train 2 steps, resume to step 3, export, load in transformers."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_block() -> str:
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    section = text.split("## Your own model and data", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(900)
def test_readme_own_model_and_data_commands(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron import resolve
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    hf = tmp_path / "my-model"
    cfg = {**resolve.hf_config_dict(load_config(os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml"), [])),
           "vocab_size": 128}
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).save_pretrained(hf)
    build_tokenizer().save_pretrained(hf)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a}+{b}?", "answer": str(a + b)}) + "\n"
                            for a in range(6) for b in range(4)))

    block = readme_block()
    values = {"HF": str(hf), "DATA": str(data), "OUT": str(tmp_path / "out")}
    for var, value in values.items():  # the placeholders at the top of the block
        block, n = re.subn(rf"^{var}=\S+", f"{var}={value}", block, flags=re.M)
        assert n == 1, var
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, timeout=840,
                       cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    out = tmp_path / "out"
    assert "24 records checked in" in r.stdout and "24 usable, 0 skipped" in r.stdout  # the dry run read every record
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if '"gspo"' in x]
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert "resumed from" in r.stderr
    assert (out / "export" / "config.json").is_file() and (out / "export" / "tokenizer_config.json").is_file()
