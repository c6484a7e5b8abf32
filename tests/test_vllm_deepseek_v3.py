"""The third model family (DeepSeek-V3: multi-latent attention, YaRN, grouped routing) against a
real vLLM 0.32 server on CPU, launched by this module's fixture through the trainer's own launch
code (rollout/vllm_server.py: prepare adds the family's `vllm_server_args`, CPU_MLA). The model is
the configuration sweep's DeepSeek-V3 (tests/test_config_sweep.py build_model: the demo
architecture with a latent of 512 + 64, the one size vLLM's CPU MLA kernels take), so the sweep's
DeepSeek-V3 x vLLM cells run here too, on the same server. Skipped only when the vLLM venv cannot
be built because the package index is unreachable."""
from __future__ import annotations

import pytest

import vllm_fixtures
from run_output import explain
from test_config_sweep import ELSEWHERE, _cell_id, build_model, run_cell
from testlib import REPO, train_pooled
from vllm_fixtures import gspo_rows

vllm_python = vllm_fixtures.vllm_python  # the shared fixture, bound here
SWEEP_CELLS = ELSEWHERE["tests/test_vllm_deepseek_v3.py::test_sweep_cells_on_this_modules_server"]
KEY = "GSPO_DSV3_VLLM_KEY"


@pytest.fixture(scope="module")
def server(vllm_python, tmp_path_factory):
    """(url, key, model dir, log dir): one vLLM server of the sweep's DeepSeek-V3 model."""
    from dist_utils import with_free_port
    from gspo_megatron.rollout.vllm_server import ServerClient, VLLMLaunchSpec, launch
    from testlib import vllm_port

    model = build_model("deepseek_v3", tmp_path_factory.mktemp("dsv3_vllm_model") / "hf")
    logs = tmp_path_factory.mktemp("dsv3_vllm_logs")

    def start(port):
        spec = VLLMLaunchSpec(model_path=model, port=port, api_key="k3y", python=vllm_python, log_dir=str(logs),
                              trainer_dtype="float32", max_model_len=512)
        procs = launch(spec)
        try:
            procs.wait_ready([ServerClient(procs.urls[0], api_key="k3y")], 900)
        except BaseException:
            procs.stop()
            raise
        return procs

    procs = with_free_port(start, free=vllm_port)
    try:
        yield procs.urls[0], "k3y", model, logs
    finally:
        procs.stop()


@pytest.mark.timeout(600)
def test_a_vllm_cpu_server_serves_deepseek_v3_as_the_trainer_computes_it(server, tmp_path):
    """Multi-latent attention served by vLLM's CPU_MLA backend (asked for by the family: the same
    backend on CPUs with and without AMX) in float32: 2 GSPO steps at TP2 + SP, every push
    verified (per-tensor digests and the log-prob probe, which re-derive after each reload the
    absorbed projections MLA's decode uses) and every sampled token's engine log-prob equal to the
    trainer's to 1e-4."""
    url, key, model, logs = server
    out = tmp_path / "run"
    args = ["--config", f"{REPO}/launch/configs/tiny_cpu_deepseek_v3.yaml", f"out_dir={out}", f"model.hf_dir={model}",
            "model.hf_config=null", "model.dtype=float32", "rollout.backend=vllm", f"rollout.vllm.urls=[{url}]",
            f"rollout.vllm.api_key_env={KEY}", f"rollout.vllm.shared_dir={tmp_path / 'sync'}",
            "rollout.verify_weights=true", "train.sft_warmup_steps=0", "rollout.prompts_per_step=2",
            "rollout.samples_per_prompt=4", "train.minibatches_per_step=2", "train.max_steps=2",
            "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.progress_bar=false",
            "logging.plot=false", "eval.interval=0"]
    r = train_pooled(2, *args, timeout=540, env={KEY: key})
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == [1, 2]
    print("DeepSeek-V3 on vLLM: mismatch_logprob_max", [x["mismatch_logprob_max"] for x in rows],
          "refit_probe_abs", [x["refit_probe_abs"] for x in rows])
    assert all(x["mismatch_logprob_max"] <= 1e-4 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    assert all(x.get("weights_verified", 0) > 0 for x in rows), [x.get("weights_verified") for x in rows]
    assert all(x["refit_probe_abs"] <= 1e-4 for x in rows), [x.get("refit_probe_abs") for x in rows]
    log = (logs / "vllm_server_0.log").read_text()
    assert "--attention-backend CPU_MLA" in log.splitlines()[0] and "Using CPU_MLA backend" in log, log[:2000]
    assert "DeepseekV3ForCausalLM" in log


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", SWEEP_CELLS, ids=_cell_id)
def test_sweep_cells_on_this_modules_server(cell, server, tmp_path):
    """tests/test_config_sweep.py's DeepSeek-V3 x vLLM cells, with every check a cell makes there
    (test_config_sweep.run_cell), on this module's server (its model is the sweep's)."""
    url, key, model, _ = server
    run_cell(cell, model, tmp_path, vllm_url=url, env={"GSPO_SWEEP_VLLM_KEY": key})
