"""Pins every CUDA assumption of Megatron-Core 0.16.1 that parallel/cpu_runtime.py covers.

Each test shows the assumption is still there (so the runtime is still needed, and a Megatron
upgrade that moves it fails here loudly) and that the runtime's answer to it works.
"""
from __future__ import annotations

import importlib
import inspect
import re
import types

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import GroupStandIn as _Group


def pins(*keys: str):
    """Marks the test that pins these cpu_runtime.ASSUMPTIONS entries."""
    def mark(fn):
        fn.pins = keys
        return fn
    return mark


def test_proxied_modules_still_assume_cuda():
    from gspo_megatron.parallel import cpu_runtime

    for modname, reason in cpu_runtime.PROXIED_MODULES.items():
        src = inspect.getsource(importlib.import_module(modname))
        assert re.search(r"torch\.cuda\.|device=['\"]cuda", src), f"{modname} no longer mentions cuda: drop it from PROXIED_MODULES ({reason})"


@pins("cuda-streams")
def test_proxy_redirects_only_cuda_devices():
    from gspo_megatron.parallel import cpu_runtime

    proxy = cpu_runtime._TorchProxy()
    assert proxy.zeros(2, device="cuda").device.type == "cpu"
    assert proxy.empty(3, device=proxy.cuda.current_device()).device.type == "cpu"
    assert proxy.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    assert proxy.Tensor is torch.Tensor and proxy.float32 is torch.float32
    assert proxy.distributed is torch.distributed
    s = proxy.cuda.Stream()
    s.wait_stream(proxy.cuda.current_stream())  # no-ops
    assert proxy.cuda.is_available() is False


def test_runtime_is_inert_for_cuda_devices():
    """For CUDA only the TE/apex-absent shims are installed (never the proxy or the RNG tracker)."""
    from megatron.core.tensor_parallel import random as mrandom

    from gspo_megatron.parallel import cpu_runtime
    from megatron.core.pipeline_parallel import schedules

    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    try:
        assert cpu_runtime.activate("cuda") is False
        assert schedules.torch is torch and not cpu_runtime.is_active()
        assert mrandom._CUDA_RNG_STATE_TRACKER is tracker
    finally:
        cpu_runtime.deactivate()


def _keys(when: str) -> set[str]:
    from gspo_megatron.parallel import cpu_runtime

    return {a.key for a in cpu_runtime.ASSUMPTIONS if a.when == when}


def test_selection_follows_te_and_apex_not_only_the_device():
    """Which entries apply, for every (device, TE, apex) combination. A CUDA run without TE (the
    first GPU machine: torch + transformers only) gets the TE-absent shims and the torch-Adam
    checkpoint fixes — before, the runtime was keyed on the device and bound neither there."""
    from gspo_megatron.parallel import cpu_runtime

    sel = lambda *a: set(cpu_runtime.selected(*a))  # noqa: E731
    assert {a.when for a in cpu_runtime.ASSUMPTIONS} <= set(cpu_runtime.WHEN)
    no_te, torch_adam = _keys("no-te"), _keys("torch-adam")
    assert no_te == {"te-general-gemm", "te-fp8-recompute-names", "te-mla-flag"}
    assert torch_adam == {"torch-adam-distopt-load"}
    assert sel("cuda", False, False) == no_te | torch_adam  # GPU, no TE, no apex
    assert sel("cuda", False, True) == no_te  # GPU with apex only: FusedAdam keeps its step in the groups
    assert sel("cuda", True, True) == set()  # the GPU presets' image: Megatron as it is
    cpu_side = _keys("cpu") | no_te | torch_adam
    assert sel("cpu", False, False) == cpu_side  # every CI machine
    assert sel("cpu", True, True) == cpu_side | _keys("te-on-cpu")  # parallel.device=cpu on a TE node
    assert sel("cpu", False, True) == cpu_side | _keys("te-on-cpu")


@pins("te-kernels-on-cpu")
def test_te_installed_cpu_run_takes_torch_optimizer_and_kernels(monkeypatch):
    """On a node with TE (or apex), parallel.device=cpu must not reach TE's FusedAdam, GEMM or
    multi-tensor kernels: the runtime routes Megatron to what it picks when they are absent.
    Simulated here by setting Megatron's import-time flags as a TE install leaves them."""
    from megatron.core import optimizer as mopt
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer as moptimizer
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.utils import local_multi_tensor_applier, local_multi_tensor_l2_norm

    from gspo_megatron.parallel import cpu_runtime

    sentinel = object()
    monkeypatch.setattr(moe_utils, "HAVE_TE", True)
    monkeypatch.setattr(moe_utils, "te_general_gemm", sentinel, raising=False)
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)
    monkeypatch.setattr(distrib_optimizer, "USING_TE_OPTIMIZER", True)
    monkeypatch.setattr(mopt, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(clip_grads, "multi_tensor_applier", sentinel)
    assert "USING_PYTORCH_OPTIMIZER" in inspect.getsource(mopt._get_megatron_optimizer_based_on_param_groups)
    try:
        assert cpu_runtime.activate("cpu") is True
        assert moe_utils.te_general_gemm is None
        assert mopt.USING_PYTORCH_OPTIMIZER is True
        assert distrib_optimizer.HAVE_APEX_OR_TE is False and distrib_optimizer.USING_TE_OPTIMIZER is False
        assert distrib_optimizer.Adam is torch.optim.Adam
        assert clip_grads.multi_tensor_applier is local_multi_tensor_applier
        assert moptimizer.multi_tensor_applier is local_multi_tensor_applier
        assert clip_grads.l2_norm_impl is local_multi_tensor_l2_norm
        # and the torch-Adam checkpoint fixes come with it
        assert hasattr(distrib_optimizer.DistributedOptimizer.load_state_dict, "__wrapped__")
    finally:
        cpu_runtime.deactivate()
    assert moe_utils.te_general_gemm is sentinel and distrib_optimizer.HAVE_APEX_OR_TE is True
    assert clip_grads.multi_tensor_applier is sentinel
    # on CUDA with TE the same flags leave Megatron untouched
    try:
        assert cpu_runtime.activate("cuda") is False
        assert moe_utils.te_general_gemm is sentinel and mopt.USING_PYTORCH_OPTIMIZER is False
        assert not hasattr(distrib_optimizer.DistributedOptimizer.load_state_dict, "__wrapped__")
    finally:
        cpu_runtime.deactivate()


@pins("te-mla-flag")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_mla_believes_te_is_there_without_it_and_the_runtime_says_it_is_not(device):
    """megatron-core's MLA module finds Transformer Engine 'importable' when only Megatron's own
    stand-in (MagicMock classes) is there, and then calls isinstance with a non-type (read in the
    installed source); the runtime binds HAVE_TE to False on every device without TE."""
    import inspect

    from megatron.core.transformer import multi_latent_attention as mla

    from gspo_megatron.parallel import cpu_runtime

    try:
        import transformer_engine  # noqa: F401
        pytest.skip("Transformer Engine installed: the flag is right")
    except ImportError:
        pass
    was = cpu_runtime.is_active()
    cpu_runtime.deactivate()
    try:
        assert mla.HAVE_TE is True and not isinstance(mla.TELinear, type)
        assert "isinstance(self.linear_proj, TELinear)" in inspect.getsource(mla)
        cpu_runtime.activate(device)
        assert mla.HAVE_TE is False
    finally:
        cpu_runtime.deactivate()
        if was:
            cpu_runtime.activate("cpu")
    assert was or mla.HAVE_TE is True


@pins("te-general-gemm")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_te_general_gemm_is_unbound_without_te(device):
    """Without TE the router reads an unbound name on every device: the stand-in is bound for a
    CUDA run as well (activate("cuda") binds nothing of the CPU part, so the router runs here on
    CPU tensors with only the device-independent shims)."""
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        pytest.skip("Transformer Engine installed: the name is bound")
    assert not hasattr(moe_utils, "te_general_gemm")  # the router would raise NameError
    from gspo_megatron.parallel import cpu_runtime

    try:
        cpu_runtime.activate(device)
        assert cpu_runtime.is_active() is (device == "cpu")
        assert moe_utils.te_general_gemm is None
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)
        y = moe_utils.RouterGatingLinearFunction.apply(x, w, None, torch.float32)
        torch.testing.assert_close(y, x @ w.t())
    finally:
        cpu_runtime.deactivate()
    assert not hasattr(moe_utils, "te_general_gemm")


@pins("a2a-split-sizes")
def test_split_sizes_stay_tensors_in_megatron_helper():
    from megatron.core.transformer.moe import moe_utils

    from gspo_megatron.parallel import cpu_runtime

    t = torch.tensor([1, 2])
    assert torch.is_tensor(moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True))  # the assumption
    out = cpu_runtime._maybe_move_tensor_to_cpu(t, as_numpy=True)
    assert isinstance(out, np.ndarray) and out.tolist() == [1, 2]


def test_torch_rmsnorm_spec_refuses_sequence_parallel():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gspo_megatron.model.norm import SPRMSNorm

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(cfg, 8, normalization="RMSNorm")
    norm = SPRMSNorm(cfg, 8, eps=1e-6)
    assert norm.weight.sequence_parallel is True
    x = torch.randn(5, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.rms_norm(x, (8,), norm.weight, 1e-6))


def _rank_runtime(rank, world):
    """Runs inside a fresh process: without the runtime Megatron fails on CPU, with it it works."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    from gspo_megatron.parallel import cpu_runtime

    dist.init_process_group("gloo")
    ps.initialize_model_parallel(create_gloo_process_groups=False)
    seen = {}
    # (c) CUDA RNG tracker
    try:
        mrandom.model_parallel_cuda_manual_seed(1)
        seen["rng_without"] = "ok"
    except (AssertionError, RuntimeError) as e:
        seen["rng_without"] = str(e)
    # (a) device="cuda" in schedules: the no-pipelining schedule allocates total_num_tokens on cuda
    from megatron.core.pipeline_parallel import schedules

    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig

    model = torch.nn.Linear(2, 2)
    model.config = ModelParallelConfig()
    model.model_type = ModelType.encoder_or_decoder
    model.set_input_tensor = lambda t: None

    def run_schedule():
        def fs(it, m):
            x = next(it)
            return m(x), lambda out: (out.sum(), {"v": out.detach().sum()})

        return schedules.forward_backward_no_pipelining(
            forward_step_func=fs, data_iterator=iter([torch.ones(1, 2)]), model=[model], num_microbatches=1,
            seq_length=1, micro_batch_size=1, forward_only=True)

    try:
        run_schedule()
        seen["schedule_without"] = "ok"
    except (AssertionError, RuntimeError) as e:
        seen["schedule_without"] = str(e)
    cpu_runtime.activate("cpu")
    cpu_runtime.seed_model_parallel_rng(1, 0, 0, 0)
    tracker = mrandom.get_cuda_rng_tracker()
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    seen["fork_advances"] = not torch.equal(a, b)
    cpu_runtime.seed_model_parallel_rng(1, 0, 0, 0)
    with mrandom.get_cuda_rng_tracker().fork():
        seen["fork_reproducible"] = torch.equal(torch.rand(3), a)
    seen["schedule_with"] = float(run_schedule()[0]["v"])
    seen["expected"] = float(model(torch.ones(1, 2)).sum())
    cpu_runtime.deactivate()
    seen["restored"] = schedules.torch is torch
    ps.destroy_model_parallel()
    return seen


@pins("cuda-tensors", "cuda-rng-tracker")
@pytest.mark.timeout(120)
def test_megatron_needs_the_runtime_on_cpu_and_works_with_it():
    seen = run_distributed(_rank_runtime, 1, timeout=100, fresh=True)[0]  # what a new process sees
    assert "CUDA" in seen["rng_without"] or "cuda" in seen["rng_without"]
    assert "CUDA" in seen["schedule_without"] or "cuda" in seen["schedule_without"]
    assert seen["fork_advances"] and seen["fork_reproducible"]
    assert seen["schedule_with"] == pytest.approx(seen["expected"], rel=1e-6)
    assert seen["restored"]


def _rank_a2a(rank, world):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    out = torch.empty(4)
    try:
        dist.all_to_all_single(out, x, output_split_sizes=torch.tensor([2, 2]), input_split_sizes=torch.tensor([2, 2]))
        tensor_ok = True
    except (TypeError, RuntimeError):
        tensor_ok = False
    dist.all_to_all_single(out, x, output_split_sizes=np.array([2, 2]).tolist(), input_split_sizes=[2, 2])
    return tensor_ok, out.tolist()


@pytest.mark.timeout(60)
def test_gloo_all_to_all_rejects_tensor_split_sizes():
    res = run_distributed(_rank_a2a, 2, timeout=50, fresh=True)
    assert res[0][0] is False and res[1][0] is False
    assert res[0][1] == [0.0, 1.0, 10.0, 11.0]


@pins("clip-grad-dtype-assert")
def test_megatron_clip_grad_asserts_cuda_and_cpu_replacement_scales():
    from megatron.core.optimizer import clip_grads

    from gspo_megatron.parallel import cpu_runtime

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 2.0)
    with pytest.raises(AssertionError):
        clip_grads.clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    cpu_runtime._clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    torch.testing.assert_close(p.grad, torch.full((4,), 2.0 * 1.0 / (4.0 + 1e-6)))
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.full((2,), 0.1)
    cpu_runtime._clip_grad_by_total_norm_fp32([q], max_norm=1.0, total_norm=0.5)  # below the max: untouched
    torch.testing.assert_close(q.grad, torch.full((2,), 0.1))


def test_every_assumption_is_pinned_here():
    """Every entry of cpu_runtime.ASSUMPTIONS has a test here that pins it (@pins), every @pins
    names a real entry, and the Megatron symbol each entry names exists in the installed
    Megatron-Core (an upgrade that moves one fails here, not silently at run time)."""
    import importlib
    import sys

    from gspo_megatron.parallel import cpu_runtime

    module = sys.modules[__name__]
    pinned: dict[str, list[str]] = {}
    for name, fn in vars(module).items():
        for key in getattr(fn, "pins", ()):
            assert name.startswith("test_") and callable(fn), name  # collected by pytest
            pinned.setdefault(key, []).append(name)
    assert set(pinned) == {a.key for a in cpu_runtime.ASSUMPTIONS}, set(pinned) ^ {a.key for a in cpu_runtime.ASSUMPTIONS}
    for a in cpu_runtime.ASSUMPTIONS:
        m = re.match(r"(megatron\.core(?:\.\w+)+)", a.where)
        if m is None:  # "the modules in PROXIED_MODULES" / "the methods in ...": lists in cpu_runtime
            continue
        parts = m.group(1).split(".")
        for cut in range(len(parts), 1, -1):  # longest importable module prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                if not hasattr(obj, attr):  # bound only when TE imports (te-general-gemm): named in the source
                    assert re.search(rf"\b{attr}\b", inspect.getsource(obj)), (a.key, m.group(1), attr)
                    break
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"{a.key}: {m.group(1)} does not import")



@pins("cuda-tensor-methods")
def test_megatron_optimizers_compare_cuda_type_names():
    """Megatron sorts parameters by CUDA type names and moves checkpoint shards with .cuda(); the
    runtime answers both for CPU tensors inside those methods only, and the optimizer builds."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from gspo_megatron.parallel import cpu_runtime

    for modname, clsname, meth in cpu_runtime.CUDA_TENSOR_METHOD_USERS:
        src = inspect.getsource(getattr(getattr(importlib.import_module(modname), clsname), meth))
        assert "torch.cuda.BFloat16Tensor" in src or ".cuda()" in src, (clsname, meth)
    x = torch.ones(2, dtype=torch.bfloat16)
    with cpu_runtime._cuda_tensor_methods():
        assert x.type() == "torch.cuda.BFloat16Tensor" and x.cuda() is x
        assert x.type(torch.float32).dtype == torch.float32  # conversions untouched
    assert x.type() == "torch.BFloat16Tensor"
    try:
        cpu_runtime.activate("cpu")
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = Float16OptimizerWithFloat16Params(torch.optim.Adam([p]), OptimizerConfig(bf16=True), None,
                                                lambda *a: None)
        master = opt.fp32_from_float16_groups[0][0]
        assert master.dtype == torch.float32 and master.device.type == "cpu"
    finally:
        cpu_runtime.deactivate()
    assert torch.Tensor.type.__name__ == "type" and x.type() == "torch.BFloat16Tensor"


@pins("torch-adam-distopt-load")
def test_distributed_optimizer_torch_adam_load_gaps_are_still_there():
    """Without TE/apex Megatron's DistributedOptimizer runs over torch's Adam, whose checkpoint path
    has three gaps the runtime covers (see ASSUMPTIONS); the resume tests show the covered path."""
    from megatron.core.optimizer import distrib_optimizer

    from gspo_megatron.parallel import cpu_runtime

    assert distrib_optimizer.HAVE_APEX_OR_TE is False  # no TE/apex on CPU machines
    cls = distrib_optimizer.DistributedOptimizer
    assert "assert len(steps) == 1" in inspect.getsource(cls.state_dict)
    assert "dst_tensors[key].copy_(tensors[key])" in inspect.getsource(cls._set_main_param_and_optimizer_states)
    assert 's["step"] = step' in inspect.getsource(cls.load_state_dict)  # one tensor for every state
    adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    cpu_runtime._init_adam_state(adam)
    ref = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    for o in (adam, ref):  # a step from the initialised state equals a step from an empty one
        o.param_groups[0]["params"][0].grad = torch.tensor([1.0, -2.0, 3.0])
        o.step()
    torch.testing.assert_close(adam.param_groups[0]["params"][0], ref.param_groups[0]["params"][0], rtol=0, atol=0)
    assert float(next(iter(adam.state.values()))["step"]) == 1.0


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_distopt_step_counters_after_a_load_are_per_parameter(device, monkeypatch):
    """After Megatron's DistributedOptimizer.load_state_dict over torch's Adam every parameter's
    state holds the *same* step tensor (distrib_optimizer.py:818-825) and torch's Adam increments
    each state's step in place: one update then adds the number of parameters to every step (wrong
    bias correction after every resume). The fix is keyed on HAVE_APEX_OR_TE, so a CUDA run
    without TE/apex gets it too; with TE/apex (FusedAdam keeps the step in its param groups) it
    is not installed."""
    from megatron.core.optimizer import distrib_optimizer

    from gspo_megatron.parallel import cpu_runtime

    cls = distrib_optimizer.DistributedOptimizer

    def adam_after_megatron_load():
        params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
        adam = torch.optim.Adam(params, lr=0.1)
        shared = torch.tensor(5.0)  # what load_state_dict leaves: one tensor for all states
        for p in params:
            adam.state[p] = {"step": shared, "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
        return adam

    def load_then_step(load):
        fake = types.SimpleNamespace(optimizer=adam_after_megatron_load())
        load(fake, {})
        for p in fake.optimizer.param_groups[0]["params"]:
            p.grad = torch.ones(3)
        fake.optimizer.step()
        return sorted(float(st["step"]) for st in fake.optimizer.state.values())

    # the gap: without the fix one update moves every step from 5 to 9
    assert load_then_step(lambda self, sd: None) == [9.0] * 4
    megatron_load = cls.load_state_dict
    try:
        cpu_runtime.activate(device)
        assert cls.load_state_dict is not megatron_load
        # the installed wrapper around a stand-in for Megatron's body (no process group needed)
        fixed = cpu_runtime._distopt_load_state_dict(lambda self, sd: None)
        assert load_then_step(fixed) == [6.0] * 4
    finally:
        cpu_runtime.deactivate()
    assert cls.load_state_dict is megatron_load
    monkeypatch.setattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)  # FusedAdam: not installed on CUDA
    try:
        cpu_runtime.activate("cuda")
        assert cls.load_state_dict is megatron_load
    finally:
        cpu_runtime.deactivate()


@pins("recompute-cuda-rng")
def test_activation_recompute_saves_the_cuda_generator():
    """Megatron's CheckpointFunction saves the CUDA generator (fails on CPU torch); the runtime's
    stand-ins leave the CPU generator, which the same functions save and restore, in charge
    (train.recompute=full|selective end to end: tests/test_train_invariance.py)."""
    from megatron.core.tensor_parallel import random as mrandom

    from gspo_megatron.parallel import cpu_runtime

    assert "torch.cuda.random.get_rng_state" in inspect.getsource(mrandom._get_cuda_rng_state)
    assert "_get_cuda_rng_state(" in inspect.getsource(mrandom._get_all_rng_states)
    with pytest.raises((AssertionError, RuntimeError)):
        mrandom._get_cuda_rng_state()
    try:
        cpu_runtime.activate("cpu")
        cpu_runtime.seed_model_parallel_rng(3, 0, 0, 0)
        states = mrandom._get_all_rng_states()
        a = torch.rand(4)
        mrandom._set_all_rng_states(*states)
        torch.testing.assert_close(torch.rand(4), a, rtol=0, atol=0)
    finally:
        cpu_runtime.deactivate()


@pins("te-fp8-recompute-names")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_checkpoint_without_output_asks_te_for_fp8(device):
    """Selective recompute of norms/activations (CheckpointWithoutOutput) asks TE's FP8 state even
    with fp8 off; without TE the name is unbound, on every device (the 30B preset's
    train.recompute=selective on a GPU without TE). The runtime binds a no-FP8 stand-in."""
    from megatron.core.tensor_parallel import random as mrandom

    from gspo_megatron.parallel import cpu_runtime

    if mrandom.HAVE_TE:
        pytest.skip("Transformer Engine installed: the name is bound")
    assert mrandom.CheckpointWithoutOutput().fp8 is True  # default fp8=False -> "is not None"
    assert not hasattr(mrandom, "FP8GlobalStateManager")
    x = torch.randn(3, requires_grad=True)

    def run():
        ck = mrandom.CheckpointWithoutOutput()
        y = ck.checkpoint(torch.sin, x)
        z = y * 2
        ck.discard_output_and_register_recompute(z)
        z.sum().backward()
        return x.grad.clone()

    try:
        cpu_runtime.activate(device)
        assert mrandom.FP8GlobalStateManager is cpu_runtime._NoFP8
        assert mrandom.activation_recompute_forward is cpu_runtime._null_context
        if device == "cuda":
            return  # the recompute itself saves CUDA RNG states: run below on CPU with the same stand-ins
        stand_in = mrandom.FP8GlobalStateManager
        del mrandom.FP8GlobalStateManager  # the runtime minus this one entry
        with pytest.raises(NameError):
            run()
        x.grad = None
        mrandom.FP8GlobalStateManager = stand_in
        torch.testing.assert_close(run(), 2 * torch.cos(x.detach()))
    finally:
        cpu_runtime.deactivate()
    assert not hasattr(mrandom, "FP8GlobalStateManager")


@pins("rope-cp-slice")
def test_rope_cp_slice_needs_cuda_and_the_replacement_slices_the_same():
    """Megatron's RoPE slice for a CP rank moves its indices to CUDA; the runtime's version takes
    the same zigzag rows (checked against parallel/seq_reduce.py zigzag_positions)."""
    from megatron.core.models.common.embeddings import rope_utils

    from gspo_megatron.parallel import cpu_runtime
    from gspo_megatron.parallel.seq_reduce import zigzag_positions

    was = cpu_runtime.is_active()
    cpu_runtime.deactivate()
    try:
        emb = torch.arange(16.0).view(16, 1, 1, 1)
        with pytest.raises((RuntimeError, AssertionError)):
            rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _Group(2, 1))
    finally:
        if was:
            cpu_runtime.activate("cpu")
    for cp in (2, 4):
        for r in range(cp):
            got = cpu_runtime._get_pos_emb_on_this_cp_rank(emb, 0, _Group(cp, r))
            assert got.flatten().tolist() == zigzag_positions(16, cp, r).float().tolist()


def test_yarn_rotary_embedding_runs_on_cpu_with_transformers_frequencies():
    """Megatron's YaRN RoPE (MLA's, DeepSeek-V3's) puts its tables on torch.cuda.current_device()
    at construction; under the runtime it builds on CPU, its frequencies are transformers' YaRN
    ones (modeling_rope_utils._compute_yarn_parameters, the independent reference), and a CP rank
    gets its zigzag rows (the module binds get_pos_emb_on_this_cp_rank by name)."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import _compute_yarn_parameters

    from gspo_megatron.parallel import cpu_runtime
    from gspo_megatron.parallel.seq_reduce import zigzag_positions

    yarn = dict(rope_theta=10000.0, factor=40.0, original_max_position_embeddings=64, beta_fast=32.0,
                beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)

    def build():
        return YarnRotaryEmbedding(16, rotary_base=yarn["rope_theta"], scaling_factor=yarn["factor"],
                                   original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                   mscale=1.0, mscale_all_dim=1.0)

    was = cpu_runtime.is_active()
    cpu_runtime.deactivate()
    try:
        with pytest.raises((RuntimeError, AssertionError)):
            build()
    finally:
        cpu_runtime.activate("cpu")
    try:
        rope = build()
        emb, _ = rope(16)
        hf = DeepseekV3Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=16, qk_nope_head_dim=32,
                              v_head_dim=32, kv_lora_rank=32, q_lora_rank=48, max_position_embeddings=2560,
                              rope_parameters={"rope_type": "yarn", **yarn})
        inv_freq, _ = _compute_yarn_parameters(hf, "cpu")
        assert emb.device.type == "cpu" and emb.shape == (16, 1, 1, 16)
        torch.testing.assert_close(emb[:, 0, 0, :8], torch.outer(torch.arange(16.0), inv_freq))
        for r in range(2):
            mine, _ = rope.forward.__wrapped__(rope, 16, cp_group=_Group(2, r))
            torch.testing.assert_close(mine, emb[zigzag_positions(16, 2, r)])
    finally:
        if not was:
            cpu_runtime.deactivate()


# ---------------------------------------------------------------------------------------------
# skip_compiled_fusions: Megatron's torch.compile-decorated kernels, which CPU runs never call


def test_jit_stand_in_defines_what_megatron_jit_defines():
    """The stand-in module (cpu_runtime.skip_compiled_fusions) defines exactly the names
    megatron/core/jit.py defines, read from the installed file (not imported: importing it is
    what the stand-in avoids)."""
    import ast
    import importlib.util

    from gspo_megatron.parallel.cpu_runtime import JIT_MODULE_NAMES

    spec = importlib.util.find_spec("megatron")
    path = f"{spec.submodule_search_locations[0]}/core/jit.py"
    tree = ast.parse(open(path).read())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    assert names == set(JIT_MODULE_NAMES), path
    assert "jit_fuser = torch.compile" in open(path).read()  # what the stand-in replaces


def _rank_jit_calls(rank, world):
    """A fresh process: record every call of a jit_fuser-decorated Megatron function while the
    CPU model takes an optimizer step (forward, backward, Adam)."""
    import sys

    from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

    skip_compiled_fusions()  # a no-op when dist_utils already did it for this process
    assert "megatron.core" not in sys.modules
    called, decorated = [], []

    def recorder(fn):
        decorated.append(fn.__qualname__)

        def wrapped(*a, **k):
            called.append(f"{fn.__module__}.{fn.__qualname__}")
            return fn(*a, **k)
        return wrapped

    sys.modules["megatron.core.jit"].jit_fuser = recorder
    from test_dist_optimizer import _train  # noqa: E402 - after the recorder is in place

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import TrainSample
    from megatron_utils import random_sequences, tiny_hf_config

    arch = MoeArch.from_hf_dict(tiny_hf_config(num_hidden_layers=2).to_dict(), source="test")
    ctx = init_parallel(ParallelConfig(), model_dims=arch.dims_for_validation())
    try:
        seqs = random_sequences(300, [9, 14, 6, 11], seed=5)
        _, _, _, _, moved, _ = _train(ctx, arch, torch.float32, True, [TrainSample(s[:3], s[3:], 0.0) for s in seqs], 1.0)
    finally:
        destroy_parallel()
    return {"called": called, "moved": moved, "inductor": "torch._inductor.compile_fx" in sys.modules,
            "decorated": decorated}


@pytest.mark.timeout(180)
def test_cpu_model_step_runs_the_fusions_eagerly_without_inductor():
    out = run_distributed(_rank_jit_calls, 1, timeout=150, fresh=True)[0]
    assert out["moved"] > 0  # the step ran
    assert len(out["decorated"]) >= 10  # the recorder did wrap Megatron's decorated functions
    # ... and the one the CPU model calls is the router's expert-bias update (router.py:531), which
    # only adds to a counter when expert bias is on (never for Qwen3-MoE): eager or traced by
    # Dynamo, the same result
    assert set(out["called"]) == {"megatron.core.transformer.moe.router.TopKRouter._apply_expert_bias"}
    assert not out["inductor"]  # the point: Inductor's compiler is never imported (nor anything traced)
