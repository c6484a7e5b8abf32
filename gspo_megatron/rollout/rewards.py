"""Reward functions: loading user functions by spec, a math-verify reward, and fault-tolerant scoring.

A reward function has the signature ``fn(response_text: str, example: dict) -> float``.
"""
from __future__ import annotations

import importlib
import logging
import math
import threading
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, dict], float]


class RewardSpecError(ValueError):
    """A ``package.module:function`` reward spec that cannot be resolved."""


def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``"package.module:function"`` (the attribute may be dotted: ``module:Class.method``)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise RewardSpecError(f"reward spec {spec!r} must look like 'package.module:function'")
    mod_name, attr_path = spec.split(":")
    if not mod_name or not attr_path:
        raise RewardSpecError(f"reward spec {spec!r} must look like 'package.module:function'")
    try:
        obj = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or whatever the module raises at import time
        msg = str(e).splitlines()[0] if str(e) else ""
        raise RewardSpecError(
            f"reward spec {spec!r}: cannot import module {mod_name!r}: {type(e).__name__}: {msg}"
        ) from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise RewardSpecError(f"reward spec {spec!r}: {mod_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardSpecError(f"reward spec {spec!r}: {attr_path!r} is not callable")
    return obj


def math_reward(response: str, example: dict) -> float:
    """1.0 if math-verify judges the response's final answer equal to ``example["answer"]``, else 0.0.

    The gold answer is parsed as given and, if nothing is extracted, again wrapped in ``$...$`` (so
    plain LaTeX like ``x^2+1`` works). math-verify's signal-based timeouts only work in the main
    thread; elsewhere they are disabled.
    """
    from math_verify import parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    answer = str(example["answer"])
    gold = parse(answer, parsing_timeout=timeout)
    if not gold:
        gold = parse(f"${answer}$", parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math_reward: cannot parse the gold answer {answer!r}")
    pred = parse(response, parsing_timeout=timeout)
    if not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def score_samples(
    fn: RewardFn, responses: Sequence[str], examples: Sequence[dict]
) -> tuple[list[float], list[bool]]:
    """Score each (response, example) pair; never raises because of the reward function.

    A sample whose reward call raises, or returns something that is not a finite number, gets
    reward 0.0 and ``raised=True``. The first such failure of the call is logged once (with the
    count of failures), the rest silently.
    """
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
    rewards: list[float] = []
    raised: list[bool] = []
    first: str | None = None
    for resp, ex in zip(responses, examples):
        try:
            r = fn(resp, ex)
            if isinstance(r, (str, bytes)):
                raise TypeError(f"reward must be a number, got {type(r).__name__} {r!r}")
            r = float(r)  # int, bool, numpy / 0-d torch scalars
            if not math.isfinite(r):
                raise ValueError(f"reward is not finite: {r}")
        except Exception as e:
            if first is None:
                first = f"{type(e).__name__}: {e}"
            rewards.append(0.0)
            raised.append(True)
        else:
            rewards.append(r)
            raised.append(False)
    if first is not None:
        name = getattr(fn, "__qualname__", repr(fn))
        logger.warning(
            "reward function %s raised on %d/%d samples (scored 0.0); first: %s",
            name, sum(raised), len(raised), first.splitlines()[0] if first else "",
        )
    return rewards, raised
