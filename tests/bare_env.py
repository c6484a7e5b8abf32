"""A bare Python for bench/gpu_check.py's CPU half, and the wheels that check carries, both made once
into a private cache.

The first GPU machine the check meets has torch and transformers and nothing else of this project's
(no megatron-core, the project not installed, no network). `bare_python()` makes a venv that looks
the same: torch (the CPU build) and transformers with their own requirements, nothing more; the
project is not installed into it and it has no megatron-core. `carried_wheels()` fills a folder
through the command `make gpu-wheels` runs (`bench/gpu_check.py --fetch-wheels`), for this Python
only. tests/test_gpu_check.py runs the check from that venv with `--wheels` = that folder, so the
check's own install path (a venv of its own that sees the bare one, megatron-core from the wheels,
a re-run there) is the one exercised.

  * torch 2.13.0 (CPU)   a wheel from $TORCH_WHEEL_DIR (default /opt/wheels, as in the Makefile)
                         when one for this Python lies there, else from download.pytorch.org's CPU index
  * transformers>=5,<6   from the package index, with its requirements

Cache: $GSPO_CACHE_DIR, else ~/.cache/gspo-megatron (the root of tests/bridge_env.py's cache too):
gpu-check-bare-py<XY>-torch<V> and gpu-check-wheels-py<XY>-<hash of the carried list>. A folder
holding the marker file `.complete` is reused, so later runs cost nothing. Each is made in a private
temporary folder beside it that is renamed into place when it is complete, so a concurrent or
interrupted run never leaves (or sees) a half-made one; the venv is only ever run as
<folder>/bin/python -m ..., which works after the rename (its console scripts' #! lines name the
temporary folder and are not used).

Failures: when pip cannot reach the package index the caller gets (None, one-line reason) to skip
with; any other failure raises BareEnvError (a broken install is a test failure, not a skip).
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK = REPO / "bench" / "gpu_check.py"
TORCH_VERSION = "2.13.0"
TRANSFORMERS = "transformers>=5,<6"  # as pyproject.toml
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CACHE_ENV = "GSPO_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path.home() / ".cache" / "gspo-megatron"
INSTALL_TIMEOUT_S = 900
# pip prints the connection error it retries on, and only then; with retries set to 0 (a config may
# do that) an unreachable index reads like a missing package. A few retries, each bounded.
PIP_NET = {"PIP_RETRIES": "3", "PIP_DEFAULT_TIMEOUT": "60"}
MARKER = ".complete"
PY_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
PY_VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


class BareEnvError(RuntimeError):
    pass


def _gpu_check():
    """bench/gpu_check.py as a module (its CARRIED list and pip-output helpers)."""
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_ROOT


def _run(cmd: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kw)
    except subprocess.TimeoutExpired:
        # pip's own retries end well before this on a dead network; a hang this long is one too
        return subprocess.CompletedProcess(cmd, -1, "", f"Max retries exceeded: timed out after {timeout_s:g} s")


def _build_cached(name: str, build) -> tuple[str | None, str | None]:
    """Cache folder `name`, made by build(tmp) -> None | skip reason when missing."""
    final = cache_root() / name
    if (final / MARKER).is_file():
        return str(final), None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700 would carry over to the cache folder
    except OSError as e:
        raise BareEnvError(f"cannot create the cache {final.parent}: {e}") from None
    try:
        skip = build(tmp)
        if skip:
            return None, skip
        (tmp / MARKER).write_text("")
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final, ignore_errors=True)  # an unfinished leftover: os.replace needs an empty target
        try:
            os.replace(tmp, final)
        except OSError as e:
            if not (final / MARKER).is_file():  # else a concurrent run finished first: use its copy
                raise BareEnvError(f"cannot move {tmp} into {final}: {e}") from None
        return str(final), None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _pip_failed(what: str, proc: subprocess.CompletedProcess, gc) -> str:
    """The skip reason when pip could not reach the index; raises for any other failure."""
    out = (proc.stderr or "") + (proc.stdout or "")
    net = gc.index_unreachable(out)
    if net:
        return f"{what}: package index unreachable ({net[:200]})"
    raise BareEnvError(f"{what}: {gc._first_error(out)}")


def bare_python() -> tuple[str | None, str | None]:
    """(python of a venv with only torch + transformers, None), or (None, reason to skip)."""
    gc = _gpu_check()

    def build(tmp: Path) -> str | None:
        r = _run([sys.executable, "-m", "venv", str(tmp)], 300)
        if r.returncode != 0:
            raise BareEnvError(f"python -m venv: {gc._first_error(r.stderr + r.stdout)}")
        py = str(tmp / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input",
               "--retries", PIP_NET["PIP_RETRIES"], "--timeout", PIP_NET["PIP_DEFAULT_TIMEOUT"]]
        wheel_dir = os.environ.get("TORCH_WHEEL_DIR", "/opt/wheels")
        wheels = sorted(glob.glob(os.path.join(wheel_dir, f"torch-{TORCH_VERSION}+cpu-{PY_TAG}-*.whl")))
        if wheels:  # one resolve for both
            r = _run([*pip, wheels[0], TRANSFORMERS], INSTALL_TIMEOUT_S)
            if r.returncode != 0:
                return _pip_failed(f"pip install {TRANSFORMERS}", r, gc)
        else:  # the CPU build first (a bare `torch` is the multi-GB CUDA one), then transformers
            r = _run([*pip, f"torch=={TORCH_VERSION}", "--index-url", TORCH_CPU_INDEX], INSTALL_TIMEOUT_S)
            if r.returncode != 0:
                return _pip_failed(f"pip install torch=={TORCH_VERSION} from {TORCH_CPU_INDEX}", r, gc)
            r = _run([*pip, TRANSFORMERS], INSTALL_TIMEOUT_S)
            if r.returncode != 0:
                return _pip_failed(f"pip install {TRANSFORMERS}", r, gc)
        # Bare means bare: neither the project nor megatron-core (cwd outside the repo).
        probe = ("import importlib.util as u, torch, transformers; "
                 "extra = [m for m in ('megatron', 'gspo_megatron', 'converters') if u.find_spec(m)]; "
                 "print(extra or '')")
        r = _run([py, "-c", probe], 300, cwd=str(tmp), env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        if r.returncode != 0 or r.stdout.strip():
            raise BareEnvError(f"the bare venv is not bare or broken: {r.stdout.strip()} {gc._first_error(r.stderr)}")
        return None

    d, skip = _build_cached(f"gpu-check-bare-{PY_TAG}-torch{TORCH_VERSION}", build)
    return (os.path.join(d, "bin", "python"), None) if d else (None, skip)


def carried_wheels() -> tuple[str | None, str | None]:
    """(folder with bench/gpu_check.py's carried wheels for this Python, None), or (None, reason to skip)."""
    gc = _gpu_check()
    key = hashlib.sha1(" ".join([*gc.CARRIED, gc.PIP_WHEEL]).encode()).hexdigest()[:10]

    def build(tmp: Path) -> str | None:
        # the command `make gpu-wheels PYVERS=<this Python>` runs
        r = _run([sys.executable, str(GPU_CHECK), "--fetch-wheels", str(tmp), "--python-versions", PY_VERSION],
                 INSTALL_TIMEOUT_S, env=dict(os.environ, **PIP_NET))
        if r.returncode != 0:
            out = r.stdout + r.stderr
            if "package index unreachable" in out or gc.index_unreachable(out):
                return f"make gpu-wheels: {gc._first_error(out)[:200]}"
            raise BareEnvError(f"make gpu-wheels: {gc._first_error(out)}")
        if not glob.glob(str(tmp / f"megatron_core-*-{PY_TAG}-*.whl")):
            raise BareEnvError(f"gpu_check.py --fetch-wheels left no megatron-core wheel for {PY_TAG} in {tmp}")
        return None

    return _build_cached(f"gpu-check-wheels-{PY_TAG}-{key}", build)
