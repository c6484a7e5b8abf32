"""Mutation check of the test suite (issue 51): three deliberate bugs in the product code, the same
ones in the old suite (base c651b52) and the new one (this checkout's working tree), each caught by
both.

    .venv/bin/python bench/mutation_check.py                     # every bug, both trees, with controls
    .venv/bin/python bench/mutation_check.py --bugs cp,adam      # no vLLM server needed (minutes)
    .venv/bin/python bench/mutation_check.py --bugs vllm         # each run starts a vLLM server (minutes)
    .venv/bin/python bench/mutation_check.py --smoke             # apply every edit to both trees, run nothing

The bugs (BUGS below), each one exact source edit of gspo_megatron/ whose anchor must occur exactly
once in the file of both trees (the three files are unchanged between c651b52 and now):
  cp    train/loss.py, policy_loss_step: the per-sequence GSPO statistics (log-ratio sums, token
        counts) reduced with cp_all_reduce_sum(t, None) instead of the CP group: every CP rank
        keeps its own partial sums (parallel/seq_reduce.py: group=None is a no-op).
  adam  train/checkpoint_shards.py, distributed_optimizer_plan (the trainer's checkpoint writer for
        the distributed optimizer): exp_avg_sq is never written, for every parameter.
  vllm  rollout/vllm_engine.py, VLLMEngine._write_push (the disk push to vLLM):
        model.layers.0.mlp.experts.0.down_proj.weight is left out of the pushed files; the server
        keeps its previous value of that expert tensor.

What it does:
  trees     old: `git archive c651b52 | tar -x` into a temporary directory (its own tests, conftest
            and package); new: the files `git ls-files -co --exclude-standard` lists, copied from
            this checkout (uncommitted and untracked, not ignored, files included).
  per bug   for each tree: the bug's test ids of THAT tree (the suites name some tests differently)
            run unmutated (control: they must pass; skipped with --no-control), then with the edit
            applied (caught: pytest exits 1, a test failed or errored), then the file is restored.
            pytest runs as `<.venv python> -m pytest -p no:cacheprovider -q -x <ids>` with cwd the
            tree and PYTHONPATH=<tree> first; before each run the module holding the edit is
            imported with the same interpreter, env and cwd, and its __file__ must be the tree's
            copy (with the edit in it for a mutated run), else the check stops (exit 2): the
            .venv's editable install points at this checkout, which must not be what runs.
  smoke     both trees made, every edit applied and compiled and reverted, every test id's file
            and function found in its tree; no test runs (seconds).

Printed: one table row per bug and tree: tests run, control passed, caught, seconds (control +
mutated run), then the edits and each run's pytest summary line. Exit status: 0 every bug caught by
both trees and every control passed (--smoke: every edit applies to both trees); 1 otherwise;
2 usage, git, or environment errors. Every subprocess has a timeout (its process group is killed);
the temporary directories are removed at the end (also on error, Ctrl-C and SIGTERM) unless --keep.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = "c651b52"
TREES = ("old", "new")


@dataclass(frozen=True)
class Bug:
    key: str
    what: str
    path: str          # the product file, relative to the tree
    module: str        # its module (imported to check which copy runs)
    anchor: str        # exact text, exactly once in the file of both trees
    replacement: str
    tests: dict = field(default_factory=dict)  # tree -> [node ids of that tree]
    timeout_s: float = 900.0  # per pytest run


BUGS: dict[str, Bug] = {b.key: b for b in [
    Bug(
        "cp", "GSPO sequence reduction forgets the CP group",
        "gspo_megatron/train/loss.py", "gspo_megatron.train.loss",
        "stats = stats.reduce(lambda t: cp_all_reduce_sum(t, ctx.cp_group))",
        "stats = stats.reduce(lambda t: cp_all_reduce_sum(t, None))  # MUTATION cp: the CP group forgotten",
        {tree: ["tests/test_train_invariance.py::test_context_parallel_and_packed_steps_match_the_reference[cp2-padded]"]
         for tree in TREES},
        timeout_s=900.0),
    Bug(
        "adam", "checkpoint drops one Adam moment (exp_avg_sq, every parameter)",
        "gspo_megatron/train/checkpoint_shards.py", "gspo_megatron.train.checkpoint_shards",
        "                            for kind in STATE_KINDS:\n"
        "                                t = states[kind]\n",
        "                            for kind in (\"param\", \"exp_avg\"):  # MUTATION adam: exp_avg_sq never written\n"
        "                                t = states[kind]\n",
        {tree: ["tests/test_checkpoint.py::test_checkpoint_reloads_exactly_at_another_layout[tp1xdp2-default-pieces]"]
         for tree in TREES},
        timeout_s=1200.0),
    Bug(
        "vllm", "vLLM push skips one expert tensor",
        "gspo_megatron/rollout/vllm_engine.py", "gspo_megatron.rollout.vllm_engine",
        "        _save_hf(named_tensors, path, self.hf_config, self.sync_dtype, self.cfg[\"model_path\"])\n",
        "        named_tensors = ((n, t) for n, t in named_tensors\n"
        "                         if n != \"model.layers.0.mlp.experts.0.down_proj.weight\")  # MUTATION vllm\n"
        "        _save_hf(named_tensors, path, self.hf_config, self.sync_dtype, self.cfg[\"model_path\"])\n",
        # tests/test_vllm.py kept these two when it was split (the supervised and GLM tests moved out)
        {tree: ["tests/test_vllm.py::test_served_logprobs_follow_pushes_and_a_skipped_push_shows",
                "tests/test_vllm.py::test_verified_pushes_pass_and_a_corrupted_expert_is_named"]
         for tree in TREES},
        timeout_s=1800.0),
]}


class Failure(Exception):
    """A usage, git or environment error: one message, exit status 2."""


def _terminate(signum, frame):  # SIGTERM: unwind through the finally blocks (temporary dirs)
    raise SystemExit(128 + signum)


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()


def _run(cmd: list[str], cwd: str, timeout: float, env: dict | None = None, log: str | None = None,
         stdin=None) -> tuple[int | None, str, float]:
    """(exit status or None on timeout, output, seconds); the command runs in its own process group,
    which is killed on timeout or interruption. Output goes to `log` when given (read back)."""
    t0 = time.monotonic()
    out_f = open(log, "w+b") if log else tempfile.TemporaryFile()
    try:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=stdin if stdin is not None else subprocess.DEVNULL,
                             stdout=out_f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            rc = None
        except BaseException:
            _kill_group(p)
            raise
        out_f.seek(0)
        out = out_f.read().decode(errors="replace")
    finally:
        out_f.close()
    return rc, out, time.monotonic() - t0


def _git(*args: str, timeout: float = 120) -> str:
    r = subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode:
        raise Failure(f"git {' '.join(args)}: {r.stderr.strip()[:300]}")
    return r.stdout


def make_old_tree(dest: str, rev: str) -> None:
    os.makedirs(dest)
    archive = subprocess.Popen(["git", "-C", ROOT, "archive", rev], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        tar = subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, capture_output=True, timeout=300)
        archive.stdout.close()
        err = archive.stderr.read().decode(errors="replace")
        rc = archive.wait(timeout=60)
    except BaseException:
        _kill_group(archive)
        raise
    if rc or tar.returncode:
        raise Failure(f"git archive {rev} | tar -x: {err.strip()[:300]} {tar.stderr.decode(errors='replace')[:300]}")


def make_new_tree(dest: str) -> int:
    """This checkout's working tree: tracked and untracked-not-ignored files (deleted ones skipped)."""
    names = [n for n in _git("ls-files", "-co", "--exclude-standard", "-z").split("\0") if n]
    n = 0
    for name in names:
        src = os.path.join(ROOT, name)
        if not os.path.lexists(src) or os.path.isdir(src) and not os.path.islink(src):
            continue
        dst = os.path.join(dest, name)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst, follow_symlinks=False)
        n += 1
    return n


def python_exe() -> str:
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    return venv if os.access(venv, os.X_OK) else sys.executable


def tree_env(tree: str) -> dict:
    env = dict(os.environ)
    for k in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST", "PYTHONSAFEPATH"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([tree] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no .pyc of a mutated file outlives its run
    return env


def check_import(bug: Bug, tree: str, mutated: bool) -> str:
    """The file `bug.module` is imported from under the tree's env and cwd; it must be the tree's copy
    (holding the edit exactly when `mutated`). Returns the printed gspo_megatron.__file__."""
    code = ("import importlib, gspo_megatron; m = importlib.import_module(%r); "
            "print(gspo_megatron.__file__); print(m.__file__)" % bug.module)
    rc, out, _ = _run([python_exe(), "-c", code], tree, 300, tree_env(tree))
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    if rc != 0 or len(lines) < 2:
        raise Failure(f"importing {bug.module} in {tree} failed (exit {rc}): {out.strip()[-500:]}")
    pkg, mod = lines[-2].strip(), lines[-1].strip()
    real_tree = os.path.realpath(tree) + os.sep
    if not os.path.realpath(pkg).startswith(real_tree) or not os.path.realpath(mod).startswith(real_tree):
        raise Failure(f"in {tree} gspo_megatron is imported from {pkg} ({bug.module}: {mod}), not the tree's copy: "
                      "refusing to run its tests")
    with open(mod) as f:
        has = bug.replacement in f.read()
    if has != mutated:
        raise Failure(f"{mod}: the edit of bug {bug.key} is {'missing' if mutated else 'present'}")
    return pkg


def apply_edit(bug: Bug, tree: str) -> str:
    """Apply the edit in `tree`; returns the original text (for revert). Refuses an anchor that is
    not there exactly once, or an edited file that does not compile."""
    path = os.path.join(tree, bug.path)
    with open(path) as f:
        text = f.read()
    n = text.count(bug.anchor)
    if n != 1:
        raise Failure(f"bug {bug.key}: the anchor occurs {n} times in {path} (needs exactly 1)")
    new = text.replace(bug.anchor, bug.replacement)
    compile(new, path, "exec")
    with open(path, "w") as f:
        f.write(new)
    return text


def revert_edit(bug: Bug, tree: str, original: str) -> None:
    with open(os.path.join(tree, bug.path), "w") as f:
        f.write(original)


def check_ids_exist(bug: Bug, tree_kind: str, tree: str) -> list[str]:
    """Problems with the bug's test ids in the tree: missing file or test function (no collection)."""
    problems = []
    for tid in bug.tests[tree_kind]:
        fname, _, rest = tid.partition("::")
        func = rest.split("[")[0].split("::")[-1]
        path = os.path.join(tree, fname)
        if not os.path.exists(path):
            problems.append(f"{tid}: no {fname} in the {tree_kind} tree")
            continue
        with open(path) as f:
            if f"def {func}(" not in f.read():
                problems.append(f"{tid}: no test {func} in the {tree_kind} tree's {fname}")
    return problems


def summary_of(out: str) -> str:
    """pytest's final summary line, and the first FAILED/ERROR line of -ra's short summary."""
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    final = next((ln for ln in reversed(lines) if ln.startswith("=") or " passed" in ln or " failed" in ln
                  or " error" in ln), lines[-1] if lines else "")
    first = next((ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))), "")
    why = next((ln[1:].strip() for ln in lines if ln.startswith("E ") and len(ln[1:].strip()) > 3), "")
    return (final.strip("= ") + (f" | {first[:220]}" if first else "")
            + (f" | E {why[:300]}" if why and (first or "failed" in final or "error" in final) else ""))


def run_tests(bug: Bug, tree_kind: str, tree: str, label: str, logdir: str) -> dict:
    ids = bug.tests[tree_kind]
    cmd = [python_exe(), "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x", *ids]
    log = os.path.join(logdir, f"{bug.key}-{tree_kind}-{label}.log")
    print(f"[{bug.key} {tree_kind} {label}] {' '.join(ids)}", flush=True)
    rc, out, secs = _run(cmd, tree, bug.timeout_s, tree_env(tree), log=log)
    s = summary_of(out)
    print(f"[{bug.key} {tree_kind} {label}] exit {'timeout' if rc is None else rc} in {secs:.0f} s: {s}", flush=True)
    return {"rc": rc, "secs": secs, "summary": s, "log": log, "tail": out.strip().splitlines()[-25:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bugs", default=",".join(BUGS), help=f"comma-separated, of {', '.join(BUGS)} (default all)")
    ap.add_argument("--base", default=BASE, help="the old suite's commit (default %(default)s)")
    ap.add_argument("--no-control", action="store_true", help="skip the unmutated runs")
    ap.add_argument("--keep", action="store_true", help="keep the temporary trees (and run logs)")
    ap.add_argument("--smoke", action="store_true", help="apply every edit to both trees, run no test")
    args = ap.parse_args(argv)
    keys = [k.strip() for k in args.bugs.split(",") if k.strip()]
    unknown = [k for k in keys if k not in BUGS]
    if unknown or not keys:
        print(f"error: unknown bug(s) {unknown}; known: {', '.join(BUGS)}", file=sys.stderr)
        return 2
    bugs = [BUGS[k] for k in keys]
    signal.signal(signal.SIGTERM, _terminate)
    tmp = tempfile.mkdtemp(prefix="mutation_check_")
    try:
        return _main(args, bugs, tmp)
    except Failure as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _main(args, bugs: list[Bug], tmp: str) -> int:
    commit = _git("rev-parse", "--verify", f"{args.base}^{{commit}}").strip()
    trees = {"old": os.path.join(tmp, "old"), "new": os.path.join(tmp, "new")}
    logdir = os.path.join(tmp, "logs")
    os.makedirs(logdir)
    make_old_tree(trees["old"], commit)
    os.makedirs(trees["new"])
    n = make_new_tree(trees["new"])
    names = {"old": f"old {commit[:7]}", "new": "new (working tree)"}
    print(f"trees: old = {args.base} ({commit[:12]}) in {trees['old']}; new = {n} files of {ROOT} in {trees['new']}",
          flush=True)
    for bug in bugs:  # every edit applies (and compiles) in both trees before any test runs
        for kind, tree in trees.items():
            revert_edit(bug, tree, apply_edit(bug, tree))
    problems = [p for bug in bugs for kind, tree in trees.items() for p in check_ids_exist(bug, kind, tree)]
    if args.smoke:
        print(f"{'bug':6} {'tree':20} {'edit applies':12} tests")
        for bug in bugs:
            for kind in trees:
                print(f"{bug.key:6} {names[kind]:20} {'yes':12} {len(bug.tests[kind])}")
        for p in problems:
            print(f"test id: {p}")
        _print_edits(bugs)
        return 1 if problems else 0
    if problems:
        raise Failure("; ".join(problems))
    rows = []
    for bug in bugs:
        for kind, tree in trees.items():
            row = {"bug": bug.key, "tree": names[kind], "tests": bug.tests[kind], "control": None, "caught": False,
                   "secs": 0.0, "runs": {}}
            rows.append(row)
            if not args.no_control:
                pkg = check_import(bug, tree, mutated=False)
                print(f"[{bug.key} {kind} control] gspo_megatron.__file__ = {pkg}", flush=True)
                r = run_tests(bug, kind, tree, "control", logdir)
                row["runs"]["control"] = r
                row["control"] = r["rc"] == 0
                row["secs"] += r["secs"]
                if not row["control"]:
                    print("\n".join(f"    {ln}" for ln in r["tail"]), flush=True)
            original = apply_edit(bug, tree)
            try:
                pkg = check_import(bug, tree, mutated=True)
                print(f"[{bug.key} {kind} mutated] gspo_megatron.__file__ = {pkg}", flush=True)
                r = run_tests(bug, kind, tree, "mutated", logdir)
            finally:
                revert_edit(bug, tree, original)
            row["runs"]["mutated"] = r
            row["caught"] = r["rc"] == 1  # tests failed; 0 = passed, 2-5 = interrupted/usage/none collected
            row["secs"] += r["secs"]
            if not row["caught"]:
                print("\n".join(f"    {ln}" for ln in r["tail"]), flush=True)
    _print_table(rows)
    _print_edits(bugs)
    print("\nruns:")
    for row in rows:
        for label, r in row["runs"].items():
            rc = "timeout" if r["rc"] is None else r["rc"]
            print(f"  {row['bug']:5} {row['tree']:20} {label:8} exit {rc} {r['secs']:6.0f} s  {r['summary']}")
    ok = all(r["caught"] and (args.no_control or r["control"]) for r in rows)
    print(f"\nverdict: {'every bug caught by both trees' if ok else 'NOT every bug caught / control passed'}"
          + (" (controls not run)" if args.no_control else ", every control passed" if ok else ""))
    return 0 if ok else 1


def _print_table(rows: list[dict]) -> None:
    print(f"\n{'bug':5} | {'tree':20} | {'control passed':14} | {'caught':6} | {'seconds':7} | tests run")
    for r in rows:
        control = "-" if r["control"] is None else ("yes" if r["control"] else "NO")
        tests = ", ".join(t.split("/")[-1] for t in r["tests"])
        print(f"{r['bug']:5} | {r['tree']:20} | {control:14} | {'yes' if r['caught'] else 'NO':6} | "
              f"{r['secs']:7.0f} | {tests}")


def _print_edits(bugs: list[Bug]) -> None:
    print("\nedits:")
    for bug in bugs:
        print(f"  {bug.key}: {bug.what} ({bug.path})")
        for ln in bug.anchor.rstrip("\n").splitlines():
            print(f"    - {ln.strip()}")
        for ln in bug.replacement.rstrip("\n").splitlines():
            print(f"    + {ln.strip()}")


if __name__ == "__main__":
    sys.exit(main())
