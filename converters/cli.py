"""gspo-convert: convert Qwen3-MoE checkpoints between Hugging Face and Megatron-Core torch_dist.

    gspo-convert hf-to-mcore --hf-dir H --out C
    gspo-convert mcore-to-hf --load C --out H2 [--hf-config-dir H]
    gspo-convert lora-to-peft --load L --out A [--base B]    a LoRA run's adapters in PEFT's format
    gspo-convert lora-merge --load L --out H3 [--base B]     its base with the adapters merged, as HF

Both directions stream tensor by tensor (memory: about the largest tensor, plus one output shard
for mcore-to-hf) and run on one CPU process or under torchrun (ranks split the work). The LoRA
exports (gspo_megatron/checkpoint/lora_export.py) build the model once, in one process. Output is
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

    def common(sp, shard_help: str | None, shard_default: str = "5GB"):
        sp.add_argument("--out", required=True, metavar="DIR",
                        help="output checkpoint directory; must not exist unless --overwrite "
                             "(written to a temporary directory beside it, renamed at the end)")
        sp.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="dtype of the written tensors; 'auto' keeps each tensor's stored dtype "
                             "(default: %(default)s)")
        if shard_help is not None:
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

    def lora_common(sp):
        sp.add_argument("--load", required=True, metavar="DIR",
                        help="a LoRA run's adapter-only checkpoint: <out_dir>/checkpoints/iter_*, or "
                             "<out_dir>/checkpoints (the iteration its tracker names)")
        sp.add_argument("--base", metavar="DIR",
                        help="the base model the adapters were trained on: a Hugging Face directory or an mcore "
                             "checkpoint (gspo-convert hf-to-mcore, a trainer checkpoint); default: the one the "
                             "checkpoint records (the run's model.load / model.hf_dir). Its architecture must be "
                             "the checkpoint's")
        sp.add_argument("--require-checksums", action="store_true",
                        help="refuse a checkpoint without checksums.json (default: load it with a warning naming "
                             "it); its files are verified before they are parsed either way")

    l2p = sub.add_parser(
        "lora-to-peft", help="LoRA adapter checkpoint -> PEFT adapter",
        description="Write the adapters of a LoRA run's checkpoint (lora.rank > 0: the checkpoint holds only "
                    "the adapters) as a PEFT LoRA adapter: adapter_model.safetensors (Hugging Face module names, "
                    "one adapter per routed expert) and adapter_config.json, whose base_model_name_or_path is the "
                    "base's path. peft.PeftModel.from_pretrained(<the base in transformers>, DIR) loads it (peft "
                    "0.21 on transformers 5 leaves out the dense and shared-expert MLP adapters of GLM-4.5 / "
                    "DeepSeek-V3, huggingface/peft#3711: lora-merge has them). The base's weights are not read (its "
                    "config is checked against the checkpoint's).",
    )
    lora_common(l2p)
    common(l2p, None)

    merge = sub.add_parser(
        "lora-merge", help="LoRA adapter checkpoint + base -> merged Hugging Face safetensors",
        description="Merge the adapters of a LoRA run's checkpoint into its base (W + (alpha / r) B A) and "
                    "write the result as a Hugging Face checkpoint that plain "
                    "transformers.AutoModelForCausalLM.from_pretrained loads, with the checkpoint's config.json "
                    "and tokenizer files. Builds the whole model in one process. A random-init base is refused "
                    "(Megatron's random init depends on the layout): the run's own <out_dir>/hf export is the "
                    "merged model.",
    )
    lora_common(merge)
    common(merge, "largest safetensors shard;", "5GB")
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

        max_size = _size(args.max_shard_size) if hasattr(args, "max_shard_size") else None
        lora_export = args.command in ("lora-to-peft", "lora-merge")
        if args.command == "hf-to-mcore":
            inputs = [args.hf_dir]
        elif lora_export:
            inputs = [args.load, args.base]
        else:
            inputs = [args.load, args.hf_config_dir]
        check_out(args.out, [d for d in inputs if d], args.overwrite, args.command)
        started = False if lora_export else _init_dist()  # the LoRA exports: a world-1 group of their own
        try:
            with output_of(args.command):  # what the output's marker names
                if lora_export:
                    from gspo_megatron.checkpoint import lora_export as lx

                    kw = dict(base=args.base, dtype=_dtype(args.dtype), overwrite=args.overwrite,
                              require_checksums=args.require_checksums)
                    if args.command == "lora-to-peft":
                        stats = lx.lora_to_peft(args.load, args.out, **kw)
                    else:
                        stats = lx.lora_merge(args.load, args.out, max_shard_size=max_size, progress=args.progress,
                                              **kw)
                elif args.command == "hf-to-mcore":
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
