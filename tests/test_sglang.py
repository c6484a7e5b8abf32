"""SGLangEngine against the SGLang HTTP test double (tests/sglang_double.py) on CPU, plus the
server-process lifecycle and GPU-only checks against real SGLang (skipped without sglang + CUDA).

What the double-based tests prove: the engine's requests carry SGLang's field names and shapes
(checked on the recorded requests), its parsing of SGLang-shaped answers yields log-probs equal to
teacher forcing on the served model, grouping per prompt, the three weight-sync transports really
replace the served weights (generations / log-probs then equal another model's), versions, cache
flushes, stale-version detection, retries / clear errors under injected faults, abort of
over-sampled groups, and routed experts (return_routing) equal to the served model's own router
choices, with SGLang's start_len rule, flag and failure modes. Every wait is bounded (request and
readiness timeouts; pytest-timeout).
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import time

import pytest
import torch

from gspo_megatron.rollout.base import SamplingParams
from gspo_megatron.rollout.hf_engine import hub_weight_targets
from gspo_megatron.rollout.sglang_engine import (
    SGLangEngine,
    SGLangProtocolError,
    SGLangServerError,
    SGLangStaleWeightsError,
    sampling_to_sglang,
)
from gspo_megatron.rollout.sglang_server import (
    LaunchSpec,
    SGLangError,
    SGLangNotReadyError,
    ServerClient,
    ServerProcesses,
)
from gspo_megatron.rollout.tokenizer import build_tokenizer
from gspo_megatron.rollout.weight_sync import iter_buckets

from dist_utils import with_free_port
from testlib import REPO, cmdline, descendants, free_port, still_running
from sglang_double import Faults, SGLangDouble, start_double_and_engine, teacher_forced_logprobs

DOUBLE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_double.py")
FAST = dict(request_timeout_s=30.0, ready_timeout_s=20.0, max_retries=2, retry_backoff_s=0.01)
ATOL = 1e-4

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The in-process doubles generate on HTTP handler threads next to the test's own torch work;
    on a small shared CPU, torch's spinning intra-op pool then slows everything ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _config(vocab: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=2, bos_token_id=None, initializer_range=0.3,
    )


def _model(vocab: int, seed: int):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(_config(vocab)).eval()


def hub_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Every Hub-format (name, tensor) of a transformers model (experts per expert)."""
    return [(k, t.get().detach().clone()) for k, t in hub_weight_targets(model).items()]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model_a(tok):
    return _model(len(tok), 0)


@pytest.fixture(scope="module")
def model_b(tok):
    return _model(len(tok), 1)


@pytest.fixture(scope="module")
def model_dir(tok, model_a, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen3_moe_a")
    model_a.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode("12+34="), tok.encode("reverse 1234567"), tok.encode("9")]


def assert_logprobs_match(samples, model, temperature):
    for s in samples:
        ref = teacher_forced_logprobs(model, s.prompt_ids, s.response_ids, temperature)
        torch.testing.assert_close(torch.tensor(s.response_logprobs), ref, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------ generation
def test_generate_logprobs_grouping_and_request_fields(model_dir, prompts, model_a):
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=8)
    with start_double_and_engine(model_dir, **FAST) as (dbl, eng):
        with pytest.warns(UserWarning, match="before any update_weights"):
            samples = eng.generate(prompts, 3, sp)
        assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        for s in samples:
            assert s.prompt_ids == prompts[s.prompt_index]
            assert 0 < len(s.response_ids) == len(s.response_logprobs) <= 8
            assert s.finish_reason in ("stop", "length")
            assert s.meta["server"] == dbl.url
        # engine log-probs == the served model's teacher-forced log softmax(logits / T), untruncated
        assert_logprobs_match(samples, dbl.engine.model, 0.7)
        assert_logprobs_match(samples, model_a, 0.7)
        # one request per group: n copies of the prompt, SGLang's field names
        reqs = dbl.calls("/generate")
        assert len(reqs) == 3
        for r in reqs:
            assert r["return_logprob"] is True
            assert len(r["input_ids"]) == 3 and len(set(map(tuple, r["input_ids"]))) == 1
            assert len(r["rid"]) == 3 and len(set(r["rid"])) == 3
            assert r["sampling_params"] == {
                "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 8,
                "no_stop_trim": True, "skip_special_tokens": True,
            }

        # greedy: argmax tokens, log-probs at T = 1; a stop token ends the response (included)
        g = eng.generate(prompts[:1], 2, SamplingParams(temperature=0.0, max_new_tokens=6))
        assert g[0].response_ids == g[1].response_ids
        assert_logprobs_match(g, model_a, 1.0)
        stop_tok = g[0].response_ids[2]
        first = g[0].response_ids.index(stop_tok)
        st = eng.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                          stop_token_ids=(stop_tok,)))
        assert st[0].response_ids == g[0].response_ids[: first + 1] and st[0].finish_reason == "stop"
        assert dbl.calls("/generate")[-1]["sampling_params"]["stop_token_ids"] == [stop_tok]


def test_sampling_translation():
    assert sampling_to_sglang(SamplingParams(temperature=0.0, top_k=-1))["temperature"] == 0.0
    assert sampling_to_sglang(SamplingParams(temperature=1.3, top_k=1))["temperature"] == 0.0  # greedy
    d = sampling_to_sglang(SamplingParams(stop=("\n\n",), stop_token_ids=(5, 6), top_k=-1))
    assert d["stop"] == ["\n\n"] and d["stop_token_ids"] == [5, 6] and d["top_k"] == -1


# ------------------------------------------------------------------------------ weight sync
def test_disk_sync_two_servers_versions_flush_and_stale(model_dir, prompts, model_a, model_b, tmp_path):
    shared = str(tmp_path / "sync")
    sp = SamplingParams(temperature=0.9, max_new_tokens=6)
    with SGLangDouble(model_dir) as d1, SGLangDouble(model_dir) as d2:
        eng = SGLangEngine({"urls": [d1.url, d2.url], "shared_dir": shared}, model_path=model_dir, **FAST)
        try:
            eng.update_weights(iter(hub_tensors(model_b)), version=1)  # a one-shot iterator
            assert eng.weight_version == 1 and d1.weight_version == d2.weight_version == "1"
            for d in (d1, d2):
                (req,) = d.calls("/update_weights_from_disk")
                assert req == {"model_path": os.path.join(shared, "v00000001"), "weight_version": "1",
                               "flush_cache": False}
                paths = [r.path for r in d.records]
                assert paths.index("/flush_cache") > paths.index("/update_weights_from_disk")
            assert os.listdir(shared) == ["v00000001"]
            assert os.path.isfile(os.path.join(shared, "v00000001", "config.json"))
            out = eng.generate(prompts, 2, sp)
            assert {s.weight_version for s in out} == {1}
            assert {s.meta["server"] for s in out} == {d1.url, d2.url}  # spread over both servers
            assert_logprobs_match(out, model_b, 0.9)  # the servers now serve model B

            # second update: version + 1, flush retried while "requests are pending", old dir pruned
            d1.faults.flush_busy = 2
            eng.update_weights(hub_tensors(model_a), version=eng.weight_version + 1)
            assert eng.weight_version == 2 and d1.weight_version == "2"
            assert len(d1.calls("/flush_cache")) == 4  # 3 tries for the busy one + 1 (first update)
            assert os.listdir(shared) == ["v00000002"]
            out = eng.generate(prompts, 1, sp)
            assert_logprobs_match(out, model_a, 0.9)
            with pytest.raises(ValueError, match="does not exceed"):
                eng.update_weights(hub_tensors(model_a), version=2)
            assert eng.server_weight_versions() == {d1.url: "2", d2.url: "2"}

            # a response from weights other than the last pushed ones is detected
            d2.faults.stale = 1
            d1.faults.stale = 1
            with pytest.raises(SGLangStaleWeightsError, match=r"weight_version='stale-0', expected 2"):
                eng.generate(prompts[:1], 1, sp)
            eng.on_stale = "count"
            d1.faults.stale = d2.faults.stale = 5
            out = eng.generate(prompts[:2], 1, sp)
            assert eng.metrics["stale_samples"] == 2 and {s.weight_version for s in out} == {-1}
            d1.faults.stale = d2.faults.stale = 0
            d1.faults.no_version = d2.faults.no_version = 2  # an SGLang without the field: warned
            with pytest.warns(UserWarning, match="no meta_info.weight_version"):
                eng.generate(prompts[:2], 1, sp)
            assert eng.metrics["unversioned_samples"] == 2

            # a failed update leaves the engine refusing to generate until a complete one lands
            with pytest.raises(SGLangServerError, match="lacks .* parameters"):
                eng.update_weights(hub_tensors(model_a)[:5], version=3)
            with pytest.raises(SGLangError, match=r"partially updated weights after a failed update_weights "
                                                  r"\(SGLang server .*lacks .* parameters") as err:
                eng.generate(prompts[:1], 1, sp)
            assert err.type is SGLangError  # refused before any request, not a server error
            eng.update_weights(hub_tensors(model_a), version=4)
            eng.on_stale = "error"
            eng.generate(prompts[:1], 1, sp)
        finally:
            eng.close()


def test_tensor_sync_and_sleep_wake(model_dir, prompts, model_b):
    """update_weights_from_tensor: one serialized entry per TP rank (the double claims TP=2 and
    opens entry 0: in-process, ForkingPickler's CPU shared memory works)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=5)
    with start_double_and_engine(model_dir, double_kw={"tp_size": 2, "memory_saver": True}, weight_sync="tensor",
                                 bucket_mb=0.05, **FAST) as (dbl, eng):
        eng.sleep()
        assert dbl.memory_released
        eng.wake()
        assert not dbl.memory_released
        eng.update_weights(hub_tensors(model_b), version=7)
        reqs = dbl.calls("/update_weights_from_tensor")
        assert len(reqs) > 1  # several buckets
        for r in reqs:
            assert len(r["serialized_named_tensors"]) == 2 and r["load_format"] is None
            assert r["flush_cache"] is False and r["weight_version"] == "7"
        assert dbl.weight_version == "7" and eng.weight_version == 7
        assert_logprobs_match(eng.generate(prompts, 2, sp), model_b, 1.0)
        assert [r.path for r in dbl.records].count("/release_memory_occupation") == 1


def test_iter_buckets():
    ts = [(f"t{i}", torch.ones(i + 1, dtype=torch.float32)) for i in range(6)]  # 4..24 bytes
    buckets = list(iter_buckets(iter(ts), 24, dtype=torch.bfloat16))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in ts]
    assert all(sum(t.numel() * 2 for _, t in b) <= 24 for b in buckets)
    assert all(t.dtype == torch.bfloat16 for b in buckets for _, t in b)
    big = list(iter_buckets([("a", torch.ones(100)), ("b", torch.ones(1))], 16))
    assert [[n for n, _ in b] for b in big] == [["a"], ["b"]]  # an oversized tensor is its own bucket
    with pytest.raises(ValueError, match="twice"):
        list(iter_buckets([("a", torch.ones(1)), ("a", torch.ones(1))], 16))


@pytest.mark.parametrize("seed", range(40))
def test_iter_buckets_keeps_every_group_an_engine_loads_together_in_one_bucket(seed):
    """Property test over random streams, tensor sizes, bucket sizes and groups (members far apart
    or adjacent, of any layer): the stream comes out whole and in order; each group's members share
    a bucket; a bucket passes the size limit only to hold a group (or one big tensor); a group
    whose member the stream lacks is an error naming it."""
    import random

    from gspo_megatron.rollout.weight_sync import LoadedTogether

    rng = random.Random(seed)
    layers, per_layer = rng.randint(1, 4), ["a", "b", "c", "d", "e"]
    names = [f"l.{i}.{x}" for i in range(layers) for x in per_layer]
    ts = [(n, torch.ones(rng.randint(1, 8))) for n in names]
    group = tuple(f"l.{{layer}}.{x}" for x in sorted(rng.sample(per_layer, rng.randint(2, 3))))
    limit = rng.randint(4, 40)
    together = LoadedTogether([group])
    buckets = list(iter_buckets(iter(ts), limit, together=together))
    assert [n for b in buckets for n, _ in b] == names
    where = {n: i for i, b in enumerate(buckets) for n, _ in b}
    for i in range(layers):
        assert len({where[t.format(layer=i)] for t in group}) == 1, (group, i, buckets)
    for b in buckets:
        size = sum(t.numel() * 4 for _, t in b)
        assert size <= limit or len(b) == 1 or any(together.partners(n) for n, _ in b), (size, b)
    lacking = [(n, t) for n, t in ts if n != group[-1].format(layer=0)]
    with pytest.raises(ValueError, match=re.escape(group[-1].format(layer=0))):
        list(iter_buckets(iter(lacking), limit, together=together))


def test_launch_and_distributed_sync_over_gloo(model_dir, prompts, model_a, model_b, tmp_path):
    """Launch the double as a server process (the command line SGLang gets), sync weights with
    weight_sync=distributed: the double joins the trainer's gloo group as rank 1 and receives each
    bucket's broadcast; then it serves model B. close() stops the process."""
    sp = SamplingParams(temperature=0.8, max_new_tokens=6)
    eng = with_free_port(lambda port: SGLangEngine(  # the server binds the port: retried if taken meanwhile
        {"launch": True, "model_path": model_dir, "port": port, "weight_sync": "distributed",
         "bucket_mb": 0.05, "api_key": "k3y", "extra_args": ["--dtype", "float32"]},
        server_command=[sys.executable, DOUBLE_SCRIPT], log_dir=str(tmp_path / "logs"),
        server_env={"OMP_NUM_THREADS": "1"}, **dict(FAST, ready_timeout_s=90.0),
    ), free=free_port)
    port = int(eng.servers[0].url.rsplit(":", 1)[1])
    proc = eng.procs.procs[0]
    try:
        assert eng.servers[0].url == f"http://127.0.0.1:{port}"
        with pytest.warns(UserWarning, match="generate before any update_weights"):
            assert_logprobs_match(eng.generate(prompts[:2], 2, sp), model_a, 0.8)
        eng.update_weights(hub_tensors(model_b), version=1)
        assert_logprobs_match(eng.generate(prompts, 2, sp), model_b, 0.8)
        eng.update_weights(hub_tensors(model_a), version=2)  # the group is reused
        out = eng.generate(prompts[:1], 2, sp)
        assert_logprobs_match(out, model_a, 0.8)
        assert {s.weight_version for s in out} == {2}
        recs = ServerClient(eng.servers[0].url, api_key="k3y").get("/_double/records")
        inits = [r["body"] for r in recs if r["path"] == "/init_weights_update_group"]
        assert len(inits) == 1
        assert inits[0]["rank_offset"] == 1 and inits[0]["world_size"] == 2
        assert inits[0]["backend"] == "gloo" and inits[0]["group_name"] == "gspo_weight_sync"
        upd = [r["body"] for r in recs if r["path"] == "/update_weights_from_distributed"]
        assert len(upd) > 2 and {u["weight_version"] for u in upd} == {"1", "2"}
        names = [n for u in upd if u["weight_version"] == "1" for n in u["names"]]
        assert sorted(names) == sorted(n for n, _ in hub_tensors(model_b))
        assert all(set(u["dtypes"]) == {"float32"} and len(u["shapes"]) == len(u["names"]) for u in upd)
        # every push inside its own weight-update session (SGLang 0.5.23 refuses it otherwise)
        seq = [r["path"] for r in recs if "weight_update" in r["path"] or r["path"] == "/update_weights_from_distributed"]
        pushes = "".join("b" if p == "/begin_weight_update" else "e" if p == "/end_weight_update" else "u" for p in seq)
        assert re.fullmatch(r"(bu+e){2}", pushes), pushes
        with open(eng.procs.log_paths[0]) as f:
            log = f.read()
        assert "--tp-size 1" in log and "--dtype float32" in log
        # the key reached the double through --config (its printed args) and is in no log line
        assert "'api_key': '<redacted>'" in log and "k3y" not in log and "--config" in log
    finally:
        eng.close()
    assert proc.poll() is not None  # stopped by close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_a_failed_distributed_push_aborts_the_group_instead_of_flushing_it(model_dir, model_b, tmp_path, monkeypatch):
    """Issue 52 (GPU): after a failed weight_sync=distributed push, close() destroyed the group, and
    since torch 2.6 destroy_process_group flushes the pending work (pg.shutdown()): on NCCL the
    trainer waited at exit for a broadcast no server would join. Now a push that fails or is
    interrupted marks the group broken and close() aborts it (c10d._abort_process_group), never
    destroys it. Real: a launched double whose /update_weights_from_distributed answers 500 (it
    never joins the broadcast), gloo; gloo's shutdown does not wait, so the hang itself is NCCL's,
    and one GPU cannot form a two-rank NCCL group to show it in `make gpu-check`."""
    from gspo_megatron.rollout import weight_sync

    calls = []
    real_abort, real_destroy = weight_sync.abort_weight_update_group, weight_sync.destroy_weight_update_group
    monkeypatch.setattr(weight_sync, "abort_weight_update_group", lambda pg: calls.append("abort") or real_abort(pg))
    monkeypatch.setattr(weight_sync, "destroy_weight_update_group", lambda pg: calls.append("destroy") or real_destroy(pg))
    eng = with_free_port(lambda port: SGLangEngine(
        {"launch": True, "model_path": model_dir, "port": port, "weight_sync": "distributed", "bucket_mb": 64,
         "extra_args": ["--dtype", "float32", "--double-fail-path", "/update_weights_from_distributed",
                        "--double-fail-5xx", "1"]},
        server_command=[sys.executable, DOUBLE_SCRIPT], log_dir=str(tmp_path / "logs"),
        server_env={"OMP_NUM_THREADS": "1"}, **dict(FAST, ready_timeout_s=90.0),
    ), free=free_port)
    try:
        with pytest.raises(SGLangError, match="distributed weight sync"):
            eng.update_weights(hub_tensors(model_b), version=1)
        with pytest.raises(SGLangError, match="unusable after an earlier failure"):
            eng.update_weights(hub_tensors(model_b), version=2)
    finally:
        eng.close()
    assert calls == ["abort"], calls  # never a flush of the pending broadcast
    assert eng.procs is None or all(p.poll() is not None for p in eng.procs.procs)

    # any exception inside a push (a SIGTERM's KeyboardInterrupt, an error between buckets) marks
    # the group broken too: close() then aborts it
    sync = weight_sync.DistributedSync([], ranks_per_server=[], master_address="127.0.0.1", master_port=0,
                                       backend="gloo")
    sync.pg = object()  # a formed group (init_group then does nothing)

    def interrupted(named, version):
        raise KeyboardInterrupt

    monkeypatch.setattr(sync, "_update", interrupted)
    monkeypatch.setattr(weight_sync, "abort_weight_update_group", lambda pg: calls.append("abort:interrupted") or "ok")
    with pytest.raises(KeyboardInterrupt):
        sync.update([], version=3)
    assert sync.broken and "KeyboardInterrupt" in sync.broken
    sync.close()
    assert calls[-1] == "abort:interrupted" and sync.pg is None, calls


def test_weight_update_store_address_and_port_come_from_the_config(monkeypatch):
    """rollout.sglang.sync_address / sync_port (a port an operator can open in a firewall) reach the
    distributed weight-update group; unset, the address is the route towards the first server and
    the port 0 (rank 0's store binds a free one)."""
    import gspo_megatron.rollout.sglang_engine as se
    from gspo_megatron.resolve import load_config

    seen = []
    monkeypatch.setattr(se, "DistributedSync", lambda *a, **kw: seen.append(kw) or object())
    monkeypatch.setattr(se.SGLangEngine, "_ranks_per_server", lambda self: [1])
    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "configs", "tiny_cpu.yaml")
    base = ["rollout.backend=sglang", "rollout.sglang.urls=[http://127.0.0.1:9]", "rollout.sglang.weight_sync=distributed"]
    for extra, addr, port in ((["rollout.sglang.sync_address=10.1.2.3", "rollout.sglang.sync_port=29555"], "10.1.2.3", 29555),
                              ([], "127.0.0.1", 0)):
        eng = se.SGLangEngine.from_config(load_config(tiny, base + extra), wait_ready=False)
        eng._make_syncer()
        assert (seen[-1]["master_address"], seen[-1]["master_port"]) == (addr, port)
    from gspo_megatron.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.sglang.sync_port must be 0"):
        load_config(tiny, base + ["rollout.sglang.sync_port=70000"])


# A stand-in server that no SIGTERM stops (a server stuck in its own shutdown), with a child of
# its own (an engine core, a scheduler) that ignores it too.
_STUCK_SERVER = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                 "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                 "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); "
                 "print('up', flush=True); time.sleep(600)")


def _start_owner(tmp_path, command: list[str]):
    """A process that launches one server through ServerProcesses (guards' grace 1 s) and sleeps:
    (its Popen, the shim's pid, the watchdog's pid, the log path)."""
    import subprocess

    pidfile = tmp_path / "pids.json"
    code = (
        "import json, sys, time\n"
        "from gspo_megatron.rollout import process_guard\n"
        "from gspo_megatron.rollout.sglang_server import LaunchSpec, ServerProcesses\n"
        "process_guard.GRACE_S = 1.0\n"
        f"spec = LaunchSpec(model_path='m', command={command!r}, log_dir={str(tmp_path)!r})\n"
        "p = ServerProcesses(spec); p.start()\n"
        f"open({str(pidfile) + '.tmp'!r}, 'w').write(json.dumps([p.procs[0].pid, p._watchdogs[0].pid, p.log_paths[0]]))\n"
        f"import os; os.rename({str(pidfile) + '.tmp'!r}, {str(pidfile)!r})\n"
        "time.sleep(600)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    deadline = time.monotonic() + 60
    while not pidfile.exists():
        assert owner.poll() is None and time.monotonic() < deadline, "the owner did not start its server"
        time.sleep(0.05)
    shim, watchdog, log_path = json.loads(pidfile.read_text())
    return owner, shim, watchdog, log_path


def test_launched_servers_do_not_outlive_a_killed_trainer(tmp_path):
    """SIGKILL of the process that launched the servers (no stop(), no atexit) still ends them:
    their guards (rollout/process_guard.py) stop the group once their owner is gone."""
    import signal

    owner, shim, _, _ = _start_owner(tmp_path, [sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        deadline = time.monotonic() + 30
        while not (len(descendants(shim)) == 1 and "time.sleep(600)" in cmdline(descendants(shim)[0])):
            assert time.monotonic() < deadline, [cmdline(q) for q in descendants(shim)]
            time.sleep(0.05)
        server = descendants(shim)
        assert len(server) == 1 and "time.sleep(600)" in cmdline(server[0])  # the server, under its shim
        assert "time.sleep(600)" not in cmdline(shim)  # its argv reaches the shim on stdin, never its own argv
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        assert not still_running([shim, *server], 30), "the server outlived its killed parent"
    finally:
        if owner.poll() is None:
            owner.kill()


@pytest.mark.parametrize("first", ["watchdog", "shim"])
def test_a_stuck_server_does_not_outlive_its_trainer_whichever_guard_was_killed_first(tmp_path, first):
    """Issue 52 (degraded): the watchdog killed, then the trainer: the server was left behind (it
    only had the kernel's SIGTERM on its parent's death, which a stopped server, or one stuck in
    its own shutdown, never acts on). Here the server ignores SIGTERM and is stopped (SIGSTOP),
    and so is its child. Either guard killed first (kill -9), then the trainer: nothing is left.
    The shim killed first takes the server with it at once (PR_SET_PDEATHSIG = SIGKILL) and the
    watchdog takes its child; the watchdog killed first leaves the shim to stop the group,
    SIGTERM then SIGKILL."""
    import signal

    owner, shim, watchdog, log_path = _start_owner(tmp_path, [sys.executable, "-c", _STUCK_SERVER])
    try:
        deadline = time.monotonic() + 60
        while not ("\nup\n" in open(log_path).read() and len(descendants(shim)) == 2):
            assert time.monotonic() < deadline, open(log_path).read()
            time.sleep(0.05)
        server, child = descendants(shim)
        for q in (server, child):
            os.kill(q, signal.SIGSTOP)
        os.kill(shim if first == "shim" else watchdog, signal.SIGKILL)
        if first == "shim":  # the kernel kills the server with its shim, stopped or not
            assert not still_running([server], 10), "the server outlived its shim"
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
        left = still_running([shim, watchdog, server, child], 30)
        assert not left, [(q, cmdline(q)[:80]) for q in left]
    finally:
        if owner.poll() is None:
            owner.kill()
        for q in descendants(os.getpid()):  # nothing of this test's survives a failure
            try:
                os.kill(q, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_server_exits_as_its_shim_reports_it():
    """The shim exits as the server did: the same exit code, or death by the same signal
    (Popen.returncode is what the server's would be: `dead()` and the supervisor read it), and a
    command that cannot start is exit 127 with a line in the log."""
    import subprocess

    from gspo_megatron.rollout import process_guard

    for argv, code in (([sys.executable, "-c", "raise SystemExit(3)"], 3),
                       ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"], -9),
                       ([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"], -15),
                       (["/nonexistent/server"], 127)):
        p = process_guard.spawn_guarded(argv, dict(os.environ), subprocess.PIPE)
        out = p.stdout.read()
        assert p.wait(timeout=60) == code, (argv, p.returncode, out)
        p.stdout.close()
        if code == 127:
            assert b"cannot start /nonexistent/server" in out, out


# ------------------------------------------------------------------------------ faults
def test_server_down_at_start_times_out_clearly():
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    # bounded: the readiness timeout raised (its message), naming the connection failure
    with pytest.raises(SGLangNotReadyError, match=rf"{url} not ready after 1.5 s .*last error: .*Connection refused"):
        SGLangEngine({"urls": [url]}, **dict(FAST, ready_timeout_s=1.5))


def test_never_ready_server_reports_its_status(model_dir):
    with SGLangDouble(None, faults=Faults(never_ready=True)) as d:
        with pytest.raises(SGLangNotReadyError, match=r"not ready after 1 s .*HTTP 503"):
            SGLangEngine({"urls": [d.url]}, **dict(FAST, ready_timeout_s=1.0))


def test_not_ready_names_the_last_answer_when_a_later_probe_times_out():
    """A server answers 503 (up, not ready), then its later probes get no answer within their
    budget (the last probe has what is left of the wait): the error still says the server
    answered 503. Before, only the last error (a timeout) was named, and
    test_never_ready_server_reports_its_status could fail on a loaded machine."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gspo_megatron.rollout.http_servers import EngineNotReadyError, ServerClient, wait_until_ready

    gets, release = [], threading.Event()

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            gets.append(self.path)
            if len(gets) > 1:
                release.wait(60)  # later probes: no answer in time
            self.send_response(503)
            self.send_header("Content-Length", "7")
            self.end_headers()
            self.wfile.write(b"loading")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        with pytest.raises(EngineNotReadyError) as e:
            wait_until_ready([ServerClient(url)], 1.5, poll_s=0.1)
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()
    msg = str(e.value)
    assert len(gets) >= 2 and "not ready after 1.5 s" in msg and "last error: HTTP" not in msg, (gets, msg)
    assert "last answer: HTTP 503: loading" in msg, msg


def test_5xx_and_dropped_connections_are_retried_then_fail_naming_the_server(model_dir, prompts, monkeypatch, caplog):
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    with start_double_and_engine(model_dir, **FAST) as (dbl, eng):
        eng._warned_unsynced = True  # no weight push in this test
        dbl.faults.fail_5xx = 1
        dbl.faults.drop = 1
        with caplog.at_level("WARNING", logger="gspo_megatron.rollout"):
            out = eng.generate(prompts, 2, sp)  # 3 groups; two failures retried
        assert len(out) == 6 and eng.metrics["retries"] == 2  # the loop's rollout_retries per step
        retried = [r.getMessage() for r in caplog.records if "retry 1 of 2 after" in r.getMessage()]
        assert len(retried) == 2 and any("HTTP 500" in m for m in retried), retried  # every retry is logged
        dbl.faults.server_abort = 1  # an abort nobody asked for is retried too
        assert len(eng.generate(prompts[:1], 2, sp)) == 2
        assert eng.metrics["retries"] == 3

        dbl.faults.fail_5xx = 100
        with pytest.raises(SGLangServerError, match=rf"{dbl.url}.*after 3 attempt.*HTTP 500"):
            eng.generate(prompts[:1], 1, sp)
        dbl.faults.fail_5xx = 0
        dbl.faults.drop = 100
        with pytest.raises(SGLangServerError, match=rf"{dbl.url}.*after 3 attempt.*RemoteDisconnected"):
            eng.generate(prompts[:1], 1, sp)
        dbl.faults.drop = 0

        dbl.faults.malformed = 1
        with pytest.raises(SGLangProtocolError, match=rf"{dbl.url}.*malformed JSON"):
            eng.generate(prompts[:1], 1, sp)
        dbl.faults.missing_fields = 1
        with pytest.raises(SGLangProtocolError, match="malformed /generate response: expected a list of 2"):
            eng.generate(prompts[:1], 2, sp)

        # a request slower than request_timeout_s times out (bounded), then fails clearly
        eng.request_timeout_s = 0.3
        dbl.faults.delay_s, dbl.faults.delay_after = 30.0, 0
        sent, arrived = len(dbl.calls("/generate")), dbl.arrived
        timeouts = []  # the timeout each /generate attempt is sent with
        real_request = ServerClient.request_once

        def request_once(self, method, path, *a, **kw):
            if path == "/generate":
                timeouts.append(kw.get("timeout_s"))
            return real_request(self, method, path, *a, **kw)

        answers = []  # finish_reason types of what the double answered from here on
        real_generate = dbl.generate

        def generate(body):
            status, res = real_generate(body)
            answers.append(tuple(r["meta_info"]["finish_reason"]["type"] for r in res))
            return status, res

        dbl.generate = generate
        monkeypatch.setattr(ServerClient, "request_once", request_once)
        with pytest.raises(SGLangServerError, match=rf"{dbl.url}.*after 3 attempt.*timed out"):
            eng.generate(prompts[:1], 1, sp)
        monkeypatch.undo()
        # bounded by the client's timeout: 3 attempts (max_retries=2), each waiting request_timeout_s;
        # the server never finished any of them: they end only when aborted, with finish_reason
        # abort, not a 30-s-late generation. The engine aborts on failure, but on a loaded machine
        # the double may take in the last attempt after that abort: once all 3 have, abort again
        assert timeouts == [0.3] * 3
        deadline = time.monotonic() + 60  # a hang bound, not a measurement
        while dbl.arrived - arrived < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(dbl.calls("/generate")) - sent == 3 and dbl.arrived - arrived == 3
        eng.abort()
        while len(answers) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert answers == [("abort",)] * 3, answers
        dbl.faults.delay_s = 0.0
        dbl.generate = real_generate
        eng.request_timeout_s = 30.0
        assert len(eng.generate(prompts[:1], 1, sp)) == 1  # healthy again


def test_abort_over_sampled_groups(model_dir, tok):
    """stop_after_groups=2 of 6: the first two requests are fast, the rest would take 60 s; the
    engine aborts them (abort_all) and returns the two complete groups quickly."""
    ps = [tok.encode(f"{i}+{i}=") for i in range(6)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    with start_double_and_engine(model_dir, faults=Faults(delay_s=60.0, delay_after=2),
                                 **dict(FAST, concurrency=8)) as (dbl, eng):
        eng._warned_unsynced = True
        finished = []  # per /generate the double answered: its rows' finish_reason types
        real_generate = dbl.generate

        def generate(body):
            status, res = real_generate(body)
            finished.append(tuple(r["meta_info"]["finish_reason"]["type"] for r in res))
            return status, res

        dbl.generate = generate
        out = eng.generate(ps, 2, sp, stop_after_groups=2)
        # the abort happened: when generate returns, the server has answered all 6 requests (none
        # retried), the 4 slow ones cut short by the abort instead of running their 60 s
        assert len(dbl.calls("/generate")) == 6
        assert sorted(f for f in finished if "abort" in f) == [("abort", "abort")] * 4, finished
        assert len(finished) == 6 and all(set(f) <= {"stop", "length"} for f in finished if "abort" not in f)
        dbl.generate = real_generate
        idx = sorted({s.prompt_index for s in out})
        assert len(idx) == 2 and len(out) == 4
        assert [s.prompt_index for s in out] == sorted(s.prompt_index for s in out)
        assert all(s.finish_reason != "abort" for s in out)
        assert {"abort_all": True} in dbl.calls("/abort_request")
        assert eng.metrics["dropped_groups"] == 4
        dbl.faults.delay_s = 0.0
        assert len(eng.generate(ps[:2], 1, sp)) == 2  # later rollouts are unaffected


def test_api_key_and_router(model_dir, prompts, model_b, tmp_path):
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    with SGLangDouble(model_dir, api_key="s3cret") as w1, SGLangDouble(model_dir, api_key="s3cret") as w2, \
            SGLangDouble(None, router_of=[w1.url, w2.url], api_key="s3cret") as router:
        no_key = SGLangEngine({"urls": [w1.url]}, **FAST)
        no_key._warned_unsynced = True
        with pytest.raises(SGLangServerError, match="HTTP 401"):  # not retried: a client error
            no_key.generate(prompts[:1], 1, sp)
        assert len(w1.calls("/generate")) == 1
        no_key.close()
        w1.records.clear()
        eng = SGLangEngine({"urls": [router.url], "api_key": "s3cret", "shared_dir": str(tmp_path / "s")},
                           model_path=model_dir, **FAST)
        try:
            assert [w.url for w in eng.workers] == [w1.url, w2.url]
            eng.update_weights(hub_tensors(model_b), version=1)  # to the workers, not the router
            assert w1.weight_version == w2.weight_version == "1"
            out = eng.generate(prompts, 2, sp)  # through the router
            assert len(router.calls("/generate")) == 3
            assert len(w1.calls("/generate")) + len(w2.calls("/generate")) == 3
            assert_logprobs_match(out, model_b, 1.0)
            eng.abort()
            assert w1.calls("/abort_request") and w2.calls("/abort_request")
        finally:
            eng.close()


def test_from_trainer_config(model_dir, prompts, tmp_path):
    """SGLangEngine.from_config(Config): model_path <- model.hf_dir, shared_dir <- out_dir, HF config
    <- hf_dir/config.json; the overrides helper is what a trainer-level test passes."""
    from gspo_megatron.resolve import load_config

    from sglang_double import sglang_overrides

    with SGLangDouble(model_dir) as d:
        cfg = load_config(None, [f"model.hf_dir={model_dir}", "model.dtype=float32",
                                 f"out_dir={tmp_path / 'run'}", *sglang_overrides(d.url)])
        eng = SGLangEngine.from_config(cfg, retry_backoff_s=0.01)
        try:
            assert eng.cfg["shared_dir"] == os.path.join(str(tmp_path / "run"), "weight_sync")
            assert eng.model_path == model_dir and eng.hf_config["model_type"] == "qwen3_moe"
            eng.update_weights(hub_tensors(d.engine.model), version=1)
            assert os.listdir(eng.cfg["shared_dir"]) == ["v00000001"]
            assert len(eng.generate(prompts[:1], 2, SamplingParams(max_new_tokens=3))) == 2
        finally:
            eng.close()


# ------------------------------------------------------------------------------ processes
def test_launch_command_line():
    spec = LaunchSpec(model_path="/m", tp=2, dp=1, ep=2, mem_fraction=0.6, port=31000, api_key="k",
                      extra_args=["--enable-memory-saver"], num_servers=2)
    assert spec.argv(1) == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
        "--port", "31001", "--tp-size", "2", "--dp-size", "1", "--ep-size", "2",
        "--mem-fraction-static", "0.6", "--base-gpu-id", "2", "--enable-memory-saver",
    ]  # the key never: it travels in a --config file (secret_args), see the test below
    assert spec.url(1) == "http://127.0.0.1:31001"
    one = LaunchSpec(model_path="/m", command=["python", "x.py"])
    assert one.argv(0)[:2] == ["python", "x.py"] and "--base-gpu-id" not in one.argv(0)
    assert LaunchSpec(model_path="/m", host="0.0.0.0").url(0) == "http://127.0.0.1:30000"


def test_a_launched_servers_key_is_in_no_argv_no_environment_and_no_log(tmp_path, monkeypatch):
    """Issue 52 row 6, by construction (rollout/http_servers.ServerProcesses): the key reaches a
    launched SGLang server (here the double, which merges --config as SGLang 0.5.23 does and then
    prints its arguments, as SGLang logs its server_args) only through a --config YAML of mode 0600
    in a private directory removed at stop; the log's argv line and the server's own output in the
    log carry `<redacted>`, never the key; the server inherits none of the trainer's secrets (the
    judge key's variable, WANDB_API_KEY, HF_TOKEN), only the allow-listed variables."""
    import stat

    key = "sentinel-k3y-7f1c"
    monkeypatch.setenv("GSPO_TEST_JUDGE_KEY", "judge-sentinel")
    monkeypatch.setenv("WANDB_API_KEY", "wandb-sentinel")
    monkeypatch.setenv("HF_TOKEN", "hf-sentinel")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # allow-listed, not secret-like
    code = ("import os, sys, json; sys.path.insert(0, %r); import sglang_double; "
            "argv = sglang_double._merge_config(sys.argv[1:]); "
            "print('argv', json.dumps(argv), flush=True); print('env', json.dumps(dict(os.environ)), flush=True); "
            "import time; time.sleep(60)") % os.path.dirname(DOUBLE_SCRIPT)
    spec = LaunchSpec(model_path=str(tmp_path), command=[sys.executable, "-c", code], api_key=key,
                      log_dir=str(tmp_path / "logs"), env_vars=("GSPO_TEST_EXTRA",))
    monkeypatch.setenv("GSPO_TEST_EXTRA", "passed-on")
    procs = ServerProcesses(spec)
    procs.start()
    try:
        deadline = time.monotonic() + 60
        while "\nenv " not in open(procs.log_paths[0]).read() and time.monotonic() < deadline:
            time.sleep(0.05)
        secret_file = procs._private_dir + "/sglang_secrets.yaml"
        assert stat.S_IMODE(os.stat(secret_file).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(procs._private_dir).st_mode) == 0o700
        environ = b""
        for q in [procs.procs[0].pid, *descendants(procs.procs[0].pid)]:  # the shim and the server
            with open(f"/proc/{q}/cmdline", "rb") as f:
                assert key.encode() not in f.read()
            with open(f"/proc/{q}/environ", "rb") as f:
                environ += f.read()
    finally:
        procs.stop(grace_s=2)
    log_text = open(procs.log_paths[0]).read()
    assert key not in log_text, log_text
    lines = {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in log_text.splitlines() if " " in ln}
    argv = json.loads(lines["argv"])
    assert argv[:2] == ["--api-key", "<redacted>"], argv  # the server got it (redacted in its log)
    env = json.loads(lines["env"])
    for name in ("GSPO_TEST_JUDGE_KEY", "WANDB_API_KEY", "HF_TOKEN"):
        assert name not in env, name
    for sentinel in (b"judge-sentinel", b"wandb-sentinel", b"hf-sentinel", key.encode()):
        assert sentinel not in environ
    assert env["TOKENIZERS_PARALLELISM"] == "false" and env["GSPO_TEST_EXTRA"] == "passed-on"
    assert "PATH" in env
    assert not os.path.exists(secret_file)  # removed at stop


def test_a_key_beginning_with_a_dash_is_refused_in_one_line(tmp_path):
    """SGLang 0.5.23 turns a --config YAML into `["--api-key", key]` before argparse
    (utils/server_args_config_parser.py _add_scalar_arg): a key beginning with '-' would read as an
    option and the server would exit with code 2. Refused at launch, the key not shown."""
    key = "-Zk3y_from_token_urlsafe"
    procs = ServerProcesses(LaunchSpec(model_path="/m", api_key=key, command=["python", "x.py"],
                                       log_dir=str(tmp_path)))
    with pytest.raises(ValueError) as e:
        procs.start()
    assert "beginning with '-'" in str(e.value) and key not in str(e.value)
    procs.stop()


def test_stop_kills_a_server_that_ignores_sigterm(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"
    procs = ServerProcesses(LaunchSpec(model_path="/m", command=[sys.executable, "-c", code],
                                       log_dir=str(tmp_path)))
    procs.start()
    deadline = time.monotonic() + 20
    while "\nup\n" not in open(procs.log_paths[0]).read() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "\nup\n" in open(procs.log_paths[0]).read()  # SIGTERM is ignored from here on
    p = procs.procs[0]
    waits = []  # the timeouts stop() waits with
    real_wait = p.wait
    p.wait = lambda timeout=None: waits.append(timeout) or real_wait(timeout=timeout)
    procs.stop(grace_s=0.5)
    # SIGTERM ignored -> SIGKILL after a wait bounded by grace_s (then a bounded wait for the kill)
    assert p.returncode == -9
    assert waits and None not in waits and waits[0] <= 0.5, waits


def test_launched_server_that_dies_or_never_gets_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")  # must not reach the servers
    base = dict(model_path=str(tmp_path), command=[sys.executable, DOUBLE_SCRIPT], log_dir=str(tmp_path / "logs"))
    dying = ServerProcesses(LaunchSpec(port=free_port(), extra_args=["--double-exit-code", "3"], **base))
    dying.start()
    # the death is reported as such (not "not ready after 60 s"): noticed, not waited out
    with pytest.raises(SGLangNotReadyError, match=r"exited with code 3 before becoming ready(.|\n)*exiting as asked") as e:
        dying.wait_ready([ServerClient(u) for u in dying.urls], timeout_s=60)
    # the log's last line is on the message's first line: the trainer's CLI prints only that one
    assert "its log ends: '[sglang test double] exiting as asked'" in str(e.value).splitlines()[0]
    assert dying.procs[0].returncode == 3
    dying.stop()
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB=None" in open(dying.log_paths[0]).read()

    port = free_port()
    with pytest.raises(SGLangNotReadyError, match=rf"127.0.0.1:{port} not ready after 3 s"):
        _never_ready_engine(tmp_path, port)


def _never_ready_engine(tmp_path, port):
    """An engine whose launched server never gets healthy: the constructor fails after the
    readiness timeout and stops the process it started."""
    started = []
    orig = ServerProcesses.start

    def spy(self):
        urls = orig(self)
        started.append(self)
        return urls

    ServerProcesses.start = spy
    try:
        SGLangEngine({"launch": True, "model_path": str(tmp_path), "port": port,
                      "extra_args": ["--double-never-ready"]},
                     server_command=[sys.executable, DOUBLE_SCRIPT], log_dir=str(tmp_path / "logs2"),
                     **dict(FAST, ready_timeout_s=3.0))
    finally:
        ServerProcesses.start = orig
        for g in started:
            assert all(p.poll() is not None for p in g.procs)  # stopped on the failed start


# ------------------------------------------------------------------------------ real SGLang (GPU)
def _real_sglang_missing() -> str | None:
    """Why the real-SGLang test cannot run here: only a missing package or a missing GPU skip it.
    An installed sglang that fails to import is a failure of the test, not a skip (the test
    imports it)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return None


TEMPERATURE_GPU, LOGPROB_TOL = 0.5, 0.1  # max |engine - reference| over tokens; bf16 on both sides


@pytest.mark.skipif(_real_sglang_missing() is not None, reason=str(_real_sglang_missing()))
@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["disk", "distributed", "tensor"])
def test_real_sglang_logprobs_and_weight_sync(mode, tmp_path, tok):
    """Real SGLang on a tiny random Qwen3-MoE with a *peaked* output layer (logit std ~4, so the
    sampling temperature changes token log-probs by whole nats): the engine's log-probs of its
    own samples equal transformers' teacher forcing at the sampling temperature within
    LOGPROB_TOL (max over tokens), while the same reference at temperature 1 is at least
    10 x LOGPROB_TOL away on those tokens (the check separates the bug it exists for: engine
    log-probs of the untempered policy); then after a weight sync to another model, the same
    against that model, and the reference of the old model is far away (the sync took)."""
    import sglang  # noqa: F401  (an installed but broken sglang fails here instead of skipping)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_experts=8, num_experts_per_tok=2, max_position_embeddings=512,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=None)

    def peaked(seed):
        torch.manual_seed(seed)
        m = Qwen3MoeForCausalLM(cfg)
        with torch.no_grad():  # logits = normed hidden (rms 1) @ W: std ~ sqrt(256) * 0.25 = 4
            m.lm_head.weight.normal_(0, 0.25)
        return m.to(torch.bfloat16).eval()

    a, b = peaked(0), peaked(1)
    d = tmp_path / "a"
    a.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    import importlib.util

    extra = ["--dtype", "bfloat16", "--disable-cuda-graph", "--skip-server-warmup", "--skip-tokenizer-init"]
    memory_saver = importlib.util.find_spec("torch_memory_saver") is not None
    if mode == "tensor" and memory_saver:
        extra.append("--enable-memory-saver")
    eng = with_free_port(lambda port: SGLangEngine(
        {"launch": True, "model_path": str(d), "port": port, "weight_sync": mode, "mem_fraction": 0.3,
         "shared_dir": str(tmp_path / "sync"), "extra_args": extra, "ready_timeout_s": 600}), free=free_port)
    try:
        ps = [tok.encode("12+34="), tok.encode("hello")]
        sp = SamplingParams(temperature=TEMPERATURE_GPU, max_new_tokens=8)
        a.cuda()
        b.cuda()

        def reference(model, samples, temperature):
            out = []
            for s in samples:
                ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")
                with torch.no_grad():
                    logits = model(ids).logits[0].float()
                ref = torch.log_softmax(logits[len(s.prompt_ids) - 1 : -1] / temperature, -1)
                out.append(ref.gather(1, torch.tensor(s.response_ids, device="cuda")[:, None])[:, 0].cpu())
            return torch.cat(out)

        def check(model, other):
            samples = eng.generate(ps, 2, sp)
            got = torch.cat([torch.tensor(s.response_logprobs) for s in samples])
            err = (got - reference(model, samples, TEMPERATURE_GPU)).abs().max().item()
            untempered = (got - reference(model, samples, 1.0)).abs().max().item()
            stale = (got - reference(other, samples, TEMPERATURE_GPU)).abs().max().item()
            print(f"{mode}: max |engine - ref| {err:.3g}, vs T=1 {untempered:.3g}, vs the other model {stale:.3g}")
            assert err < LOGPROB_TOL, err
            assert untempered > 10 * LOGPROB_TOL, untempered  # the tolerance separates the temperatures
            assert stale > 10 * LOGPROB_TOL, stale  # and the models

        with pytest.warns(UserWarning, match="generate before any update_weights"):
            check(a, b)
        if mode == "tensor" and memory_saver:
            eng.sleep()
            eng.wake()
        eng.update_weights(((k, t.to("cuda")) for k, t in hub_tensors(b)), version=1)
        check(b, a)
        assert eng.server_weight_versions() == {eng.workers[0].url: "1"}
    finally:
        eng.close()


# ------------------------------------------------------------------------------ SGLang 0.5.23 as it is
def _paths(dbl) -> list[str]:
    return [r.path for r in dbl.records]


def test_tensor_sync_opens_and_closes_a_session_per_push_with_per_rank_payloads(model_dir, model_a, model_b,
                                                                                monkeypatch):
    """SGLang 0.5.23 applies update_weights_from_tensor only inside /begin_weight_update ...
    /end_weight_update (the double refuses it otherwise, as the server does); every TP rank's
    entry is serialized on its own (SGLang's Engine: one payload per rank)."""
    from gspo_megatron.rollout import weight_sync

    calls = []
    real = weight_sync.serialize_named_tensors
    monkeypatch.setattr(weight_sync, "serialize_named_tensors", lambda b: calls.append(len(b)) or real(b))
    with start_double_and_engine(model_dir, double_kw={"tp_size": 2}, weight_sync="tensor",
                                 bucket_mb=0.05, **FAST) as (dbl, eng):
        for v in (1, 2):
            eng.update_weights(hub_tensors(model_b if v == 1 else model_a), version=v)
        seq = [p for p in _paths(dbl) if "weight_update" in p or p == "/update_weights_from_tensor"]
        n = len(dbl.calls("/update_weights_from_tensor"))
        assert n >= 4 and seq[0] == "/begin_weight_update" and seq[-1] == "/end_weight_update"
        assert seq.count("/begin_weight_update") == seq.count("/end_weight_update") == 2  # one per push
        first = seq.index("/end_weight_update")
        assert set(seq[1:first]) == {"/update_weights_from_tensor"}
        assert len(calls) == 2 * n  # two TP ranks, each entry serialized separately
        assert not dbl.session_open


def test_a_failed_push_still_closes_its_session(model_dir, model_b):
    """A bucket the server refuses: the push fails naming the server, and the session is still
    closed (else the next /begin_weight_update would be refused: 'already open')."""
    with start_double_and_engine(model_dir, weight_sync="tensor", bucket_mb=0.05, **FAST) as (dbl, eng):
        bad = [("model.layers.0.mlp.gate.weight", torch.ones(3, 3))] + hub_tensors(model_b)  # wrong shape
        with pytest.raises(SGLangServerError, match=rf"{dbl.url}: /update_weights_from_tensor failed: .*"
                                                    r"model\.layers\.0\.mlp\.gate\.weight: shape \(3, 3\) != \(4, 64\)"):
            eng.update_weights(iter(bad), version=1)
        assert _paths(dbl).count("/begin_weight_update") == _paths(dbl).count("/end_weight_update") == 1
        assert not dbl.session_open
        eng.update_weights(hub_tensors(model_b), version=2)  # a new session opens fine
        assert dbl.weight_version == "2"


def test_the_double_refuses_what_sglang_refuses(model_dir):
    """Outside a session, unknown fields, dp > 1 for weight pushes, routes 0.5.23 does not have."""
    from gspo_megatron.rollout.sglang_api import payload

    with SGLangDouble(model_dir) as dbl:
        c = ServerClient(dbl.url)
        st, data = c.request_once("POST", "/update_weights_from_distributed",
                                  payload("/update_weights_from_distributed", names=[], dtypes=[], shapes=[]))
        assert st == 400 and b"must run between begin_weight_update() and end_weight_update()" in data
        st, _ = c.request_once("POST", "/update_weights_from_disk", {"model_path": "x", "flush_caches": False})
        assert st == 422
        st, _ = c.request_once("GET", "/get_weight_version", None)
        assert st == 404
        assert c.get("/model_info")["weight_version"] == "default"
        assert c.request_once("POST", "/begin_weight_update", {})[0] == 200
        assert c.request_once("POST", "/begin_weight_update", {})[0] == 400  # already open
        assert c.request_once("POST", "/end_weight_update", {})[0] == 200
    with SGLangDouble(model_dir, dp_size=2) as dbl:
        st, _ = ServerClient(dbl.url).request_once("POST", "/update_weights_from_tensor",
                                                   {"serialized_named_tensors": []})
        assert st == 500
    with pytest.raises(KeyError, match="flush_caches"):
        payload("/update_weights_from_disk", model_path="x", flush_caches=False)


def test_weight_version_from_model_info_and_no_deprecated_endpoints(model_dir, model_b):
    """server_weight_versions() reads /model_info (0.5.23 has no /get_weight_version); the engine
    never calls /get_server_info (deprecated: /server_info)."""
    with start_double_and_engine(model_dir, weight_sync="tensor", bucket_mb=0.05, **FAST) as (dbl, eng):
        eng.update_weights(hub_tensors(model_b), version=5)
        assert eng.server_weight_versions() == {dbl.url: "5"}
        assert "/get_server_info" not in _paths(dbl) and "/get_weight_version" not in _paths(dbl)


def test_colocated_engines_per_node_command_lines(monkeypatch):
    """rollout.sglang.launch=true on 2 nodes x 8 GPUs with tp 4: each node's local rank 0 starts
    2 servers on GPUs 0-3 and 4-7 with --enable-memory-saver (rendered, no GPU needed); the
    trainer's torchrun variables are kept out of the servers' environment; layouts SGLang 0.5.23
    cannot serve are refused with one line."""
    import dataclasses

    from gspo_megatron.config import SGLangConfig
    from gspo_megatron.rollout.colocate import NodeLayout, check_colocated, node_launch_spec
    from gspo_megatron.rollout.sglang_server import SGLangError

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "0")
    layout = NodeLayout.from_env(rank=8, world_size=16)
    assert (layout.node_rank, layout.nnodes, layout.local_rank, layout.gpus_per_node) == (1, 2, 0, 8)
    sg = SGLangConfig(launch=True, tp=4, ep=4, host="0.0.0.0", weight_sync="distributed", port=31000)
    spec = node_launch_spec(sg, model_path="/m", layout=layout)
    argvs = [spec.argv(i) for i in range(spec.num_servers)]
    assert len(argvs) == 2
    for i, a in enumerate(argvs):
        assert a[a.index("--base-gpu-id") + 1] == str(4 * i) and a[a.index("--tp-size") + 1] == "4"
        assert a[a.index("--port") + 1] == str(31000 + i) and "--enable-memory-saver" in a
    assert {"RANK", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"} <= set(spec.unset_env)
    assert all("--enable-return-routed-experts" not in a for a in argvs)
    routed = node_launch_spec(sg, model_path="/m", layout=layout, return_routed_experts=True)  # R3 runs
    assert all("--enable-return-routed-experts" in routed.argv(i) for i in range(routed.num_servers))
    check_colocated(sg, nnodes=2)
    for bad, needle in [(dict(tp=3), "do not split"), (dict(weight_sync="tensor"), "weight_sync=tensor"),
                        (dict(host="127.0.0.1"), "not reachable"), (dict(tp=2, dp=2), "data-parallel")]:
        with pytest.raises(SGLangError, match=needle):
            s2 = dataclasses.replace(sg, **bad)
            check_colocated(s2, nnodes=2)
            node_launch_spec(s2, model_path="/m", layout=layout)


def test_the_colocated_multi_node_refusal_advises_a_mode_the_config_accepts():
    """Found by the refit plan (train/simulate.py): colocated SGLang on two nodes with
    weight_sync=tensor was refused with the advice "use weight_sync=distributed", which the
    config refuses for colocated servers (trainer rank 0 and server 0 share a GPU). Every mode the
    refusal advises must pass the config's own validation with launch=true."""
    import re

    from gspo_megatron.config import SGLangConfig
    from gspo_megatron.errors import ConfigError
    from gspo_megatron.resolve import load_config
    from gspo_megatron.rollout.colocate import check_colocated
    from gspo_megatron.rollout.sglang_server import SGLangError

    with pytest.raises(SGLangError) as e:
        check_colocated(SGLangConfig(launch=True, tp=4, host="0.0.0.0", weight_sync="tensor"), nnodes=2)
    advised = set(re.findall(r"weight_sync=(\w+)", str(e.value).split("; use ", 1)[1]))
    assert advised, str(e.value)
    for mode in sorted(advised):
        try:
            load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "configs", "tiny_cpu.yaml"),
                        ["rollout.backend=sglang", "rollout.sglang.launch=true", f"rollout.sglang.weight_sync={mode}",
                         "model.hf_dir=/m", "rollout.sglang.shared_dir=/tmp/w"])
        except ConfigError as err:
            if "weight_sync" in str(err):
                pytest.fail(f"the refusal advises weight_sync={mode}, which the config refuses: {err}")


# ------------------------------------------------------------------------------ routed experts (R3)
# SGLang 0.5.23's return_routed_experts: meta_info.routed_experts = base64 of the int32 C-order
# bytes of [seqlen - 1 - start_len, num_hidden_layers, num_experts_per_tok], positions
# start_len .. seqlen - 2 (tests/test_sglang_contract.py checks these facts against the source).
ROUTING = dict(return_routing=True, **FAST)
ROUTING_DOUBLE = {"enable_return_routed_experts": True}


def reference_routing(model, ids: list[int]) -> torch.Tensor:
    """The test's own reference: [len(ids) - 1, L, k] top-k expert indices of `model`'s routers
    (hooks on every layer's mlp.gate, Qwen3MoeTopKRouter -> (logits, scores, indices)) over the
    whole sequence, rows 0 .. len(ids) - 2."""
    got = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[2]))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    assert sorted(got) == list(range(len(model.model.layers)))
    return torch.stack([got[i] for i in sorted(got)], dim=1)[:-1].to(torch.int32)


def _decode(b64: str, layers: int = 2, k: int = 2) -> torch.Tensor:
    import base64

    import numpy as np

    return torch.from_numpy(np.frombuffer(base64.b64decode(b64), dtype=np.int32).copy()).view(-1, layers, k)


def test_routed_experts_equal_an_independent_reference(model_dir, prompts, model_a):
    """return_routing: every request asks for return_routed_experts; each Sample.routed_experts is
    int32 [P + R - 1, L, k] and equals the transformers model's own router choices on
    prompt + response (stop-token-ended and length-ended samples alike); off, nothing is asked."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=7)
    with start_double_and_engine(model_dir, double_kw=ROUTING_DOUBLE, **ROUTING) as (dbl, eng):
        eng._warned_unsynced = True
        assert eng.routing_shape == (2, 2)
        out = eng.generate(prompts, 3, sp)
        greedy = eng.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=6))
        stop_tok = greedy[0].response_ids[2]
        stopped = eng.generate(prompts[:1], 1, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                               stop_token_ids=(stop_tok,)))
        assert stopped[0].finish_reason == "stop" and stopped[0].response_ids[-1] == stop_tok
        for r in dbl.calls("/generate"):
            assert r["return_routed_experts"] is True and "routed_experts_start_len" not in r
    distinct = set()
    for s in out + greedy + stopped:
        P, R = len(s.prompt_ids), len(s.response_ids)
        assert s.routed_experts.dtype == torch.int32 and s.routed_experts.shape == (P + R - 1, 2, 2)
        ref = reference_routing(model_a, s.prompt_ids + s.response_ids)
        assert torch.equal(s.routed_experts, ref), (s.routed_experts, ref)
        distinct |= set(ref.flatten().tolist())
        assert not torch.equal(ref[1:], ref[:-1])  # the rows really differ: a shifted payload would fail
    assert distinct == {0, 1, 2, 3}  # every expert is used somewhere: not a degenerate routing

    with start_double_and_engine(model_dir, double_kw=ROUTING_DOUBLE, **FAST) as (dbl, eng):
        eng._warned_unsynced = True
        assert all(s.routed_experts is None for s in eng.generate(prompts[:1], 2, sp))
        assert "return_routed_experts" not in dbl.calls("/generate")[0]


def test_double_routed_experts_start_len_follows_sglang(model_dir, prompts, model_a):
    """The double against SGLang's rule (scheduler.py ~3300, state_capturer/base.py get_topk):
    rows start_len .. seqlen - 2 for 0 <= start_len <= prompt length; outside it HTTP 400 with
    SGLang's message whether or not the server has the flag; without the flag a valid request
    gets no routed_experts field at all; batched rows get one payload each."""
    prompt = prompts[0]
    P = len(prompt)
    base = {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 5},
            "return_routed_experts": True}
    with SGLangDouble(model_dir, enable_return_routed_experts=True) as dbl:
        c = ServerClient(dbl.url)
        full = c.post("/generate", base)
        seq = prompt + full["output_ids"]
        ref = reference_routing(model_a, seq)
        assert torch.equal(_decode(full["meta_info"]["routed_experts"]), ref)
        for start in (0, 1, P - 1, P):
            got = c.post("/generate", dict(base, routed_experts_start_len=start))
            assert got["output_ids"] == full["output_ids"]  # greedy: the same sequence
            rows = _decode(got["meta_info"]["routed_experts"])
            assert rows.shape[0] == len(seq) - 1 - start and torch.equal(rows, ref[start:]), start
        for bad, needle in ((-1, b"is lower than 0"), (P + 1, b"is higher than the number of input tokens")):
            st, data = c.request_once("POST", "/generate", dict(base, routed_experts_start_len=bad))
            assert st == 400 and needle in data and b"routed_experts_start_len" in data, (st, data)
        # start_len is only checked when routing is asked for (as in SGLang)
        st, _ = c.request_once("POST", "/generate", dict(base, return_routed_experts=False,
                                                         routed_experts_start_len=P + 1))
        assert st == 200
        batch = c.post("/generate", dict(base, input_ids=[prompts[1], prompts[2]]))
        for p, row in zip((prompts[1], prompts[2]), batch):
            assert torch.equal(_decode(row["meta_info"]["routed_experts"]),
                               reference_routing(model_a, p + row["output_ids"]))
        assert c.get("/server_info")["enable_return_routed_experts"] is True
        st, _ = c.request_once("POST", "/generate", {"input_ids": prompt, "return_routed_expert": True})
        assert st == 422  # a misspelt field is refused, not silently ignored
    with SGLangDouble(model_dir) as dbl:  # launched without --enable-return-routed-experts
        c = ServerClient(dbl.url)
        got = c.post("/generate", dict(base, routed_experts_start_len=1))
        assert got["output_ids"] and "routed_experts" not in got["meta_info"]
        st, data = c.request_once("POST", "/generate", dict(base, routed_experts_start_len=P + 1))
        assert st == 400 and b"is higher than the number of input tokens" in data
        assert c.get("/server_info")["enable_return_routed_experts"] is False


def test_a_server_of_another_sglang_version_is_one_line(model_dir):
    """SGLang 0.5.23 reports its version in /server_info (http_server.py server_info: __version__);
    the engine speaks exactly that one (before: nothing checked it)."""
    import warnings as _warnings

    from gspo_megatron.rollout.sglang_api import SGLANG_VERSION
    from gspo_megatron.rollout.sglang_engine import SGLangVersionError

    with SGLangDouble(model_dir, version="0.5.9") as dbl:
        with pytest.raises(SGLangVersionError) as err:
            SGLangEngine({"urls": [dbl.url]}, model_path=model_dir)
        msg = str(err.value)
        assert "\n" not in msg and dbl.url in msg and "0.5.9" in msg and SGLANG_VERSION in msg, msg
        with _warnings.catch_warnings(record=True) as caught:
            _warnings.simplefilter("always")
            SGLangEngine({"urls": [dbl.url], "check_version": False}, model_path=model_dir).close()
        assert any("0.5.9" in str(w.message) for w in caught)
    with SGLangDouble(model_dir) as dbl:  # the version it speaks: accepted
        assert dbl.server_info()["version"] == SGLANG_VERSION
        SGLangEngine({"urls": [dbl.url]}, model_path=model_dir).close()


def test_routing_from_a_server_without_the_flag_is_one_clear_line(model_dir, prompts, monkeypatch):
    """Caught at construction from /server_info; a server that does not report the argument is
    caught on the first response (SGLang then silently omits the field)."""
    from gspo_megatron.rollout.sglang_engine import SGLangRoutingNotEnabledError

    with SGLangDouble(model_dir) as dbl:
        with pytest.raises(SGLangRoutingNotEnabledError) as err:
            SGLangEngine({"urls": [dbl.url]}, model_path=model_dir, **ROUTING)
        msg = str(err.value)
        assert "\n" not in msg and dbl.url in msg and "--enable-return-routed-experts" in msg, msg
        assert "enable_return_routed_experts=false" in msg
        info = dbl.server_info()
        info.pop("enable_return_routed_experts")
        monkeypatch.setattr(dbl, "server_info", lambda: info)
        eng = SGLangEngine({"urls": [dbl.url]}, model_path=model_dir, **ROUTING)
        try:
            eng._warned_unsynced = True
            with pytest.raises(SGLangRoutingNotEnabledError) as err:
                eng.generate(prompts[:1], 2, SamplingParams(max_new_tokens=3))
            msg = str(err.value)
            assert "\n" not in msg and dbl.url in msg, msg
            assert re.search(r"no meta_info\.routed_experts .*must be launched with --enable-return-routed-experts",
                             msg), msg
            assert len(dbl.calls("/generate")) == 1  # a configuration error: not retried
        finally:
            eng.close()
    with pytest.raises(ValueError, match="return_routing needs num_hidden_layers and num_experts_per_tok"):
        SGLangEngine({"urls": ["http://127.0.0.1:9"]}, hf_config={"model_type": "llama"}, wait_ready=False,
                     **ROUTING)


def test_corrupted_routed_experts_are_a_protocol_error_naming_the_field(model_dir, prompts, monkeypatch):
    sp = SamplingParams(temperature=1.0, max_new_tokens=4)
    with start_double_and_engine(model_dir, double_kw=ROUTING_DOUBLE, **ROUTING) as (dbl, eng):
        eng._warned_unsynced = True
        dbl.faults.routed_experts_short = 1
        with pytest.raises(SGLangProtocolError, match=rf"SGLang server {dbl.url}: .*meta_info\.routed_experts has "
                                                      r"\d+ bytes, not a whole number of positions of 2 layers x 2 "
                                                      r"experts x int32 \(16 bytes each\)") as err:
            eng.generate(prompts[:1], 2, sp)
        assert "\n" not in str(err.value) and len(dbl.calls("/generate")) == 1  # not retried
        dbl.faults.routed_experts_extra_row = 1
        with pytest.raises(SGLangProtocolError, match=r"meta_info\.routed_experts covers (\d+) positions, "
                                                      r"expected prompt \d+ \+ response \d+ - 1 = \d+"):
            eng.generate(prompts[:1], 2, sp)
        monkeypatch.setattr(dbl, "_routed_experts", lambda s, start: "not base64!")
        with pytest.raises(SGLangProtocolError, match=r"meta_info\.routed_experts is not valid base64"):
            eng.generate(prompts[:1], 1, sp)
        monkeypatch.undo()
        assert all(s.routed_experts is not None for s in eng.generate(prompts[:1], 2, sp))  # healthy again


def test_launched_servers_get_the_routing_flag(model_dir, prompts, model_a, tmp_path):
    """return_routing with launch=true: the server command line carries
    --enable-return-routed-experts (once, even if extra_args has it too), and the launched double,
    which honours the flag as SGLang does, returns routing equal to the reference."""
    spec = LaunchSpec(model_path="/m", return_routed_experts=True)
    assert spec.argv(0).count("--enable-return-routed-experts") == 1
    both = LaunchSpec(model_path="/m", return_routed_experts=True, extra_args=["--enable-return-routed-experts"])
    assert both.argv(0).count("--enable-return-routed-experts") == 1
    assert "--enable-return-routed-experts" not in LaunchSpec(model_path="/m").argv(0)
    eng = with_free_port(lambda port: SGLangEngine(
        {"launch": True, "model_path": model_dir, "port": port, "extra_args": ["--dtype", "float32"]},
        server_command=[sys.executable, DOUBLE_SCRIPT], log_dir=str(tmp_path / "logs"),
        server_env={"OMP_NUM_THREADS": "1"}, return_routing=True, **dict(FAST, ready_timeout_s=90.0),
    ), free=free_port)
    try:
        assert "--enable-return-routed-experts" in eng.procs.spec.argv(0)
        with open(eng.procs.log_paths[0]) as f:
            first = f.readline()
        assert first.startswith("$ ") and "--enable-return-routed-experts" in first.split()
        eng._warned_unsynced = True
        for s in eng.generate(prompts[:1], 2, SamplingParams(temperature=1.0, max_new_tokens=4)):
            assert torch.equal(s.routed_experts, reference_routing(model_a, s.prompt_ids + s.response_ids))
    finally:
        eng.close()


def test_from_config_reads_the_routing_option(model_dir, tmp_path):
    """from_config: return_routing <- Config.engine_routing when the Config has it, else
    rollout.return_routing when the rollout section has it, else off."""
    import dataclasses
    from types import SimpleNamespace

    from gspo_megatron.config import RolloutConfig
    from gspo_megatron.resolve import load_config

    from sglang_double import sglang_overrides

    with SGLangDouble(model_dir, enable_return_routed_experts=True) as d:
        args = [f"model.hf_dir={model_dir}", f"out_dir={tmp_path / 'run'}", *sglang_overrides(d.url)]
        cfg = load_config(None, args)
        eng = SGLangEngine.from_config(cfg, retry_backoff_s=0.01)
        assert eng.return_routing is False and eng.routing_shape is None
        eng.close()
        if "return_routing" in {f.name for f in dataclasses.fields(RolloutConfig)}:
            eng = SGLangEngine.from_config(load_config(None, [*args, "rollout.return_routing=true"]),
                                           retry_backoff_s=0.01)
            assert eng.return_routing and eng.routing_shape == (2, 2)
            eng.close()
        for ns in (SimpleNamespace(model=cfg.model, out_dir=cfg.out_dir,
                                   rollout=SimpleNamespace(sglang=cfg.rollout.sglang, return_routing=True)),
                   SimpleNamespace(model=cfg.model, out_dir=cfg.out_dir, engine_routing=True,
                                   rollout=SimpleNamespace(sglang=cfg.rollout.sglang))):
            eng = SGLangEngine.from_config(ns, retry_backoff_s=0.01)
            assert eng.return_routing and eng.routing_shape == (2, 2)
            eng.close()


# ------------------------------------------------------------------------------ pushes mid-generation
def test_a_push_mid_generation_waits_for_nothing_and_labels_every_token(model_dir, prompts, model_a, model_b,
                                                                        tmp_path):
    """update_weights_mid_generation (SGLang 0.5.23's retract pause, issue 42): every request holds
    after 3 of its tokens until a pause has come and gone (Faults.hold_after_tokens), so a push that
    waited for the generation in flight could never return; this one does, the generation then
    finishes, and each sample's first 3 tokens are model A's (version 1), the rest model B's given
    the whole prefix (version 2): token_versions say so and the log-probs are those policies'
    own. The sample's weight_version is its oldest token's (the staleness bound)."""
    import threading

    sp = SamplingParams(temperature=0.9, max_new_tokens=8)
    with start_double_and_engine(model_dir, faults=Faults(hold_after_tokens=3), shared_dir=str(tmp_path / "s"),
                                 **FAST) as (dbl, eng):
        assert eng.supports_push_mid_generation
        eng.update_weights(hub_tensors(model_a), version=1)
        got: dict = {}
        gen = threading.Thread(target=lambda: got.__setitem__("out", eng.generate(prompts, 2, sp)), daemon=True)
        gen.start()
        deadline = time.monotonic() + 60
        while dbl.holding < len(prompts) and time.monotonic() < deadline:  # every request decoded 3 tokens
            time.sleep(0.01)
        assert dbl.holding == len(prompts), dbl.holding
        eng.update_weights_mid_generation(hub_tensors(model_b), version=2)
        gen.join(60)
        assert not gen.is_alive() and eng.weight_version == 2
        out = got["out"]
        spanning = [s for s in out if len(s.response_ids) > 3]
        assert spanning, [s.response_ids for s in out]  # 6 samples of 8 tokens: an eos in the first 3 of all is ~0
        for s in out:
            n = len(s.response_ids)
            assert s.weight_version == 1
            if n <= 3:  # ended before the push
                assert s.token_versions is None
                continue
            assert s.token_versions == [1] * 3 + [2] * (n - 3), s.token_versions
            lp = torch.tensor(s.response_logprobs)
            torch.testing.assert_close(lp[:3], teacher_forced_logprobs(model_a, s.prompt_ids, s.response_ids[:3], 0.9),
                                       atol=ATOL, rtol=0)
            torch.testing.assert_close(lp[3:], teacher_forced_logprobs(model_b, s.prompt_ids + s.response_ids[:3],
                                                                       s.response_ids[3:], 0.9), atol=ATOL, rtol=0)
        # SGLang's order: pause (retract), the update with no wait, the flush a paused server allows, continue
        ctl = [r.path for r in dbl.records if r.path in ("/pause_generation", "/update_weights_from_disk",
                                                         "/flush_cache", "/continue_generation")]
        assert ctl[-4:] == ["/pause_generation", "/update_weights_from_disk", "/flush_cache", "/continue_generation"]
        assert dbl.calls("/pause_generation")[-1] == {"mode": "retract"}
        # later generations (no hold) are plain version 2
        dbl.faults.hold_after_tokens = 0
        assert {s.weight_version for s in eng.generate(prompts[:1], 1, SamplingParams(max_new_tokens=4))} == {2}


def test_the_double_holds_a_weight_update_behind_running_requests_unless_paused(model_dir, prompts, model_b):
    """Fidelity of the double: SGLang's weight update takes the model-update writer lock, which waits
    for every running request (tokenizer_manager.py update_weights_from_disk), unless generation is
    paused; /flush_cache refuses while requests run; an unknown pause mode is refused."""
    from gspo_megatron.rollout.sglang_server import ServerClient as Client

    with SGLangDouble(model_dir, faults=Faults(hold_after_tokens=2)) as dbl:
        c = Client(dbl.url)
        import threading

        req = threading.Thread(target=lambda: c.request_once(
            "POST", "/generate", {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 6},
                                  "return_logprob": True}, timeout_s=60), daemon=True)
        req.start()
        deadline = time.monotonic() + 30
        while dbl.holding < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dbl.holding == 1
        assert c.request_once("POST", "/flush_cache", None, timeout_s=10)[0] == 400
        dbl.writer_timeout_s = 0.5  # not paused: the update waits for the running request (here: gives up)
        status, body = c.request_once("POST", "/update_weights_from_disk", {"model_path": model_dir}, timeout_s=10)
        assert status == 500 and b"model update lock" in body
        dbl.writer_timeout_s = 600.0
        status, _ = c.request_once("POST", "/pause_generation", {"mode": "sideways"}, timeout_s=10)
        assert status == 422
        assert c.request_once("POST", "/pause_generation", {"mode": "retract"}, timeout_s=10)[0] == 200
        assert c.request_once("POST", "/flush_cache", None, timeout_s=10)[0] == 200  # paused: queued requests allowed
        assert dbl._writer()  # paused: the update does not wait for the held request (else: 600 s, then False)
        assert c.request_once("POST", "/continue_generation", {}, timeout_s=10)[0] == 200
        req.join(30)
        assert not req.is_alive()


def test_a_restart_waits_for_every_process_of_the_old_server(tmp_path, monkeypatch):
    """Issue 52: a killed GPU process keeps its memory until it has exited, and vLLM's start-up
    free-memory check then refuses the new server; restart() waited for the leader only. Now it
    waits (bounded) until no live process of the old group is left. Real: group_members sees a
    server's leader and the child it started (same group), and nothing once they are stopped
    (zombies do not count). By construction: a restart whose old group reports live processes
    three more times spawns only after that."""
    from gspo_megatron.rollout import http_servers

    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print('up', flush=True); time.sleep(120)")
    procs = ServerProcesses(LaunchSpec(model_path="/m", command=[sys.executable, "-c", code], log_dir=str(tmp_path)))
    procs.start()
    try:
        old = procs.procs[0]
        deadline = time.monotonic() + 30
        while len(http_servers.group_members(old.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(http_servers.group_members(old.pid)) == 3  # the shim (the leader), the server, its child
        events = []
        real_members, real_spawn = http_servers.group_members, procs._spawn
        polls = {"n": 0}

        def members(pgid):
            if pgid == old.pid:
                polls["n"] += 1
                events.append("poll")
                if polls["n"] <= 3:
                    return [4242]  # still tearing down
            return real_members(pgid)

        monkeypatch.setattr(http_servers, "group_members", members)
        monkeypatch.setattr(procs, "_spawn", lambda i: events.append("spawn") or real_spawn(i))
        procs.restart(0, grace_s=1.0)
        assert events[:5] == ["poll", "poll", "poll", "poll", "spawn"], events
        assert real_members(old.pid) == []  # the old group is gone, the child included
    finally:
        procs.stop(grace_s=1.0)
