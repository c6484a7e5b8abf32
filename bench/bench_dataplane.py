"""A step's samples from rank 0 to the trainers: the old full pickled broadcast vs the data plane.

    python bench/bench_dataplane.py                 # 64 samples x 2-4k tokens, 30B-like routing, DP2 x TP2
    python bench/bench_dataplane.py --dp 4 --tp 1   # DP4
    python bench/bench_dataplane.py --smoke         # tiny, seconds (tests/test_dataplane.py runs it)

One spawn of dp x tp gloo processes (1 thread each; tests/dist_utils.py run_distributed). Rank 0
builds one step's TrainSamples as the loop has them: prompt + response token ids, an advantage,
engine log-probs (Python floats), routing as SGLang decodes it (int32 [P + R - 1, layers, top_k],
expert ids < --experts), a token mask on every third sample. Then, in turn (new first, then old;
the results of the first are reduced to a digest and freed before the second):

  old  train/loop.py before the data plane: `dist.broadcast_object_list` of all samples (pickled)
       from rank 0 to every rank, then every rank shuffles them (the step's training order);
  new  train/loop.py now: rank 0 shuffles, `distribute` (train/batch.py dp_owners + encode_shares,
       parallel/dataplane.py exchange, decode_share): every rank gets every sample's lengths, and
       its DP rank's samples' content only.

Per rank and arm: bytes received (counted by wrapping torch.distributed's broadcast and scatter,
which broadcast_object_list also goes through: payload bytes this rank received as a non-source
member), wall time from a barrier to its samples being ready (the step waits for the slowest
rank: the table's time row is the max over ranks), and the peak RSS (VmHWM, reset before the
arm; "+" = above the RSS at the arm's start, which on rank 0 holds the generated samples).
"same samples": each rank's own DP share (its TrainSamples' tokens, advantage, float32 log-probs,
mask, routing) hashes the same in both arms.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, os.path.join(_ROOT, "tests"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import format_table, proc_status, reset_peak  # noqa: E402

MB = 1e6


def size(n: float) -> str:
    return f"{n / MB:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def make_samples(a) -> list:
    import torch

    from gspo_megatron.train.batch import TrainSample

    rng = random.Random(a.seed)
    g = torch.Generator().manual_seed(a.seed)
    out = []
    for i in range(a.samples):
        n = rng.randint(a.min_tokens, a.max_tokens)
        p = max(1, n // 4)
        r = n - p
        routing = torch.randint(0, a.experts, (n - 1, a.layers, a.topk), generator=g, dtype=torch.int32)
        out.append(TrainSample([rng.randrange(150_000) for _ in range(p)], [rng.randrange(150_000) for _ in range(r)],
                               rng.gauss(0, 1), [-rng.expovariate(1.0) for _ in range(r)], routing,
                               token_mask=[rng.random() < 0.9 for _ in range(r)] if i % 3 == 0 else None))
    return out


class ReceivedBytes:
    """Payload bytes this rank receives through torch.distributed's broadcast / scatter while in
    the block (both names they are reached by: broadcast_object_list calls the c10d one)."""

    def __init__(self, rank: int):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.rank, self.n = rank, 0
        self.modules = (dist, c10d)
        self.real = {k: getattr(c10d, k) for k in ("broadcast", "scatter")}

    def __enter__(self):
        real = self.real

        def source(src, group, kw):  # a global rank, given as one or as a rank in `group`
            if src is not None:
                return src
            import torch.distributed as dist

            return dist.get_global_rank(group or dist.group.WORLD, kw.get("group_src") or 0)

        def broadcast(tensor, src=None, group=None, *a, **kw):
            if self.rank != source(src, group, kw):
                self.n += tensor.nbytes
            return real["broadcast"](tensor, src, group, *a, **kw)

        def scatter(tensor, scatter_list=None, src=None, group=None, *a, **kw):
            if self.rank != source(src, group, kw):
                self.n += tensor.nbytes
            return real["scatter"](tensor, scatter_list, src, group, *a, **kw)

        for m in self.modules:
            m.broadcast, m.scatter = broadcast, scatter
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.broadcast, m.scatter = self.real["broadcast"], self.real["scatter"]


def digest(samples, owned) -> str:
    """sha256 of this DP rank's samples' content, as collation reads it."""
    import torch

    h = hashlib.sha256()
    for i in sorted(owned):
        x = samples[i]
        h.update(repr((i, x.prompt_ids, x.response_ids, float(x.advantage), x.token_mask)).encode())
        if x.engine_logprobs is not None:
            h.update(torch.as_tensor(x.engine_logprobs, dtype=torch.float32).numpy().tobytes())
        if x.routing is not None:
            h.update(x.routing.to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def _arm(name, ctx, plane, samples, a):
    import torch.distributed as dist

    from gspo_megatron.train.batch import dp_owners
    from gspo_megatron.train.loop import _broadcast, distribute

    dist.barrier()
    start = proc_status()["VmRSS"]
    reset_peak()
    t0 = time.perf_counter()
    with ReceivedBytes(ctx.rank) as count:
        if name == "old":
            got = _broadcast(samples if ctx.rank == 0 else None)
            random.Random(a.seed).shuffle(got)
        else:
            mine = None
            if ctx.rank == 0:
                mine = list(samples)
                random.Random(a.seed).shuffle(mine)
            got = distribute(plane, mine, a.minibatches)
    dt = time.perf_counter() - t0
    peak = proc_status()["VmHWM"]
    owned = [i for i, o in enumerate(dp_owners([x.length for x in got], ctx.dp, a.minibatches)) if o == ctx.dp_rank]
    out = {"bytes": count.n, "time": dt, "peak": peak, "peak_delta": peak - start, "digest": digest(got, owned),
           "own_samples": len(owned)}
    del got
    return out


def _rank(rank, world, a):
    import torch

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel.dataplane import DataPlane
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    torch.set_num_threads(1)
    ctx = init_parallel(ParallelConfig(tp=a.tp, device="cpu"))
    try:
        plane = DataPlane(ctx)
        samples = make_samples(a) if rank == 0 else None
        res = {"coords": f"dp{ctx.dp_rank} tp{ctx.tp_rank}"}
        for name in ("new", "old"):
            res[name] = _arm(name, ctx, plane, samples, a)
        return res
    finally:
        destroy_parallel()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--min-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=48, help="routed layers (Qwen3-30B-A3B: 48)")
    ap.add_argument("--topk", type=int, default=8, help="experts per token (Qwen3-30B-A3B: 8)")
    ap.add_argument("--experts", type=int, default=128, help="experts per layer (Qwen3-30B-A3B: 128)")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--minibatches", type=int, default=4, help="train.minibatches_per_step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the spawned run (all ranks)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes at DP2 (seconds): the harness runs")
    a = ap.parse_args(argv)
    if a.smoke:
        a.samples, a.min_tokens, a.max_tokens, a.layers, a.topk, a.experts, a.dp, a.tp = 12, 8, 40, 3, 2, 8, 2, 1
    from dist_utils import run_distributed

    world = a.dp * a.tp
    tokens_est = a.samples * (a.min_tokens + a.max_tokens) / 2
    print(f"{a.samples} samples x {a.min_tokens}-{a.max_tokens} tokens (~{tokens_est / 1e3:.0f}k tokens), routing "
          f"{a.layers} layers x top-{a.topk} of {a.experts} experts, {a.minibatches} minibatches; DP{a.dp} x TP{a.tp} "
          f"({world} gloo processes)", flush=True)
    t0 = time.perf_counter()
    res = run_distributed(_rank, world, a, timeout=a.timeout, fresh=True)
    print(f"run done in {time.perf_counter() - t0:.0f} s (spawn + generate + both arms)")
    rows = []
    for r, x in enumerate(res):
        o, n = x["old"], x["new"]
        rows.append([f"rank {r} ({x['coords']})", size(o["bytes"]), size(n["bytes"]),
                     f"{o['bytes'] / n['bytes']:.1f}x" if n["bytes"] else "-",
                     f"{o['time']:.2f}", f"{n['time']:.2f}",
                     f"{o['peak'] / MB:,.0f} (+{o['peak_delta'] / MB:,.0f})",
                     f"{n['peak'] / MB:,.0f} (+{n['peak_delta'] / MB:,.0f})"])
    recv = res[1:]  # rank 0 only sends
    old_b = sum(x["old"]["bytes"] for x in recv)
    new_b = sum(x["new"]["bytes"] for x in recv)
    t_old = max(x["old"]["time"] for x in res)
    t_new = max(x["new"]["time"] for x in res)
    rows.append(["all ranks (sum / max)", size(old_b), size(new_b),
                 f"{old_b / new_b:.1f}x" if new_b else "-", f"{t_old:.2f}", f"{t_new:.2f}",
                 f"{max(x['old']['peak'] for x in res) / MB:,.0f}", f"{max(x['new']['peak'] for x in res) / MB:,.0f}"])
    print(format_table(["bytes/rank received", "old", "new", "old/new", "old s", "new s",
                        "old peak RSS MB", "new peak RSS MB"], rows))
    print(f"time (slowest rank): old {t_old:.2f} s, new {t_new:.2f} s, {t_old / max(t_new, 1e-9):.1f}x faster")
    same = all(x["old"]["digest"] == x["new"]["digest"] for x in res)
    print(f"same samples: {'yes' if same else 'NO'} (each rank's own DP share, {[x['new']['own_samples'] for x in res]} "
          "samples)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
