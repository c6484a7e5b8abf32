"""LoRA in the trainer (issue 55): the loop's own GSPO step with adapters on attention, the dense
MLP, the shared expert and every routed expert (GLM-4.5's tiny model has all four) against a
float64 reference written here from the paper's definitions - the merged weight W + (alpha / r) B A
on transformers' model, GSPO's sequence ratio exp(mean_t log pi/pi_old) clipped per sequence, and
the KL to the base model - at TP2+SP, EP2, TP2xETP2, EP2xETP2, PP2 and CP2 (packed), and with
full and selective activation recompute. Built by
train/setup.py setup_run from a `lora:` config like any run; the step is train/loop.py gspo_step.

Per layout: the step's loss, KL and clip fraction, and every adapter gradient of every rank (after
Megatron's schedule, DDP and finalize_model_grads; before the optimizer) against the reference's,
mapped to the rank's split by model/lora.py hf_to_local. π_old is the engine's (fixed per-token
log-probs near the policy's), so some sequences are clipped and others not; the KL reference is
the base: the LoRA policy with its adapters off (no second model).

And the run around it: checkpoints are adapter-only (no base tensor in them), and a run resumed
from one ends where the uninterrupted run ends, bit for bit (same machine, same layout: both
runs take the same kernels); a resume into other adapters, or without LoRA, is one line.
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import lora_leaves, lora_merged_params, make_tiny_hf, random_lora_adapters, tiny_glm_config
from testlib import REPO

TINY_GLM = os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml")
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
RANK, ALPHA, TEMPERATURE, KL = 4, 8.0, 0.8, 0.1
EPS = (0.002, 0.003)
GRAD_RTOL = 1e-4  # fp32 trainer against float64, relative to the tensor's largest entry
PROMPTS = [3, 5, 4, 6, 3, 4, 5, 2]
RESPONSES = [9, 4, 14, 7, 12, 5, 10, 16]


def _tempered(model, params, samples) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] padded log-probs of softmax(logits / T) at the response tokens, and the mask."""
    from torch.func import functional_call

    T = max(len(r) for _, r in samples)
    rows, mask = [], torch.zeros(len(samples), T, dtype=torch.bool)
    for i, (prompt, response) in enumerate(samples):
        seq = torch.tensor([prompt + response])
        logits = functional_call(model, params, (seq,)).logits[0, :-1] / TEMPERATURE
        lp = torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])[:, 0][len(prompt) - 1:]
        rows.append(torch.nn.functional.pad(lp, (0, T - len(lp))))
        mask[i, :len(lp)] = True
    return torch.stack(rows), mask


def _reference(hf_dir, adapters, samples, advantages):
    """float64: engine log-probs near the merged policy's (fixed noise), then GSPO's loss with the
    KL to the base model and its gradient with respect to every adapter tensor."""
    from transformers import AutoModelForCausalLM

    from gspo_megatron.algorithms import gspo_loss

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    leaf = lora_leaves(adapters)
    with torch.no_grad():
        base_lp, mask = _tempered(model, dict(model.named_parameters()), samples)
    lp, _ = _tempered(model, lora_merged_params(model, leaf, ALPHA / RANK), samples)
    # log s_i = mean_t (lp - engine) = shift_i - mean_t noise: every other sequence well past the
    # clip on the side that zeroes its gradient, the rest within or past the other side
    g = torch.Generator().manual_seed(3)
    sign = torch.tensor(advantages, dtype=torch.float64).sign()
    shift = torch.where(torch.arange(len(samples)) % 2 == 0, 0.01 * sign, -0.001 * sign)[:, None]
    engine = (lp.detach() - shift + 0.005 * torch.randn(lp.shape, generator=g, dtype=torch.float64)) * mask
    loss, m = gspo_loss(lp, engine, torch.tensor(advantages, dtype=torch.float64), mask, eps_low=EPS[0],
                        eps_high=EPS[1], ref_log_probs=base_lp, kl_coef=KL)
    names = list(leaf)
    grads = torch.autograd.grad(loss, [leaf[k] for k in names])
    engine_rows = [engine[i, :len(r)].tolist() for i, (_, r) in enumerate(samples)]
    return float(loss), {k: float(v) for k, v in m.items()}, {k: x.float() for k, x in zip(names, grads)}, engine_rows


def _rank_step(rank, world, hf_dir, out_dir, overrides, adapters, samples, ref_grads):
    from gspo_megatron.model import lora
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train import loop
    from gspo_megatron.train.batch import TrainSample
    from gspo_megatron.train.setup import setup_run

    cfg = load_config(TINY_GLM, [
        f"out_dir={out_dir}", f"model.hf_dir={hf_dir}", "model.hf_config=null", "model.dtype=float32",
        f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "loss.type=gspo", "loss.old_logprobs=engine",
        f"loss.kl_coef={KL}", f"loss.eps_low={EPS[0]}", f"loss.eps_high={EPS[1]}", f"rollout.temperature={TEMPERATURE}",
        "rollout.max_new_tokens=16", "train.micro_batch_tokens=40", "train.minibatches_per_step=1",
        "train.sft_warmup_steps=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
        # whole gradients on every rank after the schedule (the distributed optimizer leaves each
        # rank its shard reduced: tests/test_train_step_reference.py)
        "optimizer.use_distributed_optimizer=false", "rollout.backend=hf", *overrides])
    parts = setup_run(cfg, world_size=world)
    errs: dict[str, float] = {}
    real = loop._run_schedule

    def run_schedule(parts_, step_fn, mbs, *, forward_only):
        reports = real(parts_, step_fn, mbs, forward_only=forward_only)
        if not forward_only:  # the update's gradients, before the optimizer
            for _, module in lora.adapters(parts_.model):
                want_a, want_b = lora.hf_to_local(module, parts_.arch, ref_grads)
                for p, want in ((module.lora_A, want_a), (module.lora_B, want_b)):
                    err = float((p.main_grad.float() - want).abs().max() / want.abs().max().clamp_min(1e-12))
                    errs[f"{module._lora['key']}.{'A' if p is module.lora_A else 'B'}"] = err
        return reports

    loop._run_schedule = run_schedule  # restored below: ranks are pooled (tests/dist_utils.py)
    try:
        n = lora.load_hf_adapters(parts.model, parts.arch, adapters)
        groups = sorted({m._lora["group"] for _, m in lora.adapters(parts.model)})
        base_grads = sum(1 for c in parts.model for name, p in c.named_parameters()
                         if ".lora_" not in name and p.requires_grad)
        train = [TrainSample(p, r, adv, engine_logprobs=e) for p, r, adv, e in samples]
        metrics = loop.gspo_step(parts, train)
    finally:
        loop._run_schedule = real
        parts.close()
    return metrics, errs, n, groups, base_grads


@pytest.fixture(scope="module")
def glm_reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hf-glm-lora"))
    make_tiny_hf(d, family="glm4_moe")
    cfg = tiny_glm_config()
    g = torch.Generator().manual_seed(11)
    samples = [(torch.randint(1, cfg.vocab_size, (p,), generator=g).tolist(),
                torch.randint(1, cfg.vocab_size, (r,), generator=g).tolist()) for p, r in zip(PROMPTS, RESPONSES)]
    advantages = torch.randn(len(samples), generator=g).tolist()
    adapters = random_lora_adapters(cfg, RANK, seed=7)
    loss, metrics, grads, engine = _reference(d, adapters, samples, advantages)
    rows = [(p, r, a, e) for (p, r), a, e in zip(samples, advantages, engine)]
    return d, adapters, rows, loss, metrics, grads


TP1 = ["parallel.tp=1", "parallel.sequence_parallel=false"]
LAYOUTS = [
    pytest.param(2, ["parallel.tp=2", "parallel.sequence_parallel=true"], id="tp2-sp"),
    pytest.param(2, [*TP1, "parallel.ep=2"], id="ep2"),
    pytest.param(2, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=2"], id="tp2-etp2"),
    pytest.param(4, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=2"],
                 id="ep2xetp2"),
    pytest.param(2, [*TP1, "parallel.pp=2"], id="pp2"),
    pytest.param(2, [*TP1, "parallel.cp=2", "train.packing=true"], id="cp2-packed"),
    # activation recompute: the frozen embedding's output must require grad, or the recomputed
    # layers record no graph and their adapters get no gradient (model/lora.py _inputs_require_grad)
    pytest.param(2, [*TP1, "parallel.ep=2", "train.recompute=full"], id="ep2-recompute-full"),
    pytest.param(2, ["parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=selective"],
                 id="tp2-sp-recompute-selective"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_lora_gspo_step_matches_the_float64_merged_reference(glm_reference, world, layout, tmp_path):
    hf_dir, adapters, rows, ref_loss, ref_m, ref_grads = glm_reference
    out = run_distributed(_rank_step, world, hf_dir, str(tmp_path / "run"), layout, adapters, rows, ref_grads,
                          timeout=300)
    metrics = out[0][0]
    errs = {k: v for r in out for k, v in r[1].items()}
    worst = max(errs, key=errs.get)
    print(f"{layout}: loss {metrics['loss']:.8f} vs {ref_loss:.8f}; kl {metrics['kl_ref']:.3e} vs {ref_m['kl_ref']:.3e}; "
          f"clip {metrics['clip_frac']:.3f} vs {ref_m['clip_frac']:.3f}; adapter grad rel err max {errs[worst]:.2e} "
          f"({worst}); {sum(r[2] for r in out)} adapters over {world} ranks")
    assert out[0][3] == ["attention", "experts", "mlp", "shared_experts"]  # all four groups adapted
    assert all(r[4] == 0 for r in out)  # the base is frozen
    assert 0 < ref_m["clip_frac"] < 1 and ref_m["kl_ref"] > 1e-4  # both terms matter here
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-7)
    assert metrics["kl_ref"] == pytest.approx(ref_m["kl_ref"], rel=1e-4, abs=1e-8)
    assert metrics["clip_frac"] == pytest.approx(ref_m["clip_frac"], abs=1e-6)
    assert errs[worst] <= GRAD_RTOL, worst
    assert not math.isnan(errs[worst])


# ------------------------------------------------------------------------ checkpoints and resume

RUN = ["lora.rank=4", "lora.alpha=16", "train.sft_warmup_steps=0", "rollout.prompts_per_step=4",
       "rollout.samples_per_prompt=4", "train.minibatches_per_step=2", "checkpoint.interval=0", "checkpoint.keep_last=0",
       "checkpoint.export_hf=false", "eval.interval=0", "logging.progress_bar=false", "logging.plot=false",
       "loss.kl_coef=0.05", "optimizer.lr_decay_style=constant"]  # the same LR at step 3 whatever max_steps


def _train(out, *overrides):
    from testlib import train_pooled
    from run_output import explain

    r = train_pooled(2, "--config", TINY, f"out_dir={out}", *RUN, *overrides, timeout=600)
    return r, explain(r.stderr)


def _error_line(r) -> str:
    """The one error line of a run that must fail (exit 2, no traceback); pooled ranks have no
    torchrun to stop rank 1 once rank 0 said it, so each rank may say the same line
    (cli_util.user_errors)."""
    lines = {ln for ln in r.stderr.splitlines() if ": error: " in ln}
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines.pop()


@pytest.mark.timeout(900)
def test_lora_checkpoints_are_adapter_only_and_a_resumed_run_ends_where_the_straight_one_does(tmp_path, capsys):
    """3 steps straight, against 2 steps, then a resume for the third (TP2+SP, the demo's random-init
    base rebuilt from its seed on resume): the last checkpoints hold the same adapters, Adam
    moments and loop state bit for bit, and only adapters (no base tensor: a 235B base is never
    written per save). A resume with other adapters, or without LoRA, is one line."""
    from megatron_utils import dcp_tensors

    from gspo_megatron.train.checkpoint import read_trainer_state

    straight, halted = tmp_path / "straight", tmp_path / "halted"
    r, why = _train(straight, "train.max_steps=3")
    assert r.returncode == 0, why
    r, why = _train(halted, "train.max_steps=2")
    assert r.returncode == 0, why
    r, why = _train(halted, "train.max_steps=3")
    assert r.returncode == 0, why
    a = dcp_tensors(straight / "checkpoints" / "iter_0000003")
    b = dcp_tensors(halted / "checkpoints" / "iter_0000003")
    assert sorted(a) == sorted(b)
    assert a and all(".lora_A" in k or ".lora_B" in k for k in a), sorted(a)  # adapters and their Adam state only
    kinds = {k.split(".")[0] for k in a}
    assert any(k.startswith("optimizer.state.exp_avg.") for k in a) and kinds <= {"decoder", "optimizer"}, kinds
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
    assert any(float(t.abs().max()) > 0 for k, t in a.items() if k.endswith("lora_B"))  # B left zero: trained
    state = read_trainer_state(str(straight / "checkpoints" / "iter_0000003"))
    assert state["lora"]["rank"] == 4 and state["lora"]["alpha"] == 16.0 and state["lora"]["base"] == {"init_seed": 1234}
    rows = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (halted / "metrics.jsonl").read_text().splitlines()]
    last = [r_ for r_ in rows if r_.get("step") == 3 and "loss" in r_]
    last_b = [r_ for r_ in rows_b if r_.get("step") == 3 and "loss" in r_]
    assert last and last_b and last[-1]["loss"] == last_b[-1]["loss"]

    # the same checkpoint into other adapters, and into a full-parameter run: one line each
    r, _ = _train(halted, "train.max_steps=4", "lora.rank=8")
    line = _error_line(r)
    assert "its adapters do not fit this run's (lora.rank: saved 4, here 8)" in line, line
    r, _ = _train(halted, "train.max_steps=4", "lora.rank=0")
    line = _error_line(r)
    assert "is an adapter-only LoRA checkpoint (lora.rank=4)" in line, line
    # and as the weights of a new run: it holds no base
    r, _ = _train(tmp_path / "new", f"model.load={halted / 'checkpoints' / 'iter_0000003'}")
    line = _error_line(r)
    assert "is an adapter-only LoRA checkpoint (base: the random init of seed 1234)" in line, line
    # nor as the model gspo_megatron.score reads
    from gspo_megatron.score import main as score

    (tmp_path / "seqs.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    with pytest.raises(SystemExit) as e:
        score(["--load", str(halted / "checkpoints" / "iter_0000003"), "--input", str(tmp_path / "seqs.jsonl"),
               "--output", str(tmp_path / "lp.jsonl")])
    assert e.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ": error: " in ln]
    assert len(err) == 1 and "--load: " in err[0] and "is an adapter-only LoRA checkpoint" in err[0], err
