"""The trainer's loss options through Megatron's schedules: for gspo_token, grpo, tis_cap (with
π_old ≠ π_engine), entropy_coef (at a rollout temperature), and kl_coef on a token loss, the loss
and every gradient equal the single-process reference (transformers' Qwen3MoeForCausalLM + the
pure functions of gspo_megatron.algorithms, autograd) at TP2+SP, PP2 and EP2, padded and packed.
Each case also checks that its option is really exercised (clipping partial, TIS cap active,
the option moving the gradient far beyond the tolerance)."""
from __future__ import annotations

import math

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import hub_named_grads, make_tiny_hf, random_sequences
from test_train_invariance import REF_SHIFT, RTOL, make_samples

SEVERAL = 50 * RTOL  # an option "changes the gradient" when it moves it by more than this


def shifted_old(engine: torch.Tensor, shift: float) -> torch.Tensor:
    """π_old = π_engine - shift * sin(100 π_engine): a deterministic, sign-varying offset that is
    a function of the value alone (so every layout and the reference agree), 0 where engine is 0
    (off the loss mask)."""
    if not shift:
        return engine.clone()
    return engine - shift * torch.sin(100.0 * engine)


def make_tempered_samples(model, temperature, seed=3):
    """make_samples' sequences with engine log-probs of the tempered policy softmax(logits / T)."""
    from gspo_megatron.train.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    seqs = random_sequences(300, [9, 14, 6, 11, 17, 8, 12, 5], seed=seed)
    samples = []
    with torch.no_grad():
        for i, s in enumerate(seqs):
            lp, _ = _token_logprobs_and_entropy(model, s, temperature)
            p = 2 + i % 3
            noise = 2e-3 * torch.randn(lp[p - 1:].shape, generator=g)
            adv = float(torch.randn((), generator=g))
            samples.append(TrainSample(s[:p], s[p:], adv, (lp[p - 1:] + noise).tolist()))
    return samples


def _token_logprobs_and_entropy(model, seq, temperature):
    logits = model(torch.tensor([seq])).logits[0, :-1].float() / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)  # entropy of softmax(logits / T), as parallel/logprobs.py
    return lp, ent


def reference(model, samples, settings, old_shift, tis_engine="engine"):
    """Single-process loss, metrics and Hub-named gradients for LossSettings(**settings).
    tis_engine="old" feeds π_old where π_engine belongs (the mix-up the tests must tell apart)."""
    from gspo_megatron.algorithms import cispo_loss, grpo_loss, gspo_loss, gspo_token_loss

    fn = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss, "cispo": cispo_loss}[settings["type"]]
    temperature = settings.get("temperature", 1.0)
    model.zero_grad()
    B, T = len(samples), max(len(x.response_ids) for x in samples)
    eng, mask = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
    lps, ents = [], []
    for i, x in enumerate(samples):
        lp_i, ent_i = _token_logprobs_and_entropy(model, x.prompt_ids + x.response_ids, temperature)
        p, r = len(x.prompt_ids), len(x.response_ids)
        lps.append(torch.nn.functional.pad(lp_i[p - 1:], (0, T - r)))
        ents.append(torch.nn.functional.pad(ent_i[p - 1:], (0, T - r)))
        eng[i, :r] = torch.tensor(x.engine_logprobs)
        mask[i, :r] = True
    lp, ent = torch.stack(lps), torch.stack(ents)
    old = shifted_old(eng, old_shift)
    adv = torch.tensor([x.advantage for x in samples])
    icepop_masked = 0
    if settings.get("icepop") is not None:
        # float64: a token whose π_old / π_engine lies outside [alpha, beta] leaves the loss
        lo, hi = settings["icepop"]
        ratio = torch.exp(old.double() - eng.double())
        keep = mask & (ratio >= lo) & (ratio <= hi)
        icepop_masked = int((mask & ~keep).sum())
        mask = keep
    coef = settings.get("entropy_coef", 0.0)
    opts = dict(entropy=ent if coef else ent.detach(), entropy_coef=coef)
    if settings.get("kl_coef"):
        opts.update(ref_log_probs=old - REF_SHIFT, kl_coef=settings["kl_coef"])
    if settings.get("tis_cap") is not None:
        opts.update(engine_log_probs=eng if tis_engine == "engine" else old, tis_cap=settings["tis_cap"])
    rows = torch.arange(B)
    if settings.get("mis") is not None:
        # float64: a sequence's mean log(π_old / π_engine) outside [low, high] leaves the loss;
        # the normaliser stays B (the loss over the kept sequences only, / B)
        d = ((old.double() - eng.double()) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        lo, hi = settings["mis"]
        rows = torch.nonzero((d >= lo) & (d <= hi)).flatten()
        opts = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in opts.items()} | {"num_sequences": B}
    eps = settings.get("cispo_eps", (settings.get("eps_low"), settings.get("eps_high")))
    loss, metrics = fn(lp[rows], old[rows], adv[rows], mask[rows], eps_low=eps[0], eps_high=eps[1], **opts)
    loss.backward()
    grads = hub_named_grads(model)
    model.zero_grad()
    extra = {}
    with torch.no_grad():  # TIS activity: fraction of weights (sequence or token) at the cap
        if settings.get("tis_cap") is not None:
            log_w = old - eng
            if settings["type"] != "grpo":
                log_w = (log_w.sum(-1) / mask.sum(-1)).unsqueeze(-1).expand_as(log_w)
            extra["tis_capped"] = float((log_w >= math.log(settings["tis_cap"]))[mask].float().mean())
    extra["mis_masked"] = B - len(rows)
    extra["icepop_masked"] = icepop_masked
    return float(loss.detach()), {k: float(v) for k, v in metrics.items()} | extra, grads


def rel_diff(a, b):
    """(worst over tensors of max |a - b| / max |b|, its name)."""
    return max(((a[k] - b[k]).abs().max().item() / (b[k].abs().max().item() + 1e-12), k) for k in b)


def _rank_train_options(rank, world, hf_dir, layout, samples, budget, settings_kwargs, old_shift, packed):
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
    chunks, tcfg = build_policy(ctx, arch, hf_dir=hf_dir)
    model = wrap_ddp(chunks, tcfg)
    mbs, _ = plan_minibatch(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=budget,
                            multiple=pad_multiple(par), cp=par.cp, cp_rank=ctx.cp_rank, packed=packed)
    settings = LossSettings(**{"eps_low": 0.2, "eps_high": 0.27, **settings_kwargs})
    for mb in mbs:
        mb.old_logprobs = shifted_old(mb.engine_logprobs, old_shift)
        if settings.kl_coef:
            mb.ref_logprobs = mb.old_logprobs - REF_SHIFT
    step = policy_loss_step(ctx, arch.vocab_size, settings)
    reports = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
        seq_length=max(mb.seq_length for mb in mbs), micro_batch_size=mbs[0].micro_batch_size,
        forward_only=False)
    reporter = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0
    tot = reduce_report(reports, reporter, ("loss", "loss_norm", "sequences", "entropy", "tis_weight_mean",
                                            "mis_masked", "icepop_masked", "icepop_tokens", "metric_weight",
                                            "kl_ref", "clip_frac"), ctx.device)
    grads = dict(iter_hf_tensors(model, ctx, arch, tensor_of=grad_tensor))
    n_micro = len(mbs)
    destroy_parallel()
    return (tot, grads, n_micro) if rank == 0 else None


TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = make_tiny_hf(d)
    return str(d), model, {1.0: make_samples(model), TEMPERATURE: make_tempered_samples(model, TEMPERATURE)}


TP2SP, PP2, EP2 = dict(tp=2, sequence_parallel=True), dict(pp=2), dict(ep=2)
SHIFT = 0.2  # π_old - π_engine up to ±0.2 per token

# (layout, budget, packed, LossSettings kwargs, old_shift, options that must move the gradient)
CASES = [
    # GSPO-token (sg[s_i] times a one-token factor) and its per-sequence normalisation over microbatches
    pytest.param(TP2SP, 40, False, dict(type="gspo_token", eps_low=3e-4, eps_high=4e-4), 0.0, None,
                 id="gspo_token-tp2sp"),
    # GRPO's token-level ratio and asymmetric clip on packed THD rows across pipeline stages
    pytest.param(PP2, 40, True, dict(type="grpo", eps_low=1.5e-3, eps_high=3e-3), 0.0, None,
                 id="grpo-pp2-packed"),
    # sequence-level TIS: min(geo-mean π_old/π_engine, cap), from the engine's log-probs, not π_old's
    pytest.param(EP2, 40, False, dict(type="gspo", eps_low=0.01, eps_high=0.015, tis_cap=1.0), SHIFT, "tis_cap",
                 id="gspo-tis-ep2"),
    # token-level TIS for GRPO, engine log-probs reaching _token_options
    pytest.param(TP2SP, 10_000, False, dict(type="grpo", eps_low=0.1, eps_high=0.15, tis_cap=1.1), SHIFT,
                 "tis_cap", id="grpo-tis-tp2sp"),
    # TIS reaches GSPO-token (through the stats' tis_logratio_sum and tis_cap)
    pytest.param(PP2, 40, False, dict(type="gspo_token", eps_low=0.01, eps_high=0.015, tis_cap=1.0), SHIFT,
                 "tis_cap", id="gspo_token-tis-pp2"),
    # entropy bonus of the tempered policy (value and gradient, /T) with experts split
    pytest.param(EP2, 40, True, dict(type="gspo", eps_low=3e-4, eps_high=4e-4, entropy_coef=0.05,
                                     temperature=TEMPERATURE), 0.0, "entropy_coef", id="gspo-entropy-T0.7-ep2-packed"),
    # sequence-level mismatch masking (loss.mis) of π_old vs π_engine, GSPO and a token loss, over
    # microbatches (EP2) and zigzag CP halves of each sequence (CP2: the band is on the whole sequence)
    pytest.param(EP2, 40, False, dict(type="gspo", eps_low=0.01, eps_high=0.015, mis=(-0.045, 0.045)), SHIFT, "mis",
                 id="gspo-mis-ep2"),
    pytest.param(dict(cp=2), 60, True, dict(type="grpo", eps_low=0.1, eps_high=0.15, mis=(-0.015, 0.015)), SHIFT,
                 "mis", id="grpo-mis-cp2-packed"),
    # token-level losses under CP: gradients per rank's tokens, the reported loss and metrics
    # combined over the CP ranks (each holds a zigzag half of every sequence)
    pytest.param(dict(cp=2), 60, True, dict(type="gspo_token", eps_low=0.01, eps_high=0.015, entropy_coef=0.05,
                                             kl_coef=0.1), SHIFT, "entropy_coef+kl_coef", id="gspo_token-kl-entropy-cp2-packed"),
    # entropy assembled over vocab shards, and kl_coef honoured by a token loss
    pytest.param(TP2SP, 40, True, dict(type="grpo", eps_low=1.5e-3, eps_high=3e-3, entropy_coef=0.05, kl_coef=0.1),
                 0.0, "entropy_coef+kl_coef", id="grpo-entropy-kl-tp2sp-packed"),
    # CISPO: the clipped, stop-gradient IS weight times log π, aggregated over the minibatch's
    # tokens (each rank's token sum, Megatron dividing by every rank's loss tokens)
    pytest.param(TP2SP, 40, False, dict(type="cispo", cispo_eps=(0.002, 0.002)), 0.0, None, id="cispo-tp2sp"),
    pytest.param(PP2, 40, True, dict(type="cispo", cispo_eps=(0.002, 0.002), entropy_coef=0.05), 0.0,
                 "entropy_coef", id="cispo-entropy-pp2-packed"),
    pytest.param(EP2, 40, False, dict(type="cispo", cispo_eps=(1.0, 0.001), tis_cap=1.0), SHIFT, "tis_cap",
                 id="cispo-tis-ep2"),
    pytest.param(dict(cp=2), 60, True, dict(type="cispo", cispo_eps=(0.1, 0.1), kl_coef=0.1), SHIFT, "kl_coef",
                 id="cispo-kl-cp2-packed"),
    # IcePop: tokens whose π_old / π_engine leaves [alpha, beta] leave the loss, for a sequence
    # loss (its |y_i| shrinks), a token loss and CISPO; per rank's tokens under CP
    pytest.param(EP2, 40, False, dict(type="gspo", eps_low=0.01, eps_high=0.015, icepop=(0.9, 1.1)), SHIFT, "icepop",
                 id="gspo-icepop-ep2"),
    pytest.param(dict(cp=2), 60, True, dict(type="gspo", eps_low=0.01, eps_high=0.015, icepop=(0.9, 1.1)), SHIFT,
                 "icepop", id="gspo-icepop-cp2-packed"),
    pytest.param(TP2SP, 40, True, dict(type="grpo", eps_low=0.1, eps_high=0.15, icepop=(0.85, 1.15)), SHIFT, "icepop",
                 id="grpo-icepop-tp2sp-packed"),
    pytest.param(PP2, 40, False, dict(type="cispo", cispo_eps=(0.05, 0.05), icepop=(0.9, 1.1)), SHIFT, "icepop",
                 id="cispo-icepop-pp2"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,budget,packed,settings,old_shift,option", CASES)
def test_loss_option_matches_single_process_reference(setup, layout, budget, packed, settings, old_shift, option):
    """Loss, reported entropy (and GSPO's TIS weight mean) and every gradient equal the reference;
    clipping is partial; an option under test moves the reference gradient by >> RTOL; with
    tis_cap some weights sit at the cap and some not, and feeding π_old as π_engine would be
    caught (π_old ≠ π_engine)."""
    hf_dir, model, by_t = setup
    samples = by_t[settings.get("temperature", 1.0)]
    ref_loss, ref_m, ref_grads = reference(model, samples, settings, old_shift)

    # non-vacuous: clipping is partial, and each option really reaches the gradient
    assert 0 < ref_m["clip_frac"] < 1, ref_m["clip_frac"]
    for opt in option.split("+") if option else ():
        off = {opt: None if opt in ("tis_cap", "mis", "icepop") else 0.0}
        assert rel_diff(reference(model, samples, settings | off, old_shift)[2], ref_grads)[0] > SEVERAL, opt
    if option == "mis":  # some sequences masked, some kept
        assert 0 < ref_m["mis_masked"] < len(samples), ref_m["mis_masked"]
    if option == "icepop":  # some tokens masked, some kept
        assert 0 < ref_m["icepop_masked"] < sum(len(x.response_ids) for x in samples), ref_m["icepop_masked"]
    if option == "tis_cap":
        assert 0 < ref_m["tis_capped"] < 1, ref_m["tis_capped"]
        mixed = reference(model, samples, settings, old_shift, tis_engine="old")[2]
        assert rel_diff(mixed, ref_grads)[0] > SEVERAL

    tot, grads, n_micro = run_distributed(_rank_train_options, 2, hf_dir, layout, samples, budget, settings,
                                          old_shift, packed, timeout=280)[0]
    if budget < 100:
        assert n_micro >= 2  # the microbatch split (the per-sequence normalisation) is exercised
    n = tot["sequences"]
    assert n == len(samples)
    assert tot["mis_masked"] == ref_m["mis_masked"]  # exactly the sequences outside the band
    assert tot["icepop_masked"] == ref_m["icepop_masked"]  # exactly the tokens outside the band
    if settings.get("icepop") is not None:
        assert tot["icepop_tokens"] == sum(len(x.response_ids) for x in samples)
    # the loss over its normaliser: sequences, or for CISPO the loss tokens (the reference's own)
    assert tot["loss_norm"] == (ref_m["tokens"] if settings["type"] == "cispo" else n)
    assert tot["loss"] / tot["loss_norm"] == pytest.approx(ref_loss, rel=1e-4, abs=1e-6)
    assert tot["metric_weight"] == n - ref_m["mis_masked"]  # metrics are means over the sequences in the loss
    assert tot["entropy"] / tot["metric_weight"] == pytest.approx(ref_m["entropy"], rel=1e-4)
    if settings.get("kl_coef"):
        assert tot["kl_ref"] / tot["metric_weight"] == pytest.approx(ref_m["kl_ref"], rel=1e-4)
    if settings["type"] == "gspo":  # a fraction of sequences: exact over microbatches too
        assert tot["clip_frac"] / tot["metric_weight"] == pytest.approx(ref_m["clip_frac"], abs=1e-6)
    if settings.get("tis_cap") is not None and settings["type"] == "gspo":  # a sequence mean: exact
        assert tot["tis_weight_mean"] / tot["metric_weight"] == pytest.approx(ref_m["tis_weight_mean"], rel=1e-5)
    worst = rel_diff(grads, ref_grads)
    print(f"max relative gradient difference {worst[0]:.2e} at {worst[1]}")
    assert worst[0] <= RTOL, f"relative gradient difference {worst[0]:.2e} at {worst[1]}"
