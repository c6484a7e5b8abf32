"""Multi-turn agent rollouts: a response interleaves the policy's own tokens with environment
tokens (tool outputs the agent appended), which TrainSample.token_mask leaves out of the loss
(not trained on, not in GSPO's |y|; engine log-prob 0.0 as a placeholder).

* The trainer's GSPO loss and every gradient equal a float64 single-process reference
  (transformers' Qwen3MoeForCausalLM in float64 + the pure gspo_loss with the env tokens masked,
  autograd) at TP2+SP, PP2 (several microbatches) and CP2 packed; the mask really matters (the
  reference with env tokens trained on is far from it).
* Changing the environment tokens' contents changes nothing but what they condition: env
  tokens at the very end of a response leave the loss and every gradient unchanged; env tokens
  in the middle leave the log-probs of the policy tokens before them unchanged and change those
  after them (hence the loss)."""
from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import hf_token_logprobs, hub_named_grads, make_tiny_hf
from test_train_invariance import RTOL, _rank_train, assert_step_matches

VOCAB = 300
PAPER_EPS = (3e-4, 4e-4)
GRPO_EPS = (0.2, 0.27)

# Per sample: prompt length, then the response's segments ("p" policy tokens, "e" env tokens).
LAYOUT = [
    (2, [("p", 5), ("e", 3), ("p", 4)]),
    (3, [("p", 3), ("e", 6), ("p", 7)]),
    (4, [("p", 6), ("e", 2), ("p", 2)]),
    (2, [("p", 7), ("e", 4)]),  # env segment at the very end
    (3, [("p", 2), ("e", 3), ("p", 3), ("e", 2), ("p", 4)]),  # two env segments
    (4, [("p", 4), ("e", 5), ("p", 5)]),
    (2, [("p", 3), ("e", 2), ("p", 6), ("e", 4)]),  # two env segments, the second at the very end
    (3, [("p", 8), ("e", 3), ("p", 1)]),
]


def _segments(segs):
    """[(kind, start, end)] in response positions; 'end' for an env segment closing the response."""
    out, pos = [], 0
    for kind, n in segs:
        out.append((kind, pos, pos + n))
        pos += n
    return out


def make_agent_samples(model, seed=5):
    """TrainSamples of LAYOUT with random ids, token_mask False on env tokens; engine log-probs
    = the model's own + 2e-3 noise on policy tokens (partial clipping at the paper's eps), 0.0
    on env tokens; advantages of alternating sign."""
    from gspo_megatron.train.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    samples = []
    for p, segs in LAYOUT:
        r = sum(n for _, n in segs)
        ids = torch.randint(0, VOCAB, (p + r,), generator=g).tolist()
        mask = [kind == "p" for kind, n in segs for _ in range(n)]
        with torch.no_grad():
            lp = hf_token_logprobs(model, [ids])[0][p - 1:]
        noise = 2e-3 * torch.randn(lp.shape, generator=g)
        eng = torch.where(torch.tensor(mask), lp + noise, torch.zeros(()))
        adv = (-1) ** len(samples) * (0.3 + abs(float(torch.randn((), generator=g))))  # both signs
        samples.append(TrainSample(ids[:p], ids[p:], adv, eng.tolist(), token_mask=mask))
    return samples


def change_env(samples, where, seed=11):
    """Copies of `samples` whose env segments at the very end of the response ("end") or in its
    middle ("middle") hold other ids; everything else (engine log-probs included) as it was."""
    from gspo_megatron.train.batch import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for x, (_, segs) in zip(samples, LAYOUT):
        resp = list(x.response_ids)
        r = len(resp)
        for kind, a, b in _segments(segs):
            if kind == "e" and (b == r) == (where == "end"):
                shift = torch.randint(1, VOCAB, (b - a,), generator=g).tolist()
                resp[a:b] = [(t + s) % VOCAB for t, s in zip(resp[a:b], shift)]  # every id differs
        out.append(TrainSample(list(x.prompt_ids), resp, x.advantage, list(x.engine_logprobs),
                               token_mask=list(x.token_mask)))
    return out


def token_logprobs64(model, seqs):
    """hf_token_logprobs without the float32 cast: the model's own dtype (float64 here)."""
    out = []
    for s in seqs:
        logits = model(torch.tensor([s])).logits[0]
        out.append(torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(s[1:])[:, None])[:, 0])
    return out


def reference64(model64, samples, eps, env="masked", own=None):
    """Float64 loss, clip fraction and Hub-named gradients of the pure gspo_loss over `samples`.
    env="masked": the token masks as given (the trainer's contract). env="trained": every
    response token in the loss, env tokens with π_old = `own` (the model's own log-probs, as if
    the policy had sampled them); env="placeholder": every token in the loss, env tokens with
    the 0.0 placeholder as π_old (a trainer ignoring token_mask)."""
    from gspo_megatron.algorithms import gspo_loss

    model64.zero_grad()
    seqs = [x.prompt_ids + x.response_ids for x in samples]
    lps = token_logprobs64(model64, seqs)
    assert lps[0].dtype == torch.float64
    T = max(len(x.response_ids) for x in samples)
    B = len(samples)
    old = torch.zeros(B, T, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    rows = []
    for i, (x, l) in enumerate(zip(samples, lps)):
        r = len(x.response_ids)
        rows.append(torch.nn.functional.pad(l[len(x.prompt_ids) - 1:], (0, T - r)))
        old[i, :r] = torch.tensor(x.engine_logprobs, dtype=torch.float64)
        m = torch.tensor(x.token_mask)
        if env == "masked":
            mask[i, :r] = m
        else:
            mask[i, :r] = True
            if env == "trained":
                old[i, :r] = torch.where(m, old[i, :r], own[i][:r].to(torch.float64))
    lp = torch.stack(rows)
    adv = torch.tensor([x.advantage for x in samples], dtype=torch.float64)
    loss, metrics = gspo_loss(lp, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
    assert loss.dtype == torch.float64
    loss.backward()
    grads = hub_named_grads(model64)
    model64.zero_grad()
    return float(loss.detach()), float(metrics["clip_frac"]), grads


def rel_worst(grads, ref):
    """Largest difference of any gradient tensor relative to that tensor's scale, and its name."""
    return max(((grads[k].double() - ref[k].double()).abs().max().item()
                / (ref[k].double().abs().max().item() + 1e-12), k) for k in ref)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf_agent")
    model = make_tiny_hf(d)
    model64 = copy.deepcopy(model).double()
    model64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel; same fused weights
    samples = make_agent_samples(model)
    refs = {}

    def ref(batch, eps, env="masked"):
        key = (batch, eps, env)
        if key not in refs:
            xs = {"orig": samples, "end": change_env(samples, "end"), "middle": change_env(samples, "middle")}[batch]
            own = None
            if env == "trained":
                with torch.no_grad():
                    own = [l[len(x.prompt_ids) - 1:] for x, l in
                           zip(xs, hf_token_logprobs(model, [x.prompt_ids + x.response_ids for x in xs]))]
            refs[key] = reference64(model64, xs, eps, env, own)
        return refs[key]

    return str(d), samples, ref


def _check(setup, world, layout, budget, eps, packed):
    hf_dir, samples, ref = setup
    worst = assert_step_matches(hf_dir, samples, ref("orig", eps), world, layout, budget, eps, packed)
    print(f"\n{layout} packed={packed} eps={eps}: worst relative gradient difference {worst[0]:.2e} at {worst[1]}")


def test_masking_env_tokens_matters(setup):
    """The reference the trainer is held to is not the unmasked one: training on the env tokens
    (as if sampled, or with their 0.0 placeholder as π_old) moves the loss and the gradients
    far beyond the tolerances of the tests below, at both clip ranges."""
    _, samples, ref = setup
    assert all(not all(x.token_mask) and any(x.token_mask) for x in samples)
    for eps in (PAPER_EPS, GRPO_EPS):
        loss, _, grads = ref("orig", eps)
        for env in ("trained", "placeholder"):
            other_loss, _, other_grads = ref("orig", eps, env)
            moved = rel_worst(other_grads, grads)[0]
            print(f"\neps={eps} env {env}: loss {other_loss:.6f} vs masked {loss:.6f}, "
                  f"worst relative gradient difference {moved:.2e}")
            assert moved > 50 * RTOL, (eps, env)
        placeholder_loss = ref("orig", eps, "placeholder")[0]
        assert abs(placeholder_loss - loss) > 100 * 1e-4 * abs(loss), eps


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout,budget,packed,eps", [
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, False, PAPER_EPS, id="tp2-sp-paper-eps"),
    pytest.param(2, dict(tp=2, sequence_parallel=True), 10_000, False, GRPO_EPS, id="tp2-sp-grpo-eps"),
    pytest.param(2, dict(pp=2), 40, False, PAPER_EPS, id="pp2-many-micro"),
    pytest.param(2, dict(cp=2), 40, True, PAPER_EPS, id="cp2-packed-many-micro"),
])
def test_multi_turn_step_matches_float64_reference(setup, world, layout, budget, packed, eps):
    """Loss, clip fraction and every gradient of a step on a multi-turn batch (env tokens masked,
    some at the end of a response, some samples with two env segments) equal the float64
    reference (the masked gspo_loss on transformers' model, autograd)."""
    _check(setup, world, layout, budget, eps, packed)


def _rank_env_contents(rank, world, hf_dir, batches, budget, eps, packed, score_seqs):
    """TP1: one trainer step on each batch (fresh model each time), then the trainer's own
    per-token log-probs (the π_old pass, train/scoring.py) of `score_seqs`."""
    from gspo_megatron.config import ParallelConfig
    from gspo_megatron.model.factory import build_policy
    from gspo_megatron.model.arch import MoeArch
    from gspo_megatron.parallel.state import destroy_parallel, init_parallel
    from gspo_megatron.train.scoring import score_sequences

    steps = [_rank_train(rank, world, hf_dir, {}, b, budget, eps, False, False, "none", packed) for b in batches]
    par = ParallelConfig()
    arch = MoeArch.from_hf_dir(hf_dir)
    ctx = init_parallel(par, model_dims=arch.dims_for_validation())
    chunks, _ = build_policy(ctx, arch, hf_dir=hf_dir)
    lps = score_sequences(chunks, ctx, score_seqs, vocab_size=arch.vocab_size, micro_batch_tokens=10_000)
    destroy_parallel()
    return steps, lps


@pytest.mark.timeout(300)
def test_env_token_contents_change_only_what_they_condition(setup):
    """(a) Other ids in the env segments that end a response: the trainer's loss and every
    gradient are unchanged (nothing after them is trained on). (b) Other ids in env segments
    in the middle: the trainer's log-probs of the policy tokens before them are unchanged, those
    of the policy tokens after them change, and so does the loss. The steps on the original and
    the mid-changed batch also equal the float64 reference (TP1, packed: a changed env segment
    is followed in the THD row by the next sequence, which must not see it)."""
    hf_dir, samples, ref = setup
    end, middle = change_env(samples, "end"), change_env(samples, "middle")
    assert [x.response_ids for x in end] != [x.response_ids for x in samples]
    assert [x.response_ids for x in middle] != [x.response_ids for x in samples]
    seqs = [x.prompt_ids + x.response_ids for x in samples + middle]
    steps, lps = run_distributed(_rank_env_contents, 1, hf_dir, [samples, end, middle], 10_000, PAPER_EPS, True,
                                 seqs, timeout=280)[0]
    (t0, g0, _), (t_end, g_end, _), (t_mid, g_mid, _) = steps
    n = len(samples)
    assert t0["sequences"] == t_end["sequences"] == t_mid["sequences"] == n

    # (a) env contents at the end: nothing changes
    assert t_end["loss"] == pytest.approx(t0["loss"], rel=1e-6, abs=1e-9)
    assert t_end["clip_frac"] == t0["clip_frac"]
    worst_end = rel_worst(g_end, g0)
    exact = all(torch.equal(g_end[k], g0[k]) for k in g0) and t_end["loss"] == t0["loss"]
    print(f"\nend env changed: loss {t_end['loss'] / n:.10f} vs {t0['loss'] / n:.10f}, bitwise equal: {exact}, "
          f"worst relative gradient difference {worst_end[0]:.2e} at {worst_end[1]}")
    assert worst_end[0] <= 1e-6, f"relative gradient difference {worst_end[0]:.2e} at {worst_end[1]}"

    # (b) env contents in the middle: the policy tokens before keep their log-probs, those after do not
    before_diff, after_diff = 0.0, []
    for i, (x, (p, segs)) in enumerate(zip(samples, LAYOUT)):
        a, b = torch.tensor(lps[i]), torch.tensor(lps[n + i])
        r = len(x.response_ids)
        first = min([s for kind, s, e in _segments(segs) if kind == "e" and e < r], default=r)  # first changed
        for kind, s, e in _segments(segs):
            if kind != "p":
                continue
            d = (a[p - 1 + s: p - 1 + e] - b[p - 1 + s: p - 1 + e]).abs().max().item()
            if e <= first:
                before_diff = max(before_diff, d)
            else:
                after_diff.append(d)
        assert torch.equal(a[: p - 1 + first], b[: p - 1 + first]) or \
            (a[: p - 1 + first] - b[: p - 1 + first]).abs().max() <= 1e-6  # the whole prefix, prompt too
    print(f"middle env changed: policy log-probs before it differ by {before_diff:.2e}, after it by "
          f"{min(after_diff):.2e} .. {max(after_diff):.2e}; loss {t_mid['loss'] / n:.6f} vs {t0['loss'] / n:.6f}")
    assert before_diff <= 1e-6
    assert min(after_diff) > 1e-3  # every later policy segment is conditioned on the env tokens
    assert abs(t_mid["loss"] - t0["loss"]) > 1e-3 * abs(t0["loss"])

    # both steps are the float64 reference's
    for name, tot, grads in (("orig", t0, g0), ("middle", t_mid, g_mid)):
        ref_loss, ref_clip, ref_grads = ref(name, PAPER_EPS)
        assert tot["loss"] / n == pytest.approx(ref_loss, rel=1e-4, abs=1e-6), name
        assert tot["clip_frac"] / n == pytest.approx(ref_clip, abs=1e-6), name
        worst = rel_worst(grads, ref_grads)
        print(f"tp1-packed {name}: worst relative gradient difference {worst[0]:.2e} at {worst[1]}")
        assert worst[0] <= RTOL, f"{name}: relative gradient difference {worst[0]:.2e} at {worst[1]}"
    assert 0 < ref("orig", PAPER_EPS)[1] < 1
