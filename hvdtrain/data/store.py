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
like ``cache()``); on disk, one file per sample in this process's cache directory. A sample
becomes visible (its label is stored) only after its image is complete, and a disk file is never
rewritten in place: each write has a name of its own, so a reader never sees half a file.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

ABSENT = -1
"""Label of a position not stored yet."""
FAILED = -2
"""Label of a position whose sample did not decode: read back as a blank of weight 0."""


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
            else:
                os.makedirs(directory, exist_ok=True)
                self.file_ids = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, -1)

    def size(self):
        """Positions stored (decoded or failed)."""
        return self.labels.size()

    def holds(self, position):
        """True where ``position`` holds a decoded sample."""
        return self.labels.lookup(position) >= 0

    def put(self, position, image, label):
        """An op storing a decoded sample: the image first, then the label that makes it visible."""
        import tensorflow as tf

        data = tf.io.serialize_tensor(image)
        if self.directory is None:
            written = self.images.insert(position, data)
        else:
            # A name of its own for every write: two iterators storing the same position at once
            # write two files, and a reader only ever opens one that is complete.
            file_id = tf.random.uniform([], maxval=tf.int64.max, dtype=tf.int64)
            with tf.control_dependencies([tf.io.write_file(self._path(position, file_id), data)]):
                written = self.file_ids.insert(position, file_id)
        with tf.control_dependencies([written]):
            return self.labels.insert(position, label)

    def mark_failed(self, positions):
        """An op recording that the samples at ``positions`` (a vector) did not decode."""
        import tensorflow as tf

        return self.labels.insert(positions, tf.fill(tf.shape(positions),
                                                     tf.constant(FAILED, tf.int64)))

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
            data = self.images.lookup(position)
        else:
            data = tf.io.read_file(self._path(position, self.file_ids.lookup(position)))
        return tf.ensure_shape(tf.io.parse_tensor(data, tf.uint8), self.image_shape)

    def _path(self, position, file_id):
        import tensorflow as tf

        return tf.strings.join([self.directory + os.sep, tf.strings.as_string(position), "-",
                                tf.strings.as_string(file_id)])


def stored_passes(from_source: tf.data.Dataset, store: SampleStore, num_samples: int, *,
                  shuffle: bool, seed: int, state: list) -> tf.data.Dataset:
    """One pass over ``num_samples`` positions each time it is iterated: ``from_source`` (which
    stores what it decodes) until the store holds every position, then the store alone, in a new
    random order every pass when ``shuffle`` (else in position order)."""
    import tensorflow as tf

    with tf.device("/cpu:0"):
        passes = tf.Variable(0, dtype=tf.int64, trainable=False)
    state.append(passes)

    def one_pass(_):
        complete = store.size() >= num_samples
        positions = tf.range(num_samples, dtype=tf.int64)
        if shuffle:
            # Stateless with (seed, pass): reproducible, and a new order on every pass.
            pass_seed = tf.stack([tf.constant(seed, tf.int64), passes.assign_add(1)])
            positions = tf.random.experimental.stateless_shuffle(positions, seed=pass_seed)
        from_store = (tf.data.Dataset.from_tensor_slices(positions)
                      .map(store.get, num_parallel_calls=tf.data.AUTOTUNE))
        # take(0) never starts the other dataset: a complete store opens no file.
        everything, nothing = tf.constant(-1, tf.int64), tf.constant(0, tf.int64)
        return (from_source.take(tf.where(complete, nothing, everything))
                .concatenate(from_store.take(tf.where(complete, everything, nothing))))

    return tf.data.Dataset.from_tensors(0).flat_map(one_pass)
