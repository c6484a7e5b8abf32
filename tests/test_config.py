"""Typed config: YAML + dotted overrides, defaults, validation errors, presets."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys
import warnings

import pytest
import yaml

from gspo_megatron import resolve
from gspo_megatron.config import (
    CheckpointConfig,
    Config,
    ConfigError,
    ConfigWarning,
    DataConfig,
    LoggingConfig,
    LossConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RolloutConfig,
    SGLangConfig,
    TrainConfig,
)
from gspo_megatron.resolve import load_config

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = sorted(glob.glob(os.path.join(ROOT, "launch", "configs", "*.yaml")))
TINY = os.path.join(ROOT, "launch", "configs", "tiny_cpu.yaml")

HF_TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
}


def write(tmp_path, data, name="c.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(p)


def minimal(tmp_path, **extra):
    return write(tmp_path, {"model": {"hf_config": dict(HF_TINY)}, **extra})


def err(path, overrides=()) -> str:
    with pytest.raises(ConfigError) as ei:
        load_config(path, list(overrides))
    msg = str(ei.value)
    assert "\n" not in msg, "ConfigError messages are one line"
    return msg


# ---- defaults and presets ------------------------------------------------------------------


def test_defaults_load(tmp_path):
    cfg = load_config(minimal(tmp_path), [])
    assert cfg.parallel == ParallelConfig()
    assert cfg.rollout == RolloutConfig()
    assert cfg.rollout.sglang == SGLangConfig() and cfg.rollout.sglang.host == "127.0.0.1"
    assert cfg.data == DataConfig() and cfg.reward == RewardConfig()
    assert cfg.optimizer == OptimizerConfig() and cfg.train == TrainConfig()
    assert cfg.checkpoint == CheckpointConfig() and cfg.logging == LoggingConfig()
    assert cfg.loss == LossConfig(old_logprobs="recompute")  # null resolves to recompute (synchronous loop) ...
    assert (cfg.loss.type, cfg.loss.eps_low, cfg.loss.eps_high) == ("gspo", 3e-4, 4e-4)
    # ... and to the engine's (behaviour-policy) log-probs with async rollouts, unless set
    assert load_config(minimal(tmp_path), ["rollout.async_steps=1"]).loss.old_logprobs == "engine"
    assert load_config(minimal(tmp_path), ["rollout.async_steps=1",
                                           "loss.old_logprobs=recompute"]).loss.old_logprobs == "recompute"
    assert "loss.tis_cap needs" in err(minimal(tmp_path), ["rollout.async_steps=1", "loss.tis_cap=2"])
    assert cfg.train.minibatches_per_step == 4 and cfg.checkpoint.resume == "auto"
    assert cfg.model.hf_config == HF_TINY and cfg.model.hf_dir is None
    assert cfg.out_dir == "runs/gspo"


def test_empty_sections_mean_defaults(tmp_path):
    p = write(tmp_path, "model:\n  hf_config: %s\nparallel:\ntrain:\n" % json.dumps(HF_TINY))
    cfg = load_config(p, [])
    assert cfg.parallel == ParallelConfig() and cfg.train == TrainConfig()


def test_no_architecture_is_an_error():
    assert "model.hf_dir" in err(None) and "model.hf_config" in err(None)


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_every_preset_loads(path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)  # presets must not trigger warnings
        cfg = load_config(path, [])
    assert cfg.model.hf_config
    # Round trip through the resolved YAML the trainer saves into out_dir.
    again = Config.from_dict(yaml.safe_load(cfg.to_yaml()))
    assert again == cfg


def test_expected_presets_exist():
    names = {os.path.basename(p) for p in PRESETS}
    assert {"tiny_cpu.yaml", "qwen3_30b_a3b.yaml", "qwen3_235b_a22b.yaml",
            "qwen3_30b_a3b_cpu_scaled.yaml"} <= names


@pytest.mark.parametrize(
    "name,world",
    [("tiny_cpu", 2), ("qwen3_30b_a3b_cpu_scaled", 2), ("qwen3_30b_a3b", 8),
     ("qwen3_30b_a3b", 16), ("qwen3_235b_a22b", 128)],
)
def test_presets_fit_their_worlds(name, world):
    cfg = load_config(os.path.join(ROOT, "launch", "configs", name + ".yaml"), [])
    resolve.validate_world(cfg, world, cfg.model.hf_config)
    resolve.validate_world(cfg, world)  # same, resolving the architecture itself


def test_cpu_scaled_keeps_30b_structure():
    big = load_config(os.path.join(ROOT, "launch/configs/qwen3_30b_a3b.yaml"), []).model.hf_config
    small = load_config(
        os.path.join(ROOT, "launch/configs/qwen3_30b_a3b_cpu_scaled.yaml"), []
    ).model.hf_config
    assert small["head_dim"] == big["head_dim"]
    ratio = lambda h, a, b: h[a] / h[b]  # noqa: E731
    for a, b in [("num_attention_heads", "num_key_value_heads"), ("num_experts", "num_experts_per_tok"),
                 ("moe_intermediate_size", "hidden_size")]:
        assert ratio(small, a, b) == ratio(big, a, b), (a, b)
    assert small["num_attention_heads"] * small["head_dim"] / small["hidden_size"] == (
        big["num_attention_heads"] * big["head_dim"] / big["hidden_size"]
    )
    assert small["hidden_size"] < big["hidden_size"] and small["num_experts"] < big["num_experts"]


# ---- overrides -----------------------------------------------------------------------------


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(
        minimal(tmp_path),
        [
            "train.max_steps=5",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "rollout.sglang.urls=[http://a:1,http://b:2]",
            "out_dir=runs/x",
            "optimizer.lr=3e-4",  # YAML 1.1 reads this as a string; the float field accepts it
            "model.hf_config.num_hidden_layers=4",
            "reward.fn=my_pkg.rewards:score",
            "loss.tis_cap=null",
        ],
    )
    assert cfg.train.max_steps == 5 and cfg.parallel.tp == 2 and cfg.parallel.sequence_parallel
    assert cfg.rollout.sglang.urls == ["http://a:1", "http://b:2"]
    assert cfg.out_dir == "runs/x" and cfg.optimizer.lr == 3e-4
    assert cfg.model.hf_config["num_hidden_layers"] == 4 and cfg.model.hf_config["hidden_size"] == 64
    assert cfg.reward.fn == "my_pkg.rewards:score" and cfg.loss.tis_cap is None


def test_later_override_wins_and_single_url_becomes_list(tmp_path):
    cfg = load_config(minimal(tmp_path), ["train.max_steps=5", "train.max_steps=7",
                                          "rollout.sglang.urls=http://h:30000"])
    assert cfg.train.max_steps == 7 and cfg.rollout.sglang.urls == ["http://h:30000"]


@pytest.mark.parametrize("bad", ["train", "train.max_steps", "=3", "a..b=1"])
def test_malformed_override(tmp_path, bad):
    err(minimal(tmp_path), [bad])


# ---- unknown keys and types ----------------------------------------------------------------


def test_unknown_key_in_file_names_full_key_and_valid_ones(tmp_path):
    p = minimal(tmp_path, rollout={"sglang": {"urlz": ["http://a:1"]}})
    msg = err(p)
    assert "rollout.sglang.urlz" in msg and "urls" in msg and "weight_sync" in msg


def test_unknown_top_level_key(tmp_path):
    msg = err(minimal(tmp_path, trian={"max_steps": 3}))
    assert "'trian'" in msg and "train" in msg and "out_dir" in msg


def test_unknown_key_in_override(tmp_path):
    msg = err(minimal(tmp_path), ["train.max_step=5"])
    assert "train.max_step" in msg and "train.max_steps" in msg and "micro_batch_tokens" in msg
    msg = err(minimal(tmp_path), ["parallel.dp=2"])
    assert "parallel.dp" in msg and "sequence_parallel" in msg


def test_unknown_hf_config_field(tmp_path):
    msg = err(minimal(tmp_path), ["model.hf_config.num_expert=8"])
    assert "model.hf_config.num_expert" in msg


def test_override_into_a_scalar(tmp_path):
    assert "out_dir" in err(minimal(tmp_path), ["out_dir.x=1"])


@pytest.mark.parametrize(
    "override,key",
    [
        ("parallel.tp=two", "parallel.tp"),
        ("parallel.tp=1.5", "parallel.tp"),
        ("train.max_steps=true", "train.max_steps"),
        ("rollout.dynamic_sampling=3", "rollout.dynamic_sampling"),
        ("optimizer.lr=fast", "optimizer.lr"),
        ("rollout.sglang.urls={a: 1}", "rollout.sglang.urls"),
        ("loss.type=ppo", "loss.type"),
        ("model.dtype=fp8", "model.dtype"),
        ("model.hf_config=3", "model.hf_config"),
        ("rollout=3", "rollout"),
    ],
)
def test_wrong_type_names_the_key(tmp_path, override, key):
    assert key in err(minimal(tmp_path), [override])


def test_bad_yaml_file(tmp_path):
    assert "YAML" in err(write(tmp_path, "model: [unclosed"))
    assert "mapping" in err(write(tmp_path, "- a\n- b\n"))
    assert "does not exist" in err(str(tmp_path / "nope.yaml"))


# ---- loss ----------------------------------------------------------------------------------


def test_grpo_eps_defaults(tmp_path):
    cfg = load_config(minimal(tmp_path), ["loss.type=grpo"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (0.2, 0.27)
    cfg = load_config(minimal(tmp_path), ["loss.type=gspo_token"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (3e-4, 4e-4)
    # A user-set value is kept; the other side still gets the loss's default.
    cfg = load_config(minimal(tmp_path), ["loss.type=grpo", "loss.eps_high=0.28"])
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (0.2, 0.28)


def test_grpo_sized_clipping_on_gspo_warns(tmp_path):
    with pytest.warns(ConfigWarning, match="GSPO"):
        load_config(minimal(tmp_path), ["loss.eps_low=0.2", "loss.eps_high=0.2"])
    with pytest.warns(ConfigWarning, match="grpo"):
        load_config(minimal(tmp_path), ["loss.type=grpo", "loss.eps_low=3e-4", "loss.eps_high=4e-4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        load_config(minimal(tmp_path), ["loss.eps_high=1e-3"])


def test_loss_checks(tmp_path):
    assert "loss.tis_cap" in err(minimal(tmp_path), ["loss.tis_cap=2", "loss.old_logprobs=engine"])
    load_config(minimal(tmp_path), ["loss.tis_cap=2", "loss.old_logprobs=recompute"])
    assert "loss.kl_coef" in err(minimal(tmp_path), ["loss.kl_coef=-0.1"])
    assert "loss.eps_low" in err(minimal(tmp_path), ["loss.eps_low=1.5"])
    assert load_config(minimal(tmp_path), ["loss.mis=[-0.05,0.05]"]).loss.mis == [-0.05, 0.05]
    assert "loss.mis must be [low, high]" in err(minimal(tmp_path), ["loss.mis=[0.05,-0.05]"])
    assert "loss.mis must be [low, high]" in err(minimal(tmp_path), ["loss.mis=[0.05]"])
    assert "loss.mis needs loss.old_logprobs=recompute" in err(minimal(tmp_path), ["loss.mis=[-1,1]",
                                                                                   "loss.old_logprobs=engine"])
    # kl_coef is kept for every loss type (not silently dropped for GSPO).
    with pytest.warns(ConfigWarning, match="reference"):
        cfg = load_config(minimal(tmp_path), ["loss.kl_coef=0.01"])
    assert cfg.loss.kl_coef == 0.01 and cfg.loss.type == "gspo"


# ---- cross-checks --------------------------------------------------------------------------


def test_minibatch_divisibility(tmp_path):
    msg = err(minimal(tmp_path), ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=3"])
    assert "minibatches_per_step" in msg and "9" in msg
    load_config(minimal(tmp_path), ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=4"])


def test_layout_that_does_not_divide_the_model(tmp_path):
    p = minimal(tmp_path)
    assert "4 attention heads" in err(p, ["parallel.tp=3", "parallel.sequence_parallel=true"])
    assert "2 key/value heads" in err(p, ["parallel.tp=4", "parallel.sequence_parallel=true"])
    assert "8 experts" in err(p, ["parallel.ep=3"])
    assert "layers" in err(p, ["parallel.pp=3"])
    assert "experts' width" in err(p, ["parallel.etp=3"])
    assert "sequence_parallel" in err(p, ["parallel.tp=2"])
    assert "sequence_parallel" in err(p, ["parallel.sequence_parallel=true"])  # needs tp > 1
    assert "parallel.tp" in err(p, ["parallel.tp=0"])
    # The world size is checked separately (it is unknown at load time).
    cfg = load_config(p, ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4"])
    resolve.validate_world(cfg, 4)
    with pytest.raises(ConfigError, match="not divisible"):
        resolve.validate_world(cfg, 3)
    with pytest.raises(ConfigError, match="ep"):
        resolve.validate_world(cfg, 2)
    with pytest.raises(ConfigError, match="6 experts"):
        resolve.validate_world(cfg, 4, {**HF_TINY, "num_experts": 6})


def test_sglang_settings_only_checked_for_sglang(tmp_path):
    p = minimal(tmp_path)
    load_config(p, ["rollout.backend=hf", "rollout.sglang.urls=[not-a-url]"])
    assert "rollout.sglang.urls" in err(p, ["rollout.backend=sglang"])
    assert "rollout.sglang.urls[1]" in err(
        p, ["rollout.backend=sglang", "rollout.sglang.urls=[http://a:1,b:2]"]
    )
    assert "not both" in err(
        p, ["rollout.backend=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.launch=true"]
    )
    # Launching needs a model on disk; tensor sync needs colocated servers.
    assert "model_path" in err(p, ["rollout.backend=sglang", "rollout.sglang.launch=true"])
    load_config(p, ["rollout.backend=sglang", "rollout.sglang.launch=true",
                    f"rollout.sglang.model_path={tmp_path}", "rollout.sglang.weight_sync=tensor"])
    assert "weight_sync" in err(p, ["rollout.backend=sglang", "rollout.sglang.urls=[http://a:1]",
                                    "rollout.sglang.weight_sync=tensor"])
    # Colocated servers share rank 0's GPU: an NCCL weight-update group cannot hold it twice.
    msg = err(p, ["rollout.backend=sglang", "rollout.sglang.launch=true", f"rollout.sglang.model_path={tmp_path}",
                  "rollout.sglang.weight_sync=distributed"])
    assert "weight_sync=distributed" in msg and "tensor" in msg and "disk" in msg and "\n" not in msg
    assert "mem_fraction" in err(p, ["rollout.backend=sglang", "rollout.sglang.urls=[http://a:1]",
                                     "rollout.sglang.mem_fraction=1.5"])
    cfg = load_config(p, ["rollout.backend=sglang", "rollout.sglang.urls=[https://a.b:443/]"])
    assert cfg.rollout.sglang.urls == ["https://a.b:443/"]


def test_data_path_must_exist(tmp_path):
    p = minimal(tmp_path)
    missing = str(tmp_path / "prompts.jsonl")
    msg = err(p, ["data.source=file", f"data.path={missing}", "reward.fn=math"])
    assert missing in msg and "data.path" in msg
    assert "data.path" in err(p, ["data.source=file", "reward.fn=math"])
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    load_config(p, ["data.source=file", f"data.path={missing}", "reward.fn=math"])
    # File data has no synthetic task reward to fall back on.
    assert "reward.fn" in err(p, ["data.source=file", f"data.path={missing}"])


@pytest.mark.parametrize("fn,ok", [("math", True), ("pkg.mod:score", True), ("mod:f", True),
                                   ("pkg.mod", False), ("pkg.mod:", False), ("a b:c", False),
                                   (":f", False)])
def test_reward_fn_syntax(tmp_path, fn, ok):
    o = [f"reward.fn={fn}"]
    if ok:
        assert load_config(minimal(tmp_path), o).reward.fn == fn
    else:
        assert "reward.fn" in err(minimal(tmp_path), o)


def test_other_range_checks(tmp_path):
    p = minimal(tmp_path)
    assert "samples_per_prompt" in err(p, ["rollout.samples_per_prompt=1"])
    assert "micro_batch_tokens" in err(p, ["train.micro_batch_tokens=64"])
    assert "min_lr" in err(p, ["optimizer.min_lr=1"])
    assert "top_p" in err(p, ["rollout.top_p=0"])
    assert "checkpoint.resume" in err(p, [f"checkpoint.resume={tmp_path}/nope"])
    load_config(p, [f"checkpoint.resume={tmp_path}", "checkpoint.resume=never"])


def test_hf_dir_architecture(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    p = minimal(tmp_path)
    assert "config.json" in err(p, [f"model.hf_dir={hf}"])
    (hf / "config.json").write_text(json.dumps({**HF_TINY, "architectures": ["Qwen3MoeForCausalLM"],
                                                "some_future_field": 1}))
    cfg = load_config(p, [f"model.hf_dir={hf}"])
    assert resolve.hf_config_dict(cfg)["some_future_field"] == 1  # config.json is not key-checked
    # hf_dir alone is enough.
    cfg = load_config(None, [f"model.hf_dir={hf}"])
    assert resolve.arch_of(cfg).num_experts == 8
    # An inline field that disagrees with the checkpoint is an error naming it.
    msg = err(p, [f"model.hf_dir={hf}", "model.hf_config.num_hidden_layers=4"])
    assert "model.hf_config.num_hidden_layers" in msg
    # The layout is checked against hf_dir's architecture.
    (hf / "config.json").write_text(json.dumps({**HF_TINY, "num_attention_heads": 6}))
    assert "attention heads" in err(None, [f"model.hf_dir={hf}", "parallel.tp=4",
                                               "parallel.sequence_parallel=true"])


def test_hf_config_structure(tmp_path):
    p = minimal(tmp_path)
    assert "num_key_value_heads" in err(p, ["model.hf_config.num_key_value_heads=3"])
    assert "num_experts_per_tok" in err(p, ["model.hf_config.num_experts_per_tok=9"])
    missing = {k: v for k, v in HF_TINY.items() if k != "vocab_size"}
    assert "vocab_size" in err(write(tmp_path, {"model": {"hf_config": missing}}))


def test_dump_yaml_round_trip(tmp_path):
    cfg = load_config(TINY, ["loss.type=grpo", "rollout.sglang.urls=[http://a:1]"])
    out = tmp_path / "run" / "config.yaml"
    cfg.dump_yaml(str(out))
    again = load_config(str(out), [])
    assert again == cfg and again.to_dict() == cfg.to_dict()
    d = cfg.to_dict()
    assert d["loss"]["eps_low"] == 0.2 and d["parallel"]["tp"] == 2
    assert set(d) == {f.name for f in dataclasses.fields(Config)}


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe"])
def test_inline_keys_cover_transformers(model_type):
    """Every argument of the family's transformers config class may be given inline."""
    tr = pytest.importorskip("transformers")
    import inspect

    from gspo_megatron.model.family import family_of_type

    family = family_of_type(model_type)
    cls = tr.AutoConfig.for_model(model_type).__class__
    if dataclasses.is_dataclass(cls):
        own = [f.name for f in dataclasses.fields(cls)]
    else:
        sig = inspect.signature(cls.__init__).parameters
        own = [n for n, p in sig.items() if p.kind == p.KEYWORD_ONLY]
    own = [n for n in own if not n.startswith("_")]
    base = {f.name for f in dataclasses.fields(tr.PretrainedConfig)} if dataclasses.is_dataclass(
        tr.PretrainedConfig) else set()
    own = [n for n in own if n not in base or n in family.inline_keys]
    assert own and set(own) <= family.inline_keys, set(own) - family.inline_keys


def test_import_has_no_side_effects():
    code = (
        "import sys, gspo_megatron.config, gspo_megatron.planner; "
        "bad = [m for m in ('torch', 'megatron', 'transformers') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]" and out.stderr == ""


def test_config_reference_is_current_and_complete():
    """docs/config.md is generated from config.py: a key added without regenerating it, or without
    the comment that gives its meaning, fails here."""
    from dataclasses import dataclass

    from gspo_megatron import config_reference as ref

    entries = ref.entries()
    assert len(entries) > 70 and all(e["meaning"] for e in entries), [e["key"] for e in entries if not e["meaning"]]
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")) as f:
        assert f.read() == ref.render_markdown(), "docs/config.md is stale: python -m gspo_megatron.config_reference > docs/config.md"

    @dataclass(frozen=True)
    class WithUndocumentedKey:
        # Documented.
        a: int = 1

        b: int = 2  # a key added without the comment above it

        def __post_init__(self):
            pass

    got = {e["key"]: e["meaning"] for e in ref.entries(WithUndocumentedKey)}
    assert got == {"a": "Documented.", "b": ""}  # the check above would name "b"


def test_train_help_lists_every_key():
    import subprocess
    import sys

    from gspo_megatron.config_reference import entries

    r = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0
    missing = [e["key"] for e in entries() if f"  {e['key']} = " not in r.stdout]
    assert not missing, missing
    assert "--dry-run" in r.stdout


# ---- collective timeout ----------------------------------------------------------------------


def test_collective_timeout_outlasts_rank0_engine_waits(tmp_path, monkeypatch):
    """Rank 0 waits for the engine alone while the other ranks sit in a collective: the process
    groups' timeout comes from the config's own bounds (the 30-minute default was shorter than
    async_timeout_s = 3600 s, so NCCL's watchdog would kill a healthy run), and it reaches
    torch.distributed and Megatron's groups."""
    from gspo_megatron.config import COLLECTIVE_TIMEOUT_MARGIN_S, DEFAULT_COLLECTIVE_TIMEOUT_S

    p = minimal(tmp_path)
    assert load_config(p).collective_timeout_s() == (DEFAULT_COLLECTIVE_TIMEOUT_S, {})  # hf: nothing bounded
    t, waits = load_config(p, ["rollout.async_steps=1", "rollout.async_timeout_s=7200"]).collective_timeout_s()
    assert t == 7200 + COLLECTIVE_TIMEOUT_MARGIN_S and list(waits.values()) == [7200]
    sg = ["rollout.backend=sglang", "rollout.sglang.urls=[http://a:1]", "rollout.sglang.request_timeout_s=1000",
          "rollout.sglang.max_retries=2", "rollout.sglang.concurrency=4", "rollout.prompts_per_step=8"]
    request = 3 * 1000 + 0.5 + 1.0  # 3 attempts, back-offs 0.5 s and 1 s
    t, waits = load_config(p, sg + ["rollout.dynamic_sampling=true", "rollout.max_oversample_rounds=2",
                                    "eval.interval=5", "eval.num_prompts=6"]).collective_timeout_s()
    # push + 3 rounds x 2 waves of 4 prompt groups + eval (2 waves)
    assert t == request * (1 + 3 * 2 + 2) + COLLECTIVE_TIMEOUT_MARGIN_S, waits
    t, _ = load_config(p, sg + ["rollout.async_steps=2", "rollout.async_timeout_s=5000"]).collective_timeout_s()
    assert t == request + 5000 + COLLECTIVE_TIMEOUT_MARGIN_S

    # init_parallel hands it to torch.distributed and Megatron
    import torch.distributed as dist

    from gspo_megatron.parallel import state

    seen = {}

    class Stop(Exception):
        pass

    def fake_init(backend, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = load_config(p, ["rollout.async_steps=1", "rollout.async_timeout_s=7200", "parallel.device=cpu"])
    with pytest.raises(Stop):
        state.init_parallel(cfg.parallel, timeout_s=cfg.collective_timeout_s()[0])
    assert seen["timeout"].total_seconds() == 7200 + COLLECTIVE_TIMEOUT_MARGIN_S


def test_planner_reports_the_host_memory_colocated_engines_need():
    """Colocated SGLang parks every rank's gradient buffers and, with 16-bit parameters, its
    optimizer state (fp32 masters + Adam moments) in host memory (rollout/colocate.py): the plan
    says how much per GPU, from its own per-stage terms, and the dry run prints it."""
    from gspo_megatron import planner

    path = os.path.join(ROOT, "launch", "configs", "qwen3_30b_a3b.yaml")
    for dtype, with_opt in (("bfloat16", True), ("float32", False)):
        pl = planner.plan(load_config(path, [f"model.dtype={dtype}"]), 16)
        want = max(st["memory_gib"]["gradients"] + (st["memory_gib"]["optimizer"] if with_opt else 0)
                   for st in pl["stages"])
        assert pl["colocated_host_gib_per_gpu"] == pytest.approx(want) and want > 1
    # 16 GPUs, bf16: 16.4 GiB of fp32 gradients + 21.3 GiB of sharded optimizer state
    assert planner.plan(load_config(path, []), 16)["colocated_host_gib_per_gpu"] == pytest.approx(37.7, abs=0.1)


# ---- non-finite numbers (issue 40) ------------------------------------------------------------


def _float_keys() -> list[str]:
    """Every config key whose type holds a float (float, Optional[float], list[float]), from the
    generated reference: a new float field joins this test by construction."""
    from gspo_megatron.config_reference import entries

    import re

    # the word float outside quoted Literal values (rollout.vllm.dtype takes the string 'float')
    return [e["key"] for e in entries() if re.search(r"\bfloat\b", re.sub(r"'[^']*'|\"[^\"]*\"", "", e["type"]))]


def test_every_float_key_is_found():
    keys = _float_keys()
    assert {"optimizer.lr", "rollout.temperature", "reward.timeout_s", "loss.eps_low", "loss.mis"} <= set(keys)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "nan", "inf", "1e999"])
def test_non_finite_floats_are_refused_for_every_float_key(tmp_path, value):
    """`optimizer.lr=.inf` used to save NaN weights, `reward.timeout_s=.nan` disabled the timeout
    (NaN compares false with everything), `rollout.temperature=.nan` was a traceback in step 1."""
    p = minimal(tmp_path)
    for key in _float_keys():
        v = f"[{value}, 0.1]" if key == "loss.mis" else f"[0.5, {value}]" if key == "loss.icepop" else value
        msg = err(p, [f"{key}={v}"])
        assert key in msg and "finite" in msg, (key, msg)


def test_nan_cannot_pass_a_range_check_built_directly():
    """Dataclasses built in code (not through load_config) still refuse NaN: the range checks are
    written so that a NaN comparison fails."""
    nan = float("nan")
    for build in (lambda: OptimizerConfig(lr=nan), lambda: RewardConfig(timeout_s=nan),
                  lambda: RolloutConfig(temperature=nan), lambda: LossConfig(eps_high=nan),
                  lambda: OptimizerConfig(clip_grad=nan)):
        with pytest.raises(ConfigError):
            build()


def test_new_safety_keys_are_range_checked(tmp_path):
    p = minimal(tmp_path)
    assert "train.max_skipped_steps" in err(p, ["train.max_skipped_steps=0"])
    assert "data.max_record_bytes" in err(p, ["data.max_record_bytes=0"])
    assert "rollout.max_rejected_frac" in err(p, ["rollout.max_rejected_frac=1.5"])
    assert "loss.eps_high" in err(p, ["loss.eps_high=-0.1"])
    assert "rollout.temperature" in err(p, ["rollout.temperature=0"])
    c = load_config(p, ["checkpoint.require_checksums=true"])
    assert c.checkpoint.require_checksums and c.train.max_skipped_steps >= 1
