"""Dry-run planner: validate a config and show what a run of it would look like on N ranks.

    python -m gspo_megatron.planner --config FILE [--json] [--world-size N | --nnodes A --nproc-per-node B] [key=value ...]

(`python -m gspo_megatron.train --config FILE --dry-run ...` calls `main` with the same arguments.)

Pure Python: no torch, no process group. It prints
  * the rank grid in Megatron-Core's order "tp-cp-ep-dp-pp": which global ranks form each TP, CP,
    DP, PP group (dense part) and each expert-TP, EP, expert-DP group (MoE part);
  * which ranks hold which decoder layers (pipeline stages) and which experts (EP ranks);
  * parameter counts (total, active per token, per rank);
  * a per-GPU memory estimate (formula below).

Parameter counts (Qwen3-MoE, from the HF config fields only)
  per layer: q [nq*hd, H], k/v [nkv*hd, H], o [H, nq*hd] (+ biases if attention_bias),
             q_norm/k_norm [hd], input/post-attention norms [H],
             MoE layer: router [E, H] + E experts of 3*H*I (gate, up, down);
             dense layer (mlp_only_layers / decoder_sparse_step): 3*H*intermediate_size;
  model: embedding [V, H] + lm_head [V, H] (unless tied) + final norm [H].
  active = everything except the (E - top_k) unused experts of each MoE layer.
  Totals use the real vocab; per-rank counts use Megatron's padded vocab (multiple of 128*TP).

Per-rank layout (Megatron): attention and dense-MLP matrices split over TP; norms, q/k norms and
the router replicated; each EP rank holds E/EP experts per layer, each split over ETP; PP stage s
holds layers [s*L/PP, (s+1)*L/PP), the embedding lives on stage 0, final norm and output layer on
the last stage (a tied embedding keeps a copy there when PP > 1).

Memory per GPU (bytes; b = bytes of model.dtype, 4 for float32):
  weights     = params_rank * b
  gradients   = params_rank * (4 if optimizer.grad_reduce_in_fp32 or float32 else b)
  optimizer   = params * (4 fp32 master (16-bit dtypes only) + 4 Adam m + 4 Adam v), divided with
                use_distributed_optimizer by the ranks sharing the parameter: DP*CP for dense
                parameters, expert-DP for expert parameters
  activations = stored tensors of the stage's layers for the microbatches in flight, with
                T = train.micro_batch_tokens / CP tokens per rank and microbatch (with
                train.packing a microbatch is filled up to that budget with real tokens plus
                padding to 2*CP per sequence; padded [b, s] microbatches also stay within it,
                but part of T is then padding):
      attention, per token: 2H (norm in/out) [/TP with SP] + ((nq + 2nkv) + (nq + nkv) + nq)*hd/TP
                            (qkv, normed+roped q/k, attention output; flash attention: no s^2 term)
      MoE, per token:       2H (norm in/out) [/TP with SP] + 2*4*E/TP (fp32 router logits, probs)
                            + k*ETP/TP routed copies of (2H + 3*I/ETP) (permuted input, fc1
                            [gate; up], SwiGLU output, fc2 output) -- balanced routing, no capacity
                            factor, no token dropping
      dense MLP, per token: 2H [/TP with SP] + 3*I_dense/TP
      selective recompute drops the norm outputs, attention output and SwiGLU output;
      full recompute keeps only each layer's input (H [/TP with SP]) plus one layer's tensors;
      microbatches in flight: PP on stage 0 under 1F1B (worst stage), 1 with PP = 1;
      last stage adds fp32 logits and their softmax/gradient: 2 * 4 * T * V_padded/TP;
      with model.fused_logprobs instead the gathered hidden states and their fp32 gradient
      accumulator, (b + 4) * T * H, plus three fp32 vocab blocks of at most 2^22 elements.
  reference_model (only when loss.kl_coef > 0, without LoRA) = params_rank * b: a resident frozen copy.
  Not counted: CUDA context and NCCL buffers (~1-3 GiB), allocator fragmentation, colocated
  SGLang engines.

LoRA (lora.rank = r > 0; model/lora.py): the base is frozen, only the adapters train.
  adapters: A (r x in) and B (out x r) on each targeted linear (lora.target_modules): "attention"
            every linear_* of self_attention (GQA: linear_qkv, linear_proj; MLA's projections),
            "mlp" dense layers' linear_fc1 / linear_fc2, "shared_experts" the shared experts',
            "experts" each routed expert's (E/EP per rank and MoE layer); in / out from the
            family's HF <-> Megatron rules (model/mapping.py: linear_qkv out = (nq + 2nkv)*hd,
            a gated fc1's out = 2*ffn). Per rank, split like the weight: column-parallel (qkv,
            fc1, MLA's up projections) A whole, B split over TP (routed experts: over ETP);
            row-parallel (linear_proj, fc2) A split, B whole; replicated linears (MLA's down
            projections) both whole.
  weights     = (params_rank + adapters_rank) * b   (the adapters in the weights' dtype)
  gradients   = adapters_rank * (4 with grad_reduce_in_fp32, else b): the base has no gradient buffer
  optimizer   = adapters * (12, or 8 in float32), sharded as above (dense adapters over DP*CP,
                expert adapters over expert-DP); the base has no optimizer state
  activations += per token and adapted linear, A x (r elements; a row-parallel one's reduced sum
                r/TP with SP), for routed experts per routed copy; with lora.dropout also its
                dropped input and mask (in * (b + 1) bytes)
  reference_model: none (the KL reference is the policy with its adapters off: no second copy).
  Not counted either: a LoRA run builds Megatron's local layers, not Transformer Engine's (model/spec.py
  local_spec), so its core attention is parallel/cp_attention.py's masked attention, not flash
  attention: the score masks of the sequence being attended (up to its length squared) come on top.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import warnings
from typing import Sequence

from gspo_megatron import resolve
from gspo_megatron.config import Config
from gspo_megatron.errors import ConfigError
from gspo_megatron.model.arch import MoeArch, padded_vocab  # noqa: F401 (planner.padded_vocab)
from gspo_megatron.resolve import load_config

GiB = 1024**3
ORDER = "tp-cp-ep-dp-pp"  # Megatron-Core's default rank order (first = fastest varying)


# ---- rank grid ------------------------------------------------------------------------------


def rank_groups(dims: Sequence[tuple[str, int]], token: str) -> list[list[int]]:
    """Groups of global ranks that vary only along the named dimensions.

    `dims` lists (name, size) from fastest- to slowest-varying: rank = Σ coord_i * Π_{j<i} size_j.
    Groups are ordered by the remaining coordinates (first fastest), members likewise — the same
    groups, in the same order, as Megatron-Core's RankGenerator.get_ranks(token).
    """
    names = [n for n, _ in dims]
    sizes = [s for _, s in dims]
    want = token.split("-")
    for w in want:
        if w not in names:
            raise ValueError(f"unknown parallel dimension {w!r}")
    stride = [math.prod(sizes[:i]) for i in range(len(sizes))]
    inner = [i for i, n in enumerate(names) if n in want]
    outer = [i for i, n in enumerate(names) if n not in want]

    def coords(idx):  # all coordinate tuples over idx, first index fastest
        for c in itertools.product(*[range(sizes[i]) for i in reversed(idx)]):
            yield tuple(reversed(c))

    groups = []
    for oc in coords(outer):
        base = sum(c * stride[i] for c, i in zip(oc, outer))
        groups.append([base + sum(c * stride[i] for c, i in zip(ic, inner)) for ic in coords(inner)])
    return groups


def decoder_dims(p, world_size: int) -> list[tuple[str, int]]:
    """Dense (attention) grid: tp, cp, dp, pp (ep = 1 in this grid, as in Megatron)."""
    return [("tp", p.tp), ("cp", p.cp), ("dp", p.dp(world_size)), ("pp", p.pp)]


def expert_dims(p, world_size: int) -> list[tuple[str, int]]:
    """Expert grid: expert-tp, ep, expert-dp, pp (cp = 1 in this grid, as in Megatron)."""
    return [("tp", p.etp), ("ep", p.ep), ("dp", p.edp(world_size)), ("pp", p.pp)]


def _coord(dims, rank: int) -> dict[str, int]:
    out = {}
    for name, size in dims:
        out[name] = rank % size
        rank //= size
    return out


# ---- parameter counts -----------------------------------------------------------------------


def planner_dims(arch: MoeArch) -> dict:
    """The numbers the plan uses, from the family's parsed architecture (the one HF-config parser:
    model/family.py); "arch" keeps the record itself."""
    return {
        "arch": arch, "model_type": arch.model_type,
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size, "num_hidden_layers": arch.num_layers,
        "num_experts": arch.num_experts, "num_experts_per_tok": arch.moe_topk,
        "moe_intermediate_size": arch.moe_intermediate_size, "intermediate_size": arch.dense_intermediate_size,
        "shared_expert_intermediate_size": arch.shared_expert_intermediate_size,
        "dense_layers": list(arch.dense_layers), "tie_word_embeddings": arch.tie_word_embeddings,
    }


def is_moe_layer(d: dict, i: int) -> bool:
    return d["arch"].is_moe_layer(i)


def layer_params(d: dict, i: int, tp: int = 1, ep: int = 1, etp: int = 1) -> dict:
    """Layer i's parameters on one rank (tp = ep = etp = 1: the whole layer): the family's count."""
    return d["arch"].layer_params(i, tp, ep, etp)


def count_params(d: dict) -> dict:
    """Total and active parameter counts of the unsharded model (real vocab): the family's count."""
    return d["arch"].count_params()


# ---- LoRA adapters --------------------------------------------------------------------------


def lora_linears(d: dict, i: int) -> list[dict]:
    """The linears of layer i an adapter can go on (model/lora.py target_of names the group from
    the Megatron module name): {"group", "split": column | row | whole, "in", "out" (the whole
    weight's), "expert": one per routed expert}, from the family's HF <-> Megatron rules."""
    from gspo_megatron.model.lora import target_of
    from gspo_megatron.model.mapping import Kind

    arch = d["arch"]
    moe = is_moe_layer(d, i)
    column = (Kind.QKV, Kind.COLUMN, Kind.DENSE_FC1, Kind.EXPERT_FC1)
    row = (Kind.ROW, Kind.EXPERT_FC2)
    out = []
    for rule in arch.family.rules(arch):  # the local spec's names (the TE grouped experts' end in .weight{expert})
        if not rule.per_layer or rule.buffer or not rule.mcore.endswith(".weight"):
            continue
        if rule.layers == ("dense" if moe else "moe"):
            continue
        group = target_of(rule.mcore[: -len(".weight")].format(layer=i, expert=0))
        if group is None:
            continue
        shapes = rule.shapes(arch)  # the HF tensors a Megatron linear fuses: out rows stacked, one input
        split = "column" if rule.kind in column else "row" if rule.kind in row else "whole"
        out.append({"group": group, "split": split, "in": shapes[0][1], "out": sum(s[0] for s in shapes),
                    "expert": rule.kind.is_expert})
    return out


def _split_widths(lin: dict, tp: int, etp: int) -> tuple[int, int]:
    """(A's input columns, B's output rows) of one adapter on one rank."""
    size = etp if lin["expert"] else tp
    if lin["split"] == "column":
        return lin["in"], lin["out"] // size
    if lin["split"] == "row":
        return lin["in"] // size, lin["out"]
    return lin["in"], lin["out"]


def lora_layer_params(d: dict, i: int, rank: int, targets, tp: int = 1, ep: int = 1, etp: int = 1) -> dict:
    """Adapter parameters of layer i on one rank by target group (tp = ep = etp = 1: the whole
    layer's): r * (A's input columns + B's output rows) per adapted linear, E/EP of them for a
    routed expert's."""
    out = dict.fromkeys(("attention", "mlp", "shared_experts", "experts"), 0)
    for lin in lora_linears(d, i):
        if lin["group"] not in targets:
            continue
        n_in, n_out = _split_widths(lin, tp, etp)
        out[lin["group"]] += rank * (n_in + n_out) * (d["num_experts"] // ep if lin["expert"] else 1)
    return out


def count_lora_params(d: dict, rank: int, targets) -> dict:
    """Adapter parameters of the whole (unsharded) model: total and by target group."""
    br = dict.fromkeys(("attention", "mlp", "shared_experts", "experts"), 0)
    for i in range(d["num_hidden_layers"]):
        for k, v in lora_layer_params(d, i, rank, targets).items():
            br[k] += v
    return {"total": sum(br.values()), "breakdown": br}


def _lora_activation_elements(d, i: int, cfg: Config) -> tuple[float, float]:
    """Per token of one microbatch on one rank, layer i's adapters: (elements kept in the model
    dtype, elements of dropout masks)."""
    lc, p = cfg.lora, cfg.parallel
    if not lc.rank:
        return 0.0, 0.0
    r, drop = lc.rank, lc.dropout > 0
    sp = p.tp if p.sequence_parallel else 1
    routed = d["num_experts_per_tok"] * p.etp / p.tp  # routed copies of a token on this rank (as the MoE term)
    kept = dropped = 0.0
    for lin in lora_linears(d, i):
        if lin["group"] not in lc.target_modules:
            continue
        n_in, _ = _split_widths(lin, p.tp, p.etp)
        if lin["expert"]:
            kept += routed * r
            dropped += routed * n_in if drop else 0
        else:  # z = A x is gathered over the sequence (column); u reduce-scattered to the shard (row, SP)
            kept += r / sp if lin["split"] == "row" else r
            dropped += (n_in / sp if lin["split"] != "row" else n_in) if drop else 0
    return kept + dropped, dropped


# ---- memory ---------------------------------------------------------------------------------


def _activation_bytes_per_layer(d, i: int, cfg: Config, T: float) -> tuple[float, float]:
    """(stored bytes of layer i for one microbatch, bytes of its input alone)."""
    moe = is_moe_layer(d, i)
    p = cfg.parallel
    b = 4 if cfg.model.dtype == "float32" else 2
    H, arch = d["hidden_size"], d["arch"]
    tp, etp = p.tp, p.etp
    sp = tp if p.sequence_parallel else 1  # divisor of the H-sized (sequence-parallel) tensors
    selective = cfg.train.recompute == "selective"
    norm_terms = (1 if selective else 2) * H / sp  # norm input (+ output unless recomputed)
    attn = norm_terms + arch.family.attention_activation_elements(arch, tp, selective)  # the family's attention
    if moe:
        E, I, k = d["num_experts"], d["moe_intermediate_size"], d["num_experts_per_tok"]
        pair = 2 * H + (2 if selective else 3) * I / etp
        mlp = norm_terms + 2 * 4 * E / (tp * b) + k * etp / tp * pair
        if d["shared_expert_intermediate_size"]:  # the shared experts: a dense MLP beside the routed ones
            mlp += (2 if selective else 3) * d["shared_expert_intermediate_size"] / tp
    else:
        mlp = norm_terms + (2 if selective else 3) * d["intermediate_size"] / tp
    adapters, masks = _lora_activation_elements(d, i, cfg)  # 0 without LoRA
    return T * ((attn + mlp + adapters) * b + masks), T * H / sp * b


def memory_per_stage(cfg: Config, d: dict, world_size: int, stage: dict) -> dict:
    p, o = cfg.parallel, cfg.optimizer
    b = 4 if cfg.model.dtype == "float32" else 2
    grad_b = 4 if (o.grad_reduce_in_fp32 or b == 4) else b
    opt_b = (4 if b != 4 else 0) + 8
    dense, expert = stage["dense_params"], stage["expert_params"]
    lora_dense, lora_expert = stage["lora_dense_params"], stage["lora_expert_params"]
    if cfg.lora.rank:  # the base frozen: gradients and Adam states for the adapters only
        trained_dense, trained_expert = lora_dense, lora_expert
    else:
        trained_dense, trained_expert = dense, expert
    if o.use_distributed_optimizer:
        optimizer = opt_b * (trained_dense / (p.dp(world_size) * p.cp) + trained_expert / p.edp(world_size))
    else:
        optimizer = opt_b * (trained_dense + trained_expert)
    T = cfg.train.micro_batch_tokens / p.cp
    layers = range(*stage["layers"])
    per_layer = [_activation_bytes_per_layer(d, i, cfg, T) for i in layers]
    in_flight = p.pp - stage["pp_rank"] if p.pp > 1 else 1  # 1F1B: stage s holds pp - s
    if cfg.train.recompute == "full":
        one_mb = sum(inp for _, inp in per_layer)
        act = one_mb * in_flight + max((full for full, _ in per_layer), default=0)
    else:
        act = sum(full for full, _ in per_layer) * in_flight
    if stage["output_layer"] and cfg.model.fused_logprobs:
        from gspo_megatron.parallel.logprobs import DEFAULT_CHUNK_ELEMENTS

        act += (b + 4) * T * d["hidden_size"] + 3 * 4 * DEFAULT_CHUNK_ELEMENTS
    elif stage["output_layer"]:
        act += 2 * 4 * T * padded_vocab(d["vocab_size"], p.tp) / p.tp
    weights = (dense + expert) * b
    out = {
        "weights": (weights + (lora_dense + lora_expert) * b) / GiB,
        "gradients": (trained_dense + trained_expert) * grad_b / GiB,
        "optimizer": optimizer / GiB,
        "activations": act / GiB,
    }
    if cfg.loss.kl_coef > 0 and not cfg.lora.rank:  # LoRA: the reference is the base, adapters off
        out["reference_model"] = weights / GiB  # a resident frozen copy of the policy's shard
    out["total"] = sum(out.values())
    return out


# ---- the plan -------------------------------------------------------------------------------


def default_world_size(cfg: Config) -> int:
    """The smallest world the layout allows: pp * lcm(tp*cp, ep*etp)."""
    p = cfg.parallel
    return p.pp * math.lcm(p.tp * p.cp, p.ep * p.etp)


def plan(config: Config, world_size: int) -> dict:
    """Validate `config` on `world_size` ranks and describe the layout (a JSON-able dict)."""
    load = None
    if config.model.load is not None:  # the checkpoint's architecture, read as the trainer reads it
        from gspo_megatron.resolve import read_load_source

        load = read_load_source(config)
    hf = resolve.hf_config_dict(config, load)
    resolve.validate_world(config, world_size, hf)
    d = planner_dims(resolve.arch_of(config, hf))
    p, lc = config.parallel, config.lora
    dp, edp = p.dp(world_size), p.edp(world_size)
    ddims, edims = decoder_dims(p, world_size), expert_dims(p, world_size)
    counts = count_params(d)
    L, E = d["num_hidden_layers"], d["num_experts"]
    Vp = padded_vocab(d["vocab_size"], p.tp)
    H = d["hidden_size"]

    groups = {
        "tp": rank_groups(ddims, "tp"),
        "cp": rank_groups(ddims, "cp"),
        "dp": rank_groups(ddims, "dp"),
        "dp_cp": rank_groups(ddims, "dp-cp"),
        "pp": rank_groups(ddims, "pp"),
        "expert_tp": rank_groups(edims, "tp"),
        "ep": rank_groups(edims, "ep"),
        "expert_dp": rank_groups(edims, "dp"),
    }

    per_stage_layers = L // p.pp
    stages = []
    for s, ranks in enumerate(zip(*groups["pp"])):  # ranks with pp coordinate s
        lo, hi = s * per_stage_layers, (s + 1) * per_stage_layers
        first, last = s == 0, s == p.pp - 1
        dense = expert = lora_dense = lora_expert = 0
        for i in range(lo, hi):
            lp = layer_params(d, i, p.tp, p.ep, p.etp)
            dense += lp["attention"] + lp["norms"] + lp["router"] + lp["dense_mlp"] + lp["shared_experts"]
            expert += lp["experts"]
            if lc.rank:
                ad = lora_layer_params(d, i, lc.rank, lc.target_modules, p.tp, p.ep, p.etp)
                lora_dense += ad["attention"] + ad["mlp"] + ad["shared_experts"]
                lora_expert += ad["experts"]
        if first:
            dense += Vp * H // p.tp
        if last:
            dense += H  # final norm
            if not d["tie_word_embeddings"] or p.pp > 1:
                dense += Vp * H // p.tp  # output layer (a tied embedding's copy when PP > 1)
        stage = {
            "pp_rank": s,
            "ranks": sorted(ranks),
            "layers": [lo, hi],
            "embedding": first,
            "output_layer": last,
            "dense_params": dense,
            "expert_params": expert,
            "params": dense + expert,
            # LoRA adapters on this stage's ranks (0 without LoRA): the only trained parameters
            "lora_dense_params": lora_dense,
            "lora_expert_params": lora_expert,
            "lora_params": lora_dense + lora_expert,
        }
        stage["memory_gib"] = memory_per_stage(config, d, world_size, stage)
        stages.append(stage)

    experts = []
    if E:
        per_ep = E // p.ep
        by_ep: dict[int, list[int]] = {}
        for r in range(world_size):
            by_ep.setdefault(_coord(edims, r)["ep"], []).append(r)
        for e in range(p.ep):
            experts.append({"ep_rank": e, "experts": [e * per_ep, (e + 1) * per_ep],
                            "ranks": by_ep[e]})

    ranks = []
    for r in range(world_size):
        dc, ec = _coord(ddims, r), _coord(edims, r)
        st = stages[dc["pp"]]
        row = {"rank": r, "tp": dc["tp"], "cp": dc["cp"], "dp": dc["dp"], "pp": dc["pp"],
               "etp": ec["tp"], "ep": ec["ep"], "edp": ec["dp"], "layers": st["layers"]}
        if E:
            per_ep = E // p.ep
            row["experts"] = [ec["ep"] * per_ep, (ec["ep"] + 1) * per_ep]
        ranks.append(row)

    peak = max(stages, key=lambda st: st["memory_gib"]["total"])
    n_moe = sum(is_moe_layer(d, i) for i in range(L))
    return {
        "world_size": world_size,
        "order": ORDER,
        "layout": {
            "tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": dp, "ep": p.ep, "etp": p.etp, "edp": edp,
            "sequence_parallel": p.sequence_parallel, "device": p.device,
        },
        "model": {
            **{k: d[k] for k in ("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                                 "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                 "shared_expert_intermediate_size", "dense_layers", "tie_word_embeddings")},
            "attention": d["arch"].family.attention_summary(d["arch"]),  # the family's words
            "moe_layers": n_moe,
            "padded_vocab_size": Vp,
            "dtype": config.model.dtype,
        },
        "total_params": counts["total"],
        "active_params": counts["active"],
        "params_breakdown": counts["breakdown"],
        "lora": _lora_summary(config, d, stages),
        "groups": groups,
        "stages": stages,
        "experts": experts,
        "ranks": ranks,
        "max_params_per_rank": max(st["params"] for st in stages),
        "peak_memory_gib": peak["memory_gib"]["total"],
        "peak_memory_stage": peak["pp_rank"],
        # colocated SGLang (rollout/colocate.py): while the engines hold the GPUs every rank parks
        # its gradient buffers and, with 16-bit parameters, its optimizer state in host memory
        # (with LoRA the adapters' only: the stages' gradients and optimizer count nothing else)
        "colocated_host_gib_per_gpu": max(
            st["memory_gib"]["gradients"] + (st["memory_gib"]["optimizer"] if config.model.dtype != "float32" else 0)
            for st in stages),
        "micro_batch_tokens": config.train.micro_batch_tokens,
        "training": training_setup(config),
        "collective_timeout": _collective_timeout(config),
        "memory_assumptions": [
            "weights in model.dtype; gradients fp32 when optimizer.grad_reduce_in_fp32",
            "Adam: fp32 master (16-bit dtypes) + m + v = 12 (or 8) bytes/param, sharded over "
            "DP*CP (dense) / expert-DP (experts) with the distributed optimizer",
            "activations: flash attention, balanced MoE routing without capacity factor, "
            "T = micro_batch_tokens/CP per microbatch (" + ("packed THD" if config.train.packing else
                                                             "padded [b, s]") + "), PP-s microbatches in flight on stage s "
            "(1F1B), " + ("fused log-probs (hidden states + fp32 blocks, no logits)"
                          if config.model.fused_logprobs else "fp32 logits + softmax") + " on the last stage",
            "not counted: CUDA context, NCCL buffers, fragmentation, colocated SGLang",
        ] + ([
            f"LoRA rank {lc.rank}: base frozen in {config.model.dtype} (no gradients, no optimizer state), adapters "
            "trained (gradients, fp32 master + Adam); KL reference = the base with adapters off (no copy); "
            "adapter activations: A x per adapted linear" + (" + dropped inputs" if lc.dropout else "")
            + "; LoRA runs Megatron's local layers, not Transformer Engine's (model/spec.py local_spec): attention "
            "through parallel/cp_attention.py, whose score masks (up to a sequence's length squared) are not counted",
        ] if lc.rank else []),
    }


def _lora_summary(config, d: dict, stages: list[dict]) -> dict | None:
    lc = config.lora
    if not lc.rank:
        return None
    total = count_lora_params(d, lc.rank, lc.target_modules)
    return {
        "rank": lc.rank, "alpha": lc.alpha, "dropout": lc.dropout, "target_modules": list(lc.target_modules),
        "total_params": total["total"],  # the whole model's adapters (a column-parallel A counted once)
        "params_breakdown": total["breakdown"],
        "max_params_per_rank": max(st["lora_params"] for st in stages),
        "kl_reference": "the base (adapters off): no copy" if config.loss.kl_coef > 0 else None,
    }


def _collective_timeout(config) -> dict:
    seconds, waits = config.collective_timeout_s()
    return {"timeout_s": seconds, "waits_s": waits}


def training_setup(config) -> dict:
    """What the trainer builds from the config (train/setup.py passes the same
    optimizer.use_distributed_optimizer to Megatron's DDP wrap, and the optimizer reads it back
    from there)."""
    o = config.optimizer
    sixteen = config.model.dtype != "float32"
    lora = config.lora.rank > 0
    return {
        "use_distributed_optimizer": o.use_distributed_optimizer,
        "optimizer": ("Megatron DistributedOptimizer (masters + Adam moments sharded over DP*CP / expert-DP)"
                      if o.use_distributed_optimizer else "Megatron optimizer, not sharded"),
        "master_weights": ("fp32" if sixteen else "the fp32 parameters themselves")
                          + (" (LoRA adapters only)" if lora else ""),
        "trained": (f"LoRA adapters (rank {config.lora.rank}, alpha {config.lora.alpha:g}) on "
                    f"{', '.join(config.lora.target_modules)}; the base frozen" if lora else "every parameter"),
        "grad_reduce": "fp32" if (o.grad_reduce_in_fp32 or not sixteen) else config.model.dtype,
        "recompute": config.train.recompute,
    }


# ---- text output ----------------------------------------------------------------------------


def _fmt_ranks(rs: Sequence[int]) -> str:
    rs = list(rs)
    if len(rs) > 2 and all(b - a == 1 for a, b in zip(rs, rs[1:])):
        return f"{rs[0]}-{rs[-1]}"
    if len(rs) > 2:
        step = rs[1] - rs[0]
        if step > 0 and all(b - a == step for a, b in zip(rs, rs[1:])):
            return f"{rs[0]}-{rs[-1]}:{step}"
    return ",".join(map(str, rs))


def _fmt_groups(gs: list[list[int]], limit: int = 6) -> str:
    shown = " ".join(f"[{_fmt_ranks(g)}]" for g in gs[:limit])
    more = f" ... ({len(gs)} groups of {len(gs[0])})" if len(gs) > limit else ""
    return shown + more


def _b(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _mem(gib: float) -> str:
    if gib >= 1:
        return f"{gib:.1f} GiB"
    if gib * 1024 >= 1:
        return f"{gib * 1024:.1f} MiB"
    return f"{gib * 1024 * 1024:.1f} KiB"


def _lora_lines(pl: dict) -> list[str]:
    lo = pl["lora"]
    if not lo:
        return []
    br = ", ".join(f"{k} {_b(v)}" for k, v in lo["params_breakdown"].items() if v)
    n, share, on = lo["total_params"], 100 * lo["total_params"] / pl["total_params"], ", ".join(lo["target_modules"])
    return [f"trainable (LoRA adapters, rank {lo['rank']}, alpha {lo['alpha']:g}, on {on}): "
            f"{_b(n)} parameters ({n:,}: {br}; {share:.2f}% of the model), at most "
            f"{_b(lo['max_params_per_rank'])} per rank; the base frozen"
            + (f"; KL reference: {lo['kl_reference']}" if lo["kl_reference"] else "")]


def format_plan(pl: dict) -> str:
    lay, m = pl["layout"], pl["model"]
    lines = [
        f"world {pl['world_size']} = tp {lay['tp']} x cp {lay['cp']} x dp {lay['dp']} x pp "
        f"{lay['pp']}; experts per stage: etp {lay['etp']} x ep {lay['ep']} x edp {lay['edp']}; "
        f"sequence_parallel {'on' if lay['sequence_parallel'] else 'off'}; order {pl['order']}",
        f"model: {m['num_hidden_layers']} layers ({m['moe_layers']} MoE), hidden {m['hidden_size']}"
        f", attention {m['attention']}, "
        f"experts {m['num_experts']} top-{m['num_experts_per_tok']} (ffn "
        f"{m['moe_intermediate_size']}), vocab {m['vocab_size']} (padded {m['padded_vocab_size']}"
        f" at tp {lay['tp']}), {m['dtype']}",
        f"params: total {_b(pl['total_params'])} ({pl['total_params']:,}), active per token "
        f"{_b(pl['active_params'])} ({pl['active_params']:,})",
        *_lora_lines(pl),
        f"training: {pl['training']['optimizer']} (DDP use_distributed_optimizer="
        f"{str(pl['training']['use_distributed_optimizer']).lower()}); master weights "
        f"{pl['training']['master_weights']}; gradient reduction {pl['training']['grad_reduce']}; "
        f"recompute {pl['training']['recompute']}",
        "groups (global ranks):",
    ]
    for name, gs in pl["groups"].items():
        lines.append(f"  {name:<10}{_fmt_groups(gs)}")
    lines.append("pipeline stages:")
    for st in pl["stages"]:
        extra = [x for x, on in (("embedding", st["embedding"]), ("final norm + output layer",
                                                                  st["output_layer"])) if on]
        lines.append(
            f"  stage {st['pp_rank']}: layers {st['layers'][0]}-{st['layers'][1] - 1}"
            f"{' + ' + ' + '.join(extra) if extra else ''}; ranks {_fmt_ranks(st['ranks'])}"
        )
    if pl["experts"]:
        lines.append("experts (global ids, in every MoE layer of the rank's stage):")
        for e in pl["experts"][:16]:
            lines.append(f"  ep {e['ep_rank']}: experts {e['experts'][0]}-{e['experts'][1] - 1}; "
                         f"ranks {_fmt_ranks(e['ranks'])}")
        if len(pl["experts"]) > 16:
            lines.append(f"  ... ({len(pl['experts'])} EP ranks)")
    lines.append(f"per GPU (micro_batch_tokens {pl['micro_batch_tokens']}):")
    for st in pl["stages"]:
        mem = st["memory_gib"]
        parts = " | ".join(f"{k} {_mem(v)}" for k, v in mem.items())
        adapters = (f" + LoRA {_b(st['lora_params'])} (dense {_b(st['lora_dense_params'])}, expert "
                    f"{_b(st['lora_expert_params'])})" if pl["lora"] else "")
        lines.append(
            f"  stage {st['pp_rank']}: params {_b(st['params'])} (dense {_b(st['dense_params'])}, "
            f"expert {_b(st['expert_params'])}){adapters}: {parts}"
        )
    lines.append(f"peak {_mem(pl['peak_memory_gib'])} per GPU on stage {pl['peak_memory_stage']}")
    lines.append(f"colocated SGLang (rollout.sglang.launch=true) parks {_mem(pl['colocated_host_gib_per_gpu'])} per GPU "
                 "in host memory while the engines run (gradients + 16-bit runs' optimizer state"
                 + (", the adapters' only" if pl["lora"] else "") + "); add SGLang's own")
    ct = pl["collective_timeout"]
    waits = "; ".join(f"{k} {v / 60:.0f} min" for k, v in ct["waits_s"].items()) or "none bounded by the config"
    lines.append(f"collective timeout {ct['timeout_s'] / 60:.0f} min (rank 0's longest engine waits: {waits})")
    lines.append("assumptions: " + "; ".join(pl["memory_assumptions"]))
    return "\n".join(lines)


# ---- CLI ------------------------------------------------------------------------------------


def build_parser(prog: str = "python -m gspo_megatron.planner") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description="Validate a config and plan its layout.")
    ap.add_argument("--config", help="YAML config file")
    ap.add_argument("--dry-run", action="store_true", help="accepted for the trainer's CLI")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--world-size", type=int, help="number of ranks (GPUs / processes)")
    ap.add_argument("--nnodes", type=int, help="nodes (with --nproc-per-node)")
    ap.add_argument("--nproc-per-node", type=int, help="ranks per node (with --nnodes)")
    ap.add_argument("--no-inputs", action="store_true",
                    help="plan only: skip reading the tokenizer, data file, reward and checkpoint index")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, e.g. parallel.tp=2")
    return ap


def main(argv: Sequence[str] | None = None, prog: str = "gspo_megatron.train") -> int:
    args = build_parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _main(args, prog)
    except SystemExit as e:  # user_errors: one line printed, exit status 2
        return int(e.code or 0)


def _main(args, prog: str) -> int:
    from gspo_megatron.cli_util import user_errors

    with user_errors(prog):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cfg = load_config(args.config, args.overrides)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        if args.world_size is not None and (args.nnodes or args.nproc_per_node):
            raise ConfigError("give either --world-size or --nnodes/--nproc-per-node")
        if args.nnodes and not args.nproc_per_node:
            raise ConfigError(f"--nnodes {args.nnodes} needs --nproc-per-node (GPUs per node), e.g. 8")
        if args.world_size is not None:
            world, why = args.world_size, "--world-size"
        elif args.nnodes or args.nproc_per_node:
            world = (args.nnodes or 1) * (args.nproc_per_node or 1)
            why = f"--nnodes {args.nnodes or 1} x --nproc-per-node {args.nproc_per_node or 1}"
        elif os.environ.get("WORLD_SIZE", "").isdigit():
            world, why = int(os.environ["WORLD_SIZE"]), "WORLD_SIZE"
        elif cfg.parallel.world_size is not None:
            world, why = cfg.parallel.world_size, "parallel.world_size: the size the config is written for"
        else:
            world = default_world_size(cfg)
            why = "assumed: the smallest world the layout allows; pass --world-size or --nnodes/--nproc-per-node"
        pl = plan(cfg, world)
        pl["world_size_from"] = why
        inputs = None if args.no_inputs else _check_inputs(cfg, world)
        if inputs is not None:
            pl["inputs"] = inputs
    if args.json:
        print(json.dumps(pl))
    else:
        if args.config:
            print(f"gspo-megatron dry run: {args.config}")
        print(f"world size {pl['world_size']} ({why})")
        print(format_plan(pl))
        if inputs is not None:
            print("inputs: " + "; ".join(f"{k} {v}" for k, v in inputs.items()))
    return 0


def _check_inputs(cfg, world: int) -> dict:
    """What the trainer reads before its process groups (train/setup.py, check_inputs), read now."""
    from gspo_megatron.train.setup import check_inputs

    got = check_inputs(cfg, world_size=world)
    p = got.prompts
    if p.task is not None:
        data = f"synthetic task {cfg.data.task!r}"
    else:  # every record, as the trainer will see it (training skips and counts the same ones)
        c = p.check_all()
        data = (f"{cfg.data.path}: {c['records']} records checked in {c['seconds']:.2f} s, {c['usable']} usable, "
                f"{c['skipped']} skipped by training" + (f" ({'; '.join(c['first_problems'])})" if c["skipped"] else ""))
    return {"tokenizer": f"{len(got.tokenizer)} tokens (vocab_size {got.arch.vocab_size})", "data": data,
            "reward": cfg.reward.fn or "the synthetic task's", "warm start": f"{cfg.train.sft_warmup_steps} steps"}


if __name__ == "__main__":
    sys.exit(main())
