"""MoE experts for the CPU spec: Megatron's ``SequentialMLP`` with its expert loop done as two
grouped GEMMs.

``SequentialMLP`` (megatron/core/transformer/moe/experts.py:820) runs every local expert's MLP one
after another: per expert two parallel-linear autograd functions, a split and the SwiGLU. For the
small models the CPU runtime trains (tests, ``make demo``, the trainer bench), that loop was most of
the MoE layer's cost: 8 experts x 2 layers made 2,048 linear calls per step, each more Python and
dispatch than arithmetic. :class:`CpuGroupedExperts` keeps ``SequentialMLP``'s parameters, state
dict and checkpoint layout (``local_experts.{i}.linear_fc{1,2}.weight``: the HF<->Megatron map, the
exporter and the checkpoints see no difference) and computes

    h = grouped_mm(x, stack(W1_i)^T);  a = silu(h[:, :F]) * h[:, F:] * probs;  y = grouped_mm(a, stack(W2_i)^T)

which is exactly ``MLP.forward``'s unfused path (mlp.py:155-245: linear_fc1, ``glu``, the
per-token scale, linear_fc2) for each expert's rows: equal results in float32 (the parity tests
compare the two), and the gradients reach each expert's weight through ``torch.stack`` and
Megatron DDP's per-parameter grad-accumulator hooks (distributed_data_parallel.py:343) as before.

It takes the grouped path only where that identity holds: expert TP of 1 (with etp > 1
linear_fc1/fc2 carry TP communication), no bias, gated SiLU without clamp or offset, no FP8/FP4,
probabilities applied after the activation, more than one local expert. Anything else runs
``SequentialMLP.forward`` unchanged. On GPU the Transformer Engine spec's ``TEGroupedMLP`` is used
instead; this class is only in the CPU (local) spec (model/spec.py ``layer_block_spec``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


class CpuGroupedExperts(SequentialMLP):
    """``SequentialMLP`` whose forward runs the local experts as two grouped GEMMs (see module doc)."""

    lora_adapted = False  # LoRA adapters on the experts' linears (model/lora.py): their hooks need the loop

    def grouped_path(self, hidden: torch.Tensor) -> bool:
        """Whether forward takes the grouped GEMMs (else SequentialMLP.forward)."""
        c = self.config
        return (
            not self.lora_adapted
            and self.num_local_experts > 1
            and self.tp_group.size() == 1
            and c.gated_linear_unit
            and c.activation_func is F.silu
            and not c.add_bias_linear
            and not (c.fp8 or c.fp4)
            and not c.moe_apply_probs_on_input
            and not c.use_te_activation_func
            and not c.bias_activation_fusion
            and c.activation_func_clamp_value is None
            and not c.glu_linear_offset
            and hidden.device.type == "cpu"
            and hidden.dtype in (torch.float32, torch.bfloat16)
        )

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        x = permuted_local_hidden_states
        if not self.grouped_path(x):
            return super().forward(x, tokens_per_expert, permuted_probs)
        offs = torch.cumsum(tokens_per_expert.to(torch.int64), 0).to(device=x.device, dtype=torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts]).transpose(1, 2)  # [E, H, 2F]
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts]).transpose(1, 2)  # [E, F, H]
        h = _grouped_mm(x, w1, offs)
        gate, lin = torch.chunk(h, 2, dim=-1)
        # (silu(gate) * lin) * probs, then back to the activation's dtype: MLP.forward's order
        # (mlp.py:219-235; the probabilities are float32)
        a = (F.silu(gate) * lin * permuted_probs.unsqueeze(-1)).to(h.dtype)
        return _grouped_mm(a, w2, offs), None
