"""Keras applications as classifiers for hvdtrain: ResNet-50, MobileNetV2, EfficientNet-B0.

Untrained (``weights=None``: no download), sized from the data: any image size the architecture
accepts and any channel count. Each takes uint8 images, applies the preprocessing its family
expects, and ends in a float32 logits layer, like the built-in CNN.
"""
from __future__ import annotations

from typing import Callable

import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)


def _to_float(images):
    return keras.layers.Rescaling(1.0)(images)  # uint8 -> float in [0, 255]


# name -> (constructor, preprocessing of [0, 255] floats its weights were designed for,
#          smallest image side it accepts)
APPLICATIONS: dict[str, tuple[Callable, Callable, int]] = {
    # ResNet: 'caffe' mode, mean-subtracted BGR in [0, 255]; on unknown channels only the
    # centering applies, which batch normalization makes harmless.
    "resnet50": (keras.applications.ResNet50,
                 lambda x: keras.layers.Rescaling(1.0, offset=-127.5)(x), 32),
    # MobileNetV2 expects [-1, 1].
    "mobilenetv2": (keras.applications.MobileNetV2,
                    lambda x: keras.layers.Rescaling(1.0 / 127.5, offset=-1.0)(x), 32),
    # EfficientNet rescales and normalizes inside the model: it takes [0, 255].
    "efficientnetb0": (keras.applications.EfficientNetB0, lambda x: x, 32),
}


def build_application(name: str, input_shape: tuple[int, int, int],
                      num_classes: int) -> keras.Model:
    """uint8 images in, class logits out (float32 even under mixed precision)."""
    constructor, preprocess, min_side = APPLICATIONS[name]
    height, width, _ = input_shape
    if min(height, width) < min_side:
        raise ValueError(f"--model {name} needs images of at least {min_side}x{min_side} "
                         f"(the data is {height}x{width}); pass --image-size {min_side} or more")
    inputs = keras.Input(shape=input_shape, dtype="uint8", name="image")
    features = constructor(include_top=False, weights=None, input_shape=input_shape,
                           pooling="avg")(preprocess(_to_float(inputs)))
    # Logits in float32: softmax/cross-entropy in float16 loses precision (Keras mixed-precision
    # guide).
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(features)
    return keras.Model(inputs, logits, name=name)
