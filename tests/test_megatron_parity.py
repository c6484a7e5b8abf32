"""Megatron-Core Qwen3-MoE vs transformers' Qwen3MoeForCausalLM on the same tiny random checkpoint.

For each layout: per-token log-probs through Megatron's schedules (forward-only) and the gradients
of the mean token NLL (Megatron DDP + finalize_model_grads, exported back to Hub names by the
streaming exporter) must equal the transformers reference computed in this process.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import hf_mean_nll_grads, hf_token_logprobs, make_tiny_hf, random_sequences

LOGPROB_TOL = 1e-4
GRAD_RTOL = 1e-4  # fp32, relative to the tensor's largest entry
LENGTHS = [5, 17, 9, 12, 3, 20]


def nll_forward_step(ctx, vocab_size):
    from gspo_megatron.parallel.logprobs import vocab_parallel_log_probs

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        tokens = mb.tokens
        b, s = tokens.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        out = model(tokens, pos, None)

        def loss_func(logits):
            lp = vocab_parallel_log_probs(logits, torch.roll(tokens, -1, 1), group=ctx.tp_group, vocab_size=vocab_size)
            mask = mb.loss_mask
            n = mask.sum()
            return -(lp * mask).sum(), n.to(torch.int), {}

        return out, loss_func

    return forward_step


def _rank_parity(rank, world, hf_dir, layout, seqs):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.export import grad_tensor, iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.qwen3_moe import Qwen3MoeArch
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import TrainSample, plan_minibatch
    from gspo_megatron.train.scoring import pad_multiple, score_sequences

    par = ParallelConfig(**layout)
    arch = Qwen3MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    chunks, tcfg = build_policy(ctx, arch, hf_dir=hf_dir)
    lps = score_sequences(chunks, ctx, seqs, vocab_size=arch.vocab_size, micro_batch_tokens=48)

    model = wrap_ddp(chunks, tcfg)
    for m in model:
        m.train()
    # "prompt" = first token: the loss covers every next-token prediction; several microbatches
    mbs, _ = plan_minibatch([TrainSample(s[:1], s[1:], 0.0) for s in seqs], dp=ctx.dp, dp_rank=ctx.dp_rank,
                            token_budget=48, multiple=pad_multiple(par))
    get_forward_backward_func()(
        forward_step_func=nll_forward_step(ctx, arch.vocab_size), data_iterator=iter(mbs), model=model,
        num_microbatches=len(mbs), seq_length=max(mb.tokens.shape[1] for mb in mbs),
        micro_batch_size=mbs[0].tokens.shape[0],
        forward_only=False,
    )
    grads = dict(iter_hf_tensors(model, ctx, arch, tensor_of=grad_tensor))
    destroy_parallel()
    return (lps, grads) if rank == 0 else None


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = make_tiny_hf(d)
    seqs = random_sequences(300, LENGTHS)
    with torch.no_grad():
        lps = hf_token_logprobs(model, seqs)
    grads = hf_mean_nll_grads(model, seqs)
    return str(d), seqs, lps, grads


LAYOUTS = [
    pytest.param(1, dict(), id="tp1"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), id="tp2-sp"),
    pytest.param(2, dict(ep=2), id="ep2"),
    pytest.param(2, dict(pp=2), id="pp2"),
    pytest.param(4, dict(tp=2, ep=2, sequence_parallel=True), id="tp2xep2"),
    pytest.param(4, dict(pp=2, ep=2), id="pp2xep2"),
    pytest.param(2, dict(tp=2, etp=2, sequence_parallel=True), id="tp2-etp2"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_logprobs_and_grads_match_transformers(reference, world, layout):
    hf_dir, seqs, ref_lps, ref_grads = reference
    lps, grads = run_distributed(_rank_parity, world, hf_dir, layout, seqs, timeout=360)[0]
    assert len(lps) == len(seqs)
    for s, got, want in zip(seqs, lps, ref_lps):
        assert len(got) == len(s) - 1
        assert (torch.tensor(got) - want).abs().max().item() <= LOGPROB_TOL
    assert set(grads) == set(ref_grads)
    # relative to each tensor's scale: gradients here range from 1e-6 to 1e-1
    worst = max(
        ((grads[n] - ref_grads[n]).abs().max().item() / (ref_grads[n].abs().max().item() + 1e-12), n)
        for n in ref_grads
    )
    print(f"worst relative gradient difference {worst[0]:.2e} at {worst[1]}")
    assert worst[0] <= GRAD_RTOL, f"relative gradient difference {worst[0]:.2e} at {worst[1]}"
    # not vacuous: every gradient the loss reaches is non-zero (experts may go unrouted)
    assert min(g.abs().max().item() for n, g in ref_grads.items() if "experts" not in n) > 1e-6
