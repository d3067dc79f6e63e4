"""The README and docs/ as a user reads them: every command in them parses with the real command
line and config, every config key is documented, every link resolves, every Python example runs.

A command is checked as written, without running it: its arguments through the command's own
parser, its config and overrides through the config loader, its layout against the number of
processes it is launched with, the scripts and make targets it names against the repository.
"""
import dataclasses
import re
import shlex
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from gdpo_megatron.config import ConfigError, TrainConfig, load_config
from gdpo_megatron.device import CUDA
from gdpo_megatron.resolve import resolve

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = {"train", "eval", "convert", "plan", "doctor", "plot"}


def blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.MULTILINE | re.DOTALL)


def shell_commands(path: Path) -> list[list[str]]:
    """The commands of a document's bash blocks, one token list each (continued lines joined,
    comments and leading VAR=value assignments dropped)."""
    commands = []
    for block in blocks(path, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):
                tokens = tokens[1:]
            if tokens:
                commands.append(tokens)
    return commands


def gdpo_command(tokens: list[str]) -> tuple[str, list[str], int] | None:
    """(command, its arguments, processes launched) of a gdpo-* / python -m / torchrun line."""
    if tokens[0].startswith("gdpo-") and tokens[0][5:] in COMMANDS:
        return tokens[0][5:], tokens[1:], 1
    if "-m" in tokens and tokens[0] in ("python", "python3", "torchrun"):
        module = tokens[tokens.index("-m") + 1]
        rest = tokens[tokens.index("-m") + 2:]
        nproc = next((int(t.split("=")[1]) for t in tokens if t.startswith("--nproc-per-node=")), None)
        if "--nproc-per-node" in tokens:
            nproc = int(tokens[tokens.index("--nproc-per-node") + 1])
        if module == "gdpo_megatron":
            return rest[0], rest[1:], nproc or 1
        if module == "gdpo_megatron.demo":
            return "demo", rest, 1
    return None


def check_gdpo_command(command: str, args: list[str], world_size: int) -> None:
    import importlib

    module = importlib.import_module("gdpo_megatron.demo.__main__" if command == "demo"
                                     else f"gdpo_megatron.commands.{command}")
    parsed = module.parse(args)
    config_path = getattr(parsed, "config", None) or ("configs/tiny_cpu.yaml" if command == "demo" else None)
    if config_path is not None:
        config = load_config(TrainConfig, ROOT / config_path, parsed.overrides)
        if command == "train":  # laid out as on GPUs, with policy.model's shape
            resolve(config, CUDA, world_size, runs_here=False)
    if command == "convert":
        parallel = parsed.tp * parsed.pp
        assert world_size % parallel == 0, f"--tp {parsed.tp} --pp {parsed.pp} needs a multiple of {parallel} processes"


def documented_commands():
    return [pytest.param(path, tokens, id=f"{path.name}:{' '.join(tokens)[:60]}")
            for path in DOCS for tokens in shell_commands(path)]


@pytest.mark.parametrize("path, tokens", documented_commands())
def test_every_documented_command_is_valid_as_written(path, tokens):
    found = gdpo_command(tokens)
    if found is not None:
        check_gdpo_command(*found)
    elif tokens[0] == "make":
        targets = re.findall(r"^([\w/.-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        assert set(tokens[1:]) <= set(targets), f"no make target {tokens[1:]}"
    elif tokens[0] in ("python", "python3") and tokens[1].endswith(".py"):
        assert (ROOT / tokens[1]).is_file(), tokens[1]
    elif tokens[0] in ("sbatch", "bash") and tokens[1].endswith(".sh"):
        script = ROOT / tokens[1]
        if tokens[1].startswith(("slurm/", "examples/")):
            assert script.is_file(), tokens[1]
        if tokens[1].startswith("slurm/"):
            config = re.search(r"^launch_training (\S+) ", script.read_text(), re.MULTILINE)
            if config:
                config_file, overrides = config.group(1), tokens[2:]
                if overrides[:1] == ["--config"]:  # another config, named first (slurm/launch.sh)
                    config_file, overrides = overrides[1], overrides[2:]
                load_config(TrainConfig, ROOT / config_file, overrides)


def config_keys(cls, prefix: str = "") -> list[str]:
    """Every key of a config class, list items as ``N``."""
    hints = typing.get_type_hints(cls)
    keys = []
    for field in dataclasses.fields(cls):
        tp, key = hints[field.name], f"{prefix}{field.name}"
        args = [a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)]
        if dataclasses.is_dataclass(tp):
            keys += config_keys(tp, f"{key}.")
        elif typing.get_origin(tp) is list and args:
            keys += [key, *config_keys(args[0], f"{key}.N.")]
        else:
            keys.append(key)
    return keys


def test_every_config_key_is_in_the_reference():
    reference = (ROOT / "docs" / "configuration.md").read_text()
    missing = [key for key in config_keys(TrainConfig) if f"`{key}`" not in reference]
    assert not missing, f"docs/configuration.md does not list {missing}"


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_link_resolves(path):
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name}: {target} does not exist"
        if anchor and linked.suffix == ".md":
            anchors = {heading_anchor(h) for h in re.findall(r"^#+ (.*)$", linked.read_text(), re.MULTILINE)}
            assert anchor in anchors, f"{path.name}: no heading #{anchor} in {linked.name}"


@pytest.mark.parametrize("path", [p for p in DOCS if blocks(p, "python")], ids=lambda p: p.name)
def test_python_examples_run(path):
    for code in blocks(path, "python"):
        if "register_reward" in code:  # the README shows examples/rewards/mentions_city.py, which is its source
            assert code.strip() in (ROOT / "examples" / "rewards" / "mentions_city.py").read_text()
            continue
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{path.name}:\n{code}\n{done.stderr[-2000:]}"


def test_a_config_error_in_a_documented_command_would_be_caught():
    with pytest.raises(ConfigError, match="advantage.mod: unknown key"):
        check_gdpo_command("train", ["--config", "configs/tiny_cpu.yaml", "advantage.mod=grpo"], 1)
    with pytest.raises(AssertionError, match="needs a multiple of 2 processes"):
        check_gdpo_command("convert", ["hf-to-megatron", "a", "b", "--tp", "2"], 1)
