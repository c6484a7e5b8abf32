"""gspo-convert: HF <-> Megatron torch_dist, and loading torch_dist into the sharded model.

What the tests show:
  * HF -> mcore -> HF is bit-exact for every tensor (fp32/bf16, tied/untied, vocab 300 which
    Megatron pads to 384 at TP1 and 512 at TP2; GLM-4.5 in Megatron's per-layer keys: a dense
    first layer, shared experts, the router's expert bias; DeepSeek-V3's multi-latent attention and
    YaRN), side files carried, transformers loads the result;
  * the converted checkpoint has exactly the keys and global shapes Megatron's own
    `sharded_state_dict()` uses, and loads at TP2+SP, EP2, PP2, TP2xEP2 (through Megatron DDP), a
    tied bf16 one at TP2, and GLM and DeepSeek-V3 at TP2+SP and PP2xEP2, with every parameter
    bit-exact and log-probs equal to transformers';
    at TP1 through `python -m gspo_megatron.score --load`;
  * a checkpoint the model saves itself (save_mcore_checkpoint at TP2), of either family, has the
    converter's keys, reloads at EP2 and converts back to the original HF tensors; extra sharded
    state round-trips;
  * torchrun: both directions with 2 ranks give the single-process result;
  * bad input -> `gspo-convert: error: ...` naming the file/tensor, exit 2, nothing at --out; a
    failure half-way leaves nothing behind either.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_distributed
from megatron_utils import add_mtp_layer, hf_token_logprobs, make_tiny_hf, random_sequences
from run_output import explain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOGPROB_TOL = 1e-4
LENGTHS = [5, 17, 9, 12]
# hf-to-mcore --out R writes R/iter_0000000/ (a Megatron-LM root holding iteration 0, as
# Megatron-Bridge saves a converted model: gspo_megatron/checkpoint/megatron_dirs.py)
ITER0 = "iter_0000000"
TOKENIZER_FILES = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"model_max_length": 64}'}


def convert(*argv) -> None:
    from converters.cli import main

    assert main([*argv, "--no-progress"]) == 0


def hf_tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(str(d), "*.safetensors"))):
        out.update(load_file(f))
    return out


def assert_bit_exact(a: dict, b: dict) -> None:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


CASES = {  # name: (dtype, tied, seed, family)
    "fp32-untied": (torch.float32, False, 0, "qwen3_moe"),
    "bf16-tied": (torch.bfloat16, True, 1, "qwen3_moe"),
    "bf16-untied": (torch.bfloat16, False, 2, "qwen3_moe"),
    "fp32-tied": (torch.float32, True, 3, "qwen3_moe"),
    # GLM-4.5: a dense first layer, so Megatron keys every layer apart (checkpoint/layout.py
    # per_layer_keys); shared experts, the router's expert bias (a buffer), QKV bias
    "glm-fp32": (torch.float32, False, 4, "glm4_moe"),
    # DeepSeek-V3: multi-latent attention (q/kv latents and their norms, which the TE spec fuses
    # into the up projections), two dense first layers, a shared expert, the selection bias, YaRN
    "dsv3-fp32": (torch.float32, False, 5, "deepseek_v3"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Each case: a tiny random HF checkpoint (vocab 300, several 200 KB shards) and its conversion."""
    root = tmp_path_factory.mktemp("conv")
    out = {}
    for name, (dtype, tied, seed, family) in CASES.items():
        hf = root / f"hf-{name}"
        model = make_tiny_hf(hf, seed=seed, dtype=dtype, tie_word_embeddings=tied, family=family)
        if family == "deepseek_v3":  # carried through unchanged (checkpoint/carried.py)
            add_mtp_layer(hf, seed)
        if name == "fp32-untied":
            for f, text in TOKENIZER_FILES.items():
                (hf / f).write_text(text)
        convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(root / f"mc-{name}"))
        out[name] = (hf, root / f"mc-{name}", model)
    return root, out


# ----------------------------------------------------------------------------------------------
# HF -> mcore -> HF


@pytest.mark.parametrize("case", list(CASES))
def test_roundtrip_is_bit_exact(ckpts, case, tmp_path):
    _, cases = ckpts
    hf, mc, _ = cases[case]
    assert len(glob.glob(str(hf / "*.safetensors"))) > 1  # the input is really sharded
    assert sorted(os.listdir(mc / ITER0 / "hf_config")) == sorted(
        f for f in os.listdir(hf) if f.endswith(".json") and f != "model.safetensors.index.json")
    back = tmp_path / "back"
    convert("mcore-to-hf", "--load", str(mc), "--out", str(back), "--max-shard-size", "300KB")
    src, got = hf_tensors(hf), hf_tensors(back)
    if CASES[case][1]:  # tied: transformers may or may not store lm_head; the export never does
        src.pop("lm_head.weight", None)
    assert_bit_exact(src, got)
    assert got["model.embed_tokens.weight"].shape[0] == 300
    assert len(glob.glob(str(back / "*.safetensors"))) > 1
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(got)
    assert json.loads((back / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    for f in os.listdir(mc / ITER0 / "hf_config"):
        assert (back / f).read_bytes() == (mc / ITER0 / "hf_config" / f).read_bytes()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def test_single_file_checkpoint(tmp_path):
    make_tiny_hf(tmp_path / "hf", max_shard_size="10GB", num_hidden_layers=2)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")
    convert("hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "mc"))
    convert("mcore-to-hf", "--load", str(tmp_path / "mc"), "--out", str(tmp_path / "back"))
    assert_bit_exact(hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back"))


def test_export_loads_in_transformers_and_dtype_option(ckpts, tmp_path):
    from transformers import AutoModelForCausalLM

    _, cases = ckpts
    hf, mc, model = cases["fp32-untied"]
    convert("mcore-to-hf", "--load", str(mc), "--out", str(tmp_path / "back"))
    for f, text in TOKENIZER_FILES.items():
        assert (tmp_path / "back" / f).read_text() == text
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    ids = torch.tensor([random_sequences(300, [16], seed=3)[0]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)

    # config and side files from --hf-config-dir instead of the checkpoint's hf_config/
    convert("mcore-to-hf", "--load", str(mc), "--out", str(tmp_path / "back2"), "--hf-config-dir", str(hf))
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "back2"))
    for f in [*TOKENIZER_FILES, "generation_config.json"]:
        assert (tmp_path / "back2" / f).read_bytes() == (hf / f).read_bytes()
    assert json.loads((tmp_path / "back2" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())

    # --dtype bfloat16 on the way in: the checkpoint, its stored config and the export are bf16
    convert("hf-to-mcore", "--hf-dir", str(hf), "--out", str(tmp_path / "mc16"), "--dtype", "bfloat16")
    assert json.loads((tmp_path / "mc16" / ITER0 / "hf_config" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    convert("mcore-to-hf", "--load", str(tmp_path / "mc16"), "--out", str(tmp_path / "back16"))
    assert_bit_exact({k: v.to(torch.bfloat16) for k, v in hf_tensors(hf).items()}, hf_tensors(tmp_path / "back16"))
    # ... and back to fp32 on the way out
    convert("mcore-to-hf", "--load", str(tmp_path / "mc16"), "--out", str(tmp_path / "back32"), "--dtype", "float32")
    assert all(t.dtype == torch.float32 for t in hf_tensors(tmp_path / "back32").values())
    assert json.loads((tmp_path / "back32" / "config.json").read_text())["torch_dtype"] == "float32"


def test_layout_module_matches_the_format(ckpts):
    from gspo_megatron.checkpoint import layout
    from gspo_megatron.checkpoint.dcp_io import DcpReader
    from gspo_megatron.checkpoint.mcore import read_mcore_arch

    _, cases = ckpts
    for name, (hf, mc, _) in cases.items():
        arch = read_mcore_arch(str(mc))
        r = DcpReader(str(mc))
        assert {k: r.shape(k) for k in r.keys()} == layout.expected_keys(arch)
        assert ("output_layer.weight" in r.keys()) == (not arch.tie_word_embeddings)
        # one chunk per layer (and expert), vocab rows unpadded
        if name == "dsv3-fp32":  # layers 0, 1 dense, 2, 3 MoE; MLA's latent norms under TE's fused names
            assert r.shape("decoder.layers.2.mlp.experts.experts.linear_fc1.weight") == (8, 64, 64)
            assert r.shape("decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == (64,)
            assert r.shape("decoder.layers.3.self_attention.linear_q_up_proj.layer_norm_weight") == (48,)
            assert r.shape("decoder.layers.3.self_attention.linear_kv_up_proj.layer_norm_weight") == (32,)
            assert r.shape("decoder.layers.0.self_attention.linear_kv_down_proj.weight") == (32 + 8, 64)
            assert r.shape("decoder.layers.0.input_layernorm.weight") == (64,)
            assert not any("q_layernorm" in k or "kv_layernorm" in k for k in r.keys())
            # the MTP layer (model.layers.4.*) is no torch_dist tensor: carried/ holds it as it was
            assert not any(k.startswith("decoder.layers.4.") for k in r.keys())
            index = json.loads((mc / ITER0 / "carried" / "model.safetensors.index.json").read_text())
            assert sorted(index["weight_map"]) == sorted(k for k in hf_tensors(hf) if k.startswith("model.layers.4."))
        elif layout.per_layer_keys(arch):  # GLM: layer 0 dense, 1..3 MoE, each keyed apart
            assert len(r.tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].chunks) == 8
            assert r.shape("decoder.layers.1.mlp.experts.experts.linear_fc1.weight") == (8, 64, 64)
            assert r.shape("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == (64,)  # TE's fused norm
            assert r.shape("decoder.layers.2.mlp.router.expert_bias") == (8,)
            assert not any(k.startswith("decoder.layers.0.mlp.experts") for k in r.keys())
            # a writer without TE (the local spec) names an MoE layer's pre-MLP norm as fused: read too
            local = {"decoder.layers.2.mlp.linear_fc1.layer_norm_weight"}
            assert layout.stored_key("decoder.layers.2.pre_mlp_layernorm.weight", local) == local.pop()
            assert layout.stored_key("decoder.layers.2.pre_mlp_layernorm.weight", set()) == \
                "decoder.layers.2.pre_mlp_layernorm.weight"
        else:
            assert len(r.tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].chunks) == 4 * 8
        assert r.shape("embedding.word_embeddings.weight")[0] == 300


# ----------------------------------------------------------------------------------------------
# Loading into the sharded model


def _rank_load_layouts(rank, world, jobs, seqs):
    """For each (name, ckpt, hf_dir, layout, dtype, ddp): build at that layout, check the model's
    sharded keys/shapes against the checkpoint, load, compare every parameter with the HF tensors
    (exported back through the streaming exporter) and score `seqs`."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from gspo_megatron.checkpoint import layout as lay
    from gspo_megatron.checkpoint.dcp_io import DcpReader
    from gspo_megatron.checkpoint.mcore import _sharded_tensors, load_mcore_into_model, model_sharded_state_dict, read_mcore_arch
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import init_parallel
    from gspo_megatron.train.scoring import score_sequences

    results = {}
    for name, ckpt, hf_dir, layout, dtype, ddp in jobs:
        arch = read_mcore_arch(ckpt)
        ctx = init_parallel(ParallelConfig(**layout), model_dims=arch.dims_for_validation())
        chunks, tcfg = build_policy(ctx, arch, dtype=dtype)
        # the model's sharded state dict, in checkpoint keys, is exactly what the checkpoint holds
        reader = DcpReader(ckpt)
        sts = list(_sharded_tensors(model_sharded_state_dict(chunks, arch)))
        for st in sts:
            assert st.key in reader.keys(), (name, st.key)
            want = reader.shape(st.key)
            if lay.is_vocab_key(st.key, arch):  # padded for this TP size; stored unpadded
                assert st.global_shape[0] == arch.padded_vocab_size(ctx.parallel.tp) and want[0] == 300
                assert tuple(st.global_shape[1:]) == want[1:]
            else:
                assert tuple(st.global_shape) == want, (name, st.key)
        keys = [None] * world
        torch.distributed.all_gather_object(keys, sorted({st.key for st in sts}))
        assert set().union(*keys) == reader.keys(), (name, sorted(set().union(*keys) ^ reader.keys()))
        # every `_extra_state` entry the model asks a checkpoint for (what Megatron-Bridge's loaders
        # request) is among the ones the converter writes (gspo_megatron/checkpoint/megatron_dirs.py)
        from gspo_megatron.checkpoint import megatron_dirs
        from gspo_megatron.checkpoint.mcore import model_extra_state_keys

        asked = model_extra_state_keys(chunks)
        assert asked and set(asked) <= set(megatron_dirs.extra_state_objects(arch)), (name, asked[:3])
        # SPRMSNorm (a plain torch module) is replicated: main copy on TP rank 0 only
        for st in sts:
            if st.key.endswith("layernorm.weight") or st.key.endswith("layer_norm_weight"):
                assert isinstance(st, ShardedTensor) and st.replica_id[1] == ctx.tp_rank

        model = wrap_ddp(chunks, tcfg) if ddp else chunks
        load_mcore_into_model(model, ckpt)
        exported = dict(iter_hf_tensors(model, ctx, arch))
        # weight sync to a bf16 engine: cast on each shard's rank before the transfers
        exported16 = dict(iter_hf_tensors(model, ctx, arch, dtype=torch.bfloat16))
        lps = score_sequences(chunks, ctx, seqs, vocab_size=arch.vocab_size, micro_batch_tokens=48) \
            if dtype == torch.float32 else None
        if rank == 0:
            ref = {}
            for f in glob.glob(os.path.join(hf_dir, "*.safetensors")):
                ref.update(load_file(f))
            if arch.tie_word_embeddings:
                ref.pop("lm_head.weight", None)
            ref = {k: v for k, v in ref.items() if not k.startswith("model.layers.4.")}  # DSV3's MTP: carried
            bad = sorted(set(ref) ^ set(exported)) + [k for k in ref if k in exported and not torch.equal(
                ref[k].to(dtype).view(torch.uint8), exported[k].view(torch.uint8))]
            bad += [f"{k} (bf16)" for k in ref if k not in exported16 or not torch.equal(
                ref[k].to(dtype).to(torch.bfloat16).view(torch.uint8), exported16[k].view(torch.uint8))]
            results[name] = (bad, lps)
        ps.destroy_model_parallel()
    return results if rank == 0 else None


@pytest.mark.timeout(400)
def test_converted_checkpoint_loads_at_every_layout(ckpts):
    _, cases = ckpts
    hf, mc, model = cases["fp32-untied"]
    hf_t, mc_t, _ = cases["bf16-tied"]
    hf_g, mc_g, glm = cases["glm-fp32"]
    hf_d, mc_d, dsv3 = cases["dsv3-fp32"]
    seqs = random_sequences(300, LENGTHS)
    f32 = torch.float32
    jobs = [
        ("tp2-sp", str(mc), str(hf), dict(tp=2, sequence_parallel=True), f32, False),
        ("ep2", str(mc), str(hf), dict(ep=2), f32, False),
        ("pp2", str(mc), str(hf), dict(pp=2), f32, False),
        ("tp2xep2-ddp", str(mc), str(hf), dict(tp=2, ep=2, sequence_parallel=True), f32, True),
        # (tied embeddings at PP>1 cannot be built on CPU: Megatron moves the last stage's copy of
        # the embedding with tensor.cuda(), which the CPU runtime does not cover)
        ("tied-bf16-tp2", str(mc_t), str(hf_t), dict(tp=2, sequence_parallel=True), torch.bfloat16, False),
        # per-layer keys: TP shards each layer's tensors; PP2 puts the dense layer alone with one
        # MoE layer on stage 0, and its global layer numbers are the keys
        ("glm-tp2-sp", str(mc_g), str(hf_g), dict(tp=2, sequence_parallel=True), f32, False),
        ("glm-pp2xep2-ddp", str(mc_g), str(hf_g), dict(pp=2, ep=2), f32, True),
        # MLA: replicated down projections, column-parallel up projections; PP2 puts both dense
        # layers on stage 0 and both MoE layers on stage 1
        ("dsv3-tp2-sp", str(mc_d), str(hf_d), dict(tp=2, sequence_parallel=True), f32, False),
        ("dsv3-pp2xep2-ddp", str(mc_d), str(hf_d), dict(pp=2, ep=2), f32, True),
    ]
    res = run_distributed(_rank_load_layouts, 4, jobs, seqs, timeout=380)[0]
    with torch.no_grad():
        refs = {"qwen": hf_token_logprobs(model, seqs), "glm": hf_token_logprobs(glm, seqs),
                "dsv3": hf_token_logprobs(dsv3, seqs)}
    for name, (bad, lps) in res.items():
        assert not bad, (name, bad[:5])
        if lps is not None:
            ref = refs[name.split("-")[0] if name.startswith(("glm", "dsv3")) else "qwen"]
            assert [len(x) for x in lps] == [len(s) - 1 for s in seqs]
            worst = max((torch.tensor(g) - w).abs().max().item() for g, w in zip(lps, ref))
            assert worst <= LOGPROB_TOL, (name, worst)


def _run_score(*args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "gspo_megatron.score", *args], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.mark.timeout(300)
def test_score_cli_loads_converted_checkpoint_at_tp1(ckpts, tmp_path):
    _, cases = ckpts
    hf, mc, model = cases["fp32-untied"]
    seqs = random_sequences(300, LENGTHS, seed=5)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    r = _run_score("--load", str(mc), "--input", str(inp), "--output", str(tmp_path / "out.jsonl"))
    assert r.returncode == 0, explain(r.stderr)
    out = [json.loads(x)["token_logprobs"] for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    with torch.no_grad():
        ref = hf_token_logprobs(model, seqs)
    assert max((torch.tensor(o) - w).abs().max().item() for o, w in zip(out, ref)) <= LOGPROB_TOL
    # an HF directory given to --load: one clear line, exit 2
    r = _run_score("--load", str(hf), "--input", str(inp), "--output", str(tmp_path / "o2.jsonl"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "not a Megatron torch_dist checkpoint" in r.stderr and str(hf) in r.stderr


def _rank_save_and_reload(rank, world, hf_dir, out):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from gspo_megatron.checkpoint.mcore import load_mcore_into_model, save_mcore_checkpoint
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import init_parallel

    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(ParallelConfig(tp=2, sequence_parallel=True), model_dims=arch.dims_for_validation())
    chunks, _ = build_policy(ctx, arch, hf_dir=hf_dir)
    extra = {"trainer": {"step": ShardedTensor.from_rank_offsets("trainer.step", torch.tensor([7.0]), replica_id=rank)}}
    save_mcore_checkpoint(chunks, out, hf_dir, extra_sharded_state=extra)
    ps.destroy_model_parallel()

    ctx = init_parallel(ParallelConfig(ep=2), model_dims=arch.dims_for_validation())
    chunks, tcfg = build_policy(ctx, arch)
    model = wrap_ddp(chunks, tcfg)
    step = {"trainer": {"step": ShardedTensor.from_rank_offsets("trainer.step", torch.zeros(1), replica_id=rank)}}
    got = load_mcore_into_model(model, out, extra_sharded_state=step)
    exported = dict(iter_hf_tensors(model, ctx, arch))
    ps.destroy_model_parallel()
    return (exported, got["trainer"]["step"]) if rank == 0 else None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["fp32-untied", "glm-fp32", "dsv3-fp32"])
def test_model_saved_checkpoint_matches_converter(ckpts, tmp_path, case):
    from gspo_megatron.checkpoint.dcp_io import DcpReader

    _, cases = ckpts
    hf, mc, _ = cases[case]
    saved = tmp_path / "saved"
    exported, step = run_distributed(_rank_save_and_reload, 2, str(hf), str(saved), timeout=280)[0]
    assert step.item() == 7.0
    # the model holds the policy; the MTP layer (model.layers.4., DeepSeek-V3's case) is carried beside it
    assert_bit_exact({k: v for k, v in hf_tensors(hf).items() if not k.startswith("model.layers.4.")}, exported)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]
    # Megatron's own save (TP2: split QKV, separate gate/up chunks, vocab padded to 512) has the
    # converter's keys and shapes, and converts back to the original tensors
    a, b = DcpReader(str(saved)), DcpReader(str(mc))
    assert a.keys() - {"trainer.step"} == b.keys()
    for k in b.keys():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert a.shape(k) == (512, 64) and b.shape(k) == (300, 64)
        else:
            assert a.shape(k) == b.shape(k), k
    if case == "glm-fp32":  # per layer: layer 0's QKV in 2 TP chunks
        assert len(a.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].chunks) == 2
    elif case == "dsv3-fp32":  # column-parallel up projection in 2 chunks, replicated down projection whole
        assert len(a.tensors["decoder.layers.0.self_attention.linear_kv_up_proj.weight"].chunks) == 2
        assert len(a.tensors["decoder.layers.0.self_attention.linear_kv_down_proj.weight"].chunks) == 1
    else:
        assert len(a.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunks) == 8  # 4 layers x 2 TP
    convert("mcore-to-hf", "--load", str(saved), "--out", str(tmp_path / "back"))
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "back"))


# ----------------------------------------------------------------------------------------------
# torchrun


@pytest.mark.timeout(300)
def test_cli_under_torchrun(ckpts, tmp_path):
    _, cases = ckpts
    hf, _, _ = cases["dsv3-fp32"]  # per-layer keys, MLA, and its MTP layer: rank 0 writes it back
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               "-m", "converters.cli", *args, "--no-progress"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
        assert r.returncode == 0, explain(r.stderr)

    torchrun("hf-to-mcore", "--hf-dir", str(hf), "--out", str(tmp_path / "mc"))
    files = os.listdir(tmp_path / "mc" / ITER0)
    assert any(f.startswith("__0_") for f in files) and any(f.startswith("__1_") for f in files)
    torchrun("mcore-to-hf", "--load", str(tmp_path / "mc"), "--out", str(tmp_path / "back"), "--max-shard-size", "300KB")
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "back"))
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(f for f in os.listdir(tmp_path / "back") if f.endswith(".safetensors"))
    assert shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


# ----------------------------------------------------------------------------------------------
# Bad input and failures


def _fails(capsys, argv, *needles, out=None):
    from converters.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err[-2000:]
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("gspo-convert: error:")]
    assert len(lines) == 1, err[-2000:]
    for n in needles:
        assert str(n) in lines[0], lines[0]
    if out is not None:
        assert not os.path.exists(out)
        parent = os.path.dirname(str(out))
        assert not [f for f in os.listdir(parent) if f.startswith(f".{os.path.basename(str(out))}.")]
    return lines[0]


def _copy_hf(src, dst, edit=None):
    shutil.copytree(src, dst)
    if edit:
        edit(dst)
    return dst


def _edit_tensor(name, fn):
    def edit(d):
        index = json.loads((d / "model.safetensors.index.json").read_text())
        f = d / index["weight_map"][name]
        t = load_file(f)
        fn(t, index)
        save_file(t, f, metadata={"format": "pt"})
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


def test_bad_input(ckpts, tmp_path, capsys):
    _, cases = ckpts
    hf, mc, _ = cases["fp32-untied"]
    out = tmp_path / "out"
    h2m = lambda src: ["hf-to-mcore", "--hf-dir", str(src), "--out", str(out)]  # noqa: E731

    _fails(capsys, h2m(tmp_path / "nope"), "nope", "no such directory", out=out)

    def llama(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = "llama"
        (d / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, h2m(_copy_hf(hf, tmp_path / "llama", llama)), "model_type", "llama", out=out)

    index = json.loads((hf / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.layers.2.self_attn.q_proj.weight"]
    _fails(capsys, h2m(_copy_hf(hf, tmp_path / "noshard", lambda d: (d / shard).unlink())), shard, "missing", out=out)

    def truncate(d):
        data = (d / shard).read_bytes()
        (d / shard).write_bytes(data[: len(data) - 1000])
    _fails(capsys, h2m(_copy_hf(hf, tmp_path / "trunc", truncate)), shard, out=out)

    def garble(d):
        data = bytearray((d / shard).read_bytes())
        data[8:40] = b"\xff" * 32
        (d / shard).write_bytes(bytes(data))
    _fails(capsys, h2m(_copy_hf(hf, tmp_path / "garbled", garble)), shard, out=out)

    name = "model.layers.1.self_attn.o_proj.weight"
    shaped = _copy_hf(hf, tmp_path / "shaped", _edit_tensor(name, lambda t, i: t.update({name: t[name][:, :32].contiguous()})))
    _fails(capsys, h2m(shaped), name, "shape", out=out)

    name = "model.layers.3.mlp.experts.5.down_proj.weight"

    def drop(t, index):
        t.pop(name)
        index["weight_map"].pop(name)
    _fails(capsys, h2m(_copy_hf(hf, tmp_path / "dropped", _edit_tensor(name, drop))), name, "missing", out=out)

    _fails(capsys, h2m(hf) + ["--max-shard-size", "lots"], "--max-shard-size", "lots", out=out)

    out.mkdir()
    (out / "keep").write_text("x")
    _fails(capsys, h2m(hf), "already exists", "--overwrite")
    assert (out / "keep").read_text() == "x"
    # --overwrite replaces only an earlier output of the same command, never another directory
    _fails(capsys, h2m(hf) + ["--overwrite"], "replaces only a previous hf-to-mcore output")
    assert (out / "keep").read_text() == "x"
    shutil.rmtree(out)
    # --out equal to, inside or around the input: the source would be replaced
    from converters.cli import main

    for bad in (hf, hf / "sub", hf.parent):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            main(["hf-to-mcore", "--hf-dir", str(hf), "--out", str(bad), "--overwrite", "--no-progress"])
        assert "is, contains or lies inside the input" in capsys.readouterr().err
    assert (hf / "config.json").is_file()

    m2h = lambda src, *extra: ["mcore-to-hf", "--load", str(src), "--out", str(out), *extra]  # noqa: E731
    _fails(capsys, ["mcore-to-hf", "--load", str(mc), "--out", str(mc / "hf"), "--overwrite"], "lies inside the input")
    _fails(capsys, m2h(hf), str(hf), "not a Megatron torch_dist checkpoint", out=out)
    _fails(capsys, m2h(tmp_path / "nope"), "no such directory", out=out)

    other = _copy_hf(hf, tmp_path / "other")
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 48}))
    _fails(capsys, m2h(mc, "--hf-config-dir", str(other)), "linear_fc1.weight", "shape", out=out)

    noconf = tmp_path / "noconf"
    shutil.copytree(mc, noconf)
    shutil.rmtree(noconf / ITER0 / "hf_config")
    (noconf / ITER0 / "run_config.yaml").unlink()  # (with it, the architecture comes from there)
    _fails(capsys, m2h(noconf), "hf_config/config.json", "missing", "run_config.yaml", "run arguments", out=out)

    broken = tmp_path / "broken"
    shutil.copytree(mc, broken)
    data = (broken / ITER0 / "__0_0.distcp").read_bytes()
    (broken / ITER0 / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    _fails(capsys, m2h(broken), "__0_0.distcp", out=out)

    nometa = tmp_path / "nometa"
    shutil.copytree(mc, nometa)
    (nometa / ITER0 / ".metadata").unlink()
    _fails(capsys, m2h(nometa), ".metadata", out=out)

    # carried/ admits the MTP layers' tensors only: a policy tensor listed there (checksums
    # recomputed, so the reader's own check is what answers) would be written twice or replace one
    from gspo_megatron.checkpoint import integrity

    _, mc_d, _ = cases["dsv3-fp32"]
    smuggled = tmp_path / "smuggled"
    shutil.copytree(mc_d, smuggled)
    idx_path = smuggled / ITER0 / "carried" / "model.safetensors.index.json"
    index = json.loads(idx_path.read_text())
    index["weight_map"]["model.layers.0.input_layernorm.weight"] = sorted(index["weight_map"].values())[0]
    idx_path.write_text(json.dumps(index))
    (smuggled / ITER0 / integrity.CHECKSUM_FILE).unlink()
    integrity.record(str(smuggled / ITER0))
    _fails(capsys, m2h(smuggled), "carried", "model.layers.0.input_layernorm.weight", "MTP", out=out)


def test_failure_half_way_leaves_nothing(ckpts, tmp_path, monkeypatch):
    from gspo_megatron.checkpoint import mcore

    _, cases = ckpts
    hf, mc, _ = cases["fp32-untied"]
    calls = {"n": 0}
    real_produce, real_read = mcore._produce, mcore.DcpReader.read

    def flaky(fn):
        def wrapped(*a, **k):
            calls["n"] += 1
            if calls["n"] == 20:
                raise OSError("disk full (simulated)")
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(mcore, "_produce", flaky(real_produce))
    with pytest.raises(OSError, match="simulated"):
        mcore.hf_to_mcore(str(hf), str(tmp_path / "mc"))
    calls["n"] = 0
    monkeypatch.setattr(mcore.DcpReader, "read", flaky(real_read))
    with pytest.raises(OSError, match="simulated"):
        mcore.mcore_to_hf(str(mc), str(tmp_path / "hf"))
    assert os.listdir(tmp_path) == []


def test_help_explains_every_option(capsys):
    from converters.cli import main

    for argv, needles in [
        (["--help"], ["hf-to-mcore", "mcore-to-hf", "torchrun"]),
        (["hf-to-mcore", "--help"], ["--hf-dir", "--out", "--dtype", "--max-shard-size", "--overwrite", "--threads", "--no-progress"]),
        (["mcore-to-hf", "--help"], ["--load", "--out", "--hf-config-dir", "--dtype", "--max-shard-size", "--overwrite", "--no-progress"]),
    ]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
        text = capsys.readouterr().out
        for n in needles:
            assert n in text, (argv, n)


# ----------------------------------------------------------------------------------------------
# The bench


@pytest.mark.timeout(120)
def test_bench_convert_smoke(tmp_path):
    """bench/bench_convert.py --smoke, as a user runs it: exit 0, the round trip bit-exact, one row
    per operation with its numbers, the work directory removed. No timing is asserted."""
    import re

    work = tmp_path / "w"
    r = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_convert.py"), "--smoke",
                        "--workdir", str(work)], capture_output=True, text=True, timeout=110, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"^round trip HF -> mcore -> HF bit-exact for all \d+ tensors$", r.stdout, re.M), r.stdout
    num = r"[0-9]+\.[0-9]+"
    for op in ("copy", "hf-to-mcore", "mcore-to-hf"):
        rows = [ln for ln in r.stdout.splitlines() if ln.split()[:1] == [op]]
        assert len(rows) == 1 and re.fullmatch(rf"{op}\s+{num}\s+{num}\s+\d+%\s+{num}\s+{num}\s+\d+%", rows[0]), rows
    assert not work.exists()
