"""The second model family (GLM-4.5-style MoE, launch/configs/tiny_cpu_glm.yaml) against a real
vLLM 0.32 server on CPU that the trainer launches (a file of its own: pytest-xdist runs it beside
tests/test_vllm.py and tests/test_vllm_supervised.py). Shared fixtures: tests/vllm_fixtures.py.
Skipped only when the vLLM venv cannot be built because the package index is unreachable."""
from __future__ import annotations

import os

import pytest

import vllm_fixtures
from run_output import explain
from testlib import REPO, train_pooled, vllm_port
from vllm_fixtures import FROM_TINY, gspo_rows

vllm_python = vllm_fixtures.vllm_python  # the shared fixture, bound here


@pytest.mark.timeout(900)
def test_a_launched_vllm_server_serves_the_glm_family_as_the_trainer_does(vllm_python, tmp_path):
    """The second model family end to end against a real engine: tiny_cpu_glm.yaml (a dense first
    layer, a shared expert, sigmoid routing with an expert bias and a scaling factor, partial RoPE,
    QKV biases) with a launched vLLM server (Glm4MoeForCausalLM) and nothing else vLLM-specific.
    Every push is verified (per-tensor digests and the log-prob probe) and every sampled token's
    engine log-prob equals the trainer's to 1e-4 (fp32 both sides).

    Secrets (issue 52 row 6), on the same run: the server's key comes from the variable
    rollout.vllm.api_key_env names, and neither it nor the W&B key of the trainer's environment
    appears in anything the run writes (config.yaml, metrics, the server's log with its argv line)
    or prints. That the server inherits neither: tests/test_sglang.py (ServerProcesses, the same
    code for both engines) and tests/test_vllm_launch.py."""
    out = tmp_path / "glm"
    glm = os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml")
    args = ["--config", glm, *FROM_TINY, f"out_dir={out}", "train.sft_warmup_steps=2", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "train.minibatches_per_step=2", "train.max_steps=3",
            "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false",
            "eval.interval=0", "rollout.verify_weights=true", f"rollout.vllm.port={vllm_port()}",
            "rollout.vllm.api_key_env=GSPO_TEST_VLLM_KEY"]
    key, wandb = "sentinel-vllm-key-5e1d", "sentinel-wandb-key-9a2b"
    r = train_pooled(2, *args, timeout=840,  # the trainer's own main in pooled ranks (tests/testlib.py)
                     env={"GSPO_TEST_VLLM_KEY": key, "WANDB_API_KEY": wandb})
    assert r.returncode == 0, explain(r.stderr)
    written = [p for p in out.rglob("*") if p.is_file() and p.stat().st_size < (64 << 20)]
    assert any(p.name == "config.yaml" for p in written) and any(p.name == "vllm_server_0.log" for p in written)
    for sentinel in (key, wandb):
        assert sentinel not in r.stdout + r.stderr
        leaks = [str(p) for p in written if sentinel.encode() in p.read_bytes()]
        assert not leaks, (sentinel, leaks)
    assert "api_key_env: GSPO_TEST_VLLM_KEY" in (out / "config.yaml").read_text()  # the name is what is kept
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3]
    print("GLM on vLLM: mismatch_logprob_max", [x["mismatch_logprob_max"] for x in rows],
          "refit_probe_abs", [x["refit_probe_abs"] for x in rows])
    assert all(x["mismatch_logprob_max"] <= 1e-4 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    assert all(x.get("weights_verified", 0) > 0 for x in rows), [x.get("weights_verified") for x in rows]
    assert all(x["refit_probe_abs"] <= 1e-4 for x in rows), [x.get("refit_probe_abs") for x in rows]
    with open(out / "vllm_logs" / "vllm_server_0.log") as f:  # the server's argv, then its log
        log = f.read()
    assert "Glm4MoeForCausalLM" in log, log[:2000]
