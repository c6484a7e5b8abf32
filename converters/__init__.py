"""gspo-convert: Qwen3-MoE checkpoints between Hugging Face safetensors and Megatron-Core torch_dist.

Only the command lives here (`converters.cli`: arguments, progress, exit codes). The formats are
the library's checkpoint package (`gspo_megatron.checkpoint.mcore` holds the conversion both ways,
saving/loading the sharded model), which the trainer and `gspo_megatron.score` use too; the HF <->
Megatron tensor map itself is `gspo_megatron.model.mapping`.
"""
