"""HF checkpoint loading: wall time and resident memory per rank, streaming loader vs naive.

    python bench/bench_load.py                        # ~1 GiB fp32 checkpoint, TP2 (2 gloo ranks)
    python bench/bench_load.py --size-gb 0.3 --keep   # quicker; keep the checkpoint for the next run
    python bench/bench_load.py --tp 2 --ep 2          # experts split over the 2 ranks too
    python bench/bench_load.py --smoke                # ~55 MiB, 1 rank, all methods in one process: seconds

The checkpoint is synthetic: random fp32 tensors with the Hub names and shapes of
`mapping.hf_shapes(arch)` for a Qwen3-MoE (hidden 1024, 16/4 heads, head_dim 64, 32 experts,
vocab 32000; layers and moe_intermediate_size chosen to hit --size-gb, in GiB), written as
safetensors shards (--shard-mb each) + model.safetensors.index.json + config.json. It lives in
--workdir (default: $TMPDIR/gspo-bench-load), is reused when a previous run left it there
(--keep) and is deleted at the end otherwise. No transformers model is built.

Methods (each runs in a fresh set of --tp spawned gloo processes, so neither one's allocator
state nor its memory high-water mark leaks into another's numbers):
  stream  the project's loader: gspo_megatron.model.factory.build_policy(ctx, arch, hf_dir=...),
          i.e. HFCheckpointReader (safetensors safe_open, default mmap backend) +
          load_hf_into_model; each rank reads only the tensors its parameters are made of, and for
          vocab-parallel tensors only its rows.
  close   the same loader with a reader that drops its open shard handles (hence their mappings,
          once the tensors read from them are freed) after every 64 MiB it returned: a
          candidate fix for the mmap pages "stream" keeps resident (see "mmap" below). Passed as
          build_policy(reader=...); not the project's code.
  pread   the same loader with the reader's shards opened with safetensors' `backend="pread"`
          (a subclass passed as build_policy(reader=...)): tensor bytes are read into private
          memory on demand instead of being mapped (see "mmap" below).
  naive   what a non-streaming loader does: every rank reads every HF tensor fully,
          safetensors.torch.load_file(shard, backend="pread") for each shard into one state dict,
          then slices its share out of it (through the same mapping code, so only the reading
          strategy differs) and drops the state dict.

Per rank, each method: init_parallel(ParallelConfig(tp, ep, sequence_parallel=tp>1)), then
  baseline   VmRSS once torch + megatron are imported and the process groups are up;
  build      build_policy(ctx, arch) without a checkpoint (Megatron's random init): "after build"
             is VmRSS then; "params" is this rank's parameter bytes, which every approach must
             hold (at TP2/EP1/ETP1 the experts are replicated on both TP ranks, so that is all
             experts + half of attention and of the (padded) vocab tensors);
  load       the method, timed (wall s); its peak is VmHWM after resetting it right before the
             load (bench/common.py explains VmHWM, /proc/self/clear_refs and ru_maxrss, which is
             printed too as a cross-check). "overhead" = peak - after build: what loading needs
             on top of the parameters. It is compared with the checkpoint size and with the
             largest single HF tensor;
  anon/file  RssAnon / RssFile maxima seen by a 1 ms sampler thread during the load (lower
             bounds): the private memory the load allocated vs. pages of mmap'ed shard files;
  verify     a few parameters (QKV and attention-output shards, first/last local expert fc1/fc2
             of the first and last layer, router, q_norm, embedding and output rows) are compared
             for exact equality with slices of the HF tensors, computed here independently of
             gspo_megatron.model.mapping. The bench fails if any differs.

mmap: safe_open maps each shard; every page a rank reads stays in its VmRSS (as RssFile) while
the reader holds the file open, i.e. for the whole load. Those pages are clean page cache,
shared by the ranks on a host (each rank's VmRSS counts them, physical memory holds them once)
and reclaimable without swap, so they are not an OOM risk like private memory; but they do show
up in RSS-based monitoring and cgroup memory.current. "anon overhead" is the private part.

--smoke: --size-gb 0.05 (the smallest config: vocab 4000, 1 layer), 16 MiB shards, --tp 1 (one
process runs every loader path; the vocab-row slicing of TP2 is not exercised), and the methods
share that one process instead of a fresh one each (their peaks are still measured from a reset
VmHWM, but allocator state carries over): the same table, for checking that the bench runs.

The shards are read from the page cache (the bench just wrote them, or a previous --keep run did),
so load times are CPU/memcpy bound, not disk bound.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
for _p in (_ROOT, os.path.join(_ROOT, "tests"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from common import (  # noqa: E402
    MemSampler, MiB, format_table, mib, peak_rss, proc_status, ratio, reset_peak, ru_maxrss, timer,
)

METHODS = ("stream", "close", "pread", "naive")
CLOSE_EVERY = 64 * MiB  # method "close": drop the shard mappings after this many bytes read
META_FILE = "bench_meta.json"

# Fixed dimensions (the brief's shape); layers / moe_intermediate_size / vocab adapt to --size-gb.
BASE = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
            num_experts=32, num_experts_per_tok=4)


# ----------------------------------------------------------------------------------------------
# synthetic checkpoint


def hf_config(vocab: int, layers: int, moe_inter: int) -> dict:
    return dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=vocab,
        intermediate_size=3 * BASE["hidden_size"], num_hidden_layers=layers, moe_intermediate_size=moe_inter,
        norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=4096, decoder_sparse_step=1, mlp_only_layers=[], hidden_act="silu",
        attention_bias=False, torch_dtype="float32", **BASE,
    )


def _arch(cfg: dict):
    from gspo_megatron.model.arch import MoeArch

    return MoeArch.from_hf_dict(cfg, source="bench config")


def checkpoint_bytes(cfg: dict) -> int:
    from gspo_megatron.model import mapping

    return sum(4 * _numel(s) for s in mapping.hf_shapes(_arch(cfg)).values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def choose_config(size_bytes: float) -> dict:
    """The brief's shape (8 layers, vocab 32000) with moe_intermediate_size (a multiple of 32)
    set to hit the size; smaller vocab / fewer layers only when even the smallest experts are
    too big."""
    best = None
    for vocab in (32000, 16000, 8000, 4000):
        for layers in (8, 4, 2, 1):
            for inter in range(32, 4096 + 1, 32):
                cfg = hf_config(vocab, layers, inter)
                err = abs(checkpoint_bytes(cfg) - size_bytes) / size_bytes
                if best is None or err < best[0]:
                    best = (err, cfg)
                if checkpoint_bytes(cfg) > size_bytes:
                    break
            if best[0] < 0.1:
                return best[1]
    return best[1]


def _hf_order(names: list[str]) -> list[str]:
    """Hub order: embeddings, then layer by layer, then final norm and lm_head."""
    def key(n):
        if n.startswith("model.layers."):
            return (1, int(n.split(".")[2]))
        return (0, 0) if "embed_tokens" in n else (2, 0)

    return sorted(names, key=key)  # stable: keeps mapping's order within a layer


def write_checkpoint(path: str, cfg: dict, *, shard_bytes: int, seed: int) -> None:
    """Random tensors, shard by shard (the writer never holds more than one shard)."""
    import torch
    from safetensors.torch import save_file

    from gspo_megatron.model import mapping

    shapes = mapping.hf_shapes(_arch(cfg))
    shards: list[list[str]] = [[]]
    size = 0
    for n in _hf_order(list(shapes)):
        nb = 4 * _numel(shapes[n])
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nb
    tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=os.path.dirname(path))
    try:
        g = torch.Generator().manual_seed(seed)
        weight_map = {}
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {n: torch.randn(shapes[n], generator=g) * 0.02 for n in names}
            save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
            del tensors
            weight_map.update({n: fname for n in names})
        total = sum(4 * _numel(s) for s in shapes.values())
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        with open(os.path.join(tmp, META_FILE), "w") as f:  # last: marks a complete checkpoint
            json.dump({"config": cfg, "seed": seed, "shard_bytes": shard_bytes}, f)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_checkpoint(workdir: str, cfg: dict, *, shard_bytes: int, seed: int) -> tuple[str, bool]:
    """(path, reused). Reuses a complete checkpoint of the same config; never deletes a directory
    this bench did not write."""
    total = checkpoint_bytes(cfg)
    path = os.path.join(workdir, f"qwen3moe-{total // MiB}MiB-L{cfg['num_hidden_layers']}"
                                 f"-I{cfg['moe_intermediate_size']}-V{cfg['vocab_size']}-s{seed}")
    meta = os.path.join(path, META_FILE)
    if os.path.isdir(path):
        if not os.path.isfile(meta):
            raise SystemExit(f"{path} exists but was not written by this bench ({META_FILE} missing); "
                             "remove it or pick another --workdir")
        with open(meta) as f:
            m = json.load(f)
        if m == {"config": cfg, "seed": seed, "shard_bytes": shard_bytes}:
            return path, True
        shutil.rmtree(path)
    write_checkpoint(path, cfg, shard_bytes=shard_bytes, seed=seed)
    return path, False


# ----------------------------------------------------------------------------------------------
# loaders


class _DictReader:
    """A full in-memory state dict behind the HFCheckpointReader interface load_hf_into_model uses."""

    def __init__(self, hf_dir: str, state: dict):
        self.hf_dir, self.state = hf_dir, state

    def get(self, name, rows=None):
        t = self.state[name]
        return t if rows is None else t[rows[0]:rows[1]]

    def shape(self, name):
        return tuple(self.state[name].shape)


def _closing_reader(hf_dir: str):
    from gspo_megatron.model.hf_io import HFCheckpointReader

    class ClosingReader(HFCheckpointReader):
        read = 0

        def get(self, name, rows=None):
            t = super().get(name, rows)
            self.read += t.numel() * t.element_size()
            if self.read >= CLOSE_EVERY:
                # a tensor still in use keeps its own mapping alive; the rest is unmapped
                self._handles.clear()
                self.read = 0
            return t

    return ClosingReader(hf_dir)


def _pread_reader(hf_dir: str):
    from safetensors import safe_open

    from gspo_megatron.model.hf_io import HFCheckpointReader

    class PreadReader(HFCheckpointReader):
        def _open(self, fname):
            h = self._handles.get(fname)
            if h is None:
                h = self._handles[fname] = safe_open(os.path.join(self.hf_dir, fname), framework="pt",
                                                     backend="pread")
            return h

    return PreadReader(hf_dir)


def _load(method: str, ckpt: str, ctx, arch, chunks, config) -> None:
    from gspo_megatron.model import factory
    from gspo_megatron.model.hf_io import load_hf_into_model

    if method in ("stream", "close", "pread"):
        # build_policy exactly as the project calls it, but with the chunks built (and measured)
        # before: its build step returns them instead of building new ones.
        real = factory.build_model_chunks
        factory.build_model_chunks = lambda *a, **k: (chunks, config)
        try:
            if method == "stream":
                out, _ = factory.build_policy(ctx, arch, hf_dir=ckpt)
            else:
                reader = _closing_reader(ckpt) if method == "close" else _pread_reader(ckpt)
                out, _ = factory.build_policy(ctx, arch, reader=reader)
                del reader
        finally:
            factory.build_model_chunks = real
        assert out is chunks
        return
    if method == "naive":
        from safetensors.torch import load_file

        with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state = {}
        for fname in files:
            state.update(load_file(os.path.join(ckpt, fname), backend="pread"))
        load_hf_into_model(chunks, _DictReader(ckpt, state), arch, tp_rank=ctx.tp_rank, tp=ctx.parallel.tp,
                           ep_rank=ctx.ep_rank, ep=ctx.parallel.ep, etp_rank=ctx.etp_rank, etp=ctx.parallel.etp)
        del state
        return
    raise ValueError(method)


# ----------------------------------------------------------------------------------------------
# correctness: expected local slices computed from the HF tensors without mapping.py


def verify(chunks, ctx, arch, ckpt: str) -> int:
    import torch
    from safetensors import safe_open

    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    handles = {}

    def hf(name):
        fn = wmap[name]
        if fn not in handles:
            handles[fn] = safe_open(os.path.join(ckpt, fn), framework="pt")
        return handles[fn].get_tensor(name)

    params = dict(chunks[0].named_parameters())
    tp, r = ctx.parallel.tp, ctx.tp_rank
    G, D, H = arch.num_key_value_heads, arch.head_dim, arch.hidden_size
    qpg = arch.num_attention_heads // G
    E_local = arch.num_experts // ctx.parallel.ep
    checks = {}
    for layer in sorted({0, arch.num_layers - 1}):
        p = f"decoder.layers.{layer}."
        h = f"model.layers.{layer}."
        q, k, v = (hf(h + f"self_attn.{x}_proj.weight") for x in "qkv")
        groups = range(r * G // tp, (r + 1) * G // tp)  # this rank's query groups, Megatron layout
        checks[p + "self_attention.linear_qkv.weight"] = torch.cat(
            [torch.cat([q[g * qpg * D:(g + 1) * qpg * D], k[g * D:(g + 1) * D], v[g * D:(g + 1) * D]])
             for g in groups])
        o = hf(h + "self_attn.o_proj.weight")
        w = o.shape[1] // tp
        checks[p + "self_attention.linear_proj.weight"] = o[:, r * w:(r + 1) * w]
        checks[p + "self_attention.q_layernorm.weight"] = hf(h + "self_attn.q_norm.weight")
        checks[p + "mlp.router.weight"] = hf(h + "mlp.gate.weight")
        for e in sorted({0, E_local - 1}):
            ge = ctx.ep_rank * E_local + e
            x = h + f"mlp.experts.{ge}."
            gate, up, down = hf(x + "gate_proj.weight"), hf(x + "up_proj.weight"), hf(x + "down_proj.weight")
            etp, er = ctx.parallel.etp, ctx.etp_rank
            c = gate.shape[0] // etp
            checks[p + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = torch.cat(
                [gate[er * c:(er + 1) * c], up[er * c:(er + 1) * c]])
            checks[p + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[:, er * c:(er + 1) * c]
    vp = arch.padded_vocab_size(tp) // tp
    for pname, hname in (("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
                         ("output_layer.weight", "lm_head.weight")):
        full = hf(hname)
        exp = torch.zeros(vp, H)
        lo, hi = r * vp, min((r + 1) * vp, arch.vocab_size)
        exp[: hi - lo] = full[lo:hi]
        checks[pname] = exp
    for name, prm in params.items():  # every parameter was written (they were NaN before the load)
        if torch.isnan(prm).any():
            raise AssertionError(f"rank {ctx.rank}: {name} was not loaded (still NaN)")
    for name, exp in checks.items():
        got = params[name].detach()
        if got.shape != exp.shape or not torch.equal(got, exp):
            raise AssertionError(f"rank {ctx.rank}: {name} does not equal its HF slice "
                                 f"(shape {list(got.shape)} vs {list(exp.shape)})")
    handles.clear()
    return len(checks)


# ----------------------------------------------------------------------------------------------
# one rank


def _rank_main(rank: int, world: int, ckpt: str, tp: int, ep: int, method: str) -> dict:
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core  # noqa: F401  (baseline includes it)
    import torch
    import torch.distributed as dist

    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel

    arch = MoeArch.from_hf_dir(ckpt)
    ctx = init_parallel(ParallelConfig(tp=tp, ep=ep, sequence_parallel=tp > 1, device="cpu"),
                        model_dims=arch.dims_for_validation())
    try:
        out = {"rank": rank, "method": method}
        gc.collect()
        out["baseline"] = proc_status()

        with timer() as t:
            chunks, config = build_policy(ctx, arch)  # random init, no checkpoint
        gc.collect()
        out["build_s"] = t()
        out["after_build"] = proc_status()
        out["param_bytes"] = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
        with torch.no_grad():  # so a loader that skips a parameter cannot pass verification by luck
            for c in chunks:
                for p in c.parameters():
                    p.fill_(float("nan"))

        dist.barrier()
        out["reset_ok"] = reset_peak()
        switch = sys.getswitchinterval()
        sys.setswitchinterval(2e-4)  # let the sampler thread in between the loader's Python steps
        try:
            with MemSampler() as s, timer() as t:
                _load(method, ckpt, ctx, arch, chunks, config)
                gc.collect()  # the reader / state dict go here, inside the measured window
        finally:
            sys.setswitchinterval(switch)
        out["load_s"] = t()
        out["peak"] = peak_rss()
        out["ru_maxrss"] = ru_maxrss()
        out["sampled"] = dict(s.max)
        out["samples"] = s.samples
        out["after_load"] = proc_status()
        out["verified"] = verify(chunks, ctx, arch, ckpt)
        dist.barrier()
        return out
    finally:
        destroy_parallel()


# ----------------------------------------------------------------------------------------------
# driver


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="checkpoint size in GiB (fp32), approximate")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size = number of ranks")
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel size (carved from the TP ranks)")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {','.join(METHODS)}")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "gspo-bench-load"),
                    help="where the checkpoint is written / reused (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint for the next run")
    ap.add_argument("--shard-mb", type=int, default=256, help="safetensors shard size in MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per method (all ranks)")
    ap.add_argument("--smoke", action="store_true",
                    help="--size-gb 0.05 --shard-mb 16 --tp 1 --ep 1, the methods in one shared process: seconds")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size_gb, args.shard_mb, args.tp, args.ep = 0.05, 16, 1, 1
    methods = [m for m in args.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        ap.error(f"--methods: unknown {bad}; choose from {list(METHODS)}")
    if args.size_gb <= 0 or args.tp < 1 or args.ep < 1 or args.tp % args.ep:
        ap.error("need --size-gb > 0, --tp >= 1 and --ep dividing --tp")

    from dist_utils import run_distributed

    from gspo_megatron.model import mapping

    cfg = choose_config(args.size_gb * 2**30)
    arch = _arch(cfg)
    shapes = mapping.hf_shapes(arch)
    total = checkpoint_bytes(cfg)
    largest_name = max(shapes, key=lambda n: _numel(shapes[n]))
    largest = 4 * _numel(shapes[largest_name])

    created_workdir = not os.path.isdir(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    with timer() as t:
        ckpt, reused = ensure_checkpoint(args.workdir, cfg, shard_bytes=args.shard_mb * MiB, seed=args.seed)
    n_shards = len([f for f in os.listdir(ckpt) if f.endswith(".safetensors")])
    print(f"checkpoint {ckpt} ({'reused' if reused else f'written in {t():.1f} s'}): {mib(total)} MiB fp32 in "
          f"{n_shards} shards, {len(shapes)} tensors; layers {cfg['num_hidden_layers']}, hidden "
          f"{cfg['hidden_size']}, experts {cfg['num_experts']} x moe_intermediate {cfg['moe_intermediate_size']}, "
          f"vocab {cfg['vocab_size']}; largest tensor {largest_name} {mib(largest)} MiB", flush=True)

    results = {}
    try:
        for m in methods:
            with timer() as t:
                # fresh processes per method (run_distributed otherwise reuses pooled ranks), so one
                # method's allocator state and imports do not shape the next one's numbers
                results[m] = run_distributed(_rank_main, args.tp, ckpt, args.tp, args.ep, m, timeout=args.timeout,
                                             fresh=not args.smoke)
            print(f"  {m}: done in {t():.0f} s (spawn + init + build + load + verify, all ranks)", flush=True)
    finally:
        from dist_utils import close_pools

        close_pools()  # the smoke's pooled rank waits for work until told to stop (else no exit)
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            if created_workdir:
                try:
                    os.rmdir(args.workdir)
                except OSError:
                    pass

    print(report(results, methods, args, total=total, largest=largest))
    if not args.keep:
        print("(checkpoint deleted; --keep to reuse it)")
    return 0


def report(results, methods, args, *, total, largest) -> str:
    headers = ["method", "rank", "load s", "baseline", "after build", "params", "peak", "ru_maxrss",
               "overhead", "/ckpt", "/largest", "anon ovh", "file ovh", "ovh vs naive", "peak vs naive"]
    rows = []
    for m in methods:
        for r in results[m]:
            ab = r["after_build"]["VmRSS"]
            ovh = r["peak"] - ab
            anon = r["sampled"]["RssAnon"] - r["after_build"]["RssAnon"]
            row = [m, r["rank"], f"{r['load_s']:.2f}", mib(r["baseline"]["VmRSS"]), mib(ab), mib(r["param_bytes"]),
                   mib(r["peak"]), mib(r["ru_maxrss"]), mib(ovh), f"{ovh / total:.2f}", ratio(ovh, largest),
                   mib(anon), mib(r["sampled"]["RssFile"] - r["after_build"]["RssFile"])]
            if "naive" in results:
                nv = results["naive"][r["rank"]]
                n_ovh = nv["peak"] - nv["after_build"]["VmRSS"]
                row += [f"{ovh / n_ovh:.2f}" if n_ovh > 0 else "n/a", f"{r['peak'] / nv['peak']:.2f}"]
            else:
                row += ["", ""]
            rows.append(row)
    title = (f"HF load, TP{args.tp} EP{args.ep} ({args.tp} gloo ranks): checkpoint {mib(total)} MiB, largest tensor "
             f"{mib(largest)} MiB; MiB per rank, load in s")
    notes = [
        "baseline: VmRSS after init (torch, megatron, process groups); after build: VmRSS with the randomly",
        "  initialised model; params: this rank's parameter bytes; peak: VmHWM during the load (reset before it);",
        "  ru_maxrss: getrusage at the end of the load (cross-check of peak); overhead = peak - after build;",
        "  /ckpt, /largest: overhead over checkpoint size and over the largest HF tensor; anon ovh: sampled max",
        "  RssAnon - RssAnon after build (private memory); file ovh: same for RssFile (pages of the mmap'ed",
        "  shards: clean, shared page cache); vs naive: same rank, naive = 1.",
        "verified per rank: every parameter written, "
        + ", ".join(f"{m} {results[m][0]['verified']} params == HF slices" for m in methods),
        "sampler (anon/file ovh are its maxima, lower bounds): "
        + ", ".join(f"{m} >= {min(r['samples'] for r in results[m])} samples, max VmRSS seen "
                    f"{min(r['sampled']['VmRSS'] / r['peak'] for r in results[m]):.0%}+ of VmHWM" for m in methods),
    ]
    if not all(r["reset_ok"] for m in methods for r in results[m]):
        notes.append("WARNING: /proc/self/clear_refs not writable: peak includes everything before the load")
    return "\n" + format_table(headers, rows, title) + "\n" + "\n".join(notes)


if __name__ == "__main__":
    sys.exit(main())
