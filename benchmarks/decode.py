"""The input pipeline against the JPEG decoder's ceiling, per core: `python -m benchmarks decode`.

Files: ``FILES`` ImageNet-like JPEGs (500x375, quality 90, in 10 class folders) cut from the two
photographs scikit-learn ships in its wheel (random crops of half to all of the photo, resized,
flipped at random): real photographic content, no download. Every variant is a process pinned
to one core before TensorFlow starts (so its thread pools are sized for one), reads every file
twice at 224x224 in batches of 32, and its second pass is timed whole:

    ceiling         a bare tf.data loop: read_file, decode_jpeg, resize (parallel map), batch
    keras           keras.utils.image_dataset_from_directory (the seed article's loader)
    hvdtrain        hvdtrain's training pipeline, --augment --cache off: every pass decodes, and
                    the random-resized crop is cut while decoding (decode_and_crop_jpeg)
    hvdtrain-store  the same with the memory store (what --cache auto picks for a folder that
                    fits): its second pass, crops of the stored images, nothing decoded
    keras-run, hvdtrain-run
                    keras, and hvdtrain with the memory store, over RUN_PASSES passes timed
                    whole with no warm-up (tracing, and the store's first pass, included)

Interleaved rounds, medians (benchmarks/harness.py). Targets (issue 27): hvdtrain at least 0.9x
the ceiling and 1.3x keras.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

FILES = 3000
QUICK_FILES = 320
IMAGE_SIZE = 224
BATCH = 32
RUN_PASSES = 3
"""Passes of the ``-run`` variants: a short training run, timed whole from its first batch."""
VARIANTS = ("ceiling", "keras", "hvdtrain", "hvdtrain-store", "keras-run", "hvdtrain-run")
TARGETS = {("hvdtrain", "ceiling"): 0.9, ("hvdtrain", "keras"): 1.3}
#: Ratios reported without a target of their own.
ALSO = (("hvdtrain-store", "keras"), ("hvdtrain-run", "keras-run"))


def make_photos(root: Path, count: int) -> None:
    """``count`` 500x375 JPEGs at quality 90 in 10 class folders, each a different random crop
    of one of scikit-learn's two sample photographs (427x640)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    for index in range(count):
        photo = photos[index % len(photos)]
        height, width = photo.shape[:2]
        crop_height = int(rng.integers(height // 2, height + 1))
        crop_width = min(width, crop_height * 4 // 3)
        top = int(rng.integers(0, height - crop_height + 1))
        left = int(rng.integers(0, width - crop_width + 1))
        image = Image.fromarray(photo[top:top + crop_height, left:left + crop_width])
        image = image.resize((500, 375), Image.BILINEAR)
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        folder = root / f"class{index % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        image.save(folder / f"{index:05d}.jpg", quality=90)


def measure(variant: str, root: str) -> float:
    """Samples/s of ``variant``'s second pass over the folder, timed whole (of its first
    RUN_PASSES passes for a ``-run`` variant).

    The first pass warms up (tracing, the page cache; for hvdtrain-store it fills the store).
    The second is timed from the start of its first batch to its last, so every variant's clock
    covers one pass of work: timing from a later batch would leave out whatever a variant did
    before that batch (keras' loader fills a 256-image shuffle buffer before its first batch, so
    its clock would miss 256 decodes a pass, 9% of 3,000 files).
    """
    import tensorflow as tf

    files = sorted(tf.io.gfile.glob(os.path.join(root, "*", "*.jpg")))
    per_pass = len(files) // BATCH
    warm_up, timed = (0, RUN_PASSES) if variant.endswith("-run") else (1, 1)
    count = warm_up + timed
    if variant == "ceiling":
        def load(path):  # float32 out, as from keras' loader (hvdtrain's are uint8: 4x smaller)
            image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
            return tf.image.resize(image, [IMAGE_SIZE, IMAGE_SIZE])

        dataset = (tf.data.Dataset.from_tensor_slices(files)
                   .map(load, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH)
                   .map(lambda images: (images,)).prefetch(tf.data.AUTOTUNE))
        passes = (iter(dataset) for _ in range(count))
    elif variant.startswith("keras"):
        import keras

        dataset = keras.utils.image_dataset_from_directory(
            root, image_size=(IMAGE_SIZE, IMAGE_SIZE), batch_size=BATCH, seed=0)
        passes = (iter(dataset) for _ in range(count))
    else:
        from hvdtrain.data import build_pipelines
        from hvdtrain.data.cache import CacheChoice
        from hvdtrain.data.folder import list_image_folder
        from hvdtrain.runtime.base import World

        listing = list_image_folder(root, image_size=IMAGE_SIZE, validation_fraction=0.0,
                                    seed=0, on_bad_image="skip")
        cache = "off" if variant == "hvdtrain" else "memory"
        pipelines = build_pipelines(listing, World(), batch_size=BATCH, validation_batch_size=BATCH,
                                    validation_steps=0, seed=0, augment=True,
                                    cache=CacheChoice(cache, "benchmark"))

        def hvdtrain_passes():
            endless = iter(pipelines.train)  # repeats: a pass is per_pass batches of it
            for _ in range(count):
                yield (next(endless) for _ in range(per_pass))

        passes = hvdtrain_passes()
    for _ in range(warm_up):
        for _ in next(passes):
            pass
    started, samples = time.perf_counter(), 0
    for one_pass in passes:
        for batch in one_pass:
            samples += int(batch[0].shape[0])
    return samples / (time.perf_counter() - started)


def run(s, out: Path, log: Callable[[str], None], *, quick: bool = False) -> dict:
    import tempfile

    from benchmarks.harness import interleave
    from benchmarks.report import machine
    from benchmarks.suite import BenchmarkFailed, _run

    core = max(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-decode-") as scratch:
        root = Path(scratch) / "photos"
        files = QUICK_FILES if quick else FILES
        log(f"decode: writing {files} JPEGs of 500x375 in {root}")
        make_photos(root, files)

        def one(variant: str) -> Callable[[], dict]:
            def measured() -> dict:
                _, output = _run([sys.executable, "-m", "benchmarks.decode", "--measure",
                                  variant, "--data", str(root), "--core", str(core)],
                                 s.timeout, what=f"decode {variant}")
                try:
                    return json.loads(output.strip().splitlines()[-1])
                except (IndexError, ValueError):
                    raise BenchmarkFailed(f"decode {variant} printed no result: "
                                          f"{output[-500:]}") from None
            return measured

        rounds = interleave({variant: one(variant) for variant in VARIANTS},
                            repeats=s.repeats, warmup=s.warmup, log=log)
    result = {"files": files, "image_size": IMAGE_SIZE, "core": core,
              "samples_per_sec": {variant: [row["samples_per_sec"] for row in rows]
                                  for variant, rows in rounds.items()},
              "machine": machine()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps(result, indent=1))
    (out / "decode.md").write_text(markdown(result) + "\n")
    return result


def markdown(result: dict) -> str:
    from benchmarks.harness import ratio
    from benchmarks.report import measured_on

    rates = result["samples_per_sec"]
    where = f"{measured_on(result['machine'])} (one used)"
    lines = ["| variant | samples/s per round, one core | median | measured on |",
             "|---|---|---:|---|"]
    for variant, values in rates.items():
        lines.append(f"| {variant} | {', '.join(f'{v:.0f}' for v in values)} | "
                     f"{statistics.median(values):.0f} | {where} |")
    lines += ["", "| ratio | of medians | median of rounds | target |", "|---|---:|---:|---|"]
    for (numerator, denominator) in (*TARGETS, *ALSO):
        result_ratio = ratio(numerator, rates[numerator], denominator, rates[denominator])
        target = TARGETS.get((numerator, denominator))
        verdict = "-" if target is None else (
            f">= {target:g}: {'met' if result_ratio.of_medians >= target else 'missed'}")
        lines.append(f"| {numerator} / {denominator} | {result_ratio.of_medians:.2f} | "
                     f"{result_ratio.paired_median:.2f} | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure", choices=VARIANTS, required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--core", type=int, required=True)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {args.core})  # before TensorFlow sizes its thread pools
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hvdtrain  # noqa: F401  (selects Keras 2 for the keras variant, as a user's job would)

    print(json.dumps({"samples_per_sec": measure(args.measure, args.data)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
