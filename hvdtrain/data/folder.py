"""An image folder, ``<data_dir>/<class name>/<image files>``: listed once, read per rank.

Rank 0 lists the files (one ``scandir`` per class folder, no per-file open) and sends the other
ranks a compressed table of names (3.4 MB for ImageNet), from which each redoes the seeded split,
so a shared file system is scanned once, not once per rank, and every rank sees the same list.
"""
from __future__ import annotations

import concurrent.futures
import os
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from hvdtrain.data.images import IMAGE_EXTENSIONS, image_format
from hvdtrain.data.listing import (DEFAULT_FILE_IMAGE_SIZE, FileTable, Listing, Split,
                                   held_out_by_name, label_table_digest, name_hashes,
                                   split_by_mask, split_identity)
from hvdtrain.data.shares import rank_share
from hvdtrain.errors import UserError
from hvdtrain.rundir import is_url
from hvdtrain.runtime.base import World

if TYPE_CHECKING:
    import tensorflow as tf

HEADER_CHECK_THREADS = 32
"""Parallel header reads for --check-images: on a shared file system each open is a round trip
to the metadata server, so many in flight hide the latency (threads: the work is I/O)."""


@dataclass(frozen=True)
class FolderListing(Listing):
    """An image folder: ``Split.sources`` are paths relative to ``root`` (bytes)."""

    root: str = ""
    """The image folder."""
    held_out: np.ndarray | None = None
    """Which files, in the listing's order (class by class, names sorted), are held out for
    validation (``held_out_by_name``)."""
    split_seed: int = 0
    """The seed that ordered each side (``split_by_mask``): the receivers of the file table redo
    the split from these two."""

    def path(self, source) -> str:
        """A sample's file path, for messages and tools."""
        return os.path.join(self.root, source.decode() if isinstance(source, bytes) else source)

    def records_at(self, split: Split, world: World, positions: tf.data.Dataset
                   ) -> tf.data.Dataset:
        """``(position, (path, label))``: the order is a permutation of positions, so a pass
        over a million files starts at once and holds no buffer of paths."""
        import tensorflow as tf

        sources, labels = (tf.constant(rank_share(values, world))
                           for values in (split.sources, split.labels))
        prefix = self.root.rstrip("/") + "/"
        return positions.map(lambda position: (position, (
            tf.strings.join([prefix, tf.gather(sources, position)]),
            tf.gather(labels, position))))

    def reader(self) -> Callable:
        import tensorflow as tf

        return lambda path, label: (tf.io.read_file(path), label)

    def sample_namer(self, split: Split, world: World, *, by_file: bool
                     ) -> Callable[[int], str]:
        # Position k of this rank's share (rank_share) is sample rank + k * size.
        return lambda position: self.path(split.sources[world.rank + position * world.size])

    def __getstate__(self) -> dict:
        # The folder travels to the ranks as its sorted file table, compressed (3.4 MB for
        # ImageNet's 1.28 M names instead of ~175 MB of pickled paths), and its split as a bit a
        # file; every rank orders the sides itself.
        state = dict(self.__dict__)
        # Only rank 0 compares the run directory's file table (rundir.ensure_writable).
        state["identity"] = {key: value for key, value in self.identity.items()
                             if key != "files"}
        # Undo the split: the table in listing order (class by class, names sorted).
        count = self.train.num_samples + self.validation.num_samples
        train, validation = split_by_mask(self.held_out, self.split_seed)
        files = np.empty(count, dtype=self.train.sources.dtype)
        labels = np.empty(count, dtype=np.int32)
        files[train], files[validation] = self.train.sources, self.validation.sources
        labels[train], labels[validation] = self.train.labels, self.validation.labels
        joined = b"\n".join(files.tolist())
        if joined.count(b"\n") == count - 1:  # no file name holds a newline
            state["train"] = state["validation"] = None
            state["held_out"] = (np.packbits(self.held_out), count)
            # Labels run class by class in listing order: the table keeps a count per class.
            state["_table"] = (zlib.compress(joined, 1),
                               np.bincount(labels, minlength=len(self.class_names)))
        return state

    def __setstate__(self, state: dict) -> None:
        table = state.pop("_table", None)
        if table is not None:
            compressed, per_class = table
            names = np.array(zlib.decompress(compressed).split(b"\n"))
            labels = np.repeat(np.arange(len(per_class), dtype=np.int64), per_class)
            bits, count = state["held_out"]
            state["held_out"] = np.unpackbits(bits, count=count).astype(bool)
            train, validation = split_by_mask(state["held_out"], state["split_seed"])
            state["train"] = Split(names[train], labels[train])
            state["validation"] = Split(names[validation], labels[validation])
        for name, value in state.items():
            object.__setattr__(self, name, value)


def _printable(path: str) -> str:
    """A path whose bytes are not all UTF-8, with those bytes shown as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: bytes that are not UTF-8
        return False
    return True


def _listed(directory: str) -> list[os.DirEntry]:
    """The entries of a folder of the data, or one line saying why it cannot be listed (no
    permission, a stale network mount)."""
    try:
        with os.scandir(directory) as entries:
            return list(entries)
    except OSError as error:
        raise UserError(f"cannot list {directory}: {error.strerror or error}") from None


def require_folder(data_dir: str) -> None:
    if is_url(data_dir):  # os.path would take it for a relative path
        raise UserError(f"--data-dir {data_dir}: an image folder is read from a file system, "
                        "not a URL: copy it down (training reads TFRecord shards at a URL: "
                        "--tfrecords)")
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir}: no such directory")


def list_image_folder(data_dir: str, *, image_size: int | None, validation_fraction: float,
                      seed: int, on_bad_image: str, channels: int = 3,
                      check_images: bool = False) -> FolderListing:
    """An image folder in the layout <data_dir>/<class name>/<image files>.

    One ``scandir`` per class folder and no per-file open: files with an image extension are
    trusted (one that does not decode is skipped and counted by the pipeline), files with any
    other extension get their header checked, and ``check_images`` checks every header.
    """
    started = time.monotonic()
    require_folder(data_dir)
    class_names = sorted(entry.name for entry in _listed(data_dir)
                         if entry.is_dir() and not entry.name.startswith("."))
    unnamed_classes = [name for name in class_names if not _is_utf8(name)]
    if unnamed_classes:
        # A class name is printed, and stored in dataset.json and config.json.
        raise UserError(f"class folder {_printable(unnamed_classes[0])} in {data_dir} is not a "
                        "valid UTF-8 name; rename it")
    if not class_names:
        raise UserError(f"--data-dir {data_dir} has no class sub-folders "
                        f"(expected {data_dir}/<class>/<image files>)")
    if len(class_names) == 1:
        raise UserError(f"--data-dir {data_dir} has only one class folder ('{class_names[0]}'); "
                        "classification needs at least 2")
    _refuse_linked_classes(data_dir, class_names)
    listed = [_files_and_dead_links(os.path.join(data_dir, name)) for name in class_names]
    files_per_class = [files for files, _ in listed]
    # A link that leads to no file (a loop, a missing target) is a file that cannot be read:
    # skipped and counted like one, never a traceback from the listing.
    dead_links = sorted(os.path.join(data_dir, class_name, name)
                        for class_name, (_, dead) in zip(class_names, listed) for name in dead)
    # Names that are not UTF-8 (os.scandir gives them surrogate escapes) cannot go into the name
    # table, messages or JSON: skipped and counted like files that are not images.
    unnamed = [os.path.join(data_dir, class_name, name)
               for class_name, files in zip(class_names, files_per_class) for name in files
               if not _is_utf8(name)]
    unnamed_note = ""
    if unnamed:
        unnamed_note = (f"{len(unnamed)} file(s) in {data_dir} have names that are not valid "
                        f"UTF-8 (first: {_printable(unnamed[0])})")
        if on_bad_image == "fail":
            raise UserError(unnamed_note + "; rename them or pass --on-bad-image skip")
        files_per_class = [[name for name in files if _is_utf8(name)]
                           for files in files_per_class]
    suspects = [os.path.join(data_dir, class_name, name)
                for class_name, files in zip(class_names, files_per_class) for name in files
                if check_images or os.path.splitext(name)[1].lower() not in IMAGE_EXTENSIONS]
    bad = _not_images(suspects)
    rejected = set(bad)
    names, labels = [], []
    for label, (class_name, files) in enumerate(zip(class_names, files_per_class)):
        class_dir = os.path.join(data_dir, class_name)
        good = [name for name in files
                if os.path.join(class_dir, name) not in rejected] if rejected else files
        if not good:
            raise UserError(f"class folder {class_dir} has no PNG/JPEG/GIF/BMP images")
        prefix = class_name + "/"
        names += [(prefix + name).encode() for name in good]
        labels.append(np.full(len(good), label, dtype=np.int64))
    notes = ["skipped " + unnamed_note] if unnamed_note else []
    # Files that cannot be read: one line with --on-bad-image fail, else skipped with a note.
    unreadable = []
    if dead_links:
        unreadable.append(f"{len(dead_links)} link(s) in {data_dir} lead to no file (a loop or a "
                          f"missing target; first: {_printable(dead_links[0])})")
    if bad:
        unreadable.append(f"{len(bad)} file(s) in {data_dir} are not PNG/JPEG/GIF/BMP images "
                          f"(first: {bad[0]})")
    for message in unreadable:
        if on_bad_image == "fail":
            raise UserError(message + "; remove them or pass --on-bad-image skip")
        notes.append("skipped " + message)
    names_array = np.array(names)
    labels_array = np.concatenate(labels)
    hashes = name_hashes(names)
    held_out = held_out_by_name(hashes, validation_fraction, seed)
    train, validation = split_by_mask(held_out, seed)
    sized: dict[str, int] = {}
    digest = label_table_digest(names_array, labels_array,
                                lambda name: os.stat(os.path.join(data_dir, name)).st_size, sized)
    size = image_size or DEFAULT_FILE_IMAGE_SIZE
    seconds = time.monotonic() - started
    return FolderListing(
        description=f"{data_dir}: {len(names)} images, {len(class_names)} classes, "
                    f"resized to {size}x{size} (listed in {seconds:.1f} s, "
                    f"{len(suspects)} header(s) checked)",
        class_names=tuple(class_names),
        image_shape=(size, size, channels),
        train=Split(names_array[train], labels_array[train]),
        validation=Split(names_array[validation], labels_array[validation]),
        notes=tuple(notes),
        identity={"split": split_identity("files", validation_fraction, seed),
                  "labels": digest, "files": FileTable.of(hashes, labels_array, sized)},
        root=data_dir,
        held_out=held_out,
        split_seed=seed,
    )


def _refuse_linked_classes(data_dir: str, class_names: list[str]) -> None:
    """One line for two class folders that are one folder (a link to another class): its
    images would train under two labels at once."""
    seen: dict[str, str] = {}
    for name in class_names:
        real = os.path.realpath(os.path.join(data_dir, name))
        if real in seen:
            raise UserError(f"class folders {seen[real]} and {name} in {data_dir} are the same "
                            f"folder ({real}): its images would have two labels; remove the link")
        seen[real] = name


def _files_and_dead_links(class_dir: str) -> tuple[list[str], list[str]]:
    """The sorted names of a class folder's files, and of its links that lead to no file."""
    files, dead = [], []
    for entry in _listed(class_dir):
        try:
            if entry.is_file():
                files.append(entry.name)
            elif entry.is_symlink() and not os.path.exists(entry.path):
                dead.append(entry.name)
        except OSError:  # ELOOP: a link to itself, or a longer cycle
            dead.append(entry.name)
    return sorted(files), sorted(dead)


def _not_images(paths: list[str]) -> list[str]:
    """The paths whose first bytes are no image format's (read in parallel)."""
    if len(paths) < 8:
        formats = [image_format(path) for path in paths]
    else:
        with concurrent.futures.ThreadPoolExecutor(HEADER_CHECK_THREADS) as pool:
            formats = list(pool.map(image_format, paths, chunksize=64))
    return [path for path, found in zip(paths, formats) if found is None]
