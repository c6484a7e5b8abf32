"""The shape the loop keeps (issue 54's "house"), read from the source with `ast`:

  * the step's functions stay small enough to read top to bottom: gspo_step and _train each
    under a cyclomatic complexity of 15 (McCabe's count, nested functions included: moving a
    branch into a closure does not take it out of the function);
  * nothing under train/ asks an engine what it is with getattr/hasattr (engines declare what
    they can do: RolloutEngine.capabilities);
  * the methods the two HTTP engines share are written once (rollout/http_engine.py).

The complexity counter is checked against hand-counted functions, so a rewrite of it that stops
counting a construct fails here rather than letting a function grow unseen.
"""
from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 15


def complexity(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """McCabe's cyclomatic complexity as radon/mccabe count it for Python: 1, plus one per
    if/elif, conditional expression, loop (and its else), except clause, comprehension `for` and
    `if`, assert, `case`, and each extra operand of and/or. Nested functions and lambdas count
    toward the function that holds them."""
    n = 1
    for node in ast.walk(fn):
        if isinstance(node, (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler,
                             ast.Assert, ast.match_case)):
            n += 1
            if isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node.orelse:
                n += 1
        elif isinstance(node, ast.comprehension):
            n += 1 + len(node.ifs)
        elif isinstance(node, ast.BoolOp):
            n += len(node.values) - 1
    return n


def functions(path: str) -> dict[str, ast.FunctionDef]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{m.name}"] = m
    return out


def test_the_counter_counts_what_it_must():
    src = '''
def flat(x):
    return x

def every_construct(xs, y):
    if xs and y or not xs:          # if +1, and/or +2
        pass
    elif y:                         # elif +1
        pass
    for x in xs:                    # for +1
        pass
    else:                           # for-else +1
        pass
    while y:                        # +1
        y = y if y > 1 else 0       # ifexp +1
    try:
        pass
    except ValueError:              # +1
        pass
    except KeyError:                # +1
        pass
    assert xs                       # +1
    z = [a for a in xs if a]        # comprehension +1, its if +1
    def inner():
        if y:                       # nested: +1
            return 1
    return z
'''
    tree = ast.parse(src)
    got = {f.name: complexity(f) for f in tree.body}
    assert got == {"flat": 1, "every_construct": 1 + 3 + 1 + 2 + 1 + 1 + 2 + 1 + 2 + 1}


def test_the_loop_step_and_run_stay_under_the_limit():
    fns = functions(os.path.join(REPO, "gspo_megatron", "train", "loop.py"))
    got = {name: complexity(fns[name]) for name in ("gspo_step", "_train")}
    assert all(v < LIMIT for v in got.values()), f"complexity over {LIMIT - 1}: {got}"


def test_nothing_in_train_probes_an_engine_with_getattr():
    hits = []
    root = os.path.join(REPO, "gspo_megatron", "train")
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        path = os.path.join(root, name)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args):
                target = ast.unparse(node.args[0])
                if "engine" in target.lower():
                    hits.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, "\n".join(hits)


# the hooks an engine provides (HTTPEngine declares them; each engine writes its own)
HOOKS = {"_release", "_resync_refusal", "_resync_server", "_set_servers", "_probe_rows", "_probe_logprob"}


def test_the_http_engines_share_their_common_methods_once():
    base = functions(os.path.join(REPO, "gspo_megatron", "rollout", "http_engine.py"))
    shared = {n.split(".", 1)[1] for n in base if n.startswith("HTTPEngine.")} - HOOKS
    # the methods issue 54 found written twice, and what supervision added since
    assert {"wait_ready", "check_version", "server_software_checks", "server_weight_versions",
            "_check_open", "close", "_inc", "_supervise", "_served_version_ok", "_pushing_weights",
            "probe_logprobs"} <= shared
    for mod, cls in (("sglang_engine", "SGLangEngine"), ("vllm_engine", "VLLMEngine")):
        own = {n.split(".", 1)[1] for n in functions(os.path.join(REPO, "gspo_megatron", "rollout", f"{mod}.py"))
               if n.startswith(f"{cls}.")}
        assert not (own & shared), f"{cls} writes again what HTTPEngine holds: {sorted(own & shared)}"
        # the supervisor is the shared one (rollout/supervision.py), not a class of the engine's module
        classes = {n.split(".", 1)[0] for n in functions(os.path.join(REPO, "gspo_megatron", "rollout", f"{mod}.py"))}
        assert not any("Supervisor" in c for c in classes), classes
