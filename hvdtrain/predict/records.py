"""TFRecord shards as `hvdtrain predict`'s inputs: every record of every shard, the shards in
name order and each file's records in file order; a row's key is ``SHARD:N``, the record's
place in its file (SHARD the file's name, or its path from the folder holding every shard when
they lie in several).

A run of records in one file is read by one ``TFRecordDataset``, which ends at the first record
it cannot read (a corrupt one): the records it dropped are read again one by one
(``RecordInputs.read_alone``, at offsets found by walking the file's framing), so only the
corrupt record's row says it cannot be read."""
from __future__ import annotations

import functools
import glob
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hvdtrain.errors import UserError
from hvdtrain.predict.inputs import InputFailure, Inputs

if TYPE_CHECKING:
    import tensorflow as tf

RECORD_FRAMING = 16
"""Bytes a TFRecord adds to its data: its length (8, little-endian), the length's masked CRC
(4) before the data, the data's (4) after it."""


@dataclass(frozen=True)
class RecordInputs(Inputs):
    files: tuple[str, ...] = ()
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Records in each file."""
    class_names: tuple[str, ...] | None = None
    """The classes the shards were converted from (their dataset.json's), when it says."""

    @functools.cached_property
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

    @functools.cached_property
    def shard_names(self) -> tuple[str, ...]:
        """Each file as its rows name it: its name, or, when the shards lie in several folders
        (a glob can reach two ``train-00000-of-00004.tfrecord``), its path from the deepest
        folder holding them all."""
        folders = {os.path.dirname(path) for path in self.files}
        if len(folders) == 1:
            return tuple(os.path.basename(path) for path in self.files)
        root = os.path.commonpath(sorted(folders))
        return tuple(os.path.relpath(path, root) for path in self.files)

    def key(self, index: int) -> str:
        file, record = self.where(index)
        return f"{self.shard_names[file]}:{record}"

    def encoded(self, ranges: list[tuple[int, int]]) -> tf.data.Dataset:
        import tensorflow as tf

        from hvdtrain.data.records import parse_example

        # One (file, first record wanted, end, the file's first index) per piece of a range in
        # a file, read by one flat_map: a chain of datasets, one per piece, grew to gigabytes
        # for a thousand shards.
        pieces = [(file, begin, end, first)
                  for start, stop in ranges
                  for file, (first, count) in enumerate(zip(self.starts.tolist(),
                                                            self.counts.tolist()))
                  for begin, end in [(max(start, first), min(stop, first + count))]
                  if begin < end]
        files = tf.constant(self.files)

        def piece(file, begin, end, first):
            # Numbered as read, before anything can fail: a record that does not read, parse
            # or decode is dropped downstream (a corrupt one ends its piece's read, dropping
            # the rest of the piece too), and its number's gap makes its row (read_alone).
            records = tf.data.TFRecordDataset(tf.gather(files, file)).skip(begin - first) \
                .take(end - begin)
            return tf.data.Dataset.zip(tf.data.Dataset.range(begin, end), records)

        columns = np.array(pieces, np.int64).reshape(-1, 4).T
        return (tf.data.Dataset.from_tensor_slices(tuple(columns)).flat_map(piece)
                .map(lambda index, record: (index, parse_example(record)[0])))

    def read_alone(self, index: int) -> bytes:
        import tensorflow as tf
        from tensorflow.python.lib.io.tf_record import tf_record_random_reader

        from hvdtrain.data.records import parse_example
        from hvdtrain.errors import op_error_line

        file, record = self.where(index)
        path = self.files[file]
        cannot = f"record {record} of {path} cannot be read"
        try:
            if file not in self._offsets:
                self._offsets[file] = _record_offsets(path, int(self.counts[file]))
            offsets, walk_ended = self._offsets[file]
            if record >= len(offsets):
                raise InputFailure(f"{cannot}: {walk_ended}")
            # Both CRCs checked: a record whose bytes changed is DataLossError, never read.
            data, _ = tf_record_random_reader(path).read(offsets[record])
        except OSError as error:
            raise InputFailure(f"{cannot}: {error.strerror or error}") from None
        except (tf.errors.OpError, IndexError) as error:  # IndexError: past the file's end
            raise InputFailure(f"{cannot}: {op_error_line(error)}") from None
        try:
            return parse_example(data)[0].numpy()
        except tf.errors.OpError as error:
            raise InputFailure(f"record {record} of {path} is not an Example with an image: "
                               f"{op_error_line(error)}") from None

    @functools.cached_property
    def _offsets(self) -> dict[int, tuple[list[int], str | None]]:
        """Where each record starts, by file: walked when a record of it is first read alone,
        once per file in a process."""
        return {}


def list_records(location: str) -> RecordInputs:
    """The shards of a directory (``*.tfrecord``) or a glob, counted from the dataset.json
    beside them where it counts a file of the size it has (the converter's), else read to
    their end (on rank 0: a large set without its dataset.json takes as long as reading it)."""
    from hvdtrain.data.records import METADATA

    pattern = (os.path.join(glob.escape(location), "*.tfrecord") if os.path.isdir(location)
               else location)
    files = [path for path in sorted(glob.glob(pattern)) if os.path.isfile(path)]
    if not files:
        raise UserError(f"--tfrecords {location}: no TFRecord files there")
    metadata = {}
    for folder in sorted({os.path.dirname(path) for path in files}):
        try:
            with open(os.path.join(folder, METADATA)) as file:
                metadata[folder] = json.load(file)
        except (OSError, ValueError):
            continue
    counted = [_count(path, metadata.get(os.path.dirname(path))) for path in files]
    counts = np.array([count for count, _ in counted], np.int64)
    if not counts.sum():
        raise UserError(f"--tfrecords {location}: its {len(files)} file(s) hold no records")
    names = {tuple(found["class_names"]) for found in metadata.values()
             if isinstance(found, dict) and isinstance(found.get("class_names"), list)}
    return RecordInputs(description=f"{location}: {int(counts.sum())} record(s) in "
                                    f"{len(files)} file(s)",
                        notes=tuple(note for _, note in counted if note), files=tuple(files),
                        counts=counts, class_names=names.pop() if len(names) == 1 else None)


def _record_offsets(path: str, count: int) -> tuple[list[int], str | None]:
    """Where each of the first ``count`` records of a TFRecord file starts, as far as they can
    be found, and why the rest cannot (None: all found): its framing walked from header to
    header (a seek and a 12-byte read a record: the length and its checksum, which says whether
    the next header's place can be trusted; the data's checksum is the reader's to check)."""
    offsets: list[int] = []
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        offset = 0
        while len(offsets) < count:
            file.seek(offset)
            header = file.read(12)
            if len(header) < 12:
                return offsets, "the file ends before the record does (cut short)"
            if _masked_crc32c(header[:8]) != int.from_bytes(header[8:], "little"):
                return offsets, (f"the length of record {len(offsets)} is damaged, so no "
                                 "record from it on can be found")
            end = offset + RECORD_FRAMING + int.from_bytes(header[:8], "little")
            if end > size:
                return offsets, "the file ends before the record does (cut short)"
            offsets.append(offset)
            offset = end
    return offsets, None


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """A TFRecord header's checksum of its length: CRC-32C, rotated and offset as TensorFlow's
    crc32c::Mask does."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _count(path: str, metadata: dict | None) -> tuple[int, str | None]:
    """The records of a shard, and a note when it cannot be read to its end. dataset.json's
    count when it also has the file's size; else the file is read: to its end (a shard
    rewritten since: its own count), or to a record that cannot be read (a shard cut short:
    dataset.json's count where it has one, the rows of the records past the damage saying
    so, else the records read, with a note)."""
    import tensorflow as tf

    from hvdtrain.errors import op_error_line

    counted = None
    if isinstance(metadata, dict):
        name = os.path.basename(path)
        counted = (metadata.get("counts") or {}).get(name)
        counted = counted if isinstance(counted, int) else None
        if counted is not None and (metadata.get("bytes") or {}).get(name) == \
                os.path.getsize(path):
            return counted, None
    read = 0
    try:
        for _ in tf.data.TFRecordDataset(path):
            read += 1
    except (tf.errors.OpError, OSError) as error:
        if counted is not None:
            return max(counted, read), None
        return read, (f"{path}: read {read} record(s), then: {op_error_line(error)}; the rest "
                      "of it is not predicted")
    return read, None
