"""Rollout drivers the tests load through `rollout.driver=tests.rollout_drivers:NAME`.
`length_penalized` is the example of docs/rollout_drivers.md, verbatim (a test compares them)."""
from __future__ import annotations

# --- docs/rollout_drivers.md example: begin
from gspo_megatron.rollout.drivers import RolloutBatch, RolloutContext, single_turn

PENALTY_PER_TOKEN = 0.01


def length_penalized(ctx: RolloutContext, step: int) -> RolloutBatch:
    """The built-in single-turn rollout, each reward less 0.01 per response token, and the mean
    penalty logged as `length_penalty_mean` in the step's metrics row."""
    batch = single_turn(ctx, step)  # prompts from the run's stream, the run's reward, dynamic sampling
    penalties = [PENALTY_PER_TOKEN * len(s.response_ids) for s in batch.samples]
    rewards = [r - p for r, p in zip(batch.rewards, penalties)]
    stats = dict(batch.stats, length_penalty_mean=sum(penalties) / max(len(penalties), 1))
    return RolloutBatch(batch.samples, rewards, stats)
# --- docs/rollout_drivers.md example: end


def one_sample_short(ctx: RolloutContext, step: int) -> RolloutBatch:
    """A broken driver: the last group lacks a sample."""
    batch = single_turn(ctx, step)
    return RolloutBatch(batch.samples[:-1], batch.rewards[:-1], batch.stats)


def scores_recorded(ctx: RolloutContext, step: int) -> RolloutBatch:
    """The built-in single-turn rollout, every text the reward scored and its reward appended to
    the JSON-lines file $GSPO_TEST_SCORES (tests/test_reward_model.py compares them with a
    reference)."""
    import dataclasses
    import json
    import os

    def score(texts, examples):
        rewards, raised = ctx.score(texts, examples)
        with open(os.environ["GSPO_TEST_SCORES"], "a") as f:
            for t, e, r, bad in zip(texts, examples, rewards, raised):
                f.write(json.dumps({"step": step, "text": t, "example": e, "reward": r, "raised": bool(bad)}) + "\n")
        return rewards, raised

    score.take_metrics = ctx.score.take_metrics  # the per-source counts (model_errors, reward_model_mean)
    return single_turn(dataclasses.replace(ctx, score=score), step)
