"""The model's function calls, parsed as data: never evaluated.

A call message is written in Python call syntax, as BFCL's multi-turn questions expect:
``cd(folder='document')`` or a list ``[ls(), cd(folder='x')]``. :func:`parse_calls` reads it
with :mod:`ast` and accepts only a call (or a list / tuple of calls) of a plain function name
with literal arguments: each argument node goes through :func:`ast.literal_eval` and must give
a JSON-like value (str, int, float, bool, None, and lists, tuples and dicts of them).
Anything else is refused with a :class:`CallRefused` saying why: attribute access
(``os.system(...)``), a nested call as an argument (``open(...)``), a bare name, ``*args`` /
``**kwargs``, comprehensions, operators, a name that starts with ``_``, text over
:data:`MAX_CALL_TEXT` characters, more than :data:`MAX_CALLS` calls, or nesting the parser
refuses. Nothing here imports, looks up or runs a name; dispatching a parsed
:class:`Call` is the environment's (:mod:`gdpo_megatron.environments.environment`).

:func:`call_block` says which part of a model message is a call attempt: the stripped text
(without a Markdown code fence) when it starts with ``[`` (the list BFCL's prompt asks for,
which must then parse), or when it parses as calls as it stands (``cd(folder='x')``). Any other
message is a plain answer, which ends the model's turn: "Done (both files moved)." is not a
failed call. So is a block that parses to no call at all (``[]``, a list holding only a
comment, ``<tool_call>[]</tool_call>``): BFCL ends the turn on an empty response, and a free
step that does nothing would let a policy burn its steps or its token budget.

Chat templates of the Hermes / Qwen kind write calls as JSON in ``<tool_call>`` tags instead:
``<tool_call>{"name": "cd", "arguments": {"folder": "x"}}</tool_call>``, one object or a list
of them per tag, any text (a ``<think>`` block) around the tags. A message with such a tag is
a call attempt whose block is its tags; :func:`parse_calls` reads each tag's content with
:func:`json.loads` (an object with a ``name`` string and an ``arguments`` object), the same
limits applying.
"""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import Any

MAX_CALL_TEXT = 20_000  # characters of one call message
MAX_CALLS = 64  # calls in one message

_FENCE = re.compile(r"\A```[A-Za-z]*\n?(.*?)\n?```\Z", re.DOTALL)
_LOOKS_LIKE_CALL = re.compile(r"\A[A-Za-z_][A-Za-z0-9_]*\s*\(")
_TOOL_CALL_TAG = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_LITERAL_TYPES = (str, int, float, bool, type(None))


class CallRefused(ValueError):
    """A call message or one call that is not accepted; the message says why, for the model's
    observation."""


@dataclass(frozen=True)
class Call:
    """One parsed call: a function name, positional and keyword arguments (literal values)."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


def call_block(message: str) -> str | None:
    """The call attempt in a model ``message``, or None when the message is a plain answer."""
    text = message.strip()
    tags = _TOOL_CALL_TAG.findall(text)
    if tags:
        text = "".join(f"<tool_call>{tag}</tool_call>" for tag in tags)
    else:
        fenced = _FENCE.match(text)
        if fenced:
            text = fenced.group(1).strip()
        if not (text.startswith("[") or _LOOKS_LIKE_CALL.match(text)):
            return None
    try:
        calls = parse_calls(text)
    except CallRefused:
        return text if tags or text.startswith("[") else None  # a failed attempt, or prose
    return text if calls else None


def parse_calls(text: str) -> list[Call]:
    """The calls in ``text`` (see the module docstring); CallRefused for anything else."""
    if len(text) > MAX_CALL_TEXT:
        raise CallRefused(f"call text of {len(text)} characters is over the limit of {MAX_CALL_TEXT}")
    if text.lstrip().startswith("<tool_call>"):
        return _json_calls(_TOOL_CALL_TAG.findall(text))
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise CallRefused(f"not Python call syntax: {type(e).__name__}: {getattr(e, 'msg', e)}") from None
    body = tree.body
    nodes = body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    if len(nodes) > MAX_CALLS:
        raise CallRefused(f"{len(nodes)} calls in one message, over the limit of {MAX_CALLS}")
    return [_call(node) for node in nodes]


def _json_calls(tags: list[str]) -> list[Call]:
    objects = []
    for tag in tags:
        try:
            value = json.loads(tag)
        except (ValueError, RecursionError) as e:
            raise CallRefused(f"not a JSON tool call: {type(e).__name__}: {e}") from None
        objects.extend(value if isinstance(value, list) else [value])
    if len(objects) > MAX_CALLS:
        raise CallRefused(f"{len(objects)} calls in one message, over the limit of {MAX_CALLS}")
    calls = []
    for value in objects:
        if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
            raise CallRefused(f"expected a tool call object with a 'name', got {json.dumps(value)[:80]}")
        name, arguments = value["name"], value.get("arguments", {})
        if name.startswith("_") or not name.isidentifier():
            raise CallRefused(f"{name!r} is not a callable function name")
        if not isinstance(arguments, dict) or not _json_like(arguments):
            raise CallRefused(f"{name}: 'arguments' must be an object of JSON values")
        calls.append(Call(name, (), dict(arguments)))
    return calls


def _call(node: ast.AST) -> Call:
    if not isinstance(node, ast.Call):
        raise CallRefused(f"expected a function call, got {_describe(node)}")
    if not isinstance(node.func, ast.Name):
        raise CallRefused(f"the called function must be a plain name, got {_describe(node.func)}")
    name = node.func.id
    if name.startswith("_"):
        raise CallRefused(f"{name!r}: names starting with '_' are not callable")
    args = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, ast.Starred):
            raise CallRefused(f"{name}: *arguments are not accepted")
        args.append(_literal(arg, f"{name}: argument {i + 1}"))
    kwargs: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise CallRefused(f"{name}: **arguments are not accepted")
        if keyword.arg in kwargs:
            raise CallRefused(f"{name}: argument {keyword.arg!r} given twice")
        kwargs[keyword.arg] = _literal(keyword.value, f"{name}: argument {keyword.arg!r}")
    return Call(name, tuple(args), kwargs)


def _literal(node: ast.AST, where: str) -> Any:
    try:
        value = ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        raise CallRefused(f"{where} must be a literal value, got {_describe(node)}") from None
    if not _json_like(value):
        raise CallRefused(f"{where}: {type(value).__name__} values are not accepted")
    return value


def _json_like(value: Any, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if isinstance(value, _LITERAL_TYPES):
        return True
    if isinstance(value, (list, tuple)):
        return all(_json_like(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v, depth + 1) for k, v in value.items())
    return False


def _describe(node: ast.AST) -> str:
    return {ast.Attribute: "an attribute access", ast.Call: "a call", ast.Name: "a name",
            ast.Subscript: "a subscript", ast.Lambda: "a lambda", ast.ListComp: "a comprehension",
            ast.GeneratorExp: "a comprehension", ast.DictComp: "a comprehension", ast.SetComp: "a comprehension",
            ast.BinOp: "an operator", ast.UnaryOp: "an operator", ast.BoolOp: "an operator",
            ast.Compare: "a comparison", ast.JoinedStr: "an f-string", ast.NamedExpr: "an assignment expression",
            ast.IfExp: "a conditional expression", ast.Starred: "a starred expression",
            ast.Await: "an await"}.get(type(node), type(node).__name__)
