"""Weight-sync export throughput: sharded Megatron params -> HF-named full tensors in buckets, on CPU.

    python bench/bench_weight_sync.py                     # ~0.7 GB fp32 model, TP2 and EP2
    python bench/bench_weight_sync.py --layers 1 --experts 8 --hidden 512   # quick
    python bench/bench_weight_sync.py --profile           # where rank 0's time goes
    python bench/bench_weight_sync.py --smoke             # tiny model, TP1 (1 process), 1 pass: seconds

For each layout (TP2 = tp2 + sequence parallel; EP2 = ep2 with dp2: 2 gloo processes, 1 thread
each; tp1: one process, no gathers, the smoke's layout) build a random-init Qwen3-MoE with
`build_policy` + `init_parallel`, then stream it through `gspo_megatron.model.export.iter_hf_tensors`
(TP / EP gathers, Megatron -> HF conversion; rank 0 receives the full tensors) into
`weight_sync.iter_buckets` (bucket_mb buckets, optional dtype cast) — exactly what
SGLangEngine.update_weights consumes before its transport. Timed on rank 0 from the first item to
the last bucket (all ranks start together after a barrier), best of --repeats passes (the median
pass is printed too: the machine is shared and noisy); an untimed pass first warms the allocator.

Reported next to it, in the same process and thread count: a plain memcpy of the same number of
bytes (`dst.copy_(src)` of one uint8 buffer, best of 3), and the ratio export / memcpy. The target
is >= 30 %. With --profile, rank 0 runs the timed pass under cProfile and prints the top entries.

The exporter gathers point to point to each group's root (an earlier all-gather version ran at
~5% of memcpy here: gloo's all_gather of 64 MB moved ~0.1 GB/s against ~1 GB/s for send/recv).

The memcpy reference is reported twice: into a warm (already touched) buffer, the brief's
baseline, and into a freshly allocated one, which pays the page faults every new tensor of the
exporter pays on CPU (glibc serves big allocations with fresh mmaps).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GB = 1e9


def hf_config(a) -> dict:
    return dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=a.vocab,
        hidden_size=a.hidden, intermediate_size=a.hidden * 2, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
        num_experts=a.experts, num_experts_per_tok=2, moe_intermediate_size=a.moe_inter,
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, max_position_embeddings=4096,
        rope_theta=10000.0,
    )


def _worker(rank, world, port, layout, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        queue.put((rank, _run(rank, layout, args)))
    except BaseException:
        import traceback

        queue.put((rank, traceback.format_exc()))
        raise


def _run(rank, layout, args):
    import torch.distributed as dist

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.model.factory import build_policy, parse_dtype
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.rollout.weight_sync import drain, iter_buckets, tensor_nbytes

    arch = MoeArch.from_hf_dict(hf_config(args))
    par = ParallelConfig(tp=layout["tp"], ep=layout["ep"], sequence_parallel=layout["tp"] > 1, device="cpu")
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    dtype = parse_dtype(args.dtype)
    chunks, _ = build_policy(ctx, arch, dtype=dtype)
    local_bytes = sum(tensor_nbytes(p) for c in chunks for p in c.parameters())
    cast = parse_dtype(args.cast) if args.cast else None
    bucket_bytes = int(args.bucket_mb * (1 << 20))

    def one_pass():
        stream = iter_hf_tensors(chunks, ctx, arch, dtype=cast if args.cast_at_source else None)
        if rank != 0:
            drain(stream)
            return 0, 0
        n = b = 0
        for bucket in iter_buckets(stream, bucket_bytes, dtype=cast):
            n += 1
            b += sum(tensor_nbytes(t) for _, t in bucket)
        return b, n

    one_pass()  # warm-up
    dist.barrier()
    prof = prof_done = None
    if args.profile and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    passes = []
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        nbytes, nbuckets = one_pass()
        passes.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
            prof_done, prof = prof, None
    prof = prof_done if args.profile and rank == 0 else None
    dist.barrier()
    out = None
    if rank == 0:
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        times = []
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        fresh = []
        for _ in range(3):
            t = time.perf_counter()
            d2 = torch.empty_like(src)
            d2.copy_(src)
            fresh.append(time.perf_counter() - t)
            del d2
        del src, dst
        stats = None
        if prof is not None:
            import io
            import pstats

            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            stats = s.getvalue()
        out = dict(bytes=nbytes, buckets=nbuckets, export_s=min(passes),
                   export_median_s=sorted(passes)[len(passes) // 2], memcpy_s=min(times), memcpy_fresh_s=min(fresh),
                   local_bytes=local_bytes, profile=stats)
    destroy_parallel()
    return out


def run_layout(name, layout, args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = layout["tp"] * layout["ep"]  # the ranks of one TP or EP group (EP2 = DP2 for the dense part)
    procs = [ctx.Process(target=_worker, args=(r, world, port, layout, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(results) < world:
            import queue as _q

            try:
                rank, res = q.get(timeout=max(1.0, min(5.0, deadline - time.monotonic())))
            except _q.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name}: no result after {args.timeout} s")
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"{name}: a rank died")
                continue
            if isinstance(res, str):
                raise RuntimeError(f"{name} rank {rank} failed:\n{res}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(5)
    return results[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-inter", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="parameter dtype of the model")
    ap.add_argument("--cast", default=None, help="cast exported tensors (e.g. bfloat16) in the buckets")
    ap.add_argument("--cast-at-source", action="store_true",
                    help="with --cast: cast on each shard's rank before the transfers "
                         "(iter_hf_tensors(dtype=...)) instead of in the buckets on rank 0")
    ap.add_argument("--bucket-mb", type=float, default=512)
    ap.add_argument("--layouts", default="tp2,ep2")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (best is reported)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model (vocab 8192, hidden 128, 1 layer, 4 experts; ~9 MB), 1 MiB buckets, 1 timed pass, "
                         "layout tp1 only (one process: the export and bucketing without gathers): seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.vocab, args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim = 8192, 128, 1, 4, 2, 32
        args.experts, args.moe_inter, args.bucket_mb, args.repeats, args.layouts = 4, 32, 1, 1, "tp1"
    layouts = {"tp2": dict(tp=2, ep=1), "ep2": dict(tp=1, ep=2), "tp1": dict(tp=1, ep=1)}
    worlds = {layouts[n]["tp"] * layouts[n]["ep"] for n in args.layouts.split(",")}
    procs = "2 gloo processes" if worlds == {2} else "1 process" if worlds == {1} else "1 or 2 processes per layout"
    print(f"model: vocab={args.vocab} hidden={args.hidden} layers={args.layers} experts={args.experts} "
          f"moe_inter={args.moe_inter} dtype={args.dtype} cast={args.cast}{' at source' if args.cast_at_source else ''} bucket={args.bucket_mb} MiB; "
          f"{procs} x 1 thread")
    print(f"{'layout':12s} {'HF bytes':>10s} {'buckets':>8s} {'export s':>9s} {'export GB/s':>12s} "
          f"{'memcpy GB/s':>12s} {'ratio':>7s} {'median':>7s} {'fresh memcpy':>13s} {'ratio':>7s}")
    for name in args.layouts.split(","):
        r = run_layout(name, dict(layouts[name]), args)
        ex = r["bytes"] / r["export_s"] / GB
        mc = r["bytes"] / r["memcpy_s"] / GB
        mf = r["bytes"] / r["memcpy_fresh_s"] / GB
        med = r["bytes"] / r["export_median_s"] / GB
        print(f"{name:12s} {r['bytes'] / GB:9.3f}G {r['buckets']:8d} {r['export_s']:9.2f} {ex:12.2f} "
              f"{mc:12.2f} {100 * ex / mc:6.1f}% {100 * med / mc:6.1f}% {mf:13.2f} {100 * ex / mf:6.1f}%", flush=True)
        if r["profile"]:
            print(r["profile"])


if __name__ == "__main__":
    main()
