"""The benches that the docs quote still run: bench/bench_checkpoint.py and bench/bench_data.py in
their --smoke modes, as subprocesses (as a user runs them), exit status 0 and the rows of their
printed tables present and consistent. No timing is asserted: only that every measurement is
there and the counts agree (the CLI's dry run sees the same records as the in-process check)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM = r"[0-9][0-9,]*(?:\.[0-9]+)?"


def _run(script: str, workdir: str, timeout: float) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--smoke", "--workdir", workdir],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{script} --smoke exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout


def _row(out: str, pattern: str) -> list[str]:
    rows = [line.split() for line in out.splitlines() if re.match(pattern, line)]
    assert len(rows) == 1, f"expected one row matching {pattern!r}, got {len(rows)}:\n{out}"
    return rows[0]


def _left_nothing(workdir: str) -> bool:
    return not os.path.exists(workdir) or not os.listdir(workdir)


def _num(s: str) -> float:
    assert re.fullmatch(NUM, s), s
    return float(s.replace(",", ""))


@pytest.mark.timeout(900)
def test_bench_checkpoint_smoke(tmp_path):
    workdir = str(tmp_path / "w")
    out = _run("bench_checkpoint.py", workdir, timeout=840)
    # the main table: one dp2 row, state verified after the load
    assert re.search(r"^Trainer checkpoint, ", out, re.M), out
    assert re.search(r"^dp2: save/copy .* verified: parameters and Adam moments after load == saved", out, re.M), out
    # the checksum comparison: save and load rows, with and without, ratio, throughput
    assert re.search(r"^Checksums \(SHA-256 of every file", out, re.M), out
    header = _row(out, r"^layout\s+phase\s+s without\s+s with\s+with/without\s+checksum s")
    assert header[0] == "layout"
    for phase in ("save", "load"):
        row = _row(out, rf"^dp2\s+{phase}\s")
        off_s, on_s, ratio, ck_s, ratio_call = (_num(x) for x in row[2:7])
        assert off_s > 0 and on_s > 0 and ck_s > 0
        assert abs(ratio - on_s / off_s) < 0.02 + 0.01 * ratio, row  # printed with 2 decimals
        assert ratio_call > 1, row  # with / (with - checksum call)
        assert row[7].endswith("%"), row
        hashed_mib, mbps = _num(row[8]), _num(row[9])
        assert hashed_mib > 50 and mbps > 0, row  # the whole checkpoint (~217 MiB) is hashed
        lo, hi = row[10].split("-")
        assert 0 < _num(lo) <= _num(hi), row
        assert _num(row[11]) > 0 and _num(row[12]) > 0, row  # peak RSS without / with
        assert _num(row[13]) > 0 and _num(row[14]) > 0, row  # the first save / load and its checksum call
    assert _left_nothing(workdir), os.listdir(workdir)


@pytest.mark.timeout(600)
def test_bench_data_smoke(tmp_path):
    workdir = str(tmp_path / "w")
    out = _run("bench_data.py", workdir, timeout=540)
    assert re.search(r"^Prompt data, 2,000 records \(.*6 malformed", out, re.M), out
    cols = ["records", "usable", "skipped", "s", "s / 100k", "records/s"]
    load = _row(out, r"^load_prompts\s")
    records, usable, skipped = (int(_num(x)) for x in load[2:5])
    assert (records, usable, skipped) == (2000, 1994, 6), load  # the 6 malformed records, kept as None
    assert all(_num(x) > 0 for x in load[5:8]), dict(zip(cols, load[2:8]))
    checks = {}
    for tok in ("char", "bpe"):
        row = _row(out, rf"^dry-run check\s+{tok}\s")
        checks[tok] = [int(_num(x)) for x in row[3:6]]
        assert checks[tok][0] == 2000 and sum(checks[tok][1:]) == 2000, row
        assert checks[tok][2] >= 6, row  # the malformed ones, plus what is over the length limit
        assert all(_num(x) > 0 for x in row[6:11]), row  # s, s/100k, records/s, check s, check s/100k
    assert checks["char"][2] > 6, "the character tokenizer makes some records too long"
    cli = _row(out, r"^dry-run CLI\s+char\s")
    assert [int(_num(x)) for x in cli[3:6]] == checks["char"], (cli, checks["char"])  # same records, same verdicts
    assert all(_num(x) > 0 for x in cli[6:11]), cli
    assert _left_nothing(workdir), os.listdir(workdir)
