"""Megatron's distributed optimizer (ZeRO-1: fp32 masters and Adam moments sharded over DP,
gradients reduce-scattered, parameters all-gathered) on CPU/gloo through the CPU runtime: three
optimizer steps give the same weights as the plain optimizer, in fp32 and with bf16 parameters
(fp32 masters) — the configuration clusters run (optimizer.use_distributed_optimizer=true, the
default, and model.dtype=bfloat16 in the GPU presets)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import random_sequences

STEPS = 3
LR = 2e-3


def _train(ctx, arch, dtype, distributed, samples, clip, init=None):
    """Build, optionally copy `init` weights in, wrap, take STEPS optimizer steps on the token NLL;
    returns (HF-named weights gathered to rank 0, the model's param dtype, optimizer kind)."""
    from types import SimpleNamespace

    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.train.batch import plan_minibatch
    from gspo_megatron.train.loop import _optimizer_step
    from gspo_megatron.train.loss import sft_loss_step
    from gspo_megatron.train.optim import build_optimizer, inner_optimizers
    from gspo_megatron.train.scoring import pad_multiple
    from gspo_megatron.config import OptimizerConfig

    chunks, tcfg = build_policy(ctx, arch, dtype=dtype)
    if init is not None:
        with torch.no_grad():
            for c, src in zip(chunks, init):
                for p, q in zip(c.parameters(), src):
                    p.copy_(q)
    before = [[p.detach().clone() for p in c.parameters()] for c in chunks]
    model = wrap_ddp(chunks, tcfg, use_distributed_optimizer=distributed)
    opt, _ = build_optimizer(OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=clip), model, dtype=dtype)
    parts = SimpleNamespace(model=model)
    mbs, _ = plan_minibatch(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=32,
                            multiple=pad_multiple(ctx.parallel), pad_id=0)
    norms = [float(_optimizer_step(parts, opt, None, sft_loss_step(ctx, arch.vocab_size), mbs)[1])
             for _ in range(STEPS)]
    weights = dict(iter_hf_tensors(model, ctx, arch))
    kinds = sorted(type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt]))
    # the CPU runtime's Adam is torch's fused kernel (train/optim.py fuse_cpu_adam) in every group
    kinds.append("fused" if all(g["fused"] for o in inner_optimizers(opt) for g in o.optimizer.param_groups)
                 else "unfused")
    after = [p.detach().float() for c in chunks for p in c.parameters()]
    moved = float(sum((a - b.float()).norm() ** 2 for a, b in zip(after, [t for c in before for t in c])) ** 0.5
                  / sum(b.float().norm() ** 2 for c in before for b in c) ** 0.5)
    return weights, before, kinds, len(mbs), moved, norms


def _rank(rank, world, layout, dtype_name, clip):
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.factory import parse_dtype
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import TrainSample
    from megatron_utils import tiny_hf_config

    dtype = parse_dtype(dtype_name)
    arch = MoeArch.from_hf_dict(tiny_hf_config(num_hidden_layers=2).to_dict(), source="test")
    ctx = init_parallel(ParallelConfig(**layout), model_dims=arch.dims_for_validation())
    seqs = random_sequences(300, [9, 14, 6, 11, 17, 8, 12, 5], seed=5)
    samples = [TrainSample(s[:3], s[3:], 0.0) for s in seqs]
    plain, before, kinds_plain, n_micro, moved, norms = _train(ctx, arch, dtype, False, samples, clip)
    dist_w, _, kinds_dist, _, _, dist_norms = _train(ctx, arch, dtype, True, samples, clip, init=before)
    destroy_parallel()
    if rank != 0:
        return None
    return dict(plain=plain, dist=dist_w, kinds_plain=kinds_plain, kinds_dist=kinds_dist, n_micro=n_micro,
                moved=moved, norms=norms, dist_norms=dist_norms)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / (b.double().norm() + 1e-30))


LAYOUTS = [
    pytest.param(1, dict(), id="dp1"),  # one-rank buffers: parallel/ddp.py's collective shortcuts
    pytest.param(2, dict(), id="dp2"),
    pytest.param(4, dict(ep=2), id="ep2xdp2"),
    pytest.param(4, dict(tp=2, sequence_parallel=True), id="tp2xdp2"),
]


# bf16 runs without gradient clipping: the global norm is summed in another order over DP shards
# (1-ulp differences in the clip factor), which flips a few bf16 roundings of the weights and then
# grows through bf16 forward passes (measured: 5.5e-4 relative after 3 steps at DP2). Without
# clipping the two optimizers give bit-identical bf16 weights; fp32 runs clip (norm > 1 below).
@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype,clip", [("float32", 1.0), ("bfloat16", 0.0)], ids=["fp32-clip", "bf16"])
@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_distributed_optimizer_matches_plain_optimizer(world, layout, dtype, clip):
    out = run_distributed(_rank, world, layout, dtype, clip, timeout=560)[0]
    assert "DistributedOptimizer" in out["kinds_dist"] and "DistributedOptimizer" not in out["kinds_plain"]
    assert "fused" in out["kinds_dist"] and "fused" in out["kinds_plain"]
    if dtype == "bfloat16":
        assert "Float16OptimizerWithFloat16Params" in out["kinds_plain"]  # fp32 masters on both sides
    assert out["n_micro"] >= 2  # DP ranks hold several microbatches each
    assert out["moved"] > 1e-3  # the steps really changed the weights (relative to their norm)
    plain, dist_w = out["plain"], out["dist"]
    assert set(plain) == set(dist_w)
    worst = max((_rel(dist_w[k], plain[k]), k) for k in plain)
    print(f"{world} ranks {layout} {dtype}: weights moved {out['moved']:.2e}, "
          f"worst relative difference {worst[0]:.2e} at {worst[1]}")
    assert worst[0] <= 1e-5, worst
    assert all(t.dtype == getattr(torch, dtype) for t in dist_w.values())
    assert out["dist_norms"] == pytest.approx(out["norms"], rel=1e-5)
    if clip:
        assert out["norms"][0] > clip  # the clipping branch ran


def _shortcut_rank(rank, world_size):
    """The one-rank shortcuts of parallel/ddp.py around stand-ins for torch's collectives that
    record their calls: on a one-rank group nothing is called and the buffers hold what the
    collectives would have left; on two ranks every call goes through."""
    import torch.distributed as dist

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel import ddp
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    init_parallel(ParallelConfig(device="cpu"))
    try:
        return _shortcuts(rank, world_size)
    finally:
        destroy_parallel()


def _shortcuts(rank, world_size):
    import torch.distributed as dist

    from gspo_megatron.parallel import ddp

    calls = []

    def all_gather(out, inp, group=None, async_op=False):
        calls.append("all_gather")
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)

    def reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append("reduce_scatter")
        return dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)

    ag, rs = ddp._single_rank_all_gather(all_gather), ddp._single_rank_reduce_scatter(reduce_scatter)
    cm = ddp._single_rank_coalescing(dist.distributed_c10d._coalescing_manager)
    group = dist.group.WORLD
    params = torch.zeros(4 * world_size)
    shard = params.view(world_size, 4)[rank]  # the distributed optimizer's layout: a view of the bucket
    shard.copy_(torch.arange(4.0) + 10 * rank)
    grads = torch.full((4 * world_size,), float(rank + 1))
    with cm(group, async_ops=False) as h:
        ag(params, shard, group=group)
    h.wait()
    with cm(group, async_ops=False) as h:
        rs(grads.view(world_size, 4)[rank], grads, op=dist.ReduceOp.SUM, group=group)
    h.wait()
    # a separate output (not a view of the input) is still filled
    out = torch.zeros(4 * world_size)
    ag(out, shard, group=group)
    return calls, params, grads.view(world_size, 4)[rank].clone(), out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_single_rank_collective_shortcuts(world):
    calls, params, reduced, out = run_distributed(_shortcut_rank, world, timeout=100)[0]
    want = torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])
    assert torch.equal(params, want) and torch.equal(out, want)
    assert torch.equal(reduced, torch.full((4,), float(sum(range(1, world + 1)))))
    assert calls == ([] if world == 1 else ["all_gather", "reduce_scatter", "all_gather"])
