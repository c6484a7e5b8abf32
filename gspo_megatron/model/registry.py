"""The model-family registry: model_type -> the module holding its FAMILY (model/families/<name>/).

Apart from model/family.py (the protocol and the readers' helpers) so that the architecture record
(model/arch.py) can find its family without an import circle. Adding a family is one line here and
one folder.
"""
from __future__ import annotations

import importlib
import json
import os
from typing import Any

from gspo_megatron.errors import ModelConfigError

FAMILY_MODULES = {
    "qwen3_moe": "gspo_megatron.model.families.qwen3_moe",
    "glm4_moe": "gspo_megatron.model.families.glm4_moe",
    "deepseek_v3": "gspo_megatron.model.families.deepseek_v3",
}
# An inline model.hf_config without a model_type is the first family's (configs written before
# families existed carry none).
DEFAULT_MODEL_TYPE = "qwen3_moe"


def family_of_type(model_type: str):
    """The ModelFamily (model/family.py) registered for `model_type`; one line naming the
    supported ones otherwise."""
    try:
        module = FAMILY_MODULES[model_type]
    except (KeyError, TypeError):
        raise ModelConfigError(f"model_type {model_type!r} is not a supported model family "
                               f"(supported: {', '.join(sorted(FAMILY_MODULES))})") from None
    return importlib.import_module(module).FAMILY


def family_for(hf: dict[str, Any], source: str = "config"):
    """The family of an HF config dict (by model_type; none: the default family)."""
    mt = hf.get("model_type", DEFAULT_MODEL_TYPE)
    if not isinstance(mt, str):
        raise ModelConfigError(f"{source}: model_type must be a string, got {mt!r}")
    try:
        return family_of_type(mt)
    except ModelConfigError as e:
        raise ModelConfigError(f"{source}: {e}") from None


def arch_from_hf_dict(hf: dict[str, Any], source: str = "config"):
    """Validate an HF config dict (config.json contents or an inline dict) with its family."""
    return family_for(hf, source).read_config(hf, source)


def read_hf_config_dir(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isdir(hf_dir):
        raise ModelConfigError(f"{hf_dir}: no such directory")
    if not os.path.isfile(path):
        raise ModelConfigError(f"{path}: missing (not a Hugging Face checkpoint directory)")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{path}: invalid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelConfigError(f"{path}: not a JSON object")
    return d


def arch_from_hf_dir(hf_dir: str):
    return arch_from_hf_dict(read_hf_config_dir(hf_dir), source=os.path.join(hf_dir, "config.json"))
