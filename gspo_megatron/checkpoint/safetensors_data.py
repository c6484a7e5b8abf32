"""Read tensors out of safetensors files with plain positioned reads (no mmap).

`safetensors.safe_open` maps the whole file; every page a read touches stays resident and counts
towards the process's RSS until the handle closes, so streaming a 5 GB shard through it costs 5 GB
of RSS. Here each tensor is read with `os.preadv` straight into a fresh tensor: memory is the
tensor itself, and the page cache (which the kernel can drop) holds the rest.

All headers are parsed and checked against the file sizes up front (`check_all`), so a truncated
or corrupt shard is reported, naming the file and tensor, before any output is written.
"""
from __future__ import annotations

import json
import os
import struct
import threading

import torch

from gspo_megatron.errors import CheckpointError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors format's own limit
_READ_CHUNK = 1 << 30  # preadv moves at most ~2 GiB per call on Linux


class _File:
    def __init__(self, path: str):
        self.path = path
        try:
            self.size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > self.size:
                    raise CheckpointError(f"{path}: corrupt or truncated safetensors header (claims {n} bytes)")
                header = json.loads(f.read(n))
        except CheckpointError:
            raise
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: unreadable safetensors header (not a JSON object)")
        self.data_start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{path}: bad header entry for tensor {name!r}") from None
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * dtype.itemsize or begin < 0:
                raise CheckpointError(
                    f"{path}: tensor {name!r} has {end - begin} bytes of data, shape {list(shape)} needs "
                    f"{numel * dtype.itemsize}"
                )
            if self.data_start + end > self.size:
                raise CheckpointError(
                    f"{path}: truncated: tensor {name!r} ends at byte {self.data_start + end}, "
                    f"the file has {self.size}"
                )
            self.entries[name] = (dtype, shape, begin, end)
        self._fd: int | None = None
        self._lock = threading.Lock()

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class SafetensorsData:
    """Tensor data of an HF checkpoint, given its name -> file map (HFCheckpointReader.weight_map)."""

    def __init__(self, hf_dir: str, weight_map: dict[str, str]):
        self.hf_dir = hf_dir
        self.weight_map = dict(weight_map)
        self._files: dict[str, _File] = {}

    def _file(self, fname: str) -> _File:
        f = self._files.get(fname)
        if f is None:
            f = _File(os.path.join(self.hf_dir, fname))
            self._files[fname] = f
        return f

    def check_all(self) -> None:
        """Parse every shard's header; every indexed tensor must be in the file the index names."""
        for fname in sorted(set(self.weight_map.values())):
            self._file(fname)
        for name, fname in self.weight_map.items():
            if name not in self._file(fname).entries:
                raise CheckpointError(f"{os.path.join(self.hf_dir, fname)}: tensor {name!r} listed in the index is not in this file")

    def entry(self, name: str):
        try:
            fname = self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.hf_dir}: tensor {name!r} is missing from the checkpoint") from None
        f = self._file(fname)
        try:
            return f, f.entries[name]
        except KeyError:
            raise CheckpointError(f"{f.path}: tensor {name!r} listed in the index is not in this file") from None

    def dtype(self, name: str) -> torch.dtype:
        return self.entry(name)[1][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name)[1][1]

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (or rows [start, stop) of dim 0), read from disk into a new tensor."""
        f, (dtype, shape, begin, end) = self.entry(name)
        if rows is not None:
            row_bytes = (end - begin) // max(shape[0], 1)
            lo, hi = rows
            begin, end = begin + lo * row_bytes, begin + hi * row_bytes
            shape = (hi - lo,) + tuple(shape[1:])
        nbytes = end - begin
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(buf.numpy()) if nbytes else memoryview(b"")
        fd, pos, done = f.fd(), f.data_start + begin, 0
        try:
            while done < nbytes:
                n = os.preadv(fd, [view[done : done + _READ_CHUNK]], pos + done)
                if n <= 0:
                    raise CheckpointError(f"{f.path}: truncated while reading tensor {name!r}")
                done += n
        except OSError as e:
            raise CheckpointError(f"{f.path}: cannot read tensor {name!r} ({e})") from None
        return buf.view(dtype).reshape(shape)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
