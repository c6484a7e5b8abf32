"""MoE routing replay through Megatron's RouterReplay (parallel/routing_replay.py), against
transformers' Qwen3MoeForCausalLM forced to the same experts (a forward hook on every layer's
router replaces its top-k and renormalises the chosen experts' probabilities, as Qwen3 does).

At EP2, TP2+SP, PP2 and CP2 (packed, zigzag), two processes:
- rollout (R3): arbitrary forced experts per token and layer -> the trainer's token log-probs
  equal the forced reference (<= 1e-5), and differ from the natural one (negative control);
- old (R2): a recording pass on the natural routing (which agrees with transformers' on every
  token x layer), then a weight change that moves the natural routing, then a replaying pass ->
  its log-probs equal the reference with the changed weights forced to the *recorded* experts,
  not the reference routing naturally with the changed weights.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import make_tiny_hf, random_sequences

LENGTHS = [9, 14, 6, 11, 17, 8]
SCALE = 1.5  # layer 0's attention output projection after the recording pass


def hf_routing(model, seq, forced=None):
    """(token log-probs [len-1], the experts each layer chose [len-1, L, k]) of transformers'
    model on `seq`, with every router forced to `forced` [len-1, L, k] when given (the last
    position is routed naturally: it predicts nothing)."""
    chosen = []

    def hook(layer):
        def fn(mod, inputs, out):
            logits, scores, idx = out
            if forced is not None:
                idx = idx.clone()
                idx[: len(seq) - 1] = forced[:, layer].to(idx.dtype)
                probs = torch.softmax(logits, -1, dtype=torch.float).gather(-1, idx)
                if mod.norm_topk_prob:
                    probs = probs / probs.sum(-1, keepdim=True)
                scores = probs.to(logits.dtype)
            chosen.append(idx[: len(seq) - 1])
            return logits, scores, idx
        return fn

    hooks = [layer.mlp.gate.register_forward_hook(hook(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    return lp, torch.stack(chosen, 1)


def _rank(rank, world, hf_dir, layout, seqs, natural, forced):
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.routing_replay import RoutingPass
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import TrainSample, plan_microbatches
    from gspo_megatron.train.scoring import collect_logprobs, logprob_pass, pad_multiple

    par = ParallelConfig(**layout)
    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    # full recompute re-runs each layer's router in backward: the update pass must replay there too
    # (refused with pipeline stages, where 1F1B interleaves microbatches: config.py)
    chunks, tcfg = build_policy(ctx, arch, hf_dir=hf_dir, routing_replay=True,
                                recompute="full" if par.pp == 1 else "none")
    model = wrap_ddp(chunks, tcfg)
    k = arch.moe_topk

    def plan(routes):
        samples = [TrainSample(s[:1], s[1:], 0.0, routing=r) for s, r in zip(seqs, routes)]
        return plan_microbatches(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=40, multiple=pad_multiple(par),
                                 cp=par.cp, cp_rank=ctx.cp_rank, packed=par.cp > 1)

    # R3: the engine's (here: arbitrary) experts forced
    groups, mbs = plan(forced)
    logprob_pass(model, ctx, mbs, vocab_size=arch.vocab_size, routing=RoutingPass(ctx, "rollout", k))
    lp_forced = collect_logprobs(ctx, groups, mbs, seqs)

    # R2: record on the natural routing (transformers' natural routing rides along to count agreement)
    groups, mbs = plan(natural)
    record = RoutingPass(ctx, "record", k)
    logprob_pass(model, ctx, mbs, vocab_size=arch.vocab_size, routing=record)
    counts = torch.tensor([record.agree, record.total], dtype=torch.float64)
    torch.distributed.all_reduce(counts)
    with torch.no_grad():  # a weight change that moves the natural routing of later layers
        for name, p in model[0].named_parameters():  # (layer names are local to a pipeline stage)
            if ctx.is_first_stage and name.endswith("decoder.layers.0.self_attention.linear_proj.weight"):
                p.mul_(SCALE)
    logprob_pass(model, ctx, mbs, vocab_size=arch.vocab_size, routing=RoutingPass(ctx, "recorded", k))
    lp_recorded = collect_logprobs(ctx, groups, mbs, seqs)
    # the update pass (train mode, backward) on the same microbatches against these π_old: with
    # the recorded experts replayed every ratio is 1; routed naturally, they are not
    kl = {mode: _update_pass_kl(ctx, model, mbs, arch.vocab_size, RoutingPass(ctx, mode, k)) for mode in ("recorded", "off")}
    logprob_pass(model, ctx, mbs, vocab_size=arch.vocab_size)  # natural routing, changed weights
    lp_natural_changed = collect_logprobs(ctx, groups, mbs, seqs)
    destroy_parallel()
    return (lp_forced, lp_recorded, lp_natural_changed, counts.tolist(), kl) if rank == 0 else None


def _update_pass_kl(ctx, model, mbs, vocab_size, routing) -> float:
    """Mean k3 estimate of KL(π_old || π) over the sequences, from one forward-backward pass of
    the trainer's loss step with the routers under `routing`."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.train.loss import LossSettings, policy_loss_step
    from gspo_megatron.train.metrics import reduce_report

    for m in model:
        m.train()
        m.zero_grad_buffer()
    step = policy_loss_step(ctx, vocab_size, LossSettings("gspo", 3e-4, 4e-4),
                            routing=routing if routing.mode != "off" else None)
    reports = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
        seq_length=max(mb.seq_length for mb in mbs), micro_batch_size=mbs[0].micro_batch_size, forward_only=False)
    routing.close(model)
    reporter = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0
    tot = reduce_report(reports, reporter, ("approx_kl", "metric_weight"), ctx.device)
    return tot["approx_kl"] / tot["metric_weight"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    model = make_tiny_hf(d)
    seqs = random_sequences(300, LENGTHS, seed=4)
    g = torch.Generator().manual_seed(0)
    L, E, k = model.config.num_hidden_layers, model.config.num_experts, model.config.num_experts_per_tok
    forced = [torch.stack([torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(L)])
                           for _ in range(len(s) - 1)]).to(torch.int32) for s in seqs]
    natural = [hf_routing(model, s)[1].to(torch.int32) for s in seqs]
    return str(d), model, seqs, natural, forced


LAYOUTS = {"ep2": dict(ep=2), "tp2sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2),
           "cp2-packed": dict(cp=2)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_replay_forces_the_experts_a_reference_is_forced_to(setup, layout):
    hf_dir, model, seqs, natural, forced = setup
    lp_forced, lp_recorded, lp_natural_changed, (agree, total), kl = run_distributed(
        _rank, 2, hf_dir, layout, seqs, natural, forced, timeout=280)[0]

    # R3: forced experts, as the reference forced to the same experts
    worst = 0.0
    for s, f, got in zip(seqs, forced, lp_forced):
        ref, used = hf_routing(model, s, forced=f)
        assert torch.equal(used.to(torch.int32), f)  # the reference really ran on the forced experts
        worst = max(worst, (torch.tensor(got) - ref).abs().max().item())
    natural_gap = max((torch.tensor(got) - hf_routing(model, s)[0]).abs().max().item()
                      for s, got in zip(seqs, lp_forced))
    print(f"R3: max |trainer - forced reference| {worst:.2e}; vs the natural reference {natural_gap:.2e}")
    assert worst <= 1e-5
    assert natural_gap > 1e-2  # the forcing matters (negative control)

    # R2: recorded on the natural routing: every token x layer equals transformers' choice
    assert total == sum((len(s) - 1) * model.config.num_hidden_layers for s in seqs)
    assert agree == total
    changed = _changed(model)
    worst = max((torch.tensor(got) - hf_routing(changed, s, forced=r)[0]).abs().max().item()
                for s, r, got in zip(seqs, natural, lp_recorded))
    moved = sum(int((hf_routing(changed, s)[1].sort(-1).values != r.sort(-1).values).any(-1).sum())
                for s, r in zip(seqs, natural))
    gap = max((torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(lp_recorded, lp_natural_changed))
    print(f"R2: max |replayed - reference forced to the recorded experts| {worst:.2e}; token x layers whose natural "
          f"routing moved {moved}; replayed vs natural after the change {gap:.2e}")
    assert worst <= 1e-5
    assert moved > 0 and gap > 1e-3  # the change moved the routing: replay is what kept it
    # the update pass (with full recompute where there is no pipeline) replays the same experts
    print(f"update pass: mean k3(π_old, π) with the recorded experts {kl['recorded']:.2e}, routed naturally "
          f"{kl['off']:.2e}")
    assert kl["recorded"] < 1e-10 and kl["off"] > 1e-6


def _changed(model):
    import copy

    m = copy.deepcopy(model)
    with torch.no_grad():
        m.model.layers[0].self_attn.o_proj.weight.mul_(SCALE)
    return m


def test_router_fusion_with_routing_replay_is_refused_in_one_line():
    """megatron-core 0.16.1's fused router (moe_router_fusion) returns before RouterReplay runs:
    replay would be silently off. The installed source is read to show that order still holds
    (if a release moves the replay before the fused return, this test says the refusal can go),
    and the combination is refused where every model config is built."""
    import inspect

    from megatron.core.transformer.moe import moe_utils

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.errors import ModelConfigError
    from gspo_megatron.model.spec import transformer_config

    src = inspect.getsource(moe_utils.topk_routing_with_score_function)
    fused_return = src.index("return fused_topk_with_score_function(")
    assert src.index("if fused:") < fused_return < src.index("router_replay.get_replay_topk(")

    arch = MoeArch.from_hf_dict(dict(vocab_size=98, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                          num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                          max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False))
    par = ParallelConfig(device="cpu")
    assert transformer_config(arch, par, routing_replay=True).moe_enable_routing_replay
    assert transformer_config(arch, par, router_fusion=True).moe_router_fusion
    with pytest.raises(ModelConfigError) as e:
        transformer_config(arch, par, routing_replay=True, router_fusion=True)
    assert "moe_router_fusion" in str(e.value) and "\n" not in str(e.value)
