"""Every GPU preset simulated at its world size (`--simulate`: gspo_megatron/train/simulate.py), in
one process: the tables of docs/benchmarks.md "Scale, simulated".

    python bench/bench_simulate.py                  # the six presets, ~2 min on 2 cores
    python bench/bench_simulate.py --presets glm45_air --json out.json

Each preset runs with the background save on (`checkpoint.async_save=true`: its host snapshot is
measured). Printed: per preset the first rank's GPU bytes, the fullest node and GPU, host memory per
node and the seconds each simulation took; the weight push measured on rank 0 with the predicted
time per weight-sync mode beside the published refit times; and the background save's buffers of
c651b52 (one `torch.empty(pin_memory=True)` per chunk, rounded up by torch's pinned allocator)
measured the same way on the 235B preset's rank 0, against today's. `--json` writes every report
(tests/test_simulate.py reads it: this script's smoke run is that test's fixture).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.common import format_table  # noqa: E402

PRESETS = ["qwen3_30b_a3b", "qwen3_235b_a22b", "glm45_air", "glm45", "deepseek_v3", "kimi_k2"]
# published refit (weight-update) times, seconds: NeMo-RL, miles, checkpoint-engine (issue 56)
PUBLISHED = {"qwen3_30b_a3b": "NeMo-RL 0.74-1.0", "qwen3_235b_a22b": "miles 3.16, checkpoint-engine 6.22",
             "deepseek_v3": "NeMo-RL 2.4-2.8"}
GIB = 1 << 30


def old_snapshot(model, optimizer, arch, hf_config):
    """c651b52's background-save buffers (train/checkpoint.py `_snapshot` then): one
    torch.empty(..., pin_memory=True) per chunk, each rounded up by torch's pinned allocator."""
    import torch

    from gspo_megatron.checkpoint.mcore import model_sharded_state_dict
    from gspo_megatron.train.checkpoint_shards import distributed_optimizer_plan

    chunks, _ = distributed_optimizer_plan(optimizer, model_sharded_state_dict(model, arch))
    for c in chunks:
        torch.empty(tuple(c.sizes), dtype=c.dtype, pin_memory=True)
    return sum(c.nbytes for c in chunks), 0, len(chunks)


def _config(name: str) -> str:
    return os.path.join(REPO, "launch", "configs", f"{name}.yaml")


def run(presets: list[str], overrides: list[str]) -> dict:
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train import simulate

    out = {}
    for name in presets:
        buf = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(buf):
            rc = simulate.main(["--config", _config(name), "--json", "checkpoint.async_save=true", *overrides])
        if rc != 0:
            sys.exit(f"bench_simulate: --simulate of {name} exited {rc}")
        out[name] = dict(json.loads(buf.getvalue().strip().splitlines()[-1]), seconds=time.perf_counter() - t0)
    if "qwen3_235b_a22b" in presets:  # the c651b52 buffers, on the rank the issue measured
        cfg = load_config(_config("qwen3_235b_a22b"), ["parallel.device=cpu", "checkpoint.async_save=true"])
        old = simulate.simulate(cfg, cfg.parallel.world_size, [0], snapshot=old_snapshot)[0]
        out["c651b52_snapshot"] = {"rank": 0, **old.host}
    return out


def report(res: dict) -> None:
    g = lambda b: f"{b / GIB:.2f}"  # noqa: E731
    rows, push = [], []
    for name, d in res.items():
        if name == "c651b52_snapshot":
            continue
        r0 = next(r for r in d["ranks"] if r["rank"] == 0)
        nodes = d["nodes"]
        fullest = max(sum(n["gpu"].values()) for n in nodes)
        largest = max(n["largest_gpu"]["bytes"] for n in nodes)
        host = max(sum(n["host"].values()) for n in nodes)
        rows.append([name, d["world_size"], g(r0["gpu"]["weights"]), g(r0["gpu"]["gradients"]),
                     g(r0["gpu"]["optimizer"]), f"{fullest / GIB:.1f}", f"{largest / GIB:.1f}", f"{host / GIB:.1f}",
                     f"{d['seconds']:.1f}"])
        f, plan = r0["refit"], {p["mode"]: p for p in d["refit_plan"]}
        push.append([name, f"{f['push_bytes'] / GIB:.1f}", f"{f['recv_intra'] / GIB:.1f} + {f['recv_inter'] / GIB:.1f}",
                     f"{f['buckets']} x {f['bucket_bytes'] >> 20} MiB", f"{f['peak_extra_bytes'] / GIB:.1f}",
                     d["refit_plan"][0]["layout"], f"{plan['distributed']['total_s']:.1f}",
                     "refused" if plan["tensor"]["refused"] else f"{plan['tensor']['total_s']:.1f}",
                     f"{plan['disk']['total_s']:.0f}", PUBLISHED.get(name, "")])
    print("GiB (rank 0 per GPU; fullest node of 8 with planned activations; its largest GPU; host per node) and "
          "seconds of each simulation")
    print(format_table(["preset", "GPUs", "weights", "gradients", "optimizer", "fullest node", "largest GPU",
                        "host per node", "simulate s"], rows))
    links = next(iter(res.values()))["scale"]
    print(f"\nthe weight push on rank 0; predicted seconds (NVLink {links['nvlink_gbs']:g} GB/s, InfiniBand "
          f"{links['ib_gbs']:g} GB/s, file system {links['disk_gbs']:g} GB/s) beside the published refit times")
    print(format_table(["preset", "pushed GiB", "received GiB (node + across)", "buckets", "peak extra GiB",
                        "engines", "distributed s", "tensor s", "disk s", "published s"], push))
    plans = layout_plans(res)
    if plans:
        print("\nthe refit plan per weight-sync mode and engine layout (servers x GPUs each; GiB; per push)")
        print(format_table(["preset", "mode", "engines", "engine nodes", "collectives", "requests",
                            "each engine rank receives", "its peak extra", "across the network", "predicted s"], plans))
    old = res.get("c651b52_snapshot")
    if old:
        now = next(r for r in res["qwen3_235b_a22b"]["ranks"] if r["rank"] == 0)["host"]
        print("\nthe background save's host buffers on qwen3_235b_a22b rank 0 (GiB)")
        print(format_table(["buffers", "snapshot", "page-locked", "page-locked / snapshot"], [
            ["c651b52: one pinned tensor per chunk", g(old["checkpoint_snapshot"]), g(old["checkpoint_pinned"]),
             f"{old['checkpoint_pinned'] / old['checkpoint_snapshot']:.3f}"],
            ["today: HostSnapshot", g(now["checkpoint_snapshot"]), g(now["checkpoint_pinned"]),
             f"{now['checkpoint_pinned'] / now['checkpoint_snapshot']:.3f}"]]))


# engine layouts beside each preset's own (SERVERSxGPUS): more servers of the same size, and one
# server of twice the GPUs (the refit plan's per-layout rows)
LAYOUTS = {"qwen3_30b_a3b": ["1x4", "4x4", "1x8"], "qwen3_235b_a22b": ["1x8", "4x8", "1x16"]}


def layout_plans(res: dict) -> list[list]:
    """Rows of the refit plan (train/simulate.py refit_plan) for LAYOUTS, from each preset's rank-0
    push as measured: SGLang's modes, and vLLM's where the push's bucket is vLLM's too (the NCCL
    push's fixed 512 MiB: the same buckets, so the same measurement)."""
    from types import SimpleNamespace

    from gspo_megatron.rollout.vllm_nccl import DEFAULT_BUCKET_BYTES
    from gspo_megatron.train.simulate import EngineLayout, refit_plan

    rows = []
    for name, layouts in LAYOUTS.items():
        if name not in res:
            continue
        d = res[name]
        r0 = next(r for r in d["ranks"] if r["rank"] == 0)["refit"]
        lays = [EngineLayout.parse(x) for x in layouts]
        engines = ["sglang"] + (["vllm"] if r0["bucket_bytes"] == DEFAULT_BUCKET_BYTES else [])
        for backend in engines:
            for p in refit_plan(r0, backend, lays, SimpleNamespace(**d["scale"]), d["world_size"]):
                mode = f"{backend} {p['mode']}"
                if p["refused"]:  # one row: the reason is the trainer's, whatever the engines
                    if not any(r[:2] == [name, mode] for r in rows):
                        rows.append([name, mode, "any", "", "refused: " + p["refused"], "", "", "", "", ""])
                    continue
                rows.append([name, mode, p["layout"], p["engine_nodes"], p["collectives"], p["requests"],
                             f"{p['engine_rank_receives'] / GIB:.1f}", f"{p['engine_peak_gpu'] / GIB:.2f}",
                             f"{p['network_bytes'] / GIB:.0f}", f"{p['total_s']:.1f}"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default=",".join(PRESETS), help="comma-separated preset names (launch/configs)")
    ap.add_argument("--json", default=None, help="write every report here")
    ap.add_argument("overrides", nargs="*", help="dotted overrides for every preset")
    a = ap.parse_args(argv)
    from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

    skip_compiled_fusions()
    res = run([p for p in a.presets.split(",") if p], a.overrides)
    report(res)
    if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
