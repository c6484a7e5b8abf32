"""One-command check of the path a cluster runs, on one GPU (or its CPU half, in the test suite).

    python bench/gpu_check.py --wheels wheels      # one GPU: NCCL, bf16, distributed optimizer
    python bench/gpu_check.py --device cpu --nproc 2   # the same steps on CPU/gloo (CI runs this)
    make gpu-check                                 # = the first line
    make gpu-wheels [PYVERS="3.12"]                # where the index is reachable: fill ./wheels

It needs only torch and transformers in the interpreter that runs it: the project need not be
installed (the repository is put on sys.path here and on the PYTHONPATH of every launch), and
megatron-core, when it is missing or not 0.16.1, comes from the carried wheels (--wheels, no
network) through the same path every time: a venv in <out>/venv whose site-packages also sees
this interpreter's (a .pth file; `venv --system-site-packages` made from inside a venv would see
the base interpreter, not that venv), the wheels installed there with --no-index --no-deps, and
this script re-run with that venv's python. The interpreter itself is never written to (a PEP 668
"externally managed" system Python refuses that anyway).

What runs — the default configuration of the GPU presets on the tiny Qwen3-MoE of
launch/configs/tiny_cpu.yaml (so it fits in minutes; `--config launch/configs/tiny_cpu_glm.yaml`:
the GLM-4.5 family's tiny model, whose TE spec mixes dense and MoE layers;
`--config launch/configs/tiny_cpu_deepseek_v3.yaml`: DeepSeek-V3's, TE's MLA spec): model.dtype=bfloat16 (fp32 master weights in
the optimizer), optimizer.use_distributed_optimizer=true, train.recompute=selective, the world
process group on NCCL (parallel.device=cuda; gloo on CPU), Transformer Engine's layer spec when TE
imports (then TE's FusedAdam, whose checkpoint path keeps `step` in the param groups):

  1 environment    torch / megatron-core 0.16.1 / TE / CUDA as found (megatron-core from --wheels
                   as above when it is missing)
  2 train          launch A: SFT warm start, then GSPO steps 1-2, checkpoint at step 2 (torch_dist,
                   written in the background: checkpoint.async_save=true)
  3 resume         launch B resumes A's checkpoint (checkpoint.resume=auto), runs GSPO step 3,
                   checkpoints (in the background) and exports; launch C runs steps 1-3
                   uninterrupted in a folder of its own, saving synchronously. B's step-3 fp32 masters == C's: bit for bit on CPU; on CUDA (kernels may be
                   nondeterministic) ||B3 - C3|| <= 5% of ||C3 - A2||, the size of one step's update
                   (Adam's step count lost at the resume, i.e. a wrong bias correction: 61%)
  4 metrics        the SFT token NLL falls; GSPO steps 1..3 logged once each, finite loss / grad
                   norm, rewards in [0, 1]
  5 export         <out>/hf loads in transformers' model of the family, bf16 weights, and its
                   log-probs (transformers) == the trainer's model's (gspo_megatron.score on B's
                   step-3 checkpoint) on a few sequences, both computed in fp32
  6 mcore-to-hf    gspo-convert mcore-to-hf of the step-3 checkpoint == <out>/hf, bit for bit
  7 checkpoint     the step-3 checkpoint holds fp32 masters and Adam moments for every parameter
  8 vllm-nccl      rollout.vllm.weight_sync=nccl's trainer half (rollout/vllm_nccl.py) with no server
                   attached, a group of one rank: on CUDA through torch.cuda.nccl exactly as a push
                   does (unique id, init_rank, the warm-up all_reduce, bucketed bf16 broadcasts from
                   rank 0, on the transfer's own stream), then ncclCommAbort as a failed push
                   calls it; on CPU a stand-in communicator (torch.cuda.nccl is CUDA-only)

  9 lora         (--lora only) launch D: LoRA (rank 8 on every target) from launch B's export as the
                   base, 2 GSPO steps on the device - Megatron's own linears on CUDA with LoRA, not
                   TE's (model/spec.py local_spec), adapters hooked there -, background save:
                   finite metrics and a non-zero gradient norm, an adapter-only checkpoint (fp32
                   masters and both moments for each adapter, no base tensor), and
                   `gspo-convert lora-merge` of it == its own <out>/hf export, bit for bit

It prints a PASS/FAIL table of these 8 rows (9 with --lora) (a row not reached is a FAIL naming the row it waited
for) and exits non-zero on any failure. Every launch has a timeout; the whole check is sized for
< 8 minutes on one GPU (about 2 minutes on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# `converters` and `gspo_megatron` are imported here too (steps 5-7), not only in the launches: the
# repository goes first on sys.path, so an uninstalled checkout works and an installed copy elsewhere
# cannot stand in for the code under check.
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CONFIG = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
MEGATRON_VERSION = "0.16.1"
# What the check imports beyond torch and transformers (and their own requirements), as found in a
# venv holding only those two (tests/test_gpu_check.py runs the check from one): megatron-core only.
# Its requirement packaging>=24.2 can be older where transformers is installed, and pyyaml / tqdm
# (imported by the trainer; transformers requires them too) are carried in case transformers came
# without its requirements. Requirements already met by the interpreter are not installed again.
CARRIED = [f"megatron-core=={MEGATRON_VERSION}", "packaging>=24.2", "pyyaml>=6", "tqdm>=4"]
# pip itself, run from its wheel, where the interpreter has no pip module (pip wheels run as a path).
PIP_WHEEL = "pip"
DEFAULT_PYVERS = ("3.10", "3.11", "3.12", "3.13")
# megatron-core 0.16.1 is built for manylinux_2_24/2_28, pyyaml for 2014/2_17/2_28; pip matches
# each --platform exactly, so the accepted ones are listed (all <= glibc 2.28).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
OVERLAY_ENV = "GSPO_GPU_CHECK_VENV"  # set in the re-run: the venv it runs in (no second re-run)
ASYNC_SAVE = ("checkpoint.async_save=true",)  # launches A and B (stages 2, 3); C saves synchronously
ROWS = ("1 environment", "2 train", "3 resume", "4 metrics", "5 export", "6 mcore-to-hf", "7 checkpoint",
        "8 vllm-nccl")
LORA_ROW = "9 lora"  # with --lora


class _CpuLoopback:
    """NcclBackend stand-in for --device cpu (torch.cuda.nccl exists only in CUDA builds)."""

    def unique_id(self) -> bytes:
        return os.urandom(128)

    def join(self, uid, world_size, rank, device):
        class Comm:
            def all_reduce(self, t):
                pass

            broadcast = all_reduce

            def synchronize(self):
                pass

            def abort(self):
                return "the NCCL communicator was aborted"

        return Comm()
# Step 3 on CUDA: ||B3 - C3|| <= RESUME_RTOL * ||C3 - A2||. Measured on CPU with a fault put into
# the resume (a scratch copy of train/checkpoint.py): Adam's step count reset to 0 gives 61% (caught
# on both devices); off by one (9 instead of 8 at step 2 x 4 minibatches) gives 1.1%, which only
# the exact CPU comparison catches (beta2 = 0.98: bias corrections change slowly by then).
RESUME_RTOL = 0.05
# Step 5: max |log p_transformers - log p_trainer| over the scored tokens, both computed in fp32 on
# the same bf16 weights. Measured on CPU (the check's own step-3 model, 114 tokens): 4.8e-7 to
# 9.5e-7 for a correct export. Wrong mappings in a copy of <out>/hf, one tensor pair in layer 0:
# gate/up of one expert swapped 7.7e-3 (the mildest: silu(g)*u ~ silu(u)*g for the small values
# of a barely trained model), experts 0 and 1 swapped 3.7e-2, router rows 0/1 swapped 3.7e-2, two
# q heads swapped 0.12, k's rotary halves interleaved 0.19. (In bf16 compute the correct export
# already differs by 4e-3 on CPU, too close to 7.7e-3 to tell them apart: hence fp32.)
LOGPROB_ATOL = 1e-4
# Transformer Engine computes fp32 GEMMs in TF32 ("default to tf32", common/gemm/cublaslt_gemm.cu),
# about 8x finer than bf16's rounding: a looser bound where the trainer's model runs through TE
# (an estimate from the bf16 figure above; not measured on a TE machine yet).
LOGPROB_ATOL_TF32 = 2e-3
PIP_TIMEOUT_S = 600
VENV_TIMEOUT_S = 120
# What pip prints when it cannot reach the package index (its retry warnings name the cause).
NETWORK_ERRORS = ("Retrying (Retry(", "NewConnectionError", "Failed to establish a new connection",
                  "Temporary failure in name resolution", "Name or service not known", "Network is unreachable",
                  "No route to host", "Connection refused", "ConnectTimeoutError", "ReadTimeoutError",
                  "Max retries exceeded", "ProxyError", "Cannot connect to proxy")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own, stopped as a whole on timeout (or Ctrl-C, which a new
    session does not receive); a timeout raises a TimeoutError naming the command. SIGTERM first:
    torchrun starts its workers in sessions of their own, out of reach of a kill of its group, and
    stops them itself on SIGTERM (SIGTERM, then SIGKILL after its own 30 s); SIGKILL to the group
    when that has not ended it."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException as e:
        for sig, wait_s in ((signal.SIGTERM, 45), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            try:
                p.communicate(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:  # still running, or a process that left the group holds a pipe
                pass
        if isinstance(e, subprocess.TimeoutExpired):
            raise TimeoutError(f"{' '.join(cmd[:4])} ... did not finish in {timeout:g} s") from None
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    return (errors or lines or ["(no output)"])[0]


def _root_cause(stderr: str) -> str:
    """The line of a failed launch's stderr that says why: the trainer's one-line `...: error: ...`,
    else the first exception line of a worker's traceback (not torchrun's ChildFailedError summary,
    whose last lines only point at its docs), else the last line."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    user = [ln for ln in lines if ": error: " in ln]
    exc = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b", ln) and "ChildFailedError" not in ln]
    return (user or exc or lines[-1:] or ["(no output)"])[0][:300]


def index_unreachable(pip_output: str) -> str | None:
    """The line of a failed pip run's output that says the package index could not be reached, else None."""
    return next((ln.strip() for ln in pip_output.splitlines() if any(e in ln for e in NETWORK_ERRORS)), None)


# ----------------------------------------------------------------------------------------------
# Carried wheels: `make gpu-wheels` (download) and the venv that uses them


def fetch_wheels(dest: str, pyvers: list[str]) -> int:
    """Download CARRIED (+ pip) for each CPython version into `dest`, binary wheels only, no
    dependencies resolved (torch, numpy, ... are the target machine's). Prints the size per version."""
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as e:
        print(f"gpu-wheels: cannot create {dest}: {e}")
        return 1
    for v in pyvers:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
               "--only-binary=:all:", "--implementation", "cp", "--python-version", v,
               *[a for p in PLATFORMS for a in ("--platform", p)], "-d", dest, *CARRIED, PIP_WHEEL]
        try:
            r = _run(cmd, PIP_TIMEOUT_S)
        except TimeoutError:
            print(f"gpu-wheels: pip download for Python {v} timed out after {PIP_TIMEOUT_S} s (no package index?)")
            return 1
        if r.returncode != 0:
            net = index_unreachable(r.stderr + r.stdout)
            why = f"package index unreachable: {net}" if net else _first_error(r.stderr + r.stdout)
            print(f"gpu-wheels: Python {v}: {why}")
            return 1
    files = sorted(glob.glob(os.path.join(dest, "*.whl")))
    mib = lambda fs: sum(os.path.getsize(f) for f in fs) / 2**20  # noqa: E731
    for v in pyvers:
        tag = "cp" + v.replace(".", "")
        mine = [f for f in files if _wheel_python_ok(os.path.basename(f), tag)]
        print(f"gpu-wheels: Python {v}: {len(mine)} wheels, {mib(mine):.1f} MiB")
    print(f"gpu-wheels: {dest}: {len(files)} wheels, {mib(files):.1f} MiB in all")
    return 0


def _wheel_python_ok(name: str, tag: str) -> bool:
    """Whether wheel file `name` installs on CPython `tag` (cp311): pure, abi3 or built for it."""
    py = name[:-4].split("-")[-3]
    return py.startswith("py3") or tag in py.split(".") or "abi3" in name


def _site_dirs() -> list[str]:
    """This interpreter's site-packages folders, in its own order (user site first)."""
    import site

    dirs = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    dirs += site.getsitepackages()
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def make_overlay(venv: str, wheels: str | None, found: str | None = None) -> str:
    """A venv at `venv` that sees this interpreter's packages, with the carried wheels installed into
    it; returns its python. Raises with one line saying what is missing."""
    import importlib.util

    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if not wheels or not os.path.isdir(wheels):
        raise RuntimeError(f"megatron-core {MEGATRON_VERSION} is not installed (found: {found or 'none'}) and --wheels "
                           f"{wheels or '(not given)'} is no folder: run `make gpu-wheels` where the package "
                           "index is reachable and bring ./wheels along")
    if not [f for f in os.listdir(wheels) if f.startswith(f"megatron_core-{MEGATRON_VERSION}-")
            and _wheel_python_ok(f, tag)]:
        raise RuntimeError(f"{wheels} has no megatron-core {MEGATRON_VERSION} wheel for Python {pyver}: "
                           f'run `make gpu-wheels PYVERS="{pyver}"` where the package index is reachable')
    shutil.rmtree(venv, ignore_errors=True)
    # --without-pip: needs no ensurepip (Debian's python3 ships without it unless python3-venv is in).
    r = _run([sys.executable, "-m", "venv", "--without-pip", venv], VENV_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"python -m venv {venv}: {_first_error(r.stderr + r.stdout)}")
    py = os.path.join(venv, "bin", "python")
    r = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], VENV_TIMEOUT_S)
    if r.returncode != 0:
        raise RuntimeError(f"{py}: {_first_error(r.stderr)}")
    purelib = r.stdout.strip()
    # site.addsitedir (not a bare path line) also runs the .pth files of those folders, as this
    # interpreter does; they come after the venv's own site-packages, so a carried wheel wins.
    with open(os.path.join(purelib, "_gspo_gpu_check_parent.pth"), "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in _site_dirs())
    if importlib.util.find_spec("pip") is not None:
        pip = [py, "-m", "pip"]
    else:
        whl = sorted(glob.glob(os.path.join(wheels, "pip-*-py3-none-any.whl")))
        if not whl:
            raise RuntimeError(f"this Python has no pip module and {wheels} holds no pip wheel: run `make gpu-wheels`")
        pip = [py, os.path.join(whl[-1], "pip")]
    # --no-deps: torch, numpy, ... are this interpreter's; requirements it already meets are skipped.
    cmd = [*pip, "install", "-q", "--disable-pip-version-check", "--no-input", "--no-index", "--no-deps",
           "--only-binary=:all:", "--no-cache-dir", "--no-warn-script-location", "--find-links", wheels, *CARRIED]
    # Only the carried wheels: none of the host's pip settings (find-links, constraints, ...) apply;
    # PIP_CONFIG_FILE=os.devnull makes pip skip its config files.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    r = _run(cmd, PIP_TIMEOUT_S, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"pip install from {wheels}: {_first_error(r.stderr + r.stdout)}")
    return py


def _te_available() -> bool:
    """Whether the trainer builds Transformer Engine layers (on CUDA): as model/spec.py decides."""
    from gspo_megatron.model.spec import te_available

    return te_available()


def megatron_version() -> str | None:
    import warnings

    try:
        with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed. Falling back ..."
            warnings.simplefilter("ignore")
            import megatron.core  # noqa: F401
    except ImportError:
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "unknown"


# ----------------------------------------------------------------------------------------------
# The check


class Check:
    def __init__(self):
        self.rows: list[tuple[str, bool, float, str]] = []

    def run(self, name: str, fn) -> bool:
        t0 = time.monotonic()
        try:
            detail = fn() or ""
            ok = True
        except Exception as e:  # a failed step is a FAIL row, the check goes on where it can
            detail, ok = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:300], False
        return self.add(name, ok, time.monotonic() - t0, detail)

    def add(self, name: str, ok: bool, dt: float, detail: str) -> bool:
        self.rows.append((name, ok, dt, detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {name} ({dt:.1f} s) {detail}", flush=True)
        return ok

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'step':<{w}}  result  seconds  detail", "-" * (w + 40)]
        lines += [f"{n:<{w}}  {'PASS' if ok else 'FAIL':<6}  {dt:7.1f}  {d}" for n, ok, dt, d in self.rows]
        n_ok = sum(r[1] for r in self.rows)
        lines.append(f"{n_ok} passed, {len(self.rows) - n_ok} failed")
        return "\n".join(lines)


def _nccl_versions(device: str) -> str:
    """CUDA: the libnccl loaded at run time (what NCCL's init compares between trainer and
    servers), by the probe train_with_sglang.sbatch runs (launch/slurm/nccl_version.py), beside
    torch.cuda.nccl.version(), the header torch was built with (issue 52: the sbatch compared the
    header). A CUDA torch with no NCCL loaded fails the row. CPU: nothing to read."""
    if device != "cuda":
        return ""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("nccl_version", os.path.join(REPO, "launch", "slurm", "nccl_version.py"))
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    runtime, path = probe.runtime_version(probe.mapped_libraries())
    header = torch.cuda.nccl.version()
    header = ".".join(map(str, header)) if isinstance(header, tuple) else probe.version_string(int(header))
    return f", NCCL {runtime} loaded ({os.path.basename(path)}; torch built with {header})"


def _writer_device(device: str) -> str:
    """CUDA with two GPUs or more: the background writer thread of a rank on cuda:1 runs on cuda:1
    (issue 52: a new thread starts on device 0, and DCP's writer synchronises that thread's
    current stream, so every rank's writer made a context on GPU 0; train/async_save.py
    bind_device). One GPU cannot show it: said so. CPU: nothing."""
    if device != "cuda":
        return ""
    import torch

    if torch.cuda.device_count() < 2:
        return "; writer thread's device: not checkable with one GPU"
    from gspo_megatron.train.async_save import BackgroundSaves

    seen: list[int] = []
    saves = BackgroundSaves(ops=None, device=torch.device("cuda", 1))
    saves.submit("device-probe", lambda: seen.append(torch.cuda.current_device()))
    saves.wait()
    if seen != [1]:
        raise RuntimeError(f"the background writer of a rank on cuda:1 ran on cuda:{seen}")
    return "; background writer of a rank on cuda:1 runs on cuda:1"


SNAPSHOT_LINE = re.compile(r"checkpoint snapshot: (\d+) chunks, (\d+) bytes in one host allocation, (\d+) page-locked, "
                           r"(\d+) in torch's pinned allocator")


def _snapshot_memory(log_text: str, device: str) -> str:
    """The background save's host memory, from the trainer's line (train/checkpoint.py
    _log_snapshot_memory), checked: on CUDA the page-locked bytes are the snapshot's (<= 1.05x; one
    allocation registered once, not one power-of-two pinned block per chunk, issue 52) and torch's
    pinned allocator holds less than the snapshot (the old path put it all there, rounded up); on
    CPU nothing is page-locked."""
    found = SNAPSHOT_LINE.findall(log_text)
    if not found:
        raise RuntimeError("the background save logged no 'checkpoint snapshot:' line")
    chunks, nbytes, pinned, torch_pinned = (int(x) for x in found[0])
    if device == "cuda":
        if not 0 < pinned <= 1.05 * nbytes:
            raise RuntimeError(f"snapshot of {nbytes} bytes: {pinned} page-locked (expected <= 1.05x)")
        if torch_pinned >= nbytes:
            raise RuntimeError(f"torch's pinned allocator holds {torch_pinned} bytes >= the snapshot's {nbytes}")
    elif pinned != 0:
        raise RuntimeError(f"CPU run: {pinned} bytes page-locked")
    return f"snapshot {nbytes / 2**20:.1f} MiB in {chunks} chunks, {pinned / 2**20:.1f} MiB page-locked"


def _masters(ckpt: str) -> dict:
    """The fp32 master weights (optimizer.state.param.*) of a torch_dist checkpoint, global tensors."""
    from gspo_megatron.checkpoint.dcp_io import DcpReader

    r = DcpReader(ckpt)
    try:
        keys = sorted(k for k in r.keys() if k.startswith("optimizer.state.param."))
        return {k: r.read(k, [0] * len(r.shape(k)), list(r.shape(k))).float() for k in keys}
    finally:
        r.close()


def _adam_steps(ckpt: str) -> set:
    """Every Adam step count in a trainer checkpoint's common.pt (the optimizer's param groups)."""
    import torch

    from gspo_megatron.checkpoint.safe_torch import load_torch_file

    common = load_torch_file(os.path.join(ckpt, "common.pt"))  # the project's restricted reader, never torch.load
    found = set()

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "step" and isinstance(v, (int, float)) or (k == "step" and torch.is_tensor(v)):
                    found.add(float(v))
                else:
                    walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(common.get("optimizer"))
    return found


def _step_row(run_dir: str, step: int) -> tuple:
    """What a GSPO step trained on, as far as metrics.jsonl shows it (batch identity on GPU)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    (row,) = [r for r in rows if r.get("phase") == "gspo" and r.get("step") == step]
    return row.get("reward_mean"), row.get("response_len_mean"), row.get("train_tokens")


def _norm(ts) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in ts))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM (a timeout of whoever runs the check) becomes an exception, so _run kills the launch
    # in flight: the launches run in sessions of their own and would outlive this process.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--config", default=CONFIG,
                    help="the tiny config to run (default tiny_cpu.yaml; launch/configs/tiny_cpu_glm.yaml: the "
                         "GLM-4.5 family's path on the GPU - TE's per-layer dense/MoE spec, sigmoid routing with "
                         "the expert bias, shared experts; its mcore-to-hf row converts the per-layer-keyed checkpoint "
                         "back; launch/configs/tiny_cpu_deepseek_v3.yaml: multi-latent attention in TE's MLA spec "
                         "with TELinear down projections and TE's fused latent norms, YaRN, grouped routing)")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs); DP = nproc at TP1")
    ap.add_argument("--wheels", default=None, help="folder of carried wheels (`make gpu-wheels`); used when "
                                                   f"megatron-core {MEGATRON_VERSION} is missing")
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one, removed on success)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    ap.add_argument("--fetch-wheels", metavar="DIR", default=None,
                    help="only download the carried wheels into DIR (needs the package index), then exit")
    ap.add_argument("--python-versions", default=" ".join(DEFAULT_PYVERS),
                    help="with --fetch-wheels: CPython versions to fetch for, e.g. '3.11 3.12'")
    ap.add_argument("--lora", action="store_true",
                    help="also row 9: a LoRA run on the device from launch B's export (docs/lora.md)")
    ap.add_argument("--remove-out", action="store_true", help=argparse.SUPPRESS)  # the re-run's temporary --out
    args = ap.parse_args(argv)
    if args.fetch_wheels:
        vers = args.python_versions.replace(",", " ").split()
        bad = [v for v in vers if not (v.count(".") == 1 and all(p.isdigit() for p in v.split(".")))]
        if bad or not vers:
            ap.error(f"--python-versions: expected versions like '3.11 3.12', got {args.python_versions!r}")
        return fetch_wheels(args.fetch_wheels, vers)
    if args.nproc < 1 or args.timeout < 1:
        ap.error("--nproc and --timeout must be >= 1")

    remove_out = args.remove_out or not args.out
    try:
        out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="gspo-gpu-check-"))
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        ap.error(f"--out: {e}")
    run_dir = os.path.join(out, "run")  # launches A and B
    ref_dir = os.path.join(out, "uninterrupted")  # launch C
    overrides = [
        f"parallel.device={args.device}", "parallel.tp=1", "parallel.sequence_parallel=false",
        "model.dtype=bfloat16", "optimizer.use_distributed_optimizer=true", "train.sft_warmup_steps=4",
        "train.recompute=selective",  # as the 30B-A3B preset (GPU: + moe_act with TE's grouped experts)
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "checkpoint.interval=0",
        "checkpoint.keep_last=0", "checkpoint.resume=auto", "logging.progress_bar=false", "logging.plot=false",
        # launch A stops at max_steps=2 and B resumes to 3: a decaying LR (the demo config's cosine)
        # is a function of max_steps, so A's steps 1-2 would not be C's, and resume could not be exact
        "optimizer.lr_decay_style=constant",
    ]
    chk = Check()
    logs: dict[str, str] = {}

    def environment():
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        mc = megatron_version()
        how = ""
        if os.environ.get(OVERLAY_ENV):
            how = f" (from {args.wheels} into {os.environ[OVERLAY_ENV]})"
        if mc != MEGATRON_VERSION:
            if os.environ.get(OVERLAY_ENV):
                raise RuntimeError(f"megatron-core {mc} in {os.environ[OVERLAY_ENV]} after installing the wheels")
            py = make_overlay(os.path.join(out, "venv"), args.wheels, mc)
            print(f"[....] 1 environment: megatron-core {mc or 'missing'} here; installed {MEGATRON_VERSION} "
                  f"from {args.wheels} into {out}/venv, re-running there", flush=True)
            sys.stderr.flush()
            child = [py, os.path.abspath(__file__), *argv, "--out", out, "--wheels", os.path.abspath(args.wheels)]
            os.execve(py, child + (["--remove-out"] if remove_out else []),
                      dict(os.environ, **{OVERLAY_ENV: os.path.join(out, "venv")}))
        te = "TE spec" if args.device == "cuda" and _te_available() else "no TE: portable spec"
        import transformers

        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        backend = "nccl" if args.device == "cuda" else "gloo"
        return (f"torch {torch.__version__}, transformers {transformers.__version__}, megatron-core {mc}{how}, "
                f"{te}, {gpu}, world group on {backend}{_nccl_versions(args.device)}")

    def launch(tag: str, out_dir: str, steps: int, export: bool, extra: tuple[str, ...] = ()):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "--standalone", "-m", "gspo_megatron.train", "--config", os.path.abspath(args.config),
               f"out_dir={out_dir}",
               *overrides, f"train.max_steps={steps}", f"checkpoint.export_hf={'true' if export else 'false'}",
               *extra]
        r = _run(cmd, args.timeout, env=_env(), cwd=REPO)
        logs[tag] = r.stderr
        with open(os.path.join(out, f"{tag}.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"exit {r.returncode}: {_root_cause(r.stderr)} (log: {os.path.join(out, tag + '.log')})")

    def ckpt(d: str, step: int) -> str:
        return os.path.join(d, "checkpoints", f"iter_{step:07d}")

    def train():
        shutil.rmtree(run_dir, ignore_errors=True)
        # A and B write their checkpoints in the background (checkpoint.async_save: the snapshot
        # into pinned host memory is the CUDA branch of train/checkpoint.py _snapshot), C
        # synchronously: B's resumed step 3 must still equal C's
        launch("train", run_dir, 2, export=False, extra=ASYNC_SAVE)
        if not os.path.isdir(ckpt(run_dir, 2)):
            raise RuntimeError("no step-2 checkpoint")
        return "launch A: SFT warm start + GSPO steps 1-2, checkpoint step 2; " + _snapshot_memory(logs["train"], args.device)

    resumed = []

    def resume():
        import torch

        launch("resume", run_dir, 3, export=True, extra=ASYNC_SAVE)
        if "resumed from" not in logs["resume"]:
            raise RuntimeError("the second launch did not resume")
        resumed.append(True)
        shutil.rmtree(ref_dir, ignore_errors=True)
        launch("uninterrupted", ref_dir, 3, export=False)
        b3, c3 = _masters(ckpt(run_dir, 3)), _masters(ckpt(ref_dir, 3))
        if not b3 or set(b3) != set(c3):
            raise RuntimeError(f"master keys differ: {sorted(set(b3) ^ set(c3))[:3]} ({len(b3)} vs {len(c3)})")
        a2 = _masters(ckpt(run_dir, 2))
        diff, step = _norm(b3[k] - c3[k] for k in b3), _norm(c3[k] - a2[k] for k in b3)
        # Adam's step count after the resumed update equals the uninterrupted run's (a load that
        # shares one step tensor between parameters multiplies it: wrong bias correction)
        sb, sc = _adam_steps(ckpt(run_dir, 3)), _adam_steps(ckpt(ref_dir, 3))
        if sb != sc or not sb:
            raise RuntimeError(f"Adam step counts after the resumed step 3 {sorted(sb)} != uninterrupted {sorted(sc)}")
        if args.device == "cpu":
            bad = [k for k in b3 if not torch.equal(b3[k], c3[k])]
            if bad:
                raise RuntimeError(f"resumed step-3 masters differ from the uninterrupted run's at {len(bad)} of "
                                   f"{len(b3)} tensors, e.g. {bad[0]} (||B3 - C3|| = {diff / step:.2%} of one "
                                   "step's update); CPU must be exact")
            return (f"launch B resumed at step 2, ran step 3, exported; == launch C (1-3 at once): "
                    f"{len(b3)} masters bit-identical, Adam steps {sorted(sb)}")
        if diff <= RESUME_RTOL * step:
            return (f"launch B resumed at step 2, ran step 3, exported; vs launch C (1-3 at once): "
                    f"||B3 - C3|| = {diff / step:.2%} of one step's update (<= {RESUME_RTOL:.0%}), Adam steps {sorted(sb)}")
        # GPU kernels (atomics in MoE token scatter) may make the step-2 weights differ in the last
        # bits, and a sampled token then flips: a different step-3 batch is not a resume bug. Only
        # when both runs trained on the same batch must the updates agree.
        if _step_row(run_dir, 3) != _step_row(ref_dir, 3):
            return (f"launch B resumed at step 2, ran step 3, exported; step-3 batches differ from launch C's "
                    f"(GPU nondeterminism): masters not comparable, Adam steps equal {sorted(sb)}")
        raise RuntimeError(f"||B3 - C3|| = {diff / step:.2%} of one step's update ||C3 - A2|| > {RESUME_RTOL:.0%} on "
                           "the same step-3 batch: the resumed step 3 is not the uninterrupted one")

    def metrics():
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(ln) for ln in f if ln.strip()]
        sft = [r["nll"] for r in rows if r.get("phase") == "sft"]
        if len(sft) < 2 or not all(math.isfinite(x) for x in sft):
            raise RuntimeError(f"SFT token NLL rows {sft}: expected >= 2 finite values")
        # 4 warm-start steps at sft_lr drop it by ~20% (measured on CPU); 5% leaves room for numerics.
        if not sft[-1] < 0.95 * sft[0]:
            raise RuntimeError(f"SFT token NLL {sft[0]:.4g} -> {sft[-1]:.4g}: does not fall")
        gspo = [r for r in rows if r.get("phase") == "gspo"]
        steps = [r["step"] for r in gspo]
        if steps != [1, 2, 3]:
            raise RuntimeError(f"logged GSPO steps {steps}, expected [1, 2, 3]")
        for r in gspo:
            if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and 0 <= r["reward_mean"] <= 1):
                raise RuntimeError(f"bad metrics at step {r['step']}: {r}")
        return (f"SFT NLL {sft[0]:.3f} -> {sft[-1]:.3f}; GSPO loss {gspo[-1]['loss']:.4g}, "
                f"grad norm {gspo[-1]['grad_norm']:.3g}")

    def hf_tensors(d):
        from safetensors.torch import load_file

        t = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            t.update(load_file(f))
        return t

    def converted_equals(argv: list, conv: str, reference: str, what: str) -> int:
        """`gspo-convert argv --out conv` from scratch; its tensors must equal `reference`'s bit for bit."""
        import torch

        from converters.cli import main as convert

        shutil.rmtree(conv, ignore_errors=True)
        if convert([*argv, "--out", conv, "--no-progress"]) != 0:
            raise RuntimeError(f"gspo-convert {argv[0]} failed")
        a, b = hf_tensors(reference), hf_tensors(conv)
        bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
        if bad or set(a) != set(b):
            raise RuntimeError(f"{what} at {bad[:3]}")
        return len(a)

    def export():
        import torch
        from transformers import AutoModelForCausalLM

        hf = os.path.join(run_dir, "hf")
        dtypes = {t.dtype for t in hf_tensors(hf).values()}
        if dtypes != {torch.bfloat16}:
            raise RuntimeError(f"exported dtypes {dtypes}")
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).to(args.device).eval()
        n_params = sum(p.numel() for p in model.parameters())
        # A few sequences over the whole vocabulary: the trainer's forward (Megatron, the step-3
        # checkpoint's bf16 weights) scores them through gspo_megatron.score; transformers scores
        # them with <out>/hf. Both in fp32, so the difference is the two implementations' rounding
        # alone, far below what a wrong weight mapping gives.
        vocab = model.config.vocab_size
        rng = random.Random(0)
        seqs = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 16, 33, 64)]
        inp, outp = os.path.join(out, "score_in.jsonl"), os.path.join(out, "score_out.jsonl")
        with open(inp, "w") as f:
            f.writelines(json.dumps({"input_ids": s}) + "\n" for s in seqs)
        r = _run([sys.executable, "-m", "gspo_megatron.score", "--load", ckpt(run_dir, 3), "--input", inp,
                  "--output", outp, "--dtype", "float32", "--device", args.device], args.timeout, env=_env(), cwd=REPO)
        with open(os.path.join(out, "score.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise RuntimeError(f"gspo_megatron.score exit {r.returncode}: {_first_error(r.stderr)}")
        with open(outp) as f:
            trainer = [json.loads(ln)["token_logprobs"] for ln in f]
        err = 0.0
        with torch.no_grad():
            for s, lp in zip(seqs, trainer, strict=True):
                ids = torch.tensor([s], device=args.device)
                ref = torch.log_softmax(model(ids).logits[0].float(), -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
                if len(lp) != len(s) - 1:
                    raise RuntimeError(f"gspo_megatron.score gave {len(lp)} log-probs for {len(s)} tokens")
                err = max(err, (torch.tensor(lp) - ref.cpu()).abs().max().item())
        atol = LOGPROB_ATOL_TF32 if args.device == "cuda" and _te_available() else LOGPROB_ATOL
        if not err <= atol:
            raise RuntimeError(f"log-probs of <out>/hf (transformers) and of the trainer's model differ by up to "
                               f"{err:.3g} > {atol:g}: the export does not hold the trained model")
        return (f"{type(model).__name__}, {n_params:,} params, bf16; log-probs == trainer's "
                f"(max |diff| {err:.1e} over {sum(len(s) - 1 for s in seqs)} tokens)")

    def mcore_to_hf():
        n = converted_equals(["mcore-to-hf", "--load", ckpt(run_dir, 3)], os.path.join(out, "converted"),
                             os.path.join(run_dir, "hf"), "differs")
        return f"{n} tensors bit-identical"

    def checkpoint():
        from gspo_megatron.checkpoint.dcp_io import DcpReader

        r = DcpReader(ckpt(run_dir, 3))
        try:
            keys = r.keys()
            dtypes = {r.dtype(k) for k in keys if k.startswith("optimizer.state.")}
        finally:
            r.close()
        kinds = {k.split("optimizer.state.")[1].split(".")[0] for k in keys if "optimizer.state." in k}
        # the router's expert bias (GLM) is a buffer of the model: weights without optimizer state
        model_keys = {k for k in keys if "optimizer." not in k and not k.endswith(".expert_bias")}
        need = {"param", "exp_avg", "exp_avg_sq"}
        if not need <= kinds:
            raise RuntimeError(f"optimizer state kinds {sorted(kinds)}, expected {sorted(need)}")
        per_kind = {k: sum(1 for x in keys if f"optimizer.state.{k}." in x) for k in need}
        if set(per_kind.values()) != {len(model_keys)}:
            raise RuntimeError(f"{per_kind} optimizer tensors for {len(model_keys)} model tensors")
        if {str(d) for d in dtypes} != {"torch.float32"}:
            raise RuntimeError(f"optimizer state dtypes {sorted(map(str, dtypes))}, expected fp32")
        return f"{len(model_keys)} model tensors, each with fp32 master + exp_avg + exp_avg_sq{_writer_device(args.device)}"

    def vllm_nccl():
        import torch

        from gspo_megatron.rollout.vllm_nccl import NcclWeightSync, TorchNccl

        cuda = args.device == "cuda"
        backend, dev = (TorchNccl(), torch.device("cuda", 0)) if cuda else (_CpuLoopback(), torch.device("cpu"))
        sync = NcclWeightSync([], device=dev, timeout_s=120, bucket_bytes=1 << 20, backend=backend)
        g = torch.Generator().manual_seed(0)
        named = [(f"w{i}", torch.randn(300, 500, generator=g)) for i in range(4)]  # 293 KiB each in bf16
        sent = sync.push(named, 1, dtype=torch.bfloat16)
        if sent != len(named) or sync.world_size != 1 or sync.comm is None:
            raise RuntimeError(f"sent {sent} of {len(named)} tensors, group of {sync.world_size}")
        # what a failed push does: ncclCommAbort on the communicator torch holds, through the
        # libnccl torch loaded (vllm_nccl.abort_communicator; its lookups are tested on CPU)
        said = sync.comm.abort()
        if said != "the NCCL communicator was aborted":
            raise RuntimeError(f"abort after the push: {said}")
        how = "torch.cuda.nccl: unique id, init_rank, warm-up all_reduce" if cuda else "CPU stand-in communicator"
        return f"group of 1 rank ({how}), {sent} bf16 tensors broadcast in 2 buckets, then aborted"

    def lora():
        from gspo_megatron.checkpoint.dcp_io import DcpReader

        lora_dir = os.path.join(out, "lora")
        shutil.rmtree(lora_dir, ignore_errors=True)
        launch("lora", lora_dir, 2, export=True, extra=(
            *ASYNC_SAVE, f"model.hf_dir={os.path.join(run_dir, 'hf')}", "model.hf_config=null",
            "train.sft_warmup_steps=0", "lora.rank=8", "lora.alpha=16", "optimizer.lr=1e-3"))
        with open(os.path.join(lora_dir, "metrics.jsonl")) as f:
            gspo = [r for r in map(json.loads, f) if r.get("phase") == "gspo"]
        if [r["step"] for r in gspo] != [1, 2] or not all(math.isfinite(r["loss"]) for r in gspo) \
                or not any(r["grad_norm"] > 0 for r in gspo):
            raise RuntimeError(f"LoRA GSPO rows {gspo}")
        r = DcpReader(ckpt(lora_dir, 2))
        try:
            keys = r.keys()
            dtypes = {str(r.dtype(k)) for k in keys if k.startswith("optimizer.state.")}
        finally:
            r.close()
        model_keys = [k for k in keys if "optimizer." not in k]
        if not model_keys or any(".lora_" not in k for k in model_keys if not k.endswith(".expert_bias")):
            raise RuntimeError(f"not adapter-only: {[k for k in model_keys if '.lora_' not in k][:3]}")
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            if sum(1 for k in keys if k.startswith(f"optimizer.state.{kind}.")) != len(model_keys):
                raise RuntimeError(f"optimizer.state.{kind} does not cover the {len(model_keys)} adapters")
        if dtypes != {"torch.float32"}:
            raise RuntimeError(f"adapter optimizer state dtypes {sorted(dtypes)}")
        n = converted_equals(["lora-merge", "--load", ckpt(lora_dir, 2)], os.path.join(out, "lora-merged"),
                             os.path.join(lora_dir, "hf"), "lora-merge differs from the run's export")
        return (f"2 GSPO steps, grad norm {gspo[-1]['grad_norm']:.3g}; {len(model_keys)} adapter tensors with fp32 "
                f"masters + moments, no base; lora-merge == the run's export ({n} tensors)")

    def skip(row: str, after: str):
        chk.add(row, False, 0.0, f"not run: {after} failed")

    steps = dict(zip(ROWS, (environment, train, resume, metrics, export, mcore_to_hf, checkpoint, vllm_nccl)))
    runs = ROWS[:7]  # the launches' rows; row 8 needs only the environment
    ok_env = chk.run(ROWS[0], environment)
    if ok_env and chk.run(ROWS[1], train):
        chk.run(ROWS[2], resume)
        if resumed:  # rows 4-7 need launch B's output, not launch C's agreement
            for row in runs[3:]:
                chk.run(row, steps[row])
        else:
            for row in runs[3:]:
                skip(row, ROWS[2])
    else:
        failed = chk.rows[-1][0]
        for row in runs[len(chk.rows):]:
            skip(row, failed)
    if ok_env:
        chk.run(ROWS[7], vllm_nccl)
    else:
        skip(ROWS[7], ROWS[0])
    if args.lora:  # needs launch B's export as its base
        if resumed and os.path.isdir(os.path.join(run_dir, "hf")):
            chk.run(LORA_ROW, lora)
        else:
            skip(LORA_ROW, ROWS[2])
    print()
    print(f"gspo-megatron check, device={args.device}, {args.nproc} process(es); logs in {out}")
    print(chk.table())
    ok = all(r[1] for r in chk.rows) and len(chk.rows) == len(ROWS) + bool(args.lora)
    if ok and remove_out:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
