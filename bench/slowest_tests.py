"""The slowest tests of a suite run, written into tests/README.md's "Slowest tests" section.

    .venv/bin/python bench/slowest_tests.py --junit run.xml --label "after issue 51, <commit>"
    .venv/bin/python bench/slowest_tests.py --durations run.log --label "..." [--readme tests/README.md]
    .venv/bin/python bench/slowest_tests.py --smoke      # generated inputs and a scratch README, seconds

Input, one of:
  --junit FILE      `pytest --junitxml=FILE`: each <testcase>'s time (pytest's default: setup + call +
                    teardown). The node id is rebuilt from classname + name: the classname's dotted
                    parts up to the first one that starts with an upper-case letter are the module
                    path (tests.test_x -> tests/test_x.py), the rest are classes (::TestX).
                    The run's date is the <testsuite> timestamp, its wall time the <testsuite> time.
  --durations FILE  a log of `pytest --durations=0` (-vv to keep the entries under 5 ms): the
                    setup, call and teardown lines of a node id are added up; the wall time is
                    the final `== ... in X s ==` line's. The date is today's.
A module-scoped fixture's setup is charged to the first test that uses it.

The section between `<!-- slowest:begin -->` and `<!-- slowest:end -->` in the README is
replaced by: one line (the label, tests and their summed time, the machine - `lscpu`'s model
name and `nproc` of the machine running this script, which should be the one that ran the
suite - and the date), a table of the --top (20) slowest tests (s, node id) and one of the
--files (10) files with the largest summed test time (s, tests, file). Without the markers a
`## Slowest tests` section holding them is inserted before the README's first `## ` heading.
The README is written to a temporary file beside it and renamed over it: never half-written.

It also writes --order (tests/file_seconds.json): every file's summed test time, which
tests/conftest.py reads to hand the longest files to the workers first (with `make test`'s
--no-loadscope-reorder; xdist would otherwise start the files with the most tests first and leave
the few-but-long ones, the real-vLLM files, for the end of the run, where nothing overlaps them).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- slowest:begin -->", "<!-- slowest:end -->"
HEADING = "## Slowest tests"


def nodeid(classname: str, name: str, file: str | None = None) -> str:
    parts = classname.split(".") if classname else []
    cut = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    module, classes = parts[:cut], parts[cut:]
    path = file.replace(os.sep, "/") if file else "/".join(module) + ".py"
    return "::".join([path, *classes, name])


def read_junit(path: str) -> tuple[dict[str, float], dict]:
    """node id -> seconds (summed if an id repeats, e.g. a rerun); the run's date and wall time."""
    root = ET.parse(path).getroot()
    times: dict[str, float] = {}
    for case in root.iter("testcase"):
        nid = nodeid(case.get("classname", ""), case.get("name", ""), case.get("file"))
        times[nid] = times.get(nid, 0.0) + float(case.get("time") or 0.0)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    stamp = next((s.get("timestamp") for s in suites if s.get("timestamp")), None)
    wall = sum(float(s.get("time") or 0.0) for s in suites if s.get("time")) or None
    return times, {"date": stamp[:10] if stamp else None, "wall": wall}


DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


def read_durations(path: str) -> tuple[dict[str, float], dict]:
    times: dict[str, float] = {}
    wall = None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            m = DURATION.match(line)
            if m:
                times[m[3]] = times.get(m[3], 0.0) + float(m[1])
            else:
                m = re.search(r"=+ .* in ([0-9.]+)s(?: \([0-9:]+\))? =+\s*$", line)  # the final summary line
                if m:
                    wall = float(m[1])
    return times, {"date": None, "wall": wall}


def machine() -> str:
    model = None
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name:")), None)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if not model:
        try:
            with open("/proc/cpuinfo") as f:
                model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        except OSError:
            pass
    try:
        nproc = subprocess.run(["nproc"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        nproc = ""
    return f"{model or 'unknown CPU'}, nproc {nproc or os.cpu_count()}"


def _cell(nid: str) -> str:
    nid = nid.replace("|", "\\|")
    return f"`{nid}`" if "`" not in nid else nid


def section(times: dict[str, float], label: str, date: str, wall: float | None, where: str, top: int,
            nfiles: int) -> str:
    slow = sorted(times.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    files: dict[str, list[float]] = {}
    for nid, t in times.items():
        files.setdefault(nid.split("::", 1)[0], []).append(t)
    slow_files = sorted(files.items(), key=lambda kv: (-sum(kv[1]), kv[0]))[:nfiles]
    lines = [BEGIN,
             f"{label}: {len(times)} tests" + (f", {wall:,.0f} s wall" if wall else "")
             + f", {sum(times.values()):,.0f} s of test time (setup + call + teardown, summed over the tests).",
             f"Machine: {where}; run {date}. Written by `bench/slowest_tests.py`.", "",
             f"The {len(slow)} slowest tests:", "", "| s | test |", "|---:|---|"]
    lines += [f"| {t:.1f} | {_cell(nid)} |" for nid, t in slow]
    lines += ["", f"The {len(slow_files)} files with the most test time:", "",
              "| s | tests | file |", "|---:|---:|---|"]
    lines += [f"| {sum(ts):.1f} | {len(ts)} | `{f}` |" for f, ts in slow_files]
    lines.append(END)
    return "\n".join(lines)


def replace_section(text: str, new: str) -> str:
    if text.count(BEGIN) > 1 or text.count(END) > 1:
        raise ValueError(f"more than one {BEGIN} / {END} pair")
    b, e = text.find(BEGIN), text.find(END)
    if b >= 0 and e > b:
        return text[:b] + new + text[e + len(END):]
    if b >= 0 or e >= 0:
        raise ValueError(f"{BEGIN} and {END} must both be there, in that order")
    block = f"{HEADING}\n\n{new}\n\n"
    m = re.search(r"^## ", text, re.M)
    if m:
        return text[:m.start()] + block + text[m.start():]
    return text.rstrip("\n") + "\n\n" + block


def write_atomic(path: str, text: str) -> None:
    """Write beside `path`, then rename over it: readers see the old file or the new one."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".slowest-", suffix=".tmp", dir=d)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(path):
            shutil.copymode(path, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def file_seconds(times: dict[str, float]) -> dict[str, float]:
    """file -> its tests' summed seconds, longest first."""
    files: dict[str, float] = {}
    for nid, t in times.items():
        f = nid.split("::", 1)[0]
        files[f] = files.get(f, 0.0) + t
    return {f: round(t, 1) for f, t in sorted(files.items(), key=lambda kv: (-kv[1], kv[0]))}


def write_order(path: str, times: dict[str, float], label: str) -> None:
    write_atomic(path, json.dumps({"label": label, "seconds": file_seconds(times)}, indent=1) + "\n")


def update(readme: str, times: dict[str, float], label: str, meta: dict, top: int, nfiles: int,
           where: str | None = None) -> str:
    if not times:
        raise ValueError("no test times in the input")
    new = section(times, label, meta.get("date") or datetime.date.today().isoformat(), meta.get("wall"),
                  where or machine(), top, nfiles)
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    out = replace_section(text, new)
    if out != text:
        write_atomic(readme, out)
    return new


# ---- --smoke: generated inputs, a scratch README -------------------------------------------------

def smoke(workdir: str | None) -> int:
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="slowest-smoke-", dir=workdir)
    checks = []
    try:
        # 30 tests over 4 files (one class, parametrized ids with a `|`), times 0.1 .. 3.0 s
        cases = []
        for i in range(30):
            mod, cls = f"test_f{i % 4}", ("TestK" if i % 4 == 3 else None)
            name = f"test_{i}" + (f"[a|{i}]" if i % 5 == 0 else "")
            cases.append((mod, cls, name, round(0.1 * (i + 1), 3)))
        junit = os.path.join(tmp, "run.xml")
        with open(junit, "w") as f:
            f.write('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="30" '
                    'time="46.5" timestamp="2026-01-02T03:04:05.000000+00:00">')
            for mod, cls, name, t in cases:
                classname = f"tests.{mod}" + (f".{cls}" if cls else "")
                f.write(f'<testcase classname="{classname}" name="{name}" time="{t}" />')
            f.write("</testsuite></testsuites>")
        log = os.path.join(tmp, "run.log")
        with open(log, "w") as f:  # each test's time split over setup / call / teardown
            f.write("============ slowest durations ============\n")
            for mod, cls, name, t in cases:
                nid = "::".join([f"tests/{mod}.py", *([cls] if cls else []), name])
                for phase, part in (("call", t - 0.05), ("setup", 0.03), ("teardown", 0.02)):
                    f.write(f"{part:.2f}s {phase:<8} {nid}\n")
            f.write("========== 30 passed in 46.50s ==========\n")
        want = {"::".join([f"tests/{m}.py", *([c] if c else []), n]): t for m, c, n, t in cases}
        readme = os.path.join(tmp, "README.md")
        intro = "# tests/\n\nIntro.\n\n"
        with open(readme, "w") as f:
            f.write(intro + "## Running\n\ntext\n")
        for kind, path in (("junit", junit), ("durations", log)):
            times, meta = read_junit(path) if kind == "junit" else read_durations(path)
            ok_ids = set(times) == set(want) and all(abs(times[k] - want[k]) < 1e-6 for k in want)
            sec = update(readme, times, f"smoke {kind}", meta, 20, 10, where="smoke CPU, nproc 1")
            text = open(readme).read()
            rows = re.findall(r"^\| ([0-9.]+) \| `([^`]+)` \|$", sec, re.M)
            frows = re.findall(r"^\| ([0-9.]+) \| ([0-9]+) \| `([^`]+)` \|$", sec, re.M)
            top = sorted(want.items(), key=lambda kv: -kv[1])[:20]
            ok_rows = [(float(s), n.replace("\\|", "|")) for s, n in rows] == [(round(t, 1), n) for n, t in top]
            per_file = {}
            for n, t in want.items():
                per_file.setdefault(n.split("::")[0], []).append(t)
            ok_files = len(frows) == 4 and all(abs(float(s) - sum(per_file[f])) < 0.051 and int(c) == len(per_file[f])
                                               for s, c, f in frows)
            ok_place = (text.startswith(intro + HEADING + "\n\n" + BEGIN) and text.count(BEGIN) == 1
                        and text.rstrip().endswith("## Running\n\ntext") and sec in text)
            ok_meta = (meta == {"date": "2026-01-02", "wall": 46.5} if kind == "junit"
                       else meta == {"date": None, "wall": 46.5}) and "30 tests, 46 s wall," in sec
            checks.append((kind, len(times), len(rows), len(frows), ok_ids and ok_rows and ok_files and ok_place
                           and ok_meta))
        order = os.path.join(tmp, "file_seconds.json")
        write_order(order, times, "smoke")
        got = json.load(open(order))["seconds"]
        per_file = {}
        for n, t in want.items():
            per_file[n.split("::")[0]] = per_file.get(n.split("::")[0], 0.0) + t
        ok_order = (list(got) == sorted(per_file, key=lambda f: -per_file[f])
                    and all(abs(got[f] - per_file[f]) < 0.051 for f in per_file))
        checks.append(("file order", len(got), 0, len(got), ok_order))
        left = [f for f in os.listdir(tmp) if f.startswith(".slowest-")]
        checks.append(("no temp file", len(left), 0, 0, not left))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("slowest_tests smoke: 30 generated tests over 4 files, the section written twice into a scratch README")
    print(f"{'input':<13} {'tests':>5} {'rows':>4} {'files':>5}  verdict")
    for kind, n, nrows, nfiles, ok in checks:
        print(f"{kind:<13} {n:>5} {nrows:>4} {nfiles:>5}  {'ok' if ok else 'WRONG'}")
    return 0 if all(c[-1] for c in checks) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--junit", help="a pytest --junitxml file")
    src.add_argument("--durations", help="a log of pytest --durations=0")
    ap.add_argument("--label", help='what the run was, e.g. "after issue 51, 1a2b3c4"')
    ap.add_argument("--readme", default=os.path.join(ROOT, "tests", "README.md"))
    ap.add_argument("--top", type=int, default=20, help="slowest tests listed (default 20)")
    ap.add_argument("--files", type=int, default=10, help="slowest files listed (default 10)")
    ap.add_argument("--order", default=os.path.join(ROOT, "tests", "file_seconds.json"),
                    help="where the per-file seconds go, for tests/conftest.py's file order ('' : not written)")
    ap.add_argument("--smoke", action="store_true", help="generated inputs and a scratch README")
    ap.add_argument("--workdir", default=None, help="--smoke's scratch directory (default: a temporary one)")
    a = ap.parse_args(argv)
    if a.smoke:
        return smoke(a.workdir)
    if not (a.junit or a.durations) or not a.label:
        ap.error("--junit FILE or --durations FILE, and --label, are required")
    try:
        times, meta = read_junit(a.junit) if a.junit else read_durations(a.durations)
        new = update(a.readme, times, a.label, meta, a.top, a.files)
        if a.order:
            write_order(a.order, times, a.label)
    except (OSError, ValueError, ET.ParseError) as e:
        print(f"slowest_tests: {e}", file=sys.stderr)
        return 2
    print(new)
    print(f"(written into {a.readme}" + (f" and {a.order})" if a.order else ")"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
