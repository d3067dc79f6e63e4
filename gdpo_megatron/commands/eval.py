"""``gdpo-eval``: completions of a Hugging Face checkpoint, scored.

``gdpo-eval --model runs/x/hf --bfcl`` reports BFCL accuracy per category (exact calls,
BFCL's string normalization); ``--data FILE --family F --rewards a,b`` reports each reward's
mean on any prompt file or dataset directory (ToolRL's test split: ``--data
rlla_4k/test.parquet --family toolrl --rewards toolrl_format,toolrl_correctness``). ``--data``
and its options are the config's ``data`` section (``--prompt-key`` is ``data.prompt_key``),
built and checked by the config loader as a training config's is.

``gdpo-eval --model runs/x/hf --bfcl-multi-turn [CATEGORY ...]`` rolls out each of BFCL's
multi-turn questions (held-out split by default; ``--split train`` or ``all``; ``--limit`` per
category) as one trajectory through BFCL's environments, as training does, and reports per
category the questions, BFCL's accuracy (every turn passing its checker) and the multi-turn
rewards' means (:mod:`gdpo_megatron.evaluate_multi_turn`); ``--verdicts FILE`` writes each
question's verdict, failing check and turn, and trajectory as JSON Lines. ``--data`` of a
multi-turn family is evaluated the same way, through the environment ``--environment`` (and
``--environment-file`` for a user's own) names, else the training's, else the family's.

A model gdpo-train exported carries how it was trained (``gdpo_training.json``,
:mod:`gdpo_megatron.checkpoint.trained_with`): every prompt and sampling setting the command
line leaves out is the training's (its family, system prompt, fields and environment for its
own family; ``max_new_tokens``, temperature, top-p/top-k and stop strings), so the scores are
comparable to the rewards training reported. Other models get the defaults: the family's
instructions, 256 new tokens, greedy. One line on stderr says which settings were used and
where each came from. Every input is checked before the engine starts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from gdpo_megatron.checkpoint.trained_with import TRAINING_FILE, TrainedWith, read_trained_with
from gdpo_megatron.commands.console import (ArgumentParser, console_entry, positive_float, positive_int,
                                            quiet_defaults)
from gdpo_megatron.config import DataConfig, from_dict
from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.config.rollout import TEMPERATURE_RANGE
from gdpo_megatron.data.bfcl_multi_turn import CATEGORIES as MULTI_TURN_CATEGORIES
from gdpo_megatron.errors import InputError, UsageError
from gdpo_megatron.tasks import get_task, task_names

# The options that go with --data, each a key of the data section, and their help.
DATA_OPTIONS = {
    "--family": ("family", f"with --data: the task family ({', '.join(task_names())}; default: the training's)"),
    "--system-prompt": ("system_prompt", "with --data: instructions ('' for none; default: the training's, else "
                                         "the family's)"),
    "--split": ("split", "with --data: the split of a datasets directory (default: train of a DatasetDict, all "
                         "of a single dataset); with --bfcl-multi-turn: heldout (default), train or all"),
    "--prompt-key": ("prompt_key", "with --data: the prompt field (default: the training's, else the usual ones)"),
    "--system-key": ("system_key", "with --data: the system field (default: the training's)"),
    "--ground-truth-key": ("ground_truth_key", "with --data: the ground truth field (default: the training's, else "
                                               "the family's)"),
}
MULTI_TURN_SPLITS = ("heldout", "train", "all")  # --split of --bfcl-multi-turn
# Without a training record: the new tokens of a completion, and greedy decoding.
DEFAULT_MAX_NEW_TOKENS = 256
GREEDY = 0.0
# Where a setting came from, as the settings line says it.
GIVEN, TRAINED, DEFAULT = "given", "trained", "default"
NOT_RECORDED = object()  # a setting the model's training record does not hold


def temperature(text: str) -> float:
    """argparse type: 0 (greedy) or a sampling temperature vLLM and the trainer accept."""
    value = float(text)
    low, high = TEMPERATURE_RANGE
    if value != GREEDY and not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected 0 (greedy) or a number in [{low}, {high:g}], got {text}")
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked (a UsageError names what is wrong)."""
    parser = ArgumentParser(prog="gdpo-eval", description="Evaluate a Hugging Face checkpoint.")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--bfcl", action="store_true", help="the BFCL single-turn categories")
    source.add_argument("--bfcl-multi-turn", nargs="*", choices=MULTI_TURN_CATEGORIES, metavar="CATEGORY",
                        help=f"BFCL's multi-turn questions of these categories ({', '.join(MULTI_TURN_CATEGORIES)}; "
                             "default: all), one trajectory each through BFCL's environments")
    source.add_argument("--data", help="a prompt file (.jsonl, .json, .parquet) or datasets directory "
                                       "(see gdpo_megatron.data.samples)")
    for flag, (_, help_text) in DATA_OPTIONS.items():
        parser.add_argument(flag, default=None, help=help_text)
    parser.add_argument("--rewards", default=None,
                        help="comma-separated reward names to report (with --data, default: the family's rewards)")
    parser.add_argument("--environment", default=None,
                        help="with --data of a multi-turn family: the environment (a built-in name, or the class "
                             "--environment-file defines; default: the training's, else the family's)")
    parser.add_argument("--environment-file", default=None, help="with --environment: the Python file defining it")
    parser.add_argument("--max-steps-per-turn", type=positive_int, default=None,
                        help="multi-turn: the model's messages per user turn (default: "
                             f"{EnvironmentConfig.max_steps_per_turn}, as environment.max_steps_per_turn)")
    parser.add_argument("--verdicts", default=None,
                        help="multi-turn: also write each question's verdict and trajectory to this JSON Lines file")
    parser.add_argument("--limit", type=positive_int, default=None,
                        help="at most this many prompts (per BFCL category)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=None,
                        help=f"tokens per completion (default: the training's, else {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--temperature", type=temperature, default=None,
                        help="0 for greedy decoding (default: the training's, with its top-p/top-k, else 0)")
    parser.add_argument("--seed", type=int, default=0, help="seeds each sampled completion (default 0)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="context of the engine (default: the model's max_position_embeddings)")
    parser.add_argument("--kv-cache-gib", type=positive_float, default=None,
                        help="the engine's KV cache, as rollout.kv_cache_gib (default on the CPU: what every prompt "
                             "needs at once, the longest prompt plus --max-new-tokens each; on GPU vLLM's sizing)")
    parser.add_argument("--out", default=None, help="also write the metrics to this JSON file")
    parser.add_argument("--allow-weaker-sandbox", action="store_true",
                        help="run rewards that execute model-written code (code_pass, code_no_bug) at the sandbox's "
                             "weaker 'basic' level where bubblewrap cannot run (see docs/rewards.md)")
    args = parser.parse_args(argv)
    given = [flag for flag, (key, _) in DATA_OPTIONS.items() if getattr(args, key) is not None]
    if args.bfcl and given:
        parser.error(f"{given[0]} goes with --data, not --bfcl")
    if args.bfcl_multi_turn is not None:
        args.bfcl_multi_turn = list(dict.fromkeys(args.bfcl_multi_turn))  # each category once
        others = [flag for flag in given if flag != "--split"]
        if others:
            parser.error(f"{others[0]} goes with --data, not --bfcl-multi-turn")
        if args.split is not None and args.split not in MULTI_TURN_SPLITS:
            parser.error(f"--split: with --bfcl-multi-turn, expected one of {', '.join(MULTI_TURN_SPLITS)}, "
                         f"got {args.split!r}")
    if args.data is None and (args.environment or args.environment_file):
        parser.error("--environment goes with --data of a multi-turn family")
    if args.environment_file and not args.environment:
        parser.error("--environment-file needs --environment, the name of the class it defines")
    if args.bfcl and (args.max_steps_per_turn or args.verdicts):
        parser.error(f"{'--max-steps-per-turn' if args.max_steps_per_turn else '--verdicts'} goes with a multi-turn "
                     "evaluation, not --bfcl")
    return args


@dataclasses.dataclass
class Settings:
    """How the evaluation prompts and samples, and where each setting came from (:data:`GIVEN`,
    :data:`TRAINED` or :data:`DEFAULT`)."""

    data: DataConfig | None  # None: BFCL's prompts (``bfcl``)
    family: str | None  # the task family of the prompts (None: BFCL's single-turn categories)
    bfcl: str | None  # which of BFCL's prompts, as the settings line says it
    environment: tuple[str, EnvironmentConfig] | None  # a multi-turn family's: its reference and section
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: list[str]
    seed: int
    origins: dict[str, str]  # setting -> where it came from

    def describe(self, model: str, trained: TrainedWith | None) -> str:
        """The line that says what the evaluation uses: each setting, and where it came from."""
        def shown(name: str, value) -> str:
            return f"{value} ({self.origins[name]})"

        if self.data is None:
            prompts = self.bfcl
        else:
            system = self.data.system_prompt
            system = {None: "the family's", "": "none"}.get(system) or repr(_shorten(system))
            prompts = f"family {shown('family', self.data.family)}, system prompt {shown('system_prompt', system)}"
            prompts += "".join(f", {key} {shown(key, getattr(self.data, key))}" for key in FIELD_KEYS
                               if getattr(self.data, key) is not None)
        if self.environment is not None:
            reference, section = self.environment
            prompts += (f", environment {shown('environment', reference)}, max_steps_per_turn "
                        f"{shown('max_steps_per_turn', section.max_steps_per_turn)}")
        if self.temperature == GREEDY:
            sampling = shown("temperature", "greedy")
        else:
            sampling = f"temperature {shown('temperature', f'{self.temperature:g}')}, seed {self.seed}"
            if self.top_p < 1 or self.top_k > 0:
                sampling += f", top_p {self.top_p:g}, top_k {self.top_k} ({TRAINED})"
        if self.stop:
            sampling += f", stop {self.stop!r} ({TRAINED})"
        source = (f"{TRAINED}: {Path(model) / TRAINING_FILE}" if trained is not None
                  else f"{model} has no {TRAINING_FILE}")
        limits = f"max_new_tokens {shown('max_new_tokens', self.max_new_tokens)}, {sampling}"
        return f"gdpo-eval: {prompts}; {limits}; {source}"


# The data keys that name fields of the rows.
FIELD_KEYS = ("prompt_key", "system_key", "ground_truth_key")


def settings(args: argparse.Namespace, trained: TrainedWith | None) -> Settings:
    """The command line's settings, those it leaves out taken from ``trained`` (the model's
    training record; its data settings only for its own family), else the defaults."""
    origins: dict[str, str] = {}
    rollout = trained.rollout if trained is not None else None
    data = None if args.data is None else data_section(args, trained, origins)
    family = "bfcl_multi_turn" if args.bfcl_multi_turn is not None else data.family if data is not None else None
    if args.bfcl_multi_turn is not None:
        bfcl = (f"BFCL's multi-turn questions ({args.split or 'heldout'} split of "
                f"{', '.join(args.bfcl_multi_turn or MULTI_TURN_CATEGORIES)})")
    else:
        bfcl = "BFCL's prompts" if args.bfcl else None
    return Settings(
        data=data,
        family=family,
        bfcl=bfcl,
        environment=environment_section(args, family, trained, origins) if family is not None else None,
        max_new_tokens=_pick(origins, "max_new_tokens", args.max_new_tokens,
                             rollout.max_new_tokens if rollout else NOT_RECORDED, DEFAULT_MAX_NEW_TOKENS),
        temperature=_pick(origins, "temperature", args.temperature,
                          rollout.temperature if rollout else NOT_RECORDED, GREEDY),
        top_p=rollout.top_p if rollout else 1.0,
        top_k=rollout.top_k if rollout else -1,
        stop=list(rollout.stop) if rollout else [],
        seed=args.seed,
        origins=origins)


def data_section(args: argparse.Namespace, trained: TrainedWith | None, origins: dict[str, str]) -> DataConfig:
    """``--data`` and its options as the config's ``data`` section, converted and checked by the
    config loader and the task registry as gdpo-train's are (a ConfigError names the ``data.*``
    key). Each option left out is the training's where the family is the one it trained on;
    ``origins`` gets where each came from."""
    prompts = trained.data if trained is not None else None
    family = _pick(origins, "family", args.family, prompts.family if prompts else NOT_RECORDED, None)
    if family is None:
        raise UsageError(f"gdpo-eval: --data needs --family ({args.model} has no {TRAINING_FILE} to take it from)")
    same_task = prompts is not None and prompts.family == family
    values = {"train_path": args.data, "family": family}
    for key, _ in DATA_OPTIONS.values():
        if key != "family":  # a null the training recorded (e.g. the family's instructions) counts as trained
            recorded = getattr(prompts, key, NOT_RECORDED) if same_task else NOT_RECORDED
            values[key] = _pick(origins, key, getattr(args, key), recorded, None)
    data = from_dict(DataConfig, {key: value for key, value in values.items() if value is not None}, "data")
    get_task(data.family, "data.family")
    return data


def environment_section(args: argparse.Namespace, family: str, trained: TrainedWith | None,
                        origins: dict[str, str]) -> tuple[str, EnvironmentConfig] | None:
    """The environment the questions of a multi-turn ``family`` step through (its reference:
    ``--environment``, else the training's where it trained ``family``, else the family's) and
    the ``environment`` section, built and checked by the config loader (a ConfigError names the
    ``environment.*`` key); ``origins`` gets where each came from. None for a single-turn
    family, which takes none of the environment options."""
    from gdpo_megatron.environments.registry import configured_reference

    task = get_task(family)
    if not task.multi_turn:
        for flag in ("--environment", "--max-steps-per-turn", "--verdicts"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise UsageError(f"{flag}: --family {family} is single-turn (one completion per prompt); it goes "
                                 "with a multi-turn family")
        return None
    recorded = trained.environment if trained is not None and trained.data.family == family else None
    if args.environment is None and recorded is not None and recorded.name is not None:
        name, file, origins["environment"] = recorded.name, recorded.file, TRAINED
    else:
        name, file, origins["environment"] = args.environment, args.environment_file, (
            GIVEN if args.environment is not None else DEFAULT)
    values = {"name": name, "file": file, "step_timeout_s": recorded.step_timeout_s if recorded else None,
              "max_steps_per_turn": _pick(origins, "max_steps_per_turn", args.max_steps_per_turn,
                                          recorded.max_steps_per_turn if recorded else NOT_RECORDED, None)}
    section = from_dict(EnvironmentConfig, {k: v for k, v in values.items() if v is not None}, "environment")
    reference = configured_reference(section, task.environment)
    if reference is None:
        raise UsageError(f"--environment: --family {family} rolls out trajectories through an environment; name it "
                         "(and --environment-file for your own)")
    return reference, section


def _pick(origins: dict[str, str], name: str, given, trained, default):
    """``given`` unless None, else ``trained`` unless :data:`NOT_RECORDED`, else ``default``;
    ``origins[name]`` says which."""
    if given is not None:
        origins[name] = GIVEN
        return given
    if trained is not NOT_RECORDED:
        origins[name] = TRAINED
        return trained
    origins[name] = DEFAULT
    return default


def _shorten(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@console_entry
def main(argv: list[str]) -> int:
    args = parse(argv)

    from gdpo_megatron.preflight.validation import (about, check_code_sandbox, check_environment, check_output_file,
                                                    check_reward_specs, check_weights, data_prompts, model_shape,
                                                    prompt_lengths, read_model_config)
    from gdpo_megatron.device import this_machine
    from gdpo_megatron.rollout.factory import DEFAULT_ENGINE, engine_class

    quiet_defaults()
    # Every check before the engine starts.
    hf_config = read_model_config(args.model, "--model")
    trained = read_trained_with(args.model)
    chosen = settings(args, trained)
    data, family, environment = chosen.data, chosen.family, chosen.environment
    model = model_shape(hf_config, "--model")
    with about("--model"):
        engine_class(DEFAULT_ENGINE).check_model(hf_config)
    max_model_len = _max_model_len(hf_config, args.max_model_len, chosen.max_new_tokens)
    machine = this_machine()
    if args.kv_cache_gib is not None:
        _check_kv_cache(args.kv_cache_gib, model, machine, max_model_len, chosen.max_new_tokens)
    check_weights(args.model, "--model")
    if args.rewards is not None:
        names = args.rewards.split(",")
    else:
        names = get_task(family).rewards if family is not None else ()
    rewards = [RewardSpec(name) for name in names if name]
    check_reward_specs(rewards, "--rewards", in_config=False)
    check_code_sandbox(rewards, "--rewards", args.allow_weaker_sandbox, "pass --allow-weaker-sandbox")
    for path, flag in ((args.out, "--out"), (args.verdicts, "--verdicts")):
        if path:
            check_output_file(path, flag)
    if environment is not None:
        check_environment(environment[1], "environment", ("--environment", "--environment-file")
                          if chosen.origins["environment"] == GIVEN else None)
    if args.bfcl:
        from gdpo_megatron.data.bfcl import load_bfcl

        samples = load_bfcl(limit=args.limit)
    elif args.bfcl_multi_turn is not None:
        from gdpo_megatron.data.bfcl_multi_turn import load_bfcl_multi_turn

        split = {None: "heldout", "all": None}.get(args.split, args.split)
        samples = load_bfcl_multi_turn(args.bfcl_multi_turn or MULTI_TURN_CATEGORIES, split, limit=args.limit)
    else:
        samples = data_prompts(data, "--data")[: args.limit]
    if environment is not None:
        from gdpo_megatron.evaluate_multi_turn import check_reference_calls

        try:
            check_reference_calls(samples, environment[0])
        except ValueError as e:
            raise InputError(f"--data: {e}") from None
    tell_what_does_not_fit(samples, prompt_lengths(samples, args.model, "--model"), max_model_len,
                           chosen.max_new_tokens)
    print(chosen.describe(args.model, trained), file=sys.stderr)

    from gdpo_megatron.rollout.engine import SamplingConfig

    sampling = SamplingConfig(temperature=chosen.temperature, top_p=chosen.top_p, top_k=chosen.top_k,
                              max_new_tokens=chosen.max_new_tokens, stop=tuple(chosen.stop), seed=chosen.seed)
    if environment is None:
        from gdpo_megatron.evaluate import evaluate

        metrics, _ = evaluate(args.model, samples, rewards, machine=machine, model=model, sampling=sampling,
                              max_model_len=max_model_len, kv_cache_gib=args.kv_cache_gib, bfcl=args.bfcl,
                              allow_weaker_sandbox=args.allow_weaker_sandbox)
    else:
        from gdpo_megatron.evaluate_multi_turn import evaluate_trajectories

        metrics, verdicts = evaluate_trajectories(
            args.model, samples, rewards, environment=environment[0], environment_config=environment[1],
            machine=machine, model=model, sampling=sampling, max_model_len=max_model_len,
            kv_cache_gib=args.kv_cache_gib)
        if args.verdicts:
            Path(args.verdicts).parent.mkdir(parents=True, exist_ok=True)
            Path(args.verdicts).write_text("".join(json.dumps(v) + "\n" for v in verdicts))
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


def _check_kv_cache(kv_cache_gib: float, model, machine, max_model_len: int, max_new_tokens: int) -> None:
    """``--kv-cache-gib`` holds one sequence of the whole context, as the engine needs to start
    (where the engine sizes its cache from the sequences: on the CPU)."""
    from gdpo_megatron.evaluate import engine_section

    least = engine_section(model, machine, [max_model_len - max_new_tokens], max_new_tokens, max_model_len).kv_cache_gib
    if least is not None and kv_cache_gib < least:
        raise UsageError(f"--kv-cache-gib: {kv_cache_gib:g} holds less than one sequence of --max-model-len "
                         f"{max_model_len} tokens, which the engine needs ({least:.3g} GiB); give at least that or "
                         "a shorter --max-model-len")


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
