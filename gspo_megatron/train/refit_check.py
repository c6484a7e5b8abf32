"""Verified refits (rollout.verify_weights): after a weight push, check that every engine server
serves the policy the trainer pushed.

Two checks, by what the engine can do (capabilities on RolloutEngine, never the backend's name):

* **The log-prob probe**, every engine. Each server scores one fixed token sequence (its prompt
  log-probs at temperature 1: SGLang's input_token_logprobs, vLLM's prompt_logprobs, the in-process
  model's forward) and the trainer computes the same tokens' log-probs with its own model, through
  the training forward (every TP/SP/PP/EP/CP layout the run uses). A mean |difference| above
  rollout.verify_logprob_tol stops the run in one line naming the server. This checks the model
  as served -- its kernels, layouts and quantization included -- which a tensor digest cannot.
* **Tensor digests**, engines that set supports_weight_digests (vLLM with disk sync: its worker
  extension digests every tensor it reads). The push itself then fails, naming the tensor.

Which pushes: the run's first (whatever the servers held before) and then every verify_every-th
weight version, so a resumed run checks the versions an uninterrupted one does. The probe costs
one forward of PROBE_TOKENS tokens per server on both sides; the digests one float64 pass over
the pushed tensors.

The probe's tokens are drawn from a fixed seed over the model's vocabulary: random tokens route
to experts all over each MoE layer, so a corrupted expert moves some of their log-probs.
"""
from __future__ import annotations

import logging
import math
import random

from gspo_megatron.rollout.base import WeightVerificationError

log = logging.getLogger("gspo_megatron.train")

PROBE_TOKENS = 128
_SEED = 0x5EED


def probe_ids(vocab_size: int, length: int = PROBE_TOKENS) -> list[int]:
    """The probe sequence: `length` token ids in [0, vocab_size - 1), the same in every run. Not
    the last id: SGLang reports an input token id >= vocab_size - 1 as 0 (scheduler_components/
    logprob_result_processor.py:54-57), so its answer could not be checked token by token."""
    rng = random.Random(_SEED)
    return [rng.randrange(vocab_size - 1) for _ in range(length)]


class RefitCheck:
    """Rank 0 asks the engine; every rank takes part in the trainer's forward (`trainer_pass`)."""

    def __init__(self, cfg, hf_config: dict):
        r = cfg.rollout
        self.every, self.tol = r.verify_every, r.verify_logprob_tol
        self.started = False  # whether the run's first push (fresh or resumed) was checked
        vocab = int(hf_config["vocab_size"])
        length = min(PROBE_TOKENS, int(hf_config.get("max_position_embeddings") or PROBE_TOKENS))
        self.ids = probe_ids(vocab, length)
        self.checked = 0

    def due(self, version: int) -> bool:
        return not self.started or version % self.every == 0

    def before_push(self, engine, version: int) -> None:
        """Rank 0, before the push: ask a digesting engine to check this push's tensors."""
        if engine is not None and engine.supports_weight_digests:
            engine.digest_next_push = self.due(version)

    def engine_logprobs(self, engine) -> dict[str, list[float]]:
        """Rank 0, after the push: each server's log-probs of the probe."""
        got = engine.probe_logprobs(self.ids)
        for where, lps in got.items():
            if len(lps) != len(self.ids) - 1 or not all(math.isfinite(x) and x <= 1e-6 for x in lps):
                raise WeightVerificationError(f"refit check: {where} scored the probe with {len(lps)} log-probs "
                                              f"(expected {len(self.ids) - 1} finite ones <= 0)")
        return got

    def judge(self, version: int, where: str, mismatch: dict) -> None:
        """Every rank, with the world-reduced mismatch of one server's probe: raise past the tolerance."""
        self.started = True
        mean, worst = mismatch["mismatch_logprob_abs"], mismatch["mismatch_logprob_max"]
        if not (mean <= self.tol):  # NaN fails too
            raise WeightVerificationError(
                f"refit check failed for weight version {version}: {where} serves other weights than the trainer "
                f"pushed (log-prob probe of {len(self.ids)} tokens: mean |engine - trainer| {mean:.3g} > "
                f"rollout.verify_logprob_tol {self.tol:g}, max {worst:.3g})")
        self.checked += 1
