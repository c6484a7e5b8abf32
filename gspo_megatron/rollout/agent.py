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
running session is waiting for the engine or has ended. A turn's batch is then a function of the
sessions' logic alone, never of thread timing, and with the run's seed a run samples the same tokens
on a loaded machine as on a quiet one (the calculator demo's learning curve depended on the machine's
load before). The price: a session in a slow tool holds its turn back, up to `timeout_s`. With
`linger_s` set, a batch also goes once its oldest request has waited that long, so a slow tool does
not hold the others back, and the batches (so the samples) depend on timing. Engines batch the prompts of one call (the
in-process engine pads them into one generate; SGLang/vLLM send them concurrently). Running the
engine calls in the caller's thread keeps the async producer's and the partial generator's
locking as it is (rollout/partial.py waits on a condition the caller holds).

Failures. An agent (or its tool) that raises, or returns something that is not a finite number,
gets reward 0 and is counted (`agent_errors`); its tokens so far are kept and trained on with that
reward. A session whose own time (agent code and tools, not its waits for the engine) passes
`timeout_s` is abandoned the same way: its sample is what it had then, its thread (a daemon) gets
AgentTimeout from its next generate / append. More failures in a step than reward.max_error_frac
fail the step, as failing reward calls do.

Engine answers. Every turn is checked at the boundary (rollout/validate.py): at most the turn's
budget (what the session asked for: its max_new_tokens capped by what is left of the response
budget), ids in the vocabulary (``vocab_size`` of the runner, when given; the HTTP engines check
the model's already), one finite log-prob <= 0 per token. A turn the engine rejected
(``meta["rejected"]``) or that breaks these ends the session: generate() returns [] from then on,
append() adds nothing, and its sample is a rejected one (no tokens, ``meta["rejected"]`` the
reason, naming the server when the engine did), which the loop drops with its group
(``stats["rejected"]`` counts them). The agent is not failed for it: the engine misbehaved.

What a session does not do (yet): routing replay from the engine (train.routing_replay=rollout):
a multi-turn sample's routing would come from several engine calls, and environment tokens should
take the trainer's own; config refuses the combination, and R2 (routing_replay=old) works.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from .base import Sample, SamplingParams
from .validate import check_sample, rejected_reason, rejected_sample

AgentFn = Callable[[dict, "AgentSession"], Any]
Generate = Callable[..., list[Sample]]  # RolloutEngine.generate's signature
log = logging.getLogger(__name__)


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
    "length" once the response budget is spent, unless the last token ended the turn), ``done``
    (the budget is spent, or the engine's answer was rejected: generate returns [] and append adds
    nothing), ``rejected`` (why the engine's answer was refused, else None), ``turns`` (generate
    calls that reached the engine). A session abandoned by the timeout raises AgentTimeout from
    generate / append and no longer changes."""

    def __init__(self, example: dict, prompt_ids: list[int], tokenizer,
                 request: Callable[[list[int], SamplingParams, int], Sample], sampling: SamplingParams,
                 max_response_tokens: int, version: int = 0, vocab_size: int | None = None):
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
        self.rejected: str | None = None
        self.vocab_size = vocab_size
        self._start_version = int(version)  # environment tokens before the first turn carry it
        self._version: int | None = None
        self._lock = threading.Lock()
        self._abandoned = False

    def _left(self) -> int:
        return self.max_response_tokens - len(self.response_ids)

    def _check_alive(self) -> None:
        if self._abandoned:
            raise AgentTimeout("this session ran past rollout.agent_timeout_s and was abandoned")

    def generate(self, max_new_tokens: int | None = None, stop: str | Sequence[str] | None = None) -> list[int]:
        """The policy continues the session's tokens; returns the token ids it sampled (they are
        trained on). `max_new_tokens` defaults to rollout.max_new_tokens, capped by what is left
        of the response budget; `stop`: a string or strings that end this turn (included in the
        output), on top of the eos / stop tokens."""
        self._check_alive()
        if self.done:
            return []
        n = self._sampling.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if n < 1:
            raise ValueError(f"session.generate: max_new_tokens must be >= 1, got {max_new_tokens}")
        if isinstance(stop, str):
            stop = (stop,)
        sp = replace(self._sampling, max_new_tokens=min(n, self._left()),
                     stop=tuple(stop) if stop else self._sampling.stop)
        s = self._request(self.prompt_ids + self.response_ids, sp, self.turns)
        why = check_sample(s, max_new_tokens=sp.max_new_tokens, vocab_size=self.vocab_size)
        if why is not None:
            if rejected_reason(s) is None:  # the engine let it through: say so here
                why = f"agent session turn {self.turns}: {why}"
                log.warning("%s", why)
            with self._lock:
                self._check_alive()
                self.turns += 1
                self.rejected, self.done = why, True
            return []
        ids = list(s.response_ids)
        with self._lock:
            self._check_alive()
            self.turns += 1
            self.response_ids += ids
            self.logprobs += [float(x) for x in s.response_logprobs]
            self.mask += [True] * len(ids)
            self.token_versions += s.versions()
            v = int(s.weight_version)
            self._version = v if self._version is None else min(self._version, v)
            self.finish_reason, self.matched_stop = s.finish_reason, s.meta.get("matched_stop")
            if self._left() <= 0:
                self.done = True
                if s.finish_reason != "stop":
                    self.finish_reason = "length"
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
        with self._lock:
            self._check_alive()
            if self.done:
                return []
            if len(ids) >= self._left():
                ids = ids[: self._left()]
                self.done, self.finish_reason = True, "length"
            v = self.token_versions[-1] if self.token_versions else self._start_version
            self.response_ids += ids
            self.logprobs += [0.0] * len(ids)
            self.mask += [False] * len(ids)
            self.token_versions += [v] * len(ids)
            self.env_tokens += len(ids)
        return ids

    def text(self) -> str:
        """Everything after the prompt (policy and environment tokens), special tokens kept."""
        return self.tokenizer.decode(self.response_ids, skip_special_tokens=False)

    def abandon(self, index: int) -> Sample:
        """Stop the session (its later generate / append raise) and return what it has so far."""
        with self._lock:
            self._abandoned = True
            return self.to_sample(index)

    def to_sample(self, index: int) -> Sample:
        sample = self._to_sample(index)
        return rejected_sample(sample, self.rejected) if self.rejected is not None else sample

    def _to_sample(self, index: int) -> Sample:
        n = min(len(self.response_ids), len(self.logprobs), len(self.mask), len(self.token_versions))
        mask = self.mask[:n]
        versions = self.token_versions[:n]
        policy = sum(mask)
        weight_version = min(versions, default=self._version if self._version is not None else self._start_version)
        return Sample(
            prompt_index=index, prompt_ids=list(self.prompt_ids), response_ids=list(self.response_ids[:n]),
            response_logprobs=list(self.logprobs[:n]), finish_reason=self.finish_reason,
            weight_version=weight_version, text=None,
            meta={"turns": self.turns, "env_tokens": self.env_tokens, "policy_tokens": policy,
                  "matched_stop": self.matched_stop},
            token_versions=versions if len(set(versions)) > 1 else None,
            loss_mask=None if policy == n else list(mask))


@dataclass
class _Request:
    session: int
    turn: int
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
    """Runs the agent function over a batch of prompts (rank 0). One per run.

    Reproducibility: each engine call's seed is derived from the run's seed and its first
    request's (session, turn), so the same batch of requests gets the same seed in every run. With
    linger_s None the batches are the same in every run; with a linger, a tool (or a thread the
    machine's load delays) slower than linger_s splits a turn's batch, which changes the batches,
    and with them the samples, of that run."""

    def __init__(self, fn: AgentFn, tokenizer, *, max_response_tokens: int, concurrency: int = 64,
                 timeout_s: float = 600.0, linger_s: float | None = None, session_cls: type = AgentSession,
                 vocab_size: int | None = None):
        self.fn, self.tokenizer = fn, tokenizer
        self.vocab_size = vocab_size  # the bound of the engine's token ids (None: the engine checks them)
        self.name = getattr(fn, "__qualname__", repr(fn))
        self.max_response_tokens, self.concurrency = int(max_response_tokens), int(concurrency)
        self.timeout_s = float(timeout_s)
        self.linger_s = None if linger_s is None else float(linger_s)
        self.session_cls = session_cls

    def run(self, generate: Generate, examples: Sequence[dict], prompt_ids: Sequence[list[int]], n: int,
            sampling: SamplingParams, *, seed: int | None = None, version: int = 0) -> AgentResult:
        """n sessions per example, grouped as engine.generate groups them (example 0's n, then
        example 1's, ...). `generate` is called only from this thread. A session's timeout counts
        its own time (agent code and tools), not the time its requests wait for the engine."""
        from .rewards import _classify

        jobs = [e for e in range(len(examples)) for _ in range(n)]
        cond = threading.Condition()
        pending: list[_Request] = []
        live = [0]
        sessions: list[AgentSession | None] = [None] * len(jobs)
        outcome: list[tuple[float | None, str | None] | None] = [None] * len(jobs)
        snapshot: dict[int, Sample] = {}  # abandoned sessions, as they were then
        started = [0.0] * len(jobs)
        waited = [0.0] * len(jobs)  # seconds each session spent waiting for the engine
        waiting_since: list[float | None] = [None] * len(jobs)
        running = [True]

        def request(k: int, ids: list[int], sp: SamplingParams, turn: int) -> Sample:
            r = _Request(k, turn, ids, sp)
            with cond:
                if k in snapshot or not running[0]:
                    raise AgentTimeout(f"session {k} was abandoned")
                pending.append(r)
                waiting_since[k] = time.monotonic()
                cond.notify_all()
            try:
                while not r.done.wait(1.0):  # the dispatch loop answers every request, or the run ended
                    if k in snapshot or not running[0]:
                        raise AgentTimeout(f"session {k} was abandoned")
            finally:
                with cond:
                    if waiting_since[k] is not None:
                        waited[k] += time.monotonic() - waiting_since[k]
                        waiting_since[k] = None
            if r.error is not None:
                raise r.error
            return r.result

        def body(k: int) -> None:
            try:
                ret = self.fn(examples[jobs[k]], sessions[k])
                res = (None if ret is None else _classify(ret), None)
            except BaseException as e:  # noqa: BLE001 - a user's agent or tool: reward 0, counted
                res = (0.0, f"{type(e).__name__}: {e}")
            with cond:
                if k not in snapshot:
                    outcome[k] = res
                    live[0] -= 1
                cond.notify_all()

        def own_time(k: int, now: float) -> float:
            w = waited[k] + (now - waiting_since[k] if waiting_since[k] is not None else 0.0)
            return now - started[k] - w

        next_job = 0
        t0 = time.monotonic()
        calls = 0
        try:
            while True:
                with cond:
                    while next_job < len(jobs) and live[0] < self.concurrency:
                        k = next_job
                        next_job += 1
                        sessions[k] = self.session_cls(examples[jobs[k]], prompt_ids[jobs[k]], self.tokenizer,
                                                       lambda ids, sp, turn, k=k: request(k, ids, sp, turn), sampling,
                                                       self.max_response_tokens, version,
                                                       **({"vocab_size": self.vocab_size}
                                                          if self.vocab_size is not None else {}))
                        started[k] = time.monotonic()
                        live[0] += 1
                        threading.Thread(target=body, args=(k,), daemon=True, name=f"agent-session-{k}").start()
                    if live[0] == 0 and next_job >= len(jobs):
                        break
                    now = time.monotonic()
                    for k in range(next_job):  # sessions past their own time: abandoned, reward 0
                        if outcome[k] is None and own_time(k, now) > self.timeout_s:
                            snapshot[k] = sessions[k].abandon(jobs[k])
                            outcome[k] = (0.0, f"AgentTimeout: ran past rollout.agent_timeout_s={self.timeout_s:g}")
                            live[0] -= 1
                            for r in [r for r in pending if r.session == k]:
                                pending.remove(r)
                                r.error = AgentTimeout("abandoned")
                                r.done.set()
                    # every live session waits (the batch is the turn's, whatever the timing), or,
                    # with a linger, the oldest request has waited long enough
                    ready = pending and (len(pending) >= live[0] or (
                        self.linger_s is not None and now - pending[0].t >= self.linger_s))
                    if not ready:
                        cond.wait(timeout=min(self.linger_s, 0.5) if pending and self.linger_s else 0.5)
                        continue
                    batch = sorted(pending, key=lambda r: r.session)
                    pending.clear()
                calls += self._dispatch(generate, batch, seed)
        finally:
            with cond:
                running[0] = False
                for r in pending:
                    r.error = AgentTimeout("the rollout ended")
                    r.done.set()
                pending.clear()

        samples, rewards, errors = [], [], []
        for k, i in enumerate(jobs):
            samples.append(snapshot[k] if k in snapshot else sessions[k].to_sample(i))
            rewards.append(outcome[k][0])
            errors.append(outcome[k][1])
        stats = {"agent_errors": sum(e is not None for e in errors),
                 "turns_mean": sum(s.meta["turns"] for s in samples) / max(len(samples), 1),
                 "env_tokens": sum(s.meta["env_tokens"] for s in samples),
                 "engine_calls": calls, "t_agents": time.monotonic() - t0,
                 "rejected": sum(rejected_reason(s) is not None for s in samples)}
        return AgentResult(samples, rewards, errors, stats)

    @staticmethod
    def _dispatch(generate: Generate, batch: list[_Request], seed: int | None) -> int:
        """One engine call per distinct sampling setting (max_new_tokens, stop strings); returns
        the number of calls. An engine failure answers every request of the batch, then raises."""
        groups: dict[SamplingParams, list[_Request]] = {}
        for r in batch:
            groups.setdefault(r.sampling, []).append(r)
        try:
            for sp, reqs in groups.items():
                s = None if seed is None else seed + 7919 * reqs[0].session + 104729 * reqs[0].turn
                out = generate([r.ids for r in reqs], 1, sp, seed=s)
                if len(out) != len(reqs):
                    raise RuntimeError(f"engine returned {len(out)} samples for {len(reqs)} prompts")
                for r, x in zip(reqs, out):
                    r.result = x
                    r.done.set()
        except BaseException:
            for r in batch:  # every waiting session unwinds; the rollout fails
                if not r.done.is_set():
                    r.error = AgentTimeout("the engine failed")
                    r.done.set()
            raise
        return len(groups)


def run_and_score(runner: AgentRunner, generate: Generate, examples: Sequence[dict], prompt_ids: Sequence[list[int]],
                  n: int, sampling: SamplingParams, score, *, seed: int | None = None, version: int = 0
                  ) -> tuple[list[Sample], list[float], list[bool], dict]:
    """The agent's samples with their rewards: the agent's own, or `score(texts, examples)` (the
    run's RewardScorer) for those that returned None; 0.0 for a failed session. Returns samples,
    rewards, the scorer's raised flags and the sessions' stats (agent_errors, turns_mean,
    env_tokens). Every sample's text is set (session.text()). More failed sessions than the
    scorer's max_error_frac (reward.max_error_frac) fail the step, as failed reward calls do."""
    from .rewards import RewardError

    res = runner.run(generate, examples, prompt_ids, n, sampling, seed=seed, version=version)
    texts = [runner.tokenizer.decode(s.response_ids, skip_special_tokens=False) for s in res.samples]
    for s, t in zip(res.samples, texts):
        s.text = t
    failed = [e for e in res.errors if e is not None]
    if failed:
        log.warning("agent %s failed on %d/%d sessions (reward 0.0); first: %s", runner.name, len(failed),
                    len(res.errors), failed[0].splitlines()[0])
        limit = getattr(score, "max_error_frac", None)
        if limit is not None and len(failed) / len(res.errors) > limit:
            raise RewardError(f"rollout.agent {runner.name} failed on {len(failed)} of {len(res.errors)} sessions, "
                              f"more than reward.max_error_frac={limit:g}; first: {failed[0].splitlines()[0]}")
    rewards = [0.0 if e is not None else r for r, e in zip(res.rewards, res.errors)]
    flags = [False] * len(rewards)
    todo = [i for i, r in enumerate(rewards) if r is None]
    if todo:
        got, raised = score([texts[i] for i in todo], [examples[res.samples[i].prompt_index] for i in todo])
        for i, r, f in zip(todo, got, raised):
            rewards[i], flags[i] = float(r), bool(f)
    return res.samples, rewards, flags, res.stats
