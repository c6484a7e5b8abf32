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

from gspo_megatron import planner
from gspo_megatron.config import ConfigError, load_config

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


def render(script: str, args: list[str], env: dict | None = None, nodes: list[str] | None = None,
           tmp_path=None, expect_rc: int = 0) -> list[list[str]]:
    """Run a launch script with DRY_RUN=1; return the printed commands as argv lists."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_"))}
    for k in ("NPROC", "MASTER_PORT", "PYTHON", "CONTAINER_IMAGE", "LOG_DIR", "GPUS_PER_NODE"):
        e.pop(k, None)
    e["DRY_RUN"] = "1"
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
    e.update(env or {})
    r = subprocess.run(["bash", script, *args], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == expect_rc, r.stdout + r.stderr
    return [shlex.split(line) for line in r.stdout.splitlines() if line.strip()]


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
    cmds = render(os.path.join(ROOT, "launch", "slurm", "train_with_sglang.sbatch"),
                  [preset(name), "model.hf_dir=/ckpt/m", "train.max_steps=2"],
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
        assert launch[launch.index("--model-path") + 1] == "/ckpt/m"
        assert launch[launch.index("--tp-size") + 1] == "8"
        assert launch[launch.index("--api-key") + 1] == "sekret"
        assert "--nnodes" not in launch
    assert opt(trainer, "--nodelist") == "n1,n2,n3" and opt(trainer, "--nnodes") == "3"
    assert opt(trainer, "--rdzv-endpoint") == f"n1:{20000 + 4242}"
    assert train_args(trainer) == [
        "--config", preset(name), "checkpoint.resume=auto", "rollout.backend=sglang",
        "rollout.sglang.launch=false", "rollout.sglang.urls=[http://n4:30000,http://n5:30000]",
        "rollout.sglang.api_key=sekret", "model.hf_dir=/ckpt/m", "train.max_steps=2",
    ]
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
    # servers on the nodes' addresses and no SGLANG_API_KEY: a generated key, the same on both sides
    keys = {c[c.index("--api-key") + 1] for c in servers}
    assert len(keys) == 1 and len(keys.pop()) == 32
    assert f"rollout.sglang.api_key={servers[0][servers[0].index('--api-key') + 1]}" in train_args(trainer)

    # Servers in their own image; the trainer keeps the host interpreter.
    cmds = render(script, [preset("qwen3_30b_a3b"), "model.hf_dir=/m"],
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
])
def test_gpu_presets_fit_80gb_gpus_at_their_documented_world_size(name, world, overrides):
    """Before: the 30B preset, documented for 8 or 16 GPUs, planned 93.7 GiB at 8 and 72.3 at 16."""
    pl = dry_run_json(name, "--world-size", str(world), "--no-inputs", *overrides)
    assert pl["peak_memory_gib"] <= GPU_BUDGET_GIB, (name, world, overrides, pl["peak_memory_gib"])
    with open(os.path.join(ROOT, "docs", "cluster.md")) as f:
        doc = f.read()
    if name == "qwen3_30b_a3b" and overrides:
        assert "NPROC=8 launch/torchrun.sh launch/configs/qwen3_30b_a3b.yaml" in doc and "train.recompute=full" in doc


def test_param_counts_equal_transformers_model():
    """The planner's formula against transformers' own Qwen3-MoE module (on the meta device)."""
    torch = pytest.importorskip("torch")
    tr = pytest.importorskip("transformers")
    for path in PRESETS:
        hf = load_config(path, []).model.hf_config
        with torch.device("meta"):
            model = tr.Qwen3MoeForCausalLM(tr.Qwen3MoeConfig(**hf))
        n = sum(p.numel() for p in model.parameters())
        counts = planner.count_params(planner.hf_model_dims(hf))
        assert counts["total"] == n, (os.path.basename(path), counts["total"], n)


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
    with pytest.raises(ConfigError, match="num_key_value_heads"):  # 4 kv heads
        load_config(preset("qwen3_235b_a22b"), ["parallel.tp=8"])
    cfg = load_config(preset("qwen3_30b_a3b"), ["parallel.tp=4"])
    assert planner.plan(cfg, 32)["model"]["padded_vocab_size"] == 152064
    assert planner.padded_vocab(151936, 8) == 152576
    assert planner.padded_vocab(151936, 1) == 151936


def test_plan_single_rank_holds_everything():
    cfg = load_config(preset("tiny_cpu"), ["parallel.tp=1", "parallel.sequence_parallel=false"])
    pl = planner.plan(cfg, 1)
    d = planner.hf_model_dims(cfg.model.hf_config)
    pad = (pl["model"]["padded_vocab_size"] - d["vocab_size"]) * d["hidden_size"] * 2
    assert pl["stages"][0]["params"] == pl["total_params"] + pad


def test_per_rank_params_sum_to_total():
    """Summing each rank's share over one tp x ep slice of every stage recovers the model
    (replicated tensors -- norms, router -- counted once per slice)."""
    cfg = load_config(preset("qwen3_235b_a22b"), [])
    pl = planner.plan(cfg, 128)
    d = planner.hf_model_dims(cfg.model.hf_config)
    tp, ep = 4, 32
    H, L, E = d["hidden_size"], d["num_hidden_layers"], d["num_experts"]
    replicated = L * (2 * H + 2 * d["head_dim"] + E * H) + H
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
    assert "num_attention_heads" in capsys.readouterr().err
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


def _dry_run_fails(tmp_path, *overrides) -> str:
    """The dry run's one error line. It stops before any heavy work: no plan is printed (the plan
    comes after the inputs check) and the process never starts torch.distributed (the dry run
    has no code that would; timing it belongs in a bench, not here)."""
    r = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", preset("tiny_cpu"), "--dry-run",
                        *overrides], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, PYTHONWARNINGS="ignore"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("gspo_megatron.train: error: "), r.stderr[-2000:]
    assert r.stdout == "", r.stdout[-2000:]
    return lines[0]


def test_dry_run_checks_data_tokenizer_and_warm_start(tmp_path):
    """--dry-run reads what the trainer would read before its process groups: one line each, fast."""
    from gspo_megatron.rollout.tokenizer import build_tokenizer

    tok = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "answer": "4"}\n'
                    '{"question": "3+3?", "answer": "6"}\n')
    file_data = ["data.source=file", f"data.path={data}", "reward.fn=math", f"model.tokenizer={tok}"]
    # a record without the prompt key is reported (training skips it and counts it in data_skipped)
    ok = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", preset("tiny_cpu"), "--dry-run",
                         *file_data, "train.sft_warmup_steps=0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "3 records checked in" in ok.stdout and "2 usable, 1 skipped by training (record 3 has no key 'prompt'" \
        in ok.stdout and "data.prompt_key" in ok.stdout, ok.stdout
    # every record without the key: a wrong data.prompt_key, one line
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    line = _dry_run_fails(tmp_path, *file_data, "train.sft_warmup_steps=0")
    assert "prompts.jsonl" in line and "record 1" in line and "every one of the 1 records" in line, line
    line = _dry_run_fails(tmp_path, "model.hf_config.vocab_size=50")
    assert "98 tokens" in line and "vocab_size is 50" in line, line
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    line = _dry_run_fails(tmp_path, *file_data)  # tiny_cpu.yaml warms up for 30 steps
    assert "train.sft_warmup_steps=30" in line and "synthetic" in line, line
    ok = subprocess.run([sys.executable, "-m", "gspo_megatron.train", "--config", preset("tiny_cpu"), "--dry-run",
                         *file_data, "train.sft_warmup_steps=0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-2000:]
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
