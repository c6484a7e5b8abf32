"""Held-out evaluation (train/evaluation.py, algorithms/passk.py): pass@k equals the unbiased
estimator computed in float64 from binomials, and a run with evaluation on trains bit-identically
to one with it off, while reporting pass@k at step 0, every interval and the end."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from gspo_megatron.algorithms.passk import ks_for, mean_pass_at_k, pass_at_k


def _reference(n, c, k):
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # Chen et al. 2021, eq. 1 (comb(m, k) = 0 for m < k)


@pytest.mark.parametrize("n,c,k", [(4, 4, 4), (4, 0, 4), (4, 0, 1), (4, 4, 1), (4, 1, 4), (4, 1, 1), (5, 2, 2),
                                   (10, 3, 5), (16, 1, 8), (200, 7, 100), (1, 1, 1), (1, 0, 1)])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_reference(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edges_and_means():
    assert pass_at_k(4, 4, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0  # n = k: any correct / none
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the accuracy
    assert mean_pass_at_k([[True, False], [False, False], [True, True]], 1) == pytest.approx((0.5 + 0 + 1) / 3)
    assert mean_pass_at_k([[True, False], [False, False], [True, True]], 2) == pytest.approx((1 + 0 + 1) / 3)
    assert ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]
    for bad in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


@pytest.mark.timeout(600)
def test_eval_does_not_change_training_and_reports_pass_at_k(tmp_path):
    from safetensors.torch import load_file

    from test_train_loop import run_train

    common = ["train.max_steps=4", "train.sft_warmup_steps=6", "rollout.prompts_per_step=4",
              "rollout.samples_per_prompt=4", "checkpoint.interval=0", "logging.progress_bar=false",
              "logging.plot=false"]
    run_train(tmp_path / "off", *common)
    run_train(tmp_path / "on", *common, "eval.interval=2", "eval.num_prompts=8", "eval.samples_per_prompt=4")

    def rows(d, phase):
        return [json.loads(x) for x in open(d / "metrics.jsonl") if f'"{phase}"' in x]

    def weights(d):
        out = {}
        for f in sorted(os.listdir(d / "hf")):
            if f.endswith(".safetensors"):
                out.update(load_file(str(d / "hf" / f)))
        return out

    off, on = rows(tmp_path / "off", "gspo"), rows(tmp_path / "on", "gspo")
    assert [r["reward_mean"] for r in on] == [r["reward_mean"] for r in off]  # the same rollouts ...
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    w_off, w_on = weights(tmp_path / "off"), weights(tmp_path / "on")
    assert set(w_on) == set(w_off) and all(torch.equal(w_on[k], w_off[k]) for k in w_off)  # ... the same weights
    evals = rows(tmp_path / "on", "eval")
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert not rows(tmp_path / "off", "eval")
    for r in evals:
        p = [r[f"eval/heldout/pass@{k}"] for k in (1, 2, 4)]
        assert all(0.0 <= x <= 1.0 for x in p) and p[0] <= p[1] <= p[2]  # pass@k grows with k
        assert 0 < r["eval/heldout/response_len_mean"] <= 8 and 0 <= r["eval/heldout/truncated_frac"] <= 1
    assert len({r["eval/heldout/reward_mean"] for r in evals}) > 1  # it evaluates the current weights
