"""One trajectory's episode through its environment, message by message: what a model's message
means and what follows it.

An :class:`Episode` holds a trajectory's environment (an
:class:`~gdpo_megatron.environments.host.EnvironmentHost`, its reset already answered), the chat
so far, the question's later user turns and the model's messages per user turn; it decides, for
each model message, which messages come next or why the trajectory ends:

* a **call** in the message (:meth:`Message.calls`) is parsed as data and stepped in the
  environment (:meth:`Episode.send_calls` sends it, so a caller can send every episode's step
  before it reads any); the observation (the calls' results, or why the message did not
  parse) follows as a ``tool`` message;
* a **plain answer** ends the user turn: the question's next user message follows, with the
  environment's ``start_turn`` note; after the last user turn the trajectory ends
  (``answered``). So does a user turn of ``max_steps_per_turn`` messages (the last one's calls
  still run; ``turn_limit`` after the last user turn), and ``max_steps`` messages in all
  (``max_steps``, where a caller sets one);
* a step after which the environment is ``done`` ends the trajectory (``answered``, as an
  answer to the last user turn would);
* an environment that fails ends it with ``failure`` set (``failed``).

Tokens are the callers' (:mod:`gdpo_megatron.trajectories`, the NeMo-RL multi-turn environment):
each renders the messages that follow under its chat template, ends the episode for its token
budget (:meth:`Episode.end`) or a template that cannot be continued (:meth:`Episode.fail`), and
otherwise records the model's reply and the new messages in the chat (:meth:`Episode.extend`).
Text that UTF-8 cannot encode (a lone surrogate a call's JSON asked for) is backslash-escaped
in what the environment writes, as tokenizers raise on it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from gdpo_megatron.environments.calls import Call, CallRefused
from gdpo_megatron.environments.environment import ERROR_PREFIX
from gdpo_megatron.environments.host import EnvironmentFailed, EnvironmentHost
from gdpo_megatron.environments.trajectory import Message, Trajectory

Ending = Literal["answered", "turn_limit", "max_steps", "token_budget", "failed"]


class Episode:
    """Trajectory of ``environment`` (its reference) in progress through ``host``, from the prompt
    ``chat`` through the user messages of ``later_turns``; ``max_steps`` (None: no limit) bounds
    the model's messages in all."""

    def __init__(self, environment: str, host: EnvironmentHost | None, chat: list[dict],
                 later_turns: Sequence[Sequence[dict]], max_steps_per_turn: int, max_steps: int | None = None):
        self.environment, self.host, self.chat = environment, host, chat
        self.later_turns = list(later_turns)
        self.max_steps_per_turn, self.max_steps = max_steps_per_turn, max_steps
        self.messages: list[list[str]] = [[]]  # the model's, per user turn
        self.steps = 0
        self.steps_in_turn = 0
        self.ending: Ending | None = None
        self.failure: str | None = None

    def send_calls(self, text: str) -> list[Call] | CallRefused | None:
        """The calls of the model's message ``text`` (None for a plain answer), sent to be stepped."""
        calls = Message(text).calls()
        if calls is not None and not isinstance(calls, CallRefused):
            self.host.send("step", calls)
        return calls

    def advance(self, text: str, calls: list[Call] | CallRefused | None) -> list[dict] | None:
        """The messages that follow the model's message ``text`` and the step of its ``calls``
        (:meth:`send_calls`), or None when the trajectory ends here (:attr:`ending` says why)."""
        if self.ending is not None:
            return None
        self.messages[-1].append(text)
        self.steps += 1
        self.steps_in_turn += 1
        new: list[dict] = []
        if calls is not None:
            if isinstance(calls, CallRefused):
                observation = f"{ERROR_PREFIX}{calls}"
            else:
                try:
                    result = self.host.receive()
                except EnvironmentFailed as error:
                    return self.fail(str(error))
                if result.done:
                    return self.end("answered")
                observation = result.observation
            new.append({"role": "tool", "content": _encodable(observation)})
        if calls is None or self.steps_in_turn >= self.max_steps_per_turn:
            turn = len(self.messages)
            if turn > len(self.later_turns):
                return self.end("answered" if calls is None else "turn_limit")
            try:
                note = self.host.start_turn(turn)
            except EnvironmentFailed as error:
                return self.fail(str(error))
            user = [dict(m) for m in self.later_turns[turn - 1]]
            if note:
                user[-1] = {**user[-1], "content": _encodable(f"{user[-1]['content']}\n\n{note}")}
            new += user
            self.messages.append([])
            self.steps_in_turn = 0
        if self.max_steps is not None and self.steps >= self.max_steps:
            return self.end("max_steps")
        return new

    def extend(self, reply: str, new: list[dict]) -> None:
        """Record the model's ``reply`` (as the chat template shows it) and the ``new`` messages
        that follow it (:meth:`advance`'s) in the chat."""
        self.chat += [{"role": "assistant", "content": reply}, *new]

    def end(self, ending: Ending) -> None:
        """End the trajectory here; its environment goes back."""
        self.ending = ending
        self.close()

    def fail(self, why: str) -> None:
        """End the trajectory as failed, for ``why``."""
        self.failure = why
        self.end("failed")

    def close(self) -> None:
        """Give the environment back (idempotent)."""
        if self.host is not None:
            self.host.close()
            self.host = None

    def trajectory(self) -> Trajectory:
        """What the multi-turn rewards judge: the model's messages per user turn, less a user turn
        fed in but never answered."""
        messages = list(self.messages)
        while len(messages) > 1 and not messages[-1]:
            messages.pop()
        return Trajectory.from_texts(self.environment, messages, self.failure)


def _encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) backslash-escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
