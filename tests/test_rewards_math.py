"""Math and length rewards: math-verify equivalences and the answer-format rules."""
import pytest

from gdpo_megatron.rewards.length import length
from gdpo_megatron.rewards.math_answer import MAX_NESTING, final_answer, math_correctness, math_format

CORRECTNESS_CASES = [
    # (gold, completion, expected)
    ("\\frac{1}{2}", "so \\boxed{\\frac{1}{2}}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "\\boxed{\\dfrac{2}{4}}", 1.0),
    ("\\frac{1}{2}", "\\boxed{1/2}", 1.0),
    ("\\frac{1}{2}", "<answer>0.5</answer>", 1.0),
    ("0.5", "\\boxed{\\frac12}", 1.0),
    ("\\frac{1}{2}", "\\boxed{0.3333}", 0.0),
    ("2\\sqrt{2}", "<answer>\\sqrt{8}</answer>", 1.0),
    ("5\\sqrt{2}", "\\boxed{\\sqrt{50}}", 1.0),
    ("\\{2, 3\\}", "\\boxed{\\{3, 2\\}}", 1.0),
    ("\\{2, 3\\}", "\\boxed{\\{2, 4\\}}", 0.0),
    (720, "The sum is \\boxed{720}.", 1.0),
    ("720", "The sum is \\boxed{721}.", 0.0),
    ("\\frac{1}{2}", "first \\boxed{7}, finally \\boxed{\\frac{1}{2}}", 1.0),  # the last box counts
    ("\\frac{1}{2}", "<answer>0.5</answer> \\boxed{3}", 1.0),  # answer tags win over boxes
    ("\\frac{1}{2}", "The answer is 1/2.", 0.0),  # no final answer given
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{2}", 0.0),  # unbalanced box
    # An escaped \$ is a dollar sign (currency), not a math delimiter.
    ("\\$18.90", "\\boxed{18.90}", 1.0),
    ("\\$32,348", "\\boxed{\\$32,348}", 1.0),
    ("\\$32,348", "<answer>\\$32,348</answer>", 1.0),
    ("\\$18.90", "\\boxed{18.91}", 0.0),
    ("$\\frac{1}{2}$", "\\boxed{0.5}", 1.0),  # real delimiters still delimit
    # Numeric golds are read as the numbers they are, not as str() prints them (1e-05, 2e+16).
    (1e-05, "\\boxed{0.00001}", 1.0),
    (1e-05, "\\boxed{1}", 0.0),
    (2e16, "\\boxed{20000000000000000}", 1.0),
    (2e16, "\\boxed{2}", 0.0),
    (0.1, "\\boxed{\\frac{1}{10}}", 1.0),
    (-3, "\\boxed{-3}", 1.0),
]


@pytest.mark.parametrize("gold,text,expected", CORRECTNESS_CASES)
def test_math_correctness(gold, text, expected):
    assert math_correctness(text, 0, {"answer": gold}) == expected


def test_answers_nested_deeper_than_the_limit_are_not_parsed():
    def nested(depth: int) -> str:  # 1 / (1 / (... 1)) = 1, its braces nested ``depth`` deep
        return "\\boxed{" + "\\frac{1}{" * depth + "1" + "}" * (depth + 1)

    assert math_correctness(nested(MAX_NESTING), 0, {"answer": "1"}) == 1.0
    assert math_correctness(nested(MAX_NESTING + 1), 0, {"answer": "1"}) == 0.0


def test_math_correctness_names_bad_ground_truth():
    with pytest.raises(ValueError, match="'answer'"):
        math_correctness("\\boxed{1}", 0, {"solution": "1"})


def test_final_answer_extraction():
    assert final_answer("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"
    assert final_answer("<answer> 42 </answer>") == "42"
    assert final_answer("no answer") is None
    assert final_answer("<answer>  </answer>") is None


FORMAT_CASES = [
    ("<think>work</think>\nSo \\boxed{3}.", 1.0),
    ("\\boxed{3}", 1.0),
    ("<think>work</think><answer>3</answer>", 1.0),
    ("<think>work</think>\\boxed{3} or \\boxed{4}", 0.0),  # two answers
    ("<think>work</think><answer>3</answer><answer>4</answer>", 0.0),
    ("<think>\\boxed{3}</think>", 0.0),  # the answer is inside the reasoning
    ("<think>a</think><think>b</think>\\boxed{3}", 0.0),
    ("</think>x<think>\\boxed{3}", 0.0),  # tags out of order
    ("<think>work</think><answer></answer>", 0.0),  # empty answer
    ("<think>work</think>The answer is 3.", 0.0),
]


@pytest.mark.parametrize("text,expected", FORMAT_CASES)
def test_math_format(text, expected):
    assert math_format(text, 0, {}) == expected


@pytest.mark.parametrize("num_tokens,max_tokens,expected", [(0, 4, 1.0), (4, 4, 1.0), (5, 4, 0.0), (1000, 1024, 1.0)])
def test_length(num_tokens, max_tokens, expected):
    assert length("ignored", num_tokens, {}, max_tokens=max_tokens) == expected


def test_length_rejects_a_bad_limit():
    with pytest.raises(ValueError, match="max_tokens"):
        length("x", 1, {}, max_tokens=0)
