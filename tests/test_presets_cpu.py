"""The Qwen3-30B-A3B preset scaled down to CPU size runs real GSPO steps (EP2, 2 processes)."""
from __future__ import annotations

import json
import math
import os

import pytest

from testlib import REPO, train_pooled
from run_output import explain

SCALED = os.path.join(REPO, "launch", "configs", "qwen3_30b_a3b_cpu_scaled.yaml")


def _run(out, *overrides):
    # A length reward gives a random-init policy non-zero advantages, so every step has a real
    # policy gradient (the preset's own task reward is 0 everywhere before any training).
    r = train_pooled(2, "--config", SCALED, f"out_dir={out}", "reward.fn=tests.reward_fns:response_length",
                     *overrides, timeout=280)
    assert r.returncode == 0, explain(r.stderr)
    return r, [json.loads(line) for line in open(out / "metrics.jsonl") if '"gspo"' in line]


@pytest.mark.timeout(600)
def test_scaled_30b_preset_trains_on_cpu(tmp_path):
    r, rows = _run(tmp_path / "scaled")
    assert "loss gspo (eps 0.0003/0.0004)" in r.stderr  # the preset's clip range, as the run reads it
    assert [x["step"] for x in rows] == [1, 2, 3]
    for x in rows:
        assert x["reward_std"] > 0
        assert x["grad_norm"] > 0 and math.isfinite(x["loss"])
        # GSPO's tiny clip range (3e-4 / 4e-4) is active once the policy has moved: after the first
        # of the step's 4 minibatches some sequences' ratios leave [1 - 3e-4, 1 + 4e-4]. The first
        # minibatch is on-policy (old log-probs recomputed from the same weights: ratio 1), so at
        # most the other 3/4 of the sequences can be clipped.
        assert 0.0 < x["clip_frac"] <= 0.75, x["clip_frac"]
    # The same run with a clip range no ratio reaches: the same first rollout (same seeds), no
    # clipping at all, a different first loss: the preset's eps is what the loss clipped with.
    _, wide = _run(tmp_path / "wide", "loss.eps_low=0.99", "loss.eps_high=99")
    assert [x["step"] for x in wide] == [1, 2, 3]
    assert wide[0]["reward_mean"] == rows[0]["reward_mean"]
    assert all(x["clip_frac"] == 0.0 for x in wide), [x["clip_frac"] for x in wide]
    assert wide[0]["loss"] != pytest.approx(rows[0]["loss"], rel=1e-3)


@pytest.mark.timeout(600)
def test_routing_agreement_and_rollout_replay_on_the_scaled_30b_preset(tmp_path):
    """Issue 14 on the scaled 30B-A3B preset (EP2, 32 experts, top-2): with bf16 weights on both
    sides the engine (transformers) and the trainer (Megatron) route some token x layers
    differently (routing_agreement < 1, measured every step by the π_old pass); with
    train.routing_replay=rollout the trainer uses the engine's experts (agreement exactly 1) and,
    in fp32 with the same weights, its log-probs equal the engine's within 1e-5."""
    _, plain = _run(tmp_path / "bf16", "model.dtype=bfloat16", "rollout.return_routing=true", "train.max_steps=2")
    assert [x["step"] for x in plain] == [1, 2]
    for x in plain:
        assert 0.5 < x["routing_agreement"] < 1.0, x["routing_agreement"]
        assert x["mismatch_logprob_abs"] > 1e-4
    _, replayed = _run(tmp_path / "r3", "train.routing_replay=rollout", "train.max_steps=2")
    assert [x["step"] for x in replayed] == [1, 2]
    for x in replayed:
        assert x["routing_agreement"] == 1.0
        assert x["mismatch_logprob_abs"] < 1e-5 and x["mismatch_logprob_max"] < 1e-4, x
