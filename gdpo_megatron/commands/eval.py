"""``gdpo-eval``: greedy completions of a Hugging Face checkpoint, scored.

``gdpo-eval --model runs/x/hf --bfcl`` reports BFCL accuracy per category (exact calls,
BFCL's string normalization); ``--data FILE --family F --rewards a,b`` reports each reward's
mean on any prompt file or dataset directory (ToolRL's test split: ``--data
rlla_4k/test.parquet --family toolrl --rewards toolrl_format,toolrl_correctness``). ``--data``
and its options are the config's ``data`` section (``--prompt-key`` is ``data.prompt_key``),
built and checked by the config loader as a training config's is. Every input is checked
before the engine starts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gdpo_megatron.commands.console import ArgumentParser, console_entry, positive_int, quiet_defaults
from gdpo_megatron.config import ConfigError, DataConfig, from_dict
from gdpo_megatron.errors import UsageError
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.tasks import get_task, task_names

# The options that go with --data, each a key of the data section, and their help.
DATA_OPTIONS = {
    "--family": ("family", f"with --data: the task family ({', '.join(task_names())})"),
    "--system-prompt": ("system_prompt", "with --data: instructions ('' for none)"),
    "--split": ("split", "with --data: the split of a datasets directory (default: train of a DatasetDict, all "
                         "of a single dataset)"),
    "--prompt-key": ("prompt_key", "with --data: the prompt field"),
    "--system-key": ("system_key", "with --data: the system field"),
    "--ground-truth-key": ("ground_truth_key", "with --data: the ground truth field"),
}


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(prog="gdpo-eval", description="Evaluate a Hugging Face checkpoint.")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bfcl", action="store_true", help="the BFCL single-turn categories")
    source.add_argument("--data", help="a prompt file (.jsonl, .json, .parquet) or datasets directory "
                                       "(see gdpo_megatron.data.samples)")
    for flag, (_, help_text) in DATA_OPTIONS.items():
        parser.add_argument(flag, default=None, help=help_text)
    parser.add_argument("--rewards", default=None,
                        help="comma-separated reward names to report (with --data, default: the family's rewards)")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="at most this many prompts (per BFCL category)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="context of the engine (default: the model's max_position_embeddings)")
    parser.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    parser.add_argument("--allow-weaker-sandbox", action="store_true",
                        help="run rewards that execute model-written code (code_pass, code_no_bug) at the sandbox's "
                             "weaker 'basic' level where bubblewrap cannot run (see docs/rewards.md)")
    args = parser.parse_args(argv)
    if args.data is not None and args.family is None:
        parser.error("--data needs --family")
    given = [flag for flag, (key, _) in DATA_OPTIONS.items() if getattr(args, key) is not None]
    if args.bfcl and given:
        parser.error(f"{given[0]} goes with --data, not --bfcl")
    return args


def data_section(args: argparse.Namespace) -> DataConfig:
    """``--data`` and its options as the config's ``data`` section, converted and checked by the
    config loader and the task registry as gdpo-train's are (a ConfigError names the ``data.*`` key)."""
    values = {"train_path": args.data, **{key: getattr(args, key) for key, _ in DATA_OPTIONS.values()}}
    data = from_dict(DataConfig, {key: value for key, value in values.items() if value is not None}, "data")
    if get_task(data.family, "data.family").multi_turn:
        raise ConfigError(f"--family: {data.family} is multi-turn; gdpo-eval scores single completions, not "
                          "trajectories through an environment")
    return data


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)

    from gdpo_megatron.preflight.validation import (about, check_code_sandbox, check_output_file, check_reward_specs,
                                                    check_weights, data_prompts, prompt_lengths, read_model_config)
    from gdpo_megatron.rollout.factory import DEFAULT_ENGINE, engine_class

    quiet_defaults()
    # Every check before the engine starts.
    data = None if args.bfcl else data_section(args)
    hf_config = read_model_config(args.model, "--model")
    with about("--model"):
        engine_class(DEFAULT_ENGINE).check_model(hf_config)
    max_model_len = _max_model_len(hf_config, args.max_model_len, args.max_new_tokens)
    check_weights(args.model, "--model")
    if args.rewards is not None:
        names = args.rewards.split(",")
    else:
        names = get_task(data.family).rewards if data is not None else ()
    rewards = [RewardSpec(name) for name in names if name]
    check_reward_specs(rewards, "--rewards", in_config=False)
    check_code_sandbox(rewards, "--rewards", args.allow_weaker_sandbox, "pass --allow-weaker-sandbox")
    if args.out:
        check_output_file(args.out, "--out")
    if data is None:
        from gdpo_megatron.data.bfcl import load_bfcl

        samples = load_bfcl(limit=args.limit)
    else:
        samples = data_prompts(data, "--data")[: args.limit]
    tell_what_does_not_fit(samples, prompt_lengths(samples, args.model, "--model"), max_model_len, args.max_new_tokens)

    from gdpo_megatron.device import this_machine
    from gdpo_megatron.evaluate import evaluate

    metrics, _ = evaluate(args.model, samples, rewards, machine=this_machine(), bfcl=args.bfcl,
                          max_new_tokens=args.max_new_tokens, max_model_len=max_model_len,
                          allow_weaker_sandbox=args.allow_weaker_sandbox)
    text = json.dumps(metrics, indent=2, sort_keys=True)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


def tell_what_does_not_fit(samples: list, lengths: list[int], max_model_len: int, max_new_tokens: int) -> None:
    """A line saying which prompts leave no room for ``max_new_tokens`` in the context and are
    left out of the scores (BFCL categories left with none named); an error if none is left."""
    from gdpo_megatron.evaluate import fits

    kept = [s for s, n in zip(samples, lengths) if fits(n, max_new_tokens, max_model_len)]
    if not kept:
        raise UsageError(f"--max-model-len: none of the {len(samples)} prompts fits in {max_model_len} tokens with "
                         f"--max-new-tokens={max_new_tokens} (the shortest has {min(lengths)}); nothing to evaluate")
    if len(kept) < len(samples):
        categories = {s.metadata.get("category") for s in samples} - {None}
        left = sorted(categories - {s.metadata.get("category") for s in kept})
        empty = f"; no prompt of {', '.join(left)} fits, so they are not scored" if left else ""
        print(f"gdpo-eval: {len(samples) - len(kept)} of {len(samples)} prompts are longer than --max-model-len "
              f"{max_model_len} minus --max-new-tokens {max_new_tokens} and are left out; the scores cover the "
              f"other {len(kept)}{empty}", file=sys.stderr)


def _max_model_len(hf_config: dict, requested: int | None, max_new_tokens: int) -> int:
    """The engine's context: ``requested``, else the model's positions; room for the answer either way."""
    positions = hf_config.get("max_position_embeddings")
    if requested is None and positions is None:
        raise UsageError("--max-model-len: the model's config.json has no max_position_embeddings; give it")
    if requested is not None and positions is not None and requested > positions:
        raise UsageError(f"--max-model-len: expected <= {positions}, the model's max_position_embeddings, "
                         f"got {requested}")
    length = requested or positions
    if length <= max_new_tokens:
        raise UsageError(f"--max-model-len: {length} leaves no room for a prompt before --max-new-tokens="
                         f"{max_new_tokens}; lower --max-new-tokens")
    return length
