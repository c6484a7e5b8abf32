"""GSPO / GSPO-token / GRPO losses and group advantages against an independent float64 reading.

The references below are written with plain Python loops over sequences and tokens, in float64
(Python floats), with hand-derived gradients - they share no code with the implementation.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from gspo_megatron.algorithms import (
    MAX_LOG_RATIO,
    SequenceStats,
    group_advantages,
    grpo_loss,
    gspo_loss,
    gspo_loss_from_stats,
    gspo_sequence_stats,
    gspo_token_loss,
)
from gspo_megatron.parallel.seq_reduce import pack_sequences, packed_sequence_sum

PAPER = (3e-4, 4e-4)
GRPO_EPS = (0.2, 0.27)
BOUND = 20.0


# ---------------------------------------------------------------------------------------------
# float64 loop references
# ---------------------------------------------------------------------------------------------


def _clamp(x, lo, hi):
    return min(max(x, lo), hi)


def _surrogate_and_slope(ratio, adv, el, eh):
    """min(ratio*A, clip(ratio)*A) and its derivative w.r.t. ratio (the derivative is A when the
    unclipped branch is active or the clip is a no-op, 0 when the clipped branch wins)."""
    un = ratio * adv
    cl = _clamp(ratio, 1 - el, 1 + eh) * adv
    if un < cl:
        return un, adv
    if un > cl:
        return cl, 0.0
    return un, (adv if 1 - el <= ratio <= 1 + eh else 0.0)


def _k3_and_dlp(ref, lp):
    """k3 = e^d - d - 1 with d = clamp(ref - lp); d k3 / d lp."""
    d_raw = ref - lp
    d = _clamp(d_raw, -BOUND, BOUND)
    inside = -BOUND <= d_raw <= BOUND
    return math.exp(d) - d - 1, (-(math.exp(d) - 1) if inside else 0.0)


def ref_loss(kind, lp, old, adv, mask, el, eh, *, ref=None, kl_coef=0.0, ent=None, ent_coef=0.0,
             eng=None, tis_cap=None, num_sequences=None):
    """Returns (loss, d loss/d lp [B][T], d loss/d entropy [B][T], clip_frac, ratios list)."""
    B, T = len(lp), len(lp[0])
    g_lp = [[0.0] * T for _ in range(B)]
    g_ent = [[0.0] * T for _ in range(B)]
    idxs = [[t for t in range(T) if mask[i][t]] for i in range(B)]
    nvalid = sum(1 for ix in idxs if ix)
    N = num_sequences if num_sequences is not None else max(nvalid, 1)
    loss = 0.0
    clipped, counted, ratios = 0, 0, []
    for i in range(B):
        ix = idxs[i]
        if not ix:
            continue
        n = len(ix)
        a = lambda t: adv[i][t] if isinstance(adv[i], list) else adv[i]  # noqa: E731
        li = 0.0
        if kind in ("gspo", "gspo_token"):
            ls = sum(lp[i][t] - old[i][t] for t in ix) / n
            inside = -BOUND <= ls <= BOUND
            s = math.exp(_clamp(ls, -BOUND, BOUND))
            ratios.append(s)
            w = 1.0
            if tis_cap is not None:
                w = min(math.exp(sum(old[i][t] - eng[i][t] for t in ix) / n), tis_cap)
            if kind == "gspo":
                term, slope = _surrogate_and_slope(s, a(ix[0]), el, eh)
                li -= w * term
                for t in ix:  # d s / d lp_t = s / n
                    g_lp[i][t] -= w * slope * (s / n if inside else 0.0) / N
                A = a(ix[0])
                clipped += (A > 0 and s > 1 + eh) or (A < 0 and s < 1 - el)
                counted += 1
            else:
                for t in ix:
                    term, slope = _surrogate_and_slope(s, a(t), el, eh)
                    li -= w * term / n
                    g_lp[i][t] -= w * slope * (s if inside else 0.0) / n / N
                    A = a(t)
                    clipped += (A > 0 and s > 1 + eh) or (A < 0 and s < 1 - el)
                    counted += 1
        else:  # grpo
            for t in ix:
                lr_raw = lp[i][t] - old[i][t]
                inside = -BOUND <= lr_raw <= BOUND
                r = math.exp(_clamp(lr_raw, -BOUND, BOUND))
                ratios.append(r)
                w = 1.0
                if tis_cap is not None:
                    w = min(math.exp(old[i][t] - eng[i][t]), tis_cap)
                term, slope = _surrogate_and_slope(r, a(t), el, eh)
                li -= w * term / n
                g_lp[i][t] -= w * slope * (r if inside else 0.0) / n / N
                A = a(t)
                clipped += (A > 0 and r > 1 + eh) or (A < 0 and r < 1 - el)
                counted += 1
        if ref is not None and kl_coef:
            for t in ix:
                k, dk = _k3_and_dlp(ref[i][t], lp[i][t])
                li += kl_coef * k / n
                g_lp[i][t] += kl_coef * dk / n / N
        if ent is not None and ent_coef:
            for t in ix:
                li -= ent_coef * ent[i][t] / n
                g_ent[i][t] -= ent_coef / n / N
        loss += li / N
    clip_frac = clipped / counted if counted else 0.0
    return loss, g_lp, g_ent, clip_frac, ratios


# ---------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------

LENGTHS = [1, 3, 17, 120, 0, 64, 2, 90]  # very different lengths, one empty mask


def make_batch(seed, eps, lengths=LENGTHS, T=128, extreme=True, garbage=True, token_adv=False):
    """[B, T] float64 inputs: per-sequence log-ratio offsets chosen to land on both sides of the
    clip range for ``eps``, plus two sequences with mean log-ratio beyond +-MAX_LOG_RATIO."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    el, eh = eps
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, L in enumerate(lengths):
        start = int(torch.randint(0, T - L + 1, (1,), generator=g)) if L < T else 0
        mask[i, start:start + L] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5 - 0.01
    scale = max(el, eh)
    offsets = torch.tensor([-3.0, -0.5, 0.3, 2.5, 0.0, -1.7, 4.0, 0.8], dtype=torch.float64)[:B]
    noise = torch.randn(B, T, generator=g, dtype=torch.float64) * scale * 2
    lp = old + offsets[:, None] * scale + noise
    if extreme:
        lp[1] = old[1] + 30.0  # mean log-ratio +30 > MAX_LOG_RATIO
        lp[6] = old[6] - 25.0  # mean log-ratio -25
    if garbage:  # values under the mask must not matter (value or gradient)
        lp[~mask] = -math.inf
        lp[0, ~mask[0]] = math.nan
    adv = torch.tensor([-1.3, -0.7, 0.9, 1.1, 0.5, 0.0, 0.6, -0.4], dtype=torch.float64)[:B]
    if token_adv:
        adv = adv[:, None] + torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    ent = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    eng = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    return dict(lp=lp, old=old, adv=adv, mask=mask, ref=ref, ent=ent, eng=eng)


def _lists(d):
    return {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in d.items()}


def run_impl(fn, d, eps, dtype=torch.float64, **opts):
    lp = d["lp"].detach().to(dtype).clone().requires_grad_(True)
    ent = d["ent"].detach().to(dtype).clone().requires_grad_(True)
    kw = dict(opts)
    if kw.pop("use_ref", False):
        kw["ref_log_probs"] = d["ref"].to(dtype)
    if kw.pop("use_ent", False):
        kw["entropy"] = ent
    if kw.pop("use_eng", False):
        kw["engine_log_probs"] = d["eng"].to(dtype)
    loss, metrics = fn(lp, d["old"].to(dtype), d["adv"].to(dtype), d["mask"],
                       eps_low=eps[0], eps_high=eps[1], **kw)
    loss.backward()
    g_ent = ent.grad if ent.grad is not None else torch.zeros_like(ent)
    return loss, lp.grad, g_ent, metrics


def run_ref(kind, d, eps, **opts):
    L = _lists(d)
    kw = {}
    if opts.get("use_ref"):
        kw.update(ref=L["ref"], kl_coef=opts.get("kl_coef", 0.0))
    if opts.get("use_ent"):
        kw.update(ent=L["ent"], ent_coef=opts.get("entropy_coef", 0.0))
    if opts.get("tis_cap") is not None:
        kw.update(eng=L["eng"], tis_cap=opts["tis_cap"])
    if "num_sequences" in opts:
        kw["num_sequences"] = opts["num_sequences"]
    loss, g_lp, g_ent, cf, ratios = ref_loss(kind, L["lp"], L["old"], L["adv"], L["mask"], *eps, **kw)
    return loss, torch.tensor(g_lp, dtype=torch.float64), torch.tensor(g_ent, dtype=torch.float64), cf, ratios


FNS = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}
OPTION_SETS = {
    "plain": {},
    "kl_entropy_tis": dict(use_ref=True, kl_coef=0.05, use_ent=True, entropy_coef=0.01, use_eng=True,
                           tis_cap=1.5),
    "num_sequences": dict(num_sequences=11),
}


def _assert_matches(kind, d, eps, opts, dtype=torch.float64, rtol=1e-9, atol=1e-12):
    loss, g_lp, g_ent, metrics = run_impl(FNS[kind], d, eps, dtype=dtype, **opts)
    r_loss, r_glp, r_gent, r_cf, r_ratios = run_ref(kind, d, eps, **opts)
    assert torch.isfinite(g_lp).all() and torch.isfinite(loss)
    torch.testing.assert_close(loss.double(), torch.tensor(r_loss, dtype=torch.float64), rtol=rtol, atol=atol)
    torch.testing.assert_close(g_lp.double(), r_glp, rtol=rtol, atol=atol)
    torch.testing.assert_close(g_ent.double(), r_gent, rtol=rtol, atol=atol)
    assert metrics["clip_frac"].item() == pytest.approx(r_cf, abs=1e-6)
    assert metrics["ratio_max"].item() == pytest.approx(max(r_ratios), rel=max(rtol, 1e-12))
    assert metrics["ratio_min"].item() == pytest.approx(min(r_ratios), rel=max(rtol, 1e-12))
    for v in metrics.values():
        assert not v.requires_grad
    return loss, g_lp, metrics


# ---------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("opts", list(OPTION_SETS), ids=list(OPTION_SETS))
@pytest.mark.parametrize("eps", [PAPER, GRPO_EPS], ids=["paper_eps", "grpo_eps"])
@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_loss_and_grad_match_float64_reference(kind, eps, opts):
    """Value, gradient (log-probs and entropy input) and clip/ratio metrics equal the loop reference,
    on a batch with lengths 0..120, mean log-ratios beyond the clamp, inf/NaN under the mask."""
    d = make_batch(seed=1, eps=eps, token_adv=(kind != "gspo"))
    loss, g_lp, metrics = _assert_matches(kind, d, eps, OPTION_SETS[opts])
    # the empty sequence (index 4) gets exactly zero gradient; the clamped ones too (GSPO)
    assert (g_lp[4] == 0).all()
    if kind == "gspo":
        assert (g_lp[1] == 0).all() and (g_lp[6] == 0).all()
        assert metrics["ratio_max"].item() == pytest.approx(math.exp(MAX_LOG_RATIO))
    # the reference actually exercises both branches of the clip for these inputs
    r = run_ref(kind, d, eps, **OPTION_SETS[opts])
    assert 0.0 < r[3] < 1.0


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_float32_inputs_close_to_float64_reference(kind):
    d = make_batch(seed=2, eps=PAPER, extreme=False, token_adv=(kind != "gspo"))
    opts = OPTION_SETS["kl_entropy_tis"]
    _assert_matches(kind, d, PAPER, opts, dtype=torch.float32, rtol=2e-4, atol=1e-6)


def test_extreme_log_ratios_stay_finite_in_float32():
    """Mean log-ratio +-200 per token: exp would overflow float32 without the named clamp."""
    lp = torch.full((3, 5), -1.0, requires_grad=True)
    old = torch.tensor([[-201.0] * 5, [199.0] * 5, [-1.0] * 5])
    mask = torch.ones(3, 5, dtype=torch.bool)
    adv = torch.tensor([-1.0, 1.0, 1.0])
    for fn in (gspo_loss, gspo_token_loss, grpo_loss):
        lp.grad = None
        loss, m = fn(lp, old, adv, mask)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
        assert m["ratio_max"].item() == pytest.approx(math.exp(MAX_LOG_RATIO), rel=1e-5)
        assert m["ratio_min"].item() == pytest.approx(math.exp(-MAX_LOG_RATIO), rel=1e-5)


@pytest.mark.parametrize("eps", [PAPER, GRPO_EPS], ids=["paper_eps", "grpo_eps"])
def test_gspo_token_equals_gspo_with_equal_token_advantages(eps):
    d = make_batch(seed=3, eps=eps)
    opts = dict(use_ref=True, kl_coef=0.1, use_ent=True, entropy_coef=0.02, use_eng=True, tis_cap=1.2)
    l1, g1, e1, m1 = run_impl(gspo_loss, d, eps, **opts)
    d_tok = dict(d, adv=d["adv"][:, None].expand(d["lp"].shape).clone())
    l2, g2, e2, m2 = run_impl(gspo_token_loss, d_tok, eps, **opts)
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(e1, e2, rtol=1e-12, atol=1e-14)
    assert g1.abs().sum() > 0


def test_gspo_differs_from_grpo_where_it_should():
    """Sanity of the references themselves: with the same eps the sequence-level and token-level
    losses give different gradients (otherwise the tests above could not tell them apart)."""
    d = make_batch(seed=4, eps=GRPO_EPS, extreme=False)
    _, g1, _, _ = run_impl(gspo_loss, d, GRPO_EPS)
    _, g2, _, _ = run_impl(grpo_loss, d, GRPO_EPS)
    assert (g1 - g2).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_empty_sequence_is_excluded_and_harmless(kind):
    """An all-zero-mask sequence (with NaN log-probs) adds no loss, no gradient, no NaN, and does
    not change the default denominator: the loss equals the loss of the batch without it."""
    d = make_batch(seed=5, eps=PAPER, extreme=False, token_adv=False)
    keep = [i for i in range(len(LENGTHS)) if LENGTHS[i] > 0]
    d["lp"][4] = math.nan
    full = run_impl(FNS[kind], d, PAPER)
    sub = {k: (v[keep] if torch.is_tensor(v) and v.dim() >= 1 and v.shape[0] == len(LENGTHS) else v)
           for k, v in d.items()}
    part = run_impl(FNS[kind], sub, PAPER)
    torch.testing.assert_close(full[0], part[0], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(full[1][keep], part[1], rtol=1e-12, atol=1e-15)
    assert (full[1][4] == 0).all()
    assert full[3]["sequences"].item() == len(keep)


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_all_empty_batch_gives_zero_not_nan(kind):
    lp = torch.full((2, 4), math.nan, requires_grad=True)
    loss, m = FNS[kind](lp, torch.zeros(2, 4), torch.ones(2), torch.zeros(2, 4, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert all(torch.isfinite(v) for v in m.values())


def test_equal_rewards_give_zero_advantages_and_zero_gradient():
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.1, 1.0, 0.0, 0.5, 0.5])
    adv = group_advantages(rewards, 4)
    assert (adv[:4] == 0).all()  # exactly, although (0.1 - mean(0.1,...)) need not be 0 in fp
    g = torch.Generator().manual_seed(0)  # the global RNG's state depends on what ran before
    lp = torch.randn(8, 6, dtype=torch.float64, generator=g).requires_grad_()
    # noise well inside the paper's clip range (3e-4 / 4e-4): with 1e-3 a draw could clip every
    # sequence of the second group and zero its gradient too (seen once in CI)
    old = lp.detach() + 1e-5 * torch.randn(8, 6, dtype=torch.float64, generator=g)
    mask = torch.ones(8, 6, dtype=torch.bool)
    loss, m = gspo_loss(lp, old, adv, mask)
    loss.backward()
    assert (lp.grad[:4] == 0).all() and lp.grad[4:].abs().sum() > 0
    assert m["sequences"].item() == 8  # zero-advantage sequences still count


def test_group_advantages_reference_and_errors():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(12, generator=g, dtype=torch.float64)
    r[6:9] = 0.7  # one all-equal group of 3
    adv = group_advantages(r, 3, eps=1e-6)
    for k in range(4):
        grp = r[3 * k:3 * k + 3].tolist()
        mu = sum(grp) / 3
        sd = math.sqrt(sum((x - mu) ** 2 for x in grp) / 2)  # Bessel
        for j in range(3):
            want = 0.0 if max(grp) == min(grp) else (grp[j] - mu) / (sd + 1e-6)
            assert adv[3 * k + j].item() == pytest.approx(want, abs=1e-12)
    assert (adv[6:9] == 0).all()
    pop = group_advantages(r, 3, unbiased=False)
    assert not torch.allclose(pop, adv)
    assert (group_advantages(torch.tensor([1.0, 2.0]), 1) == 0).all()
    with pytest.raises(ValueError, match="multiple of group_size=4"):
        group_advantages(torch.ones(10), 4)
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2, 2), 2)
    assert not torch.isnan(group_advantages(torch.zeros(8), 4)).any()


def test_clip_frac_counts_only_gradient_zeroing_side():
    el, eh = PAPER
    # s values: above, above, below, below, inside
    log_s = torch.tensor([2 * eh, 2 * eh, -2 * el, -2 * el, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=torch.float64)
    lp = torch.zeros(5, 1, dtype=torch.float64, requires_grad=True)
    old = -log_s[:, None]
    loss, m = gspo_loss(lp, old, adv, torch.ones(5, 1, dtype=torch.bool))
    loss.backward()
    assert m["clip_frac"].item() == pytest.approx(2 / 5)  # rows 0 and 2
    assert lp.grad[0].item() == 0 and lp.grad[2].item() == 0
    assert lp.grad[1].item() != 0 and lp.grad[3].item() != 0 and lp.grad[4].item() != 0


@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_microbatches_with_global_count_equal_full_batch(kind):
    """1 vs 4 micro-batches: each micro-batch's loss uses num_sequences = global non-empty count;
    the summed losses and gradients equal the full-batch ones."""
    d = make_batch(seed=6, eps=GRPO_EPS, extreme=False, token_adv=(kind != "gspo"))
    opts = dict(use_ref=True, kl_coef=0.05, use_eng=True, tis_cap=2.0)
    full_loss, full_g, _, _ = run_impl(FNS[kind], d, GRPO_EPS, **opts)
    n_global = int((d["mask"].sum(-1) > 0).sum())
    total, grads = 0.0, torch.zeros_like(full_g)
    for mb in torch.arange(len(LENGTHS)).chunk(4):
        sub = {k: (v[mb] if torch.is_tensor(v) and v.dim() >= 1 else v) for k, v in d.items()}
        loss, g, _, _ = run_impl(FNS[kind], sub, GRPO_EPS, num_sequences=n_global, **opts)
        total = total + loss
        grads[mb] = g
    torch.testing.assert_close(total, full_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads, full_g, rtol=1e-12, atol=1e-15)


def test_packed_thd_stats_equal_padded():
    """GSPO from per-sequence sums over a packed THD buffer (sum_fn=packed_sequence_sum, padded
    to a multiple of 4) equals GSPO over the padded [B, T] batch, value and gradient."""
    d = make_batch(seed=7, eps=PAPER, extreme=True, garbage=False)
    B = len(LENGTHS)
    lp_pad = d["lp"].clone().requires_grad_(True)
    loss_ref, m_ref = gspo_loss(lp_pad, d["old"], d["adv"], d["mask"], ref_log_probs=d["ref"], kl_coef=0.1)
    loss_ref.backward()
    # pack: each sequence = its full row up to its last loss token (prompt part included)
    ends = [int(torch.nonzero(d["mask"][i]).max()) + 1 if d["mask"][i].any() else 3 for i in range(B)]
    rows = lambda t: [t[i, :ends[i]] for i in range(B)]  # noqa: E731
    lp_packed, cu, cu_pad = pack_sequences([r.detach() for r in rows(d["lp"])], multiple=4)
    lp_packed = lp_packed.unsqueeze(0).requires_grad_(True)  # Megatron's [1, total]
    old_p = pack_sequences(rows(d["old"]), 4)[0][None]
    ref_p = pack_sequences(rows(d["ref"]), 4)[0][None]
    mask_p = pack_sequences(rows(d["mask"]), 4, pad_value=False)[0][None]
    stats = gspo_sequence_stats(lp_packed, old_p, mask_p, ref_log_probs=ref_p,
                                sum_fn=functools.partial(packed_sequence_sum, cu_seqlens=cu_pad))
    loss, m = gspo_loss_from_stats(advantages=d["adv"], kl_coef=0.1, **stats.fields())
    loss.backward()
    torch.testing.assert_close(loss, loss_ref, rtol=1e-12, atol=1e-15)
    for i in range(B):
        got = lp_packed.grad[0, int(cu_pad[i]):int(cu_pad[i]) + ends[i]]
        torch.testing.assert_close(got, lp_pad.grad[i, :ends[i]], rtol=1e-12, atol=1e-15)
    for k in m_ref:
        torch.testing.assert_close(m[k], m_ref[k])


def test_sequence_stats_reduce_is_one_call_over_stacked_fields():
    calls = []

    def fn(t):
        calls.append(tuple(t.shape))
        return t * 2

    st = SequenceStats(torch.ones(3), torch.full((3,), 4.0), kl_sum=torch.zeros(3))
    out = st.reduce(fn)
    assert calls == [(3, 3)]
    assert torch.equal(out.token_count, torch.full((3,), 8.0)) and out.entropy_sum is None


def test_options_are_validated():
    lp, old, mask = torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    adv = torch.ones(2)
    with pytest.raises(ValueError, match="kl_coef"):
        gspo_loss(lp, old, adv, mask, kl_coef=0.1)  # never silently ignored
    with pytest.raises(ValueError, match="entropy_coef"):
        grpo_loss(lp, old, adv, mask, entropy_coef=0.1)
    with pytest.raises(ValueError, match="tis_cap"):
        gspo_token_loss(lp, old, adv, mask, tis_cap=2.0)
    with pytest.raises(TypeError, match="unknown option"):
        gspo_loss(lp, old, adv, mask, kl_coeff=0.1)
    with pytest.raises(ValueError, match="advantages"):
        gspo_loss(lp, old, torch.ones(2, 3), mask)
    with pytest.raises(ValueError, match="eps_low"):
        gspo_loss(lp, old, adv, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="kl_coef"):
        gspo_loss_from_stats(torch.zeros(2), torch.ones(2), adv, kl_coef=0.1)


def test_ref_log_probs_without_coef_only_reports_kl():
    d = make_batch(seed=8, eps=PAPER, extreme=False)
    l0, g0, _, m0 = run_impl(gspo_loss, d, PAPER)
    l1, g1, _, m1 = run_impl(gspo_loss, d, PAPER, use_ref=True, use_eng=True)
    assert torch.equal(l0, l1) and torch.equal(g0, g1)
    assert m1["kl_ref"].item() > 0 and "engine_log_ratio" in m1 and "kl_ref" not in m0


# ------------------------------------------------------------------ train-inference mismatch
def test_mismatch_sums_and_sequence_mask_against_float64_loops():
    """algorithms/mismatch.py against plain float64 loops: per-row sums, the report, the step
    metrics, and the sequence band (inclusive bounds, empty sequences kept)."""
    from gspo_megatron.algorithms.mismatch import (mismatch_metrics, mismatch_report, mismatch_row_sums,
                                                   sequence_mismatch_keep)

    g = torch.Generator().manual_seed(5)
    train = torch.randn(4, 6, generator=g) - 2
    engine = train + 0.1 * torch.randn(4, 6, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0] * 6, [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    engine[~mask] = float("nan")  # never read outside the mask
    sums = mismatch_row_sums(train, engine, mask)
    rows, n, abs_s, k3_s, tok_max, seq_max = [], 0, 0.0, 0.0, 0.0, 0.0
    for i in range(4):
        ds = [float(train[i, t]) - float(engine[i, t]) for t in range(6) if mask[i, t]]
        rows.append(ds)
        n += len(ds)
        abs_s += sum(abs(d) for d in ds)
        k3_s += sum(math.exp(d) - 1 - d for d in ds)
        tok_max = max([tok_max] + [abs(d) for d in ds])
        if ds:
            seq_max = max(seq_max, abs(sum(ds) / len(ds)))
        assert float(sums[i, 0]) == pytest.approx(sum(ds), abs=1e-6)
        assert float(sums[i, 3]) == len(ds)
    rep = mismatch_report(sums)
    m = mismatch_metrics({k: float(rep[k]) for k in ("mm_abs_sum", "mm_k3_sum", "mm_tokens")},
                         {k: float(rep[k]) for k in ("mm_tok_max", "mm_seq_max")})
    assert m["mismatch_logprob_abs"] == pytest.approx(abs_s / n, rel=1e-6)
    assert m["mismatch_k3"] == pytest.approx(k3_s / n, rel=1e-5)
    assert m["mismatch_logprob_max"] == pytest.approx(tok_max, rel=1e-6)
    assert m["mismatch_seq_ratio_max"] == pytest.approx(seq_max, rel=1e-6)

    means = [sum(d) / len(d) if d else 0.0 for d in rows]
    lo, hi = sorted(means[:2])  # the band's edges are two of the means: inclusive
    keep = sequence_mismatch_keep(sums[:, 0], sums[:, 3], lo, hi)
    assert keep.tolist() == [(lo <= x <= hi) or not rows[i] for i, x in enumerate(means)]
    assert keep[2]  # the empty sequence is kept (it has no loss terms anyway)
