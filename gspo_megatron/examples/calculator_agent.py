"""A calculator-tool agent for the synthetic two-digit addition task (data.task=add2).

    rollout.agent: gspo_megatron.examples.calculator_agent:calculator_agent

One session, two policy turns around one tool call:

    prompt     <|im_start|>user\\n47+85=<|im_end|>\\n<|im_start|>assistant\\n
    policy     [47+85]            a tool call: an expression in brackets (the turn stops at "]")
    tool       =132\\n             environment tokens: in the context, never trained on
    policy     132<|im_end|>      the answer

The tiny demo model cannot add two-digit numbers by itself (5% after 400 supervised steps,
rollout/tasks.py); with the tool it has to learn to copy the question into the call and the
tool's answer into its reply. If the policy answers without calling the tool (its first turn ends
with eos), that answer is scored. The reward (the agent returns it; reward.fn is not used): 1.0
for the exact sum, else partial credit for the half done right (see calculator_agent).

`calculator_agent.demonstration` is the warm start's worked example (train.sft_warmup_steps uses
an agent's `demonstration` when it has one): segments of text, each trained on or not.
"""
from __future__ import annotations

import re

from gspo_megatron.rollout.tasks import IM_END

CALL_OPEN, CALL_CLOSE = "[", "]"
_EXPR = re.compile(r"^\s*(\d{1,4})\s*([+\-*])\s*(\d{1,4})\s*$")


def calculator(expression: str) -> str:
    """The tool: "47+85" -> "132"; anything else -> "error"."""
    m = _EXPR.match(expression)
    if m is None:
        return "error"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str({"+": a + b, "-": a - b, "*": a * b}[op])


def tool_reply(result: str) -> str:
    return f"={result}\n"


def calculator_agent(example: dict, session) -> float:
    """Reward 1.0 for the exact answer; otherwise credit for each half done right: 0.3 for a tool
    call with the question's expression, 0.3 for an answer that repeats the tool's result."""
    tok = session.tokenizer
    first = session.generate(max_new_tokens=12, stop=[CALL_CLOSE])
    text = tok.decode(first, skip_special_tokens=False)
    if not (CALL_CLOSE in text and CALL_OPEN in text):  # answered directly (or rambled)
        return 1.0 if text.split(IM_END, 1)[0].strip() == str(example["answer"]) else 0.0
    expr = text[text.index(CALL_OPEN) + 1: text.rindex(CALL_CLOSE)]
    result = calculator(expr)
    session.append(tool_reply(result))
    final = tok.decode(session.generate(max_new_tokens=6), skip_special_tokens=False).split(IM_END, 1)[0].strip()
    if final == str(example["answer"]):
        return 1.0
    return 0.3 * (expr == str(example["prompt"]).rstrip("=")) + 0.3 * (final == result)


def demonstration(example: dict) -> list[tuple[str, bool]]:
    """The worked trajectory as (text, trained on) segments; the trainer appends eos to the last."""
    expr = str(example["prompt"]).rstrip("=")
    return [(f"{CALL_OPEN}{expr}{CALL_CLOSE}", True), (tool_reply(calculator(expr)), False),
            (str(example["answer"]), True)]


calculator_agent.demonstration = demonstration
