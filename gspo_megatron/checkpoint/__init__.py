"""Checkpoint formats and their safety, the one place the library reads and writes them:

    mcore.py            Megatron-Core torch_dist checkpoints of Qwen3-MoE: HF <-> torch_dist
                        conversion (streaming, collective), saving/loading the sharded model
    megatron_dirs.py    Megatron-LM / Megatron-Bridge roots, trackers, run_config.yaml,
                        `_extra_state` entries
    layout.py           where each HF tensor lives in a torch_dist checkpoint (from model/mapping.py)
    dcp_io.py           PyTorch DCP files written and read one chunk at a time
    safetensors_data.py HF safetensors read by byte range, threads allowed
    atomic.py           checkpoint directories that appear all at once (collective)
    safe_metadata.py, megatron_load.py, integrity.py   reading without unpickling code; checksums

The HF <-> Megatron name map stays in model/mapping.py (loader, exporter, converter and weight
sync share it); HF safetensors shard writing and the HF -> sharded-model loader are model/hf_writer.py
and model/hf_io.py. The `gspo-convert` command (converters/cli.py) sits on top of this package.
Imports nothing from converters/ or train/ (tests/test_imports.py)."""
