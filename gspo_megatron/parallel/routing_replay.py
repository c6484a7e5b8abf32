"""Routing replay for MoE layers through Megatron-Core's own RouterReplay
(megatron/core/transformer/moe/router_replay.py, 0.16.1): record each router's top-k in one pass
and force it in another, or force the experts the rollout engine chose.

Layouts. Routing travels with a microbatch in the *model layout* (train/batch.py): an int
tensor [b, s, num_layers, top_k] over this CP rank's positions (-1 where nobody routed the
position: padding, fillers, a sequence's last token). A router sees this rank's tokens of its
own layer in Megatron's token order: the MoE layer gets hidden states [s, b, h], split along s
over the TP group under sequence parallelism, and the router flattens them to [s * b, h]
(router.py: ``logits.view(-1, num_experts)``) - so `to_router_layout` transposes, keeps this TP
rank's sequence slice and flattens. Pipeline stages hold their own layers (routers are keyed by
the global layer number), expert parallelism routes before dispatch (every rank routes its own
tokens), and CP ranks hold their own zigzag chunks already in the model layout.

Megatron's replay computes the probabilities of the forced experts from the router's scores
(``scores.gather(1, indices)``), so gradients flow through the router as usual.

Recompute: with train.recompute=full a layer's forward runs again in backward. In the
non-pipelined schedule a microbatch's backward follows its forward, so the forced indices are
still those of the microbatch; with pipeline stages 1F1B interleaves microbatches and Megatron's
REPLAY_BACKWARD queue would be needed: that combination is refused in config.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def moe_routers(model) -> list[tuple[int, object]]:
    """(global 0-based layer index, RouterReplay) of every MoE layer in a model chunk (DDP-wrapped
    or not), in layer order. Empty when the model was built without routing replay."""
    out = []
    for name, module in model.named_modules():
        replay = getattr(module, "router_replay", None)
        if replay is not None and hasattr(module, "layer_number"):
            out.append((int(module.layer_number) - 1, replay))
    return sorted(out, key=lambda x: x[0])


def to_router_layout(ctx, t: torch.Tensor) -> torch.Tensor:
    """Model layout [b, s, ...] -> this rank's router token order [s_local * b, ...]."""
    t = t.transpose(0, 1)
    tp = ctx.parallel.tp
    if tp > 1 and ctx.parallel.sequence_parallel:
        n = t.shape[0] // tp
        t = t[ctx.tp_rank * n:(ctx.tp_rank + 1) * n]
    return t.reshape(-1, *t.shape[2:])


def _fill_unknown(idx: torch.Tensor) -> torch.Tensor:
    """Positions nobody routed (-1) get experts 0..k-1: they are padding or a last token, whose
    outputs no loss reads (causal attention, separate packed segments)."""
    k = idx.shape[-1]
    default = torch.arange(k, device=idx.device, dtype=idx.dtype).expand_as(idx)
    return torch.where(idx[..., :1] >= 0, idx, default)


@dataclass
class RoutingPass:
    """Per-microbatch control of the routers for one schedule pass.

    mode: "record"  - route as usual and keep each layer's top-k on the microbatch (R2's π_old pass)
          "rollout" - force the engine's experts (mb.routing; R3)
          "recorded"- force what a "record" pass kept on the microbatch (R2's update passes)
          "off"     - route as usual
    With engine routing on the microbatch, "record" and "rollout" also count how many token x
    layer top-k sets the trainer used equal the engine's (routing_agreement)."""

    ctx: object
    mode: str
    top_k: int
    agree: int = 0
    total: int = 0
    _routers: dict = field(default_factory=dict)

    def _of(self, model):
        key = id(model)
        if key not in self._routers:
            self._routers[key] = moe_routers(model)
        return self._routers[key]

    def before(self, mb, model) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        routers = self._of(model)
        if self.mode == "off" or not routers:
            return
        if self.mode == "record":
            for _, r in routers:
                r.clear_indices()
                r.set_router_replay_action(RouterReplayAction.RECORD)
            return
        for layer, r in routers:
            r.clear_indices()  # Megatron appends every target to a backward queue: keep it at one
            r.set_target_indices(self._target(mb, layer))
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _target(self, mb, layer: int) -> torch.Tensor:
        if self.mode == "recorded":
            recorded = mb.extras.get("routing_recorded", {})
            if layer not in recorded:
                raise RuntimeError(f"routing replay: no recorded routing for layer {layer} on this microbatch "
                                   "(the π_old pass records it: loss.old_logprobs=recompute)")
            return recorded[layer]
        if mb.routing is None:
            if mb.num_sequences:
                raise RuntimeError("routing_replay=rollout: the samples carry no routed experts from the engine")
            # a filler microbatch (another DP rank's share of the step): any valid experts
            empty = torch.full((*mb.tokens.shape, self.top_k), -1, dtype=torch.long, device=mb.tokens.device)
            return _fill_unknown(to_router_layout(self.ctx, empty))
        return _fill_unknown(to_router_layout(self.ctx, mb.routing[:, :, layer])).long()

    def after(self, mb, model) -> None:
        routers = self._of(model)
        if self.mode == "off" or not routers:
            return
        counts = self.ctx.parallel.sequence_parallel or self.ctx.tp_rank == 0  # TP ranks see the same tokens
        for layer, r in routers:
            used = r.get_recorded_indices() if self.mode == "record" else r.target_topk_idx
            if self.mode == "record":
                mb.extras.setdefault("routing_recorded", {})[layer] = used.detach().clone()
            if mb.routing is not None and counts:
                engine = to_router_layout(self.ctx, mb.routing[:, :, layer]).to(used.device)
                known = engine[:, 0] >= 0
                same = (torch.sort(engine.long(), -1).values == torch.sort(used.long(), -1).values).all(-1)
                self.agree += int((same & known).sum())
                self.total += int(known.sum())

    def close(self, chunks) -> None:
        """Routers back to normal routing, replay state dropped."""
        for chunk in chunks:
            for _, r in self._of(chunk):
                r.clear_router_replay_action()
                r.clear_indices()
