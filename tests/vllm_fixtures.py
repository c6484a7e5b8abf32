"""What the vLLM test files share (tests/test_vllm.py, test_vllm_supervised.py, test_vllm_glm.py; the
`vllm_python` fixture also test_vllm_contract.py, NETWORK test_config_sweep.py): the vLLM venv, the
two random models, one running server per module that asks for it, and the runs' metrics.

A test module takes the fixtures by binding them (`vllm_python = vllm_fixtures.vllm_python`): a
module-scoped fixture is then one instance per module (each module that uses `server` starts its
own server, so only tests/test_vllm.py does)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from testlib import REPO, vllm_port  # vllm_port: test_config_sweep imports it from here too

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
# tiny_cpu.yaml to a launched vLLM server: the engine, and head_dim 32 (vLLM's CPU attention takes
# 32, 64, 80, ...: cpu_attn.py); model.dtype float32 is tiny_cpu's own, said here as the issue asks
FROM_TINY = ["rollout.backend=vllm", "rollout.vllm.launch=true", "model.hf_config.head_dim=32", "model.dtype=float32"]
HF = dict(vocab_size=98, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=32,  # vLLM's CPU attention: head_dim >= 32 (cpu_attn.py)
          num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
          max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
          initializer_range=0.1)
SERVER = dict(dtype="float32", max_model_len=512, cpu_kv_cache_mb=32)
GATE_PLUGINS = os.path.join(REPO, "tests", "vllm_plugins")
NETWORK = ("Could not find a version", "No matching distribution", "NewConnectionError", "Max retries exceeded",
           "Temporary failure in name resolution", "Network is unreachable", "Connection refused")


@pytest.fixture(scope="module")
def vllm_python():
    from gspo_megatron.rollout import vllm_env

    try:
        return vllm_env.ensure(timeout_s=2400)
    except vllm_env.VLLMEnvError as e:
        if any(s in str(e) for s in NETWORK):
            pytest.skip(f"vLLM venv not buildable here, the package index is unreachable: {str(e)[:200]}")
        raise


def _model(path, seed: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**HF)).eval()
    m.save_pretrained(str(path))
    build_tokenizer(str(path))
    return m


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return root, _model(root / "A", 1), _model(root / "B", 2)


@pytest.fixture(scope="module")
def server(vllm_python, models, tmp_path_factory):
    """One running vLLM server on model A (urls mode for the tests below), stopped at the end."""
    from dist_utils import with_free_port
    from gspo_megatron.rollout.vllm_server import ServerClient, VLLMLaunchSpec, launch

    root, _, _ = models
    gate = tmp_path_factory.mktemp("vllm_gate")  # tests/vllm_plugins/gspo_vllm_gate.py, inert until armed

    def start(port):
        spec = VLLMLaunchSpec(model_path=str(root / "A"), port=port, api_key="k3y", python=vllm_python,
                              log_dir=str(tmp_path_factory.mktemp("vllm_logs")),
                              extra_args=["--scheduler-cls", "gspo_vllm_gate.HoldUntilPauseScheduler"],
                              env={"PYTHONPATH": os.pathsep.join([REPO, GATE_PLUGINS]),
                                   "GSPO_VLLM_GATE_DIR": str(gate)}, **SERVER)
        procs = launch(spec)
        try:
            procs.wait_ready([ServerClient(procs.urls[0], api_key="k3y")], 600)
        except BaseException:
            procs.stop()
            raise
        return procs

    procs = with_free_port(start, free=vllm_port)
    yield procs.urls[0], "k3y", gate
    procs.stop()


def gspo_rows(out) -> list[dict]:
    """The GSPO rows of a run's metrics.jsonl (none yet: [])."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("phase") == "gspo"]


