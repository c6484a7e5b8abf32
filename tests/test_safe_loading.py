"""Loading a checkpoint runs no code from it (issue #29 item 2).

PyTorch DCP's `.metadata` is a pickle that torch and Megatron-Core read with an unrestricted
pickle.load (torch/distributed/checkpoint/filesystem.py:926-930). Every loader of the project reads
it with gspo_megatron/checkpoint/safe_metadata.py's restricted unpickler instead. Here a code-running
`.metadata` (a real checkpoint's metadata with a payload inside: a pickled object whose
`__reduce__` runs `touch MARKER` through os.system) is planted into a real trainer checkpoint
(checksums.json updated to match, as an attacker would), and each loader —
`gspo-convert mcore-to-hf --load`, `python -m gspo_megatron.score --load`, the trainer's
`model.load=`, `checkpoint.resume=<path>` and `checkpoint.resume=auto` — must fail with one line
naming the `.metadata` file while the marker never appears. Controls show the payload is live:
plain pickle.load, and Megatron's stock dist_checkpointing.load, do create the marker.
Legitimate checkpoints still load: tests/test_converters.py, test_checkpoint.py, test_train_loop.py.
"""
from __future__ import annotations

import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from run_output import explain

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
QUIET = ["logging.progress_bar=false", "logging.plot=false"]
TP1 = ["parallel.tp=1", "parallel.sequence_parallel=false"]
REFUSED = "posix.system" if os.name == "posix" else "nt.system"


class _Payload:
    """What an attacker pickles: unpickling it runs a shell command (here: create `marker`)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(k, None)
    return env


def _run(args, timeout=300):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(), cwd=REPO)


def _plant(ckpt_dir, marker: str) -> bytes:
    """Replace ckpt_dir/.metadata by its own metadata carrying the payload (deep inside, after
    the genuine entries); checksums.json, when present, is updated to match. Returns the bytes."""
    from gspo_megatron.checkpoint import integrity

    path = os.path.join(ckpt_dir, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own fresh checkpoint: trusted
    md.planner_data = {**(md.planner_data or {}), "payload": _Payload(marker)}
    data = pickle.dumps(md)
    with open(path, "wb") as f:
        f.write(data)
    recorded = integrity.read(ckpt_dir)
    if recorded is not None:
        recorded.update(integrity.compute(ckpt_dir, [".metadata"]))
        integrity.write(ckpt_dir, recorded)
    return data


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real trainer checkpoint: one step of tiny_cpu.yaml on one process (model + distributed
    optimizer state, checksums.json, tracker): out/checkpoints/iter_0000001."""
    out = tmp_path_factory.mktemp("safe") / "run"
    r = _run(["-m", "gspo_megatron.train", "--config", TINY, f"out_dir={out}", *TP1, *QUIET,
              "train.max_steps=1", "train.sft_warmup_steps=1", "rollout.prompts_per_step=2",
              "rollout.samples_per_prompt=2", "checkpoint.interval=1", "checkpoint.export_hf=false"])
    assert r.returncode == 0, explain(r.stderr)
    assert (out / "checkpoints" / "iter_0000001" / ".metadata").is_file()
    return out


@pytest.fixture(scope="module")
def evil(trained, tmp_path_factory):
    """A copy of the trained run whose checkpoint carries the payload; (run dir, checkpoint dir,
    marker path). The payload is live: plain pickle.load of the file creates the marker."""
    base = tmp_path_factory.mktemp("evil")
    run = base / "run"
    shutil.copytree(trained, run)
    ckpt = run / "checkpoints" / "iter_0000001"
    marker = base / "MARKER"
    data = _plant(ckpt, str(marker))
    pickle.loads(data)  # control: what torch's FileSystemReader.read_metadata does
    assert marker.exists(), "the planted payload should run under an unrestricted unpickler"
    marker.unlink()
    return run, ckpt, marker


# ---------------------------------------------------------------------------------------------
# The restricted unpickler itself


def test_reads_every_real_metadata_like_pickle(trained):
    """The project's checkpoints (here: the trainer's, model + distributed optimizer) read back
    equal to an unrestricted load, in every pickle protocol >= 2."""
    from gspo_megatron.checkpoint.safe_metadata import loads_dcp_metadata, read_dcp_metadata

    ckpt = trained / "checkpoints" / "iter_0000001"
    with open(ckpt / ".metadata", "rb") as f:
        want = pickle.load(f)
    got = read_dcp_metadata(ckpt)
    assert got == want and len(got.storage_data) == len(want.storage_data) > 0
    want.planner_data = {"k": ("a", 1)}
    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert loads_dcp_metadata(pickle.dumps(want, protocol=proto), "x") == want, proto


def test_megatron_decentralized_save_plans_are_read_as_data(tmp_path):
    """Megatron-LM and Megatron-Bridge saves (Megatron's FileSystemWriterAsync + MCoreSavePlanner,
    which run the decentralized global plan) keep every rank's save plan on the metadata as an
    attribute the Metadata dataclass does not declare: megatron-core 0.16.1
    dist_checkpointing/strategies/state_dict_saver.py:141-144 `global_metadata.all_local_plans =
    all_local_plans`, read back at torch.py:677 to reuse the plan. Built here with Megatron's own
    planner as that code does: it reads back equal; a non-plan under that name is refused."""
    import torch
    from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlanner
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from gspo_megatron.checkpoint.safe_metadata import loads_dcp_metadata
    from gspo_megatron.errors import CheckpointError

    planner = MCoreSavePlanner(can_run_decentralized_global_plan=True, flatten_state_dict=False,
                               dedup_replicated_tensors=False)
    planner.set_up_planner({"w": torch.zeros(3, 4), "b": torch.ones(2)}, is_coordinator=True)
    local = planner.create_local_plan()
    _, md = planner.create_global_plan([local])
    md.all_local_plans = [local]  # state_dict_saver.py:144
    got = loads_dcp_metadata(pickle.dumps(md), "x")
    assert got == md and got.all_local_plans == [local]
    for bad in ({"k": local}, [local, BytesStorageMetadata()], [_Payload(str(tmp_path / "M"))]):
        md.all_local_plans = bad
        with pytest.raises(CheckpointError, match="^x: ") as e:
            loads_dcp_metadata(pickle.dumps(md), "x")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "M").exists()


def test_refuses_anything_but_metadata(evil, tmp_path):
    from torch.distributed.checkpoint.metadata import Metadata

    from gspo_megatron.checkpoint.safe_metadata import loads_dcp_metadata, read_dcp_metadata
    from gspo_megatron.errors import CheckpointError

    _, ckpt, marker = evil
    with pytest.raises(CheckpointError) as e:
        read_dcp_metadata(ckpt)
    msg = str(e.value)
    assert msg.startswith(f"{ckpt / '.metadata'}: refusing to unpickle the global {REFUSED}") and "\n" not in msg
    assert not marker.exists()

    # BUILD on a class object: Python's C unpickler would set attributes of torch's class (the
    # control below); the restricted one refuses it.
    build_on_class = (b"\x80\x04" + pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n"
                      + pickle.NONE + pickle.EMPTY_DICT + pickle.SHORT_BINUNICODE + b"\x06pwned_"
                      + pickle.NEWTRUE + pickle.SETITEM + pickle.TUPLE2 + pickle.BUILD + pickle.STOP)
    with pytest.raises(CheckpointError, match="state for the class torch.distributed.checkpoint.metadata.Metadata"):
        loads_dcp_metadata(build_on_class, "m")
    assert not hasattr(Metadata, "pwned_")
    try:
        pickle.loads(build_on_class)
        assert Metadata.pwned_ is True  # control
    finally:
        if "pwned_" in vars(Metadata):
            delattr(Metadata, "pwned_")

    # a data file outside the checkpoint directory
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    md = Metadata(state_dict_metadata={}, storage_data={MetadataIndex("w"): _StorageInfo("../../etc/passwd", 0, 8)})
    with pytest.raises(CheckpointError, match="not a file inside the checkpoint directory"):
        loads_dcp_metadata(pickle.dumps(md), "m")
    # a call of an admitted class (not how DCP pickles) and protocol-1 instantiation are refused
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        loads_dcp_metadata(pickle.dumps(Metadata({}), protocol=1), "m")
    with pytest.raises(CheckpointError, match="holds a builtins.dict"):
        loads_dcp_metadata(pickle.dumps({}), "m")
    with pytest.raises(CheckpointError, match="unreadable DCP metadata"):
        loads_dcp_metadata(pickle.dumps(md)[:40], "m")
    with pytest.raises(CheckpointError, match="no .metadata file"):
        read_dcp_metadata(tmp_path)


def test_common_pt_is_weights_only_even_when_the_environment_says_otherwise(trained, tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turns torch.load calls that do not pass weights_only (as
    Megatron's load_common, strategies/common.py:89) into full unpickles; the project's common.pt
    reader is its own restricted unpickler (checkpoint/safe_torch.py), which no variable changes."""
    import torch

    from gspo_megatron.checkpoint.megatron_load import load_common_state_dict
    from gspo_megatron.errors import CheckpointError

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    common = load_common_state_dict(trained / "checkpoints" / "iter_0000001")
    assert common["trainer"]["step"] == 1
    marker = tmp_path / "MARKER"
    torch.save({"trainer": _Payload(str(marker))}, tmp_path / "common.pt")
    with pytest.raises(CheckpointError) as e:
        load_common_state_dict(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'common.pt'}: refusing to unpickle the global {REFUSED}")
    assert not marker.exists()
    torch.load(tmp_path / "common.pt")  # control: the call Megatron makes
    assert marker.exists()


_MEGATRON_SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
good, evil, marker, store = sys.argv[1:5]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from gspo_megatron.checkpoint.dcp_io import DcpReader
from gspo_megatron.checkpoint.mcore import load_sharded
from gspo_megatron.checkpoint.megatron_load import safe_load_strategies, upstream_load_sha256

print("UPSTREAM_SHA", upstream_load_sha256())
key = "decoder.final_layernorm.weight"
def request():
    return {"w": ShardedTensor.from_rank_offsets(key, torch.zeros(64))}
want = DcpReader(good).read(key, [0], [64])
assert want.abs().sum() > 0 and torch.equal(load_sharded(request(), good)["w"], want)
print("GOOD loaded")
# Megatron's own load with the safe strategies and nothing read beforehand (the reader inside)
sharded, common = safe_load_strategies(evil)
try:
    dist_checkpointing.load(request(), evil, sharded_strategy=sharded, common_strategy=common)
    print("STRATEGY loaded")
except BaseException as e:
    print("STRATEGY refused", repr(str(e))[:600])
print("MARKER", os.path.exists(marker))
try:
    load_sharded(request(), evil)
    print("LOAD_SHARDED loaded")
except Exception as e:
    print("LOAD_SHARDED", str(e))
print("MARKER", os.path.exists(marker))
try:  # control: Megatron's stock strategy unpickles .metadata unrestricted
    dist_checkpointing.load(request(), evil)
except BaseException:
    pass
print("CONTROL", os.path.exists(marker))
dist.destroy_process_group()
"""


def _loaders(trained, run, ckpt, tmp):
    """name -> argv (after the python executable) of each loader, pointed at the planted checkpoint;
    "megatron": the script above, on a checkpoint of its own (its control runs the payload)."""
    (tmp / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2, 3, 4]}) + "\n")
    train = ["-m", "gspo_megatron.train", "--config", TINY, *TP1, *QUIET]
    good = trained / "checkpoints" / "iter_0000001"
    own = tmp / "megatron_ckpt"
    shutil.copytree(good, own)
    _plant(own, str(tmp / "MEGATRON_MARKER"))
    return {
        "megatron": ["-c", _MEGATRON_SCRIPT, str(good), str(own), str(tmp / "MEGATRON_MARKER"), str(tmp / "store")],
        "mcore-to-hf": ["-m", "converters.cli", "mcore-to-hf", "--load", str(run / "checkpoints"),
                        "--out", str(tmp / "hf"), "--no-progress"],
        "score": ["-m", "gspo_megatron.score", "--load", str(ckpt), "--input", str(tmp / "in.jsonl"),
                  "--output", str(tmp / "out.jsonl")],
        "model.load": [*train, f"out_dir={tmp / 'from_model_load'}", f"model.load={ckpt}"],
        "resume=<path>": [*train, f"out_dir={tmp / 'from_resume_path'}", f"checkpoint.resume={ckpt}"],
        "resume=auto": [*train, f"out_dir={run}", "checkpoint.resume=auto"],
        **{f"forged {what}": [*train, f"out_dir={_planted_run(trained, tmp, what)}", "checkpoint.resume=auto"]
           for what in FORGED},
    }


def _planted_run(trained, tmp, what: str):
    """A copy of the trained run with a forged torch.save file, checksums.json updated as an
    attacker would: "numpy": common.pt holding a numpy array of dtype object inside the trainer
    state (numpy's _reconstruct, ndarray, dtype: globals `import megatron.core` adds to torch's
    weights-only allow-list; the issue's probe forged an object array's pointers, a segfault);
    "object_rng": rank 0's RNG file holding a numpy array of dtype object; "system": common.pt
    whose trainer state unpickles through os.system."""
    import numpy as np
    import torch

    from gspo_megatron.checkpoint import integrity

    run = tmp / f"{what}_run"
    shutil.copytree(trained, run)
    ckpt = run / "checkpoints" / "iter_0000001"
    name = "common.pt"
    common = torch.load(ckpt / "common.pt", weights_only=True)  # our own fresh checkpoint: trusted
    if what == "numpy":
        common["trainer"]["planted"] = np.array([1, "x", None], dtype=object)  # a numpy dtype of objects
        torch.save(common, ckpt / name)
    elif what == "system":
        common["trainer"]["planted"] = _Payload(str(tmp / f"{what}_MARKER"))
        torch.save(common, ckpt / name)
    else:
        name = "rng/rank_00000.pt"  # train/checkpoint.py _rng_path
        rng = torch.load(ckpt / name, weights_only=True)
        rng["planted"] = np.array([1, "x", None], dtype=object)
        torch.save(rng, ckpt / name)
    recorded = integrity.read(str(ckpt))
    assert name in recorded, sorted(recorded)  # the forged file is one the checksums cover
    recorded.update(integrity.compute(str(ckpt), [name]))
    integrity.write(str(ckpt), recorded)
    return run


@pytest.fixture(scope="module")
def loader_runs(trained, evil, tmp_path_factory):
    """Every loader run once against a planted checkpoint, a few at a time (each mostly imports)."""
    run, ckpt, marker = evil
    tmp = tmp_path_factory.mktemp("loaders")
    argvs = _loaders(trained, run, ckpt, tmp)
    with ThreadPoolExecutor(max_workers=3) as pool:
        done = dict(zip(argvs, pool.map(_run, argvs.values())))
    done["marker_after_loaders"] = marker.exists()
    done["forged_dirs"] = {what: str(tmp / f"{what}_run") for what in FORGED}
    done["forged_marker"] = (tmp / "system_MARKER").exists()
    return done, ckpt, tmp / "megatron_ckpt"


@pytest.mark.timeout(600)
def test_megatron_load_path_reads_metadata_safely(loader_runs):
    """gspo_megatron.checkpoint.mcore.load_sharded (the trainer's optimizer loads) and Megatron's
    dist_checkpointing.load with the safe strategies: a legitimate tensor loads; the planted file
    is refused without running; Megatron's stock strategy would have run it (the control)."""
    done, _, ckpt = loader_runs
    r = done["megatron"]
    assert r.returncode == 0, explain(r.stderr)
    out = r.stdout
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert "GOOD loaded" in out and "STRATEGY refused" in out and REFUSED in lines["STRATEGY"], out
    assert "MARKER True" not in out, out
    assert lines["LOAD_SHARDED"].startswith(f"{ckpt / '.metadata'}: refusing to unpickle the global {REFUSED}"), out
    assert lines["CONTROL"] == "True", out  # the stock path is the hole this closes


@pytest.mark.timeout(600)
def test_megatron_load_copy_is_pinned(loader_runs):
    """SafeTorchDistLoadStrategy.load is a copy of Megatron's with the reader replaced: an upgrade
    that changes the upstream method fails here, so the copy is re-checked."""
    from gspo_megatron.checkpoint.megatron_load import UPSTREAM_LOAD_SHA256

    r = loader_runs[0]["megatron"]
    assert f"UPSTREAM_SHA {UPSTREAM_LOAD_SHA256}" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Every entry point that loads a torch_dist checkpoint


FORGED = {"numpy": ("common.pt", "the global numpy."), "object_rng": ("rng", "the global numpy."),
          "system": ("common.pt", f"the global {REFUSED}")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", list(FORGED))
def test_resume_refuses_a_forged_torch_save_file_in_one_line_and_releases_the_lock(loader_runs, what):
    """checkpoint.resume=auto onto a checkpoint with a forged torch.save file (checksums
    recomputed): a common.pt building a numpy object array from globals Megatron registers with torch,
    an RNG file holding a numpy array of dtype object, a common.pt whose state calls os.system.
    Each: one line naming the file and the refused global, exit 2, nothing run, and the run lock
    released (the issue's forged object array segfaulted here and left the lock behind)."""
    from gspo_megatron.train.runlock import LOCK_FILE

    done, _, _ = loader_runs
    r = done[f"forged {what}"]
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert len(errors) == 1, r.stderr[-3000:]
    file, refused = FORGED[what]
    assert f": refusing to unpickle {refused}" in errors[0] and file in errors[0], errors[0]
    out_dir = done["forged_dirs"][what]
    assert not os.path.exists(os.path.join(out_dir, LOCK_FILE)), os.listdir(out_dir)
    assert done["forged_marker"] is False  # os.system never ran


@pytest.mark.timeout(600)
@pytest.mark.parametrize("loader", ["mcore-to-hf", "score", "model.load", "resume=<path>", "resume=auto"])
def test_every_loader_refuses_a_code_running_metadata(loader_runs, loader):
    done, ckpt, _ = loader_runs
    r = done[loader]
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower()]
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert len(errors) == 1, r.stderr[-3000:]
    assert f"{ckpt / '.metadata'}: refusing to unpickle the global {REFUSED}" in errors[0], errors[0]
    assert done["marker_after_loaders"] is False  # no loader ran the payload


def test_megatron_lm_common_pt_with_run_arguments_loads_and_code_does_not_run(tmp_path):
    """Megatron-LM's common.pt holds its run arguments as an argparse.Namespace (with Megatron-Core
    enums inside). Weights-only loading admitted them only once megatron.core was imported (its
    __init__ registers them process-wide: megatron/core/safe_globals.py:18-42), so a load before
    that (a fresh process reading a Megatron-LM checkpoint) was refused (issue 41, 5c). Now they
    are admitted as data whatever was imported; anything else is still refused, unrun."""
    import argparse

    import torch
    from megatron.core.transformer.enums import AttnBackend

    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    marker = tmp_path / "ran"
    args = argparse.Namespace(num_layers=2, attention_backend=AttnBackend.auto, params_dtype=torch.bfloat16)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7}, good / "common.pt")
    torch.save({"args": argparse.Namespace(x=_Payload(str(marker)))}, bad / "common.pt")
    code = f"""
import sys
from gspo_megatron.checkpoint.megatron_load import load_common_state_dict
from gspo_megatron.errors import CheckpointError
assert "megatron.core" not in sys.modules  # nothing registered Megatron's safe globals yet
c = load_common_state_dict({str(good)!r})
print(c["iteration"], c["args"].num_layers, c["args"].attention_backend.name)
try:
    load_common_state_dict({str(bad)!r})
except CheckpointError as e:
    print("refused:", e)
"""
    r = _run(["-c", code])
    assert r.returncode == 0, explain(r.stderr)
    out = r.stdout.splitlines()
    assert out[0] == "7 2 auto", r.stdout
    assert out[1].startswith("refused:") and "refusing to unpickle the global" in out[1], r.stdout
    assert not marker.exists()
