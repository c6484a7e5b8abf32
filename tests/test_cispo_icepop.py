"""CISPO (algorithms/cispo.py) and IcePop (algorithms/mismatch.py icepop_keep) against float64
references written from the papers' formulas token by token, and GSPO's numerics under extreme
sequence ratios. The trainer's use of both across TP/SP/PP/EP/CP is in
test_train_invariance_options.py; the configuration sweep runs both in the loop."""
from __future__ import annotations

import math

import pytest
import torch

from gspo_megatron.algorithms import cispo_loss, grpo_loss, gspo_loss, gspo_token_loss
from gspo_megatron.algorithms.mismatch import icepop_keep


def _batch(seed: int, B: int = 5, T: int = 9, spread: float = 0.5, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 0  # one empty sequence
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    lp = (old + spread * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_()
    adv = torch.randn(B, generator=g, dtype=dtype)
    lp_garbage = torch.where(mask, lp, torch.full_like(lp, float("nan")))  # off-mask NaN never leaks
    return lp, lp_garbage, old, adv, mask


def _cispo_reference(lp, old, adv, mask, eps_low, eps_high):
    """-(1 / sum |y_i|) sum_i sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_i log pi(y_t), token by token."""
    total, tokens = 0.0, 0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(float(lp.detach()[i, t]) - float(old[i, t]))
            w = min(max(r, max(0.0, 1 - eps_low)), 1 + eps_high)
            total = total - w * float(adv[i]) * lp[i, t]
            tokens += 1
    return total / max(tokens, 1)


@pytest.mark.parametrize("eps", [(1.0, 0.28), (0.2, 0.2), (0.05, 0.0), (3.0, 5.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_loss_and_gradient_equal_the_papers_formula(seed, eps):
    lp, lp_g, old, adv, mask = _batch(seed)
    ref = _cispo_reference(lp, old, adv, mask, *eps)
    (g_ref,) = torch.autograd.grad(ref, lp)
    loss, m = cispo_loss(lp_g, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    (g,) = torch.autograd.grad(loss, lp)
    assert float(loss) == pytest.approx(float(ref), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-14)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all()
    r = torch.exp(lp.detach() - old)[mask]
    lo, hi = max(0.0, 1 - eps[0]), 1 + eps[1]
    assert float(m["clip_frac"]) == pytest.approx(float(((r < lo) | (r > hi)).double().mean()))
    assert float(m["tokens"]) == int(mask.sum())


def test_cispo_keeps_a_gradient_where_grpo_clips_it_away():
    """A token far above the clip range with A > 0: GRPO's clipped surrogate has zero gradient
    there, CISPO's capped weight times A keeps -(1 + eps_high) A / N (the paper's point)."""
    lp = torch.tensor([[-0.1, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)  # token 0: r = e^1.4 ~ 4.06
    adv, mask = torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 2, dtype=torch.bool)
    (g_grpo,) = torch.autograd.grad(grpo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.28)[0], lp)
    (g_cispo,) = torch.autograd.grad(cispo_loss(lp, old, adv, mask, eps_high=0.28)[0], lp)
    assert g_grpo[0, 0] == 0
    assert float(g_cispo[0, 0]) == pytest.approx(-1.28 / 2)
    assert float(g_cispo[0, 1]) == pytest.approx(-1.0 / 2)  # r = 1 inside the range


def test_cispo_token_sum_splits_exactly_over_parts():
    """num_tokens = the global count: per-part token sums add up to the whole batch's loss (how
    the trainer splits it over microbatches and ranks)."""
    lp, _, old, adv, mask = _batch(4, B=6)
    whole, _ = cispo_loss(lp, old, adv, mask)
    n = int(mask.sum())
    parts = sum(cispo_loss(lp[s], old[s], adv[s], mask[s], num_tokens=n)[0] for s in (slice(0, 2), slice(2, 6)))
    assert float(parts) == pytest.approx(float(whole), rel=1e-12)


def test_cispo_refuses_bad_options():
    lp, _, old, adv, mask = _batch(0)
    with pytest.raises(ValueError):
        cispo_loss(lp, old, adv, mask, eps_high=-0.1)
    with pytest.raises(TypeError, match="unknown option"):
        cispo_loss(lp, old, adv, mask, num_sequences=3)
    with pytest.raises(ValueError, match="kl_coef"):
        cispo_loss(lp, old, adv, mask, kl_coef=0.1)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_icepop_masks_exactly_the_tokens_outside_the_band(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, 12
    mask = torch.rand(B, T, generator=g) < 0.8
    eng = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    train = eng + torch.randn(B, T, generator=g, dtype=torch.float64) * 1.5  # injected mismatch
    alpha, beta = 0.5, 5.0
    keep = icepop_keep(train.float(), eng.float(), mask, alpha, beta)
    for i in range(B):
        for t in range(T):
            ratio = math.exp(float(train.float()[i, t]) - float(eng.float()[i, t]))
            assert bool(keep[i, t]) == (bool(mask[i, t]) and alpha <= ratio <= beta), (i, t, ratio)
    assert 0 < int((mask & ~keep).sum()) < int(mask.sum())  # some tokens masked, some kept
    # the bounds are kept: a ratio of exactly alpha or beta stays
    e = torch.zeros(1, 2, dtype=torch.float64)
    at = torch.tensor([[math.log(0.5), math.log(5.0)]], dtype=torch.float64)
    assert icepop_keep(at, e, torch.ones(1, 2, dtype=torch.bool), 0.5, 5.0).all()


@pytest.mark.parametrize("mean_log_ratio", [50.0, -50.0, 1e4, -1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extreme_sequence_ratios_give_finite_loss_and_gradients(mean_log_ratio, dtype):
    """GSPO with a sequence mean log-ratio of +-50 (exp would overflow float32 at ~88 only after
    the advantage product and sums; bf16 inputs are upcast): the clamp before exp keeps the loss
    and every gradient finite, for every loss type."""
    B, T = 3, 6
    old = torch.full((B, T), -2.0, dtype=dtype)
    lp = (old.float() + mean_log_ratio).to(dtype).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5])
    mask = torch.ones(B, T, dtype=torch.bool)
    for fn, kw in ((gspo_loss, {}), (gspo_token_loss, {}), (grpo_loss, {}), (cispo_loss, {}),
                   (gspo_loss, {"engine_log_probs": old, "tis_cap": 2.0})):
        loss, _ = fn(lp, old, adv, mask, **kw)
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (fn.__name__, float(loss))
