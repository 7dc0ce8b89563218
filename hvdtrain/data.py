"""Input data: the embedded digits, synthetic images, an image folder, or TFRecord shards.

Every source becomes the same two ``tf.data`` pipelines, built in the order that makes
data-parallel training correct and cheap:

    list samples -> shuffle the list with a seed all ranks share -> shard(size, rank)
    -> decode/resize in parallel -> cache -> per-epoch shuffle -> batch -> repeat -> prefetch

Sharding comes *before* decoding so that each rank only reads and decodes its own files. Listing
(and checking) the files is done by rank 0 and broadcast, so a thousand-file folder on a shared
file system is scanned once, not once per rank, and every rank sees the same list.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from hvdtrain.errors import UserError, first_line
from hvdtrain.runtime import World
from hvdtrain.task import Datasets

if TYPE_CHECKING:
    import tensorflow as tf

    from hvdtrain.config import ImageConfig
    from hvdtrain.runtime import Runtime

# File signatures of the formats tf.io.decode_image reads.
_IMAGE_SIGNATURES = {
    b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG", b"GIF87a": "GIF", b"GIF89a": "GIF",
    b"BM": "BMP",
}
DEFAULT_FILE_IMAGE_SIZE = 64
TFRECORD_METADATA = "dataset.json"


def image_format(path: str) -> str | None:
    """'PNG', 'JPEG', 'GIF' or 'BMP' from the file's first bytes; None for anything else."""
    try:
        with open(path, "rb") as file:
            head = file.read(8)
    except OSError:
        return None
    for signature, name in _IMAGE_SIGNATURES.items():
        if head.startswith(signature):
            return name
    return None


@dataclass(frozen=True)
class Split:
    """One side of the train/validation split, before decoding: what each sample is read from."""

    sources: np.ndarray
    """Row indices into an in-memory array, file paths, or (TFRecords) shard paths."""
    labels: np.ndarray | None
    """Class per sample (None for TFRecords, where labels live inside the records)."""
    counts: np.ndarray | None = None
    """Records per shard file (TFRecords only)."""

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum()) if self.counts is not None else len(self.sources)


@dataclass(frozen=True)
class Listing:
    """What rank 0 found, broadcast to every rank: picklable, no TensorFlow objects."""

    kind: str  # "memory", "files" or "tfrecords"
    description: str
    class_names: tuple[str, ...]
    image_shape: tuple[int, int, int]
    train: Split
    validation: Split
    notes: tuple[str, ...] = ()
    images: np.ndarray | None = None
    """The pixels of an in-memory set (each rank loads its own copy; never broadcast)."""


def split_indices(num_samples: int, validation_fraction: float, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic shuffled split: (train indices, validation indices), the same on every rank."""
    order = np.random.default_rng(seed).permutation(num_samples)
    num_validation = int(round(num_samples * validation_fraction))
    if validation_fraction > 0 and num_samples > 1:
        num_validation = max(1, min(num_validation, num_samples - 1))
    return order[num_validation:], order[:num_validation]


# --- listing the sources ------------------------------------------------------------------------
def list_data(config: ImageConfig) -> Listing:
    """Find the samples named by the config. Raises UserError for anything unusable."""
    if config.data_dir:
        return list_image_folder(config.data_dir, image_size=config.image_size,
                                 validation_fraction=config.validation_fraction,
                                 seed=config.seed, on_bad_image=config.on_bad_image,
                                 channels=config.channels or 3)
    if config.tfrecords:
        return list_tfrecords(config.tfrecords, image_size=config.image_size,
                              channels=config.channels)
    arrays = load_embedded(config.data, image_size=config.image_size,
                           synthetic_samples=config.synthetic_samples, seed=config.seed)
    return _memory_listing(arrays, config.validation_fraction, config.seed)


@dataclass(frozen=True)
class EmbeddedArrays:
    name: str
    images: np.ndarray  # (N, H, W, C) uint8
    labels: np.ndarray  # (N,) int64
    class_names: tuple[str, ...]


def load_embedded(name: str, *, image_size: int | None = None, synthetic_samples: int = 1797,
                  seed: int = 0) -> EmbeddedArrays:
    if name == "digits":
        # scikit-learn ships this set inside its wheel (load_digits reads a local file): real
        # handwritten digits with no download. 8x8 pixels, values 0..16.
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)[..., None]
        labels = digits.target.astype(np.int64)
        if image_size and image_size != images.shape[1]:
            images = _resize_uint8(images, image_size)
        return EmbeddedArrays("digits", images, labels, tuple(str(d) for d in range(10)))
    if name == "synthetic":
        size = image_size or 8
        rng = np.random.default_rng(seed)
        images = rng.integers(0, 256, size=(synthetic_samples, size, size, 1), dtype=np.uint8)
        labels = rng.integers(0, 10, size=synthetic_samples).astype(np.int64)
        return EmbeddedArrays("synthetic", images, labels, tuple(str(d) for d in range(10)))
    raise UserError(f"unknown embedded data set {name!r} (digits or synthetic)")


def _resize_uint8(images: np.ndarray, size: int) -> np.ndarray:
    import tensorflow as tf

    resized = tf.image.resize(images, [size, size])
    return tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8).numpy()


def _memory_listing(arrays: EmbeddedArrays, validation_fraction: float, seed: int) -> Listing:
    train, validation = split_indices(len(arrays.labels), validation_fraction, seed)
    return Listing(
        kind="memory",
        description=f"{arrays.name}: {len(arrays.labels)} images "
                    f"{'x'.join(map(str, arrays.images.shape[1:]))}, "
                    f"{len(arrays.class_names)} classes (embedded)",
        class_names=arrays.class_names,
        image_shape=tuple(int(d) for d in arrays.images.shape[1:]),
        train=Split(train, arrays.labels[train]),
        validation=Split(validation, arrays.labels[validation]),
        images=arrays.images,
    )


def list_image_folder(data_dir: str, *, image_size: int | None, validation_fraction: float,
                      seed: int, on_bad_image: str, channels: int = 3) -> Listing:
    """An image folder in the layout <data_dir>/<class name>/<image files>."""
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir}: no such directory")
    class_names = sorted(entry.name for entry in os.scandir(data_dir)
                         if entry.is_dir() and not entry.name.startswith("."))
    if not class_names:
        raise UserError(f"--data-dir {data_dir} has no class sub-folders "
                        f"(expected {data_dir}/<class>/<image files>)")
    if len(class_names) == 1:
        raise UserError(f"--data-dir {data_dir} has only one class folder ('{class_names[0]}'); "
                        "classification needs at least 2")
    paths, labels, bad = [], [], []
    for label, class_name in enumerate(class_names):
        class_dir = os.path.join(data_dir, class_name)
        files = sorted(entry.path for entry in os.scandir(class_dir) if entry.is_file())
        good = [path for path in files if image_format(path)]
        good_set = set(good)
        bad += [path for path in files if path not in good_set]
        if not good:
            raise UserError(f"class folder {class_dir} has no PNG/JPEG/GIF/BMP images")
        paths += good
        labels += [label] * len(good)
    notes = []
    if bad:
        message = (f"{len(bad)} file(s) in {data_dir} are not PNG/JPEG/GIF/BMP images "
                   f"(first: {bad[0]})")
        if on_bad_image == "fail":
            raise UserError(message + "; remove them or pass --on-bad-image skip")
        notes.append("skipped " + message)
    paths_array = np.array(paths)
    labels_array = np.array(labels, dtype=np.int64)
    train, validation = split_indices(len(paths), validation_fraction, seed)
    size = image_size or DEFAULT_FILE_IMAGE_SIZE
    return Listing(
        kind="files",
        description=f"{data_dir}: {len(paths)} images, {len(class_names)} classes, "
                    f"resized to {size}x{size}",
        class_names=tuple(class_names),
        image_shape=(size, size, channels),
        train=Split(paths_array[train], labels_array[train]),
        validation=Split(paths_array[validation], labels_array[validation]),
        notes=tuple(notes),
    )


def list_tfrecords(location: str, *, image_size: int | None,
                   channels: int | None = None) -> Listing:
    """TFRecord shards: a directory written by ``hvdtrain.tfrecords`` or a glob of shards.

    Read through tf.io.gfile, so ``gs://`` (and any file system TensorFlow knows) works as well
    as a local path.
    """
    import tensorflow as tf

    gfile = tf.io.gfile
    metadata = {}
    if gfile.isdir(location):
        metadata_path = os.path.join(location, TFRECORD_METADATA)
        if gfile.exists(metadata_path):
            with gfile.GFile(metadata_path) as file:
                metadata = json.load(file)
        train_files = sorted(gfile.glob(os.path.join(location, "train-*.tfrecord")))
        validation_files = sorted(gfile.glob(os.path.join(location, "validation-*.tfrecord")))
        if not train_files:  # a plain directory of shards: all but validation-* are training
            train_files = sorted(set(gfile.glob(os.path.join(location, "*.tfrecord")))
                                 - set(validation_files))
    else:
        train_files, validation_files = sorted(gfile.glob(location)), []
    if not train_files:
        raise UserError(f"--tfrecords {location}: no TFRecord files found")
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
    size = image_size or metadata.get("image_size") or DEFAULT_FILE_IMAGE_SIZE
    channels = channels or int(metadata.get("channels", 3))
    return Listing(
        kind="tfrecords",
        description=f"{location}: {len(train_files)} training shard(s) with "
                    f"{int(train_counts.sum())} records, {len(validation_files)} validation "
                    f"shard(s), {len(class_names)} classes, resized to {size}x{size}",
        class_names=class_names,
        image_shape=(int(size), int(size), channels),
        train=Split(np.array(train_files), None, train_counts),
        validation=Split(np.array(validation_files), None, validation_counts),
    )


def count_records(path: str) -> int:
    import tensorflow as tf

    return sum(1 for _ in tf.data.TFRecordDataset(path))


def max_label(paths: list[str]) -> int:
    import tensorflow as tf

    dataset = tf.data.TFRecordDataset(paths).map(lambda record: _parse_example(record)[1])
    return int(dataset.reduce(tf.constant(-1, tf.int64), tf.maximum))


def load_listing(config: ImageConfig, runtime: Runtime) -> Listing:
    """Rank 0 lists and checks the data; every rank receives the same result or the same error.

    Embedded data is deterministic and in memory, so every rank simply loads its own copy.
    """
    if not (config.data_dir or config.tfrecords):
        return list_data(config)
    return runtime.from_chief(lambda: _list_files(config))


def _list_files(config: ImageConfig) -> Listing:
    try:
        return list_data(config)
    except UserError:
        raise
    except Exception as error:  # unreadable files: a corrupt dataset.json or shard, ...
        if not _is_data_error(error):
            raise
        raise UserError(f"cannot read {config.data_dir or config.tfrecords}: "
                        f"{type(error).__name__}: {first_line(error)}") from None


def _is_data_error(error: Exception) -> bool:
    if isinstance(error, (OSError, ValueError)):  # JSONDecodeError is a ValueError
        return True
    import tensorflow as tf

    return isinstance(error, tf.errors.OpError)  # e.g. DataLossError from a truncated shard


# --- from a listing to tf.data pipelines ---------------------------------------------------------
@dataclass
class ImageDatasets(Datasets):
    """The per-rank training and validation datasets of image data, batched, ready for ``fit``.

    Batches are ``(images, labels)``, or ``(images, labels, weights)`` for data read from files,
    where a sample that did not decode is a blank image of weight 0 (see ``DecodeFailures``).
    """

    image_shape: tuple[int, int, int] = (0, 0, 0)
    """(height, width, channels) of every image."""
    class_names: tuple[str, ...] = ()
    decode_failures: tuple[DecodeFailures, ...] = ()
    """One counter per split read from files (none for in-memory data, which always decodes)."""


class DecodeFailures:
    """Samples of one split that this rank could not decode, counted as the pipeline meets them.

    A file can pass the header check while listing and still fail to decode (a JPEG cut short).
    Dropping it would leave this rank with fewer samples than the plan and its peers (a rank
    short of a validation batch then reports other metrics, and the ranks' metric allreduces no
    longer match: a hang). So the pipeline drops it with ``ignore_errors``, notices the gap in the
    sample indices, counts it here, and puts a blank sample of weight 0 in its place: every rank
    keeps exactly the planned number of samples, and the failure costs no gradient and no metric.
    """

    def __init__(self, split_name: str, name_of: Callable[[int], str]):
        import tensorflow as tf

        self.split_name = split_name
        self.name_of = name_of
        """Index in this rank's shard -> what to call that sample in a message."""
        with tf.device("/cpu:0"):  # updated from inside tf.data, which runs on the host
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.last_index = tf.Variable(-1, dtype=tf.int64, trainable=False)
        self._reported = 0

    def take_new(self) -> tuple[int, str | None]:
        """(failures since the last call, a name of the latest one)."""
        total = int(self.count.numpy())
        new, self._reported = total - self._reported, total
        return new, self.name_of(int(self.last_index.numpy())) if new else None

    def note(self, last_good, index):
        """tf.data step: record the indices between two decoded samples as failures."""
        import tensorflow as tf

        missing = index - last_good - 1
        return tf.group(self.count.assign_add(missing),
                        self.last_index.assign(tf.where(missing > 0, index - 1,
                                                        self.last_index)))


def shard_records(split: Split, world: World, *, seed: int, by_file: bool) -> tf.data.Dataset:
    """The records this rank owns, undecoded. Public so tests can check the sharding itself.

    In-memory and image-folder splits are already shuffled with the shared seed (split_indices).
    TFRecord shards are listed in name order, so they are shuffled here with the shared seed.
    """
    import tensorflow as tf

    if split.labels is not None:
        records = tf.data.Dataset.from_tensor_slices((split.sources, split.labels))
        return records.shard(world.size, world.rank)
    if by_file:
        files = tf.data.Dataset.from_tensor_slices(split.sources[tfrecord_file_order(split, seed)])
        return files.shard(world.size, world.rank).interleave(
            tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE)
    files = tf.data.Dataset.from_tensor_slices(split.sources)
    return tf.data.TFRecordDataset(files).shard(world.size, world.rank)


def tfrecord_file_order(split: Split, seed: int) -> np.ndarray:
    """The shard files shuffled with the seed all ranks share, before ``shard(size, rank)``.

    Plain numpy, so the ranks, the pre-flight check and the pipeline agree on it whatever
    TensorFlow's global seed is, and a check over every rank costs one shuffle, not one per rank.
    """
    return np.random.default_rng(seed).permutation(len(split.sources))


def tfrecord_files_for_rank(split: Split, world: World, order: np.ndarray
                            ) -> tuple[list[str], int]:
    """(files, records) that file-sharding gives this rank: what ``shard`` keeps of ``order``."""
    mine = order[world.rank::world.size]
    return [str(path) for path in split.sources[mine]], int(split.counts[mine].sum())


def build_pipelines(listing: Listing, world: World, *, batch_size: int,
                    validation_batch_size: int, validation_steps: int, seed: int, cache: bool,
                    tfrecord_sharding: str = "file", on_bad_image: str = "skip",
                    threads: int | None = None) -> ImageDatasets:
    """``batch_size`` and ``validation_batch_size`` are what this process feeds per step: a
    worker's batch for a horovod rank, all of its replicas' batches under a tf.distribute
    strategy (Keras splits them)."""
    import tensorflow as tf

    by_file = tfrecord_sharding == "file"
    file_order = None
    if listing.kind == "tfrecords" and by_file:
        file_order = tfrecord_file_order(listing.train, seed)
        check_tfrecord_file_sharding(listing.train, world, file_order, batch_size)
    decode = _decoder(listing)
    failures = []

    def prepare(split: Split, *, by_file: bool, limit: int | None,
                num_samples: int, split_name: str) -> tf.data.Dataset:
        records = shard_records(split, world, seed=seed, by_file=by_file)
        if limit is not None:
            # Exactly the same number of validation samples on every rank (see plan.py).
            records = records.take(limit)
            num_samples = min(num_samples, limit)
        if listing.kind == "memory":
            images = records.map(decode, num_parallel_calls=tf.data.AUTOTUNE)
        else:
            counter = DecodeFailures(split_name, _sample_namer(listing, split, world, by_file))
            failures.append(counter)
            images = _decode_or_blank(records, decode, counter, num_samples,
                                      listing.image_shape)
        return images.cache() if cache else images

    records_per_rank = (tfrecord_files_for_rank(listing.train, world, file_order)[1]
                        if file_order is not None else _examples_for_rank(listing.train, world))
    train = prepare(listing.train, by_file=by_file, limit=None, num_samples=records_per_rank,
                    split_name="training")
    train = (train.shuffle(max(1, min(records_per_rank, 10_000)), seed=seed + world.rank,
                           reshuffle_each_iteration=True)
             .batch(batch_size, drop_remainder=True)
             .repeat()  # endless: Keras stops each epoch after steps_per_epoch (plan.py)
             .prefetch(tf.data.AUTOTUNE))

    validation = None
    if validation_steps:
        # Validation shards by example even for TFRecords: every rank must run the same number
        # of validation batches, and the validation set is small enough to read in full.
        validation = (prepare(listing.validation, by_file=False,
                              limit=validation_steps * validation_batch_size,
                              num_samples=_examples_for_rank(listing.validation, world),
                              split_name="validation")
                      .batch(validation_batch_size, drop_remainder=True)
                      .prefetch(tf.data.AUTOTUNE))
    options = tf.data.Options()
    if threads:
        # The input pipeline gets this rank's share of the cores, like the model does.
        options.threading.private_threadpool_size = max(2, threads)
    train = train.with_options(options)
    validation = validation.with_options(options) if validation is not None else None
    return ImageDatasets(train, validation, listing.description, image_shape=listing.image_shape,
                         class_names=listing.class_names, decode_failures=tuple(failures))


def _decode_or_blank(records: tf.data.Dataset, decode: Callable, failures: DecodeFailures,
                     num_samples: int, image_shape: tuple[int, int, int]) -> tf.data.Dataset:
    """Decoded ``(image, label, 1.0)``, with ``(blank, 0, 0.0)`` wherever a sample did not decode.

    Always exactly ``num_samples`` elements (see ``DecodeFailures`` for why).
    """
    import tensorflow as tf

    decoded = (records.enumerate()
               .map(lambda index, record: (index, *decode(*_as_tuple(record))),
                    num_parallel_calls=tf.data.AUTOTUNE)  # keeps order (deterministic)
               .ignore_errors())
    blank = (tf.zeros(image_shape, tf.uint8), tf.constant(0, tf.int64))
    # A sentinel index past the end makes a gap after the last good sample visible too.
    end = tf.data.Dataset.from_tensors((tf.constant(num_samples, tf.int64), *blank))

    def count_gaps(last_good, element):
        index = element[0]
        with tf.control_dependencies([failures.note(last_good, index)]):
            return tf.identity(index), element

    samples = (decoded.concatenate(end)
               .scan(tf.constant(-1, tf.int64), count_gaps)
               .filter(lambda index, image, label: index < num_samples)
               .map(lambda index, image, label: (image, label, tf.constant(1.0))))
    blanks = tf.data.Dataset.from_tensors((*blank, tf.constant(0.0))).repeat(num_samples)
    return samples.concatenate(blanks).take(num_samples)


def _as_tuple(record) -> tuple:
    return record if isinstance(record, tuple) else (record,)


def _sample_namer(listing: Listing, split: Split, world: World,
                  by_file: bool) -> Callable[[int], str]:
    """Index in this rank's shard of ``split`` -> a name for that sample in messages."""
    if listing.kind == "files":
        # shard(size, rank) keeps every size-th sample from this rank's position on.
        return lambda index: str(split.sources[world.rank + index * world.size])
    if by_file:
        return lambda index: f"record {index} of this rank's TFRecord files"
    return lambda index: f"record {world.rank + index * world.size} of the TFRecord files"


def _examples_for_rank(split: Split, world: World) -> int:
    """How many samples ``shard(size, rank)`` of the whole sample list leaves this rank."""
    total = split.num_samples
    return total // world.size + (1 if world.rank < total % world.size else 0)


def check_tfrecord_file_sharding(split: Split, world: World, order: np.ndarray,
                                 batch: int) -> None:
    """Every rank must get at least one full batch from its files, or it would run dry."""
    if len(split.sources) < world.size:
        raise UserError(
            f"{world.size} ranks but only {len(split.sources)} training TFRecord file(s): with "
            "--tfrecord-sharding file every rank needs its own file; write more shards "
            "(python -m hvdtrain.tfrecords --shards N) or use --tfrecord-sharding example")
    for rank in range(world.size):
        peer = World(rank=rank, size=world.size)
        _, records = tfrecord_files_for_rank(split, peer, order)
        if records < batch:
            raise UserError(
                f"rank {rank} would get {records} record(s) from its TFRecord files, fewer than "
                f"one batch of {batch}; use --tfrecord-sharding example or evenly sized shards")


def _decoder(listing: Listing) -> Callable:
    import tensorflow as tf

    height, width, channels = listing.image_shape
    if listing.kind == "memory":
        images = tf.constant(listing.images)
        return lambda index, label: (tf.gather(images, index), label)

    def decode_bytes(encoded):
        image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
        image = tf.image.resize(image, [height, width])
        return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)

    if listing.kind == "files":
        return lambda path, label: (decode_bytes(tf.io.read_file(path)), label)
    return lambda record: (lambda image, label: (decode_bytes(image), label))(
        *_parse_example(record))


def _parse_example(record):
    import tensorflow as tf

    features = tf.io.parse_single_example(record, {
        "image": tf.io.FixedLenFeature([], tf.string),
        "label": tf.io.FixedLenFeature([], tf.int64),
    })
    return features["image"], features["label"]


# --- a job's own datasets ------------------------------------------------------------------------
def agreed_batches(runtime: Runtime, datasets: Datasets, steps_per_epoch: int | None
                   ) -> tuple[int, int]:
    """(training batches per epoch, validation batches) that every rank feeds; ``UserError`` on
    every rank when the ranks' pipelines disagree or cannot be counted.

    A collective. A rank with fewer batches would finish its epoch (or its validation) first and
    leave the others waiting in an allreduce forever, so unequal counts are refused before the
    first step. ``steps_per_epoch`` (the flag) replaces the training count: hvdtrain then repeats
    the training data and every rank takes exactly that many batches.
    """
    mine = (_cardinality(datasets.train),
            _cardinality(datasets.validation) if datasets.validation is not None else 0)
    everyone = runtime.allgather_object(mine)
    import tensorflow as tf

    infinite, unknown = int(tf.data.INFINITE_CARDINALITY), int(tf.data.UNKNOWN_CARDINALITY)
    train_counts, validation_counts = [c[0] for c in everyone], [c[1] for c in everyone]
    if steps_per_epoch is None:
        if infinite in train_counts:
            raise UserError("the training dataset repeats forever; pass --steps-per-epoch, or "
                            "return one epoch of batches (hvdtrain repeats it)")
        _require_equal("training", train_counts, unknown)
        if train_counts[0] == 0:
            raise UserError("the training dataset has no batches (fewer samples than one batch "
                            "per rank?)")
        steps_per_epoch = train_counts[0]
    if infinite in validation_counts:
        raise UserError("the validation dataset repeats forever; it must end (it runs in full "
                        "every epoch)")
    _require_equal("validation", validation_counts, unknown)
    return steps_per_epoch, validation_counts[0]


def _cardinality(dataset: tf.data.Dataset) -> int:
    return int(dataset.cardinality())


def _require_equal(split: str, counts: list[int], unknown: int) -> None:
    if unknown in counts:
        rank = counts.index(unknown)
        raise UserError(
            f"cannot count the {split} batches of rank {rank} (a filter or a generator hides the "
            "count); declare it with dataset.apply(tf.data.experimental.assert_cardinality(N))"
            + (" or pass --steps-per-epoch" if split == "training" else ""))
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
        raise UserError(
            f"the ranks' {split} datasets have different numbers of batches ({per_rank}); every "
            "rank must feed the same number (shard, then batch with drop_remainder=True and take() "
            "the smallest rank's count)"
            + (", or pass --steps-per-epoch" if split == "training" else ""))

