"""The files `hvdtrain predict` writes, by the output's suffix: CSV, JSON lines or Parquet.

Each writer takes rows part by part (a part's rows at a time, never the whole output) into a
file it was given; the caller renames that file into place when all are written. A row is a
dict of the columns ``columns`` names; a list (a job's raw outputs) is a JSON array in a CSV
cell, a list column in Parquet.
"""
from __future__ import annotations

import csv
import json
from typing import IO, Sequence

FORMATS = {".csv": "CSV", ".jsonl": "JSON lines", ".parquet": "Parquet"}


class Writer:
    def __init__(self, path: str, columns: Sequence[str]):
        self.path, self.columns = path, list(columns)

    def write(self, rows: list[dict]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class CsvWriter(Writer):
    def __init__(self, path: str, columns: Sequence[str]):
        super().__init__(path, columns)
        self.file: IO[str] = open(path, "w", newline="", encoding="utf-8")
        self.writer = csv.DictWriter(self.file, fieldnames=self.columns)
        self.writer.writeheader()

    def write(self, rows: list[dict]) -> None:
        self.writer.writerows({name: json.dumps(value) if isinstance(value, list) else value
                               for name, value in row.items()} for row in rows)

    def close(self) -> None:
        self.file.close()


class JsonLinesWriter(Writer):
    def __init__(self, path: str, columns: Sequence[str]):
        super().__init__(path, columns)
        self.file: IO[str] = open(path, "w", encoding="utf-8")

    def write(self, rows: list[dict]) -> None:
        self.file.writelines(json.dumps(row) + "\n" for row in rows)

    def close(self) -> None:
        self.file.close()


class ParquetWriter(Writer):
    """A row group a part: written as they come, read back as one table."""

    def __init__(self, path: str, columns: Sequence[str], list_columns: Sequence[str] = ()):
        import pyarrow as pa
        import pyarrow.parquet as pq

        super().__init__(path, columns)
        self.pa = pa
        self.schema = pa.schema([
            (name, pa.list_(pa.float64()) if name in list_columns
             else pa.float64() if name.startswith("probability") else pa.string())
            for name in self.columns])
        self.writer = pq.ParquetWriter(path, self.schema)

    def write(self, rows: list[dict]) -> None:
        self.writer.write_table(self.pa.Table.from_pylist(rows, schema=self.schema))

    def close(self) -> None:
        self.writer.close()


def format_of(path: str) -> str:
    """The output's suffix, checked: '.csv', '.jsonl' or '.parquet' (refused in one line
    otherwise, or when Parquet's library is not installed)."""
    import os

    from hvdtrain.errors import UserError

    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FORMATS:
        raise UserError(f"--output {path}: name a .csv, .jsonl or .parquet file (the suffix "
                        "says the format)")
    if suffix == ".parquet":
        import importlib.util

        if importlib.util.find_spec("pyarrow") is None:
            raise UserError("Parquet output needs pyarrow: pip install pyarrow (or "
                            "'hvdtrain[parquet]'), or write .csv or .jsonl")
    return suffix


def open_writer(path: str, suffix: str, columns: Sequence[str],
                list_columns: Sequence[str] = ()) -> Writer:
    if suffix == ".parquet":
        return ParquetWriter(path, columns, list_columns)
    return (CsvWriter if suffix == ".csv" else JsonLinesWriter)(path, columns)
