"""A hook for the non-finite-step tests (tests/test_reliability.py), loaded by
`reward.fn=tests.nonfinite_fns:poisoned`: a reward (response length) that, on its first call,
wraps the loop's group advantages so that the GSPO steps listed in $NAN_ADVANTAGE_STEPS (1-based,
comma-separated) get NaN advantages. The loss and the gradients of those steps are then NaN: what
any bug upstream of the loss (a reward, a kernel, the data) looks like to the optimizer. Reward
calls run in rank 0's process (reward.workers=0), where the loop computes the advantages."""
import os
import threading

_lock = threading.Lock()
_calls = [0]
_installed = [False]


def _install() -> None:
    import torch

    from gspo_megatron.train import loop

    steps = {int(x) for x in os.environ.get("NAN_ADVANTAGE_STEPS", "").split(",") if x}
    real = loop.group_advantages

    def group_advantages(rewards, group_size):
        _calls[0] += 1
        adv = real(rewards, group_size)
        return torch.full_like(adv, float("nan")) if _calls[0] in steps else adv

    loop.group_advantages = group_advantages


def poisoned(response: str, example: dict) -> float:
    with _lock:
        if not _installed[0]:
            _install()
            _installed[0] = True
    return min(len(response), 32) / 32.0
