"""LLM judges as reward sources (reward.judge): a generative reward model behind an
OpenAI-compatible chat API (vLLM's or SGLang's /v1/chat/completions, or a hosted one).

Each sample is one chat request: the user message is `template` with {prompt}, {response} and
{answer} replaced (plain replacement, not str.format: a template cannot reach attributes), the
judge answers at temperature 0, and the score is the first match of `score_regex` (its first
group, else the whole match) in the answer, or the number under `score_json_field` of the answer
parsed as JSON. Requests run `max_concurrency` at a time. Each sample has `timeout_s` for all of
its attempts together: connection errors, timeouts, HTTP 429 and 5xx are retried (at most
`retries` times, with backoff) within that budget; a 4xx answer or an answer without a score is
not (the judge answers at temperature 0: it would say the same). A sample whose judge call fails
scores 0.0 and counts as raised, like a reward function that raised (rollout/rewards.py), so a
misbehaving judge never stalls a step beyond `timeout_s` and too many failures stop the run in
one line (reward.max_error_frac).

`CombinedScorer` adds weighted sources: reward = fn_weight * reward.fn + judge.weight * judge.
"""
from __future__ import annotations

import json
import logging
import math
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .http_servers import loads_answer
from .reward_servers import ServedScorer

log = logging.getLogger("gspo_megatron.rollout")

CHAT_ROUTE = "/v1/chat/completions"
# The request's fields (tests/test_vllm_contract.py checks them against vLLM's ChatCompletionRequest)
REQUEST_FIELDS = ("model", "messages", "max_tokens", "temperature")


class JudgeScorer(ServedScorer):
    """`scorer(texts, examples) -> (scores, raised)`; `last_errors` as RewardScorer's. Its server is
    given by URL or launched by the trainer (reward.judge.launch: rollout/reward_servers.py)."""

    name = "judge"
    NAME, CONFIG = "judge", "reward.judge"

    def __init__(self, cfg, *, prompt_key: str = "prompt", answer_key: str = "answer"):
        self._serve(cfg)
        self.regex = re.compile(cfg.score_regex) if cfg.score_json_field is None else None
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.extra = json.loads(cfg.extra_body) if cfg.extra_body else {}  # checked by JudgeConfig
        self.last_errors: list[str | None] = []

    def render(self, text: str, example: dict) -> str:
        out = self.cfg.template
        for k, v in (("{prompt}", example.get(self.prompt_key, "")), ("{answer}", example.get(self.answer_key, "")),
                     ("{response}", text)):
            out = out.replace(k, "" if v is None else str(v))
        return out

    def parse(self, content: str) -> float:
        """The score in the judge's answer; ValueError naming what was missing."""
        if self.cfg.score_json_field is not None:
            try:
                obj = loads_answer(content)
            except ValueError as e:
                raise ValueError(f"the answer is not JSON ({e}): {content[:80]!r}") from None
            if not isinstance(obj, dict) or self.cfg.score_json_field not in obj:
                raise ValueError(f"the answer has no field {self.cfg.score_json_field!r}: {content[:80]!r}")
            v = obj[self.cfg.score_json_field]
        else:
            m = self.regex.search(content)
            if m is None:
                raise ValueError(f"no match of score_regex in the answer {content[:80]!r}")
            v = m.group(1) if m.groups() else m.group(0)
        if isinstance(v, bool):
            raise ValueError(f"the score is not a number: {v!r}")
        try:
            x = float(v)
        except (TypeError, ValueError):
            raise ValueError(f"the score is not a number: {str(v)[:40]!r}") from None
        if not math.isfinite(x) or abs(x) > 3.0e38:
            raise ValueError(f"the score {x!r} is not a finite float32")
        return x

    def _one(self, text: str, example: dict) -> tuple[float | None, str | None]:
        c = self.cfg
        body = {**self.extra, "model": c.model, "messages": [{"role": "user", "content": self.render(text, example)}],
                "max_tokens": c.max_tokens, "temperature": 0.0}
        data, why = self.exchange(CHAT_ROUTE, body)
        if data is None:
            return None, why
        try:
            content = loads_answer(data)["choices"][0]["message"]["content"]
            if not isinstance(content, str):
                raise TypeError
        except (ValueError, KeyError, IndexError, TypeError) as e:
            why = f" ({e})" if isinstance(e, ValueError) else ""
            return None, f"not a chat completion{why}: {data[:200].decode('utf-8', 'replace')!r}"
        try:
            return self.parse(content), None
        except ValueError as e:
            return None, str(e)

    def __call__(self, texts: Sequence[str], examples: Sequence[dict]) -> tuple[list[float], list[bool]]:
        n = len(texts)
        scores, raised = [0.0] * n, [True] * n
        errors: list[str | None] = [None] * n
        if n:
            with ThreadPoolExecutor(max_workers=min(self.cfg.max_concurrency, n), thread_name_prefix="judge") as pool:
                for i, (x, why) in enumerate(pool.map(self._one, texts, examples)):
                    if x is None:
                        errors[i] = f"judge {self.client.url}: {why}"
                    else:
                        scores[i], raised[i] = x, False
        self.last_errors = errors
        return scores, raised


class CombinedScorer:
    """Weighted reward sources: `sources` = [(name, scorer, weight)], each scorer
    `(texts, examples) -> (rewards, raised)`. A sample's reward is the weighted sum; it counts as
    raised when any source failed on it (that source contributes 0). Per-source means and error
    counts accumulate until take_metrics() (rollout/loop: once per step)."""

    def __init__(self, sources: list[tuple[str, object, float]], max_error_frac: float):
        self.sources = sources
        self.max_error_frac = max_error_frac
        self.name = "+".join(f"{w:g}*{n}" for n, _, w in sources)
        self.last_errors: list[str | None] = []
        self._lock = threading.Lock()
        self._acc = {n: [0.0, 0, 0] for n, _, _ in sources}  # sum, count, errors

    def __call__(self, texts: Sequence[str], examples: Sequence[dict]) -> tuple[list[float], list[bool]]:
        from .rewards import RewardError

        n = len(texts)
        total, raised = [0.0] * n, [False] * n
        errors: list[str | None] = [None] * n
        for name, scorer, w in self.sources:
            got, bad = scorer(texts, examples)
            why = getattr(scorer, "last_errors", [None] * n)
            with self._lock:
                acc = self._acc[name]
                acc[0] += sum(g for g, b in zip(got, bad) if not b)
                acc[1] += sum(1 for b in bad if not b)
                acc[2] += sum(bad)
            for i in range(n):
                total[i] += w * got[i]
                if bad[i]:
                    raised[i] = True
                    errors[i] = errors[i] or (why[i] if i < len(why) and why[i] else f"{name} failed")
        self.last_errors = errors
        n_bad = sum(raised)
        first = next((e for e in errors if e is not None), "")
        if n and n_bad / n > self.max_error_frac:
            raise RewardError(f"reward {self.name} failed on {n_bad} of {n} samples, more than "
                              f"reward.max_error_frac={self.max_error_frac:g}; first: {first}")
        return total, raised

    def take_metrics(self) -> dict[str, float]:
        """Per source since the last call: reward_<name>_mean over its scored samples and
        <name>_errors."""
        with self._lock:
            out = {}
            for name, (s, c, e) in self._acc.items():
                if c:  # nothing scored: no mean (rather than a NaN in the metrics)
                    out[f"reward_{name}_mean"] = s / c
                out[f"{name}_errors"] = e
            self._acc = {n: [0.0, 0, 0] for n in self._acc}
        for name, scorer, _ in self.sources:  # a launched server's restarts so far (rollout/reward_servers.py)
            if isinstance(scorer, ServedScorer) and scorer.server is not None and scorer.server.procs is not None:
                out[f"{name}_restarts"] = scorer.server.metrics["restarts"]
        return out

    def start_servers(self, log_dir: str) -> None:
        """Start the launched servers of the served sources (reward.judge.launch, reward.model.launch);
        on the rank that scores, once."""
        for _, scorer, _ in self.sources:
            if isinstance(scorer, ServedScorer):
                scorer.start(log_dir)

    def close(self) -> None:
        for _, scorer, _ in self.sources:
            close = getattr(scorer, "close", None)
            if close is not None:
                close()
