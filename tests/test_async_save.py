"""Background checkpoint writes (checkpoint.async_save=true, train/async_save.py), against the
synchronous save of the same run as the reference: 2 processes, DP2 with the distributed
optimizer, a constant LR (so a run stopped early and resumed is the same run).

A write is caught in flight by construction: tests/async_save_hold.py holds the background writer
of one iteration after its directory is renamed into place and before its checksums and the
tracker, until the test says so (no sleep races the write)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from gspo_megatron.train.metrics import wall_clock

from megatron_utils import dcp_tensors
from test_train_loop import DP2_DISTOPT, REPO, TINY, _descendants, _env, _hf_tensors, run_train

BASE = ["train.max_steps=6", "train.sft_warmup_steps=0", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "checkpoint.interval=2", "checkpoint.keep_last=0", "checkpoint.export_hf=true", "logging.progress_bar=false",
        "logging.plot=false", "optimizer.lr_decay_style=constant", *DP2_DISTOPT]
ASYNC = "checkpoint.async_save=true"
HOLD = os.path.join(os.path.dirname(__file__), "async_save_hold.py")


def rows(out_dir) -> list[dict]:
    """metrics.jsonl's GSPO rows without the timings."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in r.items() if not wall_clock(k)}
                for r in map(json.loads, f) if r.get("phase") == "gspo"]


def tracker(out_dir) -> str:
    return (out_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The synchronous run every async run is compared with."""
    out = tmp_path_factory.mktemp("sync")
    run_train(out, *BASE)
    return out


def start_held(out_dir, hold_dir, iteration: str, *overrides: str) -> tuple[subprocess.Popen, object]:
    """A 2-process async run whose background write of `iteration` is held; (process, stderr file)."""
    os.makedirs(hold_dir, exist_ok=True)
    env = dict(_env(), HOLD_DIR=str(hold_dir), HOLD_ITER=iteration)
    err = open(os.path.join(hold_dir, "stderr.txt"), "w+")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", HOLD,
           "--config", TINY, f"out_dir={out_dir}", *BASE, ASYNC, *overrides]
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                            start_new_session=True), err


def wait_for(cond, proc: subprocess.Popen, err, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc.poll() is not None:
            err.seek(0)
            pytest.fail(f"the run exited ({proc.returncode}) before {what}:\n{err.read()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.05)


def kill9(proc: subprocess.Popen) -> None:
    for pid in _descendants(proc.pid) + [proc.pid]:  # torchrun's workers have process groups of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


@pytest.mark.timeout(900)
def test_kill9_during_a_background_write_resumes_from_the_tracked_checkpoint_bit_identically(reference, tmp_path):
    """kill -9 while iter_4 is being written in the background (its directory renamed into place,
    neither checksummed nor tracked): resume=auto continues from iter_2, the tracked one, and the
    run ends bit-identical to the synchronous run (weights, Adam moments, every logged metric).
    iter_2, written in the background before the kill, holds exactly the synchronous run's tensors."""
    out, hold = tmp_path / "run", tmp_path / "hold"
    proc, err = start_held(out, hold, "iter_0000004")
    try:
        wait_for(lambda: all((hold / f"reached.{r}").exists() for r in (0, 1)), proc, err, "the held write of iter_4")
        ck = out / "checkpoints"
        # the state under test: iter_4 in place but not complete, the tracker still at iter_2
        assert (ck / "iter_0000004" / "metadata.json").exists() and not (ck / "iter_0000004" / "checksums.json").exists()
        assert tracker(out) == "2"
    finally:
        kill9(proc)
        err.close()

    a, b = dcp_tensors(reference / "checkpoints" / "iter_0000002"), dcp_tensors(ck / "iter_0000002")
    assert set(a) == set(b) and any(".exp_avg" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    sync_common = torch.load(reference / "checkpoints" / "iter_0000002" / "common.pt", weights_only=True)
    async_common = torch.load(ck / "iter_0000002" / "common.pt", weights_only=True)
    assert sync_common["trainer"] == async_common["trainer"]

    r = run_train(out, *BASE, ASYNC)
    assert f"resumed from {ck / 'iter_0000002'} at step 2" in r.stderr, r.stderr[-3000:]
    assert rows(out) == rows(reference)
    ha, hb = _hf_tensors(reference / "hf"), _hf_tensors(out / "hf")
    assert set(ha) == set(hb) and all(torch.equal(ha[k], hb[k]) for k in ha)
    final = "checkpoints/iter_0000006"
    ma, mb = dcp_tensors(reference / final, "optimizer.state."), dcp_tensors(out / final, "optimizer.state.")
    assert set(ma) == set(mb) and all(torch.equal(ma[k], mb[k]) for k in ma)
    assert tracker(out) == "6" and all((ck / f"iter_{s:07d}" / "checksums.json").exists() for s in (2, 4, 6))


@pytest.mark.timeout(900)
def test_stopped_after_step_3_and_resumed_to_step_5_logs_what_the_uninterrupted_run_logs(reference, tmp_path):
    """An async run of 3 steps (its last checkpoint written in the background and waited for at
    the end), resumed to step 5: rewards, losses and every other metric of steps 1-5 are the
    uninterrupted synchronous run's."""
    out = tmp_path / "run"
    r = run_train(out, *BASE, ASYNC, "train.max_steps=3")
    assert "waiting for the background write of iter_0000003 at the end of the run" in r.stderr, r.stderr[-3000:]
    assert tracker(out) == "3"
    run_train(out, *BASE, ASYNC, "train.max_steps=5")
    assert [x["step"] for x in rows(out)] == [1, 2, 3, 4, 5]
    assert rows(out) == rows(reference)[:5]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("when", ["at_the_hold", "while_step_6_waits"])
def test_sigterm_waits_for_the_background_write_in_flight(tmp_path, when):
    """SIGTERM (through torchrun, as on a cluster) while iter_4's background write is held: the run
    saves the step in progress after waiting for iter_4, and exits only once that checkpoint is
    written and tracked. The hold is released only after the trainer says it got the signal and
    waits, so a run that exited without waiting would leave iter_4 untracked and its own
    checkpoint unwritten.

    Which step is in progress is up to the machine: training goes on past step 4 while iter_4 is
    held, until step 6's save must wait for it (one write in flight). torchrun forwards the signal
    whenever it gets to it, so the run saves step 4, 5 or 6 (a loaded CI machine saw 6) -- never
    later, because the signal is known before the release and step 6 cannot finish before it.
    The run is 8 steps long, so that step 6's save is an interval save followed by a preemption
    point (in a 6-step run a signal landing in the final save just lets the run end normally,
    which another loaded CI machine did). `when`: the signal as soon as the write is held (any of
    steps 4-6), or only once step 6's save says it waits for iter_4 (step 6, by construction)."""
    out, hold = tmp_path / "run", tmp_path / "hold"
    proc, err = start_held(out, hold, "iter_0000004", "train.max_steps=8")
    try:
        wait_for(lambda: all((hold / f"reached.{r}").exists() for r in (0, 1)), proc, err, "the held write of iter_4")

        def said(*what: str) -> bool:
            err.seek(0)
            text = err.read()
            return all(w in text for w in what)

        if when == "while_step_6_waits":
            wait_for(lambda: said("waiting for the background write of iter_0000004"), proc, err, "step 6's save waiting")
        proc.send_signal(signal.SIGTERM)

        def says_it_got_the_signal_and_waits() -> bool:
            return said("SIGTERM received", "waiting for the background write of iter_0000004")

        wait_for(says_it_got_the_signal_and_waits, proc, err, "the trainer receiving SIGTERM and waiting for iter_4")
        (hold / "release").touch()
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            kill9(proc)
        err.seek(0)
        log = err.read()
        err.close()
    assert proc.returncode != 0, log[-3000:]
    import re

    m = re.search(r"saved the step-(\d+) checkpoint after SIGTERM", log)
    assert m, log[-3000:]
    step = int(m.group(1))
    assert (4 <= step <= 6 if when == "at_the_hold" else step == 6) and tracker(out) == str(step)
    ck = out / "checkpoints"
    assert all((ck / f"iter_{s:07d}" / "checksums.json").exists() for s in sorted({2, 4, step}))
    r = run_train(out, *BASE, ASYNC, "train.max_steps=8")
    assert f"resumed from {ck / f'iter_{step:07d}'} at step {step}" in r.stderr


def test_the_writer_thread_makes_the_ranks_device_current_before_writing(monkeypatch):
    """Issue 52: a new thread starts on CUDA device 0, and DCP's writer synchronises the thread's
    current stream, so every rank's background writer created a context on GPU 0. The writer now
    calls torch.cuda.set_device(the rank's device) first, in its own thread. The CUDA call is
    recorded here (no GPU): the branch a GPU run takes, run on CPU; `make gpu-check` runs it on a
    GPU (bench/gpu_check.py)."""
    import threading

    import torch

    from gspo_megatron.train.async_save import BackgroundSaves

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d, threading.get_ident())))
    saves = BackgroundSaves(ops=None, device=torch.device("cuda", 3))
    saves.submit("iter_1", lambda: calls.append(("write", None, threading.get_ident())))
    saves.wait()
    assert [c[0] for c in calls] == ["set_device", "write"], calls
    assert calls[0][1] == torch.device("cuda", 3) and calls[0][2] == calls[1][2] != threading.get_ident()
    calls.clear()
    cpu = BackgroundSaves(ops=None, device=torch.device("cpu"))
    cpu.submit("iter_2", lambda: calls.append(("write", None, 0)))
    cpu.wait()
    assert [c[0] for c in calls] == ["write"]


def test_a_background_snapshot_is_one_allocation_pinned_once_exactly_its_bytes(monkeypatch):
    """Issue 52: on CUDA the snapshot took one `torch.empty(pin_memory=True)` per chunk, each
    rounded up to a power of two by torch's caching host allocator and kept for the run (about
    290 GB page-locked per 8-GPU node for the 235B preset). Now (train/async_save.py HostSnapshot):
    one allocation for the whole snapshot, chunks at 64-byte aligned offsets, page-locked once with
    exactly its bytes (cudaHostRegister: recorded here through a stand-in cudart, no GPU), reused by
    every save of the same layout, unpinned before a new layout or the run's end. The snapshot
    holds copies: what the next steps write into the parameters does not reach it."""
    from gspo_megatron.checkpoint.dcp_io import Chunk
    from gspo_megatron.train import async_save
    from gspo_megatron.train.checkpoint import _snapshot

    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    saves = async_save.BackgroundSaves(ops=None, device=torch.device("cuda", 0))
    assert async_save.BackgroundSaves(ops=None, device=torch.device("cpu")).host._pin is None  # CPU: nothing pinned
    g = torch.Generator().manual_seed(0)
    sources = [torch.randn(300, 257, generator=g), torch.randn(1001, generator=g).to(torch.bfloat16),
               torch.randint(0, 9, (3,), generator=g), torch.randn(64, 33, generator=g).double(), torch.zeros(0)]
    chunks = [Chunk(f"t{i}", tuple(t.shape), (0,) * t.dim(), tuple(t.shape), t.dtype, (lambda t=t: t))
              for i, t in enumerate(sources)]
    exact = sum(c.nbytes for c in chunks)
    cpu = torch.device("cpu")  # the copies themselves: CPU tensors here
    first, state = _snapshot(chunks, {"step": 3}, cpu, saves.host)
    assert state == {"step": 3}
    assert len([c for c in calls if c[0] == "register"]) == 1, calls
    (_, ptr, size), = calls
    assert ptr == saves.host.flat.data_ptr() and size == saves.host.pinned_bytes
    assert exact <= size <= exact + 63 * len(chunks) and size <= 1.05 * exact, (size, exact)
    for c, src in zip(first, sources):
        got = c.produce()
        assert got.dtype == src.dtype and got.shape == src.shape and torch.equal(got, src)
        assert got.data_ptr() % 64 == 0 or got.numel() == 0
    for t in sources:  # the next steps overwrite the parameters: the snapshot keeps what was saved
        t.zero_() if t.dtype != torch.int64 else t.fill_(7)
    assert not torch.equal(first[0].produce(), sources[0])
    second, _ = _snapshot(chunks, {"step": 4}, cpu, saves.host)  # same layout: same memory, nothing pinned again
    assert saves.host.allocations == 1 and len(calls) == 1
    assert [c.produce().data_ptr() for c in second] == [c.produce().data_ptr() for c in first]
    assert all(torch.equal(c.produce(), s) for c, s in zip(second, sources))
    bigger = chunks + [Chunk("t9", (5,), (0,), (5,), torch.float32, lambda: torch.ones(5))]
    _snapshot(bigger, {}, cpu, saves.host)  # a new layout: the old memory unpinned first, the new pinned once
    assert [c[0] for c in calls] == ["register", "unregister", "register"] and calls[1][1] == ptr, calls
    saves.host.release()  # the run's end (train/setup.py close)
    assert [c[0] for c in calls][-1] == "unregister" and saves.host.pinned_bytes == 0
