"""The Megatron-LM / Megatron-Bridge checkpoint conventions around a torch_dist directory.

A Megatron-LM checkpoint root (Megatron-Bridge 0.3.1 writes the same) is

    ROOT/latest_checkpointed_iteration.txt   "<N>" or "release"
    ROOT/iter_<N:07d>/  or  ROOT/release/      the torch_dist directory (metadata.json, .metadata,
                                               __*.distcp, common.pt), plus Bridge's
                                               run_config.yaml (its ConfigContainer; `model:` is
                                               the model provider's fields)
    ROOT/latest_train_state.pt                 Bridge's own tracker (+ iter_<N>/train_state.pt)

`gspo-convert hf-to-mcore` writes a converted model as iteration 0, as Bridge's
`save_megatron_model` does (training/checkpointing.py:731-766: iter_0000000/, the tracker "0",
latest_train_state.pt): `AutoBridge.load_megatron_model(ROOT)` takes only the newest iter_*
directory (auto_bridge.py:662-675, the tracker unread), so a root holding just release/ fails
there. Megatron-LM reads the tracker "0" since core_v0.16.0 (Megatron-LM PR #2199,
training/checkpointing.py read_metadata: `assert iteration > -1 or release`); Bridge 0.3.1's own
copy of that reader still refuses 0 (checkpointing.py:253), but its training loader reads
latest_train_state.pt first (checkpointing.py:1977-1989), which is why that file is written too.
Roots of earlier converter versions (release/ + "release") are still read.

What this module gives the project's readers and writers:

* `resolve(path)`: the torch_dist directory of a root (tracker, else the newest iter_*), of an
  iteration directory, or of a flat directory (the project's older converter output).
* `carried_config(dir)`: an HF config dict (the family's table: model/families/*/bridge.py) from Bridge's run_config.yaml
  (`yaml.safe_load`; hydra `_target_` entries are read as data, never instantiated), else from the
  run arguments Megatron-LM keeps in common.pt (the restricted unpickler of checkpoint/safe_torch.py,
  allowing only argparse.Namespace and Megatron-Core enums beside tensors and plain data).
* `write_run_config(dir, arch)`: the run_config.yaml (the family's `bridge_run_config`) the project writes next to its tensors, so that
  Bridge's `AutoBridge.load_megatron_model` (training/model_load_save.py:213-227: instantiates
  run_config["model"]) and its training loader (training/checkpointing.py:1451-1509) accept them.
* `extra_state_objects(arch)`: the `_extra_state` entries Megatron's Transformer Engine layers
  ask a checkpoint for. Bridge's default load strictness ("assume_ok_unexpected",
  training/checkpointing.py:1237-1246) hands every requested key to PyTorch DCP, which fails on a
  missing one ("Missing key in checkpoint state_dict: ...linear_proj._extra_state/shard_0_2");
  Bridge drops their values after loading (:1286-1288). We store each as `torch.save([None])`, what
  Megatron writes for a module with no extra state (dist_checkpointing/strategies/torch.py:320-325);
  TE loads None as "no FP8 metadata". The set covers the linear layers and the experts (what a
  Bridge model requests on CPU, verified) and TE's norms (q/k/pre-MLP/final: TE >= 2 norms keep
  extra state; unverified here, no TE): a stored key nobody requests is ignored by DCP.
* `CONTENT_METADATA`: what Bridge's training loader reads from common.pt (checkpointing.py:1544).
"""
from __future__ import annotations

import os
import re

from gspo_megatron.checkpoint.layout import per_layer_keys
from gspo_megatron.errors import CheckpointError, ModelConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.family import DEFAULT_MODEL_TYPE, FAMILY_MODULES, family_of_type

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM training/checkpointing.py get_checkpoint_tracker_filename
RELEASE = "release"
# The iteration a converted model is written as (not a trained step; see the module docstring)
CONVERTED_ITERATION = 0
# Megatron-Bridge's tracker and per-iteration train state (training/utils/checkpoint_utils.py:32-33)
BRIDGE_TRAIN_STATE = "train_state.pt"
BRIDGE_LATEST_TRAIN_STATE = "latest_train_state.pt"
RUN_CONFIG = "run_config.yaml"
FORMAT_FILE = "metadata.json"
# megatron/bridge/training/checkpointing.py _build_sharded_state_dict_metadata (singleton_local_shards:
# experts stacked as [layers, experts], not one key per expert; chained_optim_avoid_prefix: the
# optimizer keys do not depend on how many optimizers are chained - the project's own choice too)
CONTENT_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
_ITER = re.compile(r"^iter_(\d{7,})$")


def iter_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def write_tracker(root: str, iteration: int | str) -> None:
    """ROOT/latest_checkpointed_iteration.txt, replaced atomically (temp file + rename)."""
    tmp = os.path.join(root, TRACKER + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def write_bridge_train_state(root: str, ckpt_dir: str, iteration: int) -> None:
    """Megatron-Bridge's train state for a checkpoint at `iteration` with nothing trained:
    ckpt_dir/train_state.pt and ROOT/latest_train_state.pt, TrainState.state_dict() of Bridge
    0.3.1 (training/state.py:56-76; the FLOP count a float32 as its save writes it,
    checkpointing.py:750-752). A dict of tensors only (checkpoint/safe_torch.py reads it).
    Our readers never read it (the Megatron-LM tracker names the iteration)."""
    import torch

    zero = torch.tensor(0, dtype=torch.int32)
    state = {"step": torch.tensor(iteration, dtype=torch.int32), "consumed_train_samples": zero.clone(),
             "skipped_train_samples": zero.clone(), "consumed_valid_samples": zero.clone(),
             "floating_point_operations_so_far": torch.tensor(0, dtype=torch.float32),
             "do_train": torch.tensor(False), "do_valid": torch.tensor(False), "do_test": torch.tensor(False)}
    torch.save(state, os.path.join(ckpt_dir, BRIDGE_TRAIN_STATE))
    torch.save(state, os.path.join(root, BRIDGE_LATEST_TRAIN_STATE))


def read_tracker(root: str) -> str | None:
    """The iteration directory name the tracker names (None without a tracker)."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        raw = f.read(4096)
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: not UTF-8 text (expected an iteration number or 'release')") from None
    if text == RELEASE:
        return RELEASE
    try:
        return iter_name(int(text))
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number or 'release', got {text[:40]!r}") from None


def iterations(root: str) -> list[str]:
    """The iter_* directories of a root, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted((d for d in os.listdir(root) if _ITER.match(d)), key=lambda d: int(_ITER.match(d).group(1)))


def is_root(path: str) -> bool:
    """A Megatron-LM root (a tracker or iter_* directories, no torch_dist files of its own)?"""
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, FORMAT_FILE))
            and (os.path.isfile(os.path.join(path, TRACKER)) or bool(iterations(path))))


def resolve(path: str) -> str:
    """The torch_dist directory `path` stands for: itself when it holds metadata.json; for a
    Megatron-LM root, the directory its tracker names, else its newest iter_*. One-line errors."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory")
    if os.path.isfile(os.path.join(path, FORMAT_FILE)):
        return path
    name = read_tracker(path)
    if name is not None:
        d = os.path.join(path, name)
        if not os.path.isfile(os.path.join(d, FORMAT_FILE)):
            raise CheckpointError(f"{os.path.join(path, TRACKER)} names {name}, but {d} is not a torch_dist "
                                  f"checkpoint (no {FORMAT_FILE})")
        return d
    its = iterations(path)
    if its:
        return os.path.join(path, its[-1])
    hint = " (it looks like a Hugging Face checkpoint directory)" \
        if os.path.isfile(os.path.join(path, "config.json")) else ""
    raise CheckpointError(f"{path}: not a Megatron torch_dist checkpoint (no {FORMAT_FILE}, no {TRACKER}, "
                          f"no iter_* directory){hint}")


# ----------------------------------------------------------------------------------------------
# run_config.yaml (Megatron-Bridge)



def carried_config(ckpt_dir: str, require_checksums: bool = False) -> tuple[dict, str] | None:
    """The HF config a checkpoint written by Megatron-Bridge (run_config.yaml) or Megatron-LM
    (the arguments in common.pt) carries, with its source; None when it carries neither. The
    folder's files are verified against its checksums.json before they are parsed."""
    from gspo_megatron.checkpoint import integrity

    integrity.verify_before_parse(ckpt_dir, data=False, require=require_checksums)
    return hf_config_from_run_config(ckpt_dir) or hf_config_from_megatron_lm_args(ckpt_dir)


def hf_config_from_run_config(ckpt_dir: str) -> tuple[dict, str] | None:
    """(HF config dict, source path) from ckpt_dir/run_config.yaml; None without one. The family is
    the one whose Megatron-Bridge provider `model._target_` names (the default family's reader
    decides for a provider no family claims, and names the field that differs)."""
    import yaml

    path = os.path.join(ckpt_dir, RUN_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            run = yaml.safe_load(f)  # data only: no tags that construct Python objects
    except UnicodeDecodeError as e:
        raise ModelConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise ModelConfigError(f"{path}: invalid YAML ({str(e).splitlines()[0]})") from None
    m = run.get("model") if isinstance(run, dict) else None
    if not isinstance(m, dict):
        raise ModelConfigError(f"{path}: no `model:` section")
    families = [family_of_type(t) for t in FAMILY_MODULES]
    family = next((f for f in families if f.bridge_provider() and f.bridge_provider() == m.get("_target_")), None)
    known = family is not None
    family = family or family_of_type(DEFAULT_MODEL_TYPE)
    return family.hf_from_provider_fields(m, path, "model.", provider_defaults=known), path


# Megatron-LM's argument names (megatron/training/arguments.py) -> the provider field names above
_MLM_ARGS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "ffn_hidden_size",
             "num_attention_heads": "num_attention_heads", "kv_channels": "kv_channels",
             "num_experts": "num_moe_experts", "moe_router_topk": "moe_router_topk",
             "moe_ffn_hidden_size": "moe_ffn_hidden_size", "moe_router_pre_softmax": "moe_router_pre_softmax",
             "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
             "moe_layer_freq": "moe_layer_freq", "norm_epsilon": "layernorm_epsilon", "rotary_base": "rotary_base",
             "qk_layernorm": "qk_layernorm", "normalization": "normalization", "add_bias_linear": "add_bias_linear",
             "add_qkv_bias": "add_qkv_bias", "position_embedding_type": "position_embedding_type",
             "swiglu": "gated_linear_unit", "max_position_embeddings": "max_position_embeddings",
             "seq_length": "seq_length"}


def hf_config_from_megatron_lm_args(ckpt_dir: str) -> tuple[dict, str] | None:
    """(HF config, source) from the run arguments Megatron-LM stores in common.pt ("args", an
    argparse.Namespace); None when there are none. Read with the restricted unpickler
    (safe_torch.py): only argparse.Namespace and Megatron-Core's enums (e.g. AttnBackend) are
    rebuilt beside tensors and plain data, so nothing in the file can run code; anything else is a
    one-line error."""
    from gspo_megatron.checkpoint.megatron_load import torch_load_common

    path = os.path.join(ckpt_dir, "common.pt")
    if not os.path.isfile(path):
        return None
    try:
        common = torch_load_common(path)
    except CheckpointError as e:
        raise ModelConfigError(f"{e}; pass --hf-config-dir / model.hf_dir") from None
    args = common.get("args") if isinstance(common, dict) else None
    if args is None:
        return None
    a = vars(args)
    m = {new: a[old] for old, new in _MLM_ARGS.items() if old in a}
    m["num_query_groups"] = a.get("num_query_groups") if a.get("group_query_attention") else None
    m["share_embeddings_and_output_weights"] = not a.get("untie_embeddings_and_output_weights", False)
    m["vocab_size"] = a.get("vocab_size") or a.get("padded_vocab_size")
    m["activation_func"] = "torch.nn.functional.silu" if a.get("swiglu") else a.get("activation_func", "gelu")
    dtype = a.get("params_dtype")
    m["params_dtype"] = str(dtype) if dtype is not None else ("torch.bfloat16" if a.get("bf16") else "torch.float32")
    # Megatron-LM's arguments name no model class: the default family's reader decides
    return family_of_type(DEFAULT_MODEL_TYPE).hf_from_provider_fields(m, path, "args.", provider_defaults=False), path


def write_run_config(ckpt_dir: str, arch: MoeArch, dtype: str = "bfloat16") -> None:
    """Megatron-Bridge's run_config.yaml for `arch`, when its family has a Bridge table (else none:
    the checkpoint's hf_config/ is what every reader here uses)."""
    import yaml

    run_config = arch.family.bridge_run_config(arch, dtype)
    if run_config is None:
        return

    with open(os.path.join(ckpt_dir, RUN_CONFIG), "w") as f:
        f.write("# Megatron-Bridge run config (the model provider and checkpoint fields its loaders read),\n"
                "# written by gspo-megatron; its own readers take the architecture from hf_config/.\n")
        yaml.safe_dump(run_config, f, sort_keys=False)


# ----------------------------------------------------------------------------------------------
# _extra_state entries


def _extra_state_modules(arch: MoeArch, layer: int) -> tuple[list[str], list[str]]:
    """The TE modules of decoder layer `layer` that keep an `_extra_state`: (per layer, per
    expert), as the family's rules declare them (mapping.Rule.extra_state)."""
    per_layer: dict[str, None] = {}
    per_expert: dict[str, None] = {}
    for r in arch.family.rules(arch):
        if r.extra_state_in_layer(arch, layer):
            (per_expert if r.kind.is_expert else per_layer).setdefault(r.extra_state)
    return list(per_layer), list(per_expert)


def extra_state_objects(arch: MoeArch) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(key, global shape, global offset) of every `_extra_state` entry: in the stacked layout
    ([layers] or [layers, experts]), or keyed per layer where dense and MoE layers mix
    (layout.per_layer_keys: shape (1,), experts [experts]); a model-level norm has shape (1,)."""
    L, E = arch.num_layers, arch.num_experts
    out: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
    if not per_layer_keys(arch):  # every layer alike: layer 0's modules, stacked
        mods, experts = _extra_state_modules(arch, 0)
        out += [(f"decoder.layers.{m}._extra_state", (L,), (i,)) for m in mods for i in range(L)]
        out += [(f"decoder.layers.{m}._extra_state", (L, E), (i, e)) for m in experts for i in range(L)
                for e in range(E)]
    else:
        for i in range(L):
            p = f"decoder.layers.{i}."
            mods, experts = _extra_state_modules(arch, i)
            out += [(f"{p}{m}._extra_state", (E,), (e,)) for m in experts for e in range(E)]
            out += [(f"{p}{m}._extra_state", (1,), (0,)) for m in mods]
    out.append(("decoder.final_layernorm._extra_state", (1,), (0,)))
    return out


def dcp_key(key: str, shape: tuple[int, ...], offset: tuple[int, ...]) -> str:
    """Megatron's ShardedObject.unique_key (dist_checkpointing/mapping.py): the DCP key it is stored under."""
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def extra_state_entries(arch: MoeArch) -> dict[str, bytes]:
    """DCP key -> stored bytes of every `_extra_state` entry (for dcp_io.save_chunks)."""
    data = extra_state_bytes()
    return {dcp_key(*x): data for x in extra_state_objects(arch)}


def extra_state_bytes() -> bytes:
    """What Megatron stores for a module whose extra state is None: torch.save([None])."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save([None], buf)
    return buf.getvalue()
