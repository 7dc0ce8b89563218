"""Write TFRecord shards from an image folder: `python -m hvdtrain.tfrecords --data-dir D --out O`.

Each record holds the file's encoded bytes unchanged under ``image`` (PNG/JPEG/GIF/BMP; decoding
happens in the training pipeline, after sharding) and its class index under ``label`` (int64).
The train/validation split is the same one ``--data-dir`` training uses (same seed, same
fraction). Output::

    O/train-00000-of-00004.tfrecord ...  O/validation-00000-of-00001.tfrecord  O/dataset.json

``dataset.json`` records class names, image size and the record count of every shard, so training
does not have to count records at start-up. The output directory is written under a temporary
name and renamed at the end: it is either complete or absent.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Sequence

import numpy as np

from hvdtrain.data import DEFAULT_FILE_IMAGE_SIZE, TFRECORD_METADATA, list_image_folder
from hvdtrain.errors import UserError, reported
from hvdtrain.rundir import current_umask

PROGRAM = "hvdtrain.tfrecords"


def write_shards(paths: np.ndarray, labels: np.ndarray, out_dir: str, prefix: str,
                 num_shards: int) -> dict[str, int]:
    """Round-robin the samples over ``num_shards`` files; returns {file name: records}."""
    import tensorflow as tf

    num_shards = max(1, min(num_shards, len(paths)))
    counts = {}
    for shard in range(num_shards):
        name = f"{prefix}-{shard:05d}-of-{num_shards:05d}.tfrecord"
        indices = range(shard, len(paths), num_shards)
        with tf.io.TFRecordWriter(os.path.join(out_dir, name)) as writer:
            for index in indices:
                with open(paths[index], "rb") as file:
                    encoded = file.read()
                example = tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded])),
                    "label": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[int(labels[index])])),
                }))
                writer.write(example.SerializeToString())
        counts[name] = len(indices)
    return counts


def convert(data_dir: str, out_dir: str, *, shards: int, validation_shards: int,
            validation_fraction: float, seed: int, image_size: int, channels: int = 3,
            on_bad_image: str = "skip") -> dict:
    # The output checks are cheap; listing opens every image. A mistyped --out fails first.
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file; name a new directory")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise UserError(f"--out {out_dir} exists and is not empty; choose a new directory")
    listing = list_image_folder(data_dir, image_size=image_size,
                                validation_fraction=validation_fraction, seed=seed,
                                on_bad_image=on_bad_image, channels=channels)
    parent = os.path.dirname(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out_dir)}.")
    except OSError as error:
        raise UserError(f"--out {out_dir}: cannot create it ({error.strerror or error})") from None
    # mkdtemp makes 0700; shards are for other users too.
    os.chmod(staging, 0o777 & ~current_umask())
    try:
        counts = write_shards(listing.train.sources, listing.train.labels, staging, "train",
                              shards)
        if listing.validation.num_samples:
            counts.update(write_shards(listing.validation.sources, listing.validation.labels,
                                       staging, "validation", validation_shards))
        metadata = {"source": os.path.abspath(data_dir), "class_names": listing.class_names,
                    "image_size": image_size, "channels": channels, "seed": seed,
                    "validation_fraction": validation_fraction, "counts": counts,
                    "skipped": list(listing.notes)}
        with open(os.path.join(staging, TFRECORD_METADATA), "w") as file:
            json.dump(metadata, file, indent=2)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)  # empty, checked above
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return metadata


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", required=True, help="image folder, one sub-folder per class")
    parser.add_argument("--out", required=True, help="new directory for the shards")
    parser.add_argument("--shards", type=int, default=4,
                        help="training shards; at least the number of ranks that will read them "
                             "with --tfrecord-sharding file (default 4)")
    parser.add_argument("--validation-shards", type=int, default=1, help="(default 1)")
    parser.add_argument("--validation-fraction", type=float, default=0.2, help="(default 0.2)")
    parser.add_argument("--seed", type=int, default=42, help="split seed (default 42)")
    parser.add_argument("--image-size", type=int, default=DEFAULT_FILE_IMAGE_SIZE,
                        help="size training resizes to, recorded in dataset.json (default 64)")
    parser.add_argument("--channels", type=int, choices=(1, 3), default=3,
                        help="channels training decodes to, recorded in dataset.json (default 3)")
    parser.add_argument("--on-bad-image", choices=("skip", "fail"), default="skip")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.validation_shards < 1:
        raise UserError("--shards and --validation-shards must be at least 1")
    metadata = convert(args.data_dir, args.out, shards=args.shards,
                       validation_shards=args.validation_shards,
                       validation_fraction=args.validation_fraction, seed=args.seed,
                       image_size=args.image_size, channels=args.channels,
                       on_bad_image=args.on_bad_image)
    for note in metadata["skipped"]:
        print(note)
    print(f"wrote {sum(metadata['counts'].values())} records in {len(metadata['counts'])} "
          f"shards to {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
