"""Exports of a LoRA run's adapter-only checkpoints (`gspo-convert lora-to-peft` / `lora-merge`).

A LoRA run (config `lora.rank > 0`) saves only its adapters and their optimizer state
(train/checkpoint.py save, `lora=`); its common.pt records the adapters' settings and the base
they were trained on (`trainer["lora"]`, train/setup.py RunParts.lora_meta):

    {"rank", "alpha", "dropout", "target_modules", "init_seed",
     "base": {"path": <model.load or model.hf_dir, absolute>} or {"init_seed": N} (a random init)}

Both exports rebuild the policy in one process (a world-1 gloo group, Megatron's parallel state at
TP = PP = EP = 1, on CPU), put the recorded adapters on it (model/lora.py apply_lora) and load them
from the checkpoint (load_mcore_into_model, trainable_only: every file verified against the
checkpoint's checksums.json first). Then

  * lora_to_peft: the adapters in PEFT's format (model/lora.py iter_hf_adapters + save_peft:
    adapter_model.safetensors + adapter_config.json naming the base); the base's weights are not
    read (only its config, checked against the checkpoint's architecture);
  * lora_merge: the base's weights (an HF directory or an mcore checkpoint) with the adapters
    merged, W + (alpha / r) B A (model/export.py iter_hf_tensors), written as a Hugging Face
    checkpoint the way mcore-to-hf and the trainer's export write one (model/hf_writer.py).

A random-init base ({"init_seed": N}) is not rebuilt for lora_merge: Megatron's CPU random init
depends on the layout (measured on launch/configs/tiny_cpu_glm.yaml: a world-1 rebuild differs
from the same seed's TP2+SP model in 40 of 53 HF tensors - the embedding is drawn with its padding
rows, more at TP2, which shifts every later draw - and from EP2's in 16 - the second EP rank's
experts draw what the first one's do, and the shared expert and output layer come after them), so
the rebuild would be another model. It is refused in one line (the run's own `<out_dir>/hf`
export holds the merged model); lora_to_peft writes such adapters with no base model named.

Memory: the whole model in one process (the exports of a model that fits one host's memory).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from gspo_megatron.checkpoint import megatron_dirs
from gspo_megatron.errors import CheckpointError, InputError
from gspo_megatron.model.arch import MoeArch

log = logging.getLogger(__name__)

PEFT_FILES = ("adapter_model.safetensors", "adapter_config.json")


@dataclass
class LoraCheckpoint:
    directory: str  # the iteration directory (a root resolved to what its tracker names)
    meta: dict  # trainer["lora"]
    hf_config: dict  # the checkpoint's hf_config/config.json
    hf_config_path: str
    arch: MoeArch
    dtype: torch.dtype  # the stored adapters' dtype (the run's model dtype)


@dataclass
class ExportStats:
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0


def read_lora_checkpoint(path: str, require_checksums: bool = False) -> LoraCheckpoint:
    """The adapter-only checkpoint at `path` (an iteration directory or a run's checkpoints/ root):
    its LoRA settings, architecture and adapters' dtype. One CheckpointError line for anything
    else - a full-parameter checkpoint (trainer's or converted) names mcore-to-hf. The files but
    the tensor data are verified against checksums.json before they are parsed, then the data."""
    from gspo_megatron.checkpoint import integrity
    from gspo_megatron.checkpoint.dcp_io import DcpReader
    from gspo_megatron.checkpoint.mcore import check_mcore_dir, read_hf_config
    from gspo_megatron.checkpoint.megatron_load import load_common_state_dict

    ckpt = megatron_dirs.resolve(path)
    check_mcore_dir(ckpt, require_checksums)  # its files but the tensor data verified, then parsed
    # and the tensor data too, before anything is built or written (small: the adapters and their
    # optimizer state); _adapted_policy's load does not verify them again
    integrity.verify_before_parse(ckpt, data=True, require=require_checksums)
    common = load_common_state_dict(ckpt)  # the restricted unpickler (checkpoint/safe_torch.py)
    trainer = common.get("trainer") if isinstance(common, dict) else None
    meta = trainer.get("lora") if isinstance(trainer, dict) else None
    if meta is None:
        what = "a full-parameter trainer checkpoint" if isinstance(trainer, dict) else "a model checkpoint"
        raise CheckpointError(f"{ckpt}: {what} (no LoRA settings in its common.pt), not a LoRA adapter checkpoint; "
                              "convert it with gspo-convert mcore-to-hf")
    _check_meta(ckpt, meta)
    cfg, cfg_path = read_hf_config(ckpt, require_checksums)
    arch = MoeArch.from_hf_dict(cfg, source=cfg_path)
    reader = DcpReader(ckpt)
    try:
        keys = sorted(k for k in reader.tensors
                      if k.endswith((".lora_A", ".lora_B")) and not k.startswith("optimizer."))
        if not keys:
            raise CheckpointError(f"{ckpt}: its common.pt records LoRA settings but it holds no adapter tensors "
                                  "(*.lora_A / *.lora_B)")
        dtype = reader.dtype(keys[0])
    finally:
        reader.close()
    return LoraCheckpoint(ckpt, dict(meta), cfg, cfg_path, arch, dtype)


def _check_meta(ckpt: str, meta) -> None:
    from gspo_megatron.config import LORA_TARGETS

    base = meta.get("base") if isinstance(meta, dict) else None
    ok = (isinstance(meta, dict) and isinstance(meta.get("rank"), int) and meta["rank"] >= 1
          and isinstance(meta.get("alpha"), (int, float)) and isinstance(meta.get("dropout", 0.0), (int, float))
          and isinstance(meta.get("target_modules"), (list, tuple)) and meta["target_modules"]
          and all(t in LORA_TARGETS for t in meta["target_modules"])
          and isinstance(meta.get("init_seed", 0), int)
          and isinstance(base, dict) and (isinstance(base.get("path"), str) or isinstance(base.get("init_seed"), int)))
    if not ok:
        raise CheckpointError(f"{os.path.join(ckpt, 'common.pt')}: malformed LoRA settings {meta!r}")


def _spec(ck: LoraCheckpoint):
    from gspo_megatron.model.lora import LoraSpec

    m = ck.meta
    return LoraSpec(rank=m["rank"], alpha=float(m["alpha"]), dropout=float(m.get("dropout", 0.0)),
                    targets=tuple(m["target_modules"]), seed=int(m.get("init_seed", 0)))


def random_init_seed(ck: LoraCheckpoint) -> int | None:
    """model.init_seed of a random-init base, None for a checkpoint base."""
    base = ck.meta["base"]
    return None if isinstance(base.get("path"), str) else int(base["init_seed"])


def resolve_base(ck: LoraCheckpoint, base: str | None, require_checksums: bool = False) -> tuple[str, str]:
    """(kind "hf" or "mcore", absolute path) of the base: `base` (--base) or the recorded one.
    Its architecture must be the checkpoint's (one line naming the fields else); a missing path,
    or a directory that is neither checkpoint kind, is one line."""
    from gspo_megatron.checkpoint.mcore import FORMAT_FILE, read_mcore_arch

    if base is not None:
        origin = f"--base {base}"
    else:
        base = ck.meta["base"]["path"]
        origin = f"the recorded base {base} (the adapters were trained on it; pass --base where it is now)"
    if not os.path.isdir(base):
        raise InputError(f"{origin}: no such directory")
    base = os.path.abspath(base)
    if os.path.isfile(os.path.join(base, FORMAT_FILE)) or megatron_dirs.is_root(base):
        kind, arch = "mcore", read_mcore_arch(base, require_checksums)
    elif os.path.isfile(os.path.join(base, "config.json")):
        kind, arch = "hf", MoeArch.from_hf_dir(base)
    else:
        raise InputError(f"{origin}: neither a Hugging Face checkpoint (config.json) nor a Megatron torch_dist "
                         f"checkpoint ({FORMAT_FILE}, or a root with iter_* directories)")
    # as train/checkpoint.py check_architecture: max_position_embeddings only bounds the RoPE table,
    # MTP layers are never part of the policy
    diff = [f"{f.name} {getattr(ck.arch, f.name)!r} -> {getattr(arch, f.name)!r}" for f in dataclasses.fields(arch)
            if f.name not in ("max_position_embeddings", "mtp_layers")
            and getattr(arch, f.name) != getattr(ck.arch, f.name)]
    if diff:
        raise CheckpointError(f"{origin}: its architecture differs from the checkpoint's ({ck.hf_config_path}): "
                              f"{', '.join(diff)}; pass the base the adapters were trained on")
    return kind, base


@contextlib.contextmanager
def _world_of_one(seed: int):
    """Megatron's parallel state at world 1 (TP = PP = EP = 1, CPU) on a one-process gloo group of
    its own (an in-process store: no port), torn down on exit (parallel/state.py)."""
    import datetime

    import torch.distributed as dist

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or dist.is_initialized():
        raise InputError("the LoRA exports run in one process (the whole model at world 1): run gspo-convert "
                         "lora-to-peft / lora-merge without torchrun")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(minutes=30))
    try:
        # RANK / WORLD_SIZE unset or 1: init_parallel validates world 1 and keeps this group
        yield init_parallel(ParallelConfig(device="cpu", cpu_collectives="gloo"), seed=seed)
    finally:
        destroy_parallel()


def _adapted_policy(ctx, ck: LoraCheckpoint, *, base: tuple[str, str] | None, require_checksums: bool):
    """The policy with the checkpoint's adapters: the base's weights (`base`: resolve_base's
    answer) or Megatron's random init (None: the adapters alone are read)."""
    from gspo_megatron.checkpoint.mcore import load_mcore_into_model
    from gspo_megatron.model import lora
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.hf_io import HFCheckpointReader

    reader = None
    if base is not None and base[0] == "hf":
        reader = HFCheckpointReader(base[1])
        reader.validate(ck.arch)
    chunks, _ = build_policy(ctx, ck.arch, reader=reader, dtype=ck.dtype, local_spec=True)  # LoRA: Megatron's linears
    if base is not None and base[0] == "mcore":
        load_mcore_into_model(chunks, base[1], require_checksums=require_checksums)
    lora.apply_lora(chunks, _spec(ck), ep_rank=ctx.ep_rank)
    # the adapters only (the frozen base is not in the checkpoint); every file verified by read_lora_checkpoint
    load_mcore_into_model(chunks, ck.directory, require_checksums=require_checksums, verify_data=False,
                          trainable_only=True)
    return chunks


def lora_to_peft(load: str, out_dir: str, *, base: str | None = None, dtype: torch.dtype | None = None,
                 overwrite: bool = False, require_checksums: bool = False) -> ExportStats:
    """The adapters of the LoRA checkpoint `load` as a PEFT adapter folder at `out_dir`
    (adapter_model.safetensors in HF names + adapter_config.json, whose base_model_name_or_path is
    the base's absolute path: `base`, else the recorded one). `dtype`: of the written tensors
    (default: the stored adapters'). Assembled in a temporary folder beside `out_dir`, renamed
    into place at the end; an existing `out_dir` is replaced only with `overwrite`, and only an
    earlier output of the same command (fsutil)."""
    from gspo_megatron.checkpoint import atomic
    from gspo_megatron.fsutil import current_command, discard, make_tmp, publish
    from gspo_megatron.model import lora

    t0 = time.monotonic()
    ck = read_lora_checkpoint(load, require_checksums)
    command = current_command() or "lora-to-peft"
    if base is None and random_init_seed(ck) is not None:
        base_path = None
        log.warning("%s was trained on a random-init base (model.init_seed=%d), which has no checkpoint: "
                    "adapter_config.json names no base model", ck.directory, random_init_seed(ck))
    else:
        base_path = resolve_base(ck, base, require_checksums)[1]  # checked, not read
    out_dir = atomic.check_target(out_dir, overwrite, command=command)
    with _world_of_one(int(ck.meta.get("init_seed", 0))) as ctx:
        chunks = _adapted_policy(ctx, ck, base=None, require_checksums=require_checksums)
        tensors = {k: v.to(dtype or ck.dtype) for k, v in lora.iter_hf_adapters(chunks, ctx, ck.arch)}
    tmp = make_tmp(out_dir)
    try:
        staged = lora.save_peft(os.path.join(tmp, "adapter"), tensors, _spec(ck), base_model=base_path)
        for f in PEFT_FILES:
            os.replace(os.path.join(staged, f), os.path.join(tmp, f))
        os.rmdir(staged)
        publish(tmp, out_dir, overwrite=overwrite, command=command)
    except BaseException:
        discard(tmp)
        raise
    nbytes = os.path.getsize(os.path.join(out_dir, PEFT_FILES[0]))
    return ExportStats(len(tensors), nbytes, time.monotonic() - t0)


def lora_merge(load: str, out_dir: str, *, base: str | None = None, dtype: torch.dtype | None = None,
               max_shard_size: str | int | None = None, overwrite: bool = False, require_checksums: bool = False,
               progress: bool = False) -> ExportStats:
    """The base with the adapters of the LoRA checkpoint `load` merged (W + (alpha / r) B A) as a
    Hugging Face checkpoint at `out_dir`: safetensors shards + index, the checkpoint's
    hf_config/config.json and the side files beside it (generation config, tokenizer), its
    carried MTP tensors if any. The base: `base` (an HF directory or an mcore checkpoint), else
    the recorded one; a random-init base is refused (module docstring). `dtype`: of the written
    tensors (default: the stored adapters', the run's model dtype, as the trainer's export)."""
    from gspo_megatron.checkpoint import atomic, carried
    from gspo_megatron.fsutil import current_command
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.model.hf_writer import DEFAULT_MAX_SHARD_BYTES, save_hf_checkpoint

    t0 = time.monotonic()
    ck = read_lora_checkpoint(load, require_checksums)
    command = current_command() or "lora-merge"
    seed = random_init_seed(ck)
    if base is None and seed is not None:
        raise CheckpointError(
            f"{ck.directory}: its adapters were trained on a random-init base (model.init_seed={seed}), which cannot "
            "be rebuilt here: Megatron's random init differs with the layout (vocab padding, EP), so a world-1 rebuild "
            "is another model; the run's own export (<out_dir>/hf, checkpoint.export_hf=true) holds the merged model")
    kind_path = resolve_base(ck, base, require_checksums)
    out_dir = atomic.check_target(out_dir, overwrite, command=command)
    mtp = carried.from_checkpoint(ck.directory, ck.arch)
    with _world_of_one(int(ck.meta.get("init_seed", 0))) as ctx:
        chunks = _adapted_policy(ctx, ck, base=kind_path, require_checksums=require_checksums)
        names = []

        def stream():
            for name, t in iter_hf_tensors(chunks, ctx, ck.arch):
                names.append(name)
                yield name, t
        nbytes = save_hf_checkpoint(stream(), out_dir, ck.hf_config, dtype=dtype or ck.dtype,
                                    max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_BYTES,
                                    copy_from=os.path.dirname(ck.hf_config_path), progress=progress,
                                    command=command, carried=mtp.tensors() if mtp else ())
    return ExportStats(len(names), nbytes, time.monotonic() - t0)

