"""The two sandboxed processes of an assert test: the program's server and the test's judge.

The verdict of an assert test must not be the program's to give: a program that exits 0
early, redefines ``exec``, patches builtins or returns an object whose ``__eq__`` is always
true would pass any test run in its own process. So the test runs in another process, the
judge, which the program cannot see (its own sandbox: another PID namespace, or at the basic
level as root another user; ``sandbox.isolation()`` says whether runs are kept apart). The program
process runs the program (as module ``solution``), then serves requests: the judge's namespace
holds, for every function and class the program defines (except those named like a builtin:
the test's ``range``, ``abs`` or ``sorted`` stay Python's), a handle whose calls go over a pipe.

Values cross as plain data, rebuilt from the judge's own types: None, bool, int, float,
complex, str, bytes, ``Fraction``, ``Decimal``, ``range``, ``deque``, lists, tuples, dicts, sets
and dict views of them. A subclass of a container (a namedtuple, a ``Counter``) arrives as the
container with the program's object behind it, for the attributes the container lacks
(``point.x``, ``counts.most_common()``). Any other value stays in the program's process and
the judge gets a :class:`Handle`: reading an attribute fetches it (a plain value, or another
handle), calling it calls it, ``len``, ``bool``, indexing and iteration ask the program, and an
iterator (a generator, ``filter``, ``map``) is read lazily in growing batches, so
``list(program())`` and ``itertools.islice(program(), 5)`` both work. A handle equals nothing
but itself (the same object of the program is the same handle). The test's comparisons
therefore run on the judge's own objects, with the judge's own builtins, and the judge writes
its verdict to a pipe only it holds. A program can pass only by returning the right values.

This file runs inside the sandbox's interpreter (standard library only); ``serve`` and
``judge`` are its entry points, called at the end of ``main.py``.
"""
from __future__ import annotations

import builtins
import collections
import collections.abc
import decimal
import fractions
import json
import math
import operator
import os
import sys
import traceback
import types

_SOLUTION, _TEST = "solution.py", "test.py"
_MAX_MESSAGE = 1 << 26  # bytes of one message the judge accepts
_MAX_DECIMAL_BITS = 4096  # larger ints travel as hex text
_MAX_BATCH, _BATCH_BYTES = 1024, 1 << 20  # items of an iterator read at once: at most, and bytes of JSON
_CONTAINERS = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "deque": collections.deque}
_DICT_VIEWS = {type({}.keys()): "dict_keys", type({}.values()): "dict_values", type({}.items()): "dict_items"}


class ProgramError(Exception):
    """The program raised, died or broke the protocol during a call (a bug, not a failed test)."""


def encode(value, hold=None, depth: int = 0):
    """``value`` as JSON-compatible plain data; containers, special numbers and large ints are tagged.

    Another value becomes a handle: ``hold(value)`` gives it (program side), or it is the
    handle it came as (judge side, where an iterator of the test's sends its items).
    """
    if depth > 100:
        raise RecursionError("value nested too deeply")
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if isinstance(value, Handle):
        return value.encoded
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
    if isinstance(value, fractions.Fraction):
        return ["fraction", encode(value.numerator), encode(value.denominator)]
    if isinstance(value, decimal.Decimal):
        return ["decimal", str(decimal.Decimal.__str__(value))]
    if isinstance(value, range):
        return ["range", encode(value.start), encode(value.stop), encode(value.step)]
    if kind in _DICT_VIEWS:
        items = [list(item) for item in value] if kind is type({}.items()) else list(value)
        return [_DICT_VIEWS[kind], encode(items, hold, depth + 1)]
    for name, container in _CONTAINERS.items():
        if isinstance(value, container):
            return _with_object(value, container, [name, [encode(v, hold, depth + 1) for v in value]], hold)
    if isinstance(value, dict):
        return _with_object(value, dict, ["dict", [[encode(k, hold, depth + 1), encode(v, hold, depth + 1)]
                                                   for k, v in value.items()]], hold)
    if callable(getattr(value, "tolist", None)):  # numpy scalars and arrays
        return encode(value.tolist(), hold, depth + 1)
    if hold is not None:
        return hold(value)
    if isinstance(value, collections.abc.Iterator):  # the test's generator: the program gets its items
        return ["iterator", encode(list(value), hold, depth + 1)]
    raise TypeError(f"cannot send a {type(value).__name__} to the program")


def _with_object(value, base: type, data: list, hold) -> list:
    """A container's data, with a handle to the object when it is a subclass of the program's
    (a namedtuple, a Counter): the judge reads the attributes the container lacks from it."""
    if type(value) is base or hold is None:
        return data
    return ["object", hold(value), data]


def decode(data, resolve):
    """The value ``data`` (from :func:`encode`) stands for; raises on anything malformed.
    ``resolve(handle id, type name, is an iterator)`` gives what a handle stands for."""
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
    if tag == "fraction" and len(rest) == 2:
        return fractions.Fraction(*(_integer(decode(x, resolve)) for x in rest))
    if tag == "decimal" and len(rest) == 1 and type(rest[0]) is str:
        return decimal.Decimal(rest[0])
    if tag == "range" and len(rest) == 3:
        return range(*(_integer(decode(x, resolve)) for x in rest))
    if tag in _CONTAINERS and len(rest) == 1 and type(rest[0]) is list:
        return _CONTAINERS[tag](decode(v, resolve) for v in rest[0])
    if tag == "iterator" and len(rest) == 1:
        return iter(_list(decode(rest[0], resolve)))
    if tag == "dict" and len(rest) == 1 and type(rest[0]) is list:
        return {decode(k, resolve): decode(v, resolve) for k, v in (_pair(item) for item in rest[0])}
    if tag in ("dict_keys", "dict_values") and len(rest) == 1:
        items = _list(decode(rest[0], resolve))
        return dict.fromkeys(items).keys() if tag == "dict_keys" else dict(enumerate(items)).values()
    if tag == "dict_items" and len(rest) == 1:
        return dict(_pair(item) for item in _list(decode(rest[0], resolve))).items()
    if tag == "handle" and len(rest) == 3 and type(rest[0]) is int and type(rest[1]) is str and type(rest[2]) is bool:
        return resolve(*rest)
    if tag == "object" and len(rest) == 2:
        held, value = decode(rest[0], resolve), decode(rest[1], resolve)
        if not isinstance(held, Handle) or type(value) not in _REMOTE:
            raise ValueError("an object must be a handle and a container")
        return _REMOTE[type(value)](value, held)
    raise ValueError(f"not an encoded value: {str(data)[:100]}")


class Handle:
    """A value that stays in the program's process (judge side): reading an attribute, calling
    it, ``len``, ``bool``, indexing and iterating ask the program; it equals nothing but itself."""

    def __init__(self, channel: "_Channel", handle_id: int, type_name: str):
        self._channel, self.handle_id, self.type_name = channel, handle_id, type_name

    @property
    def encoded(self) -> list:
        return ["handle", self.handle_id, self.type_name, isinstance(self, RemoteIterator)]

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_channel", "handle_id", "type_name"):
            raise AttributeError(name)
        return self._channel.request("getattr", self, name)

    def __call__(self, *args, **kwargs):
        return self._channel.request("call", self, *args, **kwargs)

    def __len__(self):
        return self._channel.request("len", self)

    def __bool__(self):
        return self._channel.request("bool", self)

    def __getitem__(self, key):
        return self._channel.request("getitem", self, key)

    def __iter__(self):
        return self._channel.request("iter", self)

    def __repr__(self) -> str:
        return f"<{self.type_name} object of the program>"


class RemoteIterator(Handle):
    """An iterator of the program (a generator, ``filter``, ``map``), read in batches that double
    from one item up to :data:`_MAX_BATCH`, so an infinite one can be read in part."""

    def __init__(self, channel: "_Channel", handle_id: int, type_name: str):
        super().__init__(channel, handle_id, type_name)
        self._items, self._end, self._batch = collections.deque(), None, 1

    def __iter__(self):
        return self

    def __next__(self):
        if not self._items and self._end is None:
            items, self._end = self._channel.next_items(self, self._batch)
            self._items.extend(items)
            self._batch = min(2 * self._batch, _MAX_BATCH)
        if self._items:
            return self._items.popleft()
        end, self._end = self._end, StopIteration()
        raise end


class _Remote:
    """A container the judge holds, with the program's object (of a subclass: a namedtuple, a
    Counter) behind it for the attributes the container lacks."""

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_held":
            raise AttributeError(name)
        return getattr(self._held, name)


def _remote(base: type) -> type:
    def __new__(cls, value, held=None):
        made = base.__new__(cls, value) if base in (tuple, frozenset) else base.__new__(cls)
        made._held = held
        return made

    def __init__(self, value, held=None):
        if base not in (tuple, frozenset):
            base.__init__(self, value)

    return type(base.__name__, (_Remote, base), {"__new__": __new__, "__init__": __init__})


_REMOTE = {base: _remote(base) for base in (list, tuple, set, frozenset, dict, collections.deque)}


def _number(x):
    if type(x) not in (int, float):
        raise ValueError("complex parts must be numbers")
    return x


def _integer(x):
    if type(x) is not int:
        raise ValueError("expected an integer")
    return x


def _list(x):
    if type(x) is not list:
        raise ValueError("expected a list")
    return x


def _pair(item):
    if type(item) not in (list, tuple) or len(item) != 2:
        raise ValueError("dict items must be pairs")
    return item


def _send(stream, message) -> None:
    stream.write(json.dumps(message).encode() + b"\n")
    stream.flush()


# What the judge may ask of a value the program holds (a handle).
_OPERATIONS = {"call": lambda value, *args, **kwargs: value(*args, **kwargs), "getattr": getattr, "len": len,
               "bool": bool, "getitem": operator.getitem, "iter": iter}


class _Held:
    """Program side: the values the judge holds handles to, one handle per object."""

    def __init__(self):
        self.values, self._ids = [], {}

    def __call__(self, value) -> list:
        if id(value) not in self._ids:
            self._ids[id(value)] = len(self.values)
            self.values.append(value)  # kept alive, so its id stays its own
        return ["handle", self._ids[id(value)], type(value).__name__, isinstance(value, collections.abc.Iterator)]

    def resolve(self, handle_id, type_name, iterator):
        return self.values[handle_id]


def serve(requests_fd: int, responses_fd: int) -> None:
    """Program side: run ``solution.py`` as module ``solution`` (importable, from its process and
    the worker processes it starts, so that its functions pickle), then answer requests until
    the judge closes the pipe."""
    requests, responses = os.fdopen(requests_fd, "rb"), os.fdopen(responses_fd, "wb")
    solution = types.ModuleType("solution")
    solution.__file__ = os.path.abspath(_SOLUTION)
    sys.modules["solution"] = solution
    sys.path.insert(0, os.path.dirname(solution.__file__))
    try:
        with open(_SOLUTION, encoding="utf-8") as f:
            exec(compile(f.read(), _SOLUTION, "exec"), vars(solution))
    except BaseException as e:  # SystemExit included: the program ended before it could be tested
        _send(responses, {"failed": _describe(e)})
        raise
    held = _Held()
    _send(responses, {"ready": {name: held(value) for name, value in vars(solution).items()
                                if callable(value) and not name.startswith("__")}})
    for line in requests:
        request = json.loads(line)
        try:
            value = held.values[request["on"]]
            args = [decode(a, held.resolve) for a in request["args"]]
            kwargs = {k: decode(v, held.resolve) for k, v in request["kwargs"].items()}
            if request["op"] == "next":
                responses.write(_next_items(value, *args, held) + b"\n")
                responses.flush()
                continue
            reply = {"value": encode(_OPERATIONS[request["op"]](value, *args, **kwargs), held)}
        except BaseException as e:
            reply = _raised_reply(e)
        _send(responses, reply)


def _next_items(iterator, count: int, held: _Held) -> bytes:
    """Up to ``count`` items of ``iterator`` (fewer past :data:`_BATCH_BYTES`) and how it ended,
    if it did: ``{"items": [...], "end": null | "stop" | {"raised": ...}}``."""
    items, size, end = [], 0, None
    try:
        while len(items) < count and size < _BATCH_BYTES:
            items.append(json.dumps(encode(next(iterator), held)))
            size += len(items[-1])
    except StopIteration:
        end = "stop"
    except BaseException as e:
        end = _raised_reply(e)
    return b'{"items": [' + ", ".join(items).encode() + b'], "end": ' + json.dumps(end).encode() + b"}"


def _raised_reply(e: BaseException) -> dict:
    return {"raised": type(e).__name__, "message": _describe(e)}


def judge(requests_fd: int, responses_fd: int, verdict_fd: int) -> None:
    """Test side: run ``test.py`` with a handle for every function and class the program
    defines, then write ``passed``, ``failed`` (an assertion of the test failed) or ``error``
    (the program raised, died, could not be called, or the test hit an error on its values)
    to ``verdict_fd``."""
    verdict = os.fdopen(verdict_fd, "w")
    try:
        channel = _Channel(os.fdopen(requests_fd, "wb"), os.fdopen(responses_fd, "rb"))
        first = channel.receive()
        if "ready" not in first:
            raise ProgramError(f"the program did not run to its end: {first.get('failed', first)}")
        namespace = {"__name__": "__test__"}
        for name, handle in first["ready"].items():
            if name.isidentifier() and not name.startswith("__") and name not in vars(builtins):
                namespace[name] = channel.value(handle)
        with open(_TEST, encoding="utf-8") as f:
            exec(compile(f.read(), _TEST, "exec"), namespace)
        outcome = {"verdict": "passed"}
    except BaseException as e:
        failed = isinstance(e, AssertionError) and not isinstance(e, ProgramError)
        outcome = {"verdict": "failed" if failed else "error", "detail": _describe(e)}
    verdict.write(json.dumps(outcome))
    verdict.close()


class _Channel:
    """Judge side: requests to the program, and the handles it sent (one per object)."""

    def __init__(self, requests, responses):
        self.requests, self.responses = requests, responses
        self._handles: dict[int, Handle] = {}

    def receive(self) -> dict:
        line = self.responses.readline(_MAX_MESSAGE)
        if not line.endswith(b"\n"):
            raise ProgramError("the program exited or was killed")
        message = json.loads(line)
        if type(message) is not dict:
            raise ProgramError("the program broke the protocol")
        return message

    def value(self, data):
        """The value the program sent as ``data``; a malformed one is the program's error."""
        try:
            return decode(data, self._handle)
        except (ValueError, TypeError, RecursionError, KeyError, ArithmeticError) as e:
            raise ProgramError(f"the program sent a malformed value: {e}") from None

    def _handle(self, handle_id: int, type_name: str, iterator: bool) -> Handle:
        if handle_id not in self._handles:
            self._handles[handle_id] = (RemoteIterator if iterator else Handle)(self, handle_id, type_name)
        return self._handles[handle_id]

    def request(self, op: str, on: Handle, *args, **kwargs):
        reply = self._ask(op, on, args, kwargs)
        if "value" in reply:
            return self.value(reply["value"])
        if "raised" in reply:
            raise _raised(str(reply["raised"]), str(reply.get("message", "")))
        raise ProgramError("the program broke the protocol")

    def next_items(self, on: RemoteIterator, count: int) -> tuple[list, BaseException | None]:
        """Up to ``count`` items of an iterator of the program, and what ends it after them (an
        exception to raise: ``StopIteration`` or the program's error), if anything does."""
        reply = self._ask("next", on, (count,), {})
        if type(reply.get("items")) is not list:
            raise ProgramError("the program broke the protocol")
        items, end = [self.value(item) for item in reply["items"]], reply.get("end")
        if end is None:
            return items, None
        if end == "stop":
            return items, StopIteration()
        if type(end) is dict and "raised" in end:
            return items, _raised(str(end["raised"]), str(end.get("message", "")))
        raise ProgramError("the program broke the protocol")

    def _ask(self, op: str, on: Handle, args: tuple, kwargs: dict) -> dict:
        request = {"op": op, "on": on.handle_id, "args": [encode(a) for a in args],
                   "kwargs": {k: encode(v) for k, v in kwargs.items()}}
        try:
            _send(self.requests, request)
        except (BrokenPipeError, OSError):
            raise ProgramError("the program exited or was killed") from None
        return self.receive()


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

