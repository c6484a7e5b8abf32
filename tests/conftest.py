"""Session setup and teardown: the vLLM venv built in the background while the other tests run,
the pooled rank processes (tests/dist_utils.py) closed at the end."""
import os
import signal
import subprocess
import sys

_VLLM_BUILD: list = []  # the background build of the vLLM venv, when this session started one


def pytest_collection_finish(session):
    """When vLLM tests are selected and the venv is not built yet, build it now in a process of
    its own (network and disk bound: minutes, ~3.4 GB) so it overlaps with the tests before them;
    their fixture (`vllm_env.ensure`) waits for its lock and finds it ready. Output:
    <cache>/gspo-megatron/vllm-build.log."""
    if not any(os.path.basename(str(item.fspath)).startswith("test_vllm") for item in session.items):
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":  # one build per session (the others wait on its lock)
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, repo)
    from gspo_megatron.rollout import vllm_env

    path = vllm_env.default_dir()
    if vllm_env.is_ready(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(os.path.join(os.path.dirname(path), "vllm-build.log"), "ab")
    _VLLM_BUILD.append(subprocess.Popen([sys.executable, "-m", "gspo_megatron.rollout.vllm_env", "--path", path],
                                        cwd=repo, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    log.close()


def pytest_sessionfinish(session, exitstatus):
    import dist_utils

    dist_utils.close_pools()
    for p in _VLLM_BUILD:  # never outlives the session (the build is atomic: an interrupted one leaves nothing)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
