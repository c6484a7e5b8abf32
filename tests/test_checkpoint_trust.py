"""A checkpoint is data: nothing in it runs, and nothing in it is used before it is verified
(issue #40 items 1 and 2). One real trainer run (two steps, a checkpoint each) is made once;
every test works on a copy of it.

* The BYTE_IO attack: a `.metadata` built only from classes the restricted unpickler admits turns
  one optimizer tensor entry into a `BytesStorageMetadata` with a forged `size` (so Megatron's
  global-shape check passes) whose storage is a pickle in a new file of the folder; DCP plans a
  BYTE_IO read for it and torch's DefaultLoadPlanner.load_bytes unpickles it with
  weights_only=False (torch/distributed/checkpoint/default_planner.py:382-392). checksums.json is
  recomputed, as an attacker would. Every loader must refuse it in one line, the marker never made.
* A flipped byte in a shard is one non-zero line naming the file for every loader, not only resume.
* A checkpoint without checksums.json is loaded with a warning naming the folder, refused when
  checksums are required; checksums are verified before any file of the folder is parsed, so a
  flipped common.pt is named by them and resume neither rolls back nor overwrites the iteration.
* A tracker that is not UTF-8 is a scan for the newest complete iteration, not a decode error.
* A model holding NaN is never saved.
"""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from dist_utils import run_distributed
from test_safe_loading import _Payload, _run  # the attacker's pickle; the subprocess runner
from run_output import explain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
BASE = ["parallel.tp=1", "parallel.sequence_parallel=false", "train.sft_warmup_steps=1", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "checkpoint.interval=1", "checkpoint.keep_last=0",
        "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false"]
NEWEST = "iter_0000002"




def _train(out, *overrides):
    return ["-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", *BASE, *overrides]


def _errors(r) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if ": error: " in ln]


def _one_line(r) -> str:
    """The single error line of a run that must fail (exit status 2, no traceback)."""
    lines = _errors(r)
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.returncode, r.stderr[-3000:])
    return lines[0]


def _steps(out) -> list[int]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(x)["step"] for x in f if '"gspo"' in x]


def _tree(d) -> dict[str, bytes]:
    """Every file under `d` with its contents (to show nothing was rewritten)."""
    out = {}
    for dirpath, _, names in os.walk(d):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def _recompute_checksums(ckpt, files) -> None:
    from gspo_megatron.checkpoint import integrity

    recorded = integrity.read(str(ckpt))
    recorded.update(integrity.compute(str(ckpt), files))
    integrity.write(str(ckpt), recorded)


def _flip(path, where=0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * where)] ^= 0x01
    path.write_bytes(bytes(data))


def _largest_shard(ckpt):
    return max((p for p in ckpt.iterdir() if p.name.endswith(".distcp")), key=lambda p: p.stat().st_size)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One single-process trainer run, two steps, a checkpoint after each: run/checkpoints/iter_000000{1,2}."""
    out = tmp_path_factory.mktemp("trust") / "run"
    r = _run(_train(out, "train.max_steps=2"))
    assert r.returncode == 0, explain(r.stderr)
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_0000001", NEWEST, "latest_checkpointed_iteration.txt"]
    return out


def _copy(trained, dst):
    shutil.copytree(trained, dst)
    return dst, dst / "checkpoints" / NEWEST


# ---------------------------------------------------------------------------------------------
# The BYTE_IO attack

EVIL_FILE = "__0_evil.distcp"


def _byte_io_metadata(ckpt, marker: str, key: str | None = None):
    """(crafted .metadata bytes, attacked key, payload bytes) for checkpoint `ckpt`: `key` (default:
    an optimizer Adam-moment entry) becomes a BytesStorageMetadata whose `size` is set by BUILD
    to the tensor's global shape and whose storage is `payload` in EVIL_FILE."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fresh checkpoint: trusted
    key = key or sorted(k for k in md.state_dict_metadata if k.startswith("optimizer.state.exp_avg."))[0]
    forged = BytesStorageMetadata()
    forged.size = md.state_dict_metadata[key].size  # pickled as BUILD {"size": torch.Size(...)}
    md.state_dict_metadata[key] = forged
    md.storage_data = {i: s for i, s in md.storage_data.items() if i.fqn != key}
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    payload = buf.getvalue()
    md.storage_data[MetadataIndex(key)] = _StorageInfo(EVIL_FILE, 0, len(payload))
    return pickle.dumps(md), key, payload


def _plant_byte_io(ckpt, marker: str) -> str:
    data, key, payload = _byte_io_metadata(ckpt, marker)
    (ckpt / EVIL_FILE).write_bytes(payload)
    (ckpt / ".metadata").write_bytes(data)
    _recompute_checksums(ckpt, [".metadata", EVIL_FILE])
    return key


@pytest.fixture(scope="module")
def byte_io_runs(trained, tmp_path_factory):
    """Every loader run once against the planted checkpoint (a few at a time: each mostly imports)."""
    import torch

    base = tmp_path_factory.mktemp("byteio")
    run, ckpt = _copy(trained, base / "run")
    marker = base / "MARKER"
    key = _plant_byte_io(ckpt, str(marker))
    torch.load(io.BytesIO((ckpt / EVIL_FILE).read_bytes()), weights_only=False)  # control: what load_bytes does
    assert marker.exists(), "the planted payload should run under torch.load(weights_only=False)"
    marker.unlink()
    (base / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    argvs = {
        "resume=auto": _train(run, "train.max_steps=3"),
        "model.load": _train(base / "from_load", "train.max_steps=1", f"model.load={ckpt}"),
        "score": ["-m", "gspo_megatron.score", "--load", str(ckpt), "--input", str(base / "in.jsonl"),
                  "--output", str(base / "out.jsonl")],
        "mcore-to-hf": ["-m", "converters.cli", "mcore-to-hf", "--load", str(run / "checkpoints"),
                        "--out", str(base / "hf"), "--no-progress"],
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(argvs, pool.map(_run, argvs.values())))
    return done, ckpt, key, marker


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loader", ["resume=auto", "model.load", "score", "mcore-to-hf"])
def test_a_byte_io_entry_never_runs_and_is_one_line(byte_io_runs, loader):
    """Before: resume=auto ran the payload (the marker appeared); mcore-to-hf, score and model.load
    loaded the checkpoint without a word (they never ask for the attacked optimizer key)."""
    done, ckpt, key, marker = byte_io_runs
    line = _one_line(done[loader])
    assert not marker.exists()
    assert f"{ckpt / '.metadata'}" in line and "BytesStorageMetadata" in line and "'size'" in line, line


def test_the_restricted_reader_admits_only_declared_fields_of_the_right_type(trained, tmp_path):
    """BUILD sets only declared fields, each of its declared type; the genuine file reads back equal."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

    from gspo_megatron.checkpoint.safe_metadata import loads_dcp_metadata
    from gspo_megatron.errors import CheckpointError

    ckpt = trained / "checkpoints" / NEWEST
    data, key, _ = _byte_io_metadata(ckpt, str(tmp_path / "MARKER"))
    with pytest.raises(CheckpointError) as e:
        loads_dcp_metadata(data, "m")
    assert str(e.value).startswith("m: refusing to unpickle") and "'size'" in str(e.value), str(e.value)

    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)
    assert loads_dcp_metadata(pickle.dumps(md), "m") == md
    entry = next(v for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata))
    entry.size = [4, 4]  # a list where a torch.Size belongs
    with pytest.raises(CheckpointError, match="TensorStorageMetadata.size"):
        loads_dcp_metadata(pickle.dumps(md), "m")
    entry.size = torch.Size([4, 4])
    entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))]
    entry.evil = "x"  # an undeclared field
    with pytest.raises(CheckpointError, match="evil"):
        loads_dcp_metadata(pickle.dumps(md), "m")
    del entry.evil
    md2 = Metadata(state_dict_metadata={"w": entry}, version=7)  # version: str | None
    with pytest.raises(CheckpointError, match="Metadata.version"):
        loads_dcp_metadata(pickle.dumps(md2), "m")


def _byte_io_layers(rank, world, ckpt, marker):
    """Each layer on its own, given crafted metadata as if the unpickler had admitted it: the
    project's load_sharded refuses the key, the safe reader refuses any BYTE_IO read (with torch's
    own planner), the safe planner refuses load_bytes (with torch's own reader). Controls: torch's
    reader + planner run the payload."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from gspo_megatron.checkpoint.mcore import load_sharded
    from gspo_megatron.checkpoint.megatron_load import safe_load_planner
    from gspo_megatron.checkpoint.safe_metadata import safe_file_system_reader

    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        md = pickle.load(f)  # the crafted file, trusted here on purpose
    key = next(k for k, v in md.state_dict_metadata.items() if hasattr(v, "size") and not hasattr(v, "chunks"))
    shape = tuple(md.state_dict_metadata[key].size)
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "loaded"
        except BaseException as e:  # noqa: BLE001 - DCP wraps failures in CheckpointException
            failures = getattr(e, "failures", None)
            inner = next(iter(failures.values())) if failures else e
            inner = inner[0] if isinstance(inner, tuple) else inner
            out[name] = f"{type(inner).__name__}: {inner}"
        out[name + "_marker"] = os.path.exists(marker)

    attempt("load_sharded", lambda: load_sharded(
        {"w": ShardedTensor.from_rank_offsets(key, torch.zeros(shape))}, ckpt, partial=True, metadata=md))
    attempt("safe_reader", lambda: dcp_load({key: torch.zeros(shape)}, storage_reader=safe_file_system_reader(ckpt, md),
                                            planner=DefaultLoadPlanner()))
    attempt("safe_planner", lambda: dcp_load({key: torch.zeros(shape)}, storage_reader=FileSystemReader(ckpt),
                                             planner=safe_load_planner()))
    attempt("control", lambda: dcp_load({key: torch.zeros(shape)}, storage_reader=FileSystemReader(ckpt),
                                        planner=DefaultLoadPlanner()))
    return out


@pytest.mark.timeout(300)
def test_no_layer_below_the_unpickler_reaches_an_unrestricted_torch_load(trained, tmp_path):
    """Before: safe_load_planner did not exist (ImportError), and nothing below the unpickler
    refused a byte entry: end to end, resume=auto ran the payload through load_sharded (above)."""
    _, ckpt = _copy(trained, tmp_path / "run")
    marker = tmp_path / "MARKER"
    _plant_byte_io(ckpt, str(marker))
    out = run_distributed(_byte_io_layers, 1, str(ckpt), str(marker), timeout=240)[0]
    for layer in ("load_sharded", "safe_reader", "safe_planner"):
        assert out[f"{layer}_marker"] is False, out
        assert out[layer].startswith("CheckpointError: ") and "a byte entry" in out[layer], out
    assert out["control_marker"] is True, out  # the stock reader + planner run it


# ---------------------------------------------------------------------------------------------
# One verification for every loader


@pytest.fixture(scope="module")
def flipped_runs(trained, tmp_path_factory):
    base = tmp_path_factory.mktemp("flip")
    run, ckpt = _copy(trained, base / "run")
    shard = _largest_shard(ckpt)
    _flip(shard)
    (base / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    argvs = {
        "model.load": _train(base / "from_load", "train.max_steps=1", f"model.load={ckpt}"),
        "score": ["-m", "gspo_megatron.score", "--load", str(ckpt), "--input", str(base / "in.jsonl"),
                  "--output", str(base / "out.jsonl")],
        "mcore-to-hf": ["-m", "converters.cli", "mcore-to-hf", "--load", str(ckpt), "--out", str(base / "hf"),
                        "--no-progress"],
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(argvs, pool.map(_run, argvs.values())))
    return done, shard, base


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loader", ["model.load", "score", "mcore-to-hf"])
def test_a_flipped_shard_byte_is_one_line_for_every_loader(flipped_runs, loader):
    """Before: only resume verified checksums; these three read the flipped byte silently (exit 0)."""
    done, shard, base = flipped_runs
    line = _one_line(done[loader])
    assert f"{shard}: contents differ from the checksum" in line, line
    assert not (base / "hf").exists() and not (base / "out.jsonl").exists()


@pytest.mark.timeout(600)
def test_missing_checksums_warn_naming_the_folder_and_are_refused_when_required(trained, tmp_path, caplog):
    """Before: a checkpoint without checksums.json loaded without a word, and nothing could refuse it."""
    from gspo_megatron.checkpoint.mcore import mcore_to_hf
    from gspo_megatron.errors import CheckpointError

    run, ckpt = _copy(trained, tmp_path / "run")
    (ckpt / "checksums.json").unlink()
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    score = ["-m", "gspo_megatron.score", "--load", str(ckpt), "--input", str(tmp_path / "in.jsonl")]
    argvs = {
        "resume": _train(run, "train.max_steps=3", "checkpoint.keep_last=0"),
        "resume_required": _train(tmp_path / "run_req", "train.max_steps=3", f"checkpoint.resume={ckpt}",
                                  "checkpoint.require_checksums=true"),
        "score": [*score, "--output", str(tmp_path / "out.jsonl")],
        "score_required": [*score, "--output", str(tmp_path / "out_req.jsonl"), "--require-checksums"],
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = dict(zip(argvs, pool.map(_run, argvs.values())))
    warning = f"{ckpt}: no checksums.json"
    for name in ("resume", "score"):
        r = done[name]
        assert r.returncode == 0, explain(r.stderr)
        assert sum(warning in ln for ln in r.stderr.splitlines()) == 1, r.stderr[-3000:]
    assert _steps(run) == [1, 2, 3]
    for name in ("resume_required", "score_required"):
        line = _one_line(done[name])
        assert warning in line and "required" in line, line
    assert not (tmp_path / "out_req.jsonl").exists() and not (tmp_path / "run_req" / "checkpoints").exists()

    # the converter: a warning through logging, a refusal with require_checksums
    with caplog.at_level(logging.WARNING):
        mcore_to_hf(str(ckpt), str(tmp_path / "hf"))
    assert any(warning in rec.getMessage() for rec in caplog.records), caplog.text
    with pytest.raises(CheckpointError, match="required"):
        mcore_to_hf(str(ckpt), str(tmp_path / "hf2"), require_checksums=True)
    assert not (tmp_path / "hf2").exists()


@pytest.mark.timeout(600)
def test_a_flipped_common_pt_is_named_by_the_checksums_and_resume_never_rolls_back(trained, tmp_path):
    """Before: resume=auto parsed common.pt first, took the unreadable newest iteration for an
    incomplete one, resumed from iter_0000001 and overwrote iter_0000002 with a new step 2."""
    run, ckpt = _copy(trained, tmp_path / "run")
    _flip(ckpt / "common.pt", where=0.0)  # the zip signature: unreadable
    before = _tree(run / "checkpoints")
    r = _run(_train(run, "train.max_steps=3"))
    line = _one_line(r)
    assert f"{ckpt / 'common.pt'}: contents differ from the checksum" in line, line
    assert _tree(run / "checkpoints") == before  # nothing rolled back, rewritten or deleted
    assert _steps(run) == [1, 2]


def test_a_tracker_that_is_not_utf8_is_a_scan(trained, tmp_path, caplog):
    """Before: UnicodeDecodeError out of find_latest (and out of megatron_dirs.resolve)."""
    from gspo_megatron.checkpoint.megatron_dirs import TRACKER, resolve
    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.train.checkpoint import find_latest

    run, ckpt = _copy(trained, tmp_path / "run")
    (run / "checkpoints" / TRACKER).write_bytes(b"\xff\xfe2\n")
    with caplog.at_level(logging.WARNING):
        assert find_latest(str(run)) == str(ckpt)
    assert "not UTF-8" in caplog.text and "resuming from the newest complete one, iter_0000002" in caplog.text
    with pytest.raises(CheckpointError, match="not UTF-8"):
        resolve(str(run / "checkpoints"))


# ---------------------------------------------------------------------------------------------
# Never save a non-finite tensor


def _save_with_nan(rank, world, out_dir, overrides=()):
    import torch

    from gspo_megatron.resolve import load_config
    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.train.setup import setup_run

    cfg = load_config(TINY, [f"out_dir={out_dir}", *BASE, "train.max_steps=1", *overrides])
    parts = setup_run(cfg, world_size=world)
    try:
        if cfg.checkpoint.async_save:  # Adam's moments exist: the background writer takes the save
            parts.optimizer.step()
        parts.save_checkpoint(1, {"step": 1})
        parts.wait_for_saves()
        name, p = next((n, p) for n, p in parts.model[0].named_parameters() if "linear_fc2" in n)
        with torch.no_grad():
            p.view(-1)[3] = float("nan")
        try:
            parts.save_checkpoint(2, {"step": 2})
            parts.wait_for_saves()  # a background write's error surfaces at the wait
            return name, "saved"
        except CheckpointError as e:
            return name, str(e)
    finally:
        parts.close()


@pytest.mark.timeout(300)
def test_a_model_holding_nan_is_never_saved(tmp_path):
    """Before: the checkpoint was saved and tracked with the NaN in it."""
    out = tmp_path / "run"
    name, msg = run_distributed(_save_with_nan, 1, str(out), timeout=240)[0]
    root = out / "checkpoints"
    assert "\n" not in msg and str(root / "iter_0000002") in msg and "not finite" in msg, msg
    assert name.split("module.")[-1] in msg, (name, msg)
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


@pytest.mark.timeout(300)
def test_a_background_write_never_saves_a_model_holding_nan(tmp_path):
    """checkpoint.async_save=true: the writer checks the snapshot it is about to write (the step
    does not wait for the check); the same one line, at the next wait, and nothing written."""
    out = tmp_path / "run"
    name, msg = run_distributed(_save_with_nan, 1, str(out), ["checkpoint.async_save=true"], timeout=240)[0]
    root = out / "checkpoints"
    assert "\n" not in msg and str(root / "iter_0000002") in msg and "not finite" in msg, msg
    # the checkpoint's key and the chunk (layer 0, expert 0): the writer's check, not the save's
    assert "decoder.layers.mlp.experts.experts.linear_fc2.weight (the chunk at offsets [0, 0," in msg, (name, msg)
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_every_checkpoint_the_project_writes_carries_checksums(trained, tmp_path):
    """The trainer's and the converter's checkpoints list every file they hold (so only older or
    foreign checkpoints get the missing-checksums warning). Before: hf-to-mcore wrote none."""
    from megatron_utils import make_tiny_hf

    from gspo_megatron.checkpoint import integrity
    from gspo_megatron.checkpoint.mcore import hf_to_mcore

    ckpt = trained / "checkpoints" / NEWEST
    assert sorted(integrity.read(str(ckpt))) == integrity.list_files(str(ckpt))
    make_tiny_hf(tmp_path / "hf")
    hf_to_mcore(str(tmp_path / "hf"), str(tmp_path / "mc"))
    it = tmp_path / "mc" / "iter_0000000"
    recorded = integrity.read(str(it))
    assert recorded is not None and sorted(recorded) == integrity.list_files(str(it))
    assert integrity.verify_before_parse(str(it), data=True)


def test_an_hf_index_that_is_not_utf8_or_points_outside_is_one_line(tmp_path):
    """Before: a UnicodeDecodeError traceback; a shard path outside the folder was opened."""
    from gspo_megatron.errors import CheckpointError
    from gspo_megatron.model.hf_io import INDEX_FILE, HFCheckpointReader

    (tmp_path / INDEX_FILE).write_bytes(b'{"weight_map": {"\xff": 1}}')
    with pytest.raises(CheckpointError, match="not a valid safetensors index"):
        HFCheckpointReader(str(tmp_path))
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "../outside.safetensors"}}))
    with pytest.raises(CheckpointError, match="is not a file inside"):
        HFCheckpointReader(str(tmp_path))


def test_a_data_file_outside_the_checksums_is_never_read(trained, tmp_path):
    """A `.metadata` (checksums recomputed for it alone) that points a tensor's storage at a file
    added to the folder later: refused in one line naming the file. Before: read unverified."""
    from gspo_megatron.checkpoint.dcp_io import DcpReader
    from gspo_megatron.errors import CheckpointError

    _, ckpt = _copy(trained, tmp_path / "run")
    shard = _largest_shard(ckpt)
    shutil.copy(shard, ckpt / "__9_added.distcp")
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own fresh checkpoint: trusted
    idx = next(i for i, s in md.storage_data.items() if s.relative_path == shard.name)
    md.storage_data[idx].relative_path = "__9_added.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _recompute_checksums(ckpt, [".metadata"])
    with pytest.raises(CheckpointError) as e:
        DcpReader(str(ckpt))
    assert str(e.value).startswith(f"{ckpt / '__9_added.distcp'}: named in the checkpoint's metadata but not listed")
