"""A config.json is untrusted input (issue 52, row 5 and the degraded numeric fields): the work
`gspo-convert hf-to-mcore` does before it answers is bounded by the files, not by what config.json
claims (1e9 experts, 1e7 layers beside a tiny checkpoint), and every size or count is an integer
and every float finite, in one line naming the file and the key (int() read 64.5 as 64)."""
from __future__ import annotations

import json
import time

import pytest

from megatron_utils import make_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE and a tiny GLM-4.5 checkpoint (their config.json is edited per test)."""
    root = tmp_path_factory.mktemp("hostile_configs")
    make_tiny_hf(root / "qwen3_moe", family="qwen3_moe")
    make_tiny_hf(root / "glm4_moe", family="glm4_moe")
    return root


def _convert_with(tiny, tmp_path, family: str, **claims):
    """hf-to-mcore of the tiny checkpoint whose config.json says `claims`: (exit status, stderr,
    seconds, names of expected tensors the converter enumerated)."""
    import shutil

    from converters.cli import main
    from gspo_megatron.model import mapping

    src = tmp_path / "hf"
    shutil.copytree(tiny / family, src)
    cfg = json.loads((src / "config.json").read_text())
    for k, v in claims.items():  # rope_theta where transformers 5 writes it, else at the top
        (cfg["rope_parameters"] if k == "rope_theta" and "rope_parameters" in cfg else cfg)[k] = v
    (src / "config.json").write_text(json.dumps(cfg))  # NaN written as NaN, as json.dumps does
    enumerated = [0]
    real = mapping.iter_hf_shapes

    def counting(arch):
        for x in real(arch):
            enumerated[0] += 1
            yield x

    mapping.iter_hf_shapes = counting
    t0 = time.monotonic()
    try:
        code = main(["hf-to-mcore", "--hf-dir", str(src), "--out", str(tmp_path / "out"), "--no-progress"])
    except SystemExit as e:
        code = e.code
    finally:
        mapping.iter_hf_shapes = real
    return code, time.monotonic() - t0, enumerated[0], src


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
@pytest.mark.parametrize("claim", ["experts", "layers"])
def test_a_config_claiming_a_giant_model_is_refused_after_reading_only_what_the_files_hold(
        tiny, tmp_path, capsys, family, claim):
    from safetensors import safe_open

    key = {"experts": "num_experts" if family == "qwen3_moe" else "n_routed_experts",
           "layers": "num_hidden_layers"}[claim]
    value = 10**9 if claim == "experts" else 10**7
    code, seconds, enumerated, src = _convert_with(tiny, tmp_path, family, **{key: value})
    err = capsys.readouterr().err
    print(f"{family} {key}={value}: exit {code} in {seconds:.3f} s after {enumerated} expected names")
    held = 0
    for f in src.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            held += len(list(st.keys()))
    assert code == 2, err[-2000:]
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "is missing" in lines[0] and str(src) in lines[0], err[-2000:]
    # the bound by construction: never more expected names than the files hold, plus one
    assert enumerated <= held + 1, (enumerated, held)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
@pytest.mark.parametrize("key,value,why", [
    ("hidden_size", 64.5, "must be an integer"),
    ("hidden_size", "64", "must be an integer"),
    ("hidden_size", True, "must be an integer"),
    ("num_attention_heads", 0, "must be >= 1"),
    ("vocab_size", -5, "must be >= 1"),
    ("num_hidden_layers", float("inf"), "must be an integer"),
    ("rope_theta", float("nan"), "must be a finite number"),
    ("rms_norm_eps", float("inf"), "must be a finite number"),
    ("rms_norm_eps", "1e-6", "must be a finite number"),
])
def test_every_size_is_an_integer_and_every_float_finite_in_one_line(tiny, tmp_path, capsys, family, key, value, why):
    code, _, _, src = _convert_with(tiny, tmp_path, family, **{key: value})
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert str(src / "config.json") in lines[0] and key in lines[0] and why in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_an_integral_float_is_still_read_as_the_integer(tiny, tmp_path, capsys):
    """64.0 is 64 (some tools write every number as a float); the conversion succeeds."""
    code, _, _, _ = _convert_with(tiny, tmp_path, "qwen3_moe", hidden_size=float(
        json.loads((tiny / "qwen3_moe" / "config.json").read_text())["hidden_size"]))
    assert code == 0, capsys.readouterr().err[-2000:]


@pytest.mark.parametrize("key,value,why", [
    ("hidden_size", 64.5, "must be an integer"), ("num_moe_experts", "8", "must be an integer"),
    ("num_layers", True, "must be an integer"), ("num_attention_heads", 0, "must be >= 1"),
    ("rotary_base", float("nan"), "must be a finite number"), ("layernorm_epsilon", "1e-6", "must be a finite number"),
    ("kv_channels", 16.5, "must be an integer"),
])
def test_megatron_bridge_provider_fields_are_read_as_checked_numbers(key, value, why):
    """Megatron-Bridge's run_config.yaml (and Megatron-LM's run arguments) go through the family's
    provider-field reader: the same checks as config.json (int() read 64.5 as 64 and "8" as 8,
    float() "nan" as NaN), one line naming the file and the field. Reference: the fields the
    project itself writes for a tiny Qwen3-MoE read back to its architecture."""
    from gspo_megatron.errors import ModelConfigError
    from gspo_megatron.model.family import family_of_type

    fam = family_of_type("qwen3_moe")
    hf = {"model_type": "qwen3_moe", "vocab_size": 98, "hidden_size": 64, "intermediate_size": 128,
          "moe_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False}
    arch = fam.read_config(hf, "config.json")
    fields = dict(fam.bridge_run_config(arch)["model"])
    good = fam.hf_from_provider_fields(fields, "run_config.yaml", "model.", provider_defaults=True)
    assert good["hidden_size"] == 64 and good["num_experts"] == 8 and good["head_dim"] == 16
    with pytest.raises(ModelConfigError) as e:
        fam.hf_from_provider_fields({**fields, key: value}, "run_config.yaml", "model.", provider_defaults=True)
    msg = str(e.value)
    assert msg.startswith(f"run_config.yaml: model.{key} {why}") and "\n" not in msg, msg
