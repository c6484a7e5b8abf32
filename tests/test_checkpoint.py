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

from dist_utils import run_distributed
from megatron_utils import dcp_tensors
from run_output import explain

VOCAB = 98  # tiny_cpu.yaml
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
SMALL = ["train.max_steps=2", "train.sft_warmup_steps=2", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
         "checkpoint.interval=0", "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false"]


def _reload_and_save(rank, world, ckpt, out_dir, overrides, chunk_bytes):
    from gspo_megatron.resolve import load_config
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
                        "--standalone", "-m", "gspo_megatron.train", "--config", TINY,
                        f"out_dir={out}", *SMALL, *extra], capture_output=True, text=True, timeout=600, env=env,
                       cwd=REPO)
    assert r.returncode == 0, explain(r.stderr)
    return out / "checkpoints" / "iter_0000002"


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
    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.train.checkpoint import resolve_resume

    old = tmp_path / "checkpoints" / "step_00000010"
    old.mkdir(parents=True)
    (old / "meta.json").write_text("{}")
    (old / "rank_00000.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010\n")
    with pytest.raises(CheckpointError, match="earlier per-rank format"):
        resolve_resume("auto", str(tmp_path))
    assert resolve_resume("never", str(tmp_path)) is None


# ----------------------------------------------------------------------------------------------
# The distributed optimizer's direct writer (train/checkpoint_shards.py) against Megatron's save


def test_flat_boxes_tile_a_flat_range_in_order():
    """Every [start, end) of a few shapes: the boxes are contiguous runs, in flat order, that
    together are exactly the range (checked against an index tensor)."""
    from gspo_megatron.train.checkpoint_shards import flat_boxes

    for shape in [(7,), (3, 5), (4, 1, 3), (2, 3, 4, 2), (1, 6)]:
        n = 1
        for s in shape:
            n *= s
        index = torch.arange(n).view(shape)
        for start in range(n + 1):
            for end in range(start, n + 1):
                boxes = flat_boxes(shape, start, end)
                got = []
                for off, size in boxes:
                    assert len(off) == len(size) == len(shape)
                    box = index[tuple(slice(o, o + s) for o, s in zip(off, size))]
                    flat = box.reshape(-1)
                    assert torch.equal(flat, torch.arange(int(flat[0]), int(flat[0]) + flat.numel()))  # contiguous
                    got += flat.tolist()
                assert got == list(range(start, end)), (shape, start, end, boxes)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
    with pytest.raises(ValueError):
        flat_boxes((3, 4), 5, 13)


def _save_both_ways(rank, world, out_dir, overrides):
    """One SFT optimizer step, then the same state saved by Megatron's save and by the direct
    writer; returns which writer the default took."""
    from types import SimpleNamespace

    from gspo_megatron.resolve import load_config
    from gspo_megatron.train import checkpoint, checkpoint_shards
    from gspo_megatron.train.batch import TrainSample, plan_minibatch
    from gspo_megatron.train.loop import _optimizer_step
    from gspo_megatron.train.loss import sft_loss_step
    from gspo_megatron.train.scoring import pad_multiple
    from gspo_megatron.train.setup import setup_run
    from megatron_utils import random_sequences

    cfg = load_config(TINY, [f"out_dir={out_dir}", *SMALL, *overrides])
    parts = setup_run(cfg, world_size=world)
    try:
        seqs = random_sequences(VOCAB, [9, 14, 6, 11, 17, 8, 12, 5], seed=3)
        samples = [TrainSample(s[:3], s[3:], 0.0) for s in seqs]
        mbs, _ = plan_minibatch(samples, dp=parts.ctx.dp, dp_rank=parts.ctx.dp_rank, token_budget=32,
                                multiple=pad_multiple(parts.ctx.parallel), pad_id=0)
        _optimizer_step(SimpleNamespace(model=parts.model), parts.optimizer, parts.scheduler,
                        sft_loss_step(parts.ctx, VOCAB), mbs)
        used = []
        real = checkpoint_shards.distributed_optimizer_plan
        checkpoint_shards.distributed_optimizer_plan = lambda *a: used.append(real(*a)) or used[-1]
        args = (parts.model, parts.optimizer, parts.scheduler, {"step": 1}, parts.ctx)
        try:
            a = checkpoint.save(os.path.join(out_dir, "megatron"), 1, *args, hf_config=parts.hf_config,
                                writer="megatron")
            b = checkpoint.save(os.path.join(out_dir, "direct"), 1, *args, hf_config=parts.hf_config)
        finally:
            checkpoint_shards.distributed_optimizer_plan = real
    finally:
        parts.close()
    return a, b, [u is not None for u in used]


def _equal(x, y) -> bool:
    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.dtype == y.dtype and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y))
    return x == y


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    pytest.param(["parallel.tp=2", "parallel.sequence_parallel=true"], id="tp2-sp-edp2"),
    pytest.param(["parallel.tp=1", "parallel.sequence_parallel=false", "parallel.ep=2"], id="ep2-dp2"),
    pytest.param(["parallel.tp=1", "parallel.sequence_parallel=false", "model.dtype=bfloat16"], id="dp2-bf16"),
])
def test_direct_writer_writes_what_megatrons_save_writes(tmp_path, layout):
    """The distributed optimizer's checkpoint written by each DP rank from its own shard holds the
    same global tensors, bit for bit and dtype for dtype (weights, fp32 masters, both moments), and
    the same common.pt as Megatron's fully_reshardable save (which gathers the state first)."""
    from megatron.core import dist_checkpointing

    a, b, used = run_distributed(_save_both_ways, 2, str(tmp_path), layout, timeout=560)[0]
    assert used == [True]
    ta, tb = dcp_tensors(a), dcp_tensors(b)
    assert set(ta) == set(tb) and any(".exp_avg_sq." in k for k in ta) and any(".param." in k for k in ta)
    differ = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not differ, differ[:5]
    assert any(ta[k].abs().max() > 0 for k in ta if ".exp_avg." in k)
    ca, cb = dist_checkpointing.load_common_state_dict(a), dist_checkpointing.load_common_state_dict(b)
    assert _equal(ca, cb), (ca, cb)
    if "model.dtype=bfloat16" in layout:
        assert any(t.dtype == torch.bfloat16 for t in ta.values())
        assert all(ta[k].dtype == torch.float32 for k in ta if "optimizer.state." in k)


def test_rng_states_restore_only_on_the_device_type_that_saved_them():
    """A CPU-saved checkpoint resumed on a GPU at the same parallel layout must re-seed instead of
    loading CPU generator states into the CUDA tracker ("RNG state is wrong size"): the device is
    part of the layout. Checkpoints written before it was recorded read it off their RNG file."""
    import types

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.train.checkpoint import layout_of, same_layout

    def ctx(device):
        return types.SimpleNamespace(parallel=ParallelConfig(tp=2), world_size=2, device=torch.device(device))

    cpu, cuda = layout_of(ctx("cpu")), layout_of(ctx("cuda"))
    assert cpu != cuda and cpu["device"] == "cpu"
    assert same_layout(cpu, layout_of(ctx("cpu"))) and not same_layout(cpu, cuda)
    old = {k: v for k, v in cpu.items() if k != "device"}  # a checkpoint from before this field
    cpu_rng, cuda_rng = {"torch": torch.get_rng_state()}, {"torch": torch.get_rng_state(), "cuda": torch.zeros(16)}
    assert same_layout(old, cpu, cpu_rng) and not same_layout(old, cuda, cpu_rng)
    assert same_layout(old, cuda, cuda_rng) and not same_layout(old, cuda)
