"""model/rope.py: packed RoPE with the cos/sin built once per microbatch is bitwise Megatron's own
unfused THD RoPE (rope_utils.apply_rotary_pos_emb, the function it replaces), and it is built once."""
from __future__ import annotations

import types

import pytest
import torch

from megatron.core.models.common.embeddings import rope_utils

from gspo_megatron.model import rope
from megatron_utils import GroupStandIn as _Group


def _config(**kw):
    base = dict(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    base.update(kw)
    return types.SimpleNamespace(**base)


def _freqs(n, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 1, dim, generator=g, dtype=torch.float32) * 3.0


@pytest.mark.parametrize("cp,cp_rank", [(1, 0), (2, 0), (2, 1)])
@pytest.mark.parametrize("exact_table", [False, True])
@pytest.mark.parametrize("mscale,rot", [(1.0, 16), (1.3, 12)])
def test_bitwise_megatron(cp, cp_rank, exact_table, mscale, rot):
    lengths = [8, 12, 4, 16]  # full (padded) lengths, multiples of 2 * cp
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    t_local = sum(lengths) // cp
    heads, hn = 3, 16
    g = torch.Generator().manual_seed(1)
    t = torch.randn(t_local, heads, hn, generator=g, dtype=torch.float32, requires_grad=True)
    freqs = _freqs(sum(lengths) if exact_table else max(lengths), rot)
    cfg, group = _config(), _Group(cp, cp_rank)
    want = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=group)
    got = rope.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, mscale=mscale, cp_group=group)
    assert torch.equal(got, want)
    gw, = torch.autograd.grad(want.pow(2).sum(), t)
    gg, = torch.autograd.grad(got.pow(2).sum(), t)
    assert torch.equal(gg, gw)


def test_cos_sin_built_once_per_microbatch(monkeypatch):
    calls = []
    real = rope_utils._get_thd_freqs_on_this_cp_rank
    monkeypatch.setattr(rope_utils, "_get_thd_freqs_on_this_cp_rank", lambda *a: calls.append(1) or real(*a))
    cu = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
    freqs, cfg, group = _freqs(7, 8), _config(), _Group(1, 0)
    q, k = torch.randn(16, 4, 8), torch.randn(16, 2, 8)
    for _layer in range(3):  # q and k of every layer: one table build (3 sequences -> 3 slices)
        rope.apply_rotary_pos_emb(q, freqs, cfg, cu_seqlens=cu, cp_group=group)
        rope.apply_rotary_pos_emb(k, freqs, cfg, cu_seqlens=cu, cp_group=group)
    assert len(calls) == 3
    # another microbatch (new boundaries tensor) or another table: built again
    rope.apply_rotary_pos_emb(q, freqs, cfg, cu_seqlens=cu.clone(), cp_group=group)
    rope.apply_rotary_pos_emb(q, _freqs(7, 8, seed=1), cfg, cu_seqlens=cu, cp_group=group)
    assert len(calls) == 9


def test_other_cases_go_to_megatron(monkeypatch):
    seen = []
    monkeypatch.setattr(rope_utils, "apply_rotary_pos_emb", lambda *a, **k: seen.append(k) or "megatron")
    t, freqs, cu = torch.randn(6, 2, 8), _freqs(6, 8), torch.tensor([0, 6], dtype=torch.int32)
    assert rope.apply_rotary_pos_emb(t, freqs, _config(), cu_seqlens=None) == "megatron"  # bshd
    for kw in ({"apply_rope_fusion": True}, {"rotary_interleaved": True}, {"multi_latent_attention": True}):
        assert rope.apply_rotary_pos_emb(t, freqs, _config(**kw), cu_seqlens=cu, cp_group=_Group(1, 0)) == "megatron"
    assert len(seen) == 4


def test_install_rebinds_megatron_attention():
    from megatron.core.transformer import attention

    rope.install()
    rope.install()  # idempotent
    assert attention.apply_rotary_pos_emb is rope.apply_rotary_pos_emb


def test_no_group_given_uses_megatrons_cp_group(monkeypatch):
    """cp_group=None (no caller in Megatron 0.16.1 does this) falls back to parallel_state's CP
    group, as rope_utils.apply_rotary_pos_emb itself does."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_context_parallel_group", lambda *a, **k: _Group(2, 1))
    cu = torch.tensor([0, 8, 12], dtype=torch.int32)
    t, freqs, cfg = torch.randn(6, 2, 8), _freqs(8, 8), _config()
    want = rope_utils.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu, cp_group=_Group(2, 1))
    assert torch.equal(rope.apply_rotary_pos_emb(t, freqs, cfg, cu_seqlens=cu), want)
