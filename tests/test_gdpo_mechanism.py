"""GDPO's benefit on its own: a softmax policy over 32 answers with one hard and two easy rewards."""
import math

import pytest
import torch

from gdpo_megatron.advantages import compute_advantages
from gdpo_megatron.config import AdvantageConfig
from gdpo_megatron.demo.bandit import LENGTH_GATE, NUM_ANSWERS, reward_table, train_bandit

SEEDS = range(8)
MODES = ("gdpo", "grpo", "grpo_no_std")


def test_reward_table_has_the_papers_shape():
    table = reward_table()
    correct, formatted, short = table.unbind(dim=1)
    assert table.shape == (NUM_ANSWERS, 3)
    assert correct.sum() == 3 and formatted.sum() == NUM_ANSWERS / 2  # hard, easy
    assert (short <= correct).all()  # only correct answers are short
    # correct-and-formatted and correct-but-unformatted answers both exist
    assert {int(f) for f in formatted[correct == 1]} == {0, 1}


def test_grpo_merges_what_gdpo_keeps_apart():
    # A group of 8: one correct but unformatted answer, three wrong formatted ones, four wrong
    # unformatted ones (rewards: correct, format, length).
    rewards = torch.tensor([[1.0, 0, 0]] + [[0, 1.0, 0]] * 3 + [[0, 0, 0]] * 4)
    ids = torch.zeros(8, dtype=torch.long)
    grpo = compute_advantages(rewards, ids, conditions=[LENGTH_GATE], config=AdvantageConfig(mode="grpo")).advantages
    gdpo = compute_advantages(rewards, ids, conditions=[LENGTH_GATE],
                              config=AdvantageConfig(mode="gdpo", batch_norm=False)).advantages
    assert torch.isclose(grpo[0], grpo[1])  # both total 1
    # GDPO (before the batch step): each reward's z-score in the group, summed. The one correct
    # answer's own z-score (1 - 1/8) / sqrt(1/8) = 2.47 outweighs format's spread.
    z_correct = (1 - 1 / 8) / math.sqrt(1 / 8 * 7 / 8 * 8 / 7), -(1 / 8) / math.sqrt(1 / 8 * 7 / 8 * 8 / 7)
    std_format = math.sqrt(3 / 8 * 5 / 8 * 8 / 7)
    z_format = (1 - 3 / 8) / std_format, -(3 / 8) / std_format
    assert gdpo[0].item() == pytest.approx(z_correct[0] + z_format[1], abs=1e-3)  # 1.75
    assert gdpo[1].item() == pytest.approx(z_correct[1] + z_format[0], abs=1e-3)  # 0.85


def test_gdpo_learns_the_hard_reward_faster_than_both_grpo_modes():
    runs = {m: [train_bandit(m, seed, steps=60, lr=0.25) for seed in SEEDS] for m in MODES}
    for m in MODES:
        for run in runs[m]:  # every run starts uniform: 3 correct answers of 32
            assert abs(run.correct[0].item() - 3 / NUM_ANSWERS) < 1e-12
    final = {m: torch.stack([r.correct[-1] for r in runs[m]]) for m in MODES}
    # Same seed, same first batch: a paired comparison. Measured gaps are 0.15-0.3 per seed;
    # margins leave room for a rare sample that a different CPU draws differently.
    for other in ("grpo", "grpo_no_std"):
        gap = final["gdpo"] - final[other]
        assert (gap > 0.05).all(), (other, gap)
        assert gap.mean() > 0.12, (other, gap)
    assert final["gdpo"].mean() > 0.4  # from 0.094
