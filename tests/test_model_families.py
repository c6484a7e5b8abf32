"""Model families (gspo_megatron/model/families/, docs/design.md "Adding a model family"): the
registry, each family's one HF-config parser (what it refuses, in one line), and parameter counts
that agree three ways (the planner's = the family's = the built Megatron model's = transformers').

The rest of the family suite runs where the layouts already run, parametrized over
megatron_utils.FAMILIES: tests/test_megatron_parity.py (round trip, log-probs and NLL gradients
against transformers at TP1, TP2+SP, EP2, PP2, CP2), tests/test_train_invariance.py (GSPO
gradients), tests/test_vllm.py (a launched vLLM server serving the GLM family), and the GLM demo
below (the demo task learns).
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import FAMILIES, dcp_tensors, make_tiny_hf, tiny_glm_config
from run_output import explain
from testlib import train_pooled

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GLM_TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml")
DSV3_TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu_deepseek_v3.yaml")

pytestmark = pytest.mark.timeout(300)


def test_the_suite_runs_every_registered_family():
    from gspo_megatron.model.registry import FAMILY_MODULES, family_of_type

    assert sorted(FAMILIES) == sorted(FAMILY_MODULES)
    for t in FAMILY_MODULES:
        fam = family_of_type(t)
        assert fam.model_type == t
        import transformers

        assert hasattr(transformers, fam.hf_architecture)  # its reference class exists
        # it provides everything the protocol names (what loader, planner, engines and converters call)
        from gspo_megatron.model.family import ModelFamily

        for name in ModelFamily.__annotations__:
            assert hasattr(fam, name), (t, name)
        for name, member in vars(ModelFamily).items():
            if callable(member) and not name.startswith("_"):
                assert callable(getattr(fam, name, None)), (t, name)


def _glm(**over) -> dict:
    d = tiny_glm_config().to_dict()
    d.update(over)
    return d


@pytest.mark.parametrize("over,needle", [
    (dict(norm_topk_prob=False), "norm_topk_prob"),
    (dict(n_group=2, topk_group=1), "group-limited"),
    (dict(first_k_dense_replace=4), "first_k_dense_replace"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (dict(model_type="llama"), "not a supported model family"),
])
def test_the_glm_reader_refuses_what_megatron_would_compute_differently(over, needle):
    from gspo_megatron.errors import ModelConfigError
    from gspo_megatron.model.family import arch_from_hf_dict

    with pytest.raises(ModelConfigError, match=needle) as ei:
        arch_from_hf_dict(_glm(**over), "x/config.json")
    assert "x/config.json" in str(ei.value) and "\n" not in str(ei.value)


def test_the_glm_reader_maps_each_feature():
    from gspo_megatron.model.family import arch_from_hf_dict

    a = arch_from_hf_dict(_glm())
    assert a.dense_layers == (0,) and a.is_moe_layer(1) and not a.is_moe_layer(0)
    assert a.shared_expert_intermediate_size == 32 and a.dense_intermediate_size == 96
    assert (a.router_score, a.router_expert_bias, a.routed_scaling_factor) == ("sigmoid", True, 2.5)
    assert (a.rotary_percent, a.qkv_bias, a.qk_norm) == (0.5, True, False)
    # config.json files (GLM-4.5's) carry partial_rotary_factor at the top level
    top = _glm()
    top.pop("rope_parameters")
    top.update(partial_rotary_factor=0.25, rope_theta=1e6)
    b = arch_from_hf_dict(top)
    assert (b.rotary_percent, b.rope_theta) == (0.25, 1e6)


def test_an_inline_glm_config_is_key_checked_by_its_family(tmp_path):
    from gspo_megatron.errors import ConfigError
    from gspo_megatron.resolve import load_config

    with pytest.raises(ConfigError, match=r"unknown key 'model.hf_config.num_experts'.*GLM-4.5") as ei:
        load_config(GLM_TINY, ["model.hf_config.num_experts=8"])  # Qwen3-MoE's name, not GLM's
    assert "n_routed_experts" in str(ei.value)
    with pytest.raises(ConfigError, match="norm_topk_prob"):
        load_config(GLM_TINY, ["model.hf_config.norm_topk_prob=false"])
    with pytest.raises(ConfigError, match="parallel.ep=3 does not divide the model's 8 experts"):
        load_config(GLM_TINY, ["parallel.ep=3"])


def _built_counts(rank, world, hf_dir):
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model import mapping
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.hf_io import named_local_params
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(ParallelConfig(), model_dims=arch.dims_for_validation())
    chunks, _ = build_policy(ctx, arch, hf_dir=hf_dir)
    n = 0
    pad_rows = arch.padded_vocab_size(1) - arch.vocab_size
    for c in chunks:
        for name, t in named_local_params(c, arch):
            n += t.numel()
            if mapping.match(name, arch).rule.kind is mapping.Kind.VOCAB:
                n -= pad_rows * t.shape[1]  # Megatron's vocab padding is not a parameter of the model
    destroy_parallel()
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_param_counts_agree_planner_family_built_model_transformers(tmp_path, family):
    """One parser per family: the planner's count (from a config naming the checkpoint) equals the
    family's count of its architecture, the Megatron model built from it, and transformers' model
    (the router's expert bias, a buffer in both, counted as a weight)."""
    from gspo_megatron import planner
    from gspo_megatron.model.family import arch_from_hf_dir
    from gspo_megatron.resolve import load_config

    d = tmp_path / "hf"
    model = make_tiny_hf(d, family=family)
    hf_n = sum(p.numel() for p in model.parameters())
    hf_n += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    arch = arch_from_hf_dir(str(d))
    fam_n = arch.count_params()["total"]
    cfg = load_config(GLM_TINY, [f"model.hf_dir={d}", "model.hf_config=null", "parallel.tp=1",
                                 "parallel.sequence_parallel=false"])
    plan_n = planner.plan(cfg, 1)["total_params"]
    built_n = run_distributed(_built_counts, 1, str(d), timeout=240)[0]
    print(f"{family}: planner {plan_n}, family {fam_n}, built {built_n}, transformers {hf_n}")
    assert plan_n == fam_n == built_n == hf_n


def test_shared_code_asks_the_family_for_attention_kv_cache_and_routers(monkeypatch, tmp_path):
    """Issue 53 (families provide behaviour): the planner's attention count and activation bytes,
    a launched vLLM server's KV-cache size and the in-process engine's routing capture come from the model's
    family, not from GQA formulas or transformers module names in shared code. A family defined
    in one file of its own (tests/stand_in_family.py: Qwen3-MoE's config under another
    model_type, with its own numbers), registered the way a family folder is (one registry line),
    changes all four."""
    import math

    import stand_in_family as si
    from gspo_megatron.model import registry
    from gspo_megatron.rollout.vllm_server import CPU_KV_CACHE_MIN_MB, CPU_KV_CACHE_SEQS, default_cpu_kv_cache_mb

    monkeypatch.setitem(registry.FAMILY_MODULES, si.MODEL_TYPE, "stand_in_family")
    hf = {"model_type": si.MODEL_TYPE, "vocab_size": 98, "hidden_size": 64, "num_hidden_layers": 3,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "max_position_embeddings": 4096}
    arch = registry.arch_from_hf_dict(hf)
    assert arch.family is si.FAMILY
    counts = arch.count_params()["breakdown"]
    assert counts["attention"] == 3 * sum(si.ATTENTION) and counts["norms"] == 3 * 2 * 64
    assert arch.layer_params(0, tp=2)["attention"] == si.ATTENTION[0] // 2 + si.ATTENTION[1]
    # the planner's activation memory: the family's attention elements per token
    from gspo_megatron import planner
    from gspo_megatron.model.family import gqa_attention_activation_elements
    from gspo_megatron.resolve import load_config

    cfg = load_config(os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml"),
                      ["parallel.tp=1", "parallel.sequence_parallel=false"])
    qwen_arch = registry.arch_from_hf_dict({**hf, "model_type": "qwen3_moe"})
    T, b = 64.0, 4  # tokens, fp32 bytes
    mine, _ = planner._activation_bytes_per_layer(planner.planner_dims(arch), True, cfg, T)
    gqa, _ = planner._activation_bytes_per_layer(planner.planner_dims(qwen_arch), True, cfg, T)
    expect = T * b * (si.ACTIVATION - gqa_attention_activation_elements(qwen_arch, 1, False))
    assert abs((mine - gqa) - expect) < 1e-6 * abs(expect), (mine, gqa, expect)
    mb, why = default_cpu_kv_cache_mb(hf, 4096, "bfloat16")
    assert "2000 B per token" in why  # the family's bytes per token (x 2 bytes of bf16)
    assert mb == max(CPU_KV_CACHE_MIN_MB, math.ceil(CPU_KV_CACHE_SEQS * 4096 * 2000 / (1 << 20)))
    # the in-process engine captures routing through the family's routers (Qwen3-MoE's modules here)
    from gspo_megatron.model.family import transformers_gate_routers
    from gspo_megatron.rollout.hf_engine import HFEngine
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    qwen = {**hf, "model_type": "qwen3_moe", "intermediate_size": 64}
    torch.manual_seed(0)
    registry.family_of_type("qwen3_moe").reference_model(qwen).save_pretrained(str(tmp_path))
    build_tokenizer(str(tmp_path))
    monkeypatch.setattr(registry, "family_of_type", lambda model_type: si.FAMILY)
    before = si.FAMILY.asked
    eng = HFEngine(str(tmp_path), dtype="float32", return_routing=True)
    assert si.FAMILY.asked == before + 1
    assert [i for i, _, _ in eng._gates] == [0, 1, 2]
    assert [g for _, g, _ in eng._gates] == [layer.mlp.gate for layer in eng.model.model.layers]
    assert [i for i, _, _ in transformers_gate_routers(eng.model)] == [0, 1, 2]


def test_mtp_layers_are_read_as_carried_and_declared_only_where_carried(tmp_path):
    """GLM checkpoints hold their MTP layer(s) after the decoder's (model.layers.{L}...): not part of
    the policy, carried unchanged (checkpoint/carried.py; in one safetensors file here, beside the
    policy's tensors). A config the project writes declares MTP layers only when the writer carries
    them (family.hf_config's mtp_layers; engine pushes carry none), so what it writes is complete
    for what it declares."""
    from safetensors.torch import load_file, save_file

    from gspo_megatron.checkpoint import carried
    from gspo_megatron.model.family import arch_from_hf_dir
    from gspo_megatron.model.hf_io import HFCheckpointReader

    d = tmp_path / "hf"
    make_tiny_hf(d, family="glm4_moe", max_shard_size="50MB")
    with open(d / "config.json") as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 1
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f)
    tensors = load_file(str(d / "model.safetensors"))
    L = cfg["num_hidden_layers"]
    extra = {k.replace(f"model.layers.{L - 1}.", f"model.layers.{L}."): v.clone() for k, v in tensors.items()
             if k.startswith(f"model.layers.{L - 1}.")}
    extra[f"model.layers.{L}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, str(d / "model.safetensors"))
    arch = arch_from_hf_dir(str(d))
    assert arch.mtp_layers == 1
    HFCheckpointReader(str(d)).validate(arch)  # admitted, not an unknown tensor
    mtp = carried.from_hf_dir(str(d), arch)
    assert mtp.names() == sorted(extra)
    assert all(torch.equal(t, extra[n]) for n, t in mtp.tensors())
    written = arch.family.hf_config(cfg)
    assert written["num_nextn_predict_layers"] == 0 and written["architectures"] == ["Glm4MoeForCausalLM"]
    assert arch.family.hf_config(cfg, mtp_layers=1)["num_nextn_predict_layers"] == 1
    # a tensor past the declared MTP layers is still an error naming it
    save_file({**tensors, **extra, f"model.layers.{L + 1}.eh_proj.weight": torch.zeros(1)},
              str(d / "model.safetensors"))
    from gspo_megatron.errors import CheckpointError

    with pytest.raises(CheckpointError, match=f"model.layers.{L + 1}.eh_proj.weight"):
        HFCheckpointReader(str(d)).validate(arch)


@pytest.mark.timeout(600)
def test_glm_rollout_routing_replay_forces_the_engines_experts(tmp_path):
    """R3 for the family with dense layers: in bf16 the engine (transformers) and the trainer
    (Megatron) route some tokens of GLM's MoE layer differently (routing_agreement < 1, measured by
    the pi_old pass with rollout.return_routing); with train.routing_replay=rollout the trainer
    uses the engine's experts (agreement exactly 1; the dense layer's zero rows are never read).
    Measured: 0.995 / 0.989 without replay, 1.0 / 1.0 with it. Before, the engine refused
    return_routing for a model with a dense layer."""
    from test_train_loop import gspo_rows

    def run(name, *extra):
        out = tmp_path / name
        r = train_pooled(2, "--config", GLM_TINY, f"out_dir={out}", "train.max_steps=2",
                         "train.sft_warmup_steps=0", "model.dtype=bfloat16", "checkpoint.interval=0",
                         "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false",
                         "reward.fn=tests.reward_fns:response_length", *extra, timeout=280)
        assert r.returncode == 0, explain(r.stderr)
        return gspo_rows(out)

    plain = run("plain", "rollout.return_routing=true")
    replayed = run("r3", "train.routing_replay=rollout")
    print("routing agreement without / with replay:", [x["routing_agreement"] for x in plain],
          [x["routing_agreement"] for x in replayed])
    assert [x["step"] for x in plain] == [x["step"] for x in replayed] == [1, 2]
    assert all(0.5 < x["routing_agreement"] < 1.0 for x in plain), [x["routing_agreement"] for x in plain]
    assert all(x["routing_agreement"] == 1.0 for x in replayed), [x["routing_agreement"] for x in replayed]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", [GLM_TINY, DSV3_TINY], ids=["glm4_moe", "deepseek_v3"])
def test_the_family_demos_learn_the_task(tmp_path, config):
    """tiny_cpu_glm.yaml / tiny_cpu_deepseek_v3.yaml (make demo's run with the second and third
    families, 100 steps: ~70 s / ~50 s here): after the warm start, GSPO raises held-out pass@1 on
    a task seed the training never sees (measured GLM 0.180 -> 0.312 at step 50 -> 0.336 at step
    100; DeepSeek-V3 0.102 -> 0.164 -> 0.207); the export is the same architecture and the
    checkpoint resumes at another layout."""
    import sys

    from test_train_loop import gspo_rows

    out = tmp_path / "demo"
    steps = 100
    r = train_pooled(2, "--config", config, f"out_dir={out}",
                     "eval.interval=50", "eval.num_prompts=64", "eval.samples_per_prompt=4",
                     "logging.progress_bar=false", "logging.plot=false", "checkpoint.interval=0", timeout=840)
    assert r.returncode == 0, explain(r.stderr)
    assert sys.executable
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, steps + 1))
    for x in rows:
        assert all(torch.isfinite(torch.tensor(float(x[k]))) for k in ("loss", "grad_norm", "reward_mean"))
    with open(out / "metrics.jsonl") as f:
        evals = [json.loads(line) for line in f if "eval/heldout/pass@1" in line]
    p1 = [e["eval/heldout/pass@1"] for e in evals]
    print(os.path.basename(config), "held-out pass@1:", p1)
    assert len(p1) == 3 and p1[2] > p1[0] + 0.08 and p1[1] > p1[0], p1
    # the run's export is a checkpoint of the same architecture (what an engine or a user loads)
    from gspo_megatron.model.family import arch_from_hf_dir, arch_from_hf_dict
    from gspo_megatron.resolve import hf_config_dict, load_config

    exported = arch_from_hf_dir(str(out / "hf"))
    assert exported == arch_from_hf_dict(hf_config_dict(load_config(config, [])))
    # its end-of-run checkpoint resumes at another layout (EP2: resharded) and trains on
    res = tmp_path / "resumed"
    r = train_pooled(2, "--config", config, f"out_dir={res}", "train.max_steps=101",
                     f"checkpoint.resume={out / 'checkpoints'}", "parallel.tp=1",
                     "parallel.sequence_parallel=false", "parallel.ep=2", "checkpoint.interval=0",
                     "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false", timeout=600)
    assert r.returncode == 0, explain(r.stderr)
    assert "resumed from" in r.stderr and "resharding" in r.stderr
    assert [x["step"] for x in gspo_rows(res)] == [101]


@pytest.mark.timeout(900)
def test_a_stage_without_moe_layers_saves_and_resumes_bit_identically(tmp_path):
    """GLM's dense first layer alone on pipeline stage 0: Megatron gives that stage an expert
    optimizer with no parameters (the group keys are gathered from every rank), whose state_dict over
    torch's Adam asserted one step: no checkpoint could be written (found by the configuration
    sweep's GLM x PP2 cells). 2 steps, saved, resumed to 4 at PP2: the rows of steps 3 and 4 equal the
    uninterrupted run's (the expert optimizer resumes at the right Adam step on stage 1, from the
    common state stage 0 wrote)."""
    from test_train_loop import gspo_rows

    common = ["--config", GLM_TINY, "parallel.tp=1", "parallel.sequence_parallel=false", "parallel.pp=2",
              "train.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
              "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false", "eval.interval=0",
              "checkpoint.interval=0", "train.max_steps=4", "optimizer.lr_decay_style=constant"]

    def run(out, *extra):
        r = train_pooled(2, *common, f"out_dir={out}", *extra, timeout=600)
        assert r.returncode == 0, explain(r.stderr)
        return gspo_rows(out)

    whole = run(tmp_path / "whole")
    run(tmp_path / "first", "train.max_steps=2")
    resumed = run(tmp_path / "resumed", f"checkpoint.resume={tmp_path / 'first' / 'checkpoints'}")
    assert [r["step"] for r in resumed] == [3, 4]
    keys = ("loss", "grad_norm", "reward_mean", "clip_frac", "entropy")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in whole[2:]]
    # Bit for bit, not only the logged rows: every weight and Adam moment of the end checkpoints. The
    # rows alone passed on AMD and failed on Intel by the luck of one rounding: stage 0's empty expert
    # optimizer wrote unfused param groups, so stage 1's experts resumed on torch's per-tensor Adam
    # loop instead of the fused kernel (last-bit differences in every expert weight after step 3).
    final = os.path.join("checkpoints", "iter_0000004")
    a, b = dcp_tensors(tmp_path / "whole" / final), dcp_tensors(tmp_path / "resumed" / final)
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def _glm_sharded_keys(rank, world):
    from gspo_megatron.checkpoint.mcore import model_sharded_state_dict
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.family import arch_from_hf_dict
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    arch = arch_from_hf_dict(_glm())
    ctx = init_parallel(ParallelConfig(), model_dims=arch.dims_for_validation())
    chunks, _ = build_policy(ctx, arch)
    keys = sorted(v.key for v in nested_values(model_sharded_state_dict(chunks, arch)) if hasattr(v, "key"))
    destroy_parallel()
    return keys


def test_glm_checkpoint_keys_are_the_te_specs_on_every_device():
    """Dense and MoE layers mixed: Megatron keys every layer apart. The CPU (local) spec renames
    every pre-MLP norm to mlp.linear_fc1.layer_norm_weight; the TE spec fuses only a dense layer's
    norm there and keeps an MoE layer's pre_mlp_layernorm. Checkpoints use the TE names, so one
    written on CPU loads on GPU; the TE spec's fused dense-layer norm maps to the HF tensor too."""
    from gspo_megatron.checkpoint import layout
    from gspo_megatron.model import mapping
    from gspo_megatron.model.family import arch_from_hf_dict

    keys = run_distributed(_glm_sharded_keys, 1, timeout=240)[0]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys  # dense layer 0 (TE: fused)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in keys
    for i in (1, 2, 3):  # MoE layers
        assert f"decoder.layers.{i}.pre_mlp_layernorm.weight" in keys
        assert f"decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight" not in keys
        assert f"decoder.layers.{i}.mlp.router.expert_bias" in keys
        assert f"decoder.layers.{i}.mlp.shared_experts.linear_fc1.weight" in keys
    arch = arch_from_hf_dict(_glm())
    assert layout.canonical_key("decoder.layers.2.pre_mlp_layernorm.weight",
                                "decoder.layers.2.mlp.linear_fc1.layer_norm_weight", arch) == \
        "decoder.layers.2.pre_mlp_layernorm.weight"
    te = mapping.match("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", arch)
    local = mapping.match("decoder.layers.0.pre_mlp_layernorm.weight", arch)
    assert te.rule.hf == local.rule.hf == ("model.layers.{layer}.post_attention_layernorm.weight",)


# Megatron's Transformer Engine spec provider with each TE class reduced to the parameters it holds,
# so the GPU layer spec can be built (and read) on a machine without Transformer Engine.
class _TeLinear:
    params = ("weight",)


class _TeLayerNormLinear:  # TELayerNormColumnParallelLinear: the norm fused into the linear layer
    params = ("layer_norm_weight", "weight")


class _TeNorm:
    params = ("weight",)


class _TeCoreAttention:
    params = ()


class _FakeTESpecProvider:
    def linear(self):
        return _TeLinear

    column_parallel_linear = row_parallel_linear = linear

    def fuse_layernorm_and_linear(self):
        return True

    def column_parallel_layer_norm_linear(self):
        return _TeLayerNormLinear

    def layer_norm(self, rms_norm=False, for_qk=False):
        return _TeNorm

    def core_attention(self):
        return _TeCoreAttention

    def grouped_mlp_modules(self, grouped, legacy):
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        return TEGroupedMLP, MLPSubmodules(linear_fc1=_TeLinear, linear_fc2=_TeLinear)

    def activation_func(self):
        return None


def _spec_param_names(spec, prefix="") -> set[str]:
    """The parameter names a layer spec built with _FakeTESpecProvider gives its modules."""
    import dataclasses as dc

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        if spec.submodules is None:
            return _spec_param_names(spec.module, prefix)
        return set().union(*(_spec_param_names(getattr(spec.submodules, f.name), f"{prefix}{f.name}.")
                             for f in dc.fields(spec.submodules)))
    if isinstance(spec, type) and hasattr(spec, "params") and spec.__module__ == __name__:
        return {prefix + p for p in spec.params}
    return set()


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_keys_are_the_names_megatrons_te_spec_gives(family, monkeypatch):
    """A checkpoint stores each tensor under the name Megatron's Transformer Engine spec (what a
    GPU run builds) gives it, whichever spec wrote it: every norm exactly (GQA fuses the input norm
    into linear_qkv, MLA fuses the q/kv latent norms into its up projections and keeps the input
    norm, a dense layer's pre-MLP norm is fused into linear_fc1), every other non-expert tensor
    among the spec's. The reference is the family's own GPU layer spec, built by Megatron's
    get_gpt_layer_with_transformer_engine_spec with only the TE classes stood in for."""
    from megatron.core.models.gpt import gpt_layer_specs

    from gspo_megatron.checkpoint import layout
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.family import arch_from_hf_dict
    from gspo_megatron.model.spec import transformer_config
    import megatron_utils

    cfg = {"qwen3_moe": megatron_utils.tiny_hf_config, "glm4_moe": megatron_utils.tiny_glm_config,
           "deepseek_v3": megatron_utils.tiny_deepseek_v3_config}[family]().to_dict()
    arch = arch_from_hf_dict(cfg)
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", _FakeTESpecProvider, raising=False)
    config = transformer_config(arch, ParallelConfig())
    te = {m: _spec_param_names(arch.family.layer_spec(config, m, True)) for m in (False, True)}

    def is_norm(name):
        return name.endswith("norm.weight") or name.endswith("layer_norm_weight")

    for layer in range(arch.num_layers):
        names = te[arch.is_moe_layer(layer)]
        keys = {it.key.split(f"decoder.layers.{layer}.", 1)[-1].split("decoder.layers.", 1)[-1]
                for it in layout.plan_items(arch) if it.layer == layer}
        assert {k for k in keys if is_norm(k)} == {n for n in names if is_norm(n)}, (layer, sorted(keys))
        # (a bias is its linear layer's: the stand-in classes list weights only)
        rest = {k[:-len("bias")] + "weight" if k.endswith(".bias") else k
                for k in keys if not k.startswith(("mlp.router.", "mlp.experts."))}
        assert rest <= names, (layer, sorted(rest - names))


@pytest.mark.timeout(600)
def test_mtp_layers_are_carried_through_checkpoints_and_exports(tmp_path):
    """A DeepSeek-V3 checkpoint's MTP layer (model.layers.{L}.*: FP8 weights with their scales, bf16
    norms, an fp32 projection; transformers builds none, megatron_utils.add_mtp_layer writes it) is
    not trained, but nothing that starts from the checkpoint loses it: a run from model.hf_dir
    stores it unchanged in its checkpoint's carried/ and in its HF export, whose config.json
    declares it; a run from that checkpoint (model.load) carries it again. Bit for bit, each dtype
    its own."""
    from safetensors.torch import load_file

    from megatron_utils import add_mtp_layer

    hf = tmp_path / "hf"
    make_tiny_hf(hf, family="deepseek_v3")
    mtp = add_mtp_layer(hf)
    common = ["--config", DSV3_TINY, "parallel.tp=1", "parallel.sequence_parallel=false", "model.hf_config=null",
              "train.sft_warmup_steps=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
              "logging.progress_bar=false", "logging.plot=false", "eval.interval=0", "train.max_steps=1",
              "train.minibatches_per_step=1", "checkpoint.interval=1"]

    def run(out, *extra):
        r = train_pooled(1, *common, f"out_dir={out}", *extra, timeout=300)
        assert r.returncode == 0, explain(r.stderr)

    def tensors(d):
        out = {}
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(d, f)))
        return out

    def same(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    def carried_in(ckpt_root, export):
        ckpt = ckpt_root / "iter_0000001"
        got = tensors(ckpt / "carried")
        assert got.keys() == mtp.keys() and all(same(got[k], mtp[k]) for k in mtp)
        assert json.loads((ckpt / "hf_config" / "config.json").read_text())["num_nextn_predict_layers"] == 1
        exported = tensors(export)
        assert all(same(exported[k], mtp[k]) for k in mtp)  # beside the trained (float32) policy
        assert exported["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float32
        index = json.loads((export / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(exported)
        assert json.loads((export / "config.json").read_text())["num_nextn_predict_layers"] == 1

    run(tmp_path / "a", f"model.hf_dir={hf}")
    carried_in(tmp_path / "a" / "checkpoints", tmp_path / "a" / "hf")
    run(tmp_path / "b", f"model.load={tmp_path / 'a' / 'checkpoints' / 'iter_0000001'}")
    carried_in(tmp_path / "b" / "checkpoints", tmp_path / "b" / "hf")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_groups_an_engine_loads_together_are_tensors_the_export_holds(family):
    """ModelFamily.weights_loaded_together names HF tensors of every layer that holds them: a
    template the exporter never emits would keep a push's bucket open to the end of the stream
    (rollout/weight_sync.py iter_buckets, which then fails naming it)."""
    import megatron_utils
    from gspo_megatron.model import mapping
    from gspo_megatron.model.family import arch_from_hf_dict
    from gspo_megatron.rollout.weight_sync import LoadedTogether

    cfg = {"qwen3_moe": megatron_utils.tiny_hf_config, "glm4_moe": megatron_utils.tiny_glm_config,
           "deepseek_v3": megatron_utils.tiny_deepseek_v3_config}[family]().to_dict()
    arch = arch_from_hf_dict(cfg)
    groups = arch.family.weights_loaded_together(arch)
    names = set(mapping.expected_hf_names(arch))
    together = LoadedTogether(groups)
    for group in groups:
        for layer in range(arch.num_layers):
            members = {t.format(layer=layer) for t in group}
            assert members <= names, sorted(members - names)
            assert all(together.partners(n) == members - {n} for n in members)
    assert bool(groups) == (family == "deepseek_v3")  # q_lora_rank set: SGLang's fused a-projection
