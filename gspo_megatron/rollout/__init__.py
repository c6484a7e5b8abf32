"""Rollout: the engine contract, the in-process transformers engine, rewards, tasks, prompt data.

Never imports Megatron. Names are exported lazily so that ``import gspo_megatron.rollout.base``
does not pull in transformers.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "RolloutEngine": "base", "Sample": "base", "SamplingParams": "base", "FINISH_REASONS": "base",
    "SGLangEngine": "sglang_engine",
    "HFEngine": "hf_engine", "WeightUpdateError": "hf_engine", "hub_weight_targets": "hf_engine",
    "build_tokenizer": "tokenizer",
    "TASKS": "tasks", "SyntheticTask": "tasks", "task_reward": "tasks",
    "load_reward_fn": "rewards", "math_reward": "rewards", "score_samples": "rewards",
    "RewardSpecError": "rewards",
    "load_prompts": "data", "render_prompt": "data", "PromptStream": "data", "PromptDataError": "data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
