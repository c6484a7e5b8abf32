"""The project's import graph, read from the source with `ast` (nothing is imported):

  * no import circle among the project's modules (gspo_megatron/, converters/, and launch/ if it
    ever holds Python): a circle makes what a module sees at import time depend on which module
    of the circle was imported first, and turns a lazy import inside a function into a hidden
    ordering constraint;
  * the library (gspo_megatron/) imports nothing from converters/ (the `gspo-convert` command sits
    on top of the library's checkpoint package, never under it).

Every import statement counts: module level, inside functions and methods, under
`if TYPE_CHECKING:` or `try:` alike: a lazy import only moves the moment the circle closes.
Dynamic imports (`importlib.import_module(name)`, e.g. rollout/__init__.py's lazy exports) are
strings, not statements, and are not seen.

What an import statement is an edge to:
  * `import a.b.c` and `from a.b.c import x` execute a/__init__.py, a/b/__init__.py and a/b/c.py,
    so the edges go to a, a.b and a.b.c; `from a.b import c` also to a.b.c when c is a module.
  * except the importing module's own ancestor packages: a submodule of `a` runs only after
    a/__init__.py has started (Python imports the parents first), so its `import a...` finds `a`
    in sys.modules and runs nothing. Counting those edges would report every package whose
    __init__ re-exports its submodules (algorithms/__init__.py) as a circle with each of them,
    though no import order can break it.
  * relative imports are resolved against the importing module's package (a package's
    __init__.py is its own package).
Only edges to the project's own modules are kept (torch, megatron, ... are leaves).
"""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("gspo_megatron", "converters", "launch")


def project_modules(repo: str = REPO) -> dict[str, tuple[str, bool]]:
    """module name -> (file path, is a package __init__) of every .py under ROOTS."""
    out = {}
    for root in ROOTS:
        for d, dirs, files in os.walk(os.path.join(repo, root)):
            dirs[:] = sorted(x for x in dirs if x != "__pycache__" and not x.startswith("."))
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(d, f), repo)[:-3].split(os.sep)
                pkg = rel[-1] == "__init__"
                out[".".join(rel[:-1] if pkg else rel)] = (os.path.join(d, f), pkg)
    return out


def _with_parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of the first statement importing it}."""
    graph: dict[str, dict[str, int]] = {}
    for mod, (path, is_pkg) in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        package = mod if is_pkg else mod.rpartition(".")[0]
        own_ancestors = set(_with_parents(package)) if package else set()
        edges: dict[str, int] = {}

        def add(target: str, line: int) -> None:
            for name in _with_parents(target):
                if name in modules and name != mod and name not in own_ancestors:
                    edges.setdefault(name, line)

        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    add(alias.name, node.lineno)
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: `from . import x`, `from ..a import x`
                    base = package.split(".") if package else []
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                add(source, node.lineno)
                for alias in node.names:  # `from pkg import submodule`
                    if f"{source}.{alias.name}" in modules:
                        add(f"{source}.{alias.name}", node.lineno)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle as [m0, m1, ..., m0], or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, its = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(its[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                its.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                its.append(iter(sorted(graph[nxt])))
    return None


def _describe(cycle: list[str], graph, modules) -> str:
    return "\n".join(f"  {a} ({os.path.relpath(modules[a][0], REPO)}:{graph[a][b]}) imports {b}"
                     for a, b in zip(cycle, cycle[1:]))


def test_no_import_cycles():
    modules = project_modules()
    assert "gspo_megatron.config" in modules and "converters.cli" in modules  # the walk found the tree
    graph = import_graph(modules)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle:\n" + _describe(cycle, graph, modules)


def test_library_does_not_import_converters():
    modules = project_modules()
    graph = import_graph(modules)
    bad = [f"{os.path.relpath(modules[m][0], REPO)}:{line} imports {t}"
           for m, edges in sorted(graph.items()) if m.split(".")[0] == "gspo_megatron"
           for t, line in sorted(edges.items()) if t.split(".")[0] == "converters"
           and not any(u.startswith(t + ".") for u in edges)]  # the module, not also its packages
    assert not bad, "the library imports the gspo-convert command's package:\n  " + "\n  ".join(bad)


def test_the_graph_reader_sees_what_it_must(tmp_path):
    """The reader on a small made-up tree: lazy, relative, `import a.b.c` and `from pkg import
    module` edges are seen, an ancestor package is not an edge, and a circle is reported."""
    files = {
        "gspo_megatron/__init__.py": "",
        "gspo_megatron/a.py": "def f():\n    from gspo_megatron.sub import c\n",
        "gspo_megatron/sub/__init__.py": "from .c import x\n",  # re-exports: no circle with c
        "gspo_megatron/sub/c.py": "import gspo_megatron.sub.d\nx = 1\n",
        "gspo_megatron/sub/d.py": "from ..e import y\n",
        "gspo_megatron/e.py": "import os\ny = 2\n",
        "converters/__init__.py": "",
        "converters/cli.py": "import gspo_megatron.a\n",
    }
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    modules = project_modules(str(tmp_path))
    graph = import_graph(modules)
    assert graph["gspo_megatron.a"] == {"gspo_megatron.sub": 2, "gspo_megatron.sub.c": 2}
    assert graph["gspo_megatron.sub"] == {"gspo_megatron.sub.c": 1}
    assert graph["gspo_megatron.sub.c"] == {"gspo_megatron.sub.d": 1}  # not its own package
    assert graph["gspo_megatron.sub.d"] == {"gspo_megatron.e": 1}
    assert graph["converters.cli"] == {"gspo_megatron": 1, "gspo_megatron.a": 1}  # another package: runs its __init__
    assert find_cycle(graph) is None
    (tmp_path / "gspo_megatron/e.py").write_text("def g():\n    import gspo_megatron.a\n")
    assert find_cycle(import_graph(project_modules(str(tmp_path)))) == [
        "gspo_megatron.a", "gspo_megatron.sub", "gspo_megatron.sub.c", "gspo_megatron.sub.d", "gspo_megatron.e", "gspo_megatron.a"]


# ---- model families (docs/design.md "Adding a model family") -------------------------------

FAMILIES_PKG = "gspo_megatron.model.families"
# The only modules outside the family folders that may name a family: the registry, which maps
# model_type to its module by string (and so imports none of them).
REGISTRY = "gspo_megatron.model.registry"


def _family_of_module(mod: str) -> str | None:
    """`qwen3_moe` for gspo_megatron.model.families.qwen3_moe[.x]; None outside the family folders."""
    if mod.startswith(FAMILIES_PKG + "."):
        return mod[len(FAMILIES_PKG) + 1:].split(".")[0]
    return None


def test_no_module_outside_a_family_imports_it():
    """Loader, exporter, converter, weight sync, planner, engines and `score` ask the registry
    (`family_for`, `arch.family`), never a family's module; a family imports no other family."""
    modules = project_modules()
    graph = import_graph(modules)
    bad = []
    for mod, edges in sorted(graph.items()):
        own = _family_of_module(mod)
        for target, line in sorted(edges.items()):
            fam = _family_of_module(target)
            if fam is not None and fam != own:
                bad.append(f"{os.path.relpath(modules[mod][0], REPO)}:{line} imports {target}")
    assert not bad, "imports of a model family from outside it:\n  " + "\n  ".join(bad)


def test_only_the_family_folders_and_the_registry_spell_a_family():
    """`grep -rn "qwen3_moe|Qwen3Moe|glm4_moe|Glm4Moe|deepseek_v3|DeepseekV3|..." gspo_megatron
    converters --include=*.py` (every registered family's model type and transformers class) hits
    only the families' folders and the registry; so do the HF config fields only one family has
    (issue 53: DeepSeek-V3's latent ranks and expert groups)."""
    import re

    from gspo_megatron.model.registry import FAMILY_MODULES, family_of_type

    assert {"qwen3_moe", "glm4_moe", "deepseek_v3"} <= set(FAMILY_MODULES)
    names = set()  # anywhere in a word: Qwen3MoeConfig, glm4_moe_lite
    for t in FAMILY_MODULES:
        names |= {t, family_of_type(t).hf_architecture.removesuffix("ForCausalLM")}
    fields = {"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group",
              "topk_group"}  # whole words (run_group is not n_group)
    needle = re.compile("|".join(sorted(map(re.escape, names))) + r"|\b(" + "|".join(sorted(fields)) + r")\b")
    hits = []
    for mod, (path, _) in sorted(project_modules().items()):
        if _family_of_module(mod) is not None or mod == REGISTRY:
            continue
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if needle.search(line):
                    hits.append(f"{os.path.relpath(path, REPO)}:{i}: {line.strip()}")
    assert not hits, "a model family spelled outside its folder:\n  " + "\n  ".join(hits)


def test_config_imports_only_the_errors_module_and_names_no_hf_field():
    """config.py is the schema and the loader: the model family's fields are read by the families
    (resolve.py asks them), so a new family never edits config.py."""
    modules = project_modules()
    graph = import_graph(modules)
    assert set(graph["gspo_megatron.config"]) <= {"gspo_megatron.errors"}, graph["gspo_megatron.config"]
    assert graph["gspo_megatron.errors"] == {}  # imports nothing of the project
    from gspo_megatron.model.registry import family_of_type

    hf_fields = set()
    from gspo_megatron.model.registry import FAMILY_MODULES

    for t in FAMILY_MODULES:
        hf_fields |= set(family_of_type(t).inline_keys)
    hf_fields -= {"model_type", "architectures", "dtype"}  # words every config uses
    with open(modules["gspo_megatron.config"][0], encoding="utf-8") as f:
        text = f.read()
    import re

    named = sorted(k for k in hf_fields if re.search(rf"\b{re.escape(k)}\b", text))
    assert not named, f"config.py names HF config fields: {named}"
