"""GDPO's mechanism on its own: a softmax policy over discrete answers, plain policy gradient.

The policy is one logit per answer (the same for every prompt). Of the 32 answers 3 are
correct (the hard reward), every second one is well formatted (the easy reward) and 2 of the
correct ones are short (length, gated on correctness), so the best answer earns all three. A
step samples ``group_size`` answers for each of ``prompts`` prompts (a group each), turns the
rewards into advantages with :func:`gdpo_megatron.advantages.compute_advantages` and takes a
plain policy-gradient step on the logits. Everything is float64 on a seeded generator; a run
of 150 steps takes about a second.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdpo_megatron.advantages import Condition, compute_advantages
from gdpo_megatron.config.advantage import AdvantageConfig

NUM_ANSWERS = 32
CORRECT = (0, 1, 2)
SHORT = (1, 2)
LENGTH_GATE = Condition(reward=2, gate=0, threshold=1.0)  # length counts only for correct answers


def reward_table() -> torch.Tensor:
    """``[NUM_ANSWERS, 3]`` raw rewards (correct, format, length) of every answer."""
    table = torch.zeros(NUM_ANSWERS, 3, dtype=torch.float64)
    table[list(CORRECT), 0] = 1.0
    table[::2, 1] = 1.0
    table[list(SHORT), 2] = 1.0
    return table


@dataclass
class BanditRun:
    """Probabilities of each reward under the policy, after every step (``[steps + 1]`` each)."""

    correct: torch.Tensor
    format: torch.Tensor
    length: torch.Tensor  # of an answer that is correct and short


def train_bandit(mode: str, seed: int, steps: int = 150, lr: float = 0.1, prompts: int = 8,
                 group_size: int = 8) -> BanditRun:
    """Train the softmax policy from uniform logits with ``mode``'s advantages."""
    generator = torch.Generator().manual_seed(seed)
    table = reward_table()
    gated = table[:, 0] * table[:, 2]
    logits = torch.zeros(NUM_ANSWERS, dtype=torch.float64)
    group_ids = torch.arange(prompts).repeat_interleave(group_size)
    history = []
    for _ in range(steps):
        probs = torch.softmax(logits, dim=0)
        history.append(probs)
        answers = torch.multinomial(probs.expand(prompts, -1), group_size, replacement=True,
                                    generator=generator).flatten()
        advantages = compute_advantages(table[answers], group_ids, conditions=[LENGTH_GATE],
                                        count_distinct=False, config=AdvantageConfig(mode=mode)).advantages
        logits.requires_grad_(True)
        objective = (advantages * torch.log_softmax(logits, dim=0)[answers]).mean()
        (grad,) = torch.autograd.grad(objective, logits)
        logits = (logits + lr * grad).detach()
    history.append(torch.softmax(logits, dim=0))
    probs = torch.stack(history)
    return BanditRun(correct=probs @ table[:, 0], format=probs @ table[:, 1], length=probs @ gated)
