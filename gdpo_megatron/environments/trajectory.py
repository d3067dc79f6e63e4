"""A multi-turn rollout as the rewards receive it: the model's messages, user turn by user turn.

A :class:`Trajectory` names the environment it ran in (a reference
:func:`~gdpo_megatron.environments.registry.environment_class` resolves) and holds, per user
turn, the model's messages in order. A message is a call attempt or a plain answer
(:func:`~gdpo_megatron.environments.calls.call_block`); :meth:`Message.calls` parses it the
same way the rollout did, so the rewards replay exactly the calls the environment ran. The
environment's replies are not stored: environments are deterministic given their config and
the calls (a requirement of the interface), and the rewards replay them in a fresh instance.
``failure`` says why the environment failed the trajectory (raised outside a call, ran past a
step's time limit, its process died): every reward of such a trajectory fails, and is counted.

The multi-turn rewards take a trajectory where single-turn rewards take a completion's text.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gdpo_megatron.environments.calls import Call, CallRefused, call_block, parse_calls


@dataclass(frozen=True)
class Message:
    """One model message of a turn."""

    text: str

    def calls(self) -> list[Call] | CallRefused | None:
        """The message's calls; the refusal when it is a call attempt that does not parse; None
        for a plain answer."""
        block = call_block(self.text)
        if block is None:
            return None
        try:
            return parse_calls(block)
        except CallRefused as e:
            return e


@dataclass(frozen=True)
class Trajectory:
    """The model's messages per user turn, in the environment ``environment``."""

    environment: str
    turns: tuple[tuple[Message, ...], ...]
    failure: str | None = None

    @classmethod
    def from_texts(cls, environment: str, turns: Sequence[Sequence[str]], failure: str | None = None) -> "Trajectory":
        return cls(environment, tuple(tuple(Message(t) for t in turn) for turn in turns), failure)

    @classmethod
    def from_calls(cls, environment: str, turns: Sequence[Sequence[Sequence[str]]]) -> "Trajectory":
        """A trajectory whose messages are call lists (each a list of call strings, as in BFCL's
        ground truth); an empty list is no message."""
        return cls.from_texts(environment, [[f"[{', '.join(step)}]" for step in turn if step] for turn in turns])
