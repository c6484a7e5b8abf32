"""Policy weights from the trainer into SGLang servers: bucketing and the three transports.

All three take the HF-named full tensors that `gspo_megatron.model.export.iter_hf_tensors` streams
(on global rank 0; every other rank must drain its iterator — see `drain`) and a version number:

* ``disk``: `save_hf_checkpoint` writes ``<shared_dir>/v<version>`` atomically (temp dir + rename),
  then every server gets ``POST /update_weights_from_disk`` {model_path, load_format,
  weight_version, flush_cache: false}; older version directories are deleted once every server has
  loaded the new one. ``shared_dir`` must be visible to the servers at the same path.
* ``distributed``: once, ``POST /init_weights_update_group`` {master_address, master_port,
  rank_offset, world_size, group_name, backend} to every server while this process joins the same
  group as rank 0 (SGLang's rendezvous: a TCP store at master_address:master_port hosted by rank 0,
  the group's keys under the group name; server i's TP rank r is rank_offset_i + r, with
  rank_offset_0 = 1). Then per bucket of ~bucket_mb: ``POST /update_weights_from_distributed``
  {names, dtypes, shapes, group_name, flush_cache: false, weight_version} to every server and, while
  those requests wait, one broadcast per tensor from rank 0 in the listed order (NCCL on GPU, gloo
  on CPU — which is how the tests check it against the HTTP test double).
* ``tensor``: colocated servers. Per bucket, ``POST /update_weights_from_tensor``
  {serialized_named_tensors: one entry per server TP rank, load_format: null, flush_cache: false,
  weight_version}. An entry is SGLang's ``MultiprocessingSerializer`` format: the list of
  (name, tensor) pickled with torch's ``ForkingPickler`` (CUDA tensors travel as IPC handles, the
  device named by UUID with SGLang's patched reductions), base64-encoded; each TP rank's entry is
  serialized separately, as SGLang's Engine does.

``distributed`` and ``tensor`` pushes run inside a weight-update session (``POST
/begin_weight_update`` on every server before the first bucket, ``POST /end_weight_update`` after
the last, also when a bucket fails): SGLang 0.5.23 refuses those updates outside one.
Request bodies are built with rollout/sglang_api.py, the one table of what we send.

Every transport sends ``flush_cache: false`` and the engine flushes afterwards with
``POST /flush_cache``, retried while the server still has requests (SGLang's in-request flush asserts
instead of retrying). The version is sent as a string (SGLang's ``weight_version`` is a str) on
every request of an update, so a server reports it as soon as its first bucket lands; generation
is never interleaved with a sync in the trainer's loop, and an update that fails part-way leaves the
engine refusing to generate until a complete update succeeds.
"""
from __future__ import annotations

import base64
import datetime
import inspect
import io
import logging
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Sequence

import torch

from .sglang_api import payload as api_payload
from .sglang_server import SGLangError, SGLangServerError, ServerClient, check_success

log = logging.getLogger("gspo_megatron.rollout")

WEIGHT_SYNC_MODES = ("disk", "distributed", "tensor")
VERSION_DIR_RE = re.compile(r"^v(\d+)$")


# ---------------------------------------------------------------------------------- helpers
def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (what SGLang's update_weights_from_distributed expects)."""
    return str(dtype).replace("torch.", "")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    d = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return d


class LoadedTogether:
    """Names an engine must receive in one weight update (ModelFamily.weights_loaded_together):
    `partners(name)` is the rest of `name`'s group, empty for a name in no group."""

    def __init__(self, templates: Sequence[Sequence[str]] = ()):
        self._groups = []
        for group in templates:
            pats = [re.compile(re.escape(t).replace(r"\{layer\}", r"(?P<layer>\d+)")) for t in group]
            self._groups.append((tuple(group), pats))

    def __bool__(self) -> bool:
        return bool(self._groups)

    def partners(self, name: str) -> frozenset[str]:
        for group, pats in self._groups:
            for p in pats:
                m = p.fullmatch(name)
                if m is not None:
                    layer = m.groupdict().get("layer")
                    return frozenset(t.format(layer=layer) for t in group) - {name}
        return frozenset()


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    together: LoadedTogether | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a (name, tensor) stream into lists of at most `bucket_bytes` (a larger tensor is a
    bucket of its own). Floating tensors are cast to `dtype`, all moved to `device`, made
    contiguous. Holds one bucket at a time.

    `together`: groups an engine loads only when they arrive in one request. No bucket ends while
    a group is open (a member seen, another still to come), so a bucket holding a group may pass
    `bucket_bytes` by what lies between its members (~0.1 GB at bf16 for the largest group the
    families declare today). A group the stream never completes is an error naming the
    missing tensor (the families' groups name tensors their exports hold:
    tests/test_model_families.py)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    seen: set[str] = set()
    waiting: set[str] = set()  # members of open groups not yet in the bucket
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"weight sync: tensor {name!r} appears twice in the stream")
        seen.add(name)
        t = t.detach()
        if device is not None:
            t = t.to(device)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        n = tensor_nbytes(t)
        if bucket and size + n > bucket_bytes and not waiting:
            yield bucket
            bucket, size = [], 0
        if together:
            waiting.discard(name)
            waiting |= together.partners(name) - seen
        bucket.append((name, t))
        size += n
    if waiting:
        raise ValueError(f"weight sync: {sorted(waiting)[0]!r} must reach the engine with its group, but the "
                         "stream has no such tensor")
    if bucket:
        yield bucket


def drain(named_tensors: Iterable[Any]) -> None:
    """Exhaust a weight stream on ranks that hold no engine (iter_hf_tensors' collectives need
    every rank to iterate)."""
    for _ in named_tensors:
        pass


def _parallel(servers: Sequence[ServerClient], fn) -> list[Any]:
    """fn(server) on every server concurrently; the first error is raised after all finished."""
    if len(servers) == 1:
        return [fn(servers[0])]
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        futs = [pool.submit(fn, s) for s in servers]
        errors = []
        out = []
        for f in futs:
            try:
                out.append(f.result())
            except BaseException as e:  # collect: every request was bounded by its timeout
                errors.append(e)
        if errors:
            raise errors[0]
        return out


class weight_update_session:
    """``POST /begin_weight_update`` on every server, the push, ``POST /end_weight_update`` on every
    server: SGLang 0.5.23 applies update_weights_from_distributed / _from_tensor only inside such a
    session (http_server.py:1458-1485; its weight updater answers success=False otherwise). The
    session is closed on every server that opened it also when the push fails (the push's error
    is the one raised; a failing close is then only added to its message)."""

    def __init__(self, servers: Sequence[ServerClient], timeout_s: float):
        self.servers = list(servers)
        self.timeout_s = timeout_s
        self.opened: list[ServerClient] = []

    def _call(self, s: ServerClient, route: str) -> dict:
        return check_success(s.post(route, api_payload(route), timeout_s=self.timeout_s, retries=0,
                                    ok_statuses=(200, 400)), s.url, route)

    def __enter__(self):
        try:
            for s in self.servers:
                self._call(s, "/begin_weight_update")
                self.opened.append(s)
        except BaseException:
            self._close(None)
            raise
        return self

    def _close(self, error: BaseException | None) -> None:
        failures = []
        for s in self.opened:
            try:
                self._call(s, "/end_weight_update")
            except Exception as e:  # every opened session gets its close attempt
                failures.append(f"{s.url}: {e}")
        self.opened = []
        if failures and error is None:
            raise SGLangError("closing the weight-update session failed: " + "; ".join(failures))
        if failures and error is not None and error.args:
            error.args = (f"{error.args[0]} (and closing the weight-update session failed: "
                          f"{'; '.join(failures)})", *error.args[1:])

    def __exit__(self, exc_type, exc, tb):
        self._close(exc)
        return False


def flush_cache(server: ServerClient, timeout_s: float, poll_s: float = 0.2) -> int:
    """POST /flush_cache until it succeeds (SGLang answers 400 while requests are pending).
    Returns the number of attempts."""
    deadline = time.monotonic() + timeout_s
    attempt = 0
    last = ""
    while True:
        attempt += 1
        status, data = _once_with_retries(server, "POST", "/flush_cache", api_payload("/flush_cache"))
        if status == 200:
            return attempt
        last = f"HTTP {status}: {data[:200].decode('utf-8', 'replace')}"
        if time.monotonic() + poll_s > deadline:
            raise SGLangServerError(
                f"SGLang server {server.url}: /flush_cache did not succeed within {timeout_s:g} s "
                f"({attempt} attempts; last: {last}); requests still pending?",
                url=server.url, status=status,
            )
        time.sleep(poll_s)
        poll_s = min(poll_s * 1.5, 2.0)


def _once_with_retries(server: ServerClient, method: str, path: str, payload) -> tuple[int, bytes]:
    """Status + body, retrying connection errors and 5xx like ServerClient.request."""
    from .sglang_server import RetryableHTTPError

    last = None
    for attempt in range(server.max_retries + 1):
        if attempt:
            time.sleep(server.backoff(attempt))
        try:
            status, data = server.request_once(method, path, payload)
        except RetryableHTTPError as e:
            last = e
            continue
        if status >= 500:
            last = SGLangServerError(f"HTTP {status}: {data[:200]!r}", url=server.url, status=status)
            continue
        return status, data
    raise SGLangServerError(
        f"SGLang server {server.url}: {method} {path} failed after {server.max_retries + 1} "
        f"attempt(s); last error: {last}", url=server.url,
    ) from last


# ---------------------------------------------------------------------------------- disk
def version_dir(shared_dir: str, version: int) -> str:
    return os.path.join(os.path.abspath(shared_dir), f"v{version:08d}")


def prune_versions(shared_dir: str, keep: Iterable[str]) -> list[str]:
    """Delete `v<N>` directories of shared_dir not in `keep` (abs paths); returns what went."""
    keep = {os.path.abspath(k) for k in keep}
    gone = []
    if not os.path.isdir(shared_dir):
        return gone
    for name in os.listdir(shared_dir):
        p = os.path.abspath(os.path.join(shared_dir, name))
        if VERSION_DIR_RE.match(name) and os.path.isdir(p) and p not in keep:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


class DiskSync:
    mode = "disk"

    def __init__(
        self,
        servers: Sequence[ServerClient],
        *,
        shared_dir: str,
        hf_config: dict,
        dtype: torch.dtype | None = None,
        copy_from: str | None = None,
        load_format: str | None = None,
        timeout_s: float = 600.0,
        keep_versions: int = 1,
    ):
        if not shared_dir:
            raise ValueError("disk weight sync needs shared_dir (a directory the servers can read)")
        if not hf_config:
            raise ValueError("disk weight sync needs the model's HF config (written as config.json)")
        self.servers = list(servers)
        self.shared_dir = os.path.abspath(shared_dir)
        self.hf_config = dict(hf_config)
        self.dtype = dtype
        self.copy_from = copy_from if copy_from and os.path.isdir(copy_from) else None
        self.load_format = load_format
        self.timeout_s = timeout_s
        self.keep_versions = max(1, keep_versions)
        self._written: list[str] = []

    def update(self, named_tensors, version: int) -> dict:
        """Write the tensors once as the version's directory, then every server loads it. If a
        load fails the directory stays written (`pending`): retry_pending() loads it again."""
        t0 = time.perf_counter()
        path = version_dir(self.shared_dir, version)
        nbytes = _save_hf(named_tensors, path, self.hf_config, self.dtype, self.copy_from)
        self.pending = (path, version, {"bytes": nbytes, "write_s": time.perf_counter() - t0, "path": path})
        return self.retry_pending()

    pending: tuple[str, int, dict] | None = None  # a version written and not yet loaded everywhere

    def retry_pending(self) -> dict:
        """Every server loads the written version (a server back after a loss included)."""
        path, version, stats = self.pending
        _parallel(self.servers, lambda s: self._load(s, path, version))
        self.pending = None
        self._written.append(path)
        keep = self._written[-self.keep_versions :]
        prune_versions(self.shared_dir, keep)
        self._written = keep
        return stats

    def _load(self, server: ServerClient, path: str, version: int) -> None:
        fields = {"model_path": path, "weight_version": str(version), "flush_cache": False}
        if self.load_format:
            fields["load_format"] = self.load_format
        # not retried on 5xx beyond the client's policy: a reload is idempotent
        check_success(server.post("/update_weights_from_disk", api_payload("/update_weights_from_disk", **fields),
                                  timeout_s=self.timeout_s, ok_statuses=(200, 400)),
                      server.url, "/update_weights_from_disk")

    def reload(self, server: ServerClient, version: int) -> None:
        """One server (back after a loss, rollout/supervision.py) reloads the last version all
        servers loaded, labelled `version` (the engine's: the one that directory holds)."""
        if not self._written:
            raise ValueError("disk weight sync: nothing written yet to reload")
        self._load(server, self._written[-1], version)

    def close(self) -> None:
        pass


def _save_hf(named_tensors, path, hf_config, dtype, copy_from) -> int:
    from gspo_megatron.model.hf_writer import save_hf_checkpoint

    # command=None: the sync's own v<N> folders, replaced unchecked (they carry no output marker:
    # gspo_megatron/fsutil.py; a resumed run after an upgrade finds unmarked ones)
    return save_hf_checkpoint(named_tensors, path, hf_config, dtype=dtype, copy_from=copy_from, command=None)


# ---------------------------------------------------------------------------------- distributed
def host_store(master_address: str, master_port: int, world_size: int, timeout_s: float):
    """Rank 0's TCP store of the weight-update rendezvous, bound now; port 0 lets the OS pick a
    free one (read it back from `.port`): the port is bound by the process that serves it, so
    nothing can take it between choosing and binding.

    The TCP store directly, not c10d.rendezvous("tcp://..."): under torchrun the trainer's
    environment has TORCHELASTIC_USE_AGENT_STORE=True, with which the tcp rendezvous never hosts
    a store (it expects torchrun's agent store at that address), so rank 0 would wait as a
    client for a server nobody starts (found by tests/test_train_sglang.py, colocated)."""
    import torch.distributed as dist

    return dist.TCPStore(master_address, int(master_port), world_size, is_master=True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_weight_update_group(
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    timeout_s: float = 600.0,
    store=None,
):
    """Join (or, as rank 0, host) the weight-update process group the way SGLang's servers do:
    a TCP-store rendezvous at tcp://master_address:master_port, the group's keys prefixed by
    `group_name`, a process group of `backend` registered under that name. Rank 0 may pass the
    store it already hosts (host_store). Needs no default process group, and leaves any existing
    one untouched."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = host_store(master_address, master_port, world_size, timeout_s) if rank == 0 else dist.TCPStore(
            master_address, int(master_port), world_size, is_master=False, timeout=timeout)
    store = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    opt_name = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), store,
        group_name=group_name, timeout=timeout, **{opt_name: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_weight_update_group(pg) -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group(pg)
    except Exception:
        pass


def abort_weight_update_group(pg) -> str:
    """End `pg` after a failed or interrupted push, without waiting for its pending broadcasts:
    since torch 2.6 destroy_process_group shuts a group down by flushing its pending work
    (distributed_c10d.py destroy_process_group -> pg.shutdown()), which waits for servers that
    will never join the broadcast (the trainer hung at exit). Abort drops the work instead
    (distributed_c10d.py _abort_process_group: pg.abort(), then the group's entries removed).
    What happened, for the log."""
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._abort_process_group(pg)
        return "the weight-update group was aborted"
    except Exception as e:  # the run's own error is the one to report
        return f"aborting the weight-update group failed: {type(e).__name__}: {e}"


class DistributedSync:
    mode = "distributed"

    def __init__(
        self,
        servers: Sequence[ServerClient],
        *,
        ranks_per_server: Sequence[int],
        master_address: str,
        master_port: int,
        backend: str,
        group_name: str = "gspo_weight_sync",
        bucket_bytes: int = 512 << 20,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
        together: LoadedTogether | None = None,
    ):
        if len(ranks_per_server) != len(servers):
            raise ValueError("ranks_per_server needs one entry per server")
        self.together = together
        self.servers = list(servers)
        self.ranks_per_server = [int(r) for r in ranks_per_server]
        self.master_address = master_address
        self.master_port = int(master_port)
        self.backend = backend
        self.group_name = group_name
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.pg = None
        self.broken: str | None = None

    @property
    def world_size(self) -> int:
        return 1 + sum(self.ranks_per_server)

    def rank_offsets(self) -> list[int]:
        out, off = [], 1
        for r in self.ranks_per_server:
            out.append(off)
            off += r
        return out

    def init_group(self) -> None:
        """Form the group: this process hosts the rendezvous store (on master_port, or on a port
        the OS picks when it is 0) and joins as rank 0 while every server joins over HTTP."""
        if self.pg is not None:
            return
        offsets = self.rank_offsets()
        try:
            store = host_store(self.master_address, self.master_port, self.world_size, self.timeout_s)
        except Exception as e:
            raise SGLangError(f"weight-update group {self.group_name!r}: cannot host its store at "
                              f"{self.master_address}:{self.master_port}: {e}") from e
        self.master_port = store.port
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool:
            futs = [
                pool.submit(
                    s.post, "/init_weights_update_group",
                    api_payload(
                        "/init_weights_update_group", master_address=self.master_address,
                        master_port=self.master_port, rank_offset=off, world_size=self.world_size,
                        group_name=self.group_name, backend=self.backend,
                    ),
                    timeout_s=self.timeout_s, retries=0,  # a half-formed group cannot be retried
                    ok_statuses=(200, 400),
                )
                for s, off in zip(self.servers, offsets)
            ]
            try:
                pg = init_weight_update_group(
                    master_address=self.master_address, master_port=self.master_port, rank=0,
                    world_size=self.world_size, group_name=self.group_name, backend=self.backend,
                    timeout_s=self.timeout_s, store=store,
                )
            except Exception as e:
                errs = [f.exception() for f in futs if f.done() and f.exception() is not None]
                raise SGLangError(
                    f"weight-update group {self.group_name!r} at {self.master_address}:{self.master_port} "
                    f"(world {self.world_size}) did not form: {e}"
                    + (f"; server side: {errs[0]}" if errs else "")
                ) from e
            for s, f in zip(self.servers, futs):
                check_success(f.result(), s.url, "/init_weights_update_group")
        self.pg = pg

    def update(self, named_tensors, version: int) -> dict:
        if self.broken:
            raise SGLangError(f"the weight-update group is unusable after an earlier failure ({self.broken})")
        self.init_group()
        try:
            return self._update(named_tensors, version)
        except BaseException as e:  # a broadcast of ours may be pending: the group cannot be reused or destroyed
            if not self.broken:
                self.broken = f"a push failed or was interrupted: {type(e).__name__}: {str(e)[:200]}"
            raise

    def _update(self, named_tensors, version: int) -> dict:
        import torch.distributed as dist

        nbytes, nbuckets = 0, 0
        with ThreadPoolExecutor(max_workers=len(self.servers)) as pool, \
                weight_update_session(self.servers, self.timeout_s):
            for bucket in iter_buckets(named_tensors, self.bucket_bytes, dtype=self.dtype, device=self.device,
                                       together=self.together):
                payload = api_payload(
                    "/update_weights_from_distributed",
                    names=[n for n, _ in bucket], dtypes=[dtype_name(t.dtype) for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket], group_name=self.group_name,
                    flush_cache=False, weight_version=str(version),
                )
                futs = [
                    pool.submit(s.post, "/update_weights_from_distributed", payload,
                                timeout_s=self.timeout_s, retries=0, ok_statuses=(200, 400))
                    for s in self.servers
                ]
                works = [dist.broadcast(t, group_src=0, group=self.pg, async_op=True) for _, t in bucket]
                self._wait(works, futs)
                for s, f in zip(self.servers, futs):
                    check_success(f.result(), s.url, "/update_weights_from_distributed")
                nbytes += sum(tensor_nbytes(t) for _, t in bucket)
                nbuckets += 1
        return {"bytes": nbytes, "buckets": nbuckets}

    def _wait(self, works, futs) -> None:
        """Wait for the broadcasts while watching the HTTP side: a server that rejects the bucket
        never joins the broadcast, so fail with its answer instead of waiting out the timeout."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if all(w.is_completed() for w in works):
                for w in works:
                    w.wait()
                return
            for f in futs:
                if f.done():
                    exc = f.exception()
                    ok = exc is None and isinstance(f.result(), dict) and f.result().get("success")
                    if not ok:
                        self.broken = f"a server failed a bucket: {exc or f.result()}"
                        raise SGLangError(
                            f"distributed weight sync: {exc or f.result()} (the broadcast cannot "
                            "complete; the weight-update group is now unusable)"
                        )
            if time.monotonic() > deadline:
                self.broken = "broadcast timed out"
                raise SGLangError(f"distributed weight sync: broadcast not done after {self.timeout_s:g} s")
            time.sleep(0.002)

    def close(self) -> None:
        if self.pg is None:
            return
        pg, self.pg = self.pg, None
        if self.broken:  # first: a server stuck in the broadcast may not answer the requests below
            log.error("distributed weight sync closed after a failure (%s): %s", self.broken,
                      abort_weight_update_group(pg))
        for s in self.servers:
            try:
                s.post("/destroy_weights_update_group",
                       api_payload("/destroy_weights_update_group", group_name=self.group_name),
                       timeout_s=10, retries=0)
            except Exception:
                pass
        if not self.broken:
            destroy_weight_update_group(pg)


# ---------------------------------------------------------------------------------- tensor
def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's MultiprocessingSerializer wire format with output_str: base64 of the
    ForkingPickler pickle (CUDA tensors become IPC handles, CPU tensors shared memory).

    CUDA tensors are pickled with SGLang's patched torch reductions
    (sglang/srt/utils/patch_torch.py monkey_patch_torch_reductions, which SGLang's Engine applies
    before serializing): the device travels as its UUID, so the server finds the GPU whatever its
    CUDA_VISIBLE_DEVICES. That needs sglang importable in this process; without it CUDA tensors
    are refused with one line (CPU tensors, the tests' case, need no patch)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions)

    if any(t.is_cuda for _, t in named):
        try:
            from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            raise SGLangError("weight_sync=tensor with CUDA tensors needs sglang importable in the trainer "
                              "process (its CUDA-IPC reductions name the GPU by UUID); install the sglang "
                              "extra") from None
        monkey_patch_torch_reductions()

    buf = io.BytesIO()
    ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class TensorSync:
    mode = "tensor"

    def __init__(
        self,
        servers: Sequence[ServerClient],
        *,
        ranks_per_server: Sequence[int],
        bucket_bytes: int = 512 << 20,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
        load_format: str | None = None,
        together: LoadedTogether | None = None,
    ):
        self.together = together
        self.servers = list(servers)
        self.ranks_per_server = [int(r) for r in ranks_per_server]
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.load_format = load_format

    def update(self, named_tensors, version: int) -> dict:
        with weight_update_session(self.servers, self.timeout_s):
            return self._update(named_tensors, version)

    def _update(self, named_tensors, version: int) -> dict:
        nbytes, nbuckets = 0, 0
        for bucket in iter_buckets(named_tensors, self.bucket_bytes, dtype=self.dtype, device=self.device,
                                   together=self.together):
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # data ready before IPC readers

            def send(s_r):
                s, ranks = s_r
                # one payload per TP rank, each serialized on its own as SGLang's Engine does
                # (entrypoints/engine.py _serialize_tensors_per_rank): a rank deserializes only
                # its copy, so CUDA-IPC reference counts drop cleanly after every load
                payload = api_payload(
                    "/update_weights_from_tensor",
                    serialized_named_tensors=[serialize_named_tensors(bucket) for _ in range(ranks)],
                    load_format=self.load_format, flush_cache=False, weight_version=str(version),
                )
                return check_success(
                    s.post("/update_weights_from_tensor", payload, timeout_s=self.timeout_s, retries=0,
                           ok_statuses=(200, 400)),
                    s.url, "/update_weights_from_tensor",
                )

            pairs = list(zip(self.servers, self.ranks_per_server))
            if len(pairs) == 1:
                send(pairs[0])
            else:
                with ThreadPoolExecutor(max_workers=len(pairs)) as pool:
                    list(pool.map(send, pairs))
            nbytes += sum(tensor_nbytes(t) for _, t in bucket)
            nbuckets += 1
            del bucket  # tensors must outlive the requests that map them
        return {"bytes": nbytes, "buckets": nbuckets}

    def close(self) -> None:
        pass
