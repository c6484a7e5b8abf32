"""Reward functions the trainer tests load through `reward.fn=tests.reward_fns:NAME`."""


def response_length(response: str, example: dict) -> float:
    """Non-constant on random text, so a random-init policy still gets non-zero advantages."""
    return min(len(response), 32) / 32.0


def sleepy(response: str, example: dict) -> float:
    """Sleeps example["sleep"] seconds (a slow or hung verifier), records its worker's pid in
    example["dir"] when given, and returns 1.0."""
    import os
    import time

    if example.get("dir"):
        with open(os.path.join(example["dir"], f"{os.getpid()}.{time.monotonic_ns()}"), "w"):
            pass
    time.sleep(float(example.get("sleep", 0)))
    return 1.0


def always_raises(response: str, example: dict) -> float:
    raise KeyError("solution")
