"""Throughput and peak memory of `gspo-convert` in both directions, next to a plain file copy.

    python bench/bench_convert.py [--workdir /tmp/x] [--layers 12 --experts 64 ...]
    python bench/bench_convert.py --smoke     # a ~1 MB model, one run each: the harness runs (seconds)

Builds a synthetic Qwen3-MoE (random bf16 weights, many small expert tensors, written straight
into safetensors shards, so creating it takes seconds), then on the same disk:
  * copies the HF shard files (plain read+write of the same bytes: the physical limit);
  * runs `gspo-convert hf-to-mcore` and `gspo-convert mcore-to-hf` as subprocesses, measuring wall
    time (including interpreter start-up and imports) and the subprocess's peak RSS (os.wait4);
  * checks the round trip HF -> mcore -> HF is bit-exact for every tensor.
and prints one table with GB/s, ratio to the copy and peak RSS as a fraction of the model size.
Every time includes fsync of the written files (the copy fsyncs each file; after a conversion
the bench fsyncs its output), so all rows measure "bytes durably on disk".

Targets: >= 50% of copy throughput, peak RSS < 25% of the model size.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def synth_config(a) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": a.vocab,
        "hidden_size": a.hidden, "intermediate_size": a.hidden * 3, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "num_experts": a.experts, "num_experts_per_tok": min(8, a.experts), "moe_intermediate_size": a.moe_inter,
        "norm_topk_prob": True, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 4096, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "decoder_sparse_step": 1, "mlp_only_layers": [],
    }


def write_synthetic_hf(d: str, a) -> int:
    """Random bf16 Qwen3-MoE in `a.hf_shard_mb` MB safetensors shards; returns tensor bytes."""
    from safetensors.torch import save_file

    from gspo_megatron.model.mapping import hf_shapes
    from gspo_megatron.model.arch import MoeArch

    cfg = synth_config(a)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)
    shapes = hf_shapes(MoeArch.from_hf_dict(cfg))
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(a.pool_numel, generator=g).to(torch.bfloat16)  # 128 MB of random values (default)
    limit = a.hf_shard_mb * 1024**2
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, total, weight_map = 0, 0, {}
    names = list(shapes)
    files = []

    def flush():
        fname = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], os.path.join(d, fname), metadata={"format": "pt"})
        files.append(fname)
        for k in shards[-1]:
            weight_map[k] = fname
        shards[-1] = {}

    for n in names:
        numel = 1
        for s in shapes[n]:
            numel *= s
        off = int(torch.randint(0, pool.numel() - numel + 1, (1,), generator=g))
        t = pool[off : off + numel].reshape(shapes[n]).clone()
        nbytes = t.numel() * 2
        if shards[-1] and size + nbytes > limit:
            flush()
            size = 0
        shards[-1][n] = t
        size += nbytes
        total += nbytes
    flush()
    # Hub-style names: model-0000i-of-0000n
    final = {}
    for i, fname in enumerate(files):
        new = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        os.replace(os.path.join(d, fname), os.path.join(d, new))
        final[fname] = new
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}, f)
    return total


def data_files(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)))


def copy_dir(src: str, dst: str, fsync: bool) -> float:
    """Plain copy of every file (read + write through the page cache); returns seconds."""
    os.makedirs(dst)
    t0 = time.perf_counter()
    buf = bytearray(16 * 1024 * 1024)
    mv = memoryview(buf)
    for f in data_files(src):
        with open(os.path.join(src, f), "rb", buffering=0) as fi, open(os.path.join(dst, f), "wb", buffering=0) as fo:
            while True:
                n = fi.readinto(buf)
                if not n:
                    break
                fo.write(mv[:n])
            if fsync:
                os.fsync(fo.fileno())
    return time.perf_counter() - t0


_MEASURE = r"""
import json, os, subprocess, sys, time
t0 = time.perf_counter()
p = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
err = p.stderr.read()
_, status, ru = os.wait4(p.pid, 0)
print(json.dumps({"wall": time.perf_counter() - t0, "maxrss_kb": ru.ru_maxrss,
                  "rc": os.waitstatus_to_exitcode(status), "stderr": err.decode(errors="replace")[-3000:]}))
"""


def run_measured(cmd: list[str]) -> tuple[float, int, str]:
    """(wall seconds, peak RSS bytes, stderr tail) of `cmd`, run by a small interpreter that does
    nothing else: a child forked from this (large) process would report the parent's pages as its
    own peak RSS, since Linux keeps the high-water mark across fork + exec."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-S", "-c", _MEASURE, *cmd], capture_output=True, text=True, env=env, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"measurement wrapper failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    if r["rc"] != 0:
        raise SystemExit(f"command failed ({r['rc']}): {' '.join(cmd)}\n{r['stderr']}")
    return r["wall"], r["maxrss_kb"] * 1024, r["stderr"]


def run_in_process(cmd: list[str]) -> tuple[float, int, str]:
    """--smoke: (wall seconds, 0 = no peak RSS, stderr) of the gspo-convert command `cmd` run in
    this process (converters.cli.main): a converter subprocess spends seconds starting up and
    importing torch, which is what the full bench measures but not what a smoke run is for."""
    import contextlib
    import io

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from converters.cli import main as convert

    err = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = convert(cmd[cmd.index("converters.cli") + 1:])
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"command failed ({rc}): {' '.join(cmd)}\n{err.getvalue()[-3000:]}")
    return wall, 0, err.getvalue()


def check_bit_exact(a: str, b: str) -> int:
    from gspo_megatron.checkpoint.safetensors_data import SafetensorsData
    from gspo_megatron.model.hf_io import HFCheckpointReader

    ra, rb = HFCheckpointReader(a), HFCheckpointReader(b)
    if ra.names() != rb.names():
        raise SystemExit(f"round trip changed the tensor names: {sorted(ra.names() ^ rb.names())[:5]}")
    da, db = SafetensorsData(a, ra.weight_map), SafetensorsData(b, rb.weight_map)
    for n in sorted(ra.names()):
        x, y = da.get(n), db.get(n)
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            raise SystemExit(f"round trip is not bit-exact for {n}")
    return len(ra.names())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", help="where to put the checkpoints (default: a new directory in /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-inter", type=int, default=512)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hf-shard-mb", type=int, default=1024, help="input HF shard size (MB)")
    p.add_argument("--out-shard-size", default="128MB",
                   help="--max-shard-size for both conversions (mcore-to-hf buffers one shard in memory)")
    p.add_argument("--threads", type=int, default=1, help="hf-to-mcore --threads")
    p.add_argument("--repeat", type=int, default=3, help="runs per operation; the fastest counts (busy machines are noisy)")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model (2 layers x 4 experts, ~1 MB), one run per operation: a check that the bench "
                        "runs and its round trip is bit-exact (seconds; tests/test_converters.py runs it); no "
                        "timing in it means anything")
    a = p.parse_args(argv)
    a.pool_numel = 1 << 26  # the random values tensors are cut from; larger than any tensor
    if a.smoke:
        a.layers, a.experts, a.hidden, a.moe_inter, a.heads, a.kv_heads, a.head_dim = 2, 4, 64, 32, 4, 2, 16
        a.vocab, a.hf_shard_mb, a.out_shard_size, a.repeat, a.pool_numel = 256, 1, "256KB", 1, 1 << 16

    work = a.workdir or tempfile.mkdtemp(prefix="bench_convert_", dir="/tmp")
    os.makedirs(work, exist_ok=True)
    hf, mc, hf2 = (os.path.join(work, x) for x in ("hf", "mcore", "hf2"))
    try:
        t0 = time.perf_counter()
        model_bytes = write_synthetic_hf(hf, a)
        n_files = len([f for f in os.listdir(hf) if f.endswith(".safetensors")])
        print(f"synthetic Qwen3-MoE: {a.layers} layers x {a.experts} experts, hidden {a.hidden}, "
              f"{model_bytes / 1e9:.2f} GB bf16 in {n_files} shards, written in {time.perf_counter() - t0:.1f} s "
              f"({work})", flush=True)
        disk_bytes = sum(os.path.getsize(os.path.join(hf, f)) for f in data_files(hf))

        def fsync_tree(d: str) -> float:
            t0 = time.perf_counter()
            for root, _, files in os.walk(d):
                for f in files:
                    fd = os.open(os.path.join(root, f), os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
            return time.perf_counter() - t0

        cli = [sys.executable, "-m", "converters.cli"]

        def copy():
            dst = os.path.join(work, "copy")
            shutil.rmtree(dst, ignore_errors=True)
            sec = copy_dir(hf, dst, fsync=True)
            shutil.rmtree(dst)
            return sec, sec, None

        def convert(args, out):
            shutil.rmtree(out, ignore_errors=True)
            wall, rss, err = (run_in_process if a.smoke else run_measured)(cli + args)
            m = re.search(r"in ([0-9.]+) s \(", err)  # the CLI's own timing, after start-up
            flush = fsync_tree(out)  # until the bytes are on disk, like the copy
            return wall + flush, (float(m.group(1)) if m else float("nan")) + flush, rss

        ops = {
            "copy": copy,
            "hf-to-mcore": lambda: convert(["hf-to-mcore", "--hf-dir", hf, "--out", mc, "--no-progress",
                                            "--max-shard-size", a.out_shard_size, "--threads", str(a.threads)], mc),
            "mcore-to-hf": lambda: convert(["mcore-to-hf", "--load", mc, "--out", hf2, "--no-progress",
                                            "--max-shard-size", a.out_shard_size], hf2),
        }
        runs: dict[str, list] = {k: [] for k in ops}
        for _ in range(a.repeat):  # interleaved, so slow phases of a busy machine hit every operation
            for k, fn in ops.items():
                os.sync()  # start without the previous run's dirty pages in flight
                runs[k].append(fn())
        res = {k: (min(r[0] for r in v), min(r[1] for r in v), max(r[2] or 0 for r in v)) for k, v in runs.items()}
        n = check_bit_exact(hf, hf2)
        if a.smoke:
            idle = "not measured (--smoke)"
        else:
            idle_wall, idle_rss, _ = run_measured([sys.executable, "-c", "import torch, gspo_megatron.checkpoint.mcore"])
            idle = f"{idle_wall:.1f} s, {idle_rss / 2**20:.0f} MiB RSS"

        print(f"\nround trip HF -> mcore -> HF bit-exact for all {n} tensors")
        print(f"model: {model_bytes / 1e9:.3f} GB of tensors ({disk_bytes / 1e9:.3f} GB on disk); "
              f"--max-shard-size {a.out_shard_size}; interpreter + imports alone: {idle}\n")
        base = res["copy"][0]
        print(f"{'':<14}{'-- wall, incl. start-up --':>28}{'-- conversion only --':>28}")
        print(f"{'operation':<14}{'seconds':>10}{'GB/s':>8}{'vs copy':>10}{'seconds':>10}{'GB/s':>8}{'vs copy':>10}"
              f"{'peak RSS':>12}{'RSS/model':>11}")
        for name, (wall, conv, rss) in res.items():
            cells = f"{name:<14}{wall:10.2f}{disk_bytes / wall / 1e9:8.2f}{base / wall:10.0%}"
            cells += f"{conv:10.2f}{disk_bytes / conv / 1e9:8.2f}{base / conv:10.0%}"
            if rss:
                cells += f"{rss / 2**20:8.0f} MiB{rss / model_bytes:11.1%}"
            print(cells)
        print(f"\n(best of {a.repeat} interleaved runs, os.sync() before each; every time includes fsync of "
              "the written files; 'vs copy' = copy time / time; 'conversion only' excludes interpreter "
              "start-up and imports, as timed by the CLI itself; peak RSS of the converter process"
              + ("; --smoke: conversions in this process, no RSS, times meaningless)" if a.smoke else ")"))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
