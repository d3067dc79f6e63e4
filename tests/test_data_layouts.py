"""Published data layouts read as they are, and scored by the math and code rewards.

Fixtures are small rows written here in each layout's published shape (field names, nesting,
JSON-in-a-string where the publisher uses it): verl's parquet (Eurus-2-RL, verl's math
examples), NeMo-RL's chat and response layouts, DeepScaleR's JSON list, and APPS/TACO rows in
a Hugging Face datasets directory. The problems and programs are this file's own.
"""
import json
import re
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from gdpo_megatron.config import ConfigError, DataConfig, TrainConfig, from_dict, load_config
from gdpo_megatron.data.samples import Fields, load_samples
from gdpo_megatron.preflight.validation import training_prompts
from gdpo_megatron.rewards.coding import code_no_bug, code_pass
from gdpo_megatron.tasks import task_names
from gdpo_megatron.rewards.math_answer import math_correctness
from gdpo_megatron.tasks.math import SYSTEM_PROMPT as MATH_SYSTEM_PROMPT


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_json(path, value):
    path.write_text(json.dumps(value, indent=2), encoding="utf-8")
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def boxed(answer):
    return f"<think> Work it out. </think>\nThe answer is \\boxed{{{answer}}}."


# ---- math ---------------------------------------------------------------------------------

DEEPSCALER = [  # agentica-org/DeepScaleR-Preview-Dataset: a JSON list of problem / answer / solution
    {"problem": "What is the least common multiple of 4 and 6?", "answer": "12",
     "solution": "The multiples of 6 are 6, 12, ...; 12 is the first one divisible by 4, so $\\boxed{12}$."},
    {"problem": "Compute $\\frac{1}{2} + \\frac{1}{3}$.", "answer": "\\frac{5}{6}",
     "solution": "$\\frac{3}{6} + \\frac{2}{6} = \\boxed{\\frac{5}{6}}$."},
]


def test_deepscaler_json_list(tmp_path):
    path = write_json(tmp_path / "deepscaler.json", DEEPSCALER + [{"problem": "Unanswered.", "answer": " ",
                                                                     "solution": ""}])
    with pytest.warns(UserWarning, match=r"deepscaler\.json: left out 1 of 3 rows, empty answer: rows 2$"):
        samples = load_samples(path, "math")
    assert [s.id for s in samples] == ["deepscaler-0", "deepscaler-1"]
    for sample, row in zip(samples, DEEPSCALER):
        assert sample.messages == [{"role": "system", "content": MATH_SYSTEM_PROMPT},
                                   {"role": "user", "content": row["problem"]}]
        assert sample.ground_truth == {"answer": row["answer"]}
        assert sample.metadata == {"solution": row["solution"]}
    assert math_correctness(boxed("12"), 0, samples[0].ground_truth) == 1.0
    assert math_correctness(boxed("24"), 0, samples[0].ground_truth) == 0.0
    assert math_correctness(boxed("\\dfrac{5}{6}"), 0, samples[1].ground_truth) == 1.0
    assert math_correctness(boxed("0.8333"), 0, samples[1].ground_truth) == 0.0


def test_verl_math_parquet(tmp_path):
    row = {  # verl's examples/data_preprocess/gsm8k.py and Eurus-2-RL's math rows
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Tom has 8 apples and buys 9 times as many. How many now?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "80"},
        "extra_info": {"split": "train", "index": 7, "answer": "8 + 72 = 80 #### 80"},
    }
    (sample,) = load_samples(write_parquet(tmp_path / "train.parquet", [row]), "math", system_prompt="")
    assert sample.messages == row["prompt"] and sample.ground_truth == {"answer": "80"}
    assert sample.metadata == {"data_source": "openai/gsm8k", "ability": "math", "reward_model": {"style": "rule"},
                               "extra_info": row["extra_info"]}
    assert math_correctness(boxed("80"), 0, sample.ground_truth) == 1.0


def test_nemo_rl_layouts(tmp_path):
    chat = {"messages": [{"role": "user", "content": "What is 6 times 7?"}, {"role": "assistant", "content": "42"}],
            "task_name": "arith"}
    (from_chat,) = load_samples(write_jsonl(tmp_path / "chat.jsonl", [chat]), "math", system_prompt="")
    assert (from_chat.messages, from_chat.ground_truth) == ([chat["messages"][0]], {"answer": "42"})
    assert from_chat.metadata == {"task_name": "arith"}

    problem = {"problem": "Solve $2x + 3 = 17$.", "expected_answer": 7}  # NeMo-RL's math_data_processor
    (from_problem,) = load_samples(write_jsonl(tmp_path / "math.jsonl", [problem]), "math", system_prompt="")
    assert from_problem.ground_truth == {"answer": 7}
    assert math_correctness(boxed("7"), 0, from_problem.ground_truth) == 1.0

    response = {"input": "Name the square root of 81.", "output": "9"}  # ResponseDataset's input_key / output_key
    path = write_jsonl(tmp_path / "response.jsonl", [response])
    (from_response,) = load_samples(path, "math", system_prompt="", fields=Fields("input", None, "output"))
    assert from_response.messages == [{"role": "user", "content": "Name the square root of 81."}]
    assert from_response.ground_truth == {"answer": "9"}


def test_explicit_fields_and_their_errors_name_the_row(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"q": "1+1?", "meta": {"gold": "2"}, "answer": "ignored"}])
    (sample,) = load_samples(path, "math", system_prompt="", fields=Fields("q", None, "meta.gold"))
    assert sample.ground_truth == {"answer": "2"}
    assert sample.metadata == {"meta": {}}  # the other 'answer' field cannot shadow the ground truth
    with pytest.raises(ValueError, match=r"q\.jsonl:1: no prompt field 'question' \(data.prompt_key\)"):
        load_samples(path, "math", fields=Fields("question"))
    with pytest.raises(ValueError, match=r"q\.jsonl:1: missing the math ground truth 'meta.answer'"):
        load_samples(path, "math", fields=Fields("q", None, "meta.answer"))
    with pytest.raises(ValueError, match=r"q\.jsonl:1: the system message field 'sys' \(data.system_key\)"):
        load_samples(path, "math", fields=Fields("q", "sys", "meta.gold"))
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "system", "content": "s"},
                                                             {"role": "user", "content": "u"}],
                                               "sys": "t", "answer": "1"}])
    with pytest.raises(ValueError, match=r"c\.jsonl:1: 'messages' already starts with a system message"):
        load_samples(chat, "math", fields=Fields(system_key="sys"))
    lone = write_jsonl(tmp_path / "a.jsonl", [{"messages": [{"role": "assistant", "content": "4"}]}])
    with pytest.raises(ValueError, match=r"a\.jsonl:1: 'messages' holds only an assistant message"):
        load_samples(lone, "math")


def test_data_config_checks_field_names_and_preflight_the_family():
    base = {"train_path": "x.parquet", "family": "toolrl", "prompt_key": "prompt",
            "ground_truth_key": "reward_model.ground_truth"}
    config = from_dict(DataConfig, base, "data")
    assert (config.prompt_key, config.system_key, config.ground_truth_key) == ("prompt", None,
                                                                              "reward_model.ground_truth")
    # The family names a registered task: preflight checks it before it reads the data.
    unknown = load_config(TrainConfig, "configs/tiny_cpu.yaml", ["data.family=poetry", "data.train_path=nowhere"])
    with pytest.raises(ConfigError, match=rf"^data.family: expected one of {re.escape(str(task_names()))}, "
                                          r"got 'poetry'$"):
        training_prompts(unknown)
    with pytest.raises(ConfigError, match="data.ground_truth_key: expected a field name"):
        from_dict(DataConfig, {**base, "ground_truth_key": "reward_model..ground_truth"}, "data")


# ---- code ---------------------------------------------------------------------------------

SUM_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"
MERGE_PROGRAM = "def merge(a, b):\n    return sorted(a + b)"


def eurus_row(index, ground_truth, data_source):
    """A code row of Eurus-2-RL-Data (verl layout; test cases as one JSON string)."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "system", "content": "Think step by step, then write Python 3 code in a code block."},
                   {"role": "user", "content": f"Problem {index}."}],
        "ability": "code",
        "reward_model": {"style": "rule", "ground_truth": json.dumps(ground_truth)},
        "extra_info": {"split": "train", "index": index},
    }


def program(code):
    return f"<think> Plan. </think>\n```python\n{code}\n```"


def test_eurus_code_parquet_with_stdin_and_call_based_tests(tmp_path):
    rows = [
        eurus_row(0, {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}, "codeforces"),
        eurus_row(1, {"fn_name": "merge", "inputs": ["[3, 1]\n[2]", "[]\n[5]"], "outputs": ["[1, 2, 3]", "[5]"]},
                  "apps"),
    ]
    stdin, call = load_samples(write_parquet(tmp_path / "train.parquet", rows), "code", system_prompt="")
    assert stdin.messages == rows[0]["prompt"]
    assert stdin.ground_truth == {"tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12\n"}]}
    assert stdin.metadata["data_source"] == "codeforces" and stdin.metadata["reward_model"] == {"style": "rule"}
    assert code_pass(program(SUM_PROGRAM), 0, stdin.ground_truth) == 1.0
    assert code_pass(program("a, b = map(int, input().split())\nprint(a * b + 1)"), 0, stdin.ground_truth) == 0.5
    assert len(call.ground_truth["tests"]) == 2 and all("assert" in t for t in call.ground_truth["tests"])
    assert code_pass(program(MERGE_PROGRAM), 0, call.ground_truth) == 1.0
    assert code_no_bug(program(MERGE_PROGRAM), 0, call.ground_truth) == 1.0
    assert code_pass(program("def merge(a, b):\n    return a + b"), 0, call.ground_truth) == 0.5  # [3, 1, 2] fails
    assert (code_pass(program("def merged(a, b):\n    return []"), 0, call.ground_truth),
            code_no_bug(program("def merged(a, b):\n    return []"), 0, call.ground_truth)) == (0.0, 0.0)


TACO_ROWS = [  # BAAI/TACO (APPS fields): input_output is a JSON string
    {"question": "Read n and n integers; print their sum.", "solutions": json.dumps(["print(0)"]),
     "starter_code": "", "input_output": json.dumps({"inputs": ["3\n1 2 3\n", "1\n-4\n"], "outputs": ["6\n", "-4\n"]}),
     "difficulty": "EASY", "source": "codeforces"},
    {"question": "Return how many vowels the string has.", "solutions": json.dumps([]),
     "starter_code": "def count_vowels(s):", "difficulty": "EASY", "source": "codewars",
     "input_output": json.dumps({"fn_name": "count_vowels", "inputs": [["hello"], ["sky"]], "outputs": [[2], [0]]})},
    {"question": "Return the indices of the two numbers adding up to target.", "solutions": json.dumps([]),
     "starter_code": "class Solution:\n    def twoSum(self, nums, target):", "difficulty": "EASY",
     "source": "leetcode",
     "input_output": json.dumps({"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 3], 6]],
                                 "outputs": [[[0, 1]], [[0, 1]]]})},
]
TACO_PROGRAMS = [
    "input()\nprint(sum(map(int, input().split())))",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)",
    # a tuple reads as a list, as in the APPS/TACO harness
    "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n"
    "            if target - x in seen:\n                return (seen[target - x], i)\n            seen[x] = i",
]


def test_taco_rows_in_a_datasets_directory(tmp_path):
    DatasetDict({"train": Dataset.from_list(TACO_ROWS), "test": Dataset.from_list(TACO_ROWS[:1])}).save_to_disk(
        str(tmp_path / "taco"))
    samples = load_samples(tmp_path / "taco", "code")
    assert [s.id for s in samples] == ["taco-0", "taco-1", "taco-2"]
    assert samples[0].messages[-1] == {"role": "user", "content": TACO_ROWS[0]["question"]}
    assert samples[0].ground_truth["tests"] == [{"input": "3\n1 2 3\n", "output": "6\n"},
                                                {"input": "1\n-4\n", "output": "-4\n"}]
    assert samples[2].metadata["starter_code"] == TACO_ROWS[2]["starter_code"]
    for sample, code in zip(samples, TACO_PROGRAMS):
        assert code_pass(program(code), 0, sample.ground_truth) == 1.0, sample.id
    assert code_pass(program("def count_vowels(s):\n    return len(s)"), 0, samples[1].ground_truth) == 0.0
    assert len(load_samples(tmp_path / "taco", "code", split="test")) == 1


@pytest.mark.parametrize("cases,match", [
    ({"inputs": ["1\n"], "outputs": []}, r"1 inputs and 0 outputs"),
    ({"fn_name": "f x", "inputs": [[1]], "outputs": [[1]]}, r"'fn_name' must be a Python identifier"),
    ({"fn_name": "f", "inputs": ["not json"], "outputs": ["1"]}, r"input 0 of a call-based problem"),
    ({"inputs": [3], "outputs": ["3"]}, r"input 0 must be a string or a list of lines"),
])
def test_malformed_test_cases_name_the_row(tmp_path, cases, match):
    rows = [eurus_row(0, {"inputs": ["1\n"], "outputs": ["1\n"]}, "taco"), eurus_row(1, cases, "taco")]
    path = write_parquet(tmp_path / "code.parquet", rows)
    with pytest.raises(ValueError, match=r"code\.parquet row 1: 'reward_model.ground_truth': test cases: .*" + match):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            load_samples(path, "code")
