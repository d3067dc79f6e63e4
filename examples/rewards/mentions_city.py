"""A reward of your own: 1 when the completion names the city the reference call asks about.

Listed in a config's ``rewards.reward_files``; ``rewards.rewards`` then uses it by name. The
function gets the completion text, its token count and the sample's ground truth (for the
``tool`` family: the reference ``tool_calls``); ``bounds`` are the values it returns, and a
call that fails scores the lower one.
"""
from gdpo_megatron.rewards import register_reward


@register_reward("mentions_city", bounds=(0.0, 1.0))
def mentions_city(completion: str, num_tokens: int, ground_truth: dict) -> float:
    cities = {call["arguments"].get("city") for call in ground_truth.get("tool_calls", [])
              if isinstance(call.get("arguments"), dict)}
    return float(any(city and city in completion for city in cities))
