"""The image formats hvdtrain reads (what ``tf.io.decode_image`` decodes), and decoding them.

A JPEG larger than what it is decoded for is decoded smaller (libjpeg's DCT scaling, TensorFlow's
``ratio``): at 1/2, 1/4 or 1/8 of its size, the largest that still has at least the output's
pixels in both sides, then resized to the output as before. That decodes 4-64x fewer pixels;
the pixels differ from decoding whole and resizing by what the scaled inverse DCT averages
(docs/benchmarks.md section 10 gives the difference measured on photographs).
"""
from __future__ import annotations

from typing import Callable

# File signatures of the formats tf.io.decode_image reads.
_IMAGE_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
    b"BM": "BMP",
}
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".gif", ".bmp"})
DECODED_PIXELS_LIMIT = 1 << 28
"""The most pixels hvdtrain decodes of one image (a 16384 x 16384 image; 768 MiB as RGB): a
valid 110 KB PNG can hold 30000 x 30000 pixels, 2.7 GB decoded, in every parallel decode of
every rank. Training counts a larger image with those that do not decode; the converter's limit
grows with --max-resolution (``converter_pixels_limit``). A JPEG decoded at a DCT scale counts
the pixels of that scale."""


def converter_pixels_limit(max_resolution: int) -> int:
    """The converter's limit for a --max-resolution of ``max_resolution`` pixels: the training
    limit, or 16 times the square of that shorter side where that is more."""
    return max(DECODED_PIXELS_LIMIT, 16 * max_resolution * max_resolution)


def header_pixels(encoded):
    """Width times height from a PNG's, GIF's or BMP's header (a tensor, int64; 0 for any other
    bytes, a JPEG included: its decode is bounded by its DCT scale instead)."""
    import tensorflow as tf

    # The first 26 bytes hold each format's size; a header cut short reads as zeros.
    header = tf.strings.join([tf.strings.substr(encoded, 0, 26), b"\0" * 26])

    def number(begin: int, length: int, little_endian: bool):
        digits = tf.cast(tf.io.decode_raw(tf.strings.substr(header, begin, length), tf.uint8),
                         tf.int64)
        weights = tf.constant([256 ** i for i in (range(length) if little_endian
                                                  else reversed(range(length)))], tf.int64)
        return tf.reduce_sum(digits * weights)

    head = tf.strings.substr(encoded, 0, 3)
    png = number(16, 4, False) * number(20, 4, False)
    gif = number(6, 2, True) * number(8, 2, True)
    # BMP: signed 32-bit width and height (a negative height is a top-down image).
    bmp_height = number(22, 4, True)
    bmp_height = tf.where(bmp_height >= 1 << 31, (1 << 32) - bmp_height, bmp_height)
    bmp = number(18, 4, True) * bmp_height
    return tf.case([(head == b"\x89PN", lambda: png), (head == b"GIF", lambda: gif),
                    (tf.strings.substr(encoded, 0, 2) == b"BM", lambda: bmp)],
                   default=lambda: tf.constant(0, tf.int64))


def image_format(path: str) -> str | None:
    """'PNG', 'JPEG', 'GIF' or 'BMP' from the file's first bytes; None for anything else."""
    try:
        with open(path, "rb") as file:
            head = file.read(8)
    except OSError:
        return None
    return image_format_of_bytes(head)


def image_format_of_bytes(head: bytes) -> str | None:
    """'PNG', 'JPEG', 'GIF' or 'BMP' from a file's first bytes (more are fine); None otherwise."""
    for signature, name in _IMAGE_SIGNATURES.items():
        if head.startswith(signature):
            return name
    return None


def decode_pixels(encoded, channels: int):
    """PNG/JPEG/GIF/BMP bytes -> uint8 pixels with ``channels`` (1 or 3) channels.

    TensorFlow decodes GIF and BMP only to colour, so at 1 channel they decode to RGB and are
    converted to gray (``decode_image(channels=1)`` refuses them); PNG and JPEG decode to gray
    directly, as before. An image over DECODED_PIXELS_LIMIT is an error, as one that does not
    decode is (the pipeline counts both), before any of it is decoded."""
    import tensorflow as tf

    with tf.control_dependencies([tf.debugging.assert_less_equal(
            header_pixels(encoded), tf.constant(DECODED_PIXELS_LIMIT, tf.int64),
            message="an image over hvdtrain's decoded pixels limit")]):
        encoded = tf.identity(encoded)
    if channels != 1:
        return tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    head = tf.strings.substr(encoded, 0, 3)
    gray_directly = (head == b"\x89PN") | (head == b"\xff\xd8\xff")
    return tf.cond(
        gray_directly,
        lambda: tf.io.decode_image(encoded, channels=1, expand_animations=False),
        lambda: tf.image.rgb_to_grayscale(
            tf.io.decode_image(encoded, channels=3, expand_animations=False)))


def decode_image(encoded, image_shape: tuple[int, int, int]):
    """PNG/JPEG/GIF/BMP bytes -> uint8 pixels of ``image_shape`` (resized, rounded). A JPEG at
    least twice as large decodes scaled down (``decode_jpeg_window``)."""
    import tensorflow as tf

    return _decode_region(encoded, image_shape,
                          lambda shape: (tf.zeros([2], tf.int32), shape[:2]))


def decode_center_square(encoded, image_shape: tuple[int, int, int]):
    """PNG/JPEG/GIF/BMP bytes -> uint8 pixels of the square ``image_shape``: the image's central
    square (as wide as its shorter side) resized to it, which is resizing the image to that
    shorter side and cutting out the center, with the aspect ratio kept (ImageNet's
    "resize 256, center crop"). A JPEG decodes only that square, scaled down where it is at least
    twice the output (``decode_jpeg_window``); shards converted for this size
    (``--max-resolution``) hold a square of exactly the output, which is then not resampled."""
    import tensorflow as tf

    def central_square(shape):
        side = tf.minimum(shape[0], shape[1])
        return (shape[:2] - side) // 2, tf.stack([side, side])

    return _decode_region(encoded, image_shape, central_square)


def _decode_region(encoded, image_shape: tuple[int, int, int], region: Callable):
    """The part ``region`` (image shape -> (begin, size), both (height, width)) names of the
    encoded image, resized to ``image_shape``: a JPEG decodes only that window, DCT-scaled where
    it applies (``decode_jpeg_window``); other formats decode whole and are cut."""
    import tensorflow as tf

    height, width, channels = image_shape

    def jpeg_window():
        begin, size = region(tf.io.extract_jpeg_shape(encoded))
        return decode_jpeg_window(encoded, begin, size, (height, width), channels)

    def cut_from_whole():
        pixels = decode_pixels(encoded, channels)
        begin, size = region(tf.shape(pixels))
        return tf.slice(pixels, tf.concat([begin, [0]], 0), tf.concat([size, [-1]], 0))

    pixels = tf.cond(is_jpeg(encoded), jpeg_window, cut_from_whole)
    return resized_to(pixels, (height, width))


def resized_to(pixels, size: tuple[int, int]):
    """Pixels resized to ``size`` (``resampled_to``); pixels already of that size are returned as
    they are (what resampling them would give, for no work). For the store's decode, where
    shards converted for the training size hold exactly that size."""
    import tensorflow as tf

    same_size = tf.reduce_all(tf.shape(pixels)[:2] == tf.constant(size))
    resized = tf.cond(same_size, lambda: tf.identity(pixels), lambda: resampled_to(pixels, size))
    return tf.ensure_shape(resized, [*size, pixels.shape[-1]])


def resampled_to(pixels, size: tuple[int, int]):
    """uint8 pixels resized (bilinear) to ``size`` and rounded back to uint8. Not clipped: each
    output pixel is a weighted mean of input pixels (weights >= 0, summing to 1), so it stays
    within 0..255."""
    import tensorflow as tf

    return tf.cast(tf.round(tf.image.resize(pixels, size)), tf.uint8)


def is_jpeg(encoded):
    """True (a bool tensor) where the encoded bytes are a JPEG."""
    import tensorflow as tf

    return tf.strings.substr(encoded, 0, 3) == b"\xff\xd8\xff"


DCT_RATIOS = (1, 2, 4, 8)
"""The scales a JPEG decodes at (``ratio``: 1/1, 1/2, 1/4, 1/8 of its size)."""


def dct_ratio_index(window_height, window_width, output_height, output_width):
    """Index in ``DCT_RATIOS`` of the largest ratio at which a window of this size still decodes
    to at least the output's size in both sides (0: decode at full size). Tensors or ints."""
    import tensorflow as tf

    fits = [tf.logical_and(window_height >= ratio * output_height,
                           window_width >= ratio * output_width) for ratio in DCT_RATIOS[1:]]
    return tf.add_n([tf.cast(ratio_fits, tf.int32) for ratio_fits in fits])


def decode_jpeg_window(encoded, begin, size, output_size: tuple[int, int], channels: int):
    """The window ``begin`` (top, left), ``size`` (height, width) of a JPEG, in its own pixels,
    decoded at the smallest DCT scale that keeps it at least ``output_size``: uint8 pixels of
    about ``size / ratio``, for the caller to resize.

    ``ratio`` is an attribute of the op, not a tensor, so each ratio is a branch. TensorFlow takes
    the crop window of a scaled decode in the scaled image's pixels (and checks it against the
    scaled size): the window's edges are scaled down, outward, to whole pixels."""
    import tensorflow as tf

    begin, size = tf.cast(begin, tf.int32), tf.cast(size, tf.int32)
    end = begin + size

    def at_ratio(ratio):
        def decode():
            scaled_begin = begin // ratio
            scaled_end = -(-end // ratio)  # rounded up: never inside the window
            window = tf.concat([scaled_begin, scaled_end - scaled_begin], axis=0)
            return tf.io.decode_and_crop_jpeg(encoded, window, channels=channels, ratio=ratio)
        return decode

    # Two branches first, so a window under twice the output (every crop of a 500x375 photo for
    # 224) pays one conditional, not a four-way switch (docs/benchmarks.md section 10's step
    # table has what the choice of scale costs there).
    index = dct_ratio_index(size[0], size[1], *output_size)
    scaled = [at_ratio(ratio) for ratio in DCT_RATIOS[1:]]
    return tf.cond(index > 0, lambda: tf.switch_case(index - 1, scaled), at_ratio(1))
