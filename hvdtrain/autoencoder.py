"""Train the convolutional autoencoder: `horovodrun -np 2 python -m hvdtrain.autoencoder [flags]`.

The pyimagesearch ConvAutoencoder on the embedded digits (or --data-dir / --tfrecords), on any
backend: one CPU, horovod ranks, MirroredStrategy or a TPU. Besides the usual run directory, rank 0
writes a grid of inputs above their reconstructions named after the device it ran on (cpu.png,
gpu.png, tpu.png, as in the article's outputs/).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Sequence

import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (tf_keras unless --keras 3)

from hvdtrain import train
from hvdtrain.config import ImageConfig, parse_config
from hvdtrain.errors import reported
from hvdtrain.models.autoencoder import build_autoencoder
from hvdtrain.plots import plot_reconstructions
from hvdtrain.runtime import Runtime
from hvdtrain.task import Task

PROGRAM = "hvdtrain.autoencoder"
SAMPLES_IN_GRID = 8


def default() -> ImageConfig:
    return ImageConfig(epochs=20, run_dir="runs/autoencoder", lr_decay="constant")


def tiny() -> ImageConfig:
    return dataclasses.replace(default(), epochs=3, warmup_epochs=0.5, tensorboard=False,
                               run_dir="runs/autoencoder-tiny")


PRESETS = {"default": default, "tiny": tiny}


def as_reconstruction_pairs(images, labels):
    """The target is the input itself, in [0, 1] like the sigmoid output."""
    return images, tf.cast(images, tf.float32) / 255.0


RECONSTRUCTOR = Task(
    build_model=lambda data: build_autoencoder(data.image_shape),
    loss=lambda: keras.losses.MeanSquaredError(),
    metrics=lambda: [],
    to_pairs=as_reconstruction_pairs,
)


def write_reconstructions(result: train.TrainingResult, runtime: Runtime) -> str | None:
    """Rank 0: the grid of inputs over reconstructions, as <run_dir>/<cpu|gpu|tpu>.png."""
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


def run(argv: Sequence[str] | None = None) -> int:
    # 1. configuration: a preset, then command-line overrides, validated
    config = parse_config(argv, PRESETS, prog=f"python -m {PROGRAM}", description=__doc__)
    # 2. compute: horovod ranks, a tf.distribute strategy, or one process
    runtime = train.start_runtime(config)
    # 3. data, plan, model, resume, fit, checkpoints, export (hvdtrain/train.py)
    result = train.run(PROGRAM, config, runtime, RECONSTRUCTOR)
    # 4. the article's picture, then the summary
    if result.exit_code == 0:
        picture = write_reconstructions(result, runtime)
        runtime.print0(f"reconstructions: {picture}")
    runtime.print0(train.summary(result))
    return result.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
