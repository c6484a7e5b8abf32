"""Score sequences with a Qwen3-MoE policy on Megatron-Core: per-token log-probs.

    torchrun --nproc-per-node N -m gspo_megatron.score --hf-dir DIR --tp T --pp P --ep E --cp C \\
        --input in.jsonl --output out.jsonl

Input lines: {"input_ids": [...]}. Output lines, same order: {"token_logprobs": [...]} with
len(input_ids)-1 floats, log p(token t | tokens < t). Runs single-process without torchrun too.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gspo_megatron.score", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf-dir", help="Hugging Face Qwen3-MoE checkpoint directory")
    src.add_argument("--load", help="Megatron torch_dist checkpoint directory (from gspo-convert)")
    p.add_argument("--input", required=True, help='JSONL, one {"input_ids": [...]} per line')
    p.add_argument("--output", required=True, help="JSONL written atomically, same order as --input")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (carved from TP x DP)")
    p.add_argument("--etp", type=int, default=1, help="expert tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (each sequence split over CP ranks)")
    p.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallel (default: on when --tp > 1)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="token budget of one microbatch (packed: sum of lengths; padded: sequences x length)")
    p.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                   help="pack sequences into THD microbatches (default) instead of padded [b, s] rows")
    p.add_argument("--temperature", type=float, default=1.0, help="score softmax(logits / T)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--require-checksums", action="store_true",
                   help="with --load: refuse a checkpoint without checksums.json (default: load it with a warning); "
                        "its files are verified against them before they are read either way")
    return p.parse_args(argv)


def read_input(path: str, vocab_size: int) -> list[list[int]]:
    from gspo_megatron.errors import InputError

    if not os.path.isfile(path):
        raise InputError(f"{path}: no such input file")
    seqs = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["input_ids"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise InputError(f'{path}:{lineno}: expected a JSON object with "input_ids"') from None
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise InputError(f"{path}:{lineno}: input_ids must be a non-empty list of integers")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InputError(f"{path}:{lineno}: token id {bad[0]} outside the vocabulary [0, {vocab_size})")
            seqs.append(ids)
    return seqs


def main(argv=None) -> int:
    from gspo_megatron.cli_util import quiet_known_warnings, atomic_write_text, user_errors

    quiet_known_warnings()

    args = parse_args(argv)
    with user_errors("gspo_megatron.score"):
        from gspo_megatron.config import ParallelConfig
        from gspo_megatron.model.factory import build_policy, parse_dtype
        from gspo_megatron.model.hf_io import HFCheckpointReader
        from gspo_megatron.model.arch import MoeArch
        from gspo_megatron.parallel.state import destroy_parallel, init_parallel

        sp = args.tp > 1 if args.sequence_parallel is None else args.sequence_parallel
        parallel = ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, cp=args.cp,
                                  sequence_parallel=sp, device=args.device)
        dtype = parse_dtype(args.dtype)
        # Everything that can be checked without process groups is checked first, on every rank.
        if args.load:
            from gspo_megatron.checkpoint.mcore import read_mcore_arch

            from gspo_megatron.checkpoint.megatron_dirs import resolve as resolve_dir
            from gspo_megatron.resolve import refuse_adapter_only

            # verifies the checkpoint's files but the tensor data against its checksums.json first
            arch = read_mcore_arch(args.load, require_checksums=args.require_checksums)
            refuse_adapter_only(resolve_dir(args.load), "--load")
            reader = None
        else:
            arch = MoeArch.from_hf_dir(args.hf_dir)
            reader = HFCheckpointReader(args.hf_dir)
            reader.validate(arch)
        parallel.validate(int(os.environ.get("WORLD_SIZE", "1")), training=False, **arch.dims_for_validation())
        seqs = read_input(args.input, arch.vocab_size)
        from gspo_megatron.train.scoring import score_sequences  # Megatron: only after the input checks

        ctx = init_parallel(parallel, model_dims=None)
        try:
            chunks, _ = build_policy(ctx, arch, reader=reader, dtype=dtype)
            if args.load:
                from gspo_megatron.checkpoint.mcore import load_mcore_into_model

                load_mcore_into_model(chunks, args.load, require_checksums=args.require_checksums)
            out = score_sequences(chunks, ctx, seqs, vocab_size=arch.vocab_size,
                                  micro_batch_tokens=args.micro_batch_tokens, temperature=args.temperature,
                                  packed=args.packing)
            if ctx.rank == 0:
                atomic_write_text(args.output, "".join(json.dumps({"token_logprobs": lp}) + "\n" for lp in out))
        finally:
            destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
