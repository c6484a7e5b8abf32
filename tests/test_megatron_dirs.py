"""Megatron-LM / Megatron-Bridge checkpoint conventions (gspo_megatron/checkpoint/megatron_dirs.py), without
Megatron-Bridge itself (tests/test_megatron_bridge.py runs it): roots and trackers resolve to the
torch_dist directory, the run_config.yaml we write reads back as the same architecture (and is
the only config a checkpoint needs), the `_extra_state` entries Bridge's loaders ask for are
stored with what Megatron writes for "no extra state", and the local-spec key of the pre-MLP norm
(what Megatron-Bridge and Megatron-LM runs without Transformer Engine write) is read."""
from __future__ import annotations

import io
import shutil

import pytest
import torch

from gspo_megatron import resolve
from gspo_megatron.checkpoint import megatron_dirs
from converters.cli import main as cli
from gspo_megatron.errors import CheckpointError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.errors import ModelConfigError
from megatron_utils import make_tiny_hf
from test_converters import ITER0, assert_bit_exact, hf_tensors


def _convert(hf, out, *extra):
    assert cli(["hf-to-mcore", "--hf-dir", str(hf), "--out", str(out), "--no-progress", *extra]) == 0


def test_resolve_roots_trackers_and_iterations(tmp_path):
    def ckpt(d):
        d.mkdir(parents=True)
        (d / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
        return d

    root = tmp_path / "root"
    for n in (5, 40, 100):
        ckpt(root / f"iter_{n:07d}")
    assert megatron_dirs.resolve(str(root)) == str(root / "iter_0000100")  # no tracker: the newest
    megatron_dirs.write_tracker(str(root), 40)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "40\n"
    assert megatron_dirs.resolve(str(root)) == str(root / "iter_0000040")  # the tracker decides
    assert megatron_dirs.resolve(str(root / "iter_0000005")) == str(root / "iter_0000005")
    ckpt(root / "release")
    megatron_dirs.write_tracker(str(root), "release")
    assert megatron_dirs.resolve(str(root)) == str(root / "release")
    megatron_dirs.write_tracker(str(root), 7)
    with pytest.raises(CheckpointError, match="names iter_0000007, but .* is not a torch_dist checkpoint"):
        megatron_dirs.resolve(str(root))
    (root / "latest_checkpointed_iteration.txt").write_text("latest\n")
    with pytest.raises(CheckpointError, match="expected an iteration number or 'release'"):
        megatron_dirs.resolve(str(root))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no metadata.json, no latest_checkpointed_iteration.txt, no iter_"):
        megatron_dirs.resolve(str(tmp_path / "empty"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("mdirs")
    make_tiny_hf(d / "hf", seed=4, dtype=torch.float32)
    _convert(d / "hf", d / "mc")
    return d / "hf", d / "mc"


def test_converter_writes_a_megatron_lm_root_with_bridge_files(converted):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    hf, mc = converted
    # iteration 0, as Megatron-Bridge's own save writes a converted model: iter_0000000/, the
    # Megatron-LM tracker "0" and Bridge's train state (step 0; plain tensors, weights_only reads it),
    # and our output marker (gspo_megatron/fsutil.py: what --overwrite may replace; Megatron reads
    # only the tracker and iter_* of a root)
    assert sorted(p.name for p in mc.iterdir()) == [".gspo-output.json", ITER0, "latest_checkpointed_iteration.txt",
                                                    "latest_train_state.pt"]
    assert (mc / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert megatron_dirs.resolve(str(mc)) == str(mc / ITER0)
    for state in (mc / "latest_train_state.pt", mc / ITER0 / "train_state.pt"):
        ts = torch.load(state, weights_only=True)
        assert ts["step"].item() == 0 and ts["step"].dtype == torch.int32, ts
        assert set(ts) == {"step", "consumed_train_samples", "skipped_train_samples", "consumed_valid_samples",
                           "floating_point_operations_so_far", "do_train", "do_valid", "do_test"}
    ck = mc / ITER0
    common = torch.load(ck / "common.pt", weights_only=True)
    assert common == {"content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}}
    md = FileSystemReader(str(ck)).read_metadata().state_dict_metadata
    objects = {k for k, v in md.items() if isinstance(v, BytesStorageMetadata)}
    arch = MoeArch.from_hf_dir(str(hf))
    L, E = arch.num_layers, arch.num_experts
    # the keys Megatron-Bridge 0.3.1 requests of a checkpoint (its own CPU save, tests/README.md)
    for k in (f"decoder.layers.self_attention.linear_qkv._extra_state/shard_0_{L}",
              f"decoder.layers.self_attention.linear_proj._extra_state/shard_{L - 1}_{L}",
              f"decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.{E - 1}_{L}.{E}",
              f"decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_0.0_{L}.{E}"):
        assert k in objects, k
    assert len(objects) == len(megatron_dirs.extra_state_objects(arch))
    # each holds what Megatron writes for a module without extra state: torch.save([None]) (read
    # from the data file at the offset .metadata gives, with weights_only=True: DCP's own byte
    # loading unpickles with weights_only=False)
    storage = FileSystemReader(str(ck)).read_metadata().storage_data
    for idx, info in storage.items():
        if idx.fqn in objects:
            with open(ck / info.relative_path, "rb") as f:
                f.seek(info.offset)
                assert torch.load(io.BytesIO(f.read(info.length)), weights_only=True) == [None]


def _as_release_root(mc, dst):
    """The converter's output as earlier versions wrote it: release/ and the tracker "release"."""
    shutil.copytree(mc, dst)
    (dst / ITER0).rename(dst / "release")
    (dst / "release" / "train_state.pt").unlink()
    (dst / "latest_train_state.pt").unlink()
    (dst / "release" / "checksums.json").unlink()  # earlier versions wrote none
    megatron_dirs.write_tracker(str(dst), "release")
    return dst


def test_release_roots_of_earlier_versions_still_read(converted, tmp_path):
    """A root with release/ (what hf-to-mcore wrote before it wrote iteration 0) converts back
    bit-exactly, gives its architecture to model.load and is refused by --overwrite (it has no
    output marker, gspo_megatron/fsutil.py: nothing proves it is the converter's)."""
    from gspo_megatron.checkpoint.mcore import read_mcore_arch
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train.setup import read_load_source

    hf, mc = converted
    old = _as_release_root(mc, tmp_path / "old")
    assert megatron_dirs.resolve(str(old)) == str(old / "release")
    assert read_mcore_arch(str(old)) == MoeArch.from_hf_dir(str(hf))
    assert cli(["mcore-to-hf", "--load", str(old), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "out"))
    cfg = load_config(None, [f"model.load={old}", "model.hf_config=null"])
    load = read_load_source(cfg)
    assert load.directory == str(old / "release") and load.hf_config_dir == str(old / "release" / "hf_config")
    assert MoeArch.from_hf_dict(resolve.hf_config_dict(cfg, load)) == MoeArch.from_hf_dir(str(hf))
    with pytest.raises(SystemExit) as e:
        cli(["hf-to-mcore", "--hf-dir", str(hf), "--out", str(old), "--overwrite", "--no-progress"])
    assert e.value.code == 2 and (old / "release").is_dir() and not (old / ITER0).exists()


def test_model_load_is_resolved_where_the_run_is_set_up(converted, tmp_path):
    """config.py reads no checkpoint format: load_config takes model.load=<root> without reading
    it, train/setup.py read_load_source resolves the root (one ConfigError line naming the file),
    and Config.hf_config_dict refuses to guess without what that read."""
    from gspo_megatron.config import ConfigError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train.setup import read_load_source

    hf, mc = converted
    cfg = load_config(None, [f"model.load={mc}", "model.hf_config=null"])
    with pytest.raises(ValueError, match="read_load_source"):
        resolve.hf_config_dict(cfg)
    load = read_load_source(cfg)
    assert load.directory == str(mc / ITER0) and load.carried is None
    assert cfg.model_sources(load) == [("model.load", str(mc / ITER0 / "hf_config"))]
    # without hf_config/: the architecture from Megatron-Bridge's run_config.yaml
    bare = tmp_path / "bare"
    shutil.copytree(mc, bare)
    shutil.rmtree(bare / ITER0 / "hf_config")
    cfg = load_config(None, [f"model.load={bare}", "model.hf_config=null"])
    load = read_load_source(cfg)
    assert load.hf_config_dir is None and load.carried[1] == str(bare / ITER0 / "run_config.yaml")
    assert MoeArch.from_hf_dict(resolve.hf_config_dict(cfg, load)) == MoeArch.from_hf_dir(str(hf))
    assert cfg.model_sources(load) == []
    # a tracker naming an iteration that is not there: one line naming the tracker
    megatron_dirs.write_tracker(str(bare), 7)
    with pytest.raises(ConfigError, match=r"^model.load: .*latest_checkpointed_iteration.txt names iter_0000007, "
                                          r"but .* is not a torch_dist checkpoint"):
        read_load_source(load_config(None, [f"model.load={bare}", "model.hf_config=null"]))


def test_run_config_is_enough_to_read_a_checkpoint(converted, tmp_path):
    """Without hf_config/, mcore-to-hf --load <root> takes the architecture from run_config.yaml
    (as for a Megatron-Bridge checkpoint): bit-exact, no flags."""
    hf, mc = converted
    arch = MoeArch.from_hf_dir(str(hf))
    back, path = megatron_dirs.hf_config_from_run_config(str(mc / ITER0))
    assert MoeArch.from_hf_dict(back) == arch and path.endswith("run_config.yaml")

    bare = tmp_path / "bare"
    shutil.copytree(mc, bare)
    shutil.rmtree(bare / ITER0 / "hf_config")
    (bare / ITER0 / "checksums.json").unlink()  # as Megatron-Bridge writes it: no checksums
    assert cli(["mcore-to-hf", "--load", str(bare), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "out"))

    import yaml

    run = yaml.safe_load((bare / ITER0 / "run_config.yaml").read_text())
    run["model"]["normalization"] = "LayerNorm"
    (bare / ITER0 / "run_config.yaml").write_text(yaml.safe_dump(run))
    with pytest.raises(ModelConfigError, match=r"run_config.yaml: model.normalization is 'LayerNorm'; a Qwen3-MoE has 'RMSNorm'"):
        megatron_dirs.hf_config_from_run_config(str(bare / ITER0))


def test_local_spec_pre_mlp_norm_key_is_read(converted, tmp_path):
    """A checkpoint that stores the pre-MLP norm under the local spec's name (Megatron-Bridge or
    Megatron-LM without Transformer Engine) converts bit-exactly: the DCP key is renamed in a
    copy of our checkpoint (the .metadata maps it; the data files are untouched)."""
    import pickle

    hf, mc = converted
    alias = tmp_path / "alias"
    shutil.copytree(mc, alias)
    meta = alias / ITER0 / ".metadata"
    md = pickle.loads(meta.read_bytes())
    te, local = "decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    md.state_dict_metadata[local] = md.state_dict_metadata.pop(te)
    md.storage_data = {type(k)(local if k.fqn == te else k.fqn, k.offset, k.index): v for k, v in md.storage_data.items()}
    meta.write_bytes(pickle.dumps(md))
    (alias / ITER0 / "checksums.json").unlink()  # another tool's checkpoint: no checksums
    assert cli(["mcore-to-hf", "--load", str(alias), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "out"))


def _mlm_args(arch: MoeArch, **extra):
    """The run arguments Megatron-LM's pretrain_gpt.py keeps in common.pt for this architecture
    (megatron/training/arguments.py names; an enum and a torch dtype among them, as there)."""
    import argparse

    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.moe_intermediate_size,
        num_attention_heads=arch.num_attention_heads, group_query_attention=True,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim, num_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk, moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_pre_softmax=not arch.norm_topk_prob, moe_layer_freq=[1] * arch.num_layers,
        norm_epsilon=arch.rms_norm_eps, rotary_base=arch.rope_theta, qk_layernorm=True, normalization="RMSNorm",
        swiglu=True, add_bias_linear=False, add_qkv_bias=False, position_embedding_type="rope",
        untie_embeddings_and_output_weights=not arch.tie_word_embeddings, vocab_size=arch.vocab_size,
        padded_vocab_size=arch.vocab_size + 4, max_position_embeddings=arch.max_position_embeddings,
        seq_length=4096, params_dtype=torch.float32, bf16=False, attention_backend=AttnBackend.auto, **extra)


def test_megatron_lm_run_arguments_are_read_safely(converted, tmp_path):
    """A Megatron-LM root that carries its config only as run arguments in common.pt converts with
    no flags, bit-exact; an argument of a type that could run code is refused in one line."""
    import functools

    hf, mc = converted
    arch = MoeArch.from_hf_dir(str(hf))
    mlm = tmp_path / "mlm"
    shutil.copytree(mc, mlm)
    shutil.rmtree(mlm / ITER0 / "hf_config")
    (mlm / ITER0 / "run_config.yaml").unlink()
    torch.save({"args": _mlm_args(arch), "checkpoint_version": 3.0, "iteration": 0},
               mlm / ITER0 / "common.pt")
    (mlm / ITER0 / "checksums.json").unlink()  # Megatron-LM writes none
    back, _ = megatron_dirs.carried_config(str(mlm / ITER0))
    assert MoeArch.from_hf_dict(back) == arch
    assert cli(["mcore-to-hf", "--load", str(mlm), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    assert_bit_exact(hf_tensors(hf), hf_tensors(tmp_path / "out"))

    torch.save({"args": _mlm_args(arch, hook=functools.partial(print, "x"))}, mlm / ITER0 / "common.pt")
    with pytest.raises(ModelConfigError, match=r"common.pt: refusing to unpickle the global functools.partial .*"
                                                r"nothing from the file was run; pass --hf-config-dir"):
        megatron_dirs.carried_config(str(mlm / ITER0))
