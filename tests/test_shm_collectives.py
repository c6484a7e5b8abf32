"""The shared-memory CPU backend (parallel/shm_collectives.py) against gloo, op by op.

Each case runs the same collective with the same per-rank inputs on a gloo group and on a
gspo_shm group of the same ranks and asserts bitwise-equal results; sizes include empty tensors
and payloads several slots long (several rounds); 3 ranks check a group size other than 2, and
1 rank the one-rank shortcut.
The rest: the fallbacks that stay on gloo (send/recv, all-to-all, object collectives) in a loop
that deadlocked when they went through ProcessGroup's pybind trampoline; a peer that exits is
reported within seconds instead of hanging; no file is left in /dev/shm and the mapping goes with
the group; init_parallel picks the backend from parallel.cpu_collectives.
"""
from __future__ import annotations

import datetime
import os

import pytest

from dist_utils import run_distributed
from gspo_megatron.parallel import shm_collectives

pytestmark = pytest.mark.skipif(not shm_collectives.available()[0], reason=shm_collectives.available()[1])


def _init(world_size: int, timeout_s: float = 120.0):
    import torch.distributed as dist

    dist.init_process_group(shm_collectives.register(), timeout=datetime.timedelta(seconds=timeout_s))
    gloo = dist.new_group(list(range(world_size)), backend="gloo")
    shm = dist.new_group(list(range(world_size)))
    assert isinstance(shm, shm_collectives.ShmProcessGroup) and dist.get_backend(shm) == shm_collectives.NAME
    return gloo, shm


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("gspo-shm-" in line for line in f)


def _ops_equal_gloo(rank, world_size):
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    gloo, shm = _init(world_size)
    slot_elems = shm_collectives.SLOT_BYTES // 4
    checked = 0

    def both(fn, *shapes, dtype, sums=False):
        """sums: a floating-point sum, which gloo adds in its ring's order; with 3 ranks that order
        differs from ours (rank order, the same on every rank), so equal to rounding there."""
        nonlocal checked
        outs = []
        for group in (gloo, shm):
            g = torch.Generator().manual_seed(1000 + rank)
            ts = [(torch.randn(s, generator=g) * 3).to(dtype) for s in shapes]
            fn(group, *ts)
            outs.append(ts)
        for a, b in zip(*outs):
            assert a.dtype == b.dtype, (fn.__name__, dtype)
            if sums and world_size > 2 and dtype.is_floating_point:
                # a few units in the last place of sums of three values up to ~15 in size
                tol = (2e-2, 0.5) if dtype == torch.bfloat16 else (1e-6, 1e-5)
                torch.testing.assert_close(b, a, rtol=tol[0], atol=tol[1])
            else:
                assert torch.equal(a, b), (fn.__name__, dtype, a.shape)
        checked += 1

    sizes = (0, 1, 7, 3 * slot_elems + 5)  # the last: several rounds per op
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for n in sizes:
            def all_gather(group, x, out):
                dist.all_gather_into_tensor(out, x, group=group)

            def reduce_scatter(group, out, x):
                dist.reduce_scatter_tensor(out, x, group=group)

            def broadcast(group, x):
                dist.broadcast(x, src=world_size - 1, group=group)

            both(all_gather, (n,), (n * world_size,), dtype=dtype)
            both(reduce_scatter, (n,), (n * world_size,), dtype=dtype, sums=True)
            both(broadcast, (n,), dtype=dtype)
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                def all_reduce(group, x, op=op):
                    dist.all_reduce(x, op=op, group=group)

                both(all_reduce, (n,), dtype=dtype, sums=op == dist.ReduceOp.SUM)

    # 2-D all-gather (Megatron's sequence-parallel gather), async handle, ops gloo keeps
    def gather_2d_async(group, x, out):
        dist.all_gather_into_tensor(out, x, group=group, async_op=True).wait()

    both(gather_2d_async, (5, 64), (5 * world_size, 64), dtype=torch.float32)

    def coalesced(group, a, b, oa, ob):
        with _coalescing_manager(group=group, async_ops=True) as cm:
            dist.all_reduce(a, group=group)
            dist.all_reduce(b, group=group)
        cm.wait()
        with _coalescing_manager(group=group, async_ops=True) as cm:
            dist.all_gather_into_tensor(oa, a, group=group)
            dist.all_gather_into_tensor(ob, b, group=group)
        cm.wait()

    both(coalesced, (3,), (70,), (3 * world_size,), (70 * world_size,), dtype=torch.float32, sums=True)

    def product(group, x):
        dist.all_reduce(x, op=dist.ReduceOp.PRODUCT, group=group)

    both(product, (9,), dtype=torch.float64, sums=True)
    dist.barrier(group=shm)
    with open("/proc/self/maps") as f:
        # "... /dev/shm/gspo-shm-<pid>-<random> (deleted)": rank 0 unlinks the file once all have mapped it
        arenas = {os.path.basename(line.split(maxsplit=5)[5].split()[0]) for line in f if "gspo-shm-" in line}
    return checked, _mappings(), os.getpid(), arenas


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_shared_memory_collective_equals_gloo_bitwise(world_size):
    """world_size 1: the one-rank shortcut (no arena, no gloo) against gloo's one-rank results."""
    out = run_distributed(_ops_equal_gloo, world_size)
    assert all(checked == 4 * 4 * 6 + 3 for checked, _, _, _ in out)
    if world_size > 1:
        assert all(m >= 1 for _, m, _, _ in out), "the shm group never mapped its arena: the fast path did not run"
    else:
        assert out[0][1] == 0, "a one-rank group mapped an arena"
    # the arena's name carries its creator's pid (group rank 0's), so the check below sees only this
    # run's files: another suite on the same machine may hold arenas of its own meanwhile
    ours = f"gspo-shm-{out[0][2]}-"
    assert all(name.startswith(ours) for o in out for name in o[3]), [o[3] for o in out]
    left = [f for f in os.listdir("/dev/shm") if f.startswith(ours)]
    assert not left, f"an arena file was left in /dev/shm: {left}"


def _cp2_one_row_mismatch(rank, world_size):
    """Issue 41: CP2 training crashed at step 2 of tiny_cpu.yaml on a one-row microbatch, in
    train/loss.py `_engine_mismatch`: `sums[:, 4].contiguous()` of the [1, 5] row sums is a [1]
    tensor with stride 5 (torch calls it contiguous), and the all-reduce's byte view of it raised.
    Here: that tensor alone through every overridden op, then `_engine_mismatch` itself on a
    one-row microbatch (each CP rank holding half of the tokens) over the shm group and over gloo."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from gspo_megatron.algorithms.mismatch import mismatch_report, mismatch_row_sums
    from gspo_megatron.train.loss import _engine_mismatch

    gloo, shm = _init(world_size)

    def column():
        """(the [1, 5] sums, its column 4 as the loss takes it: a view of the sums, stride 5)"""
        sums = torch.arange(5.0, dtype=torch.float64)[None] + 10 * rank
        top = sums[:, 4].contiguous()
        assert top.is_contiguous() and top.stride() == (5,) and top._base is sums, top.stride()
        return sums, top

    got = []
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.SUM):
        sums, top = column()
        dist.all_reduce(top, op=op, group=shm)
        got.append((top.item(), sums[0].tolist()))  # written in place, into the sums it views
    sums, top = column()
    dist.broadcast(top, src=1, group=shm)
    got.append((top.item(), sums[0].tolist()))
    out = torch.zeros(world_size, 5, dtype=torch.float64)[:, 2]  # [w] with stride 5
    dist.all_gather_into_tensor(out, column()[1], group=shm)
    got.append((out.tolist(), None))

    def rows(r):
        g = torch.Generator().manual_seed(41 + r)
        t = 6
        return (torch.randn(1, t, generator=g), torch.randn(1, t, generator=g),
                (torch.rand(1, t, generator=g) < 0.7).float())

    reports = []
    for group in (shm, gloo):
        lp, engine, mask = rows(rank)
        ctx = SimpleNamespace(parallel=SimpleNamespace(cp=world_size), cp_group=group)
        mb = SimpleNamespace(engine_logprobs=engine, loss_mask=mask)
        reports.append({k: v.item() for k, v in _engine_mismatch(ctx, mb, lp).items()})
    parts = [mismatch_row_sums(*rows(r)) for r in range(world_size)]  # [1, 5] each
    whole = torch.cat([sum(p[:, :4] for p in parts), torch.stack([p[:, 4] for p in parts]).amax(0)[:, None]], -1)
    return got, reports, {k: v.item() for k, v in mismatch_report(whole).items()}


def test_cp2_one_row_microbatch_mismatch_sums_all_reduce():
    """Failed before the fix with "self.stride(-1) must be 1 to view Double as Byte" on both ranks."""
    out = run_distributed(_cp2_one_row_mismatch, 2)
    for rank, (got, (on_shm, on_gloo), want) in enumerate(out):
        rest = [0.0, 1.0, 2.0, 3.0]
        assert got[0] == (14.0, [x + 10 * rank for x in rest] + [14.0]), got
        assert got[1] == (18.0, [x + 10 * rank for x in rest] + [18.0]), got
        assert got[2] == (14.0, [x + 10 * rank for x in rest] + [14.0]), got
        assert got[3] == ([4.0, 14.0], None), got
        assert on_shm == want and on_gloo == want, (on_shm, on_gloo, want)


def _fallbacks_loop(rank, world_size):
    """The ops the group leaves to gloo, many times over: each used to go through pybind's
    trampoline holding the GIL while gloo's worker thread wanted it (a deadlock within a few
    hundred calls in the trainer's checkpoint checksums)."""
    import torch
    import torch.distributed as dist

    _, shm = _init(world_size, timeout_s=60)
    for i in range(300):
        objs = [None] * world_size
        dist.all_gather_object(objs, {"rank": rank, "i": i}, group=shm)
        assert [o["rank"] for o in objs] == list(range(world_size))
        box = [f"step {i}" if rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=shm)
        assert box == [f"step {i}"]
        t = torch.arange(4.0) + i
        if rank == 0:
            dist.send(t, 1, group=shm)
        elif rank == 1:
            r = torch.empty(4)
            dist.recv(r, 0, group=shm)
            assert torch.equal(r, t)
        x = torch.arange(world_size * 2.0) + rank
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x, group=shm)
        lst = [torch.empty(3) for _ in range(world_size)]
        dist.all_gather(lst, torch.full((3,), float(rank)), group=shm)
        assert [int(v[0]) for v in lst] == list(range(world_size))
    before = _mappings()
    dist.destroy_process_group()
    return before, _mappings()


def test_ops_left_to_gloo_do_not_deadlock_and_the_mapping_goes_with_the_group():
    out = run_distributed(_fallbacks_loop, 2, timeout=120)
    for before, after in out:
        assert before >= 1 and after == 0, (before, after)


def _peer_exits(rank, world_size):
    import time

    import torch
    import torch.distributed as dist

    _, shm = _init(world_size, timeout_s=600)
    x = torch.ones(4)
    dist.all_reduce(x, group=shm)  # the arena exists on both ranks
    if rank == 1:
        os._exit(0)  # a rank that dies without a word
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=shm)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


def test_a_peer_that_exits_is_reported_not_waited_for():
    """Rank 1 exits after the first all-reduce; rank 0, already waiting in the next one (group
    timeout 600 s), raises within a few seconds naming the rank that is gone."""
    import pickle
    import queue as _q

    import torch.multiprocessing as mp

    from dist_utils import _worker, free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(_peer_exits, r, 2, port, (), results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:
            rank, ok, out = results.get(timeout=120)
            if rank == 0:
                break
        assert ok, out
        msg, waited = pickle.loads(out)
    except _q.Empty:
        pytest.fail("rank 0 did not report within 120 s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    assert "group rank 1" in msg and "has exited" in msg, msg
    assert waited < 30, waited


def _arena_refused(rank, world_size):
    """/dev/shm full on rank 0 (posix_fallocate fails): the group says so and runs on gloo."""
    import torch
    import torch.distributed as dist

    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    if rank == 0:
        os.posix_fallocate = full
    try:
        _, shm = _init(world_size, timeout_s=60)
        x = torch.full((5,), float(rank + 1))
        dist.all_reduce(x, group=shm)
        out = torch.empty(5 * world_size)
        dist.all_gather_into_tensor(out, x, group=shm)
        return x.tolist(), out.tolist(), shm._arena is None, _mappings()
    finally:
        os.posix_fallocate = real


def test_a_refused_arena_falls_back_to_gloo_on_every_rank(capfd):
    out = run_distributed(_arena_refused, 2, fresh=True)
    for summed, gathered, no_arena, maps in out:
        assert summed == [3.0] * 5 and gathered == [3.0] * 10
        assert no_arena and maps == 0
    assert "shared memory unavailable" in capfd.readouterr().err


def _init_parallel_backend(rank, world_size, choice):
    import torch.distributed as dist

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(tp=world_size, cpu_collectives=choice, device="cpu"), timeout_s=120)
    try:
        return dist.get_backend(), dist.get_backend(ctx.tp_group), type(ctx.tp_group).__name__
    finally:
        destroy_parallel()


@pytest.mark.parametrize("choice,backend", [("shm", "gspo_shm"), ("gloo", "gloo")])
def test_init_parallel_takes_the_backend_from_the_config(choice, backend):
    out = run_distributed(_init_parallel_backend, 2, choice)
    assert all(o[0] == backend and o[1] == backend for o in out), out


def test_config_refuses_an_unknown_cpu_collectives():
    from gspo_megatron.config import ConfigError, ParallelConfig

    with pytest.raises(ConfigError, match="parallel.cpu_collectives must be shm|gloo"):
        ParallelConfig(cpu_collectives="nccl")
