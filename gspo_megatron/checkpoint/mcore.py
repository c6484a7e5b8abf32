"""Megatron-Core `torch_dist` checkpoints of Qwen3-MoE: conversion to and from Hugging Face, and
saving/loading the sharded model.

Checkpoint directory layout (what `save_mcore_checkpoint` writes into C; `gspo-convert
hf-to-mcore --out R` writes it into R/iter_0000000/ with R/latest_checkpointed_iteration.txt = "0"
and Megatron-Bridge's latest_train_state.pt, a Megatron-LM checkpoint root that Megatron-LM and
Megatron-Bridge load as they load Bridge's own converted models; see megatron_dirs.py):

    C/metadata.json        {"sharded_backend": "torch_dist", ...}   Megatron's format marker
    C/common.pt            Megatron's non-sharded state ({"content_metadata": ...} for a converted model)
    C/.metadata            PyTorch DCP global metadata: key -> global shape, dtype, chunks
    C/__<rank>_<i>.distcp  DCP data files
    C/hf_config/           config.json of the HF model (+ generation config and tokenizer files
                           when the source had them): the architecture travels with the weights,
                           and mcore -> HF needs no other input
    C/run_config.yaml      the same architecture for Megatron-Bridge's loaders

Every reader here takes C or a Megatron-LM root (its tracker, else its newest iter_*), and takes
the architecture from hf_config/, else from a Megatron-Bridge run_config.yaml.

Keys and global shapes are Megatron's (see layout.py): decoder tensors stacked over
layers, experts over [layers, experts], TE norm names, vocab tensors with the HF vocabulary's rows
(unpadded; any padding rows a layout needs are zero-filled on load). The `_extra_state` entries
of Transformer Engine layers are stored as None (megatron_dirs.extra_state_objects: Megatron-Bridge's
loaders require them to exist) and never read back: our loads request tensors only (TE's FP8
metadata is not needed to resume bf16/fp32 training), so both the CPU and TE layer specs load them.

Public API
    read_hf_config(C) -> (dict, path)            the HF config stored with an mcore checkpoint
    read_mcore_arch(C) -> MoeArch           its architecture (errors name the path)
    model_sharded_state_dict(chunks, arch)       the model's sharded state dict in checkpoint keys
    save_mcore_checkpoint(chunks, C, hf_config)  collective, atomic save of the sharded model
    load_mcore_into_model(chunks, C)             collective load into already-built chunks, any layout
    hf_to_mcore(H, C, ...) / mcore_to_hf(C, H2, ...)   streaming conversion (single process or
                                                 collective under torch.distributed)
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable, Iterable, Iterator

import torch

from gspo_megatron.checkpoint import atomic, carried, integrity, layout, megatron_dirs
from gspo_megatron.checkpoint.dcp_io import Chunk, DcpReader, save_chunks
from gspo_megatron.checkpoint.safetensors_data import SafetensorsData
from gspo_megatron.model import mapping
from gspo_megatron.errors import CheckpointError
from gspo_megatron.model.hf_io import HFCheckpointReader
from gspo_megatron.model.hf_writer import (
    DEFAULT_MAX_SHARD_BYTES,
    HFShardWriter,
    copy_side_files,
    parse_size,
    save_hf_checkpoint,
)
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.errors import ModelConfigError

HF_CONFIG_DIR = "hf_config"
FORMAT_FILE = "metadata.json"  # megatron.core.dist_checkpointing.core.CONFIG_FNAME
COMMON_FILE = "common.pt"  # megatron.core.dist_checkpointing.strategies.common.COMMON_STATE_FNAME
FORMAT = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}
DEFAULT_MAX_FILE_BYTES = 5 * 1024**3  # torch_dist data file size cap of the converter


# ----------------------------------------------------------------------------------------------
# The checkpoint directory


def check_mcore_dir(ckpt_dir: str, require_checksums: bool = False) -> None:
    """A clear error unless `ckpt_dir` is a torch_dist checkpoint directory. Its files but the
    tensor data are verified against its checksums.json first (integrity.verify_before_parse:
    every reader of the folder comes through here before it parses anything of it)."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such directory")
    integrity.verify_before_parse(ckpt_dir, data=False, require=require_checksums)
    fmt = os.path.join(ckpt_dir, FORMAT_FILE)
    if not os.path.isfile(fmt):
        hint = " (it looks like a Hugging Face checkpoint directory)" \
            if os.path.isfile(os.path.join(ckpt_dir, "config.json")) else ""
        raise CheckpointError(f"{ckpt_dir}: not a Megatron torch_dist checkpoint (no {FORMAT_FILE}){hint}")
    try:
        with open(fmt, encoding="utf-8") as f:
            backend = json.load(f).get("sharded_backend")
    except (ValueError, AttributeError) as e:  # JSONDecodeError, UnicodeDecodeError; not an object
        raise CheckpointError(f"{fmt}: invalid JSON ({e})") from None
    if backend != "torch_dist":
        raise CheckpointError(f"{fmt}: sharded_backend is {backend!r}, only 'torch_dist' is supported")


def read_hf_config(ckpt_dir: str, require_checksums: bool = False) -> tuple[dict, str]:
    """(config dict, its path) of the model in an mcore checkpoint (a root or an iteration
    directory: megatron_dirs.resolve): the HF config it carries (hf_config/, the project's), else
    the one its Megatron-Bridge run_config.yaml or Megatron-LM run arguments describe.
    `require_checksums`: refuse a checkpoint without checksums.json (else a warning)."""
    ckpt_dir = megatron_dirs.resolve(ckpt_dir)
    check_mcore_dir(ckpt_dir, require_checksums)
    path = os.path.join(ckpt_dir, HF_CONFIG_DIR, "config.json")
    if not os.path.isfile(path):
        carried = megatron_dirs.carried_config(ckpt_dir)
        if carried is not None:
            return carried
        raise ModelConfigError(
            f"{path}: missing, and neither a {megatron_dirs.RUN_CONFIG} (Megatron-Bridge) nor run arguments in "
            "common.pt (Megatron-LM) beside it: the checkpoint does not carry its model config; pass "
            "--hf-config-dir / model.hf_dir")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f), path
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ModelConfigError(f"{path}: invalid JSON ({e})") from None


def read_mcore_arch(ckpt_dir: str, require_checksums: bool = False) -> MoeArch:
    """The Qwen3-MoE architecture of an mcore checkpoint (from the HF config it carries)."""
    cfg, path = read_hf_config(ckpt_dir, require_checksums)
    return MoeArch.from_hf_dict(cfg, source=path)


def _hf_config_dict(hf_config: dict | str) -> tuple[dict, str | None]:
    if isinstance(hf_config, dict):
        return dict(hf_config), None
    MoeArch.from_hf_dir(hf_config)  # validates, errors name the path
    with open(os.path.join(hf_config, "config.json")) as f:
        return json.load(f), hf_config


def _write_format_files(directory: str, hf_config: dict, side_files_from: str | None) -> None:
    with open(os.path.join(directory, FORMAT_FILE), "w") as f:
        json.dump(FORMAT, f)
    torch.save({"content_metadata": dict(megatron_dirs.CONTENT_METADATA)}, os.path.join(directory, COMMON_FILE))
    _write_hf_config(directory, hf_config, side_files_from)


def _write_hf_config(directory: str, hf_config: dict, side_files_from: str | None) -> None:
    """hf_config/ (the project's readers) and run_config.yaml (Megatron-Bridge's)."""
    d = os.path.join(directory, HF_CONFIG_DIR)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    if side_files_from:
        copy_side_files(side_files_from, d)
    dtype = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "bfloat16")
    megatron_dirs.write_run_config(directory, MoeArch.from_hf_dict(hf_config), dtype)


def _with_dtype(cfg: dict, dtype: torch.dtype | None) -> dict:
    cfg = dict(cfg)
    if dtype is not None:
        name = str(dtype).replace("torch.", "")
        cfg["torch_dtype"] = name
        cfg["dtype"] = name
    return cfg


def check_matches_arch(reader: DcpReader, arch: MoeArch) -> None:
    """Every tensor a Qwen3-MoE of `arch` needs is stored, with the global shape it implies (as a
    tensor: a byte entry under its key is refused, see safe_metadata.byte_entry_error)."""
    for key, shape in layout.expected_keys(arch).items():
        key = layout.stored_key(key, reader.tensors)
        reader.require_tensors([key])
        if key not in reader.tensors:
            raise CheckpointError(f"{reader.directory}: tensor {key!r} is missing from the checkpoint")
        got = reader.shape(key)
        if layout.is_vocab_key(key, arch):
            ok = got[1:] == shape[1:] and got[0] >= shape[0]
        else:
            ok = got == shape
        if not ok:
            raise CheckpointError(
                f"{reader.directory}: tensor {key!r} has global shape {list(got)}, the config implies {list(shape)}"
            )


# ----------------------------------------------------------------------------------------------
# Conversion


@dataclass
class ConversionStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def _split_contiguous(sizes: list[int], world: int) -> list[int]:
    """Rank of each item: contiguous runs balanced by bytes (keeps every rank's reads sequential)."""
    total = sum(sizes) or 1
    out, acc = [], 0
    for s in sizes:
        out.append(min(world - 1, int((acc + s / 2) * world / total)))
        acc += s
    return out


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                dynamic_ncols=True, mininterval=0.5)


def _barrier():
    d = atomic.dist_or_none()
    if d is not None:
        d.barrier()


def hf_to_mcore(
    hf_dir: str,
    out_dir: str,
    *,
    dtype: torch.dtype | None = None,
    max_file_size: str | int = DEFAULT_MAX_FILE_BYTES,
    progress: bool = False,
    overwrite: bool = False,
    threads: int = 1,
) -> ConversionStats:
    """Convert an HF Qwen3-MoE checkpoint to a torch_dist checkpoint at `out_dir`, streaming.

    Every input check (config, names, shapes, shard headers and sizes) runs before anything is
    written. Memory: one full Megatron tensor (a layer's QKV, one expert's fc1, the embedding) plus
    its source tensors. Collective under torch.distributed: ranks split the chunks in contiguous
    runs and DCP writes one global metadata file.
    """
    with _one_torch_thread():
        return _hf_to_mcore(hf_dir, out_dir, dtype=dtype, max_file_size=max_file_size, progress=progress,
                            overwrite=overwrite, threads=threads)


@contextlib.contextmanager
def _one_torch_thread():
    """Conversion is I/O and memcpy; torch's intra-op thread pool only adds spin-waits (on a busy
    machine a 2 MB torch.cat took 40 ms with 2 threads, 0.2 ms with one)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _hf_to_mcore(hf_dir, out_dir, *, dtype, max_file_size, progress, overwrite, threads) -> ConversionStats:
    t0 = time.monotonic()
    rank, world = atomic.rank_world()
    arch = MoeArch.from_hf_dir(hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    reader = HFCheckpointReader(hf_dir)
    reader.validate(arch)
    data = SafetensorsData(hf_dir, reader.weight_map)
    data.check_all()
    mtp = carried.from_hf_dir(hf_dir, arch, reader.weight_map)
    out_dir = atomic.check_target(out_dir, overwrite)

    items = layout.plan_items(arch)
    chunks = []
    for it in items:
        names = it.hf_names()
        dts = {data.dtype(n) for n in names}
        if len(dts) > 1 and dtype is None:
            raise CheckpointError(f"{hf_dir}: {'/'.join(names)} have different dtypes {sorted(map(str, dts))}; pass --dtype")
        dt = dtype or dts.pop()
        chunks.append(Chunk(it.key, it.global_shape, it.offsets, it.sizes, dt, partial(_produce, data, it, arch, dt)))
    owner = _split_contiguous([c.nbytes for c in chunks], world)
    mine = [c for c, r in zip(chunks, owner) if r == rank]

    stats = ConversionStats(tensors=len(mine), bytes=sum(c.nbytes for c in mine))
    bar = _progress(stats.bytes, "hf-to-mcore" + (f" [rank {rank}]" if world > 1 else ""), progress and rank == 0)
    tmp = atomic.make_tmp_collective(out_dir)
    # a Megatron-LM root holding iteration 0, as Megatron-Bridge saves a converted model:
    # iter_0000000/ + the tracker + Bridge's train state (megatron_dirs.py says why not release/;
    # Megatron-LM, Bridge's three loaders and our readers all take the root)
    it = megatron_dirs.CONVERTED_ITERATION
    ck = os.path.join(tmp, megatron_dirs.iter_name(it))
    os.makedirs(ck, exist_ok=True)
    try:
        save_chunks(mine, ck, max_file_bytes=parse_size(max_file_size), threads=threads,
                    on_written=lambda c: bar.update(c.nbytes),
                    objects=megatron_dirs.extra_state_entries(arch) if rank == 0 else None)
        bar.close()
        if rank == 0:
            _write_format_files(ck, _with_dtype(cfg, dtype), hf_dir)
            if mtp is not None:  # as they are, in their own dtype (checkpoint/carried.py)
                mtp.write(ck)
            megatron_dirs.write_bridge_train_state(tmp, ck, it)
        _barrier()
        integrity.record(ck, atomic.dist_or_none())  # every file of the iteration, before it is named
        if rank == 0:
            megatron_dirs.write_tracker(tmp, it)
        _barrier()
        if rank == 0:
            atomic.publish(tmp, out_dir, overwrite=overwrite)
        _barrier()
    except BaseException:
        bar.close()
        if rank == 0:
            atomic.discard(tmp)
        raise
    finally:
        data.close()
    stats.seconds = time.monotonic() - t0
    return stats


def _produce(data: SafetensorsData, it: layout.Item, arch: MoeArch, dtype: torch.dtype) -> torch.Tensor:
    tensors = [data.get(n) for n in it.hf_names()]
    full = mapping.hf_to_full(it.rule, tensors, arch, padded_vocab=0)
    return full.to(dtype).reshape(it.sizes)


def _iter_hf(reader: DcpReader, items: Iterable[layout.Item], arch: MoeArch, bar=None) -> Iterator[tuple[str, torch.Tensor]]:
    for it in items:
        t = reader.read(it.key, it.offsets, it.sizes).reshape(it.full_shape)
        yield from zip(it.hf_names(), mapping.full_to_hf(it.rule, t, arch))
        if bar is not None:
            bar.update(t.numel() * t.element_size())


def mcore_to_hf(
    ckpt_dir: str,
    out_dir: str,
    *,
    hf_config_dir: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = False,
    overwrite: bool = False,
    require_checksums: bool = False,
) -> ConversionStats:
    """Convert a torch_dist checkpoint (converted, or saved by the trainer at any layout) to an HF
    checkpoint at `out_dir`: safetensors shards + index, config.json, generation config and
    tokenizer files (from `hf_config_dir` when given, else from the checkpoint's hf_config/).
    Every file of the checkpoint is verified against its checksums.json before it is parsed and
    before anything is written (a mismatch: one CheckpointError line naming the file); without
    checksums.json a warning names the folder, or, with `require_checksums`, it is refused.

    Memory: one stored chunk region at a time plus one output shard (hf_writer buffers a shard).
    Collective under torch.distributed: ranks write disjoint shards, rank 0 numbers them and
    writes the index.
    """
    with _one_torch_thread():
        return _mcore_to_hf(ckpt_dir, out_dir, hf_config_dir=hf_config_dir, dtype=dtype,
                            max_shard_size=max_shard_size, progress=progress, overwrite=overwrite,
                            require_checksums=require_checksums)


def _mcore_to_hf(ckpt_dir, out_dir, *, hf_config_dir, dtype, max_shard_size, progress, overwrite,
                 require_checksums) -> ConversionStats:
    t0 = time.monotonic()
    rank, world = atomic.rank_world()
    ckpt_dir = megatron_dirs.resolve(ckpt_dir)
    check_mcore_dir(ckpt_dir, require_checksums)  # its files but the tensor data verified, then parsed
    if hf_config_dir is not None:
        arch = MoeArch.from_hf_dir(hf_config_dir)
        with open(os.path.join(hf_config_dir, "config.json")) as f:
            cfg = json.load(f)
        side = hf_config_dir
    else:
        cfg, path = read_hf_config(ckpt_dir)
        arch = MoeArch.from_hf_dict(cfg, source=path)
        side = os.path.dirname(path)
    reader = DcpReader(ckpt_dir)
    reader.check_files()
    check_matches_arch(reader, arch)
    # every file, the tensor data included (split over the ranks), before a tensor is read or
    # anything written
    integrity.verify_before_parse(ckpt_dir, data=True, require=require_checksums, dist=atomic.dist_or_none())
    mtp = carried.from_checkpoint(ckpt_dir, arch)  # written by rank 0, unconverted
    out_dir = atomic.check_target(out_dir, overwrite)
    max_bytes = parse_size(max_shard_size)

    # each tensor under the key this checkpoint stores it under (layout.KEY_ALIASES)
    items = [replace(it, key=layout.stored_key(it.key, reader.tensors)) for it in layout.plan_items(arch)]
    sizes = [it.nbytes(reader.dtype(it.key).itemsize) for it in items]
    owner = _split_contiguous(sizes, world)
    mine = [it for it, r in zip(items, owner) if r == rank]
    stats = ConversionStats(tensors=sum(len(it.rule.hf) for it in mine),
                            bytes=sum(s for s, r in zip(sizes, owner) if r == rank))
    bar = _progress(stats.bytes, "mcore-to-hf" + (f" [rank {rank}]" if world > 1 else ""), progress and rank == 0)
    try:
        if world == 1:
            save_hf_checkpoint(_iter_hf(reader, mine, arch, bar), out_dir, cfg, max_shard_size=max_bytes,
                               dtype=dtype, copy_from=side, carried=mtp.tensors() if mtp else ())
        else:
            _mcore_to_hf_collective(reader, mine, arch, out_dir, cfg, side, max_bytes, dtype, overwrite, bar,
                                    mtp if rank == 0 else None)
    finally:
        bar.close()
        reader.close()
    stats.seconds = time.monotonic() - t0
    return stats


def _mcore_to_hf_collective(reader, mine, arch, out_dir, cfg, side, max_bytes, dtype, overwrite, bar, mtp) -> None:
    d = atomic.dist_or_none()
    rank, world = atomic.rank_world()
    tmp = atomic.make_tmp_collective(out_dir)
    err: BaseException | None = None
    try:
        sub = os.path.join(tmp, f".rank{rank:05d}")
        os.makedirs(sub)
        w = HFShardWriter(sub, max_bytes, dtype)
        for name, t in _iter_hf(reader, mine, arch, bar):
            w.add(name, t)
        for name, t in (mtp.tensors() if mtp is not None else ()):
            w.add(name, t, cast=False)
        w.finish()
    except Exception as e:  # reported to every rank below, so nobody waits forever
        err = e
    errors = [None] * world
    d.all_gather_object(errors, None if err is None else (type(err).__name__, str(err)))
    try:
        if err is not None:
            raise err
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r, (kind, msg) = failed[0]
            raise CheckpointError(f"rank {r} failed: {msg}") if kind == "CheckpointError" else RuntimeError(f"rank {r}: {kind}: {msg}")
        if rank == 0:
            _merge_rank_shards(tmp, world, _with_dtype(cfg, dtype), side)
        d.barrier()
        if rank == 0:
            atomic.publish(tmp, out_dir, overwrite=overwrite)
        d.barrier()
    except BaseException:
        if rank == 0:
            atomic.discard(tmp)
        raise


def _merge_rank_shards(tmp: str, world: int, cfg: dict, side: str | None) -> None:
    from gspo_megatron.model.hf_io import INDEX_FILE

    parts = []
    for r in range(world):
        sub = os.path.join(tmp, f".rank{r:05d}")
        with open(os.path.join(sub, INDEX_FILE)) as f:
            parts.append((sub, json.load(f)))
    files = [(sub, fname) for sub, idx in parts for fname in sorted(set(idx["weight_map"].values()))]
    n = len(files)
    rename = {}
    for i, (sub, fname) in enumerate(files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(os.path.join(sub, fname), os.path.join(tmp, final))
        rename[(sub, fname)] = final
    weight_map, total = {}, 0
    for sub, idx in parts:
        total += idx["metadata"]["total_size"]
        for k, fname in idx["weight_map"].items():
            weight_map[k] = rename[(sub, fname)]
        shutil.rmtree(sub)
    with open(os.path.join(tmp, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if side:
        copy_side_files(side, tmp)


# ----------------------------------------------------------------------------------------------
# The sharded model


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    # DDP / Float16Module wrappers keep the model in `.module`
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def _chunk_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"  # Megatron-LM's naming for (virtual) pipeline chunks


def model_sharded_state_dict(chunks: list[torch.nn.Module], arch: MoeArch, *, trainable_only: bool = False) -> dict:
    """{"model": sharded state dict} (or model0, model1, ... for several chunks) in checkpoint keys:
    parameters only (no `_extra_state`), each under the Transformer Engine spec's key whichever spec
    built the model (layout.canonical_key, from `arch`'s family rules). Chunks may be wrapped in
    Megatron DDP / Float16Module. `trainable_only`: without the frozen parameters (a LoRA policy's
    base: its checkpoints hold the adapters, model/lora.py)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    out = {}
    for i, chunk in enumerate(chunks):
        sd = {}
        frozen = _frozen_names(chunk) if trainable_only else frozenset()
        for name, v in _unwrap(chunk).sharded_state_dict().items():
            if isinstance(v, ShardedObject) or name.endswith("._extra_state") or name in frozen:
                continue
            if isinstance(v, ShardedTensor):
                v.key = layout.canonical_key(name, v.key, arch)
            sd[name] = v
        out[_chunk_key(i, len(chunks))] = sd
    return out


def _frozen_names(chunk: torch.nn.Module) -> frozenset:
    return frozenset(n for n, p in _unwrap(chunk).named_parameters() if not p.requires_grad)


def model_extra_state_keys(chunks: list[torch.nn.Module]) -> list[tuple[str, tuple, tuple]]:
    """(key, global shape, global offset) of the `_extra_state` ShardedObjects this rank's model
    chunks ask a checkpoint for (Transformer Engine's modules on GPU, Megatron's linear layers on
    CPU); the keys are global, so every writer of the same architecture asks for the same ones."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = []
    for chunk in chunks:
        for v in nested_values(_unwrap(chunk).sharded_state_dict()):
            if isinstance(v, ShardedObject) and v.key.endswith("._extra_state"):
                out.append((v.key, tuple(v.global_shape), tuple(v.global_offset)))
    return out


def _sharded_tensors(sd: dict):
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for v in nested_values(sd):
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            yield from (x for x in nested_values(built if isinstance(built, dict) else {"_": built})
                        if isinstance(x, ShardedTensor))
        elif isinstance(v, ShardedTensor):
            yield v


def _check_model_against(sd: dict, reader: DcpReader) -> None:
    for st in _sharded_tensors(sd):
        reader.require_tensors([st.key])
        if st.key not in reader.tensors:
            raise CheckpointError(f"{reader.directory}: tensor {st.key!r} needed by the model is not in the checkpoint")
        got, want = reader.shape(st.key), tuple(st.global_shape)
        ok = got[1:] == want[1:] if st.allow_shape_mismatch else got == want
        if not ok:
            raise CheckpointError(
                f"{reader.directory}: tensor {st.key!r} has global shape {list(got)}, the model expects "
                f"{list(want)} (checkpoint of a different model config?)"
            )


class _SyncTorchDistSave:
    """Megatron's torch_dist save strategy, written synchronously with PyTorch's own DCP file
    writer. Megatron's default writer (FileSystemWriterAsync) calls torch.cuda.synchronize() and
    forks writer processes; this one works on CPU (gloo) and GPU alike and produces the same
    format (Megatron's key translation and save planner)."""

    def __new__(cls, thread_count: int = 2):
        from megatron.core.dist_checkpointing.strategies.torch import (
            MCoreSavePlanner,
            TorchDistSaveShardedStrategy,
            _replace_state_dict_keys_with_sharded_keys,
            mcore_to_pyt_state_dict,
        )

        class Strategy(TorchDistSaveShardedStrategy):
            def save(self, sharded_state_dict, checkpoint_dir):
                from torch.distributed.checkpoint import FileSystemWriter
                from torch.distributed.checkpoint import save as dcp_save

                sd, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
                pyt = mcore_to_pyt_state_dict(sd, False)
                dcp_save(pyt, storage_writer=FileSystemWriter(str(checkpoint_dir), thread_count=self.thread_count),
                         planner=MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica,
                                                  flatten_state_dict=False))

        return Strategy("torch_dist", 1, thread_count=thread_count)


def _parallel_save(strategy):
    """Megatron's FullyParallelSaveStrategyWrapper over the world: replicated regions (every DP
    replica's copy of the model and, with fully_reshardable optimizer state, of the optimizer
    state) are written by a balanced share of the ranks that hold them instead of all by the main
    replica (DP rank 0), which the torch_dist strategy alone does (keep_only_main_replica)."""
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(strategy) if atomic.dist_or_none() is not None else strategy


def save_mcore_checkpoint(
    chunks: list[torch.nn.Module],
    ckpt_dir: str,
    hf_config: dict | str,
    *,
    side_files_from: str | None = None,
    extra_sharded_state: dict | None = None,
    model_state: dict | None = None,
    write_rank_files: Callable[[str], None] | None = None,
    overwrite: bool = True,
    thread_count: int = 2,
    tensor_chunks: list[Chunk] | None = None,
    common_state: dict | None = None,
    checksums: bool = True,
    collectives=None,
    extra_state_keys: list | None = None,
    carried_tensors: carried.CarriedTensors | None = None,
) -> None:
    """Save this rank's model chunks (any TP/PP/EP/ETP layout) as one torch_dist checkpoint.

    Collective: every rank of the world calls it (Megatron's parallel state must exist). Written
    through `megatron.core.dist_checkpointing.save` into a hidden temporary directory beside
    `ckpt_dir`; rank 0 adds `hf_config/` and, after a barrier, renames it into place (replacing an
    existing `ckpt_dir` when `overwrite`). `hf_config`: the HF config dict, or an HF checkpoint
    directory (its config.json plus generation/tokenizer files are stored). `extra_sharded_state`:
    more sharded state to put in the same checkpoint under its own top-level keys (e.g.
    {"optimizer": optimizer.sharded_state_dict(...)}); plain values in it (not sharded) go to
    Megatron's common.pt, written by rank 0. `model_state`: the model's sharded state dict when
    the caller already built it (an optimizer's sharded state refers to its tensors).
    `write_rank_files(tmp_dir)`: called on every rank after the tensors are written and before
    the directory is published, for per-rank side files. Load it back with `load_mcore_into_model`.
    `tensor_chunks` + `common_state`: instead of Megatron's save of the sharded state, write these
    (this rank's) chunks of the global tensors with dcp_io.save_chunks and
    `common_state` as common.pt (rank 0) — the same format, e.g. for the trainer's distributed
    optimizer (gspo_megatron/train/checkpoint_shards.py); `model_state`/`extra_sharded_state` are
    then not used.
    Vocab tensors are saved with the padded rows of the saving layout; loaders accept any padding.
    `checksums`: write checksums.json (integrity.record) into the directory before it is published
    (the trainer passes False and writes them itself, train/checkpoint.py _write_checksums).
    `collectives`: the group every collective of the save runs on (parallel/state.py GroupOps; a
    background writer's own, train/async_save.py), default the world's; with `tensor_chunks` only.
    `extra_state_keys`: this rank's `model_extra_state_keys(chunks)`, when the caller read them
    already (a background writer must not walk modules the training thread is using).
    `carried_tensors`: HF tensors stored unchanged in `carried/` (the MTP layers,
    checkpoint/carried.py); by default those of the HF checkpoint `hf_config` names, if any.
    """
    from megatron.core import dist_checkpointing

    cfg, side = _hf_config_dict(hf_config)
    arch = MoeArch.from_hf_dict(cfg, source="save_mcore_checkpoint(hf_config=...)")
    if carried_tensors is None and side is not None:
        carried_tensors = carried.from_hf_dir(side, arch)
    side = side_files_from or side
    sd = dict(model_state if model_state is not None else model_sharded_state_dict(chunks, arch))
    for k, v in (extra_sharded_state or {}).items():
        if k in sd:
            raise ValueError(f"save_mcore_checkpoint: extra_sharded_state key {k!r} clashes with the model's")
        sd[k] = v
    if collectives is not None and tensor_chunks is None:
        raise ValueError("save_mcore_checkpoint: collectives= is for tensor_chunks saves (Megatron's save uses "
                         "the world's groups)")
    d = collectives if collectives is not None else atomic.dist_or_none()
    rank = d.get_rank() if d is not None else 0

    def barrier() -> None:
        if d is not None:
            d.barrier()

    out = os.path.abspath(ckpt_dir)
    tmp = atomic.make_tmp_collective(out, d)
    try:
        arch = MoeArch.from_hf_dict(cfg)
        content = dict(megatron_dirs.CONTENT_METADATA)
        # the `_extra_state` entries: the architecture's list (megatron_dirs) and whatever this
        # model's modules ask for (on GPU, Transformer Engine's exact set), gathered onto rank 0
        extra = set(megatron_dirs.extra_state_objects(arch))
        asked = list(extra_state_keys) if extra_state_keys is not None else model_extra_state_keys(chunks)
        if d is not None:
            gathered: list = [None] * d.get_world_size()
            d.all_gather_object(gathered, asked)
            asked = [x for part in gathered for x in part]
        extra |= set(asked)
        if tensor_chunks is None:
            if rank == 0:  # the `_extra_state` entries other Megatron loaders ask for (megatron_dirs)
                sd["_extra_state"] = _extra_state_sharded_objects(extra)
            dist_checkpointing.save(sd, tmp, sharded_strategy=_parallel_save(_SyncTorchDistSave(thread_count)),
                                    content_metadata=content)
        else:
            data = megatron_dirs.extra_state_bytes()
            save_chunks(tensor_chunks, tmp, max_file_bytes=DEFAULT_MAX_FILE_BYTES, threads=thread_count,
                        objects={megatron_dirs.dcp_key(*x): data for x in extra} if rank == 0 else None,
                        process_group=getattr(collectives, "group", None))
            if rank == 0:
                with open(os.path.join(tmp, FORMAT_FILE), "w") as f:
                    json.dump(FORMAT, f)
                torch.save({**(common_state or {}), "content_metadata": content}, os.path.join(tmp, COMMON_FILE))
        if write_rank_files is not None:
            write_rank_files(tmp)
        if rank == 0:
            _write_hf_config(tmp, cfg, side)
            if carried_tensors is not None:
                carried_tensors.write(tmp)
        barrier()
        if checksums:
            integrity.record(tmp, d)
            barrier()
        if rank == 0:
            atomic.publish(tmp, out, overwrite=overwrite)
        barrier()
    except BaseException:
        if rank == 0:
            atomic.discard(tmp)
        raise


def _extra_state_sharded_objects(entries) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {megatron_dirs.dcp_key(k, shape, off): ShardedObject(k, None, shape, off, replica_id=0)
            for k, shape, off in sorted(entries)}


def load_mcore_into_model(
    chunks: list[torch.nn.Module],
    ckpt_dir: str,
    *,
    extra_sharded_state: dict | None = None,
    model_state: dict | None = None,
    require_checksums: bool = False,
    verify_data: bool = True,
    trainable_only: bool = False,
) -> dict:
    """Fill this rank's already-built model chunks from a torch_dist checkpoint, at whatever
    TP/PP/EP/ETP layout they were built with (the checkpoint stores global tensors; each rank reads
    only the regions its parameters cover). Collective (Megatron's parallel state must exist);
    chunks may be wrapped in Megatron DDP. Keys and global shapes are checked against the
    checkpoint first, so a wrong checkpoint fails with a CheckpointError naming the tensor.
    Returns the loaded `extra_sharded_state` entries (e.g. the optimizer's), {} when none.
    `model_state`: the model's sharded state dict when the caller already built it.

    Nothing in the checkpoint can run code: `.metadata` is read once, with the restricted
    unpickler (gspo_megatron/checkpoint/safe_metadata.py), and that parsed metadata is what
    Megatron's load uses (not torch's FileSystemReader, an unrestricted pickle.load); common.pt is
    read with the project's own restricted unpickler (checkpoint/safe_torch.py), as is each tensor
    chunk of the data files; only tensors are read from the data files: a
    ShardedObject (pickled bytes, which PyTorch's DCP planner unpickles with weights_only=False,
    torch/distributed/checkpoint/default_planner.py:382-392, load_bytes) in the requested state is
    refused (see load_sharded).

    Nothing in it is used unverified: every file is checked against its checksums.json before it
    is parsed (the small files first, then the tensor data split over the ranks; `verify_data`:
    False when the caller has just verified the whole folder itself, as the trainer's resume
    does); a mismatch is one CheckpointError line naming the file. Without checksums.json: a
    warning naming the folder, or refused with `require_checksums`.

    After loading into a model whose optimizer keeps fp32 main parameters, call the optimizer's
    `reload_model_params()` so they follow. `trainable_only`: the frozen parameters (a LoRA
    policy's base, loaded from its own source) are neither asked for nor set.
    """
    ckpt_dir = megatron_dirs.resolve(ckpt_dir)
    check_mcore_dir(ckpt_dir, require_checksums)
    if verify_data:
        integrity.verify_before_parse(ckpt_dir, data=True, require=require_checksums, dist=atomic.dist_or_none())
    reader = DcpReader(ckpt_dir)
    reader.check_files()
    sd = dict(model_state if model_state is not None else
              model_sharded_state_dict(chunks, read_mcore_arch(ckpt_dir), trainable_only=trainable_only))
    for t in _sharded_tensors(sd):  # another writer's name for a tensor (layout.KEY_ALIASES)
        t.key = layout.stored_key(t.key, reader.tensors)
    _check_model_against(sd, reader)
    extra = dict(extra_sharded_state or {})
    for k in extra:
        if k in sd:
            raise ValueError(f"load_mcore_into_model: extra_sharded_state key {k!r} clashes with the model's")
    loaded = load_sharded({**sd, **extra}, ckpt_dir, metadata=reader.metadata)
    for i, chunk in enumerate(chunks):
        got = loaded[_chunk_key(i, len(chunks))]
        for name, p in _unwrap(chunk).named_parameters():
            if trainable_only and not p.requires_grad:
                continue
            if name not in got:
                raise CheckpointError(f"{ckpt_dir}: no value loaded for parameter {name}")
            with torch.no_grad():
                p.copy_(got[name])
    return {k: loaded[k] for k in extra}


def load_sharded(sharded_state: dict, ckpt_dir: str, *, partial: bool = False, metadata=None) -> dict:
    """`dist_checkpointing.load` of a sharded state dict (collective), tensors only: ShardedObjects
    are refused (see load_mcore_into_model), errors become one CheckpointError naming the path.
    `partial`: the ranks together ask for only part of some tensors (a piecewise load), so
    Megatron's check that every region is requested is off (validate_access_integrity).
    `metadata`: the checkpoint's `.metadata` already read with
    gspo_megatron.checkpoint.safe_metadata.read_dcp_metadata (e.g. DcpReader.metadata); pass it
    when loading from one checkpoint several times, else every call reads and checks it again.

    Megatron's own strategies would unpickle `.metadata` unrestricted (its torch_dist strategy builds
    torch's FileSystemReader itself, dist_checkpointing/strategies/torch.py:798); the strategies
    of gspo_megatron/checkpoint/megatron_load.py read it with the restricted unpickler, and it is
    read here first, so a refused file is one line naming it before Megatron starts."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException  # a BaseException

    from gspo_megatron.checkpoint.megatron_load import safe_load_strategies
    from gspo_megatron.checkpoint.safe_metadata import METADATA_FILE, read_dcp_metadata, require_tensor_entries

    _refuse_sharded_objects(sharded_state)
    if metadata is None:
        metadata = read_dcp_metadata(ckpt_dir)
    # tensors only: a byte entry under a requested key would be unpickled (see megatron_load.py)
    require_tensor_entries(metadata, [t.key for t in _sharded_tensors(sharded_state)],
                           os.path.join(ckpt_dir, METADATA_FILE))
    sharded_strategy, common_strategy = safe_load_strategies(ckpt_dir, metadata)
    try:
        return dist_checkpointing.load(sharded_state, ckpt_dir, sharded_strategy=sharded_strategy,
                                       common_strategy=common_strategy, validate_access_integrity=not partial)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        inner = _unwrap_checkpoint_exception(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(f"{ckpt_dir}: cannot load the checkpoint ({type(inner).__name__}: "
                              f"{str(inner).splitlines()[0] if str(inner) else ''})") from e


def _refuse_sharded_objects(sd: dict) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    for v in nested_values(sd):
        if isinstance(v, ShardedObject):
            raise CheckpointError(f"refusing to load {v.key!r}: a pickled object (only tensors are loaded)")


def _unwrap_checkpoint_exception(e: BaseException) -> BaseException:
    failures = getattr(e, "failures", None)
    if failures:
        f = next(iter(failures.values()))
        return f[0] if isinstance(f, tuple) else f
    return e
