"""Everything a run needs, built once from the config: parallel state, policy, optimizer,
tokenizer, prompt source, reward, rollout engine (rank 0), optional reference model."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gspo_megatron import resolve
from gspo_megatron.resolve import read_load_source  # noqa: F401  (where the run reads model.load)
from gspo_megatron.errors import InputError
from gspo_megatron.model.arch import MoeArch
from gspo_megatron.train.batch import TrainSample

log = logging.getLogger("gspo_megatron.train")


# --------------------------------------------------------------------------------------------
# Prompts


class PromptSource:
    """Prompts for each step: a synthetic task (generated from a per-step seed, so a resumed run
    sees the same prompts) or a dataset file (a resumable shuffled stream).

    File data never stops a run: a record that is malformed (rollout/data.py record_problem), does
    not render with the tokenizer, or is longer than `max_prompt_tokens` (policy `long_prompts`:
    skip, or truncate keeping its end, where the chat template's generation prompt is) is skipped
    when the stream reaches it and counted (`take_skipped`, the step's `data_skipped`); the stream
    keeps the file's positions, so fixing a record in place does not shift a resumed run."""

    def __init__(self, data_cfg, tokenizer, seed: int, *, max_prompt_tokens: int | None = None,
                 max_record_bytes: int | None = None):
        from gspo_megatron.rollout.data import PromptStream, load_prompts
        from gspo_megatron.rollout.tasks import TASKS, SyntheticTask

        self.tokenizer = tokenizer
        self.seed = data_cfg.seed
        self.task = None
        self.stream = None
        self.max_prompt_tokens = max_prompt_tokens
        self.long_prompts = data_cfg.long_prompts
        self.skipped = 0  # since the last take_skipped()
        # an agent's `demonstration(example) -> [(text, trained on), ...]` (rollout.agent), for the warm start
        self.agent_demonstration = None
        self._ids: dict[int, list[int]] = {}  # id(record) -> its checked token ids
        self._reported = 0
        if data_cfg.source == "synthetic":
            if data_cfg.task not in TASKS:
                raise InputError(f"data.task: unknown synthetic task {data_cfg.task!r}; choose from {sorted(TASKS)}")
            self.task = SyntheticTask(data_cfg.task, seed=data_cfg.seed)
        else:
            self._problems: dict[int, str] = {}
            examples = load_prompts(data_cfg.path, prompt_key=data_cfg.prompt_key, answer_key=data_cfg.answer_key,
                                    skip_malformed=True, problems=self._problems,
                                    max_record_bytes=max_record_bytes)
            self.path = data_cfg.path
            self.prompt_key = data_cfg.prompt_key
            self._index = {id(ex): i for i, ex in enumerate(examples) if ex is not None}
            bad = sum(ex is None for ex in examples)
            if bad:
                log.warning("data.path %s: %d of %d records are malformed and will be skipped (--dry-run lists them)",
                            data_cfg.path, bad, len(examples))
            self.stream = PromptStream(examples, 1, seed=data_cfg.seed, source=f"data.path {data_cfg.path}")

    def batch(self, step: int, round_: int, n: int) -> list[dict]:
        if self.task is not None:
            return self.task.sample_prompts(n, random.Random(f"{self.seed}:{step}:{round_}"))
        out, misses = [], 0
        while len(out) < n:
            (ex,) = self.stream.next_batch(1)
            if self._check(ex)[0] is None:
                self.skipped += 1
                misses += 1
                if misses > len(self.stream.examples):
                    raise InputError(f"data.path {self.path}: every record is skipped (malformed, unrenderable or "
                                     "longer than data.max_prompt_tokens): run --dry-run to see why")
                continue
            out.append(ex)
        return out

    def take_skipped(self) -> int:
        n, self.skipped = self.skipped, 0
        return n

    def _check(self, ex) -> tuple[list[int] | None, str | None]:
        """(token ids, None) of a usable record, else (None, why)."""
        if ex is None:
            return None, "malformed"
        ids = self._ids.get(id(ex))
        if ids is not None:
            return ids, None
        try:
            ids = self._render(ex)
        except Exception as e:  # noqa: BLE001 - a user's template or data: skip, say why
            return None, f"does not render with the tokenizer's chat template: {type(e).__name__}: {e}"
        if not ids:
            return None, "renders to no tokens"
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            if self.long_prompts == "skip":
                return None, f"is {len(ids)} tokens, over data.max_prompt_tokens={self.max_prompt_tokens}"
            ids = ids[-self.max_prompt_tokens:]
        self._ids[id(ex)] = ids
        return ids, None

    def _render(self, example: dict) -> list[int]:
        from gspo_megatron.rollout.data import render_prompt

        key = "prompt" if self.task is not None else self.prompt_key
        return render_prompt(self.tokenizer, example[key])

    def text(self, example: dict):
        """The record's prompt as written (string or chat messages)."""
        return example["prompt" if self.task is not None else self.prompt_key]

    def encode(self, example: dict) -> list[int]:
        if self.task is not None:
            return self._render(example)
        ids, why = self._check(example)
        if ids is None:
            raise InputError(f"data.path {self.path}: record {self._index.get(id(example), -1) + 1} (1-based) {why}")
        return ids

    def check_render(self, n: int = 3) -> None:
        """The first `n` usable records through the tokenizer (file data): a wrong template fails
        the run in seconds instead of skipping everything."""
        if self.stream is None:
            return
        usable = [ex for ex in self.stream.examples if ex is not None][:n]
        for ex in usable:
            ids, why = self._check(ex)
            if ids is None and not why.startswith("is "):  # too long is data, not the template
                raise InputError(f"data.path {self.path}: record {self._index[id(ex)] + 1} (1-based) {why}")

    def check_all(self) -> dict:
        """Every record (--dry-run): counts, the first problems, seconds."""
        import time

        t0 = time.perf_counter()
        if self.stream is None:
            return {}
        problems = []
        for i, ex in enumerate(self.stream.examples, 1):
            _, why = self._check(ex)
            if why is not None:
                problems.append(f"record {i} {self._problems.get(i - 1, why)}")
        n = len(self.stream.examples)
        return {"records": n, "usable": n - len(problems), "skipped": len(problems), "first_problems": problems[:5],
                "seconds": time.perf_counter() - t0}

    def demonstrations(self, n: int, rng: random.Random) -> list[TrainSample]:
        if self.task is None:
            raise InputError("train.sft_warmup_steps > 0 needs a synthetic task (demonstrations)")
        eos = self.tokenizer.eos_token_id
        out = []
        for ex in self.task.sample_prompts(n, rng):
            if self.agent_demonstration is None:
                answer = self.tokenizer.encode(self.task.demonstration(ex), add_special_tokens=False) + [eos]
                out.append(TrainSample(self.encode(ex), answer, 0.0))
                continue
            ids, mask = [], []  # an agent's worked trajectory: its environment segments are not trained on
            for text, trained in self.agent_demonstration(ex):
                seg = self.tokenizer.encode(text, add_special_tokens=False)
                ids += seg
                mask += [bool(trained)] * len(seg)
            out.append(TrainSample(self.encode(ex), ids + [eos], 0.0, token_mask=mask + [True]))
        return out

    def state_dict(self) -> dict:
        return self.stream.state_dict() if self.stream is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.stream is not None and state:
            self.stream.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# Reward


def resolve_reward(cfg, task):
    """The run's RewardScorer (rollout/rewards.py), built before any heavy work: a bad
    module:function fails in seconds."""
    from gspo_megatron.rollout.rewards import RewardScorer

    r = cfg.reward
    judged = r.served  # a judge or a reward model
    fn_weight = r.fn_weight if r.fn_weight is not None else (0.0 if judged else 1.0)
    sources = []
    if fn_weight != 0 or not judged:
        spec = r.fn
        if spec is None:
            if task is None:
                raise InputError("reward.fn is required when data.source=file (or a reward.judge)")
            recipe = ("task", task.name, task.seed)
            fn = task.reward
        else:
            recipe, fn = (("math",) if spec == "math" else ("spec", spec)), None
        scorer = RewardScorer(recipe, workers=r.workers, timeout_s=r.timeout_s, max_error_frac=r.max_error_frac, fn=fn)
        if not judged:
            return scorer
        sources.append(("fn", scorer, fn_weight))
    from gspo_megatron.rollout.judge import CombinedScorer

    sources += served_reward_sources(cfg)
    return CombinedScorer(sources, r.max_error_frac)


def served_reward_sources(cfg) -> list[tuple[str, object, float]]:
    """The judge and the reward model that score the run's samples; launched servers start later,
    on rank 0 (setup_run: CombinedScorer.start_servers; rollout/reward_servers.py)."""
    from gspo_megatron.rollout.judge import JudgeScorer
    from gspo_megatron.rollout.reward_servers import RewardModelScorer

    r, keys = cfg.reward, dict(prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key)
    out: list[tuple[str, object, float]] = []
    if r.judge.enabled:
        out.append(("judge", JudgeScorer(r.judge, **keys), r.judge.weight))
    if r.model.enabled:
        out.append(("model", RewardModelScorer(r.model, **keys), r.model.weight))
    return out


# --------------------------------------------------------------------------------------------
# Reference policy (KL)


class ReferencePolicy:
    """A frozen copy of the initial policy, same layout, for ref log-probs when loss.kl_coef > 0.
    `base_of_lora`: `chunks` are the LoRA policy's own, whose frozen base is the initial policy:
    its log-probs are taken with the adapters off (model/lora.py disabled), no second copy."""

    def __init__(self, parts: "RunParts", chunks, *, base_of_lora: bool = False):
        self.parts = parts
        self.chunks = chunks
        self.base_of_lora = base_of_lora
        if not base_of_lora:
            for c in chunks:
                c.requires_grad_(False)

    def fill(self, microbatches, temperature: float) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from gspo_megatron.train.loss import fill_logprobs_step

        p = self.parts
        if self.base_of_lora:
            from gspo_megatron.model.lora import disabled

            off = disabled(self.chunks)
        else:
            off = contextlib.nullcontext()
        with torch.no_grad(), off:
            get_forward_backward_func()(
                forward_step_func=fill_logprobs_step(p.ctx, p.arch.vocab_size, temperature, "ref_logprobs"),
                data_iterator=iter(microbatches), model=self.chunks, num_microbatches=len(microbatches),
                seq_length=max(mb.seq_length for mb in microbatches),
                micro_batch_size=microbatches[0].micro_batch_size, forward_only=True,
            )


# --------------------------------------------------------------------------------------------


@dataclass
class RunParts:
    cfg: Any
    ctx: Any
    arch: MoeArch
    hf_config: dict
    dtype: torch.dtype
    model: list  # DDP-wrapped chunks
    optimizer: Any
    scheduler: Any
    tokenizer: Any
    prompts: PromptSource
    score: Callable
    engine: Any  # rank 0 only
    reference: ReferencePolicy | None
    colocation: Any  # rollout/colocate.py Colocation when the SGLang engines share our GPUs, else None
    seq_multiple: int
    pad_id: int
    stop_ids: list[int]
    routing_replay: bool = False  # the policy's routers carry Megatron's RouterReplay
    heldout: Any = None  # train/evaluation.py HeldOut (eval.interval > 0)
    agent: Any = None  # rollout/agent.py AgentRunner (rollout.agent), rank 0 uses it
    saves: Any = None  # train/async_save.py BackgroundSaves (checkpoint.async_save), every rank
    refit: Any = None  # train/refit_check.py RefitCheck (rollout.verify_weights), every rank
    # checkpoint/carried.py CarriedTensors: the MTP layers of the model's source, stored unchanged
    # in every checkpoint and export; None when the source has none
    carried: Any = None
    driver: Any = None  # rollout/drivers.py: this run's rollout driver (rollout.driver)
    # the LoRA groups whose adapters are pushed on their own (_adapter_groups), every rank
    adapter_groups: tuple[str, ...] = ()

    def rollout_context(self, generate=None):
        """What the rollout driver gets (rank 0): the engine's generate, or `generate` (partial
        rollouts' interruptible one)."""
        from gspo_megatron.rollout.drivers import RolloutContext, sampling_params

        return RolloutContext(cfg=self.cfg.rollout, engine=self.engine, generate=generate or self.engine.generate,
                              prompts=self.prompts, score=self.score, tokenizer=self.tokenizer,
                              sampling=sampling_params(self.cfg.rollout, self.stop_ids), seed=self.cfg.train.seed,
                              agent=self.agent, log_prompts=self.cfg.logging.prompts)

    def plan_rows(self, samples: list) -> tuple[list[list[int]], list]:
        """`plan`'s microbatches with, for each, the indices into `samples` of its rows."""
        from gspo_megatron.train.batch import plan_microbatches

        c = self.ctx
        return plan_microbatches(samples, dp=c.dp, dp_rank=c.dp_rank, token_budget=self.cfg.train.micro_batch_tokens,
                                 multiple=self.seq_multiple, pad_id=self.pad_id, cp=c.parallel.cp, cp_rank=c.cp_rank,
                                 packed=self.cfg.train.packing)

    def plan(self, samples: list) -> tuple[list, int]:
        """This rank's microbatches of one minibatch (DP, CP, packing as configured) and the
        minibatch's global sequence count (train/batch.py plan_minibatch)."""
        from gspo_megatron.train.batch import plan_minibatch

        c = self.ctx
        return plan_minibatch(samples, dp=c.dp, dp_rank=c.dp_rank, token_budget=self.cfg.train.micro_batch_tokens,
                              multiple=self.seq_multiple, pad_id=self.pad_id, cp=c.parallel.cp, cp_rank=c.cp_rank,
                              packed=self.cfg.train.packing)

    def export_config(self) -> dict:
        """config.json of the policy as an HF model (exports and checkpoints carry it), declaring
        the MTP layers they carry."""
        cfg = self.arch.family.hf_config(self.hf_config, mtp_layers=self.arch.mtp_layers if self.carried else 0)
        if self.tokenizer.eos_token_id is not None:
            cfg.setdefault("eos_token_id", self.tokenizer.eos_token_id)
            cfg.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        return cfg

    def save_checkpoint(self, step: int, loop_state: dict) -> str:
        """Collective: model, optimizer, scheduler, RNG and loop state at <out_dir>/checkpoints."""
        from gspo_megatron.train import checkpoint

        return checkpoint.save(self.cfg.out_dir, step, self.model, self.optimizer, self.scheduler, loop_state,
                               self.ctx, hf_config=self.export_config(), keep_last=self.cfg.checkpoint.keep_last,
                               tokenizer=self.tokenizer, background=self.saves, carried_tensors=self.carried,
                               lora=self.lora_meta())

    def wait_for_saves(self, why: str = "") -> float:
        """Collective in effect (the writer's own barriers): the background write in flight, if
        any, is complete and tracked when this returns; seconds waited."""
        return self.saves.wait(why) if self.saves is not None else 0.0

    def load_checkpoint(self, path: str) -> dict:
        from gspo_megatron.train import checkpoint

        return checkpoint.load(path, self.model, self.optimizer, self.scheduler, self.ctx, seed=self.cfg.train.seed,
                               arch=self.arch, require_checksums=self.cfg.checkpoint.require_checksums,
                               lora=self.lora_meta())

    def lora_meta(self) -> dict | None:
        """A LoRA run's adapters and base, as its checkpoints record them (train/checkpoint.py);
        None without LoRA. The base: the checkpoint the policy was read from (model.load, else
        model.hf_dir, absolute), or the random init's seed."""
        lc, mc = self.cfg.lora, self.cfg.model
        if not lc.rank:
            return None
        src = mc.load or mc.hf_dir
        base = {"path": os.path.abspath(src)} if src else {"init_seed": mc.init_seed}
        return {"rank": lc.rank, "alpha": float(lc.alpha), "dropout": lc.dropout,
                "target_modules": list(lc.target_modules), "init_seed": mc.init_seed, "base": base}

    def export_hf(self, out_dir: str) -> None:
        """Final policy as an HF checkpoint (collective; rank 0 writes)."""
        from gspo_megatron.model.export import iter_hf_tensors
        from gspo_megatron.model.hf_writer import save_hf_checkpoint

        stream = iter_hf_tensors(self.model, self.ctx, self.arch)
        if self.ctx.rank == 0:
            save_hf_checkpoint(stream, out_dir, self.export_config(), dtype=self.dtype, copy_from=self.cfg.model.hf_dir,
                               carried=self.carried.tensors() if self.carried else ())
            if not self.cfg.model.hf_dir:
                self.tokenizer.save_pretrained(out_dir)
            log.info("exported the policy to %s", out_dir)
        else:
            for _ in stream:
                pass

    def close(self) -> None:
        from gspo_megatron.parallel.state import destroy_parallel

        if hasattr(self.score, "close"):
            self.score.close()
        if self.engine is not None:
            self.engine.close()
        if self.colocation is not None:
            self.colocation.close()
        if self.saves is not None and self.saves.in_flight:  # a run ending in an error: the write in flight
            try:
                self.saves.wait("before the process groups are destroyed")
            except Exception as e:  # the run's own error is the one to report
                log.error("%s", e)
        if self.saves is not None and not self.saves.in_flight:
            self.saves.host.release()  # unpinned and freed with the run (a write still in flight keeps it)
        from gspo_megatron.parallel.ddp import release_model

        release_model(self.model)  # the model and its process groups freed with the run, not the process
        destroy_parallel()


def load_tokenizer(cfg, load=None):
    """model.tokenizer, else the first checkpoint directory with tokenizer files (model.load's
    hf_config/, model.hf_dir), else (synthetic task only) the project's local tokenizer. `load`:
    read_load_source(cfg)."""
    from transformers import AutoTokenizer

    if cfg.model.tokenizer:
        if not os.path.exists(os.path.join(cfg.model.tokenizer, "tokenizer_config.json")):
            raise InputError(f"model.tokenizer: {cfg.model.tokenizer} has no tokenizer_config.json")
        return AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    for _, d in cfg.model_sources(load):
        if os.path.exists(os.path.join(d, "tokenizer_config.json")):
            return AutoTokenizer.from_pretrained(d)
    if cfg.data.source != "synthetic":
        raise InputError("no tokenizer: set model.tokenizer (or use a model.load / model.hf_dir checkpoint that "
                         "carries tokenizer files)")
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    return build_tokenizer()


def _make_hf_engine(cfg, hf_config, tokenizer, dtype):
    from gspo_megatron.model.family import family_for
    from gspo_megatron.rollout.hf_engine import HFEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.model.hf_dir:
        return HFEngine(cfg.model.hf_dir, device=device, dtype=dtype, tokenizer=tokenizer,
                        return_routing=cfg.engine_routing)
    model = family_for(hf_config).reference_model(hf_config).to(dtype)  # weights pushed before use
    return HFEngine(model, device=device, tokenizer=tokenizer, return_routing=cfg.engine_routing)


def _make_sglang_engine(cfg, hf_config, tokenizer, dtype, urls: list[str] | None = None, api_key: str | None = None):
    """The SGLang engine of global rank 0: to the configured urls, or to the colocated servers'
    `urls` with their `api_key` (rollout/colocate.py started them). The engine gets the run's
    architecture (model.load's, model.hf_dir's or the inline one): disk sync writes it as the
    servers' config.json."""
    from gspo_megatron.rollout.sglang_engine import SGLangEngine

    from gspo_megatron.model.family import family_for

    overrides = None if urls is None else {"launch": False, "urls": list(urls), "api_key": api_key}
    arch = family_for(hf_config).hf_config(hf_config)
    return SGLangEngine.from_config(cfg, sglang_overrides=overrides, hf_config=arch)


def _make_vllm_engine(cfg, hf_config, tokenizer, dtype):
    """vLLM servers (running, or launched now by rank 0 from their own environment), given the
    run's architecture for the pushed config.json."""
    from gspo_megatron.model.family import family_for
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    arch = family_for(hf_config).hf_config(hf_config)
    v = cfg.rollout.vllm
    if v.launch and v.model_path is None and cfg.model.hf_dir is None:
        # A random-init run has no checkpoint directory for the server to start from. It starts
        # from the architecture and tokenizer alone with vLLM's dummy weights (--load-format dummy);
        # the loop pushes the policy before the first rollout (loop.py push_weights) anyway.
        from gspo_megatron.fsutil import make_tmp, publish

        start = os.path.join(cfg.out_dir, "weight_sync", "initial")
        if not os.path.exists(os.path.join(start, "config.json")):
            os.makedirs(os.path.dirname(start), exist_ok=True)
            tmp = make_tmp(start)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(arch, f, indent=2)
            tokenizer.save_pretrained(tmp)
            publish(tmp, start, overwrite=True)
        return VLLMEngine.from_config(cfg, hf_config=arch, model_path=start, tokenizer=tokenizer,
                                      extra_args=[*v.extra_args, "--load-format", "dummy"])
    return VLLMEngine.from_config(cfg, hf_config=arch, tokenizer=tokenizer)


ENGINES = {"hf": _make_hf_engine, "sglang": _make_sglang_engine, "vllm": _make_vllm_engine}


@dataclass
class Inputs:
    """What a run reads from outside before any process group: checked in seconds, by setup_run
    and by `--dry-run` alike."""
    hf_config: dict
    arch: MoeArch
    reader: Any  # HFCheckpointReader of model.hf_dir, or None
    tokenizer: Any
    prompts: PromptSource
    score: Callable
    heldout: Any = None  # train/evaluation.py HeldOut when eval.interval > 0
    load: Any = None  # config.py LoadSource of model.load (read_load_source), None without it
    agent: Any = None  # rollout/agent.py AgentRunner when rollout.agent is set
    # checkpoint/carried.py CarriedTensors of model.load's carried/ or model.hf_dir's MTP layers. The
    # run's own source, not a resumed checkpoint's copy: that one may be pruned (keep_last) while
    # the run goes on, and the copies are equal
    carried: Any = None
    driver: Any = None  # rollout/drivers.py: the function rollout.driver names (or the built-in one)


def check_inputs(cfg, *, world_size: int) -> Inputs:
    """Architecture (and its agreement with every checkpoint given), layout, HF checkpoint index,
    tokenizer (fits the vocabulary), data (file readable, keys in every record, the first records
    render), warm start vs data source, reward (imports), an explicit checkpoint.resume path (a
    trainer checkpoint). One InputError/ConfigError/CheckpointError line on bad input."""
    from gspo_megatron.checkpoint import carried
    from gspo_megatron.model.hf_io import HFCheckpointReader

    load = read_load_source(cfg)  # model.load's checkpoint: resolved and read once, here
    hf_config = resolve.hf_config_dict(cfg, load)
    sources = cfg.model_sources(load)
    arch = MoeArch.from_hf_dict(hf_config, source=sources[0][0] if sources else "model.hf_config")
    resolve.validate_world(cfg, world_size, hf_config)
    reader, mtp = None, None
    if cfg.model.hf_dir:
        reader = HFCheckpointReader(cfg.model.hf_dir)
        reader.validate(arch)
        mtp = carried.from_hf_dir(cfg.model.hf_dir, arch, reader.weight_map)
    elif load is not None:
        mtp = carried.from_checkpoint(load.directory, arch)
    if cfg.checkpoint.export_hf:  # a folder at <out_dir>/hf the export may not replace: refused now, not after training
        from gspo_megatron.model.hf_writer import check_export_target

        check_export_target(os.path.join(cfg.out_dir, "hf"))
    tokenizer = load_tokenizer(cfg, load)
    if len(tokenizer) > arch.vocab_size:
        raise InputError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {arch.vocab_size} "
                         "(model.tokenizer and the model's checkpoint must belong together)")
    limit = cfg.data.max_prompt_tokens or max(1, arch.max_position_embeddings - cfg.rollout.response_budget)
    prompts = PromptSource(cfg.data, tokenizer, cfg.train.seed, max_prompt_tokens=limit,
                           max_record_bytes=cfg.data.max_record_bytes)
    if cfg.train.sft_warmup_steps > 0 and prompts.task is None:
        raise InputError(f"train.sft_warmup_steps={cfg.train.sft_warmup_steps} needs demonstrations, which only "
                         "data.source=synthetic has: set train.sft_warmup_steps=0 (start from an SFT model)")
    prompts.check_render()
    if cfg.logging.tensorboard:  # asked for: never a run that silently writes no event files
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise InputError("logging.tensorboard=true but the tensorboard package is not installed: "
                             "pip install 'gspo-megatron[tensorboard]' (or tensorboard), or set logging.tensorboard=false")
    score = resolve_reward(cfg, prompts.task)
    if cfg.checkpoint.resume not in ("auto", "never"):  # an explicit path: a trainer checkpoint
        from gspo_megatron.train.checkpoint import read_trainer_state, resolve_resume

        # one CheckpointError line naming the path (a root resolves to the iteration its tracker names)
        read_trainer_state(resolve_resume(cfg.checkpoint.resume, cfg.out_dir), cfg.checkpoint.require_checksums)
    agent = None
    if cfg.rollout.agent:  # a bad module:function fails here, in seconds
        from gspo_megatron.rollout.agent import AgentRunner, load_agent_fn
        from gspo_megatron.rollout.rewards import RewardSpecError

        try:
            fn = load_agent_fn(cfg.rollout.agent)
        except RewardSpecError as e:
            raise InputError(str(e)) from None
        r = cfg.rollout
        agent = AgentRunner(fn, tokenizer, max_response_tokens=r.response_budget, concurrency=r.agent_concurrency,
                            timeout_s=r.agent_timeout_s, linger_s=r.agent_linger_s,
                            vocab_size=arch.vocab_size)
        prompts.agent_demonstration = getattr(fn, "demonstration", None)
    from gspo_megatron.rollout.drivers import load_driver
    from gspo_megatron.rollout.rewards import RewardSpecError

    try:  # a bad module:function fails here, in seconds
        driver = load_driver(cfg.rollout.driver_spec)
    except RewardSpecError as e:
        raise InputError(str(e)) from None
    heldout = None
    if cfg.eval.interval:
        from gspo_megatron.train.evaluation import HeldOut

        heldout = HeldOut(cfg, prompts, agent=agent)
    return Inputs(hf_config, arch, reader, tokenizer, prompts, score, heldout, load, agent, mtp, driver)


def _adapter_groups(cfg, ctx, engine) -> tuple[str, ...]:
    """Collective: the LoRA groups whose adapters are pushed on their own - the run's adapted
    groups the engine declares it takes (rank 0's engine: Capabilities.lora_targets), told to
    every rank (each streams its shards merged or not alike); () without LoRA."""
    if not cfg.lora.rank:
        return ()
    box = [None]
    if ctx.rank == 0:
        served = set(engine.capabilities.lora_targets) if engine is not None else set()
        box[0] = tuple(sorted(served & set(cfg.lora.target_modules)))
    if ctx.world_size > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(box, src=0)
    groups = box[0]
    if ctx.rank == 0:
        log.info("lora pushes: %s as adapters, %s merged into their weights", ", ".join(groups) or "nothing",
                 ", ".join(sorted(set(cfg.lora.target_modules) - set(groups))) or "nothing")
    return groups


def setup_run(cfg, *, world_size: int, inputs: Inputs | None = None) -> RunParts:
    """Everything a run needs, built collectively. `inputs`: check_inputs' result when the entry
    point already checked them (before importing Megatron, so bad input fails in a second)."""
    from gspo_megatron.model.factory import build_policy, parse_dtype
    from gspo_megatron.parallel.ddp import wrap_ddp
    from gspo_megatron.parallel.state import init_parallel
    from gspo_megatron.train.optim import build_optimizer
    from gspo_megatron.train.scoring import pad_multiple

    # ---- everything that can fail on bad input, before process groups and models ----------
    inputs = inputs or check_inputs(cfg, world_size=world_size)
    from gspo_megatron.parallel.state import resolve_device

    # parallel.device=cuda without CUDA: one line before any work (not in check_inputs, which
    # --dry-run shares: a GPU preset is checked on a laptop)
    resolve_device(cfg.parallel.device)
    hf_config, arch, reader, tokenizer = inputs.hf_config, inputs.arch, inputs.reader, inputs.tokenizer
    prompts, score = inputs.prompts, inputs.score
    dtype = parse_dtype(cfg.model.dtype)

    # ---- heavy work ------------------------------------------------------------------------
    timeout_s, _ = cfg.collective_timeout_s()  # outlasts rank 0's engine waits (config.py)
    ctx = init_parallel(cfg.parallel, seed=cfg.model.init_seed, model_dims=None, timeout_s=timeout_s)
    if ctx.rank == 0 and cfg.parallel.world_size not in (None, world_size):
        log.warning("running on %d processes; the config is written for parallel.world_size=%d (its memory plan: "
                    "python -m gspo_megatron.train --config ... --dry-run --world-size %d)",
                    world_size, cfg.parallel.world_size, world_size)
    colocated, node_servers, engine = cfg.rollout.backend == "sglang" and cfg.rollout.sglang.launch, None, None
    if colocated:  # the servers start (and release their memory) before the model takes the GPUs
        from gspo_megatron.rollout.colocate import start_colocated

        engine, node_servers = start_colocated(
            cfg, ctx, make_engine=lambda urls, key: _make_sglang_engine(cfg, hf_config, tokenizer, dtype, urls, key))
    routing_replay = cfg.train.routing_replay != "none" or cfg.engine_routing  # RouterReplay in every router
    chunks, tconfig = build_policy(ctx, arch, reader=reader, dtype=dtype,
                                   recompute=cfg.train.recompute,
                                   fused_logprobs=cfg.model.fused_logprobs, routing_replay=routing_replay,
                                   local_spec=bool(cfg.lora.rank))  # LoRA hooks Megatron's own linears (spec.py)
    if cfg.model.fused_logprobs:
        log.info("token log-probs: fused from the final hidden states (no [tokens, vocab/tp] logits)")
    if cfg.model.load:
        from gspo_megatron.checkpoint.mcore import load_mcore_into_model

        # the directory check_inputs read the architecture from (a root is not resolved twice)
        load_mcore_into_model(chunks, inputs.load.directory if inputs.load is not None else cfg.model.load,
                              require_checksums=cfg.checkpoint.require_checksums)
    if cfg.lora.rank:  # the base frozen, adapters on it: only they train (model/lora.py)
        from gspo_megatron.model import lora

        adapted = lora.apply_lora(chunks, lora.LoraSpec.from_config(cfg.lora, cfg.model.init_seed), ep_rank=ctx.ep_rank)
        if ctx.rank == 0:
            log.info("lora: rank %d, alpha %g on %s: %d adapted linears on rank 0", cfg.lora.rank, cfg.lora.alpha,
                     ", ".join(cfg.lora.target_modules), adapted)
    ref_chunks = None
    if cfg.loss.kl_coef > 0 and not cfg.lora.rank:  # with LoRA the reference is the base: the policy, adapters off
        ref_chunks, _ = build_policy(ctx, arch, dtype=dtype, fused_logprobs=cfg.model.fused_logprobs)
        for src, dst in zip(chunks, ref_chunks):
            dst.load_state_dict(src.state_dict())
    model = wrap_ddp(chunks, tconfig, grad_reduce_in_fp32=cfg.optimizer.grad_reduce_in_fp32,
                     use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
    total_updates = cfg.train.max_steps * cfg.train.minibatches_per_step
    optimizer, scheduler = build_optimizer(cfg.optimizer, model, total_steps=total_updates, dtype=dtype)
    if dtype == torch.float16:
        # Megatron's schedules scale the loss before backward only through config.grad_scale_func
        # (schedules.py backward_step), and the fp16 optimizer divides the gradients by its loss
        # scale (2^32 to start) before the step: without it float16 never learns (Megatron-LM's
        # training.py sets the same). bf16 / fp32 have no loss scale (the function would multiply by 1).
        tconfig.grad_scale_func = optimizer.scale_loss
    from gspo_megatron.parallel.state import seed_rng

    seed_rng(ctx, cfg.train.seed)
    if not colocated and ctx.rank == 0:
        engine = ENGINES[cfg.rollout.backend](cfg, hf_config, tokenizer, dtype)
    colocation = None
    if colocated:
        from gspo_megatron.rollout.colocate import Colocation

        colocation = Colocation(ctx, engine, model, optimizer, dtype, node_servers)
    if ctx.rank == 0:  # the reward servers the run launches (reward.judge.launch, reward.model.launch)
        from gspo_megatron.rollout.judge import CombinedScorer

        try:
            if isinstance(score, CombinedScorer):
                score.start_servers(os.path.join(cfg.out_dir, "reward_logs"))
        except BaseException:
            score.close()
            if engine is not None:
                engine.close()
            raise
    adapter_groups = _adapter_groups(cfg, ctx, engine)
    stop_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    parts = RunParts(
        cfg=cfg, ctx=ctx, arch=arch, hf_config=hf_config, dtype=dtype, model=model, optimizer=optimizer,
        scheduler=scheduler, tokenizer=tokenizer, prompts=prompts, score=score, engine=engine, reference=None,
        colocation=colocation,
        seq_multiple=pad_multiple(cfg.parallel), pad_id=tokenizer.pad_token_id or 0, stop_ids=stop_ids,
        routing_replay=routing_replay, heldout=inputs.heldout, agent=inputs.agent, carried=inputs.carried,
        driver=inputs.driver, adapter_groups=adapter_groups,
    )
    if cfg.checkpoint.async_save:  # collective: every rank creates the writer's group here
        from gspo_megatron.parallel.state import background_group
        from gspo_megatron.train.async_save import BackgroundSaves

        t = cfg.collective_timeout_s()[0]
        parts.saves = BackgroundSaves(background_group(t), timeout_s=t, device=ctx.device)
    if cfg.rollout.verify_weights:
        from gspo_megatron.train.refit_check import RefitCheck

        parts.refit = RefitCheck(cfg, hf_config)
    if cfg.loss.kl_coef > 0:
        parts.reference = ReferencePolicy(parts, ref_chunks) if ref_chunks is not None else \
            ReferencePolicy(parts, chunks, base_of_lora=True)
    return parts
