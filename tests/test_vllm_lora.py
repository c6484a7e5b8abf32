"""LoRA pushes to a real engine (issue 55): a vLLM 0.32 server on CPU that the trainer launches
serves a LoRA policy - GLM-4.5's tiny model, adapters on attention, the dense MLP, the shared
expert and every routed expert - with the attention adapters pushed on their own (vLLM loads them
as a LoRA adapter: Capabilities.lora_targets) and the others merged into their weights, the
number of modules the adapter bound checked on every push. Shared fixtures: tests/vllm_fixtures.py;
skipped only when the vLLM venv cannot be built because the package index is unreachable."""
from __future__ import annotations

import json
import os

import pytest

import vllm_fixtures
from run_output import explain
from testlib import REPO, train_pooled, vllm_port
from vllm_fixtures import FROM_TINY, gspo_rows

vllm_python = vllm_fixtures.vllm_python  # the shared fixture, bound here
GLM = os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml")


@pytest.mark.timeout(900)
def test_a_lora_run_on_a_launched_vllm_server_pushes_attention_adapters_and_merges_the_rest(vllm_python, tmp_path):
    """3 GSPO steps with LoRA (rank 4 on every target): every push loads the attention adapters
    into the server as a LoRA adapter (its folder under weight_sync/lora-v<N>, PEFT format) and
    reloads the weights with the MLP and expert adapters merged; every push's bound-module count
    is checked (2 per layer: vLLM's qkv_proj and o_proj); every step's sampled tokens have the
    trainer's log-probs to 1e-4 (fp32 both sides), and the refit probe agrees. Non-vacuous: the
    adapters moved (B starts at zero), and the server's log says it loaded them."""
    out = tmp_path / "run"
    args = ["--config", GLM, *FROM_TINY, f"out_dir={out}", "train.sft_warmup_steps=0", "rollout.prompts_per_step=4",
            "rollout.samples_per_prompt=4", "train.minibatches_per_step=2", "train.max_steps=3",
            "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false",
            "eval.interval=0", "rollout.verify_weights=true", f"rollout.vllm.port={vllm_port()}",
            "lora.rank=4", "lora.alpha=8", "optimizer.lr=0.01", "optimizer.lr_decay_style=constant",
            "reward.fn=tests.reward_fns:text_hash"]  # rewards that differ within a group: every step updates
    r = train_pooled(2, *args, timeout=840)
    assert r.returncode == 0, explain(r.stderr)
    assert "lora pushes: attention as adapters, experts, mlp, shared_experts merged into their weights" in r.stderr
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == [1, 2, 3]
    print("LoRA on vLLM: mismatch_logprob_max", [x["mismatch_logprob_max"] for x in rows], "refit_probe_abs",
          [x.get("refit_probe_abs") for x in rows], "bound", [x.get("lora_bound_modules") for x in rows],
          "checks", [x.get("lora_bind_checks") for x in rows], "grad_norm", [x.get("grad_norm") for x in rows])
    layers = json.loads((out / "checkpoints" / "iter_0000003" / "hf_config" / "config.json").read_text())[
        "num_hidden_layers"]
    assert all(x["lora_bound_modules"] == 2 * layers for x in rows), rows
    # the first push (version 0) and one per step, each checked on the one server
    assert [x["lora_bind_checks"] for x in rows] == [2, 3, 4], [x.get("lora_bind_checks") for x in rows]
    assert all(x["mismatch_logprob_max"] <= 1e-4 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    assert all(x["refit_probe_abs"] <= 1e-4 for x in rows if "refit_probe_abs" in x), rows
    assert all(x["grad_norm"] > 0 for x in rows)
    adapters = sorted((out / "weight_sync").glob("lora-v*"))
    assert [p.name for p in adapters] == ["lora-v3"]  # earlier versions' folders pruned
    cfg = json.loads((adapters[0] / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"] and cfg["r"] == 4
    log = (out / "vllm_logs" / "vllm_server_0.log").read_text()
    assert "--enable-lora" in log and "Loaded new LoRA adapter" in log


class _Server:
    """What _load_adapter asks of a server: the load, then the workers' bound-module counts."""
    url = "http://127.0.0.1:1"

    def __init__(self, counts):
        self.counts, self.calls = counts, []

    def post(self, path, body, **kw):
        self.calls.append((path, body))
        if path == "/collective_rpc":
            return {"results": [{"adapters": c, "modules": 4} for c in self.counts]}
        return "Success"


@pytest.mark.parametrize("counts,ok", [([{"1": 4}], True), ([{"1": 0}], False), ([{"1": 4}, {"1": 3}], False),
                                       ([{}], False), ([{"1": 4, "2": 4}], False)])
def test_an_adapter_bound_to_other_modules_than_the_trainers_is_one_line_naming_the_server(counts, ok):
    """The check each push makes (VLLMEngine._load_adapter): every worker must have set weights on
    exactly the modules the trainer's adapters stand on (here 4), with one adapter loaded; an
    adapter bound to none (a server whose --lora-target-modules miss the modules: reward flat,
    no error, as once after a vLLM upgrade), to fewer on one worker, or beside another, stops the
    push with one LoraBindError line naming the server."""
    from gspo_megatron.rollout.vllm_api import LOAD_LORA, LORA_NAME
    from gspo_megatron.rollout.vllm_engine import LoraBindError, VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)
    eng.metrics, eng.request_timeout_s = {}, 30.0
    eng._lock = __import__("threading").Lock()
    s = _Server(counts)
    if ok:
        eng._load_adapter(s, ("/sync/lora-v3", 4), 3)
        assert eng.metrics["lora_bound_modules"] == 4 and eng.metrics["lora_bind_checks"] == 1
    else:
        with pytest.raises(LoraBindError) as e:
            eng._load_adapter(s, ("/sync/lora-v3", 4), 3)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"vLLM server {s.url}: the LoRA adapter of weight version 3 bound to")
        assert "the trainer's adapters stand on 4" in msg
    assert s.calls[0] == (LOAD_LORA, {"lora_name": LORA_NAME, "lora_path": "/sync/lora-v3", "load_inplace": True})
