"""LoRA adapters on Megatron's parallel linear layers (issue 55): W x -> W x + (alpha / r) B A x, with
A (r x in) and B (out x r) split the way Megatron splits W, so that the adapted layer computes
exactly what one device holding the merged W + (alpha / r) B A would, at every TP / SP / EP / PP /
CP layout.

Where the adapters go (`targets`, rollout names in config.LoraConfig):
  * "attention": every linear_* of a layer's self_attention (qkv and the output projection; MLA's
    down/up projections), never the router;
  * "mlp": the linear_fc1 / linear_fc2 of dense MLP layers;
  * "shared_experts": the shared experts' linear_fc1 / linear_fc2;
  * "experts": each routed expert's linear_fc1 / linear_fc2 - one adapter per expert (never one
    shared by an EP rank's local experts: the model trained would change with the EP degree).

An adapter is two parameters registered on the linear module itself (`<linear>.lora_A`,
`<linear>.lora_B`) and a forward hook that adds its output: the base module, its parameter names
and its checkpoint layout are untouched, and the base is frozen (requires_grad False: no gradient
buffer, no optimizer state).

How each layer is split (y = W x on one device; A, B as above; s = alpha / r):
  * column-parallel (W split on its output rows: linear_qkv, linear_fc1): A whole on every TP rank,
    B split on its rows as W is. With sequence parallelism the hook's input is this rank's
    sequence shard: z = A x_shard is gathered over the sequence (backward: reduce-scatter), then
    y_rank += s B_rank z. Without it, z = A x goes through Megatron's copy-to-TP region (backward:
    all-reduce), so dA sums every rank's B_rank^T dy_rank. With SP each rank's dA covers its
    tokens only: A is marked `sequence_parallel`, which finalize_model_grads sums over TP
    (megatron/core/distributed/finalize_model_grads.py:354-357).
  * row-parallel (W split on its input columns: linear_proj, linear_fc2): A split on its columns
    as W is, B whole. u_rank = A_rank x_rank is a partial sum: reduced over TP (all-reduce, or with
    SP reduce-scatter to this rank's sequence shard) before y += s B u. With SP, dB covers this
    rank's tokens only: B is marked `sequence_parallel` (summed over TP as above).
  * routed experts: A and B whole per expert at expert-TP 1, y += s B A x on the expert's own
    tokens. At expert-TP > 1 the split is the dense one (column: B on its rows; row: A on its
    columns), but Megatron's expert linears do no communication of their own
    (tensor_parallel/layers.py:841, explicit_expert_comm): the token dispatcher gives every
    expert-TP rank the same tokens and sums fc2's outputs, and fc1's input gradients, over the
    expert-TP group. So the adapter adds its own partial sum: row, s B (A_rank x_rank) - the
    dispatcher's sum makes it s B A x (adding the reduced s B A x on every rank would count it ETP
    times: Megatron-Bridge's defect, NVIDIA-NeMo/Megatron-Bridge#5634); column, s B_rank (A x).
    The factor whole on every expert-TP rank (row: B, column: A) then has a partial gradient on
    each: it enters through Megatron's copy-to-TP region over the expert-TP group (forward
    identity, backward all-reduce), and the input gradient stays the partial sum the dispatcher
    reduces. Every expert adapter's gradient is then reduced over the expert-data-parallel group
    like the expert's weights (`allreduce=False`, Megatron DDP's expert buffers).

Initialisation (PEFT's): A uniform(-1/sqrt(in), 1/sqrt(in)) of the *whole* matrix from a generator
seeded by (seed, the layer's global name), then sliced; B zero: the adapted model starts as the base
model, and every layout starts from the same adapters.
"""
from __future__ import annotations

import contextlib
import math
import re
import zlib
from dataclasses import dataclass
from typing import Iterator

import torch

from gspo_megatron.config import LORA_TARGETS as TARGETS
from gspo_megatron.errors import ConfigError


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    seed: int = 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, lora_cfg, seed: int) -> "LoraSpec":
        """The spec of config.py's `lora:` section (rank > 0)."""
        return cls(rank=lora_cfg.rank, alpha=float(lora_cfg.alpha), dropout=lora_cfg.dropout,
                   targets=tuple(lora_cfg.target_modules), seed=seed)


_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])$")


def target_of(name: str) -> str | None:
    """Which target group a module name (as named_modules gives it) belongs to, or None."""
    if ".self_attention." in name and name.rsplit(".", 1)[-1].startswith("linear_"):
        return "attention"
    if _EXPERT.search(name):
        return "experts"
    if name.endswith((".mlp.shared_experts.linear_fc1", ".mlp.shared_experts.linear_fc2")):
        return "shared_experts"
    if name.endswith((".mlp.linear_fc1", ".mlp.linear_fc2")):
        return "mlp"
    return None


def _kind(module) -> str:
    """"column", "row" or "duplicated": how Megatron splits this linear's weight (duplicated:
    whole on every TP rank, as multi-latent attention's down projections)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        return "column"
    if isinstance(module, RowParallelLinear):
        return "row"
    if isinstance(module, Linear):
        return "duplicated"
    kind = type(module).__name__
    raise ConfigError(f"lora: {kind} is not a Megatron ColumnParallelLinear / RowParallelLinear; LoRA on it is not "
                      "supported yet (the Transformer Engine spec's fused layers: use the local spec)")


def _uniform(shape: tuple[int, int], bound: float, key: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63))
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * bound


class _Adapter:
    """The forward hook of one adapted linear (module docstring)."""

    def __init__(self, kind: str, spec: LoraSpec, expert: bool):
        self.kind, self.scale, self.dropout, self.expert = kind, spec.scale, spec.dropout, expert
        self.enabled = True  # False: the base model (the KL reference of a LoRA run: `disabled`)

    def __call__(self, module, args, output):
        if not self.enabled:
            return output
        x = args[0]
        out, bias = output
        if self.dropout and module.training:
            x = self._dropout(x, module)
        a, b = module.lora_A, module.lora_B
        if self.kind == "duplicated" or module.tp_group.size() == 1:
            delta = (x @ a.t()) @ b.t()
        elif self.expert:
            delta = self._expert(x, a, b, module)
        elif self.kind == "column":
            delta = self._column(x @ a.t(), module) @ b.t()
        else:
            delta = self._row(x @ a.t(), module) @ b.t()
        return out + self.scale * delta.to(out.dtype), bias

    def _dropout(self, x, module):
        """Dropout on the adapter's input. An input every (expert-)TP rank holds whole - a column
        linear's without sequence parallelism, any expert linear's at expert-TP > 1 - needs the
        same mask on each: drawn from Megatron's data-parallel RNG tracker (seeded alike on every
        rank, advanced only by model code, restored by activation recompute), not the default
        generator, which rank 0's rollout work may have advanced."""
        sharded = getattr(module.weight if self.kind == "duplicated" else module, "sequence_parallel", False)
        replicated = module.tp_group.size() > 1 and self.kind in ("column", "duplicated") and (
            self.expert or not sharded)
        if not replicated:
            return torch.nn.functional.dropout(x, self.dropout)
        from megatron.core.tensor_parallel import random as mrandom

        with mrandom.get_cuda_rng_tracker().fork(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME):
            return torch.nn.functional.dropout(x, self.dropout)

    def _expert(self, x, a, b, module):
        """Expert-TP > 1: this rank's partial sum; the whole factor's gradient summed over the
        expert-TP group (module docstring)."""
        from megatron.core.tensor_parallel import mappings as m

        if self.kind == "column":
            return (x @ m.copy_to_tensor_model_parallel_region(a, group=module.tp_group).t()) @ b.t()
        return (x @ a.t()) @ m.copy_to_tensor_model_parallel_region(b, group=module.tp_group).t()

    @staticmethod
    def _column(z, module):
        """A x (whole A) -> the z every TP rank's B slice takes: the whole sequence under SP."""
        from megatron.core.tensor_parallel import mappings as m

        if module.sequence_parallel:
            return m.gather_from_sequence_parallel_region(z, group=module.tp_group)
        return m.copy_to_tensor_model_parallel_region(z, group=module.tp_group)

    @staticmethod
    def _row(u, module):
        """A_rank x_rank, a partial sum over TP -> its sum (this rank's sequence shard under SP)."""
        from megatron.core.tensor_parallel import mappings as m

        if module.sequence_parallel:
            return m.reduce_scatter_to_sequence_parallel_region(u, group=module.tp_group)
        return m.reduce_from_tensor_model_parallel_region(u, group=module.tp_group)


def apply_lora(chunks, spec: LoraSpec, *, ep_rank: int = 0) -> int:
    """Freeze every parameter of `chunks` and add an adapter to each targeted linear; the number of
    adapted linears on this rank. Each adapter's init key is its layer's name on one device (the
    global layer number, the global expert index), so every layout starts from the same adapters."""
    if spec.rank < 1:
        raise ConfigError(f"lora.rank must be >= 1, got {spec.rank}")
    unknown = sorted(set(spec.targets) - set(TARGETS))
    if unknown:
        raise ConfigError(f"lora.target_modules: unknown {unknown}; one or more of {list(TARGETS)} (routers never)")
    n = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for name, module in list(chunk.named_modules()):
            group = target_of(name)
            if group is None or group not in spec.targets:
                continue
            key = _layer_key(chunk, _expert_global(chunk, name, ep_rank))
            _add(module, key, group, spec)
            if group == "experts":  # their grouped-GEMM fast path (parallel/cpu_experts.py) would skip the hooks
                chunk.get_submodule(name.split(".local_experts.")[0]).lora_adapted = True
            n += 1
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            embedding.register_forward_hook(_inputs_require_grad)
    return n


def _inputs_require_grad(module, args, output):
    """The frozen embedding's output made to require grad (PEFT's enable_input_require_grads):
    else the first layers' inputs do not, and Megatron's activation recompute - full (its
    CheckpointFunction) or selective (CheckpointWithoutOutput, whose saved inputs then never
    reach the backward: "forward() missing 1 required positional argument") - records no graph
    through the layers it recomputes, and their adapters get no gradient."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _expert_global(chunk, name: str, ep_rank: int) -> str:
    """A routed expert's module name with its local index made global (EP rank r holds experts
    r * num_local_experts ...); any other name unchanged."""
    m = _EXPERT.search(name)
    if m is None:
        return name
    experts = chunk.get_submodule(name[:m.start(1) - len(".local_experts.")])
    g = ep_rank * int(experts.num_local_experts) + int(m.group(1))
    return name[:m.start(1)] + str(g) + name[m.end(1):]


def _layer_key(chunk, name: str) -> str:
    """`decoder.layers.<i>.` with the chunk's local layer index made global (the layer's 1-based
    layer_number: a pipeline stage's or virtual chunk's layers start past the earlier ones)."""
    m = re.match(r"^(.*?\blayers)\.(\d+)\.", name)
    if m is None:
        return name
    number = int(chunk.get_submodule(f"{m.group(1)}.{m.group(2)}").layer_number)
    return f"{m.group(1)}.{number - 1}." + name[m.end():]


def _add(module, key: str, group: str, spec: LoraSpec) -> None:
    kind = _kind(module)
    expert = group == "experts"
    if module.tp_group is None:  # (a duplicated Linear built without one: what Megatron's own default is)
        from megatron.core import parallel_state

        module.tp_group = parallel_state.get_tensor_model_parallel_group()
    tp = module.tp_group.size() if kind != "duplicated" else 1
    w = module.weight
    out_local, in_local = w.shape
    if tp == 1:
        out_full, in_full = out_local, in_local
    elif kind == "column":
        out_full, in_full = out_local * tp, in_local
    else:
        out_full, in_full = out_local, in_local * tp
    rank = module.tp_group.rank()
    a_full = _uniform((spec.rank, in_full), 1.0 / math.sqrt(in_full), key, spec.seed)
    a = a_full[:, rank * in_local:(rank + 1) * in_local] if kind == "row" else a_full
    b = torch.zeros(out_local if kind == "column" else out_full, spec.rank, dtype=torch.float64)
    module.lora_A = torch.nn.Parameter(a.to(device=w.device, dtype=w.dtype).contiguous())
    module.lora_B = torch.nn.Parameter(b.to(device=w.device, dtype=w.dtype).contiguous())
    if kind == "duplicated":  # whole everywhere; with SP each TP rank's tokens: both summed over TP, as W is
        for p in (module.lora_A, module.lora_B):
            setattr(p, "sequence_parallel", bool(getattr(module.weight, "sequence_parallel", False)))
    sp = bool(getattr(module, "sequence_parallel", False)) and tp > 1 and not expert
    replicated = module.lora_B if kind == "row" else module.lora_A  # whole on every TP rank
    split = module.lora_A if kind == "row" else module.lora_B
    if sp:
        setattr(replicated, "sequence_parallel", True)  # its gradient covers this rank's tokens: summed over TP
    if tp > 1:
        # what Megatron's own split weights carry (checkpoints and grad-norm accounting read it)
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        set_tensor_model_parallel_attributes(split, True, 1 if kind == "row" else 0, 1)
    if expert:
        for p in (module.lora_A, module.lora_B):
            setattr(p, "allreduce", False)  # the expert-data-parallel group, as the expert's weights
    module._lora = {"kind": kind, "group": group, "key": key}
    module.register_forward_hook(_Adapter(kind, spec, expert))
    module.sharded_state_dict = _ShardedWithAdapters(module, module.sharded_state_dict)


class _ShardedWithAdapters:
    """An adapted linear's `sharded_state_dict`: Megatron's for its own tensors, and the adapters
    split as the weight is (the split factor on the weight's TP axis, the other replicated), with
    a gated fc1's B stored as its weight is, gate rows then up rows of the whole layer
    (mlp.py:264-268 apply_swiglu_sharded_factory), so a checkpoint resumes at any TP / ETP. The
    parents (SequentialMLP, the layer stack) add the expert and layer offsets as to the weight."""

    def __init__(self, module, base):
        self.module, self.base = module, base

    def __call__(self, prefix: str = "", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        m = self.module
        sd = self.base(prefix, sharded_offsets, metadata)
        column = m._lora["kind"] == "column"
        split = "lora_B" if column else "lora_A"
        axis_map = {split: 0 if column else 1} if m.tp_group.size() > 1 and m._lora["kind"] != "duplicated" else {}
        mine = make_sharded_tensors_for_checkpoint({"lora_A": m.lora_A, "lora_B": m.lora_B}, prefix, axis_map,
                                                   sharded_offsets, tp_group=m.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if m._lora["key"].endswith("linear_fc1") and m.config.gated_linear_unit:
            k = f"{prefix}lora_B"
            mine[k] = apply_swiglu_sharded_factory(mine[k], sharded_offsets,
                                                   (metadata or {}).get("singleton_local_shards", False))
        sd.update(mine)
        return sd


@contextlib.contextmanager
def disabled(chunks):
    """Within: every adapter of `chunks` adds nothing - the chunks compute the frozen base model
    (a LoRA run's KL reference, with no second copy of the model)."""
    hooks = [h for _, m in adapters(chunks) for h in m._forward_hooks.values() if isinstance(h, _Adapter)]
    for h in hooks:
        h.enabled = False
    try:
        yield
    finally:
        for h in hooks:
            h.enabled = True


def is_adapted(chunks) -> bool:
    """Whether `chunks` (bare or wrapped in DDP) carry adapters: a LoRA policy."""
    return next(adapters(chunks), None) is not None


def is_adapter_param(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def adapters(chunks) -> Iterator[tuple[str, torch.nn.Module]]:
    """(module name, adapted linear) for every adapter of `chunks`, chunk by chunk."""
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if getattr(module, "_lora", None) is not None:
                yield name, module


def merged_weight(module) -> torch.Tensor:
    """This rank's slice of W + (alpha / r) B A for an adapted linear (what a merged push sends)."""
    scale = next(h.scale for h in module._forward_hooks.values() if isinstance(h, _Adapter))
    return module.weight + scale * (module.lora_B @ module.lora_A).to(module.weight.dtype)


def hf_modules(module, arch) -> tuple:
    """(mapping rule, the HF module names one adapted Megatron linear stands for): linear_qkv is
    q_proj, k_proj and v_proj, a linear_fc1 gate_proj and up_proj, anything else one module."""
    from gspo_megatron.model import mapping

    m = mapping.match(module._lora["key"] + ".weight", arch)
    return m.rule, [n[: -len(".weight")] for n in m.rule.hf_names(m.layer, m.expert)]


def hf_to_local(module, arch, tensors) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of one adapted linear from HF-layout adapters (PEFT's names:
    `<hf module>.lora_A.weight` r x in, `.lora_B.weight` out x r). A linear that fuses several HF
    modules holds one A: theirs must be equal (else one line naming them); their B's are stacked
    and split as Megatron stacks and splits the weights (model/mapping.py)."""
    from gspo_megatron.model import mapping

    rule, names = hf_modules(module, arch)
    try:
        a_list = [tensors[f"{n}.lora_A.weight"] for n in names]
        b_list = [tensors[f"{n}.lora_B.weight"] for n in names]
    except KeyError as e:
        raise ConfigError(f"lora adapters: {e.args[0]} is missing") from None
    for n, a in zip(names[1:], a_list[1:]):
        if not torch.equal(a, a_list[0]):
            raise ConfigError(f"lora adapters: {n}.lora_A.weight differs from {names[0]}.lora_A.weight; Megatron's fused "
                              f"{module._lora['key'].rsplit('.', 1)[-1]} holds one A for {', '.join(names)}")
    rank, size = module.tp_group.rank(), module.tp_group.size()  # the expert-TP group for routed experts
    if module._lora["kind"] == "duplicated":
        return a_list[0], mapping.hf_to_full(rule, b_list, arch, 0)
    if module._lora["kind"] == "column":
        a = a_list[0]
        b = mapping.shard(rule, mapping.hf_to_full(rule, b_list, arch, 0), rank, size)
    else:
        a = mapping.shard(rule, a_list[0], rank, size)
        b = b_list[0]
    return a, b


def load_hf_adapters(chunks, arch, tensors) -> int:
    """Set every adapter of `chunks` from HF-layout adapters (hf_to_local); how many were set."""
    n = 0
    with torch.no_grad():
        for _, module in adapters(chunks):
            a, b = hf_to_local(module, arch, tensors)
            for p, t in ((module.lora_A, a), (module.lora_B, b)):
                if tuple(t.shape) != tuple(p.shape):
                    raise ConfigError(f"lora adapters of {module._lora['key']}: shape {tuple(t.shape)} where this rank "
                                      f"holds {tuple(p.shape)}")
                p.copy_(t)
            n += 1
    return n


PEFT_PREFIX = "base_model.model."


def iter_hf_adapters(chunks, ctx, arch, groups: tuple[str, ...] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective: every adapter of the policy in HF layout and PEFT's names
    (`<hf module>.lora_A.weight` r x in, `.lora_B.weight` out x r; a fused Megatron linear's A
    repeated for each HF module it stands for), yielded on global rank 0 only. Each rank sends its
    first replica's pieces (data / context / expert-data parallel rank 0) to rank 0, which joins
    TP pieces as the weights' are joined (model/mapping.py unshard) - adapters are small (rank x
    (in + out) per linear), so they travel in one gather of this rank's pieces. `groups`: only the
    adapters of these target groups (None: all)."""
    import torch.distributed as dist

    from gspo_megatron.model import mapping

    par = ctx.parallel
    edp_rank = dist.get_rank(ctx.edp_group) if par.ep * par.etp < ctx.world_size // par.pp else 0
    first = ctx.dp_rank == 0 and ctx.cp_rank == 0
    mine = []
    for _, module in adapters(chunks):
        if groups is not None and module._lora["group"] not in groups:
            continue
        expert = module._lora["group"] == "experts"
        if module._lora["kind"] == "duplicated" and module.tp_group.rank() != 0:
            continue  # the same whole adapter on every TP rank: the first sends it
        if (expert and edp_rank == 0) or (not expert and first):
            mine.append((module._lora["key"], module.tp_group.rank(), module.lora_A.detach().float().cpu(),
                         module.lora_B.detach().float().cpu(), module._lora["kind"], expert))
    if ctx.world_size > 1:
        gathered = [None] * ctx.world_size if ctx.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if ctx.rank != 0:
        return
    pieces: dict[str, dict] = {}
    for rank_items in gathered:
        for key, tp_rank, a, b, kind, expert in rank_items:
            pieces.setdefault(key, {"kind": kind, "expert": expert, "by_tp": {}})["by_tp"][tp_rank] = (a, b)
    for key in sorted(pieces, key=_natural):
        p = pieces[key]
        m = mapping.match(key + ".weight", arch)
        names = [n[: -len(".weight")] for n in m.rule.hf_names(m.layer, m.expert)]
        parts = [p["by_tp"][r] for r in sorted(p["by_tp"])]
        if len(parts) == 1:
            a, b = parts[0]
            bs = mapping.full_to_hf(m.rule, b, arch) if p["kind"] == "column" else (b,)
        elif p["kind"] == "column":
            a = parts[0][0]
            bs = mapping.full_to_hf(m.rule, mapping.unshard(m.rule, [x[1] for x in parts]), arch)
        else:
            a, bs = mapping.unshard(m.rule, [x[0] for x in parts]), (parts[0][1],)
        for name, b_hf in zip(names, bs):
            yield f"{name}.lora_A.weight", a
            yield f"{name}.lora_B.weight", b_hf


def _natural(key: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", key)]


def save_peft(out_dir: str, tensors: dict[str, torch.Tensor], spec: LoraSpec, *, base_model: str | None = None) -> str:
    """Write `tensors` (iter_hf_adapters) as a PEFT LoRA adapter folder: adapter_model.safetensors
    (PEFT's `base_model.model.` prefix) and adapter_config.json, into a temporary folder renamed to
    `out_dir` once complete (an existing `out_dir` is replaced only then)."""
    import json
    import os
    import shutil
    import tempfile

    from safetensors.torch import save_file

    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
              "lora_dropout": spec.dropout, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "use_rslora": False, "base_model_name_or_path": base_model}
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".peft-", dir=parent)
    try:
        save_file({PEFT_PREFIX + k: v.detach().clone().contiguous() for k, v in tensors.items()},  # a fused A is shared
                  os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=1, sort_keys=True)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
