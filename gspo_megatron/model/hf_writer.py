"""Write a Hugging Face checkpoint from a stream of (name, tensor): safetensors shards + index.

Used by the converter (mcore -> HF), the trainer's final export and SGLang's disk weight sync.
Memory: at most one shard's worth of tensors is held. The checkpoint is assembled in a temporary
directory beside `out_dir` and renamed into place at the end, so an interrupted write never leaves
something at `out_dir` that looks like a checkpoint. The output carries fsutil's marker, and an
existing `out_dir` is replaced only when it is an earlier output of the same writer (fsutil.publish).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Iterable

import torch

from gspo_megatron.fsutil import check_replaceable, current_command, discard, make_tmp, publish

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' default max_shard_size
# what marks the trainer's export (<out_dir>/hf, train/setup.py export_hf), the default writer
EXPORT_COMMAND = "checkpoint.export_hf"


def parse_size(s: str | int) -> int:
    """'5GB', '500MB', '200KB' or a byte count."""
    if isinstance(s, int):
        return s
    t = s.strip().upper()
    for unit, mul in (("GIB", 1024**3), ("MIB", 1024**2), ("KIB", 1024), ("GB", 10**9), ("MB", 10**6),
                      ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * mul)
    return int(t)


class HFShardWriter:
    """Accumulates tensors into shards of at most `max_shard_bytes` and writes them to `directory`."""

    def __init__(self, directory: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, dtype: torch.dtype | None = None):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor, cast: bool = True) -> None:
        """`cast`: to the writer's dtype (False: as it is, e.g. a carried tensor)."""
        if name in self._names:  # a set: a 671B model's export adds ~10^5 names
            raise ValueError(f"duplicate tensor name {name!r} in HF export")
        self._names.add(name)
        t = tensor.detach().to("cpu")
        if cast and self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = t
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        idx = len(self._shards)
        save_file(self._pending, os.path.join(self.directory, f"shard-{idx:05d}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        """Flush, give shards their final `model-XXXXX-of-YYYYY` names, write the index."""
        if self._pending:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.directory, f"shard-{i:05d}.safetensors"), os.path.join(self.directory, final))
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def save_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str,
    hf_config: dict,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
    copy_from: str | None = None,
    progress: bool = False,
    command: str | None = EXPORT_COMMAND,
    add_files: Callable[[str], object] | None = None,
    carried: Iterable[tuple[str, torch.Tensor]] = (),
) -> int:
    """Write a complete HF checkpoint at `out_dir` atomically; returns bytes of tensor data.

    `hf_config` is written as config.json (with `torch_dtype`/`dtype` updated when `dtype` is given).
    `copy_from`: a directory whose generation_config.json and tokenizer files are carried over.
    `command`: what the output's marker names, and the only kind of directory at `out_dir` it
    replaces (fsutil.publish: a user's folder there is refused, after the tensors are consumed,
    so collective callers never hang); an enclosing fsutil.output_of (the converter) names it
    instead; None replaces whatever is there. `add_files(dir)`: writes more files into the
    checkpoint before it is published (e.g. a tokenizer's save_pretrained). `carried`: more
    (name, tensor) written as they are, never cast (checkpoint/carried.py: the MTP layers).
    """
    out_dir = os.path.abspath(out_dir)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    tmp = make_tmp(out_dir)
    try:
        writer = HFShardWriter(tmp, parse_size(max_shard_size), dtype)
        it = named_tensors
        if progress:
            from tqdm import tqdm

            it = tqdm(named_tensors, desc="writing HF tensors", unit="tensor")
        for name, t in it:
            writer.add(name, t)
        for name, t in carried:
            writer.add(name, t, cast=False)
        writer.finish()
        cfg = dict(hf_config)
        if dtype is not None:
            dname = str(dtype).replace("torch.", "")
            cfg["torch_dtype"] = dname
            cfg["dtype"] = dname
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        if copy_from:
            copy_side_files(copy_from, tmp)
        if add_files is not None:
            add_files(tmp)
        command = current_command() or command
        # replaces an earlier export as one step
        publish(tmp, out_dir, overwrite=True, command=command, tolerate=_tolerated(command))
    except BaseException:
        discard(tmp)
        raise
    return writer.total_bytes


def _tolerated(command: str | None) -> tuple[str, ...]:
    # train/setup.py export_hf saves the tokenizer into the export after it is published: those
    # files (all in SIDE_FILES) are the export's own, though its marker cannot list them
    return SIDE_FILES if command == EXPORT_COMMAND else ()


def check_export_target(out_dir: str, command: str = EXPORT_COMMAND) -> None:
    """Refuse now (one line) what save_hf_checkpoint(out_dir, command=command) would refuse
    after writing: an existing `out_dir` that is not an earlier output of `command`."""
    if os.path.lexists(out_dir):
        check_replaceable(os.path.abspath(out_dir), command, tolerate=_tolerated(command))


SIDE_FILES = (
    "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model",
)


def copy_side_files(src: str, dst: str) -> list[str]:
    """Carry generation config and tokenizer files over when present."""
    copied = []
    for f in SIDE_FILES:
        p = os.path.join(src, f)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(dst, f))
            copied.append(f)
    return copied
