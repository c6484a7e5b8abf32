"""Prompt records (rollout/data.py): every valid JSONL file reads back the records written to it;
a record that cannot be trained on (an answer that is no string or number, a record over
data.max_record_bytes) is named by --dry-run with its file:line and skipped and counted by
training, and an oversized record never reaches the tokenizer."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import types

import pytest

from gspo_megatron.rollout.data import PromptDataError, load_prompts, record_problem
from run_output import explain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")

# Every character Python's str.splitlines splits on, the C0/C1 controls, a BOM inside a string,
# JSON's own escapes, a non-BMP character.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
NASTY = LINE_BREAKS + "\x00\x01\x1f\x7f\x9f\t\ufeff\"\\/ \u00e9\u4e2d\U0001F600"


def _random_text(rng: random.Random, surrogates: bool) -> str:
    alphabet = NASTY + "ab{}[]:,0123456789"
    n = rng.randint(0, 12)
    chars = [rng.choice(alphabet) for _ in range(n)]
    if surrogates and rng.random() < 0.3:  # a lone surrogate: only writable as an escape
        chars.insert(rng.randint(0, n), chr(rng.randint(0xD800, 0xDFFF)))
    return "".join(chars)


def _write(path, records, *, ensure_ascii: bool, newline: str = "\n", blank_every: int = 0, last_newline=True,
           bom: bool = False):
    lines = []
    for i, r in enumerate(records):
        if blank_every and i % blank_every == 0:
            lines.append(rng_blank(i))
        lines.append(json.dumps(r, ensure_ascii=ensure_ascii))
    text = newline.join(lines) + (newline if last_newline else "")
    data = text.encode("utf-8", "surrogatepass" if ensure_ascii else "strict")
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + data)


def rng_blank(i: int) -> str:
    return ["", "   ", "\t", " \r"][i % 4]  # blank lines, also with CRLF-style residue


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_jsonl_round_trips_every_separator_and_control_character(tmp_path, ensure_ascii):
    """Before: str.splitlines split a line at a raw U+2028 / U+2029 / U+0085 inside a string
    (json.dumps(ensure_ascii=False) writes them raw), and the file was refused whole."""
    rng = random.Random(1234 + ensure_ascii)
    for trial in range(60):
        records = [{"prompt": "q" + _random_text(rng, ensure_ascii), "answer": _random_text(rng, ensure_ascii),
                    "meta": {"k" + _random_text(rng, ensure_ascii): [_random_text(rng, ensure_ascii), 1.5, None]}}
                   for _ in range(rng.randint(1, 6))]
        p = tmp_path / f"t{trial}.jsonl"
        _write(p, records, ensure_ascii=ensure_ascii, newline=rng.choice(["\n", "\r\n"]),
               blank_every=rng.choice([0, 2, 3]), last_newline=rng.random() < 0.5, bom=rng.random() < 0.3)
        got = load_prompts(str(p))
        assert got == records, (trial, p.read_bytes()[:400])
        array = tmp_path / f"t{trial}.json"  # the same records as one JSON array
        text = json.dumps(records, ensure_ascii=ensure_ascii, indent=rng.choice([None, 1]))
        array.write_bytes(text.encode("utf-8", "surrogatepass" if ensure_ascii else "strict"))
        assert load_prompts(str(array)) == records, trial


def test_raw_unicode_line_separators_inside_a_string_read_fine(tmp_path):
    p = tmp_path / "u.jsonl"
    recs = [{"prompt": "first\u2028line", "answer": "1"}, {"prompt": "next\x85line\u2029", "answer": "2"}]
    p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    assert "\u2028" in p.read_text(encoding="utf-8")  # written raw, not escaped
    assert load_prompts(str(p)) == recs


def test_a_utf8_bom_is_accepted(tmp_path):
    """Before: `invalid JSON line: Unexpected UTF-8 BOM` (JSONL) or `invalid JSON` (array)."""
    recs = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in recs).encode())
    assert load_prompts(str(lines)) == recs
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(recs, indent=1).encode())
    assert load_prompts(str(array)) == recs


def test_last_line_without_newline_blank_lines_and_crlf(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'\r\n{"prompt": "a", "answer": "1"}\r\n\r\n  \n{"prompt": "b", "answer": 2}')
    assert load_prompts(str(p)) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


@pytest.mark.parametrize("value, text", [
    (5, "5"), ("05", "05"), (-3, "-3"), (5.0, "5"), (2.5, "2.5"), (-0.125, "-0.125"), (1e-05, "0.00001"),
    (1e16, "10000000000000000"), (0.1, "0.1"), (123456789012345678901234567890, "123456789012345678901234567890"),
])
def test_numeric_answers_are_rendered_as_math_verify_reads_them(tmp_path, value, text):
    """Before: 1e-05 became the gold text "1e-05", which math-verify parses as 1."""
    p = tmp_path / "n.jsonl"
    p.write_text(json.dumps({"prompt": "q", "answer": value}) + "\n")
    (rec,) = load_prompts(str(p))
    assert rec["answer"] == text
    if isinstance(value, float):
        from math_verify import parse

        assert float(parse(rec["answer"])[0]) == value  # the gold value math_reward compares with


@pytest.mark.parametrize("line, why", [
    ('{"prompt": "q", "answer": [1, 2]}', "'answer' is list [1, 2], expected a string or a number"),
    ('{"prompt": "q", "answer": {"x": 1}}', "'answer' is dict {'x': 1}, expected a string or a number"),
    ('{"prompt": "q", "answer": true}', "'answer' is bool True, expected a string or a number"),
    ('{"prompt": "q", "answer": NaN}', "'answer' is nan, expected a string or a (finite) number"),
    ('{"prompt": "q", "answer": -Infinity}', "'answer' is -inf, expected a string or a (finite) number"),
])
def test_answers_that_are_no_string_or_number_are_named(tmp_path, line, why):
    """Before: [1, 2] became the gold text "[1, 2]", True became "True", silently."""
    p = tmp_path / "a.jsonl"
    p.write_text('{"prompt": "ok", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(PromptDataError) as e:
        load_prompts(str(p))
    assert str(e.value) == f"{p}:3: record 2 (1-based) {why}"
    problems = {}
    got = load_prompts(str(p), skip_malformed=True, problems=problems)
    assert got[1] is None and problems == {1: f"{why} ({p}:3)"}
    assert record_problem(json.loads(line)) == why


def test_parquet_rows_are_checked_alike(tmp_path):
    import datasets

    pq = tmp_path / "p.parquet"
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b" * 5000, "answer": "2"}, {"prompt": "c", "answer": "3"}]
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    problems = {}
    got = load_prompts(str(pq), skip_malformed=True, problems=problems, max_record_bytes=1000)
    assert [g and g["prompt"] for g in got] == ["a", None, "c"]
    assert "5001 bytes of prompt and answer text, over data.max_record_bytes=1000" in problems[1]
    with pytest.raises(PromptDataError, match=r"p\.parquet: record 2 \(1-based\) has 5001 bytes"):
        load_prompts(str(pq), max_record_bytes=1000)


def test_a_json_line_that_does_not_parse_is_a_skipped_record(tmp_path):
    """Unparsable lines (a truncated line, 5000-digit integers, nesting deeper than the JSON
    parser's recursion limit, a raw form feed inside a string: json.dumps always escapes C0
    controls, so only a non-JSON writer leaves one) are malformed records: skipped and counted,
    never a traceback. Before: the whole file was refused (the form feed split the line)."""
    p = tmp_path / "j.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "ans\n'
                 + '{"prompt": "c", "answer": ' + "9" * 5000 + "}\n" + "[" * 100000 + "\n"
                 + '{"prompt": "e\x0cf", "answer": "5"}\n{"prompt": "d", "answer": "4"}\n')
    problems = {}
    got = load_prompts(str(p), skip_malformed=True, problems=problems)
    assert [g and g["prompt"] for g in got] == ["a", None, None, None, None, "d"]
    assert sorted(problems) == [1, 2, 3, 4] and all("is not valid JSON" in w for w in problems.values())
    assert problems[2].endswith(f"({p}:3)")
    with pytest.raises(PromptDataError, match=rf"{p.name}:2: record 2 \(1-based\) is not valid JSON"):
        load_prompts(str(p))


def test_record_size_is_the_line_without_its_ending_at_every_boundary(tmp_path):
    """Sizes around the cap, "\n" or "\r\n" endings, a last line without one, and lines long
    enough that their skipped rest arrives in several chunks with "\r" and "\n" split apart."""
    rng = random.Random(7)
    cap = 64
    empty = len(json.dumps({"prompt": "", "answer": "1"}))
    for trial in range(40):
        sizes = [rng.choice([cap - 1, cap, cap + 1, cap + 2, cap + 3, empty + 1, (1 << 20) - 1 + rng.randint(0, 3)])
                 for _ in range(rng.randint(1, 5))]
        lines = [json.dumps({"prompt": "x" * (n - empty), "answer": "1"}) for n in sizes]
        endings = [rng.choice(["\n", "\r\n"]) for _ in lines]
        if rng.random() < 0.5:
            endings[-1] = ""
        p = tmp_path / f"s{trial}.jsonl"
        p.write_text("".join(x + e for x, e in zip(lines, endings)), newline="")
        problems = {}
        try:
            got = load_prompts(str(p), skip_malformed=True, problems=problems, max_record_bytes=cap)
        except PromptDataError as e:  # every record over the cap
            assert all(n > cap for n in sizes) and f"is {sizes[0]} bytes" in str(e)
            continue
        for i, n in enumerate(sizes):
            if n <= cap:
                assert got[i] == {"prompt": "x" * (n - empty), "answer": "1"}, (trial, i, n)
            else:
                assert got[i] is None and problems[i] == (f"is {n} bytes, over data.max_record_bytes={cap} "
                                                          f"({p}:{i + 1})"), (trial, sizes, endings)


class RecordingTokenizer:
    """The project's tokenizer, recording every text it is asked to tokenize."""

    def __init__(self, tok):
        self._tok, self.seen = tok, []

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def apply_chat_template(self, messages, **kw):
        self.seen.append(json.dumps(messages))
        return self._tok.apply_chat_template(messages, **kw)

    def encode(self, text, **kw):
        self.seen.append(text)
        return self._tok.encode(text, **kw)

    def __call__(self, text, **kw):
        self.seen.append(text)
        return self._tok(text, **kw)


def _data_cfg(path):
    return types.SimpleNamespace(source="file", path=str(path), prompt_key="prompt", answer_key="answer", seed=0,
                                 task="sort", long_prompts="skip")


def test_an_oversized_record_is_skipped_and_counted_without_being_tokenized(tmp_path):
    """Before: a 30 MB record was tokenized (minutes) before its length was checked."""
    from gspo_megatron.rollout.tokenizer import build_tokenizer
    from gspo_megatron.train.setup import PromptSource

    huge = "h" * 6000
    p = tmp_path / "big.jsonl"
    recs = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    recs[3] = {"prompt": huge, "answer": "4"}
    recs[4]["answer"] = [5]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    tok = RecordingTokenizer(build_tokenizer())
    src = PromptSource(_data_cfg(p), tok, 0, max_prompt_tokens=10_000, max_record_bytes=1000)
    got = src.batch(0, 0, 12)  # two passes over the file
    assert len(got) == 12 and all(g["prompt"] != huge and isinstance(g["answer"], str) for g in got)
    assert src.take_skipped() >= 4  # records 4 and 5, once per pass
    check = src.check_all()
    assert check["skipped"] == 2 and check["usable"] == 4
    big = len(json.dumps(recs[3]))
    assert check["first_problems"] == [
        f"record 4 is {big} bytes, over data.max_record_bytes=1000 ({p}:4)",
        f"record 5 'answer' is list [5], expected a string or a number ({p}:5)",
    ]
    assert tok.seen and not any(huge[:1000] in s for s in tok.seen)


@pytest.mark.timeout(300)
def test_dry_run_names_bad_answers_and_oversized_records_with_file_and_line(tmp_path):
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    tok = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok)
    data = tmp_path / "prompts.jsonl"
    recs = [{"prompt": f"{i}+{i}=", "answer": 2 * i} for i in range(10)]
    recs[2]["answer"] = {"value": 4}
    recs[6]["prompt"] = "x" * 3000
    data.write_text("\n" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))  # line = record + 1
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    dry = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", TINY, "--dry-run",
                          "data.source=file", f"data.path={data}", "reward.fn=math", f"model.tokenizer={tok}",
                          "train.sft_warmup_steps=0", "data.max_record_bytes=2000"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    assert dry.returncode == 0, explain(dry.stderr)
    (line,) = [x for x in dry.stdout.splitlines() if "records checked in" in x]
    assert "10 records checked in" in line and "8 usable, 2 skipped by training" in line
    assert f"record 3 'answer' is dict {{'value': 4}}, expected a string or a number ({data}:4)" in line
    size = len(json.dumps(recs[6]))
    assert f"record 7 is {size} bytes, over data.max_record_bytes=2000 ({data}:8)" in line


def test_held_out_file_sets_skip_what_training_skips_and_name_it(tmp_path, caplog):
    """Before: one malformed record anywhere in eval.path stopped the run at start, and an
    oversized one was tokenized whole."""
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.tokenizer import build_tokenizer
    from gspo_megatron.train.evaluation import HeldOut
    from gspo_megatron.train.setup import PromptSource

    huge = "h" * 6000
    p = tmp_path / "heldout.jsonl"
    recs = [{"prompt": f"{i}+1=", "answer": i + 1} for i in range(8)]
    recs[1]["answer"] = [2]
    recs[2]["prompt"] = huge
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = load_config(TINY, ["eval.interval=1", "eval.source=file", f"eval.path={p}", "eval.num_prompts=4",
                             "data.max_record_bytes=1000"])
    tok = RecordingTokenizer(build_tokenizer())
    prompts = PromptSource(cfg.data, tok, 0, max_prompt_tokens=100)
    with caplog.at_level("WARNING", logger="gspo_megatron.train"):
        (s,) = HeldOut(cfg, prompts).sets
    assert [ex["prompt"] for ex in s.examples] == ["0+1=", "3+1=", "4+1=", "5+1="]
    assert [ex["answer"] for ex in s.examples] == ["1", "4", "5", "6"]
    assert s.prompt_ids == [prompts.encode(ex) for ex in s.examples]
    assert not any(huge[:1000] in x for x in tok.seen)
    (msg,) = [r.getMessage() for r in caplog.records if "held-out" in r.getMessage()]
    assert f"eval.path {p}: 2 record(s) skipped" in msg
    assert f"record 2 'answer' is list [2], expected a string or a number ({p}:2)" in msg
    assert f"record 3 is {len(json.dumps(recs[2]))} bytes, over data.max_record_bytes=1000 ({p}:3)" in msg
