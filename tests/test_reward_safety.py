"""A reward function can neither end, stall nor poison a run (issue 40, items 3 and 4).

Before: `SystemExit(0)` from a reward with reward.workers >= 1 came back out of the worker's future
and ended the trainer with exit status 0 in step 1 (no error, no metrics, no checkpoint); in
thread mode it killed the helper thread silently and the sample waited out reward.timeout_s; a
worker that ended (os._exit) broke the whole pool, failing every pending sample and every later
call; a reward of 1e39 (finite in float64, inf in float32) became inf in the trainer's float32
rewards and a NaN loss that was stepped and saved.
"""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from gspo_megatron.algorithms import group_advantages
from gspo_megatron.rollout.rewards import RewardError, RewardScorer

BASE_SPEC = ("spec", "reward_fns:raises_base")  # tests/ is on the path of pytest and of the spawned workers


def _score(workers, examples, *, timeout_s=5.0):
    """(rewards, raised, reason per sample) of one scorer call on responses "x"."""
    s = RewardScorer(BASE_SPEC, workers=workers, timeout_s=timeout_s, max_error_frac=1.0)
    try:
        rewards, raised = s(["x"] * len(examples), examples)
        return rewards, raised, list(s.last_errors)
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("kind", ["SystemExit", "KeyboardInterrupt", "GeneratorExit"])
def test_a_base_exception_from_the_reward_is_a_scored_error(workers, kind, caplog):
    """timeout_s=5 is only the bound of the old thread-mode behaviour (the helper thread died
    silently and the sample waited it out, reported as a timeout)."""
    caplog.set_level(logging.WARNING, logger="gspo_megatron.rollout.rewards")
    rewards, raised, errors = _score(workers, [{}, {"raise": kind}, {}, {"raise": kind}, {}])
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0] and raised == [False, True, False, True, False]
    assert errors[0] is None and errors[2] is None and errors[4] is None
    assert errors[1].startswith(kind) and "timed out" not in errors[1], errors
    assert f"failed on 2/5 samples (scored 0.0); first: {kind}" in caplog.text
    # over max_error_frac: one line naming the first failure, never the exception itself
    s = RewardScorer(BASE_SPEC, workers=workers, timeout_s=5.0, max_error_frac=0.5)
    try:
        with pytest.raises(RewardError) as e:
            s(["x"] * 2, [{"raise": kind}, {"raise": kind}])
        assert "\n" not in str(e.value) and "failed on 2 of 2 samples" in str(e.value)
        assert f"first: {kind}" in str(e.value)
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_worker_process_that_ends_is_detected_and_only_its_call_fails():
    """os._exit(0) in a worker: that call is an error at once (timeout_s is an hour), the other
    calls of the batch are scored, and the next batch gets a new worker."""
    s = RewardScorer(BASE_SPEC, workers=2, timeout_s=3600.0, max_error_frac=0.5)
    try:
        exs = [{}, {"raise": "os_exit"}, {}, {}, {"value": 0.5}]
        rewards, raised = s(["x"] * 5, exs)
        assert rewards == [1.0, 0.0, 1.0, 1.0, 0.5] and raised == [False, True, False, False, False]
        assert "exited" in s.last_errors[1] and "status 0" in s.last_errors[1], s.last_errors
        assert s(["x"] * 3, [{}, {}, {}]) == ([1.0] * 3, [False] * 3)
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,why", [("close_then_exit", "exited with status 0"),
                                      ("close_then_hang", "stopped answering (its pipe broke)")])
def test_a_worker_whose_pipe_breaks_is_reported_by_how_it_ended(kind, why):
    """The trainer sees a worker's pipe break before the process is gone (an ending process
    closes its files first): the reason must still say how it ended, not that it stopped answering
    (by construction: the reward closes its files and ends 0.5 s later). A process that lives on
    with its pipe closed is said to have stopped answering, and is stopped: the call does not
    wait for it (reward.timeout_s is an hour; the process would sleep 10 minutes)."""
    rewards, raised, errors = _score(1, [{}, {"raise": kind}, {}], timeout_s=3600.0)
    assert rewards == [1.0, 0.0, 1.0] and raised == [False, True, False], errors
    assert errors[1] == f"the reward worker process {why} during the call", errors


def test_a_reward_module_that_exits_at_import_is_a_spec_error(tmp_path, monkeypatch):
    """Before: `except Exception` around the import let SystemExit(0) through: the trainer ended
    with status 0 while resolving reward.fn."""
    from gspo_megatron.rollout.rewards import RewardSpecError, load_reward_fn

    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardSpecError, match=r"cannot import module 'exits_at_import': SystemExit: 0$"):
        load_reward_fn("exits_at_import:fn")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body", ["import os\nos._exit(0)\n", "raise SystemExit(3)\n"])
def test_workers_that_cannot_start_fail_the_batch_in_one_line(tmp_path, monkeypatch, body):
    """The function given to the scorer works in the trainer, but its recipe ends or fails in
    every worker: the batch fails once with the reason (no endless respawning, no hang)."""
    (tmp_path / "worker_only.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get the parent's sys.path
    s = RewardScorer(("spec", "worker_only:fn"), fn=lambda r, e: 1.0, workers=2, timeout_s=3600.0,
                     max_error_frac=0.5)
    try:
        with pytest.raises(RewardError) as e:
            s(["x"] * 3, [{}, {}, {}])
        msg = str(e.value)
        assert "\n" not in msg and "failed on 3 of 3 samples" in msg
        assert ("a reward worker process exited with status 0 while starting" in msg if "_exit" in body else
                "a reward worker could not build the reward function: RewardSpecError" in msg), msg
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 1])
def test_rewards_outside_float32_are_scored_errors(workers):
    values = [1e39, -1e39, float("nan"), float("inf"), 3.0e38, -3.0e38, True, 0.25]
    rewards, raised, errors = _score(workers, [{"value": v} for v in values])
    assert raised == [True, True, True, True, False, False, False, False], errors
    assert rewards == [0.0, 0.0, 0.0, 0.0, 3.0e38, -3.0e38, 1.0, 0.25]
    assert "1e+39 is outside the float32 range" in errors[0] and "not finite: nan" in errors[2], errors
    # what the trainer does with them next (train/loop.py to_train_samples): float32, finite
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), 4)
    assert torch.isfinite(adv).all(), adv


def test_rewards_that_are_not_numbers_name_their_type():
    s = RewardScorer(BASE_SPEC, workers=0, timeout_s=5.0, max_error_frac=1.0)
    try:
        values = [None, "1.0", b"1", 1 + 2j, [1.0], torch.tensor([1.0, 2.0]), torch.tensor(0.5)]
        rewards, raised = s(["x"] * len(values), [{"value": v} for v in values])
        assert raised == [True] * 6 + [False] and rewards[-1] == 0.5
        for err, name in zip(s.last_errors, ["NoneType", "str", "bytes", "complex", "list", "Tensor"]):
            assert err.startswith("TypeError: reward must be a number") and name in err, s.last_errors
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_a_hung_call_in_thread_mode_fails_only_its_own_sample():
    """Two hung calls among five: each is abandoned at its timeout, every other sample is scored,
    and a SystemExit after a hung call is named as such (not a timeout)."""
    s = RewardScorer(("spec", "reward_fns:sleepy"), workers=0, timeout_s=1.0, max_error_frac=1.0)
    try:
        hang = {"sleep": 3600}
        rewards, raised = s(["x"] * 5, [{}, hang, {}, hang, {}])
        assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0] and raised == [False, True, False, True, False]
        assert [e and e.split(" after")[0] for e in s.last_errors] == [None, "timed out", None, "timed out", None]
    finally:
        s.close()
    s = RewardScorer(BASE_SPEC, workers=0, timeout_s=1.0, max_error_frac=1.0,
                     fn=lambda r, e: __import__("time").sleep(3600) if e.get("hang") else
                     __import__("reward_fns").raises_base(r, e))
    try:
        rewards, raised = s(["x"] * 3, [{"hang": True}, {"raise": "SystemExit"}, {}])
        assert rewards == [0.0, 0.0, 1.0] and s.last_errors[0].startswith("timed out")
        assert s.last_errors[1].startswith("SystemExit"), s.last_errors
    finally:
        s.close()


def test_group_advantages_never_overflow():
    """Computed in float64 on each group's values scaled by its largest magnitude: rewards at the
    float32 limit (whose sum or square overflows float32) and float64 rewards near 1e300 (whose
    square overflows float64) give the advantages of the same rewards scaled down."""
    r32 = torch.tensor([3e38, 3e38, -3e38, 0.0, 1.0, 2.0, 3.0, 4.0], dtype=torch.float32)
    adv = group_advantages(r32, 4)
    assert adv.dtype == torch.float32 and torch.isfinite(adv).all(), adv
    small = group_advantages(torch.tensor([3.0, 3.0, -3.0, 0.0, 1.0, 2.0, 3.0, 4.0]), 4)
    assert torch.allclose(adv, small, atol=1e-5), (adv, small)
    r64 = torch.tensor([1e300, -1e300, 1e300, 0.0], dtype=torch.float64)
    adv64 = group_advantages(r64, 4)
    ref = group_advantages(torch.tensor([1.0, -1.0, 1.0, 0.0], dtype=torch.float64), 4)
    assert adv64.dtype == torch.float64 and torch.allclose(adv64, ref, atol=1e-6), (adv64, ref)
    with pytest.raises(ValueError, match=r"rewards\[5\] is not finite \(inf\)"):
        group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, math.inf, 0.0, 1.0]), 4)


# ------------------------------------------------------------------------------------------
# The trainer, end to end (one process, the tiny config of tests/test_reliability.py)

# Four failures in every eight calls: exactly reward.max_error_frac=0.5 of each step's 8 samples
# (2 prompts x 4), which is allowed ("more than" stops), so the run must finish both steps.
HALF_BAD = {0: "exit,ok,genexit,ok,kbd,ok,huge,ok", 1: "exit,ok,os_exit,ok,kbd,ok,huge,ok"}


def _hostile_train(tmp_path, monkeypatch, workers, script, ok):
    """A 2-step run (test_reliability's tiny one-process config) with the `scripted` reward;
    returns its out_dir, the finished process and how many reward calls were made."""
    from test_reliability import train

    out, counter = tmp_path / f"run{workers}", tmp_path / f"calls{workers}"
    monkeypatch.setenv("SCRIPTED_REWARD", script)  # the trainer and its reward workers inherit these
    monkeypatch.setenv("SCRIPTED_REWARD_COUNTER", str(counter))
    r = train(out, "train.max_steps=2", "checkpoint.export_hf=true", "reward.fn=tests.reward_fns:scripted",
              f"reward.workers={workers}", "reward.timeout_s=120", "reward.max_error_frac=0.5", ok=ok)
    return out, r, int(counter.read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("workers", [0, 1])
def test_a_hostile_reward_is_counted_and_the_run_finishes(tmp_path, monkeypatch, workers):
    """SystemExit(0), KeyboardInterrupt, GeneratorExit / a worker's os._exit(0) and a 1e39 reward
    in every step: each is one failed sample; the run trains both steps on finite numbers and
    saves finite weights. (reward.timeout_s=120: the old thread mode waited it out per sample.)"""
    out, r, calls = _hostile_train(tmp_path, monkeypatch, workers, HALF_BAD[workers], ok=True)
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(x) for x in f if '"gspo"' in x]
    assert [row["step"] for row in rows] == [1, 2], r.stderr[-3000:]
    assert [row["reward_raised"] for row in rows] == [4, 4], rows
    assert calls == 16  # each sample scored once: nothing re-run after a worker ended
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]), row
    assert "failed on 4/8 samples (scored 0.0); first: SystemExit" in r.stderr
    from test_train_loop import _hf_tensors

    weights = _hf_tensors(out / "hf")
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    from megatron_utils import dcp_tensors  # every tensor of the saved checkpoint: weights, masters, moments

    saved = dcp_tensors(str(out / "checkpoints" / "iter_0000002"))
    assert saved and all(torch.isfinite(t).all() for t in saved.values() if t.is_floating_point())


@pytest.mark.timeout(600)
def test_a_reward_that_always_exits_stops_the_run_in_one_line(tmp_path, monkeypatch):
    """Never exit status 0 with fewer steps than asked: every call raises SystemExit(0) in the
    worker, so the step is over reward.max_error_frac and the run stops with one line."""
    from test_reliability import one_line_error

    out, r, calls = _hostile_train(tmp_path, monkeypatch, 1, "exit", ok=False)
    line = one_line_error(r)
    assert "failed on 8 of 8 samples, more than reward.max_error_frac=0.5; first: SystemExit: 0" in line, line
    assert r.returncode == 2 and calls == 8
    assert not (out / "checkpoints" / "iter_0000001").exists()  # the failed step is not saved
