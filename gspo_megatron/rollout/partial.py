"""Partial rollouts: generations that a weight push interrupts are carried over, not thrown away.

With asynchronous rollouts (rollout/async_producer.py) the producer generates while the trainer
trains; a weight push has to wait for the generation in progress. With ``rollout.partial`` it does
not: the pusher interrupts the engine (`RolloutEngine.interrupt`), every unfinished row comes back
with the tokens generated so far (finish_reason "abort"), the weights are replaced, and
`PartialGenerator` continues each row from prompt + its partial response with the new weights,
for the tokens it has left. This is abort-and-resume; SGLang's radix cache cannot reuse the old
prefix (the weights changed), so the continuation re-reads it once.

What each token carries. A carried-over sample's tokens come from two (or more) weight versions:
``Sample.token_versions`` records the version of every token, ``weight_version`` is the oldest (the
trainer's staleness bound uses it), and ``response_logprobs[t]`` is the log-probability under the
policy that generated token t, given the whole prefix re-read by that policy. With
``loss.old_logprobs=engine`` (the async default) π_old is therefore the true behaviour policy of
every token, and GSPO's sequence ratio is the geometric mean of per-token ratios against the
policies that actually sampled them. With ``recompute`` π_old is the trainer's current policy for
every token (the usual off-policy caveat). Routing of a carried-over sample (return_routing) is
the last segment's, recorded by the policy that generated its last tokens over the whole sequence.

Rejected answers (rollout/validate.py): a row whose first round the engine rejected is not
continued (it carries no tokens to continue from); a carried-over row any of whose segments the
engine rejected is returned rejected, with that segment's reason, never as a joined sample holding
the other segments' tokens.

Reproducibility: the first round is exactly engine.generate(prompts, n, sampling, seed) — a run
that is never interrupted samples what it would without partial rollouts; where a push lands is a
matter of timing, so interrupted runs are not bit-reproducible.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Callable

from .base import RolloutEngine, Sample, SamplingParams, cut_at_stop_string
from .validate import rejected_reason, rejected_sample


class PartialGenerator:
    """`generate(prompts, n, sampling, seed=)` with the RolloutEngine contract, carrying rows over
    interrupts. Runs in the producer thread, which holds `gate` (a threading.Condition that the
    pusher acquires to replace the weights); while waiting for the new weights it releases it."""

    def __init__(self, engine: RolloutEngine, gate: threading.Condition, *, timeout_s: float = 3600.0,
                 stopped: Callable[[], bool] = lambda: False):
        if not engine.supports_interrupt:
            raise ValueError(f"rollout.partial needs an engine that can interrupt generation; "
                             f"{type(engine).__name__} cannot")
        self.engine, self.gate, self.timeout_s, self._stopped = engine, gate, timeout_s, stopped
        self.carried = 0  # samples continued after a push (cumulative)

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams, *,
                 seed: int | None = None) -> list[Sample]:
        out = self.engine.generate(prompts, n, sampling, seed=seed)
        rows = {i: [s] for i, s in enumerate(out)}  # row -> its segments
        pending = [i for i, s in enumerate(out) if s.finish_reason == "abort" and rejected_reason(s) is None]
        rounds = 0
        while pending:
            self._wait_for_push(rows[pending[0]][-1].weight_version)  # the version that was interrupted
            rounds += 1
            todo = [i for i in pending if self._left(rows[i], sampling) > 0]
            for i in set(pending) - set(todo):  # interrupted exactly at its last token
                rows[i][-1] = replace(rows[i][-1], finish_reason="length")
            prompts_i = [list(out[i].prompt_ids) + [t for seg in rows[i] for t in seg.response_ids] for i in todo]
            # one call per distinct budget keeps max_new_tokens exact for every row
            by_left: dict[int, list[int]] = {}
            for i in todo:
                by_left.setdefault(self._left(rows[i], sampling), []).append(i)
            pending = []
            for left, idx in sorted(by_left.items()):
                sub = [prompts_i[todo.index(i)] for i in idx]
                got = self.engine.generate(sub, 1, replace(sampling, max_new_tokens=left),
                                           seed=None if seed is None else seed + 7919 * rounds + left)
                for i, s in zip(idx, got):
                    rows[i].append(s)
                    if s.finish_reason == "abort" and rejected_reason(s) is None:
                        pending.append(i)
        joined = [self._join(out[i], rows[i]) for i in range(len(out))]
        tok = self.engine.tokenizer
        if sampling.stop and tok is not None:  # a stop string may span the interrupt: match on the whole response
            joined = [cut_at_stop_string(s, tok, tuple(sampling.stop))
                      if len(rows[i]) > 1 and rejected_reason(s) is None else s
                      for i, s in enumerate(joined)]
        return joined

    @staticmethod
    def _left(segments: list[Sample], sampling: SamplingParams) -> int:
        return sampling.max_new_tokens - sum(len(s.response_ids) for s in segments)

    def _wait_for_push(self, version: int) -> None:
        """Release the gate until the engine holds newer weights than `version` (the pusher
        interrupted us to replace them)."""
        deadline = time.monotonic() + self.timeout_s
        while self.engine.weight_version == version:
            if self._stopped():
                raise RuntimeError("the rollout producer was stopped during a partial rollout")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"partial rollout: no weight push after {self.timeout_s:.0f} s "
                                   f"(the engine was interrupted at version {version})")
            self.gate.wait(timeout=min(left, 1.0))

    def _join(self, first: Sample, segments: list[Sample]) -> Sample:
        if len(segments) == 1:
            return first
        why = next((r for r in map(rejected_reason, segments) if r is not None), None)
        if why is not None:
            return rejected_sample(first, why)
        self.carried += 1
        last = segments[-1]
        versions = [int(seg.weight_version) for seg in segments for _ in seg.response_ids]
        ids = [t for seg in segments for t in seg.response_ids]
        text = None
        tok = self.engine.tokenizer
        if tok is not None:
            text = tok.decode(ids, skip_special_tokens=True)
        return Sample(
            prompt_index=first.prompt_index, prompt_ids=list(first.prompt_ids), response_ids=ids,
            response_logprobs=[lp for seg in segments for lp in seg.response_logprobs],
            finish_reason=last.finish_reason, weight_version=min(versions, default=int(last.weight_version)),
            text=text if text is not None else "".join(seg.text or "" for seg in segments),
            meta=dict(last.meta, segments=len(segments), completion_tokens=len(ids)),
            routed_experts=last.routed_experts, token_versions=versions,
        )
