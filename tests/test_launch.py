"""Launch scripts (rendered with DRY_RUN=1 and a fake Slurm) and the dry-run planner."""
from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from gspo_megatron import resolve

from gspo_megatron import planner
from gspo_megatron.config import ConfigError
from gspo_megatron.resolve import load_config
from run_output import explain

pytestmark = pytest.mark.timeout(120)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "launch", "configs")
PRESETS = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
SCRIPTS = [os.path.join(ROOT, "launch", "torchrun.sh")] + sorted(
    glob.glob(os.path.join(ROOT, "launch", "slurm", "*.sbatch"))
    + glob.glob(os.path.join(ROOT, "launch", "slurm", "*.sh"))
)
URLS = "rollout.sglang.urls=[http://a:1,http://b:2]"


def preset(name: str) -> str:
    return os.path.join(CONFIGS, name + ".yaml")


# ---- static checks -------------------------------------------------------------------------


def test_scripts_exist():
    names = {os.path.relpath(s, ROOT) for s in SCRIPTS}
    assert {"launch/torchrun.sh", "launch/slurm/train.sbatch",
            "launch/slurm/train_with_sglang.sbatch"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: os.path.relpath(s, ROOT))
def test_bash_syntax(script):
    r = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck)")
    rel = [os.path.relpath(s, ROOT) for s in SCRIPTS]
    r = subprocess.run(["shellcheck", "-x", *rel], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_torchrun_sh_is_executable():
    assert os.stat(os.path.join(ROOT, "launch", "torchrun.sh")).st_mode & stat.S_IXUSR


# ---- rendering -----------------------------------------------------------------------------


def render_run(script: str, args: list[str], env: dict | None = None, nodes: list[str] | None = None,
               tmp_path=None, expect_rc: int = 0) -> subprocess.CompletedProcess:
    """Run a launch script with DRY_RUN=1 (and a fake Slurm when `nodes` is given). The test's
    interpreter directory comes first on PATH, so `python3` there is this environment's (the
    Slurm scripts' default interpreter; train_with_sglang.sbatch runs it to ask for the servers'
    flags)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_"))}
    for k in ("NPROC", "MASTER_PORT", "PYTHON", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "LOG_DIR",
              "GPUS_PER_NODE", "SMOKE", "REPO_DIR"):
        e.pop(k, None)
    e["DRY_RUN"] = "1"
    e["PATH"] = f"{os.path.dirname(sys.executable)}:{e['PATH']}"
    if nodes is not None:
        fake = tmp_path / "bin"
        fake.mkdir(exist_ok=True)
        sc = fake / "scontrol"
        sc.write_text('#!/usr/bin/env bash\n[[ $1 == show && $2 == hostnames ]] || exit 1\n'
                      'tr " " "\\n" <<<"$FAKE_NODES"\n')
        sc.chmod(0o755)
        e.update(PATH=f"{fake}:{e['PATH']}", FAKE_NODES=" ".join(nodes),
                 SLURM_JOB_NODELIST=f"{nodes[0]}-list", SLURM_NNODES=str(len(nodes)),
                 SLURM_JOB_ID="4242", SLURM_JOB_NAME="gspo", SLURM_SUBMIT_DIR=ROOT,
                 SLURM_GPUS_ON_NODE="8")
    env = dict(env or {})
    if "PATH" in env:  # a test's fake commands go first; the fake Slurm and python3 stay reachable
        e["PATH"] = f"{env.pop('PATH')}:{e['PATH']}"
    e.update(env)
    r = subprocess.run(["bash", script, *args], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == expect_rc, r.stdout + r.stderr
    return r


def render(script: str, args: list[str], env: dict | None = None, nodes: list[str] | None = None,
           tmp_path=None, expect_rc: int = 0) -> list[list[str]]:
    """Run a launch script with DRY_RUN=1; return the printed commands as argv lists."""
    r = render_run(script, args, env, nodes, tmp_path, expect_rc)
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


def hf_dir(tmp_path, name: str) -> str:
    """A model directory holding the preset's architecture as config.json: what model.hf_dir
    points at (the config is loaded, and checked, before the servers start)."""
    d = tmp_path / f"hf-{name}"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(dict(load_config(preset(name), []).model.hf_config)))
    return str(d)


def train_args(argv: list[str]) -> list[str]:
    """What follows `-m gspo_megatron.train` in a command."""
    i = argv.index("gspo_megatron.train")
    assert argv[i - 1] == "-m"
    return argv[i + 1:]


def opt(argv: list[str], name: str) -> str:
    vals = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    assert len(vals) == 1, (name, argv)
    return vals[0]


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_torchrun_render(path):
    rel = os.path.relpath(path, ROOT)
    (cmd,) = render(os.path.join(ROOT, "launch", "torchrun.sh"),
                    [rel, "train.max_steps=5", URLS, "out_dir=runs/a b"], env={"NPROC": "4"})
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert opt(cmd, "--nproc-per-node") == "4" and opt(cmd, "--nnodes") == "1"
    assert "--standalone" in cmd
    assert train_args(cmd) == ["--config", rel, "train.max_steps=5", URLS, "out_dir=runs/a b"]


def test_torchrun_fixed_port_and_errors(tmp_path):
    (cmd,) = render(os.path.join(ROOT, "launch", "torchrun.sh"), [preset("tiny_cpu")],
                    env={"NPROC": "2", "MASTER_PORT": "29511", "PYTHON": "/opt/py/bin/python"})
    assert cmd[0] == "/opt/py/bin/python"
    assert opt(cmd, "--rdzv-endpoint") == "localhost:29511" and "--standalone" not in cmd
    render(os.path.join(ROOT, "launch", "torchrun.sh"), ["nope.yaml"], expect_rc=2)
    render(os.path.join(ROOT, "launch", "torchrun.sh"), [], expect_rc=2)
    render(os.path.join(ROOT, "launch", "torchrun.sh"), [preset("tiny_cpu")],
           env={"NPROC": "x"}, expect_rc=2)


@pytest.mark.parametrize("path", PRESETS, ids=os.path.basename)
def test_train_sbatch_render(path, tmp_path):
    nodes = ["gpu-a001", "gpu-a002", "gpu-a003"]
    (cmd,) = render(os.path.join(ROOT, "launch", "slurm", "train.sbatch"),
                    [os.path.relpath(path, ROOT), "checkpoint.resume=never", URLS],
                    nodes=nodes, tmp_path=tmp_path)
    assert cmd[0] == "srun"
    assert opt(cmd, "--nodes") == "3" and opt(cmd, "--ntasks-per-node") == "1"
    assert "--kill-on-bad-exit=1" in cmd
    assert opt(cmd, "--output").startswith(os.path.join(ROOT, "logs", "gspo-4242") + "/")
    assert opt(cmd, "--nnodes") == "3" and opt(cmd, "--nproc-per-node") == "8"
    assert opt(cmd, "--rdzv-backend") == "c10d" and opt(cmd, "--rdzv-id") == "4242"
    assert opt(cmd, "--rdzv-endpoint") == f"gpu-a001:{20000 + 4242}"
    # Absolute config path; resume=auto first so that a user's explicit choice still wins.
    assert train_args(cmd) == ["--config", path, "checkpoint.resume=auto",
                               "checkpoint.resume=never", URLS]


def test_train_sbatch_env_knobs(tmp_path):
    (cmd,) = render(os.path.join(ROOT, "launch", "slurm", "train.sbatch"), [preset("tiny_cpu")],
                    nodes=["n1"], tmp_path=tmp_path,
                    env={"GPUS_PER_NODE": "4", "MASTER_PORT": "23456", "LOG_DIR": str(tmp_path / "L"),
                         "CONTAINER_IMAGE": "nvcr.io#nvidia/pytorch:25.01-py3"})
    assert opt(cmd, "--nproc-per-node") == "4" and opt(cmd, "--gpus-per-node") == "4"
    assert opt(cmd, "--rdzv-endpoint") == "n1:23456" and opt(cmd, "--output") == str(tmp_path / "L" / "train-node%n.log")
    assert opt(cmd, "--container-image") == "nvcr.io#nvidia/pytorch:25.01-py3"
    assert cmd[cmd.index("-m") - 1] == "python3"  # no host venv inside a container
    assert opt(cmd, "--container-mounts") == f"{ROOT}:{ROOT}"
    # CONTAINER_MOUNTS adds mounts; the repo (the container's workdir) stays mounted (before: replaced)
    (cmd,) = render(os.path.join(ROOT, "launch", "slurm", "train.sbatch"), [preset("tiny_cpu")], nodes=["n1"],
                    tmp_path=tmp_path, env={"CONTAINER_IMAGE": "img", "CONTAINER_MOUNTS": "/ckpt:/ckpt"})
    assert opt(cmd, "--container-mounts") == f"{ROOT}:{ROOT},/ckpt:/ckpt"
    render(os.path.join(ROOT, "launch", "slurm", "train.sbatch"), ["missing.yaml"], nodes=["n1"],
           tmp_path=tmp_path, expect_rc=2)


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen3_235b_a22b"])
def test_sglang_sbatch_disaggregated(name, tmp_path):
    nodes = [f"n{i}" for i in range(1, 6)]
    model = hf_dir(tmp_path, name)
    cmds = render(os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch"),
                  [preset(name), f"model.hf_dir={model}", "train.max_steps=2"],
                  env={"SGLANG_NODES": "2", "SGLANG_API_KEY": "sekret"}, nodes=nodes,
                  tmp_path=tmp_path)
    servers = [c for c in cmds if "sglang.launch_server" in c]
    (trainer,) = [c for c in cmds if "gspo_megatron.train" in c]
    assert len(servers) == 2 and len(cmds) == 3
    for node, c in zip(["n4", "n5"], servers):  # the last SGLANG_NODES nodes
        assert c[0] == "srun" and opt(c, "--nodelist") == node
        launch = c[c.index("sglang.launch_server") + 1:]
        assert launch[launch.index("--host") + 1] == node  # bound to the node's address
        assert launch[launch.index("--port") + 1] == "30000"
        assert launch[launch.index("--model-path") + 1] == model
        assert launch[launch.index("--tp-size") + 1] == "8"
        # the key in no command line: the server starts through serve_with_key.sh (a --config file)
        assert c[c.index("env") - 1].endswith("launch/slurm/serve_with_key.sh") and c[c.index("env") - 2] == "bash"
        assert not any("sekret" in a for a in c) and not any(a.startswith("--api-key") for a in launch)
        assert "--nnodes" not in launch
    assert opt(trainer, "--nodelist") == "n1,n2,n3" and opt(trainer, "--nnodes") == "3"
    assert opt(trainer, "--rdzv-endpoint") == f"n1:{20000 + 4242}"
    assert train_args(trainer) == [
        "--config", preset(name), "checkpoint.resume=auto", "rollout.backend=sglang",
        "rollout.sglang.launch=false", "rollout.sglang.urls=[http://n4:30000,http://n5:30000]",
        "rollout.sglang.api_key_env=SGLANG_API_KEY", f"model.hf_dir={model}", "train.max_steps=2",
    ]
    assert not any("sekret" in a for c in cmds for a in c)  # nowhere in what the job runs
    # The url override the trainer receives parses back to the list of servers.
    cfg = load_config(preset(name), train_args(trainer)[2:6])
    assert cfg.rollout.sglang.urls == ["http://n4:30000", "http://n5:30000"]


def test_sglang_sbatch_multinode_servers_and_colocated(tmp_path):
    script = os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch")
    cmds = render(script, [preset("qwen3_235b_a22b")],
                  env={"SGLANG_NODES": "2", "SGLANG_NODES_PER_SERVER": "2",
                       "SGLANG_MODEL_PATH": "/m", "SGLANG_EP": "16", "SGLANG_PORT": "31000"},
                  nodes=["a", "b", "c"], tmp_path=tmp_path)
    servers = [c for c in cmds if "sglang.launch_server" in c]
    assert [opt(c, "--nodelist") for c in servers] == ["b", "c"]
    for rank, c in enumerate(servers):
        assert c[c.index("--node-rank") + 1] == str(rank) and c[c.index("--nnodes") + 1] == "2"
        assert c[c.index("--dist-init-addr") + 1] == "b:50000"
        assert c[c.index("--tp-size") + 1] == "16" and c[c.index("--ep-size") + 1] == "16"
    (trainer,) = [c for c in cmds if "gspo_megatron.train" in c]
    assert "rollout.sglang.urls=[http://b:31000]" in train_args(trainer)
    assert opt(trainer, "--nnodes") == "1"
    # servers on the nodes' addresses and no SGLANG_API_KEY: a generated key, exported to both
    # sides (the trainer reads it by name), in no command line
    assert "rollout.sglang.api_key_env=SGLANG_API_KEY" in train_args(trainer)
    assert all(c[c.index("env") - 1].endswith("serve_with_key.sh") for c in servers)
    assert not any(a.startswith("--api-key") for c in cmds for a in c)

    # Servers in their own image; the trainer keeps the host interpreter.
    cmds = render(script, [preset("qwen3_30b_a3b"), f"model.hf_dir={hf_dir(tmp_path, 'qwen3_30b_a3b')}"],
                  env={"SGLANG_CONTAINER_IMAGE": "lmsysorg/sglang:latest",
                       "SGLANG_EXTRA_ARGS": "--enable-memory-saver --log-level warning"},
                  nodes=["a", "b"], tmp_path=tmp_path)
    server, trainer = cmds
    assert opt(server, "--container-image") == "lmsysorg/sglang:latest"
    assert server[server.index("-m") - 1] == "python3"
    assert server[-3:] == ["--enable-memory-saver", "--log-level", "warning"]
    assert not any(a.startswith("--container-image") for a in trainer)

    (trainer,) = render(script, [preset("qwen3_30b_a3b"), "x.y=1"],
                        env={"SGLANG_MODE": "colocated"}, nodes=["a", "b"], tmp_path=tmp_path)
    assert opt(trainer, "--nnodes") == "2"
    args = train_args(trainer)
    assert args[:3] == ["--config", preset("qwen3_30b_a3b"), "checkpoint.resume=auto"]
    assert "rollout.sglang.launch=true" in args and args[-1] == "x.y=1"
    assert "rollout.sglang.host=0.0.0.0" in args  # rank 0 reaches the other node's servers
    # the preset's weight_sync=distributed cannot share rank 0's GPU: disk across nodes, IPC on one
    assert "rollout.sglang.weight_sync=disk" in args
    cfg = load_config(preset("qwen3_30b_a3b"), args[2:-1] + [f"rollout.sglang.model_path={tmp_path}"])
    assert cfg.rollout.sglang.weight_sync == "disk" and cfg.rollout.sglang.launch
    (trainer,) = render(script, [preset("qwen3_30b_a3b")], env={"SGLANG_MODE": "colocated"}, nodes=["a"],
                        tmp_path=tmp_path)
    assert "rollout.sglang.weight_sync=tensor" in train_args(trainer)

    # Errors: no server model, no node left for training, uneven multi-node servers.
    render(script, [preset("qwen3_30b_a3b")], nodes=["a", "b"], tmp_path=tmp_path, expect_rc=2)
    render(script, [preset("qwen3_30b_a3b"), "model.hf_dir=/m"], env={"SGLANG_NODES": "2"},
           nodes=["a", "b"], tmp_path=tmp_path, expect_rc=2)
    render(script, [preset("qwen3_30b_a3b"), "model.hf_dir=/m"],
           env={"SGLANG_NODES": "3", "SGLANG_NODES_PER_SERVER": "2"}, nodes=list("abcde"),
           tmp_path=tmp_path, expect_rc=2)


# ---- interpreter choice, server flags and environment, SMOKE (issue 31) -----------------------


def fake_repo(tmp_path) -> str:
    """A checkout whose .venv holds a (fake) interpreter, as `make` leaves on a shared filesystem,
    with this repo's launch scripts."""
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "launch"), repo / "launch")
    py = repo / ".venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\necho fake-venv-python \"$@\" >> \"$(dirname \"$0\")/calls\"\necho \"$FAKE_CUDA\"\n")
    py.chmod(0o755)
    return str(repo)


def test_slurm_scripts_never_pick_the_repo_venv(tmp_path):
    """Before: with a .venv in the submit dir and no CONTAINER_IMAGE, the Slurm scripts ran the
    trainer (and servers) with <repo>/.venv/bin/python, the CPU torch of `make`, on GPU nodes."""
    repo = fake_repo(tmp_path)
    venv_py = os.path.join(repo, ".venv", "bin", "python")
    env = {"SLURM_SUBMIT_DIR": repo}
    r = render_run(os.path.join(repo, "launch", "slurm", "train.sbatch"), [preset("tiny_cpu")], env=env,
                   nodes=["n1", "n2"], tmp_path=tmp_path)
    (cmd,) = [shlex.split(ln) for ln in r.stdout.splitlines()]
    assert cmd[cmd.index("torch.distributed.run") - 2] == "python3" and venv_py not in cmd
    (line,) = [ln for ln in r.stderr.splitlines() if "trainer python:" in ln]
    assert "python3 (" + shutil.which("python3", path=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}") in line
    assert "never the repo's .venv" in line
    # PYTHON still chooses (the .venv too, deliberately), and the log says it came from PYTHON
    r = render_run(os.path.join(repo, "launch", "slurm", "train.sbatch"), [preset("tiny_cpu")],
                   env={**env, "PYTHON": venv_py}, nodes=["n1"], tmp_path=tmp_path)
    assert shlex.split(r.stdout)[shlex.split(r.stdout).index("torch.distributed.run") - 2] == venv_py
    assert f"trainer python: {venv_py} ({venv_py}; from PYTHON)" in r.stderr
    # the SGLang job: trainer and servers alike
    cmds = render(os.path.join(repo, "launch", "slurm", "train_with_sglang.sbatch"),
                  [preset("qwen3_30b_a3b")], env={**env, "SGLANG_MODEL_PATH": "/m"}, nodes=["a", "b"],
                  tmp_path=tmp_path)
    assert len(cmds) == 2 and all(c[c.index("-m") - 1] == "python3" for c in cmds)
    assert not any(venv_py in c for c in cmds)
    assert not os.path.exists(os.path.join(repo, ".venv", "bin", "calls"))  # never even asked
    (trainer,) = render(os.path.join(repo, "launch", "slurm", "train_with_sglang.sbatch"),
                        [preset("qwen3_30b_a3b")], env={**env, "SGLANG_MODE": "colocated"}, nodes=["a"],
                        tmp_path=tmp_path)
    assert trainer[trainer.index("-m") - 1] == "python3"


def test_train_sbatch_forwards_signals_when_torch_is_not_on_the_batch_node(tmp_path):
    """Run for real (not DRY_RUN) with a fake srun: torchrun gets --signals-to-handle (SIGUSR1 before
    the time limit -> checkpoint) when the batch node's python3 cannot run torchrun (no torch
    outside the job's container: the project's torch is assumed) and when it has the flag; not
    when its torchrun lacks it."""
    b = tmp_path / "fakes"
    b.mkdir()
    (b / "srun").write_text('#!/usr/bin/env bash\nprintf "%q " srun "$@"; printf "\\n"\n')
    no_torch = b / "py-no-torch"
    no_torch.write_text("#!/bin/sh\necho 'No module named torch' >&2\nexit 1\n")
    old = b / "py-old-torchrun"
    old.write_text("#!/bin/sh\necho 'usage: torchrun [--nnodes NNODES] [--max-restarts MAX_RESTARTS]'\n")
    for f in ("srun", "py-no-torch", "py-old-torchrun"):
        (b / f).chmod(0o755)
    env = {"DRY_RUN": "0", "LOG_DIR": str(tmp_path / "logs"), "PATH": str(b)}
    for python, forwarded in ((str(no_torch), True), (sys.executable, True), (str(old), False)):
        (cmd,) = render(os.path.join(ROOT, "launch", "slurm", "train.sbatch"), [preset("tiny_cpu")],
                        env={**env, "PYTHON": python}, nodes=["n1"], tmp_path=tmp_path)
        assert cmd[0] == "srun" and cmd[cmd.index("torch.distributed.run") - 2] == python
        sig = [a for a in cmd if a.startswith("--signals-to-handle=")]
        assert sig == (["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"] if forwarded else []), python
        assert ("--shutdown-timeout=600" in cmd) is forwarded


def fake_gpu_machine(tmp_path, listing: str, rc: int = 0) -> dict:
    """PATH with an nvidia-smi whose `-L` prints `listing` and exits `rc`."""
    b = tmp_path / "gpubin"
    b.mkdir(exist_ok=True)
    smi = b / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 9\nprintf '%s' '{listing}'\nexit {rc}\n")
    smi.chmod(0o755)
    return {"PATH": str(b)}


def test_torchrun_sh_refuses_the_cpu_venv_on_a_gpu_machine(tmp_path):
    """launch/torchrun.sh keeps the repo's .venv as the default (the CPU demo), but not where GPUs
    are visible and that torch has no CUDA: one line telling to set PYTHON, exit 2 (before: it
    trained on the CPU, or failed later). The CPU path never starts the interpreter to ask."""
    repo = fake_repo(tmp_path)
    script = os.path.join(repo, "launch", "torchrun.sh")
    venv_py = os.path.join(repo, ".venv", "bin", "python")
    calls = os.path.join(repo, ".venv", "bin", "calls")
    gpus = fake_gpu_machine(tmp_path, "GPU 0: NVIDIA H200 (UUID: GPU-0)\nGPU 1: NVIDIA H200 (UUID: GPU-1)\n")
    r = render_run(script, [preset("tiny_cpu")], env={**gpus, "FAKE_CUDA": ""}, expect_rc=2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and r.stdout == "", r.stderr
    assert lines[0].startswith("torchrun.sh: 2 GPU(s) visible but " + venv_py) and "set PYTHON" in lines[0]
    # a CUDA torch in the .venv is fine; NPROC defaults to the GPUs
    (cmd,) = render(script, [preset("tiny_cpu")], env={**gpus, "FAKE_CUDA": "12.8"})
    assert cmd[0] == venv_py and opt(cmd, "--nproc-per-node") == "2"
    # PYTHON set: no question asked
    os.remove(calls)
    (cmd,) = render(script, [preset("tiny_cpu")], env={**gpus, "PYTHON": "/opt/py/bin/python3", "FAKE_CUDA": ""})
    assert cmd[0] == "/opt/py/bin/python3" and not os.path.exists(calls)
    # CPU machines: no nvidia-smi, or one that lists no GPU -> the .venv, never started to ask
    cpu = [{**fake_gpu_machine(tmp_path, "No devices were found\n", 6), "FAKE_CUDA": ""}]
    if shutil.which("nvidia-smi") is None:  # (a real one cannot be hidden from PATH)
        cpu.append({"FAKE_CUDA": ""})
    for env in cpu:
        (cmd,) = render(script, [preset("tiny_cpu")], env=env)
        assert cmd[0] == venv_py and opt(cmd, "--nproc-per-node") == "1"
        assert not os.path.exists(calls)


def server_cmds(cmds):
    return [c for c in cmds if "sglang.launch_server" in c]


@pytest.mark.parametrize("overrides,flag", [
    ([], False),
    (["train.routing_replay=rollout"], True),
    (["rollout.return_routing=true"], True),
    (["train.routing_replay=old", "loss.old_logprobs=recompute"], False),
])
def test_sglang_sbatch_server_flags_from_the_config(overrides, flag, tmp_path):
    """The servers get --enable-return-routed-experts exactly when the run uses the engine's
    routing (Config.engine_routing), as the project answers for the config and overrides the
    trainer gets; every server starts without SGLANG_RETURN_ORIGINAL_LOGPROB (before: neither)."""
    from gspo_megatron.rollout.sglang_api import ROUTED_EXPERTS_FLAG

    model = hf_dir(tmp_path, "qwen3_30b_a3b")
    cmds = render(os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch"),
                  [preset("qwen3_30b_a3b"), f"model.hf_dir={model}", *overrides],
                  env={"SGLANG_NODES": "2", "SGLANG_NODES_PER_SERVER": "2", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"},
                  nodes=["a", "b", "c"], tmp_path=tmp_path)
    servers = server_cmds(cmds)
    (trainer,) = [c for c in cmds if "gspo_megatron.train" in c]
    assert len(servers) == 2
    for c in servers:
        i = c.index("env")
        assert c[i:i + 3] == ["env", "-u", "SGLANG_RETURN_ORIGINAL_LOGPROB"] and c[i + 4:i + 6] == ["-m", "sglang.launch_server"]
        assert c.count(ROUTED_EXPERTS_FLAG) == (1 if flag else 0)
    assert load_config(preset("qwen3_30b_a3b"), train_args(trainer)[2:]).engine_routing is flag
    # the prefix does what it says: the variable is gone for the command it starts
    i = servers[0].index("env")
    probe = subprocess.run([*servers[0][i:i + 3], sys.executable, "-c",
                            "import os; print(os.environ.get('SGLANG_RETURN_ORIGINAL_LOGPROB'))"],
                           env={**os.environ, "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}, capture_output=True,
                           text=True, timeout=60)
    assert probe.stdout.strip() == "None", probe.stderr


def test_sglang_sbatch_server_flags_edge_cases(tmp_path):
    from gspo_megatron.rollout.sglang_api import ROUTED_EXPERTS_FLAG

    script = os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch")
    model = hf_dir(tmp_path, "qwen3_30b_a3b")
    # the flag already in SGLANG_EXTRA_ARGS: once; the trainer's image (DRY_RUN asks here, and says so)
    r = render_run(script, [preset("qwen3_30b_a3b"), f"model.hf_dir={model}", "train.routing_replay=rollout"],
                   env={"SGLANG_EXTRA_ARGS": f"{ROUTED_EXPERTS_FLAG} --log-level warning",
                        "CONTAINER_IMAGE": "/img/gspo.sqsh", "SGLANG_CONTAINER_IMAGE": "lmsysorg/sglang:v0.5.23"},
                   nodes=["a", "b"], tmp_path=tmp_path)
    (server,) = server_cmds(shlex.split(ln) for ln in r.stdout.splitlines())
    assert server.count(ROUTED_EXPERTS_FLAG) == 1 and server[-3:] == [ROUTED_EXPERTS_FLAG, "--log-level", "warning"]
    assert "a job asks inside /img/gspo.sqsh on a" in r.stderr
    assert "server python: python3 (inside lmsysorg/sglang:v0.5.23;" in r.stderr
    # a config the trainer would refuse stops the job before any server starts: its one line, exit 2
    r = render_run(script, [preset("qwen3_235b_a22b"), "train.routing_replay=rollout"],
                   env={"SGLANG_MODEL_PATH": "/m"}, nodes=["a", "b"], tmp_path=tmp_path, expect_rc=2)
    assert r.stdout == ""
    assert "gspo_megatron.rollout.sglang_server: error: train.routing_replay with train.recompute=full" in r.stderr
    # a missing model.hf_dir is found on the batch node, not after the servers loaded for 30 minutes
    r = render_run(script, [preset("qwen3_30b_a3b"), f"model.hf_dir={tmp_path}/nope"], nodes=["a", "b"],
                   tmp_path=tmp_path, expect_rc=2)
    assert r.stdout == "" and "config.json does not exist" in r.stderr


def test_server_flags_cli(capsys):
    from gspo_megatron.rollout import sglang_server
    from gspo_megatron.rollout.sglang_api import ROUTED_EXPERTS_FLAG

    assert sglang_server.main(["--server-flags", "--config", preset("tiny_cpu"), "train.routing_replay=rollout"]) == 0
    assert capsys.readouterr().out.splitlines() == [ROUTED_EXPERTS_FLAG, "# weight_sync=disk"]
    assert sglang_server.main(["--server-flags", "--config", preset("tiny_cpu"),
                               "rollout.sglang.weight_sync=distributed"]) == 0
    assert capsys.readouterr().out == "# weight_sync=distributed\n"
    # the model's config overrides (ModelFamily.engine_config_overrides): DeepSeek-V3's routing keys
    from gspo_megatron.rollout.sglang_api import MODEL_OVERRIDE_FLAG

    assert sglang_server.main(["--server-flags", "--config", preset("tiny_cpu_deepseek_v3")]) == 0
    assert capsys.readouterr().out.splitlines() == [
        MODEL_OVERRIDE_FLAG + '={"scoring_func": "sigmoid", "topk_method": "noaux_tc"}', "# weight_sync=disk"]
    with pytest.raises(SystemExit) as e:
        sglang_server.main(["--server-flags", "--config", preset("tiny_cpu"), "trian.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("gspo_megatron.rollout.sglang_server: error: ")
    assert "trian" in err[0]
    # as the sbatch runs it: a module with a __main__ guard, nothing but the flags (and the
    # weight-sync line the script reads) on stdout
    r = subprocess.run([sys.executable, "-m", "gspo_megatron.rollout.sglang_server", "--server-flags", "--config",
                        preset("tiny_cpu"), "rollout.return_routing=true"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout == ROUTED_EXPERTS_FLAG + "\n# weight_sync=disk\n", r.stderr


def test_smoke_passes_smoke_to_the_trainer(tmp_path):
    """SMOKE=1: the trainer gets --smoke after the config, with checkpoint.resume=auto and the
    overrides it would train with (both scripts, both SGLang modes); anything but 0/1 is refused."""
    train = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
    (cmd,) = render(train, [preset("tiny_cpu"), URLS], env={"SMOKE": "1"}, nodes=["n1"], tmp_path=tmp_path)
    assert train_args(cmd) == ["--config", preset("tiny_cpu"), "--smoke", "checkpoint.resume=auto", URLS]
    (cmd,) = render(train, [preset("tiny_cpu")], env={"SMOKE": "0"}, nodes=["n1"], tmp_path=tmp_path)
    assert "--smoke" not in cmd
    r = render_run(train, [preset("tiny_cpu")], env={"SMOKE": "yes"}, nodes=["n1"], tmp_path=tmp_path, expect_rc=2)
    assert "SMOKE must be 0 or 1" in r.stderr and r.stdout == ""
    script = os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch")
    model = hf_dir(tmp_path, "qwen3_30b_a3b")
    cmds = render(script, [preset("qwen3_30b_a3b"), f"model.hf_dir={model}"], env={"SMOKE": "1"},
                  nodes=["a", "b"], tmp_path=tmp_path)
    (trainer,) = [c for c in cmds if "gspo_megatron.train" in c]
    args = train_args(trainer)
    assert args[:4] == ["--config", preset("qwen3_30b_a3b"), "--smoke", "checkpoint.resume=auto"]
    assert len(server_cmds(cmds)) == 1 and not any("--smoke" in c for c in server_cmds(cmds))
    (trainer,) = render(script, [preset("qwen3_30b_a3b")], env={"SMOKE": "1", "SGLANG_MODE": "colocated"},
                        nodes=["a"], tmp_path=tmp_path)
    assert train_args(trainer)[2:4] == ["--smoke", "checkpoint.resume=auto"]


# ---- planner -------------------------------------------------------------------------------


def dry_run_json(name: str, *args: str) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "gspo_megatron.planner", "--config", preset(name), "--dry-run",
         "--json", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    "name,args,total,active",
    [
        ("qwen3_30b_a3b", ["--nnodes", "2", "--nproc-per-node", "8"], 30.5e9, 3.3e9),
        ("qwen3_235b_a22b", ["--world-size", "128"], 235e9, 22e9),
        # Zhipu's published sizes count the MTP layer (~3.8B in GLM-4.5, ~1.6B in Air) and leave the
        # embeddings out of the active count; the policy has no MTP layer and counts both embeddings
        ("glm45_air", ["--world-size", "32"], 106e9, 12e9 + 2 * 151552 * 4096),
        ("glm45", ["--world-size", "128"], 355e9 - 3.8e9, 32e9 + 2 * 151552 * 5120),
        # DeepSeek's 671B / 37B leave the MTP layer out (the checkpoint's 685B count it)
        ("deepseek_v3", ["--world-size", "512"], 671e9, 37e9),
        # Moonshot publishes "1T / 32B"; the checkpoint's tensors sum to 1.026T (equal to
        # transformers' count: test_param_counts_equal_transformers_model)
        ("kimi_k2", ["--world-size", "768"], 1.026e12, 32e9),
    ],
)
def test_dry_run_param_counts_match_published(name, args, total, active):
    pl = dry_run_json(name, *args)
    assert abs(pl["total_params"] / total - 1) < 0.01, pl["total_params"]
    assert abs(pl["active_params"] / active - 1) < 0.03, pl["active_params"]
    # the process groups' timeout the run will use, from the config's own waits (SGLang presets)
    ct = pl["collective_timeout"]
    assert ct["timeout_s"] == load_config(preset(name), []).collective_timeout_s()[0]
    assert ct["timeout_s"] > max(ct["waits_s"].values()) > 3600


# An H100 "80 GB" has ~79.6 GiB; the planner leaves out the CUDA context, NCCL buffers and
# fragmentation, so a preset must plan at most this much at the world size it documents.
GPU_BUDGET_GIB = 72.0


@pytest.mark.parametrize("name,world,overrides", [
    ("qwen3_30b_a3b", 16, []),  # 2 nodes of 8x H100
    ("qwen3_30b_a3b", 8, ["train.recompute=full"]),  # 1 node of 8x H100, as docs/cluster.md's example runs it
    ("qwen3_235b_a22b", 128, []),  # 16 nodes
    ("glm45_air", 32, []),  # 4 nodes
    ("glm45", 128, []),  # 16 nodes
    ("deepseek_v3", 512, []),  # 64 nodes
    ("kimi_k2", 768, []),  # 96 nodes
])
def test_gpu_presets_fit_80gb_gpus_at_their_documented_world_size(name, world, overrides):
    """Before: the 30B preset, documented for 8 or 16 GPUs, planned 93.7 GiB at 8 and 72.3 at 16."""
    pl = dry_run_json(name, "--world-size", str(world), "--no-inputs", *overrides)
    if not overrides:  # the preset names the size it is written for: a dry run without one plans for it
        assert load_config(preset(name), []).parallel.world_size == world
        pl0 = dry_run_json(name, "--no-inputs")
        assert pl0["world_size"] == world and pl0["world_size_from"].startswith("parallel.world_size"), pl0["world_size_from"]
    assert pl["peak_memory_gib"] <= GPU_BUDGET_GIB, (name, world, overrides, pl["peak_memory_gib"])
    with open(os.path.join(ROOT, "docs", "cluster.md")) as f:
        doc = f.read()
    if name == "qwen3_30b_a3b" and overrides:
        assert "NPROC=8 launch/torchrun.sh launch/configs/qwen3_30b_a3b.yaml" in doc and "train.recompute=full" in doc


def test_param_counts_equal_transformers_model():
    """The planner's counts (the family's) against transformers' own module of each preset's family
    (on the meta device; the router's expert bias is a buffer there and a counted weight here)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from gspo_megatron import resolve

    seen = set()
    for path in PRESETS:
        cfg = load_config(path, [])
        hf = resolve.hf_config_dict(cfg)
        arch = resolve.arch_of(cfg, hf)
        seen.add(arch.model_type)
        with torch.device("meta"):
            model = arch.family.reference_model(arch.family.hf_config(hf))
        n = sum(p.numel() for p in model.parameters())
        n += sum(b.numel() for name, b in model.named_buffers() if name.endswith("e_score_correction_bias"))
        counts = planner.count_params(planner.planner_dims(arch))
        assert counts["total"] == n, (os.path.basename(path), counts["total"], n)
        assert planner.plan(cfg, planner.default_world_size(cfg))["total_params"] == n
    from gspo_megatron.model.registry import FAMILY_MODULES

    assert seen == set(FAMILY_MODULES), seen  # every family has a preset


def test_plan_30b_layout():
    cfg = load_config(preset("qwen3_30b_a3b"), [])
    pl = planner.plan(cfg, 16)
    lay = pl["layout"]
    assert (lay["tp"], lay["dp"], lay["ep"], lay["edp"], lay["pp"]) == (2, 8, 8, 2, 1)
    assert pl["model"]["padded_vocab_size"] == 152064  # 151936 -> multiple of 128*2
    assert pl["groups"]["tp"][:2] == [[0, 1], [2, 3]]
    assert pl["groups"]["ep"] == [list(range(8)), list(range(8, 16))]  # an EP group = one node
    assert pl["groups"]["expert_dp"][0] == [0, 8]
    assert pl["experts"][3] == {"ep_rank": 3, "experts": [48, 64], "ranks": [3, 11]}
    (stage,) = pl["stages"]
    assert stage["layers"] == [0, 48] and stage["embedding"] and stage["output_layer"]
    assert pl["ranks"][11]["experts"] == [48, 64] and pl["ranks"][11]["tp"] == 1
    mem = stage["memory_gib"]
    assert all(v > 0 for v in mem.values())
    assert abs(mem["total"] - sum(v for k, v in mem.items() if k != "total")) < 1e-9
    # Distributed optimizer: doubling expert-DP halves the expert Adam states.
    pl8 = planner.plan(cfg, 8)
    assert pl8["stages"][0]["memory_gib"]["optimizer"] > mem["optimizer"]
    assert pl8["stages"][0]["params"] == stage["params"]
    # The setting the trainer wraps DDP and builds the optimizer with, as --dry-run prints it.
    tr = pl["training"]
    assert tr["use_distributed_optimizer"] is True and tr["master_weights"] == "fp32"
    assert tr["recompute"] == "selective"
    assert "use_distributed_optimizer=true" in planner.format_plan(pl)


def test_plan_fused_logprobs_drops_the_logits_term():
    cfg = load_config(preset("qwen3_30b_a3b"), ["model.fused_logprobs=false"])
    fused = load_config(preset("qwen3_30b_a3b"), ["model.fused_logprobs=true"])
    a = planner.plan(cfg, 16)["stages"][0]["memory_gib"]["activations"]
    b = planner.plan(fused, 16)["stages"][0]["memory_gib"]["activations"]
    T, H, Vp = cfg.train.micro_batch_tokens, 2048, 152064
    logits = 2 * 4 * T * Vp / 2  # fp32 logits + softmax/grad on a TP2 rank
    fused_terms = (2 + 4) * T * H + 3 * 4 * 2**22
    assert (a - b) * 2**30 == pytest.approx(logits - fused_terms, rel=1e-9)


def test_plan_235b_pipeline_and_tp8_vocab():
    cfg = load_config(preset("qwen3_235b_a22b"), [])
    pl = planner.plan(cfg, 128)
    s0, s1 = pl["stages"]
    assert s0["layers"] == [0, 47] and s1["layers"] == [47, 94]
    assert s0["ranks"] == list(range(64)) and s1["ranks"] == list(range(64, 128))
    assert s0["embedding"] and not s0["output_layer"] and s1["output_layer"]
    assert len(pl["experts"]) == 32 and pl["experts"][31]["experts"] == [124, 128]
    with pytest.raises(ConfigError, match="4 key/value heads"):
        load_config(preset("qwen3_235b_a22b"), ["parallel.tp=8"])
    cfg = load_config(preset("qwen3_30b_a3b"), ["parallel.tp=4"])
    assert planner.plan(cfg, 32)["model"]["padded_vocab_size"] == 152064
    assert planner.padded_vocab(151936, 8) == 152576
    assert planner.padded_vocab(151936, 1) == 151936


def test_plan_single_rank_holds_everything():
    cfg = load_config(preset("tiny_cpu"), ["parallel.tp=1", "parallel.sequence_parallel=false"])
    pl = planner.plan(cfg, 1)
    d = planner.planner_dims(resolve.arch_of(cfg))
    pad = (pl["model"]["padded_vocab_size"] - d["vocab_size"]) * d["hidden_size"] * 2
    assert pl["stages"][0]["params"] == pl["total_params"] + pad


def test_per_rank_params_sum_to_total():
    """Summing each rank's share over one tp x ep slice of every stage recovers the model
    (replicated tensors -- norms, router -- counted once per slice)."""
    cfg = load_config(preset("qwen3_235b_a22b"), [])
    pl = planner.plan(cfg, 128)
    d = planner.planner_dims(resolve.arch_of(cfg))
    tp, ep = 4, 32
    H, L, E = d["hidden_size"], d["num_hidden_layers"], d["num_experts"]
    replicated = L * (2 * H + 2 * d["arch"].head_dim + E * H) + H
    total = 0
    for st in pl["stages"]:
        total += st["dense_params"] * tp + st["expert_params"] * ep
    total -= replicated * (tp - 1)  # norms/router were counted tp times
    pad = (pl["model"]["padded_vocab_size"] - d["vocab_size"]) * H * 2
    assert total == pl["total_params"] + pad


@pytest.mark.parametrize(
    "tp,cp,pp,ep,etp,world",
    [(2, 1, 1, 1, 1, 2), (2, 1, 2, 4, 1, 8), (2, 2, 2, 2, 2, 16), (1, 1, 2, 8, 1, 16),
     (4, 1, 2, 4, 2, 32), (1, 2, 1, 4, 1, 8)],
)
def test_rank_groups_match_megatron(tp, cp, pp, ep, etp, world):
    ps = pytest.importorskip("megatron.core.parallel_state")
    from gspo_megatron.config import ParallelConfig

    p = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    dp, edp = p.dp(world), p.edp(world)
    dec = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    exp = ps.RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    ddims, edims = planner.decoder_dims(p, world), planner.expert_dims(p, world)
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp"):
        assert planner.rank_groups(ddims, token) == dec.get_ranks(token), token
    for token in ("tp", "ep", "dp", "pp", "tp-ep"):
        assert planner.rank_groups(edims, token) == exp.get_ranks(token), token


def test_planner_cli_text_and_errors(capsys):
    assert planner.main(["--config", preset("tiny_cpu"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "world 2 = tp 2" in out and "stage 0: layers 0-1" in out and "experts 0-7" in out
    assert planner.main(["--config", preset("tiny_cpu"), "parallel.tp=3"]) == 2
    assert "attention heads" in capsys.readouterr().err
    assert planner.main(["--config", preset("tiny_cpu"), "--world-size", "3"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert planner.main(["--config", preset("tiny_cpu"), "trian.max_steps=1"]) == 2
    assert "trian" in capsys.readouterr().err
    assert planner.main(["--config", preset("qwen3_30b_a3b"), "--nnodes", "1",
                         "--nproc-per-node", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 8
    # Options and overrides may be interleaved, as the trainer's CLI passes them through.
    assert planner.main(["--config", preset("tiny_cpu"), "parallel.tp=1", "--json",
                         "parallel.sequence_parallel=false", "--world-size", "2"]) == 0
    pl = json.loads(capsys.readouterr().out)
    assert pl["layout"]["tp"] == 1 and pl["layout"]["dp"] == 2


# `python -m gspo_megatron.train ARGS` as runpy runs it, plus a report written at exit (to a file:
# stdout and stderr stay the CLI's own) of what an early exit promises not to have done: import
# Megatron, import the modules that build the model or the process groups (parallel/state.py
# holds the only init_process_group call), or leave torch.distributed initialised.
_PROBE = r"""
import atexit, json, os, runpy, sys

HEAVY = ("gspo_megatron.parallel.state", "gspo_megatron.model.factory", "gspo_megatron.train.loop")


def _report():
    dist = sys.modules.get("torch.distributed")
    with open(os.environ["GSPO_PROBE_OUT"], "w") as f:
        json.dump({"megatron": sorted(m for m in sys.modules if m.split(".")[0] == "megatron"),
                   "heavy": [m for m in HEAVY if m in sys.modules],
                   "dist_initialized": bool(dist and dist.is_available() and dist.is_initialized())}, f)


atexit.register(_report)
sys.argv = ["gspo_megatron.train", *sys.argv[1:]]
runpy.run_module("gspo_megatron.train", run_name="__main__", alter_sys=True)
"""


def _cli_probed(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the trainer's CLI in a fresh process; return its result and what it had loaded at exit."""
    report = tmp_path / f"probe{len(list(tmp_path.glob('probe*.json')))}.json"
    r = subprocess.run([sys.executable, "-c", _PROBE, "--config", preset("tiny_cpu"), *args], capture_output=True,
                       text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONWARNINGS="ignore", GSPO_PROBE_OUT=str(report)))
    assert report.exists(), r.stdout[-2000:] + r.stderr[-2000:]
    return r, json.loads(report.read_text())


def _before_heavy_work(probe: dict) -> None:
    """What "fails fast" stands for (these tests used to bound the wall time at 5 s; the time is now measured
    by bench/bench_launch.py): Megatron never imported, no model built, no process group."""
    assert probe["megatron"] == [], probe["megatron"][:10]
    assert probe["heavy"] == [], probe["heavy"]
    assert probe["dist_initialized"] is False


def _dry_run_fails(tmp_path, *overrides) -> str:
    """The dry run's one error line. It stops before any heavy work: no plan is printed (the plan
    comes after the inputs check), Megatron is not imported, no model or process group is built."""
    r, probe = _cli_probed(tmp_path, "--dry-run", *overrides)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("gspo_megatron.train: error: "), r.stderr[-2000:]
    assert r.stdout == "", r.stdout[-2000:]
    _before_heavy_work(probe)
    return lines[0]


def test_dry_run_checks_data_tokenizer_and_warm_start(tmp_path):
    """--dry-run reads what the trainer would read before its process groups: one line each, before any
    heavy work (Megatron not imported, no model, no process group)."""
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    tok = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n'
                    '{"question": "3+3?", "answer": "6"}\n')
    file_data = ["data.source=file", f"data.path={data}", "reward.fn=math", f"model.tokenizer={tok}"]
    # a record without the prompt key is reported (training skips it and counts it in data_skipped)
    ok, probe = _cli_probed(tmp_path, "--dry-run", *file_data, "train.sft_warmup_steps=0")
    assert ok.returncode == 0, explain(ok.stderr)
    _before_heavy_work(probe)  # a dry run that passes does not start the trainer either
    assert "3 records checked in" in ok.stdout and "2 usable, 1 skipped by training (record 3 has no key 'prompt'" \
        in ok.stdout and "data.prompt_key" in ok.stdout, ok.stdout
    # every record without the key: a wrong data.prompt_key, one line
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    line = _dry_run_fails(tmp_path, *file_data, "train.sft_warmup_steps=0")
    assert "prompts.jsonl" in line and "record 1" in line and "every one of the 1 records" in line, line
    line = _dry_run_fails(tmp_path, "model.hf_config.vocab_size=50")
    assert "98 tokens" in line and "vocab_size is 50" in line, line
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    line = _dry_run_fails(tmp_path, *file_data)  # tiny_cpu.yaml warms up for 60 steps
    assert "train.sft_warmup_steps=60" in line and "synthetic" in line, line
    ok = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", preset("tiny_cpu"), "--dry-run",
                         *file_data, "train.sft_warmup_steps=0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, explain(ok.stderr)
    assert "world size 2 (assumed" in ok.stdout and "1 records checked in" in ok.stdout and "1 usable, 0 skipped" in ok.stdout


def test_torchrun_sh_ends_with_the_failing_ranks_line(tmp_path):
    """A bad input under torchrun: after torchrun's own report, the last line is the rank's error."""
    env = dict(os.environ, NPROC="2", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable)
    r = subprocess.run([os.path.join(ROOT, "launch", "torchrun.sh"), preset("tiny_cpu"), f"out_dir={tmp_path}",
                        "reward.fn=no_such_module_xyz:score"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("torchrun.sh: failed") and "gspo_megatron.train: error: " in last, last
    assert "no_such_module_xyz" in last


def test_planner_nnodes_needs_nproc_per_node(capsys):
    assert planner.main(["--config", preset("qwen3_30b_a3b"), "--nnodes", "2", "--no-inputs"]) == 2
    assert "--nproc-per-node" in capsys.readouterr().err


def test_only_user_error_types_are_one_line_a_bare_value_error_keeps_its_traceback(capsys):
    """Issue 43's review: cli_util counted any ValueError as a user error, so a bug deep in the
    trainer (a shape check, a collective's argument) printed one "error:" line, exit 2, and no
    traceback. Now only errors.py's types (and a missing file) are; each project error raised on
    bad input is one of them."""
    from gspo_megatron.cli_util import EXIT_BAD_INPUT, user_errors
    from gspo_megatron.errors import CheckpointError, ConfigError, InputError, ModelConfigError
    from gspo_megatron.fsutil import NotOurOutputError, TargetExistsError
    from gspo_megatron.rollout.data import PromptDataError
    from gspo_megatron.rollout.rewards import RewardError, RewardSpecError

    for err in (ConfigError, ModelConfigError, InputError, CheckpointError, PromptDataError, RewardSpecError,
                RewardError, TargetExistsError, NotOurOutputError, FileNotFoundError):
        with pytest.raises(SystemExit) as e:
            with user_errors("probe"):
                raise err(f"bad {err.__name__}\nsecond line")
        assert e.value.code == EXIT_BAD_INPUT
        assert capsys.readouterr().err == f"probe: error: bad {err.__name__}\n"
    for bug in (ValueError("a shape check of our own"), RuntimeError("x"), KeyError("k")):
        with pytest.raises(type(bug)):
            with user_errors("probe"):
                raise bug
        assert capsys.readouterr().err == ""


_BAD_INPUT_PROBE = """
import os, sys, time
from gspo_megatron.cli_util import InputError, user_errors

who = os.environ["PROBE_FAILS"]  # "all": every rank, rank 0 the slowest; "1": rank 1 only
with user_errors("probe"):
    rank = int(os.environ["RANK"])
    if who == "all":
        if rank == 0:
            time.sleep(2)  # rank 0 reaches the check last (a loaded machine)
        raise InputError("bad input seen by every rank")
    if rank == 1:
        raise InputError("bad input seen by rank 1 only")
    time.sleep(60)  # rank 0 waits (a collective, in the trainer) until torchrun stops it
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fails", ["all", "1"])
def test_a_bad_input_line_survives_torchrun_stopping_the_ranks(tmp_path, fails):
    """torchrun stops every rank as soon as one exits. The CLI's one line about bad input must
    still reach the operator: when rank 0 is the slowest to fail (CI saw torchrun.sh end with
    "the first traceback above is the cause" and no line), and when only another rank fails."""
    script = tmp_path / "probe.py"
    script.write_text(_BAD_INPUT_PROBE)
    env = dict(os.environ, PROBE_FAILS=fails, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
                        str(script)], capture_output=True, text=True, timeout=100, env=env, cwd=tmp_path)
    assert r.returncode != 0
    want = "probe: error: bad input seen by every rank" if fails == "all" else "probe: error: bad input seen by rank 1 only"
    assert want in r.stderr.splitlines(), r.stderr[-3000:]


@pytest.mark.parametrize("weight_sync", ["distributed", "disk"])
def test_sglang_sbatch_compares_nccl_versions_before_an_nccl_weight_sync(weight_sync, tmp_path):
    """Issue 41 5a: with weight_sync=distributed the job asks the trainer's and the servers'
    environments (each image on a node of its own) for their NCCL version and stops in one line when
    they differ, before any server starts; DRY_RUN shows both probes. disk: no probe."""
    script = os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch")
    model = hf_dir(tmp_path, "qwen3_30b_a3b")
    r = render_run(script, [preset("qwen3_30b_a3b"), f"model.hf_dir={model}",
                            f"rollout.sglang.weight_sync={weight_sync}"],
                   env={"CONTAINER_IMAGE": "/img/gspo.sqsh", "SGLANG_CONTAINER_IMAGE": "lmsysorg/sglang:v0.5.23"},
                   nodes=["a", "b"], tmp_path=tmp_path)
    said = [ln for ln in r.stderr.splitlines() if "compares the NCCL versions" in ln]
    if weight_sync == "disk":
        assert not said, r.stderr
        return
    (line,) = said
    train_probe, server_probe = line.split("first: ", 1)[1].split(" and ")
    assert "--nodelist=a" in train_probe and "--container-image=/img/gspo.sqsh" in train_probe
    assert "--nodelist=b" in server_probe and "--container-image=lmsysorg/sglang:v0.5.23" in server_probe
    assert train_probe.rstrip().endswith("launch/slurm/nccl_version.py")
    assert server_probe.rstrip().endswith("launch/slurm/nccl_version.py")


@pytest.mark.parametrize("linked", ["libnccl", "static"])
def test_the_nccl_probe_reports_the_library_loaded_at_run_time_not_torchs_header(linked, tmp_path):
    """Issue 52: the probe asked torch.cuda.nccl.version(), the NCCL header torch was compiled with,
    while NCCL's init compares the libnccl each side loads, which images replace. The probe the job
    runs (launch/slurm/nccl_version.py) against a stand-in torch whose header says 2.18.3 and whose
    import loads a library answering ncclGetVersion with 2.27.3: a libnccl.so.2 of its own, or
    NCCL linked into libtorch_cuda. It prints 2.27.3. A stand-in with no NCCL: one line, exit 1."""

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in NCCL library")
    libname = "libnccl.so.2" if linked == "libnccl" else "libtorch_cuda.so"
    src = tmp_path / "nccl.c"
    src.write_text("int ncclGetVersion(int *v) { *v = 22703; return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / libname), str(src)], check=True, timeout=120)
    probe = os.path.join(ROOT, "launch", "slurm", "nccl_version.py")

    def run(load: str | None):
        stub = tmp_path / ("torch_" + str(load is not None)) / "torch"
        (stub / "cuda").mkdir(parents=True)
        loader = f"import ctypes\nctypes.CDLL({load!r})\n" if load else ""
        (stub / "__init__.py").write_text(loader + "from . import cuda\n")
        (stub / "cuda" / "__init__.py").write_text("from . import nccl\n")
        (stub / "cuda" / "nccl.py").write_text("def version():\n    return (2, 18, 3)\n")
        return subprocess.run([sys.executable, probe], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(stub.parent)})

    r = run(str(tmp_path / libname))
    assert r.returncode == 0 and r.stdout.strip() == "2.27.3", (r.stdout, r.stderr)
    assert libname in r.stderr  # it names the library that answered
    r = run(None)
    assert r.returncode == 1 and r.stdout == "", r.stdout
    assert r.stderr.strip().splitlines()[-1].startswith("nccl_version.py: no NCCL library is loaded"), r.stderr


@pytest.mark.parametrize("code, printed", [(22703, "2.27.3"), (21803, "2.18.3"), (2708, "2.7.8")])
def test_the_nccl_version_code_reads_as_nccl_defines_it(code, printed):
    """NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9, major*1000 + minor*100 + patch
    before (nccl.h)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("nccl_version", os.path.join(ROOT, "launch", "slurm", "nccl_version.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.version_string(code) == printed
