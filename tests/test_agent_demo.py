"""The calculator-agent example learns on CPU: launch/configs/tiny_cpu_agent.yaml as shipped
(2 ranks, TP2+SP, 80 warm-start + 300 GSPO steps), held-out pass@1 after the warm start and at the
end."""
from __future__ import annotations

import json
import os

import pytest

from test_train_loop import DEMO_EVAL, REPO, gspo_rows, run_train

AGENT = os.path.join(REPO, "launch", "configs", "tiny_cpu_agent.yaml")

# What the run does differently from `make demo-agent`, none of it touching what is learned:
# held-out evaluation (its own prompts and sampling seed, never the training RNG) only at steps 0
# and 300 instead of every 25 (the bound is on those two), checkpoints only at the end, no plot. The
# 300 GSPO steps are ~75% of the run's time (0.3-0.65 s each); the 11 evaluations (256 agent
# sessions each) and 29 saves dropped were ~20 s.
OVERRIDES = [*(x for x in DEMO_EVAL if not x.startswith("eval.interval=")), "eval.interval=300",
             "checkpoint.interval=0", "logging.plot=false", "logging.progress_bar=false"]


@pytest.mark.timeout(1500)
def test_calculator_agent_learns_the_tool(tmp_path):
    with open(os.path.join(REPO, "Makefile")) as f:  # what `make demo-agent` runs
        assert "launch/configs/tiny_cpu_agent.yaml out_dir=runs/demo-agent $(DEMO_EVAL)" in f.read()
    out = tmp_path / "agent"
    run_train(out, *OVERRIDES, config=AGENT, timeout=1480)  # pooled ranks, the trainer's own main
    rows = gspo_rows(out)
    assert len(rows) == 300
    evals = [json.loads(x) for x in open(out / "metrics.jsonl") if '"eval"' in x]
    assert [e["step"] for e in evals] == [0, 300]
    p1 = [e["eval/heldout/pass@1"] for e in evals]
    print("held-out pass@1 at steps 0 and 300:", p1)
    # the warm start teaches the format; GSPO teaches the tool (call it with the question, copy
    # its answer): >= 0.5 at the end, from at most half of that. A frozen policy scores its step-0
    # value again (same held-out prompts, same evaluation seed): 0.06-0.12 here. Measured: seven
    # runs on two kernel sets, 0.06-0.12 after the warm start, 0.79-0.89 at step 300; with the
    # current engine batching (independent of thread timing: the same pass@1 under any load) and
    # AVX-512, 0.10 -> 0.78 -> 0.96 at steps 0/150/300 (six runs, load average 2-20), and with
    # data.seed=1 0.10 -> 0.72 -> 0.78. At step 150 older runs ended anywhere in 0.25-0.68, too
    # close to the bar to stop there. (Another train.seed can land past the warm start's sharp
    # edge: train.seed=1 gave 0.40 at step 0 -> 0.91, so the step-0 bound holds for this seed.)
    # Why not fewer steps (issue 51, 2026-12-06, Intel Xeon): 150 steps ended at 0.52 (data.seed=0)
    # and 0.56 (data.seed=1), on the bar; optimizer.lr=1e-3 collapsed (0.00 at step 50, seed 0;
    # 0.31 -> 0.06 -> 0.32 by step 200, seed 1). 300 steps at 5e-4 is the run that clears it.
    assert p1[-1] >= 0.5 and p1[0] <= p1[-1] / 2, p1
    # every session called the tool: two policy turns around it, no agent failed
    assert all(x["agent_errors"] == 0 and x["env_tokens"] > 0 for x in rows)
    assert sum(x["turns_mean"] for x in rows[-10:]) / 10 > 1.9
    # one update per batch with the engine's log-probs as π_old: the sequence ratio stays at 1
    # (fp32 rounding), nothing is clipped
    assert all(abs(x["ratio_mean"] - 1) < 1e-4 and x["clip_frac"] == 0 for x in rows)
