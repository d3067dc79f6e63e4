"""The task families by name: ``data.family`` and ``gdpo-eval --family`` name one of them."""
from __future__ import annotations

from gdpo_megatron.config.loader import require
from gdpo_megatron.tasks import bfcl_multi_turn, code, math, multi_turn, tool, toolrl
from gdpo_megatron.tasks.task import Task

TASKS: dict[str, Task] = {task.name: task for task in (math.TASK, tool.TASK, code.TASK, toolrl.TASK,
                                                       bfcl_multi_turn.TASK, multi_turn.TASK)}


def task_names() -> tuple[str, ...]:
    return tuple(TASKS)


def get_task(name: str, key: str = "family") -> Task:
    """The task called ``name``; a ConfigError naming ``key`` and the known names if there is none."""
    require(name in TASKS, key, f"one of {task_names()}", name)
    return TASKS[name]
