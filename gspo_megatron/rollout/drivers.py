"""Rollout drivers: one step's rollout as a function, chosen by config path (slime's shape).

A driver is ``fn(ctx: RolloutContext, step: int) -> RolloutBatch``, named in the config as
``rollout.driver: "package.module:function"`` and called on rank 0 once per training step (from the
step itself, or from the async producer's thread ahead of it). It gets the run's rollout pieces
(engine, prompt stream, reward, tokenizer, agent, sampling settings) and returns the step's
samples: ``rollout.prompts_per_step`` groups of ``rollout.samples_per_prompt`` samples each, in
group order, with one reward per sample and a dict of numbers to log. The trainer checks what comes
back (`check_batch`: one line naming the driver) and turns it into advantages and minibatches.

The built-in drivers:

* `single_turn` (the default): one engine request per prompt group, rewards from `ctx.score`;
* `agent` (the default when ``rollout.agent`` is set): every sample a multi-turn session of the
  agent function (rollout/agent.py), its environment tokens masked out of the loss.

Both draw prompts from the run's stream (resumable: `ctx.prompts.batch(step, round, n)`), drop a
group the engine boundary rejected a response of, and with ``rollout.dynamic_sampling`` draw more
groups until ``prompts_per_step`` groups have a reward spread (`collect_groups`). A driver of your
own can call them (`single_turn(ctx, step)` and then change what it returns) or `collect_groups`
with its own round (docs/rollout_drivers.md has an example).

Where this departs from slime: asynchronous and partial rollouts are not drivers here but how a
driver's calls are scheduled (``rollout.async_steps``, ``rollout.partial``): any driver, a user's
included, runs ahead of training with staleness bounded, and with partial rollouts
`ctx.generate` is the interruptible generator (rollout/partial.py), so a driver that generates
through `ctx.generate` needs no code of its own for either.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gspo_megatron.rollout.base import Sample, SamplingParams
from gspo_megatron.rollout.validate import check_rejected_frac, rejected_reason

BUILTIN_SINGLE_TURN = f"{__name__}:single_turn"  # what rollout.driver=null means (config.py driver_spec)
BUILTIN_AGENT = f"{__name__}:agent"


def sampling_params(rollout_cfg, stop_ids, *, temperature: float | None = None,
                    max_new_tokens: int | None = None) -> SamplingParams:
    """The engine sampling settings of a run's rollouts (rollout.temperature / top_p / top_k /
    max_new_tokens and the tokenizer's stop ids); the held-out evaluation and the smoke check
    change the temperature or the length only."""
    return SamplingParams(temperature=rollout_cfg.temperature if temperature is None else temperature,
                          top_p=rollout_cfg.top_p, top_k=rollout_cfg.top_k,
                          max_new_tokens=rollout_cfg.max_new_tokens if max_new_tokens is None else max_new_tokens,
                          stop_token_ids=tuple(stop_ids))


@dataclass
class RolloutContext:
    """What a driver works with (rank 0)."""

    cfg: Any  # the run's RolloutConfig (rollout.*)
    engine: Any  # rollout/base.py RolloutEngine: weight_version, metrics of the engines that count them
    generate: Callable[..., list[Sample]]  # engine.generate, or partial rollouts' interruptible one
    prompts: Any  # train/setup.py PromptSource: batch(step, round, n), encode(example), text(example)
    score: Callable  # (texts, examples) -> (rewards, flags): the run's reward (reward.fn, judge, task)
    tokenizer: Any
    sampling: SamplingParams
    seed: int  # train.seed: a driver's per-step seeds derive from it (a resumed run draws the same)
    agent: Any = None  # rollout/agent.py AgentRunner when rollout.agent is set
    log_prompts: bool = False  # logging.prompts: the driver puts the step's prompt texts in stats["prompts"]

    def request_seed(self, step: int, round_: int) -> int:
        return self.seed * 100003 + step * 101 + round_


@dataclass
class RolloutBatch:
    """One step's rollout: samples in groups of samples_per_prompt, one reward each, and numbers
    to log (merged into the step's metrics row)."""

    samples: list[Sample]
    rewards: list[float]
    stats: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------ built-in drivers
def single_turn(ctx: RolloutContext, step: int) -> RolloutBatch:
    """One engine request per prompt group (n = samples_per_prompt), scored by ctx.score."""
    return collect_groups(ctx, step, single_turn_round)


def agent(ctx: RolloutContext, step: int) -> RolloutBatch:
    """Every sample a multi-turn session of the run's agent (rollout.agent)."""
    if ctx.agent is None:
        raise ValueError(f"rollout.driver={BUILTIN_AGENT} needs rollout.agent (the session function)")
    return collect_groups(ctx, step, agent_round)


def single_turn_round(ctx: RolloutContext, examples: list[dict], prompt_ids: list[list[int]], seed: int):
    """(samples, rewards, reward-raised flags, stats) of one round: the engine's G samples per
    prompt, then the reward of every response the engine boundary did not reject."""
    G = ctx.cfg.samples_per_prompt
    samples = ctx.generate(prompt_ids, G, ctx.sampling, seed=seed)
    bad = {s.prompt_index for s in samples if rejected_reason(s)}
    ok = [i for i, s in enumerate(samples) if s.prompt_index not in bad]
    texts = [ctx.tokenizer.decode(samples[i].response_ids, skip_special_tokens=False) for i in ok]
    got, got_flags = ctx.score(texts, [examples[samples[i].prompt_index] for i in ok]) if ok else ([], [])
    rewards, flags = [0.0] * len(samples), [False] * len(samples)
    for j, i in enumerate(ok):
        rewards[i], flags[i] = got[j], got_flags[j]
    return samples, rewards, flags, {}


def agent_round(ctx: RolloutContext, examples: list[dict], prompt_ids: list[list[int]], seed: int):
    """One round of agent sessions (rollout/agent.py run_and_score)."""
    from gspo_megatron.rollout.agent import run_and_score

    samples, rewards, flags, st = run_and_score(ctx.agent, ctx.generate, examples, prompt_ids,
                                                ctx.cfg.samples_per_prompt, ctx.sampling, ctx.score, seed=seed,
                                                version=ctx.engine.weight_version)
    return samples, rewards, flags, {"agent_errors": st["agent_errors"], "env_tokens": st["env_tokens"],
                                     "turns": st["turns_mean"] * len(samples)}


def collect_groups(ctx: RolloutContext, step: int, round_fn) -> RolloutBatch:
    """Rounds of `round_fn(ctx, examples, prompt_ids, seed) -> (samples, rewards, flags, stats)`
    until prompts_per_step groups are kept: a group with a response the engine boundary rejected
    is dropped (its advantages are relative to each other; its rewards are never computed), and
    with rollout.dynamic_sampling a group whose rewards are all equal too (no learning signal),
    for at most max_oversample_rounds more rounds."""
    cfg = ctx.cfg
    G, P = cfg.samples_per_prompt, cfg.prompts_per_step
    retries_before = engine_retries(ctx.engine)
    kept: list[Sample] = []
    kept_rewards: list[float] = []
    kept_prompts: list[dict] = []
    all_rewards: list[float] = []
    raised = 0
    lengths: list[int] = []
    generated: list[Sample] = []  # every response of the step, rejected ones included
    extra: dict[str, float] = {}
    rounds = 0
    groups_needed = P
    while groups_needed > 0:
        examples = ctx.prompts.batch(step, rounds, groups_needed if rounds else P)
        prompt_ids = [ctx.prompts.encode(ex) for ex in examples]
        samples, rewards, flags, st = round_fn(ctx, examples, prompt_ids, ctx.request_seed(step, rounds))
        for k, v in st.items():
            extra[k] = extra.get(k, 0) + v
        bad = {s.prompt_index for s in samples if rejected_reason(s)}
        generated += samples
        raised += sum(flags)
        all_rewards += [r for s, r in zip(samples, rewards) if s.prompt_index not in bad]
        lengths += [len(s.response_ids) for s in samples if s.prompt_index not in bad]
        for g in range(len(examples)):
            if g in bad:
                continue
            grp = slice(g * G, (g + 1) * G)
            r = rewards[grp]
            if cfg.dynamic_sampling and max(r) == min(r):
                continue  # zero advantage for every sample: no learning signal
            kept += samples[grp]
            kept_rewards += r
            kept_prompts.append(examples[g])
        groups_needed = P - len(kept) // G
        rounds += 1
        if not cfg.dynamic_sampling or rounds > cfg.max_oversample_rounds:
            break
    rejected = check_rejected_frac(generated, cfg.max_rejected_frac)  # too many: one line naming the first
    kept = kept[: P * G]
    kept_rewards = kept_rewards[: P * G]
    t = torch.tensor(all_rewards, dtype=torch.float64)
    stats = {
        "reward_mean": float(t.mean()), "reward_std": float(t.std()) if len(t) > 1 else 0.0,
        "reward_raised": raised, "response_len_mean": sum(lengths) / max(len(lengths), 1),
        "groups_kept": len(kept) // G, "rollout_rounds": rounds,
        "truncated_frac": sum(1 for s in kept if s.finish_reason == "length") / max(len(kept), 1),
        # records the prompt stream skipped (malformed, unrenderable, too long) and engine requests retried
        "data_skipped": ctx.prompts.take_skipped(), "rollout_retries": engine_retries(ctx.engine) - retries_before,
        "engine_rejected": rejected,
    }
    take = getattr(ctx.score, "take_metrics", None)
    if take is not None:  # weighted reward sources (rollout/judge.py): per-source means and errors
        stats.update(take())
    if "turns" in extra:  # agent sessions; env_tokens: in the samples that train, the rest over every session
        stats.update(agent_errors=extra["agent_errors"], turns_mean=extra["turns"] / max(len(lengths), 1),
                     env_tokens_all=extra["env_tokens"], env_tokens=sum(s.meta.get("env_tokens", 0) for s in kept))
    if ctx.log_prompts:
        stats["prompts"] = [ctx.prompts.text(ex) for ex in kept_prompts[:P]]
    return RolloutBatch(kept, kept_rewards, stats)


def engine_retries(engine) -> int:
    """Requests the engine has retried so far (engines that count them: their `metrics`)."""
    return int(engine.metrics.get("retries", 0))


# ------------------------------------------------------------------------------------ loading and checks
def load_driver(spec: str) -> Callable[[RolloutContext, int], RolloutBatch]:
    """Resolve ``"package.module:function"`` (rollout.driver); RewardSpecError naming it."""
    from .rewards import RewardSpecError, load_reward_fn

    try:
        return load_reward_fn(spec)
    except RewardSpecError as e:
        raise RewardSpecError(str(e).replace("reward spec", "rollout.driver", 1)) from e.__cause__


def check_batch(batch: Any, spec: str, group_size: int) -> RolloutBatch:
    """What a driver returned, as the trainer needs it, or a ValueError line naming the driver:
    a RolloutBatch of whole groups (samples of one group consecutive, the same prompt), one finite
    reward per sample, stats a dict."""
    where = f"rollout.driver {spec}"
    if not isinstance(batch, RolloutBatch):
        raise ValueError(f"{where} returned {type(batch).__name__}, not a RolloutBatch")
    n = len(batch.samples)
    if n % group_size:
        raise ValueError(f"{where} returned {n} samples, not whole groups of rollout.samples_per_prompt={group_size}")
    if len(batch.rewards) != n:
        raise ValueError(f"{where} returned {len(batch.rewards)} rewards for {n} samples")
    for i, (s, r) in enumerate(zip(batch.samples, batch.rewards)):
        if not isinstance(s, Sample):
            raise ValueError(f"{where}: sample {i} is a {type(s).__name__}, not a rollout.base.Sample")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            raise ValueError(f"{where}: reward {i} is {r!r}, not a finite number")
        first = batch.samples[i - i % group_size]
        if s.prompt_ids != first.prompt_ids:
            raise ValueError(f"{where}: sample {i} has another prompt than the first of its group "
                             f"(samples {i - i % group_size}..{i - i % group_size + group_size - 1})")
    if not isinstance(batch.stats, dict):
        raise ValueError(f"{where} returned stats of type {type(batch.stats).__name__}, not a dict")
    return batch
