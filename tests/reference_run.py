"""A short training run through ``gdpo-train``, summarized: what a change that keeps behaviour must reproduce.

``python tests/reference_run.py --write tests/data/reference_run.json`` records the summary;
``tests/test_reference_run.py`` runs the same and compares. The summary holds every metric
of every step except timings, the checkpoints the run leaves, and per exported tensor its
sum, sum of squares and a few values.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from support.metrics_file import computed, records

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "tests" / "data" / "reference_run.yaml"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def make_base(path: Path) -> Path:
    """The reference run's base model: the tiny random Llama of seed 0, with a chat template."""
    from support.tiny_model import TinyLlamaSpec, save_tiny_llama

    save_tiny_llama(path, TinyLlamaSpec(seed=0))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def run(workdir: Path) -> dict:
    """Build the tiny model, train with the reference config, summarize what the run left."""
    base, run_dir = make_base(workdir / "base"), workdir / "run"
    command = [str(Path(sys.executable).parent / "gdpo-train"), "--config", str(CONFIG),
               f"base_model={base}", f"run_dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GDPO_MALLOC": "system"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=600)
    return summarize(run_dir)


def summarize(run_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    metrics = [computed(row) for row in records(run_dir)]
    tensors = {}
    for file in sorted((run_dir / "hf").glob("*.safetensors")):
        for name, t in sorted(load_file(file).items()):
            flat = t.double().flatten()
            picks = torch.linspace(0, flat.numel() - 1, 5).long()
            tensors[name] = {"shape": list(t.shape), "sum": flat.sum().item(), "sumsq": flat.square().sum().item(),
                             "values": flat[picks].tolist()}
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    return {"metrics": metrics, "tensors": tensors, "checkpoints": checkpoints}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", required=True, help="where to write the summary (JSON)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        summary = run(Path(tmp))
    Path(args.write).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
