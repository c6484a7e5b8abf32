"""Multi-turn agent rollouts: 16 concurrent sessions with a slow tool vs one session alone, and vs
the same 16 sessions one after another, side by side in one run.

    python bench/bench_agents.py                 # 16 sessions, tool 0.2 s, 3 rounds each
    python bench/bench_agents.py --sessions 32 --tool-s 0.5 --json out.json
    python bench/bench_agents.py --smoke         # 4 sessions, 1 round: the harness runs

Setup
  The in-process engine (rollout/hf_engine.py, transformers generate, fp32, 1 CPU thread) on
  the demo's tiny random Qwen3-MoE; each session (rollout/agent.py) is three policy turns of up to
  8 tokens with two tool calls between them, each tool call sleeping --tool-s seconds (a
  sandbox, a search API) and appending 6 environment tokens. Generation ignores eos so every
  turn has the same length in every arm.

Printed
  per arm: sessions, concurrency, wall seconds of the whole rollout (best and mean of --rounds),
  engine calls (batched generate() calls), sessions per second, the ratio to one session alone
  and to running them one after another, and peak RSS. Target: 16 concurrent sessions within
  2x the time of one session alone.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")

from common import format_table, peak_rss  # noqa: E402


def _engine():
    import torch
    import yaml
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.hf_engine import HFEngine
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    with open(TINY) as f:
        hf = yaml.safe_load(f)["model"]["hf_config"]
    torch.manual_seed(0)
    tok = build_tokenizer()
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).eval()
    return HFEngine(model, tokenizer=tok, eos_token_ids=[], max_batch_size=64), tok


def make_agent(tool_s: float):
    def agent(example, session):
        for _ in range(2):
            session.generate(max_new_tokens=8)
            time.sleep(tool_s)  # the tool
            session.append("=tool\n")
        session.generate(max_new_tokens=8)
        return 1.0

    return agent


def run_arm(engine, tok, sessions: int, concurrency: int, tool_s: float, rounds: int) -> dict:
    from gspo_megatron.rollout.agent import AgentRunner
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.data import render_prompt

    examples = [{"prompt": f"{10 + i}+{20 + i}=", "answer": str(30 + 2 * i)} for i in range(sessions)]
    prompts = [render_prompt(tok, e["prompt"]) for e in examples]
    # linger 0.5 s: a turn's requests go out together once every session waits (a straggler of a
    # loaded machine does not split the batch); the trainer's default is 0.05 s
    runner = AgentRunner(make_agent(tool_s), tok, max_response_tokens=64, concurrency=concurrency, linger_s=0.5)
    sp = SamplingParams(max_new_tokens=8)
    walls, calls = [], 0
    for r in range(rounds):
        t0 = time.perf_counter()
        res = runner.run(engine.generate, examples, prompts, 1, sp, seed=r)
        walls.append(time.perf_counter() - t0)
        assert all(e is None for e in res.errors), res.errors
        assert all(s.meta["turns"] == 3 and s.meta["env_tokens"] == 12 for s in res.samples)
        calls = res.stats["engine_calls"]
    return {"sessions": sessions, "concurrency": concurrency, "best_s": min(walls), "mean_s": sum(walls) / len(walls),
            "engine_calls": calls}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--tool-s", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.sessions, a.rounds, a.tool_s = 4, 1, 0.05
    import torch

    torch.set_num_threads(1)
    engine, tok = _engine()
    run_arm(engine, tok, 2, 2, 0.0, 1)  # warm-up: first generate() pays one-time costs
    arms = {
        "one session alone": run_arm(engine, tok, 1, 1, a.tool_s, a.rounds),
        f"{a.sessions} concurrent": run_arm(engine, tok, a.sessions, a.sessions, a.tool_s, a.rounds),
        f"{a.sessions} one after another": run_arm(engine, tok, a.sessions, 1, a.tool_s, a.rounds),
    }
    one = arms["one session alone"]["best_s"]
    seq = arms[f"{a.sessions} one after another"]["best_s"]
    rows = []
    for name, r in arms.items():
        rows.append([name, r["sessions"], r["concurrency"], f"{r['best_s']:.3f}", f"{r['mean_s']:.3f}",
                     r["engine_calls"], f"{r['sessions'] / r['best_s']:.1f}", f"{r['best_s'] / one:.2f}x",
                     f"{r['best_s'] / seq:.3f}x"])
    print(f"agent rollouts: tool {a.tool_s:g} s per call, 2 calls and 3 policy turns of 8 tokens per session, "
          f"in-process engine (tiny Qwen3-MoE, fp32, 1 thread), best of {a.rounds} round(s)")
    print(format_table(["arm", "sessions", "concurrency", "best s", "mean s", "engine calls", "sessions/s",
                        "vs one alone", "vs one after another"], rows))
    conc = arms[f"{a.sessions} concurrent"]["best_s"]
    print(f"{a.sessions} concurrent sessions / one alone: {conc / one:.2f}x (target <= 2x); "
          f"one after another / concurrent: {seq / conc:.1f}x; peak RSS {peak_rss() / 2**20:.0f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tool_s": a.tool_s, "arms": arms, "peak_rss_mib": peak_rss() / 2**20}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
