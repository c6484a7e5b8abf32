"""CpuGroupedExperts (parallel/cpu_experts.py) against Megatron's own SequentialMLP.

Same weights, same permuted tokens (one expert with no token), same per-token probabilities: the
grouped-GEMM forward and every gradient (tokens, probabilities, each expert's two weights) equal
SequentialMLP's - to float32 rounding in float32, within bf16 rounding in bf16. A configuration the
grouped path does not cover (a clamp on the SwiGLU) runs SequentialMLP's forward itself, and the
CPU spec of the model uses the class."""
from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed

E, H, FFN = 4, 16, 8
COUNTS = [5, 0, 7, 3]  # expert 1 receives no token


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
                             moe_ffn_hidden_size=FFN, ffn_hidden_size=FFN, gated_linear_unit=True,
                             activation_func=torch.nn.functional.silu, add_bias_linear=False, **kw)


def _run(module, x, counts, probs, g):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    out, bias = module(x, torch.tensor(counts), probs)
    (out * g).sum().backward()
    grads = [x.grad, probs.grad] + [p.grad.clone() for p in module.parameters()]
    return out.detach(), bias, grads


def _rank(rank, world_size):
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.spec import layer_block_spec
    from gspo_megatron.parallel.cpu_experts import CpuGroupedExperts
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    init_parallel(ParallelConfig(device="cpu"))
    out = {}
    try:
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        sub = specs.get_gpt_layer_local_spec(num_experts=E, normalization="RMSNorm").submodules.mlp.submodules
        g_ = torch.Generator().manual_seed(0)
        n = sum(COUNTS)
        for dtype in (torch.float32, torch.bfloat16):
            for name, over in (("plain", {}), ("clamped", {"activation_func_clamp_value": 0.5})):
                cfg = _config(**over)
                ref = SequentialMLP(E, cfg, sub.experts.submodules, pg_collection=pgc).to(dtype)
                new = CpuGroupedExperts(E, cfg, sub.experts.submodules, pg_collection=pgc).to(dtype)
                with torch.no_grad():
                    for p in ref.parameters():
                        p.copy_(torch.randn(p.shape, generator=g_) * 0.5)
                new.load_state_dict(ref.state_dict())
                x = torch.randn(n, H, generator=g_).to(dtype)
                probs = torch.rand(n, generator=g_)  # the router's probabilities are float32
                g = torch.randn(n, H, generator=g_).to(dtype)
                out[f"{name}_{dtype}"] = (_run(ref, x, COUNTS, probs, g), _run(new, x, COUNTS, probs, g),
                                          new.grouped_path(x))
        cfg = _config()
        from gspo_megatron.model.registry import DEFAULT_MODEL_TYPE, family_of_type

        spec = layer_block_spec(family_of_type(DEFAULT_MODEL_TYPE), cfg, use_te=False)
        out["spec_experts"] = spec.layer_specs[0].submodules.mlp.submodules.experts.module
        out["state_keys"] = (sorted(SequentialMLP(E, cfg, sub.experts.submodules, pg_collection=pgc).state_dict()),
                             sorted(CpuGroupedExperts(E, cfg, sub.experts.submodules, pg_collection=pgc).state_dict()))
    finally:
        destroy_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_rank, 1, timeout=150)[0]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_sequential_mlp(results, dtype):
    (want, want_bias, want_grads), (got, got_bias, got_grads), grouped = results[f"plain_{dtype}"]
    assert grouped  # the grouped GEMMs ran
    assert want_bias is None and got_bias is None
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    assert len(got_grads) == len(want_grads) == 2 + 2 * E
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol, msg=f"gradient {i}")
    # the expert without tokens gets a zero gradient, not a missing one
    assert torch.count_nonzero(got_grads[2 + 2]) == 0 and torch.count_nonzero(got_grads[2 + 3]) == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uncovered_config_runs_sequential_mlp(results, dtype):
    (want, _, want_grads), (got, _, got_grads), grouped = results[f"clamped_{dtype}"]
    assert not grouped
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.timeout(180)
def test_cpu_spec_uses_it_with_sequential_mlp_state_dict(results):
    from gspo_megatron.parallel.cpu_experts import CpuGroupedExperts

    assert results["spec_experts"] is CpuGroupedExperts
    ref_keys, new_keys = results["state_keys"]
    assert ref_keys == new_keys and "local_experts.0.linear_fc1.weight" in new_keys
