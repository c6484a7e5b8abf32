"""Held-out evaluation during training (the `eval:` config section: one set, plus
eval.extra_sets).

Rank 0 generates eval.samples_per_prompt samples for each held-out prompt with the rollout engine
(in-process or SGLang) right after a weight push, so with the current weights; rewards come from
the run's reward function; a sample is correct when its reward reaches eval.correct_threshold.
Reported, under eval/<name>/: pass@k for k = 1, 2, 4, ... < n and n (the unbiased estimator,
algorithms/passk.py), reward_mean, response_len_mean, truncated_frac.

Isolation from training: the held-out prompts are fixed (drawn once with eval.seed, or the first
records of eval.path) and never touch the training prompt stream; sampling uses its own seed
(the in-process engine forks the RNG for seeded generation; SGLang seeds per request), and the
trainer passes explicit seeds for its own rollouts, so a run trains bit-identically with
evaluation on or off (tests/test_evaluation.py).
"""
from __future__ import annotations

import random

from gspo_megatron.algorithms.passk import ks_for, mean_pass_at_k
from gspo_megatron.cli_util import InputError
from gspo_megatron.rollout.base import SamplingParams


class HeldOut:
    """The held-out prompt sets of one run: `eval:` itself, then eval.extra_sets."""

    def __init__(self, cfg, prompts, agent=None):
        self.cfg, self.prompts, self.agent = cfg, prompts, agent  # agent: rollout/agent.py AgentRunner
        self.sets = [_Set(spec, cfg, prompts, key) for spec, key in
                     [(cfg.eval, "eval")] + [(x, f"eval.extra_sets[{i}]") for i, x in enumerate(cfg.eval.extra_sets)]]

    def due(self, step: int) -> bool:
        """Evaluate after `step` GSPO steps? (step 0, every interval, the last step)."""
        e = self.cfg.eval
        return step == 0 or step % e.interval == 0 or step == self.cfg.train.max_steps

    def run(self, engine, score, tokenizer, stop_ids) -> dict:
        """Generate, score, and the eval/<name>/... metrics of every set (rank 0)."""
        out = {}
        for s in self.sets:
            out.update(s.run(self.cfg, engine, score, tokenizer, stop_ids, self.agent))
        return out


class _Set:
    """One held-out set: fixed prompts (a synthetic draw with its own seed, or a file's first
    records) and the seed its samples are drawn with."""

    def __init__(self, spec, cfg, prompts, key: str):
        self.name, self.seed = spec.name, spec.seed
        if spec.source == "synthetic":
            if prompts.task is None:
                raise InputError(f"{key}.source=synthetic needs data.source=synthetic (the task to draw from); "
                                 f"use {key}.source=file with {key}.path for file data")
            from gspo_megatron.rollout.tasks import SyntheticTask

            task = SyntheticTask(cfg.data.task, seed=spec.seed)
            self.examples = task.sample_prompts(spec.num_prompts, random.Random(f"eval:{spec.seed}"))
        else:
            from gspo_megatron.rollout.data import load_prompts

            examples = load_prompts(spec.path, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
            if not examples:
                raise InputError(f"{key}.path: {spec.path} has no records")
            self.examples = list(examples[: spec.num_prompts])
        self.prompt_ids = [prompts.encode(ex) for ex in self.examples]

    def run(self, cfg, engine, score, tokenizer, stop_ids, agent=None) -> dict:
        e, r = cfg.eval, cfg.rollout
        sp = SamplingParams(temperature=e.temperature, top_p=r.top_p, top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                            stop_token_ids=tuple(stop_ids))
        n = e.samples_per_prompt
        if agent is not None:  # the run's agent drives every held-out session too
            from gspo_megatron.rollout.agent import run_and_score

            samples, rewards, _, _ = run_and_score(agent, engine.generate, self.examples, self.prompt_ids, n, sp,
                                                   score, seed=self.seed, version=engine.weight_version)
        else:
            samples = engine.generate(self.prompt_ids, n, sp, seed=self.seed)
            texts = [tokenizer.decode(s.response_ids, skip_special_tokens=False) for s in samples]
            rewards, _ = score(texts, [self.examples[s.prompt_index] for s in samples])
        correct = [[] for _ in self.examples]
        for s, rew in zip(samples, rewards):
            correct[s.prompt_index].append(rew >= e.correct_threshold)
        key = f"eval/{self.name}"
        out = {f"{key}/pass@{k}": mean_pass_at_k(correct, k) for k in ks_for(n)}
        out[f"{key}/reward_mean"] = sum(rewards) / len(rewards)
        out[f"{key}/response_len_mean"] = sum(len(s.response_ids) for s in samples) / len(samples)
        out[f"{key}/truncated_frac"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
        return out
