"""Token log-prob forward+backward: time and peak memory of four implementations, side by side.

    python bench/bench_logprobs.py                                  # 4096 x 151936, H=2048
    python bench/bench_logprobs.py --tokens 512 --vocab 32768 --hidden 256   # quick
    python bench/bench_logprobs.py --smoke        # 256 x 4096, H=64, fp32, TP1 (one process): seconds

Implementations (all compute log softmax(logits)[target] and its gradient):
  naive     torch.log_softmax(logits.float()) + gather; at TP2 the logit shards are first
            all-gathered (a naive implementation needs the full vocabulary).
  megatron  megatron.core.tensor_parallel.vocab_parallel_cross_entropy (returns -log p). It needs
            Megatron's parallel_state: the workers call init_process_group('gloo') and
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp), which works
            on CPU. It works in place on float32 logits (they are destroyed) and makes a float32
            copy of bf16 logits.
  chunked   gspo_megatron.parallel.logprobs.vocab_parallel_log_probs (token chunks, not in place).
  fused     gspo_megatron.parallel.logprobs.fused_vocab_parallel_log_probs (hidden section only).
  mm3, mm4  hidden section only, reference points rather than implementations: the bare matmuls
            (bf16/fp32 as the inputs, no softmax, no autograd) that an unfused method (mm3:
            logits, grad of the weight, grad of the hidden) and an exact fused method that keeps
            no logits for backward (mm4: the same plus recomputing the logits) cannot avoid.
            mm4 / megatron is the floor of the fused ratio on this machine.

Two sections:
  logits    inputs: the logits shard [N, V/tp] (leaf); output-layer matmul not included.
  hidden    inputs: hidden [N, H] and the weight shard [V/tp, H]; the unfused methods first
            compute logits = hidden @ W.T (so they are timed with the matmul and its backward),
            the fused one never materialises them. Hidden goes through Megatron's
            copy_to_tensor_model_parallel_region at TP2, as in the model.

What is measured, per rank (each (tp, dtype) runs in fresh processes; TP2 = 2 gloo processes; each
rank uses --threads torch threads, default 1):
  time      wall seconds of one forward+backward: min over --repeats rounds that interleave the
            methods, after one untimed run per method (the memory run). Max over TP ranks.
  peak      the kernel's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs
            before each method) minus the resident set at that moment: every byte the run
            touches beyond the inputs, including the gradients it returns and allocator slack.
            glibc is told to serve every allocation >= 64 KiB with mmap (MALLOC_MMAP_THRESHOLD_)
            so freed tensors leave the resident set and do not hide later peaks. This is the
            CPU analogue of torch.cuda.max_memory_allocated() - baseline.
  extra     peak minus the gradients that any implementation must return (grad of the logits in
            the logits section; grads of hidden and weight in the hidden section), i.e. the
            memory an implementation needs for itself. (Megatron's backward writes the gradient
            into the logits' own storage, so in the logits section its peak can be at or below
            the size of the returned gradient.)
  logits    size of this rank's logits [N, V/tp] in the input dtype (the unit of the ratios).
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("naive", "megatron", "chunked", "fused", "mm3", "mm4")
MATMUL_ONLY = ("mm3", "mm4")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MiB = 1024 * 1024


def _mem_mib() -> tuple[float, float]:
    with open("/proc/self/status") as f:
        s = f.read()
    hwm = int(re.search(r"VmHWM:\s+(\d+)", s).group(1)) / 1024
    rss = int(re.search(r"VmRSS:\s+(\d+)", s).group(1)) / 1024
    return hwm, rss


def _reset_peak() -> float:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _mem_mib()[1]


class _GatherVocab(torch.autograd.Function):
    """All-gather logit shards along the vocab; backward keeps this rank's slice (the loss built
    on the gathered logits is replicated on every TP rank)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.sl = (rank * x.shape[1], (rank + 1) * x.shape[1])
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        return g[:, ctx.sl[0]:ctx.sl[1]].contiguous(), None


def _logp(method, logits, targets, group, tp):
    from gspo_megatron.parallel.logprobs import vocab_parallel_log_probs

    if method == "naive":
        full = _GatherVocab.apply(logits, group) if tp > 1 else logits
        return torch.log_softmax(full.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)
    if method == "megatron":
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(logits, targets)
    if method == "chunked":
        return vocab_parallel_log_probs(logits, targets, group=group if tp > 1 else None)
    raise ValueError(method)


def _estimate_gib(section, method, n, v_local, h, tp, nbytes):
    """Rough total peak over all ranks, to skip what cannot fit (--max-gib)."""
    lg = n * v_local
    f32 = 4
    est = {
        "naive": lg * tp * (nbytes + 3 * f32) + lg * nbytes,
        "megatron": lg * (f32 if nbytes != f32 else 0) + lg * nbytes,
        "chunked": lg * nbytes * 2,
        "fused": (n * h + v_local * h) * nbytes * 2,
        "mm3": lg * nbytes,
        "mm4": lg * nbytes,
    }[method]
    if section == "hidden" and method != "fused":
        est += lg * nbytes
    return est * tp / 2**30


def _worker(rank, world, port, cfg, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    try:
        queue.put((rank, _run(rank, world, cfg)))
    except BaseException as e:  # noqa: BLE001
        import traceback

        queue.put((rank, f"ERROR {e!r}\n{traceback.format_exc()}"))


def _run(rank, world, cfg):
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    from gspo_megatron.parallel.logprobs import fused_vocab_parallel_log_probs

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    dtype = DTYPES[cfg["dtype"]]
    nbytes = torch.empty(0, dtype=dtype).element_size()
    n, v, h = cfg["tokens"], cfg["vocab"], cfg["hidden"]
    assert v % world == 0, "vocab must divide by tp"
    vl = v // world
    torch.manual_seed(0)
    targets = torch.randint(0, v, (n,))
    g_up = torch.randn(n)
    rows = []
    for section in cfg["sections"]:
        if section == "logits":
            inputs = {"logits": torch.randn(n, vl, dtype=dtype).mul_(3).requires_grad_(True)}
            required = n * vl * nbytes
        else:
            inputs = {"hidden": torch.randn(n, h, dtype=dtype).requires_grad_(True),
                      "weight": torch.randn(vl, h, dtype=dtype).mul_(h ** -0.5).requires_grad_(True)}
            required = (n * h + vl * h) * nbytes
        methods = []
        for method in cfg["methods"]:
            if section == "logits" and method in ("fused", *MATMUL_ONLY):
                continue
            est = _estimate_gib(section, method, n, vl, h, world, nbytes)
            if est > cfg["max_gib"]:
                rows.append(dict(section=section, method=method, skipped=f"est. {est:.1f} GiB"))
            else:
                methods.append(method)

        def step(method):
            if section == "logits":
                with torch.no_grad():
                    inputs["logits"].normal_().mul_(3)  # megatron overwrote it; same storage
            t0 = time.perf_counter()
            if method in MATMUL_ONLY:
                with torch.no_grad():
                    hid, w = inputs["hidden"], inputs["weight"]
                    for _ in range(1 + (method == "mm4")):
                        x = hid @ w.t()
                    x.t() @ hid  # grad of the weight
                    x @ w  # grad of the hidden
                    del x
                return time.perf_counter() - t0
            if section == "logits":
                lp = _logp(method, inputs["logits"], targets, group, world)
            else:
                hid = copy_to_tensor_model_parallel_region(inputs["hidden"], group=group)
                if method == "fused":
                    lp = fused_vocab_parallel_log_probs(hid, inputs["weight"], targets,
                                                        group=group if world > 1 else None)
                else:
                    lp = _logp(method, hid @ inputs["weight"].t(), targets, group, world)
            (lp * g_up).sum().backward()
            del lp
            return time.perf_counter() - t0

        def clear():
            for t in inputs.values():
                t.grad = None

        # 1) memory: one run per method from a clean state (also the warm-up)
        peaks = {}
        for method in methods:
            clear()
            dist.barrier()
            base = _reset_peak()
            step(method)
            peaks[method] = _mem_mib()[0] - base
        # 2) time: rounds over the methods interleaved, so that load from other processes on a
        #    shared machine hits all of them alike; min over rounds
        best = {m: float("inf") for m in methods}
        for _ in range(cfg["repeats"]):
            for method in methods:
                clear()
                dist.barrier()
                best[method] = min(best[method], step(method))
        clear()
        for method in methods:
            rows.append(dict(section=section, method=method, time=best[method], peak=peaks[method],
                             extra=peaks[method] - required / MiB, logits=n * vl * nbytes / MiB))
        del inputs
    dist.destroy_process_group()
    return rows


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world, cfg):
    import torch.multiprocessing as mp

    # before the children start: glibc reads it at process start
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = {}
    try:
        while len(out) < world:
            rank, res = q.get(timeout=cfg["timeout"])
            if isinstance(res, str):
                raise RuntimeError(f"rank {rank}: {res}")
            out[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    # per method: max time and max peak over ranks
    merged = []
    for i, row in enumerate(out[0]):
        row = dict(row)
        if "skipped" not in row:
            for r in range(1, world):
                o = out[r][i]
                row["time"] = max(row["time"], o["time"])
                row["peak"] = max(row["peak"], o["peak"])
                row["extra"] = max(row["extra"], o["extra"])
        merged.append(row)
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--sections", default="logits,hidden")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per rank (1: OpenMP barriers on a shared, oversubscribed "
                         "machine distort timings of many small ops)")
    ap.add_argument("--max-gib", type=float, default=14.0,
                    help="skip a method whose estimated peak over all ranks exceeds this")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--smoke", action="store_true",
                    help="--tokens 256 --vocab 4096 --hidden 64 --dtypes fp32 --tp 1 --repeats 1 (4 MiB of logits), "
                         "every method and section in one process (TP2's gathers not exercised): seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.tokens, a.vocab, a.hidden, a.dtypes, a.tp, a.repeats = 256, 4096, 64, "fp32", "1", 1
    print(f"# tokens={a.tokens} vocab={a.vocab} hidden={a.hidden} threads={a.threads} "
          f"repeats={a.repeats} torch={torch.__version__}", flush=True)
    hdr = (f"{'section':8} {'tp':>2} {'dtype':5} {'method':9} {'time_s':>8} {'x_megatron':>10} "
           f"{'peak_MiB':>9} {'extra_MiB':>9} {'logits_MiB':>10} {'extra/logits':>12}")
    print(hdr)
    print("-" * len(hdr), flush=True)
    for tp in [int(x) for x in a.tp.split(",")]:
        for dt in a.dtypes.split(","):
            cfg = dict(tokens=a.tokens, vocab=a.vocab, hidden=a.hidden, dtype=dt, threads=a.threads,
                       methods=a.methods.split(","), sections=a.sections.split(","),
                       repeats=a.repeats, max_gib=a.max_gib, timeout=a.timeout)
            rows = _launch(tp, cfg)
            for sec in cfg["sections"]:
                sec_rows = [r for r in rows if r["section"] == sec]
                ref = next((r["time"] for r in sec_rows if r["method"] == "megatron" and "time" in r), None)
                for r in sec_rows:
                    if "skipped" in r:
                        print(f"{sec:8} {tp:>2} {dt:5} {r['method']:9} skipped ({r['skipped']})")
                        continue
                    ratio = f"{r['time'] / ref:10.2f}" if ref else f"{'-':>10}"
                    print(f"{sec:8} {tp:>2} {dt:5} {r['method']:9} {r['time']:8.3f} {ratio} "
                          f"{r['peak']:9.0f} {r['extra']:9.0f} {r['logits']:10.0f} "
                          f"{r['extra'] / r['logits']:12.3f}", flush=True)


if __name__ == "__main__":
    main()
