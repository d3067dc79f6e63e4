"""Wall time of one sandboxed run of a trivial program, per setup here, and of the level probe.

    python benchmarks/sandbox_latency.py [--repeats 40]

A code reward runs one sandboxed program per test case (two per assert test: the program and
its judge), so this is the floor of its cost per test case.
"""
from __future__ import annotations

import argparse
import time

from timing import median_time

from gdpo_megatron.rewards import sandbox


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    start = time.perf_counter()
    strongest = sandbox.isolation()
    print(f"probe of the strongest level ({strongest.level}): {(time.perf_counter() - start) * 1000:.0f} ms")
    setups = {"basic, own namespaces" if sandbox.isolation("basic").setup.namespaces else "basic":
              sandbox.isolation("basic").setup, "basic, host namespaces": sandbox.Setup("basic")}
    if sandbox.bwrap_missing() is None:
        setups = {"bwrap": strongest.setup, **setups}
    limits = sandbox.SandboxLimits(wall_s=30.0)
    for name, setup in setups.items():
        def one_run():
            result = sandbox.SandboxedRun({"main.py": "print(1)"}, "", limits, setup).finish(time.monotonic() + 30)
            assert result.ok, result
        print(f"{name}: median {median_time(one_run, args.repeats) * 1000:.1f} ms per run")


if __name__ == "__main__":
    main()
