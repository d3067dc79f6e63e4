"""The model's calls are parsed as data and dispatched only to documented functions with checked
arguments: every attack here is refused, and nothing it names runs."""
import importlib
import inspect
import os
import re

import pytest

from gdpo_megatron.environments import Call, CallRefused, Message, call_block, parse_calls
from gdpo_megatron.environments.bfcl import BACKENDS, CLASSES, BFCLEnvironment, function_docs
from gdpo_megatron.environments.calls import MAX_CALL_TEXT
from gdpo_megatron.environments.environment import bind_arguments

FILE_SYSTEM = {"involved_classes": ["GorillaFileSystem"], "initial_config": {"GorillaFileSystem": {"root": {
    "alice": {"type": "directory", "contents": {"document": {"type": "directory", "contents": {
        "notes.txt": {"type": "file", "content": "a b c"}}}}}}}}}


def fresh():
    environment = BFCLEnvironment()
    environment.reset(FILE_SYSTEM)
    return environment


def test_calls_parse_to_names_and_literal_arguments():
    assert parse_calls("cd(folder='document')") == [Call("cd", (), {"folder": "document"})]
    assert parse_calls("[ls(), sort('f.txt'), tail(file_name='f', lines=-3), f(x=[1.5, {'k': None}], y=True)]") == [
        Call("ls"), Call("sort", ("f.txt",)), Call("tail", (), {"file_name": "f", "lines": -3}),
        Call("f", (), {"x": [1.5, {"k": None}], "y": True}),
    ]
    assert str(Call("mv", ("a",), {"destination": "b"})) == "mv('a', destination='b')"


def test_call_block_tells_call_attempts_from_plain_answers():
    assert call_block("  [ls()]\n") == "[ls()]"
    assert call_block("```python\n[cd(folder='x')]\n```") == "[cd(folder='x')]"
    assert call_block("cd(folder='x')") == "cd(folder='x')"
    assert call_block("The file is moved.") is None
    assert call_block("Done (both files moved).") is None  # prose, not a failed call
    assert call_block("cd(folder=open('x').read())") is None  # not calls as it stands: prose, nothing runs
    assert call_block("[broken(") == "[broken("  # an attempt, which then fails to parse


@pytest.mark.parametrize("message", ["[]", " [ ] ", "```python\n[]\n```", "[  # " + "lorem " * 300 + "\n]",
                                     "<tool_call>[]</tool_call>", "<think>no</think><tool_call> [ ] </tool_call>"])
def test_a_block_without_a_call_is_a_plain_answer(message):
    """A block that parses to no call at all is a plain answer (BFCL ends a turn on an empty
    response), not a step that runs nothing and lets the model go again."""
    assert call_block(message) is None and Message(message).calls() is None


def test_json_tool_calls_in_tags_are_calls_too():
    message = ('<think>weather</think>\n<tool_call>\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n'
               '</tool_call>\n<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    block = call_block(message)
    assert block == ('<tool_call>\n[{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n</tool_call>'
                     '<tool_call>{"name": "ls", "arguments": {}}</tool_call>')
    assert parse_calls(block) == [Call("get_weather", (), {"city": "Oslo"}), Call("ls")]
    assert call_block("</tool_call>") is None  # a closing tag alone is prose
    for text, why in [('<tool_call>{"name": "ls", ', "not a JSON tool call"),
                      ('<tool_call>["ls"]</tool_call>', "expected a tool call object with a 'name'"),
                      ('<tool_call>{"name": "os.system", "arguments": {}}</tool_call>', "not a callable function name"),
                      ('<tool_call>{"name": "__class__"}</tool_call>', "not a callable function name"),
                      ('<tool_call>{"name": "cd", "arguments": "x"}</tool_call>', "must be an object"),
                      ("<tool_call>" + "[" + ", ".join(['{"name": "ls"}'] * 65) + "]</tool_call>", "over the limit")]:
        with pytest.raises(CallRefused, match=re.escape(why)):
            parse_calls(call_block(text))


SIDE_EFFECT = "/tmp/gdpo_environment_attack_marker"

ATTACKS = {
    "__import__('os').system('touch " + SIDE_EFFECT + "')": "attribute",
    "cd(folder=open('/etc/passwd').read())": "literal",
    "cd(folder=__import__('os').getcwd())": "literal",
    "exec('import os')": None,  # parses as a call of an unknown name: refused at dispatch
    "eval('1')": None,
    "_load_scenario({})": "'_'",
    "__class__()": "'_'",
    "ls.__globals__": "got an attribute access",
    "ls.__globals__['x']()": "plain name",
    "[cd(folder=x) for x in 'ab']": "expected a function call",
    "cd(*['document'])": "*arguments",
    "cd(**{'folder': 'document'})": "**arguments",
    "cd(folder='a' + 'b')": "literal",
    "cd(folder=f'{1}')": "literal",
    "cd(folder=(lambda: 'x')())": "literal",
    "cd(folder={1, 2})": "set values",
    "cd(folder=b'x')": "bytes values",
    "cd(folder='x', folder='y')": "given twice",
    "f(x=" + "[" * 500 + "]" * 500 + ")": "not Python call syntax",
    "f(x='" + "a" * MAX_CALL_TEXT + "')": "over the limit",
    "[" + ", ".join(["ls()"] * 65) + "]": "over the limit",
    "import os": "not Python call syntax",
    "cd(folder='document'); rm(file_name='notes.txt')": "not Python call syntax",
}


@pytest.mark.parametrize("text", ATTACKS)
def test_attacks_are_refused_without_side_effects(text):
    environment, untouched = fresh(), fresh()
    why = ATTACKS[text]
    if why is not None:
        with pytest.raises(CallRefused, match=re.escape(why)):
            parse_calls(text)
    else:
        (result,) = environment.step(parse_calls(text)).results
        assert result.refused and result.error and "is not an available function" in result.output
    assert not os.path.exists(SIDE_EFFECT)
    assert environment.matches(untouched) and untouched.matches(environment)


def test_only_documented_public_functions_are_dispatched():
    environment = fresh()
    schemas = {tool["name"]: tool for tool in environment.tools()}
    assert hasattr(environment._instances["GorillaFileSystem"], "_load_scenario")
    for name in ("_load_scenario", "load_scenario", "__init__", "system", "kill", "reset", "step", "call"):
        with pytest.raises(CallRefused, match="not an available function"):
            bind_arguments(Call(name.lstrip("_") or name), schemas)


@pytest.mark.parametrize("call, why", [
    (Call("cd"), "missing required argument 'folder'"),
    (Call("cd", (), {"folder": "x", "path": "y"}), "unknown argument 'path'"),
    (Call("cd", (), {"folder": 3}), "'folder' must be string, got int"),
    (Call("tail", (), {"file_name": "f", "lines": True}), "'lines' must be integer, got bool"),
    (Call("tail", (), {"file_name": "f", "lines": 2.5}), "'lines' must be integer, got float"),
    (Call("cd", ("a", "b")), "at most 1 arguments"),
    (Call("cd", ("a",), {"folder": "b"}), "'folder' given twice"),
])
def test_arguments_are_checked_against_the_schema(call, why):
    environment = fresh()
    (result,) = environment.step([call]).results
    assert result.refused and why in result.output
    assert environment.matches(fresh())


def test_an_accepted_call_runs_and_a_failing_one_is_an_error_result():
    environment = fresh()
    results = environment.step(parse_calls("[cd(folder='document'), cat('notes.txt'), cd(folder='nowhere')]")).results
    assert [r.output for r in results[:2]] == ['{"current_working_directory": "document"}',
                                               '{"file_content": "a b c"}']
    assert not results[0].error and not results[1].error
    assert "nowhere" in results[2].output and not results[2].refused
    assert environment.matches(fresh())  # BFCL's state is the tree, not the working directory
    environment.step([Call("touch", (), {"file_name": "new.txt"})])
    assert not environment.matches(fresh())


def test_positional_arguments_follow_the_docs_which_match_the_methods_but_one():
    """The docs' parameter order (the model's) is the backend method's everywhere but the one
    function the BFCL environment's docstring names."""
    differ = []
    for class_name, (module, _) in CLASSES.items():
        cls = getattr(importlib.import_module(f"{BACKENDS}.{module}"), class_name)
        for doc in function_docs(class_name):
            method = [p for p in inspect.signature(getattr(cls, doc["name"])).parameters if p != "self"]
            if method != list(doc["parameters"]["properties"]):
                differ.append(f"{class_name}.{doc['name']}")
    assert differ == ["TravelAPI.purchase_insurance"]
    schemas = {doc["name"]: doc for doc in function_docs("TravelAPI")}
    assert bind_arguments(Call("purchase_insurance", ("t", "trip", 10.0, "b1", "c1")), schemas) == {
        "access_token": "t", "insurance_type": "trip", "insurance_cost": 10.0, "booking_id": "b1", "card_id": "c1"}
