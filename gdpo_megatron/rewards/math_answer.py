"""Math rewards: ``math_correctness`` and ``math_format``, both in {0, 1}.

The final answer is the content of the last ``<answer>...</answer>`` block or, without one,
of the last ``\\boxed{...}``. Equivalence (fractions, decimals, LaTeX forms, sets, ...) is
decided by the ``math-verify`` package against the ground truth ``{"answer": "..."}``.
"""
from __future__ import annotations

import functools
import re
from decimal import Decimal

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from gdpo_megatron.rewards.registry import register_reward
from gdpo_megatron.rewards.tags import tagged_blocks

_BOXED = "\\boxed{"
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
# math-verify's own limits, per parse and per comparison: a completion's answer like
# \frac{1}{\frac{1}{...}} or 9^{9^{9}} makes sympy work for minutes. They are SIGALRM alarms
# (whole seconds of wall time, main thread only); an answer cut off by one is not equal to the
# ground truth.
_TIMEOUT_S = 1
# Those alarms can be lost (a signal handler that runs inside a finalizer has its exception
# swallowed), so the parser's worst case is also bounded by the input: an answer nested deeper
# than this (braces, brackets, parentheses) is not parsed and is not equal to any ground truth.
MAX_NESTING = 32
# Parsed once per process before the first answer (see _warm_up).
_WARM_UP = ("$\\frac{1}{2}$", "$2\\sqrt{2}$", "$\\{1, 2\\}$", "$(0, 1]$", "$x^{2} + 1$", "$0.5$")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")  # a "$" that is not an escaped "\$" (currency)


def final_answer(completion: str) -> str | None:
    """The final answer text, or ``None`` when the completion gives none."""
    blocks = tagged_blocks(completion, "<answer>", "</answer>")
    if blocks:
        return blocks[-1].strip() or None
    boxed = _last_boxed(completion)
    return boxed.strip() or None if boxed is not None else None


@register_reward("math_correctness", bounds=(0.0, 1.0))
def math_correctness(completion: str, num_tokens: int, ground_truth: dict) -> float:
    """1 if the final answer is mathematically equal to ``ground_truth["answer"]``."""
    gold = ground_truth.get("answer") if isinstance(ground_truth, dict) else None
    if not isinstance(gold, (str, int, float)) or isinstance(gold, bool):
        raise ValueError(f"ground_truth: expected an 'answer' string or number, got {ground_truth!r}")
    answer = final_answer(completion)
    if answer is None or _nesting(answer) > MAX_NESTING:
        return 0.0
    _warm_up()
    gold_parsed = parse(_as_latex(gold if isinstance(gold, str) else _plain_number(gold)), _EXTRACTION,
                        parsing_timeout=_TIMEOUT_S)
    answer_parsed = parse(_as_latex(answer), _EXTRACTION, parsing_timeout=_TIMEOUT_S)
    if not gold_parsed or not answer_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, answer_parsed, timeout_seconds=_TIMEOUT_S) else 0.0


@register_reward("math_format", bounds=(0.0, 1.0))
def math_format(completion: str, num_tokens: int, ground_truth: dict) -> float:
    """1 if the completion states exactly one final answer in the expected form.

    That is: at most one well-ordered ``<think>...</think>`` block, and either exactly one
    non-empty ``<answer>...</answer>`` block or (without answer tags) exactly one balanced
    ``\\boxed{...}``, placed after the think block.
    """
    think_open, think_close = completion.count("<think>"), completion.count("</think>")
    if (think_open, think_close) not in ((0, 0), (1, 1)):
        return 0.0
    rest = completion
    if think_open:
        start, end = completion.index("<think>"), completion.index("</think>")
        if end < start:
            return 0.0
        rest = completion[end + len("</think>"):]
    if "<answer>" in completion or "</answer>" in completion:
        ok = rest.count("<answer>") == rest.count("</answer>") == 1 and bool(final_answer(rest))
        return 1.0 if ok and completion.count("<answer>") == 1 else 0.0
    ok = rest.count(_BOXED) == completion.count(_BOXED) == 1 and bool(final_answer(rest))
    return 1.0 if ok else 0.0


@functools.cache
def _warm_up() -> None:
    """Build the LaTeX parser's prediction tables on common forms, under a generous limit: a
    process's first parse of a form builds them (0.1 s of CPU for a fraction, several times that
    in wall time on a loaded machine), which must not cut off the first honest answer."""
    for latex in _WARM_UP:
        parse(latex, _EXTRACTION, parsing_timeout=30)


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, else ``None``."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _nesting(text: str) -> int:
    """The deepest nesting of ``{[(`` in ``text`` (closers without an opener ignored)."""
    depth = deepest = 0
    for ch in text:
        if ch in "{[(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "}])" and depth:
            depth -= 1
    return deepest


def _as_latex(answer: str) -> str:
    """Wrap bare answers in ``$...$`` so that math-verify's LaTeX extraction sees them as math
    (it finds math only between delimiters or in ``\\boxed``; ``\\$`` is a dollar sign)."""
    return answer if _MATH_DELIMITER.search(answer) or "\\boxed" in answer else f"${answer}$"


def _plain_number(x: int | float) -> str:
    """A number as math-verify reads it: positional, never ``1e-05`` (which parses as 1)."""
    return str(x) if isinstance(x, int) else format(Decimal(repr(x)), "f")
