"""Pre-flight check of the rollout path, run as the job would run (same config, same launcher):

    torchrun ... -m gspo_megatron.train --config C.yaml --smoke [--smoke-tol 0.05] [overrides]
    SMOKE=1 sbatch launch/slurm/train_with_sglang.sbatch C.yaml ...   (the same, on the job's servers)

It builds the run exactly as training does (servers contacted and their SGLang version checked,
the policy loaded from model.load / model.hf_dir / the checkpoint checkpoint.resume names), then:

  servers     every server answers and reports the SGLang version the project speaks
  weights     one weight push (the run's weight_sync mode); every server then reports its version
  generate    one small rollout (a few prompts x 2 samples, at most 32 new tokens) with log-probs
  log-probs   the trainer's log-probs of the generated tokens (its own π_old pass, all of TP/PP/
              EP/CP) against the engine's: mean |Δ| under --smoke-tol
  routing     (when the run replays the engine's experts) the engine returned them; agreement

and prints a PASS/FAIL table, exit 0 (all pass) or 1 — minutes instead of the first hour of a long
job. A server that accepts a push but keeps serving other weights fails at "log-probs" (it cannot
fail when the servers happened to load the very weights the trainer holds: nothing is stale then).
Nothing is trained, no checkpoint is written; the weight push does change what the servers serve.

The tolerance: mean |log π_trainer - log π_engine| over generated tokens. Same weights in fp32
agree to ~1e-6; bf16 engines vs a bf16 trainer typically land at 1e-3..2e-2 (kernels, batching,
MoE routing flips); weights from another checkpoint are usually far above 0.05.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

from gspo_megatron.parallel.dataplane import DataPlane
from gspo_megatron.rollout.drivers import sampling_params
from gspo_megatron.train import checkpoint
from gspo_megatron.train.loop import _broadcast, distribute, old_logprobs_pass, push_weights, to_train_samples
from gspo_megatron.train.setup import setup_run

log = logging.getLogger("gspo_megatron.train")

DEFAULT_TOL = 0.05
_SMOKE_SAMPLES = 2  # per prompt
_SMOKE_NEW_TOKENS = 32


@dataclass
class Check:
    name: str
    ok: bool | None  # None: information only
    detail: str


def _table(checks: list[Check]) -> str:
    w = max(len(c.name) for c in checks)
    mark = {True: "PASS", False: "FAIL", None: "info"}
    return "\n".join(f"  {c.name:<{w}}  {mark[c.ok]}  {c.detail}" for c in checks)


def _server_rows(engine) -> list[Check]:
    rows = engine.server_software_checks()  # the engine's own servers; none in process
    if not rows:
        return [Check("servers", None, f"{type(engine).__name__} (in-process: nothing to contact)")]
    return [Check("servers", ok, f"{url}: {detail}") for url, ok, detail in rows]


def run_smoke(cfg, *, world_size: int, tol: float = DEFAULT_TOL, inputs=None) -> int:
    """Collective (every rank of the job). Returns the exit status: 0 when every check passes."""
    parts = setup_run(cfg, world_size=world_size, inputs=inputs)  # a server of the wrong version stops here (one line)
    ctx = parts.ctx
    checks: list[Check] = []
    try:
        version = 0
        resume_from = checkpoint.agree_on_resume(cfg.checkpoint.resume, cfg.out_dir, ctx)
        if resume_from:
            version = int(parts.load_checkpoint(resume_from)["step"])
        source = resume_from or cfg.model.load or cfg.model.hf_dir or "random init (model.init_seed)"
        if ctx.rank == 0:
            checks += _server_rows(parts.engine)
            checks.append(Check("policy", None, f"{source} (weight version {version})"))

        t = push_weights(parts, version)
        if ctx.rank == 0:
            served = parts.engine.server_weight_versions()
            from_servers = bool(served)
            served = served or {"in-process": parts.engine.weight_version}
            bad = {u: v for u, v in served.items() if str(v) != str(version)}
            checks.append(Check("weights", not bad, f"{cfg.rollout.backend}"
                                f"{'/' + cfg.rollout.sglang.weight_sync if cfg.rollout.backend == 'sglang' else ''}"
                                f" push in {t:.1f} s; "
                                + (f"servers report {bad} instead of {version}" if bad
                                   else f"{len(served)} server(s) report version {version}"
                                   if from_servers else f"the engine reports version {version}")))

        samples = None
        if ctx.rank == 0 and all(c.ok is not False for c in checks):
            samples = _generate(parts, version, checks)
        go = _broadcast(samples is not None)
        if go:
            samples = distribute(DataPlane(ctx), samples, 1)
            mbs, _ = parts.plan(samples)
            mm, _ = old_logprobs_pass(parts, samples, mbs)
            if ctx.rank == 0:
                mean = mm["mismatch_logprob_abs"]
                checks.append(Check("log-probs", math.isfinite(mean) and mean <= tol,
                                    f"mean |Δ| {mean:.2e} (tolerance {tol:g}), max |Δ| {mm['mismatch_logprob_max']:.2e}, "
                                    f"max |sequence mean Δ| {mm['mismatch_seq_ratio_max']:.2e}, k3 {mm['mismatch_k3']:.2e}"))
                if cfg.engine_routing:
                    agree = mm.get("routing_agreement")
                    checks.append(Check("routing", agree is not None,
                                        "the engine returned no routed experts" if agree is None
                                        else f"trainer/engine top-k agreement {agree:.3f}"))
    finally:
        parts.close()
    if ctx.rank != 0:
        return 0
    failed = [c for c in checks if c.ok is False]
    print(f"gspo-megatron smoke check ({cfg.rollout.backend} engine, {world_size} process(es))", flush=True)
    print(_table(checks), flush=True)
    if failed:
        print(f"smoke: FAIL - {failed[0].name}: {failed[0].detail}", flush=True)
        return 1
    print("smoke: PASS", flush=True)
    return 0


def _generate(parts, version: int, checks: list[Check]):
    """Rank 0: a few prompts x 2 samples from the engine; their TrainSamples, or None (a FAIL row
    says why)."""
    cfg, ctx = parts.cfg, parts.ctx
    n_prompts = max(2, ctx.dp)  # every DP rank gets a sequence to score
    examples = parts.prompts.batch(0, 0, n_prompts)
    prompt_ids = [parts.prompts.encode(ex) for ex in examples]
    sampling = sampling_params(cfg.rollout, parts.stop_ids, max_new_tokens=min(cfg.rollout.max_new_tokens, _SMOKE_NEW_TOKENS))
    t0 = time.perf_counter()
    try:
        got = parts.engine.generate(prompt_ids, _SMOKE_SAMPLES, sampling, seed=cfg.train.seed)
    except Exception as e:  # noqa: BLE001 - reported as the row's failure
        checks.append(Check("generate", False, f"{type(e).__name__}: {e}"))
        return None
    dt = time.perf_counter() - t0
    tokens = sum(len(s.response_ids) for s in got)
    problems = []
    if len(got) != n_prompts * _SMOKE_SAMPLES:
        problems.append(f"{len(got)} samples for {n_prompts * _SMOKE_SAMPLES} asked")
    if any(len(s.response_logprobs) != len(s.response_ids) for s in got):
        problems.append("log-probs missing for some tokens")
    elif any(not (math.isfinite(x) and x <= 1e-6) for s in got for x in s.response_logprobs):
        problems.append("log-probs not finite or > 0")
    if any(not s.response_ids for s in got):
        problems.append("empty responses")
    if any(x >= parts.arch.vocab_size or x < 0 for s in got for x in s.response_ids):
        problems.append(f"token ids outside the vocabulary ({parts.arch.vocab_size})")
    versions = {str(s.weight_version) for s in got}
    if versions != {str(version)}:
        problems.append(f"samples carry weight versions {sorted(versions)}, pushed {version}")
    checks.append(Check("generate", not problems,
                        "; ".join(problems) or f"{len(got)} samples, {tokens} tokens in {dt:.1f} s"))
    if problems:
        return None
    return to_train_samples(got, [0.0] * len(got), _SMOKE_SAMPLES)
