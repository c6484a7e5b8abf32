"""Read a PyTorch Distributed Checkpoint's `.metadata` without running code from it.

`.metadata` (the global index of a torch_dist checkpoint: key -> global shape, dtype, chunks, and
where each chunk lies in the data files) is a plain pickle. PyTorch reads it with an unrestricted
`pickle.load` (torch/distributed/checkpoint/filesystem.py:926-930, FileSystemReader.read_metadata),
and so does Megatron-Core, through that reader (dist_checkpointing/strategies/torch.py:750-760,
_get_filesystem_reader), so a crafted file runs arbitrary code the moment a checkpoint is opened.
`torch.load(weights_only=True)` does not cover it: `.metadata` is not a torch.save file, and
torch's weights-only unpickler (torch/_weights_only_unpickler.py) implements protocol 2's opcodes
only, while DCP writes the default protocol 4 ("Unsupported operand 149": FRAME).

Here the file goes through a restricted unpickler instead (Python's own pickle machine,
`pickle._Unpickler`, with its four risky operations narrowed):

* globals (GLOBAL, STACK_GLOBAL, INST, EXT*): only those listed below (`admitted_globals()`);
  anything else is one CheckpointError naming the file and the refused `module.name`, raised
  without importing or touching what it names, so nothing from the file runs;
* REDUCE (a call): only the admitted value constructors (torch.Size, the layout lookup, the
  memory-format enum, pure paths);
* NEWOBJ / NEWOBJ_EX (`cls.__new__(cls)`): only the DCP metadata dataclasses; OBJ / INST
  (protocol 0/1 instantiation) never;
* BUILD (set an object's state): only on instances of those dataclasses, with a dict of their
  declared fields only (`dataclasses.fields`), every field without a default present, each value
  of its declared type (`_Tables.fields`; TensorProperties: its own __setstate__ on a checked
  5-tuple). Admitted classes alone are not enough: a file of only admitted classes could give a
  BytesStorageMetadata (a byte entry, which torch's load planner unpickles with
  weights_only=False) a forged `size`, so that Megatron's global-shape check takes it for the
  tensor it replaces (issue #40; megatron_load.py has the whole path and two more refusals).
  Python's C unpickler cannot be narrowed
  this way: its BUILD will setattr on anything on the stack, including an admitted class object,
  so a file restricted to harmless globals could still rewrite attributes of torch's classes in
  this process (pickle.py load_build, the `slotstate` branch). That is why the pure-Python
  machine is used; it is slower than the C unpickler (about 5x on a 50k-chunk file: 6.4 s vs
  1.2 s on a busy 2-core machine; 10x on the tiny test checkpoints, milliseconds), and a caller
  loading one checkpoint in several pieces reads it once (mcore.py load_sharded).
* persistent ids and out-of-band buffers: refused (the defaults of pickle._Unpickler).

The result must be a `Metadata` in which every admitted object, however deep, holds exactly its
declared fields with values of their declared types (checked again after the whole file is read:
a list or dict can be appended to after the BUILD that checked it), whose entries are tensor or
byte entries, and every data file it names must lie inside the checkpoint directory (no absolute
paths, no `..`). Byte entries are still *read* here (Megatron-Bridge and Megatron-LM store
`_extra_state` and RNG state as ShardedObjects, and the project writes `_extra_state` entries for
them): no loader of the project ever loads one (`require_tensor_entries`, `byte_entry_error`,
SafeFileSystemReader.read_data).

How the list was derived: `.metadata` files written by this project (the converter's
save_chunks; the trainer with the distributed optimizer, and with the plain one, i.e. Megatron's
own torch_dist save planner; 1- and 2-process runs, TP1 / DP2 / DP2xTP2, fp32 and bf16: 20 files)
unpickled with a tracing unpickler that records each find_class; all use protocol 4 and name
exactly: torch.distributed.checkpoint.metadata.{Metadata,
StorageMeta, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
MetadataIndex, _MEM_FORMAT_ENCODING}, torch.distributed.checkpoint.filesystem._StorageInfo,
torch.Size, torch.float32 / torch.bfloat16 (dtypes), torch.serialization._get_layout (how
torch.layout pickles, torch/serialization.py:1641-1653) and pathlib.PosixPath
(StorageMeta.checkpoint_id: the writer's directory). A Megatron-Bridge 0.3.1 save (Megatron's save
planner) also names torch.distributed.checkpoint.planner.{SavePlan, WriteItem, TensorWriteData,
WriteItemType}: admitted as data too (tests/test_megatron_bridge.py reads one), as is the one
attribute Megatron's decentralized save sets on the Metadata beyond its fields, `all_local_plans`
(a list of SavePlans; `_Tables.extras`). Admitted beyond that, as data only: every
torch dtype / layout / memory_format singleton, collections.OrderedDict, and pathlib path classes
under their Python 3.13 module name (pathlib._local), all rebuilt as *pure* paths (no I/O).
Not admitted: builtins (protocol >= 2 builds dicts, lists, tuples and sets with opcodes, no
global), copyreg._reconstructor (protocol 0/1 only; DCP writes the default protocol).
"""
from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from typing import Any

from gspo_megatron.checkpoint.safe_torch import loads_torch, pread_exact
from gspo_megatron.checkpoint.safe_torch import qualified_name as _name
from gspo_megatron.errors import CheckpointError

METADATA_FILE = ".metadata"  # torch/distributed/checkpoint/filesystem.py _metadata_fn

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_DATACLASSES = [(_DCP_METADATA, n) for n in ("Metadata", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
                                            "ChunkStorageMetadata", "TensorProperties", "MetadataIndex")]
_DATACLASSES.append((_DCP_FILESYSTEM, "_StorageInfo"))
# Megatron's save planner (used by Megatron-LM and Megatron-Bridge saves) keeps the global save
# plan in Metadata.planner_data: torch's planner dataclasses (data only) and the WriteItemType enum
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
_DATACLASSES += [(_DCP_PLANNER, n) for n in ("SavePlan", "WriteItem", "TensorWriteData")]
_PATH_CLASSES = {"PosixPath": "PurePosixPath", "PurePosixPath": "PurePosixPath",
                 "WindowsPath": "PureWindowsPath", "PureWindowsPath": "PureWindowsPath"}


class _Refused(pickle.UnpicklingError):
    """A pickle operation outside what DCP metadata holds (message: what was refused)."""


class _Tables:
    """The admitted globals, built once on first use (imports torch's DCP modules)."""

    def __init__(self):
        import torch
        import torch.serialization
        from torch.distributed.checkpoint import filesystem as dcp_fs
        from torch.distributed.checkpoint import metadata as dcp_md
        from torch.distributed.checkpoint import planner as dcp_planner

        mods = {_DCP_METADATA: dcp_md, _DCP_FILESYSTEM: dcp_fs, _DCP_PLANNER: dcp_planner}
        self.dataclasses = {key: getattr(mods[key[0]], key[1]) for key in _DATACLASSES}
        calls = {("torch", "Size"): torch.Size,
                 ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
                 (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): dcp_md._MEM_FORMAT_ENCODING,
                 ("collections", "OrderedDict"): collections.OrderedDict,
                 # an Enum pickles as a call of its class with the member's value
                 (_DCP_PLANNER, "WriteItemType"): dcp_planner.WriteItemType}
        for mod in ("pathlib", "pathlib._local"):
            for name, pure in _PATH_CLASSES.items():
                calls[(mod, name)] = getattr(pathlib, pure)
        self.calls = calls
        # dtypes, layouts and memory formats pickle as the global torch.<name> (their __reduce__
        # returns the name). vars(torch), not getattr: torch's module __getattr__ imports submodules.
        kinds = (torch.dtype, torch.layout, torch.memory_format)
        values = {("torch", n): v for n, v in vars(torch).items() if isinstance(v, kinds)}
        self.globals: dict[tuple[str, str], Any] = {**values, **calls, **self.dataclasses}
        self.callable_ids = {id(v) for v in calls.values()}
        self.new_ids = {id(v) for v in self.dataclasses.values()}
        self.build_types = set(self.dataclasses.values())
        self.tensor_properties = dcp_md.TensorProperties
        self.mem_format_encoding = dcp_md._MEM_FORMAT_ENCODING
        # BUILD may set only these fields (each dataclass's own, `dataclasses.fields`), each only
        # to a value of its declared type (`Any` fields: data, i.e. made of admitted globals only).
        # Values are checked here as they are set and again, deeply, once the whole file is read
        # (_validate): a list or dict can still be appended to after its BUILD (APPENDS/SETITEMS
        # on a memo reference).
        c = {n: self.dataclasses[(_DCP_METADATA, n)] for _, n in _DATACLASSES if _ == _DCP_METADATA}
        storage_info = self.dataclasses[(_DCP_FILESYSTEM, "_StorageInfo")]
        save_plan, write_item, tensor_write = (self.dataclasses[(_DCP_PLANNER, n)]
                                               for n in ("SavePlan", "WriteItem", "TensorWriteData"))

        def of(cls):
            return lambda v: type(v) is cls

        def opt(check):
            return lambda v: v is None or check(v)

        def list_of(check):
            return lambda v: type(v) is list and all(check(x) for x in v)

        def anything(v):
            return True

        def is_dict(v):
            return type(v) is dict

        def is_path(v):
            return type(v) is str or isinstance(v, pathlib.PurePath)

        strs = lambda v: type(v) in (list, tuple) and all(type(x) is str for x in v)  # noqa: E731
        self.fields: dict[type, dict[str, Any]] = {
            c["Metadata"]: {"state_dict_metadata": is_dict, "planner_data": anything, "storage_data": opt(is_dict),
                            "storage_meta": opt(of(c["StorageMeta"])), "version": opt(_is_str)},
            c["StorageMeta"]: {"checkpoint_id": opt(is_path), "save_id": opt(_is_str), "load_id": opt(_is_str),
                               "modules": list_of(_is_str)},
            c["TensorStorageMetadata"]: {"properties": of(c["TensorProperties"]), "size": _is_shape,
                                         "chunks": list_of(of(c["ChunkStorageMetadata"]))},
            c["BytesStorageMetadata"]: {},
            c["ChunkStorageMetadata"]: {"offsets": _is_shape, "sizes": _is_shape},
            c["MetadataIndex"]: {"fqn": _is_str, "offset": opt(_is_shape), "index": opt(_is_int)},
            storage_info: {"relative_path": _is_str, "offset": _is_int, "length": _is_int,
                           "transform_descriptors": opt(strs)},
            save_plan: {"items": list_of(of(write_item)), "storage_data": anything, "planner_data": anything,
                        "usable": _is_bool},
            write_item: {"index": of(c["MetadataIndex"]), "type": of(dcp_planner.WriteItemType),
                         "bytes_io_data": lambda v: v is None, "tensor_data": opt(of(tensor_write))},
            tensor_write: {"chunk": of(c["ChunkStorageMetadata"]), "properties": of(c["TensorProperties"]),
                           "size": _is_shape},
        }
        # Attributes a writer sets on an instance beyond the dataclass's fields: Megatron's
        # decentralized save (megatron-core 0.16.1 strategies/state_dict_saver.py:141-144, used by
        # Megatron-LM's and Megatron-Bridge's async writer) keeps every rank's SavePlan on the
        # Metadata as `all_local_plans`, to reuse the plan on the next save (torch.py:677).
        self.extras: dict[type, dict[str, Any]] = {
            c["Metadata"]: {"all_local_plans": opt(list_of(of(save_plan)))},
        }
        import dataclasses

        for cls, spec in self.fields.items():  # the table names exactly the declared fields
            assert set(spec) == {f.name for f in dataclasses.fields(cls)}, cls
        for cls, extra in self.extras.items():
            self.fields[cls] = {**self.fields[cls], **extra}
        self.field_list = {cls: dataclasses.fields(cls) for cls in self.fields}
        # fields without a default must be in the state (a dataclass's __init__ sets every field)
        self.required = {cls: {f.name for f in dataclasses.fields(cls)
                               if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
                         for cls in self.fields}


def _is_str(v) -> bool:
    return type(v) is str


def _is_int(v) -> bool:
    return type(v) is int


def _is_bool(v) -> bool:
    return type(v) is bool


def _is_shape(v) -> bool:
    """A global shape, chunk offset or size: torch.Size (or a plain tuple) of non-negative ints."""
    return isinstance(v, tuple) and all(type(x) is int and x >= 0 for x in v)


def _tensor_properties_state(state, t: "_Tables") -> bool:
    import torch

    return (type(state) is tuple and len(state) == 5 and isinstance(state[0], torch.dtype)
            and isinstance(state[1], torch.layout) and _is_bool(state[2])
            and type(state[3]) is t.mem_format_encoding and _is_bool(state[4]))


_tables: _Tables | None = None


def _get_tables() -> _Tables:
    global _tables
    if _tables is None:
        _tables = _Tables()
    return _tables


def admitted_globals() -> list[str]:
    """`module.name` of every global a `.metadata` may name (documentation and tests)."""
    return sorted(f"{m}.{n}" for m, n in _get_tables().globals)


class _RestrictedUnpickler(pickle._Unpickler):  # the pure-Python machine (see the module docstring)
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file):
        super().__init__(file)
        self._t = _get_tables()

    def find_class(self, module: str, name: str):
        obj = self._t.globals.get((module, name))
        if obj is None:
            raise _Refused(f"the global {module}.{name}")
        return obj

    def persistent_load(self, pid):
        raise _Refused("a persistent id")

    def _instantiate(self, klass, args):  # OBJ / INST: protocol 0/1 instantiation
        raise _Refused(f"a protocol 0/1 instance of {_name(klass)}")

    def load_reduce(self):
        func = self.stack[-2]
        if id(func) not in self._t.callable_ids:
            raise _Refused(f"a call of {_name(func)}")
        super().load_reduce()

    def load_newobj(self):
        self._check_new(self.stack[-2])
        super().load_newobj()

    def load_newobj_ex(self):
        self._check_new(self.stack[-3])
        super().load_newobj_ex()

    def _check_new(self, cls):
        if id(cls) not in self._t.new_ids:
            raise _Refused(f"a new {_name(cls)}")

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        t = type(inst)
        if t not in self._t.build_types:
            raise _Refused(f"state for {'the class ' if isinstance(inst, type) else 'a '}{_name(inst)}")
        if t is self._t.tensor_properties:
            # torch's own __setstate__ unpacks (dtype, layout, requires_grad, memory format, pin)
            if not _tensor_properties_state(state, self._t):
                raise _Refused(f"state for a {_name(inst)} that is not (dtype, layout, bool, memory format, bool)")
            inst.__setstate__(state)
            return
        if not isinstance(state, dict):
            raise _Refused(f"state for a {_name(inst)} from a {_name(state)}")
        spec = self._t.fields[t]
        for k, v in state.items():
            check = spec.get(k) if type(k) is str else None
            if check is None:  # not a declared field: e.g. a `size` forged onto a BytesStorageMetadata
                raise _Refused(f"state for a {_name(inst)} with the undeclared field {k!r}")
            if not check(v):
                raise _Refused(f"{t.__name__}.{k} = a {_name(v)} (not of its declared type)")
        missing = self._t.required[t] - state.keys()
        if missing:
            raise _Refused(f"state for a {_name(inst)} without its field {sorted(missing)[0]!r}")
        inst.__dict__.update(state)

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex
    dispatch[pickle.BUILD[0]] = load_build


def loads_dcp_metadata(data: bytes, source: str):
    """The DCP `Metadata` pickled in `data` (the contents of `source`, named in errors)."""
    try:
        md = _RestrictedUnpickler(io.BytesIO(data)).load()
    except _Refused as e:
        raise CheckpointError(
            f"{source}: refusing to unpickle {e} (checkpoint metadata holds only PyTorch DCP metadata classes, "
            "torch.Size, dtypes and paths); nothing from the file was run"
        ) from None
    except Exception as e:  # noqa: BLE001 - truncated, corrupt or not a pickle at all
        raise CheckpointError(f"{source}: unreadable DCP metadata ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    _validate(md, source)
    return md


def read_dcp_metadata(directory: str | os.PathLike, filename: str = METADATA_FILE):
    """The `Metadata` of the torch_dist checkpoint `directory`, read with the restricted unpickler.
    One-line CheckpointError naming the file: missing, unreadable, or holding anything but DCP
    metadata (nothing in the file is run)."""
    path = os.path.join(os.fspath(directory), filename)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{os.fspath(directory)}: no {filename} file (not a torch_dist checkpoint, "
                              "or an incomplete one)") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    return loads_dcp_metadata(data, path)


def _validate(md, source: str) -> None:
    """The unpickled object is DCP metadata of the shape the readers rely on: every admitted
    dataclass instance in it, however deep, holds exactly its declared fields with values of their
    declared types (checked again here: see _Tables.fields), tensor and byte entries only, and
    storage that lies inside the checkpoint directory."""
    import dataclasses

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    t = _get_tables()

    def bad(what: str):
        raise CheckpointError(f"{source}: not valid DCP metadata ({what})")

    if type(md) is not Metadata:
        bad(f"holds a {_name(md)}")
    # an iterative walk (a deeply nested file must not become a RecursionError traceback) over
    # the objects and containers; scalars, strings and shapes were checked where they are held
    walk = (list, tuple, dict, set, frozenset, t.tensor_properties, *t.fields)
    stack, seen = [md], set()
    while stack:
        obj = stack.pop()
        cls = type(obj)
        if not isinstance(obj, walk) or (cls is torch.Size) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if cls is t.tensor_properties:
            if not _tensor_properties_state((obj.dtype, obj.layout, obj.requires_grad,
                                             _mem_format_code(obj, t), obj.pin_memory), t):
                bad("a TensorProperties of the wrong types")
        elif cls in t.fields:
            spec, state = t.fields[cls], vars(obj)
            extra = sorted(k for k in state if k not in spec)
            if extra:
                bad(f"a {cls.__name__} with the undeclared field {extra[0]!r}")
            for f in t.field_list[cls]:
                if f.name not in state:  # a field newer than the writer's torch: its default
                    if f.default is not dataclasses.MISSING:
                        state[f.name] = f.default
                    elif f.default_factory is not dataclasses.MISSING:
                        state[f.name] = f.default_factory()
                    else:
                        bad(f"a {cls.__name__} without its field {f.name!r}")
                v = state[f.name]
                if not spec[f.name](v):
                    bad(f"{cls.__name__}.{f.name} = a {_name(v)}")
                stack.append(v)
            for k in t.extras.get(cls, {}).keys() & state.keys():
                if not spec[k](state[k]):
                    bad(f"{cls.__name__}.{k} = a {_name(state[k])}")
                stack.append(state[k])
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
    for key, entry in md.state_dict_metadata.items():
        if type(key) is not str:
            bad(f"a key of type {_name(key)}")
        if type(entry) is TensorStorageMetadata:
            if len(entry.size) != 0 and any(len(c.offsets) != len(entry.size) or len(c.sizes) != len(entry.size)
                                            for c in entry.chunks):
                bad(f"tensor entry {key!r} has chunks of another rank than its shape")
        elif type(entry) is not BytesStorageMetadata:
            bad(f"entry {key!r} is a {_name(entry)}")
    for idx, info in (md.storage_data or {}).items():
        if type(idx) is not MetadataIndex or type(info) is not _StorageInfo:
            bad(f"storage entry {_name(idx)} -> {_name(info)}")
        rel = info.relative_path
        if not rel or os.path.isabs(rel) or os.path.normpath(rel).split(os.sep)[0] == "..":
            bad(f"data file {rel!r} of {idx.fqn!r} is not a file inside the checkpoint directory")


def _mem_format_code(props, t: "_Tables"):
    """TensorProperties.memory_format as its pickled encoding (None when it is not a known one)."""
    import torch

    e = t.mem_format_encoding
    return {torch.contiguous_format: e.TORCH_CONTIGUOUS_FORMAT, torch.channels_last: e.TORCH_CHANNELS_LAST,
            torch.preserve_format: e.TORCH_PRESERVE_FORMAT}.get(props.memory_format)


def byte_entry_error(source: str, key: str) -> CheckpointError:
    """The one line for a DCP byte entry (BytesStorageMetadata: a pickled object, which torch's
    DefaultLoadPlanner.load_bytes would unpickle with weights_only=False) where a loader asks for
    a tensor: the project loads tensors only, so it never reads one."""
    return CheckpointError(f"{source}: refusing to load {key!r}: it is a byte entry (a pickled object), and "
                           "only tensors are loaded from a checkpoint; nothing from it was read")


def require_tensor_entries(md, keys, source: str) -> None:
    """Every key of `keys` that `md` (DCP metadata) holds is a tensor entry; a byte entry is
    byte_entry_error (keys the checkpoint lacks are left to the caller's own message)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    sdm = md.state_dict_metadata
    for key in keys:
        if isinstance(sdm.get(key), BytesStorageMetadata):
            raise byte_entry_error(source, key)


def torch_tensor():
    import torch

    return torch.Tensor


def _narrow(tensor, offsets, lengths, path: str, fqn: str):
    """tensor[offsets : offsets + lengths] per dimension (torch's narrow_tensor_by_index), each
    inside the chunk: a read item that reaches past it is one line, not a short copy."""
    if len(offsets) != tensor.dim() or len(lengths) != tensor.dim():
        raise CheckpointError(f"{path}: the chunk of {fqn!r} has {tensor.dim()} dimensions, the load reads "
                              f"{len(offsets)}")
    for dim, (o, n) in enumerate(zip(offsets, lengths)):
        if o < 0 or n < 0 or o + n > tensor.size(dim):
            raise CheckpointError(f"{path}: the load reads {fqn!r} past its chunk (dimension {dim}: "
                                  f"{o}+{n} of {tensor.size(dim)})")
        if o != 0 or n != tensor.size(dim):
            tensor = tensor.narrow(dim, o, n)
    return tensor


def _file_system_reader_class():
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        """PyTorch's DCP file reader whose `read_metadata` uses the restricted unpickler (and reads
        the file once; `metadata`: already read, e.g. by the caller's own checks).

        `read_metadata` takes no arguments on purpose: when reading the global `.metadata` fails,
        torch's loader retries with a rank-local `__<rank>.metadata` only if the reader's
        read_metadata accepts `**kwargs` (torch/distributed/checkpoint/state_dict_loader.py:233-247);
        a refused `.metadata` must stop the load, not fall back to another pickle."""

        def __init__(self, path, metadata=None):
            super().__init__(path)
            self._metadata = metadata

        def read_data(self, plan, planner):
            """torch's FileSystemReader.read_data (filesystem.py:861-909) with each tensor chunk
            decoded by the project's restricted reader (safe_torch.loads_torch), not by torch.load,
            whose allow-list any import extends. A BYTE_IO read would hand the bytes to
            planner.load_bytes, which torch's own planner unpickles with
            torch.load(weights_only=False) (default_planner.py:382-392); the project loads tensors
            only, so no byte read reaches a planner through this reader (whichever planner the
            caller chose). Stored transforms (compression, extensions) are refused."""
            from torch.futures import Future

            from torch.distributed.checkpoint.planner import LoadItemType

            md_path = os.path.join(os.fspath(self.path), METADATA_FILE)
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise byte_entry_error(md_path, item.storage_index.fqn)
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for relative_path, reqs in per_file.items():
                path = os.path.join(os.fspath(self.path), relative_path)
                with open(path, "rb") as f:
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        info = self.storage_data[req.storage_index]
                        fqn = req.storage_index.fqn
                        if getattr(info, "transform_descriptors", None):
                            raise CheckpointError(f"{path}: {fqn!r} is stored with transforms "
                                                  f"{list(info.transform_descriptors)} (not read here)")
                        buf = pread_exact(f.fileno(), info.length, info.offset)  # the tensor views it
                        if buf is None:
                            raise CheckpointError(f"{path}: truncated (a chunk of {fqn!r} at byte {info.offset} "
                                                  f"needs {info.length} bytes)")
                        tensor = loads_torch(buf, f"{path} (a chunk of {fqn!r} at byte {info.offset})")
                        if not isinstance(tensor, torch_tensor()):
                            raise CheckpointError(f"{path}: the chunk of {fqn!r} at byte {info.offset} is not a tensor")
                        tensor = _narrow(tensor, req.storage_offsets, req.lengths, path, fqn)
                        target = planner.resolve_tensor(req).detach()
                        if target.size() != tensor.size():
                            raise CheckpointError(f"{path}: the chunk of {fqn!r} at byte {info.offset} has shape "
                                                  f"{list(tensor.size())}, the load asks for {list(target.size())}")
                        target.copy_(tensor)
                        planner.commit_tensor(req, target)
            fut: Future = Future()
            fut.set_result(None)
            return fut

        def read_metadata(self):
            from torch.distributed.checkpoint.metadata import StorageMeta

            if self._metadata is None:
                self._metadata = read_dcp_metadata(self.path)
            md = self._metadata
            if getattr(md, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader


_reader_class = None


def safe_file_system_reader(path: str | os.PathLike, metadata=None):
    """A torch.distributed.checkpoint FileSystemReader for `path` whose metadata is read with the
    restricted unpickler (or is `metadata`, already read that way)."""
    global _reader_class
    if _reader_class is None:
        _reader_class = _file_system_reader_class()
    return _reader_class(path, metadata)
