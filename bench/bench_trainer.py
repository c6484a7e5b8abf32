"""GSPO trainer step throughput on CPU: gspo-megatron (TP2+SP and 1 process) vs TRL's GRPOTrainer
with importance_sampling_level="sequence" (TRL's GSPO), side by side in one run, with peak memory.

    python bench/bench_trainer.py                         # 10 rollout batches per arm, first 2 skipped
    python bench/bench_trainer.py --steps 6 --warmup 1 --arms gspo_tp1,trl    # quicker
    python bench/bench_trainer.py --rounds 2              # arms interleaved twice (shared machines)
    python bench/bench_trainer.py --smoke                 # 2 steps, TP1 + TRL (skipped if absent): seconds
    python bench/bench_trainer.py --guard [--record]      # the suite's step-cost regression guard (below)

TRL is optional (it is not a project dependency, and it is not installed into .venv: its
requirements must not move the trainer's torch/transformers). Give it its own venv with the same
CPU torch wheel and transformers as .venv, and point the TRL arm at that interpreter:
    python3.11 -m venv /tmp/bench-trl-venv
    /tmp/bench-trl-venv/bin/pip install /opt/wheels/torch-2.13.0+cpu-*.whl   # as the Makefile does for .venv
    /tmp/bench-trl-venv/bin/pip install transformers==5.24.0                 # the version .venv has
    printf 'torch==2.13.0+cpu\\ntransformers==5.24.0\\n' > /tmp/c.txt
    /tmp/bench-trl-venv/bin/pip install -c /tmp/c.txt trl==1.16.0 pyyaml     # pyproject's `bench` extra
    .venv/bin/python bench/bench_trainer.py --rounds 2 --trl-python /tmp/bench-trl-venv/bin/python
(The TRL child imports the project from this checkout through PYTHONPATH: only the config, task
and chat-template code, which need pyyaml and transformers.) Without TRL the TRL arm is skipped
with one line saying so (its row shows the reason, no numbers).

Regression guard (--guard; tests/test_bench_smoke.py runs it)
  A fourth arm, torch_ref (child_ref), does the same work as a plain loop over transformers and
  torch in one process - no framework - so it exists wherever the suite runs (TRL does not). The
  guard runs TP1 and torch_ref interleaved twice and compares ours/torch_ref tokens per CPU-second
  of each arm's best step (a same-run ratio: the machine's speed cancels; CPU seconds of the least
  disturbed step: other jobs' load mostly does) with the ratio recorded in bench/baselines.json:
  below 0.75x of it, exit 1. Record a new ratio with
  --guard --record on a quiet machine when the trainer gets faster (or knowingly slower).

Same work on both sides
  model    the demo's tiny Qwen3-MoE (launch/configs/tiny_cpu.yaml model.hf_config), random init
           (seed model.init_seed) saved once with save_pretrained, fp32, plus the project's local
           tokenizer (rollout/tokenizer.py build_tokenizer). Both sides start from that directory
           (ours: model.hf_dir=DIR model.hf_config=null; TRL: AutoModelForCausalLM.from_pretrained).
  prompts  the synthetic `sort` task, the exact prompts our trainer draws for steps 0..N-1
           (SyntheticTask(seed=data.seed).sample_prompts(P, Random(f"{seed}:{step}:0"))), given to TRL
           in that order as conversational prompts (shuffle_dataset=False); both render them with the
           tokenizer's chat template (checked: TRL's prompt ids equal ours for the first batch).
  reward   the task's own reward (SyntheticTask.reward) on both sides.
  batch    P prompts x G samples per rollout batch, max_new_tokens, temperature, top-p/top-k and
           minibatches_per_step all read from the config (demo when written: 8 x 8 = 64 samples,
           8 new tokens, T=1, no top-k/top-p, 4 optimizer steps on 4 minibatches of 16).
  loss     GSPO, sequence-level ratio, eps 3e-4 / 4e-4, per-sequence mean, no KL/reference model;
           pi_old by one forward-only pass over the rollout batch before the first update (ours:
           loss.old_logprobs=recompute; TRL computes old_per_token_logps whenever
           steps_per_generation > gradient_accumulation_steps).
  optim    Adam(W) lr from the config (demo 1e-3), betas (0.9, 0.98), eps 1e-8, weight decay 0,
           grad-norm clip 1.0, constant LR (our arms: optimizer.lr_decay_style=constant; the
           demo config decays it).

Setting mapping (ours -> TRL GRPOConfig)
  rollout.prompts_per_step * samples_per_prompt     -> generation_batch_size (P*G, demo 64)
  rollout.samples_per_prompt                         -> num_generations (G, demo 8)
  rollout.max_new_tokens                             -> max_completion_length (demo 8)
  train.minibatches_per_step (M optimizer steps)     -> steps_per_generation=M with
                                                        per_device_train_batch_size=P*G/M (demo 16),
                                                        gradient_accumulation_steps=1, num_iterations=1
                                                        (TRL's global step = one optimizer step, so one
                                                        of our steps = 4 TRL steps; max_steps=4*N)
  train.micro_batch_tokens                           -> default 2048 here (one forward per minibatch:
                                                        sequences are <= 38 tokens), matching TRL's one
                                                        forward of P*G/M rows per optimizer step
  train.recompute=none                               -> gradient_checkpointing=False (TRL's default: True)
  model.moe_aux_loss_coef (0)                        -> router_aux_loss_coef (TRL's default: the model
                                                        config's, 0.001 for Qwen3-MoE)
  loss.type=gspo                                     -> importance_sampling_level="sequence",
                                                        loss_type="grpo" (per-sequence mean; TRL warns
                                                        that dapo/bnpo/dr_grpo weight by length),
                                                        epsilon=3e-4, epsilon_high=4e-4, beta=0
  group advantages (r - mean) / (std + eps)          -> scale_rewards="group"

What is measured (per arm, in its own subprocess tree, sequentially)
  step time  wall seconds of one rollout batch: generation + reward + pi_old + 4 optimizer steps
             (+ our weight push into the rollout engine; TRL generates with the policy itself).
             Ours: metrics.jsonl t_step. TRL: time between the ends of optimizer steps M*j and M*(j+1)
             (TrainerCallback.on_step_end; step 0 = on_train_begin), M = minibatches_per_step. The first --warmup batches are skipped.
  tokens/s   prompt+response tokens trained per rollout batch (unpadded, eos included) / step time,
             summed over the measured batches: ours metrics.jsonl train_tokens; TRL
             prompt_mask.sum() + completion_mask.sum() of the generated batch.
  phases     rollout (generate + reward), pi_old, train (4 updates), sync (ours only). TRL's are
             timed by wrapping GRPOTrainer._generate / _calculate_rewards / _generate_and_score_completions.
  best s/step  the fastest measured batch (the least disturbed by other jobs).
  cpu s      CPU seconds (process_time: user+sys of all threads, summed over ranks) per measured
             rollout batch; tok/cpu-s = tokens / those seconds. Much less sensitive than wall time
             to other jobs on a shared machine (busy-waiting threads do count).
  peak RSS   each worker process reports its own VmHWM (resident-set high-water mark over its
             whole life: imports, model build, rollout engine, training) when it finishes; ours is
             summed over ranks. The torchrun launcher (not doing any model work) is polled from
             /proc and shown separately. getrusage(RUSAGE_CHILDREN).ru_maxrss would only give the
             largest single process, not the sum over ranks.
  threads    OMP_NUM_THREADS=1 per process by default (TP2: 1 per rank, as `make demo`; the 1-process
             arms: --threads). On an oversubscribed machine two OpenMP threads per process were
             pathological: our 1-process arm took 13.3 s/step at 2 threads vs 0.23-0.3 s at 1
             (TRL similarly), so --threads 2 only makes sense on an otherwise idle machine.
  --rounds R runs the arms interleaved R times and pools their measured steps (per-round tokens/s
             are printed below the table), so a burst of load from other jobs hits every arm.

Seen on the shared 2-core machine (load average 8-15 from other jobs during the run), commit of
this file, `--steps 30 --warmup 3 --rounds 3`, demo config 8 prompts x 8 samples, 8 new tokens:

  arm                           threads  s/step  best s/step  tok/step  tokens/s  vs TRL  ...  tok/cpu-s  vs TRL  peak RSS MiB   vs TRL
  gspo-megatron TP2+SP, 2 proc      1+1    0.75         0.39      2255      3022   0.56x  ...       3586   0.33x  905 (467+438)   1.86x
  gspo-megatron TP1, 1 proc           1    0.30         0.21      2255      7644   1.41x  ...       8647   0.79x            467   0.96x
  TRL GRPOTrainer GSPO, 1 proc        1    0.42         0.17      2254      5425   1.00x  ...      10942   1.00x            487   1.00x

  tokens/s per round: TP2 3053 / 4273 / 2319, TP1 8330 / 8824 / 6285, TRL 11849 / 3542 / 5368. The
  pooled wall-clock ratio (1.41x for TP1) is driven by load bursts that hit TRL's rounds 2 and 3;
  the load-robust measures (best step 0.21 vs 0.17 s, tokens per CPU-second 0.79x) say TRL's
  GRPOTrainer is ~20-25% cheaper per token than our single-process path on this tiny model, where
  per-call framework overhead (Megatron schedules, DDP buffers, MoE dispatch, full-sequence
  log-probs incl. prompt positions, the separate rollout engine) dominates the arithmetic. TP2
  is slower still: per-layer gloo collectives on a 64-wide model. Peak RSS is mostly imported
  libraries here (the model is ~1 MB), not training state.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from common import MiB, format_table, proc_status  # noqa: E402

DEMO_CONFIG = os.path.join(ROOT, "launch", "configs", "tiny_cpu.yaml")
ARMS = ("gspo_tp2", "gspo_tp1", "trl", "torch_ref")


# --------------------------------------------------------------------------------------------
# shared setup


def load_demo_cfg(config_path: str, micro_batch_tokens: int):
    from gspo_megatron.resolve import load_config

    return load_config(config_path, [f"train.micro_batch_tokens={micro_batch_tokens}"])


def step_prompts(cfg, steps: int) -> list[list[dict]]:
    """The prompts our trainer draws at steps 0..steps-1 (PromptSource.batch, round 0)."""
    from gspo_megatron.rollout.tasks import SyntheticTask

    task = SyntheticTask(cfg.data.task, seed=cfg.data.seed)
    P = cfg.rollout.prompts_per_step
    return [task.sample_prompts(P, random.Random(f"{cfg.data.seed}:{s}:0")) for s in range(steps)]


def prepare_hf_dir(cfg, out: str) -> str:
    """Random-init tiny Qwen3-MoE (seed model.init_seed) + local tokenizer, saved as an HF dir."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.tokenizer import build_tokenizer

    tok = build_tokenizer(out)
    torch.manual_seed(cfg.model.init_seed)
    hf = dict(cfg.model.hf_config)
    hf.setdefault("eos_token_id", tok.eos_token_id)
    hf.setdefault("pad_token_id", tok.pad_token_id)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).to(torch.float32)
    model.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------
# memory: each worker reports its own peak; the parent polls the process tree for the rest


def _write_mem(path: str, extra: dict) -> None:
    s = proc_status()
    rec = {"pid": os.getpid(), "vmhwm": s["VmHWM"], "rss_end": s["VmRSS"], "rss_anon_end": s["RssAnon"], **extra}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class TreePoller:
    """Max VmHWM per pid of a process tree, polled every `interval` s (a lower bound)."""

    def __init__(self, root_pid: int, interval: float = 0.25):
        self.root = root_pid
        self.interval = interval
        self.peak: dict[int, int] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            todo, seen = [self.root], set()
            while todo:
                p = todo.pop()
                if p in seen:
                    continue
                seen.add(p)
                self.peak[p] = max(self.peak.get(p, 0), _hwm(p))
                todo += _children(p)
            self._stop.wait(self.interval)

    def stop(self):
        self._stop.set()
        self._t.join()


def _load_avg() -> float:
    return os.getloadavg()[0]


def run_arm(name: str, cmd: list[str], env: dict, log_path: str, timeout: float) -> dict:
    """Run one arm's process tree, return wall time, polled peaks, rc and load averages."""
    t0 = time.perf_counter()
    la0 = _load_avg()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        poller = TreePoller(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            rc = proc.wait()
            rc = f"timeout after {timeout:.0f}s"
        finally:
            poller.stop()
    return {"rc": rc, "wall": time.perf_counter() - t0, "launcher_pid": proc.pid, "polled": poller.peak,
            "load_start": la0, "load_end": _load_avg()}


# --------------------------------------------------------------------------------------------
# child: our trainer (under torchrun), instrumented from outside the trainer code


def child_gspo(result: str, argv: list[str]) -> int:
    """Run gspo_megatron.train's main with `argv`; record (wall, cpu) at the end of every weight
    push (one before the first step, then one ending each step) and this rank's peak RSS."""
    import torch

    if not torch.cuda.is_available():  # as train/__main__.py does on CPU, before `loop` imports Megatron
        from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

        skip_compiled_fusions()
    from gspo_megatron.train import loop
    from gspo_megatron.train.__main__ import main

    marks: list[tuple[float, float]] = []
    orig = loop.push_weights
    prof_path = os.environ.get("BENCH_PROFILE")  # --profile: cProfile the measured steps only
    prof_from = int(os.environ.get("BENCH_PROFILE_FROM", "0"))
    prof_to = int(os.environ.get("BENCH_PROFILE_TO", "0"))
    prof = None
    if prof_path:
        import cProfile

        prof = cProfile.Profile()

    # forward whatever else the loop passes (e.g. its async `producer`): the bench only needs to
    # see when each push ends, and must not break when the signature grows again
    def push_weights(parts, version, *args, **kwargs):
        out = orig(parts, version, *args, **kwargs)
        marks.append((time.perf_counter(), time.process_time()))
        if prof is not None and len(marks) == prof_from + 1:  # after the warm-up steps' pushes
            prof.enable()
        if prof is not None and len(marks) == prof_to + 1:  # the last step's push: stop before the save
            prof.disable()
        return out

    loop.push_weights = push_weights
    rank = int(os.environ.get("RANK", "0"))
    rc = 1
    try:
        rc = main(argv)
    finally:
        import torch

        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{prof_path}.rank{rank}")
        _write_mem(f"{result}.rank{rank}.json",
                   {"rank": rank, "rc": rc, "marks": marks, "torch_threads": torch.get_num_threads()})
    return rc


# --------------------------------------------------------------------------------------------
# child: TRL


def child_trl(result: str, hf_dir: str, config_path: str, steps: int, micro_batch_tokens: int, out_dir: str) -> int:
    import torch

    cfg = load_demo_cfg(config_path, micro_batch_tokens)
    rec: dict = {"rank": 0}
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except Exception as e:  # not installed, or does not import against this transformers
        rec.update(skipped=f"TRL not usable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        _write_mem(f"{result}.rank0.json", rec)
        return 0
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from gspo_megatron.rollout.data import render_prompt
    from gspo_megatron.rollout.tasks import SyntheticTask

    rec["trl_version"] = trl.__version__
    rec["python"] = sys.executable  # --trl-python: which venv the numbers come from
    r = cfg.rollout
    G, P, M = r.samples_per_prompt, r.prompts_per_step, cfg.train.minibatches_per_step
    if (P * G) % M:
        raise SystemExit(f"{P * G} samples per step do not split into {M} equal minibatches")
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    task = SyntheticTask(cfg.data.task, seed=cfg.data.seed)
    batches = step_prompts(cfg, steps)
    rows = [{"prompt": [{"role": "user", "content": ex["prompt"]}], "answer": ex["answer"], "task": ex["task"]}
            for b in batches for ex in b]
    dataset = Dataset.from_list(rows)

    def sort_reward(prompts, completions, answer, task, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task_obj.reward(t, {"answer": a, "task": k}) for t, a, k in zip(texts, answer, task)]

    task_obj = task
    o = cfg.optimizer
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=cfg.train.seed,
        per_device_train_batch_size=P * G // M, gradient_accumulation_steps=1, steps_per_generation=M,
        num_iterations=1, num_generations=G, max_completion_length=r.max_new_tokens, max_steps=steps * M,
        temperature=r.temperature, top_p=r.top_p, top_k=0 if r.top_k <= 0 else r.top_k,
        importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0,
        scale_rewards="group", mask_truncated_completions=False,
        router_aux_loss_coef=cfg.model.moe_aux_loss_coef,  # ours: 0 (off); TRL: the model config's 0.001
        gradient_checkpointing=False,  # TRL's default is True; ours: train.recompute=none
        learning_rate=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2,
        adam_epsilon=o.adam_eps, max_grad_norm=o.clip_grad, lr_scheduler_type="constant", warmup_steps=0,
        shuffle_dataset=False, remove_unused_columns=False, dataloader_num_workers=0,
        logging_steps=M, report_to="none", save_strategy="no", disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=sort_reward, args=args, train_dataset=dataset,
                          processing_class=tok)

    phase = {"generate": [], "reward": [], "gen_and_score": [], "tokens": [], "resp_len": [], "prompt_ok": None}

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            phase[key].append(time.perf_counter() - t)
            return out
        return wrapper

    trainer._generate = timed(trainer._generate, "generate")
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "reward")
    inner = timed(trainer._generate_and_score_completions, "gen_and_score")

    def gen_and_score(inputs):
        out = inner(inputs)
        pm, cm = out["prompt_mask"], out["completion_mask"]
        phase["tokens"].append(int(pm.sum()) + int(cm.sum()))
        phase["resp_len"].append(float(cm.sum(1).float().mean()))
        if phase["prompt_ok"] is None:  # TRL's prompt ids == ours (render_prompt), first batch
            ids = [row[m.bool()].tolist() for row, m in zip(out["prompt_ids"], pm)]
            ours = [render_prompt(tok, ex["prompt"]) for ex in batches[0] for _ in range(G)]
            phase["prompt_ok"] = ids == ours
        return out

    trainer._generate_and_score_completions = gen_and_score

    marks: list[tuple[float, float]] = []

    class Marks(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, *a, **k):
            marks.append((time.perf_counter(), time.process_time()))

    trainer.add_callback(Marks())
    try:
        trainer.train()
    finally:
        rec.update(marks=marks, phases=phase, steps_per_rollout=M, torch_threads=torch.get_num_threads())
        _write_mem(f"{result}.rank0.json", rec)
    return 0


# --------------------------------------------------------------------------------------------
# child: a plain-PyTorch reference (the regression guard's yardstick, always available)


def child_ref(result: str, hf_dir: str, config_path: str, steps: int, out_dir: str) -> int:
    """The same work as the other arms, written directly against transformers and torch in one
    process: HF generate (P prompts x G samples, left-padded), the task's reward, group
    advantages, pi_old by one no-grad forward per minibatch, then per minibatch a forward, the
    GSPO sequence-ratio loss (eps 3e-4/4e-4, per-sequence mean), backward, grad-norm clip and
    torch AdamW (the HF Trainer's default). No framework: what a ratio against it measures is our
    trainer's own overhead, on any machine, without TRL installed (tests/test_bench_smoke.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gspo_megatron.rollout.data import render_prompt
    from gspo_megatron.rollout.tasks import SyntheticTask

    cfg = load_demo_cfg(config_path, 2048)
    r, o = cfg.rollout, cfg.optimizer
    G, P, M = r.samples_per_prompt, r.prompts_per_step, cfg.train.minibatches_per_step
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                            weight_decay=o.weight_decay)
    task = SyntheticTask(cfg.data.task, seed=cfg.data.seed)
    torch.manual_seed(cfg.train.seed)
    pad = tok.pad_token_id
    rows: list[dict] = []

    def token_logprobs(ids, attn, n_prompt):  # [B, L] -> log p of every response token [B, L - n_prompt]
        logits = model(input_ids=ids, attention_mask=attn).logits[:, n_prompt - 1:-1].float() / r.temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[:, n_prompt:, None]).squeeze(-1)

    for examples in step_prompts(cfg, steps):
        t0, c0 = time.perf_counter(), time.process_time()
        prompts = [render_prompt(tok, [{"role": "user", "content": ex["prompt"]}]) for ex in examples]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts for _ in range(G)])
        attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts for _ in range(G)])[:, None]).long()
        model.eval()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=r.temperature,
                                 top_k=0, top_p=1.0, max_new_tokens=r.max_new_tokens, pad_token_id=pad,
                                 eos_token_id=tok.eos_token_id)
        resp = out[:, width:]
        is_eos = resp == tok.eos_token_id
        after = torch.cumsum(is_eos.long(), 1) - is_eos.long()  # tokens after the first eos
        mask = (after == 0).float()
        texts = [tok.decode(row[m.bool()], skip_special_tokens=True) for row, m in zip(resp, mask)]
        rewards = torch.tensor([task.reward(t, examples[i // G]) for i, t in enumerate(texts)])
        g = rewards.view(P, G)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).view(-1)
        full_attn = torch.cat([attn, mask.long()], 1)
        t_roll = time.perf_counter() - t0
        parts = torch.randperm(P * G).chunk(M)
        with torch.no_grad():
            olds = [token_logprobs(out[i], full_attn[i], width) for i in parts]  # pi_old per minibatch
        t_old = time.perf_counter() - t0 - t_roll
        model.train()
        for i, o_lp in zip(parts, olds):
            lp = token_logprobs(out[i], full_attn[i], width)
            m = mask[i]
            n = m.sum(1).clamp(min=1)
            ratio = torch.exp(((lp - o_lp) * m).sum(1) / n)  # GSPO: exp of the mean token log-ratio
            a = adv[i]
            loss = -torch.minimum(ratio * a, ratio.clamp(1 - 3e-4, 1 + 4e-4) * a).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
            opt.step()
        rows.append({"t_step": time.perf_counter() - t0, "cpu": time.process_time() - c0,
                     "tokens": int(full_attn.sum()), "resp_len": float(mask.sum(1).mean()), "t_rollout": t_roll,
                     "t_old": t_old, "t_train": time.perf_counter() - t0 - t_roll - t_old, "t_sync": 0.0})
    _write_mem(f"{result}.rank0.json", {"rank": 0, "steps": rows, "torch_threads": torch.get_num_threads()})
    return 0


def summarize_ref(rec: dict, warmup: int) -> dict:
    rows = rec["steps"][warmup:]
    if not rows:
        raise RuntimeError("torch reference: no steps after the warm-up")
    out = {k: [row[k] for row in rows] for k in ("t_step", "tokens", "resp_len", "t_rollout", "t_old", "t_train",
                                                "t_sync", "cpu")}
    out["peak_rss_ranks"] = [rec["vmhwm"]]
    return out


# --------------------------------------------------------------------------------------------
# results


def _read_ranks(result: str) -> list[dict]:
    d, base = os.path.dirname(result), os.path.basename(result)
    out = []
    for f in sorted(os.listdir(d)):
        if f.startswith(base + ".rank") and f.endswith(".json"):
            with open(os.path.join(d, f)) as fh:
                out.append(json.load(fh))
    return sorted(out, key=lambda r: r["rank"])


def summarize_gspo(out_dir: str, ranks: list[dict], warmup: int) -> dict:
    """Per measured step lists (wall, tokens, phases, CPU summed over ranks) and peak RSS."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if r.get("phase") == "gspo"]
    if len(rows) <= warmup:
        raise RuntimeError(f"{out_dir}/metrics.jsonl: no GSPO steps after the warm-up")
    steps = range(warmup, len(rows))
    # marks[0]: end of the weight push before the first step; marks[k]: end of step k
    cpu = [sum(rk["marks"][k + 1][1] - rk["marks"][k][1] for rk in ranks) for k in steps]
    rows = rows[warmup:]
    return {
        "t_step": [r["t_step"] for r in rows], "tokens": [r["train_tokens"] for r in rows],
        "resp_len": [r["response_len_mean"] for r in rows], "t_rollout": [r["t_rollout"] for r in rows],
        "t_old": [r.get("t_old_logprobs", 0.0) for r in rows], "t_train": [r.get("t_train", 0.0) for r in rows],
        "t_sync": [r["t_weight_sync"] for r in rows], "cpu": cpu,
        "peak_rss_ranks": [rk["vmhwm"] for rk in ranks],
    }


def summarize_trl(rec: dict, warmup: int) -> dict:
    M = rec["steps_per_rollout"]
    m, ph = rec["marks"], rec["phases"]
    n_batches = (len(m) - 1) // M  # marks[0]: train begin; marks[k]: end of optimizer step k
    idx = range(warmup, n_batches)
    if not idx:
        raise RuntimeError("TRL: no rollout batches after the warm-up")
    wall = [m[(j + 1) * M][0] - m[j * M][0] for j in idx]
    gen = [ph["generate"][j] + ph["reward"][j] for j in idx]
    old = [ph["gen_and_score"][j] - ph["generate"][j] - ph["reward"][j] for j in idx]
    return {
        "t_step": wall, "tokens": [ph["tokens"][j] for j in idx], "resp_len": [ph["resp_len"][j] for j in idx],
        "t_rollout": gen, "t_old": old, "t_train": [w - g - o for w, g, o in zip(wall, gen, old)],
        "t_sync": [0.0] * len(wall), "cpu": [m[(j + 1) * M][1] - m[j * M][1] for j in idx],
        "peak_rss_ranks": [rec["vmhwm"]], "prompt_ids_match": ph["prompt_ok"],
    }


def aggregate(runs: list[dict]) -> dict:
    """Pool the measured steps of every round: means per step, tokens/s = sum tokens / sum time."""
    pool = {k: [v for r in runs for v in r[k]] for k in
            ("t_step", "tokens", "resp_len", "t_rollout", "t_old", "t_train", "t_sync", "cpu")}
    n = len(pool["t_step"])
    out = {k: sum(v) / n for k, v in pool.items()}
    out["n"] = n
    out["t_step_min"] = min(pool["t_step"])
    out["tokens_per_s"] = sum(pool["tokens"]) / sum(pool["t_step"])
    out["tokens_per_cpu_s"] = sum(pool["tokens"]) / sum(pool["cpu"])
    # the least disturbed step's: the guard's measure (a loaded machine inflates CPU time too,
    # through contention, but not on every step)
    out["best_tokens_per_cpu_s"] = max(t / c for t, c in zip(pool["tokens"], pool["cpu"]))
    out["round_tokens_per_s"] = [sum(r["tokens"]) / sum(r["t_step"]) for r in runs]
    # peak: the round with the largest sum over ranks
    worst = max(runs, key=lambda r: sum(r["peak_rss_ranks"]))
    out["peak_rss_ranks"] = worst["peak_rss_ranks"]
    out["peak_rss"] = sum(worst["peak_rss_ranks"])
    return out


# --------------------------------------------------------------------------------------------


def trl_unavailable(python: str) -> str | None:
    """Why `python` cannot run the TRL arm (None if it has trl): checked before starting the arm,
    so a machine without TRL does not pay for a child process that only finds that out."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('trl') is None)"
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not run: {type(e).__name__}: {e}"
    return None if r.returncode == 0 else f"trl is not installed for {python} (--trl-python: a venv with trl)"


def arm_command(arm: str, args, hf_dir: str, out_dir: str, result: str) -> tuple[list[str], dict]:
    py, me = sys.executable, os.path.abspath(__file__)
    env = {}
    if arm.startswith("gspo"):
        nproc = 2 if arm == "gspo_tp2" else 1
        env["OMP_NUM_THREADS"] = str(1 if nproc == 2 else args.threads)
        layout = (["parallel.tp=2", "parallel.sequence_parallel=true"] if nproc == 2
                  else ["parallel.tp=1", "parallel.sequence_parallel=false"])
        cmd = [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), me,
               "--_child", "gspo", "--_result", result, "--",
               "--config", args.config, f"out_dir={out_dir}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
               *layout, "parallel.ep=1", "parallel.pp=1", f"train.max_steps={args.steps}",
               "train.sft_warmup_steps=0", f"train.micro_batch_tokens={args.micro_batch_tokens}",
               "optimizer.lr_decay_style=constant",  # as TRL's and torch_ref's (the demo decays)
               "checkpoint.interval=0", "checkpoint.resume=never", "checkpoint.export_hf=false",
               "logging.progress_bar=false", "logging.plot=false", *args.gspo_set]
    elif arm == "torch_ref":
        env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [py, me, "--_child", "torch_ref", "--_result", result, "--_hf_dir", hf_dir, "--_out", out_dir,
               "--config", args.config, "--steps", str(args.steps)]
    else:
        env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [args.trl_python or py, me, "--_child", "trl", "--_result", result, "--_hf_dir", hf_dir,
               "--_out", out_dir, "--config", args.config, "--steps", str(args.steps),
               "--micro-batch-tokens", str(args.micro_batch_tokens)]
    return cmd, env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="rollout batches (GSPO steps) per arm and round")
    p.add_argument("--warmup", type=int, default=2, help="first batches of each run left out of the averages")
    p.add_argument("--rounds", type=int, default=1, help="run every arm this many times, interleaved")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {ARMS}")
    p.add_argument("--config", default=DEMO_CONFIG, help="trainer config giving model, batch and lengths")
    p.add_argument("--micro-batch-tokens", type=int, default=2048,
                   help="our train.micro_batch_tokens (2048: one forward per minibatch, as TRL)")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP threads of the single-process arms (TP2 ranks always get 1 each, as in make demo)")
    p.add_argument("--workdir", default=None, help="default: a temporary directory, removed unless --keep")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--timeout", type=float, default=900, help="seconds per arm run")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--trl-python", default=None,
                   help="interpreter of the TRL arm (a venv with trl; default: this one)")
    p.add_argument("--smoke", action="store_true",
                   help="--steps 2 --warmup 1 --rounds 1 --arms gspo_tp1,trl (the TRL arm skipped when TRL is "
                        "absent): seconds, checks that the harness runs")
    p.add_argument("--profile", metavar="PREFIX", default=None,
                   help="cProfile our arms' measured steps (after --warmup) into PREFIX.<arm>.r<round>.rank<r> "
                        "(pstats files; python -m pstats to read; the timings include the profiler's overhead)")
    p.add_argument("--gspo-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra config override for our arms (repeatable), e.g. train.packing=false")
    p.add_argument("--guard", action="store_true",
                   help="the step-cost regression guard (the suite runs it): --steps 4 --warmup 1 --rounds 2 --arms "
                        "gspo_tp1,trl,torch_ref; exit 1 when ours/torch_ref tokens per CPU-second (best step) falls below "
                        f"{GUARD_FLOOR:g}x the ratio in bench/baselines.json")
    p.add_argument("--record", action="store_true", help="with --guard: write the measured ratio to bench/baselines.json")
    p.add_argument("--summarize", metavar="WORKDIR", default=None,
                   help="only print the table of a kept workdir (same --warmup/--config/--threads)")
    # internal
    p.add_argument("--_child", choices=("gspo", "trl", "torch_ref"), help=argparse.SUPPRESS)
    p.add_argument("--_result", help=argparse.SUPPRESS)
    p.add_argument("--_hf_dir", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)

    if args._child == "gspo":
        return child_gspo(args._result, rest[1:] if rest[:1] == ["--"] else rest)
    if args._child == "torch_ref":
        return child_ref(args._result, args._hf_dir, args.config, args.steps, args._out)
    if args._child == "trl":
        return child_trl(args._result, args._hf_dir, args.config, args.steps, args.micro_batch_tokens, args._out)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.smoke:
        # one trainer process (TP1) is the fewest that runs the gspo child's code (TP2 only adds a
        # second rank of the same code); 2 steps so that one is measured after the warm-up
        args.steps, args.warmup, args.rounds, args.arms = 2, 1, 1, "gspo_tp1,trl"
    if args.guard:  # arms interleaved twice: a burst of load hits both
        args.steps, args.warmup, args.rounds, args.arms = 4, 1, 2, "gspo_tp1,trl,torch_ref"
    elif args.record:
        p.error("--record needs --guard")
    if args.summarize:  # re-render the table of a kept --workdir without running anything
        cfg = load_demo_cfg(args.config, args.micro_batch_tokens)
        names = {d.rsplit(".r", 1)[0] for d in os.listdir(args.summarize) if ".r" in d}
        return report(args.summarize, [a for a in ARMS if a in names], cfg, args)

    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            p.error(f"unknown arm {a!r}; choose from {ARMS}")
    if args.steps <= args.warmup:
        p.error("--steps must be larger than --warmup")
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_trainer_")
    os.makedirs(workdir, exist_ok=True)
    cfg = load_demo_cfg(args.config, args.micro_batch_tokens)
    hf_dir = prepare_hf_dir(cfg, os.path.join(workdir, "hf"))
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    base_env["PYTHONPATH"] = ROOT + os.pathsep + base_env.get("PYTHONPATH", "")
    base_env["TOKENIZERS_PARALLELISM"] = "false"

    trl_missing = trl_unavailable(args.trl_python or sys.executable) if "trl" in arms else None
    if trl_missing:
        print(f"[bench_trainer] TRL arm skipped: {trl_missing}", flush=True)
    for rnd in range(args.rounds):
        for arm in arms:
            out_dir = os.path.join(workdir, f"{arm}.r{rnd}")
            shutil.rmtree(out_dir, ignore_errors=True)
            os.makedirs(out_dir)
            result = os.path.join(out_dir, "bench")
            if arm == "trl" and trl_missing:  # no child to start: its row shows the reason
                with open(f"{result}.rank0.json", "w") as f:
                    json.dump({"rank": 0, "skipped": trl_missing}, f)
                continue
            cmd, env = arm_command(arm, args, hf_dir, out_dir, result)
            if args.profile and arm.startswith("gspo"):
                env.update(BENCH_PROFILE=f"{os.path.abspath(args.profile)}.{arm}.r{rnd}",
                           BENCH_PROFILE_FROM=str(args.warmup), BENCH_PROFILE_TO=str(args.steps))
            print(f"[bench_trainer] round {rnd + 1}/{args.rounds} {arm}: running, log {out_dir}/log.txt", flush=True)
            run = run_arm(arm, cmd, {**base_env, **env}, os.path.join(out_dir, "log.txt"), args.timeout)
            workers = {rk["pid"] for rk in _read_ranks(result)}
            run["launcher_rss"] = sum(v for pid, v in run.pop("polled").items() if pid not in workers)
            with open(os.path.join(out_dir, "run.json"), "w") as f:
                json.dump(run, f)
            print(f"[bench_trainer] round {rnd + 1}/{args.rounds} {arm}: done in {run['wall']:.0f}s, exit status "
                  f"{run['rc']} (load avg {run['load_start']:.1f} -> {run['load_end']:.1f})", flush=True)
    return report(workdir, arms, cfg, args, cleanup=args.workdir is None and not args.keep)


def collect(workdir: str, arms: list[str], warmup: int) -> dict:
    """Summaries of every run in `workdir` (directories ARM.rK), pooled per arm."""
    results = {}
    for arm in arms:
        dirs = sorted((d for d in os.listdir(workdir) if d.startswith(arm + ".r")), key=lambda d: int(d.rsplit("r", 1)[1]))
        runs, info, problem = [], {"load": [], "wall": [], "launcher_rss": 0}, None
        for d in dirs:
            out_dir = os.path.join(workdir, d)
            run = {}
            if os.path.exists(os.path.join(out_dir, "run.json")):
                with open(os.path.join(out_dir, "run.json")) as f:
                    run = json.load(f)
                info["load"].append((run["load_start"], run["load_end"]))
                info["wall"].append(run["wall"])
                info["launcher_rss"] = max(info["launcher_rss"], run.get("launcher_rss", 0))
            ranks = _read_ranks(os.path.join(out_dir, "bench"))
            info["torch_threads"] = [rk.get("torch_threads") for rk in ranks]
            try:
                if run.get("rc", 0) != 0 or not ranks:
                    raise RuntimeError(f"exit status {run.get('rc')}; see {out_dir}/log.txt")
                if arm == "trl" and "skipped" in ranks[0]:
                    problem = ("skipped", ranks[0]["skipped"])
                elif arm == "trl":
                    runs.append(summarize_trl(ranks[0], warmup))
                    info["trl_version"] = ranks[0].get("trl_version")
                    info["trl_python"] = ranks[0].get("python")
                    info["prompt_ids_match"] = runs[-1]["prompt_ids_match"]
                elif arm == "torch_ref":
                    runs.append(summarize_ref(ranks[0], warmup))
                else:
                    runs.append(summarize_gspo(out_dir, ranks, warmup))
            except Exception as e:
                problem = ("error", f"{d}: {type(e).__name__}: {e}")
        if problem is None and not runs:
            problem = ("error", "no runs")
        results[arm] = {problem[0]: problem[1]} if problem else aggregate(runs)
        results[arm]["info"] = info
        results[arm]["rounds"] = len(dirs)
    return results


def report(workdir: str, arms: list[str], cfg, args, cleanup: bool = False) -> int:
    results = collect(workdir, arms, args.warmup)
    print()
    print(render(results, cfg, args))
    rc = 0 if not any("error" in r for r in results.values()) else 1
    if args.guard and rc == 0:
        rc = guard(results, record=args.record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings(cfg, args), "results": results}, f, indent=1, default=str)
    if cleanup:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"\nkept {workdir}")
    return rc


BASELINES = os.path.join(ROOT, "bench", "baselines.json")
GUARD_KEY = "trainer_tp1_vs_torch_ref_best_step_tokens_per_cpu_s"
GUARD_FLOOR = 0.75  # fail below this fraction of the recorded ratio: a 30% slide fails


def guard(results: dict, record: bool = False) -> int:
    """The step-cost regression guard: our TP1 arm's tokens per CPU-second over the plain
    PyTorch+HF loop's, each arm's best measured step, both measured in this run (a ratio, so the
    machine's speed cancels; CPU seconds of the least disturbed step, so other jobs' load mostly
    does too: the pooled mean read 0.79x its quiet value in a loaded CI run). Fails (exit 1, one
    line) below GUARD_FLOOR x the ratio recorded in bench/baselines.json; --record writes the
    measured one there instead."""
    ratio = results["gspo_tp1"]["best_tokens_per_cpu_s"] / results["torch_ref"]["best_tokens_per_cpu_s"]
    try:
        with open(BASELINES) as f:
            base = json.load(f)
    except FileNotFoundError:
        base = {}
    if record:
        base[GUARD_KEY] = round(ratio, 3)
        tmp = f"{BASELINES}.tmp"
        with open(tmp, "w") as f:
            json.dump(base, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, BASELINES)
        print(f"[bench_trainer] guard: recorded {GUARD_KEY} = {ratio:.3f} in {BASELINES}")
        return 0
    if GUARD_KEY not in base:
        print(f"[bench_trainer] guard: FAIL - {BASELINES} has no {GUARD_KEY} (run --guard --record)")
        return 1
    floor = GUARD_FLOOR * base[GUARD_KEY]
    verdict = "PASS" if ratio >= floor else "FAIL"
    print(f"[bench_trainer] guard: {verdict} - tokens per CPU-second of the best step, ours TP1 / plain PyTorch loop = "
          f"{ratio:.3f} "
          f"(recorded {base[GUARD_KEY]:.3f}, floor {GUARD_FLOOR:g}x = {floor:.3f})")
    return 0 if verdict == "PASS" else 1


def settings(cfg, args) -> dict:
    r = cfg.rollout
    return {"prompts_per_step": r.prompts_per_step, "samples_per_prompt": r.samples_per_prompt,
            "max_new_tokens": r.max_new_tokens, "minibatches_per_step": cfg.train.minibatches_per_step,
            "micro_batch_tokens": args.micro_batch_tokens, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "threads": args.threads, "lr": cfg.optimizer.lr,
            "hf_config": dict(cfg.model.hf_config)}


LABELS = {"gspo_tp2": "gspo-megatron TP2+SP, 2 proc", "gspo_tp1": "gspo-megatron TP1, 1 proc",
          "trl": "TRL GRPOTrainer GSPO, 1 proc", "torch_ref": "plain PyTorch+HF loop, 1 proc"}


def render(results: dict, cfg, args) -> str:
    s = settings(cfg, args)
    ref = results.get("trl") if "t_step" in results.get("trl", {}) else None
    headers = ["arm", "threads", "s/step", "best s/step", "tok/step", "tokens/s", "vs TRL", "rollout s", "pi_old s", "train s",
               "sync s", "cpu s/step", "tok/cpu-s", "vs TRL", "resp len", "peak RSS MiB", "vs TRL"]
    rows = []
    for arm, e in results.items():
        seen = e["info"].get("torch_threads") or []  # torch.get_num_threads() reported by each worker
        thr = "+".join(str(t) for t in seen) if seen and None not in seen else ("1+1" if arm == "gspo_tp2" else
                                                                               str(args.threads))
        if "t_step" not in e:
            rows.append([LABELS[arm], thr, "skipped" if "skipped" in e else "error"] + ["-"] * (len(headers) - 3))
            continue
        ranks = e["peak_rss_ranks"]
        rows.append([
            LABELS[arm], thr, f"{e['t_step']:.2f}", f"{e['t_step_min']:.2f}", f"{e['tokens']:.0f}", f"{e['tokens_per_s']:.0f}",
            f"{e['tokens_per_s'] / ref['tokens_per_s']:.2f}x" if ref else "n/a",
            f"{e['t_rollout']:.2f}", f"{e['t_old']:.2f}", f"{e['t_train']:.2f}", f"{e['t_sync']:.2f}",
            f"{e['cpu']:.2f}", f"{e['tokens_per_cpu_s']:.0f}",
            f"{e['tokens_per_cpu_s'] / ref['tokens_per_cpu_s']:.2f}x" if ref else "n/a",
            f"{e['resp_len']:.2f}",
            (f"{sum(ranks) / MiB:.0f} (" + "+".join(f"{v / MiB:.0f}" for v in ranks) + ")") if len(ranks) > 1
            else f"{e['peak_rss'] / MiB:.0f}",
            f"{e['peak_rss'] / ref['peak_rss']:.2f}x" if ref else "n/a",
        ])
    hc = s["hf_config"]
    title = (f"GSPO trainer step throughput, tiny Qwen3-MoE (hidden {hc['hidden_size']}, {hc['num_hidden_layers']} "
             f"layers, {hc['num_experts']} experts top-{hc['num_experts_per_tok']}, vocab {hc['vocab_size']}), fp32, "
             f"CPU; {s['prompts_per_step']} prompts x {s['samples_per_prompt']} samples, max_new_tokens "
             f"{s['max_new_tokens']}, {s['minibatches_per_step']} optimizer steps per rollout batch; "
             f"the first {args.warmup} steps of each run skipped")
    notes = []
    for arm, e in results.items():
        i = e["info"]
        loads = ", ".join(f"{a:.1f}->{b:.1f}" for a, b in i["load"])
        line = (f"{arm}: {e['rounds']} run(s), {e.get('n', 0)} measured steps; run wall "
                f"{', '.join(f'{w:.0f}s' for w in i['wall']) or '?'}; load average {loads or '?'}")
        if "t_step" not in e:
            line += f"; {'SKIPPED' if 'skipped' in e else 'FAILED'}: {e.get('skipped') or e.get('error')}"
        if len(e.get("round_tokens_per_s", [])) > 1:
            line += "; tokens/s per round " + ", ".join(f"{v:.0f}" for v in e["round_tokens_per_s"])
        if i.get("launcher_rss"):
            line += f"; torchrun launcher peak RSS {i['launcher_rss'] / MiB:.0f} MiB (not in the sum)"
        if i.get("trl_version"):
            line += (f"; trl {i['trl_version']} ({i.get('trl_python')}), its prompt token ids equal ours: "
                     f"{i.get('prompt_ids_match')}")
        notes.append(line)
    return format_table(headers, rows, title) + "\n" + "\n".join(notes)


if __name__ == "__main__":
    sys.exit(main())
