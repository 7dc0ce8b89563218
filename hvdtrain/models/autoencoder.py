"""The convolutional autoencoder of the pyimagesearch article (ConvAutoencoder).

Encoder: two stride-2 convolutions (32, 64 filters) with LeakyReLU and batch norm, then a dense
latent vector. Decoder: the mirror image with transposed convolutions and a sigmoid output, so it
reconstructs pixels in [0, 1]. Height and width must be divisible by 4 (two halvings).
"""
from __future__ import annotations

import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

FILTERS = (32, 64)


def build_autoencoder(input_shape: tuple[int, int, int], *, latent_dim: int = 16) -> keras.Model:
    """uint8 images in, reconstructions in [0, 1] out (float32 even under mixed precision)."""
    height, width, channels = input_shape
    downsample = 2 ** len(FILTERS)
    if height % downsample or width % downsample:
        raise ValueError(f"the autoencoder needs image sides divisible by {downsample}, "
                         f"got {height}x{width}; pass --image-size")
    inputs = keras.Input(shape=input_shape, dtype="uint8", name="image")
    x = keras.layers.Rescaling(1.0 / 255)(inputs)
    for filters in FILTERS:
        x = keras.layers.Conv2D(filters, 3, strides=2, padding="same")(x)
        x = keras.layers.LeakyReLU(0.2)(x)  # alpha (Keras 2) or negative_slope (Keras 3)
        x = keras.layers.BatchNormalization()(x)
    encoded_shape = (height // downsample, width // downsample, FILTERS[-1])
    latent = keras.layers.Dense(latent_dim, name="latent")(keras.layers.Flatten()(x))

    x = keras.layers.Dense(encoded_shape[0] * encoded_shape[1] * encoded_shape[2])(latent)
    x = keras.layers.Reshape(encoded_shape)(x)
    for filters in reversed(FILTERS):
        x = keras.layers.Conv2DTranspose(filters, 3, strides=2, padding="same")(x)
        x = keras.layers.LeakyReLU(0.2)(x)  # alpha (Keras 2) or negative_slope (Keras 3)
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Conv2DTranspose(channels, 3, padding="same")(x)
    outputs = keras.layers.Activation("sigmoid", dtype="float32", name="reconstruction")(x)
    return keras.Model(inputs, outputs, name="autoencoder")
