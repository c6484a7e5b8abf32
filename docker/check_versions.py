"""Build-time check of the trainer image against pyproject.toml (docker/Dockerfile runs it).

pyproject.toml is the one source of the ranges: the image's torch range
([tool.gspo-megatron.image], megatron-core's floor rather than CI's CPU pin: NGC builds its own
torch), the Transformer Engine range of the `gpu` extra, `requires-python`, and `dependencies` for
everything installed on top; nothing here repeats them.

    python3 check_versions.py base  --pyproject P --write-constraints C
        before anything is installed: the base image's Python, torch and Transformer Engine must
        lie in pyproject's ranges; writes a pip constraints file pinning the base's exact torch
        and TE, so that no later `pip install` can replace them (it fails instead).
    python3 check_versions.py final --pyproject P --constraints C --extras tensorboard
        after the installs: torch and TE are still the base's, every project dependency (and
        those of the named extras) is installed and satisfies pyproject's specifier, and the
        project itself is installed.

A failure is one line on stderr ("check_versions.py: error: ...") and exit status 1, which fails
the `docker build`. Versions come from the installed distributions' metadata: nothing is
imported (importing Transformer Engine needs a GPU driver, absent during a build).

NGC containers ship pre-release snapshots of torch, e.g. 2.13.0a0+<git>.nv26.6 for what becomes
2.13.0; ">=2.13.0" refuses such a version, so torch and TE are judged by their release number
(2.13.0), the local and pre-release parts set aside. Upper bounds still refuse 2.15.0a0.
"""
from __future__ import annotations

import argparse
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version
except ImportError:  # pragma: no cover - images without `packaging` still have pip's copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import InvalidVersion, Version

PROG = "check_versions.py"
# Distribution names Transformer Engine has been installed under (NGC builds it from source).
TE_NAMES = ("transformer-engine", "transformer_engine", "transformer-engine-torch")


class CheckError(Exception):
    """What is wrong with the image, as one line."""


def load_pyproject(path: str) -> dict:
    """The whole pyproject.toml ("project" and "tool" tables)."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        raise CheckError(f"Python {sys.version.split()[0]} has no tomllib: the project needs Python >= 3.11 "
                         "(pyproject.toml requires-python); pick a newer base image") from None
    with open(path, "rb") as f:
        return tomllib.load(f)


def image_table(pyproject: dict) -> dict:
    table = pyproject.get("tool", {}).get("gspo-megatron", {}).get("image")
    if not isinstance(table, dict) or "torch" not in table:
        raise CheckError("pyproject.toml: no [tool.gspo-megatron.image] table with the image's torch range")
    return table


def image_torch(pyproject: dict) -> tuple[SpecifierSet, SpecifierSet | None]:
    """The base image's admitted torch range and the part of it tested (None: all of it)."""
    table = image_table(pyproject)
    tested = table.get("tested-torch")
    return SpecifierSet(table["torch"]), (SpecifierSet(tested) if tested else None)


def project_requirement(project: dict, name: str, extra: str | None = None) -> Requirement:
    """The requirement on `name` in pyproject's dependencies (or the extra's)."""
    reqs = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    for r in map(Requirement, reqs):
        if canonicalize_name(r.name) == canonicalize_name(name):
            return r
    where = "dependencies" if extra is None else f"the {extra!r} extra"
    raise CheckError(f"pyproject.toml: no requirement on {name} in {where}")


def runtime_requirements(project: dict, extras: list[str]) -> list[Requirement]:
    """The dependencies the image installs: pyproject's own plus the named extras'."""
    out = [Requirement(r) for r in project["dependencies"]]
    for e in extras:
        if e not in project.get("optional-dependencies", {}):
            raise CheckError(f"pyproject.toml has no extra {e!r}")
        out += [Requirement(r) for r in project["optional-dependencies"][e]]
    return out


def release_in_range(spec: SpecifierSet, version: str) -> bool:
    """Whether `version` (possibly an NGC snapshot such as 2.13.0a0+abc.nv26.6) is in `spec`,
    judged by its release number."""
    v = Version(version)
    return spec.contains(v, prereleases=True) or spec.contains(Version(v.base_version), prereleases=True)


def installed_version(names, versions: dict | None = None) -> tuple[str, str] | None:
    """(name, version) of the first installed distribution among `names`; `versions` stands in
    for the environment (tests)."""
    if versions is not None:
        versions = {canonicalize_name(k): v for k, v in versions.items()}
    for n in (names if isinstance(names, (tuple, list)) else (names,)):
        if versions is not None:
            v = versions.get(canonicalize_name(n))
        else:
            try:
                v = metadata.version(n)
            except metadata.PackageNotFoundError:
                v = None
        if v is not None:
            return n, v
    return None


def check_base(pyproject: dict, versions: dict | None = None, python: str | None = None,
               warnings: list[str] | None = None) -> dict[str, str]:
    """Raise CheckError unless the base's Python, torch and TE are in pyproject's ranges; return
    the exact versions to pin ({"torch": ..., "transformer-engine": ...}). A torch in the image's
    range but outside its tested part is appended to `warnings` (one line each)."""
    project = pyproject["project"]
    python = python or ".".join(map(str, sys.version_info[:3]))
    problems = []
    rp = SpecifierSet(project.get("requires-python", ""))
    if not rp.contains(python, prereleases=True):
        problems.append(f"Python {python} is outside pyproject.toml's requires-python {rp}")
    torch_range, tested = image_torch(pyproject)
    pins = {}
    for label, spec, names, where in (
        ("torch", torch_range, ("torch",), "[tool.gspo-megatron.image] torch"),
        ("Transformer Engine", project_requirement(project, "transformer-engine", "gpu").specifier, TE_NAMES,
         "the gpu extra's transformer-engine"),
    ):
        got = installed_version(names, versions)
        if got is None:
            problems.append(f"the base image has no {label} (pyproject.toml's {where}: {spec})")
            continue
        try:
            ok = release_in_range(spec, got[1])
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append(f"the base image's {label} {got[1]} is outside pyproject.toml's {where} {spec}")
        elif label == "torch" and tested is not None and not release_in_range(tested, got[1]):
            if warnings is not None:
                warnings.append(f"the base image's torch {got[1]} is in megatron-core's range but outside the "
                                f"tested {tested} (CI runs the 2.13.0 CPU wheel): run `make gpu-check` in the image")
        pins[canonicalize_name(got[0])] = got[1]
    if problems:
        raise CheckError("; ".join(problems) + " (choose another nvcr.io/nvidia/pytorch tag: "
                         "docker build --build-arg BASE_IMAGE=...)")
    return pins


def check_final(pyproject: dict, extras: list[str], pins: dict[str, str], versions: dict | None = None) -> None:
    """Raise CheckError unless the pinned base packages are unchanged and every runtime
    requirement (and the project) is installed in its range."""
    project = pyproject["project"]
    problems = []
    for name, want in pins.items():
        got = installed_version((name,), versions)
        if got is None or got[1] != want:
            problems.append(f"{name} {want} of the base image was replaced by {got[1] if got else 'nothing'}")
    for req in runtime_requirements(project, extras):
        if req.marker is not None and not req.marker.evaluate():
            continue
        got = installed_version((req.name,), versions)
        if got is None:
            problems.append(f"{req.name} is not installed (pyproject.toml: {req})")
        elif canonicalize_name(req.name) in pins:
            continue  # the base's own, checked against the image's range in check_base
        elif not req.specifier.contains(got[1], prereleases=True):
            problems.append(f"{req.name} {got[1]} does not satisfy pyproject.toml's {req}")
    got = installed_version((project["name"],), versions)
    if got is None or got[1] != project["version"]:
        problems.append(f"{project['name']} {project['version']} is not installed "
                        f"({got[1] if got else 'none'} found)")
    if problems:
        raise CheckError("; ".join(problems))


def read_constraints(path: str) -> dict[str, str]:
    pins = {}
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[canonicalize_name(name)] = version
    return pins


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", choices=("base", "final"))
    ap.add_argument("--pyproject", required=True)
    ap.add_argument("--write-constraints", help="base: write the pins of torch and TE here")
    ap.add_argument("--constraints", help="final: the file the base stage wrote")
    ap.add_argument("--extras", nargs="*", default=[], help="final: extras whose requirements were installed")
    args = ap.parse_args(argv)
    try:
        pyproject = load_pyproject(args.pyproject)
        project = pyproject["project"]
        if args.stage == "base":
            warnings: list[str] = []
            pins = check_base(pyproject, warnings=warnings)
            for w in warnings:
                print(f"{PROG}: warning: {w}", file=sys.stderr)
            if args.write_constraints:
                with open(args.write_constraints, "w") as f:
                    f.writelines(f"{n}=={v}\n" for n, v in pins.items())
            print(f"{PROG}: base ok: " + ", ".join(f"{n} {v}" for n, v in pins.items()))
        else:
            if not args.constraints:
                raise CheckError("final needs --constraints (the file the base stage wrote)")
            check_final(pyproject, args.extras, read_constraints(args.constraints))
            print(f"{PROG}: final ok: {project['name']} {project['version']} and its requirements")
    except CheckError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
