"""Megatron-Core model of any family: a MoeArch -> TransformerConfig, layer specs, builder.

The family gives the Megatron options its features map to (`ModelFamily.megatron_options`); the
layout, dtype, recompute and RL choices are the same for every family and live here.
"""
from __future__ import annotations

import torch

from gspo_megatron.errors import ModelConfigError
from gspo_megatron.model.arch import MoeArch


def transformer_config(
    arch: MoeArch,
    parallel,
    *,
    dtype: torch.dtype = torch.float32,
    use_te: bool = False,
    dispatcher: str | None = None,
    recompute: str = "none",
    routing_replay: bool = False,
    router_fusion: bool = False,
):
    """Megatron TransformerConfig for `arch` under `parallel` (a gspo_megatron.config.ParallelConfig).

    ``routing_replay``: every router gets Megatron's RouterReplay (record / replay top-k;
    parallel/routing_replay.py drives it); with no action set it routes as usual.
    ``router_fusion``: Transformer Engine's fused top-k router (moe_router_fusion, GPU); refused
    together with routing replay (`check_routing_replay`).

    RL-specific choices: no auxiliary load-balancing loss (the policy gradient is the only
    objective, as RL peers do), fp32 routing (router decisions are sensitive to rounding, and
    train/inference routing mismatch is what GSPO's sequence ratio has to absorb), no dropout.

    ``recompute`` (train.recompute): "full" recomputes each layer from its input (uniform, one
    layer per checkpoint); "selective" recomputes core attention and the two RMSNorms, plus the
    experts' SwiGLU ("moe_act") where Megatron allows it — with grouped-GEMM experts (the TE spec,
    GPU); TransformerConfig refuses moe_act otherwise (transformer_config.py, __post_init__).
    """
    if dispatcher is None:
        # The alltoall dispatcher's uneven all-gather over the expert-TP group is unsupported by
        # gloo; the allgather dispatcher is exact there too.
        dispatcher = "alltoall" if (use_te or parallel.etp == 1) else "allgather"
    # Pipeline stages exchange activations whose shape changes per microbatch (padded batches of
    # varying length): Megatron then sends shapes first. It refuses that mode with the allgather
    # dispatcher, which is why expert-TP > 1 with PP > 1 is GPU-only (alltoall on NCCL).
    variable_seq_lengths = parallel.pp > 1
    if variable_seq_lengths and dispatcher == "allgather":
        raise ModelConfigError(
            "parallel.etp > 1 together with parallel.pp > 1 needs the alltoall MoE dispatcher, which "
            "gloo (CPU) cannot run with expert-TP; use etp=1 or pp=1 on CPU"
        )
    family_options = arch.family.megatron_options(arch)
    if arch.dense_layers:
        # Megatron's pattern of MoE (1) and dense (0) layers; it also makes checkpoints key each layer
        # apart (transformer_block.py:830-834, non_homogeneous_layers)
        family_options["moe_layer_freq"] = [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)]
    config_class = arch.family.megatron_config_class(arch)  # TransformerConfig, or a subclass (MLA's)
    config = config_class(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,  # must be explicit: heads*head_dim != hidden for Qwen3-MoE
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=use_te,
        moe_permute_fusion=False,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        context_parallel_size=parallel.cp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not use_te,
        perform_initialization=True,
        persist_layer_norm=False,
        bias_dropout_fusion=use_te,
        apply_rope_fusion=use_te,
        masked_softmax_fusion=use_te,
        gradient_accumulation_fusion=False,
        **recompute_settings(recompute, grouped_experts=use_te),
        variable_seq_lengths=variable_seq_lengths,
        moe_enable_routing_replay=routing_replay,
        moe_router_fusion=router_fusion,
        **family_options,
    )
    check_routing_replay(config)
    return config


def check_routing_replay(config) -> None:
    """Refuse, in one line, a TransformerConfig whose routing replay would be silently off.

    megatron-core 0.16.1 transformer/moe/moe_utils.py topk_routing_with_score_function: with
    `fused` (config.moe_router_fusion) it returns TE's fused top-k at lines 652-668, before the
    RouterReplay branch at 702-705 is reached, so a replaying router would route afresh while R2/R3
    believe they replay (tests/test_routing_replay.py reads that order in the installed source)."""
    if getattr(config, "moe_enable_routing_replay", False) and getattr(config, "moe_router_fusion", False):
        raise ModelConfigError(
            "moe_router_fusion with routing replay (train.routing_replay / rollout.return_routing): "
            "megatron-core 0.16.1's fused router returns before RouterReplay runs, so replay would be "
            "silently off; turn the router fusion off")


def megatron_layer_spec(config, is_moe: bool, use_te: bool, **megatron_kwargs):
    """One decoder layer's ModuleSpec from Megatron-Core's GPT layer-spec builders: the Transformer
    Engine spec (GPU: grouped-GEMM experts, fused norm + linear) or the local (portable) spec, MoE
    or dense, q/k norms as `config.qk_layernorm`; `megatron_kwargs` go to the builder (e.g.
    multi_latent_attention=True). What a family's `layer_spec` starts from; `layer_block_spec`
    puts the CPU runtime's modules into a local spec (`cpu_layer_spec`)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = config.num_moe_experts if is_moe else None
    if use_te:
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=is_moe, qk_layernorm=config.qk_layernorm, **megatron_kwargs)
    return specs.get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=config.qk_layernorm,
                                          normalization="RMSNorm", **megatron_kwargs)


def cpu_layer_spec(spec):
    """A copy of a local-spec layer with the CPU runtime's modules wherever the local spec has one
    that cannot train there, at any depth (attention of any kind, its norms, the experts):

    * every RMSNorm (the local spec's torch norm refuses sequence parallel, which MoE + TP training
      requires) -> `SPRMSNorm` (model/norm.py);
    * core attention (Megatron's local DotProductAttention refuses context parallelism and packed
      THD sequences) -> `CpuCoreAttention` (parallel/cp_attention.py; on GPU TE's attention does);
    * SequentialMLP experts -> `CpuGroupedExperts` (parallel/cpu_experts.py: its parameters, its
      expert loop as two grouped GEMMs).

    By class, not by attribute name, so a family's own attention (q/kv norms under other names)
    gets the same runtime without saying so."""
    import copy
    import dataclasses

    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from gspo_megatron.model.norm import SPRMSNorm
    from gspo_megatron.parallel.cp_attention import CpuCoreAttention
    from gspo_megatron.parallel.cpu_experts import CpuGroupedExperts

    swaps = {LocalSpecProvider().layer_norm(rms_norm=True): SPRMSNorm, DotProductAttention: CpuCoreAttention,
             SequentialMLP: CpuGroupedExperts}

    def walk(node):
        if isinstance(node, type):
            return swaps.get(node, node)
        if isinstance(node, ModuleSpec):
            node.module = swaps.get(node.module, node.module)
            node.submodules = walk(node.submodules)
            return node
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                setattr(node, f.name, walk(getattr(node, f.name)))
        return node

    return walk(copy.deepcopy(spec))


def layer_block_spec(family, config, use_te: bool, vp_stage: int | None = None, pp_rank: int | None = None):
    """TransformerBlockSubmodules for this rank's layers (MoE or dense by config.moe_layer_freq),
    each `family`'s layer spec (`ModelFamily.layer_spec`: Megatron's Transformer Engine spec on
    GPU, its local spec on CPU with the CPU runtime's modules put in by `cpu_layer_spec`)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    freq = config.moe_layer_freq
    pattern = freq if isinstance(freq, list) else [int(i % freq == 0) for i in range(config.num_layers)]
    moe = [bool(pattern[offset + i]) for i in range(n)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        te = {m: family.layer_spec(config, m, True) for m in set(moe)}
        return TransformerBlockSubmodules(layer_specs=[te[m] for m in moe], layer_norm=TENorm)

    from gspo_megatron.model.norm import SPRMSNorm

    built = {m: cpu_layer_spec(family.layer_spec(config, m, False)) for m in set(moe)}
    return TransformerBlockSubmodules(layer_specs=[built[m] for m in moe], layer_norm=SPRMSNorm)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def build_gpt_model(arch: MoeArch, config, *, pre_process: bool, post_process: bool, use_te: bool):
    """One pipeline stage of the GPTModel (Megatron's global parallel state must exist)."""
    from megatron.core.models.gpt import GPTModel

    spec = layer_block_spec(arch.family, config, use_te)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        **arch.family.gpt_model_options(arch),  # position embedding: the family's (RoPE, YaRN, ...)
    )


def recompute_settings(recompute: str, *, grouped_experts: bool) -> dict:
    """TransformerConfig fields for train.recompute = none | selective | full."""
    if recompute == "none":
        return {}
    if recompute == "full":
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if recompute == "selective":
        modules = ["core_attn", "layernorm"] + (["moe_act"] if grouped_experts else [])
        return dict(recompute_granularity="selective", recompute_modules=modules)
    raise ValueError(f"train.recompute must be none, selective or full, got {recompute!r}")


def build_model_chunks(arch: MoeArch, ctx, *, dtype: torch.dtype = torch.float32, recompute: str = "none",
                       routing_replay: bool = False, local_spec: bool = False):
    """This rank's model chunk(s) for the layout in `ctx` (a parallel.state.ParallelContext).

    Returns (chunks, transformer_config). One chunk per rank (no virtual pipeline stages yet).
    The expert parameters are marked for the expert-DP gradient reduction by the caller,
    model/factory.py build_policy (mark_expert_params reads the family's HF <-> Megatron map).
    `local_spec`: Megatron's own layers on CUDA too, not Transformer Engine's (LoRA's adapters
    hook Megatron's Column/RowParallelLinear: model/lora.py; TE's fused layernorm-linear and
    grouped expert GEMMs are not hooked yet, docs/lora.md).
    """
    from gspo_megatron.model import rope

    rope.install()  # packed RoPE's cos/sin once per microbatch where TE's fused kernel is not used
    arch.family.install_megatron_patches(arch)  # where Megatron computes unlike the family's reference
    use_te = ctx.device.type == "cuda" and not local_spec and te_available()
    if arch.tie_word_embeddings and ctx.parallel.pp > 1 and ctx.device.type == "cpu":
        # Megatron moves the last stage's copy of the shared embedding with `.cuda()`.
        raise ModelConfigError("tie_word_embeddings with parallel.pp > 1 is GPU-only (Megatron syncs the "
                               "shared embedding with .cuda()); use pp=1 on CPU")
    config = transformer_config(arch, ctx.parallel, dtype=dtype, use_te=use_te, recompute=recompute,
                                routing_replay=routing_replay)
    model = build_gpt_model(arch, config, pre_process=ctx.is_first_stage, post_process=ctx.is_last_stage, use_te=use_te)
    model.to(ctx.device)
    return [model], config
