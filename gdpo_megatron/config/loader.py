"""Loading: YAML plus dotted overrides into the typed sections, every value checked against its annotation.

A section is declared with :func:`section` (a dataclass whose fields are converted to their
annotations whenever it is built, from YAML or from Python) and checks its own rules in
``__post_init__`` with :func:`require`, naming its fields relative to itself; :func:`from_dict`
prefixes the message with where the section sits, so every error names the full dotted key.
A key that moved is listed in the section's ``REPLACED_KEYS`` (old key -> what replaces it),
and the error says so.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from gdpo_megatron.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or invalid; the message names the key."""


def section(cls=None, /, *, frozen: bool = False):
    """``@section``: a config section, a dataclass whose every field is converted to its
    annotation (``Literal``, bool, int, float, str, ``Optional``, lists, dicts, nested sections)
    when it is built, before its own ``__post_init__`` rules: ``AdvantageConfig(mode="ppo")``
    raises the :class:`ConfigError` that ``advantage.mode: ppo`` in a YAML file does."""

    def declare(cls):
        rules = cls.__dict__.get("__post_init__")

        def __post_init__(self):
            check_fields(self)
            if rules is not None:
                rules(self)

        cls.__post_init__ = __post_init__
        return dataclasses.dataclass(frozen=frozen)(cls)

    return declare if cls is None else declare(cls)


def check_fields(config) -> None:
    """Convert every field of section ``config`` to its annotation in place; raise
    :class:`ConfigError` ``"<field>: expected ..., got ..."`` for the first that does not fit."""
    hints = _type_hints(type(config))
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        converted = _convert(hints[field.name], value, field.name)
        if converted is not value:
            object.__setattr__(config, field.name, converted)  # also for a frozen section


@functools.cache
def _type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def require(ok: bool, key: str, expected: str, got: Any) -> None:
    """Raise :class:`ConfigError` ``"<key>: expected <expected>, got <got>"`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key}: expected {expected}, got {got!r}")


def require_path(value: str, key: str) -> None:
    """A path setting is not empty (an empty one would mean the current directory)."""
    require(bool(str(value).strip()), key, "a path", value)


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
    hints = _type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    data = dict(data)
    preset = data.pop("preset", None) if hasattr(cls, "preset") else None
    replaced = sorted(set(data) & set(getattr(cls, "REPLACED_KEYS", {})))
    if replaced:  # a key that was moved: say where to, not just that it is unknown
        raise ConfigError(f"{_join(path, replaced[0])}: replaced by {cls.REPLACED_KEYS[replaced[0]]}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(f"{where}{unknown[0]}: unknown key (expected one of: {', '.join(sorted(fields))})")
    kwargs = {name: _convert(hints[name], value, _join(path, name)) for name, value in data.items()}
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING and preset is None]
    if missing:
        raise ConfigError(f"{_join(path, missing[0])}: required key is missing")
    try:
        return cls.preset(preset, **kwargs) if preset is not None else cls(**kwargs)
    except ConfigError as e:  # the section's own rules name its fields relative to it
        raise ConfigError(_qualify(path, str(e), fields)) from None


def to_dict(config) -> dict:
    """Plain data of a config (for the run directory and checkpoints)."""
    return dataclasses.asdict(config)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _qualify(path: str, message: str, fields=()) -> str:
    """Prefix a section's own error ("model.x: ..." or "x: ..." / "x.y: ..." for its field x) with where the section sits."""
    if not path:
        return message
    parent, _, last = path.rpartition(".")
    if message.startswith(f"{last}.") or message.startswith(f"{last}:"):
        return f"{parent}.{message}" if parent else message
    if message.partition(":")[0].split(".")[0] in fields:
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
        return value if isinstance(value, tp) else from_dict(tp, value, path)
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
