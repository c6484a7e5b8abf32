"""The test harness itself (tests/dist_utils.py): a rendezvous port taken between picking and
binding it is retried, not reported as a test failure; other failures still are."""
from __future__ import annotations

import socket
import subprocess

import pytest

import dist_utils


def _rank_id(rank, world):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)  # env://, the port run_distributed picked
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    return rank, int(t)


def _rank_fails(rank, world):
    raise ValueError(f"rank {rank} fails on purpose")


@pytest.mark.timeout(240)
def test_run_distributed_retries_a_port_taken_before_rank0_binds_it(monkeypatch):
    held = socket.socket()
    held.bind(("0.0.0.0", 0))  # where the rendezvous listens (all addresses)
    held.listen()
    taken, real_free_port, picked = [held.getsockname()[1]], dist_utils.free_port, []

    def free_port():  # first the port someone else holds, then really free ones
        picked.append(taken.pop() if taken else real_free_port())
        return picked[-1]

    monkeypatch.setattr(dist_utils, "free_port", free_port)
    try:
        assert dist_utils.run_distributed(_rank_id, 2, timeout=120) == [(0, 3), (1, 3)]
    finally:
        held.close()
    assert len(picked) == 2 and picked[0] != picked[1]
    # any other failure is raised at once (no retry)
    picked.clear()
    with pytest.raises(RuntimeError, match="fails on purpose"):
        dist_utils.run_distributed(_rank_fails, 2, timeout=120)
    assert len(picked) == 1


def test_with_free_port_retries_only_collisions():
    seen = []

    def run(port):
        seen.append(port)
        if len(seen) == 1:
            return subprocess.CompletedProcess([], 1, "", "OSError: [Errno 98] Address already in use")
        return subprocess.CompletedProcess([], 0, "ok", "")

    ports = iter([5001, 5002, 5003])
    assert dist_utils.with_free_port(run, free=lambda: next(ports)).stdout == "ok"
    assert seen == [5001, 5002]
    failing = subprocess.CompletedProcess([], 2, "", "some other error")
    assert dist_utils.with_free_port(lambda p: failing, free=lambda: 5004) is failing  # returned, not retried
    with pytest.raises(ValueError, match="boom"):
        dist_utils.with_free_port(lambda p: (_ for _ in ()).throw(ValueError("boom")), free=lambda: 5005)
