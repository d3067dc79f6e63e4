"""The ``bfcl_multi_turn`` task: BFCL's multi-turn questions, answered against its environments.

Ground truth (the field ``multi_turn``), a dict:

* ``environment_config``: the question's BFCL environment config (involved classes, initial
  state, long context, excluded and missed functions; :mod:`gdpo_megatron.environments.bfcl`);
* ``reference_calls``: per user turn, the reference calls as BFCL call strings;
* ``later_turns``: the user messages of the turns after the first (the prompt is the first).

The rollouts of this family step through the ``bfcl`` environment; its rewards are the
multi-turn ones (:mod:`gdpo_megatron.rewards.multi_turn`). A question whose reference calls do
not fit its own functions (replayed, :func:`~gdpo_megatron.environments.judge.check_reference`
refuses one of them) is left out. The instructions are BFCL's prompting system prompt with the functions shown at the first
turn.
"""
from __future__ import annotations

import json
from typing import Any

from gdpo_megatron.environments.bfcl import available_tools, check_config
from gdpo_megatron.environments.judge import ReferenceRefused, check_reference
from gdpo_megatron.tasks.multi_turn import REWARDS, check_fields, check_turns
from gdpo_megatron.tasks.task import Task, UnusableGroundTruth

SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose.\n"
    "If none of the functions can be used, point it out. If the given question lacks the parameters required by "
    "the function, also point it out.\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in a response that calls functions.\n\n"
    "At each turn, you should try your best to complete the tasks requested by the user within the current turn. "
    "Continue to output functions to call until you have fulfilled the user's request to the best of your "
    "ability. Once you have no more functions to call, answer in plain text: the system will consider the "
    "current turn complete and proceed to the next turn or task.\n\n"
    "Here is a list of functions in JSON format that you can invoke.\n{functions}\n"
)


def parse_ground_truth(value: Any, key: str, row: dict, where: str) -> dict:
    check_fields(value, key, where)
    try:
        check_config(value["environment_config"])
    except ValueError as e:
        raise ValueError(f"{where}: {key}.environment_config: {e}") from None
    check_turns(value, key, where)
    try:
        check_reference("bfcl", value["environment_config"], value["reference_calls"])
    except ReferenceRefused as e:
        raise UnusableGroundTruth(f"{where}: {e}", "reference calls that do not fit the question's functions") \
            from None
    return dict(value)


def instructions(ground_truth: dict) -> str:
    tools = available_tools(ground_truth["environment_config"], 0)
    return SYSTEM_PROMPT.format(functions=json.dumps(tools, ensure_ascii=False))


TASK = Task(
    name="bfcl_multi_turn",
    ground_truth_keys=("multi_turn",),
    parse_ground_truth=parse_ground_truth,
    instructions=instructions,
    rewards=REWARDS,
    environment="bfcl",
    multi_turn=True,
)
