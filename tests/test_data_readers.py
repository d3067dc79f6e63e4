"""Reading rows from JSON Lines, JSON, Parquet and Hugging Face datasets directories."""
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from gdpo_megatron.data.readers import Where, read_records

ROWS = [
    {"prompt": "2+2?", "answer": "4", "tags": {"level": 1}},
    {"prompt": "3*3?", "answer": "9", "tags": {"level": 2}, "source": "own"},  # keys differ per row
]


def read(path, **kwargs):
    return [(str(where), record) for where, record in read_records(path, **kwargs)]


def test_json_lines_skip_blank_lines_and_keep_each_rows_keys(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\r\n", encoding="utf-8")
    assert read(path) == [(f"{path}:1", ROWS[0]), (f"{path}:3", ROWS[1])]


def test_json_list_and_json_lines_under_a_json_name(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(ROWS, indent=4), encoding="utf-8")
    assert read(listed) == [(f"{listed} row 0", ROWS[0]), (f"{listed} row 1", ROWS[1])]
    lines = tmp_path / "lines.json"
    lines.write_text("\n".join(json.dumps(r) for r in ROWS), encoding="utf-8")
    assert read(lines) == [(f"{lines}:1", ROWS[0]), (f"{lines}:2", ROWS[1])]
    one = tmp_path / "one.json"
    one.write_text(json.dumps(ROWS[0]), encoding="utf-8")
    assert read(one) == [(f"{one}:1", ROWS[0])]
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(ROWS[0], indent=2), encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON list of objects or JSON Lines, got one multi-line"):
        read(pretty)


def test_parquet_rows_in_order_across_batches(tmp_path):
    path = tmp_path / "d.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "reward_model": {"ground_truth": str(i)}}
            for i in range(2500)]  # more than one read batch
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=700)
    got = read(path)
    assert [r for _, r in got] == rows
    assert got[2499][0] == f"{path} row 2499"


def test_datasets_directory_and_its_splits(tmp_path):
    Dataset.from_list(ROWS[:1]).save_to_disk(str(tmp_path / "single"))
    assert read(tmp_path / "single") == [(f"{tmp_path / 'single'} row 0", ROWS[0])]
    splits = DatasetDict({"train": Dataset.from_list([{"q": "a"}, {"q": "b"}]),
                          "test": Dataset.from_list([{"q": "c"}])})
    splits.save_to_disk(str(tmp_path / "dict"))
    assert read(tmp_path / "dict", split="test") == [(f"{tmp_path / 'dict'}[test] row 0", {"q": "c"})]
    assert [r["q"] for _, r in read(tmp_path / "dict")] == ["a", "b"]
    with pytest.raises(ValueError, match=r"no split 'validation' \(splits: train, test\)"):
        read(tmp_path / "dict", split="validation")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "train.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match="must be a Hugging Face dataset written by save_to_disk"):
        read(tmp_path / "plain")


def test_a_split_that_cannot_be_honored_is_an_error(tmp_path):
    single = tmp_path / "single"
    Dataset.from_list(ROWS).save_to_disk(str(single))
    # A single dataset has no "test" part: reading all of it would evaluate on the training rows.
    with pytest.raises(ValueError, match=rf"dataset {re.escape(str(single))}: holds a single dataset \(2 rows, no named split\), "
                                         r"not a DatasetDict with split 'test'; leave the split unset"):
        read(single, split="test")
    with pytest.raises(ValueError, match=r"not a DatasetDict with split 'train'"):
        read(single, split="train")
    saved_test = tmp_path / "saved_test"
    Dataset.from_list(ROWS[1:], split="test").save_to_disk(str(saved_test))
    assert read(saved_test, split="test") == read(saved_test) == [(f"{saved_test} row 0", ROWS[1])]
    with pytest.raises(ValueError, match=r"\(1 rows, saved from split 'test'\), not a DatasetDict with split 'train'"):
        read(saved_test, split="train")
    only_test = tmp_path / "only_test"
    DatasetDict({"test": Dataset.from_list(ROWS)}).save_to_disk(str(only_test))
    with pytest.raises(ValueError, match=r"no split 'train' \(splits: test\)"):
        read(only_test)  # the default split of a DatasetDict is train
    path = tmp_path / "test.jsonl"
    path.write_text(json.dumps(ROWS[0]), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"dataset {re.escape(str(path))}: split 'test' was asked for, but a file has no splits"):
        read(path, split="test")


def test_non_utf8_text_is_named_with_file_line_and_column(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\)"):
        read(path)
    listed = tmp_path / "latin1.json"
    listed.write_bytes(b'[\n  {"prompt": "ok"},\n  {"prompt": "caf\xe9"}\n]\n')
    with pytest.raises(ValueError, match=r"latin1\.json:3: not UTF-8 text \(byte 0xe9 at column 18\)"):
        read(listed)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + json.dumps(ROWS[0]).encode())
    assert read(bom) == [(f"{bom}:1", ROWS[0])]


@pytest.mark.parametrize("name,content,match", [
    ("bad.jsonl", '{"a": 1}\n{"a": \n', r"bad\.jsonl:2: not valid JSON"),
    ("bad.json", '[{"a": 1},\n {"a": ]', r"bad\.json:2: not valid JSON"),
    ("list.jsonl", '{"a": 1}\n[1, 2]\n', r"list\.jsonl:2: expected a JSON object, got list"),
    ("scalars.json", "[1, 2]", r"scalars\.json row 0: expected a JSON object, got int"),
    ("bad.parquet", "not parquet", r"bad\.parquet: not a Parquet file"),
    ("data.csv", "a,b\n", r"expected a \.jsonl, \.json, \.parquet file or a Hugging Face datasets directory"),
])
def test_malformed_files_are_named(tmp_path, name, content, match):
    path = tmp_path / name
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        read(path)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.parquet does not exist"):
        read(tmp_path / "nothing.parquet")


def test_where_prints_lines_from_one_and_rows_from_zero():
    assert str(Where("a.jsonl", "line", 3)) == "a.jsonl:3" and str(Where("a.parquet", "row", 0)) == "a.parquet row 0"
