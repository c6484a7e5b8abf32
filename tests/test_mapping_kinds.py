"""Every tensor kind of the HF <-> Megatron map (model/mapping.py Kind) shards and unshards as the
Megatron layer that holds it splits its weight, for every kind and several TP sizes and shapes:
the reference is the layer's own definition (a column-parallel linear keeps a block of output rows,
a row-parallel one a block of input columns, the gated fc1 the same block of gate and of up rows),
written out here with index arithmetic rather than torch.chunk."""
from __future__ import annotations

import pytest
import torch

from gspo_megatron.model import mapping
from gspo_megatron.model.mapping import Kind, Rule


def _reference_shard(kind: Kind, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if kind is Kind.REPLICATED:
        return full
    if kind in (Kind.EXPERT_FC1, Kind.DENSE_FC1):  # [gate; up]: rows [r*n, (r+1)*n) of each half
        half = full.shape[0] // 2
        n = half // size
        rows = list(range(rank * n, (rank + 1) * n)) + list(range(half + rank * n, half + (rank + 1) * n))
        return full[rows]
    if kind in (Kind.ROW, Kind.EXPERT_FC2):  # input columns
        n = full.shape[1] // size
        return full[:, rank * n:(rank + 1) * n]
    n = full.shape[0] // size  # VOCAB, QKV (whole query groups), COLUMN: output rows
    return full[rank * n:(rank + 1) * n]


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.value)
@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("shape", [(8, 4), (16, 12), (24, 8)])
def test_every_kind_shards_as_its_layer_and_unshards_back(kind, size, shape):
    rule = Rule("decoder.layers.{layer}.x.weight", ("model.layers.{layer}.x.weight",), kind)
    full = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape)
    pieces = [mapping.shard(rule, full, r, size) for r in range(size)]
    for r, p in enumerate(pieces):
        assert torch.equal(p, _reference_shard(kind, full, r, size)), (kind, size, r)
    back = mapping.unshard(rule, pieces)
    assert torch.equal(back, full)
    if mapping.split_dim(kind) is None:
        assert all(p is full for p in pieces)


def test_a_column_split_that_does_not_divide_is_one_line():
    rule = Rule("decoder.layers.{layer}.x.weight", ("model.layers.{layer}.x.weight",), Kind.COLUMN)
    with pytest.raises(mapping.MappingError, match="does not split into 4"):
        mapping.shard(rule, torch.zeros(6, 2), 0, 4)
