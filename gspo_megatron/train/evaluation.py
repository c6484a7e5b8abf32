"""Held-out evaluation during training (the `eval:` config section: one set, plus
eval.extra_sets).

Rank 0 generates eval.samples_per_prompt samples for each held-out prompt with the rollout engine
(in-process or SGLang) right after a weight push, so with the current weights; rewards come from
the run's reward function; a sample is correct when its reward reaches eval.correct_threshold.
Reported, under eval/<name>/: pass@k for k = 1, 2, 4, ... < n and n (the unbiased estimator,
algorithms/passk.py), reward_mean, response_len_mean, truncated_frac (and engine_rejected when
the engine boundary rejected responses: they count as wrong, unscored).

Isolation from training: the held-out prompts are fixed (drawn once with eval.seed, or the first
records of eval.path) and never touch the training prompt stream; sampling uses its own seed
(the in-process engine forks the RNG for seeded generation; SGLang seeds per request), and the
trainer passes explicit seeds for its own rollouts, so a run trains bit-identically with
evaluation on or off (tests/test_evaluation.py).
"""
from __future__ import annotations

import logging
import random

from gspo_megatron.algorithms.passk import ks_for, mean_pass_at_k
from gspo_megatron.errors import InputError
from gspo_megatron.rollout.drivers import sampling_params
from gspo_megatron.rollout.validate import rejected_reason

log = logging.getLogger("gspo_megatron.train")


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
            self.prompt_ids = [prompts.encode(ex) for ex in self.examples]
        else:
            self.examples, self.prompt_ids = _first_usable(spec, cfg, prompts, key)

    def run(self, cfg, engine, score, tokenizer, stop_ids, agent=None) -> dict:
        e, r = cfg.eval, cfg.rollout
        sp = sampling_params(r, stop_ids, temperature=e.temperature)
        n = e.samples_per_prompt
        if agent is not None:  # the run's agent drives every held-out session too
            from gspo_megatron.rollout.agent import run_and_score

            samples, rewards, _, _ = run_and_score(agent, engine.generate, self.examples, self.prompt_ids, n, sp,
                                                   score, seed=self.seed, version=engine.weight_version)
        else:
            samples = engine.generate(self.prompt_ids, n, sp, seed=self.seed)
            ok = [i for i, s in enumerate(samples) if not rejected_reason(s)]
            got, _ = score([tokenizer.decode(samples[i].response_ids, skip_special_tokens=False) for i in ok],
                           [self.examples[samples[i].prompt_index] for i in ok]) if ok else ([], [])
            rewards = [0.0] * len(samples)  # a response the engine boundary rejected is wrong, unscored
            for j, i in enumerate(ok):
                rewards[i] = got[j]
        correct = [[] for _ in self.examples]
        for s, rew in zip(samples, rewards):
            correct[s.prompt_index].append(rew >= e.correct_threshold)
        key = f"eval/{self.name}"
        out = {f"{key}/pass@{k}": mean_pass_at_k(correct, k) for k in ks_for(n)}
        out[f"{key}/reward_mean"] = sum(rewards) / len(rewards)
        out[f"{key}/response_len_mean"] = sum(len(s.response_ids) for s in samples) / len(samples)
        out[f"{key}/truncated_frac"] = sum(s.finish_reason == "length" for s in samples) / len(samples)
        rejected = sum(1 for s in samples if rejected_reason(s))
        if rejected:
            out[f"{key}/engine_rejected"] = rejected
        return out


def _first_usable(spec, cfg, prompts, key: str) -> tuple[list[dict], list[list[int]]]:
    """The first `spec.num_prompts` records of `spec.path` training could use, and their token ids.

    A record training would skip (rollout/data.py load_prompts: malformed, over
    data.max_record_bytes, not JSON; or, by the run's PromptSource, unrenderable or over
    data.max_prompt_tokens) is skipped here too, with a warning naming it, rather than stopping
    the run: the set stays a pure function of the file, and an oversized record is never read
    whole or tokenized. A file with no usable record among those read is one line."""
    from gspo_megatron.rollout.data import load_prompts

    problems: dict[int, str] = {}
    records = load_prompts(spec.path, prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                           skip_malformed=True, problems=problems, max_record_bytes=cfg.data.max_record_bytes)
    examples, ids, skipped = [], [], []
    for i, ex in enumerate(records):
        if len(examples) == spec.num_prompts:
            break
        # PromptSource._check: the same checks (and the same cache) as the training stream's
        got, why = (None, problems[i]) if ex is None else prompts._check(ex)
        if got is None:
            skipped.append(f"record {i + 1} {why}")
            continue
        examples.append(ex)
        ids.append(got)
    if not examples:
        raise InputError(f"{key}.path: {spec.path} has no usable record ({skipped[0]})")
    if skipped:
        log.warning("%s.path %s: %d record(s) skipped, the held-out set takes the next ones (%s)",
                    key, spec.path, len(skipped), "; ".join(skipped[:3]))
    return examples, ids
