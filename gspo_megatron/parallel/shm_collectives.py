"""Shared-memory collectives for CPU ranks on one host: a torch.distributed backend ("gspo_shm").

Why: on CPU the ranks of a run are processes on one machine, and gloo's collectives go through
TCP loopback plus two thread handoffs per call (the caller's thread hands the work to gloo's
worker thread, whose socket is served by gloo's I/O loop). On the 2-core development machine a
2-rank all-gather of a few KiB costs ~500 us that way, against ~70 us for a bare socket round trip
and < 1 us for a flag in shared memory. A TP2+SP step of the demo model issues ~140 collectives
(Megatron's sequence-parallel all-gathers / reduce-scatters in every layer, forward and
backward), so gloo's latency, not the arithmetic, was most of a TP2 step (issue 30).

What it is: a Python `ProcessGroup` (torch returns a creator's ProcessGroup subclass as the group
itself: distributed_c10d.py `_new_process_group_helper`, "If the type is a subclass of
ProcessGroup"). The group carries an ordinary gloo backend, so every operation it does not
override (send/recv, all-to-all, gather, scatter, object collectives' sizes, ...) is gloo's,
unchanged. It overrides the collectives a step issues: all_gather_single, reduce_scatter_single,
allreduce, broadcast, barrier and their coalesced forms (in a one-rank group they are copies or
nothing, done without gloo); torch's Python API calls these methods on
the group object (distributed_c10d.py `all_gather_single`: `group.all_gather_single(...)`).

How a collective runs: each rank of the group maps one shared file (created in /dev/shm by group
rank 0, its path passed through the group's store, unlinked once every rank has mapped it, so
nothing is left behind after a crash). Each rank owns two data slots (used alternately) and a
sequence counter on its own cache line. A round: copy my contribution into my slot for this round,
publish the round number, wait until every rank has published it, read the slots. The slot of
round k is written again only in round k+2, which no rank can start before every rank has
published round k+1, i.e. finished reading round k. Payloads larger than a slot go in several
rounds. Reductions add the ranks' contributions in rank order on every rank, so all ranks get
bitwise the same result (as with gloo; for two ranks a+b == b+a, so the values equal gloo's).

Tensors: any CPU strided tensor of a real dtype, with any strides. One whose elements are a
dense run of memory in row-major order goes through the rounds as a byte view of itself; any
other view (a transpose, a slice with a step, `x[:, ::2]`) is copied into a dense buffer first
and the result copied back into the caller's tensor, in place, as a collective's result must be.
A tensor the collective writes whose elements share memory (an expand()) has no defined result:
refused in one line on every rank before any round (gloo writes numel elements from its first
one on). tests/test_shm_collectives_props.py checks every op against the definition over random
shapes, strides, views and dtypes.

Ordering: the data is written (a memcpy in torch) before the counter (a separate store), and
read after the counter is seen. x86-64 keeps stores in order and loads in order (TSO), so a rank
that sees the counter sees the data. Weaker memory models (ARM) would need fences that Python
cannot issue, so the backend is only offered on x86-64 Linux; elsewhere runs use gloo
(`available()`, `backend_for_cpu`).

Waiting: spin briefly, then poll with sched_yield in between (it releases the GIL, so other
threads of the rank run, and the core, so a peer that shares it runs; with a core per rank it
returns at once), then sleep in growing steps up to 1 ms (a long wait, e.g. for rank 0's rollout). Every wait is bounded by the group's timeout and notices a peer process
that died (its pid is in the header), raising one line naming the group, the operation and the
rank waited for.

Where it runs: CPU runs only (`parallel.cpu_collectives=shm`, the default). CUDA runs use NCCL
and never create this backend (`state.init_parallel`). Every multi-process test that goes
through `init_parallel` on CPU exercises it; tests/test_shm_collectives.py checks it op by op
against gloo.
"""
from __future__ import annotations

import datetime
import mmap
import os
import platform
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    ProcessGroup,
    ProcessGroupGloo,
    ReduceOp,
    ReduceScatterOptions,
    Work,
)

NAME = "gspo_shm"

SLOT_BYTES = 1 << 20  # per rank and round; larger payloads take several rounds
_LINE = 64  # header: one cache line per rank (round counter, pid)
_SPIN = 200  # busy polls (~20 us) while holding the GIL
_YIELD = 20000  # then polls with sched_yield in between, which drops the GIL (another thread of
# this process, e.g. the async rollout producer, is not held up) and the core (more ranks than cores)
_MAX_SLEEP_S = 1e-3
_LIVENESS_EVERY_S = 1.0

_REDUCE = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MAX: lambda a, b: torch.maximum(a, b, out=a),
    ReduceOp.MIN: lambda a, b: torch.minimum(a, b, out=a),
}


def available() -> tuple[bool, str]:
    """(usable here, why not). Linux /dev/shm and x86-64 ordering (module docstring)."""
    if sys.platform != "linux":
        return False, f"shared-memory collectives need Linux (this is {sys.platform})"
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"shared-memory collectives need x86-64 store ordering (this is {platform.machine()})"
    if not os.access("/dev/shm", os.W_OK):
        return False, "/dev/shm is not writable"
    return True, ""


def register() -> str:
    """Register the backend with torch.distributed (idempotent); returns its name."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])
    return NAME


def _create(store, rank: int, size: int, timeout: datetime.timedelta) -> "ShmProcessGroup":
    return ShmProcessGroup(store, rank, size, timeout)


class _Done(Work):
    """The Work of a collective that has already completed (the shm ops are synchronous)."""

    def __init__(self, result=None):
        super().__init__()
        self._result = result or []

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - nothing left to wait for
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self):
        return self._result

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class _Arena:
    """The group's shared file: header lines, then 2 slots per rank."""

    def __init__(self, store, rank: int, size: int, timeout_s: float, desc: str):
        self.rank, self.size, self.timeout_s, self.desc = rank, size, timeout_s, desc
        header = _LINE * size
        self.nbytes = header + 2 * size * SLOT_BYTES
        path = ""
        if rank == 0:
            try:
                # the creator's pid in the name: whoever finds one left behind knows whose it was
                fd, path = tempfile.mkstemp(prefix=f"gspo-shm-{os.getpid()}-", dir="/dev/shm")
                try:
                    # reserve the pages now: a full tmpfs fails here (one line) instead of SIGBUS later
                    os.posix_fallocate(fd, 0, self.nbytes)
                except OSError:
                    os.unlink(path)
                    raise
                finally:
                    os.close(fd)
            except OSError:
                store.set("gspo_shm/path", "")  # the other ranks must not wait for a path
                raise
            store.set("gspo_shm/path", path)
        else:
            path = store.get("gspo_shm/path").decode()
            if not path:
                raise OSError("group rank 0 could not create the shared file")
        self.path = path
        with open(path, "r+b") as f:
            self.mm = mmap.mmap(f.fileno(), self.nbytes)
        self.words = memoryview(self.mm).cast("q")  # int64 view: counter of rank r at r*_LINE/8
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.header = header
        self.seq = 0
        self.words[rank * (_LINE // 8) + 1] = os.getpid()

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.bytes = None
        if self.words is not None:
            self.words.release()
            self.words = None
        try:
            self.mm.close()
        except BufferError:  # a view handed out is still alive; the mapping goes with the process
            pass

    def slot(self, rank: int, seq: int) -> torch.Tensor:
        off = self.header + (rank * 2 + seq % 2) * SLOT_BYTES
        return self.bytes[off: off + SLOT_BYTES]

    def round(self, op: str, payload: torch.Tensor | None) -> int:
        """Publish my payload (uint8, <= SLOT_BYTES) for the next round and wait for every rank's.
        Returns the round number (read the slots with `slot(q, seq)`)."""
        self.seq += 1
        seq = self.seq
        if payload is not None and payload.numel():
            self.slot(self.rank, seq)[: payload.numel()].copy_(payload)
        w = self.words
        stride = _LINE // 8
        w[self.rank * stride] = seq
        for q in range(self.size):
            if q != self.rank and w[q * stride] < seq:
                self._wait(q, seq, op)
        return seq

    def _wait(self, q: int, seq: int, op: str) -> None:
        w, i = self.words, q * (_LINE // 8)
        for _ in range(_SPIN):
            if w[i] >= seq:
                return
        for _ in range(_YIELD):
            os.sched_yield()
            if w[i] >= seq:
                return
        start = last_check = time.monotonic()
        pause = 50e-6
        while w[i] < seq:
            time.sleep(pause)
            pause = min(pause * 2, _MAX_SLEEP_S)
            now = time.monotonic()
            if now - last_check >= _LIVENESS_EVERY_S:
                last_check = now
                pid = w[i + 1]
                if pid and not _alive(pid):
                    raise RuntimeError(f"{self.desc}: {op} round {seq}: group rank {q} (pid {pid}) has exited")
            if now - start > self.timeout_s:
                raise RuntimeError(f"{self.desc}: {op} round {seq}: group rank {q} did not arrive within "
                                   f"{self.timeout_s:.0f} s")


def _alive(pid: int) -> bool:
    """Whether process `pid` is still running. An exited child stays a zombie until its parent
    reaps it (a test harness blocked on a queue does not), and kill(pid, 0) succeeds on zombies,
    so /proc's state letter decides where there is one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shm_ok(*tensors: torch.Tensor) -> bool:
    """Tensors the shared-memory path takes, with any strides (a dense copy in and out where their
    elements are not one run of memory: `_Dense`): CPU, strided layout, a dtype with a byte view."""
    return all(t.device.type == "cpu" and t.layout == torch.strided and not t.is_complex() for t in tensors)


def _flat(t: torch.Tensor) -> torch.Tensor | None:
    """t's elements as a 1-D stride-1 view of the same memory, where they are one dense run in
    row-major order; else None. Not `t.reshape(-1)`: torch calls a tensor contiguous whatever
    the strides of its size-1 dims (c10/core/Contiguity.h:24, `if (size_d == 1) continue`) and a
    reshape keeps them, so `sums[:, 4].contiguous()` of a [1, 5] tensor is a [1] tensor with
    stride 5, which `.view(torch.uint8)` refuses ("self.stride(-1) must be 1"; the CP2 crash of
    issue 41). A contiguous tensor's elements are exactly storage_offset .. +numel, so the
    as_strided view below is the same memory."""
    if t.is_contiguous() and not t.is_neg():
        return t.as_strided((t.numel(),), (1,))
    return None


def _shares_memory(t: torch.Tensor) -> bool:
    """Whether elements of t may be one memory location (an expand(), a stride 0, an as_strided
    overlap). Sufficient test: ordered by stride, each dim's stride is past everything the
    smaller dims span."""
    extent = 0  # largest offset the dims seen so far reach
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1):
        if stride <= extent:
            return True
        extent += stride * (size - 1)
    return False


def _refuse_shared(op: str, role: str, t: torch.Tensor) -> None:
    """A tensor a collective writes must own each of its elements: results written through an
    expand()ed view have no defined value (gloo writes numel elements from the first one on,
    past the view's memory). Checked on every rank before any rank enters a round."""
    if _shares_memory(t):
        raise ValueError(f"{NAME} {op}: the {role} (shape {tuple(t.shape)}, stride {t.stride()}) has "
                         f"elements that share memory (an expand()?); pass one that owns each element (.clone())")


class _Dense:
    """A tensor of the caller's as a flat stride-1 tensor for the shared-memory rounds: the same
    memory where it already is one (`_flat`), else a dense copy of its elements, written back into
    the caller's tensor by `done()` when the collective writes it (gloo writes results into the
    caller's tensor, so views such as `x[:, ::2]` or `x.t()` get their elements in place)."""

    def __init__(self, op: str, role: str, t: torch.Tensor, written: bool, read: bool = True):
        if written:
            _refuse_shared(op, role, t)
        self.t, self.written = t, written
        flat = _flat(t)
        self.copied = flat is None
        if flat is None:
            flat = torch.empty(t.numel(), dtype=t.dtype)
            if read:
                flat.view(t.shape).copy_(t)
        self.flat = flat

    def bytes(self) -> torch.Tensor:
        return self.flat.view(torch.uint8)

    def done(self) -> None:
        if self.written and self.copied:
            self.t.copy_(self.flat.view(self.t.shape))


class ShmProcessGroup(ProcessGroup):
    """A ProcessGroup whose step collectives go through shared memory (module docstring); the rest
    is the gloo backend registered on it."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)  # the (rank, size) constructor is the one pybind lets Python subclass
        self._gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
        self._gloo._set_sequence_number_for_group()
        self._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, self._gloo)
        self._set_default_backend(ProcessGroup.BackendType.GLOO)
        self._store = store
        self._timeout_s = timeout.total_seconds()
        self._arena: _Arena | None = None
        self._arena_failed = size == 1
        # one rank: every collective above is the identity (or a copy), done here without gloo's
        # round trip (~0.1-0.2 ms each; TP1 runs and the one-rank groups of larger layouts)
        self._solo = size == 1
        self._closed = False

    # -- the arena, made at the first shared-memory collective (every rank calls it together) --
    def _get_arena(self) -> _Arena | None:
        if self._arena is not None or self._arena_failed:
            return self._arena
        desc = f"gspo_shm group {self.group_name or '?'} (rank {self.rank()} of {self.size()})"
        arena, err = None, ""
        try:
            arena = _Arena(dist.PrefixStore("arena/", self._store), self.rank(), self.size(),
                           self._timeout_s, desc)
        except OSError as e:
            err = f"{type(e).__name__}: {e}"
        # all ranks agree before any rank uses it (MIN of "mapped here"), then rank 0 unlinks
        ok = torch.tensor([1 if arena is not None else 0], dtype=torch.int32)
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.MIN
        self._gloo.allreduce([ok], opts).wait()
        if arena is not None and self.rank() == 0:
            arena.unlink()
        if not int(ok.item()):
            if arena is not None:
                arena.close()
            self._arena_failed = True
            if err:
                print(f"[gspo_shm] {desc}: shared memory unavailable ({err}); this group uses gloo",
                      file=sys.stderr, flush=True)
            return None
        self._arena = arena
        return arena

    # -- overridden collectives --
    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's parameter name
        if not _shm_ok(output, input):
            return self._gloo._allgather_base(output, input, _opts(opts, AllgatherOptions))
        src, dst = self._gather_args(output, input)
        arena = None if self._solo else self._get_arena()
        if arena is None and not self._solo:
            return self._gloo_dense(self._gloo._allgather_base, dst, src, _opts(opts, AllgatherOptions))
        if self._solo:
            dst.flat.copy_(src.flat)
        else:
            self._gather_rounds(arena, src.bytes(), dst.bytes())
        dst.done()
        return _Done([output])

    def _gather_args(self, output, input):  # noqa: A002
        """Checks (one line each, before any rank enters a round) and the dense forms."""
        if output.dtype != input.dtype:
            raise ValueError(f"{NAME} all_gather: output dtype {output.dtype} differs from input dtype {input.dtype}")
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"{NAME} all_gather: output has {output.numel()} elements, expected "
                             f"{input.numel()} x {self.size()}")
        dst = _Dense("all_gather", "output tensor", output, written=True, read=False)
        return _Dense("all_gather", "input tensor", input, written=False), dst

    @staticmethod
    def _gather_rounds(arena: "_Arena", src: torch.Tensor, dst: torch.Tensor) -> None:
        n = src.numel()
        for off in range(0, n, SLOT_BYTES) if n else ():
            c = min(SLOT_BYTES, n - off)
            seq = arena.round("all_gather", src[off: off + c])
            for q in range(arena.size):
                dst[q * n + off: q * n + off + c].copy_(arena.slot(q, seq)[:c])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        if not all(_shm_ok(o, i) for o, i in zip(outputs, inputs)):
            return self._gloo_each(self._gloo._allgather_base, outputs, inputs, _opts(opts, AllgatherOptions))
        for o, i in zip(outputs, inputs):  # every tensor checked before the first is written
            self._gather_args(o, i)
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i)
        return _Done(list(outputs))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        reduce = _REDUCE.get(_op_type(op))
        if not _shm_ok(output, input):
            return self._gloo._reduce_scatter_base(output, input, _opts(opts, ReduceScatterOptions))
        src, dst = self._scatter_args(output, input)
        arena = None if self._solo or reduce is None else self._get_arena()
        if arena is None and (not self._solo or reduce is None):  # an op gloo does, or no arena
            return self._gloo_dense(self._gloo._reduce_scatter_base, dst, src, _opts(opts, ReduceScatterOptions))
        if self._solo:
            dst.flat.copy_(src.flat)
            dst.done()
            return _Done([output])
        w, r = arena.size, arena.rank
        m = dst.flat.numel()
        es = dst.flat.element_size()
        per_round = max(1, SLOT_BYTES // (es * w))  # elements of each destination's block per round
        blocks = src.flat.view(w, m)
        for off in range(0, m, per_round) if m else ():
            c = min(per_round, m - off)
            stage = blocks[:, off: off + c].contiguous()  # [w, c]: block q's part for rank q
            seq = arena.round("reduce_scatter", stage.reshape(-1).view(torch.uint8))
            self._reduce_into(dst.flat[off: off + c], arena, seq, r * c, c, reduce)
        dst.done()
        return _Done([output])

    def _scatter_args(self, output, input):  # noqa: A002
        if output.dtype != input.dtype:
            raise ValueError(f"{NAME} reduce_scatter: output dtype {output.dtype} differs from input dtype "
                             f"{input.dtype}")
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"{NAME} reduce_scatter: input has {input.numel()} elements, expected "
                             f"{output.numel()} x {self.size()}")
        dst = _Dense("reduce_scatter", "output tensor", output, written=True, read=False)
        return _Dense("reduce_scatter", "input tensor", input, written=False), dst

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        if not all(_shm_ok(o, i) for o, i in zip(outputs, inputs)):
            return self._gloo_each(self._gloo._reduce_scatter_base, outputs, inputs, _opts(opts, ReduceScatterOptions))
        for o, i in zip(outputs, inputs):  # every tensor checked before the first is written
            self._scatter_args(o, i)
        for o, i in zip(outputs, inputs):
            self.reduce_scatter_single(o, i, opts)
        return _Done(list(outputs))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def allreduce(self, tensors, opts=None):
        if isinstance(opts, (ReduceOp, ReduceOp.RedOpType)):  # the allreduce(tensors, op) overload
            o = AllreduceOptions()
            o.reduceOp = opts
            opts = o
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        reduce = _REDUCE.get(_op_type(op))
        if len(tensors) != 1 or not _shm_ok(tensors[0]):
            return self._gloo.allreduce(tensors, _opts(opts, AllreduceOptions))
        if self._solo and reduce is not None:
            return _Done(list(tensors))
        t = _Dense("all_reduce", "tensor", tensors[0], written=True)
        arena = self._get_arena() if reduce is not None else None
        if arena is None:  # an op gloo does (BAND, BOR, ...), or no arena: gloo, on the dense form
            self._gloo.allreduce([t.flat], _opts(opts, AllreduceOptions)).wait()
            t.done()
            return _Done(list(tensors))
        flat = t.flat
        n, es = flat.numel(), flat.element_size()
        per_round = max(1, SLOT_BYTES // es)
        for off in range(0, n, per_round) if n else ():
            c = min(per_round, n - off)
            seq = arena.round("all_reduce", flat[off: off + c].view(torch.uint8))
            self._reduce_into(flat[off: off + c], arena, seq, 0, c, reduce)
        t.done()
        return _Done(list(tensors))

    def allreduce_coalesced(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        if not all(_shm_ok(t) for t in tensors):
            return self._gloo.allreduce_coalesced(tensors, _opts(opts, AllreduceCoalescedOptions))
        for t in tensors:  # every tensor checked before the first is written
            _refuse_shared("all_reduce", "tensor", t)
        for t in tensors:
            o = AllreduceOptions()
            o.reduceOp = op
            self.allreduce([t], o)
        return _Done(list(tensors))

    def broadcast(self, tensors, opts=None):
        if len(tensors) != 1 or not _shm_ok(tensors[0]):
            return self._gloo.broadcast(tensors, _opts(opts, BroadcastOptions))
        opts = _opts(opts, BroadcastOptions)
        if self._solo:
            return _Done(list(tensors))
        root = opts.rootRank
        # written on every rank but the root; checked on every rank alike, so all refuse together
        t = _Dense("broadcast", "tensor", tensors[0], written=True, read=self.rank() == root)
        t.written = self.rank() != root
        arena = self._get_arena()
        if arena is None:
            self._gloo.broadcast([t.flat], opts).wait()
            t.done()
            return _Done(list(tensors))
        b = t.bytes()
        n = b.numel()
        for off in range(0, n, SLOT_BYTES) if n else ():
            c = min(SLOT_BYTES, n - off)
            seq = arena.round("broadcast", b[off: off + c] if arena.rank == root else None)
            if arena.rank != root:
                b[off: off + c].copy_(arena.slot(root, seq)[:c])
        t.done()
        return _Done(list(tensors))

    def barrier(self, opts=None):
        if self._solo:
            return _Done()
        arena = self._get_arena()
        if arena is None:
            return self._gloo.barrier(_opts(opts, BarrierOptions))
        arena.round("barrier", None)
        return _Done()

    # -- everything else: the gloo backend, called directly. Not through ProcessGroup's own methods:
    # for a Python subclass those run pybind's trampoline, which holds the GIL while it enqueues
    # on gloo, and gloo's worker thread takes the queue's mutex and then the GIL to drop a finished
    # op's tensors: a deadlock (seen: all_gather_object hung in ProcessGroupGloo::enqueue while the
    # worker waited in decref_pyobject). The Backend's bindings release the GIL first.
    def allgather(self, output_lists, *args):
        # gloo copies into each output tensor: one whose elements share memory gets torch's own
        # error from inside gloo's work; refused here first, as in the methods above
        for outputs in output_lists:
            for t in outputs:
                _refuse_shared("all_gather", "output tensor", t)
        return self._gloo.allgather(output_lists, *args)

    def allgather_coalesced(self, *args):
        return self._gloo.allgather_coalesced(*args)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        return self.reduce_scatter_single(output, input, opts)

    def all_to_all_single(self, *args):
        return self._gloo.alltoall_base(*args)

    def alltoall_base(self, *args):
        return self._gloo.alltoall_base(*args)

    def alltoall(self, *args):
        return self._gloo.alltoall(*args)

    def gather(self, *args):
        return self._gloo.gather(*args)

    def scatter(self, *args):
        return self._gloo.scatter(*args)

    def reduce(self, *args):
        return self._gloo.reduce(*args)

    def reduce_scatter(self, *args):
        return self._gloo.reduce_scatter(*args)

    def send(self, *args):
        return self._gloo.send(*args)

    def recv(self, *args):
        return self._gloo.recv(*args)

    def recv_anysource(self, *args):
        return self._gloo.recv_anysource(*args)

    def monitored_barrier(self, *args, **kwargs):
        return self._gloo.monitored_barrier(*args, **kwargs)

    # _coalescing_manager(device=...): the ops inside are recorded by torch and handed to the
    # *_coalesced methods above when the block ends (distributed_c10d.py `_coalescing_manager`),
    # so there is nothing to open or close here
    def _start_coalescing(self, device=None):  # noqa: ARG002
        return None

    def _end_coalescing(self, device=None):  # noqa: ARG002
        return _Done()

    @staticmethod
    def _gloo_dense(fn, dst: _Dense, src: _Dense, opts) -> _Done:
        """A two-tensor collective on gloo (no arena), on the dense forms: gloo reads and writes a
        tensor's memory from its first element on whatever its strides."""
        fn(dst.flat, src.flat, opts).wait()
        dst.done()
        return _Done([dst.t])

    def _gloo_each(self, fn, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            fn(o, i, opts).wait()
        return _Done(list(outputs))

    def shutdown(self) -> None:
        self._close_arena()
        self._gloo.shutdown()  # directly, for the reason above (it joins gloo's worker threads)

    def abort(self) -> None:
        self._close_arena()
        self._gloo.abort()

    def _close_arena(self) -> None:
        if self._arena is not None:
            self._arena.close()
            self._arena = None
            self._arena_failed = True

    @staticmethod
    def _reduce_into(out: torch.Tensor, arena: _Arena, seq: int, start: int, c: int, reduce) -> None:
        """out = reduce over ranks q = 0..size-1, in that order, of slot q's elements [start, start+c)."""
        dt, es = out.dtype, out.element_size()

        def part(q: int) -> torch.Tensor:
            return arena.slot(q, seq)[start * es: (start + c) * es].view(dt)

        out.copy_(part(0))  # `out` is the caller's tensor, never a slot: my own part was copied in
        for q in range(1, arena.size):
            reduce(out, part(q))


def _opts(opts, cls):
    """torch passes an options object; a caller of the Python method may pass none."""
    return cls() if opts is None else opts


def _op_type(op):
    """ReduceOp or RedOpType -> RedOpType (torch passes either)."""
    return getattr(op, "op", op) if not isinstance(op, ReduceOp.RedOpType) else op
