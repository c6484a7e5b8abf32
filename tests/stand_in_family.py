"""A model family defined in this one file (tests/test_model_families.py registers it for a test):
Qwen3-MoE's config and tensors under another model_type, with its own attention parameter count,
KV-cache size and router capture, to show that shared code asks the family for those."""
from __future__ import annotations

import dataclasses

from gspo_megatron.model.families.qwen3_moe import Qwen3MoeFamily, config as qwen3_config

MODEL_TYPE = "stand_in_moe"
ATTENTION = (1234, 7)  # per layer on one rank: projections, attention-internal norms
KV_BYTES = 1000  # per token, every layer
ACTIVATION = 5000.0  # elements per token one layer's attention stores, TP1


class StandInFamily(Qwen3MoeFamily):
    model_type = MODEL_TYPE
    display_name = "stand-in MoE"
    asked = 0  # routers() calls

    def read_config(self, hf, source="config"):
        arch = qwen3_config.read_config({**hf, "model_type": qwen3_config.MODEL_TYPE}, source)
        return dataclasses.replace(arch, model_type=MODEL_TYPE)

    def attention_params(self, arch, tp=1):
        return ATTENTION[0] // tp, ATTENTION[1]

    def attention_activation_elements(self, arch, tp, selective):
        return ACTIVATION / tp

    def kv_cache_bytes_per_token(self, arch, dtype_bytes):
        return KV_BYTES * dtype_bytes

    def routers(self, model):
        self.asked += 1
        return super().routers(model)


FAMILY = StandInFamily()
