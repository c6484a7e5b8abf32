"""Typed configuration. Pure Python: validated before any process group exists."""
from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A configuration that cannot work; the message is one line naming the offending key."""


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron-Core parallel layout. dp is derived: world = tp * cp * pp * dp.

    Experts are carved out of the same ranks the way Megatron does it: per pipeline stage the
    tp*cp*dp ranks are re-divided into etp * ep * edp, so ep*etp must divide tp*cp*dp.
    """

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    # "auto": cuda when available, else cpu. Backend follows: nccl on cuda, gloo on cpu.
    device: str = "auto"

    def __post_init__(self):
        for k in ("tp", "pp", "ep", "etp", "cp"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{k} must be a positive integer, got {v!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"parallel.device must be auto|cpu|cuda, got {self.device!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")

    def dp(self, world_size: int) -> int:
        self.check_world(world_size)
        return world_size // (self.tp * self.cp * self.pp)

    def edp(self, world_size: int) -> int:
        return (world_size // self.pp) // (self.ep * self.etp)

    def check_world(self, world_size: int) -> None:
        mp = self.tp * self.cp * self.pp
        if world_size % mp:
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*cp*pp = "
                f"{self.tp}*{self.cp}*{self.pp} = {mp}"
            )
        per_stage = world_size // self.pp
        if per_stage % (self.ep * self.etp):
            raise ConfigError(
                f"parallel.ep*etp = {self.ep}*{self.etp} must divide the {per_stage} ranks of a "
                f"pipeline stage (world {world_size} / pp {self.pp})"
            )

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int,
        num_experts: int,
        moe_ffn_hidden_size: int | None = None,
        training: bool = True,
    ) -> None:
        if num_attention_heads % self.tp:
            raise ConfigError(f"parallel.tp={self.tp} does not divide num_attention_heads={num_attention_heads}")
        if num_query_groups % self.tp:
            raise ConfigError(
                f"parallel.tp={self.tp} does not divide num_key_value_heads={num_query_groups}"
            )
        if num_experts % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide num_experts={num_experts}")
        if moe_ffn_hidden_size is not None and moe_ffn_hidden_size % self.etp:
            raise ConfigError(
                f"parallel.etp={self.etp} does not divide moe_intermediate_size={moe_ffn_hidden_size}"
            )
        if num_layers % self.pp:
            raise ConfigError(f"parallel.pp={self.pp} does not divide num_hidden_layers={num_layers}")
        if training and num_experts > 0 and self.tp > 1 and not self.sequence_parallel:
            raise ConfigError(
                "MoE training with parallel.tp > 1 requires parallel.sequence_parallel=true "
                "(Megatron-Core's MoE layer assumes sequence-parallel activations under TP)"
            )

    def validate(self, world_size: int, **model_dims) -> None:
        self.check_world(world_size)
        if model_dims:
            self.check_model(**model_dims)
