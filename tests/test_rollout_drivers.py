"""Rollout drivers (rollout/drivers.py, docs/rollout_drivers.md): one step's rollout is a function
named by rollout.driver. The documented example trains and its stats reach the metrics row; what a
driver returns is checked (one line naming it); a driver path that does not import is refused
before any process group. The built-in drivers run in every other training test (single-turn and
agent: tests/test_train_loop.py, tests/test_agent_rollout.py, the configuration sweep), and a user
driver is a level of the sweep (tests/test_config_sweep.py)."""
from __future__ import annotations

import os
import re

import pytest

from run_output import explain
from testlib import REPO, train_pooled
from test_train_loop import gspo_rows

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")


def test_the_documented_driver_is_the_tested_one():
    """docs/rollout_drivers.md's example is tests/rollout_drivers.py's length_penalized, verbatim."""
    doc = open(os.path.join(REPO, "docs", "rollout_drivers.md")).read()
    block = re.search(r"```python\n(.*?)```", doc, re.S).group(1)
    src = open(os.path.join(REPO, "tests", "rollout_drivers.py")).read()
    example = src.split("# --- docs/rollout_drivers.md example: begin\n")[1].split(
        "# --- docs/rollout_drivers.md example: end")[0]
    assert block == example


@pytest.mark.timeout(300)
def test_a_users_driver_trains_and_its_stats_reach_the_metrics(tmp_path):
    out = tmp_path / "run"
    r = train_pooled(1, "--config", TINY, f"out_dir={out}", "parallel.tp=1", "parallel.sequence_parallel=false",
                     "rollout.driver=tests.rollout_drivers:length_penalized", "train.sft_warmup_steps=0",
                     "train.max_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                     "train.minibatches_per_step=1", "rollout.max_new_tokens=8", "checkpoint.interval=0",
                     "checkpoint.export_hf=false", "eval.interval=0", "logging.progress_bar=false",
                     "logging.plot=false", "reward.fn=tests.reward_fns:text_hash", timeout=240)
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == [1, 2]
    for x in rows:  # the penalty of responses of 1..8 tokens, and the reward it lowered
        assert 0.01 <= x["length_penalty_mean"] <= 0.08, x
        assert abs(x["length_penalty_mean"] - 0.01 * x["response_len_mean"]) < 1e-9, x
    assert any(x["grad_norm"] > 0 for x in rows)


def test_what_a_driver_returns_is_checked_in_one_line():
    from gspo_megatron.rollout.base import Sample
    from gspo_megatron.rollout.drivers import RolloutBatch, check_batch

    def s(prompt):
        return Sample(prompt_index=0, prompt_ids=list(prompt), response_ids=[5], response_logprobs=[-0.1],
                      finish_reason="stop", weight_version=0)

    good = RolloutBatch([s([1]), s([1]), s([2]), s([2])], [0.0, 1.0, 0.5, 0.5], {"x": 1.0})
    assert check_batch(good, "m:f", 2) is good
    for bad, needle in [
        ((good.samples, good.rewards), "not a RolloutBatch"),
        (RolloutBatch(good.samples[:3], good.rewards[:3]), "not whole groups"),
        (RolloutBatch(good.samples, good.rewards[:3]), "3 rewards for 4 samples"),
        (RolloutBatch(good.samples, [0.0, float("nan"), 0.0, 0.0]), "reward 1 is nan"),
        (RolloutBatch(good.samples, [0.0, True, 0.0, 0.0]), "reward 1 is True"),
        (RolloutBatch([s([1]), s([2]), s([2]), s([2])], good.rewards), "sample 1 has another prompt"),
        (RolloutBatch(good.samples[:2] + ["x", "y"], good.rewards), "sample 2 is a str"),
        (RolloutBatch(good.samples, good.rewards, stats=[1]), "stats of type list"),
    ]:
        with pytest.raises(ValueError) as e:
            check_batch(bad, "m:f", 2)
        assert str(e.value).startswith("rollout.driver m:f") and needle in str(e.value) and "\n" not in str(e.value)


def _broken_driver_rank(r, w, out):
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train import loop

    cfg = load_config(TINY, [f"out_dir={out}", "parallel.tp=1", "parallel.sequence_parallel=false",
                             "rollout.driver=tests.rollout_drivers:one_sample_short", "train.sft_warmup_steps=0",
                             "train.max_steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
                             "rollout.max_new_tokens=4", "checkpoint.export_hf=false", "eval.interval=0",
                             "logging.progress_bar=false", "logging.plot=false"])
    try:
        loop.train(cfg, world_size=w)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(300)
def test_a_driver_that_breaks_the_contract_stops_the_run_naming_it(tmp_path):
    from dist_utils import run_distributed

    msg = run_distributed(_broken_driver_rank, 1, str(tmp_path / "run"), timeout=240)[0]
    assert msg == ("rollout.driver tests.rollout_drivers:one_sample_short returned 3 samples, not whole groups "
                   "of rollout.samples_per_prompt=2"), msg


def test_a_driver_path_is_resolved_before_anything_runs(tmp_path):
    from gspo_megatron.config import ConfigError
    from gspo_megatron.errors import InputError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train.setup import check_inputs

    with pytest.raises(ConfigError, match="rollout.driver must look like 'package.module:function'"):
        load_config(TINY, ["rollout.driver=nocolon"])
    cfg = load_config(TINY, [f"out_dir={tmp_path}", "rollout.driver=tests.rollout_drivers:nope"])
    with pytest.raises(InputError) as e:
        check_inputs(cfg, world_size=2)
    assert "rollout.driver" in str(e.value) and "nope" in str(e.value) and "\n" not in str(e.value)
    assert load_config(TINY, []).rollout.driver_spec == "gspo_megatron.rollout.drivers:single_turn"
    assert load_config(TINY, ["rollout.agent=tests.agent_fns:two_turn"]).rollout.driver_spec == \
        "gspo_megatron.rollout.drivers:agent"


def test_every_preset_runs_the_built_in_driver_by_default():
    """rollout.driver's default (null) from every preset in launch/configs: the built-in single-turn
    driver, or the agent one where the preset sets rollout.agent; each resolves to its function."""
    import glob

    from gspo_megatron import config as C
    from gspo_megatron.rollout.drivers import agent, load_driver, single_turn

    presets = sorted(glob.glob(os.path.join(REPO, "launch", "configs", "*.yaml")))
    assert len(presets) >= 12
    for p in presets:
        cfg = C.load_config(p, [])  # the schema's load: GPU presets name checkpoints not present here
        assert cfg.rollout.driver is None, p
        assert load_driver(cfg.rollout.driver_spec) is (agent if cfg.rollout.agent else single_turn), p
