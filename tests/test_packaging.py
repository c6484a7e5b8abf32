"""The project's pins against the packages it must live with.

* `pip install .[sglang]`: colocated mode imports SGLang in the trainer's own environment
  (rollout/weight_sync.py), so every requirement SGLang 0.5.23's wheel declares on a distribution
  the project also requires must be satisfiable by the project's own specifier. Before, the
  project pinned torch==2.13.0 while the wheel pins torch==2.14.1: the extra could not resolve.
* The `gpu` extra's Transformer Engine range must lie inside the one megatron-core 0.16.1 declares.

Both read the packages' own metadata (the cached SGLang wheel of test_sglang_contract.py; the
installed megatron-core's METADATA), not a copy of it.
"""
from __future__ import annotations

import os
import tomllib
import zipfile
from importlib.metadata import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from test_sglang_contract import SGLANG_VERSION, _obtain_wheel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the platform the SGLang extra is installed on (GPU nodes)
LINUX_X86 = {**default_environment(), "sys_platform": "linux", "platform_machine": "x86_64",
             "platform_system": "Linux", "python_version": "3.11", "python_full_version": "3.11.9"}


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def _by_name(reqs) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def _pins(req: Requirement) -> list[Version]:
    return [Version(s.version) for s in req.specifier if s.operator in ("==", "===")]


def _wheel_requirements(wheel) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    out = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate({**LINUX_X86, "extra": ""}):
                out.append(r)
    return out


def test_sglang_extra_fits_the_projects_pins():
    project = _pyproject()
    extra = _by_name(project["optional-dependencies"]["sglang"])
    assert [str(v) for v in _pins(extra["sglang"])] == [SGLANG_VERSION]
    ours = _by_name(project["dependencies"])
    theirs = _wheel_requirements(_obtain_wheel(SGLANG_VERSION))
    shared = [r for r in theirs if canonicalize_name(r.name) in ours]
    assert {canonicalize_name(r.name) for r in shared} >= {"torch", "transformers"}, shared
    for r in shared:
        mine = ours[canonicalize_name(r.name)]
        for v in _pins(r):  # SGLang pins an exact version: ours must admit it
            assert mine.specifier.contains(v, prereleases=True), f"sglang {SGLANG_VERSION} needs {r}, we require {mine}"
    # and the torch CI installs (the CPU wheel) still satisfies ours
    assert ours["torch"].specifier.contains(Version("2.13.0"))


def test_gpu_extra_te_range_is_inside_megatron_cores():
    ours = _by_name(_pyproject()["optional-dependencies"]["gpu"])["transformer-engine"]
    mc = [Requirement(r) for r in metadata("megatron-core").get_all("Requires-Dist")]
    (theirs,) = [r for r in mc if canonicalize_name(r.name) == "transformer-engine"
                 and r.marker is not None and r.marker.evaluate({**LINUX_X86, "extra": "dev"})]
    assert str(ours.specifier) and "pytorch" in ours.extras
    candidates = [Version(v) for v in ("2.8.0", "2.9.0", "2.10.0", "2.11.0", "2.11.5", "2.12.0", "2.20.2")]
    admitted = [v for v in candidates if ours.specifier.contains(v, prereleases=True)]
    assert admitted, ours
    for v in candidates:
        if ours.specifier.contains(v, prereleases=True):
            assert theirs.specifier.contains(v, prereleases=True), f"we admit TE {v}, megatron-core wants {theirs}"
    assert not ours.specifier.contains(Version("2.20.2"))  # what the index serves unpinned
