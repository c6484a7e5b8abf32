"""Megatron-Bridge 0.3.1 for the interop tests, installed once into a private cache.

Megatron-Bridge is not a dependency of this project (its wheel pins transformers<5 and pulls
Transformer Engine, modelopt, ...). The interop tests only need its pure-Python package plus the
few pure-Python modules it imports at load time, so `bridge_pythonpath()` installs exactly these
with `pip install --no-deps --target` into a folder of its own, which the tests put on the
PYTHONPATH of a subprocess (tests/bridge_driver.py); the venv is never touched. `megatron` is a
namespace package, so `megatron.bridge` from that folder and `megatron.core` from the venv merge.

  * megatron-bridge==0.3.1      the package under test (its megatron-core pin, >=0.15,<0.17,
                                holds for the venv's 0.16.1)
  * omegaconf, antlr4 runtime   run_config.yaml is read/written through OmegaConf
  * einops, six                 imported at module level by Bridge model files
  * psutil                      Megatron-Core's torch_dist writer needs it in its forked writer
                                process (dist_checkpointing/strategies/filesystem_async.py); without
                                it the child dies and the parent waits forever

Cache: $GSPO_CACHE_DIR/megatron-bridge-0.3.1, else ~/.cache/gspo-megatron/megatron-bridge-0.3.1
(the same root as the SGLang wheel cache of test_sglang_contract.py). A folder that holds
megatron/bridge/__init__.py is reused, so later runs cost nothing. The install goes into a private
temporary folder beside it that is renamed into place when pip has finished, so a concurrent or
interrupted run never leaves (or sees) a half-installed package. If pip fails or times out (no
package registry), the caller gets a one-line reason to skip with.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BRIDGE_VERSION = "0.3.1"
PACKAGES = [
    f"megatron-bridge=={BRIDGE_VERSION}",
    "omegaconf==2.3.0",
    "antlr4-python3-runtime==4.9.3",  # the runtime omegaconf 2.3.0 is generated for
    "einops",
    "six",
    "psutil",
]
CACHE_ENV = "GSPO_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "gspo-megatron"
INSTALL_TIMEOUT_S = 600
MARKER = Path("megatron") / "bridge" / "__init__.py"


def bridge_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    root = Path(env).expanduser() if env else DEFAULT_CACHE_ROOT
    return root / f"megatron-bridge-{BRIDGE_VERSION}"


def _complete(site: Path) -> bool:
    return (site / MARKER).is_file()


def _pip_reason(proc: subprocess.CompletedProcess) -> str:
    """The first line of pip's error: its first `ERROR:` line (warnings such as retries come
    first), else its first non-empty line."""
    lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    if errors:
        return errors[0]
    return lines[0] if lines else f"pip exited with status {proc.returncode}"


def bridge_pythonpath(timeout_s: float = INSTALL_TIMEOUT_S) -> tuple[str | None, str | None]:
    """(site dir holding megatron/bridge, None), or (None, one-line reason to skip)."""
    site = bridge_cache_dir()
    if _complete(site):
        return str(site), None
    why = f"megatron-bridge {BRIDGE_VERSION} could not be installed"
    try:
        site.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{site.name}-install-", dir=site.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would carry over to the cache folder
    except OSError as e:
        return None, f"{why}: cannot create the cache {site.parent}: {e}"
    try:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
               "--no-input", "--target", str(tmp), *PACKAGES]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"{why}: pip timed out after {timeout_s:g}s (no package registry?)"
        if proc.returncode != 0:
            return None, f"{why}: {_pip_reason(proc)}"
        if not _complete(tmp):
            return None, f"{why}: pip succeeded but {MARKER} is missing"
        if site.exists() and not _complete(site):
            # leftover of something that is not our finished install (os.replace cannot
            # overwrite a non-empty folder)
            shutil.rmtree(site, ignore_errors=True)
        try:
            os.replace(tmp, site)
        except OSError as e:
            if not _complete(site):  # else a concurrent run finished first: use its copy
                return None, f"{why}: cannot move the install into {site}: {e}"
        return str(site), None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
