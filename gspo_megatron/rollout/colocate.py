"""Colocated SGLang engines: the trainer's own GPUs also serve generation
(`rollout.backend=sglang rollout.sglang.launch=true`).

Launch (`start_colocated`, before the trainer builds its model): on every node the process with
LOCAL_RANK 0 starts that node's engines, ``GPUs per node / (tp * dp)`` SGLang servers on the node's
GPUs (server i on GPUs ``[i*tp*dp, (i+1)*tp*dp)``: ``--base-gpu-id``) with
``--enable-memory-saver`` (SGLang can then release and re-take its weights and KV cache), waits
for them, and every rank learns all servers' URLs (an all-gather). Global rank 0 drives every
server over HTTP; the servers' GPU memory is released at once, so the model and optimizer can be
built next to them. Servers on more than one node must be reachable from rank 0: set
``rollout.sglang.host`` to an address they can bind for that (``0.0.0.0``); each node then
advertises its address towards the rendezvous host.

Every step (train/loop.py), in this order:
    generate -> release (POST /release_memory_occupation, every server) -> train
      -> resume (POST /resume_memory_occupation) -> push the new weights -> generate ...
While the engines hold memory (resume .. release) the trainer keeps out of their way: on GPU every
rank moves its DDP gradient buffers (Megatron's ``offload_grad_buffers``) and, with 16-bit
parameters, its optimizer state (``offload_to_cpu``: fp32 masters and Adam moments) to host
memory before the resume and brings them back after the release. With fp32 parameters the
optimizer state stays (Megatron's fp32 main parameters are views of the parameter buffer, which
offload_to_cpu would detach from it). The model's weights stay on the GPU: the push reads them.
On CPU nothing moves (the test double serves from host memory).

Weight sync: ``tensor`` (CUDA IPC) reaches only servers on rank 0's node, and ``distributed``
cannot share rank 0's GPU with server 0 (config.py refuses it with launch=true), so more than one
node needs ``disk`` on a shared filesystem; the check is in `check_colocated`.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .http_servers import secret_from_env
from .sglang_server import LaunchSpec, ServerClient, ServerProcesses, SGLangError
from .supervision import ProcessKeeper, restarts_default

log = logging.getLogger("gspo_megatron.rollout")

MEMORY_SAVER_FLAG = "--enable-memory-saver"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# The trainer's torchrun variables: a server started from a trainer rank must not take them for
# its own (SGLang initializes its own process groups; torch's tcp rendezvous reads
# TORCHELASTIC_USE_AGENT_STORE).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "CUDA_DEVICE_MAX_CONNECTIONS")


@dataclass(frozen=True)
class NodeLayout:
    """Where this process sits among the nodes (torchrun's LOCAL_RANK / LOCAL_WORLD_SIZE)."""

    node_rank: int
    nnodes: int
    local_rank: int
    gpus_per_node: int

    @classmethod
    def from_env(cls, rank: int, world_size: int) -> "NodeLayout":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        local_rank = int(os.environ.get("LOCAL_RANK", rank % local_world))
        return cls(node_rank=rank // local_world, nnodes=max(1, world_size // local_world), local_rank=local_rank,
                   gpus_per_node=local_world)


def engines_per_node(gpus_per_node: int, tp: int, dp: int) -> int:
    """Servers per node: the node's GPUs split into engines of tp * dp GPUs each."""
    per = tp * dp
    if per < 1 or gpus_per_node % per:
        raise SGLangError(f"colocated SGLang: {gpus_per_node} GPUs per node do not split into engines of "
                          f"rollout.sglang.tp x dp = {tp} x {dp} GPUs")
    return gpus_per_node // per


def check_colocated(sg, nnodes: int) -> None:
    """What a colocated run needs beyond the per-node split (one line each)."""
    if nnodes > 1 and sg.weight_sync == "tensor":
        raise SGLangError("colocated SGLang on more than one node: weight_sync=tensor (CUDA IPC) reaches only "
                          "rank 0's node, and distributed cannot share rank 0's GPU; use weight_sync=disk (a shared "
                          "filesystem)")
    if nnodes > 1 and sg.host in LOOPBACK:
        raise SGLangError("colocated SGLang on more than one node: rollout.sglang.host=127.0.0.1 is not reachable "
                          "from the other nodes; set rollout.sglang.host=0.0.0.0 (or this network's interface)")
    if sg.dp > 1 and sg.weight_sync in ("distributed", "tensor"):
        raise SGLangError(f"rollout.sglang.dp={sg.dp}: SGLang 0.5.23 refuses weight_sync={sg.weight_sync} for a "
                          "server with data-parallel replicas; use dp=1 (more engines per node instead)")


def node_launch_spec(sg, *, model_path: str, layout: NodeLayout, log_dir: str | None = None,
                     return_routed_experts: bool = False, api_key: str | None = None) -> LaunchSpec:
    """This node's servers: engines_per_node of them on its GPUs, with the memory saver (and
    --enable-return-routed-experts when the run needs the engines' routing)."""
    n = engines_per_node(layout.gpus_per_node, int(sg.tp), int(sg.dp))
    extra = list(sg.extra_args or [])
    if MEMORY_SAVER_FLAG not in extra:
        extra.append(MEMORY_SAVER_FLAG)
    if n == 1:  # LaunchSpec names the GPU only for several servers; say it here too
        extra += ["--base-gpu-id", "0"]
    return LaunchSpec(
        model_path=model_path, tp=int(sg.tp), dp=int(sg.dp), ep=int(sg.ep), mem_fraction=float(sg.mem_fraction),
        port=int(sg.port), host=sg.host, api_key=api_key, env_vars=tuple(sg.env_vars), extra_args=extra,
        num_servers=n, base_gpu_id=0,
        command=list(sg.server_command) if sg.server_command else None, log_dir=log_dir,
        unset_env=LaunchSpec.unset_env + TORCHRUN_ENV, return_routed_experts=return_routed_experts,
    )


def _advertised(url: str, host: str | None) -> str:
    if host is None:
        return url
    scheme, rest = url.split("://", 1)
    port = rest.rsplit(":", 1)[1]
    return f"{scheme}://{host}:{port}"


class NodeServers:
    """The servers this node's local rank 0 started (None elsewhere), and their keeper (a server
    process that exits is started again; global rank 0's engine waits for it and re-syncs it:
    rollout/supervision.py); stopped by close()."""

    def __init__(self, procs: ServerProcesses | None, keeper: ProcessKeeper | None = None):
        self.procs, self.keeper = procs, keeper

    def close(self) -> None:
        if self.keeper is not None:  # first: a server stopped below is not started again
            self.keeper.stop()
            self.keeper = None
        if self.procs is not None:
            self.procs.stop()
            self.procs = None


def start_colocated(cfg, ctx, *, make_engine) -> tuple[object | None, NodeServers]:
    """Collective. Start every node's engines, gather their URLs, build the engine on global rank 0
    with `make_engine(urls, api_key)`, release the servers' memory; returns (engine or None,
    NodeServers). The key: rollout.sglang.api_key_env's variable; servers bound beyond loopback
    without one get a generated key (rank 0's, to every rank in memory)."""
    sg = cfg.rollout.sglang
    layout = NodeLayout.from_env(ctx.rank, ctx.world_size)
    check_colocated(sg, layout.nnodes)
    model_path = sg.model_path or cfg.model.hf_dir
    if not model_path:
        raise SGLangError("colocated SGLang needs rollout.sglang.model_path or model.hf_dir (the servers' model)")
    api_key = secret_from_env(sg.api_key_env, "rollout.sglang.api_key_env")
    if api_key is None and sg.host not in LOOPBACK:
        # servers reachable beyond this host require a key: one per run, from rank 0 to every node
        import secrets

        box = [secrets.token_hex(24) if ctx.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        api_key = box[0]
        log.info("colocated SGLang servers bind %s: they require a generated API key", sg.host)
    procs, keeper, urls, error = None, None, [], None
    if layout.local_rank == 0:
        try:
            advertise = None
            if sg.host in ("0.0.0.0", "::"):
                from .sglang_engine import local_address_towards

                advertise = local_address_towards(f"http://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:1")
            spec = node_launch_spec(sg, model_path=model_path, layout=layout,
                                    log_dir=os.path.join(cfg.out_dir, "sglang_logs", f"node{layout.node_rank}"),
                                    return_routed_experts=cfg.engine_routing, api_key=api_key)
            procs = ServerProcesses(spec)
            procs.start()
            clients = [ServerClient(u, api_key=api_key) for u in procs.urls]
            procs.wait_ready(clients, float(sg.ready_timeout_s))
            urls = [_advertised(u, advertise) for u in procs.urls]
            restarts = restarts_default({"max_restarts": sg.max_restarts, "weight_sync": sg.weight_sync})
            if restarts:
                keeper = ProcessKeeper(procs, max_restarts=restarts, interval_s=float(sg.health_interval_s),
                                       name="SGLang server")
            log.info("node %d: started %d colocated SGLang server(s): %s", layout.node_rank, len(urls), urls)
        except BaseException as e:  # tell the other ranks instead of leaving them in the gather
            error = f"node {layout.node_rank}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if keeper is not None:
                keeper.stop()
                keeper = None
            if procs is not None:
                procs.stop()
                procs = None
    gathered: list = [None] * ctx.world_size
    dist.all_gather_object(gathered, (urls, error))
    errors = [e for _, e in gathered if e]
    node = NodeServers(procs, keeper)
    if errors:
        node.close()
        raise SGLangError("colocated SGLang servers did not start: " + "; ".join(errors))
    all_urls = [u for us, _ in gathered for u in us]
    engine = None
    try:
        if ctx.rank == 0:
            engine = make_engine(all_urls, api_key)
            engine.sleep()  # release: the trainer builds its model and optimizer next
        _barrier(ctx)
    except BaseException:
        if engine is not None:
            engine.close()
        node.close()
        raise
    return engine, node


def _barrier(ctx) -> None:
    if ctx.device.type == "cuda":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


class Colocation:
    """The release / resume protocol around training, and the trainer's offload while the engines
    hold memory (module docstring)."""

    def __init__(self, ctx, engine, model: list, optimizer, dtype: torch.dtype, node: NodeServers):
        self.ctx, self.engine, self.model, self.optimizer = ctx, engine, model, optimizer
        self.node = node
        self.offload = ctx.device.type == "cuda"
        self.offload_optimizer = self.offload and dtype in (torch.bfloat16, torch.float16)
        self.engines_hold_memory = False

    def before_push(self) -> None:
        """Collective: the trainer's state leaves the GPU, then the engines take their memory back."""
        if self.engines_hold_memory:
            return
        if self.offload:
            for m in self.model:
                m.offload_grad_buffers()
            if self.offload_optimizer:
                self.optimizer.offload_to_cpu()
        _barrier(self.ctx)
        if self.engine is not None:
            self.engine.wake()
        _barrier(self.ctx)
        self.engines_hold_memory = True

    def after_rollout(self) -> None:
        """Collective: the engines release their memory, then the trainer's state comes back."""
        if not self.engines_hold_memory:
            return
        if self.engine is not None:
            self.engine.sleep()
        _barrier(self.ctx)
        if self.offload:
            if self.offload_optimizer:
                self.optimizer.restore_from_cpu()
            for m in self.model:
                m.restore_grad_buffers()
        self.engines_hold_memory = False

    def close(self) -> None:
        self.node.close()
