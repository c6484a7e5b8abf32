"""A GPTModel whose last stage returns the final hidden states, for the fused log-prob path.

Megatron's ``GPTModel`` ends with ``output_layer`` (a ``ColumnParallelLinear``) and hands the
``[b, s, V/tp]`` logits shard to the loss. :func:`install_hidden_head` replaces that call, on one
model instance, with the tensor-parallel *region* the linear layer would have applied to its
input and nothing else:

* with sequence parallelism, ``gather_from_sequence_parallel_region`` (all-gather of the sequence
  shards forward, reduce-scatter backward);
* without it, ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward).

So the model returns ``[b, s, H]`` hidden states, identical on every TP rank, and
:func:`gspo_megatron.parallel.logprobs.fused_vocab_parallel_log_probs` turns them into token
log-probs with the weight shard from :func:`head_weight`: its hidden gradient is this rank's
partial sum, which the region's backward reduces over TP exactly as the linear layer's would.
Parameters, their names and checkpoints are unchanged; only the forward of that one module is.
"""
from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.utils import get_attr_wrapped_model

from .seq_reduce import group_size

_FLAG = "gspo_returns_hidden"


def install_hidden_head(chunk: torch.nn.Module, tp_group) -> None:
    """Make ``chunk`` (a GPTModel holding the last pipeline stage) return hidden states."""
    layer = getattr(chunk, "output_layer", None)
    if layer is None or not getattr(chunk, "post_process", False):
        raise ValueError("install_hidden_head: the chunk has no output layer (not the last stage)")
    sequence_parallel = bool(getattr(layer, "sequence_parallel", False))
    tp = group_size(tp_group)

    def forward(input_, weight=None, runtime_gather_output=None):
        if runtime_gather_output:
            raise ValueError("a model with the hidden head returns hidden states, not gathered logits")
        if sequence_parallel:
            return gather_from_sequence_parallel_region(input_, group=tp_group), None
        if tp > 1:
            return copy_to_tensor_model_parallel_region(input_, group=tp_group), None
        return input_, None

    layer.forward = forward
    setattr(layer, _FLAG, True)


def head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The output-layer weight shard ``[V/tp, H]`` of a (possibly DDP-wrapped) last-stage chunk
    whose hidden head is installed; None for an ordinary model (it returns logits)."""
    gpt = get_attr_wrapped_model(model, "output_layer", return_model_obj=True)
    if not getattr(gpt.output_layer, _FLAG, False):
        return None
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
