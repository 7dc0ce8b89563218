"""TFRecord shards: the format (written by ``hvdtrain.tfrecords``, read here) and the source.

The format, in one place::

    <dir>/train-00000-of-00004.tfrecord ...  <dir>/validation-00000-of-00001.tfrecord
    <dir>/dataset.json    {"class_names": [...], "image_size": N, "channels": C,
                           "counts": {shard file name: records},
                           "bytes": {shard file name: its size},
                           "files_sha256": the (file, label) table's digest, ...
                           "max_resolution": {"shorter_side": S, "jpeg_quality": Q,
                                              "resized": R} or null, ...}

Each record is a ``tf.train.Example`` with ``image`` (encoded PNG/JPEG/GIF/BMP bytes: the file's,
unchanged, or with ``max_resolution`` a JPEG of it resized to a shorter side of S pixels when its
shorter side was larger) and ``label`` (int64 class index). ``dataset.json`` is optional for
reading: without it records are counted and labels read at start-up. A glob of shards from
elsewhere works too.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np

from hvdtrain.data.augment import decoded_shape, pass_seed
from hvdtrain.data.listing import (DEFAULT_FILE_IMAGE_SIZE, HeldOutRecords, Listing, Split,
                                   held_out_counts, split_identity)
from hvdtrain.data.shares import samples_for_rank
from hvdtrain.errors import UserError
from hvdtrain.runtime.base import World

if TYPE_CHECKING:
    import tensorflow as tf

METADATA = "dataset.json"
TRAIN, VALIDATION = "train", "validation"
"""Shard name prefixes of the two splits."""
SPLIT_BY_NAME = "by name"
"""dataset.json's "split" for shards whose validation files were chosen by name
(data.listing.held_out_by_name); conversions without it chose them by position."""
RAW_RECORD_SHUFFLE = 2_048
"""Undecoded records shuffled before decoding, a block of this many at a time: a block of
encoded bytes fills by reading, not decoding, so the first step does not wait for thousands of
decodes."""


def shard_name(split_prefix: str, shard: int, count: int) -> str:
    return f"{split_prefix}-{shard:05d}-of-{count:05d}.tfrecord"


def shorter_side_decoded(image_size: int, *, augment: bool) -> int:
    """Pixels on the shorter side that training at ``image_size`` decodes an image to
    (``augment.decoded_shape``); shards that store fewer are upsampled."""
    return decoded_shape((image_size, image_size, 1), augment=augment)[0]


def serialize_example(encoded_image: bytes, label: int) -> bytes:
    import tensorflow as tf

    # deterministic: the same bytes for the same sample in every process (the protobuf that
    # TensorFlow 2.21 brings orders a map's entries differently from one process to the next),
    # so a shard written twice, or by another worker, is the same file.
    return tf.train.Example(features=tf.train.Features(feature={
        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[encoded_image])),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
    })).SerializeToString(deterministic=True)


def parse_example(record):
    """A serialized record -> (encoded image bytes, label), as tensors."""
    import tensorflow as tf

    features = tf.io.parse_single_example(record, {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    })
    return features["image"], features["label"]


@dataclass(frozen=True)
class TFRecordListing(Listing):
    """TFRecord shards: ``Split.sources`` are shard paths and ``Split.counts`` their records.

    Training shards are shared out as whole files (``by_file``: each rank reads only its files,
    in an order shuffled with the shared seed) or record by record (every rank reads every file
    and keeps every size-th record). Validation always goes record by record: every rank must
    run the same number of validation batches, and the set is small enough to read in full.
    """

    random_access: ClassVar[bool] = False  # read in file order, shuffled in blocks

    def shard_records(self, split: Split, world: World, *, seed: int, by_file: bool = False,
                      failures=None) -> tf.data.Dataset:
        import tensorflow as tf

        files = (split.sources, _first_record_indices(split), _records_in_files(split))
        if by_file:
            order = file_order(split, seed)
            return (tf.data.Dataset.from_tensor_slices(tuple(column[order] for column in files))
                    .shard(world.size, world.rank)
                    .interleave(lambda *file: _records_of(split, *file, failures),
                                cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE))
        return (tf.data.Dataset.from_tensor_slices(files)
                .flat_map(lambda *file: _records_of(split, *file, failures))
                .shard(world.size, world.rank))

    def rank_records(self, split: Split, world: World, *, shuffle: bool, seed: int,
                     by_file: bool, pass_index, failures=None) -> tf.data.Dataset:
        # A record's position is its place in this rank's reading order, which is the same on
        # every pass (files in the shared seed's order, interleaved deterministically): so a
        # store can keep it by position, and the shuffle comes after the numbering.
        records = self.shard_records(split, world, seed=seed, by_file=by_file,
                                     failures=failures).enumerate()
        if shuffle:
            num_samples = self.samples_for_rank(split, world, seed=seed, by_file=by_file)
            records = _block_shuffled(records, _buffer(num_samples),
                                      pass_seed(seed + world.rank, pass_index))
        return records

    def reader(self) -> Callable:
        return parse_example

    def sample_namer(self, split: Split, world: World, *, by_file: bool
                     ) -> Callable[[int], str]:
        if by_file:
            return lambda position: "a record of this rank's TFRecord files"
        return lambda position: "a record of the TFRecord files"

    def samples_for_rank(self, split: Split, world: World, *, seed: int, by_file: bool) -> int:
        if by_file:
            return files_for_rank(split, world, file_order(split, seed))[1]
        return samples_for_rank(split.num_samples, world)

    def check_sharding(self, world: World, batch_size: int, *, seed: int, by_file: bool) -> None:
        """With file sharding, every rank needs at least one full batch from its files, or it
        would run dry."""
        if not by_file:
            return
        split = self.train
        if len(split.sources) < world.size:
            raise UserError(
                f"{world.size} ranks but only {len(split.sources)} training TFRecord file(s): "
                "with --tfrecord-sharding file every rank needs its own file; write more shards "
                "(python -m hvdtrain.tfrecords --shards N) or use --tfrecord-sharding example")
        order = file_order(split, seed)
        for rank in range(world.size):
            _, records = files_for_rank(split, World(rank=rank, size=world.size), order)
            if records < batch_size:
                raise UserError(
                    f"rank {rank} would get {records} record(s) from its TFRecord files, fewer "
                    f"than one batch of {batch_size}; use --tfrecord-sharding example or evenly "
                    "sized shards")


def _buffer(num_samples: int) -> int:
    """The block of raw records a pass read from the files is shuffled in."""
    return min(max(num_samples, 1), RAW_RECORD_SHUFFLE)


def _block_shuffled(records: tf.data.Dataset, block: int, seed) -> tf.data.Dataset:
    """``records`` in blocks of ``block``, each in a random order drawn from (``seed``, the
    pass's, and its index): what a shuffle buffer of that size does to records read in file
    order, from stateless draws (tf.data's shuffle takes its seed through TensorFlow's global
    seed, which refuses a per-pass tensor seed once a global seed is set)."""
    import tensorflow as tf

    def permuted(index, block_records):
        count = tf.shape(tf.nest.flatten(block_records)[0])[0]
        order = tf.random.experimental.stateless_shuffle(
            tf.range(count), seed=tf.stack([seed, index]))
        return tf.nest.map_structure(lambda values: tf.gather(values, order), block_records)

    return records.batch(block).enumerate().map(permuted).unbatch()


def file_order(split: Split, seed: int) -> np.ndarray:
    """The shard files shuffled with the seed all ranks share, before ``shard(size, rank)``.

    Plain numpy, so the ranks, the pre-flight check and the pipeline agree on it whatever
    TensorFlow's global seed is, and a check over every rank costs one shuffle, not one per rank.
    """
    return np.random.default_rng(seed).permutation(len(split.sources))


def files_for_rank(split: Split, world: World, order: np.ndarray) -> tuple[list[str], int]:
    """(files, records) that file-sharding gives this rank: what ``shard`` keeps of ``order``."""
    mine = order[world.rank::world.size]
    return [str(path) for path in split.sources[mine]], int(split.counts[mine].sum())


def _first_record_indices(split: Split) -> np.ndarray:
    if split.held_out is not None:
        return split.held_out.offsets
    return np.zeros(len(split.sources), dtype=np.int64)


def _records_in_files(split: Split) -> np.ndarray:
    """Records each shard file holds, on both sides of a split that holds records out."""
    return split.held_out.file_counts if split.held_out is not None else split.counts


def _records_of(split: Split, path, first_index, expected, failures=None) -> tf.data.Dataset:
    """The records of the TFRecord file ``path`` that belong to ``split`` (all, unless it holds
    records out: then the record's index in the whole sequence decides, see HeldOutRecords).
    With ``failures``, a file that does not hold the ``expected`` records (dataset.json's count,
    or the one counted at start-up) is named at the end of its first pass
    (``DecodeFailures.count_file``): a shard cut short whose size dataset.json did not record
    (``check_sizes``) would otherwise train on with blanks for its missing records."""
    import tensorflow as tf

    records = tf.data.TFRecordDataset(path)
    if failures is not None:
        records = failures.count_file(records, path, expected)
    held_out = split.held_out
    if held_out is None:
        return records

    def belongs(index, record):
        position = tf.cast(index, tf.float64)
        held = tf.floor((position + 1) * held_out.fraction) > tf.floor(position * held_out.fraction)
        return held if held_out.keep == "validation" else tf.logical_not(held)

    return records.enumerate(start=first_index).filter(belongs).map(lambda index, record: record)


def list_tfrecords(location: str, *, image_size: int | None, channels: int | None = None,
                   validation_fraction: float = 0.0, seed: int = 0,
                   augment: bool = False) -> TFRecordListing:
    """TFRecord shards: a directory written by ``hvdtrain.tfrecords`` or a glob of shards.

    Without ``validation-*`` shards, ``validation_fraction`` of the data is held out: whole
    shards when that fraction of the shards is at least one, else records (``HeldOutRecords``).
    Read through tf.io.gfile, so ``gs://`` (and any file system TensorFlow knows) works as well
    as a local path. ``augment``: training crops (the note on shards too small for that).
    """
    import tensorflow as tf

    gfile = tf.io.gfile
    metadata = {}
    if gfile.isdir(location):
        metadata_path = os.path.join(location, METADATA)
        if gfile.exists(metadata_path):
            with gfile.GFile(metadata_path) as file:
                metadata = json.load(file)
            if not isinstance(metadata, dict):
                raise UserError(f"{metadata_path} holds a JSON {type(metadata).__name__}, not the "
                                "object python -m hvdtrain.tfrecords writes: remove it (the "
                                "records are then counted at start-up) or convert the data again")
        train_files = sorted(gfile.glob(os.path.join(location, f"{TRAIN}-*.tfrecord")))
        validation_files = sorted(gfile.glob(os.path.join(location, f"{VALIDATION}-*.tfrecord")))
        if not train_files:  # a plain directory of shards: all but validation-* are training
            train_files = sorted(set(gfile.glob(os.path.join(location, "*.tfrecord")))
                                 - set(validation_files))
    else:
        train_files, validation_files = sorted(gfile.glob(location)), []
    if not train_files:
        raise UserError(f"--tfrecords {location}: no TFRecord files found")
    check_sizes(train_files + validation_files, metadata)
    counts = metadata.get("counts", {})
    train_counts = np.array([counts.get(os.path.basename(f)) or count_records(f)
                             for f in train_files], dtype=np.int64)
    validation_counts = np.array([counts.get(os.path.basename(f)) or count_records(f)
                                  for f in validation_files], dtype=np.int64)
    if "class_names" in metadata:
        class_names = tuple(metadata["class_names"])
    else:
        class_names = tuple(str(c) for c in range(max_label(train_files) + 1))
    if len(class_names) < 2:
        raise UserError(f"--tfrecords {location}: labels name only one class; "
                        "classification needs at least 2")
    train = Split(np.array(train_files), None, train_counts)
    validation = Split(np.array(validation_files), None, validation_counts)
    identity = {}
    if validation_files:
        held_out = f"{len(validation_files)} validation shard(s)"
        # The converter's split of the folder, in the folder's own words: an image folder and
        # the shards converted from it with the same split are one experiment.
        if isinstance(metadata.get("validation_fraction"), (int, float)) \
                and isinstance(metadata.get("seed"), int):
            # Converted since files are split by name ("split"), or by position before.
            kind = "files" if metadata.get("split") == SPLIT_BY_NAME else "files by position"
            identity["split"] = split_identity(kind, metadata["validation_fraction"],
                                               metadata["seed"])
        else:
            identity["split"] = "validation shards"
    elif validation_fraction > 0:
        train, validation, held_out = hold_out(train, validation_fraction, seed)
        identity["split"] = split_identity("records", validation_fraction, seed)
    else:
        held_out = "no validation (--validation-fraction 0)"
        identity["split"] = split_identity("records", 0, seed)
    if isinstance(metadata.get("files_sha256"), str):
        identity["labels"] = metadata["files_sha256"]
    size = image_size or metadata.get("image_size") or DEFAULT_FILE_IMAGE_SIZE
    channels = channels or int(metadata.get("channels", 3))
    return TFRecordListing(
        description=f"{location}: {train.num_samples} training records in "
                    f"{len(train.sources)} shard(s), {held_out}, {len(class_names)} classes, "
                    f"resized to {size}x{size}",
        class_names=class_names,
        image_shape=(int(size), int(size), channels),
        train=train,
        validation=validation,
        notes=_resolution_notes(location, metadata, int(size), augment),
        identity=identity,
    )


def _resolution_notes(location: str, metadata: dict, image_size: int,
                      augment: bool) -> tuple[str, ...]:
    """A warning when the converter's --max-resolution stored fewer pixels than training decodes
    to (shards converted for a smaller --image-size)."""
    limit = metadata.get("max_resolution")
    stored = limit.get("shorter_side") if isinstance(limit, dict) else None
    needed = shorter_side_decoded(image_size, augment=augment)
    if not isinstance(stored, int) or stored >= needed:
        return ()
    training = f"--image-size {image_size}" + (" with --augment" if augment else "")
    return (f"warning: {location} stores images at a shorter side of at most {stored} pixels, "
            f"fewer than the {needed} that {training} decodes to, so they are upsampled; "
            f"convert with --image-size {image_size} for the full detail",)


def hold_out(shards: Split, fraction: float, seed: int) -> tuple[Split, Split, str]:
    """(train, validation, how, in words) for shards that came without validation ones."""
    num_shards = len(shards.sources)
    whole = int(round(num_shards * fraction))
    if whole >= 1 and num_shards * fraction >= 1 and whole < num_shards:
        # Whole shards: validation reads only its own files. Chosen with the shared seed.
        order = np.random.default_rng(seed).permutation(num_shards)
        held, kept = np.sort(order[:whole]), np.sort(order[whole:])
        return (Split(shards.sources[kept], None, shards.counts[kept]),
                Split(shards.sources[held], None, shards.counts[held]),
                f"{whole} of {num_shards} shard(s) held out for validation "
                f"(--validation-fraction {fraction:g})")
    offsets = np.concatenate([[0], np.cumsum(shards.counts)[:-1]]).astype(np.int64)
    held_counts = held_out_counts(offsets, shards.counts, fraction)
    if held_counts.sum() == 0:
        return shards, Split(shards.sources[:0], None, shards.counts[:0]), \
            f"no validation ({shards.num_samples} records x {fraction:g} is under one)"
    return (Split(shards.sources, None, shards.counts - held_counts,
                  HeldOutRecords(fraction, "train", offsets, shards.counts)),
            Split(shards.sources, None, held_counts,
                  HeldOutRecords(fraction, "validation", offsets, shards.counts)),
            f"{int(held_counts.sum())} records held out for validation across the shards "
            f"(--validation-fraction {fraction:g}; too few shards to hold out whole ones)")


def check_sizes(paths: list[str], metadata: dict) -> None:
    """Refuse, in one line, shards whose size is not the one dataset.json recorded (``bytes``,
    written by the converter since 2026-11-29): a shard cut short by an interrupted copy would
    otherwise train on with its missing records counted as images that did not decode, and a
    longer one would be read only as far as its recorded count. One stat per shard. Shards
    without a recorded size (older conversions, shards from elsewhere) are not checked here."""
    import tensorflow as tf

    recorded = metadata.get("bytes")
    if not isinstance(recorded, dict):
        return
    wrong = []
    for path in paths:
        expected = recorded.get(os.path.basename(path))
        if isinstance(expected, int):
            size = tf.io.gfile.stat(path).length
            if size != expected:
                wrong.append(f"{path} is {size} bytes, not {expected}")
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        raise UserError(f"TFRecord shard {wrong[0]}{more} as {METADATA} records: cut short or "
                        "changed since it was written (an interrupted copy?); copy the shards "
                        "again, or convert the images again")


def count_records(path: str) -> int:
    import tensorflow as tf

    return sum(1 for _ in tf.data.TFRecordDataset(path))


def max_label(paths: list[str]) -> int:
    import tensorflow as tf

    dataset = tf.data.TFRecordDataset(paths).map(lambda record: parse_example(record)[1])
    return int(dataset.reduce(tf.constant(-1, tf.int64), tf.maximum))
