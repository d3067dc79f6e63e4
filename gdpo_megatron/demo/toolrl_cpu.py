"""`make toolrl-cpu`: GDPO on ToolRL's tool-calling task on a CPU, scored before and after.

1. Scores the base model (``make runs/toolrl_base``, :mod:`gdpo_megatron.demo.toolrl_base`)
   on ToolRL's 80 held-out test prompts with ``gdpo-eval`` (``EVAL_ARGS``: greedy, the
   training's 256 new tokens, ToolRL's two rewards).
2. Trains it: ``gdpo-train --config configs/toolrl_cpu.yaml`` with the extra ``key=value``
   arguments.
3. Scores the training's export the same way and prints the two side by side; both score
   files are kept in ``<run_dir>_eval/``.

Each stage is its own process (the engines of one do not stay in memory for the next).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gdpo_megatron.commands.console import ArgumentParser, console_entry

CONFIG = "configs/toolrl_cpu.yaml"
TEST_DATA = "examples/data/toolrl/rlla_4k_test.parquet"
REWARDS = ("toolrl_format", "toolrl_correctness")
EVAL_ARGS = ("--data", TEST_DATA, "--family", "toolrl", "--rewards", ",".join(REWARDS), "--max-new-tokens", "256",
             "--temperature", "0", "--max-model-len", "4096", "--kv-cache-gib", "0.5")


def score(model: str | Path, out: Path, extra: tuple[str, ...] = ()) -> dict[str, float]:
    """``gdpo-eval`` of ``model`` on the held-out prompts; its metrics, also written to ``out``."""
    command = [sys.executable, "-m", "gdpo_megatron", "eval", "--model", str(model), *EVAL_ARGS, *extra,
               "--out", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def side_by_side(before: dict[str, float], after: dict[str, float]) -> str:
    """A table of each reward's held-out mean before and after training."""
    lines = [f"held-out ToolRL test prompts: {before['eval/prompts']:.0f} scored (greedy, 256 new tokens)",
             f"{'reward':<20} {'before':>8} {'after':>8} {'change':>8}"]
    for name in REWARDS:
        b, a = before[f"eval/{name}/mean"], after[f"eval/{name}/mean"]
        lines.append(f"{name:<20} {b:>8.3f} {a:>8.3f} {a - b:>+8.3f}")
    return "\n".join(lines)


@console_entry
def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="python -m gdpo_megatron.demo.toolrl_cpu", description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help=f"dotted overrides of {CONFIG}")
    args = parser.parse_args(argv)

    from gdpo_megatron.config import TrainConfig, load_config
    from gdpo_megatron.errors import InputError
    from gdpo_megatron.preflight.validation import check_output_dir, check_settings

    config = load_config(TrainConfig, CONFIG, args.overrides)
    if not Path(config.base_model, "config.json").is_file():
        raise InputError(f"{CONFIG}: no base model in {config.base_model}; `make runs/toolrl_base` writes it")
    check_settings(config)
    check_output_dir(config.run_dir, "run_dir")
    scores = Path(f"{config.run_dir}_eval")
    scores.mkdir(parents=True, exist_ok=True)
    print(f"scoring the base model {config.base_model} on {TEST_DATA}", flush=True)
    before = score(config.base_model, scores / "before.json")
    print(f"training: gdpo-train --config {CONFIG} {' '.join(args.overrides)}", flush=True)
    subprocess.run([sys.executable, "-m", "gdpo_megatron", "train", "--config", CONFIG, *args.overrides],
                   check=True, env={**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")})
    print(f"scoring the trained model {config.run_dir}/hf", flush=True)
    after = score(Path(config.run_dir, "hf"), scores / "after.json")
    print(side_by_side(before, after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
