"""gspo-megatron: GSPO post-training of Qwen3-MoE on Megatron-Core."""

__version__ = "0.1.0"
