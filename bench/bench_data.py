"""Prompt data: load and `--dry-run` check time per 100k records, one process, one thread.

    python bench/bench_data.py                      # 100k records (~2-3 min on 2 cores)
    python bench/bench_data.py --smoke              # 2k records, seconds
    python bench/bench_data.py --records 1000000 --no-cli --json out.json

The file (--records N, default 100,000; seeded by --seed) is synthetic JSONL written into --workdir
(default: a new temporary directory, deleted at the end unless --keep). Records, all ASCII:
  string    {"id", "source", "prompt": "<math word problem>", "answer": "<int>"}, ~55%
  chat      {"id", "source", "prompt": [{"role": "system"?, ...}, {"role": "user", ...}], "answer"},
            ~45% (a third with a system message, a few with an earlier user/assistant exchange);
            some answers are JSON numbers (load_prompts turns them into strings)
  lengths   the problem text is filler sentences up to a lognormal length plus the question: median
            ~280 characters, ~2% over 504 characters (tiny_cpu's prompt limit in tokens:
            max_position_embeddings 512 - max_new_tokens 8), which with the character tokenizer
            (and the chat template's tokens, a system message) makes ~3-4% of the records too long:
            skipped by training and counted by the check
  malformed max(6, N // 2000) records at seeded positions, cycling through: no "answer" key,
            an empty prompt, a null answer, a prompt that is a number, a chat message without
            "content", a record that is a list — what `record_problem` rejects
            (`skip_malformed=True` keeps them as None in place).

Measured, in this process, each phase after gc.collect() and bench/common.py reset_peak():
  load_prompts   gspo_megatron/rollout/data.py load_prompts(path, skip_malformed=True,
                 problems={}): read + json-decode + record_problem of every record. Median of
                 --repeats runs.
  dry-run check  what `--dry-run` does with the data (planner.py _check_inputs -> train/setup.py
                 check_inputs): PromptSource(cfg.data, tokenizer, seed, max_prompt_tokens=limit) (which
                 calls load_prompts) + check_render() + check_all() (every record rendered with the
                 tokenizer's chat template, length limit). cfg is launch/configs/tiny_cpu.yaml with
                 the CLI's overrides below, limit as check_inputs computes it (504). Once per
                 tokenizer:
                   char  the project's local tokenizer (rollout/tokenizer.py build_tokenizer: one
                         id per character, ChatML template), saved and reloaded with
                         AutoTokenizer.from_pretrained as `model.tokenizer=DIR` loads it
                   bpe   a byte-level BPE (vocab --bpe-vocab, default 4096) trained here on the
                         first 20k prompt texts with the `tokenizers` library, same ChatML template,
                         saved and reloaded likewise: a subword tokenizer closer to Qwen's in how
                         it encodes (no hub download). Prompts are ~4x fewer tokens, so none is over
                         the limit.
  "s" is wall seconds; "s / 100k" = s x 100,000 / records; "records/s" = records / s; "peak RSS"
  = VmHWM of this process after the phase (reset to VmRSS right before it), "phase mem" = peak -
  VmRSS before the phase (what the phase itself needed on top of what was alive).
  dry-run CLI    once (--no-cli skips it): `python -m gspo_megatron.train --config
                 launch/configs/tiny_cpu.yaml --dry-run data.source=file data.path=FILE reward.fn=math
                 train.sft_warmup_steps=0 model.tokenizer=<the char tokenizer's dir>` as a subprocess:
                 "s" = the whole command's wall seconds (interpreter start, imports, config, plan,
                 tokenizer, the check); "check s" = the seconds the command itself printed
                 ("records checked in X s"); peak RSS = the child's VmHWM, read from /proc every 20 ms
                 while it runs (a high-water mark: only the last 20 ms can be missed).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import format_table, mib, peak_rss, reset_peak, rss  # noqa: E402

CONFIG = os.path.join(_ROOT, "launch", "configs", "tiny_cpu.yaml")
PER = 100_000

# ----------------------------------------------------------------------------------------------
# the file

_NAMES = ["Alice", "Bob", "Carla", "Dmitri", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jamal"]
_ITEMS = ["apples", "marbles", "books", "coins", "stickers", "pencils", "cookies", "stamps"]
_FILLER = [
    "Each morning {n} walks to the market and counts what is left.",
    "On the way, {n} meets a friend who asks how many {i} there are in total.",
    "The shop sells {i} in boxes of {a}, and every box costs {b} dollars.",
    "Later that day {n} gives away {a} of the {i} and buys {b} more.",
    "A neighbour doubles what {n} has, then takes back {a} of them.",
    "Assume nothing is lost and every number is a whole number.",
    "The teacher writes {a} + {b} on the board and asks the class to explain the steps.",
    "Round the result only at the end, if at all.",
]
_QUESTION = "How many {i} does {n} have at the end? Put the final answer in \\boxed{{}}."
_SYSTEM = "You are a careful math tutor. Reason step by step, then give the final answer."
_MALFORMED = ("no answer key", "empty prompt", "null answer", "prompt is a number", "message without content",
              "record is a list")


def _problem(rng: random.Random) -> tuple[str, int]:
    n, i = rng.choice(_NAMES), rng.choice(_ITEMS)
    target = min(3000, max(40, int(round(rng.lognormvariate(4.8, 0.5)))))  # texts: median ~280 chars
    parts = []
    while sum(len(p) + 1 for p in parts) < target:
        parts.append(rng.choice(_FILLER).format(n=n, i=i, a=rng.randint(2, 999), b=rng.randint(2, 999)))
    a, b = rng.randint(0, 10**6), rng.randint(0, 10**4)
    parts.append(f"{n} starts with {a} {i} and receives {b} more.")
    parts.append(_QUESTION.format(n=n, i=i))
    return " ".join(parts), a + b


def _malformed(kind: str, rid: int) -> object:
    if kind == "no answer key":
        return {"id": rid, "prompt": "What is 1 + 1?"}
    if kind == "empty prompt":
        return {"id": rid, "prompt": "  ", "answer": "2"}
    if kind == "null answer":
        return {"id": rid, "prompt": "What is 2 + 2?", "answer": None}
    if kind == "prompt is a number":
        return {"id": rid, "prompt": 42, "answer": "42"}
    if kind == "message without content":
        return {"id": rid, "prompt": [{"role": "user", "text": "What is 3 + 3?"}], "answer": "6"}
    return ["What is 4 + 4?", "8"]


def write_prompts(path: str, n: int, seed: int = 0) -> dict:
    """N records as JSON lines; returns the kind counts."""
    rng = random.Random(seed)
    n_bad = min(n - 1, max(6, n // 2000))
    bad_at = dict(zip(sorted(rng.sample(range(n), n_bad)), (_MALFORMED[k % len(_MALFORMED)] for k in range(n_bad))))
    counts = {"string": 0, "chat": 0, "malformed": 0, "over 504 chars": 0}
    with open(path, "w", encoding="utf-8") as f:
        for rid in range(n):
            if rid in bad_at:
                row = _malformed(bad_at[rid], rid)
                counts["malformed"] += 1
            else:
                text, ans = _problem(rng)
                counts["over 504 chars"] += len(text) > 504
                answer = ans if rng.random() < 0.2 else str(ans)
                if rng.random() < 0.55:
                    row = {"id": rid, "source": "synthetic-string", "prompt": text, "answer": answer}
                    counts["string"] += 1
                else:
                    msgs = []
                    if rng.random() < 1 / 3:
                        msgs.append({"role": "system", "content": _SYSTEM})
                    if rng.random() < 0.05:
                        msgs += [{"role": "user", "content": "Can you help me with a word problem?"},
                                 {"role": "assistant", "content": "Of course. What is the problem?"}]
                    msgs.append({"role": "user", "content": text})
                    row = {"id": rid, "source": "synthetic-chat", "prompt": msgs, "answer": answer}
                    counts["chat"] += 1
            f.write(json.dumps(row) + "\n")
    return counts


# ----------------------------------------------------------------------------------------------
# tokenizers


def char_tokenizer(save_dir: str):
    from transformers import AutoTokenizer

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    build_tokenizer(save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


def bpe_tokenizer(save_dir: str, path: str, vocab: int, n_texts: int = 20_000):
    """Byte-level BPE trained on the file's first prompt texts, ChatML template; reloaded from disk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from gspo_megatron.rollout.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD_TOKEN

    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            p = row.get("prompt") if isinstance(row, dict) else None
            if isinstance(p, str):
                texts.append(p)
            elif isinstance(p, list):
                texts += [m["content"] for m in p if isinstance(m, dict) and isinstance(m.get("content"), str)]
            if len(texts) >= n_texts:
                break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[PAD_TOKEN, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=IM_END,
                                   additional_special_tokens=[IM_START], clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


# ----------------------------------------------------------------------------------------------
# phases


def _phase(fn):
    """(result, seconds, peak RSS, peak - RSS before) of fn()."""
    gc.collect()
    before = rss()
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    s = time.perf_counter() - t0
    peak = peak_rss()
    return out, s, peak, peak - before


def time_load(path: str, repeats: int) -> dict:
    from gspo_megatron.rollout.data import load_prompts

    runs = []
    for _ in range(repeats):
        problems: dict[int, str] = {}
        recs, s, peak, mem = _phase(lambda: load_prompts(path, skip_malformed=True, problems=problems))
        runs.append((s, peak, mem, len(recs), len(problems)))
        del recs
    s = statistics.median(r[0] for r in runs)
    return dict(phase="load_prompts", tokenizer="-", records=runs[0][3], usable=runs[0][3] - runs[0][4],
                skipped=runs[0][4], s=s, runs=[r[0] for r in runs], peak=max(r[1] for r in runs),
                mem=max(r[2] for r in runs))


def dry_run_cfg(path: str, tokenizer_dir: str):
    from gspo_megatron.resolve import load_config

    return load_config(CONFIG, cli_overrides(path, tokenizer_dir))


def cli_overrides(path: str, tokenizer_dir: str) -> list[str]:
    return ["data.source=file", f"data.path={path}", "reward.fn=math", "train.sft_warmup_steps=0",
            f"model.tokenizer={tokenizer_dir}"]


def time_check(cfg, name: str, tokenizer) -> dict:
    """PromptSource + check_render + check_all, as check_inputs / planner._check_inputs run them."""
    import logging

    from gspo_megatron.train.setup import PromptSource

    logging.getLogger("gspo_megatron").setLevel(logging.ERROR)  # the "N malformed" warning
    from gspo_megatron import resolve

    arch_max = resolve.arch_of(cfg).max_position_embeddings
    limit = cfg.data.max_prompt_tokens or max(1, arch_max - cfg.rollout.max_new_tokens)

    def run():
        t0 = time.perf_counter()
        src = PromptSource(cfg.data, tokenizer, cfg.train.seed, max_prompt_tokens=limit)
        src.check_render()
        return src.check_all(), time.perf_counter() - t0

    (c, total), s, peak, mem = _phase(run)
    return dict(phase="dry-run check", tokenizer=name, records=c["records"], usable=c["usable"],
                skipped=c["skipped"], s=s, init_s=total - c["seconds"], check_all_s=c["seconds"], peak=peak, mem=mem,
                limit=limit, first_problems=c["first_problems"])


def _vm_hwm(pid: int) -> int:
    """VmHWM of a running process in bytes (0 once it is gone). Its own high-water mark since exec:
    getrusage(RUSAGE_CHILDREN).ru_maxrss would be at least this process's RSS at the fork."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def time_cli(path: str, tokenizer_dir: str, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "gspo_megatron.train", "--config", CONFIG, "--dry-run",
           *cli_overrides(path, tokenizer_dir)]
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=_ROOT, stdout=fo, stderr=fe, text=True)
        peak = 0
        try:
            while p.poll() is None:
                peak = max(peak, _vm_hwm(p.pid))
                if time.perf_counter() - t0 > timeout:
                    raise subprocess.TimeoutExpired(cmd, timeout)
                time.sleep(0.02)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        s = time.perf_counter() - t0
        fo.seek(0)
        fe.seek(0)
        stdout, stderr = fo.read(), fe.read()
    if p.returncode != 0:
        raise RuntimeError(f"dry-run CLI exited {p.returncode}:\n{stdout[-2000:]}\n{stderr[-2000:]}")
    m = re.search(r"(\d+) records checked in ([0-9.]+) s, (\d+) usable, (\d+) skipped", stdout)
    if not m:
        raise RuntimeError(f"dry-run CLI: no 'records checked' in its output:\n{stdout[-2000:]}")
    return dict(phase="dry-run CLI", tokenizer="char", records=int(m.group(1)), usable=int(m.group(3)),
                skipped=int(m.group(4)), s=s, check_s=float(m.group(2)), peak=peak,
                cmd=" ".join(cmd))


# ----------------------------------------------------------------------------------------------
# report


def report(rows: list[dict], n: int, counts: dict, file_bytes: int) -> str:
    headers = ["phase", "tokenizer", "records", "usable", "skipped", "s", "s / 100k", "records/s", "check s",
               "check s / 100k", "peak RSS MiB", "phase mem MiB"]
    out_rows = []
    for r in rows:
        check_s = r.get("check_all_s", r.get("check_s"))
        out_rows.append([r["phase"], r["tokenizer"], f"{r['records']:,}", f"{r['usable']:,}", f"{r['skipped']:,}",
                         f"{r['s']:.2f}", f"{r['s'] * PER / r['records']:.2f}", f"{r['records'] / r['s']:,.0f}",
                         "" if check_s is None else f"{check_s:.2f}",
                         "" if check_s is None else f"{check_s * PER / r['records']:.2f}",
                         mib(r["peak"]), mib(r["mem"]) if "mem" in r else ""])
    title = (f"Prompt data, {n:,} records ({counts['string']:,} string, {counts['chat']:,} chat, "
             f"{counts['malformed']} malformed, {counts['over 504 chars']:,} over 504 characters), "
             f"{mib(file_bytes)} MiB JSONL; 1 process, 1 thread")
    lines = ["", format_table(headers, out_rows, title), "",
             "s = wall seconds of the phase; s / 100k = s x 100,000 / records; check s = PromptSource.check_all's own",
             "  seconds (dry-run check) or the seconds the CLI printed (dry-run CLI); dry-run check s = PromptSource",
             "  (load_prompts inside) + check_render + check_all; dry-run CLI s = the whole command (interpreter",
             "  start, imports, config, plan, tokenizer load, load_prompts, the check); peak RSS: VmHWM after the",
             "  phase (CLI: the child's VmHWM); phase mem = peak - VmRSS before the phase. Details: the module",
             "  docstring."]
    for r in rows:
        if r["phase"] == "dry-run CLI":
            lines.append(f"CLI: {r['s']:.2f} s, of which the check {r['check_s']:.2f} s and the rest (start-up, "
                         f"imports, plan, tokenizer, load_prompts) {r['s'] - r['check_s']:.2f} s")
        if r["phase"] == "dry-run check":
            lines.append(f"{r['tokenizer']}: limit {r['limit']} tokens; PromptSource init {r['init_s']:.2f} s; first "
                         f"problems: {'; '.join(r['first_problems'][:3])}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--smoke", action="store_true", help="2,000 records, --repeats 1, BPE vocab 512: seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="load_prompts runs (median)")
    ap.add_argument("--bpe-vocab", type=int, default=4096)
    ap.add_argument("--tokenizers", default="char,bpe", help="comma list of char, bpe")
    ap.add_argument("--no-cli", action="store_true", help="skip the end-to-end dry-run command")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the dry-run command")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.records, args.repeats, args.bpe_vocab = 2000, 1, 512
    toks = [t for t in args.tokenizers.split(",") if t]
    if not toks or any(t not in ("char", "bpe") for t in toks):
        ap.error("--tokenizers: a comma list of char, bpe")
    if args.records < 10:
        ap.error("--records must be >= 10")

    created = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="gspo-bench-data-") if created else args.workdir
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "prompts.jsonl")
    try:
        t0 = time.perf_counter()
        counts = write_prompts(path, args.records, args.seed)
        file_bytes = os.path.getsize(path)
        print(f"wrote {path}: {args.records:,} records, {mib(file_bytes)} MiB in {time.perf_counter() - t0:.1f} s "
              f"({counts})", flush=True)
        import warnings

        warnings.filterwarnings("ignore")
        rows = [time_load(path, args.repeats)]
        print(f"  load_prompts: {rows[-1]['s']:.2f} s (runs {', '.join(f'{x:.2f}' for x in rows[-1]['runs'])})",
              flush=True)
        char_dir = os.path.join(workdir, "tok-char")
        built = {}
        t0 = time.perf_counter()
        built["char"] = char_tokenizer(char_dir)
        if "bpe" in toks:
            built["bpe"] = bpe_tokenizer(os.path.join(workdir, "tok-bpe"), path, args.bpe_vocab)
        print(f"  tokenizers built in {time.perf_counter() - t0:.1f} s: "
              + ", ".join(f"{k} {len(v)} tokens" for k, v in built.items()), flush=True)
        cfg = dry_run_cfg(path, char_dir)
        for name in toks:
            rows.append(time_check(cfg, name, built[name]))
            print(f"  dry-run check ({name}): {rows[-1]['s']:.2f} s", flush=True)
        if not args.no_cli:
            rows.append(time_cli(path, char_dir, args.timeout))
            print(f"  dry-run CLI: {rows[-1]['s']:.2f} s", flush=True)
    finally:
        if not args.keep:
            if created:
                shutil.rmtree(workdir, ignore_errors=True)
            else:
                for p in (path, os.path.join(workdir, "tok-char"), os.path.join(workdir, "tok-bpe")):
                    if os.path.isdir(p):
                        shutil.rmtree(p, ignore_errors=True)
                    elif os.path.exists(p):
                        os.remove(p)

    print(report(rows, args.records, counts, file_bytes))
    if args.keep:
        print(f"kept: {workdir}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(records=args.records, counts=counts, file_bytes=file_bytes, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
