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

from gspo_megatron.errors import ConfigError, InputError

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, dict], float]

# What a reward function (or its module, at import) may raise and still be only a failure of
# that call when it runs in the caller's own thread (load_reward_fn, score_samples).
# KeyboardInterrupt is left out: in the main thread it cannot be told from the operator's Ctrl-C.
# RewardScorer runs calls in a helper thread or a worker process, where every BaseException is
# the reward's own.
_SAME_THREAD_FAILURES = (Exception, SystemExit, GeneratorExit)


class RewardSpecError(ConfigError):
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
    except _SAME_THREAD_FAILURES as e:  # ImportError, or whatever the module raises at import (sys.exit too)
        raise RewardSpecError(f"reward spec {spec!r}: cannot import module {mod_name!r}: {_describe(e)}") from e
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


# The largest float32 (torch.finfo(torch.float32).max, written out so this module needs no torch):
# the trainer holds rewards in float32 (train/loop.py to_train_samples), where 1e39 - a finite
# float64 - is inf and the advantages and the loss become NaN.
FLOAT32_MAX = float.fromhex("0x1.fffffep+127")


def _short(obj, limit: int = 60) -> str:
    """repr(obj) on one line, at most `limit` characters; never raises (a user's object may have
    any __repr__)."""
    import reprlib

    try:
        text = " ".join(reprlib.repr(obj).split())
    except Exception:  # noqa: BLE001 - only for the message
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(e: BaseException) -> str:
    """`Type: first line of the message` (just `Type` without one); never raises."""
    try:
        msg = str(e).splitlines()[0] if str(e) else ""
    except Exception:  # noqa: BLE001 - a broken __str__
        msg = ""
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _classify(r) -> float:
    """A reward call's result as a float the trainer can hold in float32, else an exception saying
    why not. Numbers are what `float()` accepts except text: ints, floats, numpy and one-element
    torch scalars, and bools (a verifier's verdict: 1.0 / 0.0). NaN, inf and finite values beyond
    the float32 range (|r| > 3.4e38) are refused."""
    if isinstance(r, (str, bytes, bytearray)):
        raise TypeError(f"reward must be a number, got {type(r).__name__} {_short(r)}")
    try:
        v = float(r)
    except Exception:  # noqa: BLE001 - None, complex, lists, many-element tensors, ...
        raise TypeError(f"reward must be a number, got {type(r).__name__} {_short(r)}") from None
    if not math.isfinite(v):
        raise ValueError(f"reward is not finite: {v}")
    if abs(v) > FLOAT32_MAX:
        raise ValueError(f"reward {v:g} is outside the float32 range (|r| <= 3.4e38) the trainer computes in")
    return v


def score_samples(
    fn: RewardFn, responses: Sequence[str], examples: Sequence[dict]
) -> tuple[list[float], list[bool]]:
    """Score each (response, example) pair in this thread; never raises because of the reward function.

    A sample whose reward call raises (SystemExit and GeneratorExit included; a KeyboardInterrupt
    propagates, see _SAME_THREAD_FAILURES), or returns something that is not a finite number in
    float32 range, gets reward 0.0 and ``raised=True``. The first such failure of the call is
    logged once (with the count of failures), the rest silently.
    """
    if len(responses) != len(examples):
        raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
    rewards: list[float] = []
    raised: list[bool] = []
    first: str | None = None
    for resp, ex in zip(responses, examples):
        try:
            r = _classify(fn(resp, ex))
        except _SAME_THREAD_FAILURES as e:
            if first is None:
                first = _describe(e)
            rewards.append(0.0)
            raised.append(True)
        else:
            rewards.append(r)
            raised.append(False)
    if first is not None:
        name = getattr(fn, "__qualname__", repr(fn))
        logger.warning("reward function %s raised on %d/%d samples (scored 0.0); first: %s",
                       name, sum(raised), len(raised), first)
    return rewards, raised


class RewardError(InputError):
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


def _call(fn: RewardFn, resp: str, ex: dict) -> tuple[bool, float | str]:
    """One reward call in a helper thread or a worker process: (True, reward) or (False, reason).
    Every BaseException is the sample's failure: there, SystemExit, KeyboardInterrupt or
    GeneratorExit can only come from the reward's own code."""
    try:
        return True, _classify(fn(resp, ex))
    except BaseException as e:  # noqa: BLE001 - see above
        return False, _describe(e)


# -- worker processes (reward.workers > 0)

# Longest a new worker may take to start (spawn, re-import the entry module, build the reward
# function) before the calls waiting for it fail; reward.timeout_s when that is longer.
WORKER_START_S = 300.0


def _ignore(signum, frame) -> None:
    """A handler that does nothing: a Python handler, unlike SIG_IGN, is reset by exec, so
    subprocesses a reward starts still get the default actions."""


def _worker_main(conn, recipe: Recipe, parent_pid: int) -> None:
    """A reward worker process: builds the function from its recipe, says ("ready",) (or
    ("init_failed", reason)), then answers each (i, response, example) with (i, ok, value) until
    its pipe closes.

    SIGINT, SIGTERM and SIGUSR1 do nothing here: a Ctrl-C, Slurm's signals to every process of the
    job or a preemption notice are for the trainer, which finishes its step (its rewards
    included) and then kills its workers. A thread ends the process when the trainer is gone
    (killed with SIGKILL), so no worker outlives it by more than a second, hung call or not."""
    import os
    import signal
    import threading
    import time

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _ignore)

    def watch_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch_parent, name="reward-worker-watchdog", daemon=True).start()
    try:
        fn = build_reward_fn(recipe)
    except BaseException as e:  # noqa: BLE001 - the worker cannot score: say why
        conn.send(("init_failed", _describe(e)))
        return
    conn.send(("ready",))
    while True:
        try:
            i, resp, ex = conn.recv()
        except (EOFError, OSError):  # the trainer closed the pipe (close()) or is gone
            return
        ok, val = _call(fn, resp, ex)
        try:
            conn.send((i, ok, val))
        except OSError:  # the trainer is gone
            return


def _exit_reason(proc) -> str:
    """How a worker process that is gone ended, for the sample's reason."""
    proc.join(timeout=5)
    code = proc.exitcode
    if code is not None and code < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class _Worker:
    """One worker process, its pipe, and the sample it is scoring (`job`, since `started`)."""

    def __init__(self, recipe: Recipe):
        import multiprocessing as mp
        import os
        import time

        ctx = mp.get_context("spawn")  # fork would copy the trainer's threads and locks
        self.conn, child = ctx.Pipe()
        # not daemonic: a daemonic process may not start children, which a reward may need
        # (a sandbox); close() and the scorer's finalizer kill it instead
        self.proc = ctx.Process(target=_worker_main, args=(child, recipe, os.getpid()), name="reward-worker")
        self.proc.start()
        child.close()
        self.born = time.monotonic()
        self.ready = False
        self.job: int | None = None
        self.started = 0.0

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def _kill_all(workers: list) -> None:
    while workers:
        workers.pop().kill()


class RewardScorer:
    """`scorer(texts, examples) -> (rewards, raised)` for the trainer (rank 0).

    Every call is bounded by `timeout_s`; a sample whose call raised (any BaseException:
    SystemExit(0), KeyboardInterrupt and GeneratorExit included), returned something that is not
    a finite number in float32 range, timed out or lost its worker process gets 0.0 and
    raised=True, with its reason in `last_errors`; when more than `max_error_frac` of one call's
    samples failed, RewardError names the first failure in one line. In workers mode no
    exception, exit, crash or hang of a reward ends or stalls the trainer.

    workers = 0: calls run one at a time in a helper (daemon) thread of the trainer's process
    (see _score_in_thread for a call past its timeout). What a thread cannot contain: a reward
    that calls os._exit, or holds the GIL in one long C call, stops or stalls the trainer itself.
    workers = N: N worker processes (spawned; each builds the function from its recipe) score in
    parallel, one call each at a time, each call timed from when its worker receives it. A worker
    whose call is late is killed; one that ends during a call (os._exit, a crash, the OOM killer)
    fails that call only, seen as soon as the process is gone; either way a new worker replaces
    it. Safe to call from several threads (calls to the workers are serialised)."""

    def __init__(self, recipe: Recipe, *, workers: int = 0, timeout_s: float = 60.0, max_error_frac: float = 0.5,
                 fn: RewardFn | None = None):
        from multiprocessing.util import Finalize

        self.recipe = recipe
        self.fn = fn if fn is not None else build_reward_fn(recipe)
        self.name = getattr(self.fn, "__qualname__", repr(self.fn))
        self.workers, self.timeout_s, self.max_error_frac = workers, timeout_s, max_error_frac
        self.last_errors: list[str | None] = []  # the last call's reason per sample (None: scored)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        # Kills the workers when the scorer is collected, and at interpreter exit before
        # multiprocessing joins its non-daemonic children (which would wait for a hung or idle
        # worker forever): its exit handler runs finalizers of exitpriority >= 0 first
        # (CPython 3.11 multiprocessing/util.py:334 runs them, :357 joins).
        self._finalizer = Finalize(self, _kill_all, args=(self._workers,), exitpriority=10)

    def close(self) -> None:
        with self._lock:
            _kill_all(self._workers)

    # -- workers = 0
    def _score_in_thread(self, responses, examples, rewards, raised, errors) -> None:
        """workers = 0: the batch is scored one sample after another in a helper thread - one
        handoff per batch (a handoff per sample cost ~0.25 ms each in thread wake-ups) - and each
        call is waited for at most timeout_s from its start (or, until the thread reaches it, from
        the handoff or the previous call's end).

        A call past its timeout is scored 0 and abandoned with its thread, and the rest of the
        batch goes on at once in a fresh thread, so one hung call costs the batch timeout_s and
        no more. The abandoned thread cannot be stopped (Python has no way to): it runs its call
        until that returns, if ever, then sees it was abandoned, drops the result and ends without
        touching any later sample. It is a daemon thread, so it never holds the process at exit;
        until then it keeps whatever the call holds (one thread per hung call)."""
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
                    out = _call(self.fn, responses[j], examples[j])
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
                            errors[i] = val
                        i += 1
                        handed = time.monotonic()  # the next call starts about now
                        continue
                    left = state["started"].get(i, handed) + self.timeout_s - time.monotonic()
                    if left <= 0:
                        late = True
                        state["abandoned"] = True
                        errors[i] = f"timed out after {self.timeout_s:g} s (reward.timeout_s)"
                        i += 1
                    else:
                        cond.wait(timeout=left)

    # -- workers = N
    def _score_in_workers(self, responses, examples, rewards, raised, errors) -> None:
        """Hand each idle, started worker the next sample; wait (multiprocessing.connection.wait)
        for an answer, a worker's end (its process sentinel) or the nearest deadline."""
        import time
        from collections import deque
        from multiprocessing.connection import wait

        todo = deque(range(len(responses)))
        start_limit = max(WORKER_START_S, self.timeout_s)
        workers = self._workers

        def fail_todo(reason: str) -> None:
            while todo:
                errors[todo.popleft()] = reason

        def retire(w: _Worker) -> None:
            w.kill()
            workers.remove(w)

        while todo or any(w.job is not None for w in workers):
            while todo and len(workers) < self.workers:
                workers.append(_Worker(self.recipe))
            now = time.monotonic()
            for w in workers:
                if w.ready and w.job is None and todo:
                    i = todo.popleft()
                    try:
                        w.conn.send((i, responses[i], examples[i]))
                    except (BrokenPipeError, ConnectionResetError, EOFError):
                        todo.appendleft(i)  # the worker is gone: seen below, the sample goes to another
                        continue
                    except Exception as e:  # noqa: BLE001 - e.g. an example that does not pickle
                        errors[i] = f"cannot pass the sample to a reward worker: {_describe(e)}"
                        continue
                    w.job, w.started = i, now
            deadlines = [w.started + self.timeout_s if w.ready else w.born + start_limit
                         for w in workers if w.job is not None or not w.ready]
            wait([w.conn for w in workers] + [w.proc.sentinel for w in workers],
                 timeout=max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)
            now = time.monotonic()
            for w in list(workers):
                msg, lost = None, False
                try:
                    if w.conn.poll():
                        msg = w.conn.recv()
                except Exception:  # noqa: BLE001 - EOF, or a reward that wrote into or closed the pipe
                    lost = True
                if msg is not None:
                    if msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "init_failed":
                        retire(w)
                        fail_todo(f"a reward worker could not build the reward function: {msg[1]}")
                    elif msg[0] == w.job:
                        _, ok, val = msg
                        if ok:
                            rewards[w.job], raised[w.job] = val, False
                        else:
                            errors[w.job] = val
                        w.job = None
                    continue  # a worker that ended after answering is seen on the next round
                if lost:
                    # an ending process closes its files before it can be reaped: the trainer can see
                    # the pipe break first; give it a moment to be gone, to say how it ended. Polled:
                    # join(timeout) blocks in waitpid once the sentinel reads EOF, and a process that
                    # closed all its files (the sentinel's too) may live on (multiprocessing/popen_fork.py:36-43)
                    gone_by = time.monotonic() + 2.0
                    while w.proc.is_alive() and time.monotonic() < gone_by:
                        time.sleep(0.01)
                if lost or not w.proc.is_alive():
                    why = _exit_reason(w.proc) if not w.proc.is_alive() else "stopped answering (its pipe broke)"
                    if w.job is not None:
                        errors[w.job] = f"the reward worker process {why} during the call"
                    elif not w.ready:  # it never started (its recipe ends the process): do not retry forever
                        fail_todo(f"a reward worker process {why} while starting")
                    retire(w)
                elif w.job is not None and now - w.started >= self.timeout_s:
                    errors[w.job] = f"timed out after {self.timeout_s:g} s (reward.timeout_s)"
                    retire(w)  # kills the hung call
                elif not w.ready and now - w.born >= start_limit:
                    retire(w)
                    fail_todo(f"a reward worker did not start within {start_limit:g} s")

    # -- scoring
    def __call__(self, responses: Sequence[str], examples: Sequence[dict]) -> tuple[list[float], list[bool]]:
        if len(responses) != len(examples):
            raise ValueError(f"{len(responses)} responses but {len(examples)} examples")
        n = len(responses)
        rewards, raised = [0.0] * n, [True] * n
        errors: list[str | None] = [None] * n
        if self.workers > 0:
            with self._lock:
                self._score_in_workers(responses, examples, rewards, raised, errors)
        else:
            self._score_in_thread(responses, examples, rewards, raised, errors)
        self.last_errors = errors
        n_bad = sum(raised)
        first = next((e for e in errors if e is not None), "")
        if n_bad:
            logger.warning("reward function %s failed on %d/%d samples (scored 0.0); first: %s",
                           self.name, n_bad, n, first)
        if n and n_bad / n > self.max_error_frac:
            raise RewardError(f"reward function {self.name} failed on {n_bad} of {n} samples, more "
                              f"than reward.max_error_frac={self.max_error_frac:g}; first: {first}")
        return rewards, raised
