"""HFEngine on tiny random Qwen3-MoE models built here (no hub access)."""
import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.data import render_prompt
from gspo_megatron.rollout.hf_engine import HFEngine, WeightUpdateError, hub_weight_targets
from gspo_megatron.rollout.tokenizer import build_tokenizer


def tiny_config(vocab_size, **kw):
    base = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=None,
        initializer_range=0.3,  # peaked distributions: greedy has no near-ties
    )
    base.update(kw)
    return Qwen3MoeConfig(**base)


def make_model(tok, seed, **kw):
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(tiny_config(len(tok), **kw)).eval()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_moe")
    make_model(tok, 0).save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFEngine(model_dir, dtype="float32", max_batch_size=4)


@pytest.fixture(scope="module")
def prompts(tok):
    # different lengths, so batches are left-padded
    return [render_prompt(tok, "12+34="), render_prompt(tok, "reverse 1234567"), render_prompt(tok, "9")]


def teacher_forced_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return lp.gather(1, torch.tensor(response)[:, None]).squeeze(1), logits[len(prompt) - 1 : -1]


@pytest.mark.parametrize(
    "sp",
    [
        SamplingParams(temperature=0.7, max_new_tokens=10),
        SamplingParams(temperature=1.3, top_p=0.8, top_k=5, max_new_tokens=10),
    ],
)
def test_logprobs_match_teacher_forcing_and_grouping(engine, prompts, sp):
    assert engine.tokenizer is not None  # found in the model dir
    samples = engine.generate(prompts, 3, sp, seed=11)  # 9 rows, batches of 4: left padding + chunking
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for s in samples:
        assert s.prompt_ids == prompts[s.prompt_index]
        assert len(s.response_logprobs) == len(s.response_ids) > 0
        assert s.finish_reason in ("stop", "length")
        assert s.weight_version == engine.weight_version
        if s.finish_reason == "length":
            assert len(s.response_ids) == sp.max_new_tokens
        ref, _ = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids, sp.temperature)
        torch.testing.assert_close(torch.tensor(s.response_logprobs), ref, atol=1e-4, rtol=0)
        assert s.text == engine.tokenizer.decode(s.response_ids, skip_special_tokens=True)
    if sp.top_k == 5:  # sampled inside the top-5, yet log-probs are of the untruncated distribution
        for s in samples:
            _, logits = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids, 1.0)
            ids = torch.tensor(s.response_ids)[:, None]
            ranks = (logits > logits.gather(1, ids)).sum(1)
            assert (ranks < 5).all()
            # not renormalised over the top-k: per token, the engine's log-prob is log_softmax(logits / T)
            # over the whole vocabulary (teacher forcing on the same model) ...
            lp = torch.log_softmax(logits / sp.temperature, -1)
            torch.testing.assert_close(torch.tensor(s.response_logprobs), lp.gather(1, ids).squeeze(1),
                                       atol=1e-5, rtol=0)
            # ... which 1e-5 tells apart from the top-5-renormalised one (log-prob - log(top-5 mass))
            assert (-torch.logsumexp(lp.topk(5, -1).values, -1) > 1e-3).all()
    # the 3 samples of one prompt differ (sampling), and seeded runs reproduce exactly
    assert len({tuple(s.response_ids) for s in samples[:3]}) > 1
    again = engine.generate(prompts, 3, sp, seed=11)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    other = engine.generate(prompts, 3, sp, seed=12)
    assert [s.response_ids for s in other] != [s.response_ids for s in samples]


def test_samples_of_one_prompt_share_its_prefill(model_dir, prompts):
    """The n samples of a prompt share one prefill (hf_engine.py `_shared_prefill`): the first
    forward sees each distinct prompt once, all its columns but the last; generate's own prefill
    then sees every row's last column only. Same tokens and log-probs as the unshared path."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    engine = HFEngine(model_dir, dtype="float32")
    width = max(len(p) for p in prompts)
    shapes = []
    hook = engine.model.model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        shared = engine.generate(prompts, 4, sp, seed=3)
        calls_shared = list(shapes)
        shapes.clear()
        engine._takes_cache = False  # the unshared path: generate prefills all 12 rows itself
        alone = engine.generate(prompts, 4, sp, seed=3)
        calls_alone = list(shapes)
    finally:
        hook.remove()
    assert calls_shared[:2] == [(3, width - 1), (12, 1)], calls_shared[:3]
    assert calls_alone[0] == (12, width), calls_alone[:2]
    assert [s.response_ids for s in shared] == [s.response_ids for s in alone]
    for a, b in zip(shared, alone):
        torch.testing.assert_close(torch.tensor(a.response_logprobs), torch.tensor(b.response_logprobs),
                                   atol=1e-5, rtol=0)
    # one distinct prompt per row: nothing to share
    shapes.clear()
    engine._takes_cache = True
    hook = engine.model.model.register_forward_pre_hook(
        lambda m, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        engine.generate(prompts, 1, sp, seed=3)
    finally:
        hook.remove()
    assert shapes[0] == (3, width), shapes[:2]


def test_seeded_sampling_leaves_global_rng_and_engine_seed(model_dir, prompts):
    sp = SamplingParams(temperature=1.0, max_new_tokens=6)
    e1 = HFEngine(model_dir, seed=5)
    e2 = HFEngine(model_dir, seed=5)
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    runs1 = [[s.response_ids for s in e1.generate(prompts, 2, sp)] for _ in range(2)]
    assert torch.equal(torch.random.get_rng_state(), before)
    runs2 = [[s.response_ids for s in e2.generate(prompts, 2, sp)] for _ in range(2)]
    assert runs1 == runs2 and runs1[0] != runs1[1]  # call i uses seed + i


def test_an_exception_inside_generate_is_what_propagates(model_dir, prompts):
    """transformers' generate raising (OOM, a bad kernel) reaches the caller as itself, not as an
    UnboundLocalError from the post-processing, and leaves no routing hook on the model."""
    eng = HFEngine(model_dir, dtype="float32", max_batch_size=4, return_routing=True)

    def boom(*a, **kw):
        raise RuntimeError("generate failed inside transformers")

    real = eng.model.generate
    eng.model.generate = boom
    with pytest.raises(RuntimeError, match="generate failed inside transformers"):
        eng.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=2))
    assert eng._gates and all(not g._forward_hooks for _, g, _ in eng._gates)
    eng.model.generate = real
    assert len(eng.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=2))[0].response_ids) >= 1


def test_greedy_is_argmax_and_reproducible(engine, prompts):
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    a = engine.generate(prompts, 2, sp)
    b = engine.generate(prompts, 2, sp)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert a[0].response_ids == a[1].response_ids
    for s in a:
        ref, logits = teacher_forced_logprobs(engine.model, s.prompt_ids, s.response_ids, 1.0)
        assert logits.argmax(-1).tolist() == s.response_ids
        torch.testing.assert_close(torch.tensor(s.response_logprobs), ref, atol=1e-4, rtol=0)  # T=1
    topk1 = engine.generate(prompts, 1, SamplingParams(temperature=0.9, top_k=1, max_new_tokens=8))
    assert [s.response_ids for s in topk1] == [s.response_ids for s in a[::2]]


def test_stop_tokens_and_strings(engine, prompts, tok):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
    full = engine.generate(prompts, 1, greedy)
    assert all(s.finish_reason == "length" and len(s.response_ids) == 8 for s in full)
    stop_tok = full[0].response_ids[2]
    cut = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(stop_tok,)))
    for s, f in zip(cut, full):
        if stop_tok in f.response_ids:
            k = f.response_ids.index(stop_tok) + 1
            assert s.response_ids == f.response_ids[:k] and s.finish_reason == "stop"  # stop token kept
            assert s.meta["matched_stop"] == stop_tok
        else:  # other rows of the batch keep going; no padding leaks into the response
            assert s.response_ids == f.response_ids and s.finish_reason == "length"
        assert s.response_logprobs == pytest.approx(f.response_logprobs[: len(s.response_ids)], abs=1e-5)
    assert cut[0].finish_reason == "stop" and len(cut[0].response_ids) <= 3

    text0 = tok.decode(full[0].response_ids)
    stop_str = text0[3:5]
    s = engine.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=8, stop=(stop_str,)))[0]
    assert s.finish_reason == "stop" and s.meta["matched_stop"] == "stop_string"
    got = tok.decode(s.response_ids)
    assert got.endswith(stop_str) and stop_str not in got[:-1]
    assert s.response_ids == full[0].response_ids[: len(s.response_ids)]


def test_checkpoint_sampling_defaults_do_not_truncate(tok, tmp_path):
    # A Qwen3-style generation_config.json (top_k=2, low temperature) must not leak into sampling:
    # with top_k=-1 every token is possible. A near-uniform model makes top-2 samples rare.
    from transformers import GenerationConfig

    d = str(tmp_path / "m")
    make_model(tok, 0, initializer_range=0.002).save_pretrained(d)
    GenerationConfig(do_sample=True, top_k=2, top_p=0.5, temperature=0.1, eos_token_id=2).save_pretrained(d)
    eng = HFEngine(d, tokenizer=tok)
    samples = eng.generate([render_prompt(tok, "1+1=")], 4, SamplingParams(max_new_tokens=8), seed=0)
    ranks = []
    for s in samples:
        _, logits = teacher_forced_logprobs(eng.model, s.prompt_ids, s.response_ids, 1.0)
        ranks += (logits > logits.gather(1, torch.tensor(s.response_ids)[:, None])).sum(1).tolist()
    assert max(ranks) >= 10


def test_eos_ends_response(tok):
    model = make_model(tok, 3)
    with torch.no_grad():  # make eos (id 2) the overwhelming choice everywhere
        model.lm_head.weight[tok.eos_token_id] = model.model.norm.weight.sign() * 50.0
        model.model.norm.weight.abs_()
    eng = HFEngine(model, tokenizer=tok)
    assert tok.eos_token_id in eng.eos_token_ids
    for s in eng.generate([render_prompt(tok, "1+1=")], 2, SamplingParams(temperature=1.0, max_new_tokens=5), seed=0):
        assert s.response_ids == [tok.eos_token_id] and s.finish_reason == "stop" and s.text == ""


def hub_tensors(path):
    with safe_open(path, "pt") as f:
        for k in f.keys():
            yield k, f.get_tensor(k)


def test_update_weights_from_hub_names(tok, tmp_path, prompts):
    src = make_model(tok, 42)
    src.save_pretrained(str(tmp_path / "src"))
    st = str(tmp_path / "src" / "model.safetensors")
    with safe_open(st, "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names  # Hub per-expert names on disk
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(src.named_parameters())  # fused in memory
    assert {t.key for t in hub_weight_targets(src).values()} == names

    eng = HFEngine(make_model(tok, 1), tokenizer=tok)
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        want = src(ids).logits
        assert not torch.allclose(eng.model(ids).logits, want, atol=1e-3)
    eng.update_weights(hub_tensors(st), version=7)  # one-shot generator
    assert eng.weight_version == 7
    with torch.no_grad():
        torch.testing.assert_close(eng.model(ids).logits, want, atol=1e-6, rtol=0)
    for a, b in zip(eng.model.state_dict().values(), src.state_dict().values()):
        assert torch.equal(a, b)
    s = eng.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert all(x.weight_version == 7 for x in s)


def test_update_weights_errors(tok, tmp_path, prompts):
    src = make_model(tok, 42)
    src.save_pretrained(str(tmp_path / "src"))
    st = str(tmp_path / "src" / "model.safetensors")
    eng = HFEngine(make_model(tok, 1), tokenizer=tok)
    good = dict(hub_tensors(st))

    with pytest.raises(WeightUpdateError, match=r"unknown tensor 'model\.layers\.0\.mlp\.experts\.9\.up_proj\.weight'"):
        eng.update_weights([("model.layers.0.mlp.experts.9.up_proj.weight", torch.zeros(32, 64))], 1)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    with pytest.raises(WeightUpdateError, match=rf"{name}.*\(32, 64\).*expected \(64, 32\)"):
        eng.update_weights([(name, torch.zeros(32, 64))], 1)
    partial = [(k, v) for k, v in good.items() if "layers.1.self_attn" not in k and k != "lm_head.weight"]
    with pytest.raises(WeightUpdateError, match=r"did not cover 7 .*lm_head\.weight.*layers\.1\.self_attn\.k_norm"):
        eng.update_weights(iter(partial), 1)
    assert eng.weight_version == 0
    with pytest.raises(RuntimeError, match="partially updated"):
        eng.generate(prompts, 1, SamplingParams(max_new_tokens=2))
    eng.update_weights(good.items(), 2)
    assert eng.weight_version == 2
    eng.generate(prompts, 1, SamplingParams(max_new_tokens=2))


def test_update_weights_tied_and_dense_layers(tok, tmp_path):
    kw = dict(tie_word_embeddings=True, mlp_only_layers=[1])
    src = make_model(tok, 5, **kw)
    src.save_pretrained(str(tmp_path / "tied"))
    eng = HFEngine(make_model(tok, 6, **kw))
    eng.update_weights(hub_tensors(str(tmp_path / "tied" / "model.safetensors")), 1)
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(eng.model(ids).logits, src(ids).logits, atol=1e-6, rtol=0)
    assert eng.model.lm_head.weight is eng.model.model.embed_tokens.weight


def test_return_routing_records_the_experts_generation_used(model_dir, prompts):
    """return_routing: Sample.routed_experts [P + R - 1, layers, top_k] equals the experts a
    teacher-forced pass of the same model chooses at every position (hooks on transformers'
    routers), rows 0 .. P + R - 2; samples of different lengths in one left-padded batch."""
    eng = HFEngine(model_dir, seed=5, return_routing=True)
    model = eng.model
    samples = eng.generate(prompts, 3, SamplingParams(temperature=1.0, max_new_tokens=7))
    L, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert len({len(s.prompt_ids) for s in samples}) > 1  # left padding exercised
    for s in samples:
        seq = s.prompt_ids + s.response_ids
        chosen = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2]))
                 for layer in model.model.layers]
        with torch.no_grad():
            model(torch.tensor([seq]))
        for h in hooks:
            h.remove()
        ref = torch.stack(chosen, 1)[: len(seq) - 1]
        assert s.routed_experts.shape == (len(seq) - 1, L, k) and s.routed_experts.dtype == torch.int32
        assert torch.equal(s.routed_experts.sort(-1).values, ref.sort(-1).values.to(torch.int32))
    assert HFEngine(model_dir).generate(prompts[:1], 1, SamplingParams(max_new_tokens=2))[0].routed_experts is None


def test_return_routing_of_a_model_with_dense_layers_has_sglangs_zero_rows(prompts, tmp_path):
    """GLM-4.5 (first layer dense, sigmoid routing with a non-zero expert bias): every MoE layer's
    rows equal the experts transformers' router chooses teacher-forced; the dense layer's rows are
    zeros, as SGLang 0.5.23 returns them (a zero-initialised buffer over num_hidden_layers that only
    MoE layers write: state_capturer/base.py:38, :48-50; its glm4_moe.py gives dense layers no
    router). Before, return_routing refused any model with a dense layer."""
    from megatron_utils import make_tiny_hf

    model = make_tiny_hf(tmp_path / "glm", family="glm4_moe", vocab_size=98)
    eng = HFEngine(str(tmp_path / "glm"), seed=5, return_routing=True)
    L, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    dense = [i for i, layer in enumerate(eng.model.model.layers) if not hasattr(layer.mlp, "gate")]
    assert dense == [0] and L == 4
    samples = eng.generate(prompts, 2, SamplingParams(temperature=1.0, max_new_tokens=6))
    for s in samples:
        seq = s.prompt_ids + s.response_ids
        chosen = []
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[2]))
                 for layer in eng.model.model.layers if hasattr(layer.mlp, "gate")]
        with torch.no_grad():
            eng.model(torch.tensor([seq]))
        for h in hooks:
            h.remove()
        ref = torch.stack(chosen, 1)[: len(seq) - 1]
        assert s.routed_experts.shape == (len(seq) - 1, L, k) and s.routed_experts.dtype == torch.int32
        assert torch.equal(s.routed_experts[:, 0], torch.zeros(len(seq) - 1, k, dtype=torch.int32))
        assert torch.equal(s.routed_experts[:, 1:].sort(-1).values, ref.sort(-1).values.to(torch.int32))
