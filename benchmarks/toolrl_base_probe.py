"""Can a ToolRL base model tell GDPO from GRPO? Its calls' names and its groups' spread.

    python benchmarks/toolrl_base_probe.py [runs/toolrl_base] [--samples 8] [--limit N]

GDPO and GRPO differ only where a reward varies inside a prompt's group (a reward that is
constant in every group leaves GDPO a rescaled GRPO: tests/test_advantages.py). Before the
registered comparison (``toolrl_cpu_comparison.py``) is worth its hours, its base model has
to get ToolRL's correctness reward above the minimum on some samples, which takes a call to a
reference tool by its exact name. This probe samples the base model as the comparison's
training does (``--samples`` completions at temperature 1, 256 new tokens) on the RL prompts
written with it (``rl_prompts.json``), and greedily on the 80 held-out test prompts, and
reports for each set: ToolRL's format and correctness means, the share of completions that
call a tool of the reference by name (among prompts whose reference calls one), and the
number of prompts whose correctness varies inside their group. Both sets are read as training
reads them (``load_samples``): prompts whose reference ToolRL's rules cannot read are left
out, with a warning that counts them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
from pathlib import Path

from gdpo_megatron.data.samples import Sample, load_samples
from gdpo_megatron.demo.toolrl_cpu import TEST_DATA
from gdpo_megatron.rewards.toolrl import parse_reference, toolrl_correctness, toolrl_format

CALLED_NAME = re.compile(r'"name": "([^"]*)"')


def called_names(completion: str) -> set[str]:
    """The names a completion's calls give (after its think block), read leniently: a
    ``"name": "..."`` pair anywhere, so a call in broken JSON still counts."""
    return set(CALLED_NAME.findall(completion.split("</think>")[-1]))


def group_counts(groups: list[tuple[dict, list[str]]]) -> dict[str, float]:
    """The probe's numbers for ``groups``, each (a sample's reward truth, completions of its
    prompt); every reference must be one ToolRL's rules can read."""
    formats, scores, named, calling, spread = [], [], 0, 0, 0
    for truth, completions in groups:
        reference = parse_reference(truth["answer"])
        formats += [toolrl_format(c, 0, truth) for c in completions]
        group = [toolrl_correctness(c, 0, truth) for c in completions]
        scores += group
        spread += max(group) > min(group)
        if reference:
            wanted = {call["name"] for call in reference}
            calling += len(completions)
            named += sum(bool(called_names(c) & wanted) for c in completions)
    return {"prompts": len(groups), "format": statistics.fmean(formats), "correctness": statistics.fmean(scores),
            "named_a_reference_tool": named / calling if calling else float("nan"),
            "completions_of_calling_prompts": calling, "prompts_with_correctness_spread": spread}


def sample(model: Path, prompt_sets: dict[str, tuple[list[Sample], int, float]]) -> dict[str, list[tuple[dict, list[str]]]]:
    """For each named set of samples: (reward truth, completions) per sample, ``n``
    completions at ``temperature``, 256 new tokens."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from gdpo_megatron.rollout.vllm_engine import CPU_BLOCK_SIZE

    llm = LLM(model=str(model), dtype="float32", max_model_len=4096, kv_cache_memory_bytes=1 << 30,
              enforce_eager=True, block_size=CPU_BLOCK_SIZE, seed=0)
    tokenizer = llm.get_tokenizer()
    groups = {}
    for label, (samples, n, temperature) in prompt_sets.items():
        prompts = [tokenizer.apply_chat_template(s.messages, add_generation_prompt=True, tokenize=False)
                   for s in samples]
        outputs = llm.generate(prompts, SamplingParams(n=n, temperature=temperature, max_tokens=256), use_tqdm=False)
        groups[label] = [(s.reward_truth(), [o.text for o in out.outputs]) for s, out in zip(samples, outputs)]
    return groups


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="runs/toolrl_base", help="a base model directory "
                        "(make runs/toolrl_base) with its rl_prompts.json")
    parser.add_argument("--samples", type=int, default=8, help="completions of each RL prompt (the group size)")
    parser.add_argument("--limit", type=int, default=None, help="probe only this many prompts of each set")
    parser.add_argument("--out", default=None, help="also write the numbers here as JSON")
    args = parser.parse_args(argv)
    model = Path(args.model)
    if not (model / "rl_prompts.json").is_file():
        parser.error(f"{model}: no rl_prompts.json; `make runs/toolrl_base` writes a base model with it")
    rl_samples = load_samples(model / "rl_prompts.json", "toolrl")[: args.limit]
    test_samples = load_samples(TEST_DATA, "toolrl")[: args.limit]
    groups = sample(model, {f"RL prompts, {args.samples} samples at temperature 1": (rl_samples, args.samples, 1.0),
                            "held-out test prompts, greedy": (test_samples, 1, 0.0)})
    numbers = {label: group_counts(g) for label, g in groups.items()}
    print(f"{'prompts':<46} {'scored':>6} {'format':>7} {'correct':>8} {'named':>7} {'spread':>7}")
    for label, n in numbers.items():
        print(f"{label:<46} {n['prompts']:>6} {n['format']:>7.3f} {n['correctness']:>8.3f} "
              f"{n['named_a_reference_tool']:>7.3f} {n['prompts_with_correctness_spread']:>7}")
    print("named: share of completions calling a reference tool by name (prompts whose reference calls one); "
          "spread: prompts whose correctness varies inside the group")
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(model), "samples": args.samples, **numbers}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
