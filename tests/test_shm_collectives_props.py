"""The shared-memory CPU backend (parallel/shm_collectives.py) against the definition of each
collective, over random shapes, strides, views and dtypes.

tests/test_shm_collectives.py compares the backend with gloo op by op on contiguous 1-D tensors.
Callers pass more than that: Megatron and the trainer hand over slices, transposes, 0-dim
scalars and one-element columns such as `sums[:, 4].contiguous()` of a one-row microbatch (a
size-1 dim keeps its stride 5, and torch calls that contiguous: the CP2 crash of issue 41). Here
every case builds each rank's tensors as views (`as_strided`) into a larger random buffer, runs
the collective on the gspo_shm group, and checks the whole buffer afterwards: the view's elements
hold the collective's result as defined below, every other element of the buffer is unchanged.
A case whose written tensor shares memory between its elements (an expanded view) has no
defined result and must be refused: one line, naming the backend and the op, raised before
any rank enters the collective.

The definition, computed by each rank from every rank's inputs (regenerated from the case's
seeds, no communication): all_reduce / reduce_scatter reduce over the ranks elementwise in rank
order in the tensor's dtype (the order the backend documents), integers in int64 then wrapped
to their width, bool as or (SUM, MAX) / and (PRODUCT, MIN); all_gather concatenates the ranks'
inputs in row-major element order; broadcast copies the source rank's tensor. The definition is
itself checked against gloo on the cases with contiguous tensors (gloo adds three ranks' floats
in its ring's order, so there to rounding). Gloo is not the reference on strided views: it
treats a tensor's memory as dense from its first element (an all_reduce of `x[:, ::2]` sums
the wrong elements), so the non-dense cases are counted against gloo only for information.

Cases are generated from a fixed seed; one spawned group runs all of them (under a minute).
"""
from __future__ import annotations

import random

import pytest

from dist_utils import run_distributed
from gspo_megatron.parallel import shm_collectives
from test_shm_collectives import _init

pytestmark = pytest.mark.skipif(not shm_collectives.available()[0], reason=shm_collectives.available()[1])

DTYPES = ("bool", "int8", "int32", "int64", "bfloat16", "float16", "float32", "float64")
LAYOUTS = ("contiguous", "offset", "permuted", "step", "size1_strides", "expanded", "empty")
REDUCE_OPS = ("SUM", "PRODUCT", "MAX", "MIN")
# ops the backend leaves to gloo; included so that a view handed to them is handled too
BITWISE_OPS = ("BAND", "BOR", "BXOR")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_reduce_coalesced",
         "all_gather_coalesced", "reduce_scatter_coalesced", "all_gather_list", "barrier")


# -- case generation (pure; every rank makes the same list) --

def _shape(rng: random.Random, layout: str) -> tuple:
    if layout == "empty":
        dims = [rng.choice((0, 1, 3)) for _ in range(rng.randint(1, 3))]
        dims[rng.randrange(len(dims))] = 0
        return tuple(dims)
    ndim = rng.choice((0, 1, 1, 2, 2, 3)) if layout in ("contiguous", "offset") else rng.choice((1, 2, 2, 3))
    dims = [rng.choice((1, 2, 3, 5, 8)) for _ in range(ndim)]
    if layout == "size1_strides" and 1 not in dims:
        dims[rng.randrange(len(dims))] = 1
    if layout == "expanded" and all(d == 1 for d in dims):
        dims[rng.randrange(len(dims))] = 3
    if layout == "permuted" and len(dims) == 1:
        dims.append(rng.choice((2, 3)))
    return tuple(dims)


def _strides(rng: random.Random, shape: tuple, layout: str) -> tuple:
    def contiguous(sizes):
        st, acc = [], 1
        for s in reversed(sizes):
            st.append(acc)
            acc *= max(s, 1)
        return list(reversed(st))

    n = len(shape)
    if layout == "permuted":  # a transpose / permute of a contiguous tensor
        order = list(range(n))
        while n > 1 and order == list(range(n)):
            rng.shuffle(order)
        inner = contiguous([shape[d] for d in order])
        st = [0] * n
        for i, d in enumerate(order):
            st[d] = inner[i]
        return tuple(st)
    if layout == "step":  # x[..., ::k] along one dim with more than one element
        big = [d for d in range(n) if shape[d] > 1] or list(range(n))
        d, k = rng.choice(big), rng.choice((2, 3))
        sizes = list(shape)
        sizes[d] *= k
        st = contiguous(sizes)
        st[d] *= k
        return tuple(st)
    st = contiguous(shape)
    if layout == "size1_strides":  # e.g. sums[:, 4] of a one-row [1, 5]: size 1, stride 5
        st = [rng.choice((3, 5, 7)) if s == 1 else x for s, x in zip(shape, st)]
    if layout == "expanded":  # x.expand(...): a dim of several elements over one (stride 0)
        st[rng.choice([d for d in range(n) if shape[d] > 1])] = 0
    return tuple(st)


def _spec(rng: random.Random, shape: tuple, layout: str) -> dict:
    return {"shape": shape, "strides": _strides(rng, shape, layout), "layout": layout,
            "offset": 0 if layout == "contiguous" else rng.randint(1, 5)}


def _cases(world_size: int, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        dtype = rng.choice(DTYPES)
        case = {"i": i, "kind": kind, "dtype": dtype, "seed": seed * 100_000 + i}
        count = 1 if not kind.endswith("coalesced") else rng.choice((2, 3))

        def layout():  # the shared-memory views (expanded) and empty tensors half as often as the rest
            return rng.choice(LAYOUTS + LAYOUTS[:5])

        if kind.startswith("all_reduce"):
            ops = REDUCE_OPS + (BITWISE_OPS if dtype in ("bool", "int8", "int32", "int64") else ())
            case["op"] = rng.choice(ops) if kind == "all_reduce" else rng.choice(REDUCE_OPS)
            specs = []
            for _ in range(count):
                lay = layout()
                specs.append({"x": _spec(rng, _shape(rng, lay), lay)})
        elif kind == "broadcast":
            case["src"] = rng.randrange(world_size)
            lay = layout()
            specs = [{"x": _spec(rng, _shape(rng, lay), lay)}]
        elif kind.startswith("all_gather"):  # "x" the input, "out" the output ([w*n0, ...] or flat)
            specs = []
            for _ in range(count):
                lin, lout = layout(), layout()
                shape = _shape(rng, lin)
                # torch's two documented forms: the inputs concatenated along dim 0, or stacked
                if shape and rng.random() < 0.5:
                    out_shape = (world_size * shape[0],) + shape[1:]
                else:
                    out_shape = (world_size,) + shape
                if lout == "expanded" and _numel(out_shape) < 2:
                    lout = "contiguous"
                if lout == "size1_strides" and 1 not in out_shape:
                    lout = "offset"
                if lout == "permuted" and len(out_shape) < 2:
                    lout = "step"
                spec = {"x": _spec(rng, shape, lin), "out": _spec(rng, out_shape, lout)}
                if kind == "all_gather_list" and lout == "expanded":
                    # the list holds the output's rank blocks (split along dim 0): a stride 0 there
                    # would make blocks alias each other, which no backend can see; within a block
                    later = [d for d in range(1, len(out_shape)) if out_shape[d] > 1]
                    st = list(_strides(rng, out_shape, "contiguous"))
                    if later:
                        st[rng.choice(later)] = 0
                    else:
                        spec["out"]["layout"] = "contiguous"
                    spec["out"]["strides"] = tuple(st)
                specs.append(spec)
        elif kind == "reduce_scatter" or kind == "reduce_scatter_coalesced":  # "out" [n0, ...], "x" [w*n0, ...]
            case["op"] = rng.choice(REDUCE_OPS) if kind == "reduce_scatter" else "SUM"
            specs = []
            for _ in range(count):
                lout, lin = layout(), layout()
                shape = _shape(rng, lout) or (1,)
                in_shape = (world_size * shape[0],) + shape[1:]
                if lin == "expanded" and _numel(in_shape) < 2:
                    lin = "step"
                if lin == "size1_strides" and 1 not in in_shape:
                    lin = "offset"
                if lin == "permuted" and len(in_shape) < 2:
                    lin = "step"
                specs.append({"x": _spec(rng, in_shape, lin), "out": _spec(rng, shape, lout)})
        else:  # barrier
            specs = []
        case["tensors"] = specs
        cases.append(case)
    # several slots per op (multi-round) with strided views: one of each main kind
    big = 3 * shm_collectives.SLOT_BYTES // 4 // 2 + 7
    for j, kind in enumerate(("all_reduce", "all_gather", "reduce_scatter", "broadcast")):
        spec_x = {"shape": (big,), "strides": (2,), "layout": "step", "offset": 3}
        case = {"i": n + j, "kind": kind, "dtype": "float32", "seed": seed * 100_000 + n + j, "op": "SUM", "src": 0}
        if kind == "all_gather":
            case["tensors"] = [{"x": spec_x, "out": {"shape": (world_size * big,), "strides": (3,), "layout": "step",
                                                     "offset": 1}}]
        elif kind == "reduce_scatter":
            case["tensors"] = [{"x": {"shape": (world_size * big,), "strides": (2,), "layout": "step", "offset": 2},
                                "out": {"shape": (big,), "strides": (3,), "layout": "step", "offset": 0}}]
        else:
            case["tensors"] = [{"x": spec_x}]
        cases.append(case)
    return cases


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- tensors and the definition (run on the ranks) --

def _buffer(spec: dict, dtype, seed: int):
    """A random buffer large enough for the view, and the view (as_strided into it)."""
    import torch

    span = sum((s - 1) * st for s, st in zip(spec["shape"], spec["strides"])) + 1 if _numel(spec["shape"]) else 0
    # elements after the view too: a write past it is seen; at least numel of them, so that a
    # backend that wrongly writes numel elements from the first one on stays inside the buffer
    size = spec["offset"] + max(span, _numel(spec["shape"])) + 4
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        base = torch.rand(size, generator=g) < 0.5
    elif dtype == torch.int8:
        base = torch.randint(-128, 128, (size,), generator=g).to(dtype)
    elif not dtype.is_floating_point:
        base = torch.randint(-(1 << 20), 1 << 20, (size,), generator=g).to(dtype)
    else:
        base = (torch.randn(size, generator=g, dtype=torch.float64) * 3).to(dtype)
    return base, base.as_strided(spec["shape"], spec["strides"], spec["offset"])


def _reduce(values: list, op: str):
    """Elementwise reduction over ranks (rank order), by the definition in the module docstring."""
    import torch

    dtype = values[0].dtype
    if dtype == torch.bool:
        stacked = torch.stack(values)
        anyv, allv = stacked.any(0), stacked.all(0)
        return {"SUM": anyv, "MAX": anyv, "BOR": anyv, "PRODUCT": allv, "MIN": allv, "BAND": allv,
                "BXOR": (stacked.sum(0) % 2).bool()}[op]
    if not dtype.is_floating_point:
        acc = values[0].to(torch.int64)
        for v in values[1:]:
            v = v.to(torch.int64)
            acc = {"SUM": acc + v, "PRODUCT": acc * v, "MAX": torch.maximum(acc, v), "MIN": torch.minimum(acc, v),
                   "BAND": acc & v, "BOR": acc | v, "BXOR": acc ^ v}[op]
        return acc.to(dtype)  # wraps to the width, as the collective's own arithmetic does
    acc = values[0].clone()
    for v in values[1:]:
        acc = {"SUM": acc + v, "PRODUCT": acc * v, "MAX": torch.maximum(acc, v), "MIN": torch.minimum(acc, v)}[op]
    return acc


def _overlaps(spec: dict) -> bool:
    return any(st == 0 and s > 1 for s, st in zip(spec["shape"], spec["strides"]))


def _dense(spec: dict) -> bool:
    """Elements that cover one block of memory without gaps or overlap (any dim order): what gloo,
    which reads memory from the first element on, gets right."""
    dims = sorted((st, s) for s, st in zip(spec["shape"], spec["strides"]) if s > 1)
    acc = 1
    for st, s in dims:
        if st != acc:
            return False
        acc *= s
    return True


def _run_case(case: dict, rank: int, world_size: int, group, before: list | None = None):
    """Runs one case on `group`; returns (this rank's buffers after, the expected buffers).
    `before` receives (buffer, its copy taken before the collective) pairs."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    dtype = getattr(torch, case["dtype"])
    kind = case["kind"]

    def make(r: int, j: int, role: str):
        return _buffer(case["tensors"][j][role], dtype, case["seed"] * 1000 + r * 97 + j * 7 + (role == "out"))

    mine = [{role: make(rank, j, role) for role in t} for j, t in enumerate(case["tensors"])]
    expected = [{role: base.clone() for role, (base, _) in t.items()} for t in mine]
    if before is not None:
        before.extend((base, base.clone()) for t in mine for base, _ in t.values())

    def expect(j: int, role: str, values):
        spec = case["tensors"][j][role]
        if _overlaps(spec):
            return  # no defined result: the case must be refused
        expected[j][role].as_strided(spec["shape"], spec["strides"], spec["offset"]).copy_(
            values.reshape(spec["shape"]))

    def inputs(j: int, role: str = "x"):
        return [make(r, j, role)[1].clone() for r in range(world_size)]

    op = getattr(dist.ReduceOp, case["op"]) if "op" in case else None
    if kind == "all_reduce":
        expect(0, "x", _reduce(inputs(0), case["op"]))
        dist.all_reduce(mine[0]["x"][1], op=op, group=group)
    elif kind == "all_reduce_coalesced":
        for j in range(len(mine)):
            expect(j, "x", _reduce(inputs(j), case["op"]))
        with _coalescing_manager(group=group, async_ops=True) as cm:
            for t in mine:
                dist.all_reduce(t["x"][1], op=op, group=group)
        cm.wait()
    elif kind == "broadcast":
        expect(0, "x", inputs(0)[case["src"]])
        dist.broadcast(mine[0]["x"][1], src=case["src"], group=group)
    elif kind in ("all_gather", "all_gather_coalesced", "all_gather_list"):
        for j in range(len(mine)):
            expect(j, "out", torch.cat([v.reshape(-1) for v in inputs(j)]))
        if kind == "all_gather":
            dist.all_gather_into_tensor(mine[0]["out"][1], mine[0]["x"][1], group=group)
        elif kind == "all_gather_list":  # the list form (left to gloo): the output's rank blocks as the list
            blocks = list(mine[0]["out"][1].tensor_split(world_size))
            dist.all_gather(blocks, mine[0]["x"][1].reshape(blocks[0].shape), group=group)
        else:
            with _coalescing_manager(group=group, async_ops=True) as cm:
                for t in mine:
                    dist.all_gather_into_tensor(t["out"][1], t["x"][1], group=group)
            cm.wait()
    elif kind in ("reduce_scatter", "reduce_scatter_coalesced"):
        for j in range(len(mine)):
            m = _numel(case["tensors"][j]["out"]["shape"])
            expect(j, "out", _reduce([v.reshape(-1)[rank * m: (rank + 1) * m] for v in inputs(j)], case["op"]))
        if kind == "reduce_scatter":
            dist.reduce_scatter_tensor(mine[0]["out"][1], mine[0]["x"][1], op=op, group=group)
        else:
            with _coalescing_manager(group=group, async_ops=True) as cm:
                for t in mine:
                    dist.reduce_scatter_tensor(t["out"][1], t["x"][1], op=op, group=group)
            cm.wait()
    else:
        dist.barrier(group=group)
    return [{role: base for role, (base, _) in t.items()} for t in mine], expected


def _written(case: dict) -> list[dict]:
    role = "x" if case["kind"] in ("all_reduce", "all_reduce_coalesced", "broadcast") else "out"
    return [t[role] for t in case["tensors"] if role in t]


def _props(rank, world_size, n_cases, seed):
    import torch
    import torch.distributed as dist

    gloo, shm = _init(world_size, timeout_s=60)
    results = []
    for case in _cases(world_size, n_cases, seed):
        must_refuse = any(_overlaps(s) for s in _written(case))
        outcome = {"i": case["i"], "kind": case["kind"], "dtype": case["dtype"], "op": case.get("op"),
                   "layouts": [(r, s["layout"], s["shape"], s["strides"])
                               for t in case["tensors"] for r, s in t.items()]}
        before: list = []
        try:
            got, want = _run_case(case, rank, world_size, shm, before)
        except Exception as e:  # noqa: BLE001 - the outcome is what is recorded
            text = str(e).strip()
            one_line = "\n" not in text and text.startswith(shm_collectives.NAME)
            untouched = all(torch.equal(a, b) for a, b in before)  # nothing half-written (coalesced forms)
            outcome["shm"] = "refused" if (must_refuse and one_line and untouched) else \
                f"raised: {type(e).__name__}: {text[:300]}" + ("" if untouched else " (and wrote some tensors)")
        else:
            ok = all(torch.equal(got[j][r], want[j][r]) for j in range(len(got)) for r in got[j])
            outcome["shm"] = ("not refused" if must_refuse else "ok") if ok or must_refuse else "wrong"
        # the ranks must still be in step (a failure inside a round on one rank only would not be)
        seqs = [None] * world_size
        dist.all_gather_object(seqs, shm._arena.seq if shm._arena is not None else 0, group=gloo)
        if len(set(seqs)) != 1:
            raise RuntimeError(f"case {case['i']}: the ranks' shared-memory rounds diverged: {seqs}")
        specs = [s for t in case["tensors"] for s in t.values()]
        # gloo's all_gather_into_tensor takes the concatenated output form only, not the stacked one
        stacked = case["kind"].startswith("all_gather") and any(
            len(t["out"]["shape"]) == len(t["x"]["shape"]) + 1 for t in case["tensors"])
        if not must_refuse and not stacked and all(_dense(s) for s in specs):
            outcome["gloo_checked_contiguous"] = all(s["layout"] in ("contiguous", "offset", "empty") for s in specs)
            try:
                got, want = _run_case(case, rank, world_size, gloo)
            except Exception as e:  # noqa: BLE001
                outcome["gloo"] = f"raised: {type(e).__name__}: {str(e).strip()[:200]}"
            else:
                rounding = world_size > 2 and case["dtype"] in ("bfloat16", "float16", "float32", "float64") \
                    and case.get("op") in ("SUM", "PRODUCT")
                close = torch.testing.assert_close if rounding else None
                ok = True
                for j in range(len(got)):
                    for r in got[j]:
                        if close is not None:
                            try:
                                close(got[j][r].double(), want[j][r].double(), rtol=2e-2, atol=0.5)
                            except AssertionError:
                                ok = False
                        elif not torch.equal(got[j][r], want[j][r]):
                            ok = False
                outcome["gloo"] = "ok" if ok else "wrong"
        results.append(outcome)
    return results


@pytest.mark.parametrize("world_size,n_cases", [(2, 240), (3, 90)])
def test_every_collective_on_every_view_equals_the_definition_or_is_refused(world_size, n_cases):
    out = run_distributed(_props, world_size, n_cases, 41 + world_size, timeout=240)
    cases = out[0]
    failures = {}  # case -> the first rank's outcome
    for rank, res in enumerate(out):
        for o in res:
            if o["shm"] not in ("ok", "refused") and o["i"] not in failures:
                failures[o["i"]] = (f"case {o['i']} {o['kind']} {o['dtype']} {o['op']} (rank {rank}): "
                                    f"{o['shm']}; {o['layouts']}")
    # the definition is gloo's on the contiguous cases (a check of this test's own arithmetic)
    definition_off = [o for res in out for o in res
                      if o.get("gloo_checked_contiguous") and o.get("gloo") != "ok"]
    gloo_wrong = sum(o.get("gloo") == "wrong" for o in cases)
    refused = sum(o["shm"] == "refused" for o in cases)
    print(f"{world_size} ranks: {len(cases)} cases, {len(failures)} failing, {refused} refused, "
          f"gloo differs from the definition on {gloo_wrong} dense cases")
    assert not definition_off, definition_off[:5]
    assert not failures, f"{len(failures)} of {len(cases)} cases failing:\n" + "\n".join(list(failures.values())[:40])
    assert {o["kind"] for o in cases} == set(KINDS)
    assert refused >= 5, "too few cases exercise the refusal of overlapping outputs"
