"""The GSPO training loop, top to bottom:

    prompts -> G samples each (rollout engine, with its log-probs) -> rewards -> group advantages
    -> optional dynamic-sampling filter -> minibatches (default 4) -> π_old (engine or recompute)
    -> per minibatch: Megatron forward_backward with the GSPO loss, optimizer step
    -> push weights to the engine -> metrics -> periodic checkpoint

Rank 0 drives the rollout engine and the reward, shuffles the samples and decides which DP rank
trains on which (train/batch.py dp_owners: the plan's own minibatch split and DP balance). Every
rank receives every sample's lengths; the content (tokens, advantages, engine log-probs, masks,
routing) as tensors, each DP rank's share only to that DP rank's ranks (parallel/dataplane.py).
Then all ranks train together through Megatron's schedules, each planning every DP rank's
microbatches from the lengths and collating its own.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gspo_megatron.algorithms import group_advantages
from gspo_megatron.algorithms.mismatch import MAX_KEYS as MISMATCH_MAXES
from gspo_megatron.algorithms.mismatch import SUM_KEYS as MISMATCH_SUMS
from gspo_megatron.algorithms.mismatch import mismatch_metrics
from gspo_megatron.model.export import iter_hf_tensors
from gspo_megatron.parallel.dataplane import DataPlane
from gspo_megatron.rollout.base import Sample, WeightVerificationError
from gspo_megatron.train import checkpoint
from gspo_megatron.train.batch import (RemoteSample, TrainSample, decode_share, dp_owners, encode_shares,
                                       split_minibatches)
from gspo_megatron.train.loss import (PI_OLD_IS_CURRENT, WEIGHTED_METRICS, LossSettings, fill_logprobs_step,
                                      policy_loss_step, sft_loss_step)
from gspo_megatron.train.metrics import MetricsWriter, plot, reduce_max, reduce_report
from gspo_megatron.train.preemption import Preempted, StopFlag
from gspo_megatron.train.setup import RunParts, setup_run

log = logging.getLogger("gspo_megatron.train")


@dataclass
class LoopState:
    step: int = 0  # GSPO steps completed
    sft_done: bool = False
    sft_steps: int = 0  # warm-start steps completed (a run preempted during its warm start resumes there)
    data: dict = field(default_factory=dict)
    wandb_run_id: str | None = None  # the W&B run a resumed run continues (logging.wandb)

    def to_dict(self) -> dict:
        return {"step": self.step, "sft_done": self.sft_done, "sft_steps": self.sft_steps, "data": self.data,
                "wandb_run_id": self.wandb_run_id}


class NonFiniteError(RuntimeError):
    """train.max_skipped_steps optimizer steps in a row had a non-finite loss or gradient norm."""


class SkipGuard:
    """Counts optimizer steps skipped for a non-finite loss or gradient norm (every rank takes the
    same decision: both are reduced over the ranks before it is taken) and stops the run after
    `limit` in a row: one line, and the last checkpoint (which holds no non-finite tensor: nothing
    non-finite was ever applied) is the one to resume from, with a fix (a lower LR, a reward bug)."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row, self.total = limit, 0, 0

    def record(self, skipped: bool, what: str) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        log.warning("%s: loss or gradient norm not finite; the update is skipped (%d in a row, %d in all)",
                    what, self.in_a_row, self.total)
        if self.in_a_row >= self.limit:
            raise NonFiniteError(f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient "
                                 f"norm ({what}; train.max_skipped_steps={self.limit}): nothing of them was applied or "
                                 "saved; resume from the last checkpoint after fixing the cause (rewards, LR, data)")


# --------------------------------------------------------------------------------------------
# Megatron passes


def _run_schedule(parts: RunParts, step_fn, microbatches, *, forward_only: bool):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for m in parts.model:
        if m.training == forward_only:  # Module.train recurses into every submodule: ~4 ms a step on the CPU demo
            m.train(not forward_only)
    seq = max(mb.seq_length for mb in microbatches)
    ctx = torch.no_grad() if forward_only else torch.enable_grad()
    with ctx:
        return get_forward_backward_func()(
            forward_step_func=step_fn, data_iterator=iter(microbatches), model=parts.model,
            num_microbatches=len(microbatches), seq_length=seq, micro_batch_size=microbatches[0].micro_batch_size,
            forward_only=forward_only,
        )


def _optimizer_step(parts: RunParts, optimizer, scheduler, step_fn, microbatches, keys: tuple[str, ...] = (),
                    loss_key: str | None = None):
    """One update. Returns (the microbatch reports, the gradient norm, their `keys` summed over the
    ranks (collective; none when `keys` is empty), whether the update was skipped for a non-finite
    loss (`loss_key` of those sums) or gradient norm: then neither the weights, Adam's moments nor
    the LR schedule move)."""
    from gspo_megatron.train.optim import guarded_step

    for m in parts.model:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    reports = _run_schedule(parts, step_fn, microbatches, forward_only=False)
    tot = reduce_report(reports, _reporter(parts), keys, parts.ctx.device) if keys else {}  # the same on every rank
    if loss_key is None or math.isfinite(tot[loss_key]):
        ok, grad_norm = guarded_step(optimizer)
    else:
        ok, grad_norm = False, float("nan")
    if ok and scheduler is not None:
        scheduler.step(increment=1)
    return reports, grad_norm, tot, not math.isfinite(grad_norm)


def _reporter(parts: RunParts) -> bool:
    c = parts.ctx
    return c.is_last_stage and c.tp_rank == 0 and c.cp_rank == 0


# --------------------------------------------------------------------------------------------
# Phases


def push_weights(parts: RunParts, version: int, producer=None) -> float:
    """Stream the current policy into the rollout engine (rank 0 owns the engine). Colocated
    engines first take their GPU memory back (rollout/colocate.py). With an async `producer`,
    the push waits for the generation in progress (they share the engine), or with
    rollout.partial interrupts it (rollout/partial.py), or, where the engine takes weights
    mid-generation (a capability: RolloutEngine.supports_push_mid_generation), runs beside it and
    waits for nothing; then wakes it."""
    t0 = time.perf_counter()
    if parts.colocation is not None:
        parts.colocation.before_push()
    if parts.refit is not None and parts.engine is not None:
        parts.refit.before_push(parts.engine, version)  # digests of this push's tensors, when checked
    # a LoRA policy's adapters the engine takes on their own (its capabilities.lora_targets, agreed
    # at setup): gathered first (collective), their modules' base weights then streamed unmerged
    kw = {"adapter": adapter_push(parts)} if parts.adapter_groups else {}
    stream = iter_hf_tensors(parts.model, parts.ctx, parts.arch, unmerged=parts.adapter_groups)
    if parts.engine is not None:
        if producer is None:
            parts.engine.update_weights(stream, version, **kw)
        elif parts.cfg.rollout.partial:  # interrupt the generation in progress instead of waiting for it
            producer.push(lambda: parts.engine.update_weights(stream, version, **kw), interrupt=parts.engine)
        elif parts.engine.capabilities.push_mid_generation:  # the engine continues it with the new weights
            producer.push(lambda: parts.engine.update_weights_mid_generation(stream, version, **kw), concurrent=True)
        else:  # wait for the generation in progress
            producer.push(lambda: parts.engine.update_weights(stream, version, **kw))
    else:
        for _ in stream:  # other ranks take part in the gathers
            pass
    return time.perf_counter() - t0


def adapter_push(parts: RunParts):
    """Collective: the adapters of parts.adapter_groups as a rollout/lora_push.py AdapterPush on
    rank 0 (None elsewhere)."""
    from gspo_megatron.model.lora import iter_hf_adapters
    from gspo_megatron.rollout.lora_push import AdapterPush

    tensors = dict(iter_hf_adapters(parts.model, parts.ctx, parts.arch, groups=parts.adapter_groups))
    if parts.ctx.rank != 0:
        return None
    return AdapterPush(tensors, rank=parts.cfg.lora.rank, alpha=float(parts.cfg.lora.alpha), groups=parts.adapter_groups)


def verify_refit(parts: RunParts, plane: DataPlane, version: int) -> dict:
    """Collective, after push_weights(version): rollout.verify_weights' log-prob probe when the
    version is due (train/refit_check.py). Every engine server's log-probs of the probe sequence
    against the trainer's, one forward-only pass per server through the training layout; past the
    tolerance every rank raises the same WeightVerificationError. Returns the step's metrics."""
    check, ctx = parts.refit, parts.ctx
    if check is None or not check.due(version):
        return {}
    t0 = time.perf_counter()
    got, failure = None, None
    if ctx.rank == 0:
        try:
            got = check.engine_logprobs(parts.engine)
        except Exception as e:  # the other ranks raise it too instead of waiting in the forward
            failure = f"refit check of weight version {version}: {str(e).splitlines()[0] if str(e) else e!r}"
    where, failure = _broadcast((sorted(got) if got else [], failure))
    if failure is not None:
        raise WeightVerificationError(failure)
    worst = 0.0
    for w in where:
        samples = None
        if ctx.rank == 0:  # one copy per DP rank: each runs its own
            samples = [TrainSample(check.ids[:1], check.ids[1:], 0.0, got[w], None)] * ctx.dp
        samples = distribute(plane, samples, minibatches=1)
        mbs, _ = parts.plan(samples)
        step_fn = fill_logprobs_step(ctx, parts.arch.vocab_size, 1.0, "old_logprobs", compare_engine=True)
        mismatch = _mismatch(parts, _run_schedule(parts, step_fn, mbs, forward_only=True))
        check.judge(version, w, mismatch)
        worst = max(worst, mismatch["mismatch_logprob_abs"])
    return {"refit_probe_abs": worst, "t_verify": time.perf_counter() - t0}


def sft_warmup(parts: RunParts, writer: MetricsWriter | None, plane: DataPlane | None = None, *, start: int = 0,
               guard: SkipGuard | None = None, step_done=None) -> None:
    """Brief supervised warm start on the task's demonstrations (RL normally starts from an SFT
    model; a random-init demo model would otherwise see reward 0 everywhere).

    It steps the run's own optimizer at train.sft_lr: with 16-bit parameters the fp32 master
    weights live in the optimizer, so a second optimizer would keep its own masters and the first
    GSPO step would write the main optimizer's stale ones back over the warm start (and double
    optimizer memory). Afterwards Adam's moments are cleared (GSPO starts with fresh statistics,
    the masters keep the warmed-up weights) and the scheduler's LR is restored.
    `plane`: the run's data plane (built here when not given). `start`: warm-start steps already
    done (a run preempted during its warm start: their batches are drawn again, untrained, so the
    rest are the ones an uninterrupted run trains on); `step_done(s)` is called (collectively)
    after each step s = 1..steps (the preemption point)."""
    cfg, ctx = parts.cfg, parts.ctx
    steps = cfg.train.sft_warmup_steps
    if steps <= 0:
        return
    plane = plane or DataPlane(ctx)
    from gspo_megatron.train.optim import reset_optimizer_state, set_lr

    opt = parts.optimizer
    set_lr(opt, cfg.train.sft_lr)
    batch = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    rng = random.Random(cfg.train.seed + 7919)
    guard = guard or SkipGuard(cfg.train.max_skipped_steps)
    for s in range(steps):
        samples = parts.prompts.demonstrations(batch, rng) if ctx.rank == 0 else None
        if s < start:
            continue
        samples = distribute(plane, samples, minibatches=1)  # planned below as one minibatch
        mbs, _ = parts.plan(samples)
        _, _, tot, skipped = _optimizer_step(parts, opt, None, sft_loss_step(ctx, parts.arch.vocab_size), mbs,
                                             ("nll_sum", "tokens"), "nll_sum")
        guard.record(skipped, f"supervised warm start step {s + 1}")
        if writer is not None and (s % 10 == 0 or s == steps - 1):
            row = {"step": 0, "phase": "sft", "sft_step": s + 1, "nll": tot["nll_sum"] / max(tot["tokens"], 1)}
            writer.write(row)
            log.info("supervised warm start %d/%d: token NLL %.3f", s + 1, steps, row["nll"])
        if step_done is not None:
            step_done(s + 1)
    reset_optimizer_state(opt)
    parts.scheduler.step(increment=0)  # back to the GSPO schedule's LR (its step count is unchanged)


def _broadcast(obj):
    """A small object from rank 0 to every rank (pickled: not for samples, see `distribute`)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def distribute(plane: DataPlane, samples: list[TrainSample] | None, minibatches: int
               ) -> list[TrainSample | RemoteSample]:
    """Collective. Rank 0's `samples` (in training order; None elsewhere) as every rank needs
    them for `minibatches` minibatches: the ones its DP rank trains on as TrainSamples, every other
    one as a RemoteSample (its lengths). Only each DP rank's ranks receive its samples' content
    (parallel/dataplane.py); rank 0 keeps its own objects."""
    ctx = plane.ctx
    if ctx.world_size == 1:  # nobody to send to: encoding the batch cost 10 ms of a 0.4 s CPU demo step
        return list(samples)
    if ctx.rank != 0:
        header, share = plane.exchange()
        return decode_share(header, share, ctx.dp_rank)
    try:
        owners = dp_owners([x.length for x in samples], ctx.dp, minibatches)
        header, shares, sizes = encode_shares(samples, owners, ctx.dp)
    except BaseException:
        plane.abort()  # the other ranks raise instead of waiting for samples
        raise
    header, _ = plane.exchange(header, shares, sizes)
    del shares
    return decode_share(header, torch.empty(0, dtype=torch.uint8), ctx.dp_rank, local=samples)


def rollout(parts: RunParts, step: int, generate=None) -> tuple[list[Sample], list[float], dict]:
    """Rank 0: this step's samples, rewards and rollout stats from the run's rollout driver
    (rollout.driver: rollout/drivers.py), checked. `generate`: the engine's, or a
    PartialGenerator's (partial rollouts)."""
    from gspo_megatron.rollout.drivers import check_batch

    batch = parts.driver(parts.rollout_context(generate), step)
    batch = check_batch(batch, parts.cfg.rollout.driver_spec, parts.cfg.rollout.samples_per_prompt)
    return batch.samples, batch.rewards, batch.stats


def drop_stale(samples: list[Sample], rewards: list[float], step: int, max_age: int, group: int):
    """Keep the groups whose every sample was generated at most `max_age` versions before `step`
    (a group is kept or dropped whole: its advantages are relative to each other). Returns the
    kept samples, their rewards, the staleness of each kept sample and the number dropped."""
    kept, kept_r, ages, dropped = [], [], [], 0
    for g in range(0, len(samples), group):
        grp = samples[g:g + group]
        age = [step - int(s.weight_version) for s in grp]
        if max(age) > max_age:
            dropped += len(grp)
            continue
        kept += grp
        kept_r += rewards[g:g + group]
        ages += age
    return kept, kept_r, ages, dropped


@dataclass
class _StepPlan:
    """A step's samples laid out for training: `splits` the sample indices of each minibatch,
    `minibatches` their microbatches, `rows` the sample index of each row of each microbatch."""

    splits: list[list[int]]
    minibatches: list[list]
    rows: list[list[list[int]]]

    @property
    def flat(self) -> list:
        return [mb for mbs in self.minibatches for mb in mbs]


def _plan_step(parts: RunParts, samples: list[TrainSample | RemoteSample]) -> _StepPlan:
    splits = split_minibatches(len(samples), parts.cfg.train.minibatches_per_step)
    plan = _StepPlan(splits, [], [])
    for idx in splits:
        groups, mbs = parts.plan_rows([samples[i] for i in idx])
        plan.minibatches.append(mbs)
        plan.rows.append([[idx[j] for j in g] for g in groups])
    return plan


def gspo_step(parts: RunParts, samples: list[TrainSample | RemoteSample], guard: SkipGuard | None = None) -> dict:
    """π_old for every minibatch, then one optimizer step per minibatch. Collective.

    `samples`: the step's samples in training order on every rank; the ones another DP rank trains
    on may be RemoteSamples (`distribute` with train.minibatches_per_step minibatches)."""
    cfg = parts.cfg
    plan = _plan_step(parts, samples)
    t0 = time.perf_counter()
    old = _fill_old_logprobs(parts, samples, plan)
    if parts.reference is not None:
        parts.reference.fill(plan.flat, cfg.rollout.temperature)
    t_old = time.perf_counter() - t0

    settings = loss_settings(cfg)
    update_routing = _routing_pass(parts, {"none": "off", "old": "recorded", "rollout": "rollout"}[
        cfg.train.routing_replay])
    step_fn = policy_loss_step(parts.ctx, parts.arch.vocab_size, settings, routing=update_routing)
    t1 = time.perf_counter()
    totals, mismatch = _update_minibatches(parts, plan.minibatches, step_fn, old, guard or SkipGuard(
        cfg.train.max_skipped_steps))
    t_train = time.perf_counter() - t1
    if update_routing is not None:
        update_routing.close(parts.model)
    out = _step_metrics(totals, settings, cfg.loss)
    out["lr"] = parts.optimizer.param_groups[0]["lr"]
    out.update(mismatch)
    out["t_old_logprobs"] = t_old
    out["t_train"] = t_train
    out["train_tokens"] = sum(x.length for x in samples)
    return out


def loss_settings(cfg) -> LossSettings:
    """The policy loss's settings from the config's loss section and the rollout temperature."""
    lc = cfg.loss
    return LossSettings(lc.type, lc.eps_low, lc.eps_high, lc.kl_coef, lc.entropy_coef, lc.tis_cap,
                        cfg.rollout.temperature, mis=tuple(lc.mis) if lc.mis is not None else None,
                        icepop=tuple(lc.icepop) if lc.icepop is not None else None,
                        cispo_eps=(lc.cispo_eps_low, lc.cispo_eps_high))


@dataclass
class _OldLogprobs:
    """What the π_old phase leaves for the updates: the mismatch metrics when its own pass measured
    them, else (first_is_current) the reports of the π_old pass over the later minibatches, which
    the first update's forward completes."""

    mismatch: dict
    first_is_current: bool = False
    reports: list = field(default_factory=list)


def _fill_old_logprobs(parts: RunParts, samples: list[TrainSample | RemoteSample], plan: _StepPlan) -> _OldLogprobs:
    """Collective. Every microbatch's old_logprobs (π_old).

    π_old of the first minibatch is the policy its own update forward runs (no update yet): that
    forward provides it, and the π_old pass covers the other minibatches only (none at all with
    one minibatch a step, the on-policy case). Not when the routers are recorded or replayed:
    that pass is where the routing is recorded / compared with the engine's."""
    cfg = parts.cfg
    flat = plan.flat
    if cfg.loss.old_logprobs != "recompute":
        for mb in flat:  # paper §5.4: the engine's likelihoods serve as π_old directly
            mb.old_logprobs = mb.engine_logprobs
        return _OldLogprobs({})
    if _routing_controlled(parts, samples):
        return _OldLogprobs(old_logprobs_pass(parts, samples, flat)[0])
    for mb in plan.minibatches[0]:
        mb.extras[PI_OLD_IS_CURRENT] = True
    rest = flat[len(plan.minibatches[0]):]
    if not rest:
        return _OldLogprobs({}, True)
    if len(plan.minibatches) > 2 and parts.ctx.dp == 1 and cfg.train.packing:
        return _OldLogprobs({}, True, _packed_old_logprobs(parts, samples, plan, rest))
    return _OldLogprobs({}, True, old_logprobs_pass(parts, samples, rest)[1])


def _packed_old_logprobs(parts: RunParts, samples: list[TrainSample | RemoteSample], plan: _StepPlan,
                         rest: list) -> list:
    """The later minibatches' π_old in one pass over fewer, fuller microbatches (a forward-only
    pass keeps no activations; each microbatch forward has a fixed per-layer cost), copied back
    row by row into `rest`: a packed row's values depend only on its own sequence. One DP rank
    only (every rank then holds all its samples). Returns the pass's reports."""
    later = [i for idx in plan.splits[1:] for i in idx]
    groups, merged = parts.plan_rows([samples[i] for i in later])
    reports = old_logprobs_pass(parts, samples, merged)[1]
    _copy_old_logprobs(merged, [[later[j] for j in g] for g in groups], rest, [g for rs in plan.rows[1:] for g in rs])
    return reports


_UPDATE_KEYS = ("loss", "loss_norm", "sequences", "mis_masked", "icepop_masked", "icepop_tokens",
                "metric_weight") + WEIGHTED_METRICS


def _update_minibatches(parts: RunParts, minibatches: list[list], step_fn, old: _OldLogprobs,
                        guard: SkipGuard) -> tuple[dict, dict]:
    """Collective. One optimizer step per minibatch. Returns (the applied minibatches' sums, with
    "loss" the sum of per-minibatch losses, "grad_norm" of gradient norms, "applied" and "skipped"
    counts; the mismatch metrics)."""
    totals = dict.fromkeys(_UPDATE_KEYS + ("grad_norm", "applied", "skipped"), 0.0)
    mismatch = old.mismatch
    for i, mbs in enumerate(minibatches):
        reports, gn, tot, was_skipped = _optimizer_step(parts, parts.optimizer, parts.scheduler, step_fn, mbs,
                                                        _UPDATE_KEYS, "loss")
        if i == 0 and old.first_is_current:  # its π_old came from this forward, with its mismatch sums
            mismatch = _mismatch(parts, old.reports + reports)
        guard.record(was_skipped, f"minibatch {i + 1} of the step")
        if was_skipped:  # not in the step's metrics: nothing of it was applied
            totals["skipped"] += 1
            continue
        totals["applied"] += 1
        totals["grad_norm"] += float(gn)
        # per-minibatch loss (sum of sequence losses / sequences; CISPO: of token losses / tokens),
        # averaged over minibatches in _step_metrics
        totals["loss"] += tot["loss"] / max(tot["loss_norm"], 1.0)
        for k in _UPDATE_KEYS[2:]:
            totals[k] += tot[k]
    return totals, mismatch


def _step_metrics(totals: dict, settings: LossSettings, loss_cfg) -> dict:
    """The step's loss metrics from _update_minibatches' sums (NaN loss and grad_norm when every
    minibatch was skipped)."""
    n_all = max(totals["sequences"], 1.0)
    present = {"kl_ref": loss_cfg.kl_coef > 0, "tis_weight_mean": loss_cfg.tis_cap is not None}
    out = {k: totals[k] / max(totals["metric_weight"], 1.0) for k in WEIGHTED_METRICS if present.get(k, True)}
    if settings.mis is not None:  # sequences of the step taken out of the loss by loss.mis
        out["mis_masked"] = totals["mis_masked"]
        out["mis_masked_frac"] = totals["mis_masked"] / n_all
    if settings.icepop is not None:  # loss tokens of the step taken out by loss.icepop
        out["icepop_masked_frac"] = totals["icepop_masked"] / max(totals["icepop_tokens"], 1.0)
    applied = totals["applied"]
    out["loss"] = totals["loss"] / applied if applied else float("nan")
    out["grad_norm"] = totals["grad_norm"] / applied if applied else float("nan")
    out["skipped_updates"] = int(totals["skipped"])
    return out


def _copy_old_logprobs(src_mbs: list, src_rows: list[list[int]], dst_mbs: list, dst_rows: list[list[int]]) -> None:
    """Each sample's π_old row from the microbatches it was computed in to the ones it trains in
    (rows layout; the same positions in both: a packed row holds its own sequence's, this CP
    rank's part). Not on pipeline stages before the last, which never have them."""
    src = {}
    for mb, grp in zip(src_mbs, src_rows):
        if mb.old_logprobs is None:
            return
        counts = (mb.index >= 0).sum(-1).tolist()
        for j, g in enumerate(grp):
            src[g] = mb.old_logprobs[j, :counts[j]]
    if not src:
        return
    device = next(iter(src.values())).device
    for mb, grp in zip(dst_mbs, dst_rows):
        old = torch.zeros(mb.loss_mask.shape, dtype=torch.float32, device=device)
        for j, g in enumerate(grp):
            v = src[g]
            old[j, :v.numel()] = v
        mb.old_logprobs = old


def _routing_controlled(parts: RunParts, samples: list[TrainSample | RemoteSample]) -> bool:
    """Whether the π_old pass records or replays the routers (train.routing_replay, engine routing)."""
    engine_routing = any(x.has_routing for x in samples)
    return bool(parts.routing_replay) and (parts.cfg.train.routing_replay != "none" or engine_routing)


def _mismatch(parts: RunParts, reports: list[dict]) -> dict:
    """Collective. The mismatch_* metrics from the microbatch reports of the π_old forwards."""
    ctx = parts.ctx
    return mismatch_metrics(reduce_report(reports, _reporter(parts), MISMATCH_SUMS, ctx.device),
                            reduce_max(reports, _reporter(parts), MISMATCH_MAXES, ctx.device))


def old_logprobs_pass(parts: RunParts, samples: list[TrainSample | RemoteSample], flat: list) -> tuple[dict, list]:
    """Collective. One forward-only pass over the microbatches `flat` before the first update:
    fills their old_logprobs (π_old is the policy that generated), measures how far the engine's
    log-probs of the same tokens are (mismatch_* metrics) and records (R2) or replays (R3) the
    routing (routing_agreement when the engine reported its experts). Returns (the metrics, the
    microbatch reports they came from)."""
    ctx = parts.ctx
    engine_routing = any(x.has_routing for x in samples)  # the same on every rank (RemoteSamples say it too)
    mode = {"none": "record" if engine_routing else "off", "old": "record",
            "rollout": "rollout"}[parts.cfg.train.routing_replay]
    routing = _routing_pass(parts, mode)
    step_fn = fill_logprobs_step(ctx, parts.arch.vocab_size, parts.cfg.rollout.temperature, "old_logprobs",
                                 compare_engine=True, routing=routing)
    reports = _run_schedule(parts, step_fn, flat, forward_only=True)
    mismatch = _mismatch(parts, reports)
    if routing is not None:
        routing.close(parts.model)
        if engine_routing:
            mismatch["routing_agreement"] = _agreement(parts, routing)
    return mismatch, reports


def _routing_pass(parts: RunParts, mode: str):
    """The routers' control for one schedule pass (None when the model has no RouterReplay)."""
    if not parts.routing_replay or mode == "off":
        return None
    from gspo_megatron.parallel.routing_replay import RoutingPass

    return RoutingPass(parts.ctx, mode, parts.arch.moe_topk)


def _agreement(parts: RunParts, routing) -> float:
    """Fraction of token x layer top-k sets the trainer's π_old pass used that equal the engine's
    (summed over every rank's own tokens and layers)."""
    t = torch.tensor([routing.agree, routing.total], dtype=torch.float64, device=parts.ctx.device)
    dist.all_reduce(t)
    return float(t[0] / t[1]) if t[1] > 0 else float("nan")


def to_train_samples(samples: list[Sample], rewards: list[float], group_size: int, *, step: int = 0,
                     max_token_age: int | None = None) -> list[TrainSample]:
    """Group advantages; with `max_token_age`, tokens generated more than that many weight
    versions before `step` are left out of the loss (loss.max_token_age)."""
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), group_size)
    out = []
    for s, a in zip(samples, adv.tolist()):
        mask = s.loss_mask  # environment tokens of an agent's sample (rollout/agent.py): never trained on
        if max_token_age is not None:
            fresh = [step - v <= max_token_age for v in s.versions()]
            mask = fresh if mask is None else [m and f for m, f in zip(mask, fresh)]
        mask = None if mask is None or all(mask) else list(mask)
        out.append(TrainSample(s.prompt_ids, s.response_ids, float(a), list(s.response_logprobs), s.routed_experts,
                               token_mask=mask))
    return out


# --------------------------------------------------------------------------------------------
# The run


def startup_summary(parts: RunParts) -> str:
    """One paragraph on rank 0: what this run is (clusters run with the progress bar off)."""
    from gspo_megatron.planner import training_setup

    cfg, ctx, p = parts.cfg, parts.ctx, parts.cfg.parallel
    n = parts.arch.count_params()
    src = cfg.model.load or cfg.model.hf_dir or f"random init (seed {cfg.model.init_seed})"
    data = (f"synthetic task {cfg.data.task!r}" if parts.prompts.task is not None
            else f"{cfg.data.path} ({len(parts.prompts.stream.examples)} records)")
    opt = training_setup(cfg)
    return "; ".join([
        f"world {ctx.world_size} = tp {p.tp} x cp {p.cp} x dp {ctx.dp} x pp {p.pp} (ep {p.ep}, etp {p.etp}, "
        f"sequence_parallel {'on' if p.sequence_parallel else 'off'}) on {ctx.device.type}",
        f"model {n['total'] / 1e6:.2f}M parameters, {n['active'] / 1e6:.2f}M active, {cfg.model.dtype}, from {src}",
        f"optimizer {'distributed' if opt['use_distributed_optimizer'] else 'plain'} Adam, lr {cfg.optimizer.lr:g}, "
        f"master weights {opt['master_weights']}, recompute {cfg.train.recompute}, microbatches "
        f"{'packed (THD)' if cfg.train.packing else 'padded [b, s]'} of {cfg.train.micro_batch_tokens} tokens",
        f"data {data}, reward {cfg.reward.fn or 'from the task'}, {cfg.rollout.prompts_per_step} prompts x "
        f"{cfg.rollout.samples_per_prompt} samples per step, {cfg.train.max_steps} steps",
        f"loss {cfg.loss.type} (eps {cfg.loss.eps_low:g}/{cfg.loss.eps_high:g}), rollouts {cfg.rollout.backend}",
    ])


def step_line(row: dict, max_steps: int) -> str:
    parts = [f"step {row['step']}/{max_steps}", f"reward {row['reward_mean']:.3f}",
             f"clip {row.get('clip_frac', 0.0):.3f}"]
    if "kl_ref" in row:
        parts.append(f"kl {row['kl_ref']:.4f}")
    parts += [f"tokens/s {row['tokens_per_s']:.0f}", f"{row['t_step']:.2f} s"]
    return " | ".join(parts)


def train(cfg, *, world_size: int, inputs=None, stop: StopFlag | None = None) -> dict:
    """The run. `stop`: the preemption signal handlers, installed by the caller before it took the
    run lock (gspo_megatron/train/__main__.py), else here: a signal at any point from here on — set
    up, the warm start, the first push, an evaluation, a step, a save — ends the run with the
    checkpoint of the last completed step (warm-start steps included) and exit status 143."""
    stop = stop if stop is not None else StopFlag(cfg.checkpoint.save_on_signals)
    try:
        return _train(cfg, world_size, inputs, stop)
    finally:
        stop.restore()


class _Run:
    """What the run's phases share: the parts, the loop state, rank 0's metrics writer, and
    whether the checkpoint on disk (or none, fresh) holds every completed step."""

    def __init__(self, parts: RunParts, stop: StopFlag):
        self.parts, self.stop = parts, stop
        self.state = LoopState()
        self.writer: MetricsWriter | None = None
        self.saved = True

    def preemption_point(self) -> None:
        """Collective: on a signal, checkpoint the last completed step (unless saved already), exit 143."""
        parts, state = self.parts, self.state
        if not self.stop.requested(parts.ctx.device):
            return
        if not self.saved:
            _save(parts, state, self.writer)
        parts.wait_for_saves("before exiting on a signal")  # the checkpoint is on disk and tracked
        if parts.ctx.rank == 0:
            where = f"step {state.step}" if state.sft_done else f"warm-start step {state.sft_steps}"
            log.warning("saved the step-%d checkpoint after %s (%s); exiting (resume with checkpoint.resume=auto)",
                        state.step, self.stop.received, where)
        raise Preempted(self.stop.received, state.step)

    def save(self) -> None:
        _save(self.parts, self.state, self.writer)
        self.saved = True

    def sft_step_done(self, s: int) -> None:
        self.state.sft_steps = s
        self.saved = False
        self.preemption_point()


def _train(cfg, world_size: int, inputs, stop: StopFlag) -> dict:
    parts = setup_run(cfg, world_size=world_size, inputs=inputs)
    run = _Run(parts, stop)
    producer = None
    try:
        if parts.ctx.rank == 0:
            log.info("run: %s", startup_summary(parts))
        resumed = _resume(run)
        run.writer = _open_metrics(run, resumed)
        plane = DataPlane(parts.ctx)
        guard = SkipGuard(cfg.train.max_skipped_steps)
        run.preemption_point()
        _warm_start(run, plane, guard)
        # Servers/engines may hold other weights (another checkpoint, a fresh random init): push ours
        # before the first rollout of every run, fresh or resumed.
        push_weights(parts, run.state.step)
        verify_refit(parts, plane, run.state.step)
        run.preemption_point()
        if run.state.step == 0:
            evaluate(parts, 0, run.writer)
            run.preemption_point()
        producer = _start_producer(parts, run.state.step)
        last = _gspo_steps(run, producer, plane, guard)
        _finish(run)
    finally:
        gc.unfreeze()
        if producer is not None:
            producer.close()
        if run.writer is not None:
            run.writer.close()
        parts.close()
    return last


def _resume(run: _Run) -> bool:
    """The loop state of the checkpoint checkpoint.resume names (rank 0 resolves it for every
    rank: train/checkpoint.py agree_on_resume), and the prompt stream where it was. Whether there
    was one."""
    parts = run.parts
    resume_from = checkpoint.agree_on_resume(parts.cfg.checkpoint.resume, parts.cfg.out_dir, parts.ctx)
    if not resume_from:
        return False
    run.state = LoopState(**parts.load_checkpoint(resume_from))
    parts.prompts.load_state_dict(run.state.data)
    if parts.ctx.rank == 0:
        log.info("resumed from %s at step %d", resume_from, run.state.step)
    return True


def _open_metrics(run: _Run, resumed: bool) -> MetricsWriter | None:
    """Rank 0's metrics writer: a fresh run starts a fresh metrics file, a resumed one keeps its
    past (and its W&B run, whose id every rank saves in the same loop state)."""
    cfg, ctx, state = run.parts.cfg, run.parts.ctx, run.state
    writer = None
    if ctx.rank == 0:
        tracker = None
        if cfg.logging.wandb.mode != "disabled":
            from gspo_megatron.train.tracking import WandbRun

            tracker = WandbRun(cfg, out_dir=cfg.out_dir, run_id=state.wandb_run_id, config=cfg.to_dict())
            state.wandb_run_id = tracker.run_id
        writer = MetricsWriter(cfg.out_dir, tensorboard=cfg.logging.tensorboard,
                               resume_step=state.step if resumed else -1, tracker=tracker)
    if cfg.logging.wandb.mode != "disabled":
        state.wandb_run_id = _broadcast(state.wandb_run_id)
    return writer


def _warm_start(run: _Run, plane: DataPlane, guard: SkipGuard) -> None:
    """The SFT warm start (train.sft_warmup_steps), where a preempted one stopped."""
    if run.state.sft_done:
        return
    sft_warmup(run.parts, run.writer, plane, start=run.state.sft_steps, guard=guard, step_done=run.sft_step_done)
    run.state.sft_done = True
    run.saved = run.parts.cfg.train.sft_warmup_steps <= 0 and run.saved


def _gspo_steps(run: _Run, producer, plane: DataPlane, guard: SkipGuard) -> dict:
    """The GSPO steps from the loop state's to train.max_steps. Returns the last metrics row."""
    parts, cfg, state = run.parts, run.parts.cfg, run.state
    bar = None
    if parts.ctx.rank == 0 and cfg.logging.progress_bar:
        from tqdm import tqdm

        bar = tqdm(total=cfg.train.max_steps, initial=state.step, desc="GSPO", unit="step")
    last = {}
    # What exists now (modules, Megatron's buffers, the engine, imported libraries: ~400k Python
    # objects on the CPU demo) lives for the whole run: out of the cyclic GC's sight, whose full
    # collections would otherwise scan all of it (0.3 s each on the CPU demo, one every ~20 steps:
    # the slowest step of a bench run). Unfrozen at the end (_train), for callers that live on (tests).
    gc.collect()
    gc.freeze()
    try:
        for step in range(state.step, cfg.train.max_steps):
            row = _gspo_iteration(run, producer, plane, guard, step)
            if row is not None:
                last = row
                _show(bar, row, cfg.train.max_steps)
            if parts.heldout is not None and parts.heldout.due(state.step):
                evaluate(parts, state.step, run.writer, producer)
            run.preemption_point()  # preemption: this step's checkpoint, then exit 143
            if cfg.checkpoint.interval and state.step % cfg.checkpoint.interval == 0 and state.step < cfg.train.max_steps:
                run.save()
                run.preemption_point()  # a signal during the save: it is written, exit now
    finally:
        if bar is not None:
            bar.close()
    return last


def _gspo_iteration(run: _Run, producer, plane: DataPlane, guard: SkipGuard, step: int) -> dict | None:
    """One GSPO step: rollout (rank 0), distribution, the update, the push. Collective. Returns
    rank 0's metrics row (None elsewhere)."""
    parts, state = run.parts, run.state
    t_step = t0 = time.perf_counter()
    samples = rstats = data_state = None
    if parts.ctx.rank == 0:
        samples, rstats, data_state = _step_samples(parts, producer, step)
    data_state = _broadcast(data_state)  # every rank saves it; rstats stay on rank 0 (it writes the rows)
    samples = distribute(plane, samples, parts.cfg.train.minibatches_per_step)
    if parts.colocation is not None:  # the engines release their memory for training
        parts.colocation.after_rollout()
    t_rollout = time.perf_counter() - t0
    metrics = gspo_step(parts, samples, guard) if samples else {}
    t_sync = push_weights(parts, step + 1, producer)
    metrics.update(verify_refit(parts, plane, step + 1))  # rollout.verify_weights, when due
    state.step = step + 1
    state.data = data_state  # the stream right after this step's prompts (async: not the producer's)
    run.saved = False
    if parts.ctx.rank != 0:
        return None
    row = step_row(parts, producer, state.step, rstats, metrics, t_rollout=t_rollout, t_sync=t_sync,
                   dt=time.perf_counter() - t_step)
    run.writer.write(row)
    return row


def _step_samples(parts: RunParts, producer, step: int):
    """Rank 0: the step's training samples in training order, the rollout stats, the prompt-stream
    state after them."""
    cfg = parts.cfg
    kept, rewards, rstats, data_state = _take_rollout(parts, producer, step)
    samples = to_train_samples(kept, rewards, cfg.rollout.samples_per_prompt, step=step,
                               max_token_age=cfg.loss.max_token_age)
    # response tokens in the loss (policy tokens: not an agent's environment tokens, not too old)
    rstats["loss_tokens"] = sum(len(x.response_ids) if x.token_mask is None else sum(x.token_mask)
                                for x in samples)
    # the training order, before the DP split is decided on it
    random.Random(cfg.train.seed * 7 + step).shuffle(samples)
    return samples, rstats, data_state


def step_row(parts: RunParts, producer, step: int, rstats: dict, metrics: dict, *, t_rollout: float,
             t_sync: float, dt: float) -> dict:
    """Rank 0's metrics row of a GSPO step."""
    row = {"step": step, "phase": "gspo", **rstats, **metrics, "t_rollout": t_rollout,
           "t_weight_sync": t_sync, "t_step": dt,
           # of t_weight_sync: the wait for the generation in flight (async), not the transfer
           "t_push_wait": producer.t_push_wait if producer is not None else 0.0,
           "tokens_per_s": metrics.get("train_tokens", 0) / max(dt, 1e-9)}
    # the ideal step over this one: the longer of the batch's generation and the trainer's own
    # work (the step less its wait for the batch), over the step. 1 = perfectly overlapped;
    # synchronous steps run the two in turn (1/2 when they are equal)
    gen = rstats.get("t_generate", t_rollout)
    own = dt - rstats.get("t_wait_rollout", t_rollout)
    row["overlap_efficiency"] = min(1.0, max(gen, own) / max(dt, 1e-9))
    engine = parts.engine.metrics
    if engine.get("verified_tensors") is not None:  # rollout.verify_weights with digests: tensors the last checked push had
        row["weights_verified"] = engine["verified_tensors"]
    if engine.get("lora_bound_modules") is not None:  # the LoRA adapter's modules every server bound, last push
        row["lora_bound_modules"] = engine["lora_bound_modules"]
        row["lora_bind_checks"] = engine.get("lora_bind_checks", 0)  # server pushes whose count was checked so far
    if engine.get("restarts") is not None:  # servers the engine restarted so far (rollout.*.max_restarts)
        row["engine_restarts"] = engine["restarts"]
    if engine.get("servers") is not None:  # the servers in use (rollout.*.urls_file: they come and go)
        row["engine_servers"] = engine["servers"]
    return row


def _show(bar, row: dict, max_steps: int) -> None:
    if bar is None:
        log.info(step_line(row, max_steps))
        return
    bar.update(1)
    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", clip=f"{row.get('clip_frac', 0):.2f}")


def _finish(run: _Run) -> None:
    """The last checkpoint, the HF export (overlapping a background write of that checkpoint), and
    rank 0's metrics file closed (and plotted)."""
    parts, cfg = run.parts, run.parts.cfg
    run.save()
    if cfg.checkpoint.export_hf:
        parts.export_hf(os.path.join(cfg.out_dir, "hf"))
    parts.wait_for_saves("at the end of the run")
    if parts.ctx.rank == 0:
        run.writer.close()
        if cfg.logging.plot:
            plot(run.writer.path, os.path.join(cfg.out_dir, "metrics.png"))


def _save(parts: RunParts, state: LoopState, writer) -> None:
    if writer is not None:
        writer.before_checkpoint()
    parts.save_checkpoint(state.step, state.to_dict())


def evaluate(parts: RunParts, step: int, writer, producer=None) -> None:
    """Held-out evaluation with the engine's current weights (rank 0; no collective): one
    "phase": "eval" row in metrics.jsonl (train/evaluation.py)."""
    if parts.heldout is None or parts.ctx.rank != 0:
        return
    import contextlib

    with producer.lock if producer is not None else contextlib.nullcontext():
        metrics = parts.heldout.run(parts.engine, parts.score, parts.tokenizer, parts.stop_ids)
    writer.write({"step": step, "phase": "eval", **metrics})
    log.info("held-out eval after %d steps: %s", step,
             ", ".join(f"{k.removeprefix('eval/')} {v:.3f}" for k, v in metrics.items()))


def _start_producer(parts: RunParts, start: int):
    """Rank 0's rollout thread when rollout.async_steps > 0 (rollout/async_producer.py)."""
    cfg = parts.cfg
    if not cfg.rollout.async_steps or parts.ctx.rank != 0:
        return None
    import threading

    from gspo_megatron.rollout.async_producer import RolloutProducer
    from gspo_megatron.rollout.partial import PartialGenerator

    gate = threading.Condition()
    producer: list = []  # the producer, once built (the partial generator asks whether it stopped)
    generate = (PartialGenerator(parts.engine, gate, timeout_s=cfg.rollout.async_timeout_s,
                                 stopped=lambda: bool(producer) and producer[0].stopped).generate
                if cfg.rollout.partial else None)
    producer.append(RolloutProducer(lambda t: rollout(parts, t, generate), start=start, end=cfg.train.max_steps,
                                    max_ahead=cfg.rollout.async_steps, version=lambda: parts.engine.weight_version,
                                    data_state=parts.prompts.state_dict, lock=gate,
                                    timeout_s=cfg.rollout.async_timeout_s))
    return producer[0]


def _take_rollout(parts: RunParts, producer, step: int):
    """Rank 0: this step's samples, rewards, rollout stats and the prompt-stream state after them
    - generated now (synchronous) or taken from the producer, with staleness bounded."""
    cfg = parts.cfg.rollout
    if producer is None:
        kept, rewards, rstats = rollout(parts, step)
        return kept, rewards, rstats, parts.prompts.state_dict()
    batch, waited = producer.get(step)
    kept, rewards, rstats = batch.payload
    kept, rewards, ages, dropped = drop_stale(kept, rewards, step, cfg.async_steps, cfg.samples_per_prompt)
    rstats = dict(rstats, staleness_mean=sum(ages) / max(len(ages), 1), staleness_max=max(ages, default=0),
                  samples_dropped_stale=dropped, t_wait_rollout=waited, t_wait_train=producer.t_wait_train,
                  rollout_version=batch.version, t_generate=batch.t_generate)
    # samples whose tokens come from more than one weight version: carried over a push (partial
    # rollouts) or continued by an engine that took the push mid-generation
    rstats["samples_carried"] = sum(1 for s in kept if s.token_versions and len(set(s.token_versions)) > 1)
    producer.t_wait_train = 0.0
    return kept, rewards, rstats, batch.data_state
