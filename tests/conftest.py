"""Session setup and teardown: the files in the order of their expected time (longest first), the
vLLM venv built in the background while the other tests run, the pooled rank processes
(tests/dist_utils.py) closed at the end."""
import json
import os
import signal
import subprocess
import sys

_VLLM_BUILD: list = []  # the background build of the vLLM venv, when this session started one
_FILE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def pytest_collection_modifyitems(session, config, items):
    """Files longest first (tests/file_seconds.json, written by bench/slowest_tests.py from the last
    measured run), the tests of a file in their own order. Under `make test` (--dist loadfile
    --no-loadscope-reorder) this is the order the workers are handed the files: the long files start
    while the short ones can still fill in beside them, and the run does not end on one worker
    finishing a long file alone. A file not in the table counts as the median file; an unreadable
    table leaves the order as collected. Every worker computes the same order (xdist requires it)."""
    try:
        with open(_FILE_SECONDS) as f:
            seconds = {str(k): float(v) for k, v in json.load(f)["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return
    if not _vllm_venv_ready():
        # its tests would wait for the build (minutes of download) at the start: they go last, so
        # the build overlaps with the rest as it did before the order existed
        seconds = {f: (-1.0 if os.path.basename(f).startswith("test_vllm") else t) for f, t in seconds.items()}
    known = sorted(seconds.values())
    median = known[len(known) // 2] if known else 0.0
    root = str(config.rootpath)
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item):
        f = item.nodeid.split("::", 1)[0]
        rel = os.path.relpath(os.path.join(root, f), root).replace(os.sep, "/")
        return (-seconds.get(rel, median), first_seen[f])

    items[:] = sorted(items, key=key)  # stable: a file's tests keep their order


def _vllm_venv_ready() -> bool:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from gspo_megatron.rollout import vllm_env

    return vllm_env.is_ready(vllm_env.default_dir())


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
