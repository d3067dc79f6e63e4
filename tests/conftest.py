"""Shared fixtures: CPU-friendly threading, the `gpu` skip, and local gloo worlds."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest
import torch

from support.local_world import LocalWorld

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def gloo_world_2():
    """Two gloo processes shared by every test of a module."""
    with LocalWorld(2) as world:
        yield world


@pytest.fixture(scope="module")
def gloo_world_4():
    """Four gloo processes shared by every test of a module."""
    with LocalWorld(4) as world:
        yield world


@pytest.fixture(scope="session")
def demo_base_model(tmp_path_factory):
    """The demo's base model (a tiny Llama warmed up on the tool-calling task), built once."""
    from gdpo_megatron.demo.warmup import make_base_model

    # Long enough a warm-up that completions differ in their rewards (else every advantage is 0).
    return str(make_base_model(tmp_path_factory.mktemp("base") / "model", steps=60))


@pytest.fixture(scope="session")
def tiny_llamas(tmp_path_factory):
    """Two tiny random Llama checkpoints (seeds 0 and 1) with a local tokenizer: paths and models."""
    from support.tiny_model import TinyLlamaSpec, save_tiny_llama

    root = tmp_path_factory.mktemp("tiny_llama")
    paths = {name: str(root / name) for name in ("base", "other")}
    return {
        "paths": paths,
        "base": save_tiny_llama(paths["base"], TinyLlamaSpec(seed=0)),
        "other": save_tiny_llama(paths["other"], TinyLlamaSpec(seed=1)),
    }
