"""Megatron-Core vs transformers on the same tiny random checkpoint, for every model family
(Qwen3MoeForCausalLM; Glm4MoeForCausalLM with a dense first layer, a shared expert, sigmoid routing
with a non-zero expert bias, partial RoPE and QKV biases).

For each layout: the weights exported back to Hub names equal the checkpoint's bit for bit (the
HF -> Megatron -> HF round trip), per-token log-probs through Megatron's schedules (forward-only)
and the gradients of the mean token NLL (Megatron DDP + finalize_model_grads, exported back to Hub
names by the streaming exporter) must equal the transformers reference computed in this process.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import FAMILIES, add_mtp_layer, hf_mean_nll_grads, hf_token_logprobs, make_tiny_hf, random_sequences

LOGPROB_TOL = 1e-5
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


def nll_backward(chunks, tcfg, ctx, par, arch, seqs):
    """Wrap `chunks` in Megatron DDP and run the mean token NLL of `seqs` forward and backward
    through Megatron's schedules (several microbatches; DDP + finalize_model_grads reduce the
    gradients into each parameter's main_grad); the wrapped model."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.train.batch import TrainSample, plan_minibatch
    from gspo_megatron.train.scoring import pad_multiple

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
    return model


def _rank_parity(rank, world, hf_dir, layout, seqs, grads_too=True):
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.export import grad_tensor, iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.scoring import score_sequences

    par = ParallelConfig(**layout)
    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    chunks, tcfg = build_policy(ctx, arch, hf_dir=hf_dir)
    weights = dict(iter_hf_tensors(chunks, ctx, arch))  # HF -> Megatron -> HF
    lps = score_sequences(chunks, ctx, seqs, vocab_size=arch.vocab_size, micro_batch_tokens=48)
    if not grads_too:  # (the NLL step below has no context-parallel split; CP's gradients: test_train_invariance)
        destroy_parallel()
        return (lps, None, weights) if rank == 0 else None

    model = nll_backward(chunks, tcfg, ctx, par, arch, seqs)
    grads = dict(iter_hf_tensors(model, ctx, arch, tensor_of=grad_tensor))
    destroy_parallel()
    return (lps, grads, weights) if rank == 0 else None


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """family -> (hf_dir, sequences, reference log-probs, reference gradients, checkpoint tensors),
    built on first use."""
    from safetensors.torch import load_file

    built = {}

    def get(family):
        if family not in built:
            d = tmp_path_factory.mktemp(f"hf-{family}")
            model = make_tiny_hf(d, family=family)
            if family == "deepseek_v3":  # as DeepSeek-V3 ships: an MTP layer, read past (not the policy's)
                add_mtp_layer(d)
            seqs = random_sequences(300, LENGTHS)
            with torch.no_grad():
                lps = hf_token_logprobs(model, seqs)
            grads = hf_mean_nll_grads(model, seqs)
            stored = {}
            for f in sorted(d.glob("*.safetensors")):
                stored.update(load_file(str(f)))
            stored = {k: v for k, v in stored.items() if not k.startswith("model.layers.4.")}  # the MTP layer
            built[family] = (str(d), seqs, lps, grads, stored)
        return built[family]

    return get


LAYOUTS = [
    pytest.param(1, dict(), id="tp1"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), id="tp2-sp"),
    pytest.param(2, dict(ep=2), id="ep2"),
    pytest.param(2, dict(pp=2), id="pp2"),
    pytest.param(2, dict(cp=2), id="cp2"),
    pytest.param(4, dict(tp=2, ep=2, sequence_parallel=True), id="tp2xep2"),
    pytest.param(4, dict(pp=2, ep=2), id="pp2xep2"),
    pytest.param(2, dict(tp=2, etp=2, sequence_parallel=True), id="tp2-etp2"),
]
# Every family runs the layouts of the family suite (docs/design.md "Adding a model family"); the
# first family also the combined ones.
FAMILY_LAYOUTS = ("tp1", "tp2-sp", "ep2", "pp2", "cp2", "tp2-etp2")
CASES = [pytest.param(fam, *p.values, id=f"{fam}-{p.id}") for fam in FAMILIES for p in LAYOUTS
         if fam == FAMILIES[0] or p.id in FAMILY_LAYOUTS]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family,world,layout", CASES)
def test_logprobs_and_grads_match_transformers(references, family, world, layout):
    hf_dir, seqs, ref_lps, ref_grads, stored = references(family)
    grads_too = layout.get("cp", 1) == 1
    lps, grads, weights = run_distributed(_rank_parity, world, hf_dir, layout, seqs, grads_too, timeout=360)[0]
    # the round trip: every tensor of the checkpoint comes back bit for bit, and nothing else
    assert set(weights) == set(stored)
    for n, t in stored.items():
        assert weights[n].dtype == t.dtype and torch.equal(weights[n], t), n
    assert len(lps) == len(seqs)
    worst_lp = 0.0
    for s, got, want in zip(seqs, lps, ref_lps):
        assert len(got) == len(s) - 1
        worst_lp = max(worst_lp, (torch.tensor(got, dtype=torch.float64) - want.double()).abs().max().item())
    print(f"{family} {layout}: max |log-prob - transformers'| {worst_lp:.2e}")
    assert worst_lp <= LOGPROB_TOL
    if not grads_too:
        return
    # buffers (the router's expert bias) are weights but are not trained: exported as zero gradients
    frozen = {n for n in grads if n.endswith("e_score_correction_bias")}
    assert all(not grads[n].any() for n in frozen)
    grads = {n: g for n, g in grads.items() if n not in frozen}
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
