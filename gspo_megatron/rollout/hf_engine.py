"""The in-process rollout engine on transformers' `generate` (the embedded default).

Semantics (see also `base.py`):

* ``generate(prompts, n, sampling)`` returns ``len(prompts) * n`` samples grouped per prompt
  (prompt 0's n samples, then prompt 1's, ...). Rows are batched (``max_batch_size`` rows per
  `generate` call) with left padding; the response never contains padding.
* ``response_logprobs[t] = log_softmax(logits_t / T)[response_ids[t]]`` computed in fp32 from the raw
  (unprocessed) logits: the untruncated tempered distribution, with no top-k / top-p
  renormalisation. That is what the trainer recomputes.
* Greedy decoding: ``temperature <= 0`` (or ``top_k == 1``). Greedy samples report log-probs at
  temperature 1 (T = 0 has no finite log-probs).
* A response ends at the first eos / ``stop_token_ids`` token, which **is included** in
  ``response_ids`` (and has a log-prob), or at the first token that completes a ``stop`` string
  (also included): finish_reason "stop". Otherwise it has ``max_new_tokens`` tokens: "length".
* Reproducible sampling: ``generate(..., seed=s)``, or an engine-level ``seed`` (call i then uses
  ``seed + i``). Sampling then runs under a forked RNG, leaving the global torch RNG untouched.
  With neither, the global torch RNG is used. Results depend on the batch composition.
* Interrupting (partial rollouts): ``interrupt()`` from another thread stops the generation in
  progress after its current decode step (a transformers StoppingCriteria reads the flag) and makes
  every generate() until ``resume()`` return at once; rows cut short come back with
  finish_reason "abort", their tokens and log-probs so far, and no routing.
* The engine owns the model: it resets ``model.generation_config`` so that checkpoint sampling
  defaults (e.g. Qwen3's top_k=20, top_p=0.95) never silently truncate the sampling distribution.

Weights arrive as Hub-format names (what ``save_pretrained`` writes, e.g.
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``). transformers 5.x keeps a Qwen3-MoE layer's
experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H] = per expert [gate; up] rows,
``mlp.experts.down_proj`` [E, H, I]); `update_weights` copies each per-expert tensor straight into
its slice of the fused parameter, so no second full state dict is materialised.
"""
from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .base import NamedTensors, RolloutEngine, Sample, SamplingParams, check_generate_args, stop_string_end


class WeightUpdateError(ValueError):
    pass


@dataclass
class _Target:
    get: Callable[[], torch.Tensor]  # returns the (view of the) parameter to copy into
    shape: tuple[int, ...]
    key: str  # identity of the storage region, for coverage accounting (aliases share it)


def _experts_targets(prefix: str, module: torch.nn.Module) -> dict[str, _Target]:
    """Hub per-expert names -> slices of a fused transformers experts module."""
    gate_up, down = module.gate_up_proj, module.down_proj
    if getattr(module, "is_concatenated", True) is False:
        raise NotImplementedError(f"{prefix}: interleaved gate/up expert layout is not supported")
    transposed = bool(getattr(module, "is_transposed", False))
    if gate_up.dim() != 3 or down.dim() != 3:
        raise NotImplementedError(f"{prefix}: expected 3-D fused expert weights")
    num_experts = gate_up.shape[0]
    if transposed:  # gate_up [E, H, 2I], down [E, I, H]
        hidden, inter = gate_up.shape[1], gate_up.shape[2] // 2
    else:  # gate_up [E, 2I, H], down [E, H, I]
        inter, hidden = gate_up.shape[1] // 2, gate_up.shape[2]
    out: dict[str, _Target] = {}
    for e in range(num_experts):
        if transposed:
            g = (lambda e=e: gate_up.data[e, :, :inter].T)
            u = (lambda e=e: gate_up.data[e, :, inter:].T)
            d = (lambda e=e: down.data[e].T)
        else:
            g = (lambda e=e: gate_up.data[e, :inter, :])
            u = (lambda e=e: gate_up.data[e, inter:, :])
            d = (lambda e=e: down.data[e])
        base = f"{prefix}.{e}"
        out[f"{base}.gate_proj.weight"] = _Target(g, (inter, hidden), f"{base}.gate_proj.weight")
        out[f"{base}.up_proj.weight"] = _Target(u, (inter, hidden), f"{base}.up_proj.weight")
        out[f"{base}.down_proj.weight"] = _Target(d, (hidden, inter), f"{base}.down_proj.weight")
    return out


def hub_weight_targets(model: torch.nn.Module) -> dict[str, _Target]:
    """Every Hub-format tensor name of `model` -> where it lives in memory.

    Plain parameters and persistent buffers keep their in-memory names; fused expert modules (a module owning 3-D
    ``gate_up_proj`` and ``down_proj`` parameters) are expanded to per-expert Hub names. Tied
    parameters get one target per name, sharing a coverage key (either name covers them).
    """
    fused: dict[str, torch.nn.Module] = {}
    for mname, mod in model.named_modules():
        gu = mod._parameters.get("gate_up_proj") if hasattr(mod, "_parameters") else None
        dp = mod._parameters.get("down_proj") if hasattr(mod, "_parameters") else None
        if isinstance(gu, torch.nn.Parameter) and isinstance(dp, torch.nn.Parameter) and gu.dim() == 3:
            fused[mname] = mod
    targets: dict[str, _Target] = {}
    for mname, mod in fused.items():
        targets.update(_experts_targets(mname, mod))
    first_name: dict[int, str] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        mname = pname.rpartition(".")[0]
        if mname in fused and pname.rpartition(".")[2] in ("gate_up_proj", "down_proj"):
            continue
        key = first_name.setdefault(id(p), pname)
        targets[pname] = _Target((lambda p=p: p.data), tuple(p.shape), key)
    # persistent buffers are weights too (a checkpoint holds them: GLM-4.5's router expert bias)
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                name = f"{mname}.{bname}" if mname else bname
                targets[name] = _Target((lambda b=b: b), tuple(b.shape), name)
    return targets


def _resolve_dtype(dtype: Any) -> Any:
    if dtype is None or isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"unknown dtype {dtype!r}")


class HFEngine(RolloutEngine):
    """Rollouts with transformers' `generate` in this process.

    model: an HF model directory (loaded locally with ``AutoModelForCausalLM``) or a built
        `PreTrainedModel` (used as is, moved to `device`/`dtype`).
    tokenizer: a tokenizer, a directory, or None (then loaded from the model directory if it holds
        tokenizer files). Needed only for ``Sample.text`` and ``stop`` strings.
    eos_token_ids: ids that end a response in addition to ``stop_token_ids``; default: the model's
        generation-config / config eos ids plus the tokenizer's eos id.
    return_routing: fill ``Sample.routed_experts`` with the top-k experts every MoE layer routed
        each token to during generation (prompt prefill and decode steps), in SGLang's layout: one
        row per decoder layer; a dense layer's row (GLM-4.5's first layers) is zeros, as SGLang
        0.5.23 returns it (its capturer's buffer spans num_hidden_layers, is zero-initialised,
        state_capturer/base.py:38, and only MoE layers write their row, :48-50). The trainer reads
        only the rows of its MoE layers (parallel/routing_replay.py keys routers by layer).
    """

    def __init__(
        self,
        model: str | os.PathLike | torch.nn.Module,
        *,
        device: str | torch.device = "cpu",
        dtype: Any = None,
        tokenizer: Any = None,
        eos_token_ids: list[int] | tuple[int, ...] | None = None,
        pad_token_id: int | None = None,
        max_batch_size: int = 64,
        seed: int | None = None,
        weight_version: int = 0,
        return_routing: bool = False,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        self.device = torch.device(device)
        dtype = _resolve_dtype(dtype)
        if isinstance(model, (str, os.PathLike)):
            model_dir = os.fspath(model)
            if not os.path.isdir(model_dir):
                raise FileNotFoundError(f"HF model directory not found: {model_dir}")
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=dtype if dtype is not None else "auto", local_files_only=True
            )
            if tokenizer is None and any(
                os.path.exists(os.path.join(model_dir, f))
                for f in ("tokenizer.json", "tokenizer_config.json")
            ):
                tokenizer = model_dir
        else:
            self.model = model
            if dtype not in (None, "auto"):
                self.model.to(dtype=dtype)
        self.model.to(self.device)
        self.model.eval()
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = AutoTokenizer.from_pretrained(os.fspath(tokenizer), local_files_only=True)
        self.tokenizer = tokenizer

        if eos_token_ids is None:
            ids: list[int] = []
            for src in (getattr(self.model, "generation_config", None), self.model.config):
                e = getattr(src, "eos_token_id", None) if src is not None else None
                ids.extend([e] if isinstance(e, int) else list(e or []))
            if tokenizer is not None and tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
            eos_token_ids = ids
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        if pad_token_id is None:
            for cand in (
                getattr(tokenizer, "pad_token_id", None),
                getattr(self.model.config, "pad_token_id", None),
                self.eos_token_ids[0] if self.eos_token_ids else None,
            ):
                if cand is not None:
                    pad_token_id = int(cand)
                    break
            else:
                pad_token_id = 0
        self.pad_token_id = pad_token_id
        self.model.generation_config = GenerationConfig(
            eos_token_id=list(self.eos_token_ids) or None, pad_token_id=self.pad_token_id
        )
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.return_routing = return_routing
        # (layer index, router, its output's top-k indices) of every MoE layer, as the model's
        # family finds them (ModelFamily.routers); dense layers have none
        self._gates = []
        if return_routing:
            from gspo_megatron.model.registry import family_of_type

            self._gates = family_of_type(self.model.config.model_type).routers(self.model)
            if not self._gates:
                raise ValueError(f"return_routing needs a MoE model: no layer of the "
                                 f"{self.model.config.num_hidden_layers} routes")
        params = inspect.signature(self.model.forward).parameters
        self._takes_cache = "cache" in params and "logits_to_keep" in params  # _shared_prefill
        self._calls = 0
        self._interrupt = threading.Event()
        self._weight_version = weight_version
        self._weights_inconsistent: str | None = None

    # ------------------------------------------------------------------ generation
    @property
    def weight_version(self) -> int:
        return self._weight_version

    supports_interrupt = True

    def interrupt(self) -> None:
        self._interrupt.set()

    def resume(self) -> None:
        self._interrupt.clear()

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        *,
        seed: int | None = None,
    ) -> list[Sample]:
        if self._weights_inconsistent is not None:
            raise RuntimeError(
                f"HFEngine weights are partially updated after a failed update_weights "
                f"({self._weights_inconsistent}); send a complete update first"
            )
        check_generate_args(prompts, n, sampling)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (pass tokenizer= to HFEngine)")
        if seed is None and self.seed is not None:
            seed = self.seed + self._calls
        self._calls += 1

        rows = [(pi, list(map(int, p))) for pi, p in enumerate(prompts) for _ in range(n)]
        out: list[Sample] = []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, len(rows), self.max_batch_size):
                out.extend(self._generate_rows(rows[start : start + self.max_batch_size], sampling))
        return out

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """The in-process model's log-probs of token_ids[1:] at temperature 1 (one forward; the
        sampling RNG and the seed counter are untouched, so a probed run samples what an unprobed
        one does)."""
        ids = torch.tensor([list(map(int, token_ids))], device=self.device)
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]
        return {"in-process": lp.tolist()}

    def _shared_prefill(self, rows: list[tuple[int, list[int]]], input_ids: torch.Tensor,
                        attention_mask: torch.Tensor) -> dict:
        """`generate`'s cache argument holding every row's prompt but its last column, computed once
        per distinct prompt and copied to its rows: the n samples of a prompt share one prefill
        (SGLang and vLLM share it through their prefix caches). `generate` then prefills only the
        last column (transformers generation/utils.py `_prefill`: with a cache of length L and the
        full attention mask, it feeds input_ids[:, L:]). {} (no sharing) when no prompt repeats,
        when routing is recorded (the hooks see one prefill call), or for a model without a
        DynamicCache-style `cache` argument.

        Sampling draws the same random numbers (the prefill is deterministic); the prompt's keys
        and values come from a forward over fewer rows, so they can differ from the unshared
        path's in the last bits (GEMMs of another shape)."""
        from transformers import DynamicCache

        keys = [tuple(p) for _, p in rows]
        first: dict[tuple, int] = {}  # each distinct prompt -> its first row, in order
        for r, k in enumerate(keys):
            first.setdefault(k, r)
        width = input_ids.shape[1]
        if len(first) == len(rows) or width < 2 or self._gates or not self._takes_cache:
            return {}
        slot = {k: i for i, k in enumerate(first)}
        src = torch.tensor(list(first.values()), device=input_ids.device)
        expand = torch.tensor([slot[k] for k in keys], device=input_ids.device)
        mask = attention_mask[src, : width - 1]
        # the position ids generate derives from the attention mask (_prepare_position_ids_for_generation)
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=input_ids[src, : width - 1], attention_mask=mask, position_ids=pos, cache=cache,
                   use_cache=True, logits_to_keep=1)
        cache.batch_select_indices(expand)
        return {"cache": cache}

    def _aborted_rows(self, rows: list[tuple[int, list[int]]]) -> list[Sample]:
        return [Sample(prompt_index=pi, prompt_ids=prompt, response_ids=[], response_logprobs=[],
                       finish_reason="abort", weight_version=self._weight_version,
                       text="" if self.tokenizer is not None else None,
                       meta={"matched_stop": None, "prompt_tokens": len(prompt), "completion_tokens": 0})
                for pi, prompt in rows]

    def _generate_rows(self, rows: list[tuple[int, list[int]]], sp: SamplingParams) -> list[Sample]:
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        if self._interrupt.is_set():
            return self._aborted_rows(rows)
        flag = self._interrupt

        class _Interrupted(StoppingCriteria):  # every row is done once interrupt() was called
            def __call__(self, input_ids, scores, **kwargs):
                return torch.full((input_ids.shape[0],), flag.is_set(), dtype=torch.bool, device=input_ids.device)

        tok, stops = self.tokenizer, tuple(sp.stop)

        class _StopStrings(StoppingCriteria):
            """A row is done once its generated tokens' text contains a stop string. Not
            transformers' stop_strings, which match across the prompt's tail as well: a prompt
            ending in an agent's environment tokens would stop its first token (SGLang matches
            the output only)."""

            def __call__(self, input_ids, scores, **kwargs):
                rows = input_ids[:, width:].tolist()
                done = [any(x in tok.decode(r, skip_special_tokens=False) for x in stops) for r in rows]
                return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

        greedy = sp.temperature <= 0 or sp.top_k == 1
        lp_temp = 1.0 if greedy else float(sp.temperature)
        stop_ids = tuple(dict.fromkeys(self.eos_token_ids + tuple(int(i) for i in sp.stop_token_ids)))

        width = max(len(p) for _, p in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (_, p) in enumerate(rows):
            input_ids[r, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[r, width - len(p) :] = 1
        gen_cfg = GenerationConfig(
            max_new_tokens=sp.max_new_tokens,
            min_new_tokens=0,
            do_sample=not greedy,
            # greedy: leave the sampling knobs unset (transformers warns about set-but-unused ones);
            # sampling: top_k=0 disables top-k (transformers' own default would be 50)
            temperature=None if greedy else float(sp.temperature),
            top_k=None if greedy else (0 if sp.top_k <= 0 else int(sp.top_k)),
            top_p=None if greedy else float(sp.top_p),
            eos_token_id=list(stop_ids) or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        # every forward of generate (the prefill, then one decode step per new token but the last)
        # records each layer's top-k (read from the router's output as its family says)
        routed: list[list[torch.Tensor]] = [[] for _ in self._gates]
        hooks = [g.register_forward_hook(lambda m, i, out, li=li, topk=topk: routed[li].append(topk(out).detach().cpu()))
                 for li, (_, g, topk) in enumerate(self._gates)]
        try:
            with torch.no_grad():
                input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
                res = self.model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=gen_cfg,
                    stopping_criteria=StoppingCriteriaList([_Interrupted()] + ([_StopStrings()] if stops else [])),
                    **self._shared_prefill(rows, input_ids, attention_mask),
                )
        finally:  # only the hooks: an exception of generate must reach the caller as itself
            for h in hooks:
                h.remove()
        gen = res.sequences[:, width:]
        steps = gen.shape[1]
        assert len(res.logits) == steps, (len(res.logits), steps)
        with torch.no_grad():  # per step to avoid stacking [B, steps, V] in fp32
            lps = torch.stack(
                [
                    torch.log_softmax(res.logits[t].float() / lp_temp, dim=-1)
                    .gather(1, gen[:, t : t + 1])
                    .squeeze(1)
                    for t in range(steps)
                ],
                dim=1,
            ) if steps else torch.zeros((len(rows), 0))
        gen_l = gen.cpu().tolist()
        lps_l = lps.cpu().tolist()
        routing = self._routing_by_position(routed, len(rows), width) if self._gates else None

        samples = []
        stop_set = set(stop_ids)
        for r, (pi, prompt) in enumerate(rows):
            toks = gen_l[r]
            end, reason, why = len(toks), "length", None
            for t, tok in enumerate(toks):
                if tok in stop_set:
                    end, reason, why = t + 1, "stop", tok
                    break
            if sp.stop:
                end_s = self._stop_string_end(toks[:end], sp.stop)
                if end_s is not None and (reason != "stop" or end_s < end):
                    end, reason, why = end_s, "stop", "stop_string"
            if reason == "length":
                end = min(end, sp.max_new_tokens)
                if end < sp.max_new_tokens:  # unfinished, and generation stopped: interrupt()
                    reason = "abort"
            resp = toks[:end]
            samples.append(
                Sample(
                    prompt_index=pi,
                    prompt_ids=prompt,
                    response_ids=resp,
                    response_logprobs=lps_l[r][:end],
                    finish_reason=reason,
                    weight_version=self._weight_version,
                    text=(
                        self.tokenizer.decode(resp, skip_special_tokens=True)
                        if self.tokenizer is not None
                        else None
                    ),
                    meta={"matched_stop": why, "prompt_tokens": len(prompt), "completion_tokens": end},
                    routed_experts=(routing[r, width - len(prompt): width + end - 1].clone()
                                    if routing is not None and reason != "abort" else None),
                )
            )
        return samples

    def _routing_by_position(self, routed: list[list[torch.Tensor]], rows: int, width: int) -> torch.Tensor:
        """[rows, width + decode steps, layers, k] from the per-call top-k of each MoE layer: the
        prefill call covers the left-padded prompt columns, each decode call one column; a dense
        layer's row stays zeros (SGLang's, see the class docstring)."""
        per_moe = []
        for calls in routed:
            prefill = calls[0].view(rows, width, -1)
            steps = [c.view(rows, 1, -1) for c in calls[1:]]
            per_moe.append(torch.cat([prefill, *steps], 1))
        first = per_moe[0]
        out = torch.zeros(first.shape[0], first.shape[1], self.model.config.num_hidden_layers, first.shape[2],
                          dtype=torch.int32)
        for (layer, _, _), t in zip(self._gates, per_moe):
            out[:, :, layer] = t.to(torch.int32)
        return out

    def _stop_string_end(self, toks: list[int], stops: tuple[str, ...]) -> int | None:
        """Length of the shortest prefix of `toks` whose decoded text contains a stop string."""
        return stop_string_end(self.tokenizer, toks, stops)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy Hub-named full tensors into the model in place, then set `weight_version`.

        Raises `WeightUpdateError` naming the tensor for an unknown name or a wrong shape, and
        listing the missing names if the stream did not cover every parameter. After a failed
        update the model is partially overwritten: `generate` refuses to run until a complete
        update succeeds (`weight_version` keeps its old value).
        """
        targets = hub_weight_targets(self.model)
        required = {t.key for t in targets.values()}
        seen: set[str] = set()
        self._weights_inconsistent = "update in progress"
        try:
            with torch.no_grad():
                for name, tensor in named_tensors:
                    tgt = targets.get(name)
                    if tgt is None:
                        raise WeightUpdateError(
                            f"update_weights: unknown tensor {name!r}: not a Hub-format parameter name "
                            f"of this {type(self.model).__name__}"
                        )
                    if tuple(tensor.shape) != tgt.shape:
                        raise WeightUpdateError(
                            f"update_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                            f"expected {tgt.shape}"
                        )
                    tgt.get().copy_(tensor)
                    seen.add(tgt.key)
            missing = sorted(required - seen)
            if missing:
                shown = ", ".join(missing[:20]) + (f", ... ({len(missing)} in all)" if len(missing) > 20 else "")
                raise WeightUpdateError(
                    f"update_weights: the stream did not cover {len(missing)} parameter(s): {shown}"
                )
        except BaseException as e:
            self._weights_inconsistent = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise
        self._weights_inconsistent = None
        self._weight_version = version
