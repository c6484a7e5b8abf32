"""Megatron optimizer + LR schedule from the config."""
from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def build_optimizer(opt_cfg, model, ctx, *, lr: float | None = None, total_steps: int = 1, dtype=torch.float32):
    """Megatron's optimizer (Adam, grad clipping, fp32 master weights for 16-bit params) and its
    OptimizerParamScheduler. On CPU the distributed optimizer is replaced by the plain one: its
    buffers assume CUDA (see parallel/cpu_runtime.py); gradients are still DP-reduced by DDP."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    distributed = opt_cfg.use_distributed_optimizer
    if distributed and ctx.device.type == "cpu":
        log.info("optimizer.use_distributed_optimizer ignored on CPU (Megatron's needs CUDA)")
        distributed = False
    lr = opt_cfg.lr if lr is None else lr
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
    )
    optimizer = get_megatron_optimizer(config, model)
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
