"""docs/cluster.md's commands: every line of its ```bash blocks, run here as far as a CPU machine
allows, the way tests/test_readme_byo.py runs the README's.

The commands are read from the doc (continuation lines joined, comments stripped), never listed
here, and each is classified by what it is:

* `python -m gspo_megatron.planner ...` / `python -m gspo_megatron.train ... --dry-run ...`: run as
  written (`python` = this venv's); exit 0 and the plan printed equals the planner's own plan of
  that config and world (the JSON's layout, memory and `collective_timeout`).
* `python -m gspo_megatron.train ... --smoke ...` (the pre-flight check, one process): run as
  written on a CPU preset (~10 s; the in-process engine): PASS rows, exit 0, nothing written.
* `python -m gspo_megatron.train ... --simulate ...`: run as written (the meta device); exit 0 and
  every rank it built holds its stage's planned parameters.
* `[ENV=..] launch/torchrun.sh CONFIG overrides`: run as written with DRY_RUN=1 (a GPU preset
  cannot run here, and a CPU one is trained for real elsewhere, see `_cpu_run_elsewhere`): the
  printed torchrun has NPROC processes and the config and overrides as written; then the trainer
  is asked for exactly that (`--dry-run --world-size NPROC` with those overrides): the overrides
  and the layout are valid at that world size.
* `[ENV=..] sbatch [--nodes=N] launch/slurm/X.sbatch CONFIG overrides`: run as written with a fake
  `sbatch` (copies the script away and starts it in the submit directory with the SLURM_*
  variables, as sbatch does) and a fake `scontrol`, under DRY_RUN=1: the printed srun lines start
  the trainer on the right nodes with the config and the overrides as written (last, so they
  win), the SGLang servers on the last SGLANG_NODES nodes with the SGLANG_* knobs given; then the
  trainer's own arguments pass its dry run at the trainer's world size.
* `pip install ...` and `python -c "import ..."` of modules absent here (Transformer Engine):
  skipped, with the reason (see the -ra summary); the container install's requirement list is
  compared with pyproject.toml instead.
* Anything else fails its test case, naming the command: a command added to the doc needs a way
  to be checked here.

Placeholders: a `model.hf_dir=/ckpt/...` that does not exist here is replaced by a directory
holding only config.json, the preset's own architecture (what the trainer and the SGLang flags
query read from it); the dry runs then skip the input check (`--no-inputs`: no tokenizer or
weights there). A comment `# ... X GiB per GPU planned` after a command must match the planner.
Everything runs concurrently (threads + subprocesses with timeouts); a broken command of every
runnable kind (a typo'd preset path, an unknown override key) is shown to fail.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from gspo_megatron import resolve
from gspo_megatron import planner
from gspo_megatron.config import ConfigError
from gspo_megatron.resolve import load_config

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "cluster.md")
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")
TIMEOUT = 180  # per subprocess (a busy 2-core machine: a dry run alone takes ~7 s)
ENV_PREFIX = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# ---- reading the doc ---------------------------------------------------------------------------


@dataclass
class Cmd:
    line: int  # 1-based line in docs/cluster.md
    text: str  # the command as written, continuation lines joined, comment stripped
    comment: str = ""  # a trailing `# ...` comment
    env: dict = field(default_factory=dict)  # leading VAR=value words
    words: list = field(default_factory=list)  # the rest, shell-split

    @property
    def shown(self) -> str:
        return " ".join(self.text.split())

    @property
    def id(self) -> str:
        return f"L{self.line}-{os.path.basename(self.words[0]) if self.words else 'empty'}"


def parse_command(text: str, line: int) -> Cmd:
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError as e:  # unbalanced quotes: no command this test knows (its case fails, naming it)
        return Cmd(line, text.strip(), words=[f"<unparsable: {e}>"])
    comment = ""
    for m in re.finditer(r"(?<=\s)#", text):  # the first `#` outside quotes that starts a comment
        try:
            if shlex.split(text[:m.start()]) == tokens:
                comment, text = text[m.start() + 1:].strip(), text[:m.start()]
                break
        except ValueError:  # inside a quote
            continue
    env = {}
    while tokens and ENV_PREFIX.match(tokens[0]):
        k, v = tokens.pop(0).split("=", 1)
        env[k] = v
    return Cmd(line, text.strip(), comment, env, tokens)


def doc_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of every ```bash block."""
    return [(text[:m.start(1)].count("\n") + 1, m.group(1))
            for m in re.finditer(r"^[ \t]*```bash[ \t]*\n(.*?)^[ \t]*```", text, re.M | re.S)]


def block_commands(first: int, body: str) -> list[Cmd]:
    """The commands of one block: continuation lines joined (bash drops backslash-newline),
    comment lines and blank lines left out."""
    lines, out, i = body.split("\n"), [], 0
    while i < len(lines):
        start, joined = first + i, lines[i]
        while joined.endswith("\\") and i + 1 < len(lines):
            i += 1
            joined = joined[:-1] + lines[i]
        i += 1
        if joined.strip() and not joined.lstrip().startswith("#"):
            out.append(parse_command(joined, start))
    return out


def doc_commands() -> list[Cmd]:
    with open(DOC, encoding="utf-8") as f:
        return [c for first, body in doc_blocks(f.read()) for c in block_commands(first, body)]


COMMANDS = doc_commands()


# ---- classification ----------------------------------------------------------------------------


def _py_c_modules(code: str) -> list[str]:
    mods = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            mods += [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.append(node.module.split(".")[0])
    return sorted(set(mods))


def classify(c: Cmd) -> tuple[str | None, str]:
    """(kind, why) with kind one of planner, dry_run, smoke, simulate, torchrun, sbatch, python_c, skip, or
    None."""
    w = c.words
    if len(w) >= 3 and w[0] == "python" and w[1] == "-m":
        if w[2] == "gspo_megatron.planner":
            return "planner", ""
        if w[2] == "gspo_megatron.train" and "--dry-run" in w:
            return "dry_run", ""
        if w[2] == "gspo_megatron.train" and "--smoke" in w:
            return "smoke", ""
        if w[2] == "gspo_megatron.train" and "--simulate" in w:
            return "simulate", ""
    if w and w[0].endswith("launch/torchrun.sh"):
        return "torchrun", ""
    if w and w[0] == "sbatch":
        return "sbatch", ""
    if w[:2] == ["pip", "install"]:
        return "skip", ("installs into the GPU training container (an NGC image) from the package index: no such "
                        "container or index here; the versions it names are compared with pyproject.toml by "
                        "test_container_install_matches_pyproject")
    if len(w) == 3 and w[0] == "python" and w[1] == "-c":
        try:
            missing = [m for m in _py_c_modules(w[2]) if importlib.util.find_spec(m) is None]
        except SyntaxError:
            return None, ""
        if missing:
            return "skip", f"needs {', '.join(missing)} (the GPU container's), not installed on this CPU machine"
        return "python_c", ""
    return None, ""


# ---- running -----------------------------------------------------------------------------------

_SCRUB = ("NPROC", "MASTER_PORT", "MASTER_ADDR", "PYTHON", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "LOG_DIR",
          "GPUS_PER_NODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "DRY_RUN", "REPO_DIR", "SMOKE", "PYTHONPATH")

FAKE_SCONTROL = """#!/usr/bin/env bash
[[ $1 == show && $2 == hostnames ]] || exit 1
tr " " "\\n" <<<"$FAKE_NODES"
"""

# sbatch as far as the doc uses it: --nodes / --gpus-per-node (else the script's #SBATCH header);
# the script is copied away and run from the submit directory, as sbatch does (the scripts must
# find the repo through SLURM_SUBMIT_DIR). An option it does not know fails: extend it.
FAKE_SBATCH = """#!/usr/bin/env bash
set -euo pipefail
nodes='' gpus=''
while [[ $# -gt 0 && $1 == -* ]]; do
    case $1 in
        --nodes=*) nodes=${1#*=} ;;
        -N | --nodes) nodes=$2; shift ;;
        --gpus-per-node=*) gpus=${1#*=} ;;
        *) echo "fake sbatch (tests/test_docs_cluster.py): option $1 not understood; teach it" >&2; exit 2 ;;
    esac
    shift
done
script=${1:?fake sbatch: no script}
shift
[[ -f $script ]] || { echo "sbatch: error: Unable to open file $script" >&2; exit 1; }
header() { sed -n "s/^#SBATCH --$1=//p" "$script" | head -n 1; }
nodes=${nodes:-$(header nodes)}
gpus=${gpus:-$(header gpus-per-node)}
names=()
for ((i = 1; i <= nodes; i++)); do names+=("$(printf 'gpu-%03d' "$i")"); done
echo "FAKE_SBATCH nodes=$nodes gpus=$gpus names=${names[*]}" >&2
spool=$(mktemp -d "${FAKE_SPOOL:?}/job.XXXXXX")
cp "$script" "$spool/slurm_script"
export FAKE_NODES="${names[*]}" SLURM_JOB_NODELIST="gpu-[001-$nodes]" SLURM_NNODES=$nodes SLURM_JOB_ID=4242
export SLURM_JOB_NAME=$(header job-name) SLURM_SUBMIT_DIR=$PWD SLURM_GPUS_ON_NODE=$gpus
exec bash "$spool/slurm_script" "$@"
"""


def make_fake_bin(d) -> str:
    for name, body in (("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH)):
        p = os.path.join(d, name)
        with open(p, "w") as f:
            f.write(body)
        os.chmod(p, 0o755)
    return str(d)


def base_env(fake_bin: str, tmp: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SGLANG_")) and k not in _SCRUB}
    e.update(PATH=os.pathsep.join([os.path.dirname(sys.executable), fake_bin, e.get("PATH", "")]),
             OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", FAKE_SPOOL=tmp, TMPDIR=tmp)
    return e


def sh(cmd_text: str, env: dict, what: str) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd_text], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, f"{what}: `{cmd_text}` exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def config_of(words: list[str]) -> str:
    cfgs = [w for w in words if w.endswith((".yaml", ".yml")) and "=" not in w]
    assert cfgs, f"no config file in {words}"
    return cfgs[0]


def stand_in_paths(c: Cmd, tmp: str) -> tuple[Cmd, bool]:
    """The command with a missing `model.hf_dir=/ckpt/...` placeholder replaced by a directory
    holding the preset's own config.json; True when one was."""
    cfg = config_of(c.words)
    text, used = c.text, False
    if not os.path.isfile(os.path.join(REPO, cfg)):
        return c, False  # the command fails on its own
    for w in c.words:
        if w.startswith("model.hf_dir="):
            path = w.split("=", 1)[1]
            if os.path.exists(path):
                continue
            arch = [o for o in c.words[c.words.index(cfg) + 1:] if o.startswith("model.hf_config.")]
            try:
                hf = resolve.hf_config_dict(load_config(os.path.join(REPO, cfg), arch))
            except ConfigError:
                return c, False  # the command's own run says why
            d = os.path.join(tmp, "standin", os.path.basename(path.rstrip("/")) or "model")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(hf, f)
            text = text.replace(w, shlex.quote(f"model.hf_dir={d}"), 1)
            used = True
    return (parse_command(text + (f"  # {c.comment}" if c.comment else ""), c.line) if used else c), used


def check_planned_memory(c: Cmd, peak_gib: float) -> str:
    m = re.search(r"(\d+(?:\.\d+)?) GiB per GPU planned", c.comment)
    if m:
        assert f"{peak_gib:.1f}" == m.group(1), (
            f"docs/cluster.md:{c.line}: the comment says {m.group(1)} GiB per GPU planned, the planner "
            f"plans {peak_gib:.1f} GiB for `{c.text}`")
        return f", {m.group(1)} GiB per GPU as its comment says"
    return ""


def trainer_dry_run(c: Cmd, train_args: list[str], world: int, no_inputs: bool) -> dict:
    """What `python -m gspo_megatron.train <the arguments a launch line starts it with> --dry-run
    --world-size <its world>` does (planner._main), in this process: the planner imports torch, which
    this process has loaded already, where a subprocess would pay for it again (~3 s of CPU each)."""
    config = train_args[train_args.index("--config") + 1]
    overrides = [a for a in train_args if "=" in a and not a.startswith("-")]  # the dotted ones (not --smoke)
    try:
        cfg = load_config(config if os.path.isabs(config) else os.path.join(REPO, config), overrides)
        pl = planner.plan(cfg, world)
        if not no_inputs:
            pl["inputs"] = planner._check_inputs(cfg, world)
    except Exception as e:  # noqa: BLE001 - the trainer's one-line error (ConfigError) or anything else
        raise AssertionError(f"docs/cluster.md:{c.line} `{c.shown}`: the trainer it starts refuses its arguments "
                             f"(--config {config} {shlex.join(overrides)} at world size {world}):\n"
                             f"{type(e).__name__}: {e}") from e
    assert pl["world_size"] == world
    return pl


def opt(argv: list[str], name: str) -> str:
    vals = [a.split("=", 1)[1] for a in argv if a.startswith(name + "=")]
    vals += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name]
    assert len(vals) == 1, (name, argv)
    return vals[0]


def after(argv: list[str], module: str) -> list[str]:
    i = argv.index(module)
    assert argv[i - 1] == "-m", argv
    return argv[i + 1:]


def overrides_of(words: list[str]) -> list[str]:
    """What follows the config file: passed on to the trainer as written."""
    return words[words.index(config_of(words)) + 1:]


# -- one function per kind; each asserts and returns a one-line summary -----------------------------


def run_planner(c: Cmd, fake_bin: str, tmp: str) -> str:
    """Run as written; the output is the planner's own plan of that config at that world size."""
    r = sh(c.text, {**base_env(fake_bin, tmp), **c.env}, f"docs/cluster.md:{c.line}")
    args = planner.build_parser().parse_intermixed_args(c.words[3:])
    cfg = load_config(os.path.join(REPO, args.config), args.overrides)
    if args.world_size:
        world = args.world_size
    elif args.nnodes or args.nproc_per_node:
        world = (args.nnodes or 1) * (args.nproc_per_node or 1)
    elif cfg.parallel.world_size is not None:  # the size the preset is written for (planner.main's order)
        world = cfg.parallel.world_size
    else:
        world = planner.default_world_size(cfg)
    pl = planner.plan(cfg, world)
    if args.json:
        got = json.loads(r.stdout)
        assert got["world_size"] == world and got["layout"] == pl["layout"], (got["layout"], pl["layout"])
        assert got["peak_memory_gib"] == pl["peak_memory_gib"] and got["groups"] == pl["groups"]
        assert "collective_timeout" in got  # the doc points readers at it
        assert ("inputs" in got) != args.no_inputs
    else:
        assert f"world size {world} (" in r.stdout, r.stdout[:2000]
        assert planner.format_plan(pl) in r.stdout, r.stdout[-4000:]  # groups, stages, experts, memory
        assert "collective timeout" in r.stdout
        assert ("\ninputs: " in r.stdout) != args.no_inputs
    return f"world {world}, peak {_gib(pl['peak_memory_gib'])}" + check_planned_memory(c, pl["peak_memory_gib"])


_REAL_TORCHRUN = re.compile(
    r'"-m",\s*"torch\.distributed\.run",.{0,300}?"--standalone",\s*"-m",\s*"gspo_megatron\.train"', re.S)


def _cpu_run_elsewhere(config: str) -> list[str]:
    """Test files that train this config for real the way launch/torchrun.sh does: a subprocess
    `python -m torch.distributed.run ... --standalone -m gspo_megatron.train` naming the config."""
    here = os.path.dirname(os.path.abspath(__file__))
    hits = []
    for name in sorted(os.listdir(here)):
        if name.startswith("test_") and name.endswith(".py") and name != os.path.basename(__file__):
            with open(os.path.join(here, name), encoding="utf-8") as f:
                src = f.read()
            if os.path.basename(config) in src and _REAL_TORCHRUN.search(src):
                hits.append(name)
    return hits


def _gib(x: float) -> str:
    return f"{x:.1f} GiB" if x >= 1 else f"{x * 1024:.1f} MiB"


def run_torchrun(c: Cmd, fake_bin: str, tmp: str) -> str:
    c, stood_in = stand_in_paths(c, tmp)
    r = sh(c.text, {**base_env(fake_bin, tmp), **c.env, "DRY_RUN": "1"}, f"docs/cluster.md:{c.line} with DRY_RUN=1")
    (cmd,) = [shlex.split(x) for x in r.stdout.splitlines() if x.strip()]
    nproc = c.env.get("NPROC", "1")  # no GPU visible here
    assert cmd[0] == VENV_PY or not os.access(VENV_PY, os.X_OK), cmd  # the repo's .venv unless PYTHON
    assert cmd[1:3] == ["-m", "torch.distributed.run"], cmd
    assert opt(cmd, "--nproc-per-node") == nproc and opt(cmd, "--nnodes") == "1", cmd
    assert ("--standalone" in cmd) == ("MASTER_PORT" not in c.env), cmd
    config = config_of(c.words)
    args = after(cmd, "gspo_megatron.train")
    assert args == ["--config", config, *overrides_of(c.words)], args
    # CPU presets: the dry run reads every input as the trainer would (tokenizer, data, reward,
    # warm start). Training itself is not repeated here (tiny_cpu.yaml's 30 warm-start steps +
    # max_steps ~ a minute on 2 busy cores): the same command, torch.distributed.run --standalone
    # --nproc-per-node=2 -m gspo_megatron.train --config tiny_cpu.yaml, trains for 100 steps in
    # test_train_loop.py::test_demo_learns_and_exports_hf (found below by reading the tests).
    pl = trainer_dry_run(c, args, int(nproc), no_inputs=stood_in)
    extra = ""
    if pl["layout"]["device"] == "cpu":
        hits = _cpu_run_elsewhere(config)
        assert hits, (f"docs/cluster.md:{c.line} `{c.text}` is a CPU run that no test trains for real "
                      f"(no test starts {os.path.basename(config)} under torch.distributed.run --standalone)")
        extra = f"; trained for real in {', '.join(hits)}"
    return (f"{nproc} processes, overrides {args[2:]}, peak {_gib(pl['peak_memory_gib'])}"
            + check_planned_memory(c, pl["peak_memory_gib"]) + extra)


# SGLANG_* knobs -> the launch_server flag that carries them (docs/cluster.md, section 4)
SERVER_FLAGS = {"SGLANG_TP": "--tp-size", "SGLANG_DP": "--dp-size", "SGLANG_EP": "--ep-size",
                "SGLANG_MEM_FRACTION": "--mem-fraction-static", "SGLANG_PORT": "--port",
                "SGLANG_MODEL_PATH": "--model-path", "SGLANG_API_KEY": "--api-key"}


def run_sbatch(c: Cmd, fake_bin: str, tmp: str) -> str:
    c, stood_in = stand_in_paths(c, tmp)
    r = sh(c.text, {**base_env(fake_bin, tmp), **c.env, "DRY_RUN": "1"},
           f"docs/cluster.md:{c.line} under a fake Slurm with DRY_RUN=1")
    (fake,) = [ln for ln in r.stderr.splitlines() if ln.startswith("FAKE_SBATCH ")]
    names = fake.split("names=", 1)[1].split()
    gpus = int(re.search(r"gpus=(\d+)", fake).group(1))
    cmds = [shlex.split(x) for x in r.stdout.splitlines() if x.strip()]
    assert all(x[0] == "srun" for x in cmds), cmds
    trainers = [x for x in cmds if "gspo_megatron.train" in x]
    servers = [x for x in cmds if "sglang.launch_server" in x]
    assert len(trainers) == 1 and len(trainers) + len(servers) == len(cmds), cmds
    (trainer,) = trainers
    script = next(w for w in c.words if w.endswith(".sbatch"))
    config = config_of(c.words)
    user = overrides_of(c.words)
    mode = c.env.get("SGLANG_MODE", "disaggregated")
    disaggregated = "sglang" in os.path.basename(script) and mode == "disaggregated"

    n_servers = int(c.env.get("SGLANG_NODES", "1")) if disaggregated else 0
    per_server = int(c.env.get("SGLANG_NODES_PER_SERVER", "1"))
    server_nodes, train_nodes = names[len(names) - n_servers:], names[:len(names) - n_servers]
    assert [opt(x, "--nodelist") for x in servers] == server_nodes, servers  # the last SGLANG_NODES nodes
    if servers or "--nodelist" in " ".join(trainer):
        assert opt(trainer, "--nodelist") == ",".join(train_nodes), trainer
    tr = trainer[trainer.index("torch.distributed.run") + 1:]
    assert opt(tr, "--nnodes") == str(len(train_nodes)) and opt(tr, "--nproc-per-node") == str(gpus), tr
    assert opt(tr, "--rdzv-backend") == "c10d" and opt(tr, "--rdzv-endpoint").startswith(train_nodes[0] + ":"), tr
    args = after(trainer, "gspo_megatron.train")
    assert args[:2] == ["--config", os.path.realpath(os.path.join(REPO, config))], args
    assert args[len(args) - len(user):] == user, (args, user)  # the user's overrides last: they win
    assert "checkpoint.resume=auto" in args[2:len(args) - len(user)], args  # requeued jobs resume
    assert ("--smoke" in args) == (c.env.get("SMOKE", "0") == "1"), args
    hf_dir = [o.split("=", 1)[1] for o in user if o.startswith("model.hf_dir=")]
    for x in servers:
        launch = after(x, "sglang.launch_server")
        want = {flag: c.env[k] for k, flag in SERVER_FLAGS.items() if k in c.env}
        want.setdefault("--model-path", hf_dir[-1] if hf_dir else None)
        want.setdefault("--tp-size", str(gpus * per_server // int(c.env.get("SGLANG_DP", "1"))))
        if per_server > 1:
            want["--nnodes"] = str(per_server)
        for flag, value in want.items():
            assert opt(launch, flag) == value, (flag, value, launch)
    if disaggregated:
        assert "rollout.backend=sglang" in args and "rollout.sglang.launch=false" in args, args
        urls = opt(args, "rollout.sglang.urls").strip("[]").split(",")
        port = c.env.get("SGLANG_PORT", "30000")
        assert urls == [f"http://{n}:{port}" for n in server_nodes[::per_server]], urls  # one per server
    pl = trainer_dry_run(c, args, len(train_nodes) * gpus, no_inputs=stood_in)
    return (f"{len(names)} nodes: {len(train_nodes)} x {gpus} training ranks, {len(servers)} server srun(s), "
            f"peak {_gib(pl['peak_memory_gib'])}" + check_planned_memory(c, pl["peak_memory_gib"]))


def run_smoke(c: Cmd, fake_bin: str, tmp: str) -> str:
    """The pre-flight check, one process: run for real on a CPU preset (the in-process engine, ~10 s
    of CPU; tests/test_smoke.py runs it against the SGLang double, not this way). It must pass and,
    as the doc says, write nothing (not even its out_dir)."""
    args = c.words[3:]
    config = args[args.index("--config") + 1]
    try:
        cfg = load_config(os.path.join(REPO, config), [a for a in args if "=" in a and not a.startswith("-")])
    except ConfigError:
        cfg = None  # the command fails on its own, below
    if cfg is not None and cfg.parallel.device != "cpu":
        pytest.skip(f"docs/cluster.md:{c.line}: the smoke check of a {cfg.parallel.device} preset needs its "
                    "GPUs and servers")
    out_dir = os.path.join(REPO, cfg.out_dir if cfg is not None else "runs")
    existed = os.path.exists(out_dir)
    r = sh(c.text, {**base_env(fake_bin, tmp), **c.env}, f"docs/cluster.md:{c.line}")
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert r.stdout.rstrip().endswith("smoke: PASS"), r.stdout[-3000:]
    assert {x[0] for x in rows if len(x) > 1 and x[1] == "PASS"} >= {"weights", "generate", "log-probs"}, r.stdout
    assert not [x for x in rows if len(x) > 1 and x[1] == "FAIL"], r.stdout
    assert existed or not os.path.exists(out_dir), f"the smoke check wrote {out_dir}"
    return "PASS: " + ", ".join(x[0] for x in rows if len(x) > 1 and x[1] == "PASS")


def run_python_c(c: Cmd, fake_bin: str, tmp: str) -> str:
    sh(c.text, {**base_env(fake_bin, tmp), **c.env}, f"docs/cluster.md:{c.line}")
    return "ran"


def run_simulate(c: Cmd, fake_bin: str, tmp: str) -> str:
    """--simulate: run as written (the meta device, no GPU; ~20 s of CPU a preset). Exit 0, and each
    rank it built holds the parameters the planner plans for its stage (planner == code, as
    tests/test_simulate.py checks for every preset)."""
    r = sh(c.text, {**base_env(fake_bin, tmp), **c.env}, f"docs/cluster.md:{c.line}")
    args = c.words[3:]
    cfg = load_config(os.path.join(REPO, config_of(c.words)), [a for a in args if "=" in a and not a.startswith("-")])
    world = int(args[args.index("--world-size") + 1]) if "--world-size" in args else cfg.parallel.world_size
    stages = {st["pp_rank"]: st["params"] for st in planner.plan(cfg, world)["stages"]}
    if "--json" in args:
        out = json.loads(r.stdout.strip().splitlines()[-1])
        built = [(x["rank"], x["coords"]["pp"], x["params"]) for x in out["ranks"]]
    else:
        built = [(int(m[1]), int(m[2]), int(m[3].replace(",", ""))) for m in
                 re.finditer(r"^rank (\d+) \(pp (\d+) .*?\): ([0-9,]+) parameters", r.stdout, re.M)]
    assert built and all(stages[pp] == n for _, pp, n in built), (built, stages, r.stdout[-2000:])
    if "--engines" in args and "--json" not in args:  # the refit plan: each mode of the engine x each layout
        from gspo_megatron.train.simulate import engine_modes

        for mode in engine_modes(cfg.rollout.backend):
            for lay in args[args.index("--engines") + 1].split(","):
                assert re.search(rf"^  {mode} {lay}: (refused: |[0-9.]+ s )", r.stdout, re.M), (mode, lay, r.stdout[-3000:])
    return f"{len(built)} ranks of {world} built, each with its stage's planned parameters"


RUNNERS = {"planner": run_planner, "dry_run": run_planner, "smoke": run_smoke, "simulate": run_simulate,
           "torchrun": run_torchrun, "sbatch": run_sbatch, "python_c": run_python_c}


# ---- tests -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fake_bin(tmp_path_factory):
    return make_fake_bin(tmp_path_factory.mktemp("fakebin"))


@pytest.fixture(scope="module")
def runs(fake_bin, tmp_path_factory, request):
    """Every runnable command this session selected, started at once (4 in flight): line -> Future."""
    selected = {item.callspec.params["cmd"].line for item in request.session.items
                if getattr(item, "originalname", "") == "test_doc_command" and hasattr(item, "callspec")}
    todo = [c for c in COMMANDS if classify(c)[0] in RUNNERS and c.line in selected]
    with ThreadPoolExecutor(max_workers=4) as ex:
        yield {c.line: ex.submit(RUNNERS[classify(c)[0]], c, fake_bin, str(tmp_path_factory.mktemp(c.id)))
               for c in todo}


def test_doc_has_commands():
    """The extraction itself: the bash blocks exist and give commands; no shell block hides from it."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    assert doc_blocks(text) and COMMANDS, "no ```bash blocks found in docs/cluster.md"
    other = re.findall(r"^[ \t]*```(sh|shell|console|zsh|bash\S+)[ \t]*$", text, re.M)
    assert not other, f"docs/cluster.md: mark shell blocks ```bash so this test runs them (found ```{other})"
    assert not [c for c in COMMANDS if c.text.endswith("\\")], "a continuation line ends a block"
    kinds = {classify(c)[0] for c in COMMANDS}
    assert {"planner", "torchrun", "sbatch"} <= kinds, kinds  # the doc's sections 2-4 (a guard on the parser)


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.id for c in COMMANDS])
def test_doc_command(cmd, runs):
    kind, why = classify(cmd)
    if kind is None:
        pytest.fail(f"docs/cluster.md:{cmd.line}: `{cmd.text}` is no command this test knows how to check "
                    "(planner, train --dry-run, train --smoke, train --simulate, launch/torchrun.sh, "
                    "sbatch launch/slurm/*.sbatch, "
                    "pip install, python -c): teach tests/test_docs_cluster.py to run it, or say why it cannot "
                    "run on CPU")
    if kind == "skip":
        pytest.skip(f"docs/cluster.md:{cmd.line} `{cmd.shown[:100]}`: {why}")
    print(f"docs/cluster.md:{cmd.line} [{kind}] {runs[cmd.line].result()}")


def test_classification_of_commands_the_doc_might_grow():
    """A command this test cannot check fails its case instead of passing unnoticed."""
    kinds = {t: classify(parse_command(t, 0))[0] for t in (
        "python -m gspo_megatron.planner --config c.yaml --world-size 8",
        "python -m gspo_megatron.train --config c.yaml --dry-run",
        "python -m gspo_megatron.train --config c.yaml --smoke",
        "python -m gspo_megatron.train --config c.yaml --simulate --ranks 0",
        "python -m gspo_megatron.train --config c.yaml",  # a real training run: not on CPU here
        "NPROC=8 MASTER_PORT=1 launch/torchrun.sh c.yaml a.b=1  # comment",
        "SGLANG_NODES=1 sbatch --nodes=3 launch/slurm/train_with_sglang.sbatch c.yaml",
        'pip install "x>=1"',
        'python -c "import transformer_engine_absent_xyz"',
        'python -c "import json; print(1)"',
        'make gpu-check ARGS="--nproc 8"',
        "torchrun --nproc-per-node 8 -m gspo_megatron.train --config c.yaml",
        'echo "unbalanced',
    )}
    assert list(kinds.values()) == ["planner", "dry_run", "smoke", "simulate", None, "torchrun", "sbatch", "skip",
                                    "skip", "python_c", None, None, None], kinds
    c = parse_command("A=1 B='x y' launch/torchrun.sh c.yaml 'k=[a,b]' # 68.7 GiB per GPU planned", 7)
    assert (c.env, c.words, c.comment) == ({"A": "1", "B": "x y"}, ["launch/torchrun.sh", "c.yaml", "k=[a,b]"],
                                           "68.7 GiB per GPU planned")
    (j,) = block_commands(10, "# a comment\n\nX=1 sbatch \\\n    s.sbatch c.yaml \\\n    k=v\n")
    assert (j.line, j.env, j.words) == (12, {"X": "1"}, ["sbatch", "s.sbatch", "c.yaml", "k=v"])


BROKEN = {"typo'd preset path": "_typo.yaml", "unknown override key": "trian"}


def _broken(c: Cmd, how: str) -> Cmd:
    if how == "typo'd preset path":
        cfg = config_of(c.words)
        return parse_command(c.text.replace(cfg, cfg.replace(".yaml", "_typo.yaml"), 1), c.line)
    return parse_command(c.text + " trian.max_steps=1", c.line)


# Not the smoke kind: its CLI imports the whole trainer (~8 s of CPU) before it reads the config, and
# its runner fails on the exit status through the same `sh` as the planner kinds checked here.
@pytest.mark.parametrize("kind,how", [(k, h) for k in ("planner", "dry_run", "simulate", "torchrun", "sbatch")
                                      for h in BROKEN])
def test_a_broken_doc_command_fails(kind, how, fake_bin, tmp_path):
    """The checks above catch a wrong command. The failure must be the command's (or the trainer's
    it starts) non-zero exit, naming the mistake in its own output."""
    found = [c for c in COMMANDS if classify(c)[0] == kind]
    if not found:
        pytest.skip(f"docs/cluster.md has no {kind} command")
    with pytest.raises(AssertionError, match=r"(exited [1-9]\d*|refuses its arguments)") as e:
        RUNNERS[kind](_broken(found[0], how), fake_bin, str(tmp_path))
    output = str(e.value).split("\n", 1)[1]  # the first line quotes the command itself
    assert BROKEN[how] in output, str(e.value)


def test_container_install_matches_pyproject():
    """The container install (`pip install --no-deps -e .` + the dependencies by hand, torch left
    to the container) cannot run here; its list must still be the project's: every dependency of
    pyproject.toml but torch, with the same version range, and any extra it names as pinned there."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with open(DOC, encoding="utf-8") as f:
        blocks = [b for _, b in doc_blocks(f.read()) if re.search(r"pip install --no-deps -e \.", b)]
    if not blocks:
        pytest.skip("docs/cluster.md has no `pip install --no-deps -e .` block")
    named = {}
    for body in blocks:
        for c in block_commands(0, body):
            if c.words[:2] == ["pip", "install"]:
                for w in c.words[2:]:
                    if not w.startswith("-") and w != ".":
                        r = Requirement(w)
                        named[canonicalize_name(r.name)] = r
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    deps = {canonicalize_name(Requirement(d).name): Requirement(d) for d in project["dependencies"]}
    extras = {canonicalize_name(Requirement(d).name): Requirement(d)
              for ds in project.get("optional-dependencies", {}).values() for d in ds}
    missing = sorted(set(deps) - {"torch"} - set(named))
    assert not missing, f"docs/cluster.md's container install lacks pyproject dependencies {missing}"
    for name, r in named.items():
        ref = deps.get(name) or extras.get(name)
        assert ref is not None, f"docs/cluster.md installs {r}, which pyproject.toml does not name"
        assert r.specifier == ref.specifier, f"docs/cluster.md installs {r}, pyproject.toml has {ref}"

