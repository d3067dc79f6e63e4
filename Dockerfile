# gdpo-megatron GPU image: NGC PyTorch (torch, CUDA, NCCL, Transformer Engine, apex) plus
# vLLM built against that torch, megatron-core and this package. The base's torch is never
# replaced: every install runs under a constraints file pinning the base's torch stack.
#
# The combination, and where each pairing is documented. Not built yet: the machines this
# project is developed on have no Docker engine (and no GPU), so build it once on a GPU host.
#   nvcr.io/nvidia/pytorch:25.06-py3  torch 2.8.0a0 (NVIDIA build), CUDA 12.9, Python 3.12,
#                                     Transformer Engine and apex preinstalled; the base of
#                                     NeMo-RL's docker/Dockerfile.ngc_pytorch.
#   vLLM 0.11.0                       its requirements pin torch==2.8.0, the series of this
#                                     base. PyPI wheels would replace the NGC torch build, so
#                                     it is compiled against the installed torch with
#                                     use_existing_torch.py: vLLM's documented route for "an
#                                     existing PyTorch installation", and what NeMo-RL's NGC
#                                     image does.
#   megatron-core 0.16.1              the version CI runs (setup.py supports 0.16 - 0.19); its
#                                     install guide asks for PyTorch >= 2.6 and recommends NGC
#                                     PyTorch containers; adds only numpy and packaging.
#
# Build:  docker build -t gdpo-megatron:gpu .     (vLLM compiles for ~30-60 min)
#         docker build --build-arg TORCH_CUDA_ARCH_LIST="8.0 9.0 10.0" ...  for A100/H100/B200
# Run:    docker run --gpus all --ipc=host --ulimit memlock=-1 -v $PWD/runs:/workspace/runs gdpo-megatron:gpu
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.06-py3
FROM ${BASE_IMAGE}

ARG VLLM_VERSION=0.11.0
ARG MEGATRON_CORE_VERSION=0.16.1
ARG TORCH_CUDA_ARCH_LIST="9.0"
ARG MAX_JOBS=16

ENV PYTHONUNBUFFERED=1 \
    WANDB_MODE=offline \
    PIP_NO_CACHE_DIR=1 \
    # NeMo-RL sets this on the 25.06 base: vLLM's standalone compile does not work with its torch.
    VLLM_USE_STANDALONE_COMPILE=0

# The base's own constraints pin every package it ships (transformers, numpy, ...); keep only
# the torch stack pinned, so pip may add or update other packages but never replace these.
RUN mkdir -p /opt/gdpo \
 && PIP_CONSTRAINT= python -m pip list --format=freeze \
    | grep -iE '^(torch|torchvision|torchaudio|triton|pytorch-triton|transformer[-_]engine[-_a-z0-9]*|apex|flash[-_]attn|nvidia-[-_a-z0-9]+)==' \
    > /opt/gdpo/torch-stack-constraints.txt \
 && grep -q '^torch==' /opt/gdpo/torch-stack-constraints.txt \
 && python -c "import torch; print(torch.__version__)" > /opt/gdpo/base-torch-version \
 && cat /opt/gdpo/torch-stack-constraints.txt
ENV PIP_CONSTRAINT=/opt/gdpo/torch-stack-constraints.txt

# vLLM from source against the installed torch. use_existing_torch.py strips the torch pins
# from its requirements; xformers goes too (its wheels pin an upstream torch, and vLLM's own
# flash-attention kernels are compiled into the build). The wheel is built without
# dependencies, its runtime requirements added after.
RUN git clone --depth 1 --branch "v${VLLM_VERSION}" https://github.com/vllm-project/vllm.git /tmp/vllm \
 && cd /tmp/vllm \
 && python use_existing_torch.py \
 && sed -i '/^xformers/d' requirements/cuda.txt \
 && python -m pip install -r requirements/build.txt \
 && MAX_JOBS=${MAX_JOBS} TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    python -m pip install --no-build-isolation --no-deps . \
 && python -m pip install -r requirements/cuda.txt \
 && cd / && rm -rf /tmp/vllm

RUN python -m pip install "megatron-core==${MEGATRON_CORE_VERSION}"

# This package last, so code changes rebuild only these layers. Its `gpu` extra names
# Transformer Engine and vLLM, both already satisfied above.
WORKDIR /workspace/gdpo-megatron
COPY . .
# The check imports only torch and this package (the build has no GPU for Transformer Engine
# or vLLM to initialize); the other versions come from the installed metadata.
RUN python -m pip install -e ".[gpu,test,wandb]" \
 && test "$(python -c 'import torch; print(torch.__version__)')" = "$(cat /opt/gdpo/base-torch-version)" \
 && python -c "import gdpo_megatron, importlib.metadata as m; \
print({p: m.version(p) for p in ('torch', 'vllm', 'megatron-core', 'transformer-engine', 'gdpo-megatron')})"

WORKDIR /workspace
