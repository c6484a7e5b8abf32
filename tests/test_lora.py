"""LoRA on MoE (issue 55), exact on every layout: the policy with adapters on attention (linear_qkv,
linear_proj) and on every routed expert (linear_fc1, linear_fc2) at TP1, TP2+SP, EP2, PP2, TP2xEP2, ETP2
and EP2xETP2 against a float64 reference written here from the paper's definition, W + (alpha / r) B A on
transformers' model of the same checkpoint (Megatron's fusions taken as the adapted model's: one A
for q/k/v, one per expert for gate/up; model/lora.py). Per layout: the per-token log-probs through
Megatron's schedules, and the gradient of the mean token NLL with respect to every adapter of every
rank (Megatron DDP + finalize_model_grads), against the reference's gradients mapped to that rank's
split by model/lora.py hf_to_local - the same function that loaded the adapters, so a wrong split
shows as wrong log-probs first. The base weights carry no gradient, and the weights a push sends
(model/export.py iter_hf_tensors of the adapted policy) are the reference's merged ones.
"""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import lora_leaves, lora_merged_params, make_tiny_hf, random_lora_adapters, random_sequences

RANK, ALPHA = 4, 8.0
LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-4  # fp32 trainer against float64, relative to the tensor's largest entry
LENGTHS = [5, 17, 9, 12, 3, 20]


def _reference(hf_dir: str, seqs, adapters: dict[str, torch.Tensor]):
    """float64: log-probs and the gradient of the mean token NLL with respect to each adapter
    tensor, of transformers' model whose every adapted weight is W + (alpha / r) B A."""
    from torch.func import functional_call
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    leaf = lora_leaves(adapters)
    params = lora_merged_params(model, leaf, ALPHA / RANK)
    merged = {}  # the merged weights under Hub names (experts one by one), what a merged push sends
    for name, w in params.items():
        w = w.detach().float()
        if name.endswith("mlp.experts.gate_up_proj"):
            for e in range(w.shape[0]):
                base = name[: -len("gate_up_proj")] + f"{e}."
                merged[base + "gate_proj.weight"], merged[base + "up_proj.weight"] = w[e].chunk(2, 0)
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(w.shape[0]):
                merged[name[: -len("down_proj")] + f"{e}.down_proj.weight"] = w[e]
        else:
            merged[name] = w
    lps = []
    for seq in seqs:
        logits = functional_call(model, params, (torch.tensor([seq]),)).logits[0]
        lps.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0])
    loss = -sum(x.sum() for x in lps) / sum(len(x) for x in lps)
    names = list(leaf)
    grads = torch.autograd.grad(loss, [leaf[k] for k in names])
    return [x.detach().float() for x in lps], {k: g.float() for k, g in zip(names, grads)}, merged


def _inject(bug: str, chunks) -> None:
    """A deliberate defect of the kind the field has shipped (issue 55), put in after the adapters:
    * shared_expert_adapter: one adapter for all of an EP rank's local experts (Megatron-Bridge's
      default with grouped GEMM; the model then changes with the EP degree);
    * row_partial_sum: a row-parallel adapter that takes its rank's A x as the whole sum (a
      partial sum ignored, on the dense TP split);
    * etp_partial_sum: at expert-TP > 1, the expert fc2 adapter's partial sum reduced and added on
      every expert-TP rank, which the token dispatcher then sums again (Megatron-Bridge#5634);
    * expert_grads_dp_group: routed-expert adapters reduced over the data-parallel group instead of
      the expert-data-parallel one (the ranks' different experts averaged together)."""
    from gspo_megatron.model import lora

    mods = list(lora.adapters(chunks))
    hooks = [(mod, h) for _, mod in mods for h in mod._forward_hooks.values() if isinstance(h, lora._Adapter)]
    if bug == "shared_expert_adapter":
        for chunk in chunks:
            for name, experts in chunk.named_modules():
                if name.endswith("mlp.experts") and hasattr(experts, "local_experts"):
                    first = experts.local_experts[0]
                    for e in experts.local_experts[1:]:
                        for fc in ("linear_fc1", "linear_fc2"):
                            getattr(e, fc).lora_A = getattr(first, fc).lora_A
                            getattr(e, fc).lora_B = getattr(first, fc).lora_B
    elif bug == "row_partial_sum":
        from megatron.core.tensor_parallel import mappings as m

        for module, hook in hooks:  # on the hook instances: the pooled rank processes outlive this test
            hook._row = (lambda u, module: m.scatter_to_sequence_parallel_region(u, group=module.tp_group)
                         if module.sequence_parallel else u)
    elif bug == "etp_partial_sum":  # Megatron-Bridge#5634: the reduced delta on every expert-TP rank
        from megatron.core.tensor_parallel import mappings as m

        for module, hook in hooks:
            if hook.expert and hook.kind == "row":
                hook._expert = (lambda x, a, b, module:
                                m.reduce_from_tensor_model_parallel_region(x @ a.t(), group=module.tp_group) @ b.t())
    elif bug == "expert_grads_dp_group":
        for _, module in mods:
            if module._lora["group"] == "experts":
                module.lora_A.allreduce = module.lora_B.allreduce = True
    else:
        raise ValueError(bug)


def _rank(rank, world, hf_dir, layout, seqs, adapters, ref_grads, bug=None):
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model import lora
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.scoring import score_sequences
    from test_megatron_parity import nll_backward

    par = ParallelConfig(**layout)
    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    try:
        chunks, tcfg = build_policy(ctx, arch, hf_dir=hf_dir)
        n = lora.apply_lora(chunks, lora.LoraSpec(rank=RANK, alpha=ALPHA, targets=("attention", "experts")),
                            ep_rank=ctx.ep_rank)
        if bug:
            _inject(bug, chunks)
        assert lora.load_hf_adapters(chunks, arch, adapters) == n
        trainable = [name for c in chunks for name, p in c.named_parameters() if p.requires_grad]
        assert trainable and all(".lora_" in name for name in trainable), trainable
        lps = score_sequences(chunks, ctx, seqs, vocab_size=arch.vocab_size, micro_batch_tokens=48)
        merged = dict(iter_hf_tensors(chunks, ctx, arch))  # rank 0: what a weight push sends
        exported = dict(lora.iter_hf_adapters(chunks, ctx, arch))  # rank 0: the PEFT export's tensors
        model = nll_backward(chunks, tcfg, ctx, par, arch, seqs)
        errs = {}
        for name, module in lora.adapters(chunks):
            want_a, want_b = lora.hf_to_local(module, arch, ref_grads)
            for p, want in ((module.lora_A, want_a), (module.lora_B, want_b)):
                got = p.main_grad.float()
                err = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
                key = f"{module._lora['key']}.{'A' if p is module.lora_A else 'B'}"
                errs[key] = err
        base_grads = [p.main_grad for c in model for name, p in c.named_parameters()
                      if ".lora_" not in name and getattr(p, "main_grad", None) is not None]
        return (lps, merged, exported) if rank == 0 else None, errs, n, len(base_grads)
    finally:
        destroy_parallel()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from megatron_utils import tiny_hf_config

    d = tmp_path_factory.mktemp("hf-lora")
    make_tiny_hf(d)
    seqs = random_sequences(300, LENGTHS)
    adapters = random_lora_adapters(tiny_hf_config(), RANK, seed=5)
    lps, grads, merged = _reference(str(d), seqs, adapters)
    return str(d), seqs, adapters, lps, grads, merged


LAYOUTS = [
    pytest.param(1, dict(), id="tp1"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), id="tp2-sp"),
    pytest.param(2, dict(ep=2), id="ep2"),
    pytest.param(2, dict(pp=2), id="pp2"),
    pytest.param(4, dict(tp=2, ep=2, sequence_parallel=True), id="tp2xep2"),
    pytest.param(2, dict(tp=2, etp=2, sequence_parallel=True), id="tp2-sp-etp2"),
    pytest.param(4, dict(tp=2, ep=2, etp=2, sequence_parallel=True), id="ep2xetp2"),
]


def _errors(out, ref_lps) -> tuple[float, dict]:
    lp_err = max(float((torch.as_tensor(a) - b).abs().max()) for a, b in zip(out[0][0][0], ref_lps))
    return lp_err, {k: v for r in out for k, v in r[1].items()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world,layout", LAYOUTS)
def test_lora_logprobs_and_adapter_grads_match_the_float64_merged_reference(reference, world, layout):
    hf_dir, seqs, adapters, ref_lps, ref_grads, ref_merged = reference
    out = run_distributed(_rank, world, hf_dir, layout, seqs, adapters, ref_grads, timeout=300)
    lp_err, errs = _errors(out, ref_lps)
    worst = max(errs, key=errs.get)
    print(f"{layout}: log-prob |err| max {lp_err:.2e}; adapter grad rel err max {errs[worst]:.2e} ({worst}); "
          f"{sum(r[2] for r in out)} adapters over {world} rank(s)")
    merged = out[0][0][1]
    assert sorted(merged) == sorted(ref_merged)  # every weight, no adapter tensor among them
    w_err = max(float((merged[k] - ref_merged[k]).abs().max()) for k in merged)
    print(f"  merged weights (the push's) |err| max {w_err:.2e} over {len(merged)} tensors")
    exported = out[0][0][2]
    assert sorted(exported) == sorted(adapters) and all(torch.equal(exported[k], adapters[k]) for k in adapters)
    assert lp_err <= LOGPROB_TOL
    assert errs[worst] <= GRAD_RTOL, worst
    assert w_err <= 1e-6
    assert all(r[3] == 0 for r in out)  # the frozen base has no gradient buffer


@pytest.mark.timeout(400)
@pytest.mark.parametrize("bug,world,layout", [
    pytest.param("shared_expert_adapter", 2, dict(ep=2), id="shared_expert_adapter-ep2"),
    pytest.param("row_partial_sum", 2, dict(tp=2, sequence_parallel=True), id="row_partial_sum-tp2-sp"),
    pytest.param("etp_partial_sum", 2, dict(tp=2, etp=2, sequence_parallel=True), id="etp_partial_sum-etp2"),
    pytest.param("expert_grads_dp_group", 2, dict(ep=2), id="expert_grads_dp_group-ep2"),
])
def test_three_deliberate_lora_bugs_are_caught(reference, bug, world, layout):
    """Each defect (_inject) breaks what the layout test asserts: the log-probs or an adapter's
    gradient leave their tolerance by orders of magnitude."""
    hf_dir, seqs, adapters, ref_lps, ref_grads, ref_merged = reference
    out = run_distributed(_rank, world, hf_dir, layout, seqs, adapters, ref_grads, bug, timeout=300)
    lp_err, errs = _errors(out, ref_lps)
    worst = max(errs, key=errs.get)
    print(f"{bug} at {layout}: log-prob |err| max {lp_err:.2e}; adapter grad rel err max {errs[worst]:.2e} ({worst})")
    assert lp_err > 100 * LOGPROB_TOL or errs[worst] > 100 * GRAD_RTOL


@pytest.mark.timeout(400)
def test_the_exported_adapter_loads_in_peft_and_gives_the_trainers_logprobs(reference, tmp_path):
    """The ecosystem reads it: the adapters exported from a TP2+SP x EP2 run (iter_hf_adapters ->
    save_peft: adapter_model.safetensors + adapter_config.json) loaded with the `peft` library onto
    transformers' model of the base checkpoint give the trainer's log-probs (<= 1e-4), and the
    merged export (what a push sends) loads as a plain transformers model that gives them too."""
    import json

    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from gspo_megatron.model import lora

    hf_dir, seqs, adapters, ref_lps, ref_grads, ref_merged = reference
    out = run_distributed(_rank, 4, hf_dir, dict(tp=2, ep=2, sequence_parallel=True), seqs, adapters, ref_grads,
                          timeout=300)
    trainer_lps, merged, exported = out[0][0]
    peft_dir = lora.save_peft(str(tmp_path / "adapter"), exported, lora.LoraSpec(rank=RANK, alpha=ALPHA),
                              base_model=hf_dir)
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, peft_dir).eval()
    with torch.no_grad():
        got = [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), -1)[:-1]
               .gather(-1, torch.tensor(s[1:])[:, None])[:, 0] for s in seqs]
    peft_err = max(float((g - torch.as_tensor(t)).abs().max()) for g, t in zip(got, trainer_lps))
    # the merged export as a checkpoint of its own: plain transformers, no adapter
    mdir = tmp_path / "merged"
    mdir.mkdir()
    (mdir / "config.json").write_text((__import__("pathlib").Path(hf_dir) / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in merged.items()}, str(mdir / "model.safetensors"))
    plain = AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()
    with torch.no_grad():
        got_m = [torch.log_softmax(plain(torch.tensor([s])).logits[0].float(), -1)[:-1]
                 .gather(-1, torch.tensor(s[1:])[:, None])[:, 0] for s in seqs]
    merged_err = max(float((g - torch.as_tensor(t)).abs().max()) for g, t in zip(got_m, trainer_lps))
    print(f"peft-loaded adapter vs trainer: |log-prob err| max {peft_err:.2e}; merged export vs trainer {merged_err:.2e}")
    assert peft_err <= 1e-4 and merged_err <= 1e-4
