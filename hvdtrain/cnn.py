"""Train the image classifier data-parallel: `horovodrun -np 4 python -m hvdtrain.cnn [flags]`.

Runs the same way on one CPU, several ranks of horovodrun/mpirun/srun, MirroredStrategy or a TPU
(--backend). Data: the embedded handwritten digits by default, --data-dir for an image folder
(one sub-folder per class), --tfrecords for shards. --model picks the network: a built-in one or
your own FILE.py:FUNCTION. Rank 0 writes everything into --run-dir; a run directory that holds a
checkpoint is resumed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hvdtrain.training import job
from hvdtrain.training.config import ImageConfig
from hvdtrain.models import CLASSIFIERS, build_classifier
from hvdtrain.models.user import is_user_model
from hvdtrain.task import Task

PROGRAM = "hvdtrain.cnn"


@dataclass(kw_only=True)
class ClassifierConfig(ImageConfig):
    """The image classifier job: the image data and training flags, plus the model to train."""

    model: str = "cnn"
    """The classifier: 'cnn' (hvdtrain's small CNN), 'resnet50', 'mobilenetv2', 'efficientnetb0'
    (Keras applications, untrained, sized from the data; images of at least 32x32), or
    'FILE.py:FUNCTION', your own FUNCTION(input_shape, num_classes) returning a keras.Model that
    maps uint8 images to class logits."""
    label_smoothing: float = 0.0
    """Train towards 1 - this for the true class and this / classes for every class (Szegedy et
    al.; the ResNet recipe's 0.1). 0: the plain cross-entropy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.label_smoothing < 1:
            raise ValueError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.model not in CLASSIFIERS and not is_user_model(self.model):
            raise ValueError(f"--model must be one of {', '.join(CLASSIFIERS)} or "
                             f"FILE.py:FUNCTION, got {self.model!r}")


# --- presets --------------------------------------------------------------------------------------
def default() -> ClassifierConfig:
    """The CNN on the embedded digits: reaches >= 95% validation accuracy on 1, 2 or 4 ranks."""
    return ClassifierConfig(run_dir="runs/cnn")


def tiny() -> ClassifierConfig:
    """The same job in a few seconds on 2 CPU ranks, for tests and a first look."""
    return ClassifierConfig(epochs=3, warmup_epochs=0.5, learning_rate=3e-3, tensorboard=False,
                            run_dir="runs/cnn-tiny")


PRESETS: Mapping[str, Callable[[], ClassifierConfig]] = {"default": default, "tiny": tiny}


def classifier(model: str = "cnn", label_smoothing: float = 0.0) -> Task:
    """Image classification with ``--model``: a built-in network or the user's own file."""
    return Task(
        build_model=lambda data: build_classifier(model, data.image_shape, len(data.class_names)),
        loss=lambda: _logits_crossentropy(label_smoothing),
        metrics=lambda: ["accuracy"],
    )


def _logits_crossentropy(label_smoothing: float = 0.0):
    import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

    if not label_smoothing:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    import tensorflow as tf

    def smoothed_crossentropy(labels, logits):
        # Keras' sparse cross-entropy has no smoothing: its one-hot form has.
        targets = tf.one_hot(tf.reshape(tf.cast(labels, tf.int32), [-1]),
                             tf.shape(logits)[-1], dtype=logits.dtype)
        return keras.losses.categorical_crossentropy(targets, logits, from_logits=True,
                                                     label_smoothing=label_smoothing)

    return smoothed_crossentropy


CLASSIFIER = classifier()


def classifier_of(config: ClassifierConfig) -> Task:
    """The classifier the flags choose: its network and its label smoothing."""
    return classifier(config.model, config.label_smoothing)


def main(argv: Sequence[str] | None = None) -> None:
    # The flags choose the network, so the task is made from the parsed config.
    job.main(classifier_of, argv, name=PROGRAM, presets=PRESETS)


if __name__ == "__main__":
    main()
