"""The project's own reader of torch.save files: every pickle in a checkpoint that is not DCP
metadata (common.pt, the per-rank RNG files, each tensor chunk of the DCP data files) goes
through it, never through `torch.load`.

Why not `torch.load(weights_only=True)`: its allow-list is process-wide and any import extends it.
`import megatron.core` runs `register_safe_globals()` (megatron/core/safe_globals.py:38-42), which
admits numpy's `_reconstruct`, `ndarray` and `dtype` among others; a common.pt holding a numpy
*object* array whose raw bytes are forged pointers then makes `ndarray.__setstate__` read through
them: a segfault (or worse) from a file, with no Python frame to catch it. Nothing a library adds
to torch's list reaches this reader: its admitted globals are fixed here.

A torch.save file is a zip archive (stored, not compressed): `<prefix>/data.pkl` (a protocol-2
pickle), `<prefix>/data/<key>` (one storage's raw bytes each), `<prefix>/byteorder`. The pickle runs
on Python's pure-Python pickle machine (`pickle._Unpickler`, as safe_metadata.py does for
`.metadata`) with every operation that can build an object narrowed:

* GLOBAL: only `torch._utils._rebuild_tensor_v2` (rebuilt here, not called), torch's legacy
  storage classes (`torch.FloatStorage` ...: a dtype tag, never constructed), torch dtypes,
  `collections.OrderedDict` (called with no arguments: a tensor's empty backward-hook dict, a
  module state dict), `torch.Size` (a tuple of ints) and `_codecs.encode` (bytes, as protocol 2
  pickles them: latin-1 only); with `run_args=True` (Megatron-LM's
  common.pt) also `argparse.Namespace` (NEWOBJ with no arguments, then BUILD with a dict of
  str keys) and Megatron-Core's Enum classes (a call with one argument: a member lookup).
* persistent ids: only `("storage", <storage class>, key, location, numel)`; the key names a
  stored member of the archive whose size is exactly numel elements; the tensor is a view of the
  file's bytes (no copy: a chunk of an expert tensor at 235B is gigabytes).
* `_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])`: ints,
  an empty hook dict, and every element inside the storage (checked before `as_strided`).
* protocol 0/1 instances, NEWOBJ_EX, out-of-band buffers: refused.
"""
from __future__ import annotations

import argparse
import collections
import enum
import functools
import importlib
import io
import os
import pickle
import struct
import zipfile
from typing import Any

from gspo_megatron.errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")  # zipfile.structFileHeader: 30 bytes
_LOCAL_MAGIC = b"PK\x03\x04"


class _View(io.RawIOBase):
    """A read-only file over a memoryview (zipfile reads the directory through it; io.BytesIO
    would copy the whole buffer first)."""

    def __init__(self, buf: memoryview):
        self._buf, self._pos = buf, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = (0, self._pos, len(self._buf))[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self._buf) - self._pos))
        b[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n


class _Refused(pickle.UnpicklingError):
    """An operation outside what a checkpoint's torch.save file holds (message: what)."""


class _StorageTag:
    """A legacy storage class named by a GLOBAL (`torch.FloatStorage`): the dtype of a persistent
    id's storage, never constructed."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype):
        self.name, self.dtype = name, dtype


class _Storage:
    """A storage of the archive: a flat tensor viewing the file's bytes."""

    __slots__ = ("flat",)

    def __init__(self, flat):
        self.flat = flat


def _rebuild_tensor(storage, offset, size, stride, requires_grad, hooks, metadata=None):
    """torch._utils._rebuild_tensor_v2, checked: arguments of the declared types, no hooks, every
    element inside the storage (as_strided does not check a view against its storage)."""
    import torch

    if type(storage) is not _Storage:
        raise _Refused(f"a tensor over a {qualified_name(storage)} (not a storage of the file)")
    shape_ok = lambda v: type(v) in (tuple, torch.Size) and all(type(x) is int and x >= 0 for x in v)  # noqa: E731
    if not (type(offset) is int and offset >= 0 and shape_ok(size) and shape_ok(stride) and len(size) == len(stride)):
        raise _Refused("a tensor whose offset, size or stride are not non-negative ints")
    if type(requires_grad) is not bool or type(hooks) not in (dict, collections.OrderedDict) or hooks:
        raise _Refused("a tensor with backward hooks or a non-bool requires_grad")
    if metadata not in (None, {}):
        raise _Refused("a tensor with metadata")
    n = storage.flat.numel()
    numel = 1
    for s in size:
        numel *= s
    if numel and offset + sum((s - 1) * st for s, st in zip(size, stride)) >= n:
        raise _Refused(f"a tensor of size {list(size)} reaching past its storage of {n} elements")
    if not numel and offset > n:
        raise _Refused(f"an empty tensor at offset {offset} past its storage of {n} elements")
    return storage.flat.as_strided(tuple(size), tuple(stride), offset)


def _ordered_dict(*args):
    if args:
        raise _Refused("an OrderedDict built from arguments")
    return collections.OrderedDict()


def _latin1(text, encoding="latin1"):
    """_codecs.encode as protocol 2 pickles bytes: (str, 'latin1') only (another codec could be
    a decompressor)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise _Refused(f"_codecs.encode with the codec {str(encoding)[:40]!r}")
    return text.encode("latin1")


def _size(dims=()):
    import torch

    if type(dims) not in (tuple, list) or not all(type(x) is int for x in dims):
        raise _Refused("a torch.Size of anything but ints")
    return torch.Size(dims)


class _Tables:
    """The admitted globals, built once (imports torch)."""

    def __init__(self):
        import torch
        from torch.storage import _dtype_to_storage_type_map

        kinds = (torch.dtype,)
        self.globals: dict[tuple[str, str], Any] = {("torch", n): v for n, v in vars(torch).items()
                                                    if isinstance(v, kinds)}
        # dtype -> the legacy storage class name torch pickles (torch/storage.py
        # _dtype_to_storage_type_map; quantized dtypes are not a checkpoint's)
        for dtype, name in _dtype_to_storage_type_map().items():
            if not name.startswith("Q"):
                self.globals[("torch", name)] = _StorageTag(name, dtype)
        self.calls = {("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
                      ("collections", "OrderedDict"): _ordered_dict, ("torch", "Size"): _size,
                      ("_codecs", "encode"): _latin1}
        self.globals.update(self.calls)
        self.call_ids = {id(f) for f in self.calls.values()}


@functools.lru_cache(maxsize=None)
def _get_tables() -> _Tables:
    """The tables, built once on first use (imports torch)."""
    return _Tables()


def admitted_globals(run_args: bool = False) -> list[str]:
    """`module.name` of every global a torch.save file of a checkpoint may name (docs and tests;
    with `run_args`, Megatron-Core's enums are admitted by kind, named here as `megatron.core.*`)."""
    names = sorted(f"{m}.{n}" for m, n in _get_tables().globals)
    return names + (["argparse.Namespace", "megatron.core.*.<an Enum class>"] if run_args else [])


def qualified_name(obj: Any) -> str:
    """`module.name` of a class or function, else of the object's type (refusals name it; also
    checkpoint/safe_metadata.py's)."""
    t = obj if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__")) else type(obj)
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', '?')}"


def _megatron_enum(module: str, name: str):
    """A Megatron-Core Enum class (Megatron-LM's run arguments hold some, e.g. AttnBackend); None
    when `module.name` is not one. Only modules under megatron.core are imported."""
    if not (module == "megatron.core" or module.startswith("megatron.core.")) or not name.isidentifier():
        return None
    try:
        cls = getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None
    return cls if isinstance(cls, type) and issubclass(cls, enum.Enum) else None


class _Unpickler(pickle._Unpickler):  # the pure-Python machine: its operations can be narrowed
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, storages, run_args: bool):
        super().__init__(file)
        self._t = _get_tables()
        self._storages = storages  # key -> (dtype) -> _Storage
        self._run_args = run_args
        self._enums: set[int] = set()

    def find_class(self, module: str, name: str):
        obj = self._t.globals.get((module, name))
        if obj is not None:
            return obj
        if self._run_args:
            if (module, name) == ("argparse", "Namespace"):
                return argparse.Namespace
            cls = _megatron_enum(module, name)
            if cls is not None:
                self._enums.add(id(cls))
                return cls
        raise _Refused(f"the global {module}.{name}")

    def persistent_load(self, pid):
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage" and type(pid[1]) is _StorageTag
                and type(pid[2]) is str and type(pid[3]) is str and type(pid[4]) is int and pid[4] >= 0):
            raise _Refused("a persistent id other than a storage of the file")
        return self._storages(pid[2], pid[1].dtype, pid[4])

    def _instantiate(self, klass, args):  # OBJ / INST: protocol 0/1
        raise _Refused(f"a protocol 0/1 instance of {qualified_name(klass)}")

    def load_reduce(self):
        args, func = self.stack[-1], self.stack[-2]
        if id(func) in self._t.call_ids:
            return super().load_reduce()
        if id(func) in self._enums and type(args) is tuple and len(args) == 1 and type(args[0]) in (int, str):
            return super().load_reduce()  # Enum(value): a member lookup
        raise _Refused(f"a call of {qualified_name(func)}")

    def load_newobj(self):
        cls, args = self.stack[-2], self.stack[-1]
        if not (cls is argparse.Namespace and self._run_args and args == ()):
            raise _Refused(f"a new {qualified_name(cls)}")
        super().load_newobj()

    def load_newobj_ex(self):
        raise _Refused(f"a new {qualified_name(self.stack[-3])} with keyword arguments")

    def load_build(self):
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) is not argparse.Namespace:
            raise _Refused(f"state for {'the class ' if isinstance(inst, type) else 'a '}{qualified_name(inst)}")
        if type(state) is not dict or not all(type(k) is str for k in state):
            raise _Refused("state for a Namespace that is not a dict of names")
        self.stack.pop()
        inst.__dict__.update(state)

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


def _member_span(buf, info: zipfile.ZipInfo) -> tuple[int, int]:
    """(start, end) of a stored member's bytes in the archive `buf` (its local header read here:
    the data is viewed in place, not copied out by zipfile)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise _Refused(f"a compressed member {info.filename!r}")
    h = info.header_offset
    if h + _LOCAL_HEADER.size > len(buf):
        raise _Refused(f"a member {info.filename!r} past the end of the file")
    fields = _LOCAL_HEADER.unpack_from(buf, h)
    if fields[0] != _LOCAL_MAGIC:
        raise _Refused(f"a member {info.filename!r} without its local header")
    start = h + _LOCAL_HEADER.size + fields[10] + fields[11]  # name and extra field lengths
    end = start + info.file_size
    if end > len(buf) or info.compress_size != info.file_size:
        raise _Refused(f"a member {info.filename!r} past the end of the file")
    return start, end


def loads_torch(data, source: str, *, run_args: bool = False):
    """What torch.save wrote into `data` (bytes, a bytearray or a memoryview; tensors are views of
    it, read-only where `data` is `bytes`), read with the restricted unpickler. `source` (a file,
    or a file and an offset) is named in errors: one CheckpointError line; nothing is run."""
    import torch

    buf = memoryview(data).cast("B") if not isinstance(data, memoryview) else data.cast("B")
    try:
        zf = zipfile.ZipFile(_View(buf))  # reads the directory only
        pkls = [i for i in zf.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pkls) != 1:
            raise _Refused("an archive without exactly one <name>/data.pkl")
        prefix = pkls[0].filename[: -len("data.pkl")]
        members = {i.filename: i for i in zf.infolist()}
        order = members.get(prefix + "byteorder")
        if order is not None and zf.read(order) not in (b"little",):
            raise _Refused(f"byte order {zf.read(order)[:16]!r} (this reader is little-endian)")
        writable = not isinstance(data, bytes) and not buf.readonly
        cache: dict[str, _Storage] = {}

        def storage(key: str, dtype, numel: int) -> _Storage:
            got = cache.get(key)
            if got is not None:
                if got.flat.dtype != dtype or got.flat.numel() != numel:
                    raise _Refused(f"storage {key!r} named with two dtypes or sizes")
                return got
            info = members.get(f"{prefix}data/{key}")
            if info is None:
                raise _Refused(f"a storage {key!r} the archive does not hold")
            start, end = _member_span(buf, info)
            size = torch.empty((), dtype=dtype).element_size()
            if end - start != numel * size:
                raise _Refused(f"storage {key!r} of {end - start} bytes for {numel} elements of {dtype}")
            view = buf[start:end]
            if numel == 0:
                flat = torch.empty(0, dtype=dtype)
            elif writable:
                flat = torch.frombuffer(view, dtype=dtype)
            else:  # bytes: read-only memory; torch warns on a non-writable buffer, so copy (small files)
                flat = torch.frombuffer(bytearray(view), dtype=dtype)
            cache[key] = got = _Storage(flat)
            return got

        pkl_start, pkl_end = _member_span(buf, pkls[0])
        return _Unpickler(io.BytesIO(buf[pkl_start:pkl_end]), storage, run_args).load()
    except _Refused as e:
        raise CheckpointError(f"{source}: refusing to unpickle {e} (a checkpoint's torch.save files hold tensors, "
                              "dicts, lists and numbers); nothing from the file was run") from None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - truncated, corrupt, not a zip or not a pickle
        why = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"{source}: unreadable ({type(e).__name__}: {why[:200]})") from None


def pread_exact(fd: int, length: int, offset: int) -> bytearray | None:
    """`length` bytes of `fd` from `offset` into a new writable buffer (what loads_torch views), or
    None when the file ends first. A loop: one read returns at most 0x7ffff000 bytes on Linux, and
    a chunk of an fp32 optimizer state at 235B is larger than that."""
    buf = bytearray(length)
    view, done = memoryview(buf), 0
    while done < length:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            return None
        done += n
    return buf


def load_torch_file(path: str | os.PathLike, *, run_args: bool = False):
    """loads_torch of the file at `path` (read whole into writable memory: tensors view it)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        if f.readinto(data) != size:
            raise CheckpointError(f"{path}: unreadable (changed size while read)")
    return loads_torch(data, path, run_args=run_args)
