"""What `hvdtrain predict` reads: its inputs in their order, and how a range of them is read.

An ``Inputs`` is listed once by rank 0 and sent to every rank (so it is picklable and compact:
an image folder of 1.28 M files travels as one compressed block of names). Each rank reads only
the parts it predicts, a range of inputs at a time, so what it holds while predicting is one
name at a time, never the whole list's images. Three kinds: an image folder (recursively), a list
of files, TFRecord shards (``records.py``).
"""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import stat
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hvdtrain.data.images import IMAGE_EXTENSIONS
from hvdtrain.errors import UserError

STAT_THREADS = 16

if TYPE_CHECKING:
    import tensorflow as tf


class InputFailure(Exception):
    """An input that gives no image read alone; its message is the row's ``error``."""


@dataclass(frozen=True)
class Inputs:
    """The inputs, in the order their rows are written."""

    description: str
    """What they are, for the banner and the result."""
    notes: tuple[str, ...]
    """What the listing left out, one line each."""

    def __len__(self) -> int:
        raise NotImplementedError

    def key(self, index: int) -> str:
        """What input ``index``'s row calls it: its path, or its record's key."""
        raise NotImplementedError

    def digest(self) -> str:
        """sha256 of the inputs in order: the same inputs in the same order, for a resume."""
        raise NotImplementedError

    def encoded(self, ranges: list[tuple[int, int]]) -> tf.data.Dataset:
        """``(index, encoded image bytes)`` of the inputs in ``ranges`` (start, stop), in order,
        as one dataset (one made a part costs a tenth of a second to start); an input that
        cannot be read raises inside it (the caller drops it and notices the gap)."""
        raise NotImplementedError

    def read_alone(self, index: int) -> bytes:
        """Input ``index``'s encoded image bytes, read by itself, or ``InputFailure`` saying why
        it cannot be. Asked only for the inputs ``encoded`` dropped: the caller reads them
        again one by one, so a failure costs no other input its prediction."""
        raise NotImplementedError


@dataclass(frozen=True)
class FileInputs(Inputs):
    """Image files: a folder's, or a list's. Names are kept as one block of bytes and their
    offsets (8 bytes a file beyond the name itself)."""

    base: str = ""
    """The directory relative names are read from (the folder, the list's own directory)."""
    key_base: str = ""
    """What a row's key starts with: the folder as given (its key is the file's path), or
    nothing (a list's row says the line as written)."""
    names: bytes = b""
    """The names, joined (file system bytes), each relative to ``base`` or absolute."""
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    """Where each name starts in ``names``, and its end last."""
    listed_as_files: bool = True
    """Every name was seen a regular file (or a link) when listed: a folder's. A list's names are
    checked as they are read: a FIFO named like an image would block its read forever."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def name(self, index: int) -> bytes:
        return self.names[self.offsets[index]:self.offsets[index + 1]]

    def path(self, index: int) -> bytes:
        return os.path.join(os.fsencode(self.base), self.name(index))

    def key(self, index: int) -> str:
        # Bytes that are not UTF-8 shown as \\xNN: a row is text in every format.
        name = self.name(index).decode("utf-8", "backslashreplace")
        return os.path.join(self.key_base, name) if self.key_base else name

    def digest(self) -> str:
        return hashlib.sha256(os.fsencode(self.base) + b"\0" + os.fsencode(self.key_base)
                              + b"\0" + self.names + self.offsets.tobytes()).hexdigest()

    def encoded(self, ranges: list[tuple[int, int]]) -> tf.data.Dataset:
        import tensorflow as tf

        def named():  # a name at a time: the whole list is never a tensor
            indices = (index for start, stop in ranges for index in range(start, stop))
            if self.listed_as_files:
                yield from ((index, self.path(index)) for index in indices)
                return
            # Stat'd ahead by threads (on a shared file system each is a round trip); what is
            # not a regular file is never opened: left out here, its row says why.
            with concurrent.futures.ThreadPoolExecutor(STAT_THREADS) as pool:
                for index, regular in _ahead(pool, self._is_regular, indices):
                    if regular:
                        yield index, self.path(index)

        return (tf.data.Dataset.from_generator(named, output_signature=(
                    tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.string)))
                .map(lambda index, path: (index, tf.io.read_file(path)),
                     num_parallel_calls=tf.data.AUTOTUNE))  # in order

    def _is_regular(self, index: int) -> bool:
        try:
            return stat.S_ISREG(os.stat(self.path(index)).st_mode)
        except OSError:
            return False

    def read_alone(self, index: int) -> bytes:
        path = self.path(index)
        try:
            if stat.S_ISREG(os.stat(path).st_mode):
                with open(path, "rb") as file:
                    return file.read()
        except OSError as error:
            raise InputFailure(f"cannot read: {error.strerror or error}") from None
        raise InputFailure("not a regular file")

    def __getstate__(self) -> dict:
        # A folder of 1.28 M files: ~60 MB of names, a tenth of it compressed, sent once.
        state = dict(self.__dict__)
        state["names"] = zlib.compress(self.names, 1)
        return state

    def __setstate__(self, state: dict) -> None:
        state["names"] = zlib.decompress(state["names"])
        for name, value in state.items():
            object.__setattr__(self, name, value)


def _ahead(pool, function, items, window: int = 256):
    """``(item, function(item))`` in order, ``function`` run by ``pool`` up to ``window`` items
    ahead (``pool.map`` would submit every item at once: a future per input of the list)."""
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append((item, pool.submit(function, item)))
        if len(pending) >= window:
            item, future = pending.popleft()
            yield item, future.result()
    for item, future in pending:
        yield item, future.result()


def _joined(names: list[bytes]) -> tuple[bytes, np.ndarray]:
    offsets = np.zeros(len(names) + 1, np.int64)
    np.cumsum([len(name) for name in names], out=offsets[1:])
    return b"".join(names), offsets


def _is_image_name(name: bytes) -> bool:
    return os.path.splitext(name)[1].lower().decode("ascii", "replace") in IMAGE_EXTENSIONS


def list_folder(directory: str) -> FileInputs:
    """Every file with an image's extension under ``directory``, at any depth, in the order of
    their relative paths (sorted bytewise: the same on every machine). A link to a file is a
    file; a link to a folder is not followed (a loop would never end); a link that leads
    nowhere is an input whose row says it cannot be read."""
    if not os.path.isdir(directory):
        raise UserError(f"--data-dir {directory}: no such directory")
    names: list[bytes] = []
    others, linked_folders, special = 0, 0, 0
    pending = [b""]
    while pending:
        relative = pending.pop()
        folder = os.path.join(os.fsencode(directory), relative)
        try:
            with os.scandir(folder) as entries:
                listed = list(entries)
        except OSError as error:
            raise UserError(f"cannot list {os.fsdecode(folder)}: {error.strerror or error}") \
                from None
        for entry in listed:
            name = os.path.join(relative, entry.name) if relative else entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    pending.append(name)
                    continue
                if entry.is_symlink() and entry.is_dir():
                    linked_folders += 1
                    continue
                regular = entry.is_file()
            except OSError:  # ELOOP: a link to itself, or a longer cycle
                regular = False
            if not _is_image_name(entry.name):
                others += 1
            elif regular or entry.is_symlink():
                names.append(name)  # a link that leads nowhere: a row says it cannot be read
            else:
                special += 1  # a FIFO, socket or device named like an image: never opened
    if not names:
        raise UserError(f"--data-dir {directory} holds no PNG/JPEG/GIF/BMP files (at any depth)")
    names.sort()
    notes = []
    if others:
        notes.append(f"left out {others} file(s) without an image's extension "
                     f"({', '.join(sorted(IMAGE_EXTENSIONS))})")
    if linked_folders:
        notes.append(f"did not follow {linked_folders} link(s) to folders")
    if special:
        notes.append(f"left out {special} named like images that are not files (a FIFO, a "
                     "socket, a device)")
    blob, offsets = _joined(names)
    return FileInputs(description=f"{directory}: {len(names)} image file(s)",
                      notes=tuple(notes), base=directory, key_base=directory, names=blob,
                      offsets=offsets)


def list_file_list(path: str) -> FileInputs:
    """The files a list names, one path a line, in its order (a relative path is relative to
    the list's directory; blank lines and lines starting with '#' are not inputs). A row's key
    is the line as written; a name twice is two rows."""
    try:
        with open(path, "rb") as file:
            lines = file.read().split(b"\n")
    except OSError as error:
        raise UserError(f"--files {path}: {error.strerror or error}") from None
    names = [line.rstrip(b"\r") for line in lines]
    names = [name for name in names if name.strip() and not name.startswith(b"#")]
    if not names:
        raise UserError(f"--files {path} names no file (one path a line)")
    blob, offsets = _joined(names)
    return FileInputs(description=f"{path}: a list of {len(names)} file(s)", notes=(),
                      base=os.path.dirname(os.path.abspath(path)), key_base="", names=blob,
                      offsets=offsets, listed_as_files=False)
