"""GSPO post-training of Qwen3-MoE on Megatron-Core.

    torchrun --nproc-per-node N -m gspo_megatron.train --config FILE.yaml [dotted.key=value ...]
    python -m gspo_megatron.train --config FILE.yaml --dry-run [--json] [--world-size N]
    torchrun ... -m gspo_megatron.train --config FILE.yaml --smoke [--smoke-tol X] [overrides]

Without torchrun it runs as one process. Bad configuration, data or reward modules fail with one
line on stderr and exit status 2 before any heavy work.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:
        from gspo_megatron.planner import main as planner_main

        return planner_main(argv)
    if "--simulate" in argv:  # a GPU preset's ranks built on the meta device (train/simulate.py)
        from gspo_megatron.train.simulate import main as simulate_main

        return simulate_main(argv)
    from gspo_megatron.config_reference import render_help

    p = argparse.ArgumentParser(prog="gspo_megatron.train", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--dry-run [--json] [--world-size N | --nnodes A --nproc-per-node B]: "
                                       "validate the config and inputs and print the layout, no training\n\n"
                                       + render_help())
    p.add_argument("--config", required=True, help="YAML config (see launch/configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=5 out_dir=runs/x")
    p.add_argument("--smoke", action="store_true",
                   help="pre-flight check instead of training: contact the engine, push weights once, generate "
                        "once, compare engine and trainer log-probs; PASS/FAIL table, exit 0/1 (train/smoke.py)")
    p.add_argument("--smoke-tol", type=float, default=None,
                   help="--smoke: largest mean |engine - trainer| token log-prob difference that passes (0.05)")
    args = p.parse_intermixed_args(argv)

    from gspo_megatron.cli_util import USER_ERRORS, quiet_known_warnings, user_errors

    quiet_known_warnings()

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its per-parameter INFO lists drown ours
    with user_errors("gspo_megatron.train"):
        from gspo_megatron.resolve import load_config

        cfg = load_config(args.config, args.overrides)  # a bad key: one line before Megatron is imported
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if args.smoke_tol is not None and not args.smoke:
            p.error("--smoke-tol needs --smoke")
        # inputs (data, tokenizer, reward, checkpoints named) and the device, also before Megatron
        from gspo_megatron.parallel.state import resolve_device
        from gspo_megatron.train.setup import check_inputs

        inputs = check_inputs(cfg, world_size=world)
        if resolve_device(cfg.parallel.device).type == "cpu":  # before Megatron is imported (its docstring)
            from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions

            skip_compiled_fusions()
        if args.smoke:  # writes nothing to out_dir: no run lock, no config.yaml
            from gspo_megatron.train.smoke import DEFAULT_TOL, run_smoke

            return run_smoke(cfg, world_size=world, tol=DEFAULT_TOL if args.smoke_tol is None else args.smoke_tol,
                             inputs=inputs)
        # The preemption handlers before the lock: a SIGTERM from here on ends the run through its
        # checkpoint-and-exit path (train/loop.py), and this `finally` releases the lock.
        from gspo_megatron.train.preemption import StopFlag

        stop = StopFlag(cfg.checkpoint.save_on_signals)
        lock = None
        if rank == 0:  # one run per out_dir, taken before anything is written there
            from gspo_megatron.train.runlock import RunLock

            lock = RunLock(cfg.out_dir).acquire()
        try:
            if rank == 0:
                cfg.dump_yaml(os.path.join(cfg.out_dir, "config.yaml"))
            from gspo_megatron.rollout.base import WeightVerificationError
            from gspo_megatron.rollout.http_servers import EngineError
            from gspo_megatron.train.loop import NonFiniteError, train

            try:
                train(cfg, world_size=world, inputs=inputs, stop=stop)
            except (NonFiniteError, WeightVerificationError) as e:  # every rank decides it together; one line, exit 1
                if rank == 0:
                    print(f"gspo_megatron.train: error: {e}", file=sys.stderr, flush=True)
                return 1
            except EngineError as e:
                if isinstance(e, USER_ERRORS):  # e.g. servers not ready at start: bad urls, exit 2 below
                    raise
                # a rollout server that stopped answering (after the engine's retries) or broke its
                # protocol: one line, exit 1; torchrun then stops the other ranks. The last
                # checkpoint stays; checkpoint.resume=auto continues from it.
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"gspo_megatron.train: error: rollout engine: {first}", file=sys.stderr, flush=True)
                return 1
        finally:
            if lock is not None:
                lock.release()
            stop.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
