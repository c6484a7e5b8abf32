"""model.dtype=float16 learns: the loss is scaled before backward as Megatron's fp16 optimizer
expects (it divides the gradients by its loss scale before stepping). Before, the schedules never
scaled the loss (TransformerConfig.grad_scale_func unset), so every fp16 update was the gradient
divided by 2^32; on CPU the grad scaler's CUDA tensors raised instead."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from run_output import explain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_float16_warm_start_learns_like_float32(tmp_path):
    """(The fp32 arm also runs with logging.tensorboard=true and checks its event files.)"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    nll = {}
    for dtype in ("float16", "float32"):
        out = tmp_path / dtype
        r = subprocess.run(
            [sys.executable, "-m", "gspo_megatron.train", "--config", os.path.join(ROOT, "launch/configs/tiny_cpu.yaml"),
             "parallel.tp=1", "parallel.sequence_parallel=false", f"model.dtype={dtype}", "train.max_steps=1",
             "train.sft_warmup_steps=20", f"out_dir={out}", "logging.progress_bar=false", "logging.plot=false",
             "checkpoint.interval=0", "checkpoint.export_hf=false", "rollout.prompts_per_step=2",
             f"logging.tensorboard={'true' if dtype == 'float32' else 'false'}"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
        assert r.returncode == 0, explain(r.stderr)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        nll[dtype] = [x["nll"] for x in rows if x.get("phase") == "sft"]
        gspo = [x for x in rows if x.get("phase") == "gspo"]
        assert len(gspo) == 1 and all(map(lambda v: v == v, (gspo[0]["loss"], gspo[0]["grad_norm"])))
    # logging.tensorboard=true (the GPU presets' setting) writes event files with the same numbers
    # (before: no extra installed tensorboard and the run went on with metrics.jsonl only)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "float32" / "tb"))
    acc.Reload()
    rows = [json.loads(x) for x in (tmp_path / "float32" / "metrics.jsonl").read_text().splitlines()]
    (gspo,) = [x for x in rows if x.get("phase") == "gspo"]
    (loss,) = acc.Scalars("loss")
    assert loss.step == 1 and abs(loss.value - gspo["loss"]) <= 1e-6 * max(1.0, abs(gspo["loss"]))
    first, last = nll["float16"][0], nll["float16"][-1]
    # fp32 falls from 4.6 to ~1.8 in these 20 steps; unscaled fp16 stayed at 4.6
    assert last < 0.6 * first, nll
    assert abs(first - nll["float32"][0]) < 0.01  # same model, same batch at step 1
    assert last < nll["float32"][-1] + 0.6, nll  # a skipped step or two while the scale settles


START_SCALE = 2.0 ** 8


def _scalers_rank(rank, world, overflow_steps):
    """EP`world` fp16 (dense + expert optimizers, each with its DynamicGradScaler): SFT updates,
    with an inf put into one expert gradient on the last rank only at `overflow_steps`. Returns per
    update (applied, grad norm, every sub-optimizer's loss scale, the scale the loss was scaled by)."""
    import math

    import torch

    from gspo_megatron.config import OptimizerConfig, ParallelConfig
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import TrainSample, plan_minibatch
    from gspo_megatron.train.loop import _run_schedule
    from gspo_megatron.train.loss import sft_loss_step
    from gspo_megatron.train.optim import build_optimizer, guarded_step, inner_optimizers
    from gspo_megatron.train.scoring import pad_multiple
    from megatron_utils import random_sequences, tiny_hf_config
    from types import SimpleNamespace

    arch = MoeArch.from_hf_dict(tiny_hf_config(num_hidden_layers=2).to_dict(), source="test")
    ctx = init_parallel(ParallelConfig(ep=world, device="cpu"), model_dims=arch.dims_for_validation())
    try:
        chunks, tcfg = build_policy(ctx, arch, dtype=torch.float16)
        model = wrap_ddp(chunks, tcfg, use_distributed_optimizer=True)
        opt, _ = build_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.0, clip_grad=1.0), model, dtype=torch.float16)
        tcfg.grad_scale_func = opt.scale_loss  # as train/setup.py does for float16
        subs = inner_optimizers(opt)
        assert len(subs) == 2 and all(o.grad_scaler is not None for o in subs)  # dense + experts
        for o in subs:  # a start where this model's own gradients do not overflow (2^16 does, twice)
            o.grad_scaler._scale.fill_(START_SCALE)
        seqs = random_sequences(300, [9, 14, 6, 11], seed=5)
        samples = [TrainSample(s[:3], s[3:], 0.0) for s in seqs]
        mbs, _ = plan_minibatch(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=64,
                                multiple=pad_multiple(ctx.parallel), pad_id=0)
        parts = SimpleNamespace(model=model)
        expert = next(p for c in model for n, p in c.named_parameters() if "experts" in n)
        out = []
        for step in range(len(overflow_steps) + 2):
            for m in model:
                m.zero_grad_buffer()
            opt.zero_grad()
            used = float(opt.get_loss_scale())
            _run_schedule(parts, sft_loss_step(ctx, arch.vocab_size), mbs, forward_only=False)
            if step in overflow_steps and rank == world - 1:
                expert.main_grad.view(-1)[0] = math.inf
            ok, norm = guarded_step(opt)
            out.append((ok, norm, [float(o.get_loss_scale()) for o in subs], used))
        return out
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
def test_float16_loss_scalers_stay_in_lockstep_after_expert_only_overflows():
    """Issue 41 5d: Megatron's ChainedOptimizer scales the loss with the dense optimizer's scale but
    lets the expert optimizer's scaler back off alone. Two expert-only overflows (hysteresis 2) on
    one EP rank: every rank skips both updates (reported as non-finite, not as a grad norm of 0.0),
    both scalers on both ranks halve together, and the next updates are applied with the loss
    scaled by the scale every sub-optimizer unscales with. Before: the expert scale fell by half
    while the loss stayed scaled by the dense one."""
    import math

    from dist_utils import run_distributed

    got = run_distributed(_scalers_rank, 2, [0, 1], timeout=240)
    for rank, rows in enumerate(got):
        print(rank, rows)
        (ok0, n0, s0, _), (ok1, n1, s1, _) = rows[:2]
        assert not ok0 and not ok1 and math.isnan(n0) and math.isnan(n1), rows
        for ok, norm, scales, used in rows[2:]:
            assert ok and math.isfinite(norm) and norm > 0, rows
            assert scales == [used, used], rows  # one scale: the one the loss was multiplied by
        assert rows[-1][2] == [START_SCALE / 2] * 2, rows  # backed off once (hysteresis 2), together
    assert [r[2] for r in got[0]] == [r[2] for r in got[1]]  # the same on every rank
