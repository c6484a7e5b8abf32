"""Multi-turn (agentic) rollouts: a user's agent function drives a session per sample.

    rollout.agent: "package.module:function"

    def my_agent(example: dict, session) -> float | None:
        out = session.generate(max_new_tokens=64, stop=["</tool>"])   # token ids the policy sampled
        session.append(run_tool(session.tokenizer.decode(out)))        # environment tokens
        session.generate()                                             # the policy continues
        return None                                                    # None: reward.fn scores session.text()

Token in, token out. `AgentSession.generate` asks the engine to continue **exactly the session's
token ids so far** (prompt + every earlier turn + every appended environment token): nothing is
decoded and re-encoded between turns, so the trainer scores the very tokens the engine sampled,
with the engine's log-probs and weight versions (re-tokenizing the text between turns is the
drift that makes a trainer score tokens the engine never sampled: verl#3720, slime PR#117).
`AgentSession.append` adds environment tokens (a tool's answer): they condition what follows and
are never trained on: `Sample.loss_mask` is False there, so the loss, the KL, the entropy, GSPO's
|y| and the mismatch metrics count policy tokens only (train/batch.py carries the mask as the
sample's token_mask).

Concurrency. Sessions run in their own threads (at most `concurrency` at once), so a slow tool
does not serialize the batch. Their generate() requests are batched: the dispatch loop, in the
caller's thread, sends one engine.generate() call per distinct sampling setting as soon as every
running session is waiting for the engine (or the oldest request has waited `linger_s`: a session
in a slow tool does not hold the others back). Engines batch the prompts of one call (the
in-process engine pads them into one generate; SGLang/vLLM send them concurrently). Running the
engine calls in the caller's thread keeps the async producer's and the partial generator's
locking as it is (rollout/partial.py waits on a condition the caller holds).

Failures. An agent (or its tool) that raises gets reward 0 and is counted (`agent_errors`), its
tokens so far are kept and trained on with that reward; a session that runs past `timeout_s` is
abandoned the same way (its thread is a daemon; any later engine request from it raises).

What a session does not do (yet): routing replay from the engine (train.routing_replay=rollout):
a multi-turn sample's routing would come from several engine calls, and environment tokens should
take the trainer's own; config refuses the combination, and R2 (routing_replay=old) works.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from .base import Sample, SamplingParams

AgentFn = Callable[[dict, "AgentSession"], Any]
Generate = Callable[..., list[Sample]]  # RolloutEngine.generate's signature


class AgentTimeout(RuntimeError):
    """The session ran past the agent timeout; raised into its thread at its next engine call."""


def load_agent_fn(spec: str) -> AgentFn:
    """Resolve ``"package.module:function"`` (rollout.agent)."""
    from .rewards import RewardSpecError, load_reward_fn

    try:
        return load_reward_fn(spec)
    except RewardSpecError as e:
        raise RewardSpecError(str(e).replace("reward spec", "rollout.agent", 1)) from e.__cause__


class AgentSession:
    """One sample's conversation: the prompt, then turns of policy tokens and environment tokens.

    Attributes for the agent: ``prompt_ids``, ``tokenizer``, ``example``, ``response_ids`` (every
    token after the prompt), ``finish_reason`` (of the last generate: "stop", "length", "abort";
    "length" once the response budget is spent), ``done`` (the budget is spent: generate returns
    [] and append adds nothing), ``turns`` (generate calls that reached the engine)."""

    def __init__(self, example: dict, prompt_ids: list[int], tokenizer, request: Callable[[list[int], SamplingParams], Sample],
                 sampling: SamplingParams, max_response_tokens: int):
        self.example = example
        self.prompt_ids = list(prompt_ids)
        self.tokenizer = tokenizer
        self._request = request
        self._sampling = sampling
        self.max_response_tokens = int(max_response_tokens)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[bool] = []
        self.token_versions: list[int] = []
        self.turns = 0
        self.env_tokens = 0
        self.finish_reason = "stop"
        self.matched_stop = None
        self.done = False
        self._version: int | None = None

    def _left(self) -> int:
        return self.max_response_tokens - len(self.response_ids)

    def generate(self, max_new_tokens: int | None = None, stop: Sequence[str] | None = None) -> list[int]:
        """The policy continues the session's tokens; returns the token ids it sampled (they are
        trained on). `max_new_tokens` defaults to rollout.max_new_tokens, capped by what is left
        of the response budget; `stop`: strings that end this turn (included in the output), on
        top of the eos / stop tokens."""
        if self.done:
            return []
        n = self._sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if n < 1:
            raise ValueError(f"session.generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        sp = replace(self._sampling, max_new_tokens=min(n, self._left()),
                     stop=tuple(stop) if stop else self._sampling.stop)
        s = self._request(self.prompt_ids + self.response_ids, sp)
        ids = list(s.response_ids)
        if len(s.response_logprobs) != len(ids):
            raise RuntimeError(f"engine returned {len(ids)} tokens with {len(s.response_logprobs)} log-probs")
        self.turns += 1
        self.response_ids += ids
        self.logprobs += [float(x) for x in s.response_logprobs]
        self.mask += [True] * len(ids)
        self.token_versions += s.versions()
        self._version = int(s.weight_version) if self._version is None else min(self._version, int(s.weight_version))
        self.finish_reason, self.matched_stop = s.finish_reason, s.meta.get("matched_stop")
        if self._left() <= 0:
            self.done, self.finish_reason = True, "length"
        return ids

    def append(self, tokens: str | Sequence[int]) -> list[int]:
        """Environment tokens (a string is encoded without special tokens): added to the context,
        never trained on. Returns the ids added (cut at the response budget, which ends the
        session with finish_reason "length")."""
        if isinstance(tokens, str):
            ids = list(self.tokenizer.encode(tokens, add_special_tokens=False))
        else:
            ids = [int(t) for t in tokens]
            vocab = len(self.tokenizer) if self.tokenizer is not None else None
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise ValueError(f"session.append: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if self.done:
            return []
        if len(ids) >= self._left():
            ids = ids[: self._left()]
            self.done, self.finish_reason = True, "length"
        v = self.token_versions[-1] if self.token_versions else (self._version or 0)
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [False] * len(ids)
        self.token_versions += [v] * len(ids)
        self.env_tokens += len(ids)
        return ids

    def text(self) -> str:
        """Everything after the prompt (policy and environment tokens), special tokens kept."""
        return self.tokenizer.decode(self.response_ids, skip_special_tokens=False)

    def to_sample(self, index: int, version: int) -> Sample:
        policy = sum(self.mask)
        weight_version = self._version if self._version is not None else version
        versions = self.token_versions if len(set(self.token_versions)) > 1 else None
        return Sample(
            prompt_index=index, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids),
            response_logprobs=list(self.logprobs), finish_reason=self.finish_reason,
            weight_version=weight_version, text=None,
            meta={"turns": self.turns, "env_tokens": self.env_tokens, "policy_tokens": policy,
                  "matched_stop": self.matched_stop},
            token_versions=versions, loss_mask=None if policy == len(self.mask) else list(self.mask))


@dataclass
class _Request:
    session: int
    ids: list[int]
    sampling: SamplingParams
    t: float = field(default_factory=time.monotonic)
    result: Sample | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class AgentResult:
    """What run() returns, in input order: one sample per (example, draw)."""

    samples: list[Sample]
    rewards: list[float | None]  # the agent's return value (None: score the text with reward.fn)
    errors: list[str | None]  # why the agent failed (its reward is then 0.0), else None
    stats: dict


class AgentRunner:
    """Runs the agent function over a batch of prompts (rank 0). One per run."""

    def __init__(self, fn: AgentFn, tokenizer, *, max_response_tokens: int, concurrency: int = 64,
                 timeout_s: float = 600.0, linger_s: float = 0.05, session_cls: type = AgentSession):
        self.fn, self.tokenizer = fn, tokenizer
        self.max_response_tokens, self.concurrency = int(max_response_tokens), int(concurrency)
        self.timeout_s, self.linger_s = float(timeout_s), float(linger_s)
        self.session_cls = session_cls

    def run(self, generate: Generate, examples: Sequence[dict], prompt_ids: Sequence[list[int]], n: int,
            sampling: SamplingParams, *, seed: int | None = None, version: int = 0) -> AgentResult:
        """n sessions per example, grouped as engine.generate groups them (example 0's n, then
        example 1's, ...). `generate` is called only from this thread."""
        jobs = [(i, e) for e in range(len(examples)) for i in [e] * n]
        cond = threading.Condition()
        pending: list[_Request] = []
        state = {"live": 0}
        sessions: list[AgentSession | None] = [None] * len(jobs)
        outcome: list[tuple[Any, str | None] | None] = [None] * len(jobs)
        started = [0.0] * len(jobs)
        abandoned: set[int] = set()

        def request(k: int, ids: list[int], sp: SamplingParams) -> Sample:
            r = _Request(k, ids, sp)
            with cond:
                if k in abandoned:
                    raise AgentTimeout(f"session {k} ran past rollout.agent_timeout_s={self.timeout_s:g}")
                pending.append(r)
                cond.notify_all()
            if not r.done.wait(self.timeout_s + 60.0):
                raise AgentTimeout(f"session {k}: no engine answer within {self.timeout_s + 60.0:g} s")
            if r.error is not None:
                raise r.error
            return r.result

        def body(k: int) -> None:
            ex_i = jobs[k][1]
            s = sessions[k]
            try:
                ret = self.fn(examples[ex_i], s)
                res = (None if ret is None else float(ret), None)
            except BaseException as e:  # noqa: BLE001 - a user's agent or tool: reward 0, counted
                res = (0.0, f"{type(e).__name__}: {e}")
            with cond:
                if k not in abandoned:
                    outcome[k] = res
                    state["live"] -= 1
                cond.notify_all()

        next_job = 0
        dispatches = 0
        t0 = time.monotonic()
        while True:
            with cond:
                while next_job < len(jobs) and state["live"] < self.concurrency:
                    k = next_job
                    next_job += 1
                    sessions[k] = self.session_cls(examples[jobs[k][1]], prompt_ids[jobs[k][1]], self.tokenizer,
                                                   lambda ids, sp, k=k: request(k, ids, sp), sampling,
                                                   self.max_response_tokens)
                    started[k] = time.monotonic()
                    state["live"] += 1
                    threading.Thread(target=body, args=(k,), daemon=True, name=f"agent-session-{k}").start()
                if state["live"] == 0 and next_job >= len(jobs):
                    break
                now = time.monotonic()
                for k in range(next_job):  # sessions past their time: abandoned, reward 0
                    if outcome[k] is None and k not in abandoned and now - started[k] > self.timeout_s:
                        abandoned.add(k)
                        outcome[k] = (0.0, f"AgentTimeout: ran past rollout.agent_timeout_s={self.timeout_s:g}")
                        state["live"] -= 1
                        for r in [r for r in pending if r.session == k]:
                            pending.remove(r)
                            r.error = AgentTimeout("abandoned")
                            r.done.set()
                ready = pending and (len(pending) >= state["live"] or now - pending[0].t >= self.linger_s)
                if not ready:
                    cond.wait(timeout=min(self.linger_s, 0.5) if pending else 0.5)
                    continue
                batch = sorted(pending, key=lambda r: r.session)
                pending.clear()
            try:
                self._dispatch(generate, batch, None if seed is None else seed + 7919 * dispatches)
            except BaseException:  # the engine failed: not the agents' fault, the rollout fails
                with cond:
                    abandoned.update(range(len(jobs)))
                    for r in pending:
                        r.error = AgentTimeout("the engine failed")
                        r.done.set()
                    pending.clear()
                raise
            dispatches += 1

        samples, rewards, errors = [], [], []
        for k, (i, _) in enumerate(jobs):
            s = sessions[k].to_sample(i, version)
            samples.append(s)
            rewards.append(outcome[k][0])
            errors.append(outcome[k][1])
        stats = {"agent_errors": sum(e is not None for e in errors),
                 "turns_mean": sum(s.meta["turns"] for s in samples) / max(len(samples), 1),
                 "env_tokens": sum(s.meta["env_tokens"] for s in samples),
                 "engine_calls": dispatches, "t_agents": time.monotonic() - t0}
        return AgentResult(samples, rewards, errors, stats)

    @staticmethod
    def _dispatch(generate: Generate, batch: list[_Request], seed: int | None) -> None:
        """One engine call per distinct sampling setting (max_new_tokens, stop strings)."""
        groups: dict[SamplingParams, list[_Request]] = {}
        for r in batch:
            groups.setdefault(r.sampling, []).append(r)
        for j, (sp, reqs) in enumerate(groups.items()):
            try:
                out = generate([r.ids for r in reqs], 1, sp, seed=None if seed is None else seed + j)
                if len(out) != len(reqs):
                    raise RuntimeError(f"engine returned {len(out)} samples for {len(reqs)} prompts")
                for r, s in zip(reqs, out):
                    r.result = s
            except BaseException:
                for r in batch:  # every waiting session unwinds; run() raises
                    if r.result is None:
                        r.error = AgentTimeout("the engine failed")
                    r.done.set()
                raise
            finally:
                for r in reqs:
                    r.done.set()


def run_and_score(runner: AgentRunner, generate: Generate, examples: Sequence[dict], prompt_ids: Sequence[list[int]],
                  n: int, sampling: SamplingParams, score, *, seed: int | None = None, version: int = 0
                  ) -> tuple[list[Sample], list[float], list[bool], dict]:
    """The agent's samples with their rewards: the agent's own, or `score(texts, examples)` (the
    run's RewardScorer) for those that returned None; 0.0 for a failed session. Returns samples,
    rewards, the scorer's raised flags and the sessions' stats (agent_errors, turns_mean,
    env_tokens). Every sample's text is set (session.text())."""
    res = runner.run(generate, examples, prompt_ids, n, sampling, seed=seed, version=version)
    texts = [runner.tokenizer.decode(s.response_ids, skip_special_tokens=False) for s in res.samples]
    for s, t in zip(res.samples, texts):
        s.text = t
    rewards = [0.0 if e is not None else r for r, e in zip(res.rewards, res.errors)]
    flags = [False] * len(rewards)
    todo = [i for i, r in enumerate(rewards) if r is None]
    if todo:
        got, raised = score([texts[i] for i in todo], [examples[res.samples[i].prompt_index] for i in todo])
        for i, r, f in zip(todo, got, raised):
            rewards[i], flags[i] = float(r), bool(f)
    return res.samples, rewards, flags, res.stats
