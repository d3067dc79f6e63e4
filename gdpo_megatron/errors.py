"""The user errors: mistakes in what the user gave, as opposed to bugs.

A :class:`UserError`'s message names the config key, argument or file, says what is wrong
and, where it is not obvious, what to do. Commands print it as one line and exit with status 2
(:mod:`gdpo_megatron.commands.console`); any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input; the message names the key or file and what is wrong."""


class InputError(UserError, ValueError):
    """A file or argument the user gave is missing, unreadable or malformed."""


class UsageError(UserError, ValueError):
    """A command-line argument is missing or invalid (the commands' argument parser raises it too)."""
