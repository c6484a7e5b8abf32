"""The dry-run memory plan of a LoRA run (planner.py, lora.rank > 0): the frozen base keeps its
weights and loses its gradients and optimizer state, the adapters add their own, and the adapter
counts the plan uses are those of the model the trainer builds.

(a) the 235B LoRA preset at the full preset's world size and layout: the optimizer states differ by
    the base's Adam states, written here from the HF config alone (params per rank x 12 bytes,
    sharded over DP*CP / expert-DP), less the adapters' (same formula); the gradients by the base's
    fp32 gradients; the weights by the adapters' bf16 copies; no reference copy under kl_coef > 0.
(b) each LoRA preset fits at its own, smaller world size, where full-parameter training does not.
(c) the planner's adapter counts (total, by target group, per rank) equal the adapter parameters of
    a real tiny model with model/lora.py apply_lora, for a Qwen3-MoE and a GLM-4.5-style model
    (a dense first layer and a shared expert), whole (1 process) and split (TP2 + SP x ETP2).
"""
from __future__ import annotations

import math
import os

import pytest

from dist_utils import run_distributed
from gspo_megatron import planner
from gspo_megatron.config import LORA_TARGETS
from gspo_megatron.errors import ConfigError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.resolve import load_config
from megatron_utils import make_tiny_hf

pytestmark = pytest.mark.timeout(300)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "launch", "configs")
GiB = 1024**3
H100_GIB = 78.0  # an "80 GB" H100 less the CUDA context (~79.6 GiB in all)
GPU_BUDGET_GIB = 72.0  # what tests/test_launch.py holds every GPU preset to at its documented size


def preset(name: str) -> str:
    return os.path.join(CONFIGS, name + ".yaml")


def layout_overrides(cfg) -> list[str]:
    p = cfg.parallel
    return [f"parallel.{k}={getattr(p, k)}" for k in ("tp", "pp", "ep", "etp", "cp", "sequence_parallel")]


def peak(pl: dict) -> dict:
    return max(pl["stages"], key=lambda st: st["memory_gib"]["total"])["memory_gib"]


# ---- (a) the base's optimizer state and gradients are what LoRA removes ----------------------------


def _per_rank_counts(hf: dict, tp: int, pp: int, ep: int, etp: int, r: int) -> list[dict]:
    """Qwen3-MoE from its HF config, written here: per pipeline stage, the base's dense and expert
    parameters on one rank and the rank-r adapters' (attention: linear_qkv column-parallel, A r x H
    whole, B split; linear_proj row-parallel, A split, B H x r whole; each routed expert's fc1
    (out 2I) and fc2 the same over ETP)."""
    H, L, V = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    nq, nkv, D = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    E, I = hf["num_experts"], hf["moe_intermediate_size"]
    Vp = math.ceil(V / (128 * tp)) * 128 * tp  # Megatron's padded vocabulary
    # attention split over TP, then q/k norms, the two layer norms and the router, whole
    dense_layer = (H * nq * D + 2 * H * nkv * D + nq * D * H) // tp + 2 * D + 2 * H + E * H
    expert_layer = E // ep * 3 * H * I // etp
    attn_adapters = r * (H + (nq + 2 * nkv) * D // tp) + r * (nq * D // tp + H)
    expert_adapters = E // ep * (r * (H + 2 * I // etp) + r * (I // etp + H))
    n = L // pp
    stages = []
    for s in range(pp):
        dense = n * dense_layer + (Vp * H // tp if s == 0 else 0) + (H + Vp * H // tp if s == pp - 1 else 0)
        stages.append({"dense": dense, "expert": n * expert_layer,
                       "lora_dense": n * attn_adapters, "lora_expert": n * expert_adapters})
    return stages


@pytest.mark.filterwarnings("ignore:loss.kl_coef > 0 with a random init")  # the presets' hf_dir is not set here
def test_lora_plan_at_the_full_presets_world_drops_the_base_optimizer_state():
    full_cfg = load_config(preset("qwen3_235b_a22b"), [])
    world = full_cfg.parallel.world_size  # 128
    lora_cfg = load_config(preset("qwen3_235b_a22b_lora"), layout_overrides(full_cfg))
    assert layout_overrides(lora_cfg) == layout_overrides(full_cfg)  # the same layout (the preset's has ep 8)
    full, lora = planner.plan(full_cfg, world), planner.plan(lora_cfg, world)
    hf, p, r = full_cfg.model.hf_config, full_cfg.parallel, lora_cfg.lora.rank
    dp, edp = p.dp(world), p.edp(world)
    expected = _per_rank_counts(hf, p.tp, p.pp, p.ep, p.etp, r)
    print(f"\n235B at {world} GPUs (tp {p.tp}, pp {p.pp}, ep {p.ep}, dp {dp}, expert-dp {edp}), GiB per GPU:")
    for st_full, st_lora, want in zip(full["stages"], lora["stages"], expected):
        mf, ml = st_full["memory_gib"], st_lora["memory_gib"]
        assert (st_full["dense_params"], st_full["expert_params"]) == (want["dense"], want["expert"])
        assert (st_lora["lora_dense_params"], st_lora["lora_expert_params"]) == \
            (want["lora_dense"], want["lora_expert"])
        base_opt = 12 * (want["dense"] / (dp * p.cp) + want["expert"] / edp)  # fp32 master + m + v, sharded
        lora_opt = 12 * (want["lora_dense"] / (dp * p.cp) + want["lora_expert"] / edp)
        adapters = want["lora_dense"] + want["lora_expert"]
        dropped = (mf["optimizer"] - ml["optimizer"]) * GiB
        print(f"  stage {st_full['pp_rank']}: full " + " | ".join(f"{k} {v:.2f}" for k, v in mf.items()))
        print(f"  stage {st_lora['pp_rank']}: LoRA " + " | ".join(f"{k} {v:.2f}" for k, v in ml.items()))
        print(f"    base optimizer (from the HF config) {base_opt / GiB:.3f} GiB, full - LoRA optimizer "
              f"{dropped / GiB:.3f} GiB ({100 * (1 - dropped / base_opt):.2f}% short: the adapters' own "
              f"{lora_opt / GiB:.3f} GiB = {100 * ml['optimizer'] / mf['optimizer']:.2f}% of the full state)")
        assert mf["optimizer"] * GiB == pytest.approx(base_opt, rel=1e-9)
        assert ml["optimizer"] * GiB == pytest.approx(lora_opt, rel=1e-9)
        assert dropped == pytest.approx(base_opt, rel=0.03)  # the base's Adam states, within the adapters' share
        # The adapters' Adam states are small next to the base's, but not < 1%: rank 32 on each routed
        # expert is r (2H + 3I) / (3 H I) = 2.17% of the expert, and the experts dominate both.
        assert ml["optimizer"] < 0.025 * mf["optimizer"]
        assert ml["optimizer"] < 0.5  # GiB per GPU, against ~20 for the full run
        # the base's fp32 gradients go, the adapters' come; the weights gain the adapters' bf16 copies
        base = want["dense"] + want["expert"]
        assert (mf["gradients"] - ml["gradients"]) * GiB == pytest.approx(4 * (base - adapters))
        assert (ml["weights"] - mf["weights"]) * GiB == pytest.approx(2 * adapters)
        assert 0 <= ml["activations"] - mf["activations"] < 0.02 * mf["activations"]  # A x per adapted linear
    assert peak(lora)["total"] < peak(full)["total"] / 3
    # a KL term costs the full run a resident reference copy and the LoRA run nothing (adapters off)
    kl_full = planner.plan(load_config(preset("qwen3_235b_a22b"), ["loss.kl_coef=0.05"]), world)
    kl_lora = planner.plan(
        load_config(preset("qwen3_235b_a22b_lora"), layout_overrides(full_cfg) + ["loss.kl_coef=0.05"]), world)
    assert peak(kl_full)["reference_model"] == pytest.approx(peak(full)["weights"])
    assert "reference_model" not in peak(kl_lora) and peak(kl_lora)["total"] == pytest.approx(peak(lora)["total"])
    assert kl_lora["lora"]["kl_reference"].startswith("the base")


def test_dry_run_text_shows_the_trainable_adapters(capsys):
    assert planner.main(["--config", preset("qwen3_235b_a22b_lora"), "--no-inputs"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "world size 16 (parallel.world_size" in out
    assert "trainable (LoRA adapters, rank 32, alpha 32, on attention, experts): 5.01B parameters " \
           "(5,005,312,000: attention 77.00M, experts 4.93B; 2.13% of the model)" in out
    assert "+ LoRA 326.89M (dense 18.87M, expert 308.02M)" in out and "master weights fp32 (LoRA adapters only)" in out


# ---- (b) the LoRA presets fit where full-parameter training does not -----------------------------


@pytest.mark.parametrize("lora_name,full_name", [("qwen3_235b_a22b_lora", "qwen3_235b_a22b"),
                                                 ("qwen3_30b_a3b_lora", "qwen3_30b_a3b")])
def test_lora_presets_fit_80gb_at_their_smaller_world_size(lora_name, full_name):
    lora_cfg, full_cfg = load_config(preset(lora_name), []), load_config(preset(full_name), [])
    world = lora_cfg.parallel.world_size
    assert world < full_cfg.parallel.world_size
    lora = planner.plan(lora_cfg, world)
    # full-parameter training at this world size, on the LoRA preset's layout (the full preset's
    # own may not divide it: the 235B's ep 32 needs 64 GPUs) and on the full preset's where it does
    full_here = planner.plan(load_config(preset(lora_name), ["lora.rank=0"]), world)
    def parts(pl):
        return " | ".join(f"{k} {v:.2f}" for k, v in peak(pl).items())

    print(f"\n{lora_name} at {world} GPUs, peak per GPU: LoRA {lora['peak_memory_gib']:.1f} GiB ({parts(lora)}); "
          f"full-parameter {full_here['peak_memory_gib']:.1f} GiB ({parts(full_here)})")
    assert lora["peak_memory_gib"] < GPU_BUDGET_GIB < H100_GIB
    assert full_here["peak_memory_gib"] > H100_GIB
    try:
        full_own = planner.plan(load_config(preset(full_name), []), world)
    except ConfigError as e:  # the full preset's layout does not divide this world: its one-line refusal
        print(f"  {full_name} at {world} GPUs: {e}")
    else:
        print(f"  {full_name} at {world} GPUs: {full_own['peak_memory_gib']:.1f} GiB")
        assert full_own["peak_memory_gib"] > H100_GIB


# ---- (c) the planner's adapter counts are the built model's ----------------------------------------


def _count_adapters(rank, world, hf_dir, layout, targets):
    """This rank's adapter parameters (by target group) and every trainable parameter, of the
    tiny model Megatron builds with LoRA applied as the trainer applies it (train/setup.py)."""
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model import lora
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    par = ParallelConfig(**layout)
    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    try:
        chunks, _ = build_policy(ctx, arch)  # random init: only the shapes count
        lora.apply_lora(chunks, lora.LoraSpec(rank=4, alpha=8, targets=tuple(targets)), ep_rank=ctx.ep_rank)
        groups = dict.fromkeys(LORA_TARGETS, 0)
        for _, module in lora.adapters(chunks):
            groups[module._lora["group"]] += module.lora_A.numel() + module.lora_B.numel()
        trainable = sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad)
        return groups, trainable
    finally:
        destroy_parallel()


def _plan(hf_dir: str, layout: dict, world: int, targets) -> dict:
    over = [f"model.hf_dir={hf_dir}", "parallel.device=cpu", "lora.rank=4", "lora.alpha=8",
            f"lora.target_modules=[{','.join(targets)}]"] + [f"parallel.{k}={v}" for k, v in layout.items()]
    return planner.plan(load_config(None, over), world)


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def tiny(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"hf-{request.param}")
    make_tiny_hf(d, family=request.param)
    return request.param, str(d)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(tp=2, etp=2, sequence_parallel=True))],
                         ids=["whole", "tp2-sp-etp2"])
def test_planner_adapter_counts_equal_the_built_models(tiny, world, layout):
    family, hf_dir = tiny
    targets = list(LORA_TARGETS)  # every group; a Qwen3-MoE has no dense MLP and no shared expert
    got = run_distributed(_count_adapters, world, hf_dir, layout, targets)
    pl = _plan(hf_dir, layout, world, targets)
    (stage,) = pl["stages"]
    print(f"\n{family} at {world} rank(s) {layout or ''}: built model, rank 0: {got[0][0]} = {got[0][1]} trainable; "
          f"planner: per rank {stage['lora_params']} (dense {stage['lora_dense_params']}, expert "
          f"{stage['lora_expert_params']}), whole model {pl['lora']['total_params']} {pl['lora']['params_breakdown']}")
    for groups, trainable in got:  # every rank holds the same shapes
        assert trainable == sum(groups.values()) == stage["lora_params"]  # nothing but the adapters trains
        assert groups["experts"] == stage["lora_expert_params"]
        assert groups["attention"] + groups["mlp"] + groups["shared_experts"] == stage["lora_dense_params"]
    if world == 1:
        assert got[0][0] == pl["lora"]["params_breakdown"]
        assert got[0][1] == pl["lora"]["total_params"] == planner.count_lora_params(
            planner.planner_dims(MoeArch.from_hf_dir(hf_dir)), 4, targets)["total"]
    if family == "glm4_moe":  # a dense first layer and a shared expert: every target group adapts something
        assert all(got[0][0].values()), got[0][0]
    else:
        assert got[0][0]["mlp"] == got[0][0]["shared_experts"] == 0
    # one group left out: neither the model nor the plan counts it
    got_less = run_distributed(_count_adapters, world, hf_dir, layout, ["attention", "experts"])
    pl_less = _plan(hf_dir, layout, world, ["attention", "experts"])
    assert got_less[0][1] == pl_less["stages"][0]["lora_params"]
