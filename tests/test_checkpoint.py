"""Trainer checkpoints reshard: a checkpoint written at TP2 (+SP), loaded at TP1 x DP2 (distributed
optimizer) or at EP2 and saved again at once, holds exactly the same global tensors — weights, fp32
masters and Adam moments — and the same scheduler and loop state. Resuming at another layout end to
end: tests/test_train_loop.py::test_resume_at_another_layout_continues_training."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dist_utils import free_port, run_distributed
from megatron_utils import dcp_tensors

VOCAB = 98  # tiny_cpu.yaml
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
SMALL = ["train.max_steps=2", "train.sft_warmup_steps=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false"]


def _reload_and_save(rank, world, ckpt, out_dir, overrides, chunk_bytes):
    from gspo_megatron.config import load_config
    from gspo_megatron.train import checkpoint
    from gspo_megatron.train.setup import setup_run

    cfg = load_config(TINY, [f"out_dir={out_dir}", *SMALL, *overrides])
    parts = setup_run(cfg, world_size=world)
    used = []
    real = checkpoint._load_distributed_optimizer
    checkpoint._load_distributed_optimizer = lambda *a, **k: used.append(real(*a, **k)) or used[-1]
    try:
        loop = checkpoint.load(ckpt, parts.model, parts.optimizer, parts.scheduler, parts.ctx,
                               chunk_bytes=chunk_bytes or checkpoint.LOAD_CHUNK_BYTES)
        path = parts.save_checkpoint(loop["step"], loop)
    finally:
        checkpoint._load_distributed_optimizer = real
        parts.close()
    return path, used


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal; vocab tensors (embedding, output layer and their optimizer state) carry the padding
    rows of the saving layout (98 tokens pad to 256 rows at TP2, 128 at TP1), so they are compared
    on the rows both have: the vocabulary and the common padding."""
    if a.shape != b.shape:
        n = min(a.shape[0], b.shape[0])
        return a.shape[1:] == b.shape[1:] and n >= VOCAB and torch.equal(a[:n], b[:n])
    return torch.equal(a, b)


def _train_tp2(out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                        f"--master-port={free_port()}", "-m", "gspo_megatron.train", "--config", TINY,
                        f"out_dir={out}", *SMALL, *extra], capture_output=True, text=True, timeout=600, env=env,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "checkpoints" / "step_00000002"


@pytest.fixture(scope="module")
def tp2_checkpoint(tmp_path_factory):
    return _train_tp2(tmp_path_factory.mktemp("tp2"))


PLAIN = ["optimizer.use_distributed_optimizer=false"]


@pytest.mark.timeout(600)
def test_plain_optimizer_checkpoint_reloads_exactly_at_another_layout(tmp_path):
    """optimizer.use_distributed_optimizer=false: Megatron's own sharded state of the plain
    optimizer, TP2 -> TP1 x DP2; loading it into the other optimizer kind is one clear error."""
    ckpt = _train_tp2(tmp_path / "tp2", *PLAIN)
    saved, used = run_distributed(_reload_and_save, 2, str(ckpt), str(tmp_path / "again"),
                                  ["parallel.tp=1", "parallel.sequence_parallel=false", *PLAIN], None, timeout=560)[0]
    assert used == [False]
    a, b = dcp_tensors(ckpt), dcp_tensors(saved)
    assert set(a) == set(b) and any(".exp_avg." in k for k in a)
    assert not [k for k in a if not _same(a[k], b[k])]
    with pytest.raises(RuntimeError, match="written with optimizer.use_distributed_optimizer=false, this run has true"):
        run_distributed(_reload_and_save, 2, str(ckpt), str(tmp_path / "again2"),
                        ["parallel.tp=1", "parallel.sequence_parallel=false"], None, timeout=560)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("chunk_bytes", [None, 20_000], ids=["default-pieces", "many-pieces"])
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.tp=1", "parallel.sequence_parallel=false"], id="tp1xdp2"),
    pytest.param(["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.ep=2"], id="ep2"),
])
def test_checkpoint_reloads_exactly_at_another_layout(tp2_checkpoint, tmp_path, layout, chunk_bytes):
    """The distributed optimizer's state is read piece by piece (train/checkpoint.py,
    _load_param_state); with 20 kB pieces the ranks make different numbers of reads and pad with
    empty collective loads."""
    from gspo_megatron.train.checkpoint import read_trainer_state

    saved, used = run_distributed(_reload_and_save, 2, str(tp2_checkpoint), str(tmp_path / "again"), layout,
                                  chunk_bytes, timeout=560)[0]
    assert used == [True]  # the piecewise loader ran
    a, b = dcp_tensors(tp2_checkpoint), dcp_tensors(saved)
    assert set(a) == set(b)
    # keys: [chained_<i>.]optimizer.state.<exp_avg|exp_avg_sq|param>.<parameter key>
    kinds = {k.split("optimizer.state.")[1].split(".")[0] for k in a if "optimizer.state." in k}
    assert {"exp_avg", "exp_avg_sq"} <= kinds, kinds
    differ = [k for k in a if not _same(a[k], b[k])]
    assert not differ, differ[:5]
    assert any(a[k].abs().max() > 0 for k in a if ".exp_avg." in k)  # real moments, not zeros
    sa, sb = read_trainer_state(str(tp2_checkpoint)), read_trainer_state(saved)
    assert sa["scheduler"] == sb["scheduler"] and sa["loop"] == sb["loop"] and sa["step"] == sb["step"] == 2
    assert sa["layout"]["tp"] == 2 and sb["layout"]["tp"] == 1


def test_resume_auto_refuses_an_old_format_checkpoint(tmp_path):
    """Checkpoints of the per-rank torch.save format (before dist_checkpointing) are not silently
    skipped by resume=auto (which would restart from scratch over them): one clear error."""
    from gspo_megatron.model.hf_io import CheckpointError
    from gspo_megatron.train.checkpoint import resolve_resume

    old = tmp_path / "checkpoints" / "step_00000010"
    old.mkdir(parents=True)
    (old / "meta.json").write_text("{}")
    (old / "rank_00000.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010\n")
    with pytest.raises(CheckpointError, match="earlier per-rank format"):
        resolve_resume("auto", str(tmp_path))
    assert resolve_resume("never", str(tmp_path)) is None
