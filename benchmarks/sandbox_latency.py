"""Wall time of one sandboxed run of a trivial program, per setup here, and of the level probe.

    python benchmarks/sandbox_latency.py [--repeats 40]

A code reward runs one sandboxed program per test case (two per assert test: the program and
its judge), so this is the floor of its cost per test case. It prints the conditions it ran
under (CPUs, kernel, the load average before and after): on a loaded machine the median
measures the contention as much as the sandbox, and the fastest run is the closer bound.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

from gdpo_megatron.rewards import sandbox


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    bwrap = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip() or "no bwrap"
    print(f"{os.cpu_count()} CPUs, kernel {platform.release()}, {bwrap}, uid {os.geteuid()}, "
          f"load average {_load()} before")
    start = time.perf_counter()
    strongest = sandbox.isolation()
    print(f"probe of the strongest level ({strongest.level}): {(time.perf_counter() - start) * 1000:.0f} ms")
    setups = {"basic, own namespaces" if sandbox.isolation("basic").setup.namespaces else "basic":
              sandbox.isolation("basic").setup, "basic, host namespaces": sandbox.Setup("basic")}
    if sandbox.bwrap_missing() is None:
        setups = {"bwrap": strongest.setup, **setups}
    limits = sandbox.SandboxLimits(wall_s=30.0)
    print(f"programs run {sandbox.programs_python()}")
    for name, setup in setups.items():
        times = []
        for i in range(args.repeats + 1):  # the first is a warm-up
            began = time.perf_counter()
            result = sandbox.SandboxedRun({"main.py": "print(1)"}, "", limits, setup).finish(time.monotonic() + 30)
            assert result.ok, result
            times.append(time.perf_counter() - began)
        times = times[1:]
        print(f"{name}: median {statistics.median(times) * 1000:.1f} ms, fastest {min(times) * 1000:.1f} ms per run")
    print(f"load average {_load()} after")


def _load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
