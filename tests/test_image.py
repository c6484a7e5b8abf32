"""The container recipe (docker/) against the project's own pins; no Docker needed.

docker/Dockerfile cannot be built here (no daemon, no registry), so these tests read it: the
instructions are well formed (continuations joined, known keywords, COPY sources exist), every
package it pip-installs carries exactly pyproject.toml's specifier (torch and Transformer Engine
never installed: the base image's are kept), the SGLang server image it names is the version
rollout/sglang_api.py speaks, and docker/check_versions.py — the build's version check — reads its
ranges from pyproject.toml. Each check is also run on a mutated copy and must then fail.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from gspo_megatron.rollout.sglang_api import SGLANG_VERSION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKERFILE = os.path.join(ROOT, "docker", "Dockerfile")
CHECKER = os.path.join(ROOT, "docker", "check_versions.py")
PYPROJECT = os.path.join(ROOT, "pyproject.toml")
KEYWORDS = {"FROM", "ARG", "RUN", "COPY", "ENV", "WORKDIR", "LABEL"}
NGC_PYTORCH = re.compile(r"^nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3$")
SGLANG_IMAGE = re.compile(r"lmsysorg/sglang:v([0-9][0-9A-Za-z.]*[0-9A-Za-z])")
# pip options that take a value (the value is not a requirement)
PIP_VALUE_OPTS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url",
                  "-f", "--find-links", "-t", "--target"}


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def pyproject(text: str | None = None) -> dict:
    return tomllib.loads(read(PYPROJECT) if text is None else text)["project"]


# ---- a small Dockerfile reader ----------------------------------------------------------------


class DockerfileError(ValueError):
    pass


@dataclass
class Instr:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str) -> list[Instr]:
    """Instructions with their continuation lines joined (backslash escape, comment lines inside a
    continuation dropped, as Docker does); raises DockerfileError on what Docker would refuse."""
    out: list[Instr] = []
    cur: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        stripped = line.lstrip()
        if stripped.startswith("#") or (not stripped and not cur):
            continue  # a comment (or a parser directive), or a blank line between instructions
        if not cur:
            start = n
        if line.endswith("\\"):
            cur.append(line[:-1])
            continue
        cur.append(line)
        joined = " ".join(part.strip() for part in cur).strip()
        cur = []
        keyword, _, args = joined.partition(" ")
        if keyword not in KEYWORDS:
            raise DockerfileError(f"line {start}: unknown or lower-case instruction {keyword!r}")
        if not args.strip():
            raise DockerfileError(f"line {start}: {keyword} without arguments")
        out.append(Instr(keyword, args.strip(), start))
    if cur:
        raise DockerfileError(f"line {start}: the file ends inside a continuation")
    return out


def check_instructions(instrs: list[Instr], context: str = ROOT) -> dict[str, str]:
    """Structure: global ARGs, then one FROM (an NGC PyTorch image through an ARG default), then
    the rest; ARG/ENV/LABEL/WORKDIR/COPY forms; every COPY source exists in the build context.
    Returns the global ARG defaults."""
    args: dict[str, str] = {}
    i = 0
    while i < len(instrs) and instrs[i].keyword == "ARG":
        name, eq, default = instrs[i].args.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) or not eq:
            raise DockerfileError(f"line {instrs[i].line}: ARG needs NAME=default, got {instrs[i].args!r}")
        args[name] = default
        i += 1
    if i == len(instrs) or instrs[i].keyword != "FROM":
        raise DockerfileError("the first instruction after the global ARGs must be FROM")
    froms = [x for x in instrs if x.keyword == "FROM"]
    if len(froms) != 1:
        raise DockerfileError(f"one stage expected, found {len(froms)} FROM")
    m = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", instrs[i].args)
    base = args.get(m.group(1)) if m else instrs[i].args
    if base is None or not NGC_PYTORCH.match(base):
        raise DockerfileError(f"FROM must be an nvcr.io/nvidia/pytorch:<yy.mm>-py3 image (via an ARG default), got {base!r}")
    for x in instrs[i + 1:]:
        if x.keyword in ("ENV", "LABEL"):
            for tok in shlex.split(x.args):
                if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*=.*", tok):
                    raise DockerfileError(f"line {x.line}: {x.keyword} needs KEY=value pairs, got {tok!r}")
        elif x.keyword == "WORKDIR":
            if not x.args.startswith("/"):
                raise DockerfileError(f"line {x.line}: WORKDIR must be absolute, got {x.args!r}")
        elif x.keyword == "COPY":
            toks = shlex.split(x.args)
            srcs = [t for t in toks[:-1] if not t.startswith("--")]
            if not srcs:
                raise DockerfileError(f"line {x.line}: COPY needs a source and a destination")
            if len(srcs) > 1 and not toks[-1].endswith("/"):
                raise DockerfileError(f"line {x.line}: COPY of several sources needs a destination ending in /")
            for s in srcs:
                if not os.path.exists(os.path.join(context, s)):
                    raise DockerfileError(f"line {x.line}: COPY source {s} is not in the build context")
        elif x.keyword == "ARG":
            raise DockerfileError(f"line {x.line}: ARG after FROM (keep build arguments global)")
    return args


def shell_commands(instrs: list[Instr]) -> list[list[str]]:
    """Every simple command of every RUN (split at && and ;), as argv lists."""
    cmds = []
    for x in instrs:
        if x.keyword != "RUN":
            continue
        cur: list[str] = []
        for tok in shlex.split(x.args):
            if tok in ("&&", ";", "||"):
                cmds.append(cur)
                cur = []
            else:
                cur.append(tok)
        cmds.append(cur)
    return [c for c in cmds if c]


@dataclass
class PipInstall:
    options: list[str]
    targets: list[str]
    index: int  # position among the shell commands


def pip_installs(cmds: list[list[str]]) -> list[PipInstall]:
    out = []
    for k, c in enumerate(cmds):
        for j in range(len(c) - 1):
            if c[j].split("/")[-1] in ("pip", "pip3") and c[j + 1] == "install":
                opts, targets, rest = [], [], c[j + 2:]
                it = iter(range(len(rest)))
                for q in it:
                    tok = rest[q]
                    if tok in PIP_VALUE_OPTS:
                        opts += [tok, rest[q + 1]]
                        next(it)
                    elif tok.startswith("-"):
                        opts.append(tok)
                    else:
                        targets.append(tok)
                out.append(PipInstall(opts, targets, k))
                break
    return out


def opt_value(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def check_pins(docker_text: str, project: dict) -> list[str]:
    """Problems (empty: none) between the Dockerfile's installs and pyproject.toml."""
    problems = []
    cmds = shell_commands(parse_dockerfile(docker_text))
    installs = pip_installs(cmds)
    base_checks = [k for k, c in enumerate(cmds) if "check_versions.py" in " ".join(c[:2]) and "base" in c]
    final_checks = [c for c in cmds if "check_versions.py" in " ".join(c[:2]) and "final" in c]
    if len(base_checks) != 1 or len(final_checks) != 1:
        return [f"expected one `check_versions.py base` and one `final` run, found {len(base_checks)}, {len(final_checks)}"]
    base = cmds[base_checks[0]]
    constraints = opt_value(base, "--write-constraints")
    if opt_value(base, "--pyproject") != "pyproject.toml" or opt_value(final_checks[0], "--pyproject") != "pyproject.toml":
        problems.append("check_versions.py must read the pyproject.toml copied into the image")
    if opt_value(final_checks[0], "--constraints") != constraints:
        problems.append("the final check must read the constraints the base check wrote")
    project_installs = [p for p in installs if "--no-deps" in p.options]
    dep_installs = [p for p in installs if "--no-deps" not in p.options]
    if [p.targets for p in project_installs] != [["."]]:
        problems.append(f"the project must be installed once, `pip install --no-deps .`; got {[p.targets for p in project_installs]}")
    for p in installs:
        if p.index < base_checks[0]:
            problems.append(f"pip install {p.targets} runs before the base image's versions are checked")
        if opt_value(p.options, "-c") != constraints and opt_value(p.options, "--constraint") != constraints:
            problems.append(f"pip install {p.targets} without -c {constraints} (it could replace the base's torch)")
    # what the final check covers: dependencies + extras given to it
    i = final_checks[0].index("--extras") if "--extras" in final_checks[0] else len(final_checks[0])
    extras = [a for a in final_checks[0][i + 1:] if not a.startswith("-")]
    wanted: dict[str, Requirement] = {}
    for r in map(Requirement, project["dependencies"]):
        wanted[canonicalize_name(r.name)] = r
    for e in extras:
        for r in map(Requirement, project.get("optional-dependencies", {}).get(e, [])):
            wanted[canonicalize_name(r.name)] = r
    kept = {"torch", "transformer-engine"}  # the base image's own
    got: dict[str, Requirement] = {}
    for p in dep_installs:
        for t in p.targets:
            if t == "." or t.startswith(("./", "/")):
                problems.append(f"pip install {t} without --no-deps (its torch pin would replace the base's)")
                continue
            r = Requirement(t)
            name = canonicalize_name(r.name)
            if name in got:
                problems.append(f"{r.name} is installed twice")
            got[name] = r
    for name, r in got.items():
        if name in kept:
            problems.append(f"the image must keep the base's {name}, not install {r}")
        elif name not in wanted:
            problems.append(f"{r} is not a dependency of pyproject.toml (or of the extras {extras})")
        elif r.specifier != wanted[name].specifier or r.extras != wanted[name].extras:
            problems.append(f"{r} differs from pyproject.toml's {wanted[name]}")
    for name, r in wanted.items():
        if name not in got and name not in kept:
            problems.append(f"pyproject.toml's {r} is not installed by the Dockerfile")
    return problems


def check_sglang_images(texts: dict[str, str], version: str) -> list[str]:
    """Every lmsysorg/sglang:v<version> named in `texts` is SGLANG_VERSION's; the Dockerfile's
    label names it."""
    problems = []
    for name, text in texts.items():
        for m in SGLANG_IMAGE.finditer(text):
            if m.group(1) != version:
                problems.append(f"{name} names {m.group(0)}, but SGLANG_VERSION is {version}")
    labels = [x for x in parse_dockerfile(texts["docker/Dockerfile"]) if x.keyword == "LABEL"]
    pairs = dict(tok.split("=", 1) for x in labels for tok in shlex.split(x.args))
    if pairs.get("gspo-megatron.sglang-image") != f"lmsysorg/sglang:v{version}":
        problems.append(f"docker/Dockerfile's gspo-megatron.sglang-image label is {pairs.get('gspo-megatron.sglang-image')!r}, "
                        f"not lmsysorg/sglang:v{version}")
    return problems


def image_texts() -> dict[str, str]:
    paths = ["docker/Dockerfile", "docker/README.md", "launch/slurm/train_with_sglang.sbatch",
             "launch/slurm/train.sbatch"]
    return {p: read(os.path.join(ROOT, p)) for p in paths}


def load_checker():
    spec = importlib.util.spec_from_file_location("check_versions", CHECKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- the recipe as it is -----------------------------------------------------------------------


def test_dockerfile_is_well_formed():
    instrs = parse_dockerfile(read(DOCKERFILE))
    args = check_instructions(instrs)
    assert NGC_PYTORCH.match(args["BASE_IMAGE"])
    runs = [x for x in instrs if x.keyword == "RUN"]
    assert len(runs) >= 3
    # the multi-line pip install was joined into one instruction with every package in it
    (deps,) = [p for p in pip_installs(shell_commands(instrs)) if "--no-deps" not in p.options]
    assert any(t.startswith("megatron-core") for t in deps.targets) and len(deps.targets) >= 10


# What NGC PyTorch tags ship (torch, Transformer Engine), as far as known without registry access
# here: torch of 25.12 from NVIDIA's release notes (docs.nvidia.com/deeplearning/frameworks/
# pytorch-release-notes/rel-25-12.html); the other versions from third-party reports of the images.
# Megatron-LM builds megatron-core 0.16.x with 25.11 (docker/.ngc_version.dev at core_v0.16.1).
# A new default tag is added here with its versions, checked by `pip list` in the image.
NGC_TAGS = {
    "25.11": {"torch": "2.10.0a0", "transformer-engine": "2.9.0"},
    "25.12": {"torch": "2.10.0a0", "transformer-engine": "2.10.0"},
    "26.01": {"torch": "2.10.0a0", "transformer-engine": "2.11.0"},
}


def test_the_default_base_images_transformer_engine_is_in_range():
    """Issue 52: the default base (26.08) almost certainly shipped a Transformer Engine outside
    megatron-core 0.16.1's range (< 2.12, pyproject.toml's `gpu` extra), so `make image` with its
    defaults failed at its first step. The default is now a tag whose versions are recorded above
    and lie in pyproject's ranges (the same judgement docker/check_versions.py makes in the build)."""
    args = check_instructions(parse_dockerfile(read(DOCKERFILE)))
    tag = args["BASE_IMAGE"].split(":")[1].removesuffix("-py3")
    assert tag in NGC_TAGS, f"record the versions of nvcr.io/nvidia/pytorch:{tag}-py3 in NGC_TAGS first"
    cv = load_checker()
    got = NGC_TAGS[tag]
    versions = {"torch": got["torch"], "transformer_engine": got["transformer-engine"]}
    assert cv.check_base(tomllib.loads(read(PYPROJECT)), versions, "3.12.3")  # admitted (maybe with a warning line)


def test_dockerfile_pins_agree_with_pyproject():
    assert check_pins(read(DOCKERFILE), pyproject()) == []


def test_sglang_image_is_the_version_the_client_speaks():
    assert check_sglang_images(image_texts(), SGLANG_VERSION) == []
    # and it is named where an operator looks: the Dockerfile label, docker/README.md, the sbatch header
    for name, text in image_texts().items():
        if name != "launch/slurm/train.sbatch":
            assert f"lmsysorg/sglang:v{SGLANG_VERSION}" in text, name


def test_dockerignore_keeps_the_copied_paths():
    """BuildKit reads docker/Dockerfile.dockerignore for this Dockerfile: it must not exclude a
    COPY source (a `**` then `!path` exceptions)."""
    lines = [ln.strip() for ln in read(DOCKERFILE + ".dockerignore").splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0] == "**"
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    for x in parse_dockerfile(read(DOCKERFILE)):
        if x.keyword == "COPY":
            for s in shlex.split(x.args)[:-1]:
                assert s in allowed, s


# ---- each check fails on a drifted copy -------------------------------------------------------


def test_parser_refuses_malformed_dockerfiles():
    good = read(DOCKERFILE)
    with pytest.raises(DockerfileError, match="continuation"):
        parse_dockerfile(good.rstrip() + " \\\n")
    with pytest.raises(DockerfileError, match="unknown or lower-case"):
        parse_dockerfile(good.replace("\nWORKDIR /workspace", "\nworkdir /workspace"))
    with pytest.raises(DockerfileError, match="not in the build context"):
        check_instructions(parse_dockerfile(good.replace("COPY converters ", "COPY converterz ")))
    with pytest.raises(DockerfileError, match="nvcr.io/nvidia/pytorch"):
        check_instructions(parse_dockerfile(re.sub(r"ARG BASE_IMAGE=\S+", "ARG BASE_IMAGE=pytorch/pytorch:latest", good)))
    with pytest.raises(DockerfileError, match="first instruction"):
        check_instructions(parse_dockerfile(good.replace("FROM ${BASE_IMAGE}", "RUN true\nFROM ${BASE_IMAGE}")))
    # a continuation that loses its backslash splits one RUN into an instruction Docker refuses
    with pytest.raises(DockerfileError, match="unknown"):
        parse_dockerfile(good.replace('"megatron-core==0.16.1" \\', '"megatron-core==0.16.1"'))


@pytest.mark.parametrize("old,new,expect", [
    ('"megatron-core==0.16.1"', '"megatron-core==0.16.2"', "megatron-core==0.16.2 differs"),
    ('"megatron-core==0.16.1"', '"megatron-core>=0.16.1"', "megatron-core>=0.16.1 differs"),
    ('"transformers>=5,<6"', '"transformers>=5"', "transformers>=5 differs"),
    ('"numpy"', '"numpy<2"', "numpy<2 differs"),
    ('        "datasets>=3" \\\n', "", "datasets>=3 is not installed"),
    ('"tensorboard>=2.14"', '"tensorboard>=2.14" "torch>=2.13.0,<2.15"', "keep the base's torch"),
    ('"tensorboard>=2.14"', '"tensorboard>=2.14" "wandb>=0.22,<0.32"', "not a dependency"),
    ("--no-deps --no-build-isolation", "--no-build-isolation", "installed once"),
    ("-c base-constraints.txt \\\n", "\\\n", "without -c base-constraints.txt"),
    ("--extras tensorboard", "--extras", "tensorboard>=2.14 is not a dependency"),
])
def test_pin_drift_in_the_dockerfile_is_caught(old, new, expect):
    text = read(DOCKERFILE)
    assert old in text
    problems = check_pins(text.replace(old, new, 1), pyproject())
    assert any(expect in p for p in problems), problems


@pytest.mark.parametrize("old,new,expect", [
    ('"megatron-core==0.16.1"', '"megatron-core==0.17.0"', "megatron-core==0.16.1 differs"),
    ('"transformers>=5,<6"', '"transformers>=5,<7"', "transformers<6,>=5 differs"),
    ('"pyyaml>=6"', '"pyyaml>=6", "rich>=13"', "rich>=13 is not installed"),
    ('tensorboard = ["tensorboard>=2.14"]', 'tensorboard = ["tensorboard>=2.15"]', "tensorboard>=2.14 differs"),
])
def test_pin_drift_in_pyproject_is_caught(old, new, expect):
    text = read(PYPROJECT)
    assert old in text
    problems = check_pins(read(DOCKERFILE), pyproject(text.replace(old, new, 1)))
    assert any(expect in p for p in problems), problems


def test_sglang_image_drift_is_caught():
    texts = image_texts()
    assert check_sglang_images(texts, "0.5.24")  # the client moved on, the image did not
    bad = dict(texts, **{"docker/README.md": texts["docker/README.md"] + "\nlmsysorg/sglang:v0.5.22\n"})
    assert any("docker/README.md names lmsysorg/sglang:v0.5.22" in p for p in check_sglang_images(bad, SGLANG_VERSION))
    bad = dict(texts, **{"docker/Dockerfile": texts["docker/Dockerfile"].replace(
        f'gspo-megatron.sglang-image="lmsysorg/sglang:v{SGLANG_VERSION}"', 'gspo-megatron.sglang-image="sglang"')})
    assert any("label" in p for p in check_sglang_images(bad, SGLANG_VERSION))


# ---- docker/check_versions.py: the build's version check -------------------------------------


def test_version_check_reads_pyprojects_ranges():
    cv = load_checker()
    full = tomllib.loads(read(PYPROJECT))
    proj = full["project"]
    te = Requirement(proj["optional-dependencies"]["gpu"][0])
    assert cv.project_requirement(proj, "transformer-engine", "gpu").specifier == te.specifier
    ok = {"torch": "2.13.0a0+5228986c39.nv26.6", "transformer-engine": "2.10.0+769ed778"}  # NGC-style snapshots
    assert cv.check_base(full, ok, "3.12.3") == ok
    assert cv.check_base(full, {"torch": "2.14.1", "transformer_engine": "2.9.0"}, "3.12.3")
    for versions, python, words in [
        ({"torch": "2.5.1a0+abc", "transformer-engine": "2.10.0"}, "3.12.3", "torch 2.5.1a0+abc is outside"),
        ({"torch": "2.15.0a0+abc", "transformer-engine": "2.10.0"}, "3.12.3", "torch 2.15.0a0+abc is outside"),
        ({"torch": "2.14.0", "transformer-engine": "2.12.0"}, "3.12.3", "Transformer Engine 2.12.0 is outside"),
        ({"torch": "2.14.0", "transformer-engine": "2.8.0"}, "3.12.3", "Transformer Engine 2.8.0 is outside"),
        ({"torch": "2.14.0"}, "3.12.3", "has no Transformer Engine"),
        ({"torch": "2.14.0", "transformer-engine": "2.10.0"}, "3.10.12", "Python 3.10.12 is outside"),
    ]:
        with pytest.raises(cv.CheckError, match=re.escape(words)):
            cv.check_base(full, versions, python)
    # it follows pyproject.toml, not a copy: move the range and the same base is refused / admitted
    moved = tomllib.loads(read(PYPROJECT).replace('torch = ">=2.6.0,<2.15"', 'torch = ">=2.14.0,<2.16"'))
    with pytest.raises(cv.CheckError, match="torch 2.13.0a0"):
        cv.check_base(moved, ok, "3.12.3")
    assert cv.check_base(moved, {**ok, "torch": "2.15.0a0+abc"}, "3.12.3")
    moved = tomllib.loads(read(PYPROJECT).replace('"transformer-engine[pytorch]>=2.9.0a0,<2.12.0"',
                                                  '"transformer-engine[pytorch]>=2.15,<2.19"'))
    assert cv.check_base(moved, {**ok, "transformer-engine": "2.17.1"}, "3.12.3")


def test_the_images_torch_floor_is_megatron_cores_not_the_cpu_pin():
    """Issue 41 5f: the build judged the base's torch by CI's CPU pin (>= 2.13), which could refuse
    every NGC tag whose Transformer Engine is in megatron-core's range (those ship torch 2.10-2.11).
    The image's floor is megatron-core 0.16.1's own (its installed metadata); an NGC torch 2.10
    snapshot with TE 2.10 is admitted, with one warning that it is outside the tested 2.13+."""
    cv = load_checker()
    full = tomllib.loads(read(PYPROJECT))
    floor = next(Requirement(r) for r in metadata.requires("megatron-core") if Requirement(r).name == "torch")
    image, tested = cv.image_torch(full)
    low = lambda spec: min(Version(s.version) for s in spec if s.operator == ">=")  # noqa: E731
    assert low(image) == low(floor.specifier), (image, floor)
    assert image.contains("2.14.1") and not image.contains("2.15.0")  # SGLang 0.5.23's torch; our ceiling
    ours = next(Requirement(r) for r in full["project"]["dependencies"] if Requirement(r).name == "torch")
    assert low(tested) == low(ours.specifier)  # what CI tests is the dependency range's floor
    warnings = []
    ngc_25_12 = {"torch": "2.10.0a0+b4e4ee8.nv25.12", "transformer-engine": "2.10.0+769ed778"}
    assert cv.check_base(full, ngc_25_12, "3.12.3", warnings=warnings) == ngc_25_12
    assert len(warnings) == 1 and "torch 2.10.0a0+b4e4ee8.nv25.12" in warnings[0] and "make gpu-check" in warnings[0]
    warnings.clear()
    cv.check_base(full, {"torch": "2.13.0a0+abc", "transformer-engine": "2.10.0"}, "3.12.3", warnings=warnings)
    assert warnings == []


def test_version_check_final_stage():
    cv = load_checker()
    full = tomllib.loads(read(PYPROJECT))
    proj = full["project"]
    env = {canonicalize_name(Requirement(r).name): "99" for r in proj["dependencies"]}
    env.update({"torch": "2.13.0a0+abc", "megatron-core": "0.16.1", "transformers": "5.19.0", "numpy": "2.1.0",
                "safetensors": "0.5.0", "pyyaml": "6.0.2", "tqdm": "4.67.0", "math-verify": "0.8.0",
                "datasets": "4.0.0", "matplotlib": "3.10.0", "tensorboard": "2.20.0", "gspo-megatron": "0.1.0",
                "transformer-engine": "2.10.0"})
    pins = {"torch": "2.13.0a0+abc", "transformer-engine": "2.10.0"}
    cv.check_final(full, ["tensorboard"], pins, env)
    for change, words in [({"torch": "2.14.1"}, "torch 2.13.0a0+abc of the base image was replaced by 2.14.1"),
                          ({"megatron-core": "0.16.0"}, "megatron-core 0.16.0 does not satisfy"),
                          ({"tensorboard": None}, "tensorboard is not installed"),
                          ({"gspo-megatron": None}, "gspo-megatron 0.1.0 is not installed")]:
        with pytest.raises(cv.CheckError, match=re.escape(words)):
            cv.check_final(full, ["tensorboard"], pins, {**env, **change})


def test_version_check_cli_one_line(tmp_path):
    """As the build runs it, on this (CPU, TE-less) environment: the base stage refuses in one
    line, exit 1; the final stage passes on the test environment (every runtime requirement and
    the tensorboard extra installed) and refuses a replaced torch."""
    r = subprocess.run([sys.executable, CHECKER, "base", "--pyproject", PYPROJECT, "--write-constraints",
                        str(tmp_path / "c.txt")], capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("check_versions.py: error: ") and "Transformer Engine" in lines[0]
    assert "--build-arg BASE_IMAGE" in lines[0]
    c = tmp_path / "pins.txt"
    c.write_text(f"torch=={metadata.version('torch')}\n")
    final = [sys.executable, CHECKER, "final", "--pyproject", PYPROJECT, "--constraints", str(c),
             "--extras", "tensorboard"]
    r = subprocess.run(final, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    c.write_text("torch==1.0.0\n")
    r = subprocess.run(final, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "torch 1.0.0 of the base image was replaced" in r.stderr


def test_readme_and_sbatch_name_the_image_variables():
    readme = read(os.path.join(ROOT, "docker", "README.md"))
    for words in ("CONTAINER_IMAGE", "SGLANG_CONTAINER_IMAGE", "enroot import", "--container-image",
                  "docker build -f docker/Dockerfile", "fresh container"):
        assert words in readme, words
    for name in ("train.sbatch", "train_with_sglang.sbatch"):
        head = read(os.path.join(ROOT, "launch", "slurm", name)).split("#SBATCH", 1)[0]
        assert "docker/" in head or "SGLANG_CONTAINER_IMAGE" in head, name
        assert "SMOKE=1" in head, name
