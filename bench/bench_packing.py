"""Padded [b, s] vs packed (THD) microbatches: GSPO training-step throughput on CPU, side by side.

    python bench/bench_packing.py                                  # 64 samples, budget 2048, tp1
    python bench/bench_packing.py --layouts tp1,tp2 --json out.json
    python bench/bench_packing.py --n 8 --reps 1 --layouts tp1,tp2 --median 16 --sigma 1.6 \\
        --max-len 256 --budget 256 --hidden 64 --layers 2 --heads 4 --kv-heads 2 --head-dim 16 \\
        --experts 4 --moe-inter 32 --vocab 512                     # tiny check: ~20 s
    python bench/bench_packing.py --smoke                          # that tiny model, tp1 only: seconds

What is compared
  The same batch of N samples (--n, default 64) trained with the two microbatch layouts of
  gspo_megatron/train/batch.py plan_minibatch, with the same token budget (--budget: what
  train.micro_batch_tokens is in the trainer, default 2048):
    padded  right-padded rows [b, s]: longest first, b * s <= budget per microbatch
    packed  the sequences of a microbatch one after the other in a [1, t] row with cu_seqlens
            (THD, PackedSeqParams), t = sum of the lengths (+ a filler segment up to the TP/SP
            multiple) <= budget
  Both arms run in the same processes on the same model (same weights, one build) and the same
  samples; only the plan differs.

Samples (seeded by --seed)
  prompt    uniform in [--prompt - 4, --prompt + 4] tokens (default ~16)
  response  lognormal lengths round(exp(ln(--median) + --sigma * z)), z ~ N(0, 1), clipped to
            [1, --max-len] (defaults 64, 1.0, 1024): a long tail. The measured mean, median, max and
            max/mean of the response lengths are printed; the bench refuses to run when
            max/mean < --min-tail (default 4).
  ids       uniform random token ids in [0, vocab); advantages N(0, 1).
  engine    engine log-probs -ln(vocab) + 0.05 * N(0, 1) per response token, used as pi_old
  logprobs  (mb.old_logprobs = mb.engine_logprobs, as tests/test_train_invariance.py): the random
            model's log-probs are close to -ln(vocab), so importance ratios are near 1 and GSPO's
            clip range (--eps-low / --eps-high, default the paper's 3e-4 / 4e-4) is live.

Model
  A random Qwen3-MoE built with Megatron's init (build_policy without hf_dir; no checkpoint, no
  download), fp32, shape from --hidden --layers --heads --kv-heads --head-dim --experts --topk
  --moe-inter --vocab (defaults: 256, 4, 8, 4, 32, 8, 2, 256, 8192), wrapped in Megatron's DDP
  (parallel/ddp.py wrap_ddp). On CPU the core attention is parallel/cp_attention.py CpuCoreAttention
  for both layouts (dense causal scores per [b, s] row; for THD one score block per packed
  sequence, as TE's THD kernels).

Layouts (--layouts, comma list; each layout is one spawn of tests/dist_utils.py run_distributed,
1 torch thread per process, every wait bounded by --timeout seconds)
  tp1   1 process
  tp2   2 gloo processes, TP2 + sequence parallel (the experts replicated on both ranks)

Step (per arm)
  plan_minibatch(..., packed=arm == "packed") once, mb.old_logprobs = mb.engine_logprobs, then one
  full GSPO forward + backward over all microbatches through Megatron's schedule
  (get_forward_backward_func() with train/loss.py policy_loss_step, forward_only=False), the grad
  buffers zeroed before each (`m.zero_grad_buffer()`). No optimizer step.
  1 warm-up step per arm (--warmup), then --reps (default 3) timed repetitions interleaved
  padded, packed, padded, packed, ... so drift of a shared machine hits both arms alike.
  Timing: wall seconds between a barrier before and one after the step (every rank), the slowest
  rank per repetition; "s/step" is the median over the repetitions.

Columns
  micro       microbatches of the plan
  positions   computed positions: sum over microbatches of the model input's numel (b*s or t)
  real tok    sum of the samples' prompt + response lengths (the same for both arms)
  pad frac    1 - real tok / positions
  attn M      attention score entries computed per head and layer, in millions: sum of b * s^2
              (padded) or of each packed segment's length^2 (packed: CpuCoreAttention computes one
              block per sequence); the samples' own causal pairs are printed below the table for
              reference
  s/step      median seconds of one forward + backward over the whole batch
  tok/s       real tok / s/step
  peak MiB    VmHWM during the arm's timed steps (bench/common.py reset_peak right before each,
              after gc + malloc_trim(0)), max over repetitions and ranks
  +MiB        peak - VmRSS right before the step (after the trim): what the step itself needs
  packed/pad  tok/s of packed / tok/s of padded (same layout)
What to expect on CPU
  Packing removes the padding: the linear layers, experts, vocabulary head and attention then
  compute only real tokens (plus each sequence's padding to 2*cp and the SP filler). An earlier
  version of the CPU attention formed one dense [t, t] score matrix per packed row and lost to
  padding on this bench (0.60x on a 16-sample check); it now attends per sequence, as TE does.

Correctness: the warm-up step's loss (sum over sequences / sequence count, reduced over ranks)
must agree between the arms to --loss-rtol (default 1e-5, fp32); the grad buffers (this rank's
DDP grad_data, finalized by the schedule) to --grad-rtol (max |diff| / max |grad|, default 1e-4;
compared after the warm-up step, so --warmup 0 skips it).
The bench fails (exit 1, after printing the table) otherwise. --json PATH writes everything,
including every repetition's time and memory per rank.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, os.path.join(_ROOT, "tests"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import format_table, mib, peak_rss, reset_peak, rss  # noqa: E402

LAYOUTS = {  # name -> (ParallelConfig kwargs, world size)
    "tp1": (dict(tp=1), 1),
    "tp2": (dict(tp=2, sequence_parallel=True), 2),
}
ARMS = ("padded", "packed")


# ----------------------------------------------------------------------------------------------
# samples


def hf_config(args) -> dict:
    """The model's shape as a Hugging Face Qwen3-MoE config dict (MoeArch.from_hf_dict)."""
    return dict(
        model_type="qwen3_moe", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, num_experts=args.experts, num_experts_per_tok=args.topk,
        moe_intermediate_size=args.moe_inter, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=max(4096, args.max_len + args.prompt + 8),
    )


def make_samples(args):
    import torch

    from gspo_megatron.train.batch import TrainSample

    g = torch.Generator().manual_seed(args.seed)
    z = torch.randn(args.n, generator=g, dtype=torch.float64)
    resp = torch.exp(math.log(args.median) + args.sigma * z).round().clamp(1, args.max_len).long().tolist()
    lo = max(1, args.prompt - 4)
    prompts = torch.randint(lo, args.prompt + 5, (args.n,), generator=g).tolist()
    base = -math.log(args.vocab)
    samples = []
    for p, r in zip(prompts, resp):
        ids = torch.randint(0, args.vocab, (p + r,), generator=g).tolist()
        adv = float(torch.randn((), generator=g, dtype=torch.float64))
        eng = (base + 0.05 * torch.randn(r, generator=g, dtype=torch.float64)).tolist()
        samples.append(TrainSample(ids[:p], ids[p:], adv, eng))
    mean = sum(resp) / len(resp)
    stats = dict(n=len(resp), mean=mean, median=float(statistics.median(resp)), max=max(resp), min=min(resp),
                 max_over_mean=max(resp) / mean, prompt_mean=sum(prompts) / len(prompts),
                 real_tokens=sum(x.length for x in samples),
                 causal_pairs=sum(x.length * (x.length + 1) // 2 for x in samples))
    return samples, stats


# ----------------------------------------------------------------------------------------------
# inside a rank


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _grad_vector(model):
    import torch

    parts = [b.grad_data.detach().reshape(-1).double()
             for m in model for b in list(m.buffers) + list(m.expert_parallel_buffers) if b.grad_data is not None]
    return torch.cat(parts).clone()


def _attn_pairs(mb) -> int:
    """(query, key) score entries CpuCoreAttention computes per head and layer for this
    microbatch: b * s^2 padded, the sum of the packed segments' length^2 packed (one block per
    sequence; at CP 1 the local length is the segment's)."""
    if mb.packed:
        lengths = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
        return sum(n * n for n in lengths)
    b, s = mb.tokens.shape
    return b * s * s


def _rank_main(rank, world, layout: dict, cfg: dict, samples, opts: dict) -> dict:
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.batch import plan_minibatch
    from gspo_megatron.train.loss import LossSettings, policy_loss_step
    from gspo_megatron.train.metrics import reduce_report
    from gspo_megatron.train.scoring import pad_multiple

    torch.set_num_threads(opts["threads"])
    arch = MoeArch.from_hf_dict(cfg, source="bench_packing config")
    par = ParallelConfig(**layout, device="cpu")
    ctx = init_parallel(par, seed=opts["seed"], model_dims=arch.dims_for_validation())
    chunks, tcfg = build_policy(ctx, arch, dtype=torch.float32)
    model = wrap_ddp(chunks, tcfg)

    plans, plan_s = {}, {}
    for arm in ARMS:
        t0 = time.perf_counter()
        mbs, n_seq = plan_minibatch(samples, dp=ctx.dp, dp_rank=ctx.dp_rank, token_budget=opts["budget"],
                                    multiple=pad_multiple(par), packed=arm == "packed")
        plan_s[arm] = time.perf_counter() - t0
        for mb in mbs:
            mb.old_logprobs = mb.engine_logprobs
        assert all(mb.packed == (arm == "packed") for mb in mbs)
        plans[arm] = mbs

    step = policy_loss_step(ctx, arch.vocab_size, LossSettings("gspo", opts["eps_low"], opts["eps_high"]))
    fb = get_forward_backward_func()
    reporter = ctx.is_last_stage and ctx.tp_rank == 0 and ctx.cp_rank == 0

    def one_step(arm):
        mbs = plans[arm]
        for m in model:
            m.zero_grad_buffer()
        dist.barrier()
        t0 = time.perf_counter()
        reports = fb(forward_step_func=step, data_iterator=iter(mbs), model=model, num_microbatches=len(mbs),
                     seq_length=max(mb.seq_length for mb in mbs), micro_batch_size=mbs[0].micro_batch_size,
                     forward_only=False)
        dist.barrier()
        dt = time.perf_counter() - t0
        tot = reduce_report(reports, reporter, ("loss", "sequences", "clip_frac"), ctx.device)
        return dt, tot

    out = {arm: dict(times=[], peak=[], before=[], warm_times=[]) for arm in ARMS}
    grads = {}
    for w in range(opts["warmup"]):
        for arm in ARMS:
            dt, tot = one_step(arm)
            out[arm]["warm_times"].append(dt)
            if w == 0:
                out[arm]["loss_sum"] = tot["loss"]
                out[arm]["sequences"] = tot["sequences"]
                out[arm]["clip_frac"] = tot["clip_frac"] / max(tot["sequences"], 1)
                grads[arm] = _grad_vector(model)
    if grads:
        a, b = grads["padded"], grads["packed"]
        grad_rdiff = float((a - b).abs().max() / a.abs().max().clamp_min(1e-30))
        grad_scale = float(a.abs().max())
        del grads, a, b
    else:
        grad_rdiff, grad_scale = None, None

    for _ in range(opts["reps"]):
        for arm in ARMS:
            gc.collect()
            _malloc_trim()
            before = rss()
            reset_peak()
            dt, tot = one_step(arm)
            out[arm]["peak"].append(peak_rss())
            out[arm]["before"].append(before)
            out[arm]["times"].append(dt)
            if "loss_sum" not in out[arm]:  # --warmup 0
                out[arm].update(loss_sum=tot["loss"], sequences=tot["sequences"],
                                clip_frac=tot["clip_frac"] / max(tot["sequences"], 1))

    for arm in ARMS:
        mbs = plans[arm]
        out[arm].update(
            microbatches=len(mbs), positions=sum(mb.tokens.numel() for mb in mbs),
            shapes=[list(mb.tokens.shape) for mb in mbs], plan_s=plan_s[arm],
            attn_pairs=sum(_attn_pairs(mb) for mb in mbs),
        )
    out["grad_rdiff"], out["grad_scale"] = grad_rdiff, grad_scale
    out["rank"] = rank
    destroy_parallel()
    return out


# ----------------------------------------------------------------------------------------------
# parent


def run_layout(name: str, cfg: dict, samples, real_tokens: int, args) -> dict:
    from dist_utils import run_distributed

    layout, world = LAYOUTS[name]
    opts = dict(threads=args.threads, seed=args.seed, budget=args.budget, eps_low=args.eps_low,
                eps_high=args.eps_high, warmup=args.warmup, reps=args.reps)
    t0 = time.perf_counter()
    ranks = run_distributed(_rank_main, world, layout, cfg, samples, opts, timeout=args.timeout)
    print(f"  {name}: done in {time.perf_counter() - t0:.0f} s (spawn + build + {args.warmup} warm-up + "
          f"{args.reps} timed steps per arm)", flush=True)
    res = dict(layout=name, world=world, arms={})
    for arm in ARMS:
        r0 = ranks[0][arm]
        times = [max(r[arm]["times"][i] for r in ranks) for i in range(args.reps)]
        med = statistics.median(times)
        peak = max(max(r[arm]["peak"]) for r in ranks)
        extra = max(p - b for r in ranks for p, b in zip(r[arm]["peak"], r[arm]["before"]))
        res["arms"][arm] = dict(
            microbatches=r0["microbatches"], positions=r0["positions"], real_tokens=real_tokens,
            attn_pairs=r0["attn_pairs"],
            pad_frac=1 - real_tokens / r0["positions"], times=times, median_s=med, tokens_per_s=real_tokens / med,
            peak_rss=peak, step_extra_rss=extra, loss=r0["loss_sum"] / r0["sequences"], sequences=r0["sequences"],
            clip_frac=r0["clip_frac"], shapes=r0["shapes"], plan_s=r0["plan_s"],
            warm_times=[max(r[arm]["warm_times"][i] for r in ranks) for i in range(len(r0["warm_times"]))],
            per_rank=[dict(rank=r["rank"], times=r[arm]["times"], peak=r[arm]["peak"], before=r[arm]["before"])
                      for r in ranks],
        )
    pad, pk = res["arms"]["padded"], res["arms"]["packed"]
    res["speedup"] = pk["tokens_per_s"] / pad["tokens_per_s"]
    res["paired_speedup_median"] = statistics.median(a / b for a, b in zip(pad["times"], pk["times"]))
    res["loss_rdiff"] = abs(pad["loss"] - pk["loss"]) / max(abs(pad["loss"]), abs(pk["loss"]), 1e-12)
    rd = [r["grad_rdiff"] for r in ranks if r["grad_rdiff"] is not None]
    res["grad_rdiff"] = max(rd) if rd else None
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="tp1", help=f"comma list of {','.join(LAYOUTS)}")
    ap.add_argument("--layout", dest="layouts", help="alias of --layouts")
    ap.add_argument("--n", type=int, default=64, help="samples in the batch")
    ap.add_argument("--budget", type=int, default=2048, help="token budget per microbatch (train.micro_batch_tokens)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per arm (interleaved)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per arm first")
    ap.add_argument("--prompt", type=int, default=16, help="mean prompt length (uniform +-4)")
    ap.add_argument("--median", type=float, default=64, help="median of the lognormal response lengths")
    ap.add_argument("--sigma", type=float, default=1.0, help="sigma of the lognormal response lengths")
    ap.add_argument("--max-len", type=int, default=1024, help="response lengths clipped to [1, max-len]")
    ap.add_argument("--min-tail", type=float, default=4.0, help="refuse to run when max/mean response length is lower")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--eps-low", type=float, default=3e-4)
    ap.add_argument("--eps-high", type=float, default=4e-4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--loss-rtol", type=float, default=1e-5)
    ap.add_argument("--grad-rtol", type=float, default=1e-4)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per layout run (all ranks)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny check above at tp1 (one process; the packed/padded correctness checks still "
                         "run after the warm-up step): seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.reps, args.warmup, args.layouts, args.median, args.sigma = 8, 1, 1, "tp1", 16, 1.6
        args.max_len, args.budget, args.hidden, args.layers, args.heads, args.kv_heads = 256, 256, 64, 2, 4, 2
        args.head_dim, args.experts, args.moe_inter, args.vocab = 16, 4, 32, 512
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        ap.error(f"unknown layout(s) {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.reps < 1 or args.warmup < 0 or args.n < 1:
        ap.error("--reps >= 1, --warmup >= 0, --n >= 1")

    cfg = hf_config(args)
    samples, st = make_samples(args)
    print(f"response lengths (n={st['n']}, lognormal median {args.median:g} sigma {args.sigma:g}, clipped to "
          f"[1, {args.max_len}], seed {args.seed}): mean {st['mean']:.1f}  median {st['median']:.0f}  "
          f"max {st['max']}  min {st['min']}  max/mean {st['max_over_mean']:.2f}; prompts mean "
          f"{st['prompt_mean']:.1f}; real tokens {st['real_tokens']}", flush=True)
    if st["max_over_mean"] < args.min_tail:
        print(f"error: max/mean = {st['max_over_mean']:.2f} < --min-tail {args.min_tail:g}: not a long tail; "
              "raise --sigma or --n, or change --seed", file=sys.stderr)
        return 2
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads}/{args.kv_heads} heads x {args.head_dim}, "
          f"{args.experts} experts top-{args.topk} x {args.moe_inter}, vocab {args.vocab}, fp32; budget "
          f"{args.budget} tokens/microbatch; {args.warmup} warm-up + {args.reps} timed steps per arm; "
          f"{args.threads} thread(s)/process", flush=True)

    from dist_utils import close_pools

    results = []
    try:
        for name in layouts:
            results.append(run_layout(name, cfg, samples, st["real_tokens"], args))
    finally:
        # run_distributed keeps its ranks alive for the next call (a pool per world size, made for
        # the test suite); they wait for work until told to stop, so this process would never exit
        close_pools()

    rows = []
    for r in results:
        for arm in ARMS:
            a = r["arms"][arm]
            rows.append([
                f"{r['layout']} {arm}", a["microbatches"], a["positions"], a["real_tokens"], f"{a['pad_frac']:.3f}",
                f"{a['attn_pairs'] / 1e6:,.2f}", f"{a['median_s']:.3f}", f"{a['tokens_per_s']:,.0f}",
                mib(a["peak_rss"]), mib(a["step_extra_rss"]),
                f"{r['speedup']:.2f}x" if arm == "packed" else "",
            ])
    print()
    print(format_table(["layout / arm", "micro", "positions", "real tok", "pad frac", "attn M", "s/step", "tok/s",
                        "peak MiB", "+MiB", "packed/pad"], rows,
                       title="GSPO forward+backward over the whole batch (median of the timed steps)"))
    print(f"attn M: million attention score entries per head and layer (b*s^2 padded, sum of segment^2 "
          f"packed); the "
          f"samples' own causal pairs are {st['causal_pairs'] / 1e6:,.3f} M (sum of L(L+1)/2)")
    print()
    failed = []
    for r in results:
        pad, pk = r["arms"]["padded"], r["arms"]["packed"]
        g = "n/a" if r["grad_rdiff"] is None else f"{r['grad_rdiff']:.1e}"
        print(f"{r['layout']}: loss padded {pad['loss']:.8f} packed {pk['loss']:.8f} rel diff {r['loss_rdiff']:.1e}; "
              f"grad rel diff {g}; clip frac {pad['clip_frac']:.2f}/{pk['clip_frac']:.2f}; paired "
              f"speedup median {r['paired_speedup_median']:.2f}x; times padded "
              f"{' '.join(f'{t:.3f}' for t in pad['times'])} packed {' '.join(f'{t:.3f}' for t in pk['times'])}")
        if pad["sequences"] != pk["sequences"] or pad["sequences"] != len(samples):
            failed.append(f"{r['layout']}: sequence counts {pad['sequences']} / {pk['sequences']} != {len(samples)}")
        if not r["loss_rdiff"] <= args.loss_rtol:
            failed.append(f"{r['layout']}: loss differs between padded and packed by {r['loss_rdiff']:.2e} "
                          f"(> {args.loss_rtol:g})")
        if r["grad_rdiff"] is not None and not r["grad_rdiff"] <= args.grad_rtol:
            failed.append(f"{r['layout']}: gradients differ between padded and packed by {r['grad_rdiff']:.2e} "
                          f"(> {args.grad_rtol:g})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), model=cfg, samples=st, results=results, failed=failed), f, indent=1)
        print(f"wrote {args.json}")
    if failed:
        print("FAILED:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
