"""HF tensors carried through unchanged: the multi-token-prediction (MTP) layers.

DeepSeek-V3, Kimi-K2 and GLM-4.5 checkpoints hold MTP layers after the decoder
(`model.layers.{num_hidden_layers + i}.*`, `num_nextn_predict_layers` of them) that engines use for
speculative decoding. The policy does not train them (the model built here has no MTP block), but a
conversion or an export that dropped them would take that away from whoever serves the result. So
every path that starts from an HF checkpoint and writes one carries them, byte for byte in their
own dtype (FP8 weights and their scales included), and the config written says so:

  * `gspo-convert hf-to-mcore` stores them in the iteration folder's `carried/` (safetensors shards
    and an index, covered by the checkpoint's checksums.json like every other file);
    `mcore-to-hf` writes them back beside the converted tensors, in the same index;
  * the trainer takes them from where its model came from (model.hf_dir's files, model.load's or
    the resumed checkpoint's `carried/`), stores them in every checkpoint it saves and writes them
    into its HF export, whose config.json then declares the MTP layers (the family's
    `hf_config(..., mtp_layers=)`; without carried tensors it declares none).

What a reader admits: only tensors of the MTP layers the config declares, from files inside the
folder (HFCheckpointReader's index checks); anything else is one CheckpointError line naming the
file and the tensor. Memory: one tensor read at a time, one output shard buffered (`SHARD_BYTES`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.errors import CheckpointError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.hf_io import is_mtp_name

DIR = "carried"  # inside a torch_dist checkpoint's iteration folder
SHARD_BYTES = 1024**3  # what a writer of carried tensors buffers before writing a shard


@dataclass(frozen=True)
class CarriedTensors:
    """The carried tensors of one source: safetensors files in `directory`, `weight_map` name -> file."""

    directory: str
    weight_map: dict

    def names(self) -> list[str]:
        return sorted(self.weight_map)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) one at a time, file by file (sequential reads), each as stored."""
        from gspo_megatron.checkpoint.safetensors_data import SafetensorsData

        data = SafetensorsData(self.directory, self.weight_map)
        try:
            data.check_all()
            for name in sorted(self.weight_map, key=lambda n: (self.weight_map[n], n)):
                yield name, data.get(name)
        finally:
            data.close()

    def write(self, checkpoint_dir: str) -> None:
        """`checkpoint_dir`/carried/: the tensors as safetensors shards and their index."""
        from gspo_megatron.model.hf_writer import HFShardWriter

        d = os.path.join(checkpoint_dir, DIR)
        os.makedirs(d, exist_ok=True)
        w = HFShardWriter(d, SHARD_BYTES)
        for name, t in self.tensors():
            w.add(name, t)
        w.finish()


def from_hf_dir(hf_dir: str, arch: MoeArch, weight_map: dict | None = None) -> CarriedTensors | None:
    """The MTP tensors of an HF checkpoint, or None when it holds none (or no weights at all).
    `weight_map`: its name -> file map when the caller's HFCheckpointReader has read it."""
    from gspo_megatron.model.hf_io import INDEX_FILE, SINGLE_FILE, HFCheckpointReader

    if weight_map is None:
        if not any(os.path.isfile(os.path.join(hf_dir, f)) for f in (INDEX_FILE, SINGLE_FILE)):
            return None
        weight_map = HFCheckpointReader(hf_dir).weight_map
    mine = {n: f for n, f in weight_map.items() if is_mtp_name(n, arch)}
    return CarriedTensors(hf_dir, mine) if mine else None


def from_checkpoint(ckpt_dir: str, arch: MoeArch) -> CarriedTensors | None:
    """The carried tensors of a torch_dist checkpoint's iteration folder (`carried/`), or None.
    Every name must be a tensor of an MTP layer `arch` declares (one line naming the file else)."""
    from gspo_megatron.model.hf_io import INDEX_FILE, HFCheckpointReader

    d = os.path.join(ckpt_dir, DIR)
    if not os.path.isdir(d):
        return None
    weight_map = HFCheckpointReader(d).weight_map  # its index checks: files inside the folder
    for name in sorted(weight_map):
        if not is_mtp_name(name, arch):
            raise CheckpointError(
                f"{os.path.join(d, INDEX_FILE)}: carried tensor {name!r} is not in the "
                f"{arch.mtp_layers} MTP layer(s) after layer {arch.num_layers - 1} that hf_config declares")
    return CarriedTensors(d, dict(weight_map)) if weight_map else None
