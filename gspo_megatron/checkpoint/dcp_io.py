"""Stream tensors into and out of PyTorch Distributed Checkpoint (DCP) files — the storage layer of
Megatron's `torch_dist` format — one chunk at a time.

Writing: `save_chunks` runs `torch.distributed.checkpoint.save` with a planner whose write items
are declared up front (key, global shape, chunk offsets/sizes, dtype) and whose data is produced
lazily by a callback when the storage writer reaches the item. DCP's writer asks for items one at
a time in plan order, so memory is one chunk (plus its producer's temporaries), never the model.
Under torch.distributed each rank declares its own chunks; DCP merges the plans into the one
global `.metadata` on rank 0, exactly as it does for Megatron's own saves.

Reading: `DcpReader` reads the global metadata (with the restricted unpickler of
gspo_megatron/checkpoint/safe_metadata.py: nothing in a checkpoint runs code) and returns any
rectangular region of a stored tensor by loading only the chunks that overlap it (each chunk is a
`torch.save`d tensor at a known file offset, read with checkpoint/safe_torch.py, never torch.load), so a reader can walk
a checkpoint layer by layer whatever chunking wrote it (the converter's one-chunk-per-layer/expert,
or Megatron's per-rank shards).
"""
from __future__ import annotations

import io
import os
import queue
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.distributed.checkpoint import FileSystemWriter

from gspo_megatron.checkpoint.safe_torch import loads_torch, pread_exact
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from gspo_megatron.checkpoint.safe_metadata import METADATA_FILE, read_dcp_metadata, require_tensor_entries
from gspo_megatron.errors import CheckpointError


@dataclass
class Chunk:
    """One tensor chunk to write: `produce()` must return a tensor of `sizes` and `dtype`."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.sizes:
            n *= s
        return n


class _LazyPlanner(DefaultSavePlanner):
    """A save planner over declared chunks; data comes from each chunk's producer on demand.
    `objects`: DCP byte entries (key -> bytes), e.g. Megatron's `_extra_state` ShardedObjects."""

    def __init__(self, chunks: Sequence[Chunk], on_written: Callable[[Chunk], None] | None = None,
                 objects: dict[str, bytes] | None = None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {MetadataIndex(c.key, torch.Size(c.offsets)): c for c in chunks}
        if len(self._chunks) != len(chunks):
            raise AssertionError("duplicate chunk in a checkpoint plan")
        self._order = list(chunks)
        self._objects = dict(objects or {})
        self._on_written = on_written
        self.error: BaseException | None = None  # the first producer failure, unwrapped

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            )
            for c in self._order
        ] + [WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self._objects]
        self.plan = SavePlan(items)
        return self.plan

    def create_global_plan(self, all_plans):
        # DefaultSavePlanner validates chunk overlaps pairwise: quadratic in the chunks of a key
        # (48 layers x 128 experts = 6144 chunks per expert tensor of Qwen3-30B-A3B). The chunks
        # here come from distinct (layer, expert) offsets, so bounds and total volume suffice.
        global_plan, metadata = create_default_global_save_plan(all_plans)
        for key, md in metadata.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                continue  # a byte entry
            volume = 0
            for ch in md.chunks:
                if any(o < 0 or o + s > g for o, s, g in zip(ch.offsets, ch.sizes, md.size)):
                    raise AssertionError(f"{key}: chunk {list(ch.offsets)}+{list(ch.sizes)} outside {list(md.size)}")
                n = 1
                for s in ch.sizes:
                    n *= s
                volume += n
            total = 1
            for s in md.size:
                total *= s
            if volume != total:
                raise AssertionError(f"{key}: chunks cover {volume} of {total} elements")
        self.global_plan, self.metadata = global_plan, metadata
        return global_plan, metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        c = self._chunks[write_item.index]
        try:
            t = c.produce()
        except BaseException as e:
            if self.error is None:
                self.error = e
            raise
        if tuple(t.shape) != tuple(c.sizes) or t.dtype != c.dtype:
            raise AssertionError(f"{c.key}{list(c.offsets)}: produced {t.dtype}{list(t.shape)}, "
                                 f"declared {c.dtype}{list(c.sizes)}")
        if self._on_written is not None:
            self._on_written(c)
        return t.contiguous()


class _BoundedFileWriter(FileSystemWriter):
    """DCP's file writer with files of at most `max_file_bytes` (a chunk larger than that gets a
    file of its own), filled with consecutive chunks in plan order so reading back layer by layer
    is sequential. DCP itself writes one file per rank and thread."""

    def __init__(self, path: str, max_file_bytes: int, **kw):
        super().__init__(path, single_file_per_rank=True, **kw)
        self.max_file_bytes = max_file_bytes

    def write_data(self, plan, planner):
        from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

        prefix = plan.storage_data.prefix
        buckets: list[list[WriteItem]] = []
        size = 0
        for item in plan.items:
            n = _chunk_bytes(item)
            if not buckets or (buckets[-1] and size + n > self.max_file_bytes):
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += n
        file_queue: queue.Queue = queue.Queue()
        for i, bucket in enumerate(buckets):
            name = f"{prefix}{i}{DEFAULT_SUFFIX}"
            file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, file_queue)


def _chunk_bytes(item: WriteItem) -> int:
    # (WriteItem.tensor_storage_size() is the size of the whole global tensor, not of the chunk)
    if item.tensor_data is None:
        return 0
    n = item.tensor_data.properties.dtype.itemsize
    for s in item.tensor_data.chunk.sizes:
        n *= s
    return n


def save_chunks(
    chunks: Sequence[Chunk],
    directory: str,
    *,
    max_file_bytes: int,
    threads: int = 1,
    on_written: Callable[[Chunk], None] | None = None,
    sync_files: bool = True,
    objects: dict[str, bytes] | None = None,
    process_group=None,
) -> None:
    """Write `chunks` (this rank's share) as a DCP checkpoint in `directory` (collective when
    torch.distributed is initialized: every rank calls it with its own chunks). `objects`: byte
    entries to store too (give them on one rank only). `process_group`: the group DCP's planning
    collectives run on (default: the world's)."""
    planner = _LazyPlanner(chunks, on_written, objects)
    writer = _BoundedFileWriter(directory, max_file_bytes, thread_count=max(1, threads), sync_files=sync_files)
    try:
        import torch.distributed as dist

        no_dist = not (dist.is_available() and dist.is_initialized())
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process is the intent
            dcp_save({}, storage_writer=writer, planner=planner, no_dist=no_dist, process_group=process_group)
    except BaseException as e:
        # DCP wraps failures of any rank into a CheckpointException; surface our own first error.
        if planner.error is not None and planner.error is not e:
            raise planner.error from None
        inner = _first_wrapped_error(e)
        if inner is not None:
            raise inner from None
        raise


def _first_wrapped_error(e: BaseException) -> BaseException | None:
    failures = getattr(e, "failures", None)
    if not failures:
        return None
    for _, f in sorted(failures.items()):
        exc = f[0] if isinstance(f, tuple) else f  # (exception, stack summary)
        if isinstance(exc, BaseException):
            return exc
    return None


# ----------------------------------------------------------------------------------------------
# Reading


class DcpReader:
    """Region reads from a DCP checkpoint directory (Megatron torch_dist or the converter's)."""

    def __init__(self, directory: str):
        """`directory`: a torch_dist directory, or a Megatron-LM root (megatron_dirs.py)."""
        from gspo_megatron.checkpoint.megatron_dirs import resolve

        from gspo_megatron.checkpoint import integrity

        directory = resolve(directory) if os.path.isdir(directory) else directory
        self.directory = directory
        # verified before parsed (its files but the tensor data; the loaders verify the data files
        # before they read tensors: mcore.py load_mcore_into_model, mcore_to_hf, train/checkpoint.py)
        if os.path.isdir(directory):
            integrity.verify_before_parse(directory, data=False)
        # not torch's FileSystemReader.read_metadata: that is an unrestricted pickle.load
        # (torch/distributed/checkpoint/filesystem.py:926-930), so a crafted .metadata would run code
        self.metadata = read_dcp_metadata(directory)
        self.tensors: dict[str, TensorStorageMetadata] = {
            k: v for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
        }
        self._storage = self.metadata.storage_data or {}
        if os.path.isdir(directory):  # no data file outside the record (checksums.json)
            integrity.check_listed(directory, [info.relative_path for info in self._storage.values()])
        self._index: dict[str, _ChunkIndex] = {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def check_files(self) -> None:
        """Every data file the metadata points into exists and is long enough (cheap: one stat per
        file), so a missing or truncated file is reported before any output is written."""
        need: dict[str, tuple[int, str]] = {}
        for idx, info in self._storage.items():
            end = info.offset + info.length
            if end > need.get(info.relative_path, (0, ""))[0]:
                need[info.relative_path] = (end, idx.fqn)
        for rel, (end, key) in sorted(need.items()):
            path = os.path.join(self.directory, rel)
            try:
                size = os.path.getsize(path)
            except OSError:
                raise CheckpointError(f"{path}: data file listed in .metadata is missing") from None
            if size < end:
                raise CheckpointError(f"{path}: truncated ({size} bytes; a chunk of {key!r} ends at byte {end})")

    def keys(self) -> set[str]:
        return set(self.tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._md(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._md(key).properties.dtype

    def require_tensors(self, keys) -> None:
        """A byte entry (a pickled object) under any of `keys` is one CheckpointError line: only
        tensors are read (this reader never unpickles one; the message says why it is refused
        rather than calling the tensor missing)."""
        require_tensor_entries(self.metadata, keys, os.path.join(self.directory, METADATA_FILE))

    def _md(self, key: str) -> TensorStorageMetadata:
        try:
            return self.tensors[key]
        except KeyError:
            self.require_tensors([key])
            raise CheckpointError(f"{self.directory}: tensor {key!r} is not in the checkpoint") from None

    def _chunks(self, key: str) -> "_ChunkIndex":
        idx = self._index.get(key)
        if idx is None:
            idx = _ChunkIndex(self._md(key).chunks)
            self._index[key] = idx
        return idx

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The region [offsets, offsets+sizes) of global tensor `key` (in `dtype`, default stored)."""
        md = self._md(key)
        for o, s, g in zip(offsets, sizes, md.size):
            if o < 0 or o + s > g:
                raise CheckpointError(f"{self.directory}: region {list(offsets)}+{list(sizes)} outside {key!r} of shape {list(md.size)}")
        out = torch.empty(tuple(sizes), dtype=dtype or md.properties.dtype)
        covered = 0
        for i, ch in self._chunks(key).overlapping(offsets, sizes):
            src_sl, dst_sl = [], []
            for o, s, co, cs in zip(offsets, sizes, ch.offsets, ch.sizes):
                lo, hi = max(o, co), min(o + s, co + cs)
                src_sl.append(slice(lo - co, hi - co))
                dst_sl.append(slice(lo - o, hi - o))
            data = self._load_chunk(key, ch, i)
            part = data[tuple(src_sl)]
            out[tuple(dst_sl)] = part
            covered += part.numel()
            del data
        if covered != out.numel():
            raise CheckpointError(
                f"{self.directory}: {key!r} region {list(offsets)}+{list(sizes)} is only partly stored "
                f"({covered} of {out.numel()} elements): incomplete checkpoint"
            )
        return out

    def _load_chunk(self, key: str, ch: ChunkStorageMetadata, i: int) -> torch.Tensor:
        info = self._storage.get(MetadataIndex(key, torch.Size(ch.offsets), i))
        if info is None:
            raise CheckpointError(f"{self.directory}: no storage entry for a chunk of {key!r} at {list(ch.offsets)}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.directory}: {key!r} is stored with transforms {info.transform_descriptors} (unsupported)")
        path = os.path.join(self.directory, info.relative_path)
        fd = self._fd(path)
        try:
            buf = pread_exact(fd, info.length, info.offset)  # writable: the chunk's tensor views it
            if buf is None:
                raise CheckpointError(f"{path}: truncated (chunk of {key!r} at byte {info.offset} needs {info.length} bytes)")
            t = loads_torch(buf, f"{path} (chunk of {key!r} at byte {info.offset})")
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: corrupt chunk of {key!r} at byte {info.offset} ({e})") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ch.sizes):
            raise CheckpointError(f"{path}: chunk of {key!r} at byte {info.offset} does not hold a tensor of shape {list(ch.sizes)}")
        return t

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"{path}: cannot open checkpoint file ({e.strerror})") from None
                self._fds[path] = fd
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


class _ChunkIndex:
    """Chunks of one tensor bucketed by their offset on dims 0 and 1 (layer, expert) when they are
    one slice thick there, so a per-layer or per-expert read does not scan every chunk."""

    def __init__(self, chunks: Sequence[ChunkStorageMetadata]):
        self.by2: dict[tuple[int, int], list[int]] = {}
        self.by1: dict[int, list[int]] = {}
        self.rest: list[int] = []
        self.chunks = list(chunks)
        for i, c in enumerate(self.chunks):
            if len(c.sizes) >= 3 and c.sizes[0] == 1 and c.sizes[1] == 1:
                self.by2.setdefault((c.offsets[0], c.offsets[1]), []).append(i)
            elif len(c.sizes) >= 2 and c.sizes[0] == 1:
                self.by1.setdefault(c.offsets[0], []).append(i)
            else:
                self.rest.append(i)

    def overlapping(self, offsets, sizes):
        cand: list[int] = list(self.rest)
        for a in range(offsets[0], offsets[0] + sizes[0]) if len(offsets) >= 2 else ():
            cand += self.by1.get(a, [])
            if len(offsets) >= 3:
                for b in range(offsets[1], offsets[1] + sizes[1]):
                    cand += self.by2.get((a, b), [])
        for i in cand:
            c = self.chunks[i]
            if all(co < o + s and o < co + cs for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes)):
                yield i, c
