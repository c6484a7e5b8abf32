"""Run Megatron-Core 0.16.1 on CPU with gloo.

Megatron-Core assumes CUDA in a handful of places, and Transformer Engine (or apex) in a few more.
This module covers exactly those, and nothing else. Each assumption is listed in `ASSUMPTIONS`
with where it lives, what we do about it and *when* it applies (`Assumption.when`):

  cpu          computing on CPU (the proxy, the RNG tracker, ...): never on CUDA
  no-te        Transformer Engine absent, whatever the device: Megatron reads TE-only names
               unconditionally (a CUDA run without TE raised NameError in the first router
               forward); also on CPU when TE is installed, since its kernels cannot take CPU tensors
  torch-adam   Megatron's optimizer is torch's Adam (no TE/apex, any device; or CPU, where the
               runtime makes it so): gaps in the distributed optimizer's checkpoint path
  te-on-cpu    TE/apex installed but computing on CPU: route Megatron to torch's Adam and its local
               multi-tensor kernels

`selected(device_type, have_te, have_apex_or_te)` is that selection as a pure function (tested on
CPU for every combination); `activate(device)` applies it and is called for every device, so the
TE-absent shims reach GPU runs too. `tests/test_cpu_runtime.py` pins every entry so an upgrade of
Megatron that moves or removes one fails loudly instead of silently running unpatched code.

How: instead of patching `torch` globally, the listed Megatron modules get a module-local `torch`
that is a thin proxy of the real one. The proxy only differs in (1) tensor factories rewrite
`device="cuda"`/`cuda:N` to CPU and (2) `torch.cuda` answers with CPU stand-ins
(`current_device() -> "cpu"`, streams/events that do nothing, `synchronize()` no-op). Every other
attribute is the real torch object, so `isinstance(x, torch.Tensor)`, dtypes, `torch.distributed`
behave as usual. The CUDA RNG tracker is replaced by one that keeps CPU generator states, and
three Megatron functions whose CPU behaviour is wrong are swapped (see ASSUMPTIONS).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Assumption:
    key: str
    where: str  # module (and symbol) in Megatron-Core 0.16.1
    what: str  # the CUDA assumption
    fix: str  # what the runtime does
    when: str = "cpu"  # cpu | no-te | torch-adam | te-on-cpu (module docstring)


WHEN = ("cpu", "no-te", "torch-adam", "te-on-cpu")


# Modules whose module-level `torch` becomes the CPU proxy, with the reason each one needs it.
PROXIED_MODULES: dict[str, str] = {
    "megatron.core.pipeline_parallel.schedules": 'total_num_tokens = torch.zeros(..., device="cuda")',
    "megatron.core.pipeline_parallel.p2p_communication": "shape tensors on torch.cuda.current_device(); torch.cuda.synchronize()",
    "megatron.core.tensor_parallel.layers": "weights/buffers allocated on torch.cuda.current_device()",
    "megatron.core.tensor_parallel.mappings": "all-gather/reduce-scatter outputs on torch.cuda.current_device()",
    "megatron.core.tensor_parallel.utils": "gather buffers on torch.cuda.current_device()",
    "megatron.core.transformer.moe.router": "router weight moved to torch.cuda.current_device()",
    "megatron.core.transformer.moe.experts": "expert weights on torch.cuda.current_device()",
    "megatron.core.transformer.moe.moe_utils": 'aux-loss tracker on device="cuda"; record_stream',
    "megatron.core.transformer.moe.token_dispatcher": "torch.cuda.Stream for device-to-host copies of split sizes",
    "megatron.core.transformer.attention": "inference buffers on torch.cuda.current_device()",
    "megatron.core.transformer.dot_product_attention": "masks on torch.cuda.current_device()",
    "megatron.core.transformer.transformer_layer": "tensors moved to torch.cuda.current_device()",
    "megatron.core.transformer.utils": 'attention masks built with device="cuda"',
    "megatron.core.models.gpt.gpt_model": "buffers on torch.cuda.current_device()",
    "megatron.core.models.common.embeddings.rotary_pos_embedding": "inv_freq on torch.cuda.current_device()",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": "YaRN inv_freq on torch.cuda.current_device() (construction and get_emb)",
    "megatron.core.distributed.param_and_grad_buffer": "grad buffers on torch.cuda.current_device(); communication streams",
    "megatron.core.distributed.distributed_data_parallel": "torch.cuda.Stream for overlapped grad reduction",
    "megatron.core.optimizer.clip_grads": 'norm buffers on device="cuda"',
    "megatron.core.optimizer.optimizer": 'found_inf / scale tensors on device="cuda"',
    "megatron.core.optimizer.distrib_optimizer": "placeholder Adam state on torch.cuda.current_device() (load_state_dict)",
    "megatron.core.optimizer.grad_scaler": "fp16 loss scale and its counters created with device='cuda'",
    "megatron.core.utils": "GlobalMemoryBuffer (attention matmul buffer) on torch.cuda.current_device()",
}

ASSUMPTIONS: tuple[Assumption, ...] = (
    Assumption(
        "cuda-tensors",
        "the modules in PROXIED_MODULES",
        'tensors created with device="cuda" or torch.cuda.current_device()',
        "module-local torch proxy that maps CUDA devices to CPU",
    ),
    Assumption(
        "cuda-streams",
        "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher",
        "torch.cuda.Stream / Event / current_stream for overlapping device-to-host copies",
        "no-op stream/event stand-ins inside the proxy (CPU work is synchronous)",
    ),
    Assumption(
        "cuda-rng-tracker",
        "megatron.core.tensor_parallel.random (model_parallel_cuda_manual_seed, get_cuda_rng_tracker)",
        "tracker stores CUDA generator states; attention forks it even with dropout 0",
        "a tracker with the same interface over CPU generator states; seeding via seed_model_parallel_rng()",
    ),
    Assumption(
        "recompute-cuda-rng",
        "megatron.core.tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state (called by "
        "_get_all_rng_states / _set_all_rng_states in CheckpointFunction: activation recompute)",
        "saves and restores the CUDA generator's state around a recomputed forward",
        "on CPU there is no CUDA generator: get returns an empty state, set does nothing (the CPU "
        "generator and the tracker's states are saved and restored by the same functions)",
    ),
    Assumption(
        "te-fp8-recompute-names",
        "megatron.core.tensor_parallel.random.CheckpointWithoutOutput (selective recompute of "
        "layernorm / moe_act): CheckpointWithoutOutputFunction.forward and _recompute",
        "CheckpointWithoutOutput() sets self.fp8 = (fp8 is not None), True for its default fp8=False, "
        "so forward and recompute always use TE's FP8GlobalStateManager, activation_recompute_forward "
        "and fp8_autocast, names only bound when TE imports: NameError",
        "bind them to stand-ins for 'no FP8': is_fp8_enabled() is False, the two contexts do nothing",
        when="no-te",
    ),
    Assumption(
        "rope-cp-slice",
        "megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank (also bound by "
        "name in rotary_pos_embedding and yarn_rotary_pos_embedding): the RoPE table slice of a CP rank for [b, s] inputs",
        "builds its two chunk indices with torch.tensor(..., pin_memory=True).cuda(non_blocking=True) "
        "(rope_utils.py:62-64): no pinned memory and no CUDA on CPU",
        "the same zigzag slice (chunks r and 2*cp-1-r of 2*cp) with the indices on the table's device",
    ),
    Assumption(
        "te-general-gemm",
        "megatron.core.transformer.moe.moe_utils.te_general_gemm",
        "name only bound when Transformer Engine imports: NameError in the router without TE",
        "bind it to None so the router takes its torch.mm path",
        when="no-te",
    ),
    Assumption(
        "te-mla-flag",
        "megatron.core.transformer.multi_latent_attention.HAVE_TE",
        "true whenever megatron.core.extensions.transformer_engine imports, which it does without "
        "Transformer Engine (its TE classes are then MagicMocks): MLASelfAttention's "
        "isinstance(self.linear_proj, TELinear) raises TypeError",
        "bind it to False, as the module's own ImportError branch would",
        when="no-te",
    ),
    Assumption(
        "a2a-split-sizes",
        "megatron.core.transformer.moe.moe_utils.maybe_move_tensor_to_cpu (used by the alltoall dispatcher)",
        "converts split sizes to numpy only for CUDA tensors; gloo all_to_all_single rejects tensor split sizes",
        "CPU version that also converts CPU tensors when as_numpy=True",
    ),
    Assumption(
        "clip-grad-dtype-assert",
        "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32 (imported by optimizer.optimizer)",
        "asserts param.grad.type() == 'torch.cuda.FloatTensor' before scaling",
        "same scaling for CPU float32 grads (the norm itself is still Megatron's get_grad_norm_fp32)",
    ),
    Assumption(
        "cuda-tensor-methods",
        "the methods in CUDA_TENSOR_METHOD_USERS: Float16OptimizerWithFloat16Params.__init__, "
        "DistributedOptimizer.__init__ (_build_model_and_main_param_groups), "
        "DistributedOptimizer.get_parameter_state_dp_zero (fully_reshardable checkpoints)",
        "sort parameters into 16-bit / fp32 groups by param.type() in {'torch.cuda.BFloat16Tensor', "
        "'torch.cuda.HalfTensor', 'torch.cuda.FloatTensor'} (a CPU tensor is a TypeError); move the "
        "optimizer-state shard to CUDA with .cuda() before the DP all-gather of a checkpoint save",
        "run those methods with Tensor.type() answering the CUDA name and Tensor.cuda() returning the "
        "tensor for CPU tensors (only inside them; the all-gather itself is gloo's)",
    ),
    Assumption(
        "torch-adam-distopt-load",
        "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer: sharded_state_dict(is_loading=True) "
        "and _set_main_param_and_optimizer_states, over torch's Adam (HAVE_APEX_OR_TE False: no TE/apex, "
        "as on every CPU machine)",
        "(1) sharded_state_dict() calls state_dict(), which asserts every Adam state already holds a "
        "'step': a never-stepped optimizer cannot be saved or loaded into (every resume fails); "
        "(2) loading a fully_reshardable checkpoint copies every key of the live Adam state, 'step' "
        "included, from saved tensors that have no 'step' (KeyError); (3) load_state_dict gives every "
        "parameter's state the same 'step' tensor object, and torch's Adam increments each parameter's "
        "step in place, so after a resume the step grows by the number of parameters per update "
        "(wrong bias correction); (4) an optimizer holding no parameter of this rank has no Adam state "
        "and state_dict asserts exactly one step: Megatron builds one optimizer per parameter-group "
        "key gathered from every rank (optimizer/__init__.py _get_param_groups, all_gather_object of "
        "the keys), so a pipeline stage without MoE layers (GLM-4.5's dense first layers on their "
        "own stage) gets an expert optimizer with no parameters and no checkpoint can be saved",
        "(1) a never-stepped DistributedOptimizer first gets the state torch's Adam would create lazily at "
        "its first step (step 0, zero moments: _init_group in torch/optim/adam.py); (2) the copy "
        "skips 'step', which load_state_dict restores from the saved param groups; (3) after "
        "load_state_dict each state gets its own copy of the step tensor; (4) the state_dict of an "
        "optimizer with no parameters records its chained siblings' step in its groups (the step "
        "load_state_dict gives the same optimizer on ranks that hold parameters)",
        when="torch-adam",
    ),
    Assumption(
        "te-kernels-on-cpu",
        "megatron.core.optimizer (USING_PYTORCH_OPTIMIZER), megatron.core.optimizer.distrib_optimizer "
        "(HAVE_APEX_OR_TE, USING_TE_OPTIMIZER, USING_APEX_OPTIMIZER, Adam), "
        "megatron.core.optimizer.optimizer and megatron.core.optimizer.clip_grads (multi_tensor_applier)",
        "with TE or apex importable Megatron builds their FusedAdam and runs their multi-tensor CUDA "
        "kernels (scale, l2norm) whatever the parameters' device: a CPU run on a node that has TE fails",
        "point them at torch's Adam and Megatron's local multi-tensor implementations (what Megatron "
        "itself selects when neither imports); the torch-adam entries then apply as on any CPU machine",
        when="te-on-cpu",
    ),
)


# --------------------------------------------------------------------------------------------
# The proxy


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")  # torch.cuda.current_device() style ordinals
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _redirect(fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapper.__name__ = getattr(fn, "__name__", "factory")
    wrapper.__wrapped__ = fn
    return wrapper


_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "rand", "randn", "randint",
    "empty_like", "zeros_like", "ones_like", "full_like", "linspace", "eye", "randperm",
)


class _NullStream:
    """Stand-in for torch.cuda.Stream/Event: CPU work is synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *a, **k):
        pass

    def wait_event(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _NullStream()

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


_NULL_STREAM = _NullStream()


def _make_cuda_namespace() -> types.SimpleNamespace:
    real = torch.cuda
    ns = types.SimpleNamespace(
        is_available=lambda: False,
        current_device=lambda: "cpu",
        device_count=lambda: 0,
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=_NullStream,
        Event=_NullStream,
        current_stream=lambda *a, **k: _NULL_STREAM,
        default_stream=lambda *a, **k: _NULL_STREAM,
        stream=lambda *a, **k: contextlib.nullcontext(),
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None,
                                   range=lambda *a, **k: contextlib.nullcontext()),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
    )
    # Anything else (types like torch.cuda.FloatTensor used in asserts, amp, ...) is the real one.
    return types.SimpleNamespace(**{**{k: getattr(real, k) for k in dir(real) if not k.startswith("__")}, **vars(ns)})


class _TorchProxy(types.ModuleType):
    """`torch` as seen by a patched Megatron module on CPU."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _make_cuda_namespace()
        for name in _FACTORIES:
            setattr(self, name, _redirect(getattr(torch, name)))

    def __getattr__(self, name):  # only called for attributes not set above
        return getattr(torch, name)


# --------------------------------------------------------------------------------------------
# CPU RNG tracker


class CpuRNGStatesTracker:
    """Megatron's CudaRNGStatesTracker interface over CPU generator states.

    `fork(name)` swaps the process-wide CPU generator state for the named one for the duration of
    the block, like the CUDA tracker does with the CUDA generator.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


# --------------------------------------------------------------------------------------------
# Replacements


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    # Same contract as Megatron's, but CPU tensors become numpy too when asked: gloo's
    # all_to_all_single only takes python/numpy split sizes.
    if torch.is_tensor(tensor):
        tensor = tensor.detach().to("cpu")
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    # Megatron's contract: scale every fp32 grad by max_norm / (total_norm + 1e-6) when < 1.
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    for g in grads:
        if g.dtype != torch.float32:
            raise TypeError(f"clip_grad_by_total_norm_fp32 expects float32 grads, got {g.dtype}")
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


@contextlib.contextmanager
def _cuda_tensor_methods():
    """Inside the block, for CPU tensors: `t.type()` (no arguments) answers 'torch.cuda.<T>' — the
    names Megatron's optimizers compare against — and `t.cuda()` returns the tensor itself (the
    collective that follows runs on gloo). `t.type(dtype)` (a conversion) is untouched. Meta
    tensors (--simulate, train/simulate.py) answer the same ('torch.meta.<T>' otherwise)."""
    real_type, real_cuda = torch.Tensor.type, torch.Tensor.cuda

    def type_(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        if not args and not kwargs and self.device.type in ("cpu", "meta") and name.startswith("torch."):
            return "torch.cuda." + name.split(".")[-1]
        return name

    def cuda_(self, *args, **kwargs):
        return self if self.device.type in ("cpu", "meta") else real_cuda(self, *args, **kwargs)

    torch.Tensor.type, torch.Tensor.cuda = type_, cuda_
    try:
        yield
    finally:
        torch.Tensor.type, torch.Tensor.cuda = real_type, real_cuda


def _with_cuda_tensor_methods(method: Callable) -> Callable:
    def wrapper(self, *args, **kwargs):
        with _cuda_tensor_methods():
            return method(self, *args, **kwargs)

    return functools.wraps(method)(wrapper)


def _init_adam_state(adam: torch.optim.Optimizer) -> None:
    # What torch.optim.Adam(W) creates for a parameter at its first step (non-fused, non-capturable,
    # no amsgrad): a float32 step of 0 and zero moments. Stepping then proceeds exactly as from empty.
    for group in adam.param_groups:
        for p in group["params"]:
            if not adam.state[p]:
                adam.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _distopt_sharded_state_dict(method: Callable) -> Callable:
    def wrapper(self, model_sharded_state_dict=None, is_loading: bool = False, *args, **kwargs):
        if len(self.optimizer.state) == 0:
            _init_adam_state(self.optimizer)
        return method(self, {} if model_sharded_state_dict is None else model_sharded_state_dict,
                      is_loading, *args, **kwargs)

    return functools.wraps(method)(wrapper)


def _distopt_state_dict(method: Callable) -> Callable:
    def wrapper(self):
        if any(g["params"] for g in self.optimizer.param_groups):
            return method(self)
        # No parameter on this rank: no Adam state holds the step (Megatron's own code asserts one).
        # The step is its chained siblings' (every update steps them all; train/optim.py
        # build_optimizer links them), so a checkpoint whose common state this rank writes resumes
        # the other ranks' optimizer of the same kind at the right step.
        step = None
        for sibling in getattr(self, "gspo_siblings", ()):
            steps = {float(st["step"]) for st in sibling.optimizer.state.values() if "step" in st}
            if len(steps) == 1:
                step = steps.pop()
                break
        inner = self.optimizer.state_dict()  # torch packs fresh group dicts: safe to edit
        out = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in out["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = step
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    return functools.wraps(method)(wrapper)


def _distopt_load_state_dict(method: Callable) -> Callable:
    def wrapper(self, state_dict):
        out = method(self, state_dict)
        for st in self.optimizer.state.values():
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].clone()
        return out

    return functools.wraps(method)(wrapper)


class _NoFP8:
    """Stand-in for TE's FP8GlobalStateManager where TE is absent: FP8 is never enabled."""

    @staticmethod
    def is_fp8_enabled() -> bool:
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def _null_context(*args, **kwargs):
    return contextlib.nullcontext()


def _get_cuda_rng_state(*args, **kwargs):
    return torch.empty(0, dtype=torch.uint8)


def _set_cuda_rng_state(*args, **kwargs):
    return None


def _get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    # Megatron's version (rope_utils.py) with the chunk indices on pos_emb's device instead of a
    # pinned host tensor moved to CUDA (see ASSUMPTIONS, rope-cp-slice).
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1):])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2):])


def _set_main_param_and_optimizer_states(self, model_param, tensors):
    # Megatron's version without precision-aware optimizer, minus the 'step' key (see
    # ASSUMPTIONS, torch-adam-distopt-load): copy the saved main param and moments in place.
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    dst = {"param": main_param, **self.optimizer.state[main_param]}
    for key, t in dst.items():
        if key != "step":
            t.copy_(tensors[key])


# Megatron methods that run under _cuda_tensor_methods() on CPU: (module, class, method).
CUDA_TENSOR_METHOD_USERS = (
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "__init__"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "get_parameter_state_dp_zero"),
)


# --------------------------------------------------------------------------------------------
# Activation


class _State:
    """Holds what activate() replaced so deactivate() can restore it (one per process)."""

    def __init__(self):
        self.saved: list[tuple[Any, str, Any, bool]] = []
        self.device_type: str | None = None  # what activate() was called for

    @property
    def active(self) -> bool:
        return self.device_type is not None


_STATE = _State()


def _set(obj: Any, name: str, value: Any) -> None:
    had = hasattr(obj, name)
    _STATE.saved.append((obj, name, getattr(obj, name, None), had))
    setattr(obj, name, value)


def should_activate(device: str | torch.device | None = None) -> bool:
    """The CPU part of the runtime applies when computing on CPU (explicitly, or because CUDA is absent)."""
    if device is None or str(device) == "auto":
        return not torch.cuda.is_available()
    return torch.device(device).type == "cpu"


def selected(device_type: str, have_te: bool, have_apex_or_te: bool) -> tuple[str, ...]:
    """Keys of the ASSUMPTIONS entries that apply to a run on `device_type` with TE / apex
    importable or not (module docstring). Pure: the GPU selections are tested on CPU."""
    cpu = device_type == "cpu"
    applies = {
        "cpu": cpu,
        "no-te": cpu or not have_te,
        "torch-adam": cpu or not have_apex_or_te,
        "te-on-cpu": cpu and (have_te or have_apex_or_te),
    }
    return tuple(a.key for a in ASSUMPTIONS if applies[a.when])


def library_flags() -> tuple[bool, bool]:
    """(HAVE_TE, HAVE_APEX_OR_TE) as the installed Megatron-Core found them at import."""
    from megatron.core.optimizer import distrib_optimizer
    from megatron.core.transformer.moe import moe_utils

    return bool(getattr(moe_utils, "HAVE_TE", False)), bool(distrib_optimizer.HAVE_APEX_OR_TE)


def activate(device: str | torch.device | None = None) -> bool:
    """Install what a run on `device` needs (`selected`): the TE/apex-absent shims on any device,
    the CPU runtime on CPU. Idempotent; returns whether the CPU runtime is active."""
    device_type = "cpu" if should_activate(device) else "cuda"
    if _STATE.active:
        if _STATE.device_type == device_type:
            return device_type == "cpu"
        deactivate()  # activated for the other device (tests switch in one process)
    keys = set(selected(device_type, *library_flags()))
    _STATE.device_type = device_type
    if "te-kernels-on-cpu" in keys:
        _route_to_torch_optimizers()
    if "te-general-gemm" in keys:
        from megatron.core.transformer.moe import moe_utils

        _set(moe_utils, "te_general_gemm", None)
    if "te-mla-flag" in keys:
        from megatron.core.transformer import multi_latent_attention

        _set(multi_latent_attention, "HAVE_TE", False)
    if "te-fp8-recompute-names" in keys:
        from megatron.core.tensor_parallel import random as mrandom

        _set(mrandom, "FP8GlobalStateManager", _NoFP8)
        _set(mrandom, "activation_recompute_forward", _null_context)
        _set(mrandom, "fp8_autocast", _null_context)
    if "torch-adam-distopt-load" in keys:
        from megatron.core.optimizer import distrib_optimizer

        cls = distrib_optimizer.DistributedOptimizer
        _set(cls, "sharded_state_dict", _distopt_sharded_state_dict(cls.sharded_state_dict))
        _set(cls, "state_dict", _distopt_state_dict(cls.state_dict))
        _set(cls, "_set_main_param_and_optimizer_states", _set_main_param_and_optimizer_states)
        _set(cls, "load_state_dict", _distopt_load_state_dict(cls.load_state_dict))
    if device_type == "cpu":
        _activate_cpu()
    return device_type == "cpu"


def _route_to_torch_optimizers() -> None:
    """te-kernels-on-cpu: what Megatron's own imports select when neither TE nor apex imports."""
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer as moptimizer
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm, local_multi_tensor_scale

    _set(mopt, "USING_PYTORCH_OPTIMIZER", True)
    _set(distrib_optimizer, "HAVE_APEX_OR_TE", False)
    _set(distrib_optimizer, "USING_TE_OPTIMIZER", False)
    _set(distrib_optimizer, "USING_APEX_OPTIMIZER", False)
    _set(distrib_optimizer, "Adam", torch.optim.Adam)
    for mod in (moptimizer, clip_grads):
        _set(mod, "multi_tensor_applier", local_multi_tensor_applier)
        _set(mod, "multi_tensor_scale_impl", local_multi_tensor_scale)
    _set(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)


def _activate_cpu() -> None:
    proxy = _TorchProxy()
    for modname in PROXIED_MODULES:
        mod = importlib.import_module(modname)
        if getattr(mod, "torch", None) is not torch:
            raise RuntimeError(
                f"cpu_runtime: {modname} no longer binds the module 'torch' as expected; "
                "megatron-core changed, revisit gspo_megatron/parallel/cpu_runtime.py"
            )
        _set(mod, "torch", proxy)

    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    _set(moe_utils, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu)
    _set(token_dispatcher, "maybe_move_tensor_to_cpu", _maybe_move_tensor_to_cpu)

    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for mod in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):  # each imported it by name
        _set(mod, "get_pos_emb_on_this_cp_rank", _get_pos_emb_on_this_cp_rank)

    from megatron.core.optimizer import clip_grads, optimizer as moptimizer

    _set(clip_grads, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32)
    _set(moptimizer, "clip_grad_by_total_norm_fp32", _clip_grad_by_total_norm_fp32)
    for modname, clsname, meth in CUDA_TENSOR_METHOD_USERS:
        cls = getattr(importlib.import_module(modname), clsname)
        _set(cls, meth, _with_cuda_tensor_methods(getattr(cls, meth)))

    _set(mrandom, "_get_cuda_rng_state", _get_cuda_rng_state)
    _set(mrandom, "_set_cuda_rng_state", _set_cuda_rng_state)
    tracker = CpuRNGStatesTracker()
    _set(mrandom, "_CUDA_RNG_STATE_TRACKER", tracker)
    _set(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", True)


#: what megatron/core/jit.py defines (megatron-core 0.16.1); tests/test_cpu_runtime.py reads the
#: real file and fails if it defines anything else, so the stand-in stays faithful
JIT_MODULE_NAMES = ("jit_fuser", "noop_decorator", "enable_jit_fuser", "disable_jit_fuser")


def skip_compiled_fusions() -> bool:
    """CPU runs: Megatron's fused elementwise kernels without torch.compile. Call before Megatron
    is first imported; returns whether it took effect (False once Megatron is imported).

    megatron/core/jit.py sets ``jit_fuser = torch.compile`` (torch >= 2.2) and ~40 functions are
    decorated with it when their modules load (fusions/*, moe/router.py, moe/experts.py, ...).
    Decorating imports TorchDynamo and Inductor's compiler in every process that imports Megatron:
    ~110 MiB resident and ~1 s, of which Dynamo (~70 MiB) comes back anyway with the first torch
    optimizer (Optimizer.add_param_group is wrapped by torch._disable_dynamo) but Inductor's
    compile_fx (~40 MiB) does not, nor Dynamo's tracing at run time. The CPU model calls one of
    those functions, ``TopKRouter._apply_expert_bias`` (router.py:531: adds to a token counter
    only when expert bias is on, never for Qwen3-MoE), which Dynamo then traces at the first
    forward of every process; no other runs (no bias-activation fusion, output gate or flex
    dispatcher; tests/test_cpu_runtime.py records the calls of a training step). So
    ``megatron.core.jit`` is pre-registered as a module whose ``jit_fuser`` is the identity - what
    jit.py itself falls back to where torch.compile is unavailable (its ``noop_decorator``): the
    same functions, run eagerly. GPU runs never call this (train/__main__.py: only when the
    resolved device is CPU)."""
    import sys

    if "megatron.core" in sys.modules or "megatron.core.jit" in sys.modules:
        return False
    jit = types.ModuleType("megatron.core.jit")
    jit.__doc__ = "gspo_megatron.parallel.cpu_runtime.skip_compiled_fusions: jit_fuser is the identity"

    def noop_decorator(func):
        return func

    def enable_jit_fuser():
        jit.jit_fuser = noop_decorator

    def disable_jit_fuser():
        jit.jit_fuser = noop_decorator

    jit.jit_fuser, jit.noop_decorator = noop_decorator, noop_decorator
    jit.enable_jit_fuser, jit.disable_jit_fuser = enable_jit_fuser, disable_jit_fuser
    sys.modules["megatron.core.jit"] = jit
    return True


def deactivate() -> None:
    """Undo activate() (tests use it to show each patch is needed)."""
    while _STATE.saved:
        obj, name, value, had = _STATE.saved.pop()
        if had:
            setattr(obj, name, value)
        else:
            delattr(obj, name)
    _STATE.device_type = None


def is_active() -> bool:
    """Whether the CPU runtime (not only the device-independent shims) is installed."""
    return _STATE.active and _STATE.device_type == "cpu"


def seed_model_parallel_rng(seed: int, tp_rank: int, ep_rank: int, etp_rank: int) -> None:
    """CPU counterpart of megatron's model_parallel_cuda_manual_seed (same seed offsets)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


__all__ = [
    "ASSUMPTIONS", "PROXIED_MODULES", "WHEN", "CpuRNGStatesTracker", "activate", "deactivate",
    "is_active", "library_flags", "seed_model_parallel_rng", "selected", "should_activate",
]
