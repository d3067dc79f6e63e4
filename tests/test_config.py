"""Config loading: YAML + dotted overrides into typed sections, with errors naming the key."""
import dataclasses
import glob
from typing import Optional

import pytest

from gdpo_megatron.advantages import Condition, conditions_by_column
from gdpo_megatron.config import (AdvantageConfig, CheckpointConfig, ConditionConfig, ConfigError, DataConfig,
                                  DistributedConfig, LoggingConfig, ModelConfig, OptimConfig, RewardsConfig, RewardSpec,
                                  RolloutConfig, TrainConfig, apply_override, from_dict, load_config)
from gdpo_megatron.config.policy import PolicyConfig


@dataclasses.dataclass
class Inner:
    rate: float = 0.5
    name: str = "x"


@dataclasses.dataclass
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)
    items: list[Inner] = dataclasses.field(default_factory=list)
    steps: int = 3
    flag: Optional[bool] = None


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("inner:\n  rate: 1e-6\nitems:\n  - {name: a}\n  - {name: b, rate: 2}\n")
    cfg = load_config(Outer, path, ["steps=7", "items.1.rate=0.25", "flag=true", "inner.name=z"])
    assert cfg == Outer(inner=Inner(rate=1e-6, name="z"), items=[Inner(name="a"), Inner(rate=0.25, name="b")],
                        steps=7, flag=True)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"inner": {"rat": 1.0}}, r"inner.rat: unknown key \(expected one of: name, rate\)"),
        ({"steps": "many"}, r"steps: expected an integer, got 'many'"),
        ({"steps": True}, r"steps: expected an integer, got True"),
        ({"inner": {"rate": "fast"}}, r"inner.rate: expected a number, got 'fast'"),
        ({"items": {"name": "a"}}, r"items: expected a list"),
        ({"items": [{"name": 3}]}, r"items.0.name: expected a string, got 3"),
        ({"flag": "yes please"}, r"flag: expected true or false"),
        ({"inner": 5}, r"inner: expected a mapping, got 5"),
    ],
)
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_override_errors():
    with pytest.raises(ConfigError, match=r"override 'steps': expected key.sub=value"):
        apply_override({}, "steps")
    with pytest.raises(ConfigError, match=r"override items.4: expected an index in \[0, 1\), got '4'"):
        apply_override({"items": [{}]}, "items.4.rate=1")
    with pytest.raises(ConfigError, match=r"steps is a value, not a section"):
        apply_override({"steps": 3}, "steps.x=1")


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: not found"):
        load_config(Outer, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(Outer, bad)


def test_policy_section_errors_are_qualified_with_their_path():
    @dataclasses.dataclass
    class Top:
        policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)

    cfg = from_dict(Top, {"policy": {"model": {"preset": "tiny", "num_layers": 4}, "optim": {"lr": "3e-6"}}})
    assert cfg.policy.model.num_layers == 4 and cfg.policy.model.hidden_size == 128
    assert cfg.policy.optim.lr == 3e-6
    with pytest.raises(ConfigError, match=r"^policy.optim.lr: expected > 0, got -1.0"):
        from_dict(Top, {"policy": {"optim": {"lr": -1}}})
    with pytest.raises(ConfigError, match=r"policy.model.preset|model preset: expected one of"):
        from_dict(Top, {"policy": {"model": {"preset": "gpt-17"}}})


def test_advantage_conditions_resolve_reward_names():
    cfg = from_dict(AdvantageConfig, {"conditions": [{"reward": "length", "gate": "correct", "threshold": 1}]})
    assert cfg.conditions == [ConditionConfig("length", "correct", 1.0)]
    assert conditions_by_column(cfg.conditions, ["format", "correct", "length"]) == [Condition(2, 1, 1.0, 0.0)]
    with pytest.raises(ConfigError, match=r"advantage.conditions.0.gate: 'correct' is not a configured reward"):
        load_config(TrainConfig, "configs/tiny_cpu.yaml", ["advantage.conditions.0.gate=correct"])
    with pytest.raises(ConfigError, match=r"advantage.mode: expected one of"):
        from_dict(AdvantageConfig, {"mode": "ppo"}, "advantage")


@pytest.mark.parametrize("path", sorted(glob.glob("configs/*.yaml")))
def test_shipped_configs_load(path):
    cfg = load_config(TrainConfig, path)
    assert cfg.rewards.names and len(conditions_by_column(cfg.advantage.conditions, cfg.rewards.names)) == len(
        cfg.advantage.conditions)


def test_advantage_leave_one_out_and_normalization_options():
    cfg = load_config(TrainConfig, "configs/tiny_cpu.yaml",
                      ["advantage.leave_one_out=true", "advantage.normalize_rewards=false"])
    assert cfg.advantage.leave_one_out is True and cfg.advantage.normalize_rewards is False
    assert load_config(TrainConfig, "configs/tiny_cpu.yaml").advantage.leave_one_out is False
    with pytest.raises(ConfigError, match=r"advantage.leave_one_out"):
        from_dict(AdvantageConfig, {"leave_one_out": "sometimes"}, "advantage")


def test_a_moved_key_names_what_replaces_it(tmp_path):
    old = tmp_path / "old.yaml"
    old.write_text(open("configs/tiny_cpu.yaml").read() + "dynamic_sampling: true\n")
    message = (r"^dynamic_sampling: replaced by advantage.filter "
               r"\(dynamic_sampling: true is advantage.filter: informative_groups\)$")
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, old)
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, "configs/tiny_cpu.yaml", ["dynamic_sampling=false", "stepz=3"])
    cfg = load_config(TrainConfig, "configs/tiny_cpu.yaml", ["advantage.filter=informative_groups"])
    assert cfg.advantage.filter == "informative_groups"
    assert load_config(TrainConfig, "configs/tiny_cpu.yaml").advantage.filter == "none"


# ---- the Python API: a section checks its fields when built -----------------------------------


@pytest.mark.parametrize("cls, kwargs, message", [
    (AdvantageConfig, {"mode": "ppo"}, "mode: expected one of ('gdpo', 'grpo', 'grpo_no_std'), got 'ppo'"),
    (AdvantageConfig, {"nonfinite": "bogus"}, "nonfinite: expected one of ('raise', 'mask'), got 'bogus'"),
    (AdvantageConfig, {"batch_norm": "yes"}, "batch_norm: expected true or false, got 'yes'"),
    (AdvantageConfig, {"eps": float("nan")}, "eps: expected a finite number, got nan"),
    (AdvantageConfig, {"conditions": ["correct"]}, "conditions.0: expected a mapping, got 'correct'"),
    (ConditionConfig, {"reward": "a", "gate": 1}, "gate: expected a string, got 1"),
    (RolloutConfig, {"group_size": True}, "group_size: expected an integer, got True"),
    (RolloutConfig, {"group_size": 4.0}, "group_size: expected an integer, got 4.0"),
    (RolloutConfig, {"kv_cache_gib": "lots"}, "kv_cache_gib: expected a number, got 'lots'"),
    (RolloutConfig, {"sleep_level": 3}, "sleep_level: expected one of (1, 2), got 3"),
    (RolloutConfig, {"stop": "\n"}, "stop: expected a list, got '\\n'"),
    (PolicyConfig, {"parallel": "tp2"}, "parallel: expected a mapping, got 'tp2'"),
    (PolicyConfig, {"micro_batch_tokens": "max"}, "micro_batch_tokens: 'max' matches none of"),
    (OptimConfig, {"lr_decay_style": "linear"}, "lr_decay_style: expected one of ('constant', 'cosine'), got 'linear'"),
    (ModelConfig, {"vocab_size": 8.5, "hidden_size": 64, "ffn_hidden_size": 64, "num_layers": 1,
                   "num_attention_heads": 1}, "vocab_size: expected an integer, got 8.5"),
    (CheckpointConfig, {"resume": "yes"}, "resume: 'yes' matches none of"),
    (DataConfig, {"train_path": "d.jsonl", "family": 3}, "family: expected a string, got 3"),
    (DistributedConfig, {"timeout_s": "10m"}, "timeout_s: expected a number, got '10m'"),
    (LoggingConfig, {"progress_bar": 1}, "progress_bar: expected true or false, got 1"),
    (RewardSpec, {"name": "length", "kwargs": ["max_tokens"]}, "kwargs: expected a mapping, got ['max_tokens']"),
    (RewardsConfig, {"rewards": [{"name": "a"}], "reward_files": "r.py"}, "reward_files: expected a list, got 'r.py'"),
])
def test_python_api_refuses_what_the_loader_refuses_in_the_same_words(cls, kwargs, message):
    with pytest.raises(ConfigError) as built:
        cls(**kwargs)
    assert str(built.value).startswith(message)
    with pytest.raises(ConfigError) as loaded:
        from_dict(cls, kwargs, "section")
    assert str(loaded.value) == f"section.{built.value}"


def test_python_api_converts_as_the_loader_does():
    spec = RewardSpec("length", weight=2)
    assert spec.weight == 2.0 and type(spec.weight) is float  # frozen, converted all the same
    assert type(RolloutConfig(temperature=1).temperature) is float
    assert AdvantageConfig(conditions=[{"reward": "a", "gate": "b"}]).conditions == [ConditionConfig("a", "b")]
    advantage = AdvantageConfig(mode="grpo", nonfinite="mask")
    assert (advantage.mode, advantage.nonfinite) == ("grpo", "mask")
    assert dataclasses.replace(advantage, eps=0).eps == 0.0
    with pytest.raises(ConfigError, match="mode: expected one of"):
        dataclasses.replace(advantage, mode="ppo")
