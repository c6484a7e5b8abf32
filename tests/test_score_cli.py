"""The scoring CLI end to end (single process) and its handling of bad input."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_utils import hf_token_logprobs, make_tiny_hf, random_sequences
from run_output import explain

CLI_TIMEOUT_S = 180


def run_score(*args, cwd=None):
    """`python -m gspo_megatron.score args`, run by its own main in a pooled process (testlib.main_pooled;
    the real launch under torchrun: tests/test_converters.py test_cli_under_torchrun)."""
    from testlib import REPO, main_pooled

    return main_pooled("gspo_megatron.score", 1, *args, timeout=CLI_TIMEOUT_S, cwd=cwd or REPO)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    model = make_tiny_hf(d / "hf", max_shard_size="10GB", num_hidden_layers=2)
    seqs = random_sequences(300, [4, 11, 7])
    (d / "in.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    return d, model, seqs


def copy_ckpt(src, dst, edit=None):
    dst.mkdir()
    for f in os.listdir(src):
        if f != "model.safetensors":
            (dst / f).write_bytes((src / f).read_bytes())
    tensors = load_file(src / "model.safetensors")
    if edit:
        edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _assert_scores_like_transformers(out_path, model, seqs) -> None:
    out = [json.loads(line)["token_logprobs"] for line in out_path.read_text().splitlines()]
    with torch.no_grad():
        ref = hf_token_logprobs(model, seqs)
    assert [len(o) for o in out] == [len(s) - 1 for s in seqs]
    assert max((torch.tensor(o) - r_).abs().max().item() for o, r_ in zip(out, ref)) <= 1e-4


@pytest.mark.timeout(200)
def test_cli_scores_like_transformers(ckpt):
    d, model, seqs = ckpt
    r = run_score("--hf-dir", str(d / "hf"), "--input", str(d / "in.jsonl"), "--output", str(d / "out.jsonl"))
    assert r.returncode == 0, explain(r.stderr)
    _assert_scores_like_transformers(d / "out.jsonl", model, seqs)
    assert not [f for f in os.listdir(d) if ".tmp." in f]  # atomic write left nothing behind


def _fails_with(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("gspo_megatron.score: error:")]
    assert len(lines) == 1, r.stderr[-2000:]
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.timeout(300)
def test_cli_bad_input(ckpt, tmp_path):
    d, _, _ = ckpt
    hf, inp, out = str(d / "hf"), str(d / "in.jsonl"), str(tmp_path / "o.jsonl")

    _fails_with(run_score("--hf-dir", str(tmp_path / "nope"), "--input", inp, "--output", out), "nope", "no such directory")
    _fails_with(run_score("--hf-dir", hf, "--input", str(tmp_path / "missing.jsonl"), "--output", out), "missing.jsonl")

    bad_in = tmp_path / "bad.jsonl"
    bad_in.write_text('{"input_ids": [1, 2]}\n{"ids": [3]}\n')
    _fails_with(run_score("--hf-dir", hf, "--input", str(bad_in), "--output", out), "bad.jsonl:2", "input_ids")
    bad_in.write_text('{"input_ids": [1, 99999]}\n')
    _fails_with(run_score("--hf-dir", hf, "--input", str(bad_in), "--output", out), "99999")

    llama = copy_ckpt(d / "hf", tmp_path / "llama")
    cfg = json.loads((llama / "config.json").read_text())
    cfg["model_type"] = "llama"
    (llama / "config.json").write_text(json.dumps(cfg))
    _fails_with(run_score("--hf-dir", str(llama), "--input", inp, "--output", out), "model_type", "llama")

    missing = copy_ckpt(d / "hf", tmp_path / "missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    _fails_with(run_score("--hf-dir", str(missing), "--input", inp, "--output", out), "model.layers.1.self_attn.k_proj.weight", "missing")

    def rename(t):
        t["model.layers.0.mlp.experts.0.gate_projj.weight"] = t.pop("model.layers.0.mlp.experts.0.gate_proj.weight")

    unknown = copy_ckpt(d / "hf", tmp_path / "unknown", rename)
    _fails_with(run_score("--hf-dir", str(unknown), "--input", inp, "--output", out), "gate_proj")

    def reshape(t):
        t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :32].contiguous()

    shaped = copy_ckpt(d / "hf", tmp_path / "shaped", reshape)
    _fails_with(run_score("--hf-dir", str(shaped), "--input", inp, "--output", out), "o_proj", "shape")

    corrupt = copy_ckpt(d / "hf", tmp_path / "corrupt")
    data = (corrupt / "model.safetensors").read_bytes()
    (corrupt / "model.safetensors").write_bytes(data[: len(data) // 2])
    _fails_with(run_score("--hf-dir", str(corrupt), "--input", inp, "--output", out), "model.safetensors")

    _fails_with(run_score("--hf-dir", hf, "--input", inp, "--output", out, "--tp", "3"), "world size 1", "tp")
    assert not os.path.exists(out)


@pytest.mark.parametrize(
    "kw,world,dims,needle",
    [
        (dict(tp=2), 3, {}, "not divisible"),
        (dict(tp=4), 4, dict(heads=6, kv_heads=2), "6 attention heads"),
        (dict(tp=2), 2, dict(kv_heads=1), "1 key/value heads"),
        (dict(ep=3), 3, dict(experts=8), "8 experts"),
        (dict(pp=3), 3, dict(layers=4), "4 layers"),
        (dict(tp=2, sequence_parallel=False), 2, {}, "sequence_parallel"),
        (dict(ep=2, etp=2), 2, {}, "ep*etp"),
    ],
)
def test_parallel_config_rejects_bad_layouts(kw, world, dims, needle):
    from gspo_megatron.config import ConfigError, ParallelConfig

    model = dict(layers=4, heads=4, kv_heads=2, experts=8, expert_width=32)
    model.update(dims)
    with pytest.raises(ConfigError, match=needle.replace("*", r"\*")):
        ParallelConfig(**kw).validate(world, **model)


def test_parallel_config_accepts_and_derives_dp():
    from gspo_megatron.config import ParallelConfig

    p = ParallelConfig(tp=2, ep=2, sequence_parallel=True)
    p.validate(4, layers=4, heads=4, kv_heads=2, experts=8)
    assert p.dp(4) == 2 and p.edp(4) == 2  # 4 ranks per stage = ep 2 x etp 1 x edp 2
    assert ParallelConfig(ep=4).edp(4) == 1
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(tp=1, sequence_parallel=True)


def test_unsupported_qwen_variants_are_rejected():
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.errors import ModelConfigError

    base = dict(model_type="qwen3_moe", vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=4)
    MoeArch.from_hf_dict(base)
    for extra, needle in [({"shared_expert_intermediate_size": 16}, "shared experts"),
                          ({"mlp_only_layers": [0]}, "dense"), ({"use_sliding_window": True}, "sliding"),
                          ({"model_type": "qwen2_moe"}, "model_type"), ({"num_experts": 0}, "num_experts")]:
        with pytest.raises(ModelConfigError, match=needle):
            MoeArch.from_hf_dict({**base, **extra})


def run_score_torchrun(nproc, *args):
    from testlib import main_pooled

    return main_pooled("gspo_megatron.score", nproc, *args, timeout=CLI_TIMEOUT_S)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("nproc,extra", [
    pytest.param(2, ["--cp", "2"], id="cp2-packed"),
    pytest.param(2, ["--cp", "2", "--no-packing"], id="cp2-padded"),
    pytest.param(4, ["--cp", "2", "--tp", "2"], id="cp2xtp2-sp-packed"),
])
def test_context_parallel_scoring_matches_transformers(ckpt, tmp_path, nproc, extra):
    """Each CP rank scores its zigzag chunks of every sequence; rank 0 reassembles them. Lengths
    2, 3, 5 and 13 are not multiples of 2*cp = 4 (padded per sequence), 8 is."""
    d, model, _ = ckpt
    seqs = random_sequences(300, [2, 13, 5, 8, 3], seed=11)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in seqs))
    r = run_score_torchrun(nproc, "--hf-dir", str(d / "hf"), "--input", str(inp), "--output",
                           str(tmp_path / "out.jsonl"), *extra)
    assert r.returncode == 0, explain(r.stderr)
    _assert_scores_like_transformers(tmp_path / "out.jsonl", model, seqs)
