"""The package's layers, as docs/architecture.md states them: imports go downward only, no module
imports itself back through others, and nothing shipped imports the test support.

Layers, top to bottom: entry points (``gdpo_megatron.commands``, ``gdpo_megatron.demo``,
``python -m gdpo_megatron``, and ``gdpo_megatron.integrations``, what other frameworks call)
-> preflight (``gdpo_megatron.preflight``) -> the core (everything else). Every import counts,
also one inside a function.
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gdpo_megatron"
LAYERS = {"entry points": 2, "preflight": 1, "core": 0}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    part = module.split(".")[1] if "." in module else ""
    if part in ("commands", "demo", "__main__", "integrations"):
        return "entry points"
    return "preflight" if part == "preflight" else "core"


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from a import b`` counts a.b if it is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name in modules}


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: imports(path, modules) - {name} for name, path in files.items()}


def test_imports_go_downward_only():
    upward = [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, targets in graph().items() for b in targets
              if LAYERS[layer(b)] > LAYERS[layer(a)]]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = graph()
    # a package's __init__ importing its own submodules is how a package exposes them
    edges = {a: {b for b in targets if not a == b.rpartition(".")[0]} for a, targets in edges.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


def test_the_package_does_not_import_test_support():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if n.split(".")[0] in ("support", "tests")], path
