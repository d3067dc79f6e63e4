"""The package's import rules, as docs/architecture.md states them, checked on the source.

The package is made of units: each subpackage (``gdpo_megatron.config``, ``gdpo_megatron.policy``,
...), each top-level module (``gdpo_megatron.device``, ``gdpo_megatron.trainer``, ...) and the
package's own ``__init__`` (``gdpo_megatron``). :data:`ALLOWED` says which units each one may
import. Every import counts: at the top of a module or inside a function, absolute or
relative, and ``importlib.import_module`` / ``__import__`` of a name of the package (a string,
or an f-string's leading text); a module name computed otherwise is allowed only in the
modules :data:`COMPUTED_IMPORTS` lists. No modules import each other in a circle, where
importing ``a.b.c`` from outside the package ``a.b`` also runs ``a/b/__init__.py`` (and a
package's ``__init__`` importing its submodules counts). :data:`BANNED_LIBRARIES` names the
libraries a unit must not import, and nothing shipped imports the test support.

``test_each_injected_break_fails_its_rule`` runs the checks on a copy of the package with one
rule broken, so that a check that would pass anything fails here.
"""
from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gdpo_megatron"
TOP = "gdpo_megatron"

# The core, bottom up: each unit imports only units listed before it.
_CORE = {
    "errors": set(),
    "exit_status": set(),  # the statuses a scheduler reads
    "config": {"errors"},  # the schema; ConfigError is a UserError
    "device": {"config"},
    "advantages": {"config"},
    "metrics": {"errors"},
    "plot": {"errors", "metrics"},
    "user_files": set(),  # importing a user's Python file (reward functions, environments)
    "worker_processes": set(),  # the forkserver reward and environment workers fork from
    "environments": {"config", "errors", "user_files", "worker_processes"},
    "rewards": {"config", "environments", "errors", "user_files", "worker_processes"},
    "distributed": {"device", "errors"},
    "policy": {"config", "device", "distributed", "errors"},
    "checkpoint": {"config", "device", "errors", "policy"},
    "rollout": {"checkpoint", "config", "device", "errors"},
    "tasks": {"config", "environments", "errors", "rewards"},
    "data": {"config", "environments", "errors", "rewards", "tasks"},
    "quiet": {"rollout"},  # third-party warnings and log levels (the engines' harmless records)
    "run_dir": {"checkpoint", "errors", "metrics"},
    "resolve": {"config", "device", "policy", "rollout"},  # the launch's decisions (the engine sizes its cache)
    "progress": set(),  # the training progress on stderr
    "inputs": {"advantages", "config", "data", "resolve"},
    "trajectories": {"config", "data", "environments", "rollout", "tasks"},
    "experience": {"config", "data", "policy", "rewards", "rollout", "trajectories"},
    "evaluate": {"config", "data", "device", "errors", "resolve", "rewards", "rollout"},
    "evaluate_multi_turn": {"config", "data", "device", "environments", "evaluate", "rewards", "rollout",
                            "trajectories"},
    "trainer": {"advantages", "checkpoint", "config", "data", "device", "distributed", "errors", "exit_status",
                "experience", "inputs", "metrics", "policy", "progress", "quiet", "resolve", "rewards", "rollout",
                "run_dir", "trajectories", "worker_processes"},
}
CORE = set(_CORE)
# Which units each unit may import (its own modules always).
ALLOWED: dict[str, set[str]] = {
    **_CORE,
    # preflight: checks before anything heavy is built: not the model, the loop or its outputs
    # (policy: its cost figures, such as the log-prob step's bytes per logit; it builds no model)
    "preflight": CORE - {"experience", "trainer", "evaluate", "evaluate_multi_turn", "plot"},
    # entry points: what a user or another framework calls
    "integrations": CORE | {"preflight"},
    "commands": CORE | {"preflight", TOP},
    "demo": CORE | {"preflight", "commands", TOP},
    "__main__": {"commands", "errors"},
    # the package's __init__: the advantage API, imported on first use
    TOP: {"advantages", "config"},
}
# Libraries a unit must not import (the name or any module under it).
BANNED_LIBRARIES = {
    "advantages": ("torch.distributed",),  # statistics across ranks go through a Reduction
    "config": ("torch", "megatron", "vllm", "transformers"),  # the schema loads without the stack
}
# Modules that import a module whose name is computed (not written in the source): why.
COMPUTED_IMPORTS = {
    f"{TOP}.preflight.doctor": "the vLLM classes whose reload API it checks",
    f"{TOP}.rollout.vllm_engine": "vLLM's layer-wise reload module, named once in RELOAD_MODULE",
    f"{TOP}.environments.bfcl": "BFCL's backend modules, named by a question's involved classes",
    f"{TOP}.environments.registry": "the built-in environments, named in BUILTIN as a user's file names its own",
}
TEST_SUPPORT = ("support", "tests")


@dataclass(frozen=True)
class Import:
    """``importer`` imports ``target`` (None: a computed name) at ``line``, ``how``: "import" or
    the function called (``import_module``, ``__import__``)."""

    importer: str
    target: str | None
    line: int
    how: str = "import"


def modules(package: Path) -> dict[str, Path]:
    """Module name -> file, for every module of ``package`` (a package is its ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def unit(module: str) -> str:
    """The unit a module of the package belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else TOP


def all_imports(path: Path, name: str) -> list[Import]:
    """Every import in ``path`` (module ``name``), third-party ones included, names as written
    (``from a import b`` gives ``a.b``, the module ``a.b`` or the name ``b`` of ``a``; relative
    imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(name, alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = f"{base}.{node.module}" if node.module else base
            found += [Import(name, f"{module}.{alias.name}", node.lineno) for alias in node.names]
        elif isinstance(node, ast.Call) and _called(node.func) in ("import_module", "__import__") and node.args:
            found.append(Import(name, _literal_name(node.args[0]), node.lineno, _called(node.func)))
    return found


def _called(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _literal_name(arg: ast.expr) -> str | None:
    """The module a call names: a string, or an f-string's leading text up to its last dot."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return arg.values[0].value.rpartition(".")[0] or None
    return None


def package_imports(package: Path) -> list[Import]:
    """The imports of the package's own modules, each target the module it runs (the longest
    prefix of the written name that is a module of the package)."""
    mods = modules(package)
    out = set()
    for name, path in mods.items():
        for imp in all_imports(path, name):
            if imp.target is None or not (imp.target == TOP or imp.target.startswith(TOP + ".")):
                continue
            target = imp.target
            while target not in mods:
                target = target.rpartition(".")[0]
            if target != name:
                out.add(Import(name, target, imp.line, imp.how))
    return sorted(out, key=lambda i: (i.importer, i.line, i.target))


def table_violations(package: Path) -> list[str]:
    """Imports of a unit that :data:`ALLOWED` does not list for the importing unit."""
    return [f"{i.importer} ({unit(i.importer)}) imports {i.target} ({unit(i.target)})"
            + (f" with {i.how}" if i.how != "import" else "") + f", line {i.line}"
            for i in package_imports(package)
            if unit(i.target) != unit(i.importer) and unit(i.target) not in ALLOWED.get(unit(i.importer), set())]


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules its imports run: each target and, for a target in a subpackage the
    importer is not part of, that subpackage's ``__init__`` and its parents' (below the top
    package, whose ``__init__`` imports nothing until an attribute is asked for). A package the
    importer is part of runs nothing: its ``__init__`` ran before the importer."""
    graph: dict[str, set[str]] = {name: set() for name in modules(package)}
    for imp in package_imports(package):
        target = imp.target
        while "." in target and not (imp.importer + ".").startswith(target + "."):
            graph[imp.importer].add(target)
            target = target.rpartition(".")[0]
    return graph


def circles(package: Path) -> list[set[str]]:
    """The sets of modules that import each other in a circle (strongly connected components)."""
    graph = import_graph(package)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def banned_library_imports(package: Path) -> list[str]:
    """Imports of a library that :data:`BANNED_LIBRARIES` keeps out of the importing unit."""
    out = []
    for name, path in modules(package).items():
        for imp in all_imports(path, name):
            for banned in BANNED_LIBRARIES.get(unit(name), ()):
                if imp.target and (imp.target == banned or imp.target.startswith(banned + ".")):
                    out.append(f"{name} imports {imp.target} ({banned} is not for {unit(name)}), line {imp.line}")
    return out


def computed_imports(package: Path) -> list[str]:
    """``import_module`` / ``__import__`` of a computed name outside :data:`COMPUTED_IMPORTS`."""
    return [f"{name} imports a computed module name with {imp.how}, line {imp.line}"
            for name, path in modules(package).items() for imp in all_imports(path, name)
            if imp.target is None and name not in COMPUTED_IMPORTS]


def test_the_table_names_every_unit():
    units = {unit(name) for name in modules(PACKAGE)}
    assert units == set(ALLOWED), f"not in the table: {sorted(units - set(ALLOWED))}; " \
                                  f"no longer in the package: {sorted(set(ALLOWED) - units)}"


def test_the_core_is_layered():
    """Each core unit's allowed imports are listed before it, so the table itself has no circle."""
    order = list(_CORE)
    later = {unit: sorted(allowed - set(order[:order.index(unit)])) for unit, allowed in _CORE.items()}
    assert not {unit: names for unit, names in later.items() if names}


def test_imports_follow_the_table():
    assert not table_violations(PACKAGE), "\n".join(table_violations(PACKAGE))


def test_no_import_circles():
    assert not circles(PACKAGE), "\n".join(" <-> ".join(sorted(c)) for c in circles(PACKAGE))


def test_banned_libraries_stay_out():
    assert not banned_library_imports(PACKAGE), "\n".join(banned_library_imports(PACKAGE))


def test_computed_module_names_only_where_listed():
    assert not computed_imports(PACKAGE), "\n".join(computed_imports(PACKAGE))
    assert all(name in modules(PACKAGE) for name in COMPUTED_IMPORTS)


def test_the_package_does_not_import_test_support():
    found = [f"{name} imports {imp.target}" for name, path in modules(PACKAGE).items()
             for imp in all_imports(path, name) if imp.target and imp.target.split(".")[0] in TEST_SUPPORT]
    assert not found, "\n".join(found)


INJECTIONS = {
    "config imports the plots": (
        "config/policy.py", "from gdpo_megatron.plot import plot_runs\n", table_violations,
        ["gdpo_megatron.config.policy (config) imports gdpo_megatron.plot (plot)"]),
    "the advantage math imports torch.distributed": (
        "advantages.py", "import torch.distributed\n", banned_library_imports,
        ["gdpo_megatron.advantages imports torch.distributed (torch.distributed is not for advantages)"]),
    "a circle through a package's __init__": (
        "config/policy.py", "from gdpo_megatron.device import CPU\n", circles,
        # device -> config (its __init__) -> config.policy -> device, and config.train on the way
        # from config's __init__ to config.policy; without __init__ edges only device <-> config.policy
        [{"gdpo_megatron.config", "gdpo_megatron.config.policy", "gdpo_megatron.config.train",
          "gdpo_megatron.device"}]),
    "the core imports a command by name": (
        "trainer.py", "def _command():\n    import importlib\n\n"
                      "    return importlib.import_module(\"gdpo_megatron.commands.train\")\n", table_violations,
        ["gdpo_megatron.trainer (trainer) imports gdpo_megatron.commands.train (commands) with import_module"]),
}


@pytest.mark.parametrize("injection", INJECTIONS)
def test_each_injected_break_fails_its_rule(tmp_path, injection):
    """On a copy of the package with one line added, the rule's check finds exactly that break."""
    module, text, check, expected = INJECTIONS[injection]
    copy = tmp_path / TOP
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert not check(copy)
    with open(copy / module, "a") as f:
        f.write("\n\n" + text)
    found = check(copy)
    if check is circles:
        assert found == expected
    else:
        assert [line.rpartition(", line ")[0] for line in found] == expected, found
