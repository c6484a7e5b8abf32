"""Megatron optimizer + LR schedule from the config."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def build_optimizer(opt_cfg, model, *, total_steps: int = 1, dtype=torch.float32):
    """Megatron's optimizer (Adam, grad clipping, fp32 master weights for 16-bit params) and its
    OptimizerParamScheduler, over the DDP-wrapped chunks `model`.

    Whether it is the distributed optimizer (fp32 masters and Adam moments sharded over DP,
    gradients reduce-scattered, parameters all-gathered) is read from the DDP wrap, not from
    `opt_cfg`: Megatron's DDP must have been built with the same flag (it pads buckets to a
    multiple of DP and allocates the parameter buffer the optimizer shards; DistributedOptimizer
    asserts the padding and start_param_sync asserts the flag), so one value decides both — the
    one setup.py passes to wrap_ddp from optimizer.use_distributed_optimizer. On CPU it runs
    through parallel/cpu_runtime.py (gloo)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = uses_distributed_optimizer(model)
    lr = opt_cfg.lr
    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min(opt_cfg.min_lr, lr),
        weight_decay=opt_cfg.weight_decay,
        adam_beta1=opt_cfg.adam_beta1,
        adam_beta2=opt_cfg.adam_beta2,
        adam_eps=opt_cfg.adam_eps,
        clip_grad=opt_cfg.clip_grad,
        use_distributed_optimizer=distributed,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        # float16: dynamic loss scaling from 2^16 (torch.amp.GradScaler's start) rather than
        # Megatron's 2^32, which skips the first ~30 updates while it backs off (hysteresis 2):
        # a short warm start would never step
        initial_loss_scale=2.0 ** 16,
    )
    optimizer = get_megatron_optimizer(config, model)
    fuse_cpu_adam(optimizer, model)
    # Megatron builds an optimizer for every parameter-group kind any rank has (optimizer/__init__.py
    # all-gathers the keys), so a pipeline stage without MoE layers holds an expert optimizer with
    # no parameters; over torch's Adam its checkpoint step comes from these siblings
    # (parallel/cpu_runtime.py _distopt_state_dict).
    inner = inner_optimizers(optimizer)
    for opt in inner:
        opt.gspo_siblings = [o for o in inner if o is not opt]
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt_cfg.warmup_steps else lr,
        max_lr=lr,
        min_lr=config.min_lr,
        lr_warmup_steps=opt_cfg.warmup_steps,
        lr_decay_steps=max(total_steps, opt_cfg.warmup_steps + 1),
        lr_decay_style=opt_cfg.lr_decay_style,
        start_wd=opt_cfg.weight_decay,
        end_wd=opt_cfg.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def fuse_cpu_adam(optimizer, model) -> int:
    """CPU runtime: torch's fused AdamW kernel (one C++ pass over every tensor of a group)
    instead of the per-tensor Python loop torch picks for CPU tensors by default. Without
    Transformer Engine or Apex, Megatron builds torch.optim.AdamW (megatron/core/optimizer/
    __init__.py:10-32, :360) with neither `foreach` nor `fused`, and torch then only chooses
    foreach for CUDA tensors: on CPU every update walked ~50 tensors one at a time in Python
    (4.4 ms per update for the demo model; fused: 0.7 ms). The fused kernel is the same Adam; its
    results differ from the loop's in the last float32 bit (~1e-8). On GPU Megatron's TE/Apex
    FusedAdam is used and this changes nothing (it only touches torch Adam over CPU tensors).

    The choice is the run's, by construction, never a checkpoint's: it is made from the model's
    device (every chunk of `model`), so an optimizer holding no parameter on this rank (a pipeline
    stage without MoE layers has an empty expert optimizer) is switched too, and checkpoint.load
    calls this again after load_state_dict, which replaces every group key with the saved one
    (torch/optim/optimizer.py load_state_dict, update_group). Before both, stage 0's empty expert
    optimizer wrote unfused groups into the common state and stage 1's experts resumed on the
    per-tensor loop: a resume differed from the uninterrupted run in the last bit of every
    expert weight (tests/test_model_families.py, the stage-without-MoE resume). Returns the
    number of param groups switched."""
    if any(p.device.type != "cpu" for m in model for p in m.parameters()):
        return 0
    n = 0
    for opt in inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam):  # AdamW is an Adam subclass in torch 2.x
            continue
        for g in inner.param_groups:
            if g.get("differentiable") or g.get("capturable"):
                continue
            g["fused"], g["foreach"] = True, False
            n += 1
    return n


def uses_distributed_optimizer(model) -> bool:
    flags = {m.ddp_config.use_distributed_optimizer for m in model}
    if len(flags) != 1:
        raise ValueError("model chunks were wrapped with different use_distributed_optimizer settings")
    return flags.pop()


def inner_optimizers(optimizer) -> list:
    """Megatron optimizers under `optimizer` (a ChainedOptimizer holds one for dense and one for
    expert parameters)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def reset_optimizer_state(optimizer) -> None:
    """Adam as if it had never stepped — moments and step counts zeroed in place (what Adam
    initialises them to) — while the fp32 master weights are kept. In place rather than
    `state.clear()`: Megatron's DistributedOptimizer.state_dict() over torch's Adam asserts that
    every state holds a step (distrib_optimizer.py, state_dict: `assert len(steps) == 1`)."""
    for opt in inner_optimizers(optimizer):
        for st in opt.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "master_param":
                    v.zero_()
                elif k == "step":
                    st[k] = 0
        for g in opt.optimizer.param_groups:
            if "step" in g:
                g["step"] = 0



def set_lr(optimizer, lr: float) -> None:
    """A fixed learning rate for every group until the scheduler's next step()."""
    for g in optimizer.param_groups:
        g["lr"] = lr


def prepare_grads_in_lockstep(optimizer) -> bool:
    """ChainedOptimizer.prepare_grads with one loss scale for the whole model. Returns whether a
    (scaled) gradient was not finite on any rank; then the step is skipped everywhere.

    With fp16, Megatron chains one optimizer for the dense and one for the expert parameters, each
    with its own DynamicGradScaler, but the schedules scale the loss with the first one's scale only
    (ChainedOptimizer.get_loss_scale, optimizer.py:1137-1139) while each sub-optimizer unscales its
    gradients by its own scale and backs off on its own overflows (prepare_grads, :524-557,
    :1233-1239). After expert-only overflows the expert scale falls while the loss keeps being
    scaled by the dense one: the expert gradients come out too large by the ratio, and they
    overflow again at every step, which is skipped forever. Here every sub-optimizer's gradients
    are copied and unscaled as Megatron does (the same calls), the overflow flags are combined over
    the sub-optimizers and the ranks (their grad-stats groups differ: model parallel for the dense
    part, expert model parallel for the experts), and every scaler is updated with that one flag,
    so all scales stay equal to the one the loss is scaled by. bf16 / fp32 (no scaler): Megatron's
    own prepare_grads."""
    from gspo_megatron.parallel.state import any_rank

    opts = inner_optimizers(optimizer)
    scaled = [o for o in opts if getattr(o, "grad_scaler", None) is not None]
    if not scaled:
        return bool(optimizer.prepare_grads())
    found = False
    for o in opts:
        if getattr(o, "grad_scaler", None) is None:
            found |= bool(o.prepare_grads())
            continue
        if not getattr(o, "is_stub_optimizer", False):
            o._copy_model_grads_to_main_grads()
        found |= bool(o._unscale_main_grads_and_check_for_nan())  # reduced over its grad-stats group
    found = any_rank(found, scaled[0].found_inf.device)
    for o in scaled:
        o.grad_scaler.update(found)
    return found


def guarded_step(optimizer) -> tuple[bool, float]:
    """Megatron's optimizer step with one change: an update whose gradient norm is not finite is
    skipped (the weights and Adam's moments stay as they were). Returns (stepped, grad_norm).

    Megatron skips only for fp16, where the loss scaler finds the inf (prepare_grads); for bf16 and
    fp32 it computes the norm, clips by it and steps whatever it is: with a NaN norm the clip
    coefficient is NaN, `clip_coeff < 1.0` is false, nothing is scaled and Adam writes NaN into every
    weight (megatron/core/optimizer/clip_grads.py:172-177, optimizer.py:593-623). This is
    ChainedOptimizer.step (optimizer.py:1308-1340; get_megatron_optimizer always returns one,
    __init__.py:689) with the norm checked between computing it and clipping by it: the same calls in
    the same order, so a finite step is bit for bit Megatron's. The norm is reduced over the
    gradient-statistics group (model parallel, and data parallel with the distributed optimizer),
    so every rank takes the same decision. An fp16 overflow skip returns (False, nan): the scaled
    gradient was not finite, and the loop counts it with the other skipped updates (Megatron's step
    returns no norm, which was logged as a grad norm of 0.0). The fp16 gradients are unscaled and
    checked by `prepare_grads_in_lockstep`, not ChainedOptimizer.prepare_grads (see there). One
    more difference: the norm is computed with clip_grad=0 too, where Megatron skips it. Imports from optimizer.py's own namespace, where the CPU runtime
    patches the clip (parallel/cpu_runtime.py)."""
    import math

    from megatron.core.optimizer import optimizer as mopt

    if prepare_grads_in_lockstep(optimizer):  # fp16: a scaled gradient overflowed; every scaler backed off
        return False, float("nan")
    grad_norm = optimizer.get_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else 0.0
    if not math.isfinite(grad_norm):
        return False, grad_norm
    for opt in inner_optimizers(optimizer):
        if getattr(opt, "is_stub_optimizer", False):
            continue
        params = opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            mopt.clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                              use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return bool(optimizer.step_with_ready_grads()), grad_norm
