"""Contract test: rollout/sglang_api.py against SGLang's own source.

What it keeps honest. `gspo_megatron/rollout/sglang_api.py` is the one table of the SGLang HTTP API
this project uses (`SGLANG_VERSION`, `ENDPOINTS`: route, method, the io_struct request class the
JSON body is decoded into, the fields we send). The engine builds every body through that table
(`sglang_api.payload` refuses an undeclared field) and the HTTP test double in
tests/sglang_double.py refuses whatever the table does not declare, so the CPU tests can only prove
the engine and the double agree with the *table*. This test ties the table to SGLang itself: for
the pinned version it reads

  * `sglang/srt/entrypoints/http_server.py` (parsed with `ast`): every route registered with
    `@app.get/post/put/delete/patch/head(path)` or `@app.api_route(path, methods=[...])` (FastAPI:
    no `methods` means GET), anywhere in the file (also inside `if` blocks / functions); a path
    that is not a string literal (e.g. `os.environ.get(...)`) is ignored, and so are routes of
    routers included from other modules;
  * `sglang/srt/managers/io_struct.py` (parsed with `ast`): each class's fields, i.e. the
    annotated assignments of its body (ClassVar excluded) plus those of its bases defined in the
    same file (`BaseReq` gives `rid`); dataclasses and msgspec structs alike;
  * `sglang/api/v1/api_types.py`: the `/generate` contract gate's `SamplingParams`, which rejects
    unknown keys, for the keys `sampling_to_sglang` sends;

and checks that each declared route exists and accepts our method, that its handler decodes the
body into exactly the declared class (or reads no body when the table says None), that every
field we send is a field of that class, plus a few facts the client depends on (no
/get_weight_version, /model_info reports weight_version, the weight-update session routes). The
`sglang` extra in pyproject.toml must pin the same version (`sglang==SGLANG_VERSION`).

Routed experts (`return_routed_experts`, decoded by SGLangEngine with return_routing and encoded by
the double): the request fields and the contract gate; the server flag (`--enable-return-routed-
experts` from the ServerArgs field, reported by /server_info; no capturer, hence no field, without
it); and the wire format from the source of state_capturer/ (int32 host buffer (tokens, num_layers,
topk_size), rows start_len .. seqlen - 2, layers/top-k from hf_text_config), the detokenizer and
tokenizer manager (standard base64 of the raw bytes in meta_info.routed_experts), the batch result
processor (seqlen = prompt + output through the stop) and the scheduler's start_len rule. These
are compared as normalised statements (`ast.unparse`), so a reformatting passes but any change of
what they compute fails with the file and function to re-read.

Where SGLang comes from. The wheel `sglang==SGLANG_VERSION` is fetched once with
`python -m pip download --no-deps` (about 40 MB; never installed, files are read from the zip) into
$GSPO_SGLANG_WHEEL_CACHE, else ~/.cache/gspo-megatron/sglang-wheels; a wheel already there is
reused, so later runs take well under a second. If the download fails or times out (no package
registry), the tests that need the source are skipped with pip's reason; the pyproject and
table-internal checks still run.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gspo_megatron.rollout import sglang_api
from gspo_megatron.rollout.sglang_api import ENDPOINTS, ROUTER_ROUTES, SESSION_ROUTES, SGLANG_VERSION

REPO = Path(__file__).resolve().parents[1]
CACHE_ENV = "GSPO_SGLANG_WHEEL_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "gspo-megatron" / "sglang-wheels"
DOWNLOAD_TIMEOUT_S = 300

HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
IO_STRUCT = "sglang/srt/managers/io_struct.py"
API_TYPES = "sglang/api/v1/api_types.py"
IO_STRUCT_MODULE = "sglang.srt.managers.io_struct"

# @app.<attr>(path) -> HTTP method; api_route takes methods=[...] (FastAPI's default: GET).
METHOD_DECORATORS = {"get", "post", "put", "delete", "patch", "head", "options"}
# Parameter types FastAPI never reads from the JSON body.
NON_BODY_TYPES = {"Request", "Response", "WebSocket", "BackgroundTasks", "HTTPConnection",
                  "str", "int", "float", "bool", "bytes"}
# FastAPI parameter markers that are not the body.
NON_BODY_MARKERS = {"Query", "Path", "Header", "Cookie", "Depends", "Security", "File", "Form"}


# ----------------------------------------------------------------------------------------------
# The wheel
# ----------------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE


def _cached_wheels(cache: Path, version: str) -> list[Path]:
    return sorted(cache.glob(f"sglang-{version}-*.whl"))


def _obtain_wheel(version: str) -> Path:
    """The cached sglang==version wheel, downloaded first if absent; pytest.skip if that fails."""
    cache = _cache_dir()
    found = _cached_wheels(cache, version)
    if found:
        return found[0]
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        pytest.skip(f"cannot create the sglang wheel cache {cache}: {e}")
    # Download into a private folder and move the finished wheel in, so a concurrent run never
    # sees a half-written file.
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=cache))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--quiet",
               f"sglang=={version}", "-d", str(tmp)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"pip download sglang=={version} timed out after {DOWNLOAD_TIMEOUT_S}s "
                        f"(no package registry?); set {CACHE_ENV} to a folder holding the wheel")
        got = _cached_wheels(tmp, version)
        if proc.returncode != 0 or not got:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit status {proc.returncode}, no wheel"
            pytest.skip(f"cannot download sglang=={version} (no package registry?): {why}")
        target = cache / got[0].name
        os.replace(got[0], target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _literal_version(source: str) -> str | None:
    """`__version__ = ... = "x"` in a module's source, or None."""
    for node in ast.parse(source).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
            return node.value.value
    return None


# ----------------------------------------------------------------------------------------------
# http_server.py: routes
# ----------------------------------------------------------------------------------------------


@dataclass
class Registration:
    route: str
    methods: frozenset[str]
    handler: ast.FunctionDef | ast.AsyncFunctionDef
    lineno: int  # of the decorator

    @property
    def name(self) -> str:
        return self.handler.name


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _short(node: ast.AST) -> str | None:
    """The last component of a (dotted) name: `fastapi.Body` -> `Body`."""
    d = _dotted(node)
    return d.rsplit(".", 1)[-1] if d else None


def _route_of_decorator(dec: ast.AST) -> tuple[str, frozenset[str]] | None:
    """(path, methods) for an `@app.<verb>(...)` / `@app.api_route(...)` decorator with a literal path."""
    if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
            and isinstance(dec.func.value, ast.Name) and dec.func.value.id == "app"):
        return None
    attr = dec.func.attr
    if attr not in METHOD_DECORATORS and attr != "api_route":
        return None  # exception_handler, middleware, websocket, ...
    kwargs = {k.arg: k.value for k in dec.keywords if k.arg}
    path = dec.args[0] if dec.args else kwargs.get("path")
    if not (isinstance(path, ast.Constant) and isinstance(path.value, str)):
        return None  # e.g. os.environ.get("AIP_PREDICT_ROUTE", ...): not a fixed route
    if attr in METHOD_DECORATORS:
        return path.value, frozenset({attr.upper()})
    methods = kwargs.get("methods")
    if methods is None:
        return path.value, frozenset({"GET"})  # fastapi.routing.APIRoute: methods=None -> ["GET"]
    try:
        value = ast.literal_eval(methods)
    except ValueError:
        raise AssertionError(f"{HTTP_SERVER}:{dec.lineno}: methods of {path.value} is not a literal; "
                             f"extend this test's parser") from None
    return path.value, frozenset(m.upper() for m in value)


def parse_routes(source: str) -> dict[str, list[Registration]]:
    routes: dict[str, list[Registration]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                got = _route_of_decorator(dec)
                if got:
                    routes.setdefault(got[0], []).append(Registration(got[0], got[1], node, dec.lineno))
    return routes


def _unwrap_annotated(ann: ast.AST) -> tuple[ast.AST, list[ast.AST]]:
    """`Annotated[X, m1, m2]` -> (X, [m1, m2]); anything else -> (ann, [])."""
    if isinstance(ann, ast.Subscript) and _short(ann.value) == "Annotated":
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        return elts[0], list(elts[1:])
    return ann, []


def _marker_name(node: ast.AST | None) -> str | None:
    """`Body()` / `Query(0.0, ge=0)` / `fastapi.Body` -> "Body" / "Query" / "Body"."""
    if node is None:
        return None
    return _short(node.func) if isinstance(node, ast.Call) else _short(node)


def body_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, str]]:
    """(parameter, class name) for each parameter FastAPI decodes from the JSON body.

    A body parameter is one annotated `Annotated[X, Body()]` or defaulting to `Body(...)`, or one
    whose annotation is a plain class name that is neither a FastAPI non-body type (Request, ...),
    a scalar (a query parameter), nor marked Query/Path/Header/Depends/...
    """
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults: dict[str, ast.AST | None] = {p.arg: None for p in positional + a.kwonlyargs}
    for p, d in zip(positional[len(positional) - len(a.defaults):], a.defaults):
        defaults[p.arg] = d
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        defaults[p.arg] = d
    out = []
    for p in positional + a.kwonlyargs:
        if p.annotation is None:
            continue
        inner, markers = _unwrap_annotated(p.annotation)
        marks = {_marker_name(m) for m in markers} | {_marker_name(defaults[p.arg])}
        name = _dotted(inner)
        if "Body" in marks:
            out.append((p.arg, name or ast.unparse(inner)))
        elif marks & NON_BODY_MARKERS or name is None or _short(inner) in NON_BODY_TYPES:
            continue  # Query/Depends/...; Request; a scalar or Optional[...] -> query parameter
        else:
            out.append((p.arg, name))
    return out


def first_param_annotation(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return ast.unparse(params[0].annotation) if params and params[0].annotation else None


def io_struct_imports(source: str) -> set[str]:
    """Names http_server.py imports from sglang.srt.managers.io_struct (anywhere in the file)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == IO_STRUCT_MODULE:
            names |= {al.asname or al.name for al in node.names}
    return names


# ----------------------------------------------------------------------------------------------
# io_struct.py / api_types.py: class fields
# ----------------------------------------------------------------------------------------------


def _is_classvar(ann: ast.AST) -> bool:
    target = ann.value if isinstance(ann, ast.Subscript) else ann
    return _short(target) == "ClassVar"


def parse_class_fields(source: str) -> dict[str, set[str]]:
    """class name -> its fields, including those inherited from bases defined in the same file."""
    own: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            own[node.name] = {s.target.id for s in node.body
                              if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                              and not _is_classvar(s.annotation)}
            bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]

    def fields(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        out = set(own[name])
        for b in bases[name]:
            if b in own and b not in seen:
                out |= fields(b, seen | {name})
        return out

    return {name: fields(name) for name in own}


# ----------------------------------------------------------------------------------------------
# The parsed source, once per session
# ----------------------------------------------------------------------------------------------


@dataclass
class SGLangSource:
    wheel: Path
    http_text: str
    io_text: str
    api_types_text: str | None
    routes: dict[str, list[Registration]]
    classes: dict[str, set[str]]
    imported_from_io_struct: set[str]
    versions: dict[str, str | None] = field(default_factory=dict)


@pytest.fixture(scope="module")
def sgl() -> SGLangSource:
    wheel = _obtain_wheel(SGLANG_VERSION)
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        pytest.fail(f"{wheel} is not a readable wheel; delete it so the next run downloads it again")
    with zf:
        names = set(zf.namelist())

        def read(path: str) -> str | None:
            return zf.read(path).decode("utf-8") if path in names else None

        http_text, io_text = read(HTTP_SERVER), read(IO_STRUCT)
        missing = [p for p, t in ((HTTP_SERVER, http_text), (IO_STRUCT, io_text)) if t is None]
        assert not missing, f"{wheel.name} lacks {missing}: SGLang moved its HTTP server / io_struct"
        metadata = next((n for n in names if re.fullmatch(r"sglang-[^/]+\.dist-info/METADATA", n)), None)
        meta_version = None
        if metadata:
            m = re.search(r"^Version:\s*(\S+)", read(metadata), re.M)
            meta_version = m.group(1) if m else None
        module_version = None
        for p in ("sglang/version.py", "sglang/_version.py"):  # version.py imports _version.py
            text = read(p)
            module_version = module_version or (_literal_version(text) if text else None)
        src = SGLangSource(
            wheel=wheel, http_text=http_text, io_text=io_text, api_types_text=read(API_TYPES),
            routes=parse_routes(http_text), classes=parse_class_fields(io_text),
            imported_from_io_struct=io_struct_imports(http_text),
            versions={"filename": wheel.name.split("-")[1], "METADATA": meta_version,
                      "sglang/_version.py": module_version})
    print(f"\n[sglang contract] {wheel} : {len(src.routes)} routes in {HTTP_SERVER}, "
          f"{len(src.classes)} classes in {IO_STRUCT}")
    return src


# ----------------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------------


def test_wheel_is_the_declared_version(sgl):
    wrong = {where: v for where, v in sgl.versions.items() if v != SGLANG_VERSION}
    assert not wrong, (f"{sgl.wheel.name}: version {wrong} != sglang_api.SGLANG_VERSION "
                       f"{SGLANG_VERSION!r}")
    print(f"  wheel version {SGLANG_VERSION} (filename, METADATA, sglang/_version.py)")


def test_pyproject_pins_the_declared_version():
    """The `sglang` extra must be `sglang==SGLANG_VERSION` (server and client written together)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    path = REPO / "pyproject.toml"
    text = path.read_text()
    extras = tomllib.loads(text).get("project", {}).get("optional-dependencies", {})
    assert "sglang" in extras, f"{path}: no `sglang` extra in [project.optional-dependencies]"
    reqs = [Requirement(r) for r in extras["sglang"]]
    pins = [r for r in reqs if canonicalize_name(r.name) == "sglang"]
    assert pins, f"{path}: the `sglang` extra {extras['sglang']} does not name the sglang package"

    def where(req: Requirement) -> str:
        for i, line in enumerate(text.splitlines(), 1):
            if re.match(r"\s*sglang\s*=", line) and re.search(r"[\"']sglang\b", line):
                return f"{path.name}:{i}: `{line.strip()}`"
        return f"{path.name}: `{req}`"

    for req in pins:
        specs = list(req.specifier)
        exact = [s for s in specs if s.operator in ("==", "===") and "*" not in s.version]
        assert len(specs) == 1 and exact, (
            f"{where(req)} does not pin sglang exactly; make it \"sglang=={SGLANG_VERSION}\" "
            f"(gspo_megatron/rollout/sglang_api.py SGLANG_VERSION)")
        pinned = exact[0].version
        assert pinned == SGLANG_VERSION or Version(pinned) == Version(SGLANG_VERSION), (
            f"{where(req)} pins sglang {pinned} but sglang_api.SGLANG_VERSION is {SGLANG_VERSION}: "
            f"change one to match the other")
        print(f"  pyproject pins sglang=={pinned}")


def check_endpoint(ep: sglang_api.Endpoint, sgl: SGLangSource) -> list[str]:
    """One line per way `ep` disagrees with SGLang's source (empty: it agrees)."""
    where = f"{ep.method} {ep.route}"
    regs = sgl.routes.get(ep.route)
    if not regs:
        return [f"{where}: no such route in sglang {SGLANG_VERSION} {HTTP_SERVER}"]
    failures = []
    methods = frozenset().union(*(r.methods for r in regs))
    if ep.method not in methods:
        failures.append(f"{where}: the route accepts {sorted(methods)}, not {ep.method}")
    for reg in regs:
        if ep.method not in reg.methods and len(regs) > 1:
            continue  # another registration of the route serves our method
        at = f"{where} ({reg.name}, {HTTP_SERVER}:{reg.lineno})"
        body = body_params(reg.handler)
        print(f"  {where}: handler {reg.name}(), methods {sorted(reg.methods)}, "
              f"first parameter annotation {first_param_annotation(reg.handler)}")
        if ep.request_class is None:
            if body:
                failures.append(f"{at}: the handler decodes a body {body}, but sglang_api declares "
                                f"request_class=None")
            continue
        if [cls for _, cls in body] != [ep.request_class]:
            failures.append(f"{at}: the body is decoded into {[c for _, c in body] or 'nothing'}, "
                            f"not {ep.request_class}")
            continue
        if ep.request_class not in sgl.classes:
            failures.append(f"{at}: class {ep.request_class} is not defined in {IO_STRUCT}")
            continue
        if ep.request_class not in sgl.imported_from_io_struct:
            failures.append(f"{at}: {HTTP_SERVER} does not import {ep.request_class} from "
                            f"{IO_STRUCT_MODULE}")
        known = sgl.classes[ep.request_class]
        for f in sorted(ep.fields):
            ok = f in known
            print(f"    {ep.request_class}.{f}: {'ok' if ok else 'NOT A FIELD'}")
            if not ok:
                failures.append(f"{at}: field {f!r} is not a field of {ep.request_class} "
                                f"(its fields: {sorted(known)})")
    return failures


@pytest.mark.parametrize("route", sorted(ENDPOINTS), ids=sorted(ENDPOINTS))
def test_endpoint_matches_sglang(sgl, route):
    failures = check_endpoint(ENDPOINTS[route], sgl)
    assert not failures, "sglang_api.ENDPOINTS disagrees with SGLang's source:\n" + "\n".join(failures)


def test_no_get_weight_version_route(sgl):
    assert "/get_weight_version" not in sgl.routes, (
        f"sglang {SGLANG_VERSION} registers /get_weight_version: the client's assumption that the "
        f"served weight version is only in /model_info is out of date")
    assert "/get_weight_version" not in ENDPOINTS


def test_model_info_reports_weight_version(sgl):
    regs = sgl.routes.get("/model_info")
    assert regs, f"no /model_info route in {HTTP_SERVER}"
    for reg in regs:
        text = ast.get_source_segment(sgl.http_text, reg.handler) or ""
        assert "weight_version" in text, (
            f"/model_info's handler {reg.name}() ({HTTP_SERVER}:{reg.lineno}) does not mention "
            f"weight_version: the client reads the served weight version there")
        assert "GET" in reg.methods, f"/model_info accepts {sorted(reg.methods)}, not GET"
        print(f"  GET /model_info -> {reg.name}() mentions weight_version")


@pytest.mark.parametrize("route", ["/begin_weight_update", "/end_weight_update"])
def test_weight_update_session_route_is_post(sgl, route):
    regs = sgl.routes.get(route)
    assert regs, f"no {route} route in sglang {SGLANG_VERSION} {HTTP_SERVER}"
    methods = frozenset().union(*(r.methods for r in regs))
    assert "POST" in methods, f"{route} accepts {sorted(methods)}, not POST"
    assert ENDPOINTS[route].method == "POST"
    print(f"  POST {route} -> {[r.name for r in regs]}")


def test_session_routes_are_declared_endpoints():
    assert SESSION_ROUTES <= set(ENDPOINTS), (
        f"sglang_api.SESSION_ROUTES {sorted(SESSION_ROUTES - set(ENDPOINTS))} are not in ENDPOINTS")


def test_router_routes_are_not_server_endpoints():
    # /list_workers, /workers belong to the sglang-router package, not http_server.py.
    both = set(ROUTER_ROUTES) & set(ENDPOINTS)
    assert not both, f"sglang_api.ROUTER_ROUTES {sorted(both)} are declared as server ENDPOINTS"


def test_sampling_params_keys_pass_the_generate_contract_gate(sgl):
    """/generate checks the body against sglang/api/v1/api_types.py before decoding it, and that
    schema's SamplingParams *rejects* unknown keys: every key sampling_to_sglang emits must be one."""
    if sgl.api_types_text is None:
        pytest.skip(f"{sgl.wheel.name} has no {API_TYPES} (no /generate contract gate)")
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.sglang_engine import sampling_to_sglang

    schema = parse_class_fields(sgl.api_types_text)
    assert "SamplingParams" in schema, f"{API_TYPES} has no SamplingParams"
    allowed = schema["SamplingParams"]
    sent = set()
    for sp in (SamplingParams(), SamplingParams(temperature=0.0),
               SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=8,
                              stop=("\n\n",), stop_token_ids=(2,))):
        sent |= set(sampling_to_sglang(sp))
    bad = sorted(sent - allowed)
    for k in sorted(sent):
        print(f"    sampling_params.{k}: {'ok' if k in allowed else 'REJECTED'}")
    assert not bad, (f"/generate sampling_params keys {bad} are not fields of {API_TYPES} "
                     f"SamplingParams, which rejects unknown keys (fields: {sorted(allowed)})")


# ----------------------------------------------------------------------------------------------
# Routed experts (return_routed_experts): what the engine decodes and the double encodes
# ----------------------------------------------------------------------------------------------

ROUTED_EXPERTS = "sglang/srt/state_capturer/routed_experts.py"
CAPTURER_BASE = "sglang/srt/state_capturer/base.py"
DETOKENIZER = "sglang/srt/managers/detokenizer_manager.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
BATCH_RESULT = "sglang/srt/managers/scheduler_components/batch_result_processor.py"
SCHEDULER = "sglang/srt/managers/scheduler.py"
EXEC_FIELDS = "sglang/srt/arg_groups/fields/exec_.py"
ARG_UTILS = "sglang/srt/arg_groups/arg_utils.py"
FIELD_ORDER = "sglang/srt/arg_groups/field_order.py"
COMMON = "sglang/srt/utils/common.py"
ROUTING_FILES = (ROUTED_EXPERTS, CAPTURER_BASE, DETOKENIZER, TOKENIZER_MANAGER, BATCH_RESULT, SCHEDULER,
                 EXEC_FIELDS, ARG_UTILS, FIELD_ORDER, COMMON)


def _wheel_sources(sgl, files: tuple[str, ...], what: str) -> dict[str, str]:
    """path -> source of `files` in the wheel; one line naming the missing ones."""
    with zipfile.ZipFile(sgl.wheel) as zf:
        names = set(zf.namelist())
        missing = [p for p in files if p not in names]
        assert not missing, f"{sgl.wheel.name} lacks {missing}: SGLang moved its {what}"
        return {p: zf.read(p).decode("utf-8") for p in files}


@pytest.fixture(scope="module")
def routing_src(sgl) -> dict[str, str]:
    """path -> source of the wheel files behind the routed-experts wire format."""
    return _wheel_sources(sgl, ROUTING_FILES, "routed-experts code")


def _function(source: str, name: str, cls: str | None = None) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The (first) function `name`, inside class `cls` when given."""
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls] if cls else [tree]
    for scope in scopes:
        for node in ast.walk(scope):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
    return None


def _code(snippet: str) -> str:
    """`snippet` as ast.unparse writes it (so spacing and quotes do not matter)."""
    return ast.unparse(ast.parse(snippet))


def _require(source: str, path: str, func: str, snippets: list[str], cls: str | None = None, why: str = "") -> None:
    fn = _function(source, func, cls)
    where = f"{path} {cls + '.' if cls else ''}{func}()"
    assert fn is not None, f"{where} is gone in sglang {SGLANG_VERSION}: {why}"
    body = ast.unparse(fn)
    stmts = {ast.unparse(n) for n in ast.walk(fn) if isinstance(n, ast.stmt)}  # multi-line snippets: whole statements
    for s in snippets:
        assert _code(s) in body or _code(s) in stmts, (
            f"{where} no longer does `{_code(s)}` (sglang {SGLANG_VERSION}, line {fn.lineno}): {why}")
        print(f"  {where}: {_code(s)}")


def test_routed_experts_request_fields_are_generate_fields(sgl):
    """return_routed_experts / routed_experts_start_len are GenerateReqInput fields (bool False,
    int 0 by default), and the api/v1 contract gate lets them through: it knows
    routed_experts_start_len and ignores the keys it does not know (return_routed_experts)."""
    ep = ENDPOINTS["/generate"]
    wanted = {"return_routed_experts", "routed_experts_start_len"}
    assert wanted <= ep.fields, f"sglang_api.ENDPOINTS['/generate'] does not declare {sorted(wanted - ep.fields)}"
    assert wanted <= sgl.classes["GenerateReqInput"], f"{IO_STRUCT} GenerateReqInput lacks {sorted(wanted)}"
    cls = next(n for n in ast.walk(ast.parse(sgl.io_text))
               if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    defaults = {s.target.id: (ast.unparse(s.annotation), s.value.value if isinstance(s.value, ast.Constant) else None)
                for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    assert defaults["return_routed_experts"] == ("bool", False), defaults["return_routed_experts"]
    assert defaults["routed_experts_start_len"] == ("int", 0), defaults["routed_experts_start_len"]
    print(f"  GenerateReqInput.return_routed_experts: bool = False, .routed_experts_start_len: int = 0")
    if sgl.api_types_text is None:
        return
    gate = parse_class_fields(sgl.api_types_text).get("GenerateRequest", set())
    decoder = _function(sgl.api_types_text, "decode_GenerateRequest")
    assert decoder is not None, f"{API_TYPES} has no decode_GenerateRequest"
    rejects_unknown = "_unknown_field" in ast.unparse(decoder)
    assert "routed_experts_start_len" in gate, f"{API_TYPES} GenerateRequest lacks routed_experts_start_len"
    for f in sorted(ep.fields):
        assert f in gate or not rejects_unknown, (
            f"{API_TYPES} decode_GenerateRequest now rejects unknown keys and {f!r} is not a GenerateRequest "
            f"field: /generate would answer 400")
    print(f"  api/v1 GenerateRequest: unknown keys {'REJECTED' if rejects_unknown else 'ignored'}; "
          f"not in its schema: {sorted(ep.fields - gate)}")


def test_routed_experts_server_flag(routing_src):
    """--enable-return-routed-experts is the CLI form of the ServerArgs bool field
    enable_return_routed_experts (store_true), a flat ServerArgs field that /server_info reports."""
    from gspo_megatron.rollout.sglang_api import ROUTED_EXPERTS_FLAG, ROUTED_EXPERTS_SERVER_ARG

    field_ann = None
    for node in ast.walk(ast.parse(routing_src[EXEC_FIELDS])):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == ROUTED_EXPERTS_SERVER_ARG:
            field_ann = node.annotation
    assert field_ann is not None, f"{EXEC_FIELDS} has no field {ROUTED_EXPERTS_SERVER_ARG}"
    inner, rest = (field_ann.slice.elts[0], field_ann.slice.elts[1:]) if isinstance(field_ann, ast.Subscript) \
        and isinstance(field_ann.slice, ast.Tuple) else (field_ann, [])
    assert ast.unparse(inner) == "bool", f"{EXEC_FIELDS} {ROUTED_EXPERTS_SERVER_ARG} is {ast.unparse(field_ann)}"
    assert all(isinstance(r, ast.Constant) for r in rest), (
        f"{EXEC_FIELDS} {ROUTED_EXPERTS_SERVER_ARG} has Arg(...) metadata (a custom CLI name?): "
        f"{ast.unparse(field_ann)}")
    _require(routing_src[ARG_UTILS], ARG_UTILS, "_field_to_cli_name", ['"--" + name.replace("_", "-")'],
             why="the CLI flag is no longer --<field name with dashes>")
    assert "--" + ROUTED_EXPERTS_SERVER_ARG.replace("_", "-") == ROUTED_EXPERTS_FLAG
    _require(routing_src[ARG_UTILS], ARG_UTILS, "add_cli_args_from_dataclass", ['kwargs = dict(action="store_true", '
             'help=arg_meta.help, **dest_kwarg)'], why="bool fields are no longer store_true flags")
    assert re.search(rf'^\s*"{ROUTED_EXPERTS_SERVER_ARG}",\s*$', routing_src[FIELD_ORDER], re.M), (
        f"{FIELD_ORDER} no longer lists {ROUTED_EXPERTS_SERVER_ARG} among ServerArgs' flat fields")
    _require(routing_src[COMMON], COMMON, "build_server_info", ["result = server_args.resolved_dict()"],
             why="/server_info no longer reports every server argument (the engine's startup check reads it)")
    _require(routing_src[ROUTED_EXPERTS], ROUTED_EXPERTS, "create",
             ["if not get_exec().features.enable_return_routed_experts:\n    return None"], cls="RoutedExpertsCapturer",
             why="without the flag there is no capturer")
    _require(routing_src[BATCH_RESULT], BATCH_RESULT, "_maybe_collect_routed_experts",
             ["if capturer is None:\n    return"],
             why="without a capturer a request asking for routed experts gets none (silently)")


def test_routed_experts_response_encoding(routing_src):
    """meta_info.routed_experts: standard base64 of the raw bytes of an int32 tensor
    [seqlen - 1 - start_len, num_hidden_layers, num_experts_per_tok], C order, positions
    start_len .. seqlen - 2, seqlen = prompt + output through the stop. SGLangEngine decodes
    exactly this, and tests/sglang_double.py encodes it."""
    _require(routing_src[ROUTED_EXPERTS], ROUTED_EXPERTS, "extract_routed_experts_from_meta_info", [
        'routed_experts_base64 = data["meta_info"].get("routed_experts", None)',
        'np.frombuffer(pybase64.b64decode(routed_experts_base64.encode("utf-8")), dtype=np.int32)',
    ], why="the payload is no longer base64 of int32 bytes in meta_info.routed_experts")
    _require(routing_src[DETOKENIZER], DETOKENIZER, "_b64_encode_per_request",
             ['pybase64.b64encode(item.numpy().tobytes()).decode("utf-8")'],
             why="the detokenizer no longer sends standard base64 of the tensor's raw bytes")
    _require(routing_src[TOKENIZER_MANAGER], TOKENIZER_MANAGER, "_handle_batch_output", [
        'val = pybase64.b64encode(val.numpy().tobytes()).decode("utf-8")',
        'meta_info["routed_experts"] = val',
    ], why="meta_info.routed_experts is no longer the base64 string")
    _require(routing_src[CAPTURER_BASE], CAPTURER_BASE, "__init__", [
        "self.buffer = alloc((num_tokens, num_layers, topk_size), dtype=torch.int32, device='cpu', pin_memory=True, "
        "allocator=HostTensorAllocator())",
    ], cls="BaseHostCache", why="the host buffer is no longer int32 (tokens, num_layers, topk_size)")
    _require(routing_src[CAPTURER_BASE], CAPTURER_BASE, "get_topk", [
        "start_len = min(start_len, seqlen - 1)",
        "cache_pool_idx = req_to_token_pool.req_to_token[req_pool_idx][start_len:seqlen - 1].cpu().clone()",
        "return self.host_cache.buffer[cache_pool_idx]",
    ], cls="BaseTopkCapturer", why="the rows are no longer positions start_len .. seqlen - 2")
    _require(routing_src[ROUTED_EXPERTS], ROUTED_EXPERTS, "__init__", [
        "topk_size = model_config.hf_text_config.num_experts_per_tok",
        "num_layers = model_config.hf_text_config.num_hidden_layers",
    ], cls="RoutedExpertsCapturer", why="the last two dims are no longer (num_hidden_layers, num_experts_per_tok)")
    _require(routing_src[BATCH_RESULT], BATCH_RESULT, "_maybe_collect_routed_experts", [
        "start_len = req.routed_experts_start_len",
        "seqlen = len(req.origin_input_ids) + len(req.output_ids_through_stop)",
        "expected_rows = max(0, seqlen - 1 - start_len)",
    ], why="seqlen is no longer prompt + output tokens through the stop")


def test_routed_experts_start_len_rule(routing_src):
    """0 <= routed_experts_start_len <= prompt length, checked (request aborted with a 400) whenever
    return_routed_experts is set: what tests/sglang_double.py enforces, with these messages."""
    src = routing_src[SCHEDULER]
    tree = ast.parse(src)
    guard = next((n for n in ast.walk(tree) if isinstance(n, ast.If)
                  and ast.unparse(n.test) == "recv_req.return_routed_experts"), None)
    assert guard is not None, f"{SCHEDULER}: no `if recv_req.return_routed_experts:` check any more"
    body = ast.unparse(guard)
    for s in ("recv_req.routed_experts_start_len < 0", "recv_req.routed_experts_start_len > len(req.origin_input_ids)",
              "req.set_finish_with_abort(error_msg)"):
        assert _code(s) in body, f"{SCHEDULER}:{guard.lineno}: the start_len check no longer does `{s}`"
    for text in ("is lower than 0. ", "Please use a non-negative routed_experts_start_len.",
                 "is higher than the ", "number of input tokens ", "use a smaller routed_experts_start_len."):
        assert text in src, f"{SCHEDULER}: message text {text!r} changed (the test double repeats it)"
    print(f"  {SCHEDULER}:{guard.lineno}: 0 <= routed_experts_start_len <= len(origin_input_ids), else abort")


# ---- pushes mid-generation (SGLangEngine.update_weights_mid_generation; the double's pause) ------
WEIGHT_VERSIONS = "sglang/srt/utils/weight_versions.py"
OUTPUT_STREAMER = "sglang/srt/managers/scheduler_components/output_streamer.py"
WEIGHT_UPDATER = "sglang/srt/managers/scheduler_components/weight_updater.py"
TOKENIZER_CONTROL = "sglang/srt/managers/tokenizer_control_mixin.py"
PAUSE_FILES = (TOKENIZER_MANAGER, SCHEDULER, WEIGHT_VERSIONS, OUTPUT_STREAMER, WEIGHT_UPDATER, TOKENIZER_CONTROL)


@pytest.fixture(scope="module")
def pause_src(sgl) -> dict[str, str]:
    return _wheel_sources(sgl, PAUSE_FILES, "pause / weight-version code")


def test_a_paused_server_takes_weights_without_waiting_and_labels_tokens(pause_src):
    """What update_weights_mid_generation relies on, and tests/sglang_double.py models: a weight
    update waits for running requests (the model-update writer lock) unless generation is paused;
    a retract pause puts the running requests back in the queue; the cache may then be flushed with
    requests queued, so they recompute their prefixes under the new weights; a version change is
    recorded for every live request, and each finished request reports contiguous spans
    meta_info.weight_versions [{version, start, end}] with weight_version the last one's."""
    src = pause_src
    _require(src[TOKENIZER_MANAGER], TOKENIZER_MANAGER, "update_weights_from_disk", [
        "lock_context = self.model_update_lock.writer_lock if not is_paused else nullcontext()",
    ], why="a paused server no longer skips the writer lock: the push would wait for running requests")
    for func in ("update_weights_from_distributed", "update_weights_from_tensor"):
        fn = _function(src[TOKENIZER_CONTROL], func)
        assert fn is not None, f"{TOKENIZER_CONTROL} {func}() is gone"
        body = ast.unparse(fn)
        assert "is_paused = self.is_pause" in body and "if not is_paused:" in body, (
            f"{TOKENIZER_CONTROL}:{fn.lineno} {func}() no longer skips the writer lock while paused")
    _require(src[TOKENIZER_MANAGER], TOKENIZER_MANAGER, "pause_generation", [
        "self.is_pause = True",
    ], why="pause_generation no longer holds new requests back")
    _require(src[SCHEDULER], SCHEDULER, "pause_generation", [
        "assert recv_req.mode in ('in_place', 'retract')",
        "retract_reqs = [r for r in self.running_batch.reqs if not r.finished()]",
        "self._add_request_to_queue(req)",
    ], why="a retract pause no longer puts the running requests back in the queue")
    _require(src[SCHEDULER], SCHEDULER, "flush_cache", ["self.tree_cache.reset()"],
             why="flush_cache no longer resets the tree cache")
    fn = _function(src[SCHEDULER], "flush_cache")
    assert "self.is_fully_idle(ignore_waiting=self._engine_paused)" in ast.unparse(fn), (
        f"{SCHEDULER}:{fn.lineno} flush_cache() no longer ignores queued requests while paused: the "
        "retracted requests would keep the old weights' prefix KV")
    _require(src[SCHEDULER], SCHEDULER, "record_weight_version_change", [
        "num_recorded = record_weight_version_events(live_reqs, old_version=old_version)",
    ], why="a version change is no longer recorded for the live requests")
    _require(src[WEIGHT_UPDATER], WEIGHT_UPDATER, "update_weights_from_disk", [
        "self.record_weight_version_after_update(recv_req.weight_version)",
    ], why="an update from disk no longer records the version change")
    _require(src[WEIGHT_VERSIONS], WEIGHT_VERSIONS, "add_weight_versions_to_meta_info", [
        "meta_info['weight_versions'] = [{'version': span.version, 'start': span.start, "
        "'end': min(span.end, num_output_tokens)} for span in visible]",
        "meta_info['weight_version'] = visible[-1].version",
    ], why="meta_info.weight_versions is no longer [{version, start, end}] (SGLangEngine._token_versions)")
    _require(src[WEIGHT_VERSIONS], WEIGHT_VERSIONS, "compute_weight_version_spans", [
        "start = spans[-1].end if spans else 0",
    ], why="the spans are no longer contiguous from token 0")
    _require(src[OUTPUT_STREAMER], OUTPUT_STREAMER, _finished_spans_function(src[OUTPUT_STREAMER]), [
        "self.weight_versions.append(compute_weight_version_spans(req.weight_version_events, "
        "current_version=self.current_weight_version, num_output_tokens=len(output_ids_)))",
    ], why="finished requests no longer report their spans")


def _finished_spans_function(source: str) -> str:
    """The function of output_streamer.py that appends a finished request's spans."""
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and "compute_weight_version_spans" in ast.unparse(n):
            return n.name
    return "<none>"


# ----------------------------------------------------------------------------------------------
# Model families: SGLang serves each family's class and loads the Hub names the exporter pushes
# ----------------------------------------------------------------------------------------------

# family -> (its SGLang model file, the file and function that load its weights, what that loader
# must do with the names the exporter pushes)
_GQA_FOLDS = ["('qkv_proj', 'q_proj', 'q')", "('qkv_proj', 'k_proj', 'k')", "('qkv_proj', 'v_proj', 'v')",
              "('gate_up_proj', 'gate_proj', 0)", "('gate_up_proj', 'up_proj', 1)",
              "ckpt_gate_proj_name='gate_proj'", "ckpt_down_proj_name='down_proj'"]
_MTP_SKIPPED = "int(name_list[2]) >= self.config.num_hidden_layers"
DEEPSEEK_LOADER = "sglang/srt/models/deepseek_common/deepseek_weight_loader.py"
FAMILY_SGLANG = {
    "qwen3_moe": ("sglang/srt/models/qwen3_moe.py", None, "load_weights", _GQA_FOLDS),
    "glm4_moe": ("sglang/srt/models/glm4_moe.py", None, "load_weights", _GQA_FOLDS + [_MTP_SKIPPED]),
    # DeepseekV3ForCausalLM subclasses DeepseekV2ForCausalLM, whose load_weights calls
    # do_load_weights of the shared DeepSeek loader: experts and dense MLPs folded as the others',
    # q_a_proj and kv_a_proj_with_mqa fused into fused_qkv_a_proj_with_mqa, MTP layers skipped
    "deepseek_v3": ("sglang/srt/models/deepseek_v2.py", DEEPSEEK_LOADER, "do_load_weights",
                    _GQA_FOLDS[3:] + ["'fused_qkv_a_proj_with_mqa'", "'kv_a_proj_with_mqa'", _MTP_SKIPPED]),
}


@pytest.mark.parametrize("model_type", sorted(FAMILY_SGLANG))
def test_sglang_serves_each_family_and_loads_its_pushed_names(sgl, model_type):
    """Every family's `hf_architecture` is an EntryClass of SGLang's model file, whose weight
    loader folds the names the exporter pushes (per layer and per expert): q/k/v_proj into
    qkv_proj (GQA) or q_a_proj + kv_a_proj_with_mqa into fused_qkv_a_proj_with_mqa (DeepSeek-V3's
    MLA), gate_proj/up_proj into gate_up_proj. The router's expert bias is a Parameter named
    `gate.e_score_correction_bias` of the MoE block (GLM-4.5, DeepSeek-V3: the pushed
    `model.layers.N.mlp.gate.e_score_correction_bias` lands by name), and layers numbered past
    num_hidden_layers (MTP) are skipped when num_nextn_predict_layers > 0 (pushes declare 0)."""
    from gspo_megatron.model.registry import FAMILY_MODULES, family_of_type

    assert set(FAMILY_SGLANG) == set(FAMILY_MODULES)
    family = family_of_type(model_type)
    path, loader_path, loader, folds = FAMILY_SGLANG[model_type]
    src = _wheel_sources(sgl, (path,), f"{family.display_name} model")[path]
    tree = ast.parse(src)
    entry = next(n for n in tree.body if isinstance(n, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in n.targets))
    assert family.hf_architecture in ast.unparse(entry.value), f"{path}: EntryClass {ast.unparse(entry.value)}"
    if loader_path is None:
        load = _function(src, loader, family.hf_architecture)
        assert load is not None, f"{path}: no {family.hf_architecture}.{loader}"
    else:
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == family.hf_architecture)
        base = ast.unparse(cls.bases[0])
        assert "self.do_load_weights(" in ast.unparse(_function(src, "load_weights", base)), f"{path}: {base}"
        load = _function(_wheel_sources(sgl, (loader_path,), "DeepSeek weight loader")[loader_path], loader)
        assert load is not None, f"{loader_path}: no {loader}"
    body = ast.unparse(load)
    for snippet in folds:
        assert snippet in body, f"{loader_path or path}: {loader} lost {snippet}"
    if model_type in ("glm4_moe", "deepseek_v3"):
        gate_cls, block_cls = {"glm4_moe": ("Glm4MoeGate", "Glm4MoeSparseMoeBlock"),
                               "deepseek_v3": ("MoEGate", "DeepseekV2MoE")}[model_type]
        gate = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == gate_cls)
        assert "self.e_score_correction_bias = nn.Parameter(" in ast.unparse(gate), ast.unparse(gate)[:500]
        block = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == block_cls)
        assert f"self.gate = {gate_cls}(" in ast.unparse(block)


def test_deepseeks_fused_a_projection_is_written_only_when_one_request_brings_both_halves(sgl):
    """What DeepSeek-V3's `weights_loaded_together` and tests/sglang_double.py's copy of it stand
    on: SGLang's DeepSeek loader caches q_a_proj and kv_a_proj_with_mqa in a dict local to one
    do_load_weights call (when q_lora_rank is set) and writes fused_qkv_a_proj_with_mqa only when
    both of a layer are in it; nothing else writes them, so a push that splits them between
    requests leaves the old weights (rollout/weight_sync.py keeps them in one bucket)."""
    src = _wheel_sources(sgl, (DEEPSEEK_LOADER,), "DeepSeek weight loader")[DEEPSEEK_LOADER]
    load = _function(src, "do_load_weights")
    assert load is not None, f"{DEEPSEEK_LOADER}: no do_load_weights"
    body = ast.unparse(load)
    for line in ("cached_a_proj = {} if fuse_qkv_a_proj else None",
                 "if q_a_proj_name in cached_a_proj and kv_a_proj_name in cached_a_proj:",
                 "cached_a_proj[name] = ", "'fused_qkv_a_proj_with_mqa'"):
        assert line in body, f"{DEEPSEEK_LOADER}: do_load_weights lost {line!r}: re-read it"
    outside = [n.lineno for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Name, ast.Attribute))
               and "cached_a_proj" in (getattr(n, "id", "") or getattr(n, "attr", ""))
               and not load.lineno <= n.lineno <= load.end_lineno]
    assert not outside, f"{DEEPSEEK_LOADER}:{outside}: cached_a_proj outside do_load_weights: does it outlive a call?"


def test_the_model_override_flag_is_a_server_args_string_field(sgl):
    """--json-model-override-args (ModelFamily.engine_config_overrides: launched servers and the
    Slurm script's flags) is the CLI form of ServerArgs' str field json_model_override_args, a
    JSON object the model config applies over config.json."""
    from gspo_megatron.rollout.sglang_api import MODEL_OVERRIDE_FLAG, MODEL_OVERRIDE_SERVER_ARG

    path = "sglang/srt/arg_groups/fields/model.py"
    src = _wheel_sources(sgl, (path, ARG_UTILS, "sglang/srt/configs/model_config.py"), "model override")
    ann = next((n.annotation for n in ast.walk(ast.parse(src[path])) if isinstance(n, ast.AnnAssign)
                and isinstance(n.target, ast.Name) and n.target.id == MODEL_OVERRIDE_SERVER_ARG), None)
    assert ann is not None, f"{path} has no field {MODEL_OVERRIDE_SERVER_ARG}"
    assert ast.unparse(ann).startswith("A[str,"), ast.unparse(ann)
    assert "--" + MODEL_OVERRIDE_SERVER_ARG.replace("_", "-") == MODEL_OVERRIDE_FLAG
    _require(src[ARG_UTILS], ARG_UTILS, "_field_to_cli_name", ['"--" + name.replace("_", "-")'],
             why="the CLI flag is no longer --<field name with dashes>")
    assert "self.model_override_args = json.loads(model_override_args)" in src["sglang/srt/configs/model_config.py"]


# ---- the refit plan's engine side (train/simulate.py refit_plan) ------------------------------
MODEL_WEIGHT_UPDATER = "sglang/srt/model_executor/model_runner_components/weight_updater.py"
SGL_WEIGHT_UTILS = "sglang/srt/model_loader/weight_utils.py"


def test_refit_plan_engine_memory_is_sglangs(sgl):
    """What train/simulate.py refit_plan counts on every engine rank: a distributed update
    allocates every tensor of the request at full size and waits for all its broadcasts before
    any is loaded (a whole bucket extra), and a tensor update copies each IPC-mapped tensor of
    rank 0's GPU to the rank's own device before loading (the bucket again, read out of GPU 0)."""
    src = _wheel_sources(sgl, (MODEL_WEIGHT_UPDATER,), "model runner's weight updates")[MODEL_WEIGHT_UPDATER]
    why = "train/simulate.py refit_plan's engine_peak_gpu for weight_sync=distributed assumes a bucket"
    _require(src, MODEL_WEIGHT_UPDATER, "receive_weights_from_distributed", [
        "weight = torch.empty(shape, dtype=target_dtype, device=self.device)",
        "weights.append((name, weight))",
        "for handle in handles:\n    handle.wait()",
        "return weights",
    ], why=why)
    fn = _function(src, "receive_weights_from_distributed")
    loads = [n for n in ast.walk(fn) if isinstance(n, ast.Attribute) and n.attr == "load_weights"]
    assert not loads, f"{MODEL_WEIGHT_UPDATER}:{fn.lineno} now loads while receiving: {why}"
    _require(src, MODEL_WEIGHT_UPDATER, "_unwrap_tensor", ["return tensor.to(device)"],
             why="refit_plan's tensor mode counts each engine rank reading the whole bucket out of GPU 0")
    loader = _wheel_sources(sgl, (SGL_WEIGHT_UTILS,), "safetensors iterator")[SGL_WEIGHT_UTILS]
    _require(loader, SGL_WEIGHT_UTILS, "safetensors_weights_iterator", [
        "with safetensors.safe_open(st_file, framework='pt', device='cpu') as f:\n"
        "    for name in f.keys():\n        yield (name, f.get_tensor(name))",
    ], why="refit_plan's disk mode counts one tensor on the host per engine rank (memory-mapped reads)")
    _require(src, MODEL_WEIGHT_UPDATER, "update_weights_from_tensor", [
        "named_tensors = [(name, _unwrap_tensor(tensor, tp_rank=tp_rank, device=infered_device)) "
        "for name, tensor in named_tensors]",
    ], why="every tensor of the request is copied before the load")
