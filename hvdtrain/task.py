"""Your own training job: what you describe, and what hvdtrain does with it.

The public API (exported from ``hvdtrain``; docs/your-job.md)::

    import hvdtrain          # first: it selects the Keras (Keras 3 unless --keras 2)
    import keras             # that Keras

    def datasets(shard: hvdtrain.Shard) -> hvdtrain.Datasets:
        ...  # this rank's batched tf.data pipelines

    task = hvdtrain.Task(build_model=..., loss=..., metrics=..., datasets=datasets)
    if __name__ == "__main__":
        hvdtrain.main(task)  # flags, banner, run directory, checkpoints, resume, preemption

``hvdtrain.main`` and ``hvdtrain.run`` are ``hvdtrain/training/job.py``'s, which runs every job; this
module holds only the types a job is described with, and imports nothing of hvdtrain.

A dataset builder returns *this rank's* batches: ``shard`` says which slice and how big a batch.
Every rank must feed the same number of batches per epoch (a rank that runs out first would leave
the others waiting in an allreduce forever): hvdtrain counts each rank's batches and refuses to
start, in one line, when they differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import tensorflow as tf

    from hvdtrain.training.config import TrainConfig


@dataclass(frozen=True)
class Shard:
    """What a dataset builder is told about its rank's part of the data."""

    rank: int
    """This process's index among the processes feeding data (``dataset.shard(num_shards,
    rank)``)."""
    num_shards: int
    """Processes feeding data (horovod ranks; 1 under a tf.distribute strategy, which splits each
    batch between its replicas itself)."""
    batch_size: int
    """Samples per training batch this process feeds (the per-worker batch times the replicas it
    drives). Batch with ``drop_remainder=True`` so every batch has this size."""
    validation_batch_size: int
    """Samples per validation batch this process feeds."""
    seed: int
    """The job's ``--seed``: use it for a shuffle all ranks share before sharding."""
    config: TrainConfig
    """The whole parsed configuration, including fields of your own config class."""


@dataclass
class Datasets:
    """A rank's batched pipelines, as a dataset builder returns them."""

    train: tf.data.Dataset
    """Batches of ``(inputs, targets)`` or ``(inputs, targets, sample_weights)``. One epoch's worth
    (hvdtrain repeats it; its batch count is the steps per epoch), or endless with
    ``--steps-per-epoch``."""
    validation: tf.data.Dataset | None = None
    """Validation batches, finite (run in full at the end of every epoch), or None."""
    description: str = "from the job's dataset builder"
    """What the data is, for the start-up banner."""


@dataclass(frozen=True)
class Task:
    """A training job: the model, its loss and metrics, and (optionally) its data."""

    build_model: Callable[[Datasets], Any]
    """Returns a new, uncompiled ``keras.Model``; receives the rank's datasets (shapes are in
    ``datasets.train.element_spec``). Called inside the backend's scope: build every variable
    here."""
    loss: Callable[[], Any]
    """Returns the Keras loss (an object or a name such as ``"mse"``)."""
    metrics: Callable[[], list] = list
    """Returns the Keras metrics to report (averaged over ranks every epoch)."""
    datasets: Callable[[Shard], Datasets] | None = None
    """Returns this rank's pipelines. None: the image data the flags name (``--data-dir``,
    ``--tfrecords``, the embedded digits); the config must then be an ``ImageConfig``."""
    to_pairs: Callable | None = None
    """For the image data hvdtrain reads: map batched ``(images, labels)`` to
    ``(inputs, targets)`` (an autoencoder's targets are its inputs). None keeps them."""
    optimizer: Callable[[Any], Any] | None = None
    """``optimizer(learning_rate) -> keras optimizer``: the job's own (any Keras optimizer, with
    its clipping, weight decay, EMA), given hvdtrain's scaled and scheduled rate (a
    ``LearningRateSchedule``, or a number with no warm-up and ``--lr-decay constant``); horovod
    averages the gradients before it sees them. None: the one ``--optimizer`` names."""
    callbacks: Callable[[], list] | None = None
    """Returns the job's own Keras callbacks (EarlyStopping, ReduceLROnPlateau, TerminateOnNaN,
    your own), made on every rank and run after the epoch's metrics are averaged over the ranks,
    so a decision on them is the same everywhere. A stop asked for on some ranks only (a callback
    reading rank-local state) stops every rank at the same step."""
