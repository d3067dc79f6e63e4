"""Records from the files RL data sets are published in.

``read_records(path)`` yields ``(where, record)`` pairs, one per row: ``record`` is a dict and
``where`` (a :class:`Where`) names the file and the line (JSON Lines, counted from 1) or the
row (JSON lists and tables, counted from 0) for error messages. By ``path``:

* ``*.jsonl``: JSON Lines (one object per line, blank lines skipped);
* ``*.json``: a JSON list of objects, or JSON Lines under a ``.json`` name (as Hugging Face
  ``datasets`` reads both);
* ``*.parquet``: read with pyarrow, one row group at a time (verl's data files);
* a directory: a Hugging Face ``datasets`` dataset written by ``save_to_disk``: of a
  ``DatasetDict``, the rows of ``split`` (default ``train``); of a single ``Dataset``, all its
  rows (a ``split`` is honored only where the dataset was saved from that split).

A split that cannot be honored (one a directory does not hold, any split of a file) is an
error naming the path and what it holds, never ignored. A row that cannot be read (a JSON
Lines line that is not UTF-8 or not JSON, a record that is not an object) is a :class:`BadRow`:
raised, or, given ``on_bad_row``, handed to it while the reading goes on to the next row.

JSON is read with the standard library so that each record keeps its own keys (an Arrow
schema would give every row the union of all rows' keys, filled with nulls); text must be
UTF-8. Every error names the file and the line or row.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

SUFFIXES = (".jsonl", ".json", ".parquet")
_PARQUET_BATCH_ROWS = 1024


class Where(NamedTuple):
    """A row's place: ``file:line`` for JSON Lines, ``file row N`` for lists and tables."""

    source: str
    unit: str  # "line" (counted from 1) or "row" (counted from 0)
    number: int

    def __str__(self) -> str:
        return f"{self.source}:{self.number}" if self.unit == "line" else f"{self.source} row {self.number}"


class BadRow(ValueError):
    """One row that cannot be read; the message names the file and the line or row."""


def read_records(path: str | Path, split: str | None = None, on_bad_row: Optional[Callable[[BadRow], None]] = None
                 ) -> Iterator[tuple[Where, dict[str, Any]]]:
    """``(where, record)`` for every record of the file or dataset directory ``path`` (of
    ``split``, for a directory; see the module docstring); a row that cannot be read goes to
    ``on_bad_row`` (None: it is raised)."""
    path = Path(path)
    if path.is_dir():
        rows = _dataset_dir_rows(path, split)
    elif not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    elif split is not None:
        raise ValueError(f"dataset {path}: split {split!r} was asked for, but a file has no splits "
                         "(a split picks part of a datasets directory); leave the split unset to read the file")
    elif path.suffix == ".jsonl":
        rows = _json_lines(path, path.read_bytes())
    elif path.suffix == ".json":
        rows = _json_file(path)
    elif path.suffix == ".parquet":
        rows = _parquet_rows(path)
    else:
        raise ValueError(f"dataset {path}: expected a {', '.join(SUFFIXES)} file or a Hugging Face "
                         f"datasets directory (save_to_disk), got a {path.suffix or 'suffix-less'} file")
    for where, record in rows:
        if not isinstance(record, (dict, BadRow)):
            record = BadRow(f"{where}: expected a JSON object, got {type(record).__name__}")
        if isinstance(record, BadRow):
            if on_bad_row is None:
                raise record
            on_bad_row(record)
        else:
            yield where, record


def _decode(path: Path, data: bytes, first_line: int = 1) -> str:
    """``data`` as UTF-8 text (a leading byte-order mark dropped); errors name the line."""
    try:
        return data.decode("utf-8-sig" if first_line == 1 else "utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data[: e.start].count(b"\n")
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise BadRow(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {column})") from None


def _json_lines(path: Path, data: bytes) -> Iterator[tuple[Where, Any]]:
    """Each line's record, or the :class:`BadRow` saying why it has none."""
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        where = Where(str(path), "line", lineno)
        try:
            line = _decode(path, raw, lineno)
        except BadRow as e:
            yield where, e
            continue
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except (ValueError, RecursionError) as e:
            yield where, BadRow(f"{path}:{lineno}: not valid JSON ({_json_error(e)})")


def _json_error(e: ValueError | RecursionError) -> str:
    """What the JSON parser rejected: a syntax error, an integer past Python's digit limit, or depth."""
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def _json_file(path: Path) -> Iterator[tuple[Where, Any]]:
    data = path.read_bytes()
    text = _decode(path, data)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # more than one JSON value: JSON Lines
            return _json_lines(path, data)
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # the parser reports no position for these
        raise ValueError(f"{path}: not valid JSON ({_json_error(e)})") from None
    if isinstance(document, list):
        return ((Where(str(path), "row", i), record) for i, record in enumerate(document))
    if "\n" in text.strip():
        raise ValueError(f"{path}: expected a JSON list of objects or JSON Lines, got one multi-line "
                         f"JSON {type(document).__name__}")
    return iter([(Where(str(path), "line", 1), document)])


def _parquet_rows(path: Path) -> Iterator[tuple[Where, Any]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a Parquet file ({e})") from None
    row, batches = 0, table.iter_batches(batch_size=_PARQUET_BATCH_ROWS)
    while True:
        try:
            records = next(batches).to_pylist()
        except StopIteration:
            return
        except (pyarrow.ArrowException, OSError) as e:  # a damaged page
            raise ValueError(f"{path}: cannot read the Parquet rows from row {row} ({e})") from None
        for record in records:
            yield Where(str(path), "row", row), record
            row += 1


def _dataset_dir_rows(path: Path, split: str | None) -> Iterator[tuple[Where, Any]]:
    if not any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
        raise ValueError(f"dataset {path}: a directory must be a Hugging Face dataset written by save_to_disk "
                         "(dataset_info.json or dataset_dict.json); for a downloaded dataset repository, "
                         f"point at one of its {', '.join(SUFFIXES)} files")
    import pyarrow
    from datasets import DatasetDict, load_from_disk

    try:
        dataset = load_from_disk(str(path))
    except (pyarrow.ArrowException, OSError) as e:  # a damaged or missing data file
        raise ValueError(f"dataset {path}: cannot read it ({e})") from None
    where = str(path)
    if isinstance(dataset, DatasetDict):
        split = split or "train"
        if split not in dataset:
            raise ValueError(f"dataset {path}: no split {split!r} (splits: {', '.join(dataset)})")
        dataset, where = dataset[split], f"{path}[{split}]"
    elif split is not None:
        saved_from = None if dataset.split is None else str(dataset.split)
        if split != saved_from:
            holds = f"saved from split {saved_from!r}" if saved_from else "no named split"
            raise ValueError(f"dataset {path}: holds a single dataset ({dataset.num_rows} rows, {holds}), not a "
                             f"DatasetDict with split {split!r}; leave the split unset to read all its rows")
    for i, record in enumerate(dataset):
        yield Where(where, "row", i), record
