"""``tool_correctness == 3`` next to BFCL's own checker (bfcl-eval's ``ast_checker``).

    python benchmarks/bfcl_agreement.py

On every question of the single-turn categories the project loads, for the listed answers and
the edits of tests/bfcl_reference.py. Prints the agreement per category and per edit, every
disagreement, and the questions whose own first listed answer BFCL rejects.
"""
from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import bfcl_reference  # noqa: E402

from gdpo_megatron.data.bfcl import load_bfcl  # noqa: E402
from gdpo_megatron.rewards.tool_call import tool_correctness  # noqa: E402


def main() -> None:
    checker = bfcl_reference.load_ast_checker()
    samples = load_bfcl()
    start = time.monotonic()
    table, disagreements, contradictions = defaultdict(Counter), [], []
    for sample in samples:
        for edit, calls in bfcl_reference.perturbations(sample).items():
            ours = tool_correctness(bfcl_reference.completion(calls), 0, sample.ground_truth) == 3.0
            reference = bfcl_reference.bfcl_valid(checker, sample, calls)
            kind = "one argument omitted" if edit.endswith(" omitted") and edit.startswith("call ") else edit
            for key in (sample.metadata["category"], f"edit: {kind}", "all"):
                table[key].update(calls=1, ours=int(ours), reference=int(reference), agree=int(ours == reference))
            if ours != reference:
                disagreements.append((sample.id, edit, ours, reference))
            if edit == "first listed values" and not reference:
                contradictions.append(sample.id)
    print(f"{len(samples)} questions, {table['all']['calls']} call sets, {time.monotonic() - start:.0f} s\n")
    print("| call sets | n | tool_correctness = 3 | BFCL valid | agree |")
    print("|---|---|---|---|---|")
    for key in sorted(table, key=lambda k: (k == "all", k.startswith("edit"), k)):
        c = table[key]
        print(f"| {key} | {c['calls']} | {c['ours']} | {c['reference']} | {c['agree']} ({c['agree'] / c['calls']:.3%}) |")
    print("\ndisagreements:")
    for sample_id, edit, ours, reference in disagreements:
        print(f"  {sample_id} ({edit}): tool_correctness {'exact' if ours else 'not exact'}, BFCL {'valid' if reference else 'invalid'}")
    print(f"\nfirst listed answer rejected by BFCL itself ({len(contradictions)}): {', '.join(contradictions)}")


if __name__ == "__main__":
    main()
