"""The README as a front page, and the docs it links to: README.md stays short, its "two commands"
block is exactly `make demo` and `make test`, every bash block in it is one a test runs, every
relative link (and #anchor) in README.md and docs/*.md resolves, every docs page is linked from the
README, and docs/benchmarks.md gives a command for each of its tables whose test names and bench
options exist. Files are read and parsed only: nothing is run here."""
from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import shlex


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
BENCHMARKS = os.path.join(ROOT, "docs", "benchmarks.md")
MAX_README_LINES = 250

FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)
TEST_REF = re.compile(r"(?:tests/)?\b(test_\w+\.py)(?:::(\w+))?")
BENCH_CMD = re.compile(r"python3? (bench/[\w./-]+\.py)([^`#\n]*)")


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def rel(path: str) -> str:
    return os.path.relpath(path, ROOT)


def md_files() -> list[str]:
    return [README] + DOCS


def blocks(text: str) -> list[tuple[str, str, int]]:
    """Fenced code blocks: (language, body, 1-based line of the opening fence)."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code spans (where links are links)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text)


def prose_keep_inline(text: str) -> str:
    """Headings may hold inline code (`x`): only the fenced blocks are blanked."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def section(text: str, title: str) -> str:
    parts = text.split(f"\n## {title}\n", 1)
    assert len(parts) == 2, f"README.md has no '## {title}' section"
    return parts[1].split("\n## ", 1)[0]


def commands(block: str) -> list[str]:
    """The shell commands of a block: comments dropped, continuation lines joined."""
    out, cur = [], ""
    for line in block.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        if cur.strip():
            out.append(" ".join(cur.split()))
        cur = ""
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose_keep_inline(read(path))):
        s = slug(m.group(2))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: str) -> list[tuple[str, int]]:
    text = prose(read(path))
    return [(m.group(1), text.count("\n", 0, m.start()) + 1) for m in LINK.finditer(text)]


def load_byo():
    spec = importlib.util.spec_from_file_location("_readme_byo", os.path.join(ROOT, "tests", "test_readme_byo.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------ README


def test_readme_is_a_front_page():
    n = len(read(README).splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): move detail into a "
                                   "page under docs/ and link it from the README's list")
    text = read(README)
    for title in ("The two commands", "Running it yourself", "Your own model and data", "Clusters",
                  "Where the measurements are"):
        section(text, title)
    assert "(docs/cluster.md)" in section(text, "Clusters")
    assert "(docs/benchmarks.md)" in section(text, "Where the measurements are")


def test_the_two_commands_are_make_demo_and_make_test():
    body = section(read(README), "The two commands")
    found = blocks(body)
    assert len(found) == 1, f"'## The two commands' should hold one code block, found {len(found)}"
    lang, block, _ = found[0]
    assert lang == "bash"
    assert commands(block) == ["make demo", "make test"], commands(block)
    makefile = read(os.path.join(ROOT, "Makefile"))
    for target in ("demo", "test"):
        assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no '{target}' target"
    assert "make test" in commands(read(os.path.join(ROOT, ".ci", "run")))  # CI runs the README's command


def test_every_readme_bash_block_is_run_by_a_test():
    """README's code blocks are the two make commands and the "Your own model and data" block,
    which tests/test_readme_byo.py runs as written. Any other command block belongs in docs/."""
    text = read(README)
    found = blocks(text)
    assert found, "README.md has no code blocks"
    other = [(lang or "(none)", line) for lang, _, line in found if lang != "bash"]
    assert not other, f"README.md: code blocks not marked ```bash (language, line): {other}"
    two = blocks(section(text, "The two commands"))[0][1]
    byo_mod = load_byo()
    byo = byo_mod.readme_block()
    assert byo.strip() and byo in text
    tree = ast.parse(read(os.path.join(ROOT, "tests", "test_readme_byo.py")))
    runs = [f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
            and any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "readme_block" for c in ast.walk(f))]
    assert runs, "tests/test_readme_byo.py has no test that runs readme_block()"
    unrun = [line for _, body, line in found if body not in (two, byo)]
    assert not unrun, (f"README.md: the bash block(s) at line(s) {unrun} are run by no test; keep README's blocks "
                       "to the two make commands and the 'Your own model and data' block, move others to docs/")


# ------------------------------------------------------------------------------------ links


def test_relative_links_resolve():
    bad = [msg for path in md_files() for msg in _bad_links(path)]
    assert not bad, "\n".join(bad)


def _bad_links(path: str) -> list[str]:
    bad = []
    for target, line in links(path):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(dest) or os.path.relpath(dest, ROOT).startswith(".."):
            bad.append(f"{rel(path)}:{line}: {target} -> {rel(dest)} does not exist")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{rel(path)}:{line}: {target}: no heading with anchor #{anchor} in {rel(dest)}")
    return bad


def test_every_docs_page_is_linked_from_the_readme():
    linked = {os.path.normpath(os.path.join(ROOT, t.partition("#")[0])) for t, _ in links(README)}
    missing = [rel(p) for p in DOCS if p not in linked]
    assert not missing, f"docs pages a reader cannot reach from README.md's links: {missing}"


def test_slug_follows_github():
    assert slug("Reliability: what a run guarantees, and the test for each") == \
        "reliability-what-a-run-guarantees-and-the-test-for-each"
    assert slug("vLLM rollouts (`rollout.backend=vllm`)") == "vllm-rollouts-rolloutbackendvllm"
    assert slug("HF → sharded model load") == "hf--sharded-model-load"


# ------------------------------------------------------------------------------------ commands in the docs


def _test_names(path: str) -> set[str]:
    tree = ast.parse(read(path))
    return {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_named_tests_exist():
    """`tests/test_x.py` and `test_x.py::test_name` in the docs name a file and a test that exist."""
    bad, names = [], {}
    for path in md_files():
        bad += _bad_test_refs(path, names)
    assert not bad, "\n".join(bad)


def _bad_test_refs(path: str, names: dict) -> list[str]:
    bad = []
    text = read(path)
    for m in TEST_REF.finditer(text):
        file, func = m.group(1), m.group(2)
        full = os.path.join(ROOT, "tests", file)
        line = text.count("\n", 0, m.start()) + 1
        if not os.path.isfile(full):
            bad.append(f"{rel(path)}:{line}: tests/{file} does not exist")
            continue
        if func and func not in names.setdefault(file, _test_names(full)):
            bad.append(f"{rel(path)}:{line}: tests/{file} has no test {func}")
    return bad


def test_bench_commands_use_options_the_bench_has():
    bad = [msg for path in md_files() for msg in _bad_bench_commands(path)]
    assert not bad, "\n".join(bad)


def _bad_bench_commands(path: str) -> list[str]:
    bad = []
    text = read(path)
    for m in BENCH_CMD.finditer(text):
        script, args = m.group(1), m.group(2)
        line = text.count("\n", 0, m.start()) + 1
        full = os.path.join(ROOT, script)
        if not os.path.isfile(full):
            bad.append(f"{rel(path)}:{line}: {script} does not exist")
            continue
        src = read(full)
        try:
            words = shlex.split(args.split("&&")[0])
        except ValueError:
            words = args.split()
        for w in words:
            flag = w.split("=", 1)[0]
            if flag.startswith("--") and f'"{flag}"' not in src:
                bad.append(f"{rel(path)}:{line}: {script} has no option {flag}")
    return bad


def test_every_benchmarks_table_has_its_command():
    """docs/benchmarks.md: each table either names a `pytest tests/...` command in every row, or
    sits in a section (between two headings) that gives the `python bench/...` command printing it."""
    text = read(BENCHMARKS)
    lines = prose_keep_inline(text).splitlines()
    bad, start, i = [], 0, 0
    while i < len(lines):
        if HEADING.match(lines[i]):
            start = i
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            j = i + 2
            rows = []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(lines[j])
                j += 1
            end = next((k for k in range(i, len(lines)) if HEADING.match(lines[k])), len(lines))
            sec = "\n".join(text.splitlines()[start:end])
            if not ("python bench/" in sec or all("pytest tests/" in r for r in rows)):
                bad.append(f"docs/benchmarks.md:{i + 1}: a table with no command (a `python bench/...` block in "
                           "its section, or `pytest tests/...` in every row)")
            i = j
            continue
        i += 1
    assert not bad, "\n".join(bad)
    assert text.count("pytest tests/") >= 20 and text.count("python bench/") >= 10


# ---- statements about options are checked against the config (issue 41: "only weight_sync=disk is
# wired" stayed in the README after nccl was) ----------------------------------------------------------
SECTIONS = "model|parallel|loss|rollout|data|reward|optimizer|train|checkpoint|logging|eval"
OPTION = re.compile(r"(?<![\w./-])((?:%s)\.[a-z_][a-z0-9_.]*[a-z0-9_])(?:=([^\s`'\"),;]+))?" % SECTIONS)
ONLY = re.compile(r"\bonly `?((?:%s)\.[a-z_][a-z0-9_.]*)=(\w+)`? (?:is|are) (?:wired|supported|implemented|available)"
                  % SECTIONS)


def _option_mentions():
    """(file:line, key, value or None) of every config option named in code (backticks or a fenced
    block) in README.md and docs/*.md."""
    for path in md_files():
        for n, line in enumerate(read(path).splitlines(), 1):
            for span in re.findall(r"`([^`]+)`", line) or ([line] if not line.startswith(("#", ">")) else []):
                for m in OPTION.finditer(span):
                    yield f"{rel(path)}:{n}", m.group(1), m.group(2)


def test_options_named_in_the_docs_exist_with_values_they_take():
    """Every `section.key` and `section.key=value` in the docs is a config key (or a section of
    them), and a value given for a Literal or bool key is one it takes (`a|b` lists alternatives).
    Statements that "only `key=value` is wired/supported" are refused for a key that takes more
    values: the config is the source of what exists."""
    from gspo_megatron.config_reference import entries

    keys = {e["key"]: e["type"] for e in entries()}
    open_types = ("Optional[dict", "dict", "list[EvalSetConfig")
    bad = []
    for where, key, value in _option_mentions():
        if key not in keys:
            section = any(k.startswith(key + ".") for k in keys)
            inside = any(key.startswith(k + ".") and t.startswith(open_types) for k, t in keys.items())
            if not (section or inside):
                bad.append(f"{where}: {key} is no config key")
            continue
        t = keys[key]
        allowed = re.findall(r"'([^']*)'", t) if "Literal" in t else ["true", "false"] if t == "bool" else None
        if value is None or allowed is None:
            continue
        for v in value.split("|"):
            if v not in allowed and not (v == "null" and "Optional" in t):
                bad.append(f"{where}: {key}={v}, which takes {allowed}")
    for path in md_files():
        for n, line in enumerate(read(path).splitlines(), 1):
            for key, value in ONLY.findall(line):
                t = keys.get(key, "")
                if len(re.findall(r"'([^']*)'", t)) > 1:
                    bad.append(f"{rel(path)}:{n}: says only {key}={value} exists; the config takes {t}")
    assert not bad, "\n".join(bad)


def test_the_option_checker_catches_what_it_is_for(tmp_path, monkeypatch):
    """Negative control: a stale key, a value a Literal does not take and an "only X is wired"
    claim about a key with more values are each reported."""
    import sys

    import pytest

    page = tmp_path / "stale.md"
    page.write_text("Use `rollout.vllm.weight_sync=rdma` or `rollout.nonexistent=1`.\n"
                    "For vLLM, only `rollout.vllm.weight_sync=disk` is wired.\n")
    monkeypatch.setattr(sys.modules[__name__], "md_files", lambda: [str(page)])
    with pytest.raises(AssertionError) as e:
        test_options_named_in_the_docs_exist_with_values_they_take()
    msg = str(e.value)
    assert "weight_sync=rdma" in msg and "rollout.nonexistent is no config key" in msg and "says only" in msg
