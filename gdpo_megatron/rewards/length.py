"""Length reward: 1 when the completion fits in ``max_tokens`` tokens, else 0.

Usually conditioned on correctness (``gdpo_megatron.advantages.Condition``) so that a short
wrong answer earns nothing.
"""
from gdpo_megatron.rewards.registry import register_reward


def _check_kwargs(max_tokens: int = 1024) -> None:
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")


@register_reward("length", bounds=(0.0, 1.0), check=_check_kwargs)
def length(completion: str, num_tokens: int, ground_truth: dict, max_tokens: int = 1024) -> float:
    _check_kwargs(max_tokens)
    return 1.0 if num_tokens <= max_tokens else 0.0
