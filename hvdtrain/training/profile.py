"""A view of the step: how long it waited for its batches (every epoch, in metrics.json), and a
TensorFlow profile of chosen steps (``--profile-steps``, the TensorBoard profiler, rank 0).

Whether a job waits on its input or on its compute is the first question on any GPU. Keras pulls
each batch inside its compiled step, so the wait is measured in the pipeline itself: a clock
element is zipped in front of every training batch (``zip`` asks its inputs in order), and the
time between the clock and the batch's arrival is the time the step was blocked on the input.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorflow as tf

#: The summary line calls an epoch input-bound when its step waited this share of the time.
INPUT_BOUND_SHARE = 0.25


class InputWait:
    """Seconds this rank's training steps spent waiting for their batches, summed."""

    def __init__(self):
        import tensorflow as tf

        with tf.device("/cpu:0"):  # updated from inside tf.data, which runs on the host
            self.total = tf.Variable(0.0, dtype=tf.float64, trainable=False)
        self.measured = True
        """False when op determinism kept ``timed`` from measuring."""

    def timed(self, batches: tf.data.Dataset) -> tf.data.Dataset:
        """``batches``, each adding the time its consumer waited for it to ``total``. Before a
        device prefetch (which must come last): there it is the time the host pipeline kept
        the copy to the device waiting, which is the step's wait once that buffer runs dry."""
        import tensorflow as tf

        if _op_determinism():
            # TensorFlow refuses tf.timestamp under op determinism (TF_DETERMINISTIC_OPS=1 or
            # enable_op_determinism()): no wait is measured, the rows say none.
            self.measured = False
            return batches
        clock = tf.data.Dataset.from_tensors(tf.constant(0)).repeat().map(
            lambda _: tf.timestamp())

        def arrived(asked, batch):
            with tf.control_dependencies([self.total.assign_add(tf.timestamp() - asked)]):
                return tf.nest.map_structure(tf.identity, batch)

        timed = tf.data.Dataset.zip(clock, batches).map(arrived)
        # No prefetch tf.data would add after this map on its own: the clock must run in the
        # consumer's call for its batch, not in a thread that waits ahead of it.
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return timed.with_options(options)

    def seconds(self) -> float:
        return float(self.total.numpy())


def _op_determinism() -> bool:
    """Whether TensorFlow runs with op determinism (its query is not public API)."""
    import os

    from tensorflow.python.framework import config

    query = getattr(config, "is_op_determinism_enabled", None)
    if query is not None:
        return bool(query())
    return os.environ.get("TF_DETERMINISTIC_OPS", "").lower() in ("1", "true")


def input_bound_note(row: dict) -> str | None:
    """'input-bound: ...' for an epoch row whose step waited on its input, else None."""
    wait, train = row.get("input_wait_seconds"), row.get("train_seconds")
    if wait is None or not train or wait < INPUT_BOUND_SHARE * train:
        return None
    return (f"input-bound: the last epoch's steps waited {wait / train:.0%} of its "
            f"{train:.3g} s for their batches (docs/data.md: cache, threads, TFRecords)")
