"""The training loop with rollout.backend=sglang, weight_sync=disk, against the SGLang test
double (tests/sglang_double.py: it generates with transformers and reloads weights on
update_weights_from_disk). Two trainer processes (TP2+SP) on CPU."""
from __future__ import annotations

import os

import pytest
import torch

from dist_utils import with_free_port
from sglang_double import SGLangDouble, sglang_overrides
from test_train_loop import REPO, TINY, gspo_rows
from testlib import train_pooled
from run_output import explain

STEPS = 3


GLM_TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml")
# the demo config of each model family (tests/megatron_utils.py FAMILIES)
FAMILY_CONFIGS = {"qwen3_moe": TINY, "glm4_moe": GLM_TINY}


def _tiny_hf_dir(path, config: str = TINY):
    """The demo config's architecture as a random-init HF checkpoint (its family's transformers
    class), with the project's tokenizer."""
    import yaml

    from gspo_megatron.model.family import family_for
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    with open(config) as f:
        hf = yaml.safe_load(f)["model"]["hf_config"]
    family = family_for(hf)
    model = family.reference_model(family.hf_config(hf))
    with torch.no_grad():  # a non-zero expert bias (GLM): the pushed buffer must reach the engine
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
    model.save_pretrained(str(path))
    build_tokenizer(str(path))
    return str(path)


def _watch_answers(server, see) -> None:
    """Call see(status, rows, updates_before) with every /generate answer of the double."""
    real_generate = server.generate

    def generate(body):
        n_updates = len(server.calls("/update_weights_from_disk"))
        status, res = real_generate(body)
        see(status, res if isinstance(res, list) else [res] if status == 200 else [], n_updates)
        return status, res

    server.generate = generate


@pytest.mark.timeout(600)
def double_run_args(hf_dir, out, steps: int, server_url: str, shared_dir, *extra: str) -> list[str]:
    """A TP2+SP run of `steps` GSPO steps of the demo config on `hf_dir` against the SGLang double
    at `server_url` (disk sync through `shared_dir`), no warm start, nothing saved, plus `extra`."""
    return ["--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
            f"train.max_steps={steps}", "train.sft_warmup_steps=0", "checkpoint.interval=0",
            "logging.progress_bar=false", "logging.plot=false", "checkpoint.export_hf=false", *extra,
            *sglang_overrides(server_url, weight_sync="disk", shared_dir=str(shared_dir))]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_training_loop_with_sglang_disk_sync(tmp_path, family):
    """Each model family's demo config against the SGLang double (its transformers class behind
    SGLang's routes): pushes, versions, log-probs equal to the trainer's, and the served weights
    equal to the exported ones bit for bit (GLM: the router's expert bias included). GLM's run also
    replays the engine's routing (R3, train.routing_replay=rollout): SGLang's routed experts, one
    row per decoder layer, the dense first layer's zeros, forced into the trainer's MoE layers
    (agreement exactly 1)."""
    import re

    from safetensors.torch import load_file

    from gspo_megatron.rollout.hf_engine import hub_weight_targets

    config = FAMILY_CONFIGS[family]
    hf_dir = _tiny_hf_dir(tmp_path / "hf0", config)
    shared = str(tmp_path / "sync")
    r3 = family == "glm4_moe"
    with SGLangDouble(hf_dir, enable_return_routed_experts=r3) as server:
        # what each /generate answered, and how many weight updates had reached the double before it
        served = []
        _watch_answers(server, lambda status, rows, n_updates: served.append(
            (n_updates, status, [r["meta_info"].get("weight_version") for r in rows])))
        out = tmp_path / "run"
        args = ["--config", config, f"out_dir={out}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                f"train.max_steps={STEPS}", "train.sft_warmup_steps=2", "checkpoint.interval=0",
                "logging.progress_bar=false", "logging.plot=false", "checkpoint.export_hf=true",
                *(["train.routing_replay=rollout"] if r3 else []),
                *sglang_overrides(server.url, weight_sync="disk", shared_dir=shared)]
        r = train_pooled(2, *args, timeout=560)
        assert r.returncode == 0, explain(r.stderr)
        records = list(server.records)
        served_weights = {k: t.get().detach().clone() for k, t in hub_weight_targets(server.engine.model).items()}
    gens = [x for x in records if x.path == "/generate"]
    updates = [x.body for x in records if x.path == "/update_weights_from_disk"]
    assert len(gens) >= STEPS * 8  # one request per prompt, 8 prompts per step
    # the run pushes its weights before the first rollout, then once after every step
    assert len(updates) == STEPS + 1
    versions = [int(u["weight_version"]) for u in updates]
    print("weight versions pushed:", versions)
    assert versions == list(range(STEPS + 1))  # +1 per update, starting from the run's step
    # every push names its own version directory v<N> in the run's shared dir
    for u, v in zip(updates, versions):
        path = u["model_path"]
        assert os.path.isabs(path) and os.path.dirname(path) == os.path.abspath(shared), path
        assert re.fullmatch(rf"v0*{v}", os.path.basename(path)), (path, v)
    # generations after each update carried the new version: every /generate answered (200) with
    # the version of the last update before it, and every step's rollout ran after its own update
    assert len(served) == len(gens)
    assert all(status == 200 and ver and set(ver) == {str(n - 1)} for n, status, ver in served), served
    assert sorted({n for n, _, _ in served}) == list(range(1, STEPS + 1))  # none before the first push, none after the last
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    assert any(x.path == "/flush_cache" for x in records)
    # after every sync the double's log-probs of the tokens it sampled equal the trainer's π_old
    # pass on them (fp32): it served the weights of the step, not older ones
    assert all(x["mismatch_logprob_max"] < 1e-5 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    if r3:  # every rollout request asked for the experts, and the trainer used exactly those
        assert all(x.body.get("return_routed_experts") is True for x in gens)
        assert all(x["routing_agreement"] == 1.0 for x in rows), [x["routing_agreement"] for x in rows]
    # after the run the double serves exactly the trainer's final weights (fp32, bit for bit) ...
    exported = {}
    for f in sorted(os.listdir(out / "hf")):
        if f.endswith(".safetensors"):
            exported.update(load_file(str(out / "hf" / f)))
    assert set(served_weights) == set(exported)
    assert all(t.dtype == torch.float32 for t in exported.values())
    differ = [k for k in exported if not torch.equal(served_weights[k], exported[k])]
    assert not differ, differ[:5]
    # ... which are not the weights it started with (negative control: the comparison can fail)
    initial = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            initial.update(load_file(os.path.join(hf_dir, f)))
    assert any(not torch.equal(initial[k], exported[k]) for k in exported)
    bias = [k for k in exported if k.endswith("e_score_correction_bias")]
    assert bool(bias) == (family == "glm4_moe")
    assert all(torch.equal(initial[k], exported[k]) for k in bias)  # a fixed buffer: never trained


def _two_free_ports() -> int:
    """A base port p with p and p + 1 free now (the doubles bind them themselves; a collision
    in between is retried by with_free_port): testlib.vllm_port's choice, below the ephemeral range."""
    from testlib import vllm_port

    return vllm_port()


@pytest.mark.timeout(600)
def test_colocated_engines_release_train_resume_push_every_step(tmp_path):
    """rollout.sglang.launch=true: local rank 0 starts GPUs-per-node / tp = 2 servers (the double,
    as SGLang's command line gets them) with --enable-memory-saver and one GPU each; every step
    the servers see  release -> (training) -> resume -> weight update -> generate, and the
    double refuses generation and weight updates while released, so a wrong order fails the run.
    Weight sync by disk (what colocated runs on several nodes use; distributed is refused: rank 0's
    GPU is also server 0's; tensor passes CUDA IPC handles, which a CPU process started apart from
    the trainer cannot open — CPU tensors travel through multiprocessing's resource sharer, whose
    authkey only forked children share)."""
    import re
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_double.py")
    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    out = tmp_path / "run"
    used = []

    def launch(port):  # the servers bind port and port + 1: retried with fresh ones if either was taken
        used.append(port)
        return train_pooled(2, *args(port), timeout=560)

    args = lambda port: ["--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
            f"train.max_steps={STEPS}", "train.sft_warmup_steps=0", "checkpoint.interval=0",
            "logging.progress_bar=false", "logging.plot=false", "checkpoint.export_hf=false",
            "rollout.backend=sglang", "rollout.sglang.urls=[]", "rollout.sglang.launch=true",
            f"rollout.sglang.port={port}", "rollout.sglang.weight_sync=disk",
            f"rollout.sglang.server_command=[{sys.executable},{script}]",
            "rollout.sglang.extra_args=[--dtype,float32]", "rollout.sglang.request_timeout_s=60",
            "rollout.sglang.ready_timeout_s=120", "rollout.sglang.max_retries=2",
            "rollout.sglang.bucket_mb=1", "rollout.sglang.host=0.0.0.0"]
    r = with_free_port(launch, free=_two_free_ports)
    assert r.returncode == 0, explain(r.stderr)
    port = used[-1]
    logs = sorted((out / "sglang_logs" / "node0").glob("sglang_server_*.log"))
    assert len(logs) == 2  # 2 GPUs (local ranks) per node / tp 1
    for i, path in enumerate(logs):
        argv = path.read_text().splitlines()[0]
        assert "--enable-memory-saver" in argv and f"--base-gpu-id {i}" in argv and f"--port {port + i}" in argv
        # bound beyond loopback without rollout.sglang.api_key_env: a generated key, which the
        # double (like SGLang) then demands of every request but the health checks; it reaches the
        # server in a --config file, never its command line, and its log has it redacted
        assert re.search(r"--config \S+/sglang_secrets.yaml$", argv) and "--api-key" not in argv, argv
        assert "'api_key': '<redacted>'" in path.read_text()
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    assert all(x["mismatch_logprob_max"] < 1e-5 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    code = {"/release_memory_occupation": "R", "/resume_memory_occupation": "W", "/begin_weight_update": "b",
            "/update_weights_from_disk": "d", "/generate": "G"}
    for path in logs:
        seq = "".join(code[m] for m in re.findall(r"^\[request\] \w+ (\S+)$", path.read_text(), re.M) if m in code)
        # startup: release; then per step: resume, push, generate, release (then the step trains)
        assert re.fullmatch(rf"R(WdG*R){{{STEPS}}}Wd", seq), (path.name, seq)


@pytest.mark.timeout(600)
def test_async_pushes_land_mid_generation_without_waiting(tmp_path):
    """rollout.async_steps=1 against the SGLang double (issue 42): the engine takes pushes
    mid-generation (a capability), so a push never waits for the batch in flight. By construction:
    from step 1's batch on, every request holds after 2 tokens until a retract pause has come and
    gone, so a push that waited would never return; the run finishes, every push after the first is
    pause(retract) -> update -> flush -> continue, and t_push_wait is 0 on every row. Staleness stays
    exact: the samples the trainer counts as spanning two versions (samples_carried) are exactly the
    rows the double answered with two weight_versions spans (a request not prefilled when the
    pause came is generated wholly by the new weights: SGLang's waiting requests are, too), none is
    more than one version old, none dropped, and the losses are finite."""
    import json
    import math

    import yaml
    from sglang_double import Faults

    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    # Step t's batch is one request per prompt, batch 0 the first ones. The push after step t
    # (version t + 1) pauses the double only once all of batch t + 1 is in: sent after the
    # trainer took batch t, it may reach the double after the push, however quick the trainer's
    # step is on a loaded machine (the delay fault makes the last request of batch 1 that late by
    # construction); admitted after the pause, it would hold until the next push,
    # which the trainer sends only once this batch is in. The last push has no batch after it.
    with open(TINY) as f:
        batch = int(yaml.safe_load(f)["rollout"]["prompts_per_step"])
    faults = Faults(hold_after_tokens=2, hold_from_request=batch, delay_s=3.0, delay_after=2 * batch - 1,
                    delay_requests=1,
                    pause_waits_for_requests=tuple(batch * (t + 2) for t in range(STEPS - 1)))
    with SGLangDouble(hf_dir, faults=faults) as server:
        spanning = []  # rows the double answered with tokens of two versions
        _watch_answers(server, lambda status, rows, n_updates: spanning.append(
            sum(len(r["meta_info"].get("weight_versions", [])) > 1 for r in rows)))
        out = tmp_path / "run"
        args = ["--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                f"train.max_steps={STEPS}", "train.sft_warmup_steps=0", "checkpoint.interval=0",
                "logging.progress_bar=false", "logging.plot=false", "checkpoint.export_hf=false",
                "rollout.async_steps=1", "rollout.dynamic_sampling=false",
                *sglang_overrides(server.url, weight_sync="disk", shared_dir=str(tmp_path / "sync"))]
        r = train_pooled(2, *args, timeout=560)
        assert r.returncode == 0, explain(r.stderr)
        records = list(server.records)
        assert server.waits_timed_out == 0
    # every batch's requests answered at their first attempt: none timed out while held
    assert sum(x.path == "/generate" for x in records) == batch * STEPS
    ctl = [x.path for x in records if x.path in ("/pause_generation", "/update_weights_from_disk", "/flush_cache",
                                                 "/continue_generation")]
    # the first push (before any rollout) is plain; every later one is mid-generation
    assert ctl[:2] == ["/update_weights_from_disk", "/flush_cache"], ctl
    later = ctl[2:]
    assert later and later == ["/pause_generation", "/update_weights_from_disk", "/flush_cache",
                               "/continue_generation"] * (len(later) // 4), ctl
    assert all(x.body == {"mode": "retract"} for x in records if x.path == "/pause_generation")
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    assert all(x["t_push_wait"] == 0.0 for x in rows), [x["t_push_wait"] for x in rows]
    assert all(x["staleness_max"] <= 1 and x["samples_dropped_stale"] == 0 for x in rows), rows
    assert sum(x["samples_carried"] for x in rows) == sum(spanning), ([x["samples_carried"] for x in rows], spanning)
    assert all(math.isfinite(x["loss"]) for x in rows), [x["loss"] for x in rows]
    assert all(0 < x["overlap_efficiency"] <= 1 for x in rows), [x["overlap_efficiency"] for x in rows]
    print(json.dumps([{k: x[k] for k in ("step", "t_push_wait", "t_weight_sync", "samples_carried",
                                         "staleness_max", "overlap_efficiency")} for x in rows]))


@pytest.mark.timeout(600)
def test_a_refit_that_serves_other_weights_stops_the_run_in_one_line(tmp_path):
    """rollout.verify_weights against the SGLang double (issue 42): every push is followed by the
    log-prob probe, the double's input_token_logprobs of the probe sequence against the trainer's
    forward (TP2 + SP). The first pushes are clean and pass (fp32 on both sides: ~1e-7, under the
    1e-4 tolerance); from the third on, the double stores one expert tensor scaled by 2 while it
    answers the update as a success (a push corrupted on the way). The run stops at that push's
    check in one line naming the server, the weight version and the probe, exit 1."""
    import json

    from sglang_double import Faults

    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    target = "model.layers.0.mlp.experts.0.down_proj.weight"
    with SGLangDouble(hf_dir, faults=Faults(scale_tensor=target, scale_by=2.0, scale_from_update=2)) as server:
        out = tmp_path / "run"
        args = double_run_args(hf_dir, out, 4, server.url, tmp_path / "sync", "rollout.prompts_per_step=2",
                               "rollout.samples_per_prompt=2", "rollout.verify_weights=true",
                               "rollout.verify_logprob_tol=1e-4")
        r = train_pooled(2, *args, timeout=560)
        records = list(server.records)
    probes = [x for x in records if x.path == "/generate" and x.body.get("logprob_start_len") == 0]
    updates = [x for x in records if x.path == "/update_weights_from_disk"]
    assert len(updates) == 3 and len(probes) == 3, (len(updates), len(probes))  # versions 0, 1 clean; 2 corrupted
    assert r.returncode == 1, r.stderr[-3000:]
    ours = [x for x in r.stderr.splitlines() if "gspo_megatron.train: error:" in x]
    # torchrun prints its own ChildFailedError traceback; none comes from the trainer's code
    frames = [x for x in r.stderr.splitlines() if x.strip().startswith("File ") and "gspo_megatron" in x]
    assert len(ours) == 1 and not frames, r.stderr[-3000:]
    assert ("refit check failed for weight version 2" in ours[0] and server.url in ours[0]
            and "log-prob probe" in ours[0]), ours[0]
    rows = gspo_rows(out)
    print(json.dumps([{k: x.get(k) for k in ("step", "refit_probe_abs", "t_verify")} for x in rows]), ours[0])
    assert [x["step"] for x in rows] == [1]  # step 2's push (version 2) failed its check
    assert rows[0]["refit_probe_abs"] < 1e-5


@pytest.mark.timeout(600)
def test_icepop_masks_exactly_the_tokens_an_engine_got_wrong(tmp_path):
    """loss.icepop=[0.5, 5] against an SGLang double that reports every third response token's
    log-prob 3 nats too low (π_old / π_engine = e^3 ~ 20 > 5 there; elsewhere fp32 agreement to
    ~1e-6): over the run, the tokens the trainer masked are exactly those, counted from what the
    double answered, and the loss stays finite."""
    import math

    from sglang_double import Faults

    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    with SGLangDouble(hf_dir, faults=Faults(logprob_offset=-3.0, logprob_offset_every=3)) as server:
        lengths = []  # response lengths of every row the double answered
        _watch_answers(server, lambda status, rows, n_updates: lengths.extend(
            r["meta_info"]["completion_tokens"] for r in rows))
        out = tmp_path / "run"
        args = double_run_args(hf_dir, out, STEPS, server.url, tmp_path / "sync", "rollout.dynamic_sampling=false",
                               "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "loss.icepop=[0.5,5.0]",
                               "loss.old_logprobs=recompute")
        r = train_pooled(2, *args, timeout=560)
        assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    expected = sum((n + 2) // 3 for n in lengths)  # positions 0, 3, 6, ... of every response
    masked = sum(round(x["icepop_masked_frac"] * x["loss_tokens"]) for x in rows)
    print("masked", masked, "expected", expected, "tokens", sum(x["loss_tokens"] for x in rows))
    assert sum(x["loss_tokens"] for x in rows) == sum(lengths)  # every answered token was in a step
    assert masked == expected > 0
    assert all(math.isfinite(x["loss"]) for x in rows)
