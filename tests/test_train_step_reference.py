"""The loop's own step, built by train/setup.py, against a single-process reference: rollout with
dynamic sampling (the in-process engine) -> group advantages -> π_old (recompute, or the engine's
log-probs) -> the frozen reference model's log-probs for kl_coef -> Megatron's schedules.

Two trainer processes; the policy is first moved away from its initial weights by one real step
(so the reference model, π_old and the engine's weights all differ), then the captured gradient
of the next step equals transformers' Qwen3MoeForCausalLM + `gspo_loss` on the kept samples, with
π_old and π_ref computed by the reference from the policy's weights and the initial checkpoint.
The train-inference mismatch metrics equal a float64 reference, and after a weight push the
engine serves exactly the trainer's weights (its log-probs equal the trainer's π_old within 1e-5)."""
from __future__ import annotations

import json
import os
import zlib

import pytest
import torch

from dist_utils import run_distributed
from megatron_utils import hub_named_grads, make_tiny_hf
from test_train_invariance import RTOL
from test_train_invariance_options import SEVERAL, rel_diff

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
TEMPERATURE = 0.8
P, G = 4, 4


def _constant_group(example) -> bool:
    """Half the prompts get the same reward for every sample (dynamic sampling drops them)."""
    return zlib.crc32(json.dumps(example, sort_keys=True, default=str).encode()) % 2 == 0


def _score(texts, examples):
    rewards = [0.5 if _constant_group(ex) else (sum(map(ord, t)) % 7) / 7 for t, ex in zip(texts, examples)]
    return rewards, [False] * len(texts)


def _rank_loop_steps(rank, world, hf_dir, out_dir, overrides):
    from gspo_megatron.resolve import load_config
    from gspo_megatron.model.export import grad_tensor, iter_hf_tensors
    from gspo_megatron.train import loop
    from gspo_megatron.train.setup import setup_run

    cfg = load_config(TINY, [f"out_dir={out_dir}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                             "train.minibatches_per_step=1", f"rollout.prompts_per_step={P}",
                             f"rollout.samples_per_prompt={G}", f"rollout.temperature={TEMPERATURE}",
                             "rollout.dynamic_sampling=true", "rollout.max_oversample_rounds=4",
                             # gradients are captured after the schedule: the distributed optimizer
                             # reduce-scatters them over (expert-)DP x CP, leaving each rank only its
                             # shard reduced; the plain optimizer's all-reduce leaves whole ones
                             # (test_dist_optimizer.py: both optimizers train alike)
                             "optimizer.use_distributed_optimizer=false", *overrides])
    parts = setup_run(cfg, world_size=world)
    parts.score = _score
    grads = {}

    real_schedule = loop._run_schedule

    def run_schedule(parts_, step_fn, mbs, *, forward_only):  # grads captured after an update's schedule
        reports = real_schedule(parts_, step_fn, mbs, forward_only=forward_only)
        if not forward_only:
            grads.clear()
            grads.update((k, t.clone()) for k, t in iter_hf_tensors(parts_.model, parts_.ctx, parts_.arch,
                                                                     tensor_of=grad_tensor))
        return reports

    loop._run_schedule = run_schedule  # restored below: ranks are pooled (tests/dist_utils.py)

    def step(n):
        payload = None
        if rank == 0:
            kept, rewards, stats = loop.rollout(parts, n)
            payload = (kept, rewards, stats, loop.to_train_samples(kept, rewards, G))
        kept, rewards, stats, samples = loop._broadcast(payload)
        metrics = loop.gspo_step(parts, samples)
        return {"kept": kept, "rewards": rewards, "stats": stats, "advantages": [s.advantage for s in samples],
                "metrics": metrics, "grads": dict(grads)}

    try:
        loop.push_weights(parts, 0)
        step(0)  # moves the policy away from the initial weights; the engine keeps serving them
        policy = {k: t.clone() for k, t in iter_hf_tensors(parts.model, parts.ctx, parts.arch)}  # not views
        second = step(1)
        loop.push_weights(parts, 2)  # now the engine serves the trainer's current weights
        third = step(2)
        after = dict(iter_hf_tensors(parts.model, parts.ctx, parts.arch))
    finally:
        loop._run_schedule = real_schedule
        parts.close()
    return (policy, second, third, after) if rank == 0 else None


def _hf_with(hf_dir, tensors, out):
    """transformers' model holding `tensors` (Hub names), loaded by transformers itself."""
    import shutil

    from safetensors.torch import save_file
    from transformers import Qwen3MoeForCausalLM

    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(hf_dir, "config.json"), out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    return Qwen3MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _tempered_logprobs(model, samples):
    """[B, T] padded token log-probs of softmax(logits / T) at the response tokens, and the mask."""
    T = max(len(s.response_ids) for s in samples)
    rows, mask = [], torch.zeros(len(samples), T, dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(seq).logits[0, :-1].float() / TEMPERATURE, -1)
        lp = logp.gather(-1, seq[0, 1:, None])[:, 0][len(s.prompt_ids) - 1:]
        rows.append(torch.nn.functional.pad(lp, (0, T - len(lp))))
        mask[i, :len(lp)] = True
    return torch.stack(rows), mask


def _advantages64(rewards, g):
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, g)
    std = r.std(-1, keepdim=True)
    adv = torch.where(std > 0, (r - r.mean(-1, keepdim=True)) / (std + 1e-6), torch.zeros_like(r))
    return adv.view(-1)


def _reference(policy_model, ref_model, kept, advantages, old, kl_coef, eps):
    from gspo_megatron.algorithms import gspo_loss

    policy_model.zero_grad()
    lp, mask = _tempered_logprobs(policy_model, kept)
    engine = torch.zeros_like(lp)
    for i, s in enumerate(kept):
        engine[i, :len(s.response_logprobs)] = torch.tensor(s.response_logprobs)
    old_lp = lp.detach() if old == "recompute" else engine
    opts = {}
    if kl_coef:
        with torch.no_grad():
            ref_lp, _ = _tempered_logprobs(ref_model, kept)
        opts = dict(ref_log_probs=ref_lp, kl_coef=kl_coef)
    loss, m = gspo_loss(lp, old_lp, torch.tensor(advantages, dtype=torch.float32), mask, eps_low=eps[0],
                        eps_high=eps[1], **opts)
    loss.backward()
    grads = hub_named_grads(policy_model)
    policy_model.zero_grad()
    return grads, {k: float(v) for k, v in m.items()}, lp.detach().double(), engine.double(), mask


CASES = [
    # TP2+SP (the demo's layout), π_old recomputed, the frozen reference model for kl_coef
    pytest.param(["loss.old_logprobs=recompute", "loss.kl_coef=0.2"], "recompute", (3e-4, 4e-4), id="recompute-kl-tp2sp"),
    # CP2 (packed, zigzag): π_old, π_ref and the mismatch sums of sequences split over two ranks
    pytest.param(["loss.old_logprobs=recompute", "loss.kl_coef=0.2", "parallel.tp=1", "parallel.sequence_parallel=false",
                  "parallel.cp=2"], "recompute", (3e-4, 4e-4), id="recompute-kl-cp2"),
    # PP2, π_old = the engine's log-probs (paper §5.4), which then differ from the policy's
    pytest.param(["loss.old_logprobs=engine", "loss.kl_coef=0.2", "parallel.tp=1", "parallel.sequence_parallel=false",
                  "parallel.pp=2", "loss.eps_low=0.01", "loss.eps_high=0.012"], "engine", (0.01, 0.012),
                 id="engine-kl-pp2"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overrides,old,eps", CASES)
def test_loop_step_matches_single_process_reference(tmp_path, overrides, old, eps):
    hf_dir = str(tmp_path / "hf")
    initial = make_tiny_hf(hf_dir, **_tiny_arch())
    policy, second, third, after = run_distributed(_rank_loop_steps, 2, hf_dir, str(tmp_path / "run"), overrides,
                                                   timeout=360)[0]
    kl_coef = 0.2

    # dynamic sampling really filtered: more groups were generated than kept, every kept group
    # has reward variance, and the step kept exactly P groups
    st = second["stats"]
    assert st["groups_kept"] == P and st["rollout_rounds"] > 1, st
    rewards = second["rewards"]
    assert all(len(set(rewards[g * G:(g + 1) * G])) > 1 for g in range(P)), rewards
    # group advantages of the kept groups (float64 formula, not the library's)
    adv = _advantages64(rewards, G)
    assert torch.allclose(torch.tensor(second["advantages"], dtype=torch.float64), adv, atol=1e-6)

    model = _hf_with(hf_dir, policy, str(tmp_path / "policy"))
    ref_grads, ref_m, lp, engine, mask = _reference(model, initial, second["kept"], adv.tolist(), old, kl_coef, eps)
    rel, name = rel_diff(second["grads"], ref_grads)
    print(f"{old}: max rel grad diff {rel:.2e} ({name}); loss {second['metrics']['loss']:.6f} vs {ref_m}")
    assert rel < RTOL, (rel, name)
    assert second["metrics"]["kl_ref"] == pytest.approx(ref_m["kl_ref"], rel=1e-4, abs=1e-7)
    assert second["metrics"]["clip_frac"] == pytest.approx(ref_m["clip_frac"], abs=1e-6)
    # non-vacuous: the KL term and the choice of π_old both move the gradient far beyond RTOL
    no_kl = _reference(model, initial, second["kept"], adv.tolist(), old, 0.0, eps)[0]
    assert rel_diff(no_kl, ref_grads)[0] > SEVERAL
    other = {"recompute": "engine", "engine": "recompute"}[old]
    assert rel_diff(_reference(model, initial, second["kept"], adv.tolist(), other, kl_coef, eps)[0],
                    ref_grads)[0] > SEVERAL
    if old == "engine":
        assert 0 < ref_m["clip_frac"] < 1, ref_m
        assert "mismatch_logprob_abs" not in second["metrics"]  # no trainer pass to compare with
        return

    # mismatch metrics (engine still at the initial weights, trainer one step further) against
    # float64 formulas on the reference's log-probs
    d = (lp - engine)[mask]
    m = second["metrics"]
    assert m["mismatch_logprob_abs"] == pytest.approx(float(d.abs().mean()), rel=1e-3)
    assert m["mismatch_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-2)
    seq = ((lp - engine) * mask).sum(-1) / mask.sum(-1)
    assert m["mismatch_seq_ratio_max"] == pytest.approx(float(seq.abs().max()), rel=1e-3)
    assert m["mismatch_logprob_max"] == pytest.approx(float(d.abs().max()), rel=1e-3)
    assert m["mismatch_logprob_max"] > 1e-3  # the stale engine is visible ...
    # ... and after the push the engine serves exactly the trainer's weights
    assert third["metrics"]["mismatch_logprob_max"] < 1e-5, third["metrics"]
    assert any(not torch.equal(after[k], policy[k]) for k in policy)  # (and training went on)


def _tiny_arch():
    """The demo config's architecture (tiny_cpu.yaml), so its tokenizer and layout apply."""
    import yaml

    with open(TINY) as f:
        hf = yaml.safe_load(f)["model"]["hf_config"]
    return {k: v for k, v in hf.items()}


def _rank_first_minibatch_pi_old(rank, world, hf_dir, out_dir, minibatches, full_pass):
    """One GSPO step from the checkpoint; `full_pass` forces the forward-only π_old pass over every
    minibatch (what the loop did before the first minibatch took π_old from its own forward)."""
    from gspo_megatron.resolve import load_config
    from gspo_megatron.model.export import iter_hf_tensors
    from gspo_megatron.train import loop
    from gspo_megatron.train.setup import setup_run

    cfg = load_config(TINY, [f"out_dir={out_dir}", f"model.hf_dir={hf_dir}", "model.hf_config=null",
                             f"train.minibatches_per_step={minibatches}", "rollout.prompts_per_step=4",
                             "rollout.samples_per_prompt=4", "train.micro_batch_tokens=128"])
    parts = setup_run(cfg, world_size=world)
    real = loop._routing_controlled
    calls = []
    real_pass = loop.old_logprobs_pass

    def counted_pass(parts_, samples_, flat):
        calls.append(len(flat))
        return real_pass(parts_, samples_, flat)

    if full_pass:
        loop._routing_controlled = lambda *a: True
    loop.old_logprobs_pass = counted_pass
    try:
        loop.push_weights(parts, 0)
        payload = None
        if rank == 0:
            kept, rewards, _ = loop.rollout(parts, 0)
            payload = loop.to_train_samples(kept, rewards, 4)
        samples = loop._broadcast(payload)
        metrics = loop.gspo_step(parts, samples)
        weights = {k: t.clone() for k, t in iter_hf_tensors(parts.model, parts.ctx, parts.arch)}
    finally:
        loop._routing_controlled = real
        loop.old_logprobs_pass = real_pass
        parts.close()
    return (metrics, weights, calls) if rank == 0 else None


@pytest.mark.parametrize("minibatches", [4, 1])
def test_first_minibatch_takes_pi_old_from_its_own_forward(tmp_path, minibatches):
    """π_old of the step's first minibatch comes from its update's forward (same weights, same
    microbatches, no dropout), so the π_old pass covers the other minibatches only (none with
    one minibatch a step), packed together into fewer microbatches and copied back row by row.
    At TP2+SP with several microbatches per minibatch, against the full per-minibatch π_old
    pass: with one minibatch, bit for bit the same loss, clip fraction, mismatch metrics and
    weights after the update; with four, the same to last-bit GEMM differences."""
    hf_dir = str(tmp_path / "hf")
    make_tiny_hf(hf_dir)
    out = {}
    for full in (False, True):
        out[full] = run_distributed(_rank_first_minibatch_pi_old, 2, hf_dir, str(tmp_path / f"run{int(full)}"),
                                    minibatches, full)[0]
    (m_new, w_new, calls_new), (m_old, w_old, calls_old) = out[False], out[True]
    per_mb = calls_old[0] // minibatches
    assert calls_old == [minibatches * per_mb] and per_mb >= 2, calls_old  # several microbatches each
    if minibatches > 1:  # the other minibatches in one pass, packed into fewer microbatches (one DP rank)
        assert len(calls_new) == 1 and calls_new[0] < calls_old[0] - per_mb, (calls_new, calls_old)
    else:
        assert calls_new == [], calls_new
    keys = [k for k in m_old if not k.startswith("t_")]
    assert "mismatch_logprob_abs" in keys and "clip_frac" in keys
    assert w_new.keys() == w_old.keys()
    if minibatches == 1:  # the first minibatch only: bit for bit
        assert {k: m_new[k] for k in keys} == {k: m_old[k] for k in keys}
        assert all(torch.equal(w_new[k], w_old[k]) for k in w_old)
        return
    # the later minibatches' π_old from other microbatch shapes: the same math, GEMMs of other
    # sizes (last-bit differences, ~1e-7 in a log-prob); a 1e-4 error in π_old moves these by ~1e-4
    for k in keys:
        assert m_new[k] == pytest.approx(m_old[k], rel=1e-5, abs=1e-6), (k, m_new[k], m_old[k])
    for k in w_old:
        torch.testing.assert_close(w_new[k], w_old[k], rtol=1e-5, atol=1e-6, msg=k)
