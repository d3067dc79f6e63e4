"""Config loading: YAML + dotted overrides into typed sections, with errors naming the key."""
import dataclasses
import glob
from typing import Optional

import pytest

from gdpo_megatron.advantages import Condition, conditions_by_column
from gdpo_megatron.config import (AdvantageConfig, ConditionConfig, ConfigError, TrainConfig, apply_override, from_dict,
                                  load_config)
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
