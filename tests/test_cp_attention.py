"""CpuCoreAttention (gspo_megatron/parallel/cp_attention.py) against an independent reference.

The reference is plain float64 softmax attention with an explicit causal mask on the full, unsplit
sequences (one sequence at a time for packed batches; GQA by repeating KV heads). One gloo job with
1 process pins the conventions against Megatron's own local ``DotProductAttention`` and checks THD
packing without CP; one job with 2 processes plays CP2 - every rank gets its zigzag chunks (sbhd)
or its per-sequence TE chunks (thd) - and the parent compares outputs and gradients with the
reference at the positions each rank holds. Every job is started once per module (fixtures).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dist_utils import run_distributed

NP, NG, HN = 4, 2, 8  # query heads, KV groups (GQA), head dim


def _config(cp=1, **kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw.setdefault("attention_dropout", 0.0)
    return TransformerConfig(num_layers=3, hidden_size=NP * HN, num_attention_heads=NP, num_query_groups=NG,
                             context_parallel_size=cp, **kw)


# ---------------------------------------------------------------------------------------------
# independent reference and layouts
# ---------------------------------------------------------------------------------------------


def ref_attention(q, k, v, lengths, scale):
    """q [T, np, hn], k/v [T, ng, hn], packed sequences of `lengths` -> [T, np*hn] (float64)."""
    rep = q.size(1) // k.size(1)
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))  # [np, n, hn]
        scores = qs @ ks.transpose(1, 2) * scale
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        outs.append((probs @ vs).transpose(0, 1).reshape(n, -1))
        start += n
    return torch.cat(outs)


def ref_sbhd(q, k, v, scale):
    """q [S, b, np, hn], k/v [S, b, ng, hn] -> [S, b, np*hn]: each batch row one sequence."""
    S, b = q.shape[:2]
    return torch.stack([ref_attention(q[:, i], k[:, i], v[:, i], [S], scale) for i in range(b)], dim=1)


def ref_with_grads(fn, q, k, v, g):
    """Reference output and the gradients of sum(out * g) w.r.t. q, k, v."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    (out * g.double()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def zigzag_index(length, cp, rank, offset=0):
    """Positions CP rank `rank` holds of a sequence of `length`: chunks rank and 2cp-1-rank of 2cp."""
    chunks = torch.arange(offset, offset + length).chunk(2 * cp)
    assert all(len(c) == length // (2 * cp) for c in chunks)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def thd_index(lengths, cp, rank):
    """Packed positions rank `rank` holds: per sequence, in order, its two zigzag chunks."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return torch.cat([zigzag_index(n, cp, rank, s) for n, s in zip(lengths, starts)])


def _qkvg(T_shape, seed, dtype=torch.float64):
    """Random full-sequence q, k, v and an upstream gradient; leading dims `T_shape`."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*T_shape, NP, HN, generator=g, dtype=dtype)
    k = torch.randn(*T_shape, NG, HN, generator=g, dtype=dtype)
    v = torch.randn(*T_shape, NG, HN, generator=g, dtype=dtype)
    grad = torch.randn(*T_shape, NP * HN, generator=g, dtype=dtype)
    return q, k, v, grad


HV = 12  # a value head dim unlike q/k's (multi-head latent attention)


def _qkvg_v(T_shape, seed, dtype=torch.float64):
    """_qkvg with values of head dim HV (and the upstream gradient of width NP * HV)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*T_shape, NP, HN, generator=g, dtype=dtype)
    k = torch.randn(*T_shape, NG, HN, generator=g, dtype=dtype)
    v = torch.randn(*T_shape, NG, HV, generator=g, dtype=dtype)
    grad = torch.randn(*T_shape, NP * HV, generator=g, dtype=dtype)
    return q, k, v, grad


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _run_local(module, q, k, v, g, **kw):
    """Forward + backward of sum(out * g) on local slices; returns out and dq, dk, dv."""
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = module(q, k, v, None, **kw)
    (out * g).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


# ---------------------------------------------------------------------------------------------
# 1 process: parity with Megatron's DotProductAttention, THD packing without CP
# ---------------------------------------------------------------------------------------------

DPA_VARIANTS = {  # name -> (config overrides, softmax_scale argument, layer_number)
    "default": ({}, None, 1),
    "explicit_scale": ({}, 0.3, 1),
    "qk_layer_scaling": ({"apply_query_key_layer_scaling": True}, None, 3),
}
THD_LENGTHS = [2, 5, 9]  # includes length 2 and odd lengths
THD_PADDED = ([2, 5, 7], [2, 6, 8])  # real lengths, padded lengths


def _single_rank(rank, world_size):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel.cp_attention import CpuCoreAttention
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(device="cpu"))
    out = {}
    try:
        # 1. sbhd, fp32: equals DotProductAttention (values and gradients)
        q, k, v, g = _qkvg((7, 2), seed=1, dtype=torch.float32)
        for name, (over, scale, layer) in DPA_VARIANTS.items():
            cfg = _config(**over)
            res = []
            for cls in (DotProductAttention, CpuCoreAttention):
                m = cls(cfg, layer, AttnMaskType.causal, "self", softmax_scale=scale)
                m.train()
                res.append(_run_local(m, q, k, v, g))
            out[f"dpa_{name}"] = res

        # 2. thd without CP: 3 sequences, no attention across them; padded cu_seqlens preferred
        cfg = _config()
        pgc = ProcessGroupCollection(tp=ctx.tp_group, cp=ctx.cp_group)
        m = CpuCoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgc)
        q, k, v, g = _qkvg((sum(THD_LENGTHS),), seed=2)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(THD_LENGTHS), cu_seqlens_kv=_cu(THD_LENGTHS),
                              max_seqlen_q=9, max_seqlen_kv=9)
        out["thd"] = _run_local(m, q, k, v, g, packed_seq_params=psp)
        # the same pack in padded batches of at most 800 scores: (9, 5) | 2, out of local order
        m.BATCH_ELEMENTS = 800
        out["thd_grouped"] = _run_local(m, q, k, v, g, packed_seq_params=psp)
        m.BATCH_ELEMENTS = CpuCoreAttention.BATCH_ELEMENTS
        real, padded = THD_PADDED
        q, k, v, g = _qkvg((sum(padded),), seed=3)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(real), cu_seqlens_kv=_cu(real),
                              cu_seqlens_q_padded=_cu(padded), cu_seqlens_kv_padded=_cu(padded),
                              max_seqlen_q=8, max_seqlen_kv=8)
        out["thd_padded"] = _run_local(m, q, k, v, g, packed_seq_params=psp)

        # the index plan is built once per PackedSeqParams (one per microbatch, passed to every
        # layer) and again for a new one; the second layer's answer is the first's
        from gspo_megatron.parallel import cp_attention as cpa

        builds, real_build = [], cpa._build_thd_plan
        cpa._build_thd_plan = lambda *a: builds.append(1) or real_build(*a)
        try:
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(real), cu_seqlens_kv=_cu(real),
                                  cu_seqlens_q_padded=_cu(padded), cu_seqlens_kv_padded=_cu(padded))
            layers = [m(q, k, v, None, packed_seq_params=psp) for _ in range(3)]
            first = len(builds)
            m(q, k, v, None, packed_seq_params=dataclasses.replace(psp))
            out["plan_builds"] = (first, len(builds), all(torch.equal(x, layers[0]) for x in layers))
        finally:
            cpa._build_thd_plan = real_build

        # dropout: active in training only, through the model-parallel RNG tracker
        md = CpuCoreAttention(_config(attention_dropout=0.5), 1, AttnMaskType.causal, "self")
        q, k, v, _ = _qkvg((6, 1), seed=4)
        md.train()
        dropped = md(q, k, v, None)
        md.eval()
        out["dropout"] = (dropped, md(q, k, v, None))

        # 5. refusals at forward time
        out["err_mask_type"] = _error(lambda: m(q, k, v, None, attn_mask_type=AttnMaskType.no_mask))
        bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([2, 3]))
        out["err_cu_total"] = _error(lambda: m(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=bad))
        out["err_heads"] = _error(lambda: m(q, q, v, None))
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def single():
    return run_distributed(_single_rank, 1, timeout=150)[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(DPA_VARIANTS))
def test_cp1_sbhd_equals_megatron_dot_product_attention(single, name):
    (want, *want_grads), (got, *got_grads) = single[f"dpa_{name}"]
    assert got.shape == want.shape == (7, 2, NP * HN) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and both equal the float64 reference
    q, k, v, _ = _qkvg((7, 2), seed=1, dtype=torch.float32)
    _over, scale, _layer = DPA_VARIANTS[name]
    ref = ref_sbhd(q, k, v, scale if scale is not None else 1 / math.sqrt(HN))
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(180)
def test_cp1_thd_equals_reference_per_sequence(single):
    q, k, v, g = _qkvg((sum(THD_LENGTHS),), seed=2)
    want = ref_with_grads(lambda q, k, v: ref_attention(q, k, v, THD_LENGTHS, 1 / math.sqrt(HN)), q, k, v, g)
    got = single["thd"]
    assert got[0].shape == (sum(THD_LENGTHS), NP * HN)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    for a, b in zip(single["thd_grouped"], want):  # split into batches: the same answer
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # attending across the sequence boundary would change the answer
    joint = ref_attention(q, k, v, [sum(THD_LENGTHS)], 1 / math.sqrt(HN))
    assert not torch.allclose(joint[2:], got[0][2:])


@pytest.mark.timeout(180)
def test_cp1_thd_uses_padded_cu_seqlens(single):
    _, padded = THD_PADDED
    q, k, v, g = _qkvg((sum(padded),), seed=3)
    want = ref_with_grads(lambda q, k, v: ref_attention(q, k, v, padded, 1 / math.sqrt(HN)), q, k, v, g)
    for a, b in zip(single["thd_padded"], want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(180)
def test_thd_index_plan_built_once_per_microbatch(single):
    assert single["plan_builds"] == (1, 2, True)


@pytest.mark.timeout(180)
def test_dropout_only_in_training(single):
    dropped, plain = single["dropout"]
    q, k, v, _ = _qkvg((6, 1), seed=4)
    torch.testing.assert_close(plain, ref_sbhd(q, k, v, 1 / math.sqrt(HN)), rtol=1e-10, atol=1e-10)
    assert not torch.allclose(dropped, plain)


@pytest.mark.timeout(180)
def test_forward_refusals(single):
    assert "causal" in single["err_mask_type"] and "no_mask" in single["err_mask_type"]
    assert "cu_seqlens[-1]=5" in single["err_cu_total"]
    assert "key/value heads" in single["err_heads"]


def test_non_causal_mask_type_refused_at_construction():
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.parallel.cp_attention import CpuCoreAttention

    for mt in (AttnMaskType.padding, AttnMaskType.no_mask, AttnMaskType.padding_causal):
        with pytest.raises(ValueError, match="causal attention only"):
            CpuCoreAttention(_config(), 1, mt, "self")


def test_zigzag_positions_helper():
    from gspo_megatron.parallel.cp_attention import zigzag_positions

    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    for cp in (2, 3):
        for r in range(cp):
            assert zigzag_positions(12, cp, r).tolist() == zigzag_index(12, cp, r).tolist()
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_positions(6, 2, 0)


# ---------------------------------------------------------------------------------------------
# CP2: 2 processes
# ---------------------------------------------------------------------------------------------

SBHD_CASES = {  # name -> (S, b, dtype)
    "b2_s8_fp64": (8, 2, torch.float64),
    "b1_s4_fp64": (4, 1, torch.float64),  # chunk size 1
    "b2_s12_fp32": (12, 2, torch.float32),
}
THD_CP_CASES = {  # name -> (real lengths, padded lengths or None)
    "padded": ([3, 8, 9], [4, 8, 12]),
    "unpadded": ([8, 4, 12], None),
}


def _cp2_rank(rank, world_size):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.parallel.cp_attention import CpuCoreAttention
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    ctx = init_parallel(ParallelConfig(cp=2, device="cpu"))
    assert ctx.cp_rank == rank and ctx.cp_group.size() == 2
    cfg = _config(cp=2)
    out = {}
    try:
        m = CpuCoreAttention(cfg, 1, AttnMaskType.causal, "self")  # groups from Megatron's state
        for i, (name, (S, b, dtype)) in enumerate(SBHD_CASES.items()):
            q, k, v, g = _qkvg((S, b), seed=10 + i, dtype=dtype)
            idx = zigzag_index(S, 2, rank)
            out[f"sbhd_{name}"] = _run_local(m, q[idx], k[idx], v[idx], g[idx])

        pgc = ProcessGroupCollection(tp=ctx.tp_group, cp=ctx.cp_group)
        mp = CpuCoreAttention(cfg, 1, AttnMaskType.causal, "self", pg_collection=pgc)
        for i, (name, (real, padded)) in enumerate(THD_CP_CASES.items()):
            full = padded or real
            q, k, v, g = _qkvg((sum(full),), seed=20 + i)
            idx = thd_index(full, 2, rank)
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(real), cu_seqlens_kv=_cu(real),
                                  max_seqlen_q=max(full), max_seqlen_kv=max(full))
            if padded:
                psp.cu_seqlens_q_padded = psp.cu_seqlens_kv_padded = _cu(padded)
            out[f"thd_{name}"] = _run_local(mp, q[idx], k[idx], v[idx], g[idx], packed_seq_params=psp)

        # local lengths 4 | 2 | 6 (full 8 | 4 | 12): batches of at most 2*6*12*4 = 576 scores -> (6, 4) | 2
        real = THD_CP_CASES["unpadded"][0]
        q, k, v, g = _qkvg((sum(real),), seed=20 + list(THD_CP_CASES).index("unpadded"))
        idx = thd_index(real, 2, rank)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(real), cu_seqlens_kv=_cu(real))
        mp.BATCH_ELEMENTS = 576
        out["thd_grouped"] = _run_local(mp, q[idx], k[idx], v[idx], g[idx], packed_seq_params=psp)
        mp.BATCH_ELEMENTS = CpuCoreAttention.BATCH_ELEMENTS

        # dynamic CP: packed_seq_params.cp_group wins over the module's group
        full = THD_CP_CASES["unpadded"][0]
        q, k, v, g = _qkvg((sum(full),), seed=21)
        idx = thd_index(full, 2, rank)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(full), cp_group=ctx.cp_group)
        out["thd_dynamic_group"] = _run_local(m, q[idx], k[idx], v[idx], g[idx], packed_seq_params=psp)

        # a value head dim unlike q/k's, sbhd and thd: K and V gathered over CP in one collective;
        # built as multi-latent attention builds its core attention (k_channels, v_channels)
        mv = CpuCoreAttention(cfg, 1, AttnMaskType.causal, "self", k_channels=HN, v_channels=HV, pg_collection=pgc)
        out["hv_channels"] = (mv.softmax_scale, mv.hidden_size_per_partition)
        q, k, v, g = _qkvg_v((8, 2), seed=30)
        idx = zigzag_index(8, 2, rank)
        out["hv_sbhd"] = _run_local(mv, q[idx], k[idx], v[idx], g[idx])
        full = THD_CP_CASES["unpadded"][0]
        q, k, v, g = _qkvg_v((sum(full),), seed=31)
        idx = thd_index(full, 2, rank)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu(full), cu_seqlens_kv=_cu(full))
        out["hv_thd"] = _run_local(mv, q[idx], k[idx], v[idx], g[idx], packed_seq_params=psp)

        # refusals happen before any collective, on every rank alike
        bad = PackedSeqParams(qkv_format="thd", cu_seqlens_q=_cu([6, 6]))
        out["err_thd_len"] = _error(lambda: m(q[:6], k[:6], v[:6], None, packed_seq_params=bad))
        out["err_sbhd_odd"] = _error(lambda: m(q[:3, None], k[:3, None], v[:3, None], None))
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def cp2():
    return run_distributed(_cp2_rank, 2, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(SBHD_CASES))
def test_cp2_sbhd_zigzag_equals_reference(cp2, name):
    S, b, dtype = SBHD_CASES[name]
    i = list(SBHD_CASES).index(name)
    q, k, v, g = _qkvg((S, b), seed=10 + i, dtype=dtype)
    want = ref_with_grads(lambda q, k, v: ref_sbhd(q, k, v, 1 / math.sqrt(HN)), q, k, v, g)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for rank in range(2):
        idx = zigzag_index(S, 2, rank)
        got = cp2[rank][f"sbhd_{name}"]
        assert got[0].shape == (S // 2, b, NP * HN) and got[0].dtype == dtype
        for what, a, ref in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a.double(), ref[idx], rtol=tol, atol=tol, msg=f"{what} rank {rank}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(THD_CP_CASES) + ["dynamic_group", "grouped"])
def test_cp2_thd_equals_reference(cp2, name):
    if name == "dynamic_group":
        full, seed = THD_CP_CASES["unpadded"][0], 21
    elif name == "grouped":  # the unpadded case in two padded batches, out of local order
        full, seed = THD_CP_CASES["unpadded"][0], 20 + list(THD_CP_CASES).index("unpadded")
    else:
        real, padded = THD_CP_CASES[name]
        full, seed = padded or real, 20 + list(THD_CP_CASES).index(name)
    q, k, v, g = _qkvg((sum(full),), seed=seed)
    want = ref_with_grads(lambda q, k, v: ref_attention(q, k, v, full, 1 / math.sqrt(HN)), q, k, v, g)
    for rank in range(2):
        idx = thd_index(full, 2, rank)
        got = cp2[rank][f"thd_{name}"]
        assert got[0].shape == (sum(full) // 2, NP * HN)
        for what, a, ref in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, ref[idx], rtol=1e-10, atol=1e-10, msg=f"{what} rank {rank}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fmt", ["sbhd", "thd"])
def test_cp2_a_value_head_dim_unlike_qk_equals_reference(cp2, fmt):
    """Issue 53 (a generic capability, not a family's flag): values whose head dim differs from
    the queries' and keys' (multi-head latent attention's v_head_dim against qk_head_dim +
    qk_pos_emb_head_dim), at CP2 in both layouts, against the float64 reference; the output is
    np * hv wide. The key/value shapes may still differ in nothing else."""
    if fmt == "sbhd":
        q, k, v, g = _qkvg_v((8, 2), seed=30)
        want = ref_with_grads(lambda q, k, v: ref_sbhd(q, k, v, 1 / math.sqrt(HN)), q, k, v, g)
        index = [zigzag_index(8, 2, r) for r in range(2)]
    else:
        full = THD_CP_CASES["unpadded"][0]
        q, k, v, g = _qkvg_v((sum(full),), seed=31)
        want = ref_with_grads(lambda q, k, v: ref_attention(q, k, v, full, 1 / math.sqrt(HN)), q, k, v, g)
        index = [thd_index(full, 2, r) for r in range(2)]
    for rank in range(2):
        assert cp2[rank]["hv_channels"] == (1 / math.sqrt(HN), NP * HV)
        got = cp2[rank][f"hv_{fmt}"]
        assert got[0].shape[-1] == NP * HV
        for what, a, ref in zip(("out", "dq", "dk", "dv"), got, want):
            torch.testing.assert_close(a, ref[index[rank]], rtol=1e-10, atol=1e-10, msg=f"{what} rank {rank}")


@pytest.mark.timeout(180)
def test_cp2_layout_refusals(cp2):
    for rank in range(2):
        assert "multiple of 4" in cp2[rank]["err_thd_len"]
        assert "must be even" in cp2[rank]["err_sbhd_odd"]


def test_packed_microbatch_passes_padded_boundaries_only_when_padded():
    """TE takes any cu_seqlens_q_padded as "padded between sequences" and then cannot use
    FlashAttention-2: a packed microbatch whose sequences fill their segments exactly passes only
    cu_seqlens_q (which Megatron's THD RoPE then uses too, attention.py:1082-1089); one with a
    sequence padded inside its segment (CP's 2*cp multiple) passes both."""
    from gspo_megatron.train.batch import BatchShape, TrainSample, collate_packed

    def sample(n_prompt, n_resp):
        return TrainSample(list(range(1, n_prompt + 1)), list(range(1, n_resp + 1)), 1.0)

    exact = collate_packed([sample(3, 3), sample(2, 2)], BatchShape(multiple=2, pad_id=0, cp=1, cp_rank=0, packed=True))
    psp = exact.packed_seq_params()
    assert psp.cu_seqlens_q_padded is None and psp.cu_seqlens_kv_padded is None
    assert psp.cu_seqlens_q.tolist() == [0, 6, 10]
    # CP 2: each sequence padded to a multiple of 4 (7 -> 8)
    padded = collate_packed([sample(4, 3), sample(2, 2)], BatchShape(multiple=4, pad_id=0, cp=2, cp_rank=0, packed=True))
    psp = padded.packed_seq_params()
    assert psp.cu_seqlens_q.tolist() == [0, 7, 11] and psp.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    # a filler segment is not padding inside a sequence
    filled = collate_packed([sample(3, 3)], BatchShape(multiple=2, pad_id=0, cp=1, cp_rank=0, packed=True), total=10)
    assert filled.packed_seq_params().cu_seqlens_q_padded is None and filled.cu_seqlens.tolist() == [0, 6, 10]
