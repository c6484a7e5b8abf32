"""The harness itself (tests/dist_utils.py, tests/testlib.py): what a pooled run reports when ranks
fail. A pooled run stands in for a torchrun launch, so a failing run must show what torchrun
shows: the output of every rank that failed, not only the first to report."""
from __future__ import annotations

import time

import pytest

from dist_utils import run_distributed
from testlib import _EXIT_MARK, pooled_exit


def _late_rank0(rank, world):
    # every rank fails; rank 0, which alone prints the error line (as the trainer does), last
    if rank == 0:
        time.sleep(1.0)
        raise ValueError("rank 0's own line")
    raise ValueError(f"rank {rank} failed first")


@pytest.mark.timeout(120)
def test_a_pooled_failure_carries_every_failing_rank_in_rank_order():
    """Failed on the first version of the pool: only the first rank to report (here rank 1) came
    back, so a trainer run whose error line only rank 0 prints lost it now and then."""
    with pytest.raises(RuntimeError) as e:
        run_distributed(_late_rank0, 2, timeout=60)
    text = str(e.value)
    assert "rank 0's own line" in text and "rank 1 failed first" in text, text
    assert text.index("rank 0:") < text.index("rank 1:"), text


def _hang_rank1(rank, world):
    import torch
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("rank 0 failed")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.all_reduce(torch.ones(1))  # waits for rank 0 forever: the grace ends it


@pytest.mark.timeout(120)
def test_a_rank_left_waiting_after_a_failure_ends_the_run_after_the_grace():
    # the run's own timeout would raise TimeoutError (an OSError): the grace ends it first
    with pytest.raises(RuntimeError) as e:
        run_distributed(_hang_rank1, 2, timeout=100)
    assert "rank 0 failed" in str(e.value) and "rank 1:" not in str(e.value)


def test_pooled_exit_reads_every_rank_lowest_status_first():
    import json

    def part(rank, rc, out, err):
        return f"rank {rank}:\nTraceback ...\ntestlib._RankExit: {_EXIT_MARK}{json.dumps([rank, rc, out, err])}\n"

    run = pooled_exit(part(1, 3, "o1\n", "e1 \"quoted\"\nsecond line\n") + part(0, 1, "o0\n", "error line\n"))
    assert (run.returncode, run.stdout, run.stderr) == (1, "o0\no1\n", "error line\ne1 \"quoted\"\nsecond line\n")
    assert pooled_exit("rank 0:\nValueError: boom") is None


def _pid(rank, world):
    import os

    return os.getpid()


def _clean_fail(rank, world):
    from testlib import CleanExit

    raise CleanExit(f"rank {rank} returned 1")


def _dirty_fail(rank, world):
    raise ValueError("mid-run")


@pytest.mark.timeout(120)
def test_a_run_every_rank_left_cleanly_keeps_the_pool_any_other_failure_replaces_it():
    before = run_distributed(_pid, 2)
    with pytest.raises(RuntimeError, match="returned 1"):
        run_distributed(_clean_fail, 2)
    assert run_distributed(_pid, 2) == before  # the trainer's non-zero exits: no restart (~7 s CPU)
    with pytest.raises(RuntimeError, match="mid-run"):
        run_distributed(_dirty_fail, 2)
    assert not set(run_distributed(_pid, 2)) & set(before)  # fresh processes
