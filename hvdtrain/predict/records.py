"""TFRecord shards as `hvdtrain predict`'s inputs: every record of every shard, the shards in
name order and each file's records in file order; a row's key is ``SHARD:N``, the record's
place in its file."""
from __future__ import annotations

import glob
import itertools
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hvdtrain.errors import UserError
from hvdtrain.predict.inputs import Inputs

if TYPE_CHECKING:
    import tensorflow as tf


@dataclass(frozen=True)
class RecordInputs(Inputs):
    files: tuple[str, ...] = ()
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Records in each file."""

    @property
    def starts(self) -> np.ndarray:
        """The index of each file's first record."""
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.counts.sum())

    def where(self, index: int) -> tuple[int, int]:
        """(file, record in it) of input ``index``."""
        file = int(np.searchsorted(self.starts, index, side="right")) - 1
        return file, index - int(self.starts[file])

    def digest(self) -> str:
        import hashlib

        return hashlib.sha256(json.dumps([list(self.files), self.counts.tolist()]).encode()
                              ).hexdigest()

    def key(self, index: int) -> str:
        file, record = self.where(index)
        return f"{os.path.basename(self.files[file])}:{record}"

    def encoded(self, ranges: list[tuple[int, int]]) -> tf.data.Dataset:
        import tensorflow as tf

        from hvdtrain.data.records import parse_example

        pieces = None
        for (start, stop), (file, (first, count)) in itertools.product(
                ranges, enumerate(zip(self.starts, self.counts))):
            begin, end = max(start, first), min(stop, first + count)
            if begin >= end:
                continue
            # Numbered as read, before anything can fail: a record that does not parse or
            # decode is dropped downstream, and its number's gap makes its row.
            records = tf.data.TFRecordDataset(self.files[file]).skip(begin - first) \
                .take(end - begin)
            piece = tf.data.Dataset.zip(tf.data.Dataset.range(begin, end), records).map(
                lambda index, record: (index, parse_example(record)[0]))
            pieces = piece if pieces is None else pieces.concatenate(piece)
        return pieces

    def failure(self, index: int, decode) -> str:
        file, record = self.where(index)
        return f"record {record} of {self.files[file]} could not be read or decoded"


def list_records(location: str) -> RecordInputs:
    """The shards of a directory (``*.tfrecord``, counted from its dataset.json where it
    counts them) or a glob."""
    from hvdtrain.data.records import METADATA

    if os.path.isdir(location):
        files = sorted(glob.glob(os.path.join(location, "*.tfrecord")))
        try:
            with open(os.path.join(location, METADATA)) as file:
                counted = json.load(file).get("counts", {})
        except (OSError, ValueError, AttributeError):
            counted = {}
    else:
        files, counted = sorted(glob.glob(location)), {}
    files = [path for path in files if os.path.isfile(path)]
    if not files:
        raise UserError(f"--tfrecords {location}: no TFRecord files there")
    counts = np.array([counted.get(os.path.basename(path)) or _count(path) for path in files],
                      np.int64)
    if not counts.sum():
        raise UserError(f"--tfrecords {location}: its {len(files)} file(s) hold no records")
    return RecordInputs(description=f"{location}: {int(counts.sum())} record(s) in "
                                    f"{len(files)} file(s)", notes=(), files=tuple(files),
                        counts=counts)


def _count(path: str) -> int:
    """The records of a shard dataset.json does not count, read to its end."""
    from hvdtrain.data.records import count_records
    from hvdtrain.errors import op_error_line

    try:
        return count_records(path)
    except Exception as error:  # noqa: BLE001 - TensorFlow's DataLossError, an OSError
        raise UserError(f"cannot count the records of {path} (and no dataset.json counts "
                        f"them): {op_error_line(error)}") from None
