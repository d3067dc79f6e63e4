"""`make demo`: the paper's worked example, GRPO vs GRPO without std vs GDPO, side by side.

Two prompts, two rollouts each, two binary rewards. The reward totals are (0, 1) for the
first prompt and (0, 2) for the second: GRPO gives both the same advantages, GDPO keeps
the stronger signal of the second prompt.
"""
import torch

from gdpo_megatron.advantages import compute_advantages
from gdpo_megatron.config.advantage import AdvantageConfig

REWARDS = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]])
PROMPTS = torch.tensor([0, 0, 1, 1])


def worked_example() -> str:
    header = f"{'prompt':>6} {'rollout':>7} {'rewards':>9} {'total':>5} | {'GRPO':>8} {'GRPO w/o std':>12} {'GDPO':>8} {'GDPO+BN':>8}"
    results = {
        "grpo": compute_advantages(REWARDS, PROMPTS, config=AdvantageConfig(mode="grpo")),
        "grpo_no_std": compute_advantages(REWARDS, PROMPTS, config=AdvantageConfig(mode="grpo_no_std")),
        "gdpo": compute_advantages(REWARDS, PROMPTS, config=AdvantageConfig(mode="gdpo", batch_norm=False)),
        "gdpo_bn": compute_advantages(REWARDS, PROMPTS, config=AdvantageConfig(mode="gdpo")),
    }
    lines = [header, "-" * len(header)]
    for i, (row, prompt) in enumerate(zip(REWARDS.tolist(), PROMPTS.tolist())):
        values = " ".join(f"{results[m].advantages[i].item():>{w}.4f}" for m, w in
                          [("grpo", 8), ("grpo_no_std", 12), ("gdpo", 8), ("gdpo_bn", 8)])
        lines.append(f"{prompt:>6} {i % 2:>7} {str(tuple(int(v) for v in row)):>9} {int(sum(row)):>5} | {values}")
    distinct = {m: len({round(v, 3) for v in r.advantages.tolist()}) for m, r in results.items()}
    lines.append("")
    lines.append(f"distinct advantage values over the batch (to 3 decimals): GRPO {distinct['grpo']}, "
                 f"GRPO w/o std {distinct['grpo_no_std']}, GDPO {distinct['gdpo']}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(worked_example())
