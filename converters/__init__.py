"""gspo-convert: Qwen3-MoE checkpoints between Hugging Face safetensors and Megatron-Core torch_dist.

`converters.mcore` holds the API (conversion both ways, saving/loading the sharded model),
`converters.cli` the `gspo-convert` command; the HF <-> Megatron tensor map itself is
`gspo_megatron.model.mapping`, used here as is.
"""
