"""The calculator-agent example learns on CPU: launch/configs/tiny_cpu_agent.yaml as shipped
(2 processes, TP2+SP, ~2.2 minutes quiet), held-out pass@1 after the warm start and at the end."""
from __future__ import annotations

import json
import os

import pytest

from test_train_loop import DEMO_EVAL, REPO, _env, gspo_rows, torchrun_cmd
from run_output import explain

AGENT = os.path.join(REPO, "launch", "configs", "tiny_cpu_agent.yaml")


@pytest.mark.timeout(1500)
def test_calculator_agent_learns_the_tool(tmp_path):
    import subprocess

    with open(os.path.join(REPO, "Makefile")) as f:  # what `make demo-agent` runs
        assert "launch/configs/tiny_cpu_agent.yaml out_dir=runs/demo-agent $(DEMO_EVAL)" in f.read()
    out = tmp_path / "agent"
    r = subprocess.run(torchrun_cmd(2, "--config", AGENT, f"out_dir={out}", *DEMO_EVAL, "logging.progress_bar=false"),
                       capture_output=True, text=True, timeout=1480, env=_env(), cwd=REPO)
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert len(rows) == 300
    evals = [json.loads(x) for x in open(out / "metrics.jsonl") if '"eval"' in x]
    assert [e["step"] for e in evals] == list(range(0, 301, 25))
    p1 = [e["eval/heldout/pass@1"] for e in evals]
    print("held-out pass@1:", p1)
    # the warm start teaches the format; GSPO teaches the tool (call it with the question, copy
    # its answer): >= 0.5 at the end, from at most half of that (measured in seven runs on two
    # kernel sets: 0.06-0.12 after the warm start, 0.79-0.89 at step 300; at step 150 the same
    # runs were anywhere in 0.25-0.68, too close to the bar)
    assert p1[-1] >= 0.5 and p1[0] <= p1[-1] / 2, p1
    # every session called the tool: two policy turns around it, no agent failed
    assert all(x["agent_errors"] == 0 and x["env_tokens"] > 0 for x in rows)
    assert sum(x["turns_mean"] for x in rows[-10:]) / 10 > 1.9
    # one update per batch with the engine's log-probs as π_old: the sequence ratio stays at 1
    # (fp32 rounding), nothing is clipped
    assert all(abs(x["ratio_mean"] - 1) < 1e-4 and x["clip_frac"] == 0 for x in rows)
