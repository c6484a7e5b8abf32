"""vLLM worker extension: in-place weight reload from a safetensors directory, exact on CPU MoE.

Runs **inside the vLLM server's worker process** (the vLLM venv), so it imports only the
standard library, torch and vllm — never the rest of gspo_megatron. Start the server with

    PYTHONPATH=<repo> python -m vllm.entrypoints.openai.api_server ... \\
        --worker-extension-cls gspo_megatron.rollout.vllm_worker.GSPOWorkerExtension

and (with ``VLLM_SERVER_DEV_MODE=1``) call it over HTTP:

    POST /collective_rpc {"method": "gspo_reload_weights",
                          "kwargs": {"weights_dir": "/path/to/hf_export"}}

Why not vLLM's own ``reload_weights``: in vllm 0.32.0 an in-place reload re-runs
``UnquantizedFusedMoEMethod.process_weights_after_loading`` -> ``_setup_kernel`` with
``is_weight_update=True``, which copies the *checkpoint-layout* expert weights into the existing
parameter storage but skips ``moe_kernel.fused_experts.process_weights_after_loading(layer)``
(``model_executor/layers/fused_moe/unquantized_fused_moe_method.py`` ``_setup_kernel``). On CPU
that hook is what pads the intermediate dim and prepacks the experts into the grouped-GEMM layout
(``model_executor/layers/fused_moe/experts/cpu_moe.py``
``CPUUnquantizedExperts.process_weights_after_loading``), so after a plain reload the CPU kernel
reads unpacked weights through a packed layout and the served model is wrong. Here the reload runs
with ``_setup_kernel`` wrapped so that, on a weight update, the CPU experts' own
``process_weights_after_loading`` runs on the freshly loaded (materialized) layer before the
layerwise reloader copies the result into the kernel storage — exactly what the first load does.

Note: on CPU, vLLM packs every dense linear layer's weight into a oneDNN/sgl handler and leaves
the ``weight`` parameter empty (``model_executor/layers/utils.py`` ~560-600), so parameter sums or
``/weight_checker`` checksums do not identify the served model there; compare served log-probs.

The served weight version lives in the engine core, not in the worker: after this call, set it
with ``POST /update_weight_version {"new_version": "..."}`` (ideally between ``/pause?mode=keep``
and ``/resume`` so no step runs with new weights under the old label).
"""
from __future__ import annotations

import contextlib
import glob
import os
import time
from collections.abc import Iterator

import torch

__all__ = ["GSPOWorkerExtension"]


def _iter_safetensors(weights_dir: str) -> tuple[list[str], Iterator[tuple[str, torch.Tensor]]]:
    files = sorted(glob.glob(os.path.join(weights_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors under {weights_dir!r}")
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    return files, safetensors_weights_iterator(files, use_tqdm_on_load=False)


def _is_cpu_unquantized_experts(obj: object) -> bool:
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except Exception:  # noqa: BLE001 - not a CPU build / module moved: nothing to repack
        return False
    return isinstance(obj, CPUUnquantizedExperts)


@contextlib.contextmanager
def _repack_experts_on_weight_update(counter: list[int]):
    """Wrap ``UnquantizedFusedMoEMethod._setup_kernel`` for the duration of a reload."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    original = UnquantizedFusedMoEMethod._setup_kernel

    def _setup_kernel(self, layer, w13, w2):  # noqa: ANN001
        is_weight_update = getattr(self, "moe_kernel", None) is not None
        original(self, layer, w13, w2)
        if not is_weight_update:
            return
        fused = getattr(self.moe_kernel, "fused_experts", None)
        if _is_cpu_unquantized_experts(fused):
            # pad + prepack the just-loaded checkpoint-layout weights, as on the first load
            fused.process_weights_after_loading(layer)
            counter[0] += 1

    UnquantizedFusedMoEMethod._setup_kernel = _setup_kernel
    try:
        yield
    finally:
        UnquantizedFusedMoEMethod._setup_kernel = original


# The MoE layer's own module names in vLLM (FusedMoE is `...mlp.experts`; its LoRA wrapper takes
# the per-expert w1/w2/w3): a LoRA target list naming none of them leaves the experts unadapted.
_MOE_LORA_MODULES = frozenset({"experts", "w1", "w2", "w3", "w13", "gate_up_proj_moe"})


def _cpu_moe_kernel_without_lora() -> None:
    """vLLM 0.32 picks the Triton MoE kernel whenever LoRA is enabled at all
    (``model_executor/layers/fused_moe/layer.py:364`` sets ``is_lora_enabled`` from the presence
    of a LoRA config; ``fused_moe/oracle/unquantized.py:234-247`` then returns TRITON), even when
    ``--lora-target-modules`` leaves every MoE layer without an adapter. On CPU there is no Triton
    (``triton.language`` has no ``float32``: the first generation dies), so there, and only when the
    targets name no MoE module, the experts keep the kernel they have without LoRA. Installed when
    this module is imported in the worker, before the model is built (vLLM resolves the worker
    extension in ``WorkerWrapperBase.init_worker``, ahead of ``load_model``)."""
    try:
        import dataclasses

        import vllm.platforms as platforms  # current_platform: resolved by the module's __getattr__
        from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    except Exception:  # noqa: BLE001 - another vLLM layout: leave it as it is
        return
    if not platforms.current_platform.is_cpu() or getattr(method.select_unquantized_moe_backend, "_gspo", False):
        return
    original = method.select_unquantized_moe_backend

    def select(moe_config):  # noqa: ANN001
        if moe_config.is_lora_enabled:
            from vllm.config import get_current_vllm_config

            lc = get_current_vllm_config().lora_config
            targets = set(lc.target_modules or ()) if lc is not None else set()
            if targets and not targets & _MOE_LORA_MODULES:
                moe_config = dataclasses.replace(moe_config, is_lora_enabled=False)
        return original(moe_config)

    select._gspo = True
    method.select_unquantized_moe_backend = select


_cpu_moe_kernel_without_lora()


class GSPOWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); ``self`` is the worker."""

    def gspo_lora_bound(self) -> dict:
        """How many of this worker's LoRA-capable modules each loaded adapter sets weights on: the
        modules ``LoRAModelManager.activate_adapter`` gives a ``set_lora`` (lora/model_manager.py
        371-394), counted the same way (``_get_lora_layer_weights`` per module). ``{"adapters":
        {lora int id: bound modules}, "modules": LoRA-wrapped modules}``; no LoRA: both empty / 0."""
        manager = getattr(getattr(self, "model_runner", None), "lora_manager", None)
        inner = getattr(manager, "_adapter_manager", None)
        if inner is None:
            return {"adapters": {}, "modules": 0}
        out = {}
        for lora_id, model in list(inner._registered_adapters.items()):
            out[int(lora_id)] = sum(1 for name in inner.modules if inner._get_lora_layer_weights(model, name))
        return {"adapters": out, "modules": len(inner.modules)}

    def gspo_reload_weights(self, weights_dir: str, digests: bool = False) -> dict:
        """Reload every weight from ``weights_dir/*.safetensors`` (HF names), in place.

        Returns ``{"files": n, "seconds": s, "repacked_moe_layers": k}`` (per worker) and, with
        ``digests``, ``"digests": {name: [sum, sum of squares]}`` (float64) of every tensor this
        worker read and handed to the model loader (rollout/vllm_engine.py compares them with the
        trainer's).
        """
        t0 = time.perf_counter()
        files, weights = _iter_safetensors(weights_dir)
        seen: dict[str, list[float]] = {}
        if digests:
            weights = _digested(weights, seen)
        repacked = [0]
        with _repack_experts_on_weight_update(repacked):
            # Worker.reload_weights sets the current vllm config and, in the model runner,
            # drops LoRA / encoder / multimodal caches derived from the old weights.
            self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        out = {
            "files": len(files),
            "seconds": round(time.perf_counter() - t0, 4),
            "repacked_moe_layers": repacked[0],
        }
        if digests:
            out["digests"] = seen
        return out


# Elements converted to float64 at a time: the digest's extra memory is two such blocks (64 MiB),
# whatever the tensor's size. A whole-tensor float64 copy was 12 GB on rank 0's GPU for GLM-4.5's
# output layer (issue 52).
DIGEST_BLOCK = 1 << 22


def tensor_digest(t: torch.Tensor) -> list[float]:
    """[sum, sum of squares] of a tensor's values in float64, block by block (DIGEST_BLOCK
    elements): the trainer computes the same of what it writes (rollout/vllm_engine.py imports
    this function: one definition; the comparison allows any summation order, check_digests)."""
    x = t.detach()
    flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)  # a weight is contiguous: no copy
    s = torch.zeros((), dtype=torch.float64, device=flat.device)
    q = torch.zeros((), dtype=torch.float64, device=flat.device)
    for i in range(0, flat.numel(), DIGEST_BLOCK):
        block = flat[i:i + DIGEST_BLOCK].to(torch.float64)
        s += block.sum()
        q += torch.dot(block, block)
    return [float(s), float(q)]


def _digested(weights: Iterator[tuple[str, torch.Tensor]], seen: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in weights:
        seen[name] = tensor_digest(t)
        yield name, t
