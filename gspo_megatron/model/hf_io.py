"""Read Hugging Face safetensors checkpoints tensor by tensor, and load them into a sharded model.

No rank ever materialises the whole model: each rank reads only the tensors its parameters are
made of (its layers, its experts), and for vocab-parallel tensors only its rows.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

import torch

from gspo_megatron.model import mapping
from gspo_megatron.errors import CheckpointError
from gspo_megatron.model.mapping import Kind, MappingError
from gspo_megatron.model.arch import MoeArch

INDEX_FILE = "model.safetensors.index.json"
# safetensors maps shard files; pages read through an open handle stay charged to this process
# until the handle closes. Closing handles every this many bytes keeps a rank's RSS near its own
# parameters instead of parameters + every shard page it touched (bench/bench_load.py: loader
# overhead 0.97x -> 0.19x of a 1 GB checkpoint at TP2). A tensor already read keeps its data.
HANDLE_RECYCLE_BYTES = 64 * 1024**2
SINGLE_FILE = "model.safetensors"


class HFCheckpointReader:
    """Lazy access to the tensors of an HF checkpoint directory (sharded or single-file)."""

    def __init__(self, hf_dir: str):
        self.hf_dir = hf_dir
        self._handles: dict = {}
        self._read_since_recycle = 0
        if not os.path.isdir(hf_dir):
            raise CheckpointError(f"{hf_dir}: no such directory")
        index = os.path.join(hf_dir, INDEX_FILE)
        single = os.path.join(hf_dir, SINGLE_FILE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                if not isinstance(weight_map, dict) or not all(
                        type(k) is str and type(v) is str for k, v in weight_map.items()):
                    raise TypeError("weight_map is not an object of tensor name -> file name")
            except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, a list
                raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
            self.weight_map: dict[str, str] = dict(weight_map)
        elif os.path.isfile(single):
            self.weight_map = {k: SINGLE_FILE for k in self._open(SINGLE_FILE).keys()}
        else:
            raise CheckpointError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        for fname in sorted(set(self.weight_map.values())):
            if os.path.isabs(fname) or os.path.normpath(fname).split(os.sep)[0] == "..":
                raise CheckpointError(f"{os.path.join(hf_dir, INDEX_FILE)}: shard {fname!r} is not a file inside "
                                      f"{hf_dir}")
            if not os.path.isfile(os.path.join(hf_dir, fname)):
                raise CheckpointError(f"{os.path.join(hf_dir, fname)}: shard listed in {INDEX_FILE} is missing")

    def _open(self, fname: str):
        from safetensors import safe_open

        h = self._handles.get(fname)
        if h is None:
            path = os.path.join(self.hf_dir, fname)
            try:
                h = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
            self._handles[fname] = h
        return h

    def names(self) -> set[str]:
        return set(self.weight_map)

    def _file_of(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise CheckpointError(f"{self.hf_dir}: tensor {name!r} is missing from the checkpoint") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._file_of(name)).get_slice(name).get_shape())

    def get(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only rows [start, stop) of dim 0 (read from disk without the rest)."""
        fname = self._file_of(name)
        try:
            sl = self._open(fname).get_slice(name)
            t = sl[rows[0] : rows[1]] if rows is not None else sl[:]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{os.path.join(self.hf_dir, fname)}: cannot read tensor {name!r} ({e})") from None
        self._read_since_recycle += t.numel() * t.element_size()
        if self._read_since_recycle >= HANDLE_RECYCLE_BYTES:
            self._handles.clear()
            self._read_since_recycle = 0
        return t

    def validate(self, arch: MoeArch) -> None:
        """Names and shapes against the config, before any rank loads anything."""
        have = self.names()
        # Bounded by the files, not by the config: the expected names are enumerated only while
        # they can all be present (a config claiming 1e9 experts beside a tiny checkpoint is
        # answered after len(have) + 1 names, not after building a billion of them).
        expected: dict[str, tuple[int, ...]] = {}
        missing: list[str] = []
        for n, shp in mapping.iter_hf_shapes(arch):
            expected[n] = shp
            if n not in have:
                missing.append(n)
            if len(expected) > len(have):
                break
        if missing:
            more = len(missing) - 1
            raise CheckpointError(
                f"{self.hf_dir}: tensor {missing[0]!r} is missing"
                + (f" (config.json implies more tensors than the checkpoint's {len(have)})"
                   if len(expected) > len(have) else f" (and {more} more)" if more else "")
            )
        ignorable = set(mapping.output_rule(arch).hf) if arch.tie_word_embeddings else set()
        # the MTP layers: not part of the policy, carried unchanged into checkpoints and exports
        # (checkpoint/carried.py)
        mtp = {n for n in have if is_mtp_name(n, arch)}
        unknown = sorted(have - set(expected) - ignorable - mtp)
        if unknown:
            raise CheckpointError(
                f"{self.hf_dir}: unknown tensor {unknown[0]!r} (not part of a {arch.family.display_name} with "
                "this config)"
                + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            )
        for n, shp in expected.items():
            got = self.shape(n)
            if got != shp:
                raise CheckpointError(f"{self.hf_dir}: tensor {n!r} has shape {list(got)}, config implies {list(shp)}")


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def is_mtp_name(name: str, arch: MoeArch) -> bool:
    """Whether `name` is a tensor of one of the multi-token-prediction layers `arch`'s config
    declares (`model.layers.{num_layers + i}.`, after the decoder)."""
    i = _layer_of(name)
    return i is not None and arch.num_layers <= i < arch.num_layers + arch.mtp_layers


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of this stage's first decoder layer (Megatron layer_number is 1-based)."""
    layers = getattr(getattr(_unwrap(model), "decoder", None), "layers", None)
    if not layers:
        return 0
    return layers[0].layer_number - 1


def global_expert(local: int, ep_rank: int, arch: MoeArch, ep: int) -> int:
    # Megatron assigns experts to EP ranks in contiguous blocks.
    return ep_rank * (arch.num_experts // ep) + local


def named_local_params(model: torch.nn.Module, arch: MoeArch) -> Iterable[tuple[str, torch.Tensor]]:
    """The weights of one model chunk, with wrapper prefixes removed: its parameters and the
    buffers the family's map names (the router's expert bias)."""
    m = _unwrap(model)
    yield from m.named_parameters()
    for name, b in m.named_buffers():
        if b is not None and mapping.is_mapped_buffer(name, arch):
            yield name, b


def load_hf_into_model(
    models: list[torch.nn.Module],
    reader: HFCheckpointReader,
    arch: MoeArch,
    *,
    tp_rank: int,
    tp: int,
    ep_rank: int,
    ep: int,
    etp_rank: int,
    etp: int,
) -> int:
    """Copy HF weights into this rank's parameters; returns the number of parameters loaded."""
    n = 0
    for model in models:
        offset = layer_offset(model)
        for name, param in named_local_params(model, arch):
            m = mapping.match(name, arch)
            layer = None if m.layer is None else m.layer + offset
            expert = None if m.expert is None else global_expert(m.expert, ep_rank, arch, ep)
            hf_names = m.rule.hf_names(layer, expert)
            if m.rule.kind is Kind.VOCAB and arch.tie_word_embeddings:
                hf_names = mapping.embedding_rule(arch).hf
            if m.rule.kind is Kind.VOCAB:
                _load_vocab_rows(param, hf_names[0], reader, arch, tp_rank)
                n += 1
                continue
            local = _local_tensor(m.rule, hf_names, reader, arch,
                                  rank=etp_rank if m.rule.kind.is_expert else tp_rank,
                                  size=etp if m.rule.kind.is_expert else tp)
            if tuple(local.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"{reader.hf_dir}: {'/'.join(hf_names)} gives shape {list(local.shape)} for "
                    f"{name}, model expects {list(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(local.to(param.dtype))
            n += 1
    return n


def _load_vocab_rows(param, hf_name, reader, arch, tp_rank) -> None:
    """Read only this rank's vocab rows, straight into the parameter; padding rows are zero."""
    rows = param.shape[0]
    start = tp_rank * rows
    hi = min(start + rows, arch.vocab_size)
    shape = reader.shape(hf_name)
    if tuple(shape[1:]) != tuple(param.shape[1:]) or shape[0] != arch.vocab_size:
        raise CheckpointError(f"{reader.hf_dir}: tensor {hf_name!r} has shape {list(shape)}, "
                              f"expected [{arch.vocab_size}, {param.shape[1]}]")
    with torch.no_grad():
        if hi > start:
            param[: hi - start].copy_(reader.get(hf_name, rows=(start, hi)))
        param[max(hi - start, 0):].zero_()


def _local_tensor(rule, hf_names, reader, arch, *, rank, size) -> torch.Tensor:
    tensors = [reader.get(n) for n in hf_names]
    full = mapping.hf_to_full(rule, tensors, arch, padded_vocab=0)
    try:
        return mapping.shard(rule, full, rank, size)
    except MappingError as e:
        raise CheckpointError(f"{reader.hf_dir}: {e}") from None

