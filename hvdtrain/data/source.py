"""The image data the flags name, parsed once into one typed value (``ImageConfig.source``).

Three flags can name it (``--data-dir``, ``--tfrecords``, ``--data``); everything after the flags
asks this value, never the flags: which kind it is (a row of ``data.sources.LISTERS``), where it
is, whether it is read from files, and how the banner, the run directory's default name and its
fingerprint call it. A new source is a kind here, one lister in ``data/sources.py`` and its test.
Imports nothing heavy: the flags' own checks (``--help``) run without TensorFlow.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

#: Each kind and what the banner and the fingerprint call it.
KINDS = {"folder": "image folder", "tfrecords": "TFRecords", "embedded": "embedded"}


@dataclass(frozen=True)
class DataSource:
    """One of ``KINDS`` and where it is: a folder, a TFRecord directory or glob (a path or a URL),
    or the name of an embedded set ('digits', 'synthetic')."""

    kind: str
    location: str

    @classmethod
    def from_flags(cls, data_dir: str | None, tfrecords: str | None, data: str) -> DataSource:
        """The source the flags name (ValueError, one line, when they name two)."""
        if data_dir and tfrecords:
            raise ValueError("give either --data-dir or --tfrecords, not both")
        if data_dir:
            return cls("folder", data_dir)
        if tfrecords:
            return cls("tfrecords", tfrecords)
        return cls("embedded", data)

    @property
    def from_files(self) -> bool:
        """Read from files (listed on rank 0, decoded per rank), not held in memory."""
        return self.kind != "embedded"

    @property
    def label(self) -> str:
        """'image folder', 'TFRecords' or 'embedded digits' (or synthetic)."""
        return KINDS[self.kind] + ("" if self.from_files else f" {self.location}")

    def described(self) -> str:
        """The kind and, for files, the path (a local one resolved, a URL as given)."""
        if not self.from_files:
            return self.label
        from hvdtrain.rundir import is_url

        where = self.location if is_url(self.location) else os.path.realpath(self.location)
        return f"{self.label} {where}"
