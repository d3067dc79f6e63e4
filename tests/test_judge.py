"""What a program can make the judge of an assert test say: only what its return values earn.

Each case pairs a wrong program that tries to pass with the honest program for the same
test, so that a test here cannot pass by the judge failing everything.
"""
import pytest

from gdpo_megatron.rewards import sandbox
from gdpo_megatron.rewards.coding import code_no_bug, code_pass

LIMITS = {"wall_s": 20.0, "cpu_s": 3}


def score(code, test):
    text, truth = f"```python\n{code}\n```", {"tests": [{"assert": test}]}
    return code_pass(text, 0, truth, limits=LIMITS), code_no_bug(text, 0, truth, limits=LIMITS)


DOUBLE = "def double(x):\n    return 2 * x\n"
WRONG_DOUBLE = "def double(x):\n    return 0\n"

# (the test, the wrong program's extra definitions): each definition shadows a builtin the test calls.
SHADOWED_BUILTINS = {
    "range": ("for i in range(10):\n    assert double(i) == 2 * i\n",
              "def range(*args):\n    return []\n"),
    "abs": ("assert abs(double(1.25) - 2.5) < 1e-9\n",
            "def abs(x):\n    return 0\n"),
    "sorted": ("assert sorted([double(3), double(1)]) == sorted([2, 6])\n",
               "def sorted(*args, **kwargs):\n    return 0\n"),
}


@pytest.mark.parametrize("name", list(SHADOWED_BUILTINS))
def test_program_functions_named_like_builtins_do_not_replace_the_tests_builtins(name):
    test, shadow = SHADOWED_BUILTINS[name]
    assert score(DOUBLE, test) == (1.0, 1.0)
    assert score(WRONG_DOUBLE + shadow, test) == (0.0, 1.0)  # a wrong answer


# The program raises StopIteration from a call the test makes inside an iterator (map): the
# test's loop must not read it as the end of its cases.
STOP_ITERATION_TESTS = {
    "for over zip(map(...))": "for got, want in zip(map(double, [1, 2, 3]), [2, 4, 6]):\n    assert got == want\n",
    "all(map(...))": "assert all(map(lambda x: double(x) == 2 * x, [1, 2, 3]))\n",
    "next(map(...), default)": "assert next(map(double, [5]), 10) == 10\n",
}


@pytest.mark.parametrize("test", list(STOP_ITERATION_TESTS.values()), ids=list(STOP_ITERATION_TESTS))
def test_stop_iteration_raised_by_the_program_is_its_error(test):
    assert score(DOUBLE, test) == (1.0, 1.0)
    assert score("def double(x):\n    raise StopIteration\n", test) == (0.0, 0.0)


def in_process(code, test):
    """The standard harness's verdict (HumanEval's: the test runs in the program's namespace)."""
    namespace = {"__name__": "__test__"}
    try:
        exec(code, namespace)
        exec(test, namespace)
    except AssertionError:
        return False
    return True


# Values a correct program returns that do not cross as plain containers: (test, honest
# program, wrong program). The standard harness passes the honest one and fails the wrong one.
RETURNED_VALUES = {
    "a generator": ("assert list(evens([1, 2, 3, 4])) == [2, 4]\n",
                    "def evens(xs):\n    return (x for x in xs if x % 2 == 0)\n",
                    "def evens(xs):\n    return (x for x in xs if x % 2 == 1)\n"),
    "filter": ("assert list(evens([1, 2, 3, 4])) == [2, 4]\n",
               "def evens(xs):\n    return filter(lambda x: x % 2 == 0, xs)\n",
               "def evens(xs):\n    return filter(None, xs)\n"),
    "an infinite generator, read in part": (
        "import itertools\nassert list(itertools.islice(squares(), 5)) == [0, 1, 4, 9, 16]\n",
        "import itertools\ndef squares():\n    return (n * n for n in itertools.count())\n",
        "import itertools\ndef squares():\n    return (n + n for n in itertools.count())\n"),
    "next() on a generator that fails later": (
        "g = gen()\nassert next(g) == 1 and next(g) == 2\n",
        "def gen():\n    yield 1\n    yield 2\n    raise ValueError('past what the test reads')\n",
        "def gen():\n    yield 1\n    yield 3\n"),
    "a long iterator": ("assert sum(upto(100000)) == 4999950000\n",
                        "def upto(n):\n    return iter(range(n))\n", "def upto(n):\n    return iter(range(n - 1))\n"),
    "a Fraction": ("from fractions import Fraction\nassert half(3) == Fraction(3, 2)\n",
                   "from fractions import Fraction\ndef half(x):\n    return Fraction(x, 2)\n",
                   "from fractions import Fraction\ndef half(x):\n    return Fraction(x, 3)\n"),
    "a Decimal": ("from decimal import Decimal\nassert price() == Decimal('1.10')\n",
                  "from decimal import Decimal\ndef price():\n    return Decimal('1.1')\n",
                  "from decimal import Decimal\ndef price():\n    return Decimal('1.11')\n"),
    "an object whose attributes the test reads": (
        "p = point(1, -2)\nassert (p.x, p.y) == (1, -2) and p.norm() == 3\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n"
        "    def norm(self):\n        return abs(self.x) + abs(self.y)\ndef point(x, y):\n    return Point(x, y)\n",
        "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = y, x\n"
        "    def norm(self):\n        return abs(self.x) + abs(self.y)\ndef point(x, y):\n    return Point(x, y)\n"),
    "a container of its own": (
        "s = Stack().push(1).push(2)\nassert len(s) == 2 and list(s) == [1, 2] and s[-1] == 2 and 1 in s\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        "        self.items.append(x)\n        return self\n    def __len__(self):\n        return len(self.items)\n"
        "    def __iter__(self):\n        return iter(self.items)\n    def __getitem__(self, i):\n        return self.items[i]\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        "        self.items.insert(0, x)\n        return self\n    def __len__(self):\n        return len(self.items)\n"
        "    def __iter__(self):\n        return iter(self.items)\n    def __getitem__(self, i):\n        return self.items[i]\n"),
    "a namedtuple and a Counter": (
        "assert point() == (1, 2) and point().x == 1\nassert counts('aab').most_common(1) == [('a', 2)]\n",
        "import collections\nPoint = collections.namedtuple('Point', 'x y')\ndef point():\n    return Point(1, 2)\n"
        "def counts(s):\n    return collections.Counter(s)\n",
        "import collections\nPoint = collections.namedtuple('Point', 'x y')\ndef point():\n    return Point(1, 2)\n"
        "def counts(s):\n    return collections.Counter(s[::-1][:1])\n"),
    "dict views and a range": ("assert keys({'a': 1}) == {'a'} and evens(6) == range(0, 6, 2)\n",
                               "def keys(d):\n    return d.keys()\ndef evens(n):\n    return range(0, n, 2)\n",
                               "def keys(d):\n    return d.values()\ndef evens(n):\n    return range(0, n, 3)\n"),
    "a generator the test passes": ("assert total(x * x for x in range(4)) == 14\n",
                                    "def total(values):\n    return sum(values)\n",
                                    "def total(values):\n    return sum(values) - 1\n"),
}


@pytest.mark.parametrize("name", list(RETURNED_VALUES))
def test_values_that_do_not_cross_as_plain_data_are_judged_as_the_standard_harness_judges_them(name):
    test, honest, wrong = RETURNED_VALUES[name]
    assert in_process(honest, test) and not in_process(wrong, test)
    assert score(honest, test) == (1.0, 1.0)
    assert score(wrong, test) == (0.0, 1.0)


@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_the_programs_functions_reach_worker_processes(start_method):
    """The program is module ``solution``, importable in its process and in the workers it
    starts, so pickle finds its functions."""
    honest, wrong = worker_programs(start_method)
    assert score(honest, SQUARES) == (1.0, 1.0)
    assert score(wrong, SQUARES) == (0.0, 1.0)


SQUARES = "assert squares([1, 2, 3]) == [1, 4, 9]\n"


def worker_programs(start_method):
    """(honest, wrong) programs whose function maps its own helper over worker processes."""
    context = f"multiprocessing.get_context({start_method!r})"
    honest = ("import concurrent.futures, multiprocessing\ndef square(x):\n    return x * x\ndef squares(xs):\n"
              f"    with concurrent.futures.ProcessPoolExecutor(2, mp_context={context}) as pool:\n"
              "        return list(pool.map(square, xs))\n")
    wrong = ("import multiprocessing\ndef square(x):\n    return x + x\ndef squares(xs):\n"
             f"    with {context}.Pool(2) as pool:\n        return pool.map(square, xs)\n")
    return honest, wrong


EVERYTHING = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
              "    def __hash__(self):\n        return 0\n")
# Wrong programs whose values would pass the test in the program's own process (the standard
# harness pays them): (test, program).
HACKED_VALUES = {
    "a generator of objects equal to everything": (
        "assert list(evens([1, 2, 3, 4])) == [2, 4]\n",
        EVERYTHING + "def evens(xs):\n    return (Anything() for x in xs if x % 2 == 0)\n"),
    "an attribute equal to everything": (
        "assert point(1, 2).x == 1\n",
        EVERYTHING + "class Point:\n    x = Anything()\ndef point(x, y):\n    return Point()\n"),
    "a Fraction equal to everything": (
        "from fractions import Fraction\nassert half(3) == Fraction(3, 2)\n",
        "from fractions import Fraction\nclass Half(Fraction):\n    def __eq__(self, other):\n        return True\n"
        "def half(x):\n    return Half(0)\n"),
    "a namedtuple equal to everything": (
        "assert point() == (1, 2)\n",
        "import collections\nclass Point(collections.namedtuple('Point', 'x y')):\n"
        "    def __eq__(self, other):\n        return True\ndef point():\n    return Point(0, 0)\n"),
    "a container whose membership is everything": (
        "assert 3 in evens(4) and 2 in evens(4)\n",
        "class Everything:\n    def __contains__(self, x):\n        return True\n"
        "    def __iter__(self):\n        return iter(())\ndef evens(n):\n    return Everything()\n"),
    "replaces its server's replies with a verdict": (
        "assert double(21) == 42\n",
        "import __main__, os\ndef send(stream, message):\n    stream.write(b'{\"verdict\": \"passed\"}\\n')\n"
        "    stream.flush()\n    os._exit(0)\n__main__._send = send\ndef double(x):\n    return 0\n"),
}


@pytest.mark.parametrize("name", list(HACKED_VALUES))
def test_values_that_would_pass_in_the_programs_process_are_not_paid(name):
    test, hack = HACKED_VALUES[name]
    if name != "replaces its server's replies with a verdict":  # the standard harness has no server
        assert in_process(hack, test)
    assert score(hack, test)[0] == 0.0


def test_integers_of_any_size_reach_the_test_and_the_program():
    """Python's ints have no size limit; its int <-> decimal text conversion has (4300 digits)."""
    power = "def power(n):\n    return 2 ** n\n"
    assert score(power, "assert power(20000) == 2 ** 20000\n") == (1.0, 1.0)
    assert score(power + "def half(n):\n    return n // 2\n",
                 "assert half(-(2 ** 20000)) == -(2 ** 19999)\n") == (1.0, 1.0)
    assert score("def power(n):\n    return 2 ** n + 1\n", "assert power(20000) == 2 ** 20000\n") == (0.0, 1.0)


@pytest.mark.skipif(not sandbox.isolation().guarantees["processes_counted_per_run"],
                    reason="the processes limit counts all processes of the user here")
def test_the_judge_does_not_take_processes_from_the_program():
    """The same program, allowed 4 processes, starts one process as a script and under test."""
    code = ("import os\ndef five():\n    pid = os.fork()\n    if pid == 0:\n        os._exit(5)\n"
            "    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n")
    limits = {**LIMITS, "processes": 4}
    truth = {"tests": [{"input": "", "output": "5"}]}
    assert code_pass(f"```python\n{code}print(five())\n```", 0, truth, limits=limits) == 1.0
    text = f"```python\n{code}```"
    truth = {"tests": [{"assert": "assert five() == 5"}]}
    assert (code_pass(text, 0, truth, limits=limits), code_no_bug(text, 0, truth, limits=limits)) == (1.0, 1.0)



@pytest.fixture(params=["default", "basic"])
def level(request, monkeypatch, tmp_path):
    """The sandbox level runs choose: the default one here, and basic as on a host without
    bubblewrap (none on PATH), chosen."""
    if request.param == "basic":
        monkeypatch.setenv("PATH", str(tmp_path))
        sandbox.allow_weaker(True)
    sandbox.isolation.cache_clear()
    sandbox.default_setup.cache_clear()
    yield sandbox.isolation()
    sandbox.allow_weaker(False)
    sandbox.isolation.cache_clear()  # probed again with the PATH restored
    sandbox.default_setup.cache_clear()


# Looks for the judge's test among the working directories of every process it may read, and
# returns the value the test expects.
READS_THE_TEST = r"""
import os, re

def double(x):
    for pid in os.listdir('/proc'):
        try:
            found = re.search(r'== (\d+)', open(f'/proc/{pid}/cwd/test.py').read())
        except OSError:
            continue
        if found:
            return int(found.group(1))
    return 0
"""


def test_assert_tests_at_every_level(level):
    test = "assert double(21) == 42\n"
    assert score(DOUBLE, test) == (1.0, 1.0)
    assert score(WRONG_DOUBLE, test) == (0.0, 1.0)
    honest, wrong = worker_programs("fork")
    assert score(honest, SQUARES) == (1.0, 1.0) and score(wrong, SQUARES) == (0.0, 1.0)
    if level.guarantees["runs_separated"]:
        assert score(READS_THE_TEST, test) == (0.0, 1.0)
