"""Malformed data files: each error is one line naming the file and, where it can, the row."""
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from gdpo_megatron.data.readers import read_records
from gdpo_megatron.data.samples import BadRows, Fields, load_samples

GOOD = {"problem": "1 + 1?", "answer": "2"}
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_INT = "1" + "0" * 5000  # past Python's 4300-digit limit on int("...")


def read(path):
    return list(read_records(path))


@pytest.mark.parametrize("value,match", [(DEEP, "nested too deeply"), (HUGE_INT, "digits")])
def test_json_values_past_the_parsers_limits_name_the_file_and_line(tmp_path, value, match):
    lines = tmp_path / "rows.jsonl"
    lines.write_text(json.dumps(GOOD) + '\n{"problem": "x", "answer": ' + value + "}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(lines))}:2: .*{match}"):
        read(lines)
    listed = tmp_path / "rows.json"
    listed.write_text("[" + json.dumps(GOOD) + ', {"problem": "x", "answer": ' + value + "}]", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(listed))}: .*{match}"):
        read(listed)


def test_a_damaged_parquet_page_names_the_file_and_the_rows(tmp_path):
    path = tmp_path / "damaged.parquet"
    rows = [{"problem": f"problem {i}", "answer": str(i)} for i in range(3000)]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=1000, compression="NONE")
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # inside the second row group's pages; the footer stays intact
    data[middle:middle + 2000] = b"\xab" * 2000
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: cannot read the Parquet rows from row \d+ "):
        read(path)


def test_a_damaged_datasets_directory_names_it(tmp_path):
    DatasetDict({"train": Dataset.from_list([GOOD])}).save_to_disk(str(tmp_path / "ds"))
    for arrow in (tmp_path / "ds" / "train").glob("*.arrow"):
        arrow.write_bytes(b"not arrow")
    with pytest.raises(ValueError, match=rf"^dataset {re.escape(str(tmp_path / 'ds'))}: cannot read it \("):
        read(tmp_path / "ds")


def test_flattened_dotted_column_names_are_read_as_they_are(tmp_path):
    # Flattening a nested table (pandas json_normalize, datasets' flatten) names the columns
    # "reward_model.ground_truth": the dotted name is then the field itself.
    path = tmp_path / "flat.parquet"
    row = {"prompt": [{"role": "user", "content": "1 + 1?"}], "reward_model.ground_truth": "2",
           "reward_model.style": "rule"}
    pq.write_table(pa.Table.from_pylist([row]), path)
    for fields in (Fields(), Fields(ground_truth_key="reward_model.ground_truth")):
        (sample,) = load_samples(path, "math", fields=fields)
        assert sample.ground_truth == {"answer": "2"} and sample.metadata == {"reward_model.style": "rule"}


@pytest.mark.parametrize("truth", [7, {"answer": "<think> t </think>"}, ["<think> t </think>"]])
def test_a_toolrl_reference_that_is_not_a_string_is_an_error_naming_the_row(tmp_path, truth):
    path = tmp_path / "toolrl.parquet"
    rows = [{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "<think> t </think>"}},
            {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": json.dumps(truth)}}]
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert len(load_samples(path, "toolrl")) == 2  # JSON text of it is just a (call-less) string
    rows[1]["reward_model"]["ground_truth"] = truth
    path = tmp_path / "toolrl.json"
    path.write_text(json.dumps(rows), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))} row 1: 'reward_model.ground_truth' .*must be a string"):
        load_samples(path, "toolrl")


def test_every_malformed_row_is_named_up_to_twenty_then_counted(tmp_path):
    """Rows that are not JSON, not objects or lack a prompt, among good ones: one line each for
    the first 20 in file order, then how many more; reading goes on past each."""
    path = tmp_path / "rows.jsonl"
    rows, bad = [], []
    for i in range(60):
        if i % 2:
            rows.append(json.dumps(GOOD))
        elif i % 4 == 0:
            rows.append('{"problem": "x", "answer": ')
            bad.append(f"{path}:{i + 1}: not valid JSON (Expecting value: line 1 column 28 (char 27))")
        else:
            rows.append(json.dumps([GOOD]))
            bad.append(f"{path}:{i + 1}: expected a JSON object, got list")
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    with pytest.raises(BadRows) as refused:
        load_samples(path, "math")
    assert refused.value.count == 30
    assert refused.value.lines() == bad[:20] + [f"{path}: 10 more malformed rows (the first 20 are listed above)"]
    assert str(refused.value) == "\n".join(refused.value.lines())
    path.write_text("\n".join(rows[:5]) + "\n", encoding="utf-8")  # three bad rows: each named, no count
    with pytest.raises(BadRows) as refused:
        load_samples(path, "math")
    assert refused.value.lines() == bad[:3] and refused.value.count == 3
