"""Vocab-parallel token log-probs / entropy (chunked and fused) against log_softmax + gather.

Single-process cases check the math, chunking, temperature, dtypes and vocab padding; one TP2 gloo
job (2 processes, run once per module) checks the collectives: values and gradients of the
sharded computation equal the full-vocabulary reference, and the fused variant's hidden gradient
equals the reference after Megatron's ``copy_to_tensor_model_parallel_region`` reduces it over TP.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from gspo_megatron.parallel.logprobs import fused_vocab_parallel_log_probs, vocab_parallel_log_probs


def reference(logits, targets, temperature=1.0, vocab_size=None):
    """log_softmax + gather and entropy on the full (unsharded) logits."""
    x = logits if vocab_size is None else logits[..., :vocab_size]
    logp_all = torch.log_softmax(x.double() / temperature, dim=-1)
    lp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


def ref_grads(logits, targets, g_lp, g_ent, temperature=1.0, vocab_size=None):
    x = logits.detach().double().requires_grad_(True)
    lp, ent = reference(x, targets, temperature, vocab_size)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), x.grad


def _data(N, V, H, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / H ** 0.5 * 3
    targets = torch.randint(0, V, (N,), generator=g)
    g_lp = torch.randn(N, generator=g, dtype=dtype)
    g_ent = torch.randn(N, generator=g, dtype=dtype)
    return hidden, weight, targets, g_lp, g_ent


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 7, None])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_matches_reference(chunk, temperature):
    hidden, weight, targets, g_lp, g_ent = _data(33, 50, 8, seed=0)
    logits = (hidden @ weight.T).reshape(3, 11, 50)  # leading dims like Megatron's [s, b, V]
    t = targets.reshape(3, 11)
    want_lp, want_ent, want_grad = ref_grads(logits, t, g_lp.reshape(3, 11), g_ent.reshape(3, 11), temperature)
    x = logits.clone().requires_grad_(True)
    before = x.detach().clone()
    lp, ent = vocab_parallel_log_probs(x, t, temperature=temperature, chunk_size=chunk, return_entropy=True)
    assert lp.shape == t.shape and ent.shape == t.shape
    (lp * g_lp.reshape(3, 11) + ent * g_ent.reshape(3, 11)).sum().backward()
    torch.testing.assert_close(lp, want_lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, want_ent, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(x.grad, want_grad, rtol=1e-10, atol=1e-10)
    assert torch.equal(x.detach(), before)  # never in place (unlike Megatron's cross-entropy)


@pytest.mark.parametrize("chunk", [1, 13, None])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_fused_matches_reference(chunk, temperature):
    hidden, weight, targets, g_lp, g_ent = _data(21, 64, 16, seed=1)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp_ref, ent_ref = reference(h @ w.T, targets, temperature)
    (lp_ref * g_lp + ent_ref * g_ent).sum().backward()
    gh_ref, gw_ref = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp, ent = fused_vocab_parallel_log_probs(h, w, targets, temperature=temperature, chunk_size=chunk,
                                             return_entropy=True)
    (lp * g_lp + ent * g_ent).sum().backward()
    torch.testing.assert_close(lp, lp_ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent, ent_ref.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h.grad, gh_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(w.grad, gw_ref, rtol=1e-10, atol=1e-10)


def test_log_probs_only_and_frozen_weight():
    hidden, weight, targets, g_lp, _ = _data(10, 30, 4, seed=2)
    h = hidden.clone().requires_grad_(True)
    lp_ref, _ = reference(h @ weight.T, targets)
    (lp_ref * g_lp).sum().backward()
    gh = h.grad.clone()
    h.grad = None
    lp = fused_vocab_parallel_log_probs(h, weight, targets, chunk_size=4)  # weight needs no grad
    (lp * g_lp).sum().backward()
    torch.testing.assert_close(h.grad, gh, rtol=1e-10, atol=1e-10)
    x = (hidden @ weight.T).requires_grad_(True)
    lp2 = vocab_parallel_log_probs(x, targets)
    assert lp2.dtype == torch.float64 and lp2.shape == (10,)
    torch.testing.assert_close(lp2, lp.detach())


def test_padded_vocab_is_excluded():
    """Megatron pads the vocabulary; with vocab_size the padding columns leave the softmax and get
    zero gradient (without it the result would differ)."""
    hidden, weight, targets, g_lp, g_ent = _data(12, 40, 8, seed=3)
    targets = targets % 37
    logits = hidden @ weight.T
    lp_ref, ent_ref, grad_ref = ref_grads(logits, targets, g_lp, g_ent, vocab_size=37)
    x = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(x, targets, vocab_size=37, chunk_size=5, return_entropy=True)
    (lp * g_lp + ent * g_ent).sum().backward()
    torch.testing.assert_close(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref)
    torch.testing.assert_close(x.grad, grad_ref)
    assert (x.grad[:, 37:] == 0).all() and x.grad[:, :37].abs().sum() > 0
    assert not torch.allclose(vocab_parallel_log_probs(logits, targets), lp_ref)
    w = weight.clone().requires_grad_(True)
    lp_f = fused_vocab_parallel_log_probs(hidden, w, targets, vocab_size=37, chunk_size=6)
    lp_f.sum().backward()
    torch.testing.assert_close(lp_f, lp_ref)
    assert (w.grad[37:] == 0).all() and w.grad[:37].abs().sum() > 0


def test_bf16_inputs():
    """bf16 logits / weights: float32 outputs equal the reference on the bf16-rounded logits."""
    hidden, weight, targets, g_lp, _ = _data(40, 300, 32, seed=4, dtype=torch.float32)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    logits_b = hb @ wb.T
    lp_ref, ent_ref = reference(logits_b.float(), targets, 0.9)
    x = logits_b.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(x, targets, temperature=0.9, return_entropy=True, chunk_size=16)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=1e-5, atol=1e-5)
    (lp * g_lp).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    hq, wq = hb.clone().requires_grad_(True), wb.clone().requires_grad_(True)
    lp_f = fused_vocab_parallel_log_probs(hq, wq, targets, temperature=0.9, chunk_size=64)
    torch.testing.assert_close(lp_f.double(), lp_ref, rtol=1e-5, atol=1e-5)
    (lp_f * g_lp).sum().backward()
    h64, w64 = hb.double().requires_grad_(True), wb.double().requires_grad_(True)
    lp64, _ = reference(h64 @ w64.T, targets, 0.9)
    (lp64 * g_lp.double()).sum().backward()
    assert hq.grad.dtype == wq.grad.dtype == torch.bfloat16
    for got, want in ((hq.grad, h64.grad), (wq.grad, w64.grad)):
        rel = (got.double() - want).norm() / want.norm()
        assert rel < 1e-2, rel  # bf16 rounding of the per-block gradients only
    # small blocks: the bf16 hidden-grad product is also split over token rows (scratch <= block)
    hs, ws = hb.clone().requires_grad_(True), wb.clone().requires_grad_(True)
    (fused_vocab_parallel_log_probs(hs, ws, targets, temperature=0.9, chunk_size=8) * g_lp).sum().backward()
    assert (hs.grad.double() - h64.grad).norm() / h64.grad.norm() < 1e-2
    torch.testing.assert_close(ws.grad, wq.grad, rtol=1e-2, atol=1e-3)


def test_argument_checks():
    with pytest.raises(ValueError, match="targets shape"):
        vocab_parallel_log_probs(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_log_probs(torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="weight"):
        fused_vocab_parallel_log_probs(torch.zeros(3, 4), torch.zeros(5, 3), torch.zeros(3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# TP2 on gloo
# ---------------------------------------------------------------------------------------------

TP_N, TP_V, TP_H, TP_TEMP = 24, 40, 12, 0.7
TP_PAD_VOCAB = 33  # < TP_V: rank 1 holds 20 ids of which 13 are real, 7 padding


def _tp_rank(rank, world_size):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world_size)))
    hidden, weight, targets, g_lp, g_ent = _data(TP_N, TP_V, TP_H, seed=10)
    targets[:4] = torch.tensor([0, 19, 20, 39])  # shard edges
    vl = TP_V // world_size
    sl = slice(rank * vl, (rank + 1) * vl)
    out = {}

    logits = (hidden @ weight.T)[:, sl].contiguous().requires_grad_(True)
    for chunk in (5, None):
        logits.grad = None
        lp, ent = vocab_parallel_log_probs(logits, targets, group=group, temperature=TP_TEMP,
                                           chunk_size=chunk, return_entropy=True)
        (lp * g_lp + ent * g_ent).sum().backward()
        out[f"chunked{chunk}"] = (lp.detach(), ent.detach(), logits.grad.clone())

    # fused: hidden replicated on the TP ranks, wrapped like Megatron's output layer input
    h = hidden.clone().requires_grad_(True)
    w = weight[sl].clone().requires_grad_(True)
    h_in = copy_to_tensor_model_parallel_region(h, group=group)
    lp, ent = fused_vocab_parallel_log_probs(h_in, w, targets, group=group, temperature=TP_TEMP,
                                             chunk_size=3, return_entropy=True)
    (lp * g_lp + ent * g_ent).sum().backward()
    out["fused"] = (lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())
    # the same without the wrapper: this rank's partial hidden gradient only
    h2 = hidden.clone().requires_grad_(True)
    lp2 = fused_vocab_parallel_log_probs(h2, weight[sl], targets, group=group, temperature=TP_TEMP)
    (lp2 * g_lp).sum().backward()
    out["fused_partial_h"] = h2.grad.clone()

    # padded vocabulary at TP2 (ids >= TP_PAD_VOCAB are padding)
    t_pad = targets % TP_PAD_VOCAB
    x = (hidden @ weight.T)[:, sl].contiguous().requires_grad_(True)
    lp = vocab_parallel_log_probs(x, t_pad, group=group, vocab_size=TP_PAD_VOCAB, chunk_size=7)
    (lp * g_lp).sum().backward()
    out["padded"] = (lp.detach(), x.grad.clone())
    return out


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp_rank, 2, timeout=120)


@pytest.mark.timeout(180)
def test_tp2_chunked_equals_full_vocab_reference(tp2_results):
    hidden, weight, targets, g_lp, g_ent = _data(TP_N, TP_V, TP_H, seed=10)
    targets[:4] = torch.tensor([0, 19, 20, 39])
    lp_ref, ent_ref, grad_ref = ref_grads(hidden @ weight.T, targets, g_lp, g_ent, TP_TEMP)
    for key in ("chunked5", "chunkedNone"):
        for r in range(2):
            lp, ent, grad = tp2_results[r][key]
            torch.testing.assert_close(lp, lp_ref, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(ent, ent_ref, rtol=1e-10, atol=1e-10)
        full_grad = torch.cat([tp2_results[0][key][2], tp2_results[1][key][2]], dim=1)
        torch.testing.assert_close(full_grad, grad_ref, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(180)
def test_tp2_fused_equals_reference_after_tp_reduction(tp2_results):
    hidden, weight, targets, g_lp, g_ent = _data(TP_N, TP_V, TP_H, seed=10)
    targets[:4] = torch.tensor([0, 19, 20, 39])
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    lp_ref, ent_ref = reference(h @ w.T, targets, TP_TEMP)
    (lp_ref * g_lp + ent_ref * g_ent).sum().backward()
    for r in range(2):
        lp, ent, gh, _ = tp2_results[r]["fused"]
        torch.testing.assert_close(lp, lp_ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(ent, ent_ref.detach(), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(gh, h.grad, rtol=1e-10, atol=1e-10)  # reduced by copy_to_...
    gw = torch.cat([tp2_results[0]["fused"][3], tp2_results[1]["fused"][3]], dim=0)
    torch.testing.assert_close(gw, w.grad, rtol=1e-10, atol=1e-10)
    # without the TP reduction each rank's hidden grad is partial; the partials sum to the total
    h.grad = None
    lp_ref2, _ = reference(h @ weight.T, targets, TP_TEMP)
    (lp_ref2 * g_lp).sum().backward()
    p0, p1 = tp2_results[0]["fused_partial_h"], tp2_results[1]["fused_partial_h"]
    assert not torch.allclose(p0, h.grad)
    torch.testing.assert_close(p0 + p1, h.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(180)
def test_tp2_padded_vocab(tp2_results):
    hidden, weight, targets, g_lp, _ = _data(TP_N, TP_V, TP_H, seed=10)
    targets[:4] = torch.tensor([0, 19, 20, 39])
    t_pad = targets % TP_PAD_VOCAB
    lp_ref, _, grad_ref = ref_grads(hidden @ weight.T, t_pad, g_lp, torch.zeros_like(g_lp),
                                    vocab_size=TP_PAD_VOCAB)
    for r in range(2):
        torch.testing.assert_close(tp2_results[r]["padded"][0], lp_ref, rtol=1e-10, atol=1e-10)
    full = torch.cat([tp2_results[0]["padded"][1], tp2_results[1]["padded"][1]], dim=1)
    torch.testing.assert_close(full, grad_ref, rtol=1e-10, atol=1e-10)
    assert (full[:, TP_PAD_VOCAB:] == 0).all()
