"""No check lost (issue 51): every test of the suite at a base commit is still in the suite now,
under its own id or under the id an explicit table of moves and merges names.

    .venv/bin/python bench/test_map.py                          # base c651b52, tests/test_moves.txt
    .venv/bin/python bench/test_map.py --base REV --table PATH [--show-new]
    .venv/bin/python bench/test_map.py --smoke                  # a tiny generated repository, seconds

What it does:
  old ids   `git archive REV | tar -x` into a temporary directory (the whole tree at REV, so the
            old tests import the old package and the old conftest.py), then
            `<python> -m pytest --collect-only --rootdir <that dir> <that dir>/tests` with cwd there:
            the old tree's own pytest config and conftest, the current venv's interpreter.
  new ids   the same collection of this checkout's tests/ (its working tree, uncommitted edits
            included).
  Node ids are read by a tiny pytest plugin from `session.items` (one id per collected item:
  every parametrized case counts by itself), not parsed from pytest's text output. Collection
  errors are reported (pytest runs with --continue-on-collection-errors) and make the exit
  status 2: a module that fails to import would otherwise look like lost tests.
  Collection runs with PYTEST_XDIST_WORKER=collect-only: tests/conftest.py then never starts its
  background vLLM venv build (it only does so on worker gw0 / a plain session).

Each old id is then, in this order:
  kept      the same id is collected now;
  moved     the table maps it (old -> new) and every new id it names is collected now (a test
            split into several: one line per part; merged tests: several old ids -> one new id);
  unmapped  neither: listed, exit status 1.
The table (default tests/test_moves.txt) has one entry per line, `old_id -> new_id  # why` (the
reason is required); blank lines and lines starting with # are ignored. An entry whose two ids
both end in `*` maps every old id starting with the old prefix to the new prefix + the same rest
(`tests/test_a.py::* -> tests/test_b.py::*  # file merged`); each id it covers still counts
individually. Entries that name an old id the base suite does not have, or a new id the suite
does not have now, are stale: listed, exit status 1. An entry for an old id that is still
collected under its own id is ignored with a note.

Printed: the base (rev and commit), old total, kept same id, moved/merged (by the table),
unmapped, new ids not in the old suite (and how many of them are table targets), then the
unmapped ids, the table's problems, and with --show-new the new ids.
Exit status: 0 every old id accounted for; 1 unmapped ids or stale table entries; 2 usage,
git or collection errors. Subprocesses have timeouts (--timeout, per collection); the temporary
directory is removed at the end (also on Ctrl-C / SIGTERM).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BASE = "c651b52"
DEFAULT_TABLE = os.path.join("tests", "test_moves.txt")

# the plugin that writes the collected node ids (and collection errors) as JSON
PLUGIN_NAME = "_test_map_collect"
PLUGIN = '''
import json, os

_errors = []


def pytest_collectreport(report):
    if report.failed:
        text = str(report.longrepr).strip().splitlines()
        _errors.append({"nodeid": report.nodeid, "error": text[-1] if text else "collection failed"})


def pytest_collection_finish(session):
    with open(os.environ["TEST_MAP_OUT"], "w") as f:
        json.dump({"ids": [item.nodeid for item in session.items], "errors": _errors}, f)
'''


class Failure(Exception):
    """A usage, git or collection error: one message, exit status 2."""


def _terminate(signum, frame):  # SIGTERM: unwind through the finally blocks (temporary dirs)
    raise SystemExit(128 + signum)


def _run(cmd: list[str], cwd: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in its own process group; on timeout kill the whole group."""
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise Failure(f"timed out after {timeout:.0f} s: {' '.join(cmd)} (cwd {cwd})")
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def git(repo: str, *args: str, timeout: float = 120) -> str:
    r = _run(["git", "-C", repo, *args], cwd=repo, timeout=timeout)
    if r.returncode != 0:
        raise Failure(f"git {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


def export_tree(repo: str, rev: str, dest: str, timeout: float) -> str:
    """The whole tree at `rev` into `dest` (git archive | tar -x); returns the full commit id."""
    commit = git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}").strip()
    os.makedirs(dest)
    archive = os.path.join(os.path.dirname(dest), "tree.tar")
    git(repo, "archive", "--format=tar", "-o", archive, commit, timeout=timeout)
    r = _run(["tar", "-xf", archive, "-C", dest], cwd=dest, timeout=timeout)
    if r.returncode != 0:
        raise Failure(f"tar -x of {rev} failed: {r.stderr.strip()}")
    os.remove(archive)
    return commit


def collect(python: str, tree: str, plugin_dir: str, timeout: float) -> tuple[list[str], list[dict]]:
    """Node ids of `tree`/tests, collected with that tree's own pytest config and conftest."""
    out = os.path.join(plugin_dir, f"ids-{len(os.listdir(plugin_dir))}.json")
    env = dict(os.environ, TEST_MAP_OUT=out, OMP_NUM_THREADS="1", PYTEST_XDIST_WORKER="collect-only",
               PYTHONPATH=os.pathsep.join([plugin_dir] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", PLUGIN_NAME, "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "--rootdir", tree, os.path.join(tree, "tests")]
    r = _run(cmd, cwd=tree, timeout=timeout, env=env)
    if not os.path.exists(out):  # pytest stopped before the end of collection (usage error, bad conftest, ...)
        tail = "\n".join((r.stdout + r.stderr).strip().splitlines()[-30:])
        raise Failure(f"collecting {tree}/tests failed (exit {r.returncode}), no node ids:\n{tail}")
    with open(out) as f:
        data = json.load(f)
    return data["ids"], data["errors"]


def read_table(path: str) -> tuple[list[tuple[int, str, str, str]], list[str]]:
    """Entries (line number, old, new, why) and format problems of the moves table."""
    entries, problems = [], []
    if not os.path.exists(path):
        return entries, [f"{path}: no such file (an empty table is a file with only comments)"]
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            m = re.match(r"^\s*(\S.*?)\s+->\s+(\S.*?)(?:\s+#\s*(.*?))?\s*$", line)
            if not m:
                problems.append(f"{path}:{n}: not `old_id -> new_id  # why`: {line!r}")
            elif not (m[3] or "").strip():
                problems.append(f"{path}:{n}: no reason (`  # why` after the new id): {line!r}")
            elif m[1].endswith("*") != m[2].endswith("*"):
                problems.append(f"{path}:{n}: a prefix entry needs `*` at the end of both ids: {line!r}")
            else:
                entries.append((n, m[1], m[2], m[3].strip()))
    return entries, problems


def build_map(old: list[str], new: list[str], entries, table: str) -> dict:
    """Every old id -> kept / moved (with its targets) / unmapped; the table's stale entries."""
    old_set, new_set = set(old), set(new)
    targets: dict[str, list[str]] = {}  # old id -> new ids the table names for it
    stale, notes = [], []
    for n, o, t, _why in entries:
        if o.endswith("*"):
            covered = [x for x in old if x.startswith(o[:-1])]
            if not covered:
                stale.append(f"{table}:{n}: no old id starts with {o[:-1]!r}")
            pairs = [(x, t[:-1] + x[len(o) - 1:]) for x in covered]
        else:
            if o not in old_set:
                stale.append(f"{table}:{n}: old id not in the base suite: {o}")
            pairs = [(o, t)]
        for x, y in pairs:
            if x not in old_set:
                continue
            if x in new_set:
                notes.append(f"{table}:{n}: {x} is still collected under its own id (entry ignored)")
                continue
            if y not in new_set:
                stale.append(f"{table}:{n}: new id not collected now: {y} (for {x})")
            targets.setdefault(x, []).append(y)
    kept, moved, unmapped = [], {}, []
    for x in old:
        if x in new_set:
            kept.append(x)
        elif x in targets and all(y in new_set for y in targets[x]):
            moved[x] = targets[x]
        else:
            unmapped.append(x)
    target_set = {y for ys in moved.values() for y in ys}
    fresh = [y for y in new if y not in old_set]
    return {"kept": kept, "moved": moved, "unmapped": unmapped, "fresh": fresh,
            "fresh_targets": [y for y in fresh if y in target_set], "stale": stale, "notes": notes}


def default_python(repo: str) -> str:
    venv = os.path.join(repo, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


def run(repo: str, base: str, table: str, python: str, timeout: float, show_new: bool,
        tmp_parent: str | None) -> tuple[int, dict]:
    """Collect both suites, map, print the report; returns (exit status, the map)."""
    table = table if os.path.isabs(table) else os.path.join(repo, table)
    tmp = tempfile.mkdtemp(prefix="test_map-", dir=tmp_parent)
    try:
        plugin_dir = os.path.join(tmp, "plugin")
        os.makedirs(plugin_dir)
        with open(os.path.join(plugin_dir, PLUGIN_NAME + ".py"), "w") as f:
            f.write(PLUGIN)
        tree = os.path.join(tmp, "base")
        commit = export_tree(repo, base, tree, timeout)
        old, old_errors = collect(python, tree, plugin_dir, timeout)
        new, new_errors = collect(python, repo, plugin_dir, timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    entries, problems = read_table(table)
    m = build_map(old, new, entries, os.path.relpath(table, repo))
    print(f"base {base} = {commit[:12]}; current tree {repo}; table {os.path.relpath(table, repo)} "
          f"({len(entries)} entries)")
    rows = [("old total", len(old)), ("kept same id", len(m["kept"])), ("moved/merged (by the table)", len(m["moved"])),
            ("unmapped", len(m["unmapped"])),
            (f"new ids not in the old suite ({len(m['fresh_targets'])} of them table targets)", len(m["fresh"])),
            ("current total", len(new))]
    for label, count in rows:
        print(f"{label:<60} {count:>6}")
    for title, items in (("unmapped old ids (no check may be lost: map them in the table)", m["unmapped"]),
                         ("table problems", problems + m["stale"]), ("notes", m["notes"]),
                         ("collection errors at the base", [f"{e['nodeid']}: {e['error']}" for e in old_errors]),
                         ("collection errors now", [f"{e['nodeid']}: {e['error']}" for e in new_errors])):
        if items:
            print(f"\n{title} ({len(items)}):")
            for x in items:
                print(f"  {x}")
    if show_new and m["fresh"]:
        print(f"\nnew ids ({len(m['fresh'])}):")
        for y in m["fresh"]:
            print(f"  {y}" + ("  (table target)" if y in m["fresh_targets"] else ""))
    if old_errors or new_errors:
        print("\nRESULT: incomplete - collection errors (exit 2)")
        return 2, m
    if m["unmapped"] or problems or m["stale"]:
        print(f"\nRESULT: FAIL - {len(m['unmapped'])} unmapped old id(s), {len(problems) + len(m['stale'])} "
              f"table problem(s)")
        return 1, m
    print("\nRESULT: PASS - every old id is collected now, under its own id or the table's")
    return 0, m


# ---- --smoke: the whole flow on a tiny generated git repository --------------------------------

SMOKE_OLD = {
    "pyproject.toml": '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n',
    "tests/conftest.py": "import pytest\n\n\n@pytest.fixture\ndef base():\n    return 1\n",
    "tests/test_a.py": textwrap.dedent("""\
        import pytest


        def test_kept(base):
            assert base == 1


        def test_moved():
            pass


        @pytest.mark.parametrize("x", [1, 2, 3])
        def test_param(x):
            pass


        def test_gone():
            pass


        class TestGroup:
            def test_inner(self):
                pass
        """),
    "tests/test_c.py": "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n",
}
SMOKE_NEW = {
    "tests/test_a.py": "def test_kept(base):\n    assert base == 1\n\n\ndef test_added():\n    pass\n",
    "tests/test_b.py": textwrap.dedent("""\
        import pytest


        def test_moved():
            pass


        def test_param_merged():
            pass


        class TestGroup:
            def test_inner(self):
                pass
        """),
    "tests/test_c2.py": "def test_one():\n    pass\n\n\ndef test_two():\n    pass\n",
    "tests/test_c.py": None,  # deleted: the whole file renamed, one prefix entry
}
SMOKE_TABLE = textwrap.dedent("""\
    # smoke table
    tests/test_a.py::test_moved -> tests/test_b.py::test_moved  # moved to test_b
    tests/test_a.py::test_param[1] -> tests/test_b.py::test_param_merged  # three cases merged into one
    tests/test_a.py::test_param[2] -> tests/test_b.py::test_param_merged  # three cases merged into one
    tests/test_a.py::test_param[3] -> tests/test_b.py::test_param_merged  # three cases merged into one
    tests/test_a.py::TestGroup::* -> tests/test_b.py::TestGroup::*  # the class moved
    tests/test_c.py::* -> tests/test_c2.py::*  # file renamed
    """)


def _write(root: str, files: dict) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        if text is None:
            os.remove(path)
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def smoke(python: str, timeout: float, workdir: str | None) -> int:
    """Old suite: 9 ids. Now: test_gone dropped, the rest kept or moved (prefix entries included),
    one test added. Case `missing entry`: exit 1 with exactly test_gone unmapped; case `complete`
    (an entry for it): exit 0; case `stale entry` (an entry whose target does not exist): exit 1."""
    if workdir:
        os.makedirs(workdir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="test_map-smoke-", dir=workdir)
    results = []
    try:
        repo = os.path.join(tmp, "repo")
        os.makedirs(repo)
        g = ["-c", "user.name=smoke", "-c", "user.email=smoke@localhost", "-c", "commit.gpgsign=false"]
        git(repo, "init", "-q")
        _write(repo, SMOKE_OLD)
        git(repo, "add", "-A")
        git(repo, *g, "commit", "-q", "-m", "old suite")
        base = git(repo, "rev-parse", "HEAD").strip()
        _write(repo, SMOKE_NEW)  # uncommitted: the working tree is what counts now
        table = os.path.join(tmp, "moves.txt")
        cases = [("missing entry", SMOKE_TABLE, 1, ["tests/test_a.py::test_gone"], 0),
                 ("complete", SMOKE_TABLE + "tests/test_a.py::test_gone -> tests/test_a.py::test_kept  # same check\n",
                  0, [], 0),
                 ("stale entry", SMOKE_TABLE + "tests/test_a.py::test_gone -> tests/test_a.py::test_nope  # typo\n",
                  1, ["tests/test_a.py::test_gone"], 1)]
        for name, text, want_rc, want_unmapped, want_stale in cases:
            with open(table, "w") as f:
                f.write(text)
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):  # the report is printed only when the case goes wrong
                rc, m = run(repo, base, table, python, timeout, show_new=False, tmp_parent=tmp)
            ok = rc == want_rc and m["unmapped"] == want_unmapped and len(m["stale"]) == want_stale
            results.append((name, rc, want_rc, m, ok))
            if not ok:
                print(buf.getvalue())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("test_map smoke: a generated repository, old suite 9 ids")
    print(f"{'case':<14} {'exit':>4} {'expected':>8} {'old':>4} {'kept':>4} {'moved':>5} {'unmapped':>8} {'new':>4}  "
          f"verdict")
    for name, rc, want_rc, m, ok in results:
        old = len(m["kept"]) + len(m["moved"]) + len(m["unmapped"])
        print(f"{name:<14} {rc:>4} {want_rc:>8} {old:>4} {len(m['kept']):>4} {len(m['moved']):>5} "
              f"{len(m['unmapped']):>8} {len(m['fresh']):>4}  {'ok' if ok else 'WRONG'}")
    return 0 if all(r[-1] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=DEFAULT_BASE, help=f"the base revision (default {DEFAULT_BASE})")
    ap.add_argument("--table", default=DEFAULT_TABLE, help=f"the moves table (default {DEFAULT_TABLE})")
    ap.add_argument("--python", default=None, help="interpreter that runs pytest (default: .venv/bin/python)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per collection / git command (default 900)")
    ap.add_argument("--show-new", action="store_true", help="also list the ids that are new since the base")
    ap.add_argument("--repo", default=ROOT, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="the whole flow on a tiny generated repository")
    ap.add_argument("--workdir", default=None, help="where temporary directories go (default: the system's)")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    python = a.python or default_python(a.repo)
    try:
        if a.smoke:
            return smoke(python, min(a.timeout, 120), a.workdir)
        return run(os.path.abspath(a.repo), a.base, a.table, python, a.timeout, a.show_new, a.workdir)[0]
    except Failure as e:
        print(f"test_map: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
