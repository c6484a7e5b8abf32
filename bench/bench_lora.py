"""LoRA against full-parameter GSPO on the demo task, side by side in one run (issue 55: "it
learns and it is cheaper").

1. The base: the demo's supervised warm start only (launch/configs/tiny_cpu.yaml, full-parameter,
   train.max_steps=0), exported as an HF checkpoint - a model that knows the task's format, as a
   LoRA RL run starts from an instruction-tuned model.
2. GSPO from that base, 100 steps, held-out pass@1 every 25 steps (64 prompts x 4 samples):
   full-parameter (the demo's lr) and LoRA (rank 16, alpha 32, on attention and every routed
   expert; lr 2e-3: the adapters start at B = 0, so the LoRA run's step 0 *is* the frozen base,
   and a frozen model stays at that value).

Printed: pass@1 per eval step, the rise over the frozen base, step time, trainable parameters,
the last checkpoint's size, and the peak resident memory of each run (the largest process's
high-water mark, getrusage of the launcher's children). Runs on 2 CPU processes (TP2+SP), about 5
minutes here. `--steps`, `--rank`, `--lr` change the LoRA run; `--json` writes the numbers.
`--smoke`: the same three runs at toy size (a 4-step warm start, 2 GSPO steps, evals of 8 prompts
x 2 samples), for tests/test_bench_smoke.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import format_table  # noqa: E402

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
EVAL = ["eval.interval=25", "eval.num_prompts=64", "eval.samples_per_prompt=4", "logging.progress_bar=false",
        "logging.plot=false"]


def _run(out: str, *overrides: str) -> int:
    """One torchrun.sh run on 2 processes in a process of its own; the peak RSS (bytes) of the
    largest process it waited for."""
    code = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024); sys.exit(r.returncode)")
    env = dict(os.environ, OMP_NUM_THREADS="1", NPROC="2", PYTHON=sys.executable)
    cmd = [sys.executable, "-c", code, os.path.join(REPO, "launch", "torchrun.sh"), TINY, f"out_dir={out}", *overrides]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        sys.exit(f"bench_lora: the run in {out} failed:\n{r.stderr[-3000:]}")
    return int(r.stdout.strip().splitlines()[-1])


def _rows(out: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x) for x in f]


def _trainable(out: str) -> int:
    """Parameters in the last checkpoint's optimizer state (Adam's first moment: what trains)."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from gspo_megatron.checkpoint.dcp_io import DcpReader

    ck = os.path.join(out, "checkpoints")
    last = sorted(d for d in os.listdir(ck) if d.startswith("iter_"))[-1]
    r = DcpReader(os.path.join(ck, last))
    try:
        n = 0
        for k in r.keys():
            if k.startswith("optimizer.state.exp_avg."):
                size = 1
                for s in r.shape(k):
                    size *= s
                n += size
        return n
    finally:
        r.close()


def _ckpt_bytes(out: str) -> int:
    ck = os.path.join(out, "checkpoints")
    last = sorted(d for d in os.listdir(ck) if d.startswith("iter_"))[-1]
    return sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(ck, last)) for f in fs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--json", default=None)
    p.add_argument("--keep", default=None, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--smoke", action="store_true", help="toy sizes: the plumbing, not the numbers")
    a = p.parse_args(argv)
    evals, warm = EVAL, []
    if a.smoke:
        a.steps = 2
        evals = ["eval.interval=1", "eval.num_prompts=8", "eval.samples_per_prompt=2", *EVAL[3:]]
        warm = ["train.sft_warmup_steps=4"]
    root = a.keep or tempfile.mkdtemp(prefix="bench-lora-")
    try:
        base = os.path.join(root, "base")
        _run(base, "train.max_steps=0", "checkpoint.export_hf=true", *warm, *EVAL[3:])
        common = [f"model.hf_dir={base}/hf", "model.hf_config=null", "train.sft_warmup_steps=0",
                  f"train.max_steps={a.steps}", "checkpoint.interval=0", *evals]
        runs = {"full": (os.path.join(root, "full"), []),
                "lora": (os.path.join(root, "lora"), [f"lora.rank={a.rank}", f"lora.alpha={a.alpha}",
                                                      f"optimizer.lr={a.lr}"])}
        res = {}
        for name, (out, extra) in runs.items():
            peak = _run(out, *common, *extra)
            rows = _rows(out)
            pass1 = {r["step"]: r["eval/heldout/pass@1"] for r in rows if "eval/heldout/pass@1" in r}
            steps = [r["t_step"] for r in rows if r.get("phase") == "gspo"]
            res[name] = {"pass@1": pass1, "t_step_s": sum(steps) / len(steps), "peak_rss": peak,
                         "trainable": _trainable(out), "checkpoint_bytes": _ckpt_bytes(out)}
        full, lora = res["full"], res["lora"]
        frozen = lora["pass@1"][0]
        size = " x ".join(x.split("=")[1] for x in evals[1:3])
        print(f"held-out pass@1 ({size.replace(' x ', ' prompts x ', 1)} samples), from the same SFT base "
              f"(frozen base: {frozen:.3f})")
        print(format_table(["step", "full-parameter", f"LoRA r{a.rank}"],
                           [[s, f"{full['pass@1'].get(s, float('nan')):.3f}", f"{lora['pass@1'][s]:.3f}"]
                            for s in sorted(lora["pass@1"])]))
        last = max(lora["pass@1"])
        print(format_table(
            ["", "full-parameter", f"LoRA r{a.rank}", "LoRA / full"],
            [["pass@1 rise over the frozen base", f"{full['pass@1'][last] - frozen:+.3f}",
              f"{lora['pass@1'][last] - frozen:+.3f}", ""],
             ["trainable parameters", f"{full['trainable']:,}", f"{lora['trainable']:,}",
              f"{lora['trainable'] / full['trainable']:.3f}"],
             ["last checkpoint (bytes)", f"{full['checkpoint_bytes']:,}", f"{lora['checkpoint_bytes']:,}",
              f"{lora['checkpoint_bytes'] / full['checkpoint_bytes']:.3f}"],
             ["mean GSPO step (s)", f"{full['t_step_s']:.3f}", f"{lora['t_step_s']:.3f}",
              f"{lora['t_step_s'] / full['t_step_s']:.2f}"],
             ["peak RSS, largest process (MiB)", f"{full['peak_rss'] / 2**20:.0f}", f"{lora['peak_rss'] / 2**20:.0f}",
              f"{lora['peak_rss'] / full['peak_rss']:.2f}"]]))
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"frozen_pass@1": frozen, **res}, f, indent=1, default=str)
        return 0
    finally:
        if a.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
