"""DeepSeek-V3 (model/families/deepseek_v3/): what is this family's own. The layouts, the GSPO step,
the sweep and the parameter counts run it in the shared family suites (megatron_utils.FAMILIES).

Here: node-limited routing as transformers' DeepseekV3TopkRouter computes it, against Megatron's
router with the family's patch (and without, to show the patch matters); the reader's refusals.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from gspo_megatron.errors import ModelConfigError


def _hf_router(E, n_group, topk_group, topk, scaling, seed):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=16, n_routed_experts=E, n_group=n_group, topk_group=topk_group,
                           num_experts_per_tok=topk, routed_scaling_factor=scaling, norm_topk_prob=True)
    r = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        r.weight.copy_(torch.randn(r.weight.shape, generator=g))
        r.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.3)
    return r


def _megatron_routing(r, x, E, n_group, topk_group, topk, scaling):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    logits = x @ r.weight.t()
    return topk_routing_with_score_function(
        logits, topk, num_groups=n_group, group_topk=topk_group, scaling_factor=scaling,
        score_function="sigmoid", expert_bias=r.e_score_correction_bias)


def _dense(weights, idx, E):
    return torch.zeros(idx.shape[0], E, dtype=weights.dtype).scatter(1, idx, weights)


# (experts, groups, groups kept, top-k): top-k / groups kept = 1, 2, 3 and 4 (Megatron's group score
# equals transformers' only at 2)
SHAPES = [(8, 4, 2, 2), (16, 4, 2, 4), (24, 8, 3, 9), (8, 2, 1, 4)]


@pytest.mark.parametrize("E,n_group,topk_group,topk", SHAPES)
def test_node_limited_routing_equals_transformers_with_the_family_patch(E, n_group, topk_group, topk):
    """The same experts and weights as transformers' router for 256 random tokens, through
    Megatron's topk_routing_with_score_function (sigmoid, selection bias, groups, scaling) after
    the family's patch; the line the patch replaces is the installed megatron-core's."""
    from megatron.core.transformer.moe import moe_utils

    from gspo_megatron.model.families.deepseek_v3 import megatron_patches

    original = moe_utils.group_limited_topk
    megatron_own = megatron_patches.megatron_group_limited_topk()
    assert "".join(megatron_patches.PINNED_SOURCE_LINE.split()) in "".join(inspect.getsource(megatron_own).split())
    r = _hf_router(E, n_group, topk_group, topk, 2.5, seed=E + topk)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(7))
    _, hf_w, hf_idx = r(x)
    want = _dense(hf_w, hf_idx, E)
    try:
        moe_utils.group_limited_topk = megatron_own
        before, _ = _megatron_routing(r, x, E, n_group, topk_group, topk, 2.5)
        megatron_patches.install()
        assert moe_utils.group_limited_topk is megatron_patches.group_limited_topk
        got, routing_map = _megatron_routing(r, x, E, n_group, topk_group, topk, 2.5)
    finally:
        moe_utils.group_limited_topk = original
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(routing_map, want > 0)
    if topk // topk_group != 2:  # unpatched Megatron chooses other experts for some tokens
        assert not torch.equal(before > 0, want > 0)


def test_the_counterexample_of_the_docstring():
    """8 experts in 2 groups, keep 1, top-4, scores [.9 .8 0 0 | .5 .5 .5 .5]: by the top-2 sum
    (transformers) group 0 wins (1.7 > 1.0), by the top-4 sum (Megatron's topk // group_topk) group
    1 does (2.0 > 1.7)."""
    from gspo_megatron.model.families.deepseek_v3 import megatron_patches

    scores = torch.tensor([[.9, .8, .0, .0, .5, .5, .5, .5]])
    _, mine = megatron_patches.group_limited_topk(scores, 4, 1, 8, 2, 1)
    _, theirs = megatron_patches.megatron_group_limited_topk()(scores, 4, 1, 8, 2, 1)
    assert sorted(mine[0].tolist()) == [0, 1, 2, 3]
    assert sorted(theirs[0].tolist()) == [4, 5, 6, 7]


def _dsv3(**over):
    from megatron_utils import tiny_deepseek_v3_config

    d = tiny_deepseek_v3_config().to_dict()
    d.update(over)
    return d


@pytest.mark.parametrize("over,needle", [
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"n_group": 3}, "n_group=3 must divide"),
    ({"topk_group": 1, "num_experts_per_tok": 3}, "cannot hold num_experts_per_tok=3"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type 'longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 64, "attention_factor": 0.5}}, "attention_factor"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
    # transformers' rotary table would have head_dim channels (found by the sweep's first DSV3 cells)
    ({"head_dim": 32}, "head_dim=32 must equal qk_rope_head_dim=8"),
])
def test_the_reader_refuses_what_megatron_would_compute_differently(over, needle):
    from gspo_megatron.model.arch import MoeArch

    with pytest.raises(ModelConfigError) as e:
        MoeArch.from_hf_dict(_dsv3(**over), "config.json")
    msg = str(e.value)
    assert msg.startswith("config.json: ") and needle in msg and "\n" not in msg, msg


def test_the_reader_maps_each_feature():
    from gspo_megatron.model.arch import MoeArch

    a = MoeArch.from_hf_dict(_dsv3(), "config.json")
    f = a.family_fields
    assert (a.dense_layers, a.shared_expert_intermediate_size, a.router_score, a.routed_scaling_factor) == (
        (0, 1), 32, "sigmoid", 2.5)
    assert (f.q_lora_rank, f.kv_lora_rank, f.qk_nope_head_dim, f.qk_rope_head_dim, f.v_head_dim) == (48, 32, 16, 8, 12)
    assert (f.n_group, f.topk_group) == (4, 2)
    assert f.yarn.factor == 4.0 and f.yarn.mscale_all_dim == 1.0
    # transformers uses mscale only together with mscale_all_dim: one alone reads as (1, 0)
    lone = MoeArch.from_hf_dict(_dsv3(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                       "original_max_position_embeddings": 64, "mscale": 0.7}))
    assert (lone.family_fields.yarn.mscale, lone.family_fields.yarn.mscale_all_dim) == (1.0, 0.0)
    assert MoeArch.from_hf_dict(_dsv3(q_lora_rank=None)).family_fields.q_lora_rank is None
    # the real config.json form: rope_scaling with "type" and rope_theta at the top level
    old = _dsv3(rope_parameters=None, rope_theta=5e4, rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0})
    y = MoeArch.from_hf_dict(old)
    assert y.rope_theta == 5e4 and y.family_fields.yarn.factor == 40.0


@pytest.mark.parametrize("grouped", [True, False], ids=["family_groups", "no_groups"])
def test_an_sglang_push_by_tensors_keeps_the_fused_a_projection_in_one_request(tmp_path, monkeypatch, grouped):
    """SGLang writes DeepSeek's fused q_a_proj + kv_a_proj_with_mqa only when one request brings
    both (tests/test_sglang_contract.py pins the loader's lines; tests/sglang_double.py does the
    same). With buckets smaller than one tensor, the family's `weights_loaded_together` keeps each
    layer's pair in one request and the server holds every pushed tensor; without it (the control)
    the pairs are split and the server keeps its old a-projections without a word."""
    from sglang_double import start_double_and_engine

    from gspo_megatron.model.families.deepseek_v3 import DeepseekV3Family
    from gspo_megatron.rollout.hf_engine import hub_weight_targets
    from gspo_megatron.rollout.tokenizer import build_tokenizer
    from megatron_utils import make_tiny_hf

    d = tmp_path / "a"
    make_tiny_hf(d, seed=0, family="deepseek_v3")
    build_tokenizer(str(d))
    new = make_tiny_hf(tmp_path / "b", seed=1, family="deepseek_v3")
    pushed = [(k, t.get().detach().clone()) for k, t in hub_weight_targets(new).items()]
    if not grouped:
        monkeypatch.setattr(DeepseekV3Family, "weights_loaded_together", lambda self, arch: ())
    with start_double_and_engine(str(d), weight_sync="tensor", bucket_mb=0.01) as (dbl, eng):
        eng.update_weights(iter(pushed), version=1)
        served = {k: t.get() for k, t in hub_weight_targets(dbl.engine.model).items()}
        requests = len(dbl.calls("/update_weights_from_tensor"))
    a_proj = [k for k, _ in pushed if "q_a_proj" in k or "kv_a_proj_with_mqa" in k]
    assert len(a_proj) == 8 and requests > len(pushed) // 2  # small buckets: many requests
    stale = sorted(k for k, t in pushed if not torch.equal(served[k], t))
    assert stale == ([] if grouped else sorted(a_proj)), stale


def test_engine_launches_get_what_the_family_needs_or_one_line(tmp_path):
    """Launched servers of a DeepSeek-V3 checkpoint saved by transformers (whose config.json has no
    scoring_func / topk_method: vLLM and SGLang would route with softmax, or fail to load the
    selection bias) get them as config overrides; a vLLM server on CPU gets the CPU_MLA backend
    (the same on CPUs with and without AMX), unless the user's extra_args choose one; a latent
    other than 512 + 64 cannot be served by vLLM on CPU: one line at launch, before any process."""
    import json

    from gspo_megatron.rollout.sglang_api import MODEL_OVERRIDE_FLAG
    from gspo_megatron.rollout.sglang_server import LaunchSpec
    from gspo_megatron.rollout.vllm_server import VLLMLaunchError, VLLMLaunchSpec, prepare
    from megatron_utils import make_tiny_hf

    served = tmp_path / "served"
    make_tiny_hf(served, family="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64)
    saved = json.loads((served / "config.json").read_text())
    assert "scoring_func" not in saved and "topk_method" not in saved  # as transformers writes it
    want = json.dumps({"scoring_func": "sigmoid", "topk_method": "noaux_tc"}, sort_keys=True)

    def vllm_args(path, device="cpu", extra=()):
        spec = VLLMLaunchSpec(model_path=str(path), port=1, device=device, trainer_dtype="float32",
                              max_model_len=64, cpu_kv_cache_mb=8, extra_args=list(extra), node_gpus=2,
                              trainer_gpus=1)
        return prepare(spec).extra_args

    assert vllm_args(served) == ["--hf-overrides", want, "--attention-backend", "CPU_MLA"]
    assert vllm_args(served, extra=["--attention-backend=AMX_MLA"]) == \
        ["--attention-backend=AMX_MLA", "--hf-overrides", want]
    assert vllm_args(served, device="cuda") == ["--hf-overrides", want]
    small = tmp_path / "small"
    make_tiny_hf(small, family="deepseek_v3")  # 32 + 8
    with pytest.raises(VLLMLaunchError) as e:
        vllm_args(small)
    assert "\n" not in str(e.value) and "576" in str(e.value) and "32 + 8" in str(e.value)
    argv = LaunchSpec(model_path=str(served)).argv(0)
    assert argv.count(MODEL_OVERRIDE_FLAG) == 1 and argv[argv.index(MODEL_OVERRIDE_FLAG) + 1] == want
    mine = LaunchSpec(model_path=str(served), extra_args=[f"{MODEL_OVERRIDE_FLAG}={{}}"]).argv(0)
    assert MODEL_OVERRIDE_FLAG not in mine and mine[-1] == f"{MODEL_OVERRIDE_FLAG}={{}}"  # the user's own wins
