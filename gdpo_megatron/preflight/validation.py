"""What can be checked about a command's inputs before a model, an engine or a reward pool exists.

Paths (readable inputs, writable or empty outputs), prompt files (encoding, every line's
schema, prompt lengths under the base model's tokenizer and chat template), reward files
(import, registration) and names, a user's environment file (import, class), the code sandbox rewards that run code get, a Hugging Face directory (``config.json``, architecture,
every safetensors file's header and tensor names), the parallel layout against the model's
shape, a step against the data (no more prompts than it holds) and, without CUDA, against the
host memory available, and what a run directory already holds. Every check raises a
:class:`~gdpo_megatron.errors.UserError` whose message starts with the config key or argument
it is about, and nothing here writes a file.

:func:`check_training` runs them all for a training run: ``gdpo-train`` calls it before the
process group and the trainer exist, and hands the trainer what it read
(:class:`~gdpo_megatron.inputs.TrainingInputs`). ``gdpo-eval``, ``gdpo-convert`` and
``gdpo-plot`` use the single checks.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence

import psutil

from gdpo_megatron.advantages import Condition, conditions_by_column
from gdpo_megatron.checkpoint.hf_config import model_config_from_hf, read_hf_config
from gdpo_megatron.checkpoint.hf_files import check_tensors, safetensors_index
from gdpo_megatron.checkpoint.layout import hf_shapes
from gdpo_megatron.checkpoint.state import (
    LAYOUT_KEYS, check_files, check_reshardable, complete_steps, model_section, read_training_state, step_dir,
)
from gdpo_megatron.config import ConfigError, DataConfig, TrainConfig, to_dict
from gdpo_megatron.data.samples import BadRows, Fields, Sample, load_samples
from gdpo_megatron.errors import InputError, UserError, together
from gdpo_megatron.device import Machine
from gdpo_megatron.inputs import TrainingInputs
from gdpo_megatron.config.policy import SHAPE_FIELDS, ModelConfig, ParallelConfig
from gdpo_megatron.config.environment import EnvironmentConfig
from gdpo_megatron.config.rewards import RewardSpec
from gdpo_megatron.environments.registry import check_family_environment, environment_class, environment_reference
from gdpo_megatron.rewards import sandbox
from gdpo_megatron.rewards.registry import (SignatureError, load_reward_file, registered_rewards, runs_code,
                                             validate_specs)
from gdpo_megatron.resolve import Resolved, check_model_split, data_parallel_size, resolve
from gdpo_megatron.rollout.factory import engine_class
from gdpo_megatron.run_dir import CHECKPOINT_DIR
from gdpo_megatron.tasks import get_task



@contextlib.contextmanager
def about(key: str) -> Iterator[None]:
    """Prefix the message of a UserError raised inside with ``key``."""
    try:
        yield
    except UserError as e:
        raise type(e)(f"{key}: {e}") from e


class Problems:
    """The user errors of independent checks, reported together: a run with several mistakes
    learns them all at once."""

    def __init__(self):
        self.errors: list[UserError] = []

    @contextlib.contextmanager
    def check(self) -> Iterator[None]:
        """Run the block; a UserError it raises is recorded and the block is left."""
        try:
            yield
        except UserError as e:
            self.errors.append(e)

    def raise_any(self) -> None:
        """Raise the errors recorded, together (one line each), if any."""
        if self.errors:
            raise together(self.errors)


# ---- paths ---------------------------------------------------------------------------------


def check_input_file(path: str | os.PathLike, key: str) -> Path:
    """An existing, readable file."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{key}: {path} {'is a directory' if path.is_dir() else 'does not exist'}"
                         " (expected a file)")
    if not os.access(path, os.R_OK):
        raise InputError(f"{key}: {path} is not readable")
    return path


def check_output_dir(path: str | os.PathLike, key: str, *, empty: bool = False) -> Path:
    """A directory that can be written: a writable one (with nothing in it if ``empty``), or one
    that can be created."""
    path = Path(path)
    if not path.exists():
        _require_creatable(path, key)
    elif not path.is_dir():
        raise InputError(f"{key}: {path} is a file, not a directory")
    elif empty and any(path.iterdir()):
        raise InputError(f"{key}: {path} exists and is not empty; give a new or empty directory")
    else:
        _require_writable(path, path, key)
    return path


def check_output_file(path: str | os.PathLike, key: str) -> Path:
    """A file that can be written (replacing a file of that name, never a directory)."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{key}: {path} is a directory (expected a file name)")
    if path.exists():
        _require_writable(path, path, key)
    else:
        _require_creatable(path, key)
    return path


def _require_creatable(path: Path, key: str) -> None:
    """The nearest existing parent of ``path`` is a writable directory."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"{key}: cannot create {path}: {parent} is a file")
    _require_writable(parent, path, key)


def _require_writable(existing: Path, target: Path, key: str) -> None:
    if not os.access(existing, os.W_OK | (os.X_OK if existing.is_dir() else 0)):
        raise InputError(f"{key}: cannot write {target}: {existing} is not writable")


# ---- prompts ---------------------------------------------------------------------------------


def load_prompts(path: str | os.PathLike, family: str, system_prompt: Optional[str], key: str, *,
                 fields: Fields = Fields(), split: Optional[str] = None) -> list[Sample]:
    """The samples of a prompt file or dataset directory; every row is decoded and checked."""
    if not Path(path).exists():
        raise InputError(f"{key}: {path} does not exist")
    try:
        return load_samples(path, family, system_prompt, fields=fields, split=split)
    except BadRows as e:  # one line per malformed row
        raise together([InputError(f"{key}: {line}") for line in e.lines()]) from e
    except ValueError as e:  # the readers' errors name the file and the line or row
        raise InputError(f"{key}: {e}") from e


def prompt_lengths(samples: Sequence[Sample], model_dir: str | os.PathLike, key: str) -> list[int]:
    """The token count of each prompt rendered by ``model_dir``'s tokenizer and chat template."""
    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    from gdpo_megatron.data.chat import encode_prompt

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise InputError(f"{key}: cannot load the tokenizer of {model_dir} ({e})") from e
    lengths = []
    for sample in samples:
        try:
            lengths.append(len(encode_prompt(tokenizer, sample.messages)))
        except TemplateError as e:  # a template that does not compile, or refuses the chat (raise_exception)
            raise InputError(f"{key}: the chat template of {model_dir} cannot render the prompt {sample.id!r} "
                             f"({type(e).__name__}: {e})") from e
        except ValueError as e:  # no chat template
            raise InputError(f"{key}: {e}") from e
    return lengths


def check_prompt_lengths(samples: Sequence[Sample], config: TrainConfig) -> list[int]:
    """Every prompt of ``data.train_path``, rendered by the base model's tokenizer and chat
    template, fits ``data.max_prompt_tokens``; returns their lengths in tokens. The error says
    which settings would fit the longest one."""
    lengths = prompt_lengths(samples, config.base_model, "base_model")
    limit = config.data.max_prompt_tokens
    too_long = [(s, n) for s, n in zip(samples, lengths) if n > limit]
    if too_long:
        sample, n = max(too_long, key=lambda item: item[1])
        raise ConfigError(
            f"data.max_prompt_tokens: {len(too_long)} prompt(s) of {config.data.train_path} are longer than {limit} "
            f"tokens, the longest {sample.id!r} with {n}; set data.max_prompt_tokens={n} and "
            f"rollout.max_model_len={n + config.rollout.max_new_tokens} (or more), or drop them")
    return lengths


# ---- rewards ---------------------------------------------------------------------------------


def load_reward_files(paths: Sequence[str], key: str) -> None:
    """Import each reward file, so that its rewards are registered; every file's error together."""
    problems = Problems()
    for i, path in enumerate(paths):
        with problems.check():
            check_input_file(path, f"{key}.{i}")
            try:
                load_reward_file(path)
            except (Exception, SystemExit) as e:  # whatever the user's module raises on import, or sys.exit()
                what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                raise InputError(f"{key}.{i}: importing {path} failed: {what}") from e
    problems.raise_any()


def check_environment(environment: EnvironmentConfig, key: str, options: tuple[str, str] | None = None) -> None:
    """The configured environment resolves: a built-in name, or a file that imports and defines
    the named Environment subclass. Errors name ``key.file`` / ``key.name``, or where the
    section came from the command line, its ``options`` (for the name, for the file)."""
    if environment.name is None:
        return
    name_key, file_key = options or (f"{key}.name", f"{key}.file")
    what = file_key if environment.file is not None else name_key
    if environment.file is not None:
        check_input_file(environment.file, what)
    try:
        environment_class(environment_reference(environment.name, environment.file))
    except (Exception, SystemExit) as e:  # whatever the user's module raises on import, or sys.exit()
        raise InputError(f"{what}: {type(e).__name__}: {e}" if str(e) else f"{what}: {type(e).__name__}") from e


def check_reward_specs(specs: Sequence[RewardSpec], key: str, *, in_config: bool = True) -> None:
    """Each reward is registered and takes its kwargs. ``in_config``: ``key`` is the config's list
    of rewards (errors name ``key.<i>.name`` / ``key.<i>.kwargs``), else a command-line argument.
    Every reward's error together."""
    known, problems = registered_rewards(), Problems()
    for i, spec in enumerate(specs):
        name_key, kwargs_key = (f"{key}.{i}.name", f"{key}.{i}.kwargs") if in_config else (key, key)
        with problems.check():
            if spec.name not in known:
                hint = "; a reward of your own needs its file in rewards.reward_files" if in_config else ""
                raise ConfigError(f"{name_key}: {spec.name!r} is not a registered reward "
                                  f"(registered: {', '.join(known)}){hint}")
            try:
                validate_specs([spec])
            except SignatureError as e:  # the function, not the kwargs
                raise ConfigError(f"{name_key}: {e}") from e
            except ValueError as e:
                raise ConfigError(f"{kwargs_key}: {e}") from e
    problems.raise_any()


def check_code_sandbox(specs: Sequence[RewardSpec], key: str, allow_weaker: bool, allow_with: str) -> None:
    """Rewards that run model-written code get the strong sandbox (bubblewrap) here, or the weaker
    basic level where ``allow_weaker`` chooses it (``allow_with`` says how, e.g. "pass
    --allow-weaker-sandbox"). Refused in one line: why the strong level is missing, and the two
    ways out."""
    names = [spec.name for spec in specs if runs_code(spec.name)]
    if not names:
        return
    what = f"{key}: {', '.join(names)} run{'s' if len(names) == 1 else ''} model-written code"
    try:
        missing = sandbox.bwrap_missing()
    except sandbox.SandboxError as e:
        raise InputError(f"{what}, and no sandbox level can run it here: {e}") from e
    if missing is not None and not allow_weaker:
        raise ConfigError(f"{what}, and the strong sandbox cannot run here: {missing}; install or allow bubblewrap "
                          f"(docs/rewards.md), or {allow_with} to accept the weaker 'basic' level")


def check_sandbox_python(path: Optional[str], key: str) -> None:
    """The interpreter sandboxed programs are to run with (``None``: the default) can run them;
    from here on this process's sandbox probes and runs use it."""
    try:
        sandbox.use_python(path)
    except sandbox.SandboxError as e:
        raise ConfigError(f"{key}: expected a Python interpreter the sandbox's programs can run, got {path!r}: "
                          f"{sandbox.python_problem(path)}") from e


# ---- a Hugging Face model directory -------------------------------------------------------------


def read_model_config(path: str | os.PathLike, key: str) -> dict:
    """The ``config.json`` of a Hugging Face directory."""
    if not Path(path).is_dir():
        raise InputError(f"{key}: {path} is not a directory (expected a Hugging Face model directory)")
    with about(key):
        return read_hf_config(path)


def model_shape(hf_config: dict, key: str, **overrides) -> ModelConfig:
    """The policy's shape from a ``config.json`` (Llama and Qwen2 only)."""
    with about(key):
        return model_config_from_hf(hf_config, **overrides)


def check_weights(path: str | os.PathLike, key: str, model: Optional[ModelConfig] = None) -> None:
    """Every safetensors file present with a readable header (and, given ``model``, exactly its tensors at their shapes)."""
    with about(key):
        index, shapes = safetensors_index(path)
        if model is not None:
            check_tensors(index, shapes, hf_shapes(model), Path(path), model.tie_word_embeddings)


def check_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int, key: str) -> None:
    """``model`` splits evenly over ``parallel`` and the world holds whole model-parallel groups
    (a conversion's layout; a training run's is :func:`~gdpo_megatron.resolve.resolve`'s)."""
    try:
        check_model_split(model, parallel)
        data_parallel_size(parallel, world_size)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from e


# ---- a training run ---------------------------------------------------------------------------


def ranks_on_this_machine(world_size: int) -> int:
    """The ranks of a ``world_size``-rank launch that run on this machine: torchrun's
    ``LOCAL_WORLD_SIZE``, else all of them."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def launch_world_size() -> int:
    """The number of ranks the launcher (torchrun, srun, or none) starts."""
    from gdpo_megatron.distributed.launch import resolve_launch_env

    try:
        return resolve_launch_env().world_size
    except ValueError as e:
        raise InputError(f"launch environment: {e}") from e


def check_run_dir_by_writing(run_dir: str | os.PathLike) -> None:
    """Create and remove a file in ``run_dir`` (or in its nearest existing parent, where the run
    will create it): permission bits, which :func:`check_output_dir` reads, say yes to root
    everywhere, also in /proc or on a read-only mount."""
    existing = Path(run_dir).absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise InputError(f"run_dir: cannot write {run_dir}: creating a file in {existing} failed: "
                         f"{e.strerror or e}") from e


def check_settings(config: TrainConfig) -> list[Condition]:
    """The checks of a training run that read neither the base model nor the data; the
    conditions. Independent checks all run (the rewards are checked once their files imported,
    their sandbox once they are known)."""
    problems, rewards = Problems(), config.rewards
    with problems.check():
        check_output_dir(config.run_dir, "run_dir")
        check_run_dir_by_writing(config.run_dir)
    with problems.check():
        check_sandbox_python(rewards.sandbox_python, "rewards.sandbox_python")
    with problems.check():
        load_reward_files(rewards.reward_files, "rewards.reward_files")
        check_reward_specs(rewards.rewards, "rewards.rewards")
        check_code_sandbox(rewards.rewards, "rewards.rewards", rewards.allow_weaker_sandbox,
                           "set rewards.allow_weaker_sandbox=true")
    with problems.check():
        check_environment(config.environment, "environment")
        family = get_task(config.data.family, "data.family")
        check_family_environment(config.environment, family.name, family.multi_turn, family.environment)
    problems.raise_any()
    return conditions_by_column(config.advantage.conditions, rewards.names)


def training_prompts(config: TrainConfig) -> list[Sample]:
    """The samples of ``data.train_path``, every row checked."""
    return data_prompts(config.data, "data.train_path")


def data_prompts(data: DataConfig, key: str) -> list[Sample]:
    """The samples a ``data`` section names, every row checked (``data.family`` first); errors
    name ``key``."""
    get_task(data.family, "data.family")
    return load_prompts(data.train_path, data.family, data.system_prompt, key,
                        fields=Fields(data.prompt_key, data.system_key, data.ground_truth_key), split=data.split)


def check_base_model(config: TrainConfig, hf_config: dict) -> ModelConfig:
    """The policy's shape from ``base_model``'s ``config.json``, checked against the context the
    config asks for and every safetensors header."""
    model = model_shape(hf_config, "base_model",
                        make_vocab_size_divisible_by=config.policy.model.make_vocab_size_divisible_by)
    with about("base_model"):
        engine_class(config.rollout.engine).check_model(hf_config)
    if config.rollout.max_model_len > model.max_position_embeddings:
        raise ConfigError(f"rollout.max_model_len: expected <= {model.max_position_embeddings}, the "
                          f"max_position_embeddings of base_model, got {config.rollout.max_model_len}")
    check_weights(config.base_model, "base_model", model)
    return model


def check_training(config: TrainConfig, machine: Machine, world_size: int) -> TrainingInputs:
    """Every check of a training run that needs no model, and the run resolved for ``machine``
    (the command's, this one), ``world_size`` ranks and the base model's shape. Checks that do not depend on each
    other all run; their errors come as one line (:class:`Problems`)."""
    problems = Problems()
    conditions = hf_config = model = samples = lengths = resolved = resume_step = None
    with problems.check():
        conditions = check_settings(config)
    with problems.check():
        hf_config = read_model_config(config.base_model, "base_model")
    if hf_config is not None:
        with problems.check():
            model = check_base_model(config, hf_config)
    batch_fits = False
    with problems.check():
        samples = training_prompts(config)
        check_prompts_per_step(config.data, len(samples))
        batch_fits = True
    if samples is not None and hf_config is not None:
        with problems.check():
            lengths = check_prompt_lengths(samples, config)
    if model is not None and lengths is not None:
        with problems.check():
            resolved = resolve(config, machine, world_size, model, _longest_prompt(config, lengths))
    if resolved is not None:
        if batch_fits:
            with problems.check():
                check_host_memory(config, resolved, ranks_on_this_machine(world_size),
                                  psutil.virtual_memory().available)
        with problems.check():
            resume_step = check_resume(config, model, resolved)
    problems.raise_any()
    return TrainingInputs(samples, hf_config, model, conditions, resume_step, resolved)


def check_prompts_per_step(data: DataConfig, prompts: int) -> None:
    """A step's prompts are distinct: ``data.prompts_per_step`` is at most the ``prompts`` of
    ``data.train_path`` (more would repeat prompts within a step, as separate groups)."""
    if data.prompts_per_step > prompts:
        raise ConfigError(f"data.prompts_per_step: {data.prompts_per_step} is more than the {prompts} prompts of "
                          f"{data.train_path}, so a step would repeat prompts; at most {prompts}")


def check_host_memory(config: TrainConfig, resolved: Resolved, ranks: int, available: int) -> None:
    """A run without CUDA fits the host memory ``available`` with ``ranks`` of its ranks here
    (:func:`~gdpo_megatron.preflight.plan.plan_host_memory`). The error names the key that
    sizes the excess, what is available and what would fit: ``rollout.kv_cache_gib`` where set,
    else ``data.prompts_per_step`` (the KV cache holds a step's rollouts), else ``base_model``."""
    from gdpo_megatron.preflight.plan import GIB, plan_host_memory

    if resolved.machine.cuda:
        return
    plan = plan_host_memory(config, resolved, ranks)
    if plan.total <= available:
        return
    gib = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
    need = (f"needs {gib(plan.total)} of host memory ({ranks} rank(s) x: KV cache {gib(plan.kv_cache)}, engine "
            f"weights {gib(plan.engine_weights)}, policy {gib(plan.policy)}), {gib(available)} is available here")
    room = available // ranks - plan.engine_weights - plan.policy  # each rank's room for its KV cache
    layout = resolved.layout
    per_rollout = plan.kv_cache / layout.rollouts_per_replica  # what one more rollout adds, at most
    if config.rollout.kv_cache_gib is not None and room > 0:
        raise ConfigError(f"rollout.kv_cache_gib: {config.rollout.kv_cache_gib} {need}; at most "
                          f"{math.floor(room / GIB * 100) / 100} would fit")
    group, replicas = config.rollout.group_size, layout.data_parallel_size
    fitting = int(room // per_rollout) // group * replicas if room > 0 else 0
    if config.rollout.kv_cache_gib is None and fitting >= replicas:
        raise ConfigError(f"data.prompts_per_step: {config.data.prompts_per_step} prompts x rollout.group_size "
                          f"{group} rollouts, with the KV cache that holds them, {need}; at most "
                          f"{fitting} prompts per step would fit")
    raise ConfigError(f"base_model: the run {need}; even its weights, policy and the smallest KV cache do not fit")


def _longest_prompt(config: TrainConfig, lengths: Sequence[int]) -> int:
    """What the KV cache is sized for before each rollout's max_new_tokens: the data's longest
    prompt, or for a multi-turn family the whole token budget a trajectory may fill."""
    if get_task(config.data.family).multi_turn:
        return config.rollout.max_model_len - config.rollout.max_new_tokens
    return max(lengths)


# Keys whose value may change when a run directory resumes: how the run is laid out, sized,
# logged and saved, not what it trains. policy.parallel and the rollout engine's layout are
# checked against the checkpoint by check_reshardable; policy.model is gdpo-plan's shape.
RESUME_MAY_CHANGE = (
    "run_dir", "base_model", "steps", "logging.", "checkpoint.", "rewards.num_workers", "rewards.timeout_s",
    "policy.parallel.", "policy.model.", "policy.micro_batch_size", "policy.micro_batch_tokens",
    "policy.offload_grads_and_optimizer", "rollout.tensor_parallel_size", "rollout.gpu_memory_utilization",
    "rollout.kv_cache_gib", "rollout.enforce_eager", "rollout.max_num_batched_tokens",
)


def config_changes(saved: dict, config: TrainConfig) -> list[str]:
    """``key: saved -> new`` for every setting that changes what a resumed run trains (keys
    that either side lacks, from another version of the schema, are left out)."""
    old, new = _flatten(saved), _flatten(to_dict(config))
    return [f"{key}: {old[key]!r} -> {new[key]!r}" for key in sorted(old.keys() & new.keys())
            if old[key] != new[key] and not key.startswith(RESUME_MAY_CHANGE)]


def _flatten(data, prefix: str = "") -> dict:
    """Dotted keys of the leaves of nested dicts and lists (list items by index, as in overrides;
    a list's own key holds its length, so an item added or removed shows)."""
    if isinstance(data, list):
        items = _flatten(dict(enumerate(data)), prefix) if data else {}
        return {prefix[:-1]: f"{len(data)} items", **items}
    if isinstance(data, dict) and data:
        return {k: v for key, value in data.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: data}


def check_resume(config: TrainConfig, model: ModelConfig, resolved: Resolved) -> int:
    """The step a run directory resumes from (0: none to resume). It resumes only when allowed,
    from a complete training checkpoint of ``model``'s shape, of the same run (the settings
    that change what it trains are the same, unless ``checkpoint.resume: force``), at this
    config's data position, with optimizer state this layout can load."""
    root = Path(config.run_dir) / CHECKPOINT_DIR
    if root.exists():
        check_output_dir(root, "run_dir")
    steps = complete_steps(root)
    if not steps:
        return 0
    if config.checkpoint.resume is False:
        raise ConfigError(f"checkpoint.resume: false, but {root} holds step_{steps[-1]}; "
                          "choose another run_dir or remove its checkpoints")
    directory = step_dir(root, steps[-1])
    state = read_training_state(directory)
    if state.data_position is None:
        raise InputError(f"run_dir: {directory} is not a training checkpoint (it has no data position; "
                         "gdpo-convert writes such); choose another run_dir")
    saved = model_section(state.config) or {}
    differ = [f"{f}={saved[f]} (base_model: {getattr(model, f)})" for f in SHAPE_FIELDS
              if f in saved and saved[f] != getattr(model, f)]
    if differ:
        raise InputError(f"run_dir: {directory} holds a model of another shape: {', '.join(differ)}; "
                         "choose another run_dir")
    changes = config_changes(state.config or {}, config)
    if changes and config.checkpoint.resume != "force":
        raise ConfigError(f"run_dir: {config.run_dir} holds step {state.step} of a run with other settings "
                          f"({'; '.join(changes)}); choose a new run_dir, or set checkpoint.resume=force to "
                          "continue that run under these settings")
    expected = state.step * config.data.prompts_per_step
    if state.data_position != expected:
        raise ConfigError(f"data.prompts_per_step: the checkpoint of step {state.step} was taken after "
                          f"{state.data_position} prompts, this config would resume after {expected}")
    if resolved.policy.config.optim.use_distributed_optimizer:
        parallel = config.policy.parallel
        check_reshardable(directory, state, {key: getattr(parallel, key) for key in LAYOUT_KEYS})
    check_files(directory)
    return state.step
