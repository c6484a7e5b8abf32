"""Synchronous vs asynchronous training (rollout.async_steps 0 vs 1, and 1 with partial rollouts),
side by side in one run.

    python bench/bench_async.py                            # ratio 1, 20 steps each, ~2 min on 2 cores
    python bench/bench_async.py --ratios 0.5,1,2 --repeats 3 --json out.json   # issue 42's table
    python bench/bench_async.py --model-rollouts           # the double generates on this CPU
    python bench/bench_async.py --engine vllm --steps 10   # each run launches the real vLLM server
    python bench/bench_async.py --engine vllm --nproc 1 --pin --new-tokens 24   # trainer CPU 0, server CPU 1
    python bench/bench_async.py --smoke                    # 2 steps, 1 trainer process: the harness runs

Setup
  Two trainer processes (torchrun, TP2+SP, the demo's tiny Qwen3-MoE, fp32, CPU) train against
  the SGLang HTTP test double (tests/sglang_double.py, in this process, weight_sync=disk), which
  answers each /generate after a fixed time per generated token (a GPU server's decode time;
  concurrent requests overlap as in a batching server). By default its answers are canned tokens
  that cost no compute: rollout GPUs do not take the trainer's CPU, and on this 2-core machine a
  generating double would (--model-rollouts: the double generates with transformers on one thread,
  which competes with the two trainer processes, so async training there is short of its ideal for
  a reason no cluster has). The per-token time is calibrated from a short synchronous run without
  a decode delay so that a step's rollout takes `ratio` times the rest of its step.

Printed
  per (ratio, run): wall time of each run (torchrun start to exit, the same fixed start-up cost in
  both), the per-step means of t_step, t_rollout, t_old_logprobs, t_train and t_weight_sync
  ("push"), t_push_wait (the part of the push spent waiting for the generation in flight), the
  maximum staleness seen (<= async_steps), dropped samples, samples carried over a weight push
  (partial rollouts), peak RSS of the run's processes (ru_maxrss of the children), and "/ideal":
  the run's mean step against the ideal overlap measured in the synchronous run, max(rollout, the
  rest of the step) (issue 42: <= 1.15 at a rollout:train ratio near 1), and "overlap": the run's
  own mean overlap_efficiency metric (max(generation, the trainer's own work) / step; 1 = fully
  overlapped, a synchronous step 1/2 at ratio 1). Then, with several ratios or repeats, the median
  over the repeats.

--nproc 1: one trainer process at TP1 (no sequence parallel), started without torchrun.
--smoke: 2 steps per run, --nproc 1 (the fewest processes that run the same loop), a fixed
2 ms/token instead of the calibration run, the runs sync and async + partial only; the same
table, numbers meaningless.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, REPO)
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")


def _hf_dir(path: str, **changes) -> str:
    import yaml
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    with open(TINY) as f:
        hf = dict(yaml.safe_load(f)["model"]["hf_config"], **changes)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).save_pretrained(path)
    build_tokenizer(path)
    return path


def _vllm_pinned_command() -> list[str]:
    """The launched vLLM server's command, bound to CPU 1 (taskset; its processes inherit it)."""
    from gspo_megatron.rollout.vllm_api import API_SERVER_MODULE
    from gspo_megatron.rollout.vllm_env import default_dir, venv_python

    return ["taskset", "-c", "1", venv_python(default_dir()), "-m", API_SERVER_MODULE]


def _run(out: str, hf_dir: str, url: str | None, steps: int, async_steps: int, shared: str, partial: bool = False,
         nproc: int = 2, keep: bool = True, pin: bool = False, extra: tuple = ()) -> dict:
    """One training run; url None: the run launches its own vLLM server (rollout.vllm.launch).
    pin: the trainer on CPU 0, its launched vLLM server on CPU 1 (a server with compute of its own)."""
    from sglang_double import sglang_overrides

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    # tiny_cpu.yaml's layout is TP2+SP on 2 processes; one process runs it at TP1
    layout = [] if nproc == 2 else ["parallel.tp=1", "parallel.sequence_parallel=false"]
    # one process needs no launcher (the trainer runs as world 1 without torchrun's environment),
    # which saves torchrun's own start-up (importing torch once more) per run
    launch = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
              if nproc > 1 else [sys.executable])
    cmd = [*launch, "-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}",
           "model.hf_config=null", *layout, f"train.max_steps={steps}", "train.sft_warmup_steps=0", "checkpoint.interval=0",
           "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false",
           "train.minibatches_per_step=2", f"rollout.async_steps={async_steps}", f"rollout.partial={str(partial).lower()}",
           # the synchronous loop's pi_old default; the same in both runs, so only the overlap differs
           "loss.old_logprobs=recompute",
           *(sglang_overrides(url, weight_sync="disk", shared_dir=shared) if url is not None else
             ["rollout.backend=vllm", "rollout.vllm.launch=true", "model.dtype=float32",
              f"rollout.vllm.shared_dir={shared}", f"rollout.vllm.push_mid_generation={str(keep).lower()}"]),
           *extra]
    if pin:
        cmd.append("rollout.vllm.server_command=[" + ",".join(_vllm_pinned_command()) + "]")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, env=env, cwd=REPO,
                       preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if pin else None)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"run {out} failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")) if '"gspo"' in x]
    peak = max(before, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    mean = lambda k: sum(x.get(k, 0.0) for x in rows) / len(rows)  # noqa: E731
    return {"async_steps": async_steps, "partial": partial, "keep": keep,
            "carried": sum(x.get("samples_carried", 0) for x in rows),
            "wall_s": wall, "steps": len(rows), "t_step": mean("t_step"),
            "t_rollout": mean("t_rollout"), "t_train": mean("t_train"), "t_old": mean("t_old_logprobs"),
            "t_wait_rollout": mean("t_wait_rollout"), "t_sync": mean("t_weight_sync"),
            "t_push_wait": mean("t_push_wait"), "overlap": mean("overlap_efficiency"), "staleness_max": max(x.get("staleness_max", 0) for x in rows),
            "dropped": sum(x.get("samples_dropped_stale", 0) for x in rows),
            "reward_first": rows[0]["reward_mean"], "reward_last": rows[-1]["reward_mean"],
            "peak_rss_mib": peak / 1024}


def _table(res: list[dict], ideal: float) -> None:
    print(f"{'async_steps':>11} {'partial':>7} {'mid-push':>8} {'wall s':>8} {'t_step':>8} {'rollout':>8} {'pi_old':>8} {'train':>8} "
          f"{'push':>8} {'push wait':>9} {'stale max':>9} {'dropped':>7} {'carried':>7} {'peak MiB':>9} {'/ideal':>7} "
          f"{'overlap':>7}")
    for r in res:
        print(f"{r['async_steps']:>11} {str(r['partial']):>7} {str(r['keep']):>8} {r['wall_s']:>8.1f} {r['t_step']:>8.2f} "
              f"{r['t_rollout']:>8.2f} {r['t_old']:>8.2f} {r['t_train']:>8.2f} {r['t_sync']:>8.2f} "
              f"{r['t_push_wait']:>9.2f} {r['staleness_max']:>9} {r['dropped']:>7} {r['carried']:>7} "
              f"{r['peak_rss_mib']:>9.0f} {r['t_step'] / ideal:>7.2f} {r['overlap']:>7.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--per-token-s", type=float, default=None,
                    help="the double's decode time per token; default: calibrated from --ratios")
    ap.add_argument("--ratios", default="1",
                    help="comma-separated rollout:train time ratios, each a per-token time from the calibration "
                         "run (issue 42: 0.5,1,2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each (ratio, mode), one after another")
    ap.add_argument("--model-rollouts", action="store_true",
                    help="the double generates with the model on this CPU (competing with the trainer) instead "
                         "of answering canned tokens after the decode time: a GPU server as the trainer sees it")
    ap.add_argument("--engine", choices=("double", "vllm"), default="double",
                    help="vllm: each run launches the real vLLM server on this CPU (its cached venv; "
                         "head_dim 32, fp32); no decode delay to set, so --ratios does not apply")
    ap.add_argument("--nproc", type=int, choices=(1, 2), default=2,
                    help="trainer processes: 2 = TP2+SP as tiny_cpu.yaml, 1 = TP1")
    ap.add_argument("--pin", action="store_true",
                    help="--engine vllm: the trainer on CPU 0, the server it launches on CPU 1 (taskset), as a "
                         "server with devices of its own; use with --nproc 1")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="--engine vllm: rollout.max_new_tokens (sets the rollout:train ratio; default tiny_cpu's 8)")
    ap.add_argument("--async-steps", type=int, default=1,
                    help="--engine vllm: rollout.async_steps of the async runs (2: the server generates the batch "
                         "after next while a push reloads it)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="--steps 2 --nproc 1 --per-token-s 0.002 (no calibration), runs sync and async + partial: "
                         "seconds, the harness runs")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.nproc = 2, 1
        if args.per_token_s is None:
            args.per_token_s = 0.002
    ratios = [float(x) for x in args.ratios.split(",")] if args.per_token_s is None else [None]
    if args.engine == "vllm":
        return _main_vllm(args)

    import statistics

    import torch
    from sglang_double import Faults, SGLangDouble

    # with --model-rollouts the double stands in for rollout GPUs with its own transformers
    # generation: one thread, as little of the trainers' two cores as it can
    torch.set_num_threads(1)
    layout = "2 trainer processes (TP2+SP)" if args.nproc == 2 else "1 trainer process (TP1)"
    stand_in = "the model's generation on this CPU" if args.model_rollouts else "canned tokens (no compute)"
    summary: dict = {}
    report = {"steps": args.steps, "nproc": args.nproc, "model_rollouts": args.model_rollouts, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = _hf_dir(os.path.join(tmp, "hf"))
        with SGLangDouble(hf_dir, faults=Faults(canned=not args.model_rollouts)) as dbl:
            train = None
            if args.per_token_s is None:
                cal = _run(os.path.join(tmp, "cal"), hf_dir, dbl.url, 3, 0, os.path.join(tmp, "sync_cal"),
                           nproc=args.nproc)
                train = cal["t_step"] - cal["t_rollout"]
                print(f"calibration (3 sync steps, no decode delay): rollout {cal['t_rollout']:.2f} s, "
                      f"rest of the step {train:.2f} s")
            # (async_steps, partial); the smoke leaves out plain async: async + partial runs the same
            # producer code and more, and each run costs a trainer start-up (~13 CPU-s)
            modes = ((0, False), (1, True)) if args.smoke else ((0, False), (1, False), (1, True))
            for ratio in ratios:
                # the double answers after per_token * tokens (less its own generation time): a step's
                # rollout then takes ~ 8 * per_token (max_new_tokens of tiny_cpu.yaml) = ratio * the rest
                per_token = args.per_token_s if ratio is None else ratio * train / 8
                dbl.faults.per_token_s = per_token
                for rep in range(args.repeats):
                    res = [_run(os.path.join(tmp, f"r{ratio}_{rep}_{k}{'p' * p}"), hf_dir, dbl.url, args.steps, k,
                                os.path.join(tmp, f"s{ratio}_{rep}_{k}{'p' * p}"), partial=p, nproc=args.nproc)
                           for k, p in modes]
                    sync = res[0]
                    # the ideal overlapped step, from the synchronous run: the longer of its rollout
                    # and the rest of its step (pi_old, training, the push), which async training can
                    # at best run side by side
                    ideal = max(sync["t_rollout"], sync["t_step"] - sync["t_rollout"])
                    print(f"\n{args.steps} steps, {layout}, stand-in: {stand_in} at {per_token * 1e3:.0f} ms/token"
                          + (f", rollout:train {ratio:g}" if ratio is not None else "") + f", run {rep + 1}")
                    _table(res, ideal)
                    for r in res[1:]:
                        name = "async + partial rollouts" if r["partial"] else "async"
                        print(f"speed-up {name} / sync: step time {sync['t_step'] / r['t_step']:.2f}x, whole run "
                              f"{sync['wall_s'] / r['wall_s']:.2f}x; step time / ideal {r['t_step'] / ideal:.2f} "
                              f"(ideal {ideal:.2f} s = max(sync rollout, sync rest of the step))")
                        summary.setdefault((ratio, name), []).append(
                            (r["t_step"] / ideal, sync["t_step"] / r["t_step"]))
                    report["cells"].append({"ratio": ratio, "repeat": rep, "per_token_s": per_token,
                                            "ideal_s": ideal, "runs": res})
    if len(summary) > 0 and (args.repeats > 1 or len(ratios) > 1):
        print(f"\nsummary over {args.repeats} run(s) each: median step time / ideal (range), median speed-up")
        for (ratio, name), xs in summary.items():
            over = [x for x, _ in xs]
            print(f"  rollout:train {ratio if ratio is not None else '-'!s:>4} {name:<25} "
                  f"{statistics.median(over):.2f} ({min(over):.2f}-{max(over):.2f}), "
                  f"{statistics.median(y for _, y in xs):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _main_vllm(args) -> None:
    """The same runs against the real vLLM server each run launches (rollout/vllm_server.py): it
    computes on this CPU next to the trainer, so the overlap is short of a cluster's, where the
    servers have GPUs of their own. Async runs push mid-generation (rollout.vllm.push_mid_generation:
    a keep pause, no push wait), and once more with the push waiting for the generation in flight
    (push_mid_generation=false), side by side; partial rollouts interrupt it."""
    import statistics

    layout = "2 trainer processes (TP2+SP)" if args.nproc == 2 else "1 trainer process (TP1)"
    if args.pin:
        layout += " on CPU 0, the server on CPU 1"
    d = args.async_steps
    modes = ((0, False, True), (d, False, True), (d, False, False), (d, True, True))
    summary: dict = {}
    extra = (f"rollout.max_new_tokens={args.new_tokens}",) if args.new_tokens else ()
    report = {"steps": args.steps, "nproc": args.nproc, "engine": "vllm", "pin": args.pin, "async_steps": d,
              "new_tokens": args.new_tokens, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = _hf_dir(os.path.join(tmp, "hf"), head_dim=32)  # vLLM's CPU attention: 32, 64, 80, ...
        for rep in range(args.repeats):
            res = [_run(os.path.join(tmp, f"v{rep}_{k}{'p' * p}{'w' * (not keep)}"), hf_dir, None, args.steps, k,
                        os.path.join(tmp, f"vs{rep}_{k}{'p' * p}{'w' * (not keep)}"), partial=p, nproc=args.nproc,
                        keep=keep, pin=args.pin, extra=extra) for k, p, keep in modes]
            sync = res[0]
            ideal = max(sync["t_rollout"], sync["t_step"] - sync["t_rollout"])
            print(f"\n{args.steps} steps, {layout}, the real vLLM server on this CPU, run {rep + 1} (wall includes "
                  "each run's server start)")
            _table(res, ideal)
            for r in res[1:]:
                name = ("async + partial rollouts" if r["partial"] else
                        "async, push mid-generation" if r["keep"] else "async, push waits")
                print(f"speed-up {name} / sync: step time {sync['t_step'] / r['t_step']:.2f}x; step time / ideal "
                      f"{r['t_step'] / ideal:.2f} (ideal {ideal:.2f} s; rollout:train {sync['t_rollout'] / max(sync['t_step'] - sync['t_rollout'], 1e-9):.2f})")
                summary.setdefault(name, []).append(r["t_step"] / ideal)
            report["cells"].append({"repeat": rep, "ideal_s": ideal, "runs": res})
    if args.repeats > 1:
        print(f"\nsummary over {args.repeats} runs: median step time / ideal (range)")
        for name, xs in summary.items():
            print(f"  {name:<25} {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
