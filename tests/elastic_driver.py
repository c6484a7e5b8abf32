"""The rollout driver of tests/test_elastic_servers.py's training run: the built-in single-turn
rollout that also changes the fleet (ELASTIC_FILE, the run's rollout.sglang.urls_file): after step
ELASTIC_ADD_AFTER's rollout it lists ELASTIC_A and ELASTIC_B, after step ELASTIC_REMOVE_AFTER's
only ELASTIC_B. The change is written within a step, so the next step's rollout sees it (the
engine reads the file at the start of every generate), by construction. Logged per step: the
samples served by B, the oldest weight version among them, and the trainer's version."""
from __future__ import annotations

import os

from gspo_megatron.rollout.drivers import RolloutBatch, RolloutContext, single_turn


def _write(path: str, urls: list[str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{u}\n" for u in urls))
    os.replace(tmp, path)  # a reader never sees half a list


def fleet(ctx: RolloutContext, step: int) -> RolloutBatch:
    a, b, path = os.environ["ELASTIC_A"], os.environ["ELASTIC_B"], os.environ["ELASTIC_FILE"]
    version = ctx.engine.weight_version
    batch = single_turn(ctx, step)
    on_b = [s for s in batch.samples if s.meta.get("server") == b]
    # the servers this rollout could use (joins land at the start of generate; this step's own
    # change to the file comes below); the row's engine_servers is read later, at the step's end
    stats = dict(batch.stats, served_by_b=len(on_b), b_version_min=min((s.weight_version for s in on_b), default=-1),
                 trainer_version=version, samples_n=len(batch.samples), servers_used=ctx.engine.metrics["servers"])
    row = step + 1  # the metrics row of this step
    if row == int(os.environ["ELASTIC_ADD_AFTER"]):
        _write(path, [a, b])
    if row == int(os.environ["ELASTIC_REMOVE_AFTER"]):
        _write(path, [b])
    return RolloutBatch(batch.samples, batch.rewards, stats)
