"""The project's own JSONL prompt files for math, tool and code, and chat rendering with a tokenizer's template."""
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gdpo_megatron.data import encode_prompt, load_samples, render_prompt
from gdpo_megatron.rewards.coding import code_no_bug, code_pass
from gdpo_megatron.tasks.code import SYSTEM_PROMPT as CODE_SYSTEM_PROMPT
from gdpo_megatron.tasks.math import SYSTEM_PROMPT as MATH_SYSTEM_PROMPT

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("family,truth_keys", [
    ("math", ["answer"]), ("tool", ["tool_calls", "tools"]), ("code", ["tests"]),
])
def test_example_datasets_load(family, truth_keys):
    path = EXAMPLES / f"{family}.jsonl"
    samples = load_samples(path, family)
    raw = records(path)
    assert [s.id for s in samples] == [r["id"] for r in raw]
    for sample, record in zip(samples, raw):
        assert sample.family == family
        assert sample.ground_truth == {k: record[k] for k in truth_keys}
        assert sample.messages[-1] == {"role": "user", "content": record["prompt"]}
        assert sample.messages[0]["role"] == "system" and len(sample.messages) == 2
        assert sample.metadata == {}
    if family == "tool":
        for sample, record in zip(samples, raw):
            for tool in record["tools"]:
                assert json.dumps(tool) in sample.messages[0]["content"]
    else:
        expected = MATH_SYSTEM_PROMPT if family == "math" else CODE_SYSTEM_PROMPT
        assert all(s.messages[0]["content"] == expected for s in samples)


def test_messages_metadata_ids_and_system_prompt_override(tmp_path):
    path = tmp_path / "chat.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path.write_text(
        json.dumps({"messages": chat, "answer": 4, "level": 3}) + "\n\n"
        + json.dumps({"id": "q2", "prompt": "3+3?", "answer": "6"}) + "\n"
    )
    first, second = load_samples(path, "math", system_prompt="Answer in \\boxed{}.")
    assert first.id == "chat-1"
    assert first.messages == [{"role": "system", "content": "Be brief.\n\nAnswer in \\boxed{}."}, chat[1]]
    assert (first.ground_truth, first.metadata) == ({"answer": 4}, {"level": 3})
    assert second.id == "q2"
    assert second.messages == [
        {"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "3+3?"},
    ]
    (bare,) = load_samples(path, "math", system_prompt="")[1:]
    assert bare.messages == [{"role": "user", "content": "3+3?"}]
    (default,) = load_samples(path, "math")[:1]
    assert default.messages[0]["content"] == f"Be brief.\n\n{MATH_SYSTEM_PROMPT}"


@pytest.mark.parametrize("family,line,match", [
    ("math", "{not json", r"bad\.jsonl:2: not valid JSON"),
    ("math", "[1, 2]", r"bad\.jsonl:2: expected a JSON object"),
    ("math", '{"prompt": "x"}', r"bad\.jsonl:2: missing the math ground truth 'answer' or 'expected_answer'"),
    ("math", '{"answer": "1"}', r"bad\.jsonl:2: expected a prompt in one of 'messages', 'prompt'"),
    ("math", '{"prompt": "x", "answer": true}', "'answer' \\(the answer\\) must be a string or a number"),
    ("math", '{"messages": [{"role": "user"}], "answer": "1"}', "'messages' must be a string or a non-empty list"),
    ("tool", '{"prompt": "x", "tool_calls": [{"name": "f"}]}', "'tool_calls' must be"),
    ("code", '{"prompt": "x", "tests": [{"input": "1"}]}', "'tests' must be"),
])
def test_bad_records_are_named_with_file_and_line(tmp_path, family, line, match):
    path = tmp_path / "bad.jsonl"
    good = {"math": '{"prompt": "ok", "answer": "1"}', "tool": '{"prompt": "ok", "tool_calls": []}',
            "code": '{"prompt": "ok", "tests": [{"assert": "pass"}]}'}[family]
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ValueError, match=match):
        load_samples(path, family)


def test_bad_family_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="family"):
        load_samples(EXAMPLES / "math.jsonl", "poetry")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_samples(tmp_path / "missing.jsonl", "math")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no samples"):
        load_samples(tmp_path / "empty.jsonl", "math")


@pytest.fixture(scope="module")
def tokenizer():
    words = ["<|system|>", "<|user|>", "<|assistant|>", "Be", "brief.", "2+2?", "[UNK]"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]")
    tok.chat_template = TEMPLATE
    return tok


def test_render_and_encode_with_the_chat_template(tokenizer):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    text = render_prompt(tokenizer, chat)
    assert text == "<|system|> Be brief.\n<|user|> 2+2?\n<|assistant|>"
    assert encode_prompt(tokenizer, chat) == [0, 3, 4, 1, 5, 2]


def test_tokenizer_without_a_template_is_named(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="[UNK]")
    with pytest.raises(ValueError, match="no chat_template"):
        render_prompt(bare, [{"role": "user", "content": "hi"}])


REFERENCE_PROGRAMS = {
    "code-0": "a, b = map(int, input().split())\nprint(a + b)",
    "code-1": "print(input()[::-1])",
    "code-2": "input()\nprint(max(map(int, input().split())))",
    "code-3": "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1))",
    "code-4": "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
}


def test_example_code_tasks_are_solvable():
    samples = load_samples(EXAMPLES / "code.jsonl", "code")
    assert sorted(s.id for s in samples) == sorted(REFERENCE_PROGRAMS)
    for sample in samples:
        completion = f"```python\n{REFERENCE_PROGRAMS[sample.id]}\n```"
        assert code_pass(completion, 0, sample.ground_truth) == 1.0, sample.id
        assert code_no_bug(completion, 0, sample.ground_truth) == 1.0, sample.id
