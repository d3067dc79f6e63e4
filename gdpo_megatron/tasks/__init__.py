"""Task families: what each kind of prompt data holds, tells the model and is scored by.

A family is one :class:`~gdpo_megatron.tasks.task.Task` in its own module (``math``, ``tool``,
``code``, ``toolrl``), listed in :mod:`gdpo_megatron.tasks.registry`; its reward functions are
registered by :mod:`gdpo_megatron.rewards`.
"""
from gdpo_megatron.tasks.registry import TASKS, get_task, task_names
from gdpo_megatron.tasks.task import Task, UnusableGroundTruth

__all__ = ["TASKS", "Task", "UnusableGroundTruth", "get_task", "task_names"]
