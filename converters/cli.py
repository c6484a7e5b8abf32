"""gspo-convert: convert Qwen3-MoE checkpoints between Hugging Face and Megatron-Core torch_dist.

    gspo-convert hf-to-mcore --hf-dir H --out C
    gspo-convert mcore-to-hf --load C --out H2 [--hf-config-dir H]

Both directions stream tensor by tensor (memory: about the largest tensor, plus one output shard
for mcore-to-hf) and run on one CPU process or under torchrun (ranks split the work). Output is
assembled in a hidden temporary directory beside --out and renamed into place at the end, with a
marker (.gspo-output.json: the command and every entry it wrote); --overwrite replaces only such an
earlier output of the same command, holding nothing else.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

PROG = "gspo-convert"
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog="Run `gspo-convert <command> --help` for a command's options. Under torchrun "
               "(e.g. torchrun --nproc-per-node 4 -m converters.cli ...) the ranks split the tensors.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="command")

    def common(sp, shard_help: str, shard_default: str):
        sp.add_argument("--out", required=True, metavar="DIR",
                        help="output checkpoint directory; must not exist unless --overwrite "
                             "(written to a temporary directory beside it, renamed at the end)")
        sp.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype of the written tensors; 'auto' keeps each tensor's stored dtype "
                             "(default: %(default)s)")
        sp.add_argument("--max-shard-size", default=shard_default, metavar="SIZE",
                        help=shard_help + " e.g. 5GB, 500MB, 2GiB or a byte count (default: %(default)s)")
        sp.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out that this command wrote earlier (proven by its "
                             ".gspo-output.json; any other directory is refused); the old one is swapped out "
                             "only once the new one is complete")
        sp.add_argument("--no-progress", dest="progress", action="store_false",
                        help="do not show the progress bar (shown on stderr by default)")

    h2m = sub.add_parser(
        "hf-to-mcore", help="Hugging Face safetensors -> Megatron torch_dist",
        description="Convert a Hugging Face Qwen3-MoE checkpoint (safetensors shards + index, or one "
                    "model.safetensors) into a Megatron-Core torch_dist checkpoint that loads at any "
                    "TP/PP/EP/ETP layout (gspo_megatron.score --load, the trainer's model.load), as a "
                    "Megatron-LM checkpoint root holding iteration 0: <out>/iter_0000000/, "
                    "<out>/latest_checkpointed_iteration.txt and Megatron-Bridge's latest_train_state.pt, "
                    "which Megatron-LM and Megatron-Bridge 0.3.1 (AutoBridge.load_megatron_model included) "
                    "load too. The HF config, generation config and tokenizer files are kept in "
                    "<out>/iter_0000000/hf_config/, Megatron-Bridge's run_config.yaml beside it.",
    )
    h2m.add_argument("--hf-dir", required=True, metavar="DIR", help="Hugging Face checkpoint directory (config.json + safetensors)")
    common(h2m, "largest torch_dist data file (.distcp); a tensor larger than this gets a file of its own;", "5GB")
    h2m.add_argument("--threads", type=int, default=1, metavar="N",
                     help="writer threads per process, each filling its own data files (default: %(default)s)")

    m2h = sub.add_parser(
        "mcore-to-hf", help="Megatron torch_dist -> Hugging Face safetensors",
        description="Convert a Megatron-Core torch_dist checkpoint of Qwen3-MoE (from hf-to-mcore, or "
                    "saved by the trainer at any layout) into a Hugging Face checkpoint with Hub names "
                    "(per-expert gate_proj/up_proj/down_proj), loadable by "
                    "transformers.AutoModelForCausalLM.from_pretrained.",
    )
    m2h.add_argument("--load", required=True, metavar="DIR",
                     help="Megatron torch_dist checkpoint directory, or a Megatron-LM / Megatron-Bridge root "
                          "(latest_checkpointed_iteration.txt, else the newest iter_*)")
    m2h.add_argument("--hf-config-dir", metavar="DIR",
                     help="take config.json, generation config and tokenizer files from this HF directory "
                          "instead of the checkpoint's hf_config/ or Megatron-Bridge run_config.yaml (its "
                          "architecture must match the checkpoint)")
    m2h.add_argument("--require-checksums", action="store_true",
                     help="refuse a checkpoint without checksums.json (default: load it with a warning naming "
                          "it); its files are verified before they are parsed either way")
    common(m2h, "largest safetensors shard; memory holds about one shard while writing;", "5GB")
    return p


def _dtype(name: str):
    if name == "auto":
        return None
    from gspo_megatron.model.factory import parse_dtype

    return parse_dtype(name)


def _size(text: str) -> int:
    from gspo_megatron.errors import InputError
    from gspo_megatron.model.hf_writer import parse_size

    try:
        n = parse_size(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise InputError(f"--max-shard-size: expected a positive size such as 5GB, 500MB or 2GiB, got {text!r}")
    return n


def _within(path: str, parent: str) -> bool:
    path, parent = os.path.realpath(path), os.path.realpath(parent)
    return path == parent or path.startswith(parent.rstrip(os.sep) + os.sep)


def check_out(out: str, inputs: list[str], overwrite: bool, command: str) -> None:
    """--out may not be (or lie inside, or contain) an input, and --overwrite replaces only an
    earlier output of the same command, proven by the marker it writes into its output
    (gspo_megatron/fsutil.py): `--overwrite --out ~/data` would otherwise delete the whole
    directory once the conversion succeeds, and `--out` = `--hf-dir` the source itself. A
    replacement of --out that was interrupted is finished or undone first (rank 0)."""
    from gspo_megatron.errors import InputError
    from gspo_megatron.fsutil import check_replaceable, recover_replaced

    for src in inputs:
        if _within(out, src) or _within(src, out):
            raise InputError(f"--out {out}: is, contains or lies inside the input {src}; write somewhere else")
    if int(os.environ.get("RANK", "0")) == 0:
        recover_replaced(out)
    if overwrite and os.path.lexists(out):
        check_replaceable(os.path.abspath(out), command)


def _init_dist() -> bool:
    """Start a gloo group under torchrun (WORLD_SIZE > 1); returns whether this call started it."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    return True


def main(argv=None) -> int:
    from gspo_megatron.cli_util import quiet_known_warnings, user_errors

    quiet_known_warnings()
    args = build_parser().parse_args(argv)
    started = False
    with user_errors(PROG):
        from gspo_megatron.checkpoint import mcore
        from gspo_megatron.errors import InputError
        from gspo_megatron.fsutil import output_of

        max_size = _size(args.max_shard_size)
        inputs = [args.hf_dir] if args.command == "hf-to-mcore" else [args.load, args.hf_config_dir]
        check_out(args.out, [d for d in inputs if d], args.overwrite, args.command)
        started = _init_dist()
        try:
            with output_of(args.command):  # what the output's marker names
                if args.command == "hf-to-mcore":
                    if args.threads < 1:
                        raise InputError("--threads must be >= 1")
                    stats = mcore.hf_to_mcore(args.hf_dir, args.out, dtype=_dtype(args.dtype),
                                              max_file_size=max_size, progress=args.progress,
                                              overwrite=args.overwrite, threads=args.threads)
                else:
                    stats = mcore.mcore_to_hf(args.load, args.out, hf_config_dir=args.hf_config_dir,
                                              dtype=_dtype(args.dtype), max_shard_size=max_size,
                                              progress=args.progress, overwrite=args.overwrite,
                                              require_checksums=args.require_checksums)
        finally:
            if started:
                import torch.distributed as dist

                dist.destroy_process_group()
        if int(os.environ.get("RANK", "0")) == 0:
            gb = stats.bytes / 1e9
            print(f"{PROG}: wrote {os.path.abspath(args.out)}: {stats.tensors} tensors, {gb:.3f} GB"
                  + (" on rank 0" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "")
                  + f" in {stats.seconds:.2f} s ({gb / max(stats.seconds, 1e-9):.2f} GB/s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
