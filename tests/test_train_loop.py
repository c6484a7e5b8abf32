"""The GSPO trainer end to end on CPU (2 gloo processes, tiny_cpu.yaml): it learns, it resumes
after kill -9 to the same weights, it exports a loadable HF model, and bad input fails early."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gspo_megatron import resolve
from megatron_utils import dcp_tensors
from run_output import explain
from testlib import REPO, descendants as _descendants, train_pooled
from testlib import run_env as _env, torchrun_cmd  # noqa: F401 - imported from here by other test files

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
# A smaller variant for the resume test (the learning test uses the demo config unchanged).
SMALL = ["train.max_steps=6", "train.sft_warmup_steps=4", "rollout.prompts_per_step=4",
         "rollout.samples_per_prompt=4", "checkpoint.interval=2", "checkpoint.keep_last=0",
         "logging.progress_bar=false", "logging.plot=false"]


def run_train(out_dir, *overrides, nproc=2, timeout=900, config=TINY):
    """A training run of `config` + overrides that must succeed, in pooled ranks (testlib.train_pooled:
    the trainer's own command-line main, without a torchrun launch per run)."""
    r = train_pooled(nproc, "--config", config, f"out_dir={out_dir}", *overrides, timeout=timeout)
    assert r.returncode == 0, explain(r.stderr)
    return r


def gspo_rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"gspo"' in line]


# The Makefile's demo target adds these (DEMO_EVAL): held-out pass@k every 25 steps.
DEMO_EVAL = ["eval.interval=25", "eval.num_prompts=64", "eval.samples_per_prompt=4"]


@pytest.mark.timeout(900)
def test_demo_learns_and_exports_hf(tmp_path):
    with open(os.path.join(REPO, "Makefile")) as f:  # what `make demo` runs
        assert f"DEMO_EVAL = {' '.join(DEMO_EVAL)}\n" in f.read()
    out = tmp_path / "demo"
    run_train(out, *DEMO_EVAL)
    rows = gspo_rows(out)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)) and len(rows) >= 20
    for key in ("step", "reward_mean", "reward_std", "clip_frac", "ratio_mean", "loss", "grad_norm",
                "response_len_mean", "tokens_per_s", "t_rollout", "t_train", "t_weight_sync"):
        assert key in rows[-1], key
    k = max(1, len(rows) // 5)
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    print(f"reward first 20%: {first:.3f}  last 20%: {last:.3f}")
    # the warm start (train.sft_warmup_steps=60) already earns ~0.5 mean reward; GSPO holds it and
    # sharpens pass@1 (measured: 0.523 -> 0.697)
    assert last > first, (first, last)
    assert os.path.isfile(out / "metrics.png")
    # held-out pass@1 (a task seed the training never sees) at steps 0, 25, ..., 100: the task is
    # learned (>= 0.3 at the end; measured 0.387 after the warm start -> 0.582 at step 100, cosine LR)
    evals = [json.loads(x) for x in open(out / "metrics.jsonl") if '"eval"' in x]
    assert [r["step"] for r in evals] == [0, 25, 50, 75, 100]
    p1 = [r["eval/heldout/pass@1"] for r in evals]
    print("held-out pass@1:", p1)
    assert p1[-1] >= 0.3 and p1[-1] > p1[0], p1
    # after every weight push the in-process engine serves exactly the trainer's weights: its
    # log-probs of every sampled token equal the trainer's π_old pass (fp32 rounding: 1.4e-5 at
    # worst over the demo's 100 steps; a skipped or stale push shows up as ~1e-2,
    # test_train_step_reference.py)
    worst = max(r["mismatch_logprob_max"] for r in rows)
    print(f"engine vs trainer log-probs, worst step: {worst:.2e}")
    assert worst < 1e-4, worst

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo_megatron.rollout.data import render_prompt
    from gspo_megatron.rollout.tasks import SyntheticTask

    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    tok = AutoTokenizer.from_pretrained(out / "hf")
    task = SyntheticTask("sort", seed=123)
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in task.sample_prompts(16, 5):
            p = render_prompt(tok, ex["prompt"])
            a = tok.encode(task.demonstration(ex), add_special_tokens=False) + [tok.eos_token_id]
            logits = model(torch.tensor([p + a])).logits[0, len(p) - 1 : -1]
            total += torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(a)[:, None]).sum().item()
            count += len(a)
    # uniform over the 98-token vocabulary would be log(1/98) = -4.6 per token
    assert total / count > -1.5, total / count


def _hf_tensors(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


# The default optimizer path at DP2: Megatron's distributed optimizer shards masters and moments.
DP2_DISTOPT = ["parallel.tp=1", "parallel.sequence_parallel=false", "optimizer.use_distributed_optimizer=true"]


def kill9_after_checkpoint(out_dir, min_step: int, *overrides: str, timeout_s: float = 600) -> int:
    """Start a 2-process run of tiny_cpu.yaml + overrides, SIGKILL it once its newest checkpoint
    is at step >= min_step, and return that step (the run's resume point)."""
    proc = subprocess.Popen(torchrun_cmd(2, "--config", TINY, f"out_dir={out_dir}", *overrides), env=_env(),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    latest = out_dir / "checkpoints" / "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if latest.exists() and latest.read_text().strip() and int(latest.read_text()) >= min_step:
                break
            if proc.poll() is not None:
                pytest.fail(f"the run exited before its step-{min_step} checkpoint")
            time.sleep(0.1)
        else:
            pytest.fail(f"no step-{min_step} checkpoint within {timeout_s:.0f} s")
    finally:
        # torchrun starts its workers in process groups of their own: SIGKILL every process under
        # our torchrun (found by parent pid in /proc), workers first, not just torchrun's group
        pids = _descendants(proc.pid) + [proc.pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
        # a SIGKILLed process in uninterruptible I/O (a checkpoint's fsync on a loaded machine) runs
        # until the I/O returns: the resumed run would find the run lock held by a live process
        from gspo_megatron.train.runlock import _alive

        gone_by = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
    return int(latest.read_text())


@pytest.mark.timeout(900)
def test_kill9_then_resume_matches_uninterrupted_run(tmp_path):
    """kill -9 mid-run with the distributed optimizer at DP2, then resume=auto: final weights
    bit-identical, Adam moments in the final checkpoint equal, and the trainer checkpoint exports
    (gspo-convert mcore-to-hf) to exactly the run's own <out_dir>/hf."""
    # long enough that the kill lands mid-run: with 6 steps the whole run (~0.1 s a step) used to
    # finish between two polls, and "resume" started from the final checkpoint
    steps = 30
    long = [*SMALL, *DP2_DISTOPT, f"train.max_steps={steps}"]
    ref = tmp_path / "ref"
    run_train(ref, *long)

    out = tmp_path / "killed"
    kill9_after_checkpoint(out, 4, *long)
    latest = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert not (out / "hf").exists()
    step = int(latest.read_text())  # the newest complete checkpoint when it was killed
    r = run_train(out, *long, "checkpoint.resume=auto")
    assert f"resumed from {out / 'checkpoints' / f'iter_{step:07d}'} at step {step}" in r.stderr + r.stdout, \
        (r.stderr + r.stdout)[-2000:]
    assert 4 <= step < steps  # it really resumed mid-run (not from scratch, not after the end)

    a, b = _hf_tensors(ref / "hf"), _hf_tensors(out / "hf")
    assert set(a) == set(b)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff == 0.0, f"resumed run differs from the uninterrupted one by {diff}"
    assert [r["step"] for r in gspo_rows(out)] == list(range(1, steps + 1))
    ra, rb = gspo_rows(ref), gspo_rows(out)
    assert [r["reward_mean"] for r in ra] == [r["reward_mean"] for r in rb]

    final = f"checkpoints/iter_{steps:07d}"
    ma, mb = dcp_tensors(ref / final, "optimizer.state."), dcp_tensors(out / final, "optimizer.state.")
    moments = [k for k in ma if ".exp_avg" in k]
    assert moments and set(ma) == set(mb)
    assert all(torch.equal(ma[k], mb[k]) for k in ma), [k for k in ma if not torch.equal(ma[k], mb[k])][:3]
    assert any(ma[k].abs().max() > 0 for k in moments)

    from converters.cli import main as convert

    assert convert(["mcore-to-hf", "--load", str(ref / final), "--out", str(tmp_path / "conv"), "--no-progress"]) == 0
    c = _hf_tensors(tmp_path / "conv")
    assert set(c) == set(a) and all(torch.equal(c[k], a[k]) for k in a)


def _last_row(out_dir):
    return gspo_rows(out_dir)[-1]


@pytest.mark.timeout(900)
def test_resume_at_another_layout_continues_training(tmp_path):
    """A checkpoint written at TP2 (+SP) resumes at TP1 x DP2 (distributed optimizer) and at EP2,
    and training goes on from its step (the exact state after loading: test_checkpoint.py)."""
    src = tmp_path / "tp2"
    run_train(src, *SMALL, "train.max_steps=2", "checkpoint.interval=0")
    ckpt = src / "checkpoints"  # a Megatron-LM root: its tracker names iter_0000002
    for name, layout in (("dp2", DP2_DISTOPT), ("ep2", ["parallel.tp=1", "parallel.sequence_parallel=false",
                                                      "parallel.ep=2"])):
        out = tmp_path / name
        r = run_train(out, *SMALL, *layout, "train.max_steps=3", f"checkpoint.resume={ckpt}")
        assert "resharding" in r.stderr and "resumed from" in r.stderr
        # with the progress bar off (SMALL), a startup summary and one line per step
        assert "run: world 2 = tp 1" in r.stderr and "optimizer distributed Adam" in r.stderr
        assert "step 3/3 | reward" in r.stderr
        assert [row["step"] for row in gspo_rows(out)] == [3]
        assert (out / "checkpoints" / "iter_0000003").is_dir() and (out / "hf").is_dir()


@pytest.mark.timeout(900)
def test_sft_warm_start_survives_the_first_gspo_step_with_bf16_params(tmp_path):
    """bf16 parameters (fp32 masters in the optimizer): the SFT warm start and GSPO share one
    optimizer, so the first GSPO step starts from the warmed-up weights. With a second optimizer
    (the old code) the first GSPO step wrote the main optimizer's masters — the initial weights —
    back over the warm start."""
    bf16 = [*SMALL, *DP2_DISTOPT, "model.dtype=bfloat16", "checkpoint.interval=0"]
    run_train(tmp_path / "init", *bf16, "train.sft_warmup_steps=0", "train.max_steps=0")
    run_train(tmp_path / "warm", *bf16, "train.max_steps=0")
    run_train(tmp_path / "step", *bf16, "train.max_steps=1", "optimizer.lr=1e-12")
    init, warm, step = (_hf_tensors(tmp_path / d) for d in ("init/hf", "warm/hf", "step/hf"))
    assert all(t.dtype == torch.bfloat16 for t in warm.values())

    def dist(a, b):
        return sum(float((a[k].double() - b[k].double()).norm() ** 2) for k in a) ** 0.5

    moved = dist(warm, init)
    assert moved > 1.0  # the warm start changed the weights
    assert dist(step, warm) < 1e-3 * moved, (dist(step, warm), moved)  # and a tiny GSPO step kept them


def _left_in_the_process(rank, world):
    """What of a finished run is still alive in this (pooled) rank, after two collections."""
    import gc

    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    gc.collect()
    gc.collect()  # the first frees the run's cycles, whose finalizers release the rest
    kinds = {"GPTModel": GPTModel, "DistributedDataParallel": DistributedDataParallel, "ProcessGroup": dist.ProcessGroup}
    alive = {k: sum(isinstance(o, t) for o in gc.get_objects()) for k, t in kinds.items()}
    return alive, len(os.listdir("/proc/self/task"))


@pytest.mark.timeout(600)
def test_a_finished_run_leaves_no_model_in_the_process(tmp_path):
    """train() returns, and nothing of the run stays: the model, its DDP wrapper and its process
    groups (with gloo's ~60 threads a rank) are freed (parallel/ddp.py release_model). Failed on the
    first version: Megatron's DDP hooks and the MoE dispatcher's cached routing graph made a cycle
    through C++ that kept all of it, one copy per run, for the life of the process."""
    import dist_utils

    dist_utils.close_pools()  # ranks that have run nothing yet
    run_train(tmp_path / "run", *SMALL, "train.max_steps=2", "checkpoint.interval=0", "checkpoint.export_hf=false")
    for alive, threads in dist_utils.run_distributed(_left_in_the_process, 2):
        # the run built 16 groups a rank; the 2 left are not the run's (the old code: all 16 and
        # ~56 threads a rank after one run, one more set per run)
        assert alive["GPTModel"] == 0 and alive["DistributedDataParallel"] == 0, (alive, threads)
        assert alive["ProcessGroup"] <= 2 and threads < 30, (alive, threads)


@pytest.mark.timeout(600)
def test_fused_logprobs_trains_like_the_logits_head(tmp_path):
    """model.fused_logprobs=true end to end (SFT warm-up, old log-probs, GSPO updates, HF export)
    at the demo's TP2+SP: same losses as the logits head up to float32 rounding."""
    steps = ["train.max_steps=2", "checkpoint.interval=0"]
    plain = run_train(tmp_path / "plain", *SMALL, *steps)
    fused = run_train(tmp_path / "fused", *SMALL, *steps, "model.fused_logprobs=true")
    note = "token log-probs: fused from the final hidden states"
    assert note in fused.stderr and note not in plain.stderr

    def rows(d):
        with open(d / "metrics.jsonl") as f:
            return [json.loads(line) for line in f]

    a, b = rows(tmp_path / "plain"), rows(tmp_path / "fused")
    sft_a = [r["nll"] for r in a if r.get("phase") == "sft"]
    sft_b = [r["nll"] for r in b if r.get("phase") == "sft"]
    assert sft_a and sft_b == pytest.approx(sft_a, rel=1e-5)
    ga, gb = [r for r in a if r.get("phase") == "gspo"], [r for r in b if r.get("phase") == "gspo"]
    assert len(ga) == len(gb) == 2
    for x, y in zip(ga, gb):
        assert y["reward_mean"] == x["reward_mean"]
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-7)
    ha, hb = _hf_tensors(tmp_path / "plain" / "hf"), _hf_tensors(tmp_path / "fused" / "hf")
    assert max((ha[k] - hb[k]).abs().max().item() for k in ha) < 1e-4


# `python -m gspo_megatron.train`, with the heavy phase's entry points (process groups, model
# build) recording their calls in the file named by the first argument.
_HEAVY_SPY = """
import runpy, sys
import gspo_megatron.model.factory as factory
import gspo_megatron.parallel.state as state
marker = sys.argv.pop(1)
def spy(mod, name):
    real = getattr(mod, name)
    def called(*a, **k):
        with open(marker, "a") as f:
            f.write(name + "\\n")
        return real(*a, **k)
    setattr(mod, name, called)
spy(state, "init_parallel")
spy(factory, "build_policy")
sys.argv[0] = "gspo_megatron.train"
runpy.run_module("gspo_megatron.train", run_name="__main__", alter_sys=True)
"""


def _train_fails(tmp_path, *overrides):
    """The one error line of a run that must fail on bad input, and which heavy-phase functions
    (init_parallel: process groups, build_policy: the model) it reached before failing."""
    marker = tmp_path / "heavy_calls.txt"
    marker.unlink(missing_ok=True)
    r = subprocess.run([sys.executable, "-c", _HEAVY_SPY, str(marker), "--config", TINY,
                        f"out_dir={tmp_path / 'bad'}", *overrides], capture_output=True, text=True,
                       timeout=120, env=_env(), cwd=REPO)
    lines = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(lines) == 1, r.stderr[-2000:]
    assert not (tmp_path / "bad" / "checkpoints").exists()
    return lines[0], marker.read_text().split() if marker.exists() else []


@pytest.mark.timeout(300)
def test_bad_input_fails_early_with_one_line(tmp_path):
    line, heavy = _train_fails(tmp_path, "train.max_stepz=3")
    assert "train.max_stepz" in line and heavy == []
    line, heavy = _train_fails(tmp_path, "parallel.tp=3")
    assert ("parallel.tp" in line or "tp=3" in line) and heavy == []
    line, heavy = _train_fails(tmp_path, "data.source=file", f"data.path={tmp_path / 'nope.jsonl'}", "reward.fn=math")
    assert "nope.jsonl" in line and heavy == []
    line, heavy = _train_fails(tmp_path, "reward.fn=no_such_module_xyz:score", "parallel.tp=1",
                               "parallel.sequence_parallel=false")
    assert "no_such_module_xyz" in line
    assert heavy == []  # failed before building models / process groups
    # an explicit resume directory that is not a trainer checkpoint (was found only after the model
    # was built), and parallel.device=cuda without CUDA (was a traceback)
    (tmp_path / "not_a_checkpoint").mkdir()
    line, heavy = _train_fails(tmp_path, f"checkpoint.resume={tmp_path / 'not_a_checkpoint'}", "parallel.tp=1",
                               "parallel.sequence_parallel=false")
    assert "not a trainer checkpoint" in line and heavy == [], (line, heavy)
    line, heavy = _train_fails(tmp_path, "parallel.device=cuda", "parallel.tp=1", "parallel.sequence_parallel=false")
    assert "CUDA is not available" in line and heavy == [], (line, heavy)
    # negative control for the spy: an input found bad only after setup (no SGLang server at the
    # configured url: the engine is built after the model) is seen reaching process groups and model
    line, heavy = _train_fails(tmp_path, "parallel.tp=1", "parallel.sequence_parallel=false", "rollout.backend=sglang",
                               "rollout.sglang.urls=[http://127.0.0.1:9]", "rollout.sglang.ready_timeout_s=1")
    assert "not ready" in line and "127.0.0.1:9" in line
    assert heavy == ["init_parallel", "build_policy"], heavy


@pytest.mark.timeout(600)
def test_trainer_starts_from_a_converted_checkpoint(tmp_path):
    """model.load= takes a `gspo-convert hf-to-mcore` output (the same torch_dist format as the
    trainer's checkpoints): with no training, the run's HF export is the source model bit for bit."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from converters.cli import main as convert
    from gspo_megatron.resolve import load_config

    hf_cfg = resolve.hf_config_dict(load_config(TINY, []))
    torch.manual_seed(3)
    src = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_cfg))
    src.save_pretrained(tmp_path / "src")
    assert convert(["hf-to-mcore", "--hf-dir", str(tmp_path / "src"), "--out", str(tmp_path / "mc"),
                    "--no-progress"]) == 0
    run_train(tmp_path / "run", *SMALL, *DP2_DISTOPT, f"model.load={tmp_path / 'mc'}", "train.max_steps=0",
              "train.sft_warmup_steps=0")
    a, b = _hf_tensors(tmp_path / "src"), _hf_tensors(tmp_path / "run" / "hf")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _converted(tmp_path, **over):
    """A tiny random Qwen3-MoE with tiny_cpu.yaml's architecture (plus `over`) and the project's
    local tokenizer, converted with gspo-convert hf-to-mcore; returns the checkpoint directory."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from converters.cli import main as convert
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    hf_cfg = {**resolve.hf_config_dict(load_config(TINY, [])), **over}
    torch.manual_seed(5)
    src = tmp_path / "src"
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_cfg)).save_pretrained(src)
    build_tokenizer().save_pretrained(src)
    assert convert(["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "mc"), "--no-progress"]) == 0
    return tmp_path / "mc"


@pytest.mark.timeout(600)
def test_model_load_takes_architecture_and_tokenizer_from_the_checkpoint(tmp_path):
    """Bring your own model: `model.load=` of a gspo-convert output, with no model.hf_config /
    hf_dir / tokenizer, trains and exports a model of the checkpoint's vocabulary."""
    mc = _converted(tmp_path, vocab_size=128)
    run_train(tmp_path / "run", *SMALL, *DP2_DISTOPT, "model.hf_config=null", f"model.load={mc}",
              "train.max_steps=1", "train.sft_warmup_steps=2", "checkpoint.interval=0")
    out = _hf_tensors(tmp_path / "run" / "hf")
    assert out["model.embed_tokens.weight"].shape[0] == 128 and out["lm_head.weight"].shape[0] == 128
    assert [r["step"] for r in gspo_rows(tmp_path / "run")] == [1]


@pytest.mark.timeout(300)
def test_no_silent_slicing_or_ignored_data(tmp_path):
    """A config whose inline vocab_size (98) is smaller than the checkpoint's (128) used to load,
    train and export a 98-row model; data.path without data.source=file used to train on the
    synthetic task. Both are now one line before any weights move."""
    mc = _converted(tmp_path, vocab_size=128)
    line, heavy = _train_fails(tmp_path, f"model.load={mc}", "parallel.tp=1", "parallel.sequence_parallel=false")
    assert "vocab_size=98" in line and "vocab_size=128" in line, line
    assert heavy == []  # before any process group or model exists, let alone weights moving
    line, heavy = _train_fails(tmp_path, f"data.path={tmp_path / 'prompts.jsonl'}", "reward.fn=math")
    assert "data.source=file" in line and "prompts.jsonl" in line, line
    assert heavy == []


_GC_PROBE = '''
import gc, json, sys
import gspo_megatron.train.loop as loop
from gspo_megatron.train.__main__ import main

seen, step = [], loop.gspo_step


def gspo_step(*a, **k):
    seen.append(gc.get_freeze_count())
    return step(*a, **k)


loop.gspo_step = gspo_step
rc = main()
print("GC_PROBE " + json.dumps({"during": seen, "after": gc.get_freeze_count()}))
sys.exit(rc)
'''


@pytest.mark.timeout(300)
def test_the_run_freezes_what_setup_built_out_of_the_gc(tmp_path):
    """What setup built (~400k objects) is frozen out of the cyclic GC during the steps (a full
    collection scanning it took 0.3 s, the slowest step of a bench run), and unfrozen after."""
    probe = tmp_path / "probe.py"
    probe.write_text(_GC_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone", str(probe),
           "--config", TINY, f"out_dir={tmp_path / 'run'}", "parallel.tp=1", "parallel.sequence_parallel=false",
           "train.max_steps=2", "train.sft_warmup_steps=0", "checkpoint.interval=0", "checkpoint.export_hf=false",
           "logging.progress_bar=false", "logging.plot=false"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=REPO)
    assert r.returncode == 0, explain(r.stderr)
    got = json.loads(r.stdout.split("GC_PROBE ", 1)[1].splitlines()[0])
    assert len(got["during"]) == 2 and min(got["during"]) > 100_000, got
    assert got["after"] == 0, got
