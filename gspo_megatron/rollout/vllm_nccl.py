"""``rollout.vllm.weight_sync=nccl``: vLLM 0.32's own NCCL weight transfer, trainer side, without
vLLM in the trainer's environment.

vLLM ships a trainer half of its transfer (``NCCLTrainerWeightTransferEngine``,
distributed/weight_transfer/nccl_engine.py), but it imports vLLM, and vLLM lives in the servers'
own environment here (as in production). So this module speaks the same protocol with torch alone:

* Rendezvous by NCCL unique id (nccl_common.py ``NCCLWeightTransferInitInfo``: "for torch-free
  trainers ... that mint the unique id out of band"): trainer rank 0 mints an ``ncclUniqueId``
  (``torch.cuda.nccl.unique_id()``), and every server gets ``POST /init_weight_transfer_engine``
  {init_info: {rank_offset, world_size, nccl_unique_id_b64, packed: false}}. Its workers join as
  ranks ``rank_offset + dp_rank * (tp*pp) + rank`` (nccl_common.py ``worker_init_process_group``);
  we are rank 0 and server i's offset is 1 + the world sizes (``GET /get_world_size``) of the
  servers before it. There is no store and no barrier: every rank must enter ``ncclCommInitRank``
  together, so the HTTP requests run on side threads while rank 0 joins, and everything is bounded
  by ``timeout_s`` (a server that never joins fails the run with one line instead of hanging).
* The warm-up handshake: vLLM's communicator runs a one-element float32 ``all_reduce`` right after
  ``ncclCommInitRank`` (pynccl.py ``_init_comm``; skipped only on ROCm, which this path does not
  support), so rank 0 issues the matching one before any broadcast, or all ranks deadlock.
* A push: ``/pause?mode=wait`` (requests in flight finish, new ones queue), ``/start_weight_update``,
  then per bucket ``/update_weights`` {update_info: {names, dtype_names, shapes}} on every server
  while rank 0 broadcasts those tensors one by one in that order (``packed: false``: the worker
  receives each into ``torch.empty(shape, dtype)`` and loads it, nccl_engine.py
  ``receive_weights``), then ``/finish_weight_update`` {weight_version} (which also labels the
  weights, v1/engine/async_llm.py ``finish_weight_update``) and ``/resume``.

``torch.cuda.nccl`` is torch's own binding (torch/cuda/nccl.py; its C++ ``broadcast`` takes
user communicators and ``root`` is the rank inside the communicator, torch/csrc/cuda/nccl.cpp).
torch never destroys such a communicator (``comm_destroy`` is a no-op there) and has no abort, so
a push that fails half-way (a server gone, a timeout) would leave a broadcast kernel waiting for
peers that never come, and with it every later kernel of its stream. Two guards: the transfer runs
on a stream of its own (the trainer's stream never queues behind it), and a failed push aborts the
communicator with NCCL's own ``ncclCommAbort`` (what vLLM's engine does on its side,
pynccl_wrapper.py), called through ctypes on the pointer torch's communicator capsule holds
(torch/csrc/cuda/python_nccl.cpp ``unpack_nccl_comm``: capsule "torch.cuda.nccl.Communicator") in
the libnccl torch loaded. Where that library cannot be found the run still stops in one line, and
the line says the communicator was left as it was. The communicator is injectable (``backend=``) so CPU tests drive the protocol against a
double of vLLM's routes; the real NCCL half runs only on GPUs (not on this project's CI machines:
tests/test_vllm_nccl.py and tests/test_vllm_contract.py cover the protocol and its fields).
"""
from __future__ import annotations

import base64
import ctypes
import logging
import os
import threading
import time
from typing import Any, Iterable, Protocol, Sequence

import torch

from .http_servers import EngineError, EngineProtocolError, ServerClient

log = logging.getLogger("gspo_megatron.rollout")

NCCL_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId): vllm pynccl_wrapper.py NCCL_UNIQUE_ID_BYTES
INIT = "/init_weight_transfer_engine"
START = "/start_weight_update"
UPDATE = "/update_weights"
FINISH = "/finish_weight_update"
WORLD_SIZE = "/get_world_size"
INIT_INFO_FIELDS = ("rank_offset", "world_size", "nccl_unique_id_b64", "packed")
UPDATE_INFO_FIELDS = ("names", "dtype_names", "shapes")


class Communicator(Protocol):
    def all_reduce(self, t: torch.Tensor) -> None: ...
    def broadcast(self, t: torch.Tensor) -> None: ...  # from rank 0 of the group
    def synchronize(self) -> None: ...
    def abort(self) -> str: ...  # ends every operation in flight; returns what it did, in words


class NcclBackend(Protocol):
    def unique_id(self) -> bytes: ...
    def join(self, uid: bytes, world_size: int, rank: int, device: torch.device) -> Communicator: ...


class TorchNccl:
    """NcclBackend over torch.cuda.nccl (CUDA builds of torch)."""

    def unique_id(self) -> bytes:
        import torch.cuda.nccl as nccl

        return nccl.unique_id()

    def join(self, uid: bytes, world_size: int, rank: int, device: torch.device) -> Communicator:
        import torch.cuda.nccl as nccl

        with torch.cuda.device(device):
            comm = nccl.init_rank(world_size, uid, rank)
        return _TorchNcclComm(comm, device)


class _TorchNcclComm:
    def __init__(self, comm: Any, device: torch.device):
        self.comm, self.device = comm, device
        # the transfer's own stream (torch.cuda.nccl enqueues on the stream it is given, nccl.cpp
        # broadcast/all_reduce): a broadcast that never completes holds this stream only
        self.stream = torch.cuda.Stream(device)

    def _ready(self, t: torch.Tensor) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # t was written on the trainer's stream
        t.record_stream(self.stream)  # the allocator keeps t until the transfer's stream is past it

    def all_reduce(self, t: torch.Tensor) -> None:
        import torch.cuda.nccl as nccl

        self._ready(t)
        nccl.all_reduce([t], streams=[self.stream], comms=[self.comm])

    def broadcast(self, t: torch.Tensor) -> None:
        import torch.cuda.nccl as nccl

        self._ready(t)
        nccl.broadcast([t], root=0, streams=[self.stream], comms=[self.comm])

    def synchronize(self) -> None:
        self.stream.synchronize()

    def abort(self) -> str:
        return abort_communicator(self.comm)


COMM_CAPSULE_NAME = b"torch.cuda.nccl.Communicator"  # torch/csrc/cuda/python_nccl.cpp


def capsule_pointer(capsule: Any, name: bytes = COMM_CAPSULE_NAME) -> int:
    """The pointer a PyCapsule of that name holds (torch's communicator: the ncclComm_t)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, name)  # raises ValueError for a capsule of another name
    if not ptr:
        raise ValueError("the NCCL communicator capsule holds no pointer")
    return ptr


def loaded_libnccl(maps: str | None = None) -> str | None:
    """The path of the libnccl this process has loaded (torch's), from /proc/self/maps; None if
    none is (a torch that links NCCL statically: its symbols are then looked up in the process)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return None
    for line in maps.splitlines():
        path = line.split(None, 5)[-1] if len(line.split(None, 5)) == 6 else ""
        if os.path.basename(path).startswith("libnccl.so"):
            return path
    return None


def abort_communicator(comm: Any, *, lib: Any = None) -> str:
    """ncclCommAbort on torch's communicator: NCCL makes the operations in flight return and frees
    the communicator (nccl.h: "Frees resources associated with communicator object and aborts any
    operations that might still be running on the device"). Returns what happened, in words; never
    raises (it runs while a failure is being reported)."""
    try:
        ptr = capsule_pointer(comm)
        if lib is None:
            path = loaded_libnccl()
            lib = ctypes.CDLL(path) if path else ctypes.CDLL(None)
        fn = lib.ncclCommAbort
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p]
        rc = fn(ptr)
    except (AttributeError, OSError, ValueError, TypeError) as e:
        return f"the NCCL communicator could not be aborted ({type(e).__name__}: {e}); a broadcast may still wait on its stream"
    return "the NCCL communicator was aborted" if rc == 0 else f"ncclCommAbort returned {rc}"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the worker resolves it with getattr(torch, name)."""
    return str(dtype).replace("torch.", "")


class _Calls:
    """One request per server on daemon threads (a thread stuck on a server that never answers must
    not keep the process alive), collected with a deadline."""

    def __init__(self, servers: Sequence[ServerClient], path: str, bodies: Sequence[dict], timeout_s: float):
        self.path, self.timeout_s = path, timeout_s
        self.results: list[Any] = [None] * len(servers)
        self.errors: list[BaseException | None] = [None] * len(servers)
        self.threads = []
        for i, (s, body) in enumerate(zip(servers, bodies)):
            t = threading.Thread(target=self._one, args=(i, s, body), daemon=True, name=f"vllm-nccl{path}")
            t.start()
            self.threads.append((s, t))

    def _one(self, i: int, s: ServerClient, body: dict) -> None:
        try:
            self.results[i] = s.post(self.path, body, timeout_s=self.timeout_s, retries=0, expect_json=False)
        except BaseException as e:  # reported by wait()
            self.errors[i] = e

    def failed(self) -> BaseException | None:
        return next((e for e in self.errors if e is not None), None)

    def wait(self, deadline: float) -> None:
        """Until every request returned; the first failure ends the wait (the other servers' workers
        may sit in a collective the failed one never joins, so their requests would only time out)."""
        while time.monotonic() < deadline and any(t.is_alive() for _, t in self.threads) and self.failed() is None:
            next(t for _, t in self.threads if t.is_alive()).join(0.1)
        err = self.failed()
        if err is not None:
            raise EngineError(f"vLLM NCCL weight transfer: POST {self.path} failed: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
        for s, t in self.threads:
            if t.is_alive():
                raise EngineError(f"vLLM server {s.url}: POST {self.path} did not return within {self.timeout_s:g} s "
                                  "(NCCL weight transfer; is the server up and started with --weight-transfer-config "
                                  "'{\"backend\": \"nccl\"}'?)")


def _bounded(fn, deadline: float, calls: _Calls | None, what: str) -> None:
    """fn() on a daemon thread, waited for until `deadline`; a failed server request ends the wait
    early (its workers will not take part in the collective fn waits for)."""
    out: dict[str, BaseException] = {}

    def run():
        try:
            fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True, name="vllm-nccl")
    t.start()
    while t.is_alive() and time.monotonic() < deadline:
        t.join(0.2)
        err = calls.failed() if calls is not None else None
        if err is not None:
            calls.wait(deadline)  # raises the failure
    if t.is_alive():
        raise EngineError(f"vLLM NCCL weight transfer: {what}")
    if "error" in out:
        raise EngineError(f"vLLM NCCL weight transfer: {out['error']}") from out["error"]


# Bytes per pushed bucket (rollout.vllm has no bucket_mb: one size, SGLang's default)
DEFAULT_BUCKET_BYTES = 512 << 20


class NcclWeightSync:
    """Trainer rank 0's side of vLLM's NCCL weight transfer (see the module docstring)."""

    def __init__(self, servers: Sequence[ServerClient], *, device: torch.device, timeout_s: float,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, backend: NcclBackend | None = None):
        self.servers = list(servers)
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self.backend = backend or TorchNccl()
        self.comm: Communicator | None = None
        self.world_size = 0
        self.broken: str | None = None

    # ------------------------------------------------------------------ rendezvous
    def rank_offsets(self) -> tuple[list[int], int]:
        """Each server's first NCCL rank and the group's size (rank 0 = this trainer process)."""
        offsets, nxt = [], 1
        for s in self.servers:
            r = s.get(WORLD_SIZE, timeout_s=60, retries=1)
            size = r.get("world_size") if isinstance(r, dict) else None
            if not isinstance(size, int) or size < 1:
                raise EngineProtocolError(f"vLLM server {s.url}: GET {WORLD_SIZE} answered {str(r)[:200]}")
            offsets.append(nxt)
            nxt += size
        return offsets, nxt

    def connect(self) -> None:
        offsets, world = self.rank_offsets()
        uid = self.backend.unique_id()
        if len(uid) != NCCL_UNIQUE_ID_BYTES:
            raise EngineError(f"NCCL unique id has {len(uid)} bytes, vLLM expects {NCCL_UNIQUE_ID_BYTES}")
        b64 = base64.b64encode(uid).decode("ascii")  # standard alphabet: vLLM refuses URL-safe base64
        bodies = [{"init_info": {"rank_offset": off, "world_size": world, "nccl_unique_id_b64": b64,
                                 "packed": False}} for off in offsets]
        deadline = time.monotonic() + self.timeout_s
        calls = _Calls(self.servers, INIT, bodies, self.timeout_s)
        joined: dict[str, Any] = {}

        def join():
            comm = self.backend.join(uid, world, 0, self.device)
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # vLLM's warm-up all_reduce
            comm.all_reduce(warm)
            comm.synchronize()
            joined["comm"] = comm

        _bounded(join, deadline, calls,
                 f"the group of {world} ranks did not form within {self.timeout_s:g} s (servers "
                 f"{[s.url for s in self.servers]}; NCCL must reach trainer rank 0 from every server GPU: "
                 "NCCL_SOCKET_IFNAME, firewalls)")
        calls.wait(deadline)
        self.comm, self.world_size = joined["comm"], world
        log.info("vLLM NCCL weight transfer: group of %d ranks (trainer rank 0 + %s)", world,
                 [f"{s.url} from rank {o}" for s, o in zip(self.servers, offsets)])

    # ------------------------------------------------------------------ a push
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *, dtype: torch.dtype | None,
             resume: bool = True, pause: str = "wait") -> int:
        """Broadcast every tensor to every server worker and label the weights `version`. Returns the
        number of tensors sent. A failure leaves the group unusable (the servers may sit in a
        broadcast): later pushes refuse with the first error."""
        from .weight_sync import iter_buckets

        if self.broken is not None:
            raise EngineError(f"vLLM NCCL weight transfer failed earlier ({self.broken}); restart the run "
                              "(checkpoint.resume=auto continues it)")
        try:
            if self.comm is None:
                self.connect()
            for s in self.servers:
                s.post(f"/pause?mode={pause}", {}, timeout_s=self.timeout_s, retries=1, expect_json=False)
            for s in self.servers:
                s.post(START, {}, timeout_s=self.timeout_s, retries=0, expect_json=False)
            sent = 0
            for bucket in iter_buckets(named_tensors, self.bucket_bytes, dtype=dtype, device=self.device):
                info = {"names": [n for n, _ in bucket], "dtype_names": [dtype_name(t.dtype) for _, t in bucket],
                        "shapes": [list(t.shape) for _, t in bucket]}
                deadline = time.monotonic() + self.timeout_s
                calls = _Calls(self.servers, UPDATE, [{"update_info": info}] * len(self.servers), self.timeout_s)
                if calls.failed() is None:  # a request already refused would leave us alone in the broadcast
                    for _, t in bucket:
                        self.comm.broadcast(t)  # enqueued on the transfer's stream
                    _bounded(self.comm.synchronize, deadline, calls,
                             f"the broadcast of {len(bucket)} tensors did not complete within {self.timeout_s:g} s")
                calls.wait(deadline)
                sent += len(bucket)
            for s in self.servers:
                s.post(FINISH, {"weight_version": str(version)}, timeout_s=self.timeout_s, retries=0,
                       expect_json=False)
                if resume:
                    s.post("/resume", {}, timeout_s=60, retries=1, expect_json=False)
            return sent
        except BaseException as e:
            self.broken = str(e).splitlines()[0] if str(e) else type(e).__name__
            self._abort()
            raise

    def _abort(self) -> None:
        """After a failed push the group is unusable (the servers' workers may sit in a broadcast
        that never ends): abort rank 0's communicator so that no operation of ours waits on it."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        abort = getattr(comm, "abort", None)
        what = abort() if abort is not None else "the communicator has no abort"
        self.broken += f"; {what}"
        log.error("vLLM NCCL weight transfer failed (%s)", self.broken)
