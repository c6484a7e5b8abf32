"""Reward functions: loading user functions by spec, a math-verify reward, and fault-tolerant scoring.

A reward function has the signature ``fn(response_text: str, example: dict) -> float``.
`RewardScorer` runs it for the trainer: every call bounded by a timeout, optionally in a pool of
worker processes, and a step whose calls fail too often stops the run in one line (a reward that
always raises would otherwise train on zeros forever).
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


def _classify(r) -> float:
    """A reward call's result as a finite float, else an exception describing it."""
    if isinstance(r, (str, bytes)):
        raise TypeError(f"reward must be a number, got {type(r).__name__} {r!r}")
    r = float(r)  # int, bool, numpy / 0-d torch scalars
    if not math.isfinite(r):
        raise ValueError(f"reward is not finite: {r}")
    return r


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
            r = _classify(fn(resp, ex))
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


class RewardError(ValueError):
    """A step's reward calls failed more often than reward.max_error_frac allows (one line)."""


# What a worker process builds its reward function from (the function itself may not pickle):
# ("task", name, seed) | ("math",) | ("spec", "package.module:function")
Recipe = tuple


def build_reward_fn(recipe: Recipe) -> RewardFn:
    kind = recipe[0]
    if kind == "task":
        from gspo_megatron.rollout.tasks import SyntheticTask

        return SyntheticTask(recipe[1], seed=recipe[2]).reward
    if kind == "math":
        return math_reward
    if kind == "spec":
        return load_reward_fn(recipe[1])
    raise ValueError(f"unknown reward recipe {recipe!r}")


_WORKER_FN: RewardFn | None = None  # the worker process's reward function (set by its initializer)


def _worker_init(recipe: Recipe) -> None:
    global _WORKER_FN
    _WORKER_FN = build_reward_fn(recipe)


def _worker_call(resp: str, ex: dict):
    try:
        return True, _classify(_WORKER_FN(resp, ex))
    except Exception as e:  # noqa: BLE001 - reported back as the sample's failure
        return False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


class RewardScorer:
    """`scorer(texts, examples) -> (rewards, raised)` for the trainer (rank 0).

    workers = 0: calls run one at a time in a helper (daemon) thread, each waited for at most
    `timeout_s`; a call that does not return in time is abandoned (the thread is replaced; Python
    cannot stop it) and scored 0. workers = N: N worker processes (spawned; each builds the function from
    its recipe) score in parallel; a call past its timeout is scored 0 and the pool is replaced,
    which kills the hung worker. Either way a sample whose call raised, returned a non-number or
    timed out gets 0.0 and raised=True, and when more than `max_error_frac` of one call's samples
    failed, RewardError names the first failure."""

    def __init__(self, recipe: Recipe, *, workers: int = 0, timeout_s: float = 60.0, max_error_frac: float = 0.5,
                 fn: RewardFn | None = None):
        self.recipe = recipe
        self.fn = fn if fn is not None else build_reward_fn(recipe)
        self.name = getattr(self.fn, "__qualname__", repr(self.fn))
        self.workers, self.timeout_s, self.max_error_frac = workers, timeout_s, max_error_frac
        self._pool = None

    # -- executors
    def _process_pool(self):
        if self._pool is None:
            import multiprocessing as mp
            from concurrent.futures import ProcessPoolExecutor

            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_worker_init, initargs=(self.recipe,))
        return self._pool

    def _drop(self, which: str) -> None:
        ex = getattr(self, which)
        setattr(self, which, None)
        if ex is None:
            return
        if which == "_pool":  # kill the workers (a hung call never returns)
            for p in list(getattr(ex, "_processes", {}).values()):
                p.kill()
        ex.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        self._drop("_pool")

    def _score_in_thread(self, responses, examples, rewards, raised, errors) -> None:
        """workers = 0: the batch is scored one sample after another in the helper thread - one
        handoff per batch (a handoff per sample cost ~0.25 ms each in thread wake-ups) - and each
        call is waited for at most timeout_s from its start (or, until the thread reaches it, from
        the handoff or the previous call's end). A late call is scored 0 and abandoned with its
        thread; the rest of the batch goes on in a fresh one."""
        import time

        n, i = len(responses), 0
        while i < n:
            cond = threading.Condition()
            state = {"started": {}, "done": {}, "abandoned": False}

            def work(first: int, cond=cond, state=state) -> None:
                for j in range(first, n):
                    with cond:
                        if state["abandoned"]:
                            return
                        state["started"][j] = time.monotonic()
                    try:
                        out = (True, _classify(self.fn(responses[j], examples[j])))
                    except Exception as err:  # noqa: BLE001 - the sample's failure
                        out = (False, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                    with cond:
                        state["done"][j] = out
                        cond.notify_all()

            handed = time.monotonic()
            # a daemon thread per batch: an abandoned (hung) call must not hold the process at exit,
            # which a ThreadPoolExecutor's worker did (interpreter shutdown joins those)
            threading.Thread(target=work, args=(i,), name="reward", daemon=True).start()
            late = False
            with cond:
                while i < n and not late:
                    if i in state["done"]:
                        ok, val = state["done"].pop(i)
                        if ok:
                            rewards[i], raised[i] = val, False
                        else:
                            errors.append(val)
                        i += 1
                        handed = time.monotonic()  # the next call starts about now
                        continue
                    left = state["started"].get(i, handed) + self.timeout_s - time.monotonic()
                    if left <= 0:
                        late = True
                        state["abandoned"] = True
                        errors.append(f"timed out after {self.timeout_s:g} s (reward.timeout_s)")
                        i += 1
                    else:
                        cond.wait(timeout=left)
            # late: the thread is abandoned (it returns after its call); the rest of the batch,
            # and the next batch, get a fresh one

    # -- scoring
    def __call__(self, responses: Sequence[str], examples: Sequence[dict]) -> tuple[list[float], list[bool]]:
        import time
        from concurrent.futures import TimeoutError as FutureTimeout

        if len(responses) != len(examples):
            raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
        rewards, raised = [0.0] * len(responses), [True] * len(responses)
        errors: list[str] = []
        timed_out = False
        if self.workers > 0:
            pool = self._process_pool()
            futs = [pool.submit(_worker_call, r, e) for r, e in zip(responses, examples)]
            # every call has timeout_s of its own once a worker takes it: wait for the batch's
            # share of the workers' time, then whatever is unfinished is late
            deadline = time.monotonic() + self.timeout_s * max(1, -(-len(futs) // self.workers))
            for i, f in enumerate(futs):
                try:
                    ok, val = f.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    timed_out = True
                    errors.append(f"timed out after {self.timeout_s:g} s (reward.timeout_s)")
                    continue
                except Exception as e:  # noqa: BLE001 - a worker that died: the sample's failure
                    errors.append(f"{type(e).__name__}: {e}")
                    continue
                if ok:
                    rewards[i], raised[i] = val, False
                else:
                    errors.append(val)
            if timed_out:
                self._drop("_pool")
        else:
            self._score_in_thread(responses, examples, rewards, raised, errors)
        n_bad = sum(raised)
        if n_bad:
            logger.warning("reward function %s failed on %d/%d samples (scored 0.0); first: %s",
                           self.name, n_bad, len(raised), errors[0] if errors else "")
        if responses and n_bad / len(responses) > self.max_error_frac:
            raise RewardError(f"reward function {self.name} failed on {n_bad} of {len(responses)} samples, more "
                              f"than reward.max_error_frac={self.max_error_frac:g}; first: {errors[0]}")
        return rewards, raised
