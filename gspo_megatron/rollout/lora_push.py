"""A LoRA policy's adapters pushed on their own (issue 55), beside the weights: the engine serves
W x + (alpha / r) B A x for the modules of the groups it declares (Capabilities.lora_targets),
the trainer sends those modules' base weights unmerged and every other adapter merged into its
weight (model/export.py iter_hf_tensors `unmerged`). Which groups: what the engine declares and
the run adapts, never the engine's name (train/setup.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdapterPush:
    """One version's adapters in PEFT's names and HF layout (`<hf module>.lora_A.weight` r x in,
    `.lora_B.weight` out x r: model/lora.py iter_hf_adapters), and their settings."""
    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    groups: tuple[str, ...]

    @property
    def modules(self) -> list[str]:
        """The HF modules the adapters stand on, each once."""
        return sorted({k.split(".lora_")[0] for k in self.tensors})

    def save(self, path: str, base_model: str | None = None) -> str:
        """A PEFT adapter folder at `path` (model/lora.py save_peft: temp folder, then rename)."""
        from gspo_megatron.model.lora import LoraSpec, save_peft

        return save_peft(path, self.tensors, LoraSpec(rank=self.rank, alpha=self.alpha), base_model=base_model)
