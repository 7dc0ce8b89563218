"""The image formats hvdtrain reads (what ``tf.io.decode_image`` decodes), and decoding them."""
from __future__ import annotations

# File signatures of the formats tf.io.decode_image reads.
_IMAGE_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
    b"BM": "BMP",
}
IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".gif", ".bmp"})


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
    directly, as before."""
    import tensorflow as tf

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
    """PNG/JPEG/GIF/BMP bytes -> uint8 pixels of ``image_shape`` (resized, rounded)."""
    import tensorflow as tf

    height, width, channels = image_shape
    image = tf.image.resize(decode_pixels(encoded, channels), [height, width])
    return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
