"""Reward functions the trainer tests load through `reward.fn=tests.reward_fns:NAME`."""


def response_length(response: str, example: dict) -> float:
    """Non-constant on random text, so a random-init policy still gets non-zero advantages."""
    return min(len(response), 32) / 32.0


def text_hash(response: str, example: dict) -> float:
    """A pseudo-random reward in [0, 1) fixed by the response text: two different responses of a
    group get different rewards (almost surely), so every group has a non-zero advantage, whatever
    the lengths (response_length is equal across a group whenever every sample runs to its budget)."""
    import hashlib

    return int(hashlib.sha256(response.encode("utf-8")).hexdigest()[:8], 16) / 2 ** 32


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


def rendezvous(response: str, example: dict) -> float:
    """Records its worker's pid in example["dir"], then returns 1.0 once example["peers"]
    distinct processes have recorded theirs (a call in each of that many workers running at
    once); raises after example["within"] seconds without them."""
    import os
    import time

    d = example["dir"]
    with open(os.path.join(d, f"{os.getpid()}.{time.monotonic_ns()}"), "w"):
        pass
    end = time.monotonic() + float(example["within"])
    while len({f.split(".")[0] for f in os.listdir(d)}) < int(example["peers"]):
        if time.monotonic() > end:
            raise TimeoutError(f"fewer than {example['peers']} reward processes within {example['within']} s")
        time.sleep(0.01)
    return 1.0


def always_raises(response: str, example: dict) -> float:
    raise KeyError("solution")


def scripted(response: str, example: dict) -> float:
    """A hostile reward for end-to-end runs: call k of the whole run (counted in the file named by
    $SCRIPTED_REWARD_COUNTER, so the count survives a worker process that died) does what entry
    k % len of the comma-separated $SCRIPTED_REWARD says: ok (response_length), exit
    (SystemExit(0)), kbd (KeyboardInterrupt), genexit (GeneratorExit), huge (1e39: finite in
    float64, inf in float32), nan, os_exit (the process ends at once with status 0)."""
    import os

    script = os.environ["SCRIPTED_REWARD"].split(",")
    path = os.environ["SCRIPTED_REWARD_COUNTER"]
    k = int(open(path).read() or 0) if os.path.exists(path) else 0
    with open(path, "w") as f:
        f.write(str(k + 1))
    what = script[k % len(script)]
    if what == "ok":
        return response_length(response, example)
    if what == "exit":
        raise SystemExit(0)
    if what == "kbd":
        raise KeyboardInterrupt
    if what == "genexit":
        raise GeneratorExit
    if what == "huge":
        return 1e39
    if what == "nan":
        return float("nan")
    if what == "os_exit":
        os._exit(0)
    raise AssertionError(f"unknown SCRIPTED_REWARD entry {what!r}")


def raises_base(response: str, example: dict) -> float:
    """Raises the BaseException named by example["raise"] (SystemExit(0) and the like), else 1.0."""
    kind = example.get("raise")
    if kind == "SystemExit":
        raise SystemExit(0)
    if kind == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if kind == "GeneratorExit":
        raise GeneratorExit
    if kind == "os_exit":
        import os

        os._exit(0)
    if kind in ("close_then_exit", "close_then_hang"):  # the pipe to the trainer breaks; the process
        import os                                        # ends 0.5 s later, or not for 10 minutes
        import time

        os.closerange(3, 65536)
        time.sleep(0.5 if kind == "close_then_exit" else 600)
        os._exit(0)
    if "value" in example:
        return example["value"]
    return 1.0
