"""Two text rewards that vary on a random model's completions, for the reference run."""
from gdpo_megatron.rewards.registry import register_reward


@register_reward("distinct_chars", bounds=(0.0, 1.0))
def distinct_chars(completion, num_tokens, ground_truth):
    """Share of distinct characters in the completion."""
    return len(set(completion)) / max(len(completion), 1)


@register_reward("vowel_share", bounds=(0.0, 1.0))
def vowel_share(completion, num_tokens, ground_truth):
    """Share of the completion's characters that are vowels."""
    return sum(c in "aeiou" for c in completion) / max(len(completion), 1)
