"""RoPE of packed (THD) microbatches without TE's fused kernel: the packed cos/sin once per microbatch.

Megatron-Core 0.16.1's unfused THD path (models/common/embeddings/rope_utils.py:178-247,
``_apply_rotary_pos_emb_thd``) reads ``cu_seqlens`` back to the host, slices the frequency table
once per sequence (``_get_thd_freqs_on_this_cp_rank``, :129-175), concatenates the slices and
takes their cos and sin (``_apply_rotary_pos_emb_bshd``, :92-126) - for the query and again for
the key, in every layer. All of that depends only on the microbatch's boundaries and the table,
which are the same tensors for q and k and for every layer of a forward (attention.py:1075-1117
passes ``packed_seq_params.cu_seqlens_*`` and one ``rotary_pos_emb``). On CPU, at 16 sequences of
~38 tokens, it cost more than the rotation itself (bench/bench_trainer.py profile: 26 ms of a
0.44 s step). `install()` rebinds ``apply_rotary_pos_emb`` in megatron.core.transformer.attention
to `apply_rotary_pos_emb`, which builds the packed cos/sin with Megatron's own slicing once and
keeps them on the ``cu_seqlens`` tensor (they live and die with the microbatch); the rotation is
Megatron's formula on the same shapes, so the result is bitwise the same
(tests/test_rope.py). Everything else - TE's fused RoPE (``apply_rope_fusion``: GPU runs with
TE, checked by bench/gpu_check.py), bshd, interleaved or MLA rotary - goes to Megatron's function
unchanged.
"""
from __future__ import annotations

import torch
from torch import Tensor

_ATTR = "_gspo_thd_rope"  # the attribute of the cu_seqlens tensor that holds the packed cos/sin


def _megatron():
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils


def packed_cos_sin(freqs: Tensor, cu_seqlens: Tensor, cp_size: int, cp_rank: int, mscale: float,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin [t, 1, 1, rot_dim] of this CP rank's packed tokens, as Megatron's unfused THD
    path computes them (both of its frequency layouts: a table of max_seqlen positions, or one
    of every packed position when its length is cu_seqlens[-1]); cached on `cu_seqlens`."""
    key = (id(freqs), tuple(freqs.shape), cp_size, cp_rank, float(mscale), dtype)
    cache = getattr(cu_seqlens, _ATTR, None)
    if cache is None:
        cache = {}
        setattr(cu_seqlens, _ATTR, cache)
    hit = cache.get(key)
    if hit is not None and hit[0] is freqs:  # the table itself is kept: its id cannot be reused
        return hit[1], hit[2]
    ru = _megatron()
    lengths = ((cu_seqlens[1:] - cu_seqlens[:-1]) // cp_size).tolist()
    # rope_utils.py:210-233: per-sequence offsets only when the table holds every packed position
    exact = freqs.dim() >= 1 and freqs.size(0) == int(cu_seqlens[-1])
    starts = cu_seqlens[:-1].tolist() if exact else [0] * len(lengths)
    slices = [ru._get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, freqs.new_empty(n, 0), freqs, int(o))
              for n, o in zip(lengths, starts)]
    packed = torch.cat(slices, dim=0) if slices else freqs[:0]
    cos = (torch.cos(packed) * mscale).to(dtype)
    sin = (torch.sin(packed) * mscale).to(dtype)
    cache[key] = (freqs, cos, sin)
    return cos, sin


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config, cu_seqlens: Tensor | None = None, mscale: float = 1.0,
                         cp_group=None) -> Tensor:
    """Megatron's ``rope_utils.apply_rotary_pos_emb`` (same signature); the unfused THD case with
    plain rotary uses the cached packed cos/sin."""
    ru = _megatron()
    if (cu_seqlens is None or config.apply_rope_fusion or config.rotary_interleaved
            or config.multi_latent_attention):
        return ru.apply_rotary_pos_emb(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    cos, sin = packed_cos_sin(freqs, cu_seqlens, cp_group.size(), cp_group.rank(), mscale, t.dtype)
    # _apply_rotary_pos_emb_bshd on t.unsqueeze(1), as rope_utils.py:235-241 calls it
    x = t.unsqueeze(1)
    rot = cos.shape[-1]
    x, x_pass = x[..., :rot], x[..., rot:]
    x = (x * cos) + (ru._rotate_half(x, False) * sin)
    return torch.cat((x, x_pass), dim=-1).squeeze(1)


def install() -> None:
    """Rebind Megatron's attention module to `apply_rotary_pos_emb` (idempotent; any device:
    it only takes over where Megatron would run its own unfused THD code)."""
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is not apply_rotary_pos_emb:
        if attention.apply_rotary_pos_emb is not _megatron().apply_rotary_pos_emb:
            raise RuntimeError("megatron.core.transformer.attention.apply_rotary_pos_emb is not rope_utils' "
                               "any more: megatron-core changed, revisit gspo_megatron/model/rope.py")
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb
