"""Rollout capacity that changes mid-run (issue 54): rollout.<engine>.urls_file
(rollout/membership.py).

  * The file reader admits URLs only; a bad line is one line naming the file and the line.
  * Against in-process SGLang doubles: a server added to the file joins only after a catch-up to
    the weights the others serve (its first request is the reload of the pushed version, labelled
    with it; its answers carry that version), then shares the requests; a server removed while
    a request is in flight on it loses nothing: the request is cut and sent to the other.
  * A training run (8 steps): a second server added after step 3 serves from step 4 with the
    trainer's weight version (its first answer's label equals the trainer's; the engine's
    log-probs within 1e-5 of the trainer's), the first removed after step 5; every step keeps all
    its samples. The run's own driver edits the file at those steps (tests/elastic_driver.py), so
    the change lands before the next step's rollout by construction, not by timing.
"""
from __future__ import annotations

import os
import re
import threading
import time

import pytest

from gspo_megatron.errors import InputError
from gspo_megatron.rollout.membership import read_urls_file
from test_sglang import FAST, assert_logprobs_match, hub_tensors, model_a, model_b, model_dir, prompts, tok  # noqa: F401


def _write(path, urls) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("# the rollout servers\n" + "".join(f"{u}\n" for u in urls))
    os.replace(tmp, path)


def test_the_servers_file_admits_urls_only(tmp_path):
    p = tmp_path / "servers"
    p.write_text("# fleet\n\nhttp://10.0.0.1:30000  # node 1\nhttps://h:1/\nhttp://10.0.0.1:30000\n")
    assert read_urls_file(str(p)) == ["http://10.0.0.1:30000", "https://h:1"]
    for bad in ("10.0.0.1:30000", "ftp://h:1", "http://h", "http://h:1/generate", "http://h:99999",
                "http://:1", "http://h:1 http://g:2"):
        p.write_text(f"http://ok:1\n{bad}\n")
        with pytest.raises(InputError) as e:
            read_urls_file(str(p))
        assert str(e.value).startswith(f"{p}:2: not a server URL") and "\n" not in str(e.value), bad
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="cannot read the servers file"):
        read_urls_file(str(p))
    with pytest.raises(InputError, match="cannot read the servers file"):
        read_urls_file(str(tmp_path / "missing"))


def test_the_replicas_file_admits_one_count_only(tmp_path):
    from gspo_megatron.rollout.membership import read_replicas_file

    p = tmp_path / "replicas"
    for text, n in (("2\n", 2), ("# wanted\n\n 3  # after the scale-up\n", 3), ("0", 0)):
        p.write_text(text)
        assert read_replicas_file(str(p)) == n
    for bad in ("", "two", "2 3", "2\n3\n", "-1", "2.5", "0x2", "# nothing\n"):
        p.write_text(bad)
        with pytest.raises(InputError) as e:
            read_replicas_file(str(p))
        assert str(e.value).startswith(f"{p}: a replicas file holds one number") and "\n" not in str(e.value), bad
    p.write_bytes(b"\xff\xfe")
    with pytest.raises(InputError, match="cannot read the replicas file"):
        read_replicas_file(str(p))


def test_replicas_are_for_launched_vllm_servers_on_disk_sync():
    from gspo_megatron.config import ConfigError
    from gspo_megatron.resolve import load_config
    from test_vllm_launch import TINY

    base = ["rollout.backend=vllm", "rollout.vllm.launch=true"]
    assert load_config(TINY, [*base, "rollout.vllm.replicas=2", "rollout.vllm.replicas_file=/r"]).rollout.vllm.replicas == 2
    for extra, words in ((["rollout.vllm.replicas=3", "rollout.vllm.max_replicas=2"], "more than"),
                         (["rollout.vllm.replicas=0"], "rollout.vllm.replicas"),
                         (["rollout.vllm.replicas_file=/r", "rollout.vllm.weight_sync=nccl"], "only disk sync"),
                         (["rollout.vllm.launch=false", "rollout.vllm.urls=[http://h:1]", "rollout.vllm.replicas=2"],
                          "count launched servers")):
        with pytest.raises(ConfigError, match=words):
            load_config(TINY, [*base, *extra])


def test_a_server_joins_after_a_catch_up_and_one_removed_mid_request_loses_nothing(model_dir, prompts, model_b,
                                                                                     tmp_path):
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.sglang_engine import SGLangEngine
    from sglang_double import SGLangDouble

    servers = tmp_path / "servers"
    sp = SamplingParams(temperature=0.9, max_new_tokens=6)
    with SGLangDouble(model_dir) as a, SGLangDouble(model_dir) as b:
        _write(servers, [a.url])
        eng = SGLangEngine({"urls_file": str(servers), "shared_dir": str(tmp_path / "sync"),
                            "health_interval_s": 0.2}, model_path=model_dir, **FAST)
        try:
            assert [s.url for s in eng.servers] == [a.url] and eng.metrics["servers"] == 1
            eng.update_weights(iter(hub_tensors(model_b)), version=1)
            _write(servers, [a.url, b.url])
            out = eng.generate(prompts, 2, sp)  # applies the file first
            assert [s.url for s in eng.servers] == [a.url, b.url] and eng.metrics["servers_joined"] == 1
            seen = [r.path for r in b.records if r.path in ("/update_weights_from_disk", "/generate")]
            assert seen[0] == "/update_weights_from_disk" and "/generate" in seen, seen  # the catch-up first
            assert b.calls("/update_weights_from_disk")[0]["weight_version"] == "1" and b.weight_version == "1"
            assert {s.meta["server"] for s in out} == {a.url, b.url} and {s.weight_version for s in out} == {1}
            assert_logprobs_match(out, model_b, 0.9)

            # a request held on A (60 s); A leaves the file meanwhile: cut, sent to B
            a.faults.delay_s, a.faults.delay_after, a.faults.delay_requests = 60.0, len(a.calls("/generate")), 1
            box: dict = {}
            t = threading.Thread(target=lambda: box.setdefault("out", eng.generate(prompts, 2, sp)), daemon=True)
            t.start()
            deadline = time.monotonic() + 60
            while not a.delaying and time.monotonic() < deadline:
                time.sleep(0.02)
            assert a.delaying, "no request reached A"
            _write(servers, [b.url])  # the supervisor's next round applies it (every 0.2 s)
            t.join(50)
            assert not t.is_alive(), "the request held on A was not sent to B"
            out = box["out"]
            assert len(out) == len(prompts) * 2 and {s.weight_version for s in out} == {1}
            assert [s.url for s in eng.servers] == [b.url] and eng.metrics["servers_left"] == 1
            assert eng.metrics["retries"] >= 1
            assert_logprobs_match(out, model_b, 0.9)
            n_a = len(a.calls("/update_weights_from_disk"))
            eng.update_weights(iter(hub_tensors(model_b)), version=2)  # pushes skip the server that left
            assert len(a.calls("/update_weights_from_disk")) == n_a and b.weight_version == "2"
        finally:
            eng.close()


STEPS, ADD_AFTER, REMOVE_AFTER = 8, 3, 5


@pytest.mark.timeout(900)
def test_a_training_run_gains_a_server_at_step_3_and_loses_one_at_step_5(tmp_path):
    from run_output import explain
    from test_server_supervision import RUN, TINY, _start_double, _stop
    from test_train_loop import gspo_rows
    from test_train_sglang import _tiny_hf_dir
    from testlib import train_pooled, vllm_port

    hf_dir = _tiny_hf_dir(tmp_path / "hf0")
    ports = [vllm_port(), vllm_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [tmp_path / "double_a.log", tmp_path / "double_b.log"]
    servers = tmp_path / "servers"
    _write(servers, urls[:1])
    doubles = [_start_double(hf_dir, p, log) for p, log in zip(ports, logs)]
    try:
        env = {"ELASTIC_A": urls[0], "ELASTIC_B": urls[1], "ELASTIC_FILE": str(servers),
               "ELASTIC_ADD_AFTER": str(ADD_AFTER), "ELASTIC_REMOVE_AFTER": str(REMOVE_AFTER)}
        args = [a for a in RUN if not a.startswith("train.max_steps")]
        r = train_pooled(2, "--config", TINY, f"out_dir={tmp_path / 'run'}", f"model.hf_dir={hf_dir}", *args,
                         f"train.max_steps={STEPS}", "rollout.driver=tests.elastic_driver:fleet",
                         "rollout.backend=sglang", f"rollout.sglang.urls_file={servers}",
                         "rollout.sglang.weight_sync=disk", f"rollout.sglang.shared_dir={tmp_path / 'shared'}",
                         "rollout.sglang.ready_timeout_s=120", "rollout.sglang.request_timeout_s=60",
                         timeout=840, env=env)
    finally:
        for d in doubles:
            _stop(d)
    assert r.returncode == 0, explain(r.stderr)
    rows = gspo_rows(tmp_path / "run")
    assert [x["step"] for x in rows] == list(range(1, STEPS + 1))
    per_step = 2 * 2  # rollout.prompts_per_step x samples_per_prompt (RUN)
    assert all(x["samples_n"] == per_step for x in rows)  # no sample lost, before, during or after
    assert [x["servers_used"] for x in rows] == [1] * ADD_AFTER + [2] * (REMOVE_AFTER - ADD_AFTER) + \
        [1] * (STEPS - REMOVE_AFTER)
    assert rows[-1]["engine_servers"] == 1
    # B serves from the step after it was added, each answer with the trainer's version
    assert all(x["served_by_b"] == 0 for x in rows[:ADD_AFTER])
    assert rows[ADD_AFTER]["served_by_b"] > 0 and all(x["served_by_b"] == per_step for x in rows[REMOVE_AFTER:])
    for x in rows[ADD_AFTER:]:
        assert x["b_version_min"] == x["trainer_version"] == x["step"] - 1, x
    assert all(x["mismatch_logprob_max"] <= 1e-5 for x in rows), [x["mismatch_logprob_max"] for x in rows]
    with open(logs[1]) as f:
        seen = re.findall(r"^\[request\] \w+ (/update_weights_from_disk|/generate)$", f.read(), re.M)
    assert seen[0] == "/update_weights_from_disk", seen  # B's catch-up came before its first generation
