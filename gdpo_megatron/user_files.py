"""Importing a user's Python file (custom rewards, environments) once per process.

The module is named from the file's resolved path under a namespace (so two files with the same
stem do not collide, and the same file imported twice is the same module); a file that fails
on import leaves nothing behind, so that a corrected file can be imported again.
"""
from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_user_file(path: str | Path, namespace: str, what: str) -> ModuleType:
    """The module of the Python file ``path`` (imported on the first call); ``what`` names the
    kind of file in errors ("reward file")."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    module_name = f"{namespace}.{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{what} {path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
