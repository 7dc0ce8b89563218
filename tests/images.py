"""Real image folders for tests: the embedded digits, upscaled and written as PNG and JPEG files."""
from __future__ import annotations

from pathlib import Path


def make_image_folder(root: Path, *, classes: int = 3, per_class: int = 40,
                      sizes=(24, 32, 40)) -> Path:
    """<root>/<digit name>/<n>.png|.jpg, mixed sizes and formats, RGB and grayscale."""
    import tensorflow as tf
    from sklearn.datasets import load_digits

    digits = load_digits()
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    for label in range(classes):
        folder = root / names[label]
        folder.mkdir(parents=True, exist_ok=True)
        images = digits.images[digits.target == label][:per_class]
        for index, image in enumerate(images):
            size = sizes[index % len(sizes)]
            pixels = tf.image.resize((image * 255 / 16)[..., None], [size, size])
            pixels = tf.cast(tf.clip_by_value(pixels, 0, 255), tf.uint8)
            if index % 2:
                encoded = tf.io.encode_jpeg(tf.image.grayscale_to_rgb(pixels), quality=95)
                (folder / f"{index:03d}.jpg").write_bytes(encoded.numpy())
            else:
                (folder / f"{index:03d}.png").write_bytes(tf.io.encode_png(pixels).numpy())
    return root

