"""The project's own reader of torch.save files (gspo_megatron/checkpoint/safe_torch.py; issue 52
row 1): common.pt, the per-rank RNG files and every tensor chunk of the DCP data files go through
it, never through torch.load.

Reference: torch.load itself. Whatever torch.save writes for a checkpoint (tensors of every dtype,
views with offsets and strides, shared and empty storages, nested dicts, lists, tuples, numbers,
dtypes, torch.Size, OrderedDicts) reads back equal to torch.load's answer (a property test over
random structures). What torch's weights-only loader admits only because an import extended its
process-wide allow-list (`import megatron.core` admits numpy's `_reconstruct`, `ndarray`, `dtype`:
megatron/core/safe_globals.py) is refused in one line naming the file and the global, and so is
every forged archive (a storage too small for its tensor, a compressed member, a big-endian file,
a persistent id that is not a storage). The end-to-end refusal of a planted common.pt on
`checkpoint.resume=auto` is in tests/test_safe_loading.py (the loaders' runs)."""
from __future__ import annotations

import argparse
import ast
import collections
import io
import os
import pickle
import random
import zipfile

import pytest
import torch

from gspo_megatron.checkpoint.safe_torch import load_torch_file, loads_torch
from gspo_megatron.errors import CheckpointError

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64]


def _saved(obj) -> bytearray:
    b = io.BytesIO()
    torch.save(obj, b)
    return bytearray(b.getvalue())


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
                and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace):
        return _equal(vars(a), vars(b))
    return a == b or (a != a and b != b)  # NaN


def _random_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
    base = (torch.randn(shape, dtype=torch.float64) * 50).to(dtype) if dtype != torch.bool else \
        torch.rand(shape) > 0.5
    view = rng.random()
    if view < 0.2 and base.dim() == 2:
        return base.t()  # non-contiguous strides
    if view < 0.4 and base.numel() > 1:
        return base.reshape(-1)[1:]  # a storage offset
    return base


def _random_obj(rng: random.Random, depth: int = 0):
    pick = rng.random() if depth < 3 else rng.random() * 0.6
    if pick < 0.35:
        return _random_tensor(rng)
    if pick < 0.45:
        return rng.choice([0, -7, 2 ** 40, 3.5, float("inf"), float("nan"), True, None, "s", "é", b"\x00b"])
    if pick < 0.5:
        return rng.choice(DTYPES)
    if pick < 0.55:
        return torch.Size([rng.randint(0, 9) for _ in range(rng.randint(0, 3))])
    if pick < 0.7:
        return [_random_obj(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if pick < 0.8:
        return tuple(_random_obj(rng, depth + 1) for _ in range(rng.randint(0, 3)))
    cls = collections.OrderedDict if pick < 0.85 else dict
    return cls((f"k{i}", _random_obj(rng, depth + 1)) for i in range(rng.randint(0, 4)))


@pytest.mark.parametrize("seed", range(40))
def test_reads_what_torch_save_writes_equal_to_torch_load(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    obj = {"a": _random_obj(rng), "b": [_random_obj(rng) for _ in range(3)]}
    data = _saved(obj)
    want = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    got = loads_torch(data, "x.pt")
    assert _equal(got, want), (got, want)
    assert _equal(loads_torch(bytes(data), "x.pt"), want)  # read-only input: the same answer


def test_shared_storages_stay_shared_and_tensors_view_the_buffer():
    """Two views of one storage come back as views of one storage (as torch.load gives them), and a
    tensor is a view of the file's bytes, not a copy: at 235B a chunk is gigabytes."""
    base = torch.arange(12, dtype=torch.float32)
    data = _saved({"x": base[2:8].view(2, 3), "y": base[4:]})
    got = loads_torch(data, "x.pt")
    assert got["x"].untyped_storage().data_ptr() == got["y"].untyped_storage().data_ptr()
    got["x"][0, 2] = -1  # base[4]
    assert got["y"][0].item() == -1
    big = _saved(torch.randn(256, 256))
    t = loads_torch(big, "big.pt")
    start = torch.frombuffer(big, dtype=torch.uint8).data_ptr()
    assert start <= t.data_ptr() < start + len(big)


def test_megatron_lm_run_arguments_only_where_asked():
    from megatron.core.transformer.enums import AttnBackend

    obj = {"args": argparse.Namespace(num_layers=2, attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16)}
    data = _saved(obj)
    got = loads_torch(data, "common.pt", run_args=True)
    assert _equal(got, obj) and got["args"].attention_backend is AttnBackend.auto
    with pytest.raises(CheckpointError, match=r"^common.pt: refusing to unpickle the global argparse.Namespace"):
        loads_torch(data, "common.pt")  # a trainer checkpoint's files hold no run arguments


def _numpy_common(path) -> None:
    """A common.pt whose pickle builds a numpy array: numpy's _reconstruct, ndarray and dtype, the
    globals `import megatron.core` adds to torch's weights-only allow-list. (The issue's probe
    forged an object array's pointers this way: a segfault; here the array is harmless.)"""
    import numpy as np

    torch.save({"trainer": {"step": 1, "x": np.arange(4, dtype=np.uint32)}}, path)  # UInt32DType: admitted


def test_numpy_from_megatrons_safe_globals_is_refused_where_torch_load_constructs_it(tmp_path):
    """The control shows the hole: once megatron.core is imported (as in every run, and in this
    process), torch.load with weights_only=True constructs the numpy array from the file: the
    allow-list is process-wide state that any import extends. The project's reader refuses it,
    with one line naming the file and the global."""
    import megatron.core  # noqa: F401 - registers megatron/core/safe_globals.py SAFE_GLOBALS with torch

    path = tmp_path / "common.pt"
    _numpy_common(path)
    x = torch.load(path, weights_only=True)["trainer"]["x"]
    assert type(x).__module__ == "numpy" and x.tolist() == [0, 1, 2, 3]  # torch.load built it
    with pytest.raises(CheckpointError) as e:
        load_torch_file(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: refusing to unpickle the global numpy.") and "_reconstruct" in msg, msg
    assert "nothing from the file was run" in msg and "\n" not in msg


def _forge(obj, edit) -> bytearray:
    """torch.save(obj) with its archive rewritten by `edit(name, bytes) -> bytes | None` (None:
    member dropped), written back as a stored zip as torch writes it."""
    src = zipfile.ZipFile(io.BytesIO(bytes(_saved(obj))))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for info in src.infolist():
            data = edit(info.filename, src.read(info))
            if data is not None:
                z.writestr(info.filename, data)
    return bytearray(out.getvalue())


class _Sentinel:
    pass


def _tensor_pickle(offset, size, stride, hooks) -> bytes:
    """The pickle torch.save writes for a float32 tensor over storage "0" of 6 elements, with the
    given offset, size, stride and backward hooks."""
    storage = _Sentinel()

    class _T:
        def __reduce__(self):
            return torch._utils._rebuild_tensor_v2, (storage, offset, size, stride, False, hooks)

    class _P(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", 6) if obj is storage else None

    b = io.BytesIO()
    _P(b, protocol=2).dump(_T())
    return b.getvalue()


def _pickle_with(global_line: bytes) -> bytes:
    """A protocol-2 pickle calling `global_line` (module\\nname\\n) with one string argument."""
    return b"\x80\x02c" + global_line + b"X\x01\x00\x00\x00a\x85R."


@pytest.mark.parametrize("case,match", [
    ("os.system", r"refusing to unpickle the global posix.system|refusing to unpickle the global nt.system"),
    ("builtins.eval", "refusing to unpickle the global builtins.eval"),
    ("codecs", "_codecs.encode with the codec 'zlib_codec'"),  # bytes are latin-1 text, never a decompressor
    ("storage_too_small", "reaching past its storage"),
    ("storage_size", "bytes for 6 elements"),
    ("missing_storage", "a storage '0' the archive does not hold"),
    ("hooks", "backward hooks"),
    ("persid", "a persistent id other than a storage"),
    ("big_endian", "byte order"),
    ("compressed", "a compressed member"),
    ("truncated", "unreadable"),
    ("two_pickles", "exactly one <name>/data.pkl"),
    ("od_args", "an OrderedDict built from arguments"),
    ("reduce_enum_no_run_args", "refusing to unpickle the global megatron.core"),
    ("no_stop", "unreadable"),
    ("oversize_view", "reaching past its storage"),
])
def test_forged_archives_are_one_line_naming_the_file(case, match):
    t = torch.arange(6, dtype=torch.float32)
    pk = "archive/data.pkl"
    if case == "os.system":
        data = _forge(t, lambda n, b: _pickle_with(b"posix\nsystem\n" if os.name == "posix" else b"nt\nsystem\n")
                      if n == pk else b)
    elif case == "builtins.eval":
        data = _forge(t, lambda n, b: _pickle_with(b"builtins\neval\n") if n == pk else b)
    elif case == "codecs":
        data = _forge(t, lambda n, b: b"\x80\x02c_codecs\nencode\nX\x01\x00\x00\x00aX\n\x00\x00\x00zlib_codec\x86R."
                      if n == pk else b)
    elif case == "storage_too_small":  # a tensor of 6 elements claiming size 60
        data = _forge(t, lambda n, b: b.replace(b"K\x06\x85", b"K<\x85") if n == pk else b)
    elif case == "storage_size":
        data = _forge(t, lambda n, b: b[:8] if n == "archive/data/0" else b)
    elif case == "missing_storage":
        data = _forge(t, lambda n, b: None if n == "archive/data/0" else b)
    elif case == "hooks":
        data = _forge(t, lambda n, b: _tensor_pickle(0, (6,), (1,), collections.OrderedDict(a=1)) if n == pk else b)
    elif case == "oversize_view":  # 6 elements, but a stride that reaches element 10
        data = _forge(t, lambda n, b: _tensor_pickle(0, (2, 3), (5, 1), collections.OrderedDict()) if n == pk else b)
    elif case == "persid":
        data = _forge(t, lambda n, b: b"\x80\x02X\x01\x00\x00\x00aQ." if n == pk else b)
    elif case == "big_endian":
        data = _forge(t, lambda n, b: b"big" if n == "archive/byteorder" else b)
    elif case == "compressed":
        src = zipfile.ZipFile(io.BytesIO(bytes(_saved(t))))
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
            for info in src.infolist():
                z.writestr(info.filename, src.read(info))
        data = bytearray(out.getvalue())
    elif case == "truncated":
        data = _saved(t)[:100]
    elif case == "two_pickles":
        data = _forge(t, lambda n, b: b)
        extra = io.BytesIO(bytes(data))
        with zipfile.ZipFile(extra, "a", zipfile.ZIP_STORED) as z:
            z.writestr("other/data.pkl", b"\x80\x02N.")
        data = bytearray(extra.getvalue())
    elif case == "od_args":
        data = _forge(t, lambda n, b: b"\x80\x02ccollections\nOrderedDict\n]\x85R." if n == pk else b)
    elif case == "reduce_enum_no_run_args":
        data = _forge(t, lambda n, b: _pickle_with(b"megatron.core.transformer.enums\nAttnBackend\n")
                      if n == pk else b)
    else:  # no_stop: a pickle without its STOP
        data = _forge(t, lambda n, b: b"\x80\x02]" if n == pk else b)
    with pytest.raises(CheckpointError) as e:
        loads_torch(data, "ck/common.pt")
    msg = str(e.value)
    assert msg.startswith("ck/common.pt: ") and "\n" not in msg, msg
    import re

    assert re.search(match, msg), msg


def test_load_torch_file_reads_the_file_and_names_it(tmp_path):
    p = tmp_path / "rng_rank0.pt"
    state = {"torch": torch.get_rng_state(), "tracker": {"model-parallel-rng": torch.get_rng_state()}}
    torch.save(state, p)
    assert _equal(load_torch_file(p), state)
    p.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match=rf"^{p}: unreadable"):
        load_torch_file(p)


def test_nothing_in_the_package_calls_torch_load():
    """By construction: no module of the project (or bench/, converters/) calls torch.load; every
    torch.save file of a checkpoint is read by safe_torch.py."""
    from testlib import project_trees

    calls = []
    for rel, tree in project_trees("gspo_megatron", "bench", "converters"):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"):
                calls.append(f"{rel}:{node.lineno}")
    assert not calls, calls


def test_pread_exact_loops_over_short_reads_and_says_when_the_file_ends(tmp_path, monkeypatch):
    """One read returns at most 0x7ffff000 bytes on Linux (an fp32 optimizer chunk at 235B is
    larger): a short read is continued, not taken for a truncated file. Short reads forced here
    (7 bytes at a time); a file that ends early is None (the caller's one-line "truncated")."""
    from gspo_megatron.checkpoint import safe_torch

    data = bytes(range(256)) * 40
    p = tmp_path / "f"
    p.write_bytes(data)
    real = os.preadv
    monkeypatch.setattr(safe_torch.os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:7]], off))
    fd = os.open(p, os.O_RDONLY)
    try:
        assert bytes(safe_torch.pread_exact(fd, 1000, 100)) == data[100:1100]
        assert safe_torch.pread_exact(fd, 100, len(data) - 50) is None
    finally:
        os.close(fd)
