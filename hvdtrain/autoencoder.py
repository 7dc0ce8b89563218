"""Train the convolutional autoencoder: `horovodrun -np 2 python -m hvdtrain.autoencoder [flags]`.

The pyimagesearch ConvAutoencoder on the embedded digits (or --data-dir / --tfrecords), on any
backend: one CPU, horovod ranks, MirroredStrategy or a TPU. Besides the usual run directory, rank 0
writes a grid of inputs above their reconstructions named after the device it ran on (cpu.png,
gpu.png, tpu.png, as in the article's outputs/).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from hvdtrain.training import job
from hvdtrain.training.config import ImageConfig
from hvdtrain.task import Task

if TYPE_CHECKING:  # TensorFlow and Keras load once the job runs: the flags need neither
    from hvdtrain.runtime import Runtime
    from hvdtrain.training.fit import TrainingResult

PROGRAM = "hvdtrain.autoencoder"
SAMPLES_IN_GRID = 8


def default() -> ImageConfig:
    """The autoencoder on the embedded digits, 20 epochs at a constant learning rate."""
    return ImageConfig(epochs=20, run_dir="runs/autoencoder", lr_decay="constant")


def tiny() -> ImageConfig:
    """The same job in a few seconds, for tests and a first look."""
    return dataclasses.replace(default(), epochs=3, warmup_epochs=0.5, tensorboard=False,
                               run_dir="runs/autoencoder-tiny")


PRESETS = {"default": default, "tiny": tiny}


def as_reconstruction_pairs(images, labels):
    """The target is the input itself, in [0, 1] like the sigmoid output."""
    import tensorflow as tf

    return images, tf.cast(images, tf.float32) / 255.0


def _build_autoencoder(data):
    from hvdtrain.models.autoencoder import build_autoencoder

    return build_autoencoder(data.image_shape)


def _mean_squared_error():
    import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

    return keras.losses.MeanSquaredError()


RECONSTRUCTOR = Task(
    build_model=_build_autoencoder,
    loss=_mean_squared_error,
    metrics=lambda: [],
    to_pairs=as_reconstruction_pairs,
)


def write_reconstructions(result: TrainingResult, runtime: Runtime) -> str | None:
    """Rank 0: the grid of inputs over reconstructions, as <run_dir>/<cpu|gpu|tpu>.png."""
    from hvdtrain.plots import plot_reconstructions

    if not runtime.world.is_chief:
        return None
    source = result.datasets.validation or result.datasets.train
    images = next(iter(source))[0][:SAMPLES_IN_GRID]  # (images, labels[, weights])
    reconstructions = result.model.predict(images, verbose=0)
    name = f"{runtime.devices.kind}.png"
    title = (f"autoencoder on {runtime.devices.description}, backend {runtime.world.backend}: "
             "inputs (top), reconstructions (bottom)")
    result.run_dir.write_with(
        name, lambda path: plot_reconstructions(images.numpy(), reconstructions, title, path))
    return result.run_dir.file(name)


def after_training(result: TrainingResult, runtime: Runtime) -> None:
    """The article's picture, named on rank 0."""
    picture = write_reconstructions(result, runtime)
    runtime.print0(f"reconstructions: {picture}")


def main(argv: Sequence[str] | None = None) -> None:
    job.main(RECONSTRUCTOR, argv, name=PROGRAM, presets=PRESETS, after=after_training)


if __name__ == "__main__":
    main()
