"""gspo-convert lora-to-peft / lora-merge on a LoRA run's adapter-only checkpoint
(gspo_megatron/checkpoint/lora_export.py). One tiny LoRA run for the module: GLM-4.5's features on
the tiny model of tests/megatron_utils.py (a dense first layer, a shared expert, routed experts),
adapters on every target (attention, mlp, shared_experts, experts), 2 GSPO steps at TP2 + SP with
the trainer's own HF export. Then:

  * lora-merge (from the recorded HF base, and from an mcore copy of it given as --base) writes
    what the run exported itself: the same tensor names, every tensor within 1e-6;
  * lora-to-peft writes adapters whose W + (alpha / r) B A is the merged model, tensor by tensor,
    that the `peft` library loads onto transformers' base model with the merged model's log-probs
    (<= 1e-4), and whose B moved in training;
  * bad input is one line each: a full-parameter checkpoint (converted, or a trainer's) names
    mcore-to-hf, a missing base, a base of another architecture, a random-init base (lora-merge),
    a corrupted file, an existing --out.

The conversions that build the model run `main(argv)` in a pooled world-1 rank (Megatron's global
state stays out of pytest's process); the refusals, which come before any model is built, run
in-process.
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dist_utils import run_distributed
from megatron_utils import hf_token_logprobs, make_tiny_hf, random_sequences
from run_output import explain
from testlib import REPO, train_pooled

GLM = os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml")
RANK, ALPHA = 4, 8.0
PEFT_PREFIX = "base_model.model."


def _main_in_rank(rank, world, argv):
    from converters.cli import main

    return main(argv)


def convert(*argv) -> None:
    """`gspo-convert argv` through its main(argv), in a pooled one-process rank."""
    assert run_distributed(_main_in_rank, 1, [*argv, "--no-progress"], timeout=300) == [0]


def fails(capsys, *argv_and_needles):
    """`gspo-convert argv` in this process: exit 2 with one `gspo-convert: error:` line holding
    every needle. Returns the line (shown under -s)."""
    from converters.cli import main

    argv, needles = argv_and_needles[0], argv_and_needles[1:]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*argv, "--no-progress"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("gspo-convert: error:")]
    assert e.value.code == 2 and len(lines) == 1, err[-2000:]
    for n in needles:
        assert str(n) in lines[0], lines[0]
    with capsys.disabled():
        print(lines[0])
    return lines[0]


def hf_tensors(d) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(str(d), "*.safetensors"))):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(root, the HF base, the run's out_dir, lora-merge's output, lora-to-peft's output)."""
    root = tmp_path_factory.mktemp("lora-convert")
    base = root / "base"
    make_tiny_hf(base, seed=3, family="glm4_moe")
    out = root / "run"
    # the random tiny model earns reward 0 on every sample (GSPO's advantages, and so its
    # gradient, are then 0): one supervised warm-up step moves the adapters
    r = train_pooled(2, "--config", GLM, f"out_dir={out}", f"model.hf_dir={base}", "model.hf_config=null",
                     f"lora.rank={RANK}", f"lora.alpha={ALPHA}", "train.max_steps=2", "train.sft_warmup_steps=1",
                     "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4", "checkpoint.interval=0",
                     "checkpoint.export_hf=true", "logging.progress_bar=false", "logging.plot=false", timeout=600)
    assert r.returncode == 0, explain(r.stderr)
    ckpts = out / "checkpoints"
    convert("lora-merge", "--load", str(ckpts), "--out", str(root / "merged"))  # the root: what its tracker names
    convert("lora-to-peft", "--load", str(ckpts), "--out", str(root / "peft"))
    return root, base, out, root / "merged", root / "peft"


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.mark.timeout(900)
def test_lora_merge_writes_what_the_run_exported(run, tmp_path):
    """From the HF base the checkpoint records, and from an mcore checkpoint of it (--base)."""
    from converters.cli import main

    root, base, out, merged, _ = run
    exported = hf_tensors(out / "hf")
    got = hf_tensors(merged)
    err = _max_diff(got, exported)
    assert main(["hf-to-mcore", "--hf-dir", str(base), "--out", str(tmp_path / "base-mcore"), "--no-progress"]) == 0
    convert("lora-merge", "--load", str(out / "checkpoints"), "--base", str(tmp_path / "base-mcore"),
            "--out", str(tmp_path / "merged-mcore"))
    err_mcore = _max_diff(hf_tensors(tmp_path / "merged-mcore"), exported)
    moved = max(float((exported[k] - v).abs().max()) for k, v in hf_tensors(base).items())
    print(f"lora-merge vs the run's export, {len(got)} tensors: |diff| max {err:.2e} (HF base), {err_mcore:.2e} "
          f"(mcore base); the run's export vs its base: {moved:.2e}")
    assert err <= 1e-6 and err_mcore <= 1e-6
    assert moved > 1e-4  # the adapters changed the model: the comparison is not of two copies of the base
    cfg = json.loads((merged / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and json.loads((merged / ".gspo-output.json").read_text())["written_by"] \
        == "lora-merge"


def _peft_model(base_dir, peft_dir, adapters: dict, scale: float):
    """peft.PeftModel.from_pretrained on transformers' base model. PEFT 0.21.2 on transformers 5
    maps the targets gate_proj / up_proj / down_proj to the fused routed experts only and drops the
    dense and shared-expert MLP modules of those names (huggingface/peft#3711, fixed by #3715):
    those modules - and only those - are merged into the base here first. Returns the model and
    the modules merged by hand."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32),
                                      str(peft_dir))
    wrapped = {n[len(PEFT_PREFIX):].rsplit(".lora_A", 1)[0] for n, _ in probe.named_modules()
               if n.endswith("lora_A.default")}
    modules = sorted({k[len(PEFT_PREFIX):].split(".lora_")[0] for k in adapters})
    dropped = [m for m in modules if m not in wrapped and m.split(".experts.")[0] + ".experts" not in wrapped]
    assert all(".mlp.shared_experts." in m or m.rsplit(".", 1)[0].endswith(".mlp") for m in dropped), dropped
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    sd = model.state_dict()
    with torch.no_grad():
        for m in dropped:
            a, b = (adapters[f"{PEFT_PREFIX}{m}.lora_{x}.weight"].double() for x in "AB")
            sd[f"{m}.weight"].copy_((sd[f"{m}.weight"].double() + scale * b @ a).float())
    return PeftModel.from_pretrained(model, str(peft_dir)).eval(), dropped


@pytest.mark.timeout(900)
def test_lora_to_peft_is_the_merged_model_and_loads_in_peft(run):
    from transformers import AutoModelForCausalLM

    root, base, out, merged, peft_dir = run
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", RANK, ALPHA)
    assert cfg["base_model_name_or_path"] == str(base)  # the recorded base, absolute
    adapters = load_file(str(peft_dir / "adapter_model.safetensors"))
    scale = ALPHA / RANK
    # the file's content: base + (alpha / r) B A of every module is the merged model's tensor
    base_w, merged_w = hf_tensors(base), hf_tensors(merged)
    modules = sorted({k[len(PEFT_PREFIX):].split(".lora_")[0] for k in adapters})
    for group in ("self_attn.q_proj", "self_attn.o_proj", "layers.0.mlp.gate_proj", "shared_experts.down_proj",
                  "experts.7.up_proj"):
        assert any(group in m for m in modules), group  # every target group, every expert
    w_err = max(float((base_w[f"{m}.weight"].double() + scale * adapters[f"{PEFT_PREFIX}{m}.lora_B.weight"].double()
                       @ adapters[f"{PEFT_PREFIX}{m}.lora_A.weight"].double() - merged_w[f"{m}.weight"].double())
                      .abs().max()) for m in modules)
    b_max = {m: float(adapters[f"{PEFT_PREFIX}{m}.lora_B.weight"].abs().max()) for m in modules}
    moved = sum(v > 0 for v in b_max.values())
    # through the peft library, on transformers' model of the base
    model, dropped = _peft_model(base, peft_dir, adapters, scale)
    plain = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    seqs = random_sequences(300, [5, 17, 9, 12])
    with torch.no_grad():
        lp_err = max(float((a - b).abs().max()) for a, b in zip(hf_token_logprobs(model, seqs),
                                                              hf_token_logprobs(plain, seqs)))
    print(f"lora-to-peft: {len(modules)} adapted HF modules, B non-zero in {moved} (the rest: experts no token "
          f"reached; |B| max {max(b_max.values()):.2e});"
          f" base + (alpha/r) B A vs lora-merge |diff| max {w_err:.2e}; peft-loaded vs merged log-probs |diff| max "
          f"{lp_err:.2e} ({len(dropped)} dense / shared-expert modules merged by hand: huggingface/peft#3711)")
    # training moved B (PEFT's init: zero) of every adapter the tokens went through: every module
    # but the routed experts, and some expert of each MoE layer (one no token reached has no gradient)
    assert all(b_max[m] > 0 for m in modules if ".experts." not in m)
    expert_layers = {m.split(".mlp.")[0] for m in modules if ".experts." in m}
    assert all(any(b_max[m] > 0 for m in modules if m.startswith(f"{layer}.mlp.experts.")) for layer in expert_layers)
    assert w_err <= 1e-6
    assert lp_err <= 1e-4


def _edited_checkpoint(src, dst, edit) -> str:
    """A copy of the iteration `src` with its common.pt trainer state edited (`edit(trainer)`) and
    its checksums recomputed, so that the converter's own checks are what answer."""
    from gspo_megatron.checkpoint import integrity
    from gspo_megatron.checkpoint.megatron_load import load_common_state_dict

    shutil.copytree(src, dst)
    common = load_common_state_dict(str(dst))
    edit(common["trainer"])
    torch.save(common, os.path.join(dst, "common.pt"))
    os.unlink(os.path.join(dst, integrity.CHECKSUM_FILE))
    integrity.record(str(dst))
    return str(dst)


@pytest.mark.timeout(600)
def test_bad_input_is_one_line(run, tmp_path, capsys):
    from converters.cli import main

    root, base, out, merged, _ = run
    ck = out / "checkpoints" / "iter_0000002"
    o = str(tmp_path / "o")
    both = ("lora-to-peft", "lora-merge")

    # a full-parameter checkpoint: converted, and a trainer's (no LoRA settings)
    assert main(["hf-to-mcore", "--hf-dir", str(base), "--out", str(tmp_path / "full"), "--no-progress"]) == 0
    full_trainer = _edited_checkpoint(ck, tmp_path / "full-trainer", lambda t: t.pop("lora"))
    for cmd in both:
        fails(capsys, [cmd, "--load", str(tmp_path / "full"), "--out", o], "not a LoRA adapter checkpoint",
              "mcore-to-hf")
        fails(capsys, [cmd, "--load", full_trainer, "--out", o], "full-parameter", "mcore-to-hf")

    # the base: recorded but gone, --base missing, another architecture
    gone = _edited_checkpoint(ck, tmp_path / "gone", lambda t: t["lora"].update(base={"path": str(tmp_path / "nope")}))
    other = tmp_path / "other"
    make_tiny_hf(other, family="glm4_moe", moe_intermediate_size=48)
    for cmd in both:
        fails(capsys, [cmd, "--load", gone, "--out", o], str(tmp_path / "nope"), "no such directory", "--base")
        fails(capsys, [cmd, "--load", str(ck), "--base", str(tmp_path / "nope2"), "--out", o],
              "--base", "no such directory")
        fails(capsys, [cmd, "--load", str(ck), "--base", str(other), "--out", o], "architecture differs",
              "moe_intermediate_size 32 -> 48")

    # a random-init base cannot be rebuilt exactly at world 1 (the module docstring of lora_export.py)
    rand = _edited_checkpoint(ck, tmp_path / "rand", lambda t: t["lora"].update(base={"init_seed": 1234}))
    fails(capsys, ["lora-merge", "--load", rand, "--out", o], "random-init base", "model.init_seed=1234",
          "<out_dir>/hf")

    # a corrupted data file: named, before anything is built or written
    flipped = tmp_path / "flipped"
    shutil.copytree(ck, flipped)
    data = bytearray((flipped / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (flipped / "__0_0.distcp").write_bytes(bytes(data))
    for cmd in both:
        fails(capsys, [cmd, "--load", str(flipped), "--out", o], "__0_0.distcp")

    # an existing --out: refused without --overwrite; --overwrite replaces only this command's output
    for cmd in both:
        fails(capsys, [cmd, "--load", str(ck), "--out", str(merged)], "already exists", "--overwrite")
    fails(capsys, ["lora-to-peft", "--load", str(ck), "--out", str(merged), "--overwrite"],
          "replaces only a previous lora-to-peft output")
    assert not os.path.exists(o)
