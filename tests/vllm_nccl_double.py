"""A double of vLLM 0.32's NCCL weight-transfer routes and of the NCCL group, for CPU tests of
rollout/vllm_nccl.py (a real vLLM server cannot take NCCL transfers on CPU).

It refuses what vLLM refuses (tests/test_vllm_contract.py checks these field sets against vLLM's
source): an ``init_info`` with keys that are not fields of ``NCCLWeightTransferInitInfo``
(nccl_common.py; parse_init_info turns the dataclass's TypeError into an error), both or neither
rendezvous modes, a unique id that is not standard base64 of 128 bytes; ``update_weights`` outside
``start_weight_update`` … ``finish_weight_update`` (v1/worker/gpu_worker.py), ``update_info`` keys
beyond ``NCCLWeightTransferUpdateInfo``'s or lists of different lengths. The NCCL group is a set of
queues: every broadcast of rank 0 lands in each server's queue; a server's init needs the warm-up
one-element float32 all_reduce first (pynccl.py ``_init_comm``), its update pops one broadcast per
listed name and checks its shape and dtype, as a receiving worker's ``torch.empty(shape, dtype)``
would hang or load garbage otherwise.
"""
from __future__ import annotations

import base64
import binascii
import json
import queue
import threading
import urllib.parse

import torch

# vLLM 0.32 nccl_common.py NCCLWeightTransferInitInfo / nccl_engine.py NCCLWeightTransferUpdateInfo
INIT_INFO_ACCEPTS = frozenset({"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
                               "packed", "packed_buffer_size_bytes", "packed_num_buffers"})
INIT_INFO_REQUIRES = frozenset({"rank_offset", "world_size"})
UPDATE_INFO_ACCEPTS = frozenset({"names", "dtype_names", "shapes"})
UNIQUE_ID_BYTES = 128


class FakeNccl:
    """NcclBackend: unique ids and a group whose broadcasts reach every joined server's queue."""

    def __init__(self, timeout_s: float = 10.0):
        self.uid: bytes | None = None
        self.timeout_s = timeout_s
        self.queues: dict[str, queue.Queue] = {}
        self.joined = threading.Event()
        self.expected = 0
        self.lock = threading.Lock()
        # NCCL's behaviour when a peer is gone mid-broadcast: the kernel (synchronize here) never
        # completes until ncclCommAbort
        self.stall_broadcasts = False
        self.comms: list[_FakeComm] = []
        # NCCL's collectives start once every rank is in the group: the servers the double serves
        # (VLLMNcclDouble sets them) must all have joined before the warm-up all_reduce goes out
        self.servers: set[str] = set()
        self.all_joined = threading.Condition(self.lock)

    def unique_id(self) -> bytes:
        import os

        self.uid = os.urandom(UNIQUE_ID_BYTES)
        return self.uid

    def server_joins(self, url: str, uid: bytes, world_size: int) -> queue.Queue:
        if uid != self.uid:
            raise ValueError("a server joined with another unique id")
        with self.lock:
            q = self.queues.setdefault(url, queue.Queue())
            self.all_joined.notify_all()
        return q

    def wait_for_group(self) -> None:
        """Blocks like a collective whose peers have not all joined (the caller bounds the wait)."""
        with self.lock:
            if not self.all_joined.wait_for(lambda: self.servers <= set(self.queues), self.timeout_s):
                raise RuntimeError(f"servers {sorted(self.servers - set(self.queues))} never joined the group")

    def join(self, uid: bytes, world_size: int, rank: int, device):
        assert rank == 0 and uid == self.uid
        self.expected = world_size
        self.comms.append(_FakeComm(self))
        return self.comms[-1]


class _FakeComm:
    def __init__(self, net: FakeNccl):
        self.net = net
        self.ops: list[tuple[str, tuple, torch.dtype]] = []
        self.aborted = threading.Event()
        self.synchronize_returned = threading.Event()

    def _send(self, op: str, t: torch.Tensor) -> None:
        self.net.wait_for_group()
        self.ops.append((op, tuple(t.shape), t.dtype))
        for q in list(self.net.queues.values()):
            q.put((op, t.detach().clone()))

    def all_reduce(self, t: torch.Tensor) -> None:
        self._send("all_reduce", t)

    def broadcast(self, t: torch.Tensor) -> None:
        self._send("broadcast", t)

    def synchronize(self) -> None:
        if self.net.stall_broadcasts and self.ops and self.ops[-1][0] == "broadcast":
            self.aborted.wait(600)  # a stalled kernel ends only when the communicator is aborted
        self.synchronize_returned.set()

    def abort(self) -> str:
        self.aborted.set()
        return "the NCCL communicator was aborted"


class VLLMNcclDouble:
    """Stands in for ServerClient.request_once of every server (monkeypatch it to this)."""

    def __init__(self, net: FakeNccl, world_sizes: dict[str, int]):
        self.net = net
        self.world_sizes = dict(world_sizes)
        self.calls: list[tuple[str, str, str, object]] = []  # (url, method, path, body)
        self.state = {u: {"queue": None, "active": False, "version": "default", "weights": {}, "paused": False,
                          "inits": 0} for u in world_sizes}
        self.fail_update: set[str] = set()  # servers whose update_weights errors (HTTP 500)
        self.never_join: set[str] = set()  # servers whose init blocks without joining
        self.join_delay_s: dict[str, float] = {}  # servers whose worker reaches the group late
        net.servers = set(world_sizes)

    def __call__(self, client, method, path, payload=None, *, timeout_s=None):
        url = client.url
        split = urllib.parse.urlsplit(path)
        self.calls.append((url, method, split.path, payload))
        st = self.state[url]
        try:
            out = self._route(url, st, method, split.path, dict(urllib.parse.parse_qsl(split.query)), payload or {},
                              timeout_s)
        except ValueError as e:  # vLLM answers an invalid request with an error status
            return 400, json.dumps({"error": str(e)}).encode()
        except RuntimeError as e:
            return 500, json.dumps({"error": str(e)}).encode()
        return 200, json.dumps(out).encode()

    def _route(self, url, st, method, path, query, body, timeout_s):
        if path == "/get_world_size":
            return {"world_size": self.world_sizes[url]}
        if path == "/version":
            from gspo_megatron.rollout.vllm_api import VLLM_VERSION

            return {"version": VLLM_VERSION}
        if path in ("/health",):
            return {}
        if path == "/pause":
            if query.get("mode") not in ("abort", "wait", "keep"):
                raise ValueError(f"bad pause mode {query}")
            st.setdefault("pause_modes", []).append(query["mode"])
            st["paused"] = True
            return {"status": "paused"}
        if path == "/resume":
            st["paused"] = False
            return {"status": "resumed"}
        if path == "/weight_info":
            return {"weight_version": st["version"]}
        if path == "/init_weight_transfer_engine":
            return self._init(url, st, body, timeout_s)
        if path == "/start_weight_update":
            if st["queue"] is None:
                raise RuntimeError("Weight transfer not initialized")
            st["active"] = True
            return {"message": "Weight update started"}
        if path == "/update_weights":
            return self._update(url, st, body)
        if path == "/finish_weight_update":
            if not st["active"]:
                raise RuntimeError("finish_weight_update called without a matching start_weight_update.")
            st["active"] = False
            if body.get("weight_version") is not None:
                st["version"] = str(body["weight_version"])
            return {"message": "Weight update finished"}
        raise ValueError(f"the double does not serve {method} {path}")

    def _init(self, url, st, body, timeout_s):
        if set(body) != {"init_info"}:
            raise ValueError(f"init body keys {sorted(body)}")
        info = body["init_info"]
        unknown = set(info) - INIT_INFO_ACCEPTS
        missing = INIT_INFO_REQUIRES - set(info)
        if unknown or missing:
            raise ValueError(f"Invalid init_info: unexpected {sorted(unknown)}, missing {sorted(missing)}")
        has_uid = bool(info.get("nccl_unique_id_b64"))
        has_addr = info.get("master_address") is not None or info.get("master_port") is not None
        if has_uid == has_addr:
            raise ValueError("pass nccl_unique_id_b64 OR master_address/master_port")
        try:
            uid = base64.b64decode(info["nccl_unique_id_b64"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError("nccl_unique_id_b64 is not valid standard base64") from e
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"nccl_unique_id_b64 must decode to {UNIQUE_ID_BYTES} bytes")
        if url in self.never_join:
            threading.Event().wait(timeout_s or 5)  # blocks like a worker that cannot reach rank 0
            raise RuntimeError("NCCL init timed out")
        if url in self.join_delay_s:
            threading.Event().wait(self.join_delay_s[url])  # a worker slow to start its side
        q = self.net.server_joins(url, uid, int(info["world_size"]))
        op, t = q.get(timeout=self.net.timeout_s)  # the warm-up collective comes first
        if op != "all_reduce" or tuple(t.shape) != (1,) or t.dtype != torch.float32:
            raise RuntimeError(f"the first collective was {op} {tuple(t.shape)} {t.dtype}, not the warm-up all_reduce")
        st.update(queue=q, info=dict(info), inits=st["inits"] + 1, packed=bool(info.get("packed", False)))
        return {"message": "Weight transfer initialized"}

    def _update(self, url, st, body):
        if not st["active"]:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        info = body.get("update_info")
        if not isinstance(info, dict) or set(info) - UPDATE_INFO_ACCEPTS or UPDATE_INFO_ACCEPTS - set(info):
            raise ValueError(f"Invalid update_info {info!r:.200}")
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError("`dtype_names` / `shapes` should be of the same size as `names`")
        if url in self.fail_update:
            raise RuntimeError("update failed on the worker")
        for name, dt, shape in zip(names, dtypes, shapes):
            op, t = st["queue"].get(timeout=self.net.timeout_s)
            want = getattr(torch, dt)
            if op != "broadcast" or list(t.shape) != list(shape) or t.dtype != want:
                raise RuntimeError(f"{name}: received {op} {list(t.shape)} {t.dtype}, expected {shape} {dt}")
            st["weights"][name] = t
        return {"message": "Weights updated"}
