"""Secrets by environment variable name only (issue 52 row 6): one real run, as a user starts it
(torchrun; one rank: the layout is not what is checked), with sentinel secrets in every place a key can come from: a judge behind a
key (reward.judge.api_key_env), SGLang servers behind a key (rollout.sglang.api_key_env, the SGLang
double at a URL), W&B offline with WANDB_API_KEY set, plus an unrelated secret in the environment.
Everything the run wrote (out_dir, W&B's offline files and its own directories), everything it
printed, and the command line of every process it started (/proc/<pid>/cmdline, polled while it
runs) are searched for every sentinel: none is found. The launched-server half (a vLLM server's
argv, log and inherited environment) is tests/test_vllm_launch.py and tests/test_sglang.py; a real
launched vLLM server with a sentinel key, tests/test_vllm_glm.py."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from sglang_double import SGLangDouble, sglang_overrides
from test_judge import StandInJudge
from test_train_sglang import _tiny_hf_dir
from testlib import REPO, cmdline, descendants, run_env, torchrun_cmd

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
SENTINELS = {"GSPO_TEST_JUDGE_KEY": "sentinel-judge-71a3", "GSPO_TEST_SGLANG_KEY": "sentinel-sglang-52c8",
             "WANDB_API_KEY": "sentinel-wandb-0f4e", "AWS_SECRET_ACCESS_KEY": "sentinel-aws-9d21"}


@pytest.mark.timeout(600)
def test_no_sentinel_secret_in_anything_the_run_wrote_printed_or_ran(tmp_path):
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    hf_dir = _tiny_hf_dir(tmp_path / "hf")
    out = tmp_path / "run"
    judge = StandInJudge(lambda msg, n: ("ok", "7"), api_key=SENTINELS["GSPO_TEST_JUDGE_KEY"])
    wandb_dirs = {k: str(tmp_path / v) for k, v in (("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "wandb_cache"),
                                                     ("WANDB_CONFIG_DIR", "wandb_config"),
                                                     ("WANDB_DATA_DIR", "wandb_data"))}
    env = run_env(**SENTINELS, **wandb_dirs, WANDB_CONSOLE="off", WANDB_SILENT="true")
    seen: dict[int, str] = {}
    with SGLangDouble(hf_dir, api_key=SENTINELS["GSPO_TEST_SGLANG_KEY"]) as server:
        args = ["--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                "parallel.tp=1", "parallel.sequence_parallel=false", "train.max_steps=2", "train.sft_warmup_steps=0", "checkpoint.interval=1", "checkpoint.export_hf=true",
                "logging.progress_bar=false", "logging.plot=false", "rollout.prompts_per_step=2",
                "rollout.samples_per_prompt=2",
                *sglang_overrides(server.url, weight_sync="disk", shared_dir=str(tmp_path / "sync")),
                "rollout.sglang.api_key_env=GSPO_TEST_SGLANG_KEY",
                f"reward.judge.url={judge.url}", "reward.judge.api_key_env=GSPO_TEST_JUDGE_KEY",
                "reward.judge.timeout_s=30", "logging.wandb.mode=offline", "logging.wandb.project=secrets"]
        # the streams to files: the loop below polls the process tree, it does not read pipes
        out_f, err_f = open(tmp_path / "stdout", "w+"), open(tmp_path / "stderr", "w+")
        p = subprocess.Popen(torchrun_cmd(1, *args), stdout=out_f, stderr=err_f, text=True, env=env, cwd=REPO)
        try:
            deadline = time.monotonic() + 540
            while p.poll() is None and time.monotonic() < deadline:  # every process of the run, as it runs
                for q in descendants(p.pid):
                    if q not in seen:
                        seen[q] = cmdline(q)
                time.sleep(0.1)
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
            judge.close()
            out_f.close()
            err_f.close()
    stdout, stderr = (tmp_path / "stdout").read_text(), (tmp_path / "stderr").read_text()
    assert p.returncode == 0, stderr[-3000:]
    assert len(judge.bodies) >= 8 and len(server.calls("/generate")) >= 2  # both keys were used
    assert len(seen) >= 1, seen  # the rank at least
    written = [f for d in (out, tmp_path / "wandb_dir", tmp_path / "wandb_cache", tmp_path / "wandb_config",
                           tmp_path / "wandb_data") if d.exists() for f in d.rglob("*") if f.is_file()]
    assert any(f.name == "config.yaml" for f in written) and any(f.suffix == ".wandb" for f in written), written
    for name, value in SENTINELS.items():
        assert value not in stdout + stderr, name
        assert not [q for q, c in seen.items() if value in c], (name, seen)
        leaks = [str(f) for f in written if value.encode() in f.read_bytes()]
        assert not leaks, (name, leaks)
    config_yaml = (out / "config.yaml").read_text()
    assert "GSPO_TEST_SGLANG_KEY" in config_yaml and "GSPO_TEST_JUDGE_KEY" in config_yaml  # names, not keys
