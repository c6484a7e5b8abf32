"""What an engine's answer must be before anything trains on it (the boundary check).

Servers are other programs (SGLang, vLLM, a router, whatever answers on the URL): their answers
are data, checked like a file a user hands us. `check_response` is the one rule, pure; the HTTP
engines (rollout/sglang_engine.py, rollout/vllm_engine.py) apply it to every row they parse, and
agent sessions (rollout/agent.py) to every turn. A response is valid when

  * it has at most ``max_new_tokens`` tokens (the budget the request asked for; an agent turn's
    budget is what is left of its session's);
  * every token id is an int in [0, vocab_size) (vocab_size: the model's HF config, the rows of
    the trainer's output layer; unknown -> only >= 0 is checked);
  * there is exactly one log-prob per token, each a real number, finite and <= LOGPROB_TOL.

A violating row is never returned as a trainable sample: the engine retries the request as it
retries a failed one, then returns `rejected_sample(...)` in the row's place, an empty response
whose ``meta["rejected"]`` holds the one-line reason naming the server; ``engine.metrics
["rejected"]`` counts them. generate() keeps returning len(prompts) * n samples in order (the
loop slices groups of n); `rejected_reason` / `check_rejected_frac` are for the loop, which drops
the groups that hold one and stops when too many of a step's samples are rejected.
"""
from __future__ import annotations

import math
from dataclasses import replace
from numbers import Real
from typing import Any, Mapping, Sequence

from gspo_megatron.errors import InputError

from .base import Sample

# Largest log-prob accepted. Exact log_softmax is never positive (x_i - logsumexp(x) with
# logsumexp >= max(x) holds under IEEE rounding too), but servers compute it in fused / chunked
# reductions (a TP-sharded logsumexp, a float32 sum over ~150k exps: relative error ~1e-6 to
# 1e-5), so a token of probability ~1 can come back as a few 1e-6 above 0. 1e-4 leaves that
# noise an order of magnitude of room and is still far below anything that would change
# training: the ratio exp(logp_new - logp_old) moves by < 1e-4, under the engine/trainer
# mismatch fp32 runs already show. A sign error or raw logits (values of order 1) are refused.
LOGPROB_TOL = 1e-4


class EngineRejectedError(InputError):
    """Too many of a step's samples were rejected (rollout.max_rejected_frac): one line naming
    the first rejected response's server and why (an InputError: entry points print one line)."""


def vocab_size_of(hf_config: Mapping | None) -> int | None:
    """vocab_size of a model's HF config dict (``text_config``'s for a multimodal one), or None."""
    cfg = hf_config or {}
    if isinstance(cfg.get("text_config"), Mapping) and "vocab_size" in cfg["text_config"]:
        cfg = cfg["text_config"]
    v = cfg.get("vocab_size")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None
    return v


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_response(ids: Sequence[Any], logprobs: Sequence[Any], *, max_new_tokens: int,
                   vocab_size: int | None = None) -> str | None:
    """None when (ids, logprobs) is a valid response for a request of `max_new_tokens` tokens,
    else why not (one line, the first violation; ids and values shown are the offending ones)."""
    n = len(ids)
    if n > max_new_tokens:
        return f"{n} tokens for max_new_tokens={max_new_tokens}"
    if len(logprobs) != n:
        return f"{len(logprobs)} log-probs for {n} tokens"
    for i, t in enumerate(ids):
        if not _is_int(t):
            return f"token {i} is {t!r}, not an integer id"
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            hi = f"{vocab_size - 1}" if vocab_size is not None else "..."
            return f"token {i} has id {t}, outside the vocabulary [0, {hi}]"
    for i, lp in enumerate(logprobs):
        if lp is None:  # orjson (SGLang's response class) writes NaN / inf as null
            return f"log-prob {i} is null (a NaN or infinity the server serialised as null)"
        if isinstance(lp, bool) or not isinstance(lp, Real):
            return f"log-prob {i} is {lp!r}, not a number"
        x = float(lp)
        if not math.isfinite(x):
            return f"log-prob {i} is {x!r}, not finite"
        if x > LOGPROB_TOL:
            return f"log-prob {i} is {x!r}, above 0 (a probability over 1)"
    return None


def check_sample(sample: Sample, *, max_new_tokens: int, vocab_size: int | None = None) -> str | None:
    """check_response on a Sample's response (a rejected sample stays rejected)."""
    return rejected_reason(sample) or check_response(sample.response_ids, sample.response_logprobs,
                                                     max_new_tokens=max_new_tokens, vocab_size=vocab_size)


def rejected_sample(sample: Sample, reason: str) -> Sample:
    """`sample` with nothing trainable left: no tokens, no log-probs, no routing,
    meta["rejected"] = reason. finish_reason "abort" (the response did not end normally) is
    what every consumer already expects of an empty response; PartialGenerator never continues
    a rejected one."""
    return replace(sample, response_ids=[], response_logprobs=[], finish_reason="abort", text="",
                   routed_experts=None, token_versions=None, loss_mask=None,
                   meta=dict(sample.meta, rejected=str(reason).splitlines()[0] if reason else "rejected"))


def rejected_reason(sample: Sample) -> str | None:
    """Why the engine rejected `sample` (a one-line reason naming the server), or None."""
    meta = sample.meta if isinstance(sample.meta, dict) else {}
    r = meta.get("rejected")
    return str(r) if r else None


def check_rejected_frac(samples: Sequence[Sample], max_frac: float) -> int:
    """The number of rejected samples in a step's `samples`; EngineRejectedError (one line) when
    they are more than `max_frac` of them (rollout.max_rejected_frac)."""
    reasons = [r for r in (rejected_reason(s) for s in samples) if r]
    if samples and len(reasons) / len(samples) > max_frac:
        raise EngineRejectedError(
            f"{len(reasons)} of {len(samples)} samples of this step were rejected (more than "
            f"rollout.max_rejected_frac={max_frac:g}); first: {reasons[0]}")
    return len(reasons)
