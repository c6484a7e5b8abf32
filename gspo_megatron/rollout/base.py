"""The rollout-engine contract shared by every engine (in-process transformers, SGLang over HTTP).

Engines never import Megatron: they see token ids, sampling settings and HF-named weight tensors.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Iterable

import torch

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: disabled (SGLang's convention)
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()


@dataclass
class Sample:
    """One generated response.

    response_logprobs[t] is the engine's log π(response_ids[t] | prompt, response[:t]) under the
    engine's sampling temperature, len == len(response_ids).
    """

    prompt_index: int  # index into the prompts list passed to generate()
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str  # one of FINISH_REASONS
    weight_version: int
    text: str | None = None
    meta: dict = field(default_factory=dict)
    # The experts the engine routed each token to, when asked (return_routing): int [P + R - 1,
    # num_layers, top_k] for sequence positions 0 .. P + R - 2 (every token the engine fed through
    # the model: the prompt and every response token but the last), in SGLang 0.5.23's
    # return_routed_experts layout; None otherwise.
    routed_experts: torch.Tensor | None = None
    # The weight version that produced each response token, when it is not weight_version for all
    # of them: a partial rollout carried over a weight push (rollout/partial.py). weight_version
    # is then the oldest of them.
    token_versions: list[int] | None = None
    # Which response tokens the policy sampled (trained on) and which an agent appended as
    # environment tokens (tool output: in the context, never in the loss, the KL, the entropy or
    # GSPO's |y|; their response_logprobs entries are 0.0). None: every token is the policy's.
    # Multi-turn rollouts (rollout/agent.py) set it.
    loss_mask: list[bool] | None = None

    def versions(self) -> list[int]:
        """The weight version of every response token."""
        if self.token_versions is not None:
            return list(self.token_versions)
        return [int(self.weight_version)] * len(self.response_ids)


NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightVerificationError(RuntimeError):
    """A verified refit found that an engine does not serve the weights the trainer pushed."""


def check_generate_args(prompts: list[list[int]], n: int, sampling: SamplingParams) -> None:
    """Argument checks every engine's generate() applies before doing any work."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if sampling.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")


def stop_string_end(tokenizer, toks: list[int], stops: tuple[str, ...]) -> int | None:
    """Length of the shortest prefix of `toks` whose decoded text contains one of `stops`."""
    if not stops or not any(s in tokenizer.decode(toks, skip_special_tokens=False) for s in stops):
        return None
    for t in range(1, len(toks) + 1):
        if any(s in tokenizer.decode(toks[:t], skip_special_tokens=False) for s in stops):
            return t
    return None


def cut_at_stop_string(sample: Sample, tokenizer, stops: tuple[str, ...]) -> Sample:
    """`sample` ending at its first stop string (included), finish_reason "stop", for engines that
    cannot match stop strings themselves (vLLM's token-in/token-out route does not detokenize).
    The kept tokens' log-probs are unchanged: tokens after a prefix do not condition it."""
    end = stop_string_end(tokenizer, sample.response_ids, stops)
    if end is None or (end == len(sample.response_ids) and sample.finish_reason == "stop"):
        return sample
    from dataclasses import replace

    tv = sample.token_versions[:end] if sample.token_versions is not None else None
    versions = tv if tv is not None else [sample.weight_version]
    return replace(sample, response_ids=sample.response_ids[:end], response_logprobs=sample.response_logprobs[:end],
                   finish_reason="stop", token_versions=tv, weight_version=min(versions, default=sample.weight_version),
                   meta=dict(sample.meta, matched_stop="stop_string"))


@dataclass(frozen=True)
class Capabilities:
    """What an engine can do, declared by its class (RolloutEngine.capabilities); the loop and the
    checks ask these, never an engine's name.

    interrupt: abort generation in flight and keep the partial output (partial rollouts);
    push_mid_generation: take weights while generating, re-prefilling with them;
    sleep_wake: release and re-take accelerator memory (colocation);
    weight_digests: report a digest of every tensor a push delivered (verified refits);
    routing_return: return the experts each token was routed to (routing replay R3);
    supervised_restarts: a server that goes away is brought back (restarted, or waited for) with
        the last weights, and servers may join mid-run (rollout/supervision.py, membership.py);
    lora_targets: the trainer's LoRA groups (config.py LORA_TARGETS) whose adapters the engine takes
        on their own (update_weights' `adapter`: rollout/lora_push.py), the base weights of those
        modules staying as pushed; the others' adapters are pushed merged into their weights;
    weight_groups_reform: a weight-update group (NCCL broadcast) re-forms with a restarted server
        on both sides (none does yet: the config refuses restarts with those syncs)."""

    interrupt: bool = False
    push_mid_generation: bool = False
    sleep_wake: bool = False
    weight_digests: bool = False
    routing_return: bool = False
    supervised_restarts: bool = False
    lora_targets: tuple[str, ...] = ()
    weight_groups_reform: bool = False


class RolloutEngine(abc.ABC):
    """Generates samples and receives policy weights (HF names, full unsharded tensors)."""

    # The tokenizer the engine decodes with (stop strings), when it has one.
    tokenizer = None

    @property
    def capabilities(self) -> Capabilities:
        """What this engine can do (the supports_* flags below and what engines add)."""
        return Capabilities(interrupt=self.supports_interrupt, push_mid_generation=self.supports_push_mid_generation,
                            weight_digests=self.supports_weight_digests)

    @property
    def metrics(self) -> dict:
        """Counters an engine keeps (retries, weight_syncs, restarts, verified_tensors, ...): what
        the loop reports from them; empty for an engine that keeps none."""
        return self.__dict__.setdefault("_engine_metrics", {})

    @metrics.setter
    def metrics(self, value: dict) -> None:
        self.__dict__["_engine_metrics"] = value

    @abc.abstractmethod
    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, *, seed: int | None = None
    ) -> list[Sample]:
        """n samples per prompt, returned grouped: prompt 0's n samples, then prompt 1's, ...

        `seed` makes sampling reproducible where the engine can (the in-process engine does; the
        trainer passes a per-step seed so that a resumed run draws the same samples)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Replace the policy weights with the streamed HF-named tensors, tagged `version`.

        `named_tensors` may be a one-shot iterator (streamed from a sharded model): consume once.
        """

    @property
    @abc.abstractmethod
    def weight_version(self) -> int: ...

    # The servers behind the engine, for the pre-flight smoke check (train/smoke.py). An
    # in-process engine has none: both answer empty.
    def server_software_checks(self) -> list[tuple[str, bool | None, str]]:
        """(url, ok, detail) of every server's engine version against the one the project speaks
        (ok None: reported, not failed, as when rollout.*.check_version is off)."""
        return []

    def server_weight_versions(self) -> dict[str, str | None]:
        """The weight version every server reports serving (None where it fails to answer)."""
        return {}

    # Interrupting generation (partial rollouts, rollout/partial.py). An engine that supports it
    # sets supports_interrupt and implements both methods; they are called from another thread
    # than the one in generate().
    supports_interrupt = False

    def interrupt(self) -> None:
        """Make the generate() in progress return soon, and any generate() called before resume()
        return at once: finished rows as usual, every other row as a partial sample with
        finish_reason "abort" holding the tokens (and log-probs) generated so far, possibly none.
        Idempotent."""
        raise NotImplementedError(f"{type(self).__name__} cannot interrupt generation")

    def resume(self) -> None:
        """End interrupt(): generate() runs normally again."""
        raise NotImplementedError(f"{type(self).__name__} cannot interrupt generation")

    # Pushing weights while generate() runs in another thread, without waiting for it. An engine
    # that sets supports_push_mid_generation implements update_weights_mid_generation: its
    # servers set the requests in flight aside, take the new weights, recompute those requests'
    # prefixes with them and continue, and report which weight version generated each token
    # (Sample.token_versions; weight_version is the oldest): SGLang's retract pause, vLLM 0.32's
    # keep pause with its cache reset (rollout/vllm_engine.py update_weights_mid_generation).
    supports_push_mid_generation = False

    def update_weights_mid_generation(self, named_tensors: NamedTensors, version: int) -> None:
        """update_weights while a generate() may be in progress in another thread."""
        raise NotImplementedError(f"{type(self).__name__} cannot take weights mid-generation")

    # Verified refits (train/refit_check.py). Every engine answers a log-prob probe: what the model
    # it serves assigns to a fixed sequence, compared with the trainer's. An engine whose servers
    # can also report a digest of every tensor a push delivered sets supports_weight_digests; the
    # trainer then sets digest_next_push before a push it wants checked, and the push itself fails
    # with WeightVerificationError naming the tensor and the server.
    supports_weight_digests = False
    digest_next_push = False

    def probe_logprobs(self, token_ids: list[int]) -> dict[str, list[float]]:
        """For each place that serves the policy (a server's URL; "in-process"), the log-probs at
        temperature 1 of token_ids[1:], each given the tokens before it."""
        raise NotImplementedError(f"{type(self).__name__} cannot score a probe sequence")

    def close(self) -> None:  # engines holding servers/processes release them here
        pass

    def __enter__(self) -> "RolloutEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

