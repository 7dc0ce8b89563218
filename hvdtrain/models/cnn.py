"""The image classifier of the source article: rescaling, conv/pool blocks, a dense head.

Sized from the input: as many conv/pool blocks as the image can halve through while staying at
least 2 pixels wide (8x8 digits get 2 blocks, 64x64 images 3), with 16, 32, 64 filters.
"""
from __future__ import annotations

import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

FILTERS = (16, 32, 64)


def num_conv_blocks(height: int, width: int, max_blocks: int = len(FILTERS)) -> int:
    blocks = 0
    side = min(height, width)
    while blocks < max_blocks and side // 2 >= 2:
        side //= 2
        blocks += 1
    return max(1, blocks)


def build_cnn(input_shape: tuple[int, int, int], num_classes: int, *, dense_units: int = 128,
              dropout: float = 0.2) -> keras.Model:
    """uint8 images in, class logits out (float32 even under mixed precision)."""
    height, width, _ = input_shape
    inputs = keras.Input(shape=input_shape, dtype="uint8", name="image")
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    for filters in FILTERS[:num_conv_blocks(height, width)]:
        x = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(dropout)(x)
    x = keras.layers.Dense(dense_units, activation="relu")(x)
    # Logits in float32: softmax/cross-entropy in float16 loses precision (Keras mixed-precision
    # guide).
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name="cnn")
