"""The user errors: mistakes in what the user gave, as opposed to bugs.

A :class:`UserError`'s message names the config key, argument or file, says what is wrong
and, where it is not obvious, what to do. Checks that do not depend on each other collect their
errors and raise them together (:func:`together`), so one run names every mistake it can see.
Commands print each mistake as one line and exit with status 2
(:mod:`gdpo_megatron.commands.console`); any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

from typing import Sequence


class UserError(Exception):
    """A mistake in the user's input; the message names the key or file and what is wrong."""

    mistakes: tuple["UserError", ...] = ()  # the errors :func:`together` collected into this one

    def lines(self) -> list[str]:
        """One line per mistake (a message's own line breaks folded)."""
        return [" ".join(str(e).split()) for e in self.mistakes or (self,)]


def together(errors: Sequence[UserError]) -> UserError:
    """One error to raise for independent ``errors`` (at least one): the error itself if it is
    alone, else an error of their nearest common class holding each (``mistakes``), one line
    each in its message. A mistake two checks found (the same message) is named once."""
    first: dict[str, UserError] = {}
    for mistake in (m for e in errors for m in (e.mistakes or (e,))):
        first.setdefault(str(mistake), mistake)
    flat = list(first.values())
    if len(flat) == 1:
        return flat[0]
    common = next(c for c in type(flat[0]).__mro__ if all(isinstance(e, c) for e in flat))
    error = common("\n".join(line for e in flat for line in e.lines()))
    error.mistakes = tuple(flat)
    return error


class InputError(UserError, ValueError):
    """A file or argument the user gave is missing, unreadable or malformed."""


class UsageError(UserError, ValueError):
    """A command-line argument is missing or invalid (the commands' argument parser raises it too)."""
