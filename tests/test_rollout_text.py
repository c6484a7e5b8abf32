"""Tokenizer, synthetic tasks, reward loading/scoring, prompt data (no model needed)."""
import json
import logging

import pytest

from gspo_megatron.rollout.data import PromptDataError, PromptStream, load_prompts, render_prompt
from gspo_megatron.rollout.rewards import RewardSpecError, load_reward_fn, math_reward, score_samples
from gspo_megatron.rollout.tasks import TASKS, SyntheticTask, task_reward
from gspo_megatron.rollout.tokenizer import IM_END, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_and_specials(tok):
    assert len(tok) < 128
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", IM_END]
    assert tok.pad_token_id == 0 and tok.eos_token_id == 2
    task = SyntheticTask("add", seed=0)
    texts = [ex["prompt"] + ex["answer"] for ex in task.sample_prompts(20)]
    texts += ["reverse 0123", "sort 987", "Hello, World!\nx*y = (3/4); a-b?"]
    for s in texts:
        ids = tok.encode(s, add_special_tokens=False)
        assert len(ids) == len(s)  # character level
        assert tok.decode(ids) == s
    assert tok.encode(IM_END, add_special_tokens=False) == [tok.eos_token_id]
    assert tok.decode(tok.encode("12" + IM_END), skip_special_tokens=True) == "12"


def test_chat_template_and_save_load(tok, tmp_path):
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|im_start|>user\n12+34=<|im_end|>\n<|im_start|>assistant\n"
    no_gen = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False)
    assert no_gen == "<|im_start|>user\n1+1=<|im_end|>\n"
    ids = render_prompt(tok, "12+34=")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 1
    assert tok.decode(ids) == rendered

    build_tokenizer(str(tmp_path / "tk"))
    from transformers import AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(str(tmp_path / "tk"), local_files_only=True)
    assert render_prompt(tok2, "12+34=") == ids
    s = "sort 5129\nreverse 307!"
    assert tok2.encode(s) == tok.encode(s)
    assert tok2.eos_token_id == tok.eos_token_id and tok2.pad_token_id == tok.pad_token_id
    assert build_tokenizer().get_vocab() == tok.get_vocab()  # deterministic ids


def test_render_prompt_without_template(tok):
    class Plain:
        chat_template = None

        def encode(self, text):
            return [ord(c) for c in text]

    assert render_prompt(Plain(), "ab") == [97, 98]


# ---------------------------------------------------------------- tasks
@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_rewards_and_determinism(name):
    task = SyntheticTask(name, seed=7)
    a = task.sample_prompts(30)
    assert a == SyntheticTask(name, seed=7).sample_prompts(30)
    assert a != SyntheticTask(name, seed=8).sample_prompts(30)
    assert task.sample_prompts(5, rng=3) == task.sample_prompts(5, rng=3)
    for ex in a:
        demo = task.demonstration(ex)
        assert task.reward(demo, ex) == 1.0
        assert task.reward(demo + IM_END + "junk", ex) == 1.0  # text after eos is ignored
        assert task_reward(" " + demo + "\n", ex) == 1.0
        wrong = str(int(ex["answer"]) + 1) if name == "add" else ex["answer"] + "1"
        assert task.reward(wrong, ex) < 1.0
        assert task.reward("", ex) == 0.0 and task.reward("no digits", ex) == 0.0
        strict = SyntheticTask(name, seed=7, partial_credit=False)
        assert strict.reward(wrong, ex) == 0.0


def test_task_partial_credit_and_errors():
    task = SyntheticTask("add", digits=2)
    ex = {"prompt": "12+34=", "answer": "46", "task": "add"}
    assert task.reward("47", ex) == pytest.approx(0.25)  # tens digit right
    assert task.reward("46", ex) == 1.0
    assert task.reward("99", ex) == 0.0
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        SyntheticTask("nope")
    with pytest.raises(ValueError, match="bad difficulty"):
        SyntheticTask("add", width=3)
    hard = SyntheticTask("add", seed=0, digits=4).sample_prompts(50)
    assert max(int(x) for ex in hard for x in ex["prompt"][:-1].split("+")) >= 1000


# ---------------------------------------------------------------- rewards
def _flaky(resp, ex):
    if resp == "boom":
        raise RuntimeError("reward exploded")
    return 1.0 if resp == ex["answer"] else 0.0


def test_score_samples_isolates_failures(caplog):
    exs = [{"answer": "1"}, {"answer": "2"}, {"answer": "3"}, {"answer": "4"}]
    with caplog.at_level(logging.WARNING):
        r, raised = score_samples(_flaky, ["1", "boom", "0", "boom"], exs)
    assert r == [1.0, 0.0, 0.0, 0.0]
    assert raised == [False, True, False, True]
    msgs = [rec.getMessage() for rec in caplog.records if "reward exploded" in rec.getMessage()]
    assert len(msgs) == 1 and "2/4" in msgs[0]
    r, raised = score_samples(lambda s, e: float("nan") if s == "x" else 0.5, ["x", "y"], exs[:2])
    assert r == [0.0, 0.5] and raised == [True, False]
    r, raised = score_samples(lambda s, e: "1.0", ["x"], exs[:1])
    assert raised == [True]


def test_load_reward_fn():
    fn = load_reward_fn("gspo_megatron.rollout.rewards:math_reward")
    assert fn is math_reward
    assert load_reward_fn("gspo_megatron.rollout.tasks:task_reward") is task_reward
    with pytest.raises(RewardSpecError, match="no_such_mod_xyz"):
        load_reward_fn("no_such_mod_xyz:f")
    with pytest.raises(RewardSpecError, match="has no attribute 'nope'"):
        load_reward_fn("gspo_megatron.rollout.rewards:nope")
    with pytest.raises(RewardSpecError, match="must look like"):
        load_reward_fn("gspo_megatron.rollout.rewards.math_reward")
    with pytest.raises(RewardSpecError, match="not callable"):
        load_reward_fn("gspo_megatron.rollout.rewards:logger.name")
    assert issubclass(RewardSpecError, ValueError)


@pytest.mark.parametrize(
    "response,answer,expected",
    [
        ("The answer is \\boxed{42}", "42", 1.0),
        ("so $\\frac{2}{4}$", "0.5", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{43}", "42", 0.0),
        ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
        ("\\boxed{x^2+1}", "x^2+2x+1", 0.0),
        ("no answer here", "42", 0.0),
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, {"answer": answer}) == expected


# ---------------------------------------------------------------- data
def test_load_prompts_jsonl_parquet(tmp_path):
    rows = [{"question": f"{i}+1=", "sol": f"0{i + 1}", "id": i} for i in range(5)]
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    got = load_prompts(str(p), prompt_key="question", answer_key="sol")
    assert [g["prompt"] for g in got] == [r["question"] for r in rows]
    assert [g["answer"] for g in got] == [r["sol"] for r in rows]  # "01" stays a string
    assert got[3]["id"] == 3

    import datasets

    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    got_pq = load_prompts(str(pq), prompt_key="question", answer_key="sol")
    assert got_pq == got

    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "a", "answer": 3}) + "\n")
    assert load_prompts(str(plain)) == [{"prompt": "a", "answer": "3"}]
    assert load_prompts(str(plain), answer_key=None) == [{"prompt": "a", "answer": 3}]


def test_load_prompts_errors(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(PromptDataError, match="nope.jsonl"):
        load_prompts(str(missing))
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    with pytest.raises(PromptDataError, match=r"d\.jsonl.*record 2 \(1-based\).*'answer'.*data\.answer_key"):
        load_prompts(str(p))
    with pytest.raises(PromptDataError, match=r"d\.jsonl.*'question'"):
        load_prompts(str(p), prompt_key="question")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n')
    with pytest.raises(PromptDataError, match=r"bad\.jsonl:2"):
        load_prompts(str(bad), answer_key=None)
    csv = tmp_path / "d.csv"
    csv.write_text("prompt\nx\n")
    with pytest.raises(PromptDataError, match="unsupported"):
        load_prompts(str(csv))


def test_prompt_files_that_cannot_be_read_name_the_file_and_line(tmp_path):
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(PromptDataError, match=r"latin\.jsonl:2: not UTF-8 text"):
        load_prompts(str(latin))
    import datasets

    pq = tmp_path / "p.parquet"
    datasets.Dataset.from_list([{"prompt": f"{i}", "answer": "1"} for i in range(50)]).to_parquet(str(pq))
    pq.write_bytes(pq.read_bytes()[:-40])  # truncated: the footer is gone
    with pytest.raises(PromptDataError, match=r"p\.parquet: unreadable parquet file"):
        load_prompts(str(pq))


def test_long_prompts_are_skipped_or_truncated_and_counted(tmp_path):
    """data.max_prompt_tokens: before, a prompt longer than the model's context trained with only a
    transformers warning."""
    import types

    from gspo_megatron.rollout.tokenizer import build_tokenizer
    from gspo_megatron.train.setup import PromptSource

    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "1"}) + "\n" for n in (3, 40, 4, 5)))
    tok = build_tokenizer()
    cfg = lambda policy: types.SimpleNamespace(source="file", path=str(p), prompt_key="prompt", answer_key="answer",  # noqa: E731
                                               seed=0, task="sort", long_prompts=policy)
    from gspo_megatron.rollout.data import render_prompt

    limit = len(render_prompt(tok, "x" * 5))  # the chat template's tokens count too
    src = PromptSource(cfg("skip"), tok, 0, max_prompt_tokens=limit)
    got = src.batch(0, 0, 6)
    assert all(len(ex["prompt"]) <= 5 for ex in got) and src.take_skipped() >= 1
    check = src.check_all()
    assert check["skipped"] == 1 and f"over data.max_prompt_tokens={limit}" in check["first_problems"][0]
    src = PromptSource(cfg("truncate"), tok, 0, max_prompt_tokens=limit)
    long = next(ex for ex in src.stream.examples if len(ex["prompt"]) == 40)
    assert src.encode(long) == render_prompt(tok, "x" * 40)[-limit:] and src.check_all()["skipped"] == 0


def test_prompt_stream_order_and_resume():
    data = list(range(10))
    s = PromptStream(data, 4, seed=3)
    first = [s.next_batch() for _ in range(5)]  # 20 examples = 2 epochs
    assert all(len(b) == 4 for b in first)
    flat = [x for b in first for x in b]
    assert sorted(flat[:10]) == data and sorted(flat[10:]) == data  # each epoch is a permutation
    assert flat[:10] != flat[10:20] and flat[:10] != data  # reshuffled per epoch
    def take20(seed):
        st = PromptStream(data, 4, seed=seed)
        return [x for _ in range(5) for x in st.next_batch()]

    assert flat == take20(3) and flat != take20(4)

    s = PromptStream(data, 4, seed=3)
    for _ in range(3):
        s.next_batch()  # ends mid epoch 1
    state = s.state_dict()
    assert state == {"epoch": 1, "position": 2, "seed": 3, "num_examples": 10}
    cont = [s.next_batch() for _ in range(4)]
    r = PromptStream(data, 4, seed=999)
    r.load_state_dict(json.loads(json.dumps(state)))
    assert [r.next_batch() for _ in range(4)] == cont
    assert r.next_batch(7) == s.next_batch(7)
    with pytest.raises(ValueError, match="saved over 10"):
        PromptStream(list(range(11)), 4).load_state_dict(state)
