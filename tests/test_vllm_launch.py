"""A launched vLLM server follows the run's config, not the vLLM preset's (issue 41, item 2 and 5b/5g):

* on CPU it gets the CPU flags by default (--enforce-eager, a KV cache sized from the model instead
  of most of the host's memory, VLLM_CPU_OMP_THREADS_BIND=nobind);
* it serves in the trainer's model.dtype unless rollout.vllm.dtype says otherwise, with one
  warning line when the two differ (vLLM's own auto serves a float32 checkpoint in bfloat16);
* a server that dies at start is reported with its root cause (the first exception of its log),
  not only its last line;
* on CUDA it takes GPUs disjoint from the trainer's, or the launch is refused in one line
  (`vllm_server.server_gpus` / `prepare` with stand-in GPU counts: no GPU here; on a GPU node the
  same code runs in `launch`, called by VLLMEngine on trainer rank 0);
* server versions are compared by release: ``0.32.0+cu130`` is vLLM 0.32.0, ``0.5.23+cu129`` SGLang 0.5.23.

The launch tests run the real launch path (VLLMEngine.from_config -> vllm_server.launch ->
ServerProcesses) with a stand-in server command that records its argv and environment. The real
server from tiny_cpu.yaml + rollout.backend=vllm rollout.vllm.launch=true (head_dim 32, float32,
nothing else vLLM-specific; every step's mismatch_logprob_max <= 1e-4) is
tests/test_vllm.py::test_trainer_launches_vllm_trains_survives_a_server_kill_and_resumes.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import textwrap

import pytest
import torch

from gspo_megatron import resolve
from test_train_loop import REPO

TINY = os.path.join(REPO, "launch", "configs", "tiny_cpu.yaml")
VLLM = ["rollout.backend=vllm", "rollout.vllm.launch=true"]
HEAD32 = ["model.hf_config.head_dim=32"]  # vLLM's CPU attention takes head_dim 32, 64, 80, ... (cpu_attn.py)
# Qwen3-30B-A3B's attention (config.json): what sizes the KV cache
QWEN3_30B = dict(model_type="qwen3_moe", vocab_size=151936, num_hidden_layers=48, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, hidden_size=2048, max_position_embeddings=40960, num_experts=128,
                 num_experts_per_tok=8, moe_intermediate_size=768)

RECORDER = textwrap.dedent("""
    import ctypes, json, os, sys
    keep = ("VLLM_CPU_OMP_THREADS_BIND", "CUDA_VISIBLE_DEVICES", "VLLM_SERVER_DEV_MODE", "LOCAL_RANK", "RANK",
            "VLLM_API_KEY", "GSPO_TEST_VLLM_KEY", "WANDB_API_KEY", "HF_TOKEN", "PATH", "GSPO_TEST_EXTRA")
    sig = ctypes.c_int(-1)  # prctl(PR_GET_PDEATHSIG): kept across exec
    ctypes.CDLL(None).prctl(2, ctypes.byref(sig))
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({"argv": sys.argv[2:], "env": {k: os.environ.get(k) for k in keep}, "pdeathsig": sig.value}, f)
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
""")


def _config(*overrides):
    from gspo_megatron.resolve import load_config

    return load_config(TINY, [*VLLM, *HEAD32, *overrides])


def _hf_dir(tmp_path, cfg) -> str:
    """The run's architecture as a checkpoint directory's config.json (what the server loads)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    arch = {**resolve.hf_config_dict(cfg), "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"]}
    (d / "config.json").write_text(json.dumps(arch))
    return str(d)


def _recorded_launch(tmp_path, cfg) -> tuple[list[str], dict]:
    """Launch through the trainer's path (VLLMEngine.from_config, as train/setup.py does) with a
    server command that records its argv and environment and exits."""
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    script = tmp_path / "record_server.py"
    script.write_text(RECORDER)
    out = tmp_path / "launched.json"
    eng = VLLMEngine.from_config(cfg, hf_config=resolve.hf_config_dict(cfg), model_path=_hf_dir(tmp_path, cfg),
                                 server_command=[sys.executable, str(script), str(out)], wait_ready=False,
                                 log_dir=str(tmp_path / "logs"))
    try:
        eng.procs.procs[0].wait(timeout=120)
    finally:
        eng.close()
    rec = json.loads(out.read_text())
    return rec["argv"], {**rec["env"], "pdeathsig": rec["pdeathsig"]}


def _flag(argv: list[str], name: str) -> str:
    assert name in argv, f"{name} not in {argv}"
    return argv[argv.index(name) + 1]


# ----------------------------------------------------------------------------------------- CPU
def test_cpu_launch_gets_the_cpu_flags_and_a_kv_cache_sized_from_the_model(tmp_path, monkeypatch):
    """tiny_cpu.yaml + rollout.backend=vllm rollout.vllm.launch=true, nothing else: eager, a
    bounded KV cache (the tiny model's 4 x 512 tokens need 2 MiB: the 32 MiB floor), nobind, and
    the torchrun variables of the trainer are not the server's."""
    cfg = _config()
    assert cfg.rollout.vllm.cpu_kv_cache_mb is None and cfg.rollout.vllm.dtype == "auto"
    monkeypatch.setenv("LOCAL_RANK", "0")  # as under torchrun: the server must not inherit it
    argv, env = _recorded_launch(tmp_path, cfg)
    assert "--enforce-eager" in argv, argv
    assert int(_flag(argv, "--kv-cache-memory-bytes")) == 32 << 20
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["LOCAL_RANK"] is None


def test_the_key_reaches_the_server_as_its_own_variable_and_nothing_secret_is_inherited(tmp_path, monkeypatch):
    """Issue 52 row 6: rollout.vllm.api_key_env names the variable; the launched server gets the
    key as VLLM_API_KEY (vllm/entrypoints/serve/middleware/register.py:32-33 reads it there), never
    in its argv or its log; the trainer's secrets (the key's own variable, WANDB_API_KEY, HF_TOKEN)
    are not inherited; rollout.vllm.env_vars passes more by name. Without a key: a generated one."""
    key = "sentinel-launch-key-3c9e"
    for name, value in (("GSPO_TEST_VLLM_KEY", key), ("WANDB_API_KEY", "wandb-sentinel"), ("HF_TOKEN", "hf-sentinel"),
                        ("GSPO_TEST_EXTRA", "passed-on")):
        monkeypatch.setenv(name, value)
    argv, env = _recorded_launch(tmp_path, _config("rollout.vllm.api_key_env=GSPO_TEST_VLLM_KEY",
                                                   "rollout.vllm.env_vars=[GSPO_TEST_EXTRA]"))
    assert env["VLLM_API_KEY"] == key and not any(key in a for a in argv), argv
    assert env["GSPO_TEST_VLLM_KEY"] is None and env["WANDB_API_KEY"] is None and env["HF_TOKEN"] is None, env
    assert env["GSPO_TEST_EXTRA"] == "passed-on" and env["PATH"], env
    log_text = (tmp_path / "logs" / "vllm_server_0.log").read_text()
    assert log_text.startswith("$ ") and key not in log_text, log_text[:500]
    monkeypatch.delenv("GSPO_TEST_VLLM_KEY")
    _, env = _recorded_launch(tmp_path, _config())
    assert len(env["VLLM_API_KEY"]) == 32  # secrets.token_hex(16): a launched server always has a key


def test_keys_are_named_never_written_in_a_config(monkeypatch):
    """A key in a config is refused in one line pointing at api_key_env (it would reach
    config.yaml, the W&B config and the servers' argv); api_key_env must be a variable name (a
    pasted key is refused without being shown); env_vars may not name a secret; a named variable
    that is unset, or holds what no header carries, is one line naming the variable, not the value."""
    from gspo_megatron.config import ConfigError
    from gspo_megatron.errors import InputError
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    for key in ("rollout.vllm.api_key", "rollout.sglang.api_key", "reward.judge.api_key"):
        with pytest.raises(ConfigError, match=rf"^{key}: keys are given by environment variable name.*api_key_env"):
            _config(f"{key}=s3cr3t-value")
    with pytest.raises(ConfigError) as e:
        _config("rollout.vllm.api_key_env=sk-live-s3cr3t")
    assert "s3cr3t" not in str(e.value) and "not a name" in str(e.value)
    with pytest.raises(ConfigError, match="WANDB_API_KEY looks like a secret"):
        _config("rollout.vllm.env_vars=[WANDB_API_KEY]")
    monkeypatch.delenv("GSPO_UNSET_KEY", raising=False)
    with pytest.raises(InputError, match=r"^rollout.vllm.api_key_env=GSPO_UNSET_KEY: that environment variable is not set"):
        VLLMEngine({"urls": ["http://127.0.0.1:9"], "api_key_env": "GSPO_UNSET_KEY"}, wait_ready=False)
    monkeypatch.setenv("GSPO_CR_KEY", "abc\r")
    with pytest.raises(InputError) as e:
        VLLMEngine({"urls": ["http://127.0.0.1:9"], "api_key_env": "GSPO_CR_KEY"}, wait_ready=False)
    assert str(e.value).startswith("rollout.vllm.api_key_env=GSPO_CR_KEY: the key holds a carriage return")
    assert "abc" not in str(e.value)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_server_dies_with_its_starter_and_nothing_is_loaded_between_fork_and_exec(tmp_path, monkeypatch):
    """Issue 41 5h, then issue 52: the server gets SIGKILL when its shim dies (PR_SET_PDEATHSIG, read
    back in the server; rollout/process_guard.py: the shim, not the trainer, is its parent, and the
    shim stops the group when the trainer dies), and nothing is looked up between fork and exec in
    the trainer: a dlopen there, in a process with threads, can hang on a loader lock held by
    another thread at the fork. ctypes.CDLL is wrapped to leave a mark when a process other than
    this one calls it (the forked child runs this process's memory until exec); before issue 41,
    the child called it. The shim that sets the signal is single-threaded and resolves libc before
    its own fork."""
    import ctypes
    import signal

    parent, mark = os.getpid(), tmp_path / "dlopen_in_child"
    real = ctypes.CDLL

    def cdll(*a, **k):
        if os.getpid() != parent:
            os.close(os.open(str(mark), os.O_CREAT | os.O_WRONLY))
        return real(*a, **k)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    _, env = _recorded_launch(tmp_path, _config())
    assert env["pdeathsig"] == int(signal.SIGKILL)
    assert not mark.exists(), "ctypes.CDLL ran in the forked child"


def test_default_cpu_kv_cache_is_derived_from_the_model_and_max_model_len():
    from gspo_megatron.rollout.vllm_server import (CPU_KV_CACHE_FALLBACK_MB, VLLMLaunchSpec,
                                                   default_cpu_kv_cache_mb, prepare)

    # 4 sequences x 4096 tokens x (K+V x 48 layers x 4 kv heads x 128 x 4 B) = 3 GiB; bf16 half
    assert default_cpu_kv_cache_mb(QWEN3_30B, 4096, "float32")[0] == 3072
    assert default_cpu_kv_cache_mb(QWEN3_30B, 4096, "bfloat16")[0] == 1536
    # no max_model_len: the model's max_position_embeddings (what vLLM serves then)
    assert default_cpu_kv_cache_mb(QWEN3_30B, None, "bfloat16")[0] == 15360
    mb, why = default_cpu_kv_cache_mb({"model_type": "something"}, None, "float32")
    assert mb == CPU_KV_CACHE_FALLBACK_MB and "fixed" in why
    # an explicit size is kept
    spec = prepare(VLLMLaunchSpec(model_path="/nonexistent", device="cpu", cpu_kv_cache_mb=7))
    assert int(_flag(spec.argv(0), "--kv-cache-memory-bytes")) == 7 << 20


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_launched_server_serves_in_the_trainers_dtype(tmp_path, model_dtype):
    """rollout.vllm.dtype=auto (the default) is model.dtype, not vLLM's auto (which would serve
    this fp32 model in bf16: mismatch_logprob_max ~9e-2 every step)."""
    argv, _ = _recorded_launch(tmp_path, _config(f"model.dtype={model_dtype}"))
    assert _flag(argv, "--dtype") == model_dtype


def test_a_server_dtype_other_than_the_trainers_is_kept_and_said_once(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="gspo_megatron.rollout"):
        argv, _ = _recorded_launch(tmp_path, _config("model.dtype=float32", "rollout.vllm.dtype=bfloat16"))
    assert _flag(argv, "--dtype") == "bfloat16"
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "dtype" in r.getMessage()]
    assert len(said) == 1 and "bfloat16" in said[0] and "float32" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gspo_megatron.rollout"):
        _recorded_launch(tmp_path, _config("model.dtype=float32", "rollout.vllm.dtype=float"))  # vLLM's alias
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dtype" in r.getMessage()]


def test_config_refuses_what_vllm_would_not_take():
    from gspo_megatron.errors import ConfigError

    for bad, key in ((["rollout.vllm.dtype=fp8"], "rollout.vllm.dtype"), (["rollout.vllm.gpus=[1,1]"], "rollout.vllm.gpus"),
                     (["rollout.vllm.launch=false", "rollout.vllm.urls=[http://h:1]", "rollout.vllm.gpus=[1]"],
                      "rollout.vllm.gpus")):
        with pytest.raises(ConfigError, match=key):
            _config(*bad)


# ----------------------------------------------------------------------------------------- a dead server
VLLM_LIKE_DEATH = textwrap.dedent("""
    import sys
    print("(APIServer pid=1) WARNING 12-03 [system_utils.py:255] This can cause fd limit errors like "
          "`OSError: [Errno 24] Too many open files`.")
    print("(EngineCore_DP0 pid=2) ERROR 12-03 [core.py:1] EngineCore failed to start.")
    print("(EngineCore_DP0 pid=2) Traceback (most recent call last):")
    print('(EngineCore_DP0 pid=2)   File "cpu_worker.py", line 83, in init_device')
    print("(EngineCore_DP0 pid=2) ValueError: Available memory on node 0 (3.1/125.5 GiB) on startup is less than "
          "desired CPU memory utilization (0.92, 115.4 GiB).")
    print("(APIServer pid=1) Traceback (most recent call last):")
    print("(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. "
          "Failed core proc(s): {}")
    sys.exit(1)
""")


def test_a_dead_servers_error_line_carries_its_root_cause(tmp_path):
    from gspo_megatron.rollout.http_servers import EngineNotReadyError
    from gspo_megatron.rollout.vllm_server import ServerClient, VLLMLaunchSpec, launch

    script = tmp_path / "dying_server.py"
    script.write_text(VLLM_LIKE_DEATH)
    procs = launch(VLLMLaunchSpec(model_path=str(tmp_path), port=1, device="cpu", cpu_kv_cache_mb=32,
                                  command=[sys.executable, str(script)], log_dir=str(tmp_path / "logs")))
    try:
        with pytest.raises(EngineNotReadyError) as e:
            procs.wait_ready([ServerClient(procs.urls[0])], 120)
    finally:
        procs.stop()
    first = str(e.value).splitlines()[0]
    assert "exited with code 1 before becoming ready: ValueError: Available memory on node 0" in first, first
    assert "Engine core initialization failed" in first  # its last line still follows
    assert "OSError" not in first  # a warning that mentions an error is not the cause


def test_root_cause_is_the_first_exception_line():
    from gspo_megatron.rollout.http_servers import root_cause

    assert root_cause("$ python -m x\nINFO ok\nKeyError: 'a'\nRuntimeError: then this") == "KeyError: 'a'"
    assert root_cause("(EngineCore pid=3) torch.OutOfMemoryError: no room\n") == "torch.OutOfMemoryError: no room"
    assert root_cause("WARNING like `OSError: x`\nexiting as asked\n") is None


# ----------------------------------------------------------------------------------------- CUDA (stand-in counts)
def test_cuda_launch_takes_gpus_disjoint_from_the_trainers_or_is_refused(monkeypatch):
    from gspo_megatron.rollout.vllm_server import VLLMLaunchError, VLLMLaunchSpec, parallel_size, prepare, server_gpus

    # the trainer's 8 local ranks hold every GPU of an 8-GPU node: refused in one line
    with pytest.raises(VLLMLaunchError) as e:
        server_gpus([], node_gpus=8, trainer_gpus=8, needed=1)
    msg = str(e.value)
    assert "\n" not in msg and "GPUs 0-7" in msg and "rollout.vllm.urls" in msg
    # 4 trainer ranks on 8 GPUs: the server takes the GPUs after them
    assert server_gpus([], node_gpus=8, trainer_gpus=4, needed=1) == [4]
    assert server_gpus([], node_gpus=8, trainer_gpus=4, needed=parallel_size(["--tensor-parallel-size", "2"])) == [4, 5]
    assert parallel_size(["-tp=2", "--pipeline-parallel-size", "2"]) == 4
    assert server_gpus([6, 7], node_gpus=8, trainer_gpus=4, needed=2) == [6, 7]
    for gpus, needed, words in (([0, 5], 1, "are the trainer's"), ([9], 1, "do not exist"), ([5], 2, "needs 2 GPUs")):
        with pytest.raises(VLLMLaunchError, match=words):
            server_gpus(gpus, node_gpus=8, trainer_gpus=4, needed=needed)

    # through prepare (what launch runs): CUDA_VISIBLE_DEVICES of the server, mapped through the
    # trainer's own list when it has one; no CPU flags on CUDA
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    spec = prepare(VLLMLaunchSpec(model_path="m", device="cuda", node_gpus=8, trainer_gpus=4,
                                  extra_args=["--tensor-parallel-size", "2"], trainer_dtype=torch.bfloat16))
    assert spec.server_env()["CUDA_VISIBLE_DEVICES"] == "4,5" and "--enforce-eager" not in spec.argv(0)
    assert _flag(spec.argv(0), "--dtype") == "bfloat16"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    spec = prepare(VLLMLaunchSpec(model_path="m", device="cuda", node_gpus=4, trainer_gpus=2))
    assert spec.server_env()["CUDA_VISIBLE_DEVICES"] == "6"
    # the CPU cache size means nothing to a CUDA server: no CPU flags
    spec = prepare(VLLMLaunchSpec(model_path="m", device="cuda", node_gpus=2, trainer_gpus=1, cpu_kv_cache_mb=32))
    assert "--enforce-eager" not in spec.argv(0) and "VLLM_CPU_OMP_THREADS_BIND" not in spec.server_env()
    # the device found as the trainer finds it (torch sees CUDA), the trainer's ranks from torchrun
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(VLLMLaunchError, match="launch=true on CUDA"):
        prepare(VLLMLaunchSpec(model_path="m"))


def test_launched_replicas_on_cuda_each_take_gpus_of_their_own(tmp_path, monkeypatch):
    """rollout.vllm.replicas (issue 54): on CUDA server i takes the i-th slice of the GPU pool
    (rollout.vllm.gpus, else the GPUs after the trainer's), through the real spawn path
    (ServerProcesses.start / add with a stand-in server that records its environment); a replica
    the pool has no room for is refused in one line and leaves the fleet as it was."""
    from gspo_megatron.rollout.http_servers import ServerProcesses
    from gspo_megatron.rollout.vllm_server import VLLMLaunchError, VLLMLaunchSpec, prepare

    script = tmp_path / "record.py"
    script.write_text("import json, os, sys\n"
                      "port = sys.argv[sys.argv.index('--port') + 1]\n"
                      "with open(os.path.join(sys.argv[1], port + '.json'), 'w') as f:\n"
                      "    json.dump(os.environ.get('CUDA_VISIBLE_DEVICES'), f)\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,9")  # the trainer's view: indices into this list
    spec = prepare(VLLMLaunchSpec(model_path="m", device="cuda", node_gpus=8, trainer_gpus=2, num_servers=2, port=9000,
                                  extra_args=["--tensor-parallel-size", "2"], trainer_dtype=torch.bfloat16,
                                  command=[sys.executable, str(script), str(tmp_path)], log_dir=str(tmp_path / "logs")))
    assert [spec.replica_env(i)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["2,3", "4,5", "6,9"]
    with pytest.raises(VLLMLaunchError) as e:
        spec.replica_env(3)
    assert "\n" not in str(e.value) and "vLLM server 3: needs 2 GPU(s)" in str(e.value) and "hold 3 server(s)" in str(e.value)
    procs = ServerProcesses(spec)
    try:
        procs.start()
        assert procs.add() == 2 and procs.urls == [spec.url(i) for i in range(3)]
        for p in procs.procs:
            p.wait(timeout=60)
        got = {port: json.loads((tmp_path / f"{port}.json").read_text()) for port in (9000, 9001, 9002)}
        assert got == {9000: "2,3", 9001: "4,5", 9002: "6,9"}
        with pytest.raises(VLLMLaunchError, match="vLLM server 3"):
            procs.add()
        assert len(procs.procs) == len(procs.log_paths) == 3  # nothing half-added
        procs.stop_last(grace_s=1)
        assert procs.urls == [spec.url(0), spec.url(1)] and len(procs.log_paths) == 2
    finally:
        procs.stop(grace_s=1)
    # rollout.vllm.gpus lists the pool; two servers need 4 of them
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(VLLMLaunchError, match="needs 4 GPUs"):
        prepare(VLLMLaunchSpec(model_path="m", device="cuda", node_gpus=8, trainer_gpus=2, num_servers=2,
                               gpus=[5, 6, 7], extra_args=["--tensor-parallel-size", "2"]))


# ----------------------------------------------------------------------------------------- versions
def test_versions_compare_by_release_with_a_note_for_a_local_build():
    from gspo_megatron.rollout import sglang_api, vllm_api

    assert vllm_api.version_matches("0.32.0") == (True, None)
    ok, note = vllm_api.version_matches("0.32.0+cu130")
    assert ok and "+cu130" in note and "0.32.0" in note
    assert sglang_api.version_matches("0.5.23+cu129")[0] and sglang_api.version_matches("v0.5.23") == (True, None)
    for bad in ("0.32.1", "0.32.0rc1", "0.32.0+", "0.33.0+cu130", "", "unknown"):
        assert vllm_api.version_matches(bad) == (False, None), bad
    assert sglang_api.version_matches("0.5.22+cu129") == (False, None)


class _VersionServer:
    def __init__(self, version, route):
        self.url, self.version, self.route = "http://stand-in:1", version, route

    def get(self, path, **kw):
        assert path == self.route
        return {"version": self.version}


def test_engines_accept_a_local_build_of_their_release_and_refuse_another_release(caplog):
    from gspo_megatron.rollout.sglang_engine import SGLangEngine, SGLangVersionError
    from gspo_megatron.rollout.vllm_engine import VLLMEngine, VLLMVersionError

    v = VLLMEngine({"urls": ["http://stand-in:1"]}, wait_ready=False)
    s = SGLangEngine({"urls": ["http://stand-in:1"]}, wait_ready=False)
    try:
        with caplog.at_level(logging.INFO):
            v.servers = [_VersionServer("0.32.0+cu130", "/version")]
            v.check_version(strict=True)
            s.workers = [_VersionServer("0.5.23+cu129", "/server_info")]
            s.check_version(strict=True)
        assert sum("+cu130" in r.getMessage() for r in caplog.records) == 1
        assert sum("+cu129" in r.getMessage() for r in caplog.records) == 1
        v.servers = [_VersionServer("0.33.0+cu130", "/version")]
        with pytest.raises(VLLMVersionError, match="0.33.0"):
            v.check_version(strict=True)
        s.workers = [_VersionServer("0.5.24", "/server_info")]
        with pytest.raises(SGLangVersionError, match="0.5.24"):
            s.check_version(strict=True)
    finally:
        v.close()
        s.close()


def test_both_http_engines_refuse_another_release_in_the_same_one_line_and_declare_what_they_do(caplog):
    """One server layer (rollout/http_engine.py): a version mismatch is the same EngineVersionError
    line from SGLang and vLLM, an InputError that entry points print as one line (vLLM's was a bare
    EngineError, a traceback, before); each engine declares its capabilities, which is what the loop
    and the checks ask (rollout/base.py Capabilities), and an in-process engine keeps no metrics."""
    from gspo_megatron.errors import InputError
    from gspo_megatron.rollout.base import Capabilities
    from gspo_megatron.rollout.http_engine import EngineVersionError
    from gspo_megatron.rollout.sglang_engine import SGLangEngine
    from gspo_megatron.rollout.vllm_engine import VLLMEngine

    v = VLLMEngine({"urls": ["http://stand-in:1"]}, wait_ready=False)
    s = SGLangEngine({"urls": ["http://stand-in:1"]}, wait_ready=False)
    lines = []
    try:
        v.servers = [_VersionServer("0.31.0", "/version")]
        s.workers = [_VersionServer("0.5.22", "/server_info")]
        for eng, name, got, want, section in [(v, "vLLM", "0.31.0", "0.32.0", "rollout.vllm"),
                                              (s, "SGLang", "0.5.22", "0.5.23", "rollout.sglang")]:
            with pytest.raises(EngineVersionError) as e:
                eng.check_version(strict=True)
            assert isinstance(e.value, InputError) and "\n" not in str(e.value)
            lines.append(str(e.value).replace(name, "E").replace(got, "G").replace(want, "W").replace(section, "S")
                         .replace(eng.API_MODULE, "M"))
        assert lines[0] == lines[1] == ("E server http://stand-in:1 runs version G; this project speaks W (M): use that "
                                        "server version, or set S.check_version=false to try anyway"), lines
        # disk sync: a lost server, launched or given by URL, is brought back with the last weights
        assert v.capabilities == Capabilities(interrupt=True, push_mid_generation=True, weight_digests=True,
                                              supervised_restarts=True)  # keep pauses (rollout.vllm.push_mid_generation)
        assert s.capabilities == Capabilities(interrupt=True, push_mid_generation=True, sleep_wake=True,
                                              routing_return=True, supervised_restarts=True)
        assert v.metrics is not s.metrics and "retries" in s.metrics
    finally:
        v.close()
        s.close()
    v.close()  # idempotent
    with pytest.raises(Exception, match="VLLMEngine is closed"):
        v._check_open()


def test_push_digests_name_the_first_tensor_that_differs_is_missing_or_extra():
    """rollout/vllm_engine.py check_digests against the worker's own digest function (the one the
    server runs, rollout/vllm_worker.py tensor_digest): equal tensors pass in any summation order
    (a permuted copy), a 1.01-scaled one, a missing one and an extra one are each one line naming
    it; a worker that sends no digests is a protocol error."""
    from gspo_megatron.rollout.http_servers import EngineProtocolError
    from gspo_megatron.rollout.vllm_engine import WeightMismatchError, check_digests
    from gspo_megatron.rollout.vllm_worker import tensor_digest

    g = torch.Generator().manual_seed(0)
    ts = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16)
          for e in range(4)}
    sent = {k: tensor_digest(t) for k, t in ts.items()}
    shuffled = {k: tensor_digest(t.reshape(-1)[torch.randperm(t.numel(), generator=g)]) for k, t in ts.items()}
    assert check_digests("http://s", [{"digests": shuffled}, {"digests": dict(sent)}], sent, 3) == 4
    bad = "model.layers.0.mlp.experts.2.down_proj.weight"
    for got, needle in (({**sent, bad: tensor_digest(ts[bad] * 1.01)}, f"{bad} differs from the trainer's"),
                        ({k: v for k, v in sent.items() if k != bad}, f"never read {bad}"),
                        ({**sent, "lm_head.weight": [0.0, 0.0]}, "read lm_head.weight, which the trainer did not")):
        with pytest.raises(WeightMismatchError) as e:
            check_digests("http://s", [{"digests": got}], sent, 3)
        assert "\n" not in str(e.value) and needle in str(e.value) and "http://s" in str(e.value), str(e.value)
    with pytest.raises(EngineProtocolError, match="sent no digests"):
        check_digests("http://s", [{"files": 1}], sent, 3)


def test_the_digest_is_taken_block_by_block_and_equals_the_float64_reference(monkeypatch):
    """Issue 52: the push digest made a float64 copy of the whole tensor (12 GB on rank 0's GPU for
    GLM-4.5's output layer). Now DIGEST_BLOCK elements at a time; the answer is the float64
    reference's (a whole-tensor sum) to rounding, for blocks that do and do not divide the size, a
    non-contiguous tensor, a 0-dim and an empty one; every block converted is at most DIGEST_BLOCK."""
    import torch

    from gspo_megatron.rollout import vllm_worker

    converted = []
    real_to = torch.Tensor.to

    def recording_to(self, *a, **k):
        out = real_to(self, *a, **k)
        if out.dtype == torch.float64 and self.dtype != torch.float64:
            converted.append(self.numel())
        return out

    monkeypatch.setattr(vllm_worker, "DIGEST_BLOCK", 7)
    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    g = torch.Generator().manual_seed(0)
    for t in (torch.randn(5, 9, generator=g).to(torch.bfloat16), torch.randn(4, 7, generator=g),
              torch.randn(6, 5, generator=g).t(), torch.tensor(3.5), torch.empty(0, 3)):
        converted.clear()
        ref = real_to(t, torch.float64)
        got = vllm_worker.tensor_digest(t)
        assert got[0] == pytest.approx(float(ref.sum()), rel=1e-12, abs=1e-12)
        assert got[1] == pytest.approx(float((ref * ref).sum()), rel=1e-12, abs=1e-12)
        assert all(n <= 7 for n in converted), converted
