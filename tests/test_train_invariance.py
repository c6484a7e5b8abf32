"""The trainer's GSPO loss through Megatron's schedules: value and gradients equal the
single-process reference (transformers' model of the family + the pure gspo_loss, autograd) for
any layout and microbatch count. Exercises the normalisation contract of train/loss.py. The
first family runs every case; every other family the family suite's layouts
(test_every_family_gspo_step_matches_the_reference)."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import FAMILIES, hf_token_logprobs, hub_named_grads, make_tiny_hf, random_sequences

RTOL = 2e-4  # relative to each gradient tensor's scale, fp32


def make_samples(model, seed=3):
    """Prompt/response pairs with π_old = π + noise (so some sequences are clipped)."""
    from gspo_megatron.train.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    seqs = random_sequences(300, [9, 14, 6, 11, 17, 8, 12, 5], seed=seed)
    with torch.no_grad():
        lps = hf_token_logprobs(model, seqs)
    samples = []
    for i, (s, lp) in enumerate(zip(seqs, lps)):
        p = 2 + i % 3  # prompt length
        resp_lp = lp[p - 1:]
        noise = 2e-3 * torch.randn(resp_lp.shape, generator=g)
        adv = float(torch.randn((), generator=g))
        samples.append(TrainSample(s[:p], s[p:], adv, (resp_lp + noise).tolist()))
    return samples


KL_COEF = 0.1
REF_SHIFT = 0.05  # π_ref = π_old - 0.05 per token: a non-zero KL with a non-trivial gradient


def reference_loss_and_grads(model, samples, eps_low, eps_high, kl=False):
    from gspo_megatron.algorithms import gspo_loss

    model.zero_grad()
    seqs = [x.prompt_ids + x.response_ids for x in samples]
    lps = hf_token_logprobs(model, seqs)
    T = max(len(x.response_ids) for x in samples)
    B = len(samples)
    lp = torch.zeros(B, T)
    old = torch.zeros(B, T)
    mask = torch.zeros(B, T, dtype=torch.bool)
    rows = []
    for i, (x, l) in enumerate(zip(samples, lps)):
        r = len(x.response_ids)
        rows.append(l[len(x.prompt_ids) - 1:])
        old[i, :r] = torch.tensor(x.engine_logprobs)
        mask[i, :r] = True
    lp = torch.stack([torch.nn.functional.pad(r, (0, T - len(r))) for r in rows])
    adv = torch.tensor([x.advantage for x in samples])
    kw = dict(ref_log_probs=old - REF_SHIFT, kl_coef=KL_COEF) if kl else {}
    loss, metrics = gspo_loss(lp, old, adv, mask, eps_low=eps_low, eps_high=eps_high, **kw)
    loss.backward()
    grads = hub_named_grads(model)
    return float(loss.detach()), float(metrics["clip_frac"]), grads


def _rank_train(rank, world, hf_dir, layout, samples, token_budget, eps, kl=False, fused=False, recompute="none",
                packed=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.export import grad_tensor, iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import plan_minibatch
    from gspo_megatron.train.loss import LossSettings, policy_loss_step
    from gspo_megatron.train.metrics import reduce_report
    from gspo_megatron.train.scoring import pad_multiple

    par = ParallelConfig(**layout)
    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    chunks, tcfg = build_policy(ctx, arch, hf_dir=hf_dir, fused_logprobs=fused, recompute=recompute)
    tot_cfg = {k: getattr(tcfg, k) for k in ("recompute_granularity", "recompute_method", "recompute_modules")}
    model = wrap_ddp(chunks, tcfg)
    mbs, _ = plan_minibatch(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=token_budget,
                            multiple=pad_multiple(par), cp=par.cp, cp_rank=ctx.cp_rank, packed=packed)
    for mb in mbs:
        mb.old_logprobs = mb.engine_logprobs
        if kl:
            mb.ref_logprobs = mb.engine_logprobs - REF_SHIFT
    settings = LossSettings("gspo", eps[0], eps[1], kl_coef=KL_COEF if kl else 0.0)
    step = policy_loss_step(ctx, arch.vocab_size, settings)
    reports = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
        seq_length=max(mb.seq_length for mb in mbs), micro_batch_size=mbs[0].micro_batch_size,
        forward_only=False)
    reporter = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0
    tot = reduce_report(reports, reporter, ("loss", "sequences", "clip_frac"), ctx.device)
    grads = dict(iter_hf_tensors(model, ctx, arch, tensor_of=grad_tensor))
    n_micro = len(mbs)
    destroy_parallel()
    if recompute != "none":
        return (tot, grads, tot_cfg) if rank == 0 else None
    return (tot, grads, n_micro) if rank == 0 else None


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = make_tiny_hf(d)
    samples = make_samples(model)
    return str(d), model, samples


CASES = [
    pytest.param(1, dict(), 10_000, id="tp1-1micro"),
    pytest.param(1, dict(), 40, id="tp1-many-micro"),
    pytest.param(2, dict(), 60, id="dp2"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, id="tp2-sp"),
    pytest.param(2, dict(pp=2), 40, id="pp2"),
    pytest.param(2, dict(ep=2), 40, id="ep2"),
]


CP_CASES = [  # context parallelism (padded [b, s] and packed THD) and packing at the other layouts
    pytest.param(2, dict(cp=2), 10_000, False, id="cp2-padded"),
    pytest.param(2, dict(cp=2), 40, True, id="cp2-packed-many-micro"),
    pytest.param(4, dict(cp=2, tp=2, sequence_parallel=True), 10_000, False, id="cp2xtp2-sp-padded"),
    pytest.param(4, dict(cp=2, tp=2, sequence_parallel=True), 10_000, True, id="cp2xtp2-sp-packed"),
    pytest.param(4, dict(cp=2, ep=2), 40, True, id="cp2xep2-packed"),
    pytest.param(1, dict(), 40, True, id="tp1-packed-many-micro"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, True, id="tp2-sp-packed"),
    pytest.param(2, dict(pp=2), 40, True, id="pp2-packed"),
    pytest.param(2, dict(ep=2), 40, True, id="ep2-packed"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout,budget,packed", CP_CASES)
def test_context_parallel_and_packed_steps_match_the_reference(setup, world, layout, budget, packed):
    """CP splits every sequence into zigzag chunks (targets and masks built on the full sequence
    first; the per-sequence statistics summed over CP, the sequence count taken once); packing
    puts a microbatch's sequences in one THD row. Loss and every gradient equal the single-process
    reference. Before CP was split in the trainer every CP rank held whole sequences: on CPU
    Megatron's attention refused cp > 1, and on a GPU the gradients came out cp times too large
    (every CP rank back-propagated every token, the count was taken once) with TE attending over
    the wrong positions."""
    _check_against_reference(setup, world, layout, budget, (3e-4, 4e-4), packed=packed)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.2, 0.27)], ids=["paper-eps", "grpo-eps"])
@pytest.mark.parametrize("world,layout,budget", CASES)
def test_gspo_step_matches_single_process_reference(setup, world, layout, budget, eps):
    _check_against_reference(setup, world, layout, budget, eps)


@pytest.fixture(scope="module")
def family_setups(tmp_path_factory):
    built = {}

    def get(family):
        if family not in built:
            d = tmp_path_factory.mktemp(f"hf-{family}")
            model = make_tiny_hf(d, family=family)
            built[family] = (str(d), model, make_samples(model))
        return built[family]

    return get


FAMILY_CASES = [
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, False, id="tp2-sp"),
    pytest.param(2, dict(ep=2), 40, False, id="ep2"),
    pytest.param(2, dict(pp=2), 40, False, id="pp2"),
    pytest.param(2, dict(cp=2), 40, True, id="cp2-packed"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", FAMILIES[1:])
@pytest.mark.parametrize("world,layout,budget,packed", FAMILY_CASES)
def test_every_family_gspo_step_matches_the_reference(family_setups, family, world, layout, budget, packed):
    """GLM-4.5's dense first layer, shared expert, sigmoid routing with its expert bias, partial
    RoPE and QKV biases under each layout: the GSPO step's loss and gradients equal transformers'
    Glm4MoeForCausalLM + gspo_loss in one process."""
    _check_against_reference(family_setups(family), world, layout, budget, (3e-4, 4e-4), packed=packed)


def _check_against_reference(setup, world, layout, budget, eps, packed=False):
    hf_dir, model, samples = setup
    ref = reference_loss_and_grads(model, samples, *eps)
    assert_step_matches(hf_dir, samples, ref, world, layout, budget, eps, packed)


def assert_step_matches(hf_dir, samples, ref, world, layout, budget, eps, packed) -> tuple[float, str]:
    """One trainer step at `layout` (_rank_train) against `ref` = (loss, clip_frac, Hub-named
    grads): loss, clip fraction and every gradient within the tolerances. Returns the worst
    relative gradient difference and where."""
    ref_loss, ref_clip, ref_grads = ref
    tot, grads, n_micro = run_distributed(_rank_train, world, hf_dir, layout, samples, budget, eps, False, False,
                                          "none", packed, timeout=280)[0]
    if budget < 100:
        assert n_micro >= 2  # the microbatch split is really exercised
    n = tot["sequences"]
    assert n == len(samples)
    assert tot["loss"] / n == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert tot["clip_frac"] / n == pytest.approx(ref_clip, abs=1e-6)
    worst = max(((grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12), k)
                for k in ref_grads)
    assert worst[0] <= RTOL, f"relative gradient difference {worst[0]:.2e} at {worst[1]}"
    if eps[0] < 0.01:
        assert 0 < ref_clip < 1  # tight clipping is active on some sequences, not all
    return worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(tp=2, sequence_parallel=True))], ids=["tp1", "tp2-sp"])
def test_kl_penalty_reaches_the_gradient(setup, world, layout):
    """kl_coef is honoured for GSPO (a known peer pitfall is to ignore it silently)."""
    hf_dir, model, samples = setup
    ref_loss, _, ref_grads = reference_loss_and_grads(model, samples, 3e-4, 4e-4, kl=True)
    plain_loss, _, _ = reference_loss_and_grads(model, samples, 3e-4, 4e-4)
    assert abs(ref_loss - plain_loss) > 1e-4  # the KL term changes the objective
    tot, grads, _ = run_distributed(_rank_train, world, hf_dir, layout, samples, 10_000, (3e-4, 4e-4), True,
                                    timeout=280)[0]
    assert tot["loss"] / tot["sequences"] == pytest.approx(ref_loss, rel=1e-4)
    worst = max((grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12)
                for k in ref_grads)
    assert worst <= RTOL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout,budget", [
    pytest.param(1, dict(), 40, id="tp1-many-micro"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, id="tp2-sp"),
    pytest.param(2, dict(pp=2), 40, id="pp2"),
    pytest.param(2, dict(ep=2), 40, id="ep2"),
])
def test_fused_logprob_head_matches_reference(setup, world, layout, budget):
    """model.fused_logprobs: the last stage returns hidden states and the loss uses the fused
    hidden -> log-prob path; loss and every gradient (output layer and the layers below, whose
    hidden gradient the TP region wrapper must reduce) equal the reference."""
    hf_dir, model, samples = setup
    ref_loss, _, ref_grads = reference_loss_and_grads(model, samples, 3e-4, 4e-4)
    tot, grads, _ = run_distributed(_rank_train, world, hf_dir, layout, samples, budget, (3e-4, 4e-4), False, True,
                                    timeout=280)[0]
    assert tot["loss"] / tot["sequences"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    worst = max(((grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12), k)
                for k in ref_grads)
    assert worst[0] <= RTOL, f"relative gradient difference {worst[0]:.2e} at {worst[1]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", ["full", "selective"])
@pytest.mark.parametrize("world,layout,budget", [
    pytest.param(1, dict(), 40, id="tp1-many-micro"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, id="tp2-sp"),
])
def test_activation_recompute_matches_reference(setup, world, layout, budget, recompute):
    """train.recompute reaches Megatron's TransformerConfig and changes nothing but memory: loss and
    every gradient equal the reference (which is what recompute=none gives, tests above)."""
    hf_dir, model, samples = setup
    ref_loss, _, ref_grads = reference_loss_and_grads(model, samples, 3e-4, 4e-4)
    tot, grads, tcfg = run_distributed(_rank_train, world, hf_dir, layout, samples, budget, (3e-4, 4e-4), False,
                                       False, recompute, timeout=280)[0]
    assert tcfg["recompute_granularity"] == recompute
    if recompute == "full":
        assert tcfg["recompute_method"] == "uniform"
    else:  # CPU spec: no grouped-GEMM experts, so no moe_act (GPU adds it)
        assert tcfg["recompute_modules"] == ["core_attn", "layernorm"]
    assert tot["loss"] / tot["sequences"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    worst = max(((grads[k] - ref_grads[k]).abs().max().item() / (ref_grads[k].abs().max().item() + 1e-12), k)
                for k in ref_grads)
    assert worst[0] <= RTOL, f"relative gradient difference {worst[0]:.2e} at {worst[1]}"
