"""One-command check of the path a cluster runs, on one GPU (or its CPU half, in the test suite).

    python bench/gpu_check.py                      # one GPU: NCCL, bf16, distributed optimizer
    python bench/gpu_check.py --device cpu --nproc 2   # the same steps on CPU/gloo (CI runs this)
    make gpu-check                                 # = the first line

What runs — the default configuration of the GPU presets on the tiny Qwen3-MoE of
launch/configs/tiny_cpu.yaml (so it fits in minutes): model.dtype=bfloat16 (fp32 master weights in
the optimizer), optimizer.use_distributed_optimizer=true, train.recompute=selective, the world
process group on NCCL (parallel.device=cuda; gloo on CPU), Transformer Engine's layer spec when TE
imports (then TE's FusedAdam, whose checkpoint path keeps `step` in the param groups):

  1 environment    torch / megatron-core 0.16.1 / TE / CUDA as found (megatron-core is installed
                   from --wheels DIR, no network, when it is missing: `make gpu-wheels` fills
                   ./wheels with the few pure-Python wheels this needs, ~3 MiB)
  2 train          SFT warm start, then 2 GSPO steps, checkpoint at step 2 (torch_dist)
  3 resume         a second launch resumes from the checkpoint (checkpoint.resume=auto) and runs
                   GSPO step 3; checkpoint, HF export
  4 metrics        steps 1..3 logged once each, finite loss / grad norm, rewards in [0, 1]
  5 export         <out>/hf loads in transformers' Qwen3MoeForCausalLM, bf16 weights
  6 mcore-to-hf    gspo-convert mcore-to-hf of the step-3 checkpoint == <out>/hf, bit for bit
  7 checkpoint     the step-3 checkpoint holds fp32 masters and Adam moments for every parameter

It prints a PASS/FAIL table and exits non-zero on any failure. Every launch has a timeout; the whole
check is sized for < 8 minutes on one GPU (about 1.5 minutes on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
MEGATRON = "megatron-core==0.16.1"


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def ensure_megatron(wheels: str | None) -> str:
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        if not wheels:
            raise RuntimeError(f"megatron-core is not installed: pass --wheels DIR with the {MEGATRON} wheel "
                               "(`make gpu-wheels` downloads it into ./wheels)") from None
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheels,
                        MEGATRON, "pyyaml", "tqdm"], check=True, timeout=300)
    from importlib.metadata import version

    return version("megatron-core")


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
        self.rows.append((name, ok, time.monotonic() - t0, detail))
        print(f"[{'PASS' if ok else 'FAIL'}] {name} ({time.monotonic() - t0:.1f} s) {detail}", flush=True)
        return ok

    def table(self) -> str:
        w = max(len(r[0]) for r in self.rows)
        lines = [f"{'step':<{w}}  result  seconds  detail", "-" * (w + 40)]
        lines += [f"{n:<{w}}  {'PASS' if ok else 'FAIL':<6}  {dt:7.1f}  {d}" for n, ok, dt, d in self.rows]
        n_ok = sum(r[1] for r in self.rows)
        lines.append(f"{n_ok} passed, {len(self.rows) - n_ok} failed")
        return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--nproc", type=int, default=1, help="processes (GPUs); DP = nproc at TP1")
    ap.add_argument("--wheels", default=None, help="folder with the megatron-core wheel (no network)")
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one, removed)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per launch")
    args = ap.parse_args(argv)

    out = args.out or tempfile.mkdtemp(prefix="gspo-gpu-check-")
    os.makedirs(out, exist_ok=True)
    run_dir = os.path.join(out, "run")
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [
        f"out_dir={run_dir}", f"parallel.device={args.device}", "parallel.tp=1", "parallel.sequence_parallel=false",
        "model.dtype=bfloat16", "optimizer.use_distributed_optimizer=true", "train.sft_warmup_steps=4",
        "train.recompute=selective",  # as the 30B-A3B preset (GPU: + moe_act with TE's grouped experts)
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "checkpoint.interval=0",
        "checkpoint.keep_last=0", "checkpoint.resume=auto", "logging.progress_bar=false", "logging.plot=false",
    ]
    chk = Check()
    logs: dict[str, str] = {}

    def environment():
        import torch

        mc = ensure_megatron(args.wheels)
        if mc != "0.16.1":
            raise RuntimeError(f"megatron-core {mc}; this project pins 0.16.1")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        try:
            import transformer_engine  # noqa: F401

            te = "TE spec"
        except ImportError:
            te = "no TE: portable spec"
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        backend = "nccl" if args.device == "cuda" else "gloo"
        return f"torch {torch.__version__}, megatron-core {mc}, {te}, {gpu}, world group on {backend}"

    def launch(tag: str, steps: int):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
               "--standalone", "-m", "gspo_megatron.train", "--config", CONFIG,
               *overrides, f"train.max_steps={steps}", f"checkpoint.export_hf={'true' if steps == 3 else 'false'}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_env(), cwd=REPO)
        logs[tag] = r.stderr
        with open(os.path.join(out, f"{tag}.log"), "w") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            err = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
            raise RuntimeError(f"exit {r.returncode}: {(err or r.stderr.splitlines() or [''])[-1]} "
                               f"(log: {os.path.join(out, tag + '.log')})")

    def train():
        launch("train", 2)
        if not os.path.isdir(os.path.join(run_dir, "checkpoints", "iter_0000002")):
            raise RuntimeError("no step-2 checkpoint")
        return "SFT warm start + GSPO steps 1-2, checkpoint step 2"

    def resume():
        launch("resume", 3)
        if "resumed from" not in logs["resume"]:
            raise RuntimeError("the second launch did not resume")
        return "resumed at step 2, ran step 3, exported"

    def metrics():
        import math

        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(ln) for ln in f if '"gspo"' in ln]
        steps = [r["step"] for r in rows]
        if steps != [1, 2, 3]:
            raise RuntimeError(f"logged GSPO steps {steps}, expected [1, 2, 3]")
        for r in rows:
            if not (math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and 0 <= r["reward_mean"] <= 1):
                raise RuntimeError(f"bad metrics at step {r['step']}: {r}")
        return f"loss {rows[-1]['loss']:.4g}, grad norm {rows[-1]['grad_norm']:.3g}"

    def hf_tensors(d):
        from safetensors.torch import load_file

        t = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            t.update(load_file(f))
        return t

    def export():
        import torch
        from transformers import AutoModelForCausalLM

        hf = os.path.join(run_dir, "hf")
        model = AutoModelForCausalLM.from_pretrained(hf)
        dtypes = {t.dtype for t in hf_tensors(hf).values()}
        if dtypes != {torch.bfloat16}:
            raise RuntimeError(f"exported dtypes {dtypes}")
        return f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} params, bf16"

    def mcore_to_hf():
        import torch

        from converters.cli import main as convert

        conv = os.path.join(out, "converted")
        shutil.rmtree(conv, ignore_errors=True)
        if convert(["mcore-to-hf", "--load", os.path.join(run_dir, "checkpoints", "iter_0000003"), "--out", conv,
                    "--no-progress"]) != 0:
            raise RuntimeError("gspo-convert failed")
        a, b = hf_tensors(os.path.join(run_dir, "hf")), hf_tensors(conv)
        bad = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
        if bad or set(a) != set(b):
            raise RuntimeError(f"differs at {bad[:3]}")
        return f"{len(a)} tensors bit-identical"

    def checkpoint():
        from converters.dcp_io import DcpReader

        r = DcpReader(os.path.join(run_dir, "checkpoints", "iter_0000003"))
        try:
            keys = r.keys()
        finally:
            r.close()
        kinds = {k.split("optimizer.state.")[1].split(".")[0] for k in keys if "optimizer.state." in k}
        model_keys = {k for k in keys if "optimizer." not in k}
        need = {"param", "exp_avg", "exp_avg_sq"}
        if not need <= kinds:
            raise RuntimeError(f"optimizer state kinds {sorted(kinds)}, expected {sorted(need)}")
        per_kind = {k: sum(1 for x in keys if f"optimizer.state.{k}." in x) for k in need}
        if set(per_kind.values()) != {len(model_keys)}:
            raise RuntimeError(f"{per_kind} optimizer tensors for {len(model_keys)} model tensors")
        return f"{len(model_keys)} model tensors, each with fp32 master + exp_avg + exp_avg_sq"

    chk.run("1 environment", environment)
    if chk.run("2 train", train) and chk.run("3 resume", resume):
        chk.run("4 metrics", metrics)
        chk.run("5 export", export)
        chk.run("6 mcore-to-hf", mcore_to_hf)
        chk.run("7 checkpoint", checkpoint)
    print()
    print(f"gspo-megatron check, device={args.device}, {args.nproc} process(es); logs in {out}")
    print(chk.table())
    ok = all(r[1] for r in chk.rows) and len(chk.rows) == 7
    if ok and not args.out:
        shutil.rmtree(out, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
