"""Agent functions the trainer tests load through `rollout.agent=tests.agent_fns:NAME`.

With AGENT_LOG set (a file path), every session appends one JSON line: the token ids the policy
generated and the environment ids appended, so a test can check the step metrics against them."""
from __future__ import annotations

import json
import os
import threading

TOOL_TEXT = "=tool\n"  # 6 environment tokens with the character tokenizer
_lock = threading.Lock()


def _log(generated: list[int], appended: list[int]) -> None:
    path = os.environ.get("AGENT_LOG")
    if path:
        with _lock, open(path, "a") as f:
            f.write(json.dumps({"generated": generated, "appended": appended}) + "\n")


def two_turn(example: dict, session):
    """Policy turn, environment tokens, policy turn; reward from reward.fn (returns None)."""
    a = session.generate(max_new_tokens=5)
    env = session.append(TOOL_TEXT)
    b = session.generate(max_new_tokens=4)
    _log(a + b, env)
    return None


def two_turn_retokenized(example: dict, session):
    """The drift this project exists to avoid: after the first turn the conversation is rebuilt
    from its text (decoded without special tokens, then encoded again, as text-based multi-turn
    loops do), so the second turn and the trainer see token ids the engine never sampled next to
    log-probs it computed for other tokens."""
    tok = session.tokenizer
    a = session.generate(max_new_tokens=5)
    text = tok.decode(session.response_ids, skip_special_tokens=True)
    ids = tok.encode(text, add_special_tokens=False)
    lps = (session.logprobs + [0.0] * len(ids))[: len(ids)]
    session.response_ids[:] = ids
    session.logprobs[:] = lps
    session.mask[:] = [True] * len(ids)
    session.token_versions[:] = session.token_versions[:1] * len(ids)
    env = session.append(TOOL_TEXT)
    b = session.generate(max_new_tokens=4)
    _log(a + b, env)
    return None

