"""The embedded sets: scikit-learn's handwritten digits, or synthetic noise for tests and timing.

Both are small, deterministic and in memory, so every rank loads its own copy instead of
receiving one, and "decoding" a sample is a row lookup.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np

from hvdtrain.data.images import resampled_to
from hvdtrain.data.listing import (Listing, Split, split_identity,
                                   split_indices)
from hvdtrain.data.shares import rank_share
from hvdtrain.errors import UserError
from hvdtrain.runtime.base import World

if TYPE_CHECKING:
    import tensorflow as tf


@dataclass(frozen=True)
class EmbeddedArrays:
    name: str
    images: np.ndarray  # (N, H, W, C) uint8
    labels: np.ndarray  # (N,) int64
    class_names: tuple[str, ...]


def load_embedded(name: str, *, image_size: int | None = None, synthetic_samples: int = 1797,
                  seed: int = 0) -> EmbeddedArrays:
    if name == "digits":
        pixels, targets = _digits()
        images = (pixels * (255.0 / 16.0)).round().astype(np.uint8)[..., None]
        labels = targets.astype(np.int64)
        if image_size and image_size != images.shape[1]:
            images = resampled_to(images, (image_size, image_size)).numpy()
        return EmbeddedArrays("digits", images, labels, tuple(str(d) for d in range(10)))
    if name == "synthetic":
        size = image_size or 8
        rng = np.random.default_rng(seed)
        images = rng.integers(0, 256, size=(synthetic_samples, size, size, 1), dtype=np.uint8)
        labels = rng.integers(0, 10, size=synthetic_samples).astype(np.int64)
        return EmbeddedArrays("synthetic", images, labels, tuple(str(d) for d in range(10)))
    raise UserError(f"unknown embedded data set {name!r} (digits or synthetic)")


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's handwritten digits, (N, 8, 8) pixels of 0..16 and (N,) labels: real data
    that ship inside its wheel, no download.

    Read from the file ``sklearn.datasets.load_digits`` reads, the way it reads it, without
    importing scikit-learn: that import took 0.6-1.1 s of every rank's start (the tiny preset's
    whole data phase was 2.1 s). ``load_digits`` itself where the file is not where it has been
    since scikit-learn 0.x.
    """
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(spec.submodule_search_locations[0], "datasets", "data",
                        "digits.csv.gz") if spec and spec.submodule_search_locations else ""
    if os.path.isfile(path):
        table = np.loadtxt(path, delimiter=",")
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images, digits.target


@dataclass(frozen=True)
class EmbeddedListing(Listing):
    """An embedded set: ``Split.sources`` are row indices into ``images``."""

    images: np.ndarray | None = None
    """The pixels (each rank loads its own copy; never broadcast)."""

    in_memory: ClassVar[str | None] = "the embedded data is in memory already"

    def records_at(self, split: Split, world: World, positions: tf.data.Dataset
                   ) -> tf.data.Dataset:
        import tensorflow as tf

        rows, labels = (tf.constant(rank_share(values, world))
                        for values in (split.sources, split.labels))
        return positions.map(lambda position: (
            position, (tf.gather(rows, position), tf.gather(labels, position))))

    def decoder(self, to_pixels: Callable) -> Callable:
        import tensorflow as tf

        # The arrays were resized to image_shape (a square) when loaded (load_embedded).
        images = tf.constant(self.images)
        return lambda row, label: (tf.gather(images, row), label)


def embedded_listing(arrays: EmbeddedArrays, validation_fraction: float, seed: int
                     ) -> EmbeddedListing:
    train, validation = split_indices(len(arrays.labels), validation_fraction, seed)
    return EmbeddedListing(
        description=f"{arrays.name}: {len(arrays.labels)} images "
                    f"{'x'.join(map(str, arrays.images.shape[1:]))}, "
                    f"{len(arrays.class_names)} classes (embedded)",
        class_names=arrays.class_names,
        image_shape=tuple(int(d) for d in arrays.images.shape[1:]),
        train=Split(train, arrays.labels[train]),
        validation=Split(validation, arrays.labels[validation]),
        identity={"split": split_identity("samples", validation_fraction, seed)},
        images=arrays.images,
    )
