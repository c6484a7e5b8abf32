"""Built-in synthetic verifiable tasks, small enough for a tiny Qwen3-MoE to learn on CPU.

Each task makes examples ``{"prompt": str, "answer": str, "task": name}``. The prompt is the user
turn's content (render it with `data.render_prompt`, which applies the chat template); the answer is
exactly the text a correct completion contains before the eos token.

    add      "7+5="        -> "12"      two non-negative integers below 10**digits (default digits=1)
    add2     "47+85="      -> "132"     add with digits=2 (the calculator-agent example's task)
    reverse  "reverse 307" -> "703"     a digit string of min_len..max_len digits
    sort     "sort 5129"   -> "1259"    a digit string of min_len..max_len digits, sorted ascending

Reward (`SyntheticTask.reward`, also `task_reward` for `load_reward_fn` specs):
  * 1.0 when the response, cut at the first ``<|im_end|>`` and stripped of whitespace, equals the
    answer exactly;
  * otherwise, with ``partial_credit=True`` (the default), a dense shaping term strictly below 1:
    ``0.5 * matched / max(len(answer), len(candidate))`` where ``candidate`` is the first run of
    digits in the response and ``matched`` counts positions where candidate and answer agree,
    aligned from the right for ``add`` (units with units) and from the left for ``reverse``/``sort``.
    So a well-formed near miss earns more than garbage, and only an exact answer earns 1.0;
  * 0.0 for no digits at all (or any miss with ``partial_credit=False``).

Measured learnability (hidden 64, 2 layers, 4 experts top-2, moe_intermediate 64, AdamW lr 3e-3,
batch 32 of SFT on demonstrations + eos, 1 CPU thread; accuracy = exact answers at T=1):
  sort (2..5 digits): 42% after 100 steps (4 s), 87% after 400;
  reverse (2..5 digits): 4% after 100 steps, 94% after 200 -- learned by SFT alone, little left for RL;
  add digits=1: 30% after 200 steps (5 s), 81% after 400; add digits=2: 5% after 400 steps.
So a brief warm start (sort ~100 steps, add ~200) leaves the mixed-success groups GSPO learns from.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Callable

from .tokenizer import IM_END

_DIGITS = re.compile(r"\d+")


def _gen_add(rng: random.Random, digits: int = 1) -> tuple[str, str]:
    if digits < 1:
        raise ValueError(f"add: digits must be >= 1, got {digits}")
    hi = 10**digits - 1
    a, b = rng.randint(0, hi), rng.randint(0, hi)
    return f"{a}+{b}=", str(a + b)


def _digit_string(rng: random.Random, min_len: int, max_len: int) -> str:
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len} max_len={max_len}")
    n = rng.randint(min_len, max_len)
    return "".join(rng.choice("0123456789") for _ in range(n))


def _gen_reverse(rng: random.Random, min_len: int = 2, max_len: int = 5) -> tuple[str, str]:
    s = _digit_string(rng, min_len, max_len)
    return f"reverse {s}", s[::-1]


def _gen_sort(rng: random.Random, min_len: int = 2, max_len: int = 5) -> tuple[str, str]:
    s = _digit_string(rng, min_len, max_len)
    return f"sort {s}", "".join(sorted(s))


@dataclass(frozen=True)
class TaskSpec:
    generate: Callable[..., tuple[str, str]]  # (rng, **difficulty) -> (prompt, answer)
    align_right: bool  # partial credit: compare digit positions from the right (numbers) or left


TASKS: dict[str, TaskSpec] = {
    "add": TaskSpec(_gen_add, align_right=True),
    # two-digit sums: hard for the tiny model alone (5% after 400 SFT steps), easy with a
    # calculator tool (gspo_megatron/examples/calculator_agent.py)
    "add2": TaskSpec(lambda rng: _gen_add(rng, digits=2), align_right=True),
    "reverse": TaskSpec(_gen_reverse, align_right=False),
    "sort": TaskSpec(_gen_sort, align_right=False),
}


def extract_completion(response_text: str) -> str:
    """The response up to the first eos marker, whitespace-stripped."""
    return response_text.split(IM_END, 1)[0].strip()


def score_answer(
    response_text: str, answer: str, *, align_right: bool, partial_credit: bool = True
) -> float:
    text = extract_completion(response_text)
    if text == answer:
        return 1.0
    if not partial_credit:
        return 0.0
    m = _DIGITS.search(text)
    if m is None:
        return 0.0
    cand = m.group(0)
    a, c = (answer[::-1], cand[::-1]) if align_right else (answer, cand)
    matched = sum(x == y for x, y in zip(a, c))
    score = 0.5 * matched / max(len(answer), len(cand))
    return min(score, 0.5)


class SyntheticTask:
    """A registered synthetic task with fixed difficulty; deterministic given `seed`.

    `sample_prompts(n)` draws from the task's own RNG (seeded once), so successive calls continue
    one reproducible stream; pass `rng` (a `random.Random` or an int seed) to draw independently.
    """

    def __init__(self, name: str, seed: int = 0, *, partial_credit: bool = True, **difficulty: Any):
        if name not in TASKS:
            raise ValueError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)}")
        self.name = name
        self.spec = TASKS[name]
        self.seed = seed
        self.partial_credit = partial_credit
        self.difficulty = dict(difficulty)
        self._rng = random.Random(seed)
        # validate the difficulty keywords now rather than at the first sample
        try:
            self.spec.generate(random.Random(0), **self.difficulty)
        except TypeError as e:
            raise ValueError(f"task {name!r}: bad difficulty arguments {self.difficulty}: {e}") from None

    def sample_prompts(self, n: int, rng: random.Random | int | None = None) -> list[dict]:
        if isinstance(rng, int):
            rng = random.Random(rng)
        rng = self._rng if rng is None else rng
        out = []
        for _ in range(n):
            prompt, answer = self.spec.generate(rng, **self.difficulty)
            out.append({"prompt": prompt, "answer": answer, "task": self.name})
        return out

    def reward(self, response_text: str, example: dict) -> float:
        return score_answer(
            response_text,
            str(example["answer"]),
            align_right=self.spec.align_right,
            partial_credit=self.partial_credit,
        )

    def demonstration(self, example: dict) -> str:
        """The correct completion text (without eos: append `tokenizer.eos_token_id` for SFT)."""
        return str(example["answer"])


def task_reward(response_text: str, example: dict) -> float:
    """Reward function usable as ``gspo_megatron.rollout.tasks:task_reward``; dispatches on
    ``example["task"]`` (examples made by `SyntheticTask.sample_prompts` carry it)."""
    name = example.get("task")
    if name not in TASKS:
        raise ValueError(f"example has no registered 'task' field (got {name!r})")
    return score_answer(response_text, str(example["answer"]), align_right=TASKS[name].align_right)
