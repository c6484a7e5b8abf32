"""vLLM servers as seen from the trainer: how one is launched (the engine-independent client and
process management are rollout/http_servers.py's).

A server the vLLM engine can drive needs (vLLM 0.32.0, read in its source):
* ``--enable-scale-out``: the token-in/token-out route ``POST /inference/v1/generate``, which
  returns every choice's ``token_ids``, per-token ``logprobs`` and ``weight_versions``;
* ``--logprobs-mode processed_logprobs``: the log-probs of the distribution actually sampled,
  i.e. after temperature (the default ``raw_logprobs`` are taken before it:
  config/model.py ``logprobs_mode``, v1/sample/ops/topk_topp_sampler.py);
* ``VLLM_SERVER_DEV_MODE=1``: the RL control routes (``/pause``, ``/resume``,
  ``/update_weight_version``, ``/collective_rpc``; entrypoints/launchers/api_server/routers.py);
* ``--worker-extension-cls gspo_megatron.rollout.vllm_worker.GSPOWorkerExtension`` with this
  repository on the server's PYTHONPATH: the weight reload that is exact on CPU MoE
  (rollout/vllm_worker.py explains vLLM's repack bug);
* on CPU ``--enforce-eager`` and ``--kv-cache-memory-bytes`` (otherwise the KV cache is sized from
  most of the host's memory, v1/worker/cpu_worker.py), ``VLLM_CPU_OMP_THREADS_BIND=nobind``.
The control routes are not covered by ``--api-key`` (it guards /v1, /v2, /inference only:
entrypoints/serve/middleware/authenticate.py), so a launched server binds loopback.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from . import http_servers as _http
from .vllm_api import API_SERVER_MODULE, WORKER_EXTENSION

# the repository root: the server imports the worker extension from it
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class ServerClient(_http.ServerClient):
    label = "vLLM server"


@dataclass
class VLLMLaunchSpec:
    model_path: str
    port: int = 8000
    host: str = "127.0.0.1"
    api_key: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    cpu_kv_cache_mb: int | None = None  # set: a CPU server (eager mode, a bounded KV cache)
    extra_args: list[str] = field(default_factory=list)
    command: list[str] | None = None  # [python, -m, vllm.entrypoints.openai.api_server] by default
    python: str = "python3"
    env: dict[str, str] | None = None
    unset_env: tuple[str, ...] = ()
    log_dir: str | None = None
    # "nccl": the server takes vLLM's NCCL weight transfer (rollout.vllm.weight_sync=nccl)
    weight_transfer: str | None = None
    num_servers: int = 1
    log_name: str = "vllm_server"
    health_path: str = "/health"

    def url(self, i: int) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "localhost") else self.host
        return f"http://{host}:{self.port + i}"

    def argv(self, i: int) -> list[str]:
        prefix = list(self.command) if self.command else [self.python, "-m", API_SERVER_MODULE]
        args = ["--model", str(self.model_path), "--host", self.host, "--port", str(self.port + i),
                "--dtype", self.dtype, "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
                "--max-logprobs", "0", "--worker-extension-cls", WORKER_EXTENSION]
        if self.max_model_len:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.cpu_kv_cache_mb:
            args += ["--enforce-eager", "--kv-cache-memory-bytes", str(int(self.cpu_kv_cache_mb) << 20)]
        if self.api_key:
            args.append(f"--api-key={self.api_key}")  # one token: a key may begin with '-' (see sglang_server)
        if self.weight_transfer:
            args += ["--weight-transfer-config", json.dumps({"backend": self.weight_transfer})]
        return prefix + args + [str(a) for a in self.extra_args]

    def server_env(self) -> dict[str, str]:
        """What a launched server needs in its environment besides ours."""
        path = os.environ.get("PYTHONPATH")
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": REPO_ROOT + (os.pathsep + path if path else "")}
        if self.cpu_kv_cache_mb:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env.update(self.env or {})
        return env


def launch(spec: VLLMLaunchSpec) -> _http.ServerProcesses:
    """Start the servers (their own process groups); the caller stops them (`.stop()`)."""
    spec.env = spec.server_env()
    procs = _http.ServerProcesses(spec)
    procs.start()
    return procs
