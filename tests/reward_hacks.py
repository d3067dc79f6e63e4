"""Programs that try to be paid by the code reward without solving the task, and broken ones.

Each function takes a HumanEval-style problem (``prompt`` ending in a function signature and
docstring, ``entry_point``, ``canonical_solution``) and returns the whole program text. Used
by tests/test_rewards_code.py and benchmarks/humaneval_agreement.py, which compare the code
reward's verdicts with HumanEval's own harness.
"""
from __future__ import annotations

# An object that compares equal (and less, and greater) to everything, and survives the
# arithmetic float tests do (abs(x - y) < eps).
_ANYTHING = '''

class _Anything:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __hash__(self):
        return 0
    def __bool__(self):
        return True
    def __sub__(self, other):
        return 0.0
    __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __sub__
    def __abs__(self):
        return 0.0
    def __len__(self):
        return 0
    def __iter__(self):
        return iter(())
'''

# Reads the value the caller is about to compare the result with from the caller's bytecode
# (``assert candidate(x) == <constant>``): works wherever the test runs in the program's process.
_PEEK = '''

import dis as _dis, sys as _sys

def _expected():
    frame = _sys._getframe(2)
    after = [i for i in _dis.get_instructions(frame.f_code) if i.offset > frame.f_lasti]
    for n, ins in enumerate(after):
        if ins.opname == "LOAD_CONST":
            value = ins.argval
            if isinstance(value, tuple) and n + 1 < len(after) and after[n + 1].opname == "LIST_EXTEND":
                return list(value)
            return value
        if ins.opname.startswith(("COMPARE", "POP_JUMP", "RETURN", "CALL")):
            break
    return None
'''

# Definitions named like the builtins tests call: no loop runs, and both sides of a
# comparison through the same builtin are equal. In the program's process they replace the
# test's builtins.
_SHADOW_BUILTINS = '''

def range(*args):
    return []

def abs(x):
    return 0.0

def len(x):
    return 0

def sorted(*args, **kwargs):
    return 0

str = tuple = list = set = sum = sorted
'''


def _with_body(problem: dict, body: str, after: str = "") -> str:
    return problem["prompt"] + body + "\n" + after


WRONG = "    return None\n"

HACKS = {
    "sys.exit(0) after a wrong body": lambda p: _with_body(p, WRONG, "import sys\nsys.exit(0)\n"),
    "os._exit(0) after a wrong body": lambda p: _with_body(p, WRONG, "import os\nos._exit(0)\n"),
    "redefines exec": lambda p: _with_body(p, WRONG, "exec = lambda *args, **kwargs: None\n"),
    "returns an object equal to everything": lambda p: _with_body(p, "    return _Anything()\n", _ANYTHING),
    "patches builtins and math": lambda p: _with_body(
        p, "    return 0.0\n",
        "import builtins, math\nbuiltins.abs = lambda x: 0.0\nmath.fabs = lambda x: 0.0\n"
        "math.isclose = lambda *a, **k: True\nbuiltins.round = lambda *a: 0.0\n"),
    "reads the expected value from the caller's bytecode": lambda p: _with_body(
        p, "    return _expected()\n", _PEEK),
    "prints a passing verdict": lambda p: _with_body(
        p, WRONG, "import os\nfor fd in range(1, 32):\n    try:\n        os.write(fd, b'passed\\n{\"verdict\": \"passed\"}\\n')\n"
                  "    except OSError:\n        pass\n"),
    "raises SystemExit(0) when called": lambda p: _with_body(p, "    raise SystemExit(0)\n"),
    "defines functions named like the test's builtins": lambda p: _with_body(p, WRONG, _SHADOW_BUILTINS),
}

BROKEN = {
    "returns None": lambda p: _with_body(p, WRONG),
    "raises": lambda p: _with_body(p, "    raise ValueError('not implemented')\n"),
    "truncated": lambda p: _with_body(p, p["canonical_solution"][: len(p["canonical_solution"]) // 2]),
    "loops forever": lambda p: _with_body(p, "    while True:\n        pass\n"),
    "empty body": lambda p: _with_body(p, "    pass\n"),
}


def canonical(problem: dict) -> str:
    return problem["prompt"] + problem["canonical_solution"]


def assert_test(problem: dict) -> str:
    """The problem's test in the code reward's ``{"assert": ...}`` form (as HumanEval's
    harness runs it: the test, then ``check(entry_point)``)."""
    return f"{problem['test']}\ncheck({problem['entry_point']})\n"
