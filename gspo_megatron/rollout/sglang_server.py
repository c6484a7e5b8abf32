"""SGLang servers as seen from the trainer: the engine-independent HTTP client and process
management of rollout/http_servers.py with SGLang's names, health route and launch command.

* `ServerClient`: JSON over HTTP to one SGLang server (stdlib `http.client`; no extra dependency).
  Every request has a timeout; connection errors, timeouts and HTTP 5xx are retried with
  exponential backoff, then reported as `SGLangServerError` naming the server and the endpoint.
  A body that is not the JSON the endpoint promises is a `SGLangProtocolError` (not retried).
  An API key is sent as ``Authorization: Bearer <key>`` (SGLang's ``--api-key``).
* `wait_until_ready`: polls ``GET /health_generate`` (a real one-token generation on SGLang) on
  every server until all answer 200, or raises `SGLangNotReadyError` ("server X not ready after
  N s") at the deadline; a launched process that dies while we wait is reported at once with the
  tail of its log.
* `ServerProcesses`: starts ``python -m sglang.launch_server`` processes (the module or the whole
  command prefix is configurable, which is how the tests launch ``tests/sglang_double.py``), one
  per server, each in its own session; `stop()` terminates exactly the processes (and their
  process groups) it started, waits a grace period, then kills. An ``atexit`` hook stops them
  if the owner forgot to.
* `server_flags(cfg)` / ``python -m gspo_megatron.rollout.sglang_server --server-flags --config C
  [overrides...]``: the launch_server flags a run's config needs from servers started outside the
  trainer (launch/slurm/train_with_sglang.sbatch asks before starting them), one per line.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import http_servers as _http
from .http_servers import (RETRYABLE_OS_ERRORS, EngineError, EngineNotReadyError, EngineProtocolError,  # noqa: F401
                           EngineServerError, RetryableHTTPError, ServerProcesses, _signal_group,
                           local_address_towards, log, parse_json)
from .sglang_api import MODEL_OVERRIDE_FLAG, ROUTED_EXPERTS_FLAG

# SGLang's names for the engine-independent errors (the SGLang engine and its tests use these)
SGLangError = EngineError
SGLangServerError = EngineServerError
SGLangProtocolError = EngineProtocolError
SGLangNotReadyError = EngineNotReadyError


class ServerClient(_http.ServerClient):
    """JSON requests to one SGLang server (rollout/http_servers.py ServerClient)."""

    label = "SGLang server"


def normalize_url(url: str) -> str:
    return _http.normalize_url(url, "SGLang server")


def wait_until_ready(clients: Sequence[_http.ServerClient], timeout_s: float, **kw) -> float:
    """rollout/http_servers.py wait_until_ready on SGLang's /health_generate (a real one-token
    generation) unless `path` says otherwise."""
    kw.setdefault("path", "/health_generate")
    return _http.wait_until_ready(clients, timeout_s, **kw)


def check_success(resp: Any, url: str, path: str) -> dict:
    """SGLang's control endpoints answer {"success": bool, "message": str, ...}."""
    if not isinstance(resp, dict) or "success" not in resp:
        raise SGLangProtocolError(f"SGLang server {url}: {path} answered {str(resp)[:300]!r}, expected "
                                  "a JSON object with 'success'")
    if not resp["success"]:
        raise SGLangServerError(f"SGLang server {url}: {path} failed: {resp.get('message', '')}", url=url)
    return resp


def check_not_failed(resp: Any, url: str, path: str) -> Any:
    """Endpoints that answer null / {} on success (release/resume_memory_occupation): only an
    explicit {"success": false} is a failure."""
    if isinstance(resp, dict) and resp.get("success") is False:
        raise SGLangServerError(f"SGLang server {url}: {path} failed: {resp.get('message', '')}", url=url)
    return resp


# ---------------------------------------------------------------------------------- processes
@dataclass
class LaunchSpec:
    """How to start SGLang servers (`rollout.sglang` with launch=true)."""

    model_path: str
    tp: int = 1
    dp: int = 1
    ep: int = 1
    mem_fraction: float = 0.7
    port: int = 30000
    host: str = "127.0.0.1"
    # the key: never in argv (`ps`, the log's first line); given in a --config YAML file only this
    # user can read (secret_args)
    api_key: str | None = None
    extra_args: list[str] = field(default_factory=list)
    num_servers: int = 1
    # `python -m <module>`; tests point it at the HTTP test double.
    module: str = "sglang.launch_server"
    # Full command prefix instead of [python, -m, module] (e.g. [python, "tests/sglang_double.py"]).
    command: list[str] | None = None
    python: str = sys.executable
    # GPU of server i's first rank: base_gpu_id + i * tp * dp (SGLang's --base-gpu-id).
    base_gpu_id: int = 0
    env: dict[str, str] | None = None
    env_vars: tuple[str, ...] = ()  # rollout.*.env_vars: more of the trainer's variables passed on
    # Removed from the servers' inherited environment. SGLANG_RETURN_ORIGINAL_LOGPROB would make
    # SGLang report T=1 log-probs instead of the tempered ones the trainer recomputes.
    unset_env: tuple[str, ...] = ("SGLANG_RETURN_ORIGINAL_LOGPROB",)
    log_dir: str | None = None
    # --enable-return-routed-experts: without it SGLang answers return_routed_experts requests
    # without the field (its capturer is None, state_capturer/routed_experts.py `create`).
    return_routed_experts: bool = False
    log_name: str = "sglang_server"  # <log_dir>/sglang_server_<i>.log
    health_path: str = "/health_generate"

    def url(self, i: int) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port + i}"

    def replica_env(self, i: int) -> dict[str, str]:
        return {}  # server i's GPUs are its --base-gpu-id (argv), not its environment

    def secret_env(self) -> dict[str, str]:
        return {}  # SGLang 0.5.23 reads no key from its environment (srt/environ.py); see secret_args

    def secret_args(self, private_dir: str) -> list[str]:
        """`--config <file>`: the key in a YAML file of its own (mode 0600, in `private_dir`, 0700,
        which the trainer removes at stop). SGLang 0.5.23 merges a --config YAML into its argv
        before parsing (server_args.py:683-689, utils/server_args_config_parser.py), as
        `["--api-key", key]`: a key beginning with '-' would then read as an option, so such a
        key is refused (one line, the key not shown)."""
        if not self.api_key:
            return []
        if self.api_key.startswith("-"):
            raise ValueError("rollout.sglang: a key beginning with '-' cannot reach a launched SGLang server "
                             "(its --config file becomes ['--api-key', key]); use another key (not shown)")
        import yaml

        path = os.path.join(private_dir, "sglang_secrets.yaml")  # SGLang takes .yaml/.yml only
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump({"api-key": self.api_key}, f)
        return ["--config", path]

    def argv(self, i: int) -> list[str]:
        """The command line of server i."""
        prefix = list(self.command) if self.command else [self.python, "-m", self.module]
        args = [
            "--model-path", str(self.model_path),
            "--host", self.host,
            "--port", str(self.port + i),
            "--tp-size", str(self.tp),
            "--dp-size", str(self.dp),
            "--ep-size", str(self.ep),
            "--mem-fraction-static", str(self.mem_fraction),
        ]
        if self.num_servers > 1 or self.base_gpu_id:
            args += ["--base-gpu-id", str(self.base_gpu_id + i * self.tp * self.dp)]
        extra = [str(a) for a in self.extra_args]
        if self.return_routed_experts and ROUTED_EXPERTS_FLAG not in extra:
            args.append(ROUTED_EXPERTS_FLAG)
        overrides = model_config_overrides(self.model_path)
        if overrides and not any(a.partition("=")[0] == MODEL_OVERRIDE_FLAG for a in extra):
            args += [MODEL_OVERRIDE_FLAG, json.dumps(overrides, sort_keys=True)]
        return prefix + args + extra


def model_config_overrides(model_path: str) -> dict:
    """The served model's family's engine_config_overrides (what transformers' class implies and a
    saved config.json may not say); {} for a config no family reads (SGLang's own error then)."""
    from gspo_megatron.errors import ModelConfigError
    from gspo_megatron.model.registry import arch_from_hf_dict

    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            cfg = json.load(f)
        arch = arch_from_hf_dict(cfg if isinstance(cfg, dict) else {}, "the served model's config.json")
    except (OSError, ValueError, ModelConfigError):
        return {}
    return arch.family.engine_config_overrides(arch)


# ---- servers started outside the trainer (Slurm) ------------------------------------------------


def server_flags(cfg) -> list[str]:
    """The `sglang.launch_server` flags a run with `cfg` needs from its servers, beyond model,
    address and sizes: --enable-return-routed-experts when the run uses the engine's routing
    (Config.engine_routing: rollout.return_routing or train.routing_replay=rollout), and the
    model's config overrides (--json-model-override-args=<json>: ModelFamily.
    engine_config_overrides). Launched servers get the same through LaunchSpec."""
    flags = [ROUTED_EXPERTS_FLAG] if cfg.engine_routing else []
    overrides = _config_overrides(cfg)
    if overrides:  # one argument, as the launch script passes each line on
        flags.append(f"{MODEL_OVERRIDE_FLAG}={json.dumps(overrides, sort_keys=True)}")
    return flags


def _config_overrides(cfg) -> dict:
    """The run's model family's engine_config_overrides (ModelFamily), from the architecture the
    trainer will read (model.load's, model.hf_dir's or the inline config)."""
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.resolve import hf_config_dict, read_load_source

    hf = hf_config_dict(cfg, read_load_source(cfg))
    arch = MoeArch.from_hf_dict(hf, source="the run's model config")
    return arch.family.engine_config_overrides(arch)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from gspo_megatron.cli_util import user_errors
    from gspo_megatron.resolve import load_config

    prog = "gspo_megatron.rollout.sglang_server"
    ap = argparse.ArgumentParser(
        prog=prog, description="Print the sglang.launch_server flags a run's config needs, one per line "
        "(the config is loaded as the trainer loads it: YAML + dotted overrides, validated), then a "
        "'# weight_sync=<how>' line.")
    ap.add_argument("--server-flags", action="store_true", required=True,
                    help="print the flags (the only action)")
    ap.add_argument("--config", required=True, help="the run's YAML config")
    ap.add_argument("overrides", nargs="*", help="dotted overrides, as given to the trainer")
    args = ap.parse_args(argv)
    with user_errors(prog):
        cfg = load_config(args.config, args.overrides)
        for flag in server_flags(cfg):
            print(flag)
        # not a flag: what the launch script checks before starting servers (the NCCL versions
        # of both images when the weights travel over NCCL; launch/slurm/train_with_sglang.sbatch)
        print(f"# weight_sync={cfg.rollout.sglang.weight_sync}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
