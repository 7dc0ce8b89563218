"""``--augment``: random-resized crops and horizontal flips for training, a center crop for
validation (the Inception / Goyal et al. recipe horovod's ImageNet example uses).

Augmenting comes after the store, so that every epoch crops anew: images are decoded and stored
as the central square of ``image_size / CENTER_FRACTION`` (73 pixels for 64, 256 for 224): each
image resized to that shorter side, aspect ratio kept, and its center cut out
(``images.decode_center_square``; a JPEG decodes only that square, and shards converted for this
size are stored at exactly it, so the store's first pass resamples nothing). Each training sample
is cut from the stored square at 8-100% of its area with an aspect ratio of 3/4 to 4/3, resized
to the training size and flipped half of the time. Validation takes the central
``CENTER_FRACTION`` of the same stored square, every time the same pixels (ImageNet's "resize
256, center crop 224"). Without a store (``--cache off``) every pass decodes anyway, so the crop
is cut while decoding, from the whole image: a JPEG decodes only its window
(``decode_and_crop_jpeg``), cheaper than decoding it whole. The randomness is stateless, drawn
from seeds of its own per rank, pass and sample (``seed_stream``), so ranks never crop alike, a
run is reproducible, and a resumed pass crops as the whole one.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hvdtrain.data.images import (decode_center_square, decode_image, decode_jpeg_window,
                                  decode_pixels, is_jpeg, resampled_to)

if TYPE_CHECKING:
    import tensorflow as tf

CENTER_FRACTION = 0.875
"""Side of the validation crop over the stored image's (ImageNet's 224 of 256)."""
AREA_RANGE = (0.08, 1.0)
"""Share of the stored image's area a training crop covers."""
ASPECT_RATIO_RANGE = (3 / 4, 4 / 3)
"""Width over height of a training crop."""


def stored_shape(image_shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The shape images are decoded and stored at, for crops of ``image_shape``."""
    height, width, channels = image_shape
    return (round(height / CENTER_FRACTION), round(width / CENTER_FRACTION), channels)


def decoded_shape(image_shape: tuple[int, int, int], *, augment: bool) -> tuple[int, int, int]:
    """The shape training at ``image_shape`` decodes (and stores) images at: with ``augment``
    the larger square its crops are cut from, else ``image_shape`` itself."""
    return stored_shape(image_shape) if augment else image_shape


def pixel_decoder(image_shape: tuple[int, int, int], *, augment: bool) -> Callable:
    """Encoded bytes -> the uint8 image training at ``image_shape`` decodes (and stores): the
    whole image resized to ``image_shape``, or with ``augment`` the central square at
    ``decoded_shape`` (aspect ratio kept) that crops are cut from. Validation and predict decode
    through it too, so a model sees at inference what it saw while validated."""
    shape = decoded_shape(image_shape, augment=augment)
    to_pixels = decode_center_square if augment else decode_image
    return lambda encoded: to_pixels(encoded, shape)


def pass_seed(seed: int, pass_index):
    """One seed per (seed, pass) (``pass_index`` an int64 tensor), for a pass's stateless draws:
    the same in every process and iterator. A TFRecord pass's block order (records.py) and its
    crops and flips (``seed_stream``) draw from it."""
    import tensorflow as tf

    return tf.constant(seed, tf.int64) * 1_000_003 + tf.cast(pass_index, tf.int64)


def seed_stream(seed: int, pass_index, skip=0) -> tf.data.Dataset:
    """Two seeds per sample of pass ``pass_index`` (an int64 tensor), from its ``skip``-th sample
    on: (seed and pass, the sample's place in the pass), for the stateless ops that crop and
    flip. The same in every process, so a pass resumed part-way crops its remaining samples as
    the whole pass would have; no seed goes through TensorFlow's global one."""
    import tensorflow as tf

    this_pass = pass_seed(seed, pass_index)
    return tf.data.Dataset.range(tf.cast(skip, tf.int64), 2**62).map(
        lambda index: tf.stack([this_pass, index]))


def augmented(train: tf.data.Dataset, image_shape: tuple[int, int, int], *,
              seeds: tf.data.Dataset) -> tf.data.Dataset:
    """``(image, label[, weight])`` elements of stored images -> random crops of ``image_shape``,
    flipped at random, with ``seeds`` (``seed_stream``): a new draw for every sample of every
    pass."""
    import tensorflow as tf

    def crop_and_flip(element, sample_seeds):
        image, rest = element[0], element[1:]
        begin, size = _crop_window(tf.shape(image), sample_seeds)
        return (_resized_and_flipped(tf.slice(image, begin, size), image_shape, sample_seeds),
                *rest)

    return (tf.data.Dataset.zip(train, seeds)
            .map(crop_and_flip, num_parallel_calls=tf.data.AUTOTUNE))


def decode_random_crop(encoded, seeds, image_shape: tuple[int, int, int]):
    """Encoded image bytes -> a random-resized crop of ``image_shape``, flipped at random. A
    JPEG decodes only the crop's window, scaled down where it is at least twice the output
    (``decode_jpeg_window``); other formats decode whole, then crop."""
    import tensorflow as tf

    channels = image_shape[2]

    def jpeg_window():
        begin, size = _crop_window(tf.io.extract_jpeg_shape(encoded), seeds)
        return decode_jpeg_window(encoded, begin[:2], size[:2], image_shape[:2], channels)

    def whole_then_crop():
        image = decode_pixels(encoded, channels)
        begin, size = _crop_window(tf.shape(image), seeds)
        return tf.slice(image, begin, size)

    crop = tf.cond(is_jpeg(encoded), jpeg_window, whole_then_crop)
    return _resized_and_flipped(crop, image_shape, seeds)


def _crop_window(shape, seeds):
    """(begin, size) of a random crop of an image of ``shape`` (Inception's ranges)."""
    import tensorflow as tf

    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seeds,
        min_object_covered=AREA_RANGE[0], aspect_ratio_range=ASPECT_RATIO_RANGE,
        area_range=AREA_RANGE, max_attempts=10, use_image_if_no_bounding_boxes=True)
    return begin, size


def _resized_and_flipped(crop, image_shape: tuple[int, int, int], seeds):
    """The crop resized to ``image_shape`` and mirrored left-right half of the time: the draw of
    ``tf.image.stateless_random_flip_left_right``, without its branch (reversing along no axis is
    the unflipped image)."""
    import tensorflow as tf

    resized = resampled_to(crop, image_shape[:2])  # a random crop: hardly ever already the size
    flip_seed = tf.stack([seeds[1], seeds[0]])  # not the crop's own seed
    flip = tf.random.stateless_uniform([], seed=flip_seed) < 0.5
    return tf.reverse(resized, axis=tf.range(1, 1 + tf.cast(flip, tf.int32)))


def center_cropped(validation: tf.data.Dataset,
                   image_shape: tuple[int, int, int]) -> tf.data.Dataset:
    """The central ``image_shape`` of every stored image (no resampling)."""
    import tensorflow as tf

    height, width, _ = image_shape
    return validation.map(
        lambda image, *rest: (tf.image.resize_with_crop_or_pad(image, height, width), *rest),
        num_parallel_calls=tf.data.AUTOTUNE)
