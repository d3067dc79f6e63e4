"""Typed configuration: dataclass sections, loaded from YAML plus dotted overrides.

``load_config("configs/tiny_cpu.yaml", ["policy.optim.lr=1e-5", "advantage.mode=grpo"])``
reads the file, applies the overrides, and builds the dataclasses, converting and checking
every value against its annotation. Unknown keys and bad values raise :class:`ConfigError`
naming the dotted key. The sections validate their own fields (``__post_init__``).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from gdpo_megatron.advantages import MODES, NONFINITE_POLICIES, Condition
from gdpo_megatron.data.samples import FAMILIES, Fields
from gdpo_megatron.errors import UserError
from gdpo_megatron.policy.config import PolicyConfig
from gdpo_megatron.rewards.registry import RewardSpec

ROLLOUT_QUANTIZATIONS = (None, "fp8")


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key."""


@dataclasses.dataclass
class ConditionConfig:
    """Reward ``reward`` counts only where reward ``gate`` is >= ``threshold`` (else ``fill``).

    (The key is not ``on``: YAML 1.1 reads a bare ``on`` as ``true``.)
    """

    reward: str
    gate: str
    threshold: float = 1.0
    fill: float = 0.0


@dataclasses.dataclass
class AdvantageConfig:
    """How rewards become advantages (see :func:`gdpo_megatron.advantages.compute_advantages`).

    Reward weights live with the rewards; conditions name rewards, not columns.
    """

    mode: str = "gdpo"
    batch_norm: Optional[bool] = None  # None: on for gdpo, off for the GRPO modes
    eps: float = 1e-4
    leave_one_out: bool = False  # baseline and std of a rollout from its group's other rollouts
    normalize_rewards: bool = True  # false: center inside the group without dividing by the std
    conditions: list[ConditionConfig] = dataclasses.field(default_factory=list)
    nonfinite: str = "raise"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"advantage.mode: expected one of {MODES}, got {self.mode!r}")
        if self.nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"advantage.nonfinite: expected one of {NONFINITE_POLICIES}, got {self.nonfinite!r}")
        if not (self.eps >= 0 and math.isfinite(self.eps)):
            raise ValueError(f"advantage.eps: expected a finite value >= 0, got {self.eps}")

    def resolve_conditions(self, reward_names: list[str]) -> list[Condition]:
        """The conditions as column indices of the reward tensor (ordered as ``reward_names``)."""
        out = []
        for i, c in enumerate(self.conditions):
            for key in ("reward", "gate"):
                if getattr(c, key) not in reward_names:
                    raise ConfigError(
                        f"advantage.conditions.{i}.{key}: {getattr(c, key)!r} is not a configured reward "
                        f"(rewards: {reward_names})"
                    )
            out.append(Condition(reward_names.index(c.reward), reward_names.index(c.gate), c.threshold, c.fill))
        return out


@dataclasses.dataclass
class RolloutConfig:
    """Sampling and the colocated vLLM engine (see :mod:`gdpo_megatron.rollout.vllm_engine`)."""

    group_size: int = 8  # completions per prompt (G); GDPO and GRPO normalize inside the group
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop: list[str] = dataclasses.field(default_factory=list)
    tensor_parallel_size: int = 1  # vLLM's own TP; may differ from the policy's
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: Optional[float] = None
    max_model_len: int = 2048
    enforce_eager: Optional[bool] = None
    quantization: Optional[str] = None  # "fp8": FP8 rollouts on GPU

    def __post_init__(self):
        _check(self.group_size >= 2, "rollout.group_size",
               ">= 2 (advantages compare the completions of a prompt; one alone gets advantage 0)", self.group_size)
        _check(self.temperature > 0, "rollout.temperature", "> 0 (training samples; gdpo-eval is greedy)",
               self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "rollout.top_k", "-1 (off) or >= 1", self.top_k)
        if self.top_p < 1 or self.top_k > 0:
            warnings.warn("rollout.top_p / rollout.top_k: the policy's logprobs do not truncate the "
                          "distribution, so the importance ratio of the first update is biased")
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.max_model_len > self.max_new_tokens, "rollout.max_model_len",
               f"> max_new_tokens={self.max_new_tokens}", self.max_model_len)
        _check(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        _check(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.kv_cache_gib is None or self.kv_cache_gib > 0, "rollout.kv_cache_gib", "> 0 or null",
               self.kv_cache_gib)
        _check(self.quantization in ROLLOUT_QUANTIZATIONS, "rollout.quantization", "null or 'fp8'",
               self.quantization)


@dataclasses.dataclass
class RewardsConfig:
    """The rewards (in column order) and the process pool that scores them."""

    rewards: list[RewardSpec] = dataclasses.field(default_factory=list)
    num_workers: int = 2
    timeout_s: float = 30.0
    reward_files: list[str] = dataclasses.field(default_factory=list)  # Python files registering rewards

    def __post_init__(self):
        _check(len(self.rewards) > 0, "rewards.rewards", "at least one reward", self.rewards)
        names = [r.name for r in self.rewards]
        _check(len(set(names)) == len(names), "rewards.rewards", "unique names", names)
        _check(self.num_workers >= 1, "rewards.num_workers", ">= 1 (reward worker processes)", self.num_workers)
        _check(self.timeout_s > 0, "rewards.timeout_s", "> 0 seconds", self.timeout_s)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.rewards]


@dataclasses.dataclass
class DataConfig:
    """Prompt data of one task family, in a published layout (see :mod:`gdpo_megatron.data.samples`)."""

    train_path: str  # .jsonl, .json, .parquet, or a Hugging Face datasets directory (save_to_disk)
    family: str  # "tool", "math", "code" or "toolrl"
    # The split of a datasets directory; None: "train" of a DatasetDict, all of a single dataset.
    split: Optional[str] = None
    # Field names, as verl's data.prompt_key; dotted names reach into nested fields. None: the
    # usual ones (messages / prompt / problem / question; the family's ground-truth fields).
    prompt_key: Optional[str] = None
    system_key: Optional[str] = None  # a field holding the system message (ToolRL's SFT set: instruction)
    ground_truth_key: Optional[str] = None
    # Instructions added to each chat's system message: None, the family's own (answer format,
    # tool schemas; none for toolrl, whose prompts carry ToolRL's); "" none.
    system_prompt: Optional[str] = None
    prompts_per_step: int = 8  # over all data-parallel ranks
    max_prompt_tokens: int = 512
    shuffle_seed: int = 0

    def __post_init__(self):
        _check_path(self.train_path, "data.train_path")
        _check(self.family in FAMILIES, "data.family", f"one of {FAMILIES}", self.family)
        _check(self.prompts_per_step >= 1, "data.prompts_per_step", ">= 1", self.prompts_per_step)
        _check(self.max_prompt_tokens >= 1, "data.max_prompt_tokens", ">= 1", self.max_prompt_tokens)
        for key in ("prompt_key", "system_key", "ground_truth_key"):
            value = getattr(self, key)
            _check(value is None or (value and all(value.split("."))), f"data.{key}",
                   "a field name (dotted for nested fields) or null", value)

    def fields(self) -> Fields:
        """The field names, for :func:`gdpo_megatron.data.samples.load_samples`."""
        return Fields(self.prompt_key, self.system_key, self.ground_truth_key)


@dataclasses.dataclass
class CheckpointConfig:
    """Where and how often to save; resume from the latest complete checkpoint."""

    save_every: int = 0  # steps; 0: only at the end
    keep_last: int = 2
    resume: bool = True
    export_hf: bool = True  # write a Hugging Face directory at the end
    # The distributed optimizer's state on disk (megatron-core's formats): "dp_reshardable"
    # resumes under another data-parallel size only, "fully_reshardable" (gathered when saving)
    # under any TP/PP/DP layout. The plain optimizer's state and the weights reshard either way.
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"

    def __post_init__(self):
        _check(self.save_every >= 0, "checkpoint.save_every", ">= 0", self.save_every)
        _check(self.keep_last >= 1, "checkpoint.keep_last", ">= 1", self.keep_last)


@dataclasses.dataclass
class LoggingConfig:
    wandb_project: Optional[str] = None  # None: JSONL only
    progress_bar: bool = True


@dataclasses.dataclass
class TrainConfig:
    """Everything ``gdpo-train`` reads.

    The policy trains the shape of ``base_model/config.json`` (``policy.model`` is what
    ``gdpo-plan`` plans with), seeded with ``seed`` and at ``rollout.temperature``, so that
    its logprobs are those of the distribution the rollouts were sampled from.
    """

    run_dir: str
    base_model: str  # a Hugging Face directory; the policy's shape comes from its config.json
    data: DataConfig
    rewards: RewardsConfig
    steps: int = 100
    seed: int = 1234
    dynamic_sampling: bool = False  # drop (not refill) prompt groups in which no reward has any spread
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self):
        _check_path(self.run_dir, "run_dir")
        _check_path(self.base_model, "base_model")
        _check(self.steps >= 1, "steps", ">= 1", self.steps)
        # The policy's logprobs are those of the distribution the rollouts were sampled from.
        defaults = {f.name: f.default for f in dataclasses.fields(PolicyConfig)}
        for name, used, instead in (
                ("temperature", self.rollout.temperature, "samples and trains at rollout.temperature"),
                ("seed", self.seed, "seeds the policy with seed")):
            if getattr(self.policy, name) not in (defaults[name], used):
                raise ConfigError(f"policy.{name}: a training run {instead}; set that instead")
        self.advantage.resolve_conditions(self.rewards.names)
        longest = self.data.max_prompt_tokens + self.rollout.max_new_tokens
        _check(longest <= self.rollout.max_model_len, "rollout.max_model_len",
               f">= data.max_prompt_tokens + rollout.max_new_tokens = {longest}", self.rollout.max_model_len)

    def layout(self, world_size: int) -> tuple[int, int]:
        """(data-parallel size, rollouts per data-parallel replica) on ``world_size`` ranks.

        Raises ConfigError naming the key when the step does not split evenly.
        """
        parallel = self.policy.parallel
        try:
            dp = parallel.data_parallel_size(world_size)
        except ValueError as e:
            raise ConfigError(f"policy.{e}") from None
        tp = parallel.tensor_model_parallel_size
        if tp % self.rollout.tensor_parallel_size:
            raise ConfigError(f"rollout.tensor_parallel_size: {self.rollout.tensor_parallel_size} must divide "
                              f"policy.parallel.tensor_model_parallel_size={tp} (vLLM groups consecutive ranks)")
        if self.data.prompts_per_step % dp:
            raise ConfigError(f"data.prompts_per_step: {self.data.prompts_per_step} is not divisible by the "
                              f"data-parallel size {dp}")
        per_replica = self.data.prompts_per_step // dp * self.rollout.group_size
        if self.policy.micro_batch_tokens is None and per_replica % self.policy.micro_batch_size:
            raise ConfigError(f"policy.micro_batch_size: {self.policy.micro_batch_size} does not divide the "
                              f"{per_replica} rollouts of a data-parallel replica")
        return dp, per_replica


def _check(ok: bool, key: str, expected: str, got) -> None:
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


def _check_path(value: str, key: str) -> None:
    """A path setting is not empty (an empty one would mean the current directory)."""
    _check(bool(str(value).strip()), key, "a path", value)


# ---------------------------------------------------------------------------------------------
# Loading


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives a key twice (PyYAML would keep the last one silently)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (merge keys ``<<`` may still be overridden)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first:
                    raise DuplicateKeyError(f"line {line}: duplicate key {key!r} (first at line {first[key]})")
                first[key] = line
        return super().construct_mapping(node, deep)


def read_yaml(text: str):
    """Plain data from YAML text; :class:`DuplicateKeyError` for a key given twice in one mapping."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None):
    """Build ``cls`` (a dataclass) from a YAML file and ``key.sub=value`` overrides."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path}: {'a directory' if path.is_dir() else 'not found'}")
        try:
            data = read_yaml(path.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path}: not UTF-8 ({e.reason} at byte {e.start})") from None
        except DuplicateKeyError as e:
            raise ConfigError(f"config file {path}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path}: not valid YAML: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path}: expected a mapping at the top level, got {type(data).__name__}")
    for item in overrides or ():
        apply_override(data, item)
    return from_dict(cls, data)


def apply_override(data: dict, item: str) -> None:
    """Set ``a.b.c=value`` in a nested dict (list items by index: ``rewards.0.weight=2``)."""
    key, sep, raw = item.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: expected key.sub=value")
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: not valid YAML ({e})") from None
    *parents, last = key.split(".")
    node: Any = data
    for depth, part in enumerate(parents):
        where = ".".join(parents[: depth + 1])
        if isinstance(node, list):
            node = node[_list_index(node, part, where)]
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
    if isinstance(node, list):
        node[_list_index(node, last, key)] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {where}: expected an index in [0, {len(node)}), got {part!r}")
    return int(part)


def from_dict(cls: type, data: Any, path: str = ""):
    """Build dataclass ``cls`` from plain data, checking keys and types; errors name ``path``."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = dict(data)
    preset = data.pop("preset", None) if hasattr(cls, "preset") else None
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key (expected one of: {', '.join(sorted(fields))})")
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    try:
        if preset is not None:
            return cls.preset(preset, **kwargs)
        missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"{_join(path, missing[0])}: required key is missing")
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, NotImplementedError) as e:
        raise ConfigError(_qualify(path, str(e), fields)) from e


def to_dict(config) -> dict:
    """Plain data of a config (for the run directory and checkpoints)."""
    return dataclasses.asdict(config)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _qualify(path: str, message: str, fields=()) -> str:
    """Prefix a section's own error ("model.x: ..." or "x: ..." for its field x) with where the section sits."""
    if not path:
        return message
    parent, _, last = path.rpartition(".")
    if message.startswith(f"{last}.") or message.startswith(f"{last}:"):
        return f"{parent}.{message}" if parent else message
    if message.partition(":")[0] in fields:
        return f"{path}.{message}"
    return f"{path}: {message}"


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(option, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {options}")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_convert(args[0], v, f"{path}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {k: _convert(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: expected one of {args}, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        number = value
        if isinstance(value, str):  # YAML 1.1 reads 1e-6 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{path}: expected a finite number, got {value!r}")
        return float(number)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{path}: unsupported annotation {tp!r}")
