"""Megatron-Core's torch_dist loading with nothing unpickled unrestricted.

`megatron.core.dist_checkpointing.load` reads two pickles besides the tensor data:

* `.metadata`, through TorchDistLoadShardedStrategy.load, which builds its reader with the
  module-level `_get_filesystem_reader` (dist_checkpointing/strategies/torch.py:750-760, :798) —
  PyTorch's FileSystemReader, whose read_metadata is an unrestricted pickle.load
  (torch/distributed/checkpoint/filesystem.py:926-930). The strategy takes no reader argument, so
  `SafeTorchDistLoadStrategy.load` is a copy of the upstream method (megatron-core 0.16.1,
  strategies/torch.py:770-821) with that line replaced by the restricted reader
  (safe_metadata.py), and the planner by SafeLoadPlanner (byte entries, below).
  UPSTREAM_LOAD_SHA256 pins the upstream source: tests/test_safe_loading.py fails when an
  upgrade changes it, so the copy is re-checked rather than silently stale. The
  other upstream readers of `.metadata` (load_tensors_metadata, load_sharded_metadata) are
  overridden too; remove_sharded_tensors (which rewrites a checkpoint) is refused.
* `common.pt`, through TorchCommonLoadStrategy.load_common: `torch.load(path)` with no
  weights_only argument (strategies/common.py:89), i.e. weights-only by torch's default since 2.6
  — unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is in the environment, which flips a call that does
  not pass weights_only to a full unpickle (torch/serialization.py:1480-1505). Weights-only is not
  enough either: its allow-list is process-wide, and `import megatron.core` adds numpy's
  `_reconstruct` and `ndarray` to it (megatron/core/safe_globals.py), enough for a numpy object
  array over forged pointers (a segfault from a file). `SafeCommonLoadStrategy` reads it with the
  project's own restricted unpickler (safe_torch.py) and refuses ShardedObject files
  (`<key>/shard_*.pt`).

The data files torch itself reads with torch.load(weights_only=True) (filesystem.py:899-903);
SafeFileSystemReader.read_data (safe_metadata.py) decodes each tensor chunk with safe_torch instead. Byte
entries are the other way code could run: for every requested key whose `.metadata` entry is a
BytesStorageMetadata, DCP plans a BYTE_IO read whatever the request holds (a tensor included:
planner_helpers.py:439-459, _create_read_items; Megatron's global-shape check reads only the
entry's `size`, strategies/torch.py:503-518, which a crafted entry can carry), FileSystemReader
hands those bytes to planner.load_bytes (filesystem.py:884-887), and torch's DefaultLoadPlanner,
whose load_bytes Megatron's MCoreLoadPlanner inherits (strategies/torch.py:484), unpickles them
with torch.load(weights_only=False) (default_planner.py:382-392). The project loads tensors only,
so a byte entry is refused at each of three places, each enough on its own:
  1. mcore.py load_sharded: a requested key whose entry is a byte entry, before Megatron starts;
  2. SafeLoadPlanner (used by SafeTorchDistLoadStrategy.load): no BYTE_IO item in a local plan,
     and its load_bytes refuses instead of unpickling;
  3. safe_metadata.SafeFileSystemReader.read_data: no BYTE_IO read, whatever the planner.
The restricted unpickler itself (safe_metadata.py) refuses a `size` (or anything undeclared) on a
BytesStorageMetadata, so the crafted entry of (1) is refused before any of them.
"""
from __future__ import annotations

import os

from gspo_megatron.checkpoint.safe_metadata import (
    METADATA_FILE,
    byte_entry_error,
    read_dcp_metadata,
    require_tensor_entries,
    safe_file_system_reader,
)
from gspo_megatron.errors import CheckpointError

# sha256 of inspect.getsource(TorchDistLoadShardedStrategy.load) in megatron-core 0.16.1
UPSTREAM_LOAD_SHA256 = "960cfa14f177d722fda23c97fdc3d90dd078a2b98d28fbaeefe63dd1cc9c37db"


def upstream_load_sha256() -> str:
    import hashlib
    import inspect

    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    return hashlib.sha256(inspect.getsource(TorchDistLoadShardedStrategy.load).encode()).hexdigest()


def _same_dir(a, b) -> bool:
    return os.path.realpath(os.fspath(a)) == os.path.realpath(os.fspath(b))


def _strategy_classes():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        """Megatron's torch_dist load strategy reading `.metadata` with the restricted unpickler.
        `metadata`/`directory`: the checkpoint's metadata already read that way (used when the load
        is of that directory), so the file is parsed once and what was checked is what is used."""

        def __init__(self, metadata=None, directory=None):
            super().__init__()
            self._known = (directory, metadata) if metadata is not None else None

        def _metadata(self, checkpoint_dir):
            if self._known is not None and _same_dir(self._known[0], checkpoint_dir):
                return self._known[1]
            md = read_dcp_metadata(checkpoint_dir)
            self._known = (checkpoint_dir, md)
            return md

        def load(self, sharded_state_dict, checkpoint_dir):
            # megatron-core 0.16.1 strategies/torch.py:770-821, but for the reader and the planner
            # (both marked [changed])
            from typing import Dict, List, Union, cast
            import io

            from megatron.core.dist_checkpointing.dict_utils import nested_values
            from megatron.core.dist_checkpointing.mapping import ShardedTensor
            from megatron.core.dist_checkpointing.strategies.torch import (
                _replace_sharded_keys_with_state_dict_keys,
                _replace_state_dict_keys_with_sharded_keys,
                _restore_dict_types,
                _unwrap_pyt_sharded_tensor,
                mcore_to_pyt_state_dict,
            )
            from torch.distributed import checkpoint
            from torch.distributed._shard.sharded_tensor import ShardedTensor as TorchShardedTensor

            flexible_shape_sharded_tensors = [
                sh_ten
                for sh_ten in nested_values(sharded_state_dict)
                if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch
            ]
            allow_shape_mismatch_sharded_tensors = {
                sh_ten.key: sh_ten
                for sh_ten in nested_values(sharded_state_dict)
                if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch
            }

            orig_sharded_state_dict = sharded_state_dict
            # MCore state dict to PyT Distributed compatible
            (sharded_state_dict, flat_mapping, rename_mapping) = (
                _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
            )
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, True)
            # Load PyT Distributed format
            # [changed] upstream: fsr = _get_filesystem_reader(checkpoint_dir, cache_metadata=True)
            fsr = safe_file_system_reader(checkpoint_dir, self._metadata(checkpoint_dir))
            checkpoint.load_state_dict(
                pyt_state_dict,
                fsr,
                # [changed] upstream: planner=MCoreLoadPlanner(
                planner=safe_load_planner(
                    source=checkpoint_dir,
                    shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
                    allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors,
                ),
            )

            self.cached_global_metadata = (
                fsr.read_metadata()
            )  # no storage interaction thanks to caching

            pyt_state_dict = cast(
                Dict[str, Union[TorchShardedTensor, List[io.BytesIO]]], pyt_state_dict
            )
            # Unwrap ShardedTensors and return to original state dict
            mcore_state_dict = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
            mcore_state_dict = _replace_sharded_keys_with_state_dict_keys(
                mcore_state_dict, flat_mapping, rename_mapping  # type: ignore[arg-type]
            )
            _restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
            return mcore_state_dict

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            return super().load_tensors_metadata(
                checkpoint_dir, metadata if metadata is not None else self._metadata(checkpoint_dir))

        def load_sharded_metadata(self, checkpoint_dir):
            # upstream strategies/torch.py:841-854, but for the reader
            from megatron.core.dist_checkpointing.mapping import ShardedObject
            from torch.distributed.checkpoint.metadata import BytesStorageMetadata

            metadata = self._metadata(checkpoint_dir)
            sharded_metadata = {}
            for metadata_key, storage_metadata in metadata.state_dict_metadata.items():
                if not isinstance(storage_metadata, BytesStorageMetadata):
                    continue
                sh_obj = ShardedObject.empty_from_unique_key(metadata_key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
            sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir, metadata))
            return sharded_metadata

        def remove_sharded_tensors(self, checkpoint_dir, key_prefix):
            raise NotImplementedError("SafeTorchDistLoadStrategy only loads")

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        """Megatron's common.pt read with the restricted unpickler (safe_torch.py); no ShardedObjects."""

        def load_common(self, checkpoint_dir):
            return load_common_state_dict(checkpoint_dir)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            from megatron.core.dist_checkpointing.dict_utils import nested_values

            keys = [getattr(v, "key", "?") for v in nested_values(sharded_objects_state_dict)]
            if keys:
                raise CheckpointError(f"{checkpoint_dir}: refusing to load {keys[0]!r}: a pickled object "
                                      "(only tensors are loaded)")
            return sharded_objects_state_dict

    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class SafeLoadPlanner(MCoreLoadPlanner):
        """Megatron's load planner (global-shape validation) that never reads a byte entry: none
        is planned, and load_bytes refuses instead of torch.load(weights_only=False). `source`:
        the checkpoint directory (named in the refusal)."""

        def __init__(self, *args, source=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.source = source

        def create_local_plan(self):
            from torch.distributed.checkpoint.planner import LoadItemType

            # before Megatron's shape check, which reads a byte entry's (forgeable) `size`
            require_tensor_entries(self.metadata, self.state_dict, self._source())
            plan = super().create_local_plan()
            for item in plan.items:
                if item.type == LoadItemType.BYTE_IO:
                    raise byte_entry_error(self._source(), item.dest_index.fqn)
            return plan

        def load_bytes(self, read_item, value):
            raise byte_entry_error(self._source(), read_item.dest_index.fqn)

        def _source(self) -> str:
            return os.path.join(os.fspath(self.source), METADATA_FILE) if self.source else METADATA_FILE

    return SafeTorchDistLoadStrategy, SafeCommonLoadStrategy, SafeLoadPlanner


_classes = None


def _get_classes():
    global _classes
    if _classes is None:
        _classes = _strategy_classes()
    return _classes


def safe_load_strategies(checkpoint_dir: str, metadata=None):
    """(sharded, common) strategies for `megatron.core.dist_checkpointing.load(...,
    sharded_strategy=, common_strategy=)` of the torch_dist checkpoint `checkpoint_dir`;
    `metadata`: its `.metadata` already read with safe_metadata.read_dcp_metadata."""
    sharded_cls, common_cls, _ = _get_classes()
    return sharded_cls(metadata, checkpoint_dir), common_cls()


def safe_load_planner(source=None, **kwargs):
    """Megatron's MCoreLoadPlanner(**kwargs) that refuses byte entries (see the module docstring);
    `source`: the checkpoint directory, named in the refusal."""
    return _get_classes()[2](source=source, **kwargs)


def torch_load_common(path: str):
    """A Megatron common.pt read with the project's own restricted unpickler (safe_torch.py), never
    torch.load: tensors, dicts and numbers, plus what Megatron-LM keeps there beside them, its run
    arguments ("args", an argparse.Namespace) and the Megatron-Core enums inside them (e.g.
    AttnBackend). Whatever `import megatron.core` or any other import adds to torch's
    weights-only allow-list (megatron/core/safe_globals.py admits numpy's _reconstruct) is not
    admitted here. One CheckpointError line naming the file otherwise; nothing in it is run."""
    from gspo_megatron.checkpoint.safe_torch import load_torch_file

    return load_torch_file(path, run_args=True)


def load_common_state_dict(checkpoint_dir: str) -> dict:
    """Megatron's common.pt (its non-sharded state) read with the restricted unpickler
    (torch_load_common); the equivalent of dist_checkpointing.load_common_state_dict, which calls
    torch.load (strategies/common.py:89). One-line CheckpointError when missing, or when it holds
    anything the reader refuses."""
    path = os.path.join(os.fspath(checkpoint_dir), "common.pt")  # strategies/common.py COMMON_STATE_FNAME
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: missing (not a complete torch_dist checkpoint)")
    return torch_load_common(path)
