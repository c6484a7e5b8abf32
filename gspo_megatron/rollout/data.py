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


def _read_jsonl(path: str) -> list:
    # stdlib rather than `datasets` for JSON: Arrow schema inference would coerce a column mixing
    # "04" and 7 into integers, and answers must stay exactly as written.
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PromptDataError(f"{path}:{line}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                              "re-encode the file as UTF-8") from None
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
    return rows


def _read_parquet(path: str) -> list:
    import datasets

    try:
        ds = datasets.Dataset.from_parquet(path, keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - pyarrow's many error types: one line naming the file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PromptDataError(f"{path}: unreadable parquet file ({type(e).__name__}: {msg})") from None
    return ds.to_list()


def record_problem(row: Any, prompt_key: str = "prompt", answer_key: str | None = "answer") -> str | None:
    """Why a record cannot be trained on (one phrase), or None. A prompt is a non-empty string or
    a non-empty list of chat messages ({"role": str, "content": str}); an answer must be present
    and not null (str(None) would become the gold text "None", which no sample can match)."""
    if not isinstance(row, dict):
        return f"is a {type(row).__name__}, expected an object"
    for key, option in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key is not None and key not in row:
            return f"has no key {key!r} (its keys: {sorted(row)[:8]}; set {option} to the field that holds it)"
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            return f"{prompt_key!r} is an empty string"
    elif isinstance(prompt, list):
        if not prompt:
            return f"{prompt_key!r} is an empty list of messages"
        for j, m in enumerate(prompt):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return f"{prompt_key!r} message {j} is not {{'role': str, 'content': str}}: {str(m)[:60]}"
    else:
        return f"{prompt_key!r} is {type(prompt).__name__} {str(prompt)[:40]}, expected a string or chat messages"
    if answer_key is not None and row[answer_key] is None:
        return f"{answer_key!r} is null"
    return None


def load_prompts(
    path: str, *, prompt_key: str = "prompt", answer_key: str | None = "answer", skip_malformed: bool = False,
    problems: dict[int, str] | None = None,
) -> list[dict | None]:
    """Load prompt records from a local ``.jsonl``/``.json`` (JSON lines or one array) or
    ``.parquet`` file.

    Each record is returned with all its fields, plus ``"prompt"`` (from `prompt_key`) and, unless
    `answer_key` is None, ``"answer"`` (from `answer_key`, converted to ``str``). A missing file,
    an unknown suffix, an empty or undecodable file raise `PromptDataError` naming the file (and
    line). A malformed record (`record_problem`) raises naming the record, or with
    `skip_malformed` becomes None in its place (positions stay those of the file, so a resumed
    prompt stream is not shifted when a record is fixed; `problems` receives {0-based index: why})
    — unless every record is malformed, which is a wrong key rather than bad data and raises.
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
    out: list[dict | None] = []
    first_bad = None
    for i, row in enumerate(rows, 1):
        why = record_problem(row, prompt_key, answer_key)
        if why is not None:
            first_bad = first_bad or f"{path}: record {i} (1-based) {why}"
            if not skip_malformed:
                raise PromptDataError(first_bad)
            if problems is not None:
                problems[i - 1] = why
            out.append(None)
            continue
        rec = dict(row)
        rec["prompt"] = row[prompt_key]
        if answer_key is not None:
            rec["answer"] = str(row[answer_key])
        out.append(rec)
    if all(r is None for r in out):
        raise PromptDataError(f"{first_bad} (and so is every one of the {len(out)} records)")
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

    def __init__(self, examples: Sequence[Any], batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 source: str = "the data"):
        if len(examples) == 0:
            raise ValueError("PromptStream needs at least one example")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.examples = examples
        self.source = source  # named in errors (data.path)
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
            raise PromptDataError(
                f"{self.source} has {len(self.examples)} records but the checkpoint's prompt stream was saved over {n}: "
                "records were added or removed since (fixing a record in place is fine); restore the file, or "
                "start a new out_dir to train on the edited one"
            )
        if not 0 <= int(state["position"]) < len(self.examples):
            raise ValueError(f"PromptStream state position {state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.seed = state["seed"]
        self._order_epoch = None
