"""Train the image classifier data-parallel: `horovodrun -np 4 python -m hvdtrain.cnn [flags]`.

Runs the same way on one CPU, several ranks of horovodrun/mpirun/srun, MirroredStrategy or a TPU
(--backend). Data: the embedded handwritten digits by default, --data-dir for an image folder
(one sub-folder per class), --tfrecords for shards. Rank 0 writes everything into --run-dir; a
run directory that holds a checkpoint is resumed.
"""
from __future__ import annotations

import sys
from typing import Sequence

import tf_keras as keras

from hvdtrain import train
from hvdtrain.config import CNN_PRESETS, parse_config
from hvdtrain.errors import reported
from hvdtrain.models import build_classifier

PROGRAM = "hvdtrain.cnn"


def classifier(model: str = "cnn") -> train.Task:
    """Image classification with ``--model``: a built-in network or the user's own file."""
    return train.Task(
        build_model=lambda listing: build_classifier(model, listing.image_shape,
                                                     len(listing.class_names)),
        loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=lambda: ["accuracy"],
    )


CLASSIFIER = classifier()


def run(argv: Sequence[str] | None = None) -> int:
    # 1. configuration: a preset, then command-line overrides, validated
    config = parse_config(argv, CNN_PRESETS, prog=f"python -m {PROGRAM}", description=__doc__)
    # 2. compute: horovod ranks, a tf.distribute strategy, or one process
    runtime = train.start_runtime(config)
    # 3. data, plan, model, resume, fit, checkpoints, export (hvdtrain/train.py)
    result = train.run(PROGRAM, config, runtime, classifier(config.model))
    # 4. summary
    runtime.print0(train.summary(result))
    return result.exit_code


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
