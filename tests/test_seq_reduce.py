"""Packed per-sequence sums, the zigzag CP layout, and layout invariance of the losses.

Single-process tests pin the layout helpers down exactly. One gloo job with 2 processes (run once
per module) plays CP2 - synthetic log-probs split in the zigzag layout, per-sequence sums reduced
with ``cp_all_reduce_sum`` - and DP2 - each rank holds half of the sequences, gradients summed;
the parent compares everything with the single-process full batch.
"""
from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import run_distributed
from gspo_megatron.algorithms import (
    grpo_loss,
    gspo_loss,
    gspo_loss_from_stats,
    gspo_sequence_stats,
    gspo_token_loss,
)
from gspo_megatron.parallel.logprobs import vocab_parallel_log_probs
from gspo_megatron.parallel.seq_reduce import (
    cp_all_reduce_sum,
    cp_all_reduce_sum_many,
    pack_sequences,
    packed_sequence_sum,
    packed_to_padded,
    pad_cu_seqlens,
    padded_to_packed,
    zigzag_merge,
    zigzag_merge_packed,
    zigzag_packed_indices,
    zigzag_split,
    zigzag_split_packed,
)

# ---------------------------------------------------------------------------------------------
# single process: layout helpers
# ---------------------------------------------------------------------------------------------


def test_packed_sequence_sum_matches_loop_and_ignores_masked_garbage():
    cu = torch.tensor([0, 3, 3, 10, 11])  # includes an empty sequence
    vals = torch.randn(13, dtype=torch.float64)  # 2 trailing padding tokens
    mask = torch.rand(13) > 0.3
    vals_g = vals.clone()
    vals_g[~mask] = float("nan")
    x = vals_g.clone().requires_grad_(True)
    out = packed_sequence_sum(x[None], cu, mask[None])  # Megatron's [1, total]
    want = [sum(vals[t].item() for t in range(int(cu[i]), int(cu[i + 1])) if mask[t]) for i in range(4)]
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float64))
    (out * torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)).sum().backward()
    seq_of = [0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 3]
    for t in range(13):
        want_g = (seq_of[t] + 1.0) if t < 11 and mask[t] else 0.0
        assert x.grad[t].item() == want_g
    torch.testing.assert_close(packed_sequence_sum(vals, cu), torch.stack(
        [vals[0:3].sum(), vals[3:3].sum(), vals[3:10].sum(), vals[10:11].sum()]))


def test_packed_padded_roundtrip_and_gradient():
    cu = torch.tensor([0, 2, 7, 8])
    vals = torch.arange(8, dtype=torch.float64).requires_grad_(True)
    padded, valid = packed_to_padded(vals, cu, pad_value=-1.0)
    assert padded.tolist() == [[0, 1, -1, -1, -1], [2, 3, 4, 5, 6], [7, -1, -1, -1, -1]]
    assert valid.sum() == 8
    assert torch.equal(padded_to_packed(padded, cu), vals.detach())
    (padded * torch.arange(15, dtype=torch.float64).view(3, 5)).sum().backward()
    assert vals.grad.tolist() == [0, 1, 5, 6, 7, 8, 9, 10]


def test_zigzag_layout_matches_megatron_convention():
    x = torch.arange(8)
    assert zigzag_split(x, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_split(x, 2, 1).tolist() == [2, 3, 4, 5]
    y = torch.arange(16).view(1, 16)
    assert zigzag_split(y, 4, 1, dim=1).tolist() == [[2, 3, 12, 13]]
    for cp in (1, 2, 4):
        z = torch.randn(3, 8 * cp, 2)
        parts = [zigzag_split(z, cp, r, dim=1) for r in range(cp)]
        assert torch.equal(zigzag_merge(parts, dim=1), z)
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        zigzag_split(torch.arange(6), 2, 0)


def test_zigzag_packed_indices_and_roundtrip():
    cu_pad = torch.tensor([0, 8, 12])
    assert zigzag_packed_indices(cu_pad, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert zigzag_packed_indices(cu_pad, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    seqs = [torch.randn(5), torch.randn(9), torch.randn(1)]
    packed, cu, cu_pad = pack_sequences(seqs, multiple=4)
    assert cu.tolist() == [0, 5, 14, 15] and cu_pad.tolist() == [0, 8, 20, 24]
    assert torch.equal(pad_cu_seqlens(cu, 4), cu_pad)
    parts = [zigzag_split_packed(packed, cu_pad, 2, r) for r in range(2)]
    assert all(p.numel() == 12 for p in parts)
    assert torch.equal(zigzag_merge_packed(parts, cu_pad), packed)
    # local per-sequence sums over the local cu_seqlens (= padded / cp) add up to the global ones
    local = [packed_sequence_sum(p, cu_pad // 2) for p in parts]
    torch.testing.assert_close(local[0] + local[1], packed_sequence_sum(packed, cu_pad))
    with pytest.raises(ValueError):
        zigzag_packed_indices(torch.tensor([0, 6]), 2, 0)


def test_cp_all_reduce_without_group_is_identity():
    x = torch.randn(4, requires_grad=True)
    assert cp_all_reduce_sum(x, None) is x
    a, b = cp_all_reduce_sum_many([x, x * 2], None)
    assert a is x


# ---------------------------------------------------------------------------------------------
# CP2 / DP2 on gloo
# ---------------------------------------------------------------------------------------------

CP = 2
EPS = {"gspo": (3e-4, 4e-4), "gspo_token": (3e-4, 4e-4), "grpo": (0.2, 0.27)}


def make_rl_batch(scenario: str):
    """Padded [B, T] float64 batch: rows = prompt then response; mask = response tokens.

    ``mixed``: prompt/response lengths of all kinds (one sequence whose response lies entirely
    in rank 0's chunks). ``prompt_only_rank``: every response sits in the last 1/4 of its padded
    sequence, so CP rank 1 holds only prompt tokens for the whole micro-batch.
    """
    g = torch.Generator().manual_seed(123 if scenario == "mixed" else 7)
    if scenario == "mixed":
        plen = [5, 1, 6, 20, 3, 9]
        rlen = [7, 30, 2, 3, 13, 0]  # last sequence: empty response (all-zero mask)
    else:
        plen = [6, 12, 9]
        rlen = [2, 4, 3]
    B = len(plen)
    lengths = [p + r for p, r in zip(plen, rlen)]
    T = max(lengths)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        mask[i, plen[i]:plen[i] + rlen[i]] = True
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4
    scale = torch.tensor([1e-3, -2e-3, 5e-4, 0.3, -0.1, 0.0, 2e-3][:B], dtype=torch.float64)
    lp = old + scale[:, None] + torch.randn(B, T, generator=g, dtype=torch.float64) * 1e-3
    ref = old + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3, 0.9, -0.8][:B], dtype=torch.float64)
    return dict(lp=lp, old=old, ref=ref, mask=mask, adv=adv, lengths=lengths)


def _pack(batch, key, pad_value=0):
    rows = [batch[key][i, :L] for i, L in enumerate(batch["lengths"])]
    return pack_sequences(rows, multiple=2 * CP, pad_value=pad_value)


def _cp_rank_losses(rank, scenario, group):
    """This CP rank's losses and local gradients for one scenario (packed THD + zigzag)."""
    b = make_rl_batch(scenario)
    lp_packed, cu, cu_pad = _pack(b, "lp")
    local = {k: zigzag_split_packed(_pack(b, k, False if k == "mask" else 0)[0], cu_pad, CP, rank)
             for k in ("lp", "old", "ref", "mask")}
    cu_local = cu_pad // CP
    out = {"local_tokens": int(local["mask"].sum())}
    S = len(b["lengths"])

    # GSPO: local sums -> one CP all-reduce -> loss (replicated on the CP ranks)
    lp = local["lp"][None].clone().requires_grad_(True)  # [1, total_local]
    stats = gspo_sequence_stats(lp, local["old"][None], local["mask"][None], ref_log_probs=local["ref"][None],
                                sum_fn=functools.partial(packed_sequence_sum, cu_seqlens=cu_local))
    stats = stats.reduce(lambda t: cp_all_reduce_sum(t, group))
    loss, metrics = gspo_loss_from_stats(advantages=b["adv"], kl_coef=0.05, **stats.fields())
    loss.backward()
    out["gspo"] = (loss.detach(), lp.grad[0].clone(), metrics)

    # token-level losses: local tokens in [S, T_local], global |y_i| (and log-ratio sums) from CP
    glob_lr, glob_cnt = cp_all_reduce_sum_many(
        [packed_sequence_sum(local["lp"] - local["old"], cu_local, local["mask"]),
         packed_sequence_sum(local["mask"].double(), cu_local)], group)
    for kind, fn in (("gspo_token", gspo_token_loss), ("grpo", grpo_loss)):
        lp = local["lp"].clone().requires_grad_(True)
        pad = lambda v, fill=0.0: packed_to_padded(v, cu_local, pad_value=fill)[0]  # noqa: E731
        mask_pad = pad(local["mask"], False)
        extra = dict(logratio_sum=glob_lr) if kind == "gspo_token" else {}
        loss, metrics = fn(pad(lp), pad(local["old"]), b["adv"], mask_pad, eps_low=EPS[kind][0],
                           eps_high=EPS[kind][1], ref_log_probs=pad(local["ref"]), kl_coef=0.05,
                           token_count=glob_cnt, **extra)
        loss.backward()
        out[kind] = (loss.detach(), lp.grad.clone(), metrics)
    assert S == glob_cnt.numel()
    return out


def _dp_rank(rank, group, world):
    """DP2: a tiny policy (output layer W) scores its half of the sequences; grads summed."""
    b = _dp_batch()
    B = b["tokens"].shape[0]
    mine = torch.arange(B)[rank::world]
    W = b["W"].clone().requires_grad_(True)
    n_global = int((b["mask"].sum(-1) > 0).sum())
    out = {}
    for kind, fn in (("gspo", gspo_loss), ("grpo", grpo_loss)):
        W.grad = None
        logits = b["hidden"][mine] @ W.T
        lp = vocab_parallel_log_probs(logits, b["tokens"][mine])
        loss, _ = fn(lp, b["old"][mine], b["adv"][mine], b["mask"][mine], num_sequences=n_global)
        loss.backward()
        torch.distributed.all_reduce(W.grad, group=group)
        out[kind] = (loss.detach(), W.grad.clone())
    return out


def _dp_batch():
    g = torch.Generator().manual_seed(99)
    B, T, H, V = 6, 9, 5, 11
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    W = torch.randn(V, H, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    with torch.no_grad():
        lp0 = torch.log_softmax(hidden @ W.T, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = lp0 + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[3] = False  # an empty sequence on rank 1
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return dict(hidden=hidden, W=W, tokens=tokens, old=old, mask=mask, adv=adv)


def _dist_rank(rank, world_size):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group(list(range(world_size)))
    return {
        "mixed": _cp_rank_losses(rank, "mixed", group),
        "prompt_only_rank": _cp_rank_losses(rank, "prompt_only_rank", group),
        "dp": _dp_rank(rank, group, world_size),
    }


@pytest.fixture(scope="module")
def dist_results():
    return run_distributed(_dist_rank, 2, timeout=120)


def _single_process(scenario, kind):
    b = make_rl_batch(scenario)
    lp = b["lp"].clone().requires_grad_(True)
    fn = {"gspo": gspo_loss, "gspo_token": gspo_token_loss, "grpo": grpo_loss}[kind]
    loss, metrics = fn(lp, b["old"], b["adv"], b["mask"], eps_low=EPS[kind][0], eps_high=EPS[kind][1],
                       ref_log_probs=b["ref"], kl_coef=0.05)
    loss.backward()
    return b, loss.detach(), lp.grad, metrics


def _merge_grads(b, parts):
    """Local per-rank gradients (packed, zigzag) -> [B, T] padded like the batch."""
    _, cu, cu_pad = _pack(b, "lp")
    full = zigzag_merge_packed(parts, cu_pad)
    out = torch.zeros_like(b["lp"])
    for i, L in enumerate(b["lengths"]):
        out[i, :L] = full[int(cu_pad[i]):int(cu_pad[i]) + L]
        assert (full[int(cu_pad[i]) + L:int(cu_pad[i + 1])] == 0).all()  # CP padding gets no grad
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", ["mixed", "prompt_only_rank"])
@pytest.mark.parametrize("kind", ["gspo", "gspo_token", "grpo"])
def test_cp2_zigzag_equals_single_process(dist_results, scenario, kind):
    b, loss_ref, grad_ref, m_ref = _single_process(scenario, kind)
    ranks = [dist_results[r][scenario] for r in range(2)]
    if scenario == "prompt_only_rank":
        assert ranks[1]["local_tokens"] == 0 and ranks[0]["local_tokens"] > 0
    losses = [rk[kind][0] for rk in ranks]
    if kind == "gspo":
        # replicated: every CP rank returns the full micro-batch loss (and the same metrics)
        for L in losses:
            torch.testing.assert_close(L, loss_ref, rtol=1e-12, atol=1e-15)
        for k in ("clip_frac", "ratio_mean", "ratio_min", "ratio_max", "approx_kl", "kl_ref", "sequences"):
            for rk in ranks:
                torch.testing.assert_close(rk[kind][2][k], m_ref[k], rtol=1e-10, atol=1e-12)
    else:
        # token terms are local: the CP ranks' shares add up to the full loss
        torch.testing.assert_close(losses[0] + losses[1], loss_ref, rtol=1e-12, atol=1e-15)
    grads = [rk[kind][1] for rk in ranks]  # local packed gradients (through packed_to_padded)
    merged = _merge_grads(b, grads)
    torch.testing.assert_close(merged, grad_ref, rtol=1e-10, atol=1e-14)
    assert grad_ref.abs().sum() > 0
    if scenario == "prompt_only_rank":
        assert (grads[1] == 0).all()


@pytest.mark.timeout(180)
def test_cp_identity_backward_is_what_makes_it_exact(dist_results):
    """Had the backward all-reduced (the adjoint of a summed loss), the merged GSPO gradient would
    be cp times too large: check the measured one is not."""
    b, _, grad_ref, _ = _single_process("mixed", "gspo")
    ranks = [dist_results[r]["mixed"]["gspo"][1] for r in range(2)]
    merged = _merge_grads(b, ranks)
    assert not torch.allclose(merged, CP * grad_ref)
    torch.testing.assert_close(merged, grad_ref, rtol=1e-10, atol=1e-14)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["gspo", "grpo"])
def test_dp2_halves_with_global_count_equal_full_batch(dist_results, kind):
    b = _dp_batch()
    W = b["W"].clone().requires_grad_(True)
    lp = torch.log_softmax(b["hidden"] @ W.T, -1).gather(-1, b["tokens"][..., None]).squeeze(-1)
    fn = {"gspo": gspo_loss, "grpo": grpo_loss}[kind]
    loss, _ = fn(lp, b["old"], b["adv"], b["mask"])
    loss.backward()
    l0, g0 = dist_results[0]["dp"][kind]
    l1, g1 = dist_results[1]["dp"][kind]
    torch.testing.assert_close(l0 + l1, loss.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(g0, W.grad, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(g1, W.grad, rtol=1e-10, atol=1e-13)
