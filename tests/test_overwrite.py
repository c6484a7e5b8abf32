"""Replacing an output deletes it, so a command replaces only what it can prove it wrote
(gspo_megatron/fsutil.py: the marker .gspo-output.json names the command and every entry).

What the tests show:
  * `gspo-convert ... --overwrite` into a folder the command did not write — a run's checkpoint
    root, a downloaded HF folder with the user's notes and .git/, an output of the other command,
    one of an earlier version (no marker), an earlier output the user added a file to — exits 2
    with one line naming the folder and what would have gone, and every file stays;
  * an earlier output of the same command is replaced (both directions), and so is an earlier
    export of the trainer (checkpoint.export_hf), which never replaces a user's folder either;
  * an interrupted replacement (killed between its renames, or while deleting the old copy) is
    undone or finished by the next run of the command, and in the trainer's checkpoint folder.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors.torch import load_file

from megatron_utils import make_tiny_hf

MARKER = ".gspo-output.json"


def tree(d) -> dict:
    """Every entry under `d`: file bytes, None for a directory."""
    out = {}
    for root, dirs, files in os.walk(str(d)):
        for n in dirs:
            out[os.path.relpath(os.path.join(root, n), str(d))] = None
        for n in files:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), str(d))] = f.read()
    return out


def cli(*argv) -> None:
    from converters.cli import main

    assert main([*map(str, argv), "--no-progress"]) == 0


def fails(capsys, *argv) -> str:
    """The one error line of a converter run that must exit 2."""
    from converters.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*map(str, argv), "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2, err[-2000:]
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("gspo-convert: error:")]
    assert len(lines) == 1, err[-2000:]
    return lines[0]


def hf_tensors(d) -> dict:
    out = {}
    for f in sorted(os.listdir(str(d))):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(str(d), f)))
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("overwrite")
    make_tiny_hf(root / "hf", seed=0)
    cli("hf-to-mcore", "--hf-dir", root / "hf", "--out", root / "mc")
    return root / "hf", root / "mc"


def test_hf_to_mcore_keeps_a_run_it_did_not_write(ckpts, tmp_path, capsys):
    """Before: a Megatron root with a tracker looked like the converter's output, and
    `hf-to-mcore --out <run>/checkpoints --overwrite` replaced the run's iterations."""
    hf, _ = ckpts
    root = tmp_path / "run" / "checkpoints"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "iter_0000003" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (root / "iter_0000003" / "__0_0.distcp").write_bytes(b"weights" * 100)
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    before = tree(root)
    line = fails(capsys, "hf-to-mcore", "--hf-dir", hf, "--out", root, "--overwrite")
    assert str(root) in line and "replaces only a previous hf-to-mcore output" in line
    assert "iter_0000003/" in line and "latest_checkpointed_iteration.txt" in line and "delete it yourself" in line
    assert tree(root) == before
    assert sorted(os.listdir(root.parent)) == ["checkpoints"]  # no temporary directory left beside it


def test_mcore_to_hf_keeps_a_downloaded_folder(ckpts, tmp_path, capsys):
    """Before: any folder with config.json and safetensors counted as the converter's: a
    downloaded model's NOTES.md and .git/ went with it."""
    hf, mc = ckpts
    dl = tmp_path / "Qwen3-tiny"
    shutil.copytree(hf, dl)
    (dl / "NOTES.md").write_text("my notes")
    (dl / ".git" / "objects").mkdir(parents=True)
    (dl / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = tree(dl)
    line = fails(capsys, "mcore-to-hf", "--load", mc, "--out", dl, "--overwrite")
    assert str(dl) in line and "no .gspo-output.json" in line and ".git/" in line and "more)" in line
    assert tree(dl) == before


def test_an_earlier_output_of_the_same_command_is_replaced_and_nothing_else(ckpts, tmp_path, capsys):
    hf, mc = ckpts
    # hf-to-mcore over its own output: replaced (the new one marked the same)
    out = tmp_path / "mc"
    cli("hf-to-mcore", "--hf-dir", hf, "--out", out)
    (out / "iter_0000000" / "common.pt").write_bytes(b"stale")  # shows the replacement happened
    cli("hf-to-mcore", "--hf-dir", hf, "--out", out, "--overwrite")
    assert (out / "iter_0000000" / "common.pt").read_bytes() != b"stale"
    assert json.loads((out / MARKER).read_text())["written_by"] == "hf-to-mcore"
    # mcore-to-hf over its own output: replaced, bit-exact
    back = tmp_path / "back"
    cli("mcore-to-hf", "--load", mc, "--out", back)
    cli("mcore-to-hf", "--load", mc, "--out", back, "--overwrite")
    want = hf_tensors(hf)
    got = hf_tensors(back)
    assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)
    assert json.loads((back / MARKER).read_text())["written_by"] == "mcore-to-hf"

    # the other command's output: refused
    before = tree(out)
    line = fails(capsys, "mcore-to-hf", "--load", mc, "--out", out, "--overwrite")
    assert "its .gspo-output.json names 'hf-to-mcore'" in line and str(out) in line
    assert tree(out) == before
    # an earlier output the user added files to: refused, naming them, all kept
    (back / "README.md").write_text("model card")
    (back / "eval").mkdir()
    (back / "eval" / "scores.json").write_text("{}")
    before = tree(back)
    line = fails(capsys, "mcore-to-hf", "--load", mc, "--out", back, "--overwrite")
    assert "README.md" in line and "eval/" in line and "scores.json" not in line and "did not write" in line
    assert tree(back) == before
    # an output of an earlier version (no marker): refused with what to do
    (out / MARKER).unlink()
    before = tree(out)
    line = fails(capsys, "hf-to-mcore", "--hf-dir", hf, "--out", out, "--overwrite")
    assert "no .gspo-output.json" in line and "delete it yourself" in line
    assert tree(out) == before


def test_the_trainer_export_replaces_only_an_earlier_export(ckpts, tmp_path):
    """Before: checkpoint.export_hf replaced whatever <out_dir>/hf held. Called as
    train/setup.py export_hf calls it."""
    from gspo_megatron.model.hf_writer import save_hf_checkpoint

    hf, _ = ckpts
    tensors = hf_tensors(hf)
    cfg = json.loads((hf / "config.json").read_text())
    out = tmp_path / "run" / "hf"
    out.mkdir(parents=True)
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(ValueError) as e:
        save_hf_checkpoint(iter(tensors.items()), str(out), cfg)
    msg = str(e.value)
    assert "\n" not in msg and str(out) in msg and "NOTES.md" in msg and "checkpoint.export_hf" in msg
    assert tree(out) == {"NOTES.md": b"mine"}
    assert os.listdir(out.parent) == ["hf"]  # the written export discarded, no temporary directory
    from gspo_megatron.model.hf_writer import check_export_target

    with pytest.raises(ValueError, match="NOTES.md"):  # the same refusal before any work
        check_export_target(str(out))
    # an earlier export, with the tokenizer files export_hf writes into it afterwards: replaced
    shutil.rmtree(out)
    save_hf_checkpoint(iter(tensors.items()), str(out), cfg)
    (out / "tokenizer.json").write_text("{}")
    (out / "model.safetensors.index.json").write_text("{}")  # shows the replacement happened
    check_export_target(str(out))
    save_hf_checkpoint(iter(tensors.items()), str(out), cfg)
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not (out / "tokenizer.json").exists()


def test_an_interrupted_replacement_is_finished_or_undone(ckpts, tmp_path, capsys, caplog):
    """Before: a replacement killed between its renames left the previous output only as
    `.<name>.old-*`, and one killed while deleting the old copy left that copy, forever."""
    _, mc = ckpts
    back = tmp_path / "back"
    cli("mcore-to-hf", "--load", mc, "--out", back)
    # killed while deleting the old copy: the next run of the command deletes it
    old = tmp_path / ".back.old-k1ll3d_1"
    shutil.copytree(back, old)
    cli("mcore-to-hf", "--load", mc, "--out", back, "--overwrite")
    assert not old.exists() and back.is_dir()
    assert f"removed {old}: the previous {back}" in caplog.text
    # killed between the renames (the output renamed aside, the new one not in yet): put back,
    # so a run without --overwrite finds it as before
    before = tree(back)
    os.rename(back, old)
    caplog.clear()
    line = fails(capsys, "mcore-to-hf", "--load", mc, "--out", back)
    assert "already exists" in line and tree(back) == before and not old.exists()
    assert f"restored {back} from {old}" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["back"]

    # the trainer's checkpoint folder (train/checkpoint.py cleans it before resolving a resume)
    from gspo_megatron.fsutil import recover_all

    root = tmp_path / "checkpoints"
    for name, content in (("iter_0000004", "new"), (".iter_0000004.old-abcdefgh", "old"),
                          (".iter_0000005.old-12345678", "five")):
        (root / name).mkdir(parents=True)
        (root / name / "common.pt").write_text(content)
    recover_all(str(root))
    assert sorted(os.listdir(root)) == ["iter_0000004", "iter_0000005"]
    assert (root / "iter_0000004" / "common.pt").read_text() == "new"
    assert (root / "iter_0000005" / "common.pt").read_text() == "five"
