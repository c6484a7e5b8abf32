"""Prompt data: loading local prompt files, rendering prompts to token ids, and a resumable stream."""
from __future__ import annotations

import json
import os
import random
from typing import Any, Iterator, Sequence

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


class PromptDataError(ValueError):
    pass


def _read_jsonl(path: str) -> list[dict]:
    # stdlib rather than `datasets` for JSON: Arrow schema inference would coerce a column mixing
    # "04" and 7 into integers, and answers must stay exactly as written.
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):  # a single JSON array
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise PromptDataError(f"{path}: invalid JSON: {e}") from None
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PromptDataError(f"{path}:{lineno}: invalid JSON line: {e}") from None
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise PromptDataError(f"{path}: record {i + 1} (1-based) is a {type(row).__name__}, expected an object")
    return rows


def _read_parquet(path: str) -> list[dict]:
    import datasets

    ds = datasets.Dataset.from_parquet(path, keep_in_memory=True)
    return ds.to_list()


def load_prompts(
    path: str, *, prompt_key: str = "prompt", answer_key: str | None = "answer"
) -> list[dict]:
    """Load prompt records from a local ``.jsonl``/``.json`` (JSON lines or one array) or
    ``.parquet`` file.

    Each record is returned with all its fields, plus ``"prompt"`` (from `prompt_key`) and, unless
    `answer_key` is None, ``"answer"`` (from `answer_key`, converted to ``str``). A missing file,
    an unknown suffix, an empty file, or a record lacking a key raises `PromptDataError` naming the
    file and the key.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PromptDataError(f"prompt file not found: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in JSONL_SUFFIXES:
        rows = _read_jsonl(path)
    elif suffix in PARQUET_SUFFIXES:
        rows = _read_parquet(path)
    else:
        raise PromptDataError(
            f"{path}: unsupported prompt file type {suffix!r} (use {JSONL_SUFFIXES + PARQUET_SUFFIXES})"
        )
    if not rows:
        raise PromptDataError(f"{path}: no records")
    out = []
    for i, row in enumerate(rows, 1):
        for key, option in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
            if key is not None and key not in row:
                raise PromptDataError(
                    f"{path}: record {i} (1-based) has no key {key!r} (its keys: {sorted(row)}; set "
                    f"{option} to the field that holds it)"
                )
        rec = dict(row)
        rec["prompt"] = row[prompt_key]
        if answer_key is not None:
            rec["answer"] = str(row[answer_key])
        out.append(rec)
    return out


def render_prompt(tokenizer: Any, text: str | Sequence[dict]) -> list[int]:
    """Token ids of a prompt: with a chat template, the user turn plus the generation prompt
    (``text`` may also be a ready list of chat messages); without one, plain ``encode``."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else list(text)
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # the template already wrote every special token it wants
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    if not isinstance(text, str):
        raise TypeError("chat messages given but the tokenizer has no chat template")
    return list(tokenizer.encode(text))


class PromptStream:
    """Endless batches of examples in a shuffled order that is a pure function of (seed, epoch).

    Batches are always full: a batch that runs past the end of an epoch continues with the next
    epoch's order. ``state_dict()`` -> ``{"epoch", "position", "seed", "num_examples"}`` is the
    position of the next example; after ``load_state_dict`` the stream continues exactly where the
    saved one would have.
    """

    def __init__(self, examples: Sequence[Any], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        if len(examples) == 0:
            raise ValueError("PromptStream needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.examples = examples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order_epoch: int | None = None
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(f"{self.seed}:{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_batch(self, batch_size: int | None = None) -> list[Any]:
        """The next `batch_size` (default: the stream's) examples."""
        k = self.batch_size if batch_size is None else batch_size
        out = []
        while len(out) < k:
            order = self._epoch_order()
            take = min(k - len(out), len(order) - self.position)
            out.extend(self.examples[i] for i in order[self.position : self.position + take])
            self.position += take
            if self.position == len(order):
                self.epoch += 1
                self.position = 0
        return out

    def __iter__(self) -> Iterator[list[Any]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict) -> None:
        n = state.get("num_examples", len(self.examples))
        if n != len(self.examples):
            raise ValueError(
                f"PromptStream state was saved over {n} examples, this stream has {len(self.examples)}"
            )
        if not 0 <= int(state["position"]) < len(self.examples):
            raise ValueError(f"PromptStream state position {state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = state["seed"]
        self._order_epoch = None
