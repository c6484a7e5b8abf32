"""Samples from rank 0 to the DP ranks that train on them (parallel/dataplane.py, train/loop.py
`distribute`, train/batch.py encode_shares / decode_share).

Reference: what the loop did before: every rank held every sample (a full broadcast) and planned
its microbatches from them. Here every rank builds the same seeded samples itself (the reference),
rank 0 distributes them, and on every rank of DP2xTP2, DP2xCP2, DP2xPP2 and DP4 (4 gloo processes):
  - the samples its DP rank's plan collates are TrainSamples equal to the reference (tokens,
    advantage, engine log-probs as float32, token masks, routing in its dtype with -1 kept, None
    fields None), every other one a RemoteSample of the same lengths; which ones are this DP
    rank's comes from plan_microbatches on the reference list, not from the data plane's split;
  - every microbatch planned from what it received (packed and padded, this CP rank's part) equals
    the one planned from the reference, tensor by tensor;
  - bytes received, counted by wrapping torch.distributed's collectives: the header and exactly
    this DP rank's share (a leader's scatter part padded to the largest share), so no rank receives
    another DP rank's content, and nothing is pickled (no broadcast_object_list); the data plane's
    own count (DataPlane.traffic) agrees;
  - a batch rank 0 cannot encode makes rank 0 raise its error and every other rank a RuntimeError,
    and the data plane still works after it.
The bench's --smoke mode runs too (old vs new, tiny sizes), so bench/bench_dataplane.py cannot rot.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"dp2_tp2": dict(tp=2), "dp2_cp2": dict(cp=2), "dp2_pp2": dict(pp=2), "dp4": dict()}
LAYERS, TOPK = 3, 2


def make_samples(kind: str, n: int, seed: int) -> list:
    """The same list on every rank. "engine": routing on every sample (int32 and int64, -1 among
    them, one sample with expert ids past 254 so its routing travels as int16), engine log-probs,
    token masks on some, an empty response; "sft": demonstrations (no log-probs, routing, masks)."""
    from gspo_megatron.train.batch import TrainSample

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = rng.randint(1, 12), (0 if i == 5 else rng.randint(1, 20))
        ids = ([rng.randrange(50_000) for _ in range(p)], [rng.randrange(50_000) for _ in range(r)])
        if kind == "sft":
            out.append(TrainSample(*ids, 0.0))
            continue
        hi = 300 if i == 3 else 128
        routing = torch.randint(-1, hi, (p + r - 1, LAYERS, TOPK), generator=g,
                                dtype=torch.int64 if i % 2 else torch.int32)
        out.append(TrainSample(*ids, rng.gauss(0, 1), [rng.gauss(-2, 1) for _ in range(r)], routing,
                               token_mask=[rng.random() < 0.7 for _ in range(r)] if i % 3 == 0 else None))
    return out


class Counter:
    """Wraps torch.distributed's collectives (both names they are reached by) for one block:
    bytes this rank received, and the pickled-object calls."""

    NAMES = ("broadcast", "scatter", "broadcast_object_list")

    def __init__(self, rank: int):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.rank, self.received, self.objects = rank, 0, 0
        self.modules = (dist, c10d)
        self.saved = [(m, k, getattr(m, k)) for m in self.modules for k in self.NAMES]

    def __enter__(self):
        real = {k: getattr(self.modules[1], k) for k in self.NAMES}

        def source(src, group, kw):  # a global rank, given as one or as a rank in `group`
            if src is not None:
                return src
            import torch.distributed as dist

            return dist.get_global_rank(group or dist.group.WORLD, kw.get("group_src") or 0)

        def broadcast(tensor, src=None, group=None, *a, **kw):
            if self.rank != source(src, group, kw):
                self.received += tensor.nbytes
            return real["broadcast"](tensor, src, group, *a, **kw)

        def scatter(tensor, scatter_list=None, src=None, group=None, *a, **kw):
            if self.rank != source(src, group, kw):
                self.received += tensor.nbytes
            return real["scatter"](tensor, scatter_list, src, group, *a, **kw)

        def broadcast_object_list(*a, **kw):
            self.objects += 1
            return real["broadcast_object_list"](*a, **kw)

        for m in self.modules:
            m.broadcast, m.scatter, m.broadcast_object_list = broadcast, scatter, broadcast_object_list
        return self

    def __exit__(self, *exc):
        for m, k, f in self.saved:
            setattr(m, k, f)


def _same_microbatch(a, b) -> list[str]:
    bad = []
    for k, v in vars(a).items():
        w = getattr(b, k)
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w)):
                bad.append(k)
        elif v != w:
            bad.append(k)
    return bad


def _check_batch(ctx, plane, kind, n, seed, minibatches) -> dict:
    from gspo_megatron.train.batch import (RemoteSample, TrainSample, dp_owners, encode_shares, plan_microbatches,
                                           split_minibatches)
    from gspo_megatron.train.loop import distribute

    reference = make_samples(kind, n, seed)
    before = plane.traffic.received
    with Counter(ctx.rank) as count:
        got = distribute(plane, reference if ctx.rank == 0 else None, minibatches)
    problems = []
    if plane.traffic.received - before != count.received:
        problems.append(f"the data plane counts {plane.traffic.received - before} bytes received, the wrapped "
                        f"collectives {count.received}")
    if count.objects:
        problems.append(f"{count.objects} pickled-object broadcasts")
    if len(got) != len(reference):
        return {"problems": [f"{len(got)} samples for {len(reference)}"]}
    owned = set()
    for packed in (False, True):
        for idx in split_minibatches(len(reference), minibatches):
            kw = dict(dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=64, multiple=2 * ctx.parallel.cp if packed else 4,
                      cp=ctx.parallel.cp, cp_rank=ctx.cp_rank, packed=packed)
            groups, want = plan_microbatches([reference[i] for i in idx], **kw)
            groups_got, have = plan_microbatches([got[i] for i in idx], **kw)
            owned |= {idx[j] for grp in groups for j in grp}
            if groups != groups_got or len(want) != len(have):
                problems.append(f"plan differs: {groups} vs {groups_got}")
                continue
            for k, (a, b) in enumerate(zip(want, have)):
                if bad := _same_microbatch(a, b):
                    problems.append(f"packed={packed} microbatch {k}: {bad} differ")
    f32 = lambda v: None if v is None else torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for i, (x, y) in enumerate(zip(reference, got)):
        if i not in owned:
            if not (isinstance(y, RemoteSample) and (y.prompt_len, y.response_len, y.has_routing)
                    == (len(x.prompt_ids), len(x.response_ids), x.routing is not None)):
                problems.append(f"sample {i} of another DP rank arrived as {y!r:.80}")
            continue
        if not isinstance(y, TrainSample):
            problems.append(f"own sample {i} is a {type(y).__name__}")
            continue
        same = (y.prompt_ids == x.prompt_ids and y.response_ids == x.response_ids and y.advantage == x.advantage
                and y.token_mask == x.token_mask
                and (x.engine_logprobs is None) == (y.engine_logprobs is None)
                and (x.engine_logprobs is None or torch.equal(f32(x.engine_logprobs), f32(y.engine_logprobs)))
                and (x.routing is None) == (y.routing is None)
                and (x.routing is None or (x.routing.dtype == y.routing.dtype and torch.equal(x.routing, y.routing))))
        if not same:
            problems.append(f"own sample {i} differs")
    # what this rank may receive: the header (and its 4 + dp sizes) and its own DP rank's share,
    # as the scatter's padded part on a leader other than rank 0
    header, _, sizes = encode_shares(reference, dp_owners([x.length for x in reference], ctx.dp, minibatches),
                                     ctx.dp)
    leader = ctx.tp_rank == ctx.cp_rank == ctx.pp_rank == 0
    share = 0 if ctx.rank == 0 else (max(sizes) if leader and ctx.dp > 1 else sizes[ctx.dp_rank])
    expected = 0 if ctx.rank == 0 else 8 * (4 + ctx.dp) + header.nbytes + share
    if count.received != expected:
        problems.append(f"received {count.received} bytes, expected {expected} (share {share} of {sizes})")
    content = count.received - (8 * (4 + ctx.dp) + header.nbytes if ctx.rank else 0)
    if content and sum(sizes) - sizes[ctx.dp_rank] and content >= sum(sizes):
        problems.append(f"received {content} bytes of content: not less than all of it ({sum(sizes)})")
    return {"problems": problems, "received": count.received, "sizes": sizes, "owned": len(owned)}


def _rank(rank, world, layout):
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel.dataplane import DataPlane
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import TrainSample
    from gspo_megatron.train.loop import distribute

    ctx = init_parallel(ParallelConfig(**layout, device="cpu"))
    try:
        plane = DataPlane(ctx)
        out = {"coords": (ctx.dp_rank, ctx.tp_rank, ctx.cp_rank, ctx.pp_rank), "batches": []}
        for kind, n, seed, minibatches in (("engine", 23, 1, 2), ("sft", 9, 2, 1), ("engine", 0, 3, 4),
                                           ("engine", 3, 4, 1)):
            out["batches"].append(_check_batch(ctx, plane, kind, n, seed, minibatches))
        bad = [TrainSample([1, 2], [3], 0.0, routing=torch.zeros(2, 1, 1))]  # float routing: not encodable
        try:
            distribute(plane, bad if rank == 0 else None, 1)
            out["abort"] = "no error"
        except (ValueError, RuntimeError) as e:
            out["abort"] = f"{type(e).__name__}: {e}"
        out["after_abort"] = _check_batch(ctx, plane, "engine", 7, 5, 1)
        return out
    finally:
        destroy_parallel()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_dp_rank_gets_exactly_its_share(name):
    results = run_distributed(_rank, 4, LAYOUTS[name], timeout=240)
    for rank, res in enumerate(results):
        for b in res["batches"] + [res["after_abort"]]:
            assert not b["problems"], f"rank {rank} {res['coords']}: {b['problems']}"
        assert res["abort"].startswith("ValueError" if rank == 0 else "RuntimeError: data plane"), res["abort"]
    # every sample is some DP rank's, each once (per DP rank, counted on its ranks)
    by_dp = {res["coords"][0]: [b["owned"] for b in res["batches"]] for res in results}
    assert [sum(c) for c in zip(*by_dp.values())] == [23, 9, 0, 3]
    assert len(by_dp) == (4 if name == "dp4" else 2)


def test_bench_smoke():
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_dataplane.py"), "--smoke"],
                       capture_output=True, text=True, timeout=240, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bytes/rank" in r.stdout and "same samples: yes" in r.stdout, r.stdout
