"""Export rows to files: JSON Lines, or Parquet a row group at a time (one type per column,
the same in every row group)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson


def write_jsonl(produced: Iterator[dict[str, Any]], path: Path) -> int:
    count = 0
    with open(path, "wb") as out:
        for row in produced:
            out.write(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
            count += 1
    return count


# Lists of numbers stay lists in Parquet; every other non-scalar value is written as JSON text.
_LIST_COLUMNS = {
    "prompt_token_ids": "int32",
    "completion_token_ids": "int32",
    "logprobs": "float32",
}


def write_parquet(
    produced: Iterator[dict[str, Any]], path: Path, names: list[str], batch: int
) -> int:
    import pyarrow as pa  # (here: the CLI's other commands need not load it)
    import pyarrow.parquet as pq

    schema = pa.schema([(name, _parquet_type(pa, name)) for name in names])
    count = 0
    chunk: list[dict[str, Any]] = []
    with open(path, "wb") as out, pq.ParquetWriter(out, schema) as writer:

        def flush() -> None:
            values = {name: [_parquet_value(name, row[name]) for row in chunk] for name in names}
            writer.write_table(pa.Table.from_pydict(values, schema=schema))
            chunk.clear()

        for row in produced:
            chunk.append(row)
            count += 1
            if len(chunk) >= batch:
                flush()
        if chunk or not count:  # no rows: one empty row group, so the file has the columns
            flush()
    return count


def _parquet_value(name: str, value: Any) -> Any:
    if name in _LIST_COLUMNS or value is None or isinstance(value, str | int | float | bool):
        return value
    return orjson.dumps(value).decode()


def _parquet_type(pa: Any, name: str) -> Any:
    """One type per column, the same in every row group (not guessed from the values)."""
    if name in _LIST_COLUMNS:
        return pa.list_(getattr(pa, _LIST_COLUMNS[name])())
    return _SCALAR_TYPES[name](pa) if name in _SCALAR_TYPES else pa.string()


_SCALAR_TYPES: dict[str, Callable[[Any], Any]] = {
    "policy_version": lambda pa: pa.int32(),
    "trained_version": lambda pa: pa.int32(),
    "prompt_tokens": lambda pa: pa.int32(),
    "completion_tokens": lambda pa: pa.int32(),
    "latency_ms": lambda pa: pa.float64(),
    "cost_usd": lambda pa: pa.float64(),
    "return": lambda pa: pa.float64(),
    "final_reward": lambda pa: pa.float64(),
    "chosen_return": lambda pa: pa.float64(),
    "rejected_return": lambda pa: pa.float64(),
}
