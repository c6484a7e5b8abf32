"""Multi-turn agent rollouts (rollout/agent.py): sessions continue exactly their token ids,
environment tokens are masked, budgets, failures and concurrency; then the trainer: every step's
engine-vs-trainer log-prob mismatch stays at fp32 rounding (the trainer scores exactly the sampled
tokens) with the in-process engine and the SGLang double, and a re-tokenizing agent fails that."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from gspo_megatron.rollout.agent import AgentRunner, AgentSession, run_and_score
from gspo_megatron.rollout.base import Sample, SamplingParams
from gspo_megatron.rollout.tokenizer import build_tokenizer
from run_output import explain

TOK = build_tokenizer()


class FakeEngine:
    """Deterministic: answers a prompt of length L with tokens 10 + (L + i) % 50, log-prob -0.1*(i+1).
    Records every call (prompts, sampling)."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.fail = fail
        self.weight_version = 3

    def generate(self, prompts, n, sampling, *, seed=None):
        assert n == 1
        if self.fail:
            raise ConnectionError("engine down")
        self.calls.append(([list(p) for p in prompts], sampling))
        out = []
        for i, p in enumerate(prompts):
            ids = [10 + (len(p) + j) % 50 for j in range(sampling.max_new_tokens)]
            out.append(Sample(i, list(p), ids, [-0.1 * (j + 1) for j in range(len(ids))], "length",
                              self.weight_version, meta={"matched_stop": None}))
        return out


SP = SamplingParams(max_new_tokens=8, stop_token_ids=(TOK.eos_token_id,))
EXAMPLES = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}]
PROMPTS = [[1, 20, 21, 22], [1, 23, 24]]


def _run(fn, n=2, engine=None, **kw):
    engine = engine or FakeEngine()
    runner = AgentRunner(fn, TOK, max_response_tokens=kw.pop("budget", 32), **kw)
    return engine, runner.run(engine.generate, EXAMPLES, PROMPTS, n, SP, seed=5, version=3)


def test_sessions_continue_exactly_their_token_ids_and_mask_environment_tokens():
    seen = {}

    def agent(example, s):
        a = s.generate(max_new_tokens=3)
        env = s.append([60, 61])
        b = s.generate(max_new_tokens=2)
        seen.setdefault(example["prompt"], []).append((a, env, b))
        return 0.5

    engine, res = _run(agent)
    assert res.errors == [None] * 4 and res.rewards == [0.5] * 4
    # first turn: the prompts; second turn: prompt + the first turn + the environment tokens, as ids
    first, second = engine.calls
    assert first[0] == [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    for s in res.samples:
        p = PROMPTS[s.prompt_index]
        a = [10 + (len(p) + j) % 50 for j in range(3)]
        assert s.response_ids[:5] == a + [60, 61]
        assert p + a + [60, 61] in second[0]
        assert s.loss_mask == [True] * 3 + [False] * 2 + [True] * 2
        assert s.response_logprobs[3:5] == [0.0, 0.0] and s.response_logprobs[:3] == pytest.approx([-0.1, -0.2, -0.3])
        assert s.meta["turns"] == 2 and s.meta["env_tokens"] == 2 and s.meta["policy_tokens"] == 5
    assert [s.prompt_index for s in res.samples] == [0, 0, 1, 1]
    assert res.stats["env_tokens"] == 8 and res.stats["turns_mean"] == 2.0 and res.stats["engine_calls"] == 2
    assert second[1].max_new_tokens == 2 and first[1].max_new_tokens == 3


def test_append_text_encodes_without_special_tokens_and_refuses_foreign_ids():
    def agent(example, s):
        s.generate(max_new_tokens=1)
        assert s.append("=7\n") == TOK.encode("=7\n", add_special_tokens=False)
        assert s.text().endswith("=7\n")
        with pytest.raises(ValueError, match="outside the vocabulary"):
            s.append([len(TOK) + 5])

    _, res = _run(agent, n=1)
    assert res.errors == [None, None], res.errors


def test_the_response_budget_ends_the_session_with_length():
    def agent(example, s):
        assert len(s.generate(max_new_tokens=4)) == 4
        assert s.append([60, 61, 62, 63, 64]) == [60, 61]  # cut at the budget of 6
        assert s.done and s.finish_reason == "length"
        assert s.generate() == [] and s.append([60]) == []  # nothing reaches the engine any more

    engine, res = _run(agent, n=1, budget=6)
    assert len(engine.calls) == 1
    assert all(len(s.response_ids) == 6 and s.finish_reason == "length" for s in res.samples)
    # a generate() asks for no more than what is left
    _, res = _run(lambda ex, s: s.generate(max_new_tokens=50), n=1, budget=6)
    assert all(len(s.response_ids) == 6 and s.finish_reason == "length" for s in res.samples)


def test_a_failing_agent_scores_zero_and_is_counted_and_the_batch_goes_on():
    def agent(example, s):
        s.generate(max_new_tokens=2)
        if example["answer"] == "3":
            raise RuntimeError("tool failed")
        return None  # scored by the reward function

    score = lambda texts, exs: ([0.75] * len(texts), [False] * len(texts))  # noqa: E731
    samples, rewards, flags, stats = run_and_score(AgentRunner(agent, TOK, max_response_tokens=8), FakeEngine().generate,
                                                   EXAMPLES, PROMPTS, 2, SP, score)
    assert rewards == [0.0, 0.0, 0.75, 0.75] and stats["agent_errors"] == 2
    assert all(len(s.response_ids) == 2 and s.text is not None for s in samples)


def test_a_hung_agent_is_bounded_by_the_timeout():
    release = threading.Event()

    def agent(example, s):
        s.generate(max_new_tokens=1)
        if example["answer"] == "8":
            release.wait(30)  # a tool that hangs
        return 1.0

    try:
        _, res = _run(agent, timeout_s=0.5)
    finally:
        release.set()
    assert res.rewards[:2] == [1.0, 1.0] and res.rewards[2:] == [0.0, 0.0]
    assert all(e and e.startswith("AgentTimeout") for e in res.errors[2:]) and res.stats["agent_errors"] == 2


def test_an_engine_failure_fails_the_rollout():
    with pytest.raises(ConnectionError, match="engine down"):
        _run(lambda ex, s: s.generate(), engine=FakeEngine(fail=True))


def test_concurrent_sessions_overlap_their_tools_and_share_engine_calls():
    """16 sessions whose tool runs until every session allowed to run is inside its tool: the tools
    run at the same time (16 at once, not one after another; run one after another, the first tool
    would wait out its bound alone) and each turn of all sessions goes to the engine as one batched
    call. By construction, not by a sleep: a tool leaves only once `target` tools are in (bounded)."""
    active, peak, cond = [0], [0], threading.Condition()
    target = [16]

    def agent(example, s):
        for _ in range(2):
            s.generate(max_new_tokens=2)
            with cond:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
                cond.notify_all()
                cond.wait_for(lambda: peak[0] >= target[0], timeout=10)
                active[0] -= 1
            s.append([60])
        s.generate(max_new_tokens=2)
        return 1.0

    engine, res = _run(agent, n=8)
    assert peak[0] == 16 and res.errors == [None] * 16
    assert len(engine.calls) == 3 and all(len(c[0]) == 16 for c in engine.calls), [len(c[0]) for c in engine.calls]
    # a bounded pool: never more sessions at once than asked
    active[0] = peak[0] = 0
    target[0] = 4
    engine, res = _run(agent, n=8, concurrency=4)
    assert peak[0] == 4 and res.errors == [None] * 16


def test_with_a_linger_a_turn_goes_without_a_session_whose_tool_is_slow():
    """rollout.agent_linger_s: a batch goes once its oldest request has waited that long, so the
    15 sessions whose tools returned are answered without the one whose tool is still running
    (held until the engine has answered the other 15's second turn, in one call or several: by
    construction, no timing), and that session's turn follows alone. Without a linger the 15 would
    wait for it (the test above), and the held tool would wait out its bound."""
    engine = FakeEngine()
    answered, cond = [0], threading.Condition()
    inner = engine.generate

    def generate(prompts, n, sampling, *, seed=None):
        out = inner(prompts, n, sampling, seed=seed)
        with cond:
            answered[0] += len(prompts)
            cond.notify_all()
        return out

    engine.generate = generate
    pick, held = threading.Lock(), []

    def agent(example, s):
        s.generate(max_new_tokens=2)
        with pick:  # the first session to get here: its tool is slow
            slow = not held
            held.append(s)
        if slow:
            with cond:
                assert cond.wait_for(lambda: answered[0] >= 16 + 15, timeout=30), \
                    "the other sessions' turn did not go without the slow one"
        s.append([60])
        s.generate(max_new_tokens=2)
        return 1.0

    _, res = _run(agent, n=8, engine=engine, linger_s=0.05)
    sizes = [len(c[0]) for c in engine.calls]
    # every turn answered once; the slow session's second turn last and alone (a turn's first
    # batch may itself be split by the linger on a loaded machine: not asserted)
    assert res.errors == [None] * 16 and sum(sizes) == 32 and sizes[-1] == 1, sizes
    assert engine.calls[-1][0] == [held[0].prompt_ids + held[0].response_ids[:2] + [60]]


class SeededEngine(FakeEngine):
    """Like a real engine: what a row samples depends on the call's seed and the row's place in
    the call, so a turn split into other batches samples other tokens."""

    def generate(self, prompts, n, sampling, *, seed=None):
        out = super().generate(prompts, n, sampling, seed=seed)
        for i, s in enumerate(out):
            s.response_ids = [10 + (seed * 31 + i * 7 + j) % 50 for j in range(len(s.response_ids))]
        return out


def test_a_turn_is_one_batch_whatever_the_timing_so_runs_sample_the_same_tokens():
    """Default (no linger): a turn goes to the engine only once every running session waits for
    it, so a session whose tool (or thread, on a loaded machine) is slow never splits the batch:
    the calls and the sampled tokens are the same whichever session is slow. Before, a tool slower
    than 50 ms split the turn and the run sampled other tokens (the calculator demo learned more
    slowly on a loaded machine)."""

    def run(slow):
        def agent(example, s):
            s.generate(max_new_tokens=2)
            if s.prompt_ids == PROMPTS[0] and id(s) in slow_ids:
                time.sleep(0.2)
            s.append([60])
            s.generate(max_new_tokens=2)
            return 1.0

        slow_ids = set()
        real_cls = AgentSession

        class Marked(real_cls):
            count = [0]

            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                if Marked.count[0] in slow:
                    slow_ids.add(id(self))
                Marked.count[0] += 1

        return _run(agent, n=8, engine=SeededEngine(), session_cls=Marked)

    (e1, r1), (e2, r2) = run({0}), run({3, 5})
    assert [len(c[0]) for c in e1.calls] == [16, 16] == [len(c[0]) for c in e2.calls]
    assert [s.response_ids for s in r1.samples] == [s.response_ids for s in r2.samples]


def test_the_session_api():
    def agent(example, s):
        assert isinstance(s, AgentSession) and s.example is example and s.tokenizer is TOK
        assert s.prompt_ids == PROMPTS[EXAMPLES.index(example)]
        s.generate()
        assert s.text() == TOK.decode(s.response_ids, skip_special_tokens=False)

    _, res = _run(agent, n=1)
    assert res.errors == [None, None]


def test_rollout_agent_spec_and_config_checks():
    from gspo_megatron.config import ConfigError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.agent import load_agent_fn
    from gspo_megatron.rollout.rewards import RewardSpecError

    with pytest.raises(RewardSpecError, match="rollout.agent 'no_such_module_x:f'"):
        load_agent_fn("no_such_module_x:f")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tiny = os.path.join(repo, "launch", "configs", "tiny_cpu.yaml")
    with pytest.raises(ConfigError, match="rollout.agent must look like"):
        load_config(tiny, ["rollout.agent=nocolon"])
    with pytest.raises(ConfigError, match="routing_replay=rollout"):
        load_config(tiny, ["rollout.agent=tests.agent_fns:two_turn", "train.routing_replay=rollout"])
    with pytest.raises(ConfigError, match="rollout.max_response_tokens=600"):
        load_config(tiny, ["rollout.agent=tests.agent_fns:two_turn", "rollout.max_response_tokens=600"])
    cfg = load_config(tiny, ["rollout.agent=tests.agent_fns:two_turn", "rollout.max_response_tokens=20"])
    assert cfg.rollout.response_budget == 20
    assert load_config(tiny, ["rollout.max_response_tokens=20"]).rollout.response_budget == 8  # no agent: unused


# ------------------------------------------------------------------------------------------
# The trainer


AGENT_RUN = ["train.max_steps=3", "train.sft_warmup_steps=0", "rollout.prompts_per_step=4",
             "rollout.samples_per_prompt=4", "rollout.max_response_tokens=16", "checkpoint.interval=0",
             "checkpoint.export_hf=false", "logging.progress_bar=false", "logging.plot=false",
             "loss.old_logprobs=recompute", "reward.fn=tests.reward_fns:response_length"]


def _agent_train(tmp_path, name, agent, *extra):
    from test_train_loop import TINY, gspo_rows
    from testlib import train_pooled

    out, log = tmp_path / name, tmp_path / f"{name}.agent.jsonl"
    r = train_pooled(2, "--config", TINY, f"out_dir={out}", f"rollout.agent=tests.agent_fns:{agent}",
                     *AGENT_RUN, *extra, timeout=560, env={"AGENT_LOG": str(log)})
    assert r.returncode == 0, explain(r.stderr)
    sessions = [json.loads(x) for x in open(log)]
    return gspo_rows(out), sessions


def _check_exact(rows, sessions):
    assert [x["step"] for x in rows] == [1, 2, 3]
    worst = [x["mismatch_logprob_max"] for x in rows]
    print("mismatch_logprob_max per step:", worst)
    assert all(w <= 1e-5 for w in worst), worst
    assert len(sessions) == 3 * 16
    # env_tokens: the tokens the agent appended; loss_tokens: the tokens the policy generated
    assert sum(x["env_tokens"] for x in rows) == sum(len(s["appended"]) for s in sessions) > 0
    assert sum(x["loss_tokens"] for x in rows) == sum(len(s["generated"]) for s in sessions)
    assert all(x["turns_mean"] == 2.0 and x["agent_errors"] == 0 for x in rows)


@pytest.mark.timeout(600)
def test_two_turn_agent_trains_on_exactly_the_sampled_tokens_in_process(tmp_path):
    rows, sessions = _agent_train(tmp_path, "exact", "two_turn")
    _check_exact(rows, sessions)
    # the negative control: rebuilding the conversation from text between turns (special tokens
    # dropped by decode) makes the trainer score tokens the engine never sampled
    rows, _ = _agent_train(tmp_path, "retok", "two_turn_retokenized")
    worst = max(x["mismatch_logprob_max"] for x in rows)
    print("re-tokenizing agent, worst mismatch:", worst)
    assert worst > 1e-2, worst


@pytest.mark.timeout(600)
def test_two_turn_agent_trains_on_exactly_the_sampled_tokens_with_sglang(tmp_path):
    from sglang_double import SGLangDouble, sglang_overrides
    from test_train_sglang import _tiny_hf_dir

    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    with SGLangDouble(hf_dir) as server:
        rows, sessions = _agent_train(tmp_path, "sglang", "two_turn", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                                      *sglang_overrides(server.url, weight_sync="disk", shared_dir=str(tmp_path / "sync")))
        gens = [x.body for x in server.records if x.path == "/generate"]
    _check_exact(rows, sessions)
    # the second turns continued token ids (input_ids), never text
    assert gens and all("input_ids" in g and "text" not in g for g in gens)


@pytest.mark.timeout(600)
def test_agent_with_async_partial_rollouts_dynamic_sampling_and_routing_replay(tmp_path):
    """The agent path under rollout.async_steps=1 with partial rollouts (a push may interrupt a
    session's generation; it resumes with the new weights), dynamic sampling and R2 routing
    replay (the π_old pass records every token's routing, environment tokens included)."""
    rows, sessions = _agent_train(tmp_path, "async", "two_turn", "rollout.async_steps=1", "rollout.partial=true",
                                  "rollout.dynamic_sampling=true", "train.routing_replay=old")
    assert [x["step"] for x in rows] == [1, 2, 3]
    assert all(x["agent_errors"] == 0 and x["staleness_max"] <= 1 and x["samples_dropped_stale"] == 0 for x in rows)
    # every session the agent ran was generated for a step (dynamic sampling may run extra rounds)
    assert sum(x["env_tokens_all"] for x in rows) == sum(len(s["appended"]) for s in sessions)
    assert all(0 < x["env_tokens"] <= x["env_tokens_all"] and x["loss_tokens"] > 0 for x in rows)


def test_engines_without_stop_string_matching_cut_at_the_first_stop_string():
    """vLLM's token route does not detokenize: VLLMEngine cuts each sample at its first stop string
    (rollout/base.py cut_at_stop_string), as the in-process engine matches them while generating."""
    from gspo_megatron.rollout.base import cut_at_stop_string

    ids = TOK.encode("ab]cd]e", add_special_tokens=False)
    s = Sample(0, [1], ids, [-0.1 * i for i in range(len(ids))], "length", 4, token_versions=[4, 4, 5, 5, 5, 6, 6])
    cut = cut_at_stop_string(s, TOK, ("]",))
    assert TOK.decode(cut.response_ids) == "ab]" and cut.response_logprobs == s.response_logprobs[:3]
    assert cut.finish_reason == "stop" and cut.token_versions == [4, 4, 5] and cut.weight_version == 4
    assert cut_at_stop_string(s, TOK, ("zz",)) is s  # no stop string: unchanged
    multi = cut_at_stop_string(s, TOK, ("d]", "c"))  # the shortest prefix containing any of them
    assert TOK.decode(multi.response_ids) == "ab]c"


def test_vllm_engine_refuses_stop_strings_without_a_tokenizer():
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)  # no servers: the check comes before any request
    eng.tokenizer, eng._closed, eng._inconsistent = None, False, None
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=2, stop=("]",)))


class SlowEngine(FakeEngine):
    def generate(self, prompts, n, sampling, *, seed=None):
        time.sleep(0.8)
        return super().generate(prompts, n, sampling, seed=seed)


def test_the_timeout_counts_the_sessions_own_time_not_the_engine_wait():
    """An engine call longer than agent_timeout_s does not abandon sessions that wait for it."""
    _, res = _run(lambda ex, s: s.generate(max_new_tokens=2) and 1.0, engine=SlowEngine(), timeout_s=0.5)
    assert res.errors == [None] * 4 and res.rewards == [1.0] * 4


def test_an_abandoned_session_keeps_the_sample_it_had():
    go_on = threading.Event()
    after: list = []

    def agent(example, s):
        s.generate(max_new_tokens=2)
        go_on.wait(20)  # past the timeout, then tries to go on
        try:
            s.append([60, 61, 62])
        except Exception as e:  # noqa: BLE001
            after.append(type(e).__name__)
        return 1.0

    try:
        _, res = _run(agent, n=1, timeout_s=0.3)
    finally:
        go_on.set()
    deadline = time.monotonic() + 30  # the abandoned agents' threads go on after go_on: wait for both (bounded)
    while len(after) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert res.stats["agent_errors"] == 2 and after == ["AgentTimeout"] * 2
    assert all(len(s.response_ids) == len(s.response_logprobs) == 2 and s.loss_mask is None for s in res.samples)


@pytest.mark.parametrize("bad", ["0.5", float("nan"), float("inf"), [1.0]])
def test_an_agent_returning_a_non_number_is_a_failure(bad):
    _, res = _run(lambda ex, s: bad, n=1)
    assert res.rewards == [0.0, 0.0] and res.stats["agent_errors"] == 2


def test_too_many_failed_sessions_fail_the_step_like_reward_errors():
    from gspo_megatron.rollout.rewards import RewardError

    class Scorer:
        max_error_frac = 0.25

        def __call__(self, texts, exs):
            return [1.0] * len(texts), [False] * len(texts)

    def agent(example, s):
        if example["answer"] == "3":
            raise RuntimeError("tool failed")

    with pytest.raises(RewardError, match=r"failed on 2 of 4 sessions, more than reward.max_error_frac=0.25"):
        run_and_score(AgentRunner(agent, TOK, max_response_tokens=8), FakeEngine().generate, EXAMPLES, PROMPTS, 2, SP,
                      Scorer())
    Scorer.max_error_frac = 0.5
    _, rewards, _, stats = run_and_score(AgentRunner(agent, TOK, max_response_tokens=8), FakeEngine().generate,
                                         EXAMPLES, PROMPTS, 2, SP, Scorer())
    assert rewards == [0.0, 0.0, 1.0, 1.0] and stats["agent_errors"] == 2


def test_stop_as_a_string_and_environment_tokens_before_the_first_turn():
    def agent(example, s):
        s.append([60, 61])
        s.generate(max_new_tokens=2, stop="</tool>")

    engine, res = _run(agent, n=1)
    assert engine.calls[0][1].stop == ("</tool>",)
    # the run's weight version (3) on the environment tokens too: one version, the oldest token's
    assert all(s.token_versions is None and s.weight_version == 3 for s in res.samples)
    assert all(s.loss_mask == [False, False, True, True] for s in res.samples)


def test_in_process_engine_matches_stop_strings_in_the_output_only(tmp_path):
    """A stop string spanning the prompt's last token and the first sampled one must not end the
    turn (transformers' stop_strings match across the prompt: the row came back as 'abort' with one
    token, or padded with pad tokens inside a batch); SGLang matches the output only."""
    import torch
    import yaml
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from gspo_megatron.rollout.hf_engine import HFEngine

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "launch", "configs", "tiny_cpu.yaml")) as f:
        hf = yaml.safe_load(f)["model"]["hf_config"]
    torch.manual_seed(0)
    eng = HFEngine(Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf)).eval(), tokenizer=TOK, eos_token_ids=[])
    last = "~"
    stops = tuple(last + TOK.decode([i]) for i in range(4, len(TOK)))  # any first token completes one
    prompts = [TOK.encode("ab" + last, add_special_tokens=False), TOK.encode("xyz" + last, add_special_tokens=False)]
    out = eng.generate(prompts, 2, SamplingParams(max_new_tokens=5, stop=stops), seed=1)
    for s in out:
        text = TOK.decode(s.response_ids, skip_special_tokens=False)
        assert s.finish_reason in ("length", "stop") and 0 not in s.response_ids, (s.finish_reason, s.response_ids)
        assert (s.finish_reason == "length" and len(s.response_ids) == 5) or any(x in text for x in stops)
