"""Config resolution: a loaded Config (config.py: schema + loader, no model knowledge) and what it
points at on disk -> the model architecture, checked against the layout.

The architecture comes from the model family (model/family.py) of whichever config gives it:
model.load's checkpoint, model.hf_dir's config.json, or the inline model.hf_config. Every source
given must agree with the chosen one field by field, never a silent override (a smaller inline
vocab_size used to load a larger checkpoint's embedding cut to its first rows).
"""
from __future__ import annotations

import os

from gspo_megatron import config as _config
from gspo_megatron.config import Config, LoadSource
from gspo_megatron.errors import ConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.family import check_inline, family_for


def load_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML file (or none: defaults) + dotted overrides -> a validated Config whose model (when
    it is not model.load's: that is read where the run is set up, train/setup.py check_inputs)
    is checked against the layout. Raises ConfigError (one line)."""
    cfg = _config.load_config(path, overrides)
    if cfg.model.load is None:
        check_model(cfg)
    return cfg


def hf_config_dict(cfg: Config, load: LoadSource | None = None) -> dict:
    """The model architecture as an HF config dict: the config a checkpoint carries (model.load's,
    else model.hf_dir's config.json), else the inline hf_config (checked key by key against its
    family's). `load`: what model.load's checkpoint holds, read by train/setup.py
    read_load_source (required when model.load is set)."""
    m = cfg.model
    configs = cfg.config_sources(load)
    if not configs:
        if m.hf_config is None:
            raise ConfigError(f"model.load: {m.load} has no hf_config/config.json (nor a Megatron-Bridge "
                              "run_config.yaml); set model.hf_config or model.hf_dir to give the architecture")
        hf = dict(m.hf_config)
        check_inline(hf, family_for(hf, "model.hf_config"), "model.hf_config")
        return hf
    opt0, path0, chosen = configs[0]
    family = family_for(chosen, f"{opt0} ({path0})")
    for opt, path, other in configs[1:]:
        for k in sorted(family.inline_keys & chosen.keys() & other.keys()):
            if other[k] != chosen[k]:
                raise ConfigError(f"{opt}: {path} has {k}={other[k]!r} but {opt0} ({path0}) has "
                                  f"{k}={chosen[k]!r}; they must describe the same model")
    for k, v in (m.hf_config or {}).items():
        if k in chosen and chosen[k] != v:
            raise ConfigError(
                f"model.hf_config.{k}={v!r} disagrees with {path0} ({k}={chosen[k]!r}); "
                f"drop the inline field or fix {opt0}"
            )
    check_inline(chosen, family, f"{opt0} ({path0})", require=False)
    return chosen


def arch_of(cfg: Config, hf: dict | None = None, load: LoadSource | None = None) -> MoeArch:
    """The run's architecture (from `hf`, else resolved from the config)."""
    hf = hf_config_dict(cfg, load) if hf is None else hf
    return family_for(hf).read_config(hf, "model")


def check_model(cfg: Config, hf: dict | None = None) -> None:
    """Layout checks that need the model but not the world size."""
    cfg.parallel.check_model(**arch_of(cfg, hf).dims_for_validation())


def validate_world(cfg: Config, world_size: int, hf: dict | None = None) -> None:
    """Check the layout against the world size and the model (ParallelConfig.validate)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    cfg.parallel.validate(world_size, **arch_of(cfg, hf).dims_for_validation())


def refuse_adapter_only(directory: str, option: str) -> None:
    """A LoRA run's checkpoint holds its adapters only: as a model to load (`option`: model.load,
    score's --load) it would leave the base unset. One ConfigError line saying what to do
    instead. `directory`: a checkpoint directory (not a root), its small files already verified."""
    if not os.path.isfile(os.path.join(directory, "common.pt")):
        return
    from gspo_megatron.checkpoint.megatron_load import load_common_state_dict
    from gspo_megatron.config import ConfigError

    common = load_common_state_dict(directory)  # the restricted unpickler (checkpoint/safe_torch.py)
    trainer = common.get("trainer") if isinstance(common, dict) else None
    lora = trainer.get("lora") if isinstance(trainer, dict) else None
    if isinstance(lora, dict):
        base = lora.get("base") or {}
        where = base.get("path") or f"the random init of seed {base.get('init_seed')}"
        raise ConfigError(f"{option}: {directory} is an adapter-only LoRA checkpoint (base: {where}); resume it "
                          f"with that base and checkpoint.resume={directory}, or merge it first (gspo-convert lora-merge)")


def read_load_source(cfg):
    """What model.load's checkpoint holds (config.py LoadSource), None without model.load: the
    torch_dist directory a Megatron-LM root stands for (its tracker's iteration, else its newest
    iter_*), its hf_config/, else the architecture Megatron-Bridge's run_config.yaml or
    Megatron-LM's run arguments give. Read here, where the run is set up, not in config.py (which
    parses and validates, and reads no checkpoint format). One ConfigError line naming the file."""
    from gspo_megatron.checkpoint.megatron_dirs import carried_config, resolve
    from gspo_megatron.config import ConfigError, LoadSource

    load = cfg.model.load
    if load is None:
        return None
    if not os.path.isdir(load):  # load_config checked it; it went away since
        raise ConfigError(f"model.load: {load} is not a directory")
    try:
        directory = resolve(load)
    except ValueError as e:  # CheckpointError: a root whose tracker names nothing usable, ...
        raise ConfigError(f"model.load: {e}") from None
    from gspo_megatron.checkpoint import integrity

    # before any of its files is parsed (hf_config/, run_config.yaml, common.pt, the tokenizer);
    # the tensor data is verified by load_mcore_into_model, split over the ranks
    integrity.verify_before_parse(directory, data=False, require=cfg.checkpoint.require_checksums)
    refuse_adapter_only(directory, "model.load")
    hf_config_dir = os.path.join(directory, "hf_config")
    if os.path.isfile(os.path.join(hf_config_dir, "config.json")):
        return LoadSource(directory, hf_config_dir=hf_config_dir)
    return LoadSource(directory, carried=carried_config(directory))
