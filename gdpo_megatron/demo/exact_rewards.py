"""``tool_exact``: 1 when the completion's calls are exactly the expected ones, else 0.

A reward file (``rewards.reward_files`` in ``configs/tiny_cpu_exact.yaml``): exact means a
``tool_correctness`` of 3, the same test as BFCL accuracy (every expected call once, no extra
call, every argument present with its expected value, no extra argument).
"""
from gdpo_megatron.rewards.registry import register_reward
from gdpo_megatron.rewards.tool_call import MAX_CORRECTNESS, tool_correctness


@register_reward("tool_exact")
def tool_exact(completion: str, num_tokens: int, ground_truth: dict) -> float:
    return 1.0 if tool_correctness(completion, num_tokens, ground_truth) == MAX_CORRECTNESS else 0.0
