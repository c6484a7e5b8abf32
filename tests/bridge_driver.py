"""Run Megatron-Bridge 0.3.1 on CPU against a checkpoint, for the interop tests.

Run as a subprocess, never imported by pytest (it installs process-wide stand-ins for Transformer
Engine, triton, ModelOpt and CUDA RNG calls):

    OMP_NUM_THREADS=1 PYTHONPATH=<bridge site dir>:<repo root> python tests/bridge_driver.py save \
        --hf HF_DIR --out ROOT
    ... python tests/bridge_driver.py load --hf HF_DIR --ckpt PATH --loader lowlevel|training|highlevel \
        [--ckpt PATH --loader ... ...]

with the site dir from tests/bridge_env.py:bridge_pythonpath().

save   Bridge imports the HF Qwen3-MoE in HF_DIR (Bridge's own HF->Megatron conversion) and writes it
       with AutoBridge.save_megatron_model to ROOT (Bridge's layout: iter_0000000/,
       latest_checkpointed_iteration.txt, latest_train_state.pt, run_config.yaml in the iter dir).
       Prints {"saved": ROOT, "keys": [sorted tensor keys of the checkpoint's .metadata]}.
load   Builds a randomly initialised Bridge model from HF_DIR's config, loads PATH into it with one
       of Bridge's three loaders, all with their default strictness:
         lowlevel   training.checkpointing._load_model_weights_from_checkpoint(iter dir, model);
                    PATH is the iter dir (holds metadata.json) or a Megatron-LM root whose
                    latest_checkpointed_iteration.txt names it ("release" or an iteration)
         training   training.checkpointing.load_checkpoint with CheckpointConfig(load=PATH,
                    finetune=True, load_optim=False, load_rng=False): the fine-tune-from-
                    pretrained path; PATH is the root
         highlevel  AutoBridge.load_megatron_model(PATH): Bridge builds the model itself from the
                    checkpoint's run_config.yaml (made CPU-buildable, see _cpu_model_config)
       and compares every tensor of the loaded model's state_dict with a model Bridge builds from
       HF_DIR with load_weights=True. Prints {"loader", "tensors": n compared, "differ": [...],
       "missing": [...], "pre_mlp_norm_key": the checkpoint key the MoE pre-MLP norm was read from}.
       Several --ckpt/--loader pairs load in turn in this one process (one Bridge import, one
       reference model, a fresh model per load: the interop test's loads cost one start-up, not
       five) and print {"loads": [one result per pair]}; a pair whose load raises gets
       {"loader", "ckpt", "error": "<ExceptionType>: <message>"} and the next pair still runs.

Exit status: 0 success (load: every tensor equal, none missing, n > 0, no pair raised); 1 load
compared but found a difference or a missing tensor, or a pair of several raised (the JSON line is
still printed); 2 any other exception (one line "<ExceptionType>: <first 500 characters of the
message>"; traceback on stderr). The highlevel loader does build a CPU model here, so the status 3
reserved for "not feasible" is never used.

stdout carries only the result line: Bridge and Megatron print progress with print() on rank 0, so
the process's stdout is redirected to stderr while they run.

Bridge citations are `file:line` under megatron/bridge/ of megatron-bridge 0.3.1; Megatron-Core ones
under megatron/core/ of megatron-core 0.16.1.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import json
import os
import sys
import traceback
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

LOCAL_PRE_MLP_KEY = "decoder.layers.mlp.linear_fc1.layer_norm_weight"
TE_PRE_MLP_KEY = "decoder.layers.pre_mlp_layernorm.weight"
TRACKER = "latest_checkpointed_iteration.txt"
SEED = 1234

EXIT_OK, EXIT_DIFFER, EXIT_ERROR = 0, 1, 2


# ----------------------------------------------------------------------------------------------
# CPU shim: what Bridge needs to import and run without Transformer Engine / CUDA
# ----------------------------------------------------------------------------------------------


class _StandIn:
    """Any TE class: constructible, callable, subclassable (`class TELinearAdapter(te.Linear)`)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return None


class _StandInModule(types.ModuleType):
    """A package whose every public attribute is a fresh stand-in class."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (_StandIn,), {})
        setattr(self, name, cls)
        return cls


def _stand_in_package(name: str) -> types.ModuleType:
    mod = _StandInModule(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    mod.__path__ = []  # a package: `import a.b` finds a.b in sys.modules
    mod.__version__ = "0.0.0+stand-in"
    sys.modules[name] = mod
    parent, _, leaf = name.rpartition(".")
    if parent in sys.modules:
        setattr(sys.modules[parent], leaf, mod)
    return mod


def _absent(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return True
    return False


_shim_installed = False


def install_shim() -> None:
    """Call before importing megatron.bridge."""
    global _shim_installed
    if _shim_installed:
        return
    _shim_installed = True
    import torch

    # 1. Megatron-Core modules that probe `import transformer_engine` / `import triton` at import
    #    time go first, while those packages are really absent: their HAVE_TE / HAVE_TRITON stay
    #    False and they keep the local / torch fallbacks.
    for name in ("megatron.core", "megatron.core.extensions", "megatron.core.extensions.transformer_engine",
                 "megatron.core.utils", "megatron.core.tensor_parallel", "megatron.core.optimizer",
                 "megatron.core.dist_checkpointing", "megatron.core.fusions.fused_bias_dropout",
                 "megatron.core.fusions.fused_indices_converter", "megatron.core.transformer.moe.experts",
                 "megatron.core.transformer.transformer_layer", "megatron.core.models.gpt",
                 "megatron.core.models.gpt.gpt_layer_specs"):
        with contextlib.suppress(ImportError):
            __import__(name)

    # 2. Bridge imports TE unconditionally (peft/lora_layers.py:20, peft/lora.py:21, reached from
    #    megatron.bridge.__init__ via auto_bridge -> model_bridge -> peft_bridge) and subclasses its
    #    classes. Stand-ins satisfy that; Bridge modules that probe TE then believe it is there, so
    #    the model must be built with the local spec explicitly (_cpu_provider_fields).
    if _absent("transformer_engine"):
        for sub in ("", ".pytorch", ".pytorch.optimizers", ".pytorch.ops", ".pytorch.float8_tensor",
                    ".pytorch.tensor", ".pytorch.distributed", ".pytorch.fp8", ".pytorch.module",
                    ".pytorch.cpp_extensions", ".pytorch.attention", ".common", ".common.recipe"):
            _stand_in_package("transformer_engine" + sub)
        sys.modules["transformer_engine.pytorch.optimizers"].multi_tensor_applier = None

    # 3. Bridge's Mamba provider (models/mamba/mamba_provider.py, imported by megatron.bridge)
    #    reaches megatron.core.inference code that does a top-level `import triton` and decorates
    #    kernels; identity decorators suffice, the kernels never run.
    if _absent("triton"):
        triton = _stand_in_package("triton")
        triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
        triton.autotune = lambda *a, **kw: (lambda f: f)
        triton.heuristics = lambda *a, **kw: (lambda f: f)
        _stand_in_package("triton.language")

    # 4. training/checkpointing.py:53-57 imports ModelOpt's state save/restore at module level (every
    #    save and load path imports that module). They act only on ModelOpt-quantized models.
    if _absent("modelopt.torch.opt.plugins"):
        for name in ("modelopt", "modelopt.torch", "modelopt.torch.opt", "modelopt.torch.opt.plugins"):
            _stand_in_package(name)
        plugins = sys.modules["modelopt.torch.opt.plugins"]
        for fn in ("restore_modelopt_state", "save_modelopt_state", "save_sharded_modelopt_state",
                   "restore_sharded_modelopt_state"):
            setattr(plugins, fn, lambda *a, **kw: None)

    # 5. training/state.py:28 imports torch.utils.tensorboard.writer, which needs `tensorboard`.
    if _absent("tensorboard"):
        _stand_in_package("torch.utils.tensorboard")
        _stand_in_package("torch.utils.tensorboard.writer")

    # 6. CUDA calls on paths that have no CPU branch: the RNG seeding of model building, the
    #    torch_dist writer (core/dist_checkpointing/strategies/filesystem_async.py:230
    #    torch.cuda.synchronize(); strategies/state_dict_saver.py:252 a tensor on
    #    torch.cuda.current_device()).
    torch.cuda.manual_seed = lambda *a, **kw: None
    torch.cuda.manual_seed_all = lambda *a, **kw: None
    torch.cuda.get_rng_state = lambda *a, **kw: torch.get_rng_state()
    torch.cuda.get_rng_state_all = lambda *a, **kw: [torch.get_rng_state()]
    torch.cuda.set_rng_state = lambda *a, **kw: None
    torch.cuda.set_rng_state_all = lambda *a, **kw: None
    torch.cuda.synchronize = lambda *a, **kw: None
    torch.cuda.current_device = lambda *a, **kw: "cpu"

    # 7. Megatron's CUDA RNG tracker (core/tensor_parallel/random.py) keeps CUDA generator states
    #    and forks into them during weight init: keep CPU states instead, fork without switching
    #    (weights are initialised with use_cpu_initialization, from the CPU generator).
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self.seeds_.add(seed)
            self.states_[name] = torch.get_rng_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            yield

    def cpu_model_parallel_seed(seed, *args, **kwargs):
        torch.manual_seed(seed)
        tracker = mrandom._CUDA_RNG_STATE_TRACKER
        tracker.reset()
        for name in (mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                     mrandom._DATA_PARALLEL_RNG_TRACKER_NAME):
            tracker.add(name, seed)

    mrandom._set_cuda_rng_state = lambda *a, **kw: None
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom.initialize_rng_tracker = lambda *a, **kw: None
    mrandom.model_parallel_cuda_manual_seed = cpu_model_parallel_seed
    tensor_parallel.model_parallel_cuda_manual_seed = cpu_model_parallel_seed  # re-exported name


def _patch_read_metadata() -> None:
    """Bridge's Megatron-LM tracker reader all-reduces the iteration in a tensor it creates with
    device="cuda" whenever torch.distributed is initialized (training/checkpointing.py:226-278,
    the tensor at :257). With one rank there is nothing to reduce: run it as if undistributed."""
    import torch.distributed as dist

    import megatron.bridge.training.checkpointing as ckpt

    original = ckpt.read_metadata

    def read_metadata(tracker_filename):
        is_initialized = dist.is_initialized
        dist.is_initialized = lambda: False
        try:
            return original(tracker_filename)
        finally:
            dist.is_initialized = is_initialized

    ckpt.read_metadata = read_metadata


# ----------------------------------------------------------------------------------------------
# One gloo rank
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def world_of_one():
    """gloo, world size 1, Megatron's parallel state (all sizes 1) and seeded RNG; torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    # The store binds port 0 itself, i.e. a port the OS knows to be free, with no window in which
    # another process could take it (as there would be between probing a port and binding it).
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(SEED)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# Bridge models on CPU
# ----------------------------------------------------------------------------------------------


def _cpu_provider_fields(provider) -> None:
    """Make a Bridge GPT provider build a CPU model. The defaults assume TE and CUDA."""
    import torch
    from megatron.bridge.models.gpt_provider import local_layer_spec

    # default_layer_spec -> TE spec (gpt_provider.py:116-121); the local spec (:79) is torch only
    provider.transformer_layer_spec = local_layer_spec
    provider.moe_grouped_gemm = False  # local spec + grouped GEMM = legacy GroupedMLP; SequentialMLP
    provider.moe_permute_fusion = False  # TE fused permute (core transformer_config.py:1834)
    # the alltoall dispatcher creates a torch.cuda.Stream (core moe/token_dispatcher.py:445)
    provider.moe_token_dispatcher_type = "allgather"
    provider.gradient_accumulation_fusion = False
    provider.bias_activation_fusion = False
    provider.masked_softmax_fusion = False
    provider.persist_layer_norm = False
    provider.apply_rope_fusion = False
    provider.bf16 = False
    provider.fp16 = False
    provider.params_dtype = torch.float32
    provider.pipeline_dtype = torch.float32
    provider.autocast_dtype = torch.float32


def _bridge(hf_dir: str):
    import torch
    from megatron.bridge import AutoBridge

    return AutoBridge.from_hf_pretrained(hf_dir, torch_dtype=torch.float32)  # auto_bridge.py:194


def cpu_provider(bridge, load_weights: bool):
    """A finalized CPU provider for the bridge's HF config: its models get Bridge's HF->Megatron
    conversion of the HF weights (load_weights=True registers it as a pre-wrap hook,
    auto_bridge.py:829-870), or random initialisation."""
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    _cpu_provider_fields(provider)
    if not load_weights:
        provider.perform_initialization = True
    provider.finalize()
    return provider


def build_model(provider) -> list:
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


@contextlib.contextmanager
def _cpu_model_config():
    """highlevel: AutoBridge.load_megatron_model builds the model from the provider that
    model_load_save.load_model_config instantiates from run_config.yaml (model_load_save.py:188-231,
    called by load_megatron_model at :346). A GPU run's config names the TE spec, grouped GEMM,
    alltoall, bf16: apply the CPU fields to that provider before Bridge builds from it."""
    from megatron.bridge.training import model_load_save

    original = model_load_save.load_model_config

    def load_model_config(checkpoint_path):
        model_cfg, mlm_args = original(checkpoint_path)
        _cpu_provider_fields(model_cfg)
        return model_cfg, mlm_args

    model_load_save.load_model_config = load_model_config
    try:
        yield
    finally:
        model_load_save.load_model_config = original


# ----------------------------------------------------------------------------------------------
# The MoE pre-MLP norm's checkpoint key
# ----------------------------------------------------------------------------------------------
# Megatron's local spec declares sharded_state_dict_keys_map {"pre_mlp_layernorm.":
# "mlp.linear_fc1.layer_norm_"} (core models/gpt/gpt_layer_specs.py:417-420, in
# get_gpt_layer_local_spec) so that a dense local model's checkpoint matches the TE spec, whose
# linear_fc1 fuses that norm; the map is applied to MoE layers too, where TE keeps a separate norm. So a CPU Bridge model asks the checkpoint for the pre-MLP norm under
# decoder.layers.mlp.linear_fc1.layer_norm_weight, while a TE Bridge model (what Bridge builds on
# a GPU, gpt_provider.py:50-62) asks for decoder.layers.pre_mlp_layernorm.weight and every
# checkpoint written from a TE model stores that name. To load such a checkpoint as Bridge on a GPU
# would, the CPU model requests the TE name; a checkpoint Bridge wrote on CPU only has the local
# name, which is then requested unchanged. Only the ShardedTensor's key (where to read) changes,
# not the state-dict key it fills, so Bridge's loaders put the tensor into the same parameter.


def checkpoint_tensor_keys(ckpt_dir: Path) -> set[str]:
    """Tensor keys of a torch_dist checkpoint's .metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    return {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


def pre_mlp_norm_key(ckpt_dir: Path | None) -> str:
    """The TE name if the checkpoint has it, else the local-spec name."""
    if ckpt_dir is not None and (ckpt_dir / ".metadata").is_file():
        if TE_PRE_MLP_KEY in checkpoint_tensor_keys(ckpt_dir):
            return TE_PRE_MLP_KEY
    return LOCAL_PRE_MLP_KEY


@contextlib.contextmanager
def request_pre_mlp_norm_as(key: str):
    """While active, GPTModel.sharded_state_dict (what every Bridge loader asks the model for,
    training/checkpointing.py:1103) requests the local-spec pre-MLP norm under `key`."""
    if key == LOCAL_PRE_MLP_KEY:
        yield
        return
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = GPTModel.__dict__["sharded_state_dict"]

    def sharded_state_dict(self, *args, **kwargs):
        sharded = original(self, *args, **kwargs)
        for value in nested_values(sharded):
            if isinstance(value, ShardedTensor) and value.key == LOCAL_PRE_MLP_KEY:
                value.key = key
        return sharded

    GPTModel.sharded_state_dict = sharded_state_dict
    try:
        yield
    finally:
        GPTModel.sharded_state_dict = original


# ----------------------------------------------------------------------------------------------
# Checkpoint directories
# ----------------------------------------------------------------------------------------------


def tracked_dir(root: Path) -> Path | None:
    """The directory a Megatron-LM tracker names: "release" -> root/release, N -> root/iter_{N:07d}."""
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        return root / "release"
    try:
        return root / f"iter_{int(text):07d}"
    except ValueError:
        raise ValueError(f"{tracker}: expected 'release' or an iteration, found {text!r}") from None


def lowlevel_dir(path: Path) -> Path:
    """The directory holding metadata.json that _load_model_weights_from_checkpoint wants
    (training/checkpointing.py:1232; it reads no tracker itself)."""
    if (path / "metadata.json").is_file():
        return path
    found = tracked_dir(path)
    if found is None:
        raise FileNotFoundError(f"{path}: neither a checkpoint directory (metadata.json) nor a root "
                                f"with {TRACKER}")
    return found


def read_dir(path: Path, loader: str) -> Path | None:
    """Where `loader` will read tensors from (to choose the pre-MLP key), or None if unknown. (The
    training loader prefers latest_train_state.pt over the Megatron-LM tracker,
    training/checkpointing.py:1977-1989; Bridge writes both with the same iteration.)"""
    if (path / "metadata.json").is_file():
        return path
    if loader == "highlevel":  # the largest iter_* (auto_bridge.py:662-675), the tracker is not read
        iters = [p for p in path.glob("iter_*") if p.is_dir() and p.name[5:].isdigit()]
        return max(iters, key=lambda p: int(p.name[5:])) if iters else None
    with contextlib.suppress(ValueError):
        return tracked_dir(path)
    return None


# ----------------------------------------------------------------------------------------------
# Subcommands
# ----------------------------------------------------------------------------------------------


def cmd_save(args) -> tuple[dict, int]:
    bridge = _bridge(args.hf)
    model = build_model(cpu_provider(bridge, load_weights=True))
    # model_load_save.py:405 -> training/checkpointing.py save_checkpoint at iteration 0,
    # torch_dist, no optimizer / RNG state
    bridge.save_megatron_model(model, args.out)  # auto_bridge.py:554
    ckpt_dir = tracked_dir(Path(args.out)) or Path(args.out)
    return {"saved": args.out, "keys": sorted(checkpoint_tensor_keys(ckpt_dir))}, EXIT_OK


def _load(loader: str, bridge, path: Path) -> list:
    if loader == "lowlevel":
        from megatron.bridge.training.checkpointing import _load_model_weights_from_checkpoint

        model = build_model(cpu_provider(bridge, load_weights=False))
        _load_model_weights_from_checkpoint(str(lowlevel_dir(path)), model)
        return model
    if loader == "training":
        from megatron.core.optimizer import OptimizerConfig

        from megatron.bridge.training.checkpointing import load_checkpoint
        from megatron.bridge.training.config import CheckpointConfig, ConfigContainer, LoggerConfig
        from megatron.bridge.training.state import GlobalState

        _patch_read_metadata()
        provider = cpu_provider(bridge, load_weights=False)
        model = build_model(provider)
        state = GlobalState()
        # the fields _load_checkpoint_from_path reads (training/checkpointing.py:1372-1560): the
        # model's TP/PP for the resume check, the checkpoint config, the optimizer kind
        state.cfg = ConfigContainer(
            model=provider, train=None,
            optimizer=OptimizerConfig(use_distributed_optimizer=False), ddp=None, scheduler=None,
            dataset=None, logger=LoggerConfig(), tokenizer=None, dist=None,
            checkpoint=CheckpointConfig(load=str(path), finetune=True, load_optim=False, load_rng=False),
        )
        load_checkpoint(state, model, None, None)  # training/checkpointing.py:1307
        return model
    if loader == "highlevel":
        with _cpu_model_config():
            # auto_bridge.py:621: picks the iter dir, then model_load_save.load_megatron_model with
            # use_cpu_init since the default group is gloo (auto_bridge.py:677-683)
            return bridge.load_megatron_model(str(path), wrap_with_ddp=False)
    raise ValueError(f"unknown loader {loader!r}")


def _tensors(model: list) -> dict:
    import torch
    from megatron.core.utils import unwrap_model

    assert len(model) == 1, f"expected one model chunk (no pipeline parallelism), got {len(model)}"
    return {k: v for k, v in unwrap_model(model[0]).state_dict().items() if torch.is_tensor(v)}


def _compare(loader: str, bridge, path: Path, reference: dict) -> tuple[dict, int]:
    import torch

    key = pre_mlp_norm_key(read_dir(path, loader))
    with request_pre_mlp_norm_as(key):
        loaded = _tensors(_load(loader, bridge, path))
    missing = sorted(set(reference) ^ set(loaded))  # in one state_dict but not the other
    both = sorted(set(reference) & set(loaded))
    differ = [k for k in both
              if loaded[k].dtype != reference[k].dtype or loaded[k].shape != reference[k].shape
              or not torch.equal(loaded[k], reference[k])]
    result = {"loader": loader, "tensors": len(both), "differ": differ, "missing": missing,
              "pre_mlp_norm_key": key}
    return result, EXIT_OK if both and not differ and not missing else EXIT_DIFFER


def cmd_load(args) -> tuple[dict, int]:
    if len(args.ckpt) != len(args.loader):
        raise ValueError(f"load: {len(args.ckpt)} --ckpt for {len(args.loader)} --loader; give them in pairs")
    bridge = _bridge(args.hf)
    reference = _tensors(build_model(cpu_provider(bridge, load_weights=True)))
    if len(args.ckpt) == 1:
        return _compare(args.loader[0], bridge, Path(args.ckpt[0]), reference)
    results, status = [], EXIT_OK
    for ckpt, loader in zip(args.ckpt, args.loader):
        try:
            result, one = _compare(loader, bridge, Path(ckpt), reference)
        except Exception as e:  # noqa: BLE001 - reported per pair; the next pair still runs
            traceback.print_exc()
            result, one = {"loader": loader, "ckpt": ckpt, "error": f"{type(e).__name__}: {_message(e)[:500]}"}, 1
        results.append(result)
        status = max(status, one)
    return {"loads": results}, status


def _message(e: BaseException) -> str:
    """The exception's message on one line. torch's CheckpointException renders every rank's
    traceback; its message here is each rank's exception instead."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        text = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in failures.items())
    else:
        text = str(e)
    return " ".join(text.split())


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    save = sub.add_parser("save", help="HF -> Bridge model -> AutoBridge.save_megatron_model")
    save.add_argument("--hf", required=True)
    save.add_argument("--out", required=True)
    load = sub.add_parser("load", help="load a checkpoint with a Bridge loader, compare with Bridge's HF import")
    load.add_argument("--hf", required=True)
    load.add_argument("--ckpt", required=True, action="append", help="repeat with --loader: pairs, loaded in turn")
    load.add_argument("--loader", required=True, action="append", choices=["lowlevel", "training", "highlevel"])
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    # Only the result line goes to stdout; everything printed meanwhile (Bridge, Megatron, forked
    # checkpoint writers) lands on stderr.
    sys.stdout.flush()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        install_shim()
        with world_of_one():
            result, status = (cmd_save if args.command == "save" else cmd_load)(args)
        line = json.dumps(result)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException is a BaseException
        traceback.print_exc()
        line = f"{type(e).__name__}: {_message(e)[:500]}"
        status = EXIT_ERROR
    print(line, file=result_out, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
