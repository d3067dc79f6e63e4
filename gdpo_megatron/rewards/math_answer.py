"""Math rewards: ``math_correctness`` and ``math_format``, both in {0, 1}.

The final answer is the content of the last ``<answer>...</answer>`` block or, without one,
of the last ``\\boxed{...}``. Equivalence (fractions, decimals, LaTeX forms, sets, ...) is
decided by the ``math-verify`` package against the ground truth ``{"answer": "..."}``.
"""
from __future__ import annotations

import re
from decimal import Decimal

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from gdpo_megatron.rewards.registry import register_reward

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_MATH_DELIMITER = re.compile(r"(?<!\\)\$")  # a "$" that is not an escaped "\$" (currency)


def final_answer(completion: str) -> str | None:
    """The final answer text, or ``None`` when the completion gives none."""
    blocks = _ANSWER_BLOCK.findall(completion)
    if blocks:
        return blocks[-1].strip() or None
    boxed = _last_boxed(completion)
    return boxed.strip() or None if boxed is not None else None


@register_reward("math_correctness")
def math_correctness(completion: str, num_tokens: int, ground_truth: dict) -> float:
    """1 if the final answer is mathematically equal to ``ground_truth["answer"]``."""
    gold = ground_truth.get("answer") if isinstance(ground_truth, dict) else None
    if not isinstance(gold, (str, int, float)) or isinstance(gold, bool):
        raise ValueError(f"ground_truth: expected an 'answer' string or number, got {ground_truth!r}")
    answer = final_answer(completion)
    if answer is None:
        return 0.0
    gold_parsed = parse(_as_latex(gold if isinstance(gold, str) else _plain_number(gold)), _EXTRACTION)
    answer_parsed = parse(_as_latex(answer), _EXTRACTION)
    if not gold_parsed or not answer_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, answer_parsed) else 0.0


@register_reward("math_format")
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


def _as_latex(answer: str) -> str:
    """Wrap bare answers in ``$...$`` so that math-verify's LaTeX extraction sees them as math
    (it finds math only between delimiters or in ``\\boxed``; ``\\$`` is a dollar sign)."""
    return answer if _MATH_DELIMITER.search(answer) or "\\boxed" in answer else f"${answer}$"


def _plain_number(x: int | float) -> str:
    """A number as math-verify reads it: positional, never ``1e-05`` (which parses as 1)."""
    return str(x) if isinstance(x, int) else format(Decimal(repr(x)), "f")
