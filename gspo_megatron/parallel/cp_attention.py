"""CPU core attention with context parallelism (CP) and packed THD sequences, for Megatron's local spec.

What it is for
--------------
A *test vehicle*: it lets the real Megatron model code around attention (QKV projection, RoPE with
CP slicing, ``PackedSeqParams`` plumbing, output projection, schedules) run on CPU / gloo with
``context_parallel_size > 1`` and with packed ``thd`` batches. Megatron's local
``DotProductAttention`` refuses both (megatron/core/transformer/dot_product_attention.py:57-59
asserts ``context_parallel_size == 1``; :153 asserts ``packed_seq_params is None``). On GPU the
Transformer Engine spec is used instead and TE's own CP attention (ring / all-gather) does this work;
this module is never meant to run there. It plugs in as
``layer_spec.submodules.self_attention.submodules.core_attention = CpuCoreAttention``.

It is exact, not fast: every rank all-gathers K and V of the whole CP group and computes its local
queries against all of them with an explicit mask; memory is O(local_tokens x full_tokens) for
[s, b] inputs and, for packed THD inputs, per sequence: sequences of similar lengths are padded
into batches of at most ``BATCH_ELEMENTS`` scores (one masked call per batch; no work across
sequence boundaries, as TE's THD kernels). The index work of a packed microbatch is done once and
kept on its ``PackedSeqParams`` (every layer gets the same object); without dropout the masked
call is torch's ``scaled_dot_product_attention`` (about half the time of matmul + softmax here).
It once looked as if SDPA's summation order moved the calculator-agent demo (held-out pass@1
0.30-0.34 against 0.61-0.77); that was the demo's run-to-run spread at 150 steps, which the
matmul path shows too (0.25-0.68 over twelve runs): the demo now runs 300 steps.

Conventions copied from ``DotProductAttention`` (dot_product_attention.py)
-------------------------------------------------------------------------
* heads per TP partition: ``num_attention_heads / tp`` query heads and ``num_query_groups / tp``
  KV heads (GQA: KV heads repeated with ``repeat_interleave`` along the head dim, :169-175).
  Note attention.py:310-315 hands core attention a config copy with ``num_query_groups = tp`` when
  there are fewer groups than TP ranks.
* softmax scale: the ``softmax_scale`` argument (attention.py:324 passes ``config.softmax_scale``),
  else ``1/sqrt(kv_channels)`` (:85). ``apply_query_key_layer_scaling`` divides the scale by the
  layer number (:89-91) and ``FusedScaleMaskSoftmax`` multiplies the scores back by the same
  number in fp32 (fused_softmax.py:316-317): the net scale is unchanged, so it is accepted and the
  plain net scale is used (scores are always formed in fp32 or wider here).
* the dropout is ``config.attention_dropout`` unless ``attention_dropout`` is given (:114-116),
  applied to the probabilities in training inside the model-parallel RNG tracker unless sequence
  parallel is on (:216-220). With p == 0 the tracker is not touched (dropout is the identity).
* scores, softmax and the probability-value product run in fp32 (fp64 for fp64 inputs); the
  output is cast back to the input dtype. (Without dropout these steps run inside torch's fused
  SDPA, in the same fp32/fp64 compute dtype: the same math, summed in another order.)
* output ``[s, b, np*hn]`` (sbhd) like DotProductAttention (:248-249); ``[t, np*hn]`` for thd,
  which attention.py:1189-1194 reshapes to ``[t, 1, np*hn]``.

Only causal self-attention is supported. The causal mask is built from global token positions;
``attention_mask`` is ignored, as TE does for causal mask types. (Careful: DotProductAttention would
*use* a given mask instead of its own causal one, fused_softmax.py:323, filling -10000.0 rather
than -inf, transformer/utils.py:49-51.)

Layouts
-------
sbhd (``packed_seq_params is None``): query ``[s, b, np, hn]``, key/value ``[s, b, ng, hn]``.
With CP size ``c > 1`` the local ``s`` tokens are Megatron's zigzag ("load balanced") split: the
full sequence of length ``S = s * c`` is cut into ``2c`` equal chunks and CP rank ``r`` holds
chunks ``r`` and ``2c-1-r``, concatenated (megatron/core/utils.py:2021-2036
``get_batch_on_this_cp_rank``; rope_utils.py:48-70 ``get_pos_emb_on_this_cp_rank`` slices RoPE
the same way).

thd (``packed_seq_params.qkv_format == 'thd'``): query ``[t, np, hn]``, key/value ``[t, ng, hn]``
(attention.py:1066-1069 squeezes the dummy batch dim). ``cu_seqlens_q_padded`` if set, else
``cu_seqlens_q`` (as attention.py:1081-1085 does for RoPE), are the cumulative lengths of the
FULL sequences (all CP ranks). With CP every length is a multiple of ``2c`` and rank ``r`` holds,
for each sequence in order, that sequence's chunks ``r`` and ``2c-1-r`` (chunk = L_i / 2c), so the
local ``t = cu[-1] / c``. This is Transformer Engine's THD CP partitioning, which Megatron's RoPE
assumes too (rope_utils.py:204 divides each length by ``cp_size``, :129-165
``_get_thd_freqs_on_this_cp_rank`` takes chunks ``r`` and ``2c-1-r`` per sequence). A token attends
to tokens of its own sequence at global positions <= its own. Padding tokens (the tail of a
sequence's padded length) are ordinary causal tokens; they never influence real tokens, since they
come after them. (TE leaves padding-token outputs unspecified, so only real tokens are comparable.)

CP group: ``packed_seq_params.cp_group`` when set (Megatron's dynamic CP, as TEDotProductAttention
does, extensions/transformer_engine.py:1345-1363), else ``pg_collection.cp``, else Megatron's
global context-parallel group.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from gspo_megatron.parallel.seq_reduce import zigzag_positions as _zigzag

__all__ = [
    "AllGatherSeqOverCP",
    "CpuCoreAttention",
    "all_gather_seq_over_cp",
    "zigzag_positions",
]


class AllGatherSeqOverCP(torch.autograd.Function):
    """All-gather a tensor along dim 0 (sequence / token dim) over the CP group, in rank order.

    Backward: every rank's gathered tensor fed its own attention, so the gradient of rank ``j``'s
    slice is the SUM over CP ranks of the gradients w.r.t. that slice. gloo has no
    reduce_scatter, so the full gradient is all-reduced and each rank keeps its own slice.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        world = dist.get_world_size(group)
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        ctx.n = x.size(0)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous().clone()  # never reduce into a tensor autograd may share
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n].clone(), None


def all_gather_seq_over_cp(x: Tensor, group) -> Tensor:
    """``AllGatherSeqOverCP.apply``: ``[n, ...]`` per rank -> ``[cp * n, ...]`` in CP-rank order."""
    return AllGatherSeqOverCP.apply(x, group)


def zigzag_positions(length: int, cp_size: int, cp_rank: int, device=None) -> Tensor:
    """parallel/seq_reduce.py's zigzag positions of CP rank ``cp_rank``, on ``device``."""
    return _zigzag(length, cp_size, cp_rank).to(device) if device is not None else _zigzag(length, cp_size, cp_rank)


class CpuCoreAttention(MegatronModule):
    """Causal core attention for CPU with context parallelism and THD packing (see module doc).

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None):
      sbhd: query [s, b, np, hn], key [s, b, ng, hn], value [s, b, ng, hv] -> [s, b, np*hv]
      thd:  query [t, np, hn],    key [t, ng, hn],    value [t, ng, hv]    -> [t, np*hv]

    The value head dim `hv` may differ from the query/key one `hn` (multi-head latent attention:
    q/k carry a rotary part that v has not); the scale is then Megatron's, given by the caller
    (softmax_scale) or 1/sqrt(kv_channels).
    """

    #: THD: score elements (batch x heads x local queries x keys) per attention call (_forward_thd)
    BATCH_ELEMENTS = 1 << 22

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        # k_channels / v_channels: the q/k and the value head dims when they differ from
        # config.kv_channels (multi-latent attention passes both: multi_latent_attention.py, its
        # core_attention build_module), as TEDotProductAttention takes them; the attention itself
        # reads the head dims from q, k and v.
        super().__init__(config=config)
        self.config: TransformerConfig = config
        _check_mask_type(attn_mask_type)
        if attention_type != "self":
            raise ValueError(f"CpuCoreAttention supports self-attention only, got attention_type={attention_type!r}")
        if config.softmax_type != "vanilla":
            raise ValueError(f"CpuCoreAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}")
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise ValueError("CpuCoreAttention does not support sliding-window attention (config.window_size)")
        if getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False):
            raise ValueError("CpuCoreAttention does not track max attention logits (qk_clip / log_max_attention_logit)")

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # unused: K/V are always all-gathered

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        elif not hasattr(pg_collection, "tp"):
            raise ValueError("CpuCoreAttention pg_collection must have a tp process group")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)

        tp = pg_collection.tp.size()
        self.k_channels = config.kv_channels if k_channels is None else k_channels
        self.v_channels = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_partition = divide(self.v_channels * config.num_attention_heads, tp)  # output
        self.hidden_size_per_attention_head = self.k_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)

        # DotProductAttention: scale / layer_number before the matmul, * layer_number in the fp32
        # softmax when apply_query_key_layer_scaling -> the same net scale, used directly here.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.softmax_scale = softmax_scale

        self.attention_dropout = torch.nn.Dropout(
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    # ------------------------------------------------------------------------------------------

    def _resolve_cp_group(self, packed_seq_params: Optional[PackedSeqParams]):
        if packed_seq_params is not None:
            if packed_seq_params.cp_group is not None:  # dynamic CP (as TEDotProductAttention)
                return packed_seq_params.cp_group
            if packed_seq_params.local_cp_size is not None:
                if packed_seq_params.local_cp_size != 1:
                    raise ValueError("packed_seq_params.local_cp_size must be 1 when cp_group is not given")
                return None
        group = self.cp_group
        if group is None:
            group = parallel_state.get_context_parallel_group(check_initialized=False)
        if group is not None and group.size() != self.config.context_parallel_size:
            raise ValueError(
                f"CP group has {group.size()} ranks but config.context_parallel_size="
                f"{self.config.context_parallel_size}"
            )
        return group

    def _check_heads(self, query: Tensor, key: Tensor, value: Tensor, head_dim: int) -> None:
        np_, ng = self.num_attention_heads_per_partition, self.num_query_groups_per_partition
        if query.size(head_dim) != np_ or key.size(head_dim) != ng or value.size(head_dim) != ng:
            raise ValueError(
                f"expected {np_} query heads and {ng} key/value heads per TP partition, got "
                f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
            )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must differ in the head dim only")

    def _gather_kv(self, key: Tensor, value: Tensor, group, cp: int) -> tuple[Tensor, Tensor]:
        if cp == 1:
            return key, value
        hn = key.size(-1)
        kv = all_gather_seq_over_cp(torch.cat([key, value], dim=-1), group)  # one collective
        return kv[..., :hn], kv[..., hn:]  # the value's head dim may differ (hv)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> Tensor:
        """q [B, np, sq, hn], k [B, ng, sk, hn], v [B, ng, sk, hv], allowed bool broadcastable to
        [B, np, sq, sk] -> [B, np, sq, hv]."""
        rep = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        if not (self.training and self.attention_dropout.p > 0):
            # torch's fused attention (on CPU its flash kernel, GQA without copying k/v): forward
            # plus backward in about half the time of the matmul/softmax below at the demo's sizes
            # (16 x 4 heads x 40 x 40: 1.8 ms against 3.5). Every query row allows >= 1 key, so no
            # row is all -inf. Dropout stays below: it must draw from Megatron's RNG tracker.
            return torch.nn.functional.scaled_dot_product_attention(
                q.to(compute), k.to(compute), v.to(compute), attn_mask=allowed, scale=self.softmax_scale,
                enable_gqa=rep > 1)
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q.to(compute), k.to(compute).transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))  # every row keeps its own token
        probs = torch.softmax(scores, dim=-1)
        if self.training and self.attention_dropout.p > 0:
            if not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    probs = self.attention_dropout(probs)
            else:
                probs = self.attention_dropout(probs)
        return torch.matmul(probs, v.to(compute))

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """Causal attention of the local queries against the CP group's keys/values.

        ``attention_mask`` is ignored (the causal mask follows from global positions)."""
        _check_mask_type(self.attn_mask_type if attn_mask_type is None else attn_mask_type)
        if attention_bias is not None:
            raise ValueError("CpuCoreAttention does not support attention_bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format != "thd":
            raise ValueError(
                f"CpuCoreAttention supports packed_seq_params.qkv_format='thd' only, got "
                f"{packed_seq_params.qkv_format!r} (pass packed_seq_params=None for sbhd)"
            )
        group = self._resolve_cp_group(packed_seq_params)
        cp = 1 if group is None else group.size()
        cp_rank = 0 if group is None else group.rank()
        if packed_seq_params is None:
            return self._forward_sbhd(query, key, value, group, cp, cp_rank)
        return self._forward_thd(query, key, value, packed_seq_params, group, cp, cp_rank)

    def _forward_sbhd(self, query, key, value, group, cp, cp_rank) -> Tensor:
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                f"sbhd attention expects 4-d query/key/value [s, b, heads, hn], got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        self._check_heads(query, key, value, head_dim=2)
        s, b, np_, hn = query.shape
        if key.size(0) != s or key.size(1) != b:
            raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} differ in [s, b]")
        if cp > 1 and s % 2:
            raise ValueError(f"with CP={cp} the local sequence length must be even (two zigzag chunks), got {s}")
        full = s * cp
        dev = query.device
        q_pos = zigzag_positions(full, cp, cp_rank, dev)
        k_pos = torch.cat([zigzag_positions(full, cp, j, dev) for j in range(cp)])
        allowed = k_pos[None, :] <= q_pos[:, None]  # [s, S]

        k_all, v_all = self._gather_kv(key, value, group, cp)  # [S, b, ng, hn|hv], CP-rank order
        out = self._attend(
            query.permute(1, 2, 0, 3), k_all.permute(1, 2, 0, 3), v_all.permute(1, 2, 0, 3), allowed
        )  # [b, np, s, hv]
        out = out.permute(2, 0, 1, 3).reshape(s, b, np_ * value.size(-1))
        return out.to(query.dtype)

    def _forward_thd(self, query, key, value, psp: PackedSeqParams, group, cp, cp_rank) -> Tensor:
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise ValueError(
                f"thd attention expects 3-d query/key/value [t, heads, hn], got "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        self._check_heads(query, key, value, head_dim=1)
        t, np_, hn = query.shape
        hv = value.size(-1)
        if key.size(0) != t:
            raise ValueError(f"query {tuple(query.shape)} and key {tuple(key.shape)} differ in t")
        plan = _thd_plan(psp, t, cp, cp_rank, query.device, np_ * cp, self.BATCH_ELEMENTS)
        k_all, v_all = self._gather_kv(key, value, group, cp)  # [T, ng, hn|hv], CP-rank order
        q_h, k_h, v_h = query.permute(1, 0, 2), k_all.permute(1, 0, 2), v_all.permute(1, 0, 2)
        outs = []
        for qi, ki, allowed, keep in plan.batches:
            B, lq = qi.shape
            q = q_h[:, qi.reshape(-1)].view(np_, B, lq, hn).transpose(0, 1)
            k = k_h[:, ki.reshape(-1)].view(-1, B, ki.shape[1], hn).transpose(0, 1)
            v = v_h[:, ki.reshape(-1)].view(-1, B, ki.shape[1], hv).transpose(0, 1)
            o = self._attend(q, k, v, allowed)  # [B, np, Lq, hv]
            outs.append(o.transpose(0, 1).reshape(np_, B * lq, hv).index_select(1, keep))
        if not outs:
            return query.new_zeros(t, np_ * hv)
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # [np, t, hv] in batch order
        if plan.unsort is not None:
            out = out.index_select(1, plan.unsort)
        return out.permute(1, 0, 2).reshape(t, np_ * hv).to(query.dtype)


class _ThdPlan:
    """The index work of one packed microbatch's attention: per batch of similar-length sequences
    (qi [B, Lq] local query index, ki [B, cp*Lq] key index into the CP-gathered tokens, allowed
    [B, 1, Lq, cp*Lq], keep: the real rows of the flattened batch), and the permutation back to
    token order (None when the batches already are in it)."""

    __slots__ = ("batches", "unsort")

    def __init__(self, batches, unsort):
        self.batches, self.unsort = batches, unsort


def _thd_plan(psp: PackedSeqParams, t: int, cp: int, cp_rank: int, device, heads_cp: int, budget: int) -> _ThdPlan:
    """The attention plan of a packed microbatch, computed once per PackedSeqParams object and
    kept on it: Megatron passes the same object to every layer of a forward (gpt_model.py ->
    transformer_block.py -> attention.py), so the Python index work and the host read of
    cu_seqlens happen once per microbatch instead of once per layer (it cost more than the
    attention arithmetic of a 2-layer model at 16 x ~38 tokens). The plan depends on nothing
    but the boundaries and these arguments, which key it."""
    key = (t, cp, cp_rank, str(device), heads_cp, budget)
    cache = getattr(psp, "_gspo_thd_plans", None)
    if cache is None:
        cache = {}
        psp._gspo_thd_plans = cache  # a plain dataclass: the attribute lives and dies with it
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = _build_thd_plan(psp, t, cp, cp_rank, device, heads_cp, budget)
    return plan


def _build_thd_plan(psp: PackedSeqParams, t: int, cp: int, cp_rank: int, device, heads_cp: int,
                    budget: int) -> _ThdPlan:
    cu_q = psp.cu_seqlens_q_padded if psp.cu_seqlens_q_padded is not None else psp.cu_seqlens_q
    cu_kv = psp.cu_seqlens_kv_padded if psp.cu_seqlens_kv_padded is not None else psp.cu_seqlens_kv
    if cu_q is None:
        raise ValueError("thd attention needs packed_seq_params.cu_seqlens_q (or cu_seqlens_q_padded)")
    if cu_kv is not None and not torch.equal(cu_kv.cpu().long(), cu_q.cpu().long()):
        raise ValueError("self-attention: cu_seqlens_kv(_padded) must equal cu_seqlens_q(_padded)")
    cu = [int(x) for x in cu_q.tolist()]
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if not cu or cu[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu}")
    if cu[-1] != t * cp:
        raise ValueError(
            f"cu_seqlens[-1]={cu[-1]} must be the full packed length = local tokens ({t}) x CP ({cp})"
        )
    if cp > 1:
        bad = [n for n in lengths if n % (2 * cp)]
        if bad:
            raise ValueError(
                f"with CP={cp} every (padded) sequence length must be a multiple of {2 * cp}, got {lengths}"
            )
    # Sequences of similar length are attended together, padded to a batch [B, heads, Lq, Lk]
    # of (local queries) x (their keys from every CP rank: rank j's tokens of sequence i sit at
    # j*t + [its local offset, + n_i/cp) of the gathered tensors), with a mask keeping each
    # query to its own sequence's real keys at global positions <= its own. The work stays
    # close to TE's per-sequence sum_i n_i^2 / cp (a batch only takes sequences at least half
    # as long as its longest) in a few calls instead of one small call per sequence, which
    # cost more in Python and dispatch than in arithmetic (the demo packs 16 x ~38 tokens).
    local = [n // cp for n in lengths]
    starts = [0]
    for n in local[:-1]:
        starts.append(starts[-1] + n)
    batches, order = [], []
    for batch in _thd_batches(local, heads_cp, budget):
        qi, valid, pos_q, ki, valid_k, pos_k = _thd_batch_index([local[i] for i in batch],
                                                               [starts[i] for i in batch],
                                                               [lengths[i] for i in batch], t, cp, cp_rank, device)
        allowed = valid_k[:, None, :] & (pos_k[:, None, :] <= pos_q[:, :, None])  # [B, Lq, Lk]
        # a padding query row sees one key: its softmax stays finite (NaN would reach the
        # real rows' gradients through the matmuls) and its output is dropped
        allowed[:, :, 0] |= ~valid
        keep = valid.reshape(-1).nonzero().squeeze(1)
        batches.append((qi, ki, allowed[:, None], keep))
        order.append(qi.reshape(-1)[keep])
    unsort = None
    if len(order) > 1:
        perm = torch.cat(order)
        if not bool((perm[1:] > perm[:-1]).all()):
            unsort = torch.argsort(perm)
    return _ThdPlan(batches, unsort)


def _thd_batches(local: list[int], heads_cp: int, budget: int) -> list[list[int]]:
    """Sequence indices (non-empty ones) in batches of similar local length: longest first, a
    batch takes sequences at least half as long as its first while B x Lq x Lq x heads_cp (its
    score elements) stays within `budget` (a sequence alone may exceed it)."""
    todo = sorted((i for i, n in enumerate(local) if n > 0), key=lambda i: (-local[i], i))
    batches: list[list[int]] = []
    for i in todo:
        if batches:
            cur = batches[-1]
            L = local[cur[0]]
            if 2 * local[i] >= L and (len(cur) + 1) * L * L * heads_cp <= budget:
                cur.append(i)
                continue
        batches.append([i])
    for b in batches:  # local order within a batch: the output needs no reordering when one batch
        b.sort()
    return batches


def _thd_batch_index(local, start, full, t, cp, cp_rank, device):
    """Index tensors of one padded THD batch of B sequences (their local token counts, local
    offsets and full lengths): local query index [B, Lq], its validity and global position; key
    index into the CP-gathered tokens [B, cp*Lq], its validity and global position."""
    lq = max(local)
    ar = torch.arange(lq)
    n = torch.tensor(local)[:, None]
    st = torch.tensor(start)[:, None]
    chunk = torch.tensor(full)[:, None] // (2 * cp)
    valid = ar[None, :] < n  # [B, Lq]
    qi = torch.where(valid, st + ar[None, :], st)  # padding rows point at the sequence's first token

    def positions(j):
        if cp == 1:
            return ar[None, :].expand_as(qi)
        return torch.where(ar[None, :] < chunk, ar[None, :] + j * chunk, ar[None, :] + (2 * cp - 2 - j) * chunk)

    ki = torch.cat([qi + j * t for j in range(cp)], dim=1)
    valid_k = valid.repeat(1, cp)
    pos_k = torch.cat([positions(j) for j in range(cp)], dim=1)
    return (qi.to(device), valid.to(device), positions(cp_rank).to(device), ki.to(device), valid_k.to(device),
            pos_k.to(device))


def _check_mask_type(mask_type) -> None:
    if mask_type != AttnMaskType.causal:
        raise ValueError(
            f"CpuCoreAttention supports causal attention only (AttnMaskType.causal), got {mask_type!r}"
        )
