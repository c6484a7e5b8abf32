"""Build this rank's model chunks and fill them with weights (HF or Megatron checkpoint)."""
from __future__ import annotations

import torch

from gspo_megatron.model import mapping
from gspo_megatron.model.hf_io import HFCheckpointReader, load_hf_into_model
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.model.spec import build_model_chunks

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def mark_expert_params(model: torch.nn.Module, arch: MoeArch) -> None:
    """Reduce expert gradients over the expert-data-parallel group, also when EP == 1.

    Megatron-Core 0.16.1 marks expert weights `allreduce=False` (reduce over the expert-DP group)
    only when expert_model_parallel_size > 1. With EP=1, ETP=1 and TP>1 (sequence parallel),
    every TP rank runs the full experts on its own token shard, so the expert gradient must be
    summed over the TP ranks too — which is the expert-DP group, not the DP group Megatron then
    uses. tests/test_megatron_parity.py::...[tp2-sp] fails without this. (Here, not in
    spec.build_model_chunks: the map belongs to the family.)
    """
    for name, p in model.named_parameters():
        if mapping.match(name, arch).rule.kind.is_expert:
            setattr(p, "allreduce", False)


def build_policy(ctx, arch: MoeArch, *, hf_dir: str | None = None, dtype=torch.float32, recompute="none",
                 reader: HFCheckpointReader | None = None, fused_logprobs: bool = False, routing_replay: bool = False,
                 local_spec: bool = False):
    """Model chunks for this rank; loaded from `hf_dir` when given (else Megatron's random init).

    ``fused_logprobs``: the last stage returns final hidden states instead of logits, for the
    fused hidden -> log-prob path (parallel/fused_head.py); train/loss.py picks the path from the
    model, so every forward step works with either. `local_spec`: spec.py build_model_chunks."""
    chunks, config = build_model_chunks(arch, ctx, dtype=dtype, recompute=recompute, routing_replay=routing_replay,
                                        local_spec=local_spec)
    for chunk in chunks:
        mark_expert_params(chunk, arch)
    if fused_logprobs:
        from gspo_megatron.parallel.fused_head import install_hidden_head

        for chunk in chunks:
            if chunk.post_process:
                install_hidden_head(chunk, ctx.tp_group)
    if hf_dir is not None or reader is not None:
        reader = reader or HFCheckpointReader(hf_dir)
        load_hf_into_model(
            chunks, reader, arch,
            tp_rank=ctx.tp_rank, tp=ctx.parallel.tp, ep_rank=ctx.ep_rank, ep=ctx.parallel.ep,
            etp_rank=ctx.etp_rank, etp=ctx.parallel.etp,
        )
    return chunks, config
