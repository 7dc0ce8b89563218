"""Does training from resized shards lose accuracy? `python -m benchmarks resized`.

Files: ``FILES`` photos of 500x375 (JPEG quality 90) in 10 class folders, each class one region
of one of scikit-learn's two sample photographs (a corner or the center), each file a different
crop around it (shifted, 80-100% of its size, flipped at random): a task a small CNN learns to
~0.9 in a few epochs, not to 1.0, so a loss of detail would show. No download.

For each seed of ``SEEDS``, one core each, the real commands a user runs:

    original  hvdtrain train --data-dir PHOTOS --augment --image-size 64 --epochs 8 --seed S
    resized   hvdtrain convert --data-dir PHOTOS --out SHARDS --image-size 64 --seed S (its default
              --max-resolution: a shorter side of 73, what --augment at 64 decodes to: 2% of the
              pixels), then hvdtrain train --tfrecords SHARDS, the same flags

Same seed, same split (the converter splits as --data-dir training does), same model. Each run's
saved model is then evaluated on the same validation pixels: the seed's validation split decoded
from the original files by hvdtrain's own validation pipeline (the center crop), built twice and
compared, so both sources are judged on identical pixels. Each run's own val_accuracy (on its own
source's validation pixels) is kept beside it. Accuracy holds when the two sources' medians differ
by no more than the run-to-run spread (max - min over seeds) of either.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Callable

FILES = 600
QUICK_FILES = 100
IMAGE_SIZE = 64
EPOCHS = 8
QUICK_EPOCHS = 1
SEEDS = (1, 2, 3)
QUICK_SEEDS = (1,)
VALIDATION_FRACTION = 0.2
SOURCES = ("original", "resized")
PHOTO_SIZE = (375, 500)


def make_region_photos(root: Path, count: int) -> None:
    """``count`` JPEGs of PHOTO_SIZE in 10 class folders: class k is a 320x240 region of one
    of the two sample photographs (427x640), each file a different crop around it."""
    import numpy as np
    from sklearn.datasets import load_sample_images

    from benchmarks.decode import save_photo

    photos = load_sample_images().images
    regions = [(photo, top, left) for photo in range(2)
               for top, left in ((0, 0), (0, 320), (187, 0), (187, 320), (93, 160))]
    rng = np.random.default_rng(0)
    for index in range(count):
        label = index % len(regions)
        photo, top, left = regions[label]
        scale = rng.uniform(0.8, 1.0)
        height, width = int(240 * scale), int(320 * scale)
        top = int(np.clip(top + rng.integers(-30, 31), 0, 427 - height))
        left = int(np.clip(left + rng.integers(-40, 41), 0, 640 - width))
        save_photo(photos[photo][top:top + height, left:left + width], PHOTO_SIZE, rng,
                   root / f"region{label}" / f"{index:04d}.jpg")


def validation_pixels(photos: str, seed: int):
    """(images, labels) of the seed's validation split decoded from the original files by
    hvdtrain's validation pipeline (--augment's center crop)."""
    import numpy as np

    from hvdtrain.data import build_pipelines
    from hvdtrain.data.cache import CacheChoice
    from hvdtrain.data.folder import list_image_folder
    from hvdtrain.runtime.base import World

    listing = list_image_folder(photos, image_size=IMAGE_SIZE,
                                validation_fraction=VALIDATION_FRACTION, seed=seed,
                                on_bad_image="skip")
    samples = listing.validation.num_samples
    pipelines = build_pipelines(listing, World(), batch_size=1, validation_batch_size=samples,
                                seed=seed, augment=True,
                                cache=CacheChoice("off", "benchmark"))
    (batch,) = list(pipelines.validation)
    return np.asarray(batch[0]), np.asarray(batch[1])


def evaluate(photos: str, seed: int, models: list[str]) -> dict:
    """Every model's accuracy on the same validation pixels, and whether two builds of the
    validation pipeline gave the same pixels."""
    import keras
    import numpy as np

    images, labels = validation_pixels(photos, seed)
    again, labels_again = validation_pixels(photos, seed)
    accuracies = []
    for path in models:
        scores = keras.models.load_model(path, compile=False).predict(images, verbose=0)
        accuracies.append(float(np.mean(np.argmax(scores, axis=-1) == labels)))
    return {"accuracy": accuracies, "samples": int(len(labels)),
            "identical": bool(np.array_equal(images, again)
                              and np.array_equal(labels, labels_again))}


def run(s, out: Path, log: Callable[[str], None], *, quick: bool = False) -> dict:
    import tempfile

    from benchmarks.report import machine
    from benchmarks.suite import BenchmarkFailed, _run

    core = str(max(os.sched_getaffinity(0)))
    files, epochs, seeds = (QUICK_FILES, QUICK_EPOCHS, QUICK_SEEDS) if quick else (
        FILES, EPOCHS, SEEDS)
    hvdtrain = [sys.executable, "-m", "hvdtrain"]
    runs: dict = {source: {"own_val_accuracy": [], "same_pixels_accuracy": []}
                  for source in SOURCES}
    identical, samples, stored = [], 0, None
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-resized-") as scratch:
        photos = Path(scratch) / "photos"
        log(f"resized: writing {files} photos of {PHOTO_SIZE[1]}x{PHOTO_SIZE[0]}")
        make_region_photos(photos, files)
        for seed in seeds:
            shards = Path(scratch) / f"shards-{seed}"
            _run([*hvdtrain, "convert", "--data-dir", str(photos), "--out", str(shards),
                  "--image-size", str(IMAGE_SIZE), "--seed", str(seed), "--validation-fraction",
                  str(VALIDATION_FRACTION), "--workers", "1", "--quiet"], s.timeout,
                 what=f"resized: convert seed {seed}")
            stored = json.loads((shards / "dataset.json").read_text())["max_resolution"]
            models = []
            for source, data in (("original", ["--data-dir", str(photos)]),
                                 ("resized", ["--tfrecords", str(shards)])):
                run_dir = Path(scratch) / f"{source}-{seed}"
                log(f"resized: seed {seed}, training from the {source} images")
                _run(["taskset", "-c", core, *hvdtrain, "train", *data, "--augment",
                      "--image-size", str(IMAGE_SIZE), "--epochs", str(epochs), "--seed",
                      str(seed), "--validation-fraction", str(VALIDATION_FRACTION),
                      "--run-dir", str(run_dir), "--no-tensorboard"], s.timeout,
                     what=f"resized: train {source} seed {seed}")
                history = json.loads((run_dir / "metrics.json").read_text())
                runs[source]["own_val_accuracy"].append(_last(history, "val_accuracy"))
                models.append(str(run_dir / "model.keras"))
            _, output = _run(["taskset", "-c", core, sys.executable, "-m", "benchmarks.resized",
                              "--evaluate", str(photos), "--seed", str(seed), *models],
                             s.timeout, what=f"resized: evaluate seed {seed}")
            try:
                evaluated = json.loads(output.strip().splitlines()[-1])
            except (IndexError, ValueError):
                raise BenchmarkFailed(f"resized: evaluation printed no result: "
                                      f"{output[-500:]}") from None
            for source, accuracy in zip(SOURCES, evaluated["accuracy"]):
                runs[source]["same_pixels_accuracy"].append(accuracy)
            identical.append(evaluated["identical"])
            samples = evaluated["samples"]
    result = {"files": files, "photo_size": f"{PHOTO_SIZE[1]}x{PHOTO_SIZE[0]}",
              "image_size": IMAGE_SIZE, "epochs": epochs, "seeds": list(seeds),
              "validation_samples": samples, "max_resolution": stored,
              "validation_pixels_identical": identical, "runs": runs, "machine": machine()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "resized.json").write_text(json.dumps(result, indent=1))
    (out / "resized.md").write_text(markdown(result) + "\n")
    return result


def _last(history: list[dict], metric: str) -> float:
    """The last epoch's ``metric`` from a run's metrics.json (a row per epoch)."""
    return float(history[-1][metric])


def markdown(result: dict) -> str:
    from benchmarks.report import measured_on

    runs = result["runs"]
    lines = ["| trained from | val_accuracy on the same pixels, per seed | median | spread | "
             "own val_accuracy, per seed | measured on |", "|---|---|---:|---:|---|---|"]
    spreads = {}
    for source in SOURCES:
        same = runs[source]["same_pixels_accuracy"]
        spreads[source] = max(same) - min(same)
        limit = result["max_resolution"]
        what = (f"shards, shorter side <= {limit['shorter_side']}" if source == "resized"
                and limit else "the original files")
        lines.append(f"| {what} | {', '.join(f'{v:.3f}' for v in same)} | "
                     f"{statistics.median(same):.3f} | {spreads[source]:.3f} | "
                     f"{', '.join(f'{v:.3f}' for v in runs[source]['own_val_accuracy'])} | "
                     f"{measured_on(result['machine'])} |")
    difference = (statistics.median(runs["resized"]["same_pixels_accuracy"])
                  - statistics.median(runs["original"]["same_pixels_accuracy"]))
    spread = max(spreads.values())
    verdict = "holds" if abs(difference) <= spread else "differs by more than that"
    identical = "identical" if all(result["validation_pixels_identical"]) else "NOT identical"
    lines += ["", f"Resized minus original, medians: {difference:+.3f} against a run-to-run "
                  f"spread of {spread:.3f}: accuracy {verdict}. Validation pixels of two builds: "
                  f"{identical}. {result['validation_samples']} validation samples, "
                  f"{result['files']} photos of {result['photo_size']}, --image-size "
                  f"{result['image_size']}, {result['epochs']} epochs."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluate", required=True, metavar="PHOTOS")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("models", nargs="+")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hvdtrain  # noqa: F401  (the Keras a user's job gets)

    print(json.dumps(evaluate(args.evaluate, args.seed, args.models)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
