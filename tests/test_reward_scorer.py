"""The trainer's reward scoring (rollout/rewards.py RewardScorer): every call bounded by
reward.timeout_s, parallel worker processes, and a failure threshold that stops the run in one line.
Before: a hung reward blocked the run until gloo's 30-minute timeout, a reward that always raised
let the run go on with loss 0 forever, and scoring was serial on rank 0."""
from __future__ import annotations

import os

import pytest

from gspo_megatron.rollout.rewards import RewardError, RewardScorer
from run_output import explain

SPEC = ("spec", "reward_fns:sleepy")  # tests/ is on the path of pytest and of the spawned workers


@pytest.mark.timeout(60)
def test_a_hung_call_is_scored_zero_after_its_timeout_inline():
    s = RewardScorer(SPEC, workers=0, timeout_s=0.5, max_error_frac=0.5)
    try:
        rewards, raised = s(["a", "b", "c"], [{"sleep": 0}, {"sleep": 3600}, {"sleep": 0}])
        assert rewards == [1.0, 0.0, 1.0] and raised == [False, True, False]
        assert s(["d"], [{"sleep": 0}]) == ([1.0], [False])  # a fresh thread after the abandoned one
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_hung_inline_call_does_not_hold_the_process_at_exit():
    """The abandoned call sleeps for an hour: the process must still exit when its work is done
    (a ThreadPoolExecutor's worker was joined at interpreter shutdown: the run hung there)."""
    import subprocess
    import sys

    code = ("from gspo_megatron.rollout.rewards import RewardScorer\n"
            "s = RewardScorer(('spec', 'reward_fns:sleepy'), workers=0, timeout_s=0.5)\n"
            "print(s(['a', 'b'], [{'sleep': 3600}, {'sleep': 0}]))\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, explain(out.stderr)
    assert out.stdout.strip() == "([0.0, 1.0], [True, False])"


@pytest.mark.timeout(240)
def test_worker_processes_score_in_parallel_and_a_hung_worker_is_replaced(tmp_path):
    """Parallel by construction: every call returns only once calls in 2 processes have run
    (reward_fns.rendezvous; a scorer that ran them one at a time fails each after 60 s)."""
    s = RewardScorer(("spec", "reward_fns:rendezvous"), workers=2, timeout_s=90.0, max_error_frac=0.5)
    try:
        exs = [{"dir": str(tmp_path), "peers": 2, "within": 60} for _ in range(6)]
        rewards, raised = s(["x"] * 6, exs)
        assert rewards == [1.0] * 6 and not any(raised), s.last_errors
        pids = {f.split(".")[0] for f in os.listdir(tmp_path)}
        assert len(pids) == 2 and str(os.getpid()) not in pids  # two workers, not rank 0 itself
        s.close()
        s = RewardScorer(SPEC, workers=2, timeout_s=1.0, max_error_frac=0.5)
        rewards, raised = s(["x"] * 3, [{"sleep": 0}, {"sleep": 3600}, {"sleep": 0}])
        assert rewards == [1.0, 0.0, 1.0] and raised == [False, True, False]
        assert s(["x"], [{"sleep": 0}]) == ([1.0], [False])  # the pool that held the hung call was replaced
    finally:
        s.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_too_many_failures_stop_with_one_line(workers):
    s = RewardScorer(("spec", "reward_fns:always_raises"), workers=workers, timeout_s=30.0, max_error_frac=0.5)
    try:
        with pytest.raises(RewardError) as e:
            s(["a", "b"], [{}, {}])
        msg = str(e.value)
        assert "\n" not in msg and "always_raises failed on 2 of 2 samples" in msg and "KeyError: 'solution'" in msg
    finally:
        s.close()
    # a string is not a reward; below the threshold the step goes on
    s = RewardScorer(("spec", "reward_fns:sleepy"), fn=lambda r, e: "1.0" if r == "s" else 0.5, max_error_frac=0.5)
    try:
        assert s(["s", "n", "n"], [{}, {}, {}]) == ([0.0, 0.5, 0.5], [True, False, False])
        with pytest.raises(RewardError, match="TypeError: reward must be a number"):
            s(["s", "s", "n"], [{}, {}, {}])
    finally:
        s.close()
