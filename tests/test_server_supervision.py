"""Servers that go away and come back (issue 54), SGLang's side; vLLM's launched server is
tests/test_vllm_supervised.py. The supervisor is one for both engines (rollout/supervision.py).

  * A server the trainer launched (colocated SGLang: the double, started by local rank 0) killed
    -9 at step 2 of 5: its node's keeper starts it again, the engine finds it lost, waits for it,
    reloads the last pushed weights into it, labels them, and the run goes on: engine_restarts 0
    then 1, the engine's log-probs within 1e-5 of the trainer's on every step (fp32 both sides).
  * A server given by URL stopped for 20 s and started again on the same port: the run waits (no
    step is logged meanwhile), re-syncs the new process before its first generation and finishes.
Nothing of either run is left running.

And the supervisor's own decisions, against a fake engine (no server): the config refuses
restarts where the weights cannot be re-sent; a server that answers its health checks but serves
other weights than the pushed ones is brought back like a dead one.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from run_output import explain
from sglang_double import sglang_overrides
from test_train_loop import REPO, TINY, gspo_rows
from test_train_sglang import _tiny_hf_dir
from testlib import cmdline, descendants, run_env, still_running, train_pooled, vllm_port

STEPS = 5
KILL_AFTER = 2  # the step whose row is written before the kill
DOUBLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_double.py")
RUN = ["train.sft_warmup_steps=0", "checkpoint.interval=0", "logging.progress_bar=false", "logging.plot=false",
       "checkpoint.export_hf=false", "eval.interval=0", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
       "rollout.max_new_tokens=8", "train.minibatches_per_step=1", f"train.max_steps={STEPS}",
       "model.hf_config=null", "rollout.sglang.health_interval_s=0.5"]


class _Background:
    """A pooled training run in a thread: its PooledRun (or exception) once it ends."""

    def __init__(self, *argv: str, timeout: float):
        self.result = self.error = None
        self._t = threading.Thread(target=self._go, args=(argv, timeout), daemon=True)
        self._t.start()

    def _go(self, argv, timeout):
        try:
            self.result = train_pooled(2, *argv, timeout=timeout)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            self.error = e

    def running(self) -> bool:
        return self._t.is_alive()

    def wait(self, timeout_s: float):
        self._t.join(timeout_s)
        assert not self._t.is_alive(), f"the run did not end within {timeout_s:.0f} s"
        if self.error is not None:
            raise self.error
        return self.result


def _rows(out) -> list[dict]:
    """The run's GSPO rows so far (none before its metrics file exists)."""
    return gspo_rows(out) if os.path.exists(os.path.join(out, "metrics.jsonl")) else []


def _until(cond, what: str, timeout_s: float, run: _Background) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert run.running(), f"the run ended before {what}: {run.wait(5)}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def _pids(log_path) -> list[int]:
    """The pids the double logged at every start, in order."""
    with open(log_path) as f:
        return [int(x) for x in re.findall(r"^\[sglang test double\] pid=(\d+)", f.read(), re.M)]


def _requests_after_last_start(log_path) -> list[str]:
    with open(log_path) as f:
        text = f.read()
    last = text.rfind("[sglang test double] pid=")
    return re.findall(r"^\[request\] \w+ (\S+)$", text[last:], re.M)


def _doubles_of(out) -> list[int]:
    """Processes of this test process's tree running the double for `out`'s run (its model dir)."""
    return [q for q in descendants(os.getpid()) if "sglang_double.py" in cmdline(q) and str(out) in cmdline(q)]


@pytest.mark.timeout(900)
def test_a_launched_server_killed_at_step_2_is_restarted_resynced_and_the_run_finishes(tmp_path):
    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    out = tmp_path / "run"
    port = vllm_port()
    run = _Background("--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", *RUN,
                      "rollout.backend=sglang", "rollout.sglang.urls=[]", "rollout.sglang.launch=true",
                      f"rollout.sglang.port={port}", "rollout.sglang.weight_sync=disk",
                      f"rollout.sglang.server_command=[{sys.executable},{DOUBLE}]",
                      "rollout.sglang.extra_args=[--dtype,float32]", "rollout.sglang.request_timeout_s=120",
                      "rollout.sglang.ready_timeout_s=120", "rollout.sglang.max_retries=2", timeout=840)
    log0 = out / "sglang_logs" / "node0" / "sglang_server_0.log"
    try:
        _until(lambda: len(_rows(out)) >= KILL_AFTER, f"step {KILL_AFTER}", 600, run)
        first = _pids(log0)
        assert len(first) == 1, first
        os.kill(first[0], signal.SIGKILL)
        r = run.wait(840)
    finally:
        if run.running():
            for q in _doubles_of(hf_dir):
                os.kill(q, signal.SIGKILL)
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    killed_at = max(x["step"] for x in rows if x["engine_restarts"] == 0)
    assert killed_at >= KILL_AFTER and rows[-1]["engine_restarts"] == 1, [x["engine_restarts"] for x in rows]
    assert all(x["mismatch_logprob_max"] <= 1e-5 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    # the keeper started a new process; before serving anything it got the pushed weights
    pids = _pids(log0)
    assert len(pids) == 2 and pids[0] != pids[1], pids
    seen = _requests_after_last_start(log0)
    assert "/update_weights_from_disk" in seen and "/generate" in seen, seen
    assert seen.index("/update_weights_from_disk") < seen.index("/generate"), seen
    assert "restarting it (1 of at most 3)" in r.stderr and "weights version" in r.stderr, explain(r.stderr)
    assert not still_running(_doubles_of(hf_dir), 60)


def _start_double(hf_dir, port: int, log_path) -> subprocess.Popen:
    with open(log_path, "ab") as f:
        return subprocess.Popen([sys.executable, DOUBLE, "--model-path", str(hf_dir), "--port", str(port),
                                 "--dtype", "float32"], stdout=f, stderr=subprocess.STDOUT, env=run_env(),
                                cwd=REPO, start_new_session=True)


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)


@pytest.mark.timeout(900)
def test_a_url_server_gone_for_20_s_is_waited_for_and_resynced(tmp_path):
    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    out = tmp_path / "run"
    port = vllm_port()
    logs = [tmp_path / "double_a.log", tmp_path / "double_b.log"]
    a = _start_double(hf_dir, port, logs[0])
    b = None
    try:
        run = _Background("--config", TINY, f"out_dir={out}", f"model.hf_dir={hf_dir}", *RUN,
                          *sglang_overrides(f"http://127.0.0.1:{port}", weight_sync="disk",
                                            shared_dir=str(tmp_path / "shared"), ready_timeout_s=120,
                                            lost_timeout_s=120),
                          timeout=840)
        _until(lambda: len(_rows(out)) >= KILL_AFTER, f"step {KILL_AFTER}", 600, run)
        _stop(a)  # kill -9: no goodbye
        gone_at = time.monotonic()
        time.sleep(20)  # the outage itself (the run's bound, lost_timeout_s=120, is what it must not race)
        during = len(_rows(out))
        b = _start_double(hf_dir, port, logs[1])
        r = run.wait(840)
        back_after = time.monotonic() - gone_at
    finally:
        _stop(a)
        if b is not None:
            _stop(b)
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(out)
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    assert during <= KILL_AFTER + 1 < STEPS, during  # no step completed while no server answered
    assert rows[-1]["engine_restarts"] == 1 and back_after >= 20
    assert all(x["mismatch_logprob_max"] <= 1e-5 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    seen = _requests_after_last_start(logs[1])
    assert seen.index("/update_weights_from_disk") < seen.index("/generate"), seen
    assert "is lost" in r.stderr and "waiting up to 120 s" in r.stderr, explain(r.stderr)
    assert not [q for q in descendants(os.getpid()) if "sglang_double.py" in cmdline(q)]


# ------------------------------------------------------------------------------ without a run
from test_sglang import FAST, assert_logprobs_match, hub_tensors, model_a, model_b, model_dir, prompts, tok  # noqa: E402,F401


def test_a_server_restarted_between_two_checks_is_found_by_its_weight_version(model_dir, prompts, model_b,
                                                                               tmp_path):
    """A server restarted by someone else between two health checks answers them, but serves the
    weights it started from under its start label. Its first answer is stale: the engine asks the
    server what it serves, the supervisor brings it back (reload of the last pushed version, its
    label) and the request is sent again; the samples are model B's, the pushed one (transformers'
    log-probs), and the engine counts one restart. A stale answer from a server that claims the
    pushed version stays an error (tests/test_sglang.py's stale test, unchanged)."""
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.sglang_engine import SGLangEngine
    from sglang_double import SGLangDouble

    with SGLangDouble(model_dir) as d:
        eng = SGLangEngine({"urls": [d.url], "shared_dir": str(tmp_path / "sync"), "health_interval_s": 0.5},
                           model_path=model_dir, **FAST)
        try:
            eng.update_weights(iter(hub_tensors(model_b)), version=1)
            d.engine = None  # "restarted": the model it started from, under its start label
            d.load()
            d.weight_version = "default"
            sp = SamplingParams(temperature=0.9, max_new_tokens=6)
            out = eng.generate(prompts[:1], 2, sp)
            assert eng.metrics["restarts"] == 1 and {s.weight_version for s in out} == {1}
            assert_logprobs_match(out, model_b, 0.9)
            assert [r["weight_version"] for r in d.calls("/update_weights_from_disk")] == ["1", "1"]
        finally:
            eng.close()


@pytest.mark.parametrize("engine,sync", [("sglang", "distributed"), ("sglang", "tensor"), ("vllm", "nccl")])
def test_restarts_where_the_weights_cannot_be_re_sent_are_refused_at_config_time(engine, sync):
    from gspo_megatron.config import ConfigError, load_config
    from gspo_megatron.rollout.supervision import DEFAULT_RESTARTS, restarts_default

    where = ["rollout.sglang.launch=true", "rollout.sglang.model_path=/m"] if sync == "tensor" else [f"rollout.{engine}.urls=[http://127.0.0.1:1]"]
    base = [f"rollout.backend={engine}", *where, f"rollout.{engine}.weight_sync={sync}"]
    if engine == "vllm":
        base += ["rollout.top_p=1", "rollout.top_k=-1"]
    with pytest.raises(ConfigError) as e:
        load_config(TINY, base + [f"rollout.{engine}.max_restarts=2"])
    assert "\n" not in str(e.value) and f"max_restarts=2 with weight_sync={sync}" in str(e.value)
    cfg = load_config(TINY, base)  # the default: no restarts there, and the run is allowed
    section = getattr(cfg.rollout, engine)
    assert section.max_restarts is None
    assert restarts_default({"max_restarts": None, "weight_sync": sync}) == 0
    assert restarts_default({"max_restarts": None, "weight_sync": "disk"}) == DEFAULT_RESTARTS
    load_config(TINY, base + [f"rollout.{engine}.max_restarts=0"])


def test_every_preset_supervises_its_servers_as_its_weight_sync_allows():
    """The new fields' defaults from every preset in launch/configs: max_restarts null resolves to 3
    with disk sync and 0 with a group broadcast (distributed / tensor / nccl: the GPU presets, which
    then stop in one line when a server is lost), no urls_file, no reward servers; the presets
    load unchanged (the config's own checks pass)."""
    import glob

    from gspo_megatron import config as C
    from gspo_megatron.rollout.supervision import DEFAULT_RESTARTS, restarts_default

    presets = sorted(glob.glob(os.path.join(REPO, "launch", "configs", "*.yaml")))
    assert len(presets) >= 12
    seen = set()
    for p in presets:
        cfg = C.load_config(p, [])
        for name in ("sglang", "vllm"):
            s = getattr(cfg.rollout, name)
            assert s.max_restarts is None and s.urls_file is None, p
            want = DEFAULT_RESTARTS if s.weight_sync == "disk" else 0
            assert restarts_default({"max_restarts": None, "weight_sync": s.weight_sync}) == want, p
            seen.add((name, s.weight_sync))
        assert not cfg.reward.model.enabled and not cfg.reward.judge.launch, p
    assert ("sglang", "distributed") in seen and ("sglang", "disk") in seen, seen  # both kinds of preset
