"""The two sandboxed processes of an assert test: the program's server and the test's judge.

The verdict of an assert test must not be the program's to give: a program that exits 0
early, redefines ``exec``, patches builtins or returns an object whose ``__eq__`` is always
true would pass any test run in its own process. So the test runs in another process, the
judge, which the program cannot see (its own sandbox: another PID namespace). The program
process runs the program, then serves calls: the judge's namespace holds, for every
function the program defines, a stub that sends the arguments over a pipe and receives the
return value as plain data (None, bool, int, float, complex, str, bytes, and lists, tuples,
dicts, sets of them). Anything else arrives as an opaque value equal to nothing. The test's
comparisons therefore run on the judge's own objects, with the judge's own builtins, and
the judge writes its verdict to a pipe only it holds. A program can pass only by returning
the right values.

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


class ProgramError(Exception):
    """The program raised, died or broke the protocol during a call (a bug, not a failed test)."""


def encode(value, depth: int = 0):
    """``value`` as JSON-compatible plain data; containers and special numbers are tagged."""
    if depth > 100:
        raise RecursionError("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else ["float", repr(value)]
    if isinstance(value, complex):
        return ["complex", encode(value.real), encode(value.imag)]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray)):
        return ["bytes", bytes(value).hex()]
    for container in (list, tuple, set, frozenset):
        if isinstance(value, container):
            return [container.__name__, [encode(v, depth + 1) for v in value]]
    if isinstance(value, dict):
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    if callable(getattr(value, "tolist", None)):  # numpy scalars and arrays
        return encode(value.tolist(), depth + 1)
    return ["object", type(value).__name__]


def decode(data):
    """The plain value ``data`` (from :func:`encode`) stands for; raises on anything else."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError(f"not an encoded value: {str(data)[:100]}")
    tag, rest = data[0], data[1:]
    if tag == "float" and rest in (["nan"], ["inf"], ["-inf"]):
        return float(rest[0])
    if tag == "complex" and len(rest) == 2:
        return complex(_number(decode(rest[0])), _number(decode(rest[1])))
    if tag == "bytes" and len(rest) == 1 and type(rest[0]) is str:
        return bytes.fromhex(rest[0])
    if tag in ("list", "tuple", "set", "frozenset") and len(rest) == 1 and type(rest[0]) is list:
        return {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}[tag](decode(v) for v in rest[0])
    if tag == "dict" and len(rest) == 1 and type(rest[0]) is list:
        return {decode(k): decode(v) for k, v in (_pair(item) for item in rest[0])}
    if tag == "object" and len(rest) == 1 and type(rest[0]) is str:
        return Opaque(rest[0])
    raise ValueError(f"not an encoded value: {str(data)[:100]}")


class Opaque:
    """A value of the program's that is not plain data: equal to nothing but itself."""

    def __init__(self, type_name: str):
        self.type_name = type_name

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
    _send(responses, {"ready": sorted(name for name, value in namespace.items()
                                      if callable(value) and not name.startswith("__"))})
    for line in requests:
        request = json.loads(line)
        try:
            function = namespace[request["call"]]
            result = function(*[decode(a) for a in request["args"]],
                              **{k: decode(v) for k, v in request["kwargs"].items()})
            reply = {"value": encode(result)}
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
        for name in first["ready"]:
            namespace[name] = _Stub(channel, str(name))
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

    def call(self, name: str, args: tuple, kwargs: dict):
        try:
            _send(self.requests, {"call": name, "args": [encode(a) for a in args],
                                  "kwargs": {k: encode(v) for k, v in kwargs.items()}})
        except (BrokenPipeError, OSError):
            raise ProgramError("the program exited or was killed") from None
        reply = self.receive()
        if "value" in reply:
            try:
                return decode(reply["value"])
            except (ValueError, TypeError, RecursionError) as e:
                raise ProgramError(f"the program sent a malformed value: {e}") from None
        if "raised" in reply:
            raise _raised(str(reply["raised"]), str(reply.get("message", "")))
        raise ProgramError("the program broke the protocol")


class _Stub:
    """Stands for the program's function ``name`` in the test's namespace."""

    def __init__(self, channel: _Channel, name: str):
        self._channel, self.__name__ = channel, name

    def __call__(self, *args, **kwargs):
        return self._channel.call(self.__name__, args, kwargs)

    def __repr__(self) -> str:
        return f"<function {self.__name__} of the program>"


_RAISED_TYPES: dict[str, type] = {}


def _raised(type_name: str, message: str) -> ProgramError:
    """An exception the test can catch as the builtin type the program raised, which is also
    a :class:`ProgramError` (so a program's own AssertionError is a bug, not a failed test)."""
    if type_name not in _RAISED_TYPES:
        base = getattr(builtins, type_name, None)
        try:
            if not (isinstance(base, type) and issubclass(base, Exception)):
                raise TypeError
            _RAISED_TYPES[type_name] = type(type_name, (base, ProgramError), {})
        except TypeError:  # not a builtin exception, or one that cannot be combined
            _RAISED_TYPES[type_name] = type(type_name, (ProgramError,), {})
    return _RAISED_TYPES[type_name](message)


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-1000:]

