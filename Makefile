# Two entry points for a fresh machine: `make demo` (main job) and `make test` (the suite).
# Both create or reuse .venv and install what they need; nothing else is required.
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_VERSION := 2.13.0
# Where a CPU torch wheel may already lie (CI and dev machines keep one there).
TORCH_WHEEL_DIR ?= /opt/wheels

.PHONY: demo demo-agent test install clean gpu-check gpu-wheels image

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	# The CPU torch wheel first, so the project's torch pin is already satisfied (no CUDA build).
	w=$$(ls $(TORCH_WHEEL_DIR)/torch-$(TORCH_VERSION)+cpu-*.whl 2>/dev/null | head -n 1); \
	if [ -n "$$w" ]; then $(VPY) -m pip install -q "$$w"; \
	else $(VPY) -m pip install -q "torch==$(TORCH_VERSION)" --index-url https://download.pytorch.org/whl/cpu; fi
	$(VPY) -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# The main job: GSPO on a tiny Qwen3-MoE, 2 CPU processes (TP2 + sequence parallel), ~3 minutes.
# The demo also evaluates 64 held-out prompts x 4 samples every 25 steps (pass@k; tests/test_train_loop.py
# runs the same overrides). They are not in tiny_cpu.yaml: runs that swap in their own data start from it.
DEMO_EVAL = eval.interval=25 eval.num_prompts=64 eval.samples_per_prompt=4

demo: $(STAMP)
	OMP_NUM_THREADS=1 NPROC=2 PYTHON=$(VPY) launch/torchrun.sh launch/configs/tiny_cpu.yaml out_dir=runs/demo $(DEMO_EVAL) $(ARGS)

# The calculator-tool agent (multi-turn, docs/agents.md): the tiny model learns two-digit addition with a tool.
demo-agent: $(STAMP)
	OMP_NUM_THREADS=1 NPROC=2 PYTHON=$(VPY) launch/torchrun.sh launch/configs/tiny_cpu_agent.yaml out_dir=runs/demo-agent $(DEMO_EVAL) $(ARGS)

# Two pytest workers, one test file each at a time (--dist loadfile: a file's module fixtures are
# built once): most waits are process start-up, servers and installs, which overlap.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(VPY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests $(ARGS)

# On a GPU machine (torch + transformers present, no network): the default cluster path on one GPU
# (bf16 + fp32 masters, distributed optimizer, NCCL, SFT, checkpoint, resume, HF export), a
# PASS/FAIL table. The project need not be installed; megatron-core, when missing, is installed from
# ./wheels into a venv of the check's own (the interpreter is never written to). `make gpu-wheels`
# (where the package index is reachable) fills ./wheels for CPython PYVERS (default 3.10-3.13,
# ~15 MiB; e.g. PYVERS="3.12"). WHEELS=DIR for another folder, PY=... for another interpreter.
gpu-check:
	$(PY) bench/gpu_check.py --wheels $(or $(WHEELS),wheels) $(ARGS)

gpu-wheels:
	$(PY) bench/gpu_check.py --fetch-wheels $(or $(WHEELS),wheels) --python-versions "$(or $(PYVERS),3.10 3.11 3.12 3.13)"

# The trainer's container image (docker/Dockerfile, docker/README.md): needs Docker and access to
# nvcr.io and the package index. BASE_IMAGE=nvcr.io/nvidia/pytorch:<yy.mm>-py3 for another base.
IMAGE ?= gspo-megatron:0.1.0
image:
	docker build -f docker/Dockerfile -t $(IMAGE) $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) .

clean:
	rm -rf $(VENV)
