"""This rank's decoded samples, kept by their position in its share: the cache behind
``--cache memory`` and ``--cache disk``.

tf.data's own ``cache()`` replays the first pass in the first pass's order, so every later epoch
trains in nearly the same order (a small shuffle buffer after the cache barely moves a sample),
and it refuses a second iterator while the first is still writing (batch-norm statistics
recomputed at the end of an epoch that did not finish a pass). A store keyed by position has
neither problem:

* **A new order every pass.** Once every position is stored, a pass is a fresh random
  permutation of the positions, each read from the store: no file is opened again.
* **Any number of readers.** Until then a pass reads the source, and a sample already stored is
  read back instead of decoded; storing is idempotent (the same position always holds the same
  decoded sample), so a second iterator at any moment only costs decodes, never an error.

In memory the images are a hash table of serialized tensors (growing as the first pass decodes,
like ``cache()``); on disk, one file per split in this process's cache directory, sample ``p`` at
byte ``p * image bytes``, written and read with ``pwrite``/``pread`` (one system call per
sample, one call from TensorFlow into Python per batch of them; a file per sample costs ext4
an inode and a journal entry each, which held the first pass at 1.28 M files well under its
speed at 10k in ``bench data``). A sample becomes visible (its label is stored) only after its
image is written, and rewriting a position writes the same bytes (decoding is deterministic), so
a reader never sees a torn image.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
from typing import TYPE_CHECKING, Iterator

import numpy as np

from hvdtrain.data.cache import DISK_ADVICE
from hvdtrain.errors import RankError

if TYPE_CHECKING:
    import tensorflow as tf

ABSENT = -1
"""Label of a position not stored yet."""
FAILED = -2
"""Label of a position whose sample did not decode: read back as a blank of weight 0."""
STORE_BATCH = 32
"""Samples a disk store writes, or reads, per call into Python."""
DISK_CACHE_FAILURE = "cannot write the disk cache in"
"""How a failed write of a disk store starts its message (see ``disk_cache_failure``)."""


class SampleStore:
    """Decoded ``(image, label)`` of one split of this rank, by position; ``directory`` None keeps
    them in memory."""

    def __init__(self, image_shape: tuple[int, int, int], directory: str | None = None):
        import tensorflow as tf

        self.image_shape = image_shape
        self.directory = directory
        with tf.device("/cpu:0"):  # used from inside tf.data, which runs on the host
            self.labels = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, ABSENT)
            if directory is None:
                self.images = tf.lookup.experimental.MutableHashTable(tf.int64, tf.string, "")
        if directory is not None:
            # A new directory and file, inside this process's private one (hvdtrain.scratch):
            # never one that was there first, nor a symlink's target. Closed with the process
            # (the directory goes with it).
            os.mkdir(directory, 0o700)
            self._fd = os.open(os.path.join(directory, "samples"),
                               os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            self._image_bytes = int(np.prod(image_shape))

    def size(self):
        """Positions stored (decoded or failed)."""
        return self.labels.size()

    def holds(self, position):
        """True where ``position`` holds a decoded sample."""
        return self.labels.lookup(position) >= 0

    def storing(self, decoded: tf.data.Dataset) -> tf.data.Dataset:
        """``decoded`` (``(count, position, image, label, fresh)`` elements, ``fresh`` where the
        sample was decoded rather than read from this store) as ``(count, image, label)``, with
        every fresh sample stored on the way: its image first, then the label that makes it
        visible."""
        import tensorflow as tf

        if self.directory is None:
            def put_one(count, position, image, label, fresh):
                def put():
                    written = self.images.insert(position, tf.io.serialize_tensor(image))
                    with tf.control_dependencies([written]):
                        return self.labels.insert(position, label)

                with tf.control_dependencies([tf.cond(fresh, put, tf.no_op)]):
                    return count, tf.identity(image), tf.identity(label)

            return decoded.map(put_one, num_parallel_calls=tf.data.AUTOTUNE)

        def put_batch(count, position, image, label, fresh):
            positions, images, labels = only(fresh, position, image, label)
            # TensorFlow has no op that writes at an offset: Python writes them, a batch per
            # call (a call per sample held the first pass at 0.86 of the memory store's rate in
            # bench data); os.pwrite releases the GIL while it writes.
            written = tf.py_function(self._write, [positions, images], tf.int64)
            with tf.control_dependencies([written]):
                stored = self.labels.insert(positions, labels)
            with tf.control_dependencies([stored]):
                return count, tf.identity(image), tf.identity(label)

        return (decoded.batch(STORE_BATCH)
                .map(put_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                .unbatch())

    def mark_failed_where_absent(self, num_samples: int):
        """An op recording every position below ``num_samples`` that holds no sample as failed.
        Run at the end of a whole pass over the source: that pass tried every position and
        stored each one that decoded, so a position still absent did not decode (decoding is
        deterministic). Another iterator reading at the same time only stores more of the same
        samples, so it cannot make a good position look failed."""
        import tensorflow as tf

        positions = tf.range(num_samples, dtype=tf.int64)
        labels = tf.ensure_shape(self.labels.lookup(positions), [num_samples])
        absent = tf.boolean_mask(positions, labels == ABSENT)
        return self.labels.insert(absent, tf.fill(tf.shape(absent),
                                                  tf.constant(FAILED, tf.int64)))

    def stored(self, positions: tf.data.Dataset) -> tf.data.Dataset:
        """``(image, label, weight)`` of every position of ``positions``, in their order: weight
        1, or a blank of weight 0 for a sample that did not decode."""
        import tensorflow as tf

        if self.directory is None:
            return positions.map(self.get, num_parallel_calls=tf.data.AUTOTUNE)

        def get_batch(position):
            label = tf.ensure_shape(self.labels.lookup(position), [None])
            held = label >= 0
            images = tf.py_function(self._read_many, only(held, position), tf.uint8)
            images = tf.reshape(images, [-1, *self.image_shape])
            full_shape = tf.concat([tf.shape(position, tf.int64),
                                    tf.constant(self.image_shape, tf.int64)], 0)
            # Blanks (zeros, weight 0) where a sample did not decode.
            images = tf.cond(tf.reduce_all(held), lambda: images,
                             lambda: tf.scatter_nd(tf.where(held), images, full_shape))
            return (tf.ensure_shape(images, [None, *self.image_shape]),
                    tf.where(held, label, tf.zeros_like(label)), tf.cast(held, tf.float32))

        # A batch per call into Python, as for writing.
        return (positions.batch(STORE_BATCH)
                .map(get_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                .unbatch())

    def get(self, position):
        """``(image, label, weight)`` of a stored position: weight 1, or a blank of weight 0 for a
        sample that did not decode."""
        import tensorflow as tf

        label = tf.ensure_shape(self.labels.lookup(position), [])

        def stored():
            return self.read(position), label, tf.constant(1.0)

        def blank():
            return (tf.zeros(self.image_shape, tf.uint8), tf.constant(0, tf.int64),
                    tf.constant(0.0))

        return tf.cond(label >= 0, stored, blank)

    def read(self, position):
        """The stored image of ``position`` (which must hold a decoded sample)."""
        import tensorflow as tf

        if self.directory is None:
            image = tf.io.parse_tensor(self.images.lookup(position), tf.uint8)
        else:
            image = tf.py_function(self._read_many, [position[None]], tf.uint8)
        return tf.ensure_shape(tf.reshape(image, self.image_shape), self.image_shape)

    def _write(self, positions, images) -> int:
        try:
            for position, image in zip(positions.numpy(), images.numpy()):
                data, offset = memoryview(image).cast("B"), int(position) * self._image_bytes
                while data:  # a short write (the disk filling up) writes the rest again
                    written = os.pwrite(self._fd, data, offset)
                    if written == 0:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    data, offset = data[written:], offset + written
        except OSError as error:
            # The disk filled up after the start's check (another job's files, say). TensorFlow
            # re-raises this inside fit with its own words around it; the marker lets the rank
            # turn it into one line (disk_cache_failure).
            raise OSError(error.errno, f"{DISK_CACHE_FAILURE} {self.directory}: "
                                       f"{error.strerror}") from None
        return len(positions)

    def _read_many(self, positions) -> np.ndarray:
        positions = positions.numpy()
        images = np.empty((len(positions), self._image_bytes), np.uint8)
        for image, position in zip(images, positions):
            os.preadv(self._fd, [image], int(position) * self._image_bytes)  # into place
        return images


def disk_cache_failure(error: BaseException) -> str | None:
    """The one line for ``error`` if it is a disk store's failed write, as TensorFlow raises it
    from inside the pipeline (else None)."""
    # The directory may hold spaces and colons; the reason (strerror) holds neither ": " nor
    # a newline.
    found = re.search(re.escape(DISK_CACHE_FAILURE) + r" (.+): ([^:\n]+)", str(error))
    if found is None:
        return None
    directory, reason = found.groups()
    return f"{DISK_CACHE_FAILURE} {directory}: {reason.strip()}; free space there, {DISK_ADVICE}"


@contextlib.contextmanager
def disk_cache_failures_in_one_line() -> Iterator[None]:
    """Inside it, a disk store's failed write ends this rank with one line (a full disk is this
    node's own), not with TensorFlow's traceback."""
    try:
        yield
    except Exception as error:
        line = disk_cache_failure(error)
        if line is None:
            raise
        raise RankError(line) from None


def only(keep, *values) -> list:
    """Each of ``values`` where ``keep`` (a boolean vector) holds, decided once for all of them;
    without a copy when it holds everywhere, as it does for nearly every batch."""
    import tensorflow as tf

    return tf.cond(tf.reduce_all(keep), lambda: list(values),
                   lambda: [tf.boolean_mask(value, keep) for value in values])


def stored_pass(from_source: tf.data.Dataset, store: SampleStore, num_samples: int,
                order: tf.data.Dataset) -> tf.data.Dataset:
    """One pass: ``from_source`` (which stores what it decodes) until the store holds every one
    of the ``num_samples`` positions, then the store alone, read in ``order`` (the pass's
    positions, as the source gives them). Whether the store is complete is asked each time the
    pass is iterated (inside a ``flat_map`` of one element, which takes both datasets as they
    are: nothing is traced again)."""
    import tensorflow as tf

    from_store = store.stored(order)

    def whichever(_):
        complete = store.size() >= num_samples
        # take(0) never starts the other dataset: a complete store opens no file.
        everything, nothing = tf.constant(-1, tf.int64), tf.constant(0, tf.int64)
        return (from_source.take(tf.where(complete, nothing, everything))
                .concatenate(from_store.take(tf.where(complete, everything, nothing))))

    return tf.data.Dataset.from_tensors(0).flat_map(whichever)
