"""Prompt data: loading local prompt files, rendering prompts to token ids, and a resumable stream."""
from __future__ import annotations

import json
import math
import os
import random
from decimal import Decimal
from typing import Any, Iterator, Sequence

from gspo_megatron.config import DataConfig
from gspo_megatron.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_BOM = b"\xef\xbb\xbf"


class PromptDataError(InputError):
    """A prompt file or record that cannot be used (one line naming the file and record)."""


class _Bad:
    """A record that cannot be trained on, found while reading (too big, not JSON): its place in
    the file is kept, `load_prompts` reports it like a malformed record."""

    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why


def _utf8_error(path: str, line: int, offset: int, e: UnicodeDecodeError, raw: bytes) -> PromptDataError:
    # a wrong encoding is the file's problem, not a record's: refused whole, as before
    return PromptDataError(f"{path}:{line}: not UTF-8 text (byte {offset + e.start}: {raw[e.start:e.start + 1]!r}); "
                           "re-encode the file as UTF-8")


def _json_value(text: str) -> Any:
    r"""`json.loads`, with every parse failure as `json.JSONDecodeError`'s ValueError: json.loads
    also raises plain ValueError (an integer over `sys.get_int_max_str_digits()` digits) and
    RecursionError (nesting deeper than the interpreter's recursion limit)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _lines(f, cap: int) -> Iterator[tuple[int, int, bytes | None, int]]:
    r"""(line number, byte offset, content, content size) of each line of the binary file `f` from
    where it stands. Lines end at b"\n" (b"\r\n" too: the "\r" is not content). The content of
    a line over `cap` bytes is None: it is never held whole, its rest is skipped in chunks."""
    lineno, offset = 0, f.tell()
    while True:
        # readline's limit bounds the read: cap + 2 bytes hold any line within the cap, with "\r\n"
        line = f.readline(cap + 2)
        if not line:
            return
        lineno += 1
        start, offset, tail = offset, offset + len(line), line[-2:]
        if not line.endswith(b"\n") and len(line) == cap + 2:
            while not tail.endswith(b"\n"):
                chunk = f.readline(1 << 20)
                if not chunk:
                    break
                offset += len(chunk)
                tail = tail[-1:] + chunk[-2:]  # "\r" and "\n" may arrive in two chunks
        size = offset - start - tail.endswith(b"\n") - tail.endswith(b"\r\n")
        yield lineno, start, (line[:size] if size <= cap else None), size


def _read_jsonl(path: str, max_record_bytes: int) -> tuple[list, list[int] | None]:
    r"""(records, their 1-based line numbers) of JSON lines; (records, None) of one JSON array.

    Lines end at b"\n" only (a "\r" before it is JSON whitespace): str.splitlines would also split
    at U+2028, U+2029, U+0085, \x1c-\x1e, \x0b and \x0c, which json.dumps(ensure_ascii=False)
    writes raw inside strings. A UTF-8 BOM (Windows tools write one) is skipped. A line over
    `max_record_bytes` is never held whole, decoded or parsed: it becomes a `_Bad` record.
    """
    # stdlib rather than `datasets` for JSON: Arrow schema inference would coerce a column mixing
    # "04" and 7 into integers, and answers must stay exactly as written.
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        start = len(_BOM) if head.startswith(_BOM) else 0
        if head[start:].lstrip().startswith(b"["):  # a single JSON array
            raw = head[start:] + f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _utf8_error(path, raw.count(b"\n", 0, e.start) + 1, start, e, raw) from None
            try:
                rows = _json_value(text)
            except ValueError as e:
                raise PromptDataError(f"{path}: invalid JSON: {e}") from None
            return rows, None
        f.seek(start)
        rows, lines = [], []
        for lineno, offset, body, size in _lines(f, max_record_bytes):
            if body is None:
                rows.append(_Bad(f"is {size} bytes, over data.max_record_bytes={max_record_bytes}"))
                lines.append(lineno)
                continue
            if body.startswith(_BOM):  # files joined with cat, each with its BOM
                body = body[len(_BOM):]
            if not body.strip():  # blank (ASCII whitespace only)
                continue
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _utf8_error(path, lineno, offset, e, body) from None
            try:
                rows.append(_json_value(text))
            except ValueError as e:
                rows.append(_Bad(f"is not valid JSON ({e})"))
            lines.append(lineno)
    return rows, lines


def _read_parquet(path: str) -> list:
    import datasets

    try:
        ds = datasets.Dataset.from_parquet(path, keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - pyarrow's many error types: one line naming the file
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PromptDataError(f"{path}: unreadable parquet file ({type(e).__name__}: {msg})") from None
    return ds.to_list()


def _text_bytes(value: Any) -> int:
    """UTF-8 bytes of the text in a field: a string, or the strings inside its lists and dicts
    (chat messages); other scalars by their printed length."""
    n, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            n += len(v) if v.isascii() else len(v.encode("utf-8", "surrogatepass"))
        elif isinstance(v, (bytes, bytearray)):
            n += len(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
        elif v is not None:
            n += len(str(v))
    return n


def answer_text(value: str | int | float) -> str:
    """The gold text of an answer `record_problem` accepts: a string as written, an integer in
    digits, a float in positional notation with its shortest round-trip digits and no trailing
    ".0" (5.0 -> "5", 2.5 -> "2.5", 1e-05 -> "0.00001": math-verify reads "1e-05" as 1)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int):
        return str(value)
    if value == 0:
        return "0"  # not "-0"
    text = format(Decimal(repr(value)), "f")  # repr: the shortest digits that read back as value
    return text.rstrip("0").rstrip(".") if "." in text else text


def record_problem(row: Any, prompt_key: str = "prompt", answer_key: str | None = "answer") -> str | None:
    """Why a record cannot be trained on (one phrase), or None. A prompt is a non-empty string or
    a non-empty list of chat messages ({"role": str, "content": str}); an answer is a string or a
    number (an int, a finite float; not a bool), rendered by `answer_text`: null would become the
    gold text "None", a list or dict its Python repr, which no sample matches."""
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
    if answer_key is not None:
        answer = row[answer_key]
        if answer is None:
            return f"{answer_key!r} is null"
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            return f"{answer_key!r} is {type(answer).__name__} {str(answer)[:40]}, expected a string or a number"
        if isinstance(answer, float) and not math.isfinite(answer):
            return f"{answer_key!r} is {answer}, expected a string or a (finite) number"
    return None


def load_prompts(
    path: str, *, prompt_key: str = "prompt", answer_key: str | None = "answer", skip_malformed: bool = False,
    problems: dict[int, str] | None = None, max_record_bytes: int | None = None,
) -> list[dict | None]:
    """Load prompt records from a local ``.jsonl``/``.json`` (JSON lines or one array) or
    ``.parquet`` file.

    Each record is returned with all its fields, plus ``"prompt"`` (from `prompt_key`) and, unless
    `answer_key` is None, ``"answer"`` (from `answer_key`, as text: `answer_text`). A missing
    file, an unknown suffix, an empty or undecodable file raise `PromptDataError` naming the file
    (and line). A record that cannot be trained on raises naming the record (``path:line:`` for
    JSON lines), or with `skip_malformed` becomes None in its place (positions stay those of the
    file, so a resumed prompt stream is not shifted when a record is fixed; `problems` receives
    {0-based index: why, ending in "(path:line)" for JSON lines}) — unless every record is bad,
    which is a wrong key rather than bad data and raises. Bad: malformed (`record_problem`), a
    JSON line that does not parse, or a record over `max_record_bytes` (default:
    data.max_record_bytes'), measured before it is parsed (a JSON line's bytes) or, for parquet
    rows and JSON arrays, as the UTF-8 bytes of its prompt and answer text.
    """
    path = os.fspath(path)
    cap = DataConfig.max_record_bytes if max_record_bytes is None else int(max_record_bytes)
    if not os.path.isfile(path):
        raise PromptDataError(f"prompt file not found: {path}")
    suffix = os.path.splitext(path)[1].lower()
    if suffix in JSONL_SUFFIXES:
        rows, lines = _read_jsonl(path, cap)
    elif suffix in PARQUET_SUFFIXES:
        rows, lines = _read_parquet(path), None
    else:
        raise PromptDataError(
            f"{path}: unsupported prompt file type {suffix!r} (use {JSONL_SUFFIXES + PARQUET_SUFFIXES})"
        )
    if not rows:
        raise PromptDataError(f"{path}: no records")
    out: list[dict | None] = []
    first_bad = None
    for i, row in enumerate(rows, 1):
        if isinstance(row, _Bad):
            why = row.why
        else:  # a JSON line's size was checked before parsing; a parquet row or array element
            # was parsed with its file: its size is that of the text training would tokenize
            parsed_whole = lines is None and isinstance(row, dict)
            size = _text_bytes([row.get(prompt_key), row.get(answer_key)]) if parsed_whole else 0
            why = (f"has {size} bytes of prompt and answer text, over data.max_record_bytes={cap}" if size > cap
                   else record_problem(row, prompt_key, answer_key))
        if why is not None:
            where = f"{path}:{lines[i - 1]}" if lines is not None else None
            bad = f"{where or path}: record {i} (1-based) {why}"
            first_bad = first_bad or bad
            if not skip_malformed:
                raise PromptDataError(bad)
            if problems is not None:
                problems[i - 1] = f"{why} ({where})" if where else why
            out.append(None)
            continue
        rec = dict(row)
        rec["prompt"] = row[prompt_key]
        if answer_key is not None:
            rec["answer"] = answer_text(row[answer_key])
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
