"""Nothing lost: what a resume does when the checkpoint directory is not what the run left there
(tracker deleted or stale, corrupted files, a changed architecture). One single-process trainer
run (TP1) with a checkpoint every step is made once; each test works on a copy of it."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from gspo_megatron.train.metrics import wall_clock
from run_output import explain
from testlib import train_pooled

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
BASE = ["parallel.tp=1", "parallel.sequence_parallel=false", "train.sft_warmup_steps=2",
        "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "checkpoint.interval=1",
        "checkpoint.keep_last=0", "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def train(out, *overrides, ok=True, timeout=300, env=None):
    """A one-process run (`python -m gspo_megatron.train`), by its own main in a pooled process
    (testlib.train_pooled); the signal, kill and ulimit tests below launch real processes."""
    r = train_pooled(1, "--config", TINY, f"out_dir={out}", *BASE, *overrides, timeout=timeout, env=env)
    if ok:
        assert r.returncode == 0, explain(r.stderr)
    else:
        assert r.returncode != 0, r.stderr[-2000:]
    return r


def sigterm_through_torchrun(out, hold_when: str, *overrides):
    """A one-process run under torchrun, SIGTERM sent to torchrun (which forwards it, as on a
    cluster) once the run holds at the preemption point after the metrics row `hold_when`
    ("gspo:2", "sft:11"; tests/preempt_hold.py waits there for the signal, so it lands at that
    step by construction); returns (the torchrun process, its stderr)."""
    hold = out.parent / f"{out.name}.hold"
    hold.mkdir(parents=True)
    env = {**_env(), "HOLD_DIR": str(hold), "HOLD_METRICS": str(out / "metrics.jsonl"), "HOLD_WHEN": hold_when}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone",
           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "--shutdown-timeout=300",
           os.path.join(REPO, "tests", "preempt_hold.py"), "--config", TINY, f"out_dir={out}", *BASE, *overrides]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 600
        while p.poll() is None and not (hold / "reached").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # a poll interval
        assert p.poll() is None and (hold / "reached").exists(), "the run ended (or hung) before its hold"
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=60)
    return p, err


def one_line_error(r) -> str:
    lines = [x for x in r.stderr.strip().splitlines() if x.startswith("gspo_megatron.train: error")]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def steps(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x)["step"] for x in f if '"gspo"' in x]


def ckpts(out):
    root = os.path.join(out, "checkpoints")
    return sorted(d for d in os.listdir(root) if d.startswith("iter_"))


@pytest.fixture(scope="module")
def run4(tmp_path_factory):
    out = tmp_path_factory.mktemp("reliability") / "run"
    train(out, "train.max_steps=4")
    assert ckpts(out) == [f"iter_{i:07d}" for i in range(1, 5)]
    return out


def copy_run(run4, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run4, out)
    return out


@pytest.mark.timeout(600)
def test_tracker_lost_resumes_from_newest_complete_and_prunes_nothing_newer(run4, tmp_path):
    """Before: without the tracker resume=auto started at step 1, rewrote metrics.jsonl, and
    keep_last deleted each new checkpoint right after saving it (the older, higher-numbered ones
    counted first)."""
    out = copy_run(run4, tmp_path)
    tracker = out / "checkpoints" / "latest_checkpointed_iteration.txt"
    tracker.unlink()
    # and the lock of a run killed with kill -9 (its process is gone): taken over, with a line
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (out / ".gspo-run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    # and the temporary directory of a save that never finished (a full checkpoint's size on a real model)
    stale = out / "checkpoints" / ".iter_0000005.tmp-abc123"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"x" * 100)
    r = train(out, "train.max_steps=5", "checkpoint.keep_last=2")
    assert f"removed {stale}, the temporary directory of a save that never finished" in r.stderr and not stale.exists()
    assert f"took over the run lock {out / '.gspo-run.lock'}: its process {dead.pid} on this host is gone" in r.stderr
    assert not (out / ".gspo-run.lock").exists()  # released at the end
    assert "no tracker; resuming from the newest complete one, iter_0000004" in r.stderr
    assert steps(out) == [1, 2, 3, 4, 5]
    assert ckpts(out) == ["iter_0000004", "iter_0000005"] and tracker.read_text().strip() == "5"

    # the tracker names a checkpoint whose files are gone: the newest complete one before it
    out = copy_run(run4, tmp_path / "b")
    (out / "checkpoints" / "iter_0000004" / "common.pt").unlink()
    r = train(out, "train.max_steps=4", "checkpoint.keep_last=1")
    assert "the tracker names iter_0000004, which is not a complete checkpoint" in r.stderr
    assert "resuming from the newest complete one, iter_0000003" in r.stderr and steps(out) == [1, 2, 3, 4]
    # pruning kept only the step-4 checkpoint it just wrote (older ones are up to it)
    assert ckpts(out) == ["iter_0000004"]

    # checkpoints, none usable: one line, nothing deleted
    out = copy_run(run4, tmp_path / "c")
    for d in ckpts(out):
        (out / "checkpoints" / d / "metadata.json").unlink()
    (out / "checkpoints" / "latest_checkpointed_iteration.txt").unlink()
    r = train(out, "train.max_steps=6", ok=False)
    assert "none complete" in one_line_error(r) and "nothing was deleted" in r.stderr
    assert ckpts(out) == [f"iter_{i:07d}" for i in range(1, 5)] and steps(out) == [1, 2, 3, 4]


@pytest.mark.timeout(600)
def test_a_flipped_byte_in_a_shard_is_one_line_naming_the_file(run4, tmp_path):
    """Before: bytes overwritten in a shard loaded without complaint (Adam's second moment became
    3.7e19 and training went on)."""
    out = copy_run(run4, tmp_path)
    d = out / "checkpoints" / "iter_0000004"
    sums = json.loads((d / "checksums.json").read_text())["files"]
    assert {".metadata", "common.pt", "metadata.json"} <= set(sums) and any(f.endswith(".distcp") for f in sums)
    shard = max((f for f in sums if f.endswith(".distcp")), key=lambda f: sums[f]["size"])
    data = bytearray((d / shard).read_bytes())
    data[len(data) // 2] ^= 0x01
    (d / shard).write_bytes(bytes(data))
    r = train(out, "train.max_steps=5", ok=False)
    line = one_line_error(r)
    assert str(d / shard) in line and "checksum" in line
    assert steps(out) == [1, 2, 3, 4] and ckpts(out)[-1] == "iter_0000004"


@pytest.mark.timeout(600)
def test_resume_with_a_changed_architecture_is_refused(run4, tmp_path):
    """A changed rope_theta loads every tensor (same shapes) and would train another function."""
    out = copy_run(run4, tmp_path)
    r = train(out, "train.max_steps=5", "model.hf_config.rope_theta=500000.0", ok=False)
    line = one_line_error(r)
    assert "rope_theta 10000.0 -> 500000.0" in line and "iter_0000004" in line


@pytest.mark.timeout(600)
def test_a_second_job_on_the_same_out_dir_stops_in_one_line(tmp_path):
    """Before: no lock, each rank resolved `resume` on its own, and the two jobs overwrote each
    other's metrics and checkpoints (ranks could load different iterations: SIGABRT)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", *BASE, "train.max_steps=6"]
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    try:
        lock = out / ".gspo-run.lock"
        for _ in range(600):
            if lock.exists() or first.poll() is not None:
                break
            time.sleep(0.1)
        assert lock.exists(), "the first run never took the lock"
        # hold the first run still while the second starts (a loaded machine could otherwise let it
        # finish first); its lock stays fresh (heartbeat < 5 min old) and its process alive
        first.send_signal(signal.SIGSTOP)
        try:
            second = train(out, "train.max_steps=2", "train.seed=99", ok=False)
        finally:
            first.send_signal(signal.SIGCONT)
        line = one_line_error(second)
        assert "is in use by another run" in line and f"pid {first.pid}," in line
        _, err = first.communicate(timeout=500)
        assert first.returncode == 0, err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=60)
    assert steps(out) == [1, 2, 3, 4, 5, 6] and ckpts(out)[-1] == "iter_0000006"
    assert "seed: 99" not in (out / "config.yaml").read_text()  # the second job wrote nothing
    assert not lock.exists()


@pytest.mark.timeout(900)
def test_sigterm_saves_the_current_step_and_resume_is_bit_identical(tmp_path):
    """Before: a preempted job (Slurm sends SIGTERM before the kill) saved nothing, and everything
    since the last checkpoint interval was lost. The signal goes to torchrun, which forwards it to
    its worker, as on a cluster."""
    from megatron_utils import dcp_tensors

    ref = tmp_path / "ref"
    train(ref, "train.max_steps=5", "checkpoint.interval=0")
    out = tmp_path / "run"
    # held at the end of step 2 until the signal is in
    p, err = sigterm_through_torchrun(out, "gspo:2", "train.max_steps=5", "checkpoint.interval=0")
    assert p.returncode != 0, err[-2000:]
    done = steps(out)
    assert done == [1, 2] and ckpts(out) == ["iter_0000002"], (done, ckpts(out), err[-2000:])
    assert "saved the step-2 checkpoint after SIGTERM" in err
    r = train(out, "train.max_steps=5", "checkpoint.interval=0")
    assert f"resumed from" in r.stderr and steps(out) == [1, 2, 3, 4, 5]
    a, b = dcp_tensors(str(ref / "checkpoints" / "iter_0000005")), dcp_tensors(str(out / "checkpoints" / "iter_0000005"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda d: [{k: v for k, v in json.loads(x).items() if not wall_clock(k)}  # noqa: E731
                      for x in (d / "metrics.jsonl").read_text().splitlines() if '"gspo"' in x]
    assert rows(out) == rows(ref)


@pytest.mark.timeout(900)
def test_bad_records_are_reported_by_dry_run_and_skipped_by_training(tmp_path):
    """Before: --dry-run checked 3 records; record 20's prompt 12345 crashed training with a
    traceback when its batch came (and again on resume), "answer": null became the gold text
    "None", and removing the record made the run unresumable with a message naming no file."""
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    tok = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok)
    recs = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(24)]
    recs[19]["prompt"] = 12345
    recs[4]["answer"] = None
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in recs))
    file_data = ["data.source=file", f"data.path={data}", "reward.fn=math", f"model.tokenizer={tok}",
                 "train.sft_warmup_steps=0", "rollout.prompts_per_step=8", "rollout.samples_per_prompt=2"]
    dry = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", TINY, "--dry-run", *file_data],
                         capture_output=True, text=True, timeout=120, env=_env(), cwd=REPO)
    assert dry.returncode == 0, explain(dry.stderr)
    assert "24 records checked in" in dry.stdout and "22 usable, 2 skipped by training" in dry.stdout
    assert "record 5 'answer' is null" in dry.stdout and "record 20 'prompt' is int 12345" in dry.stdout

    out = tmp_path / "run"
    r = train(out, *file_data, "train.max_steps=3", "checkpoint.interval=1")  # 24 draws: the whole file
    assert "2 of 24 records are malformed and will be skipped" in r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"gspo"' in x]
    assert [x["step"] for x in rows] == [1, 2, 3] and sum(x["data_skipped"] for x in rows) >= 2

    # fixing a record in place keeps the stream's positions: the run resumes
    recs[19]["prompt"] = "19+19="
    data.write_text("".join(json.dumps(x) + "\n" for x in recs))
    train(out, *file_data, "train.max_steps=4", "checkpoint.interval=1")
    # removing one shifts every position: one line naming the file and what changed
    data.write_text("".join(json.dumps(x) + "\n" for x in recs[:-1]))
    line = one_line_error(train(out, *file_data, "train.max_steps=5", ok=False))
    assert str(data) in line and "has 23 records but the checkpoint's prompt stream was saved over 24" in line


@pytest.mark.timeout(300)
def test_a_save_over_the_file_size_limit_is_one_line_and_leaves_nothing(tmp_path):
    """Before: "unexpected pos 704 vs 598" or an OSError traceback, with a temp directory left."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", *BASE,
                        "train.max_steps=1", "train.sft_warmup_steps=0"], capture_output=True, text=True,
                       timeout=280, env=_env(), cwd=REPO, preexec_fn=limit)
    assert r.returncode != 0
    line = one_line_error(r)
    assert f"cannot write checkpoint {out / 'checkpoints' / 'iter_0000001'}" in line and "ulimit -f" in line
    assert os.listdir(out / "checkpoints") == []


# ---- non-finite steps (issue 40) ----------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_non_finite_step_is_skipped_and_nothing_non_finite_is_saved(tmp_path):
    """Before: a NaN loss (here: NaN advantages at step 2) went through Megatron's bf16/fp32 step,
    which clips by a NaN norm (a no-op) and writes NaN into every weight; the checkpoint was saved
    and tracked with every tensor NaN. Now the step's updates are skipped: step 2's checkpoint holds
    step 1's weights and Adam moments bit for bit, and the run goes on."""
    from megatron_utils import dcp_tensors

    out = tmp_path / "run"
    env_nan = dict(os.environ, NAN_ADVANTAGE_STEPS="2")
    # a real process: tests/nonfinite_fns.py patches the loop for the life of the process it runs in
    r = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", *BASE,
                        "train.max_steps=3", "reward.fn=tests.nonfinite_fns:poisoned", "reward.workers=0"],
                       capture_output=True, text=True, timeout=500, env={**_env(), **env_nan}, cwd=REPO)
    assert r.returncode == 0, explain(r.stderr)
    rows = {json.loads(x)["step"]: json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
            if '"gspo"' in x}
    assert [rows[s]["skipped_updates"] for s in (1, 2, 3)] == [0, 4, 0], rows
    assert "loss or gradient norm not finite" in r.stderr
    it = {s: dcp_tensors(str(out / "checkpoints" / f"iter_{s:07d}")) for s in (1, 2, 3)}
    for s, tensors in it.items():
        bad = [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
        assert not bad, (s, bad[:5])
    assert set(it[1]) == set(it[2]) and all(torch.equal(it[1][k], it[2][k]) for k in it[1])  # nothing applied
    assert any(not torch.equal(it[2][k], it[3][k]) for k in it[2])  # step 3 trained again


@pytest.mark.timeout(600)
def test_non_finite_steps_in_a_row_stop_the_run_in_one_line(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", *BASE,
                        "train.max_steps=4", "train.max_skipped_steps=6", "reward.fn=tests.nonfinite_fns:poisoned",
                        "reward.workers=0"],
                       capture_output=True, text=True, timeout=500,
                       env={**_env(), "NAN_ADVANTAGE_STEPS": "2,3"}, cwd=REPO)
    assert r.returncode == 1, r.stderr[-3000:]
    line = one_line_error(r)
    assert "train.max_skipped_steps=6" in line and "non-finite" in line, line
    assert steps(out) == [1, 2]  # step 3's second minibatch made it 4 + 2 = 6 in a row
    assert ckpts(out) == ["iter_0000001", "iter_0000002"]
    assert not (out / ".gspo-run.lock").exists()


@pytest.mark.timeout(900)
def test_sigterm_during_the_warm_start_saves_it_and_resume_is_bit_identical(tmp_path):
    """Before: the signal handlers were installed after the warm start, the first push and the
    step-0 evaluation; a SIGTERM there killed the run at once (rc 143 from the signal itself): no
    checkpoint, the warm-start steps lost, the run lock left behind. The signal goes to torchrun,
    which forwards it, as on a cluster; it is sent once the warm start has logged step 11 of 120."""
    from megatron_utils import dcp_tensors

    warm = ["train.sft_warmup_steps=120", "train.max_steps=2", "checkpoint.interval=0"]
    ref = tmp_path / "ref"
    train(ref, *warm)
    out = tmp_path / "run"
    p, err = sigterm_through_torchrun(out, "sft:11", *warm)  # held after warm-start step 11 until the signal is in
    assert p.returncode != 0, err[-2000:]
    assert "saved the step-0 checkpoint after SIGTERM (warm-start step 11)" in err, err[-3000:]
    assert ckpts(out) == ["iter_0000000"] and steps(out) == []
    assert not (out / ".gspo-run.lock").exists()
    r = train(out, *warm)
    assert "resumed from" in r.stderr and steps(out) == [1, 2]
    a, b = dcp_tensors(str(ref / "checkpoints" / "iter_0000002")), dcp_tensors(str(out / "checkpoints" / "iter_0000002"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda d: [{k: v for k, v in json.loads(x).items() if not wall_clock(k)}  # noqa: E731
                      for x in (d / "metrics.jsonl").read_text().splitlines() if '"gspo"' in x]
    assert rows(out) == rows(ref)


# ---- engine responses that break the contract (issue 40) --------------------------------------


def _rollout_parts(samples_of, max_rejected_frac=0.5, G=4, P=2):
    """The pieces of RunParts that loop.rollout touches, around a stand-in engine whose generate()
    returns `samples_of(prompts, n)`."""
    from types import SimpleNamespace

    from gspo_megatron.resolve import load_config

    cfg = load_config(TINY, [f"rollout.samples_per_prompt={G}", f"rollout.prompts_per_step={P}",
                             f"rollout.max_rejected_frac={max_rejected_frac}"])
    scored = []

    class Prompts:
        def batch(self, step, rounds, n):
            return [{"prompt": f"p{step}.{rounds}.{i}", "answer": "x"} for i in range(n)]

        def encode(self, ex):
            return [1, 2, 3]

        def take_skipped(self):
            return 0

        def text(self, ex):
            return ex["prompt"]

    def score(texts, examples):
        scored.extend(texts)
        return [float(len(t)) for t in texts], [False] * len(texts)

    engine = SimpleNamespace(generate=lambda prompts, n, sampling, seed=None: samples_of(prompts, n),
                             weight_version=0, metrics={})
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "t" * len(ids))
    from gspo_megatron.rollout.drivers import single_turn
    from gspo_megatron.train.setup import RunParts

    parts = SimpleNamespace(cfg=cfg, engine=engine, prompts=Prompts(), tokenizer=tok, score=score, stop_ids=[0],
                            agent=None, driver=single_turn)  # the run's default driver (rollout/drivers.py)
    parts.rollout_context = lambda generate=None: RunParts.rollout_context(parts, generate)
    return parts, scored


def _samples(prompts, n, rejected=()):
    from gspo_megatron.rollout.base import Sample

    out = []
    for p in range(len(prompts)):
        for j in range(n):
            k = p * n + j
            meta = {"rejected": f"http://127.0.0.1:1: response {k}: 48 tokens for max_new_tokens=8"} if k in rejected else {}
            ids = [] if k in rejected else [5] * (j + 1)
            out.append(Sample(p, prompts[p], ids, [-0.5] * len(ids), "stop", 0, meta=meta))
    return out


def test_a_rejected_response_takes_its_group_out_unscored():
    from gspo_megatron.train import loop

    parts, scored = _rollout_parts(lambda prompts, n: _samples(prompts, n, rejected={5}))
    kept, rewards, stats = loop.rollout(parts, 0)
    assert stats["engine_rejected"] == 1
    assert [s.prompt_index for s in kept] == [0] * 4 and len(rewards) == 4  # group 1 (samples 4..7) is out
    assert len(scored) == 4 and all(s.response_ids for s in kept)


def test_a_step_made_mostly_of_rejected_responses_stops_in_one_line():
    from gspo_megatron.rollout.validate import EngineRejectedError
    from gspo_megatron.train import loop

    parts, scored = _rollout_parts(lambda prompts, n: _samples(prompts, n, rejected={0, 1, 2, 4, 5}),
                                   max_rejected_frac=0.5)
    with pytest.raises(EngineRejectedError) as ei:
        loop.rollout(parts, 0)
    msg = str(ei.value)
    assert "\n" not in msg and "5 of 8 samples" in msg and "http://127.0.0.1:1" in msg and "max_new_tokens=8" in msg
    assert scored == []  # nothing of it was scored either


@pytest.mark.timeout(300)
def test_a_user_folder_where_the_export_goes_is_refused_before_training(tmp_path):
    """checkpoint.export_hf writes <out_dir>/hf: a folder there that the export did not write is
    refused by the input checks, before any step (it used to be replaced at the end of the run)."""
    out = tmp_path / "run"
    (out / "hf").mkdir(parents=True)
    (out / "hf" / "NOTES.md").write_text("mine")
    r = train(out, "train.max_steps=1", "checkpoint.export_hf=true", ok=False)
    line = one_line_error(r)
    assert str(out / "hf") in line and r.returncode == 2, line
    assert (out / "hf" / "NOTES.md").read_text() == "mine" and not (out / "checkpoints").exists()
