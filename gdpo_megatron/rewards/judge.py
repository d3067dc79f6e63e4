"""The two sandboxed processes of an assert test: the program's server and the test's judge.

The verdict of an assert test must not be the program's to give: a program that exits 0
early, redefines ``exec``, patches builtins or returns an object whose ``__eq__`` is always
true would pass any test run in its own process. So the test runs in another process, the
judge, which the program cannot see (its own sandbox: another PID namespace, or at the basic
level as root another user; ``sandbox.isolation()`` says whether runs are kept apart). The program
process runs the program, then serves calls: the judge's namespace holds, for every
function and class the program defines (except those named like a builtin: the test's
``range``, ``abs`` or ``sorted`` stay Python's), a stub that sends the arguments over a pipe and
receives the return value as plain data (None, bool, int, float, complex, str, bytes, and
lists, tuples, dicts, sets of them). Any other value stays in the program's process; the
judge gets a handle whose methods it can call (``Solution().two_sum(...)``) and which equals
nothing but itself. The test's comparisons therefore run on the judge's own objects, with
the judge's own builtins, and the judge writes its verdict to a pipe only it holds. A
program can pass only by returning the right values.

This file runs inside the sandbox's interpreter (standard library only); ``serve`` and
``judge`` are its entry points, called at the end of ``main.py``.
"""
from __future__ import annotations

import builtins
import json
import math
import os
import traceback

_SOLUTION, _TEST = "solution.py", "test.py"
_MAX_MESSAGE = 1 << 26  # bytes of one message the judge accepts
_MAX_DECIMAL_BITS = 4096  # larger ints travel as hex text


class ProgramError(Exception):
    """The program raised, died or broke the protocol during a call (a bug, not a failed test)."""


def encode(value, keep: list | None = None, depth: int = 0):
    """``value`` as JSON-compatible plain data; containers, special numbers and large ints are tagged.

    Another value becomes a handle: appended to ``keep`` (program side), or the handle it
    came as (judge side).
    """
    if depth > 100:
        raise RecursionError("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if isinstance(value, int):
        value = int(value)
        # Decimal text of more than 4300 digits is refused by int() and str(); hex has no limit.
        return value if value.bit_length() <= _MAX_DECIMAL_BITS else ["int", hex(value)]
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else ["float", repr(value)]
    if isinstance(value, complex):
        return ["complex", float(value.real), float(value.imag)]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    for container in (list, tuple, set, frozenset):
        if isinstance(value, container):
            return [container.__name__, [encode(v, keep, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[encode(k, keep, depth + 1), encode(v, keep, depth + 1)] for k, v in value.items()]]
    if isinstance(value, Handle):
        return ["handle", value.handle_id, value.type_name]
    if callable(getattr(value, "tolist", None)):  # numpy scalars and arrays
        return encode(value.tolist(), keep, depth + 1)
    if keep is None:
        raise TypeError(f"cannot send a {type(value).__name__} to the program")
    keep.append(value)
    return ["handle", len(keep) - 1, type(value).__name__]


def decode(data, resolve):
    """The value ``data`` (from :func:`encode`) stands for; raises on anything malformed.
    ``resolve(handle id, type name)`` gives what a handle stands for."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"not an encoded value: {str(data)[:100]}")
    tag, rest = data[0], data[1:]
    if tag == "float" and rest in (["nan"], ["inf"], ["-inf"]):
        return float(rest[0])
    if tag == "int" and len(rest) == 1 and type(rest[0]) is str:
        return int(rest[0], 16)
    if tag == "complex" and len(rest) == 2:
        return complex(_number(rest[0]), _number(rest[1]))
    if tag == "bytes" and len(rest) == 1 and type(rest[0]) is str:
        return bytes.fromhex(rest[0])
    if tag in ("list", "tuple", "set", "frozenset") and len(rest) == 1 and type(rest[0]) is list:
        kind = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag]
        return kind(decode(v, resolve) for v in rest[0])
    if tag == "dict" and len(rest) == 1 and type(rest[0]) is list:
        return {decode(k, resolve): decode(v, resolve) for k, v in (_pair(item) for item in rest[0])}
    if tag == "handle" and len(rest) == 2 and type(rest[0]) is int and type(rest[1]) is str:
        return resolve(rest[0], rest[1])
    raise ValueError(f"not an encoded value: {str(data)[:100]}")


class Handle:
    """A value that stays in the program's process (judge side): its methods can be called;
    it equals nothing but itself."""

    def __init__(self, channel: "_Channel", handle_id: int, type_name: str):
        self._channel, self.handle_id, self.type_name = channel, handle_id, type_name

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(self._channel, name, self.handle_id)

    def __repr__(self) -> str:
        return f"<{self.type_name} object of the program>"


def _number(x):
    if type(x) not in (int, float):
        raise ValueError("complex parts must be numbers")
    return x


def _pair(item):
    if type(item) is not list or len(item) != 2:
        raise ValueError("dict items must be pairs")
    return item


def _send(stream, message) -> None:
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


def serve(requests_fd: int, responses_fd: int) -> None:
    """Program side: run ``solution.py`` (as module ``solution``), then answer calls until
    the judge closes the pipe."""
    requests, responses = os.fdopen(requests_fd, "rb"), os.fdopen(responses_fd, "wb")
    namespace = {"__name__": "solution", "__builtins__": builtins}
    try:
        with open(_SOLUTION, encoding="utf-8") as f:
            exec(compile(f.read(), _SOLUTION, "exec"), namespace)
    except BaseException as e:  # SystemExit included: the program ended before it could be tested
        _send(responses, {"failed": _describe(e)})
        raise
    kept: list = []

    def resolve(handle_id, _):
        return kept[handle_id]

    _send(responses, {"ready": {name: sorted(m for m in dir(value) if not m.startswith("_"))
                                if isinstance(value, type) else None
                                for name, value in namespace.items() if callable(value) and not name.startswith("__")}})
    for line in requests:
        request = json.loads(line)
        try:
            if request["on"] is None:
                function = namespace[request["call"].split(".")[0]]
                for attribute in request["call"].split(".")[1:]:
                    function = getattr(function, attribute)
            else:
                function = getattr(kept[request["on"]], request["call"])
            result = function(*[decode(a, resolve) for a in request["args"]],
                              **{k: decode(v, resolve) for k, v in request["kwargs"].items()})
            reply = {"value": encode(result, kept)}
        except BaseException as e:
            reply = {"raised": type(e).__name__, "message": _describe(e)}
        _send(responses, reply)


def judge(requests_fd: int, responses_fd: int, verdict_fd: int) -> None:
    """Test side: run ``test.py`` with a stub for every function the program defines, then
    write ``passed``, ``failed`` (an assertion of the test failed) or ``error`` (the program
    raised, died, could not be called, or the test hit an error on its values) to ``verdict_fd``."""
    verdict = os.fdopen(verdict_fd, "w")
    try:
        channel = _Channel(os.fdopen(requests_fd, "wb"), os.fdopen(responses_fd, "rb"))
        first = channel.receive()
        if "ready" not in first:
            raise ProgramError(f"the program did not run to its end: {first.get('failed', first)}")
        namespace = {"__name__": "__test__"}
        for name, members in first["ready"].items():
            if name.isidentifier() and not name.startswith("__") and name not in vars(builtins):
                namespace[name] = _Stub(channel, name, members=members)
        with open(_TEST, encoding="utf-8") as f:
            exec(compile(f.read(), _TEST, "exec"), namespace)
        outcome = {"verdict": "passed"}
    except BaseException as e:
        failed = isinstance(e, AssertionError) and not isinstance(e, ProgramError)
        outcome = {"verdict": "failed" if failed else "error", "detail": _describe(e)}
    verdict.write(json.dumps(outcome))
    verdict.close()


class _Channel:
    def __init__(self, requests, responses):
        self.requests, self.responses = requests, responses

    def receive(self) -> dict:
        line = self.responses.readline(_MAX_MESSAGE)
        if not line.endswith(b"\n"):
            raise ProgramError("the program exited or was killed")
        message = json.loads(line)
        if type(message) is not dict:
            raise ProgramError("the program broke the protocol")
        return message

    def call(self, name: str, on: int | None, args: tuple, kwargs: dict):
        request = {"call": name, "on": on, "args": [encode(a) for a in args],
                   "kwargs": {k: encode(v) for k, v in kwargs.items()}}
        try:
            _send(self.requests, request)
        except (BrokenPipeError, OSError):
            raise ProgramError("the program exited or was killed") from None
        reply = self.receive()
        if "value" in reply:
            try:
                return decode(reply["value"], lambda handle_id, type_name: Handle(self, handle_id, type_name))
            except (ValueError, TypeError, RecursionError, KeyError) as e:
                raise ProgramError(f"the program sent a malformed value: {e}") from None
        if "raised" in reply:
            raise _raised(str(reply["raised"]), str(reply.get("message", "")))
        raise ProgramError("the program broke the protocol")


class _Stub:
    """Stands for the program's function or class ``name`` in the test's namespace (or, with
    ``on``, for a method of a value kept in the program's process). A class's stub has its
    public members (``hasattr(Solution, "two_sum")``)."""

    def __init__(self, channel: _Channel, name: str, on: int | None = None, members: list | None = None):
        self._channel, self.__name__, self._on, self._members = channel, name, on, members or []

    def __getattr__(self, name: str):
        if name in self.__dict__.get("_members", ()):
            return _Stub(self._channel, f"{self.__name__}.{name}")
        raise AttributeError(name)

    def __call__(self, *args, **kwargs):
        return self._channel.call(self.__name__, self._on, args, kwargs)

    def __repr__(self) -> str:
        return f"<function {self.__name__} of the program>"


_RAISED_TYPES: dict[str, type] = {}


def _raised(type_name: str, message: str) -> ProgramError:
    """An exception the test can catch as the builtin type the program raised, which is also
    a :class:`ProgramError` (so a program's own AssertionError is a bug, not a failed test).
    Not a StopIteration: raised from a call inside ``map`` or ``next(it, default)``, it would
    end the test's iteration early instead of failing it."""
    if type_name not in _RAISED_TYPES:
        base = getattr(builtins, type_name, None)
        try:
            if not (isinstance(base, type) and issubclass(base, Exception)) or issubclass(
                    base, (StopIteration, StopAsyncIteration)):
                raise TypeError
            _RAISED_TYPES[type_name] = type(type_name, (base, ProgramError), {})
        except TypeError:  # not a builtin exception, a StopIteration, or one that cannot be combined
            _RAISED_TYPES[type_name] = type(type_name, (ProgramError,), {})
    return _RAISED_TYPES[type_name](message)


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-1000:]

