"""Input data: the embedded digits, synthetic images, an image folder, or TFRecord shards.

Every source becomes the same two ``tf.data`` pipelines, built in the order that makes
data-parallel training correct and cheap at any size:

    list samples -> split with a seed all ranks share -> this rank's share (every size-th)
    -> shuffle positions / encoded records -> decode/resize in parallel -> cache (memory, disk
    or off, sized against the node's memory) -> batch -> repeat -> prefetch

Sharding comes *before* decoding so that each rank only reads and decodes its own files, and
shuffling comes before decoding so the first step never waits for a buffer of decoded images.
Rank 0 lists the files (one ``scandir`` per class folder, no per-file open) and sends the other
ranks a compressed table of names (3.4 MB for ImageNet), from which each redoes the seeded split,
so a shared file system is scanned once, not once per rank, and every rank sees the same list.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from hvdtrain.datacache import (CacheChoice, choose_cache, default_disk_dir, free_bytes,
                                make_process_cache_dir, memory_budget, parse_cache_flag)
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
    return image_format_of_bytes(head)


def image_format_of_bytes(head: bytes) -> str | None:
    """'PNG', 'JPEG', 'GIF' or 'BMP' from a file's first bytes (more are fine); None otherwise."""
    for signature, name in _IMAGE_SIGNATURES.items():
        if head.startswith(signature):
            return name
    return None


@dataclass(frozen=True)
class Split:
    """One side of the train/validation split, before decoding: what each sample is read from."""

    sources: np.ndarray
    """Row indices into an in-memory array, file paths relative to ``Listing.root`` (bytes), or
    (TFRecords) shard paths."""
    labels: np.ndarray | None
    """Class per sample (None for TFRecords, where labels live inside the records)."""
    counts: np.ndarray | None = None
    """Records per shard file that belong to this split (TFRecords only)."""
    held_out: HeldOutRecords | None = None
    """Set when this split is a record-level part of TFRecord shards it shares with the other."""

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum()) if self.counts is not None else len(self.sources)


@dataclass(frozen=True)
class HeldOutRecords:
    """Validation records held out of TFRecord shards too few to hold out whole ones.

    Record ``i`` (counting through the shards in name order) is held out when
    ``floor((i + 1) * fraction) > floor(i * fraction)``: evenly spread, exactly ``fraction`` of
    them, and each shard's share computable from its first index and length alone (the sum
    telescopes), so counting needs no read.
    """

    fraction: float
    keep: str
    """'train' keeps the records not held out, 'validation' the ones held out."""
    offsets: np.ndarray
    """Index of each shard's first record in the whole sequence."""


def held_out_counts(offsets: np.ndarray, counts: np.ndarray, fraction: float) -> np.ndarray:
    """Records of each shard that HeldOutRecords holds out (same float64 arithmetic as the
    pipeline's per-record test)."""
    return (np.floor((offsets + counts) * fraction) - np.floor(offsets * fraction)).astype(np.int64)


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
    root: str | None = None
    """The image folder that ``sources`` of files are relative to."""
    split_fraction: float = 0.0
    split_seed: int = 0
    """How an image folder's files were split (the receivers redo it from the file table)."""

    def path(self, source) -> str:
        """A sample's file path (image folders), for messages and tools."""
        return os.path.join(self.root, source.decode() if isinstance(source, bytes) else source)

    def __getstate__(self) -> dict:
        # An image folder travels to the ranks as its sorted file table, compressed (3.4 MB for
        # ImageNet's 1.28 M names instead of ~175 MB of pickled paths); every rank redoes the
        # seeded split itself.
        state = dict(self.__dict__)
        if self.kind == "files":
            # Undo the seeded split: the table in listing order (class by class, names sorted).
            count = self.train.num_samples + self.validation.num_samples
            train, validation = split_indices(count, self.split_fraction, self.split_seed)
            files = np.empty(count, dtype=self.train.sources.dtype)
            labels = np.empty(count, dtype=np.int32)
            files[train], files[validation] = self.train.sources, self.validation.sources
            labels[train], labels[validation] = self.train.labels, self.validation.labels
            joined = b"\n".join(files.tolist())
            if joined.count(b"\n") == count - 1:  # no file name holds a newline
                state["train"] = state["validation"] = None
                # Labels run class by class in listing order: the table keeps a count per class.
                state["_table"] = (zlib.compress(joined, 1),
                                   np.bincount(labels, minlength=len(self.class_names)))
        return state

    def __setstate__(self, state: dict) -> None:
        table = state.pop("_table", None)
        if table is not None:
            compressed, per_class = table
            names = np.array(zlib.decompress(compressed).split(b"\n"))
            labels = np.repeat(np.arange(len(per_class), dtype=np.int64), per_class)
            train, validation = split_indices(len(names), state["split_fraction"],
                                              state["split_seed"])
            state["train"] = Split(names[train], labels[train])
            state["validation"] = Split(names[validation], labels[validation])
        for name, value in state.items():
            object.__setattr__(self, name, value)


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
                                 channels=config.channels or 3,
                                 check_images=config.check_images)
    if config.tfrecords:
        return list_tfrecords(config.tfrecords, image_size=config.image_size,
                              channels=config.channels,
                              validation_fraction=config.validation_fraction, seed=config.seed)
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


IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".gif", ".bmp"})
HEADER_CHECK_THREADS = 32
"""Parallel header reads for --check-images: on a shared file system each open is a round trip
to the metadata server, so many in flight hide the latency (threads: the work is I/O)."""


def _printable(path: str) -> str:
    """A path whose bytes are not all UTF-8, with those bytes shown as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _is_utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a surrogate escape: bytes that are not UTF-8
        return False
    return True


def list_image_folder(data_dir: str, *, image_size: int | None, validation_fraction: float,
                      seed: int, on_bad_image: str, channels: int = 3,
                      check_images: bool = False) -> Listing:
    """An image folder in the layout <data_dir>/<class name>/<image files>.

    One ``scandir`` per class folder and no per-file open: files with an image extension are
    trusted (one that does not decode is skipped and counted by the pipeline), files with any
    other extension get their header checked, and ``check_images`` checks every header.
    """
    started = time.monotonic()
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir}: no such directory")
    class_names = sorted(entry.name for entry in os.scandir(data_dir)
                         if entry.is_dir() and not entry.name.startswith("."))
    unnamed_classes = [name for name in class_names if not _is_utf8(name)]
    if unnamed_classes:
        # A class name is printed, and stored in dataset.json and config.json.
        raise UserError(f"class folder {_printable(unnamed_classes[0])} in {data_dir} is not a "
                        "valid UTF-8 name; rename it")
    if not class_names:
        raise UserError(f"--data-dir {data_dir} has no class sub-folders "
                        f"(expected {data_dir}/<class>/<image files>)")
    if len(class_names) == 1:
        raise UserError(f"--data-dir {data_dir} has only one class folder ('{class_names[0]}'); "
                        "classification needs at least 2")
    files_per_class = [sorted(entry.name for entry in os.scandir(os.path.join(data_dir, name))
                              if entry.is_file()) for name in class_names]
    # Names that are not UTF-8 (os.scandir gives them surrogate escapes) cannot go into the name
    # table, messages or JSON: skipped and counted like files that are not images.
    unnamed = [os.path.join(data_dir, class_name, name)
               for class_name, files in zip(class_names, files_per_class) for name in files
               if not _is_utf8(name)]
    unnamed_note = ""
    if unnamed:
        unnamed_note = (f"{len(unnamed)} file(s) in {data_dir} have names that are not valid "
                        f"UTF-8 (first: {_printable(unnamed[0])})")
        if on_bad_image == "fail":
            raise UserError(unnamed_note + "; rename them or pass --on-bad-image skip")
        files_per_class = [[name for name in files if _is_utf8(name)]
                           for files in files_per_class]
    suspects = [os.path.join(data_dir, class_name, name)
                for class_name, files in zip(class_names, files_per_class) for name in files
                if check_images or os.path.splitext(name)[1].lower() not in IMAGE_EXTENSIONS]
    bad = _not_images(suspects)
    rejected = set(bad)
    names, labels = [], []
    for label, (class_name, files) in enumerate(zip(class_names, files_per_class)):
        class_dir = os.path.join(data_dir, class_name)
        good = [name for name in files
                if os.path.join(class_dir, name) not in rejected] if rejected else files
        if not good:
            raise UserError(f"class folder {class_dir} has no PNG/JPEG/GIF/BMP images")
        prefix = class_name + "/"
        names += [(prefix + name).encode() for name in good]
        labels.append(np.full(len(good), label, dtype=np.int64))
    notes = ["skipped " + unnamed_note] if unnamed_note else []
    if bad:
        message = (f"{len(bad)} file(s) in {data_dir} are not PNG/JPEG/GIF/BMP images "
                   f"(first: {bad[0]})")
        if on_bad_image == "fail":
            raise UserError(message + "; remove them or pass --on-bad-image skip")
        notes.append("skipped " + message)
    names_array = np.array(names)
    labels_array = np.concatenate(labels)
    train, validation = split_indices(len(names), validation_fraction, seed)
    size = image_size or DEFAULT_FILE_IMAGE_SIZE
    seconds = time.monotonic() - started
    return Listing(
        kind="files",
        description=f"{data_dir}: {len(names)} images, {len(class_names)} classes, "
                    f"resized to {size}x{size} (listed in {seconds:.1f} s, "
                    f"{len(suspects)} header(s) checked)",
        class_names=tuple(class_names),
        image_shape=(size, size, channels),
        train=Split(names_array[train], labels_array[train]),
        validation=Split(names_array[validation], labels_array[validation]),
        notes=tuple(notes),
        root=data_dir,
        split_fraction=validation_fraction,
        split_seed=seed,
    )


def _not_images(paths: list[str]) -> list[str]:
    """The paths whose first bytes are no image format's (read in parallel)."""
    if len(paths) < 8:
        formats = [image_format(path) for path in paths]
    else:
        with concurrent.futures.ThreadPoolExecutor(HEADER_CHECK_THREADS) as pool:
            formats = list(pool.map(image_format, paths, chunksize=64))
    return [path for path, found in zip(paths, formats) if found is None]


def list_tfrecords(location: str, *, image_size: int | None, channels: int | None = None,
                   validation_fraction: float = 0.0, seed: int = 0) -> Listing:
    """TFRecord shards: a directory written by ``hvdtrain.tfrecords`` or a glob of shards.

    Without ``validation-*`` shards, ``validation_fraction`` of the data is held out: whole
    shards when that fraction of the shards is at least one, else records (``HeldOutRecords``).
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
    train = Split(np.array(train_files), None, train_counts)
    validation = Split(np.array(validation_files), None, validation_counts)
    if validation_files:
        held_out = f"{len(validation_files)} validation shard(s)"
    elif validation_fraction > 0:
        train, validation, held_out = hold_out_tfrecords(train, validation_fraction, seed)
    else:
        held_out = "no validation (--validation-fraction 0)"
    size = image_size or metadata.get("image_size") or DEFAULT_FILE_IMAGE_SIZE
    channels = channels or int(metadata.get("channels", 3))
    return Listing(
        kind="tfrecords",
        description=f"{location}: {train.num_samples} training records in "
                    f"{len(train.sources)} shard(s), {held_out}, {len(class_names)} classes, "
                    f"resized to {size}x{size}",
        class_names=class_names,
        image_shape=(int(size), int(size), channels),
        train=train,
        validation=validation,
    )


def hold_out_tfrecords(shards: Split, fraction: float, seed: int) -> tuple[Split, Split, str]:
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
                  HeldOutRecords(fraction, "train", offsets)),
            Split(shards.sources, None, held_counts, HeldOutRecords(fraction, "validation",
                                                                   offsets)),
            f"{int(held_counts.sum())} records held out for validation across the shards "
            f"(--validation-fraction {fraction:g}; too few shards to hold out whole ones)")


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
    cache: CacheChoice | None = None
    """Where decoded images are cached, and why."""
    pipeline_state: tuple = ()
    """TensorFlow variables the pipelines update (held here so they live as long as them)."""


SHUFFLE_BUFFER = 10_000
"""Decoded samples shuffled between epochs of in-memory data, and after a cache."""
RAW_RECORD_SHUFFLE = 2_048
"""Undecoded TFRecord records shuffled before decoding (file order is reshuffled every pass too):
a buffer of encoded bytes fills by reading, not decoding, so the first step does not wait for
thousands of decodes."""
POST_CACHE_SHUFFLE = 1_024
"""Decoded samples shuffled after a cache: the first pass is already in random order (shuffled
before decoding), later passes replay it from the cache and this buffer varies their batches."""
POSITION_RING = 1 << 16
"""Positions remembered for naming a sample that failed to decode; far more than the samples in
flight between the sequential numbering and the decode (the parallel map's buffer)."""


class DecodeFailures:
    """Samples of one split that this rank could not decode, counted as the pipeline meets them.

    A file can have an image's name and still fail to decode (a JPEG cut short, a text file
    called .png). Dropping it would leave this rank with fewer samples than the plan and its
    peers (a rank short of a validation batch then reports other metrics, and the ranks' metric
    allreduces no longer match: a hang). So the pipeline drops it with ``ignore_errors``, notices
    the gap in the numbering of the samples, counts it here, and puts a blank sample of weight 0
    in its place: every rank keeps exactly the planned number of samples, and the failure costs
    no gradient and no metric. The numbering comes after the shuffle, so each number's position
    in this rank's list is remembered (a ring of the latest ones) to name the sample.
    """

    def __init__(self, split_name: str, name_of: Callable[[int], str]):
        import tensorflow as tf

        self.split_name = split_name
        self.name_of = name_of
        """Position in this rank's list of the split -> what to call that sample in a message."""
        with tf.device("/cpu:0"):  # updated from inside tf.data, which runs on the host
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.last_position = tf.Variable(-1, dtype=tf.int64, trainable=False)
            self.positions = tf.Variable(tf.fill([POSITION_RING], tf.constant(-1, tf.int64)),
                                         trainable=False)
        self._reported = 0

    def take_new(self) -> tuple[int, str | None]:
        """(failures since the last call, a name of the latest one)."""
        total = int(self.count.numpy())
        new, self._reported = total - self._reported, total
        return new, self.name_of(int(self.last_position.numpy())) if new else None

    def remember(self, number, position):
        """tf.data step (sequential): sample ``number`` of this pass is ``position`` in the list."""
        return self.positions.scatter_nd_update([[number % POSITION_RING]], [position])

    def note(self, last_good, number):
        """tf.data step: record the samples numbered between two decoded ones as failures."""
        import tensorflow as tf

        missing = number - last_good - 1
        latest = self.positions[(number - 1) % POSITION_RING]
        return tf.group(self.count.assign_add(missing),
                        self.last_position.assign(tf.where(missing > 0, latest,
                                                           self.last_position)))


def shard_records(split: Split, world: World, *, seed: int, by_file: bool) -> tf.data.Dataset:
    """The records this rank owns, undecoded and in list order. Public so tests can check the
    sharding itself: ``(path, label)`` of files, ``(row, label)`` in memory, TFRecord records.

    In-memory and image-folder splits are already shuffled with the shared seed (split_indices),
    and each rank takes every size-th sample. TFRecord shards are listed in name order, so whole
    files are shuffled here with the shared seed before ``shard(size, rank)``.
    """
    import tensorflow as tf

    if split.labels is not None:
        return tf.data.Dataset.from_tensor_slices(_rank_share(split, world))
    if by_file:
        order = tfrecord_file_order(split, seed)
        files = tf.data.Dataset.from_tensor_slices(
            (split.sources[order], _first_record_indices(split)[order]))
        return files.shard(world.size, world.rank).interleave(
            lambda path, first: _records_of(split, path, first), cycle_length=4,
            num_parallel_calls=tf.data.AUTOTUNE)
    return _records_of(split, tf.constant(split.sources), tf.constant(0, tf.int64)).shard(
        world.size, world.rank)


def _rank_share(split: Split, world: World) -> tuple[np.ndarray, np.ndarray]:
    """(sources, labels) of this rank: every size-th sample from its rank on. Sliced before
    TensorFlow sees the list, so a rank holds its own share, not the whole list."""
    return split.sources[world.rank::world.size], split.labels[world.rank::world.size]


def _first_record_indices(split: Split) -> np.ndarray:
    if split.held_out is not None:
        return split.held_out.offsets
    return np.zeros(len(split.sources), dtype=np.int64)


def _records_of(split: Split, paths, first_index) -> tf.data.Dataset:
    """The records of TFRecord files that belong to ``split`` (all, unless it holds records out:
    then the record's index in the whole sequence decides, see HeldOutRecords)."""
    import tensorflow as tf

    records = tf.data.TFRecordDataset(paths)
    held_out = split.held_out
    if held_out is None:
        return records

    def belongs(index, record):
        position = tf.cast(index, tf.float64)
        held = tf.floor((position + 1) * held_out.fraction) > tf.floor(position * held_out.fraction)
        return held if held_out.keep == "validation" else tf.logical_not(held)

    return records.enumerate(start=first_index).filter(belongs).map(lambda index, record: record)


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


def decoded_bytes_per_rank(listing: Listing, world: World, validation_samples: int) -> int:
    """What caching this rank's training share and its validation samples holds, decoded."""
    height, width, channels = listing.image_shape
    return (_examples_for_rank(listing.train, world) + validation_samples) * height * width * channels


def choose_data_cache(listing: Listing, world: World, flag: str, *, budget_gb: float | None,
                      validation_samples: int) -> CacheChoice:
    """The cache this rank uses for ``listing`` (see hvdtrain.datacache)."""
    if listing.kind == "memory":
        return CacheChoice("off", "the embedded data is in memory already")
    mode, directory = parse_cache_flag(flag)
    disk_dir = directory or default_disk_dir()
    # Only auto needs the budget (it reads Slurm's variables, the cgroup files and /proc).
    budget, budget_source = memory_budget(budget_gb) if mode == "auto" else (0, "")
    return choose_cache(flag, bytes_per_rank=decoded_bytes_per_rank(listing, world,
                                                                    validation_samples),
                        local_size=world.local_size, memory_budget=budget,
                        budget_source=budget_source, disk_free=free_bytes(disk_dir),
                        disk_dir=disk_dir)


def build_pipelines(listing: Listing, world: World, *, batch_size: int,
                    validation_batch_size: int, validation_steps: int, seed: int,
                    cache: CacheChoice = CacheChoice("memory", "default"),
                    tfrecord_sharding: str = "file", on_bad_image: str = "skip",
                    threads: int | None = None) -> ImageDatasets:
    """``batch_size`` and ``validation_batch_size`` are what this process feeds per step: a
    worker's batch for a horovod rank, all of its replicas' batches under a tf.distribute
    strategy (Keras splits them).

    Training data is shuffled *before* decoding (positions in the file list, or encoded records),
    so the first step waits for one batch of decodes, not a decoded shuffle buffer, whatever the
    data set's size; after a cache, a small decoded buffer varies the replayed passes.
    """
    import tensorflow as tf

    by_file = tfrecord_sharding == "file"
    file_order = None
    if listing.kind == "tfrecords" and by_file:
        file_order = tfrecord_file_order(listing.train, seed)
        check_tfrecord_file_sharding(listing.train, world, file_order, batch_size)
    decode = _decoder(listing)
    failures, state = [], []
    cache_dir = _process_cache_dir(cache)

    def cached(dataset: tf.data.Dataset, split_name: str) -> tf.data.Dataset:
        if cache.kind == "memory":
            return dataset.cache()
        if cache.kind == "disk":
            return dataset.cache(os.path.join(cache_dir, split_name))
        return dataset

    def from_files(split: Split, *, shuffle: bool, limit: int | None, num_samples: int,
                   split_name: str) -> tf.data.Dataset:
        """Decoded ``(image, label, weight)`` of this rank's share of ``split``."""
        if listing.kind == "files":
            records = _file_records(listing, split, world, shuffle=shuffle,
                                    seed=seed + world.rank, state=state)
        else:
            raw = shard_records(split, world, seed=seed, by_file=by_file and split is listing.train)
            if shuffle:
                raw = raw.shuffle(min(max(num_samples, 1), RAW_RECORD_SHUFFLE),
                                  seed=seed + world.rank, reshuffle_each_iteration=True)
            records = raw.enumerate()  # positions name nothing better for records
        if limit is not None:
            # Exactly the same number of validation samples on every rank (see plan.py).
            records = records.take(limit)
            num_samples = min(num_samples, limit)
        counter = DecodeFailures(split_name, _sample_namer(listing, split, world,
                                                           by_file and split is listing.train))
        failures.append(counter)
        return cached(_decode_or_blank(records, decode, counter, num_samples,
                                       listing.image_shape), split_name)

    if listing.kind == "memory":
        train = (shard_records(listing.train, world, seed=seed, by_file=False)
                 .map(decode, num_parallel_calls=tf.data.AUTOTUNE))
        records_per_rank = _examples_for_rank(listing.train, world)
        train = train.shuffle(max(1, min(records_per_rank, SHUFFLE_BUFFER)), seed=seed + world.rank,
                              reshuffle_each_iteration=True)
    else:
        records_per_rank = (tfrecord_files_for_rank(listing.train, world, file_order)[1]
                            if file_order is not None
                            else _examples_for_rank(listing.train, world))
        train = from_files(listing.train, shuffle=True, limit=None, num_samples=records_per_rank,
                           split_name="training")
        if cache.kind != "off":
            train = train.shuffle(max(1, min(records_per_rank, POST_CACHE_SHUFFLE)),
                                  seed=seed + world.rank, reshuffle_each_iteration=True)
    train = (train.batch(batch_size, drop_remainder=True)
             .repeat()  # endless: Keras stops each epoch after steps_per_epoch (plan.py)
             .prefetch(tf.data.AUTOTUNE))

    validation = None
    if validation_steps:
        # Validation shards by example even for TFRecords: every rank must run the same number
        # of validation batches, and the validation set is small enough to read in full.
        limit = validation_steps * validation_batch_size
        if listing.kind == "memory":
            validation = (shard_records(listing.validation, world, seed=seed, by_file=False)
                          .take(limit).map(decode, num_parallel_calls=tf.data.AUTOTUNE))
        else:
            validation = from_files(listing.validation, shuffle=False, limit=limit,
                                    num_samples=_examples_for_rank(listing.validation, world),
                                    split_name="validation")
        validation = (validation.batch(validation_batch_size, drop_remainder=True)
                      .prefetch(tf.data.AUTOTUNE))
    options = tf.data.Options()
    if threads:
        # The input pipeline gets this rank's share of the cores, like the model does.
        options.threading.private_threadpool_size = max(2, threads)
    train = train.with_options(options)
    validation = validation.with_options(options) if validation is not None else None
    return ImageDatasets(train, validation, listing.description, image_shape=listing.image_shape,
                         class_names=listing.class_names, decode_failures=tuple(failures),
                         cache=cache, pipeline_state=tuple(state))


def _process_cache_dir(cache: CacheChoice) -> str | None:
    """This process's directory for a disk cache, removed when the process ends."""
    if cache.kind != "disk":
        return None
    try:
        directory = make_process_cache_dir(cache.directory or default_disk_dir())
    except OSError as error:
        raise UserError(f"--cache disk: cannot create a cache directory in "
                        f"{cache.directory}: {error.strerror or error}") from None
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _file_records(listing: Listing, split: Split, world: World, *, shuffle: bool, seed: int,
                  state: list) -> tf.data.Dataset:
    """``(position, (path, label))`` of this rank's files, in a new random order every pass
    when ``shuffle``: a permutation of positions (an int64 each), so it costs milliseconds, not a
    buffer of paths to fill."""
    import tensorflow as tf

    sources, labels = map(tf.constant, _rank_share(split, world))
    count = int(sources.shape[0])
    prefix = listing.root.rstrip("/") + "/"
    if shuffle:
        with tf.device("/cpu:0"):
            passes = tf.Variable(0, dtype=tf.int64, trainable=False)
        state.append(passes)

        def one_pass(_):
            # Stateless with (seed, pass): reproducible, and a new order on every pass.
            pass_seed = tf.stack([tf.constant(seed, tf.int64), passes.assign_add(1)])
            order = tf.random.experimental.stateless_shuffle(tf.range(count, dtype=tf.int64),
                                                             seed=pass_seed)
            return tf.data.Dataset.from_tensor_slices(order)

        positions = tf.data.Dataset.from_tensors(0).flat_map(one_pass)
    else:
        positions = tf.data.Dataset.range(count)
    return positions.map(lambda position: (position, (
        tf.strings.join([prefix, tf.gather(sources, position)]), tf.gather(labels, position))))


def _decode_or_blank(records: tf.data.Dataset, decode: Callable, failures: DecodeFailures,
                     num_samples: int, image_shape: tuple[int, int, int]) -> tf.data.Dataset:
    """Decoded ``(image, label, 1.0)`` of ``(position, record)``, with ``(blank, 0, 0.0)``
    wherever a sample did not decode. Always exactly ``num_samples`` elements (see
    ``DecodeFailures`` for why)."""
    import tensorflow as tf

    def number(count, element):
        position, record = element
        with tf.control_dependencies([failures.remember(count, position)]):
            return tf.identity(count), record

    decoded = (records.enumerate()
               .map(number)  # sequential: every number's position is stored before decoding
               .map(lambda count, record: (count, *decode(*_as_tuple(record))),
                    num_parallel_calls=tf.data.AUTOTUNE)  # keeps order (deterministic)
               .ignore_errors())
    blank = (tf.zeros(image_shape, tf.uint8), tf.constant(0, tf.int64))
    # A sentinel number past the end makes a gap after the last good sample visible too.
    end = tf.data.Dataset.from_tensors((tf.constant(num_samples, tf.int64), *blank))

    def count_gaps(last_good, element):
        count = element[0]
        with tf.control_dependencies([failures.note(last_good, count)]):
            return tf.identity(count), element

    samples = (decoded.concatenate(end)
               .scan(tf.constant(-1, tf.int64), count_gaps)
               .filter(lambda count, image, label: count < num_samples)
               .map(lambda count, image, label: (image, label, tf.constant(1.0))))
    blanks = tf.data.Dataset.from_tensors((*blank, tf.constant(0.0))).repeat(num_samples)
    return samples.concatenate(blanks).take(num_samples)


def _as_tuple(record) -> tuple:
    return record if isinstance(record, tuple) else (record,)


def _sample_namer(listing: Listing, split: Split, world: World,
                  by_file: bool) -> Callable[[int], str]:
    """Position in this rank's share of ``split`` -> a name for that sample in messages."""
    if listing.kind == "files":
        # Position k of this rank's share (_rank_share) is sample rank + k * size.
        return lambda position: listing.path(split.sources[world.rank + position * world.size])
    if by_file:
        return lambda position: "a record of this rank's TFRecord files"
    return lambda position: "a record of the TFRecord files"


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

