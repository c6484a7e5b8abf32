"""A step's samples from rank 0 to the ranks that train on them, as tensors.

Rank 0 generates and scores every sample; each data-parallel (DP) rank trains on its own share
(train/batch.py plans which, from every sample's length). The samples travel as
  1. a header: a small int64 matrix (one row per sample: lengths, owning DP rank, field sizes) that
     every rank receives (world broadcast; planning needs every sample's length on every rank),
     preceded by its shape and the byte size of each DP rank's share (one int64 vector);
  2. one byte buffer per DP rank (train/batch.py encode_shares): scattered from rank 0 over the DP
     group of rank 0 to the DP "leaders" (tp = cp = pp = 0), padded to the largest share (a
     scatter's parts are equal);
  3. then within each DP rank's replica, in three hops: over the CP group (the tp = pp = 0
     ranks), over the PP group (the tp = 0 ranks), over the TP group (every rank). Each hop's
     source is the group's member at coordinate 0 of that group's axis, which holds the share
     after the previous hop.
So a rank receives the header and its own DP rank's share, nothing of another DP rank's samples.

The groups are Megatron's (ParallelContext), passed explicitly. The sources are chosen by global
rank from every rank's (dp, tp, cp, pp) coordinates, gathered once when the DataPlane is built,
which also checks that each group used stays inside one DP replica: no assumption about how
Megatron orders the ranks of a group.

Collective tensors live on ctx.device (NCCL takes CUDA tensors only; gloo CPU ones); what
`exchange` returns is on the CPU, where train/batch.py builds microbatches (MicroBatch.to_ moves
them to the device in the forward step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# columns of the coordinates table
DP, TP, CP, PP = range(4)


@dataclass
class Traffic:
    """What this rank's collectives of the data plane moved, in bytes of tensor payload.
    `received`: bytes this rank received (as a non-source member of a broadcast or scatter);
    `sent`: bytes it handed to others as a source (counted once per receiving rank: what the
    receivers get, whatever tree or ring the backend uses)."""

    received: int = 0
    sent: int = 0
    collectives: int = 0


class DataPlane:
    """Built once per run by every rank (collective: one all-gather of coordinates), then
    `exchange` once per batch of samples (collective, every rank)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.device = ctx.device
        self.traffic = Traffic()
        coords = self._coordinates()
        me = coords[ctx.rank]
        self.leader = me[TP] == 0 and me[CP] == 0 and me[PP] == 0
        problems: list[str] = []
        # rank 0's DP group: the leaders; share d goes to the member whose DP rank is d, in the
        # group's rank order (a scatter's parts are ordered by group rank)
        self.scatter_order: list[int] = []
        if self.leader and ctx.dp > 1:
            members = dist.get_process_group_ranks(ctx.dp_group)
            self.scatter_order = [coords[g][DP] for g in members]
            if 0 not in members or sorted(self.scatter_order) != list(range(ctx.dp)) \
                    or any(coords[g][TP] or coords[g][CP] or coords[g][PP] for g in members):
                problems.append(f"the DP group of a leader {members} is not rank 0's DP leaders "
                                f"(coordinates {[coords[g] for g in members]})")
        # the replica hops this rank takes part in: (name, group, source's global rank, members)
        self.hops: list[tuple[str, object, int, int]] = []
        for name, group, axis, takes_part in (("cp", ctx.cp_group, CP, me[TP] == 0 and me[PP] == 0),
                                              ("pp", ctx.pp_group, PP, me[TP] == 0),
                                              ("tp", ctx.tp_group, TP, True)):
            if not takes_part:
                continue
            members = dist.get_process_group_ranks(group)
            if len(members) == 1:
                continue
            # every member shares this rank's coordinates but the hop's axis: the same DP rank
            # (no other DP rank's content) and the same stage of the hops before
            strangers = [g for g in members if any(coords[g][a] != me[a] for a in (DP, TP, CP, PP) if a != axis)]
            sources = [g for g in members if coords[g][axis] == 0]
            if strangers or len(sources) != 1:
                problems.append(f"{name} group {members} of rank {ctx.rank}: members outside this replica "
                                f"{strangers} or not one source {sources}")
                continue
            self.hops.append((name, group, sources[0], len(members)))
        # every rank raises together (a lone failure would leave the others waiting in exchange)
        ok = torch.tensor([0 if problems else 1], dtype=torch.int64, device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if problems or not int(ok):
            raise RuntimeError("data plane: " + ("; ".join(problems) or "another rank's process groups are "
                                                 "not the layout this rank expects (see its error)"))

    def _coordinates(self) -> list[list[int]]:
        c = self.ctx
        mine = torch.tensor([c.dp_rank, c.tp_rank, c.cp_rank, c.pp_rank], dtype=torch.int64, device=self.device)
        everyone = [torch.empty_like(mine) for _ in range(c.world_size)]
        dist.all_gather(everyone, mine)
        return [t.tolist() for t in everyone]

    def _broadcast(self, t: torch.Tensor, src: int, group=None, members: int | None = None) -> torch.Tensor:
        members = members if members is not None else self.ctx.world_size
        if members > 1 and t.numel():
            dist.broadcast(t, src=src, group=group)
            self.traffic.collectives += 1
            if self.ctx.rank == src:
                self.traffic.sent += t.nbytes * (members - 1)
            else:
                self.traffic.received += t.nbytes
        return t

    def abort(self) -> None:
        """Rank 0, instead of `exchange`, when it has nothing to send (its samples could not be
        encoded): every other rank's `exchange` raises instead of waiting for them."""
        self.exchange()

    def exchange(self, header: torch.Tensor | None = None, shares: list[torch.Tensor] | None = None,
                 sizes: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Collective. Rank 0 passes `header` (int64 [n, k]), `shares` (one uint8 tensor per DP
        rank, at least `sizes[d]` bytes each; equal lengths avoid a padding copy) and `sizes`;
        every rank gets (header, its DP rank's share: uint8 [sizes[dp_rank]]), both on the CPU.
        Rank 0 passing nothing (abort) makes every other rank raise."""
        c = self.ctx
        dp = c.dp
        meta = torch.zeros(4 + dp, dtype=torch.int64)
        if c.rank == 0 and header is not None:
            if len(shares) != dp or len(sizes) != dp:
                raise ValueError(f"data plane: {len(shares)} shares / {len(sizes)} sizes for {dp} DP ranks")
            meta[1:3] = torch.tensor(header.shape)
            meta[3] = max(sizes, default=0)
            meta[4:] = torch.tensor(sizes, dtype=torch.int64)
        elif c.rank == 0:
            meta[0] = 1
        meta = self._broadcast(meta.to(self.device), 0).cpu()
        if int(meta[0]):
            if c.rank == 0:
                return None
            raise RuntimeError("data plane: rank 0 could not send this batch's samples (its own error says why)")
        rows, cols, width = (int(v) for v in meta[1:4])
        sizes = meta[4:].tolist()
        mine = sizes[c.dp_rank]
        hdr = header.to(self.device) if c.rank == 0 else torch.empty(rows, cols, dtype=torch.int64,
                                                                        device=self.device)
        hdr = self._broadcast(hdr, 0).cpu()
        buf = None
        if self.leader and width:
            buf = self._scatter(shares, sizes, width)
        for _name, group, src, members in self.hops:
            if not mine:
                break  # (every member of a hop group is of the same DP rank: all skip alike)
            if c.rank != src:
                buf = torch.empty(mine, dtype=torch.uint8, device=self.device)
            self._broadcast(buf[:mine], src, group, members)
        share = buf[:mine].cpu() if buf is not None else torch.empty(0, dtype=torch.uint8)
        return hdr, share

    def _scatter(self, shares, sizes, width: int) -> torch.Tensor:
        """Rank 0's DP group (the leaders): share d to DP rank d, each padded to `width` bytes."""
        c = self.ctx
        if c.dp == 1:
            return shares[0].to(self.device)
        out = torch.empty(width, dtype=torch.uint8, device=self.device)
        parts = None
        if c.rank == 0:
            parts = []
            for d in self.scatter_order:
                s = shares[d][:width]
                if s.numel() < width:  # pad to the scatter's common size
                    s = torch.cat([s, torch.zeros(width - s.numel(), dtype=torch.uint8)])
                parts.append(s.to(self.device))
            self.traffic.sent += width * (c.dp - 1)
        else:
            self.traffic.received += width
        dist.scatter(out, parts, src=0, group=c.dp_group)
        self.traffic.collectives += 1
        return out
