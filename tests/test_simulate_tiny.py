"""--simulate against the real run (issue 56): on the tiny CPU config, for every parallel layout the
config sweep covers (tests/test_config_sweep.py FACTORS["layout"]), in bf16 with fp32 master weights
and the distributed optimizer (the clusters' setup), each rank's simulated weight, gradient and
optimizer bytes equal what a real 2-rank run holds after its first GSPO step, and the background
save's host snapshot (its chunks' bytes and its one allocation) what the run's first save allocated.

The real side is measured differently from the simulation: the distinct storages (by data pointer)
behind every parameter, every `main_grad`, and every master weight and Adam moment the inner
optimizers hold, each storage counted once; the simulation reads the sizes of Megatron's buffers
and shards as built on the meta device. (Adam's 0-dim step counters, 4 bytes each, are left out on
both sides.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dist_utils import run_distributed
from test_config_sweep import FACTORS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "launch", "configs", "tiny_cpu.yaml")
BASE = ["model.dtype=bfloat16", "checkpoint.async_save=true", "train.sft_warmup_steps=0", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "train.minibatches_per_step=1", "eval.interval=0",
        "logging.progress_bar=false", "logging.plot=false"]
LAYOUTS = dict(FACTORS["layout"])


def _held(parts) -> dict:
    from gspo_megatron.train.optim import inner_optimizers

    def storages(tensors) -> dict[int, int]:
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}

    weights = storages(p for c in parts.model for p in c.parameters())
    grads = storages(p.main_grad for c in parts.model for p in c.parameters() if getattr(p, "main_grad", None) is not None)
    opt: list = []
    for inner in inner_optimizers(parts.optimizer):
        for group in inner.optimizer.param_groups:
            opt += group["params"]  # the fp32 masters (16-bit model parameters)
        for state in inner.optimizer.state.values():
            opt += [v for k, v in state.items() if k in ("exp_avg", "exp_avg_sq")]
    optimizer = {k: v for k, v in storages(opt).items() if k not in weights and k not in grads}
    return {"weights": sum(weights.values()), "gradients": sum(grads.values()), "optimizer": sum(optimizer.values())}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _real_step(rank, world, out_dir, overrides):
    import torch

    from gspo_megatron.resolve import load_config
    from gspo_megatron.train import loop
    from gspo_megatron.train.batch import TrainSample
    from gspo_megatron.train.setup import setup_run

    cfg = load_config(TINY, [f"out_dir={out_dir}", *BASE, *overrides])
    parts = setup_run(cfg, world_size=world)
    try:
        g = torch.Generator().manual_seed(5)
        samples = [TrainSample(torch.randint(3, 60, (6,), generator=g).tolist(),
                               torch.randint(3, 60, (5,), generator=g).tolist(), float(a))
                   for a in (1.0, -1.0, 0.5, -0.5)]
        loop.gspo_step(parts, samples)
        held = _held(parts)
        parts.save_checkpoint(1, {})  # a background save: its host snapshot stays allocated for the run
        parts.wait_for_saves()
        host = parts.saves.host
        held["checkpoint_snapshot"] = sum(_numel(shape) * dtype.itemsize for shape, dtype in host.layout)
        held["checkpoint_allocation"] = host.flat.numel() * host.flat.element_size()
        return held
    finally:
        parts.close()


_SIM = """
import json, sys
from gspo_megatron.resolve import load_config
from gspo_megatron.parallel.cpu_runtime import skip_compiled_fusions
from gspo_megatron.train import simulate
skip_compiled_fusions()
for overrides in json.loads(sys.argv[1]):
    cfg = load_config(sys.argv[2], [*overrides, "parallel.device=cpu"])
    print(json.dumps([dict(r.gpu, **r.host) for r in simulate.simulate(cfg, 2, [0, 1])]), flush=True)
"""


@pytest.fixture(scope="module")
def simulated() -> dict:
    """Every layout simulated in one process."""
    runs = [[*BASE, *LAYOUTS[name]] for name in LAYOUTS]
    p = subprocess.run([sys.executable, "-c", _SIM, json.dumps(runs), TINY], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("[")]
    assert len(rows) == len(LAYOUTS), p.stdout
    return dict(zip(LAYOUTS, rows))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_simulated_bytes_equal_what_the_real_run_holds(simulated, layout, tmp_path):
    real = run_distributed(_real_step, 2, str(tmp_path / "run"), LAYOUTS[layout])
    for rank, (held, sim) in enumerate(zip(real, simulated[layout])):
        assert held["weights"] > 0 and held["gradients"] > 0 and held["optimizer"] > 0, held
        for what in ("weights", "gradients", "optimizer", "checkpoint_snapshot"):
            assert sim[what] == held[what], (layout, rank, what, sim[what], held[what])
        # the one host allocation the background save made (its chunks at 64-byte offsets) is what
        # the simulation says it page-locks on a GPU machine
        assert sim["checkpoint_pinned"] == held["checkpoint_allocation"], (layout, rank, sim, held)
