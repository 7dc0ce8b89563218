"""What a source found, and the few questions every source answers for the pipeline.

A ``Listing`` is made by rank 0 and sent to every rank (so it is picklable and holds no
TensorFlow objects). Each source is a subclass (``embedded``, ``folder``, ``records``) that
answers, for a split and a rank: which records it owns, in what order this pass, how a record
becomes ``(image, label)``, and what to call a sample in a message. ``pipeline`` asks those
questions and never needs to know which source it reads.
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, ClassVar

import numpy as np

from hvdtrain.data.shares import rank_share, samples_for_rank
from hvdtrain.runtime.base import World

if TYPE_CHECKING:
    import tensorflow as tf

    from hvdtrain.data.pipeline import DecodeFailures

DEFAULT_FILE_IMAGE_SIZE = 64


@dataclass(frozen=True)
class Split:
    """One side of the train/validation split, before decoding: what each sample is read from."""

    sources: np.ndarray
    """Row indices into an in-memory array, file paths relative to the folder (bytes), or
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
    file_counts: np.ndarray
    """Records each shard holds, held out or not."""


def split_identity(kind: str, fraction: float, seed: int) -> str:
    """How a listing split its samples, as the run directory's fingerprint records it: the same
    words for an image folder and the TFRecords the converter made of it with the same split.
    ``kind`` "files" is ``held_out_by_name``'s split; "files by position" the one before it
    (``split_indices`` over the sorted names), which TFRecords converted then still hold."""
    if fraction <= 0:
        return "no validation"
    if kind == "files":
        return f"{fraction:g} of the files held out for validation by their names, seed {seed}"
    if kind == "files by position":
        return f"{fraction:g} of the files held out for validation, seed {seed}"
    return f"{fraction:g} of the {kind} held out for validation, seed {seed}"


#: Files of each class whose size goes into the (file, label) table's digest: two class folders
#: swapped (the same names, other images) change it, for a few stats per class.
SIZED_PER_CLASS = 8


def label_table_digest(names, labels, size_of: Callable[[str], int] | None = None,
                       sizes: dict[str, int] | None = None) -> str:
    """sha256 of the (relative name, label) table, sorted: which file has which label, with the
    size of the first ``SIZED_PER_CLASS`` files of each class (``size_of(name)``, also put into
    ``sizes``). The same for an image folder and for the TFRecords the converter made of it (it
    records this in dataset.json), whatever the split; changed by a file added, removed,
    renamed or relabelled, and by class folders swapped."""
    # "name<TAB>label" strings: sorting them is ~3x faster than sorting (name, label) tuples.
    rows = sorted(f"{name.decode() if isinstance(name, bytes) else name}\t{label}"
                  for name, label in zip(names, labels))
    if size_of is not None:
        sized: dict[str, int] = {}
        for index, row in enumerate(rows):
            name, label = row.rsplit("\t", 1)
            if sized.get(label, 0) < SIZED_PER_CLASS:
                sized[label] = sized.get(label, 0) + 1
                size = size_of(name)
                rows[index] = f"{row}\t{size}"
                if sizes is not None:
                    sizes[name] = size
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def name_hashes(names) -> np.ndarray:
    """A 64-bit hash of each relative file name (bytes), the same in every process and
    version: what a file's side of the split and its row in the FileTable come from."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")
                        for name in names), dtype=np.uint64, count=len(names))


def _mixed(values: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64's finalizer of ``values + salt``: uniform 64-bit outputs, vectorized."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(salt % 2**64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def held_out_by_name(hashes: np.ndarray, validation_fraction: float, seed: int) -> np.ndarray:
    """Which files are held out for validation, by their names' hashes: a file is when its
    name's hash, mixed with the seed, falls in the lowest ``validation_fraction`` of the range.
    So each file's side depends on its name alone: a file removed (one that did not decode) or
    added moves no other file across the split, and a resume never validates on samples it
    trained on. The share held out is ``validation_fraction`` on average (not exactly: with
    1000 files and 0.2, 200 +- 13); at least one file on each side."""
    keys = _mixed(hashes, seed)
    held = keys.astype(np.float64) < validation_fraction * 2.0**64
    if validation_fraction > 0 and len(keys) > 1:
        if not held.any():
            held[np.argmin(keys)] = True
        elif held.all():
            held[np.argmax(keys)] = False
    return held


def split_by_mask(held_out: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices) of the files ``held_out`` marks, each side in an
    order shuffled with the seed (ranks take every size-th file of it, so each gets every
    class, and a validation set cut short loses files at random, not the last class)."""
    order = np.random.default_rng(seed).permutation(len(held_out))
    held = held_out[order]
    return order[~held], order[held]


@dataclass(frozen=True, eq=False)
class FileTable:
    """Which files a folder listing holds and their labels, compactly (8 bytes a file), for
    the run directory: on a resume it tells files removed (one that did not decode, deleted as
    the epoch line invites) from any other change of the (file, label) table."""

    rows: np.ndarray
    """Sorted uint64, one per file: its name's hash mixed with its label."""
    sized: dict[str, int]
    """Sizes of the files ``label_table_digest`` weighs (two class folders swapped)."""

    @classmethod
    def of(cls, hashes: np.ndarray, labels: np.ndarray, sized: dict[str, int]) -> FileTable:
        return cls(np.sort(_mixed(hashes ^ labels.astype(np.uint64), 0)), dict(sized))

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        np.savez(buffer, rows=self.rows, sized=np.array(json.dumps(self.sized)))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> FileTable:
        with np.load(io.BytesIO(data), allow_pickle=False) as stored:
            return cls(stored["rows"], json.loads(str(stored["sized"])))

    def files_removed_since(self, recorded: FileTable) -> int | None:
        """How many of ``recorded``'s files are gone, when that is the only change (every file
        here was there with the same label, and the weighed files both have are the same
        size); None for any other change."""
        if (len(self.rows) > len(recorded.rows)
                or not np.isin(self.rows, recorded.rows, assume_unique=False).all()
                or any(recorded.sized[name] != size for name, size in self.sized.items()
                       if name in recorded.sized)):
            return None
        return len(recorded.rows) - len(self.rows)


def held_out_counts(offsets: np.ndarray, counts: np.ndarray, fraction: float) -> np.ndarray:
    """Records of each shard that HeldOutRecords holds out (same float64 arithmetic as the
    pipeline's per-record test)."""
    return (np.floor((offsets + counts) * fraction) - np.floor(offsets * fraction)).astype(np.int64)


@dataclass(frozen=True)
class Listing:
    """The samples of one source, split into training and validation."""

    description: str
    class_names: tuple[str, ...]
    image_shape: tuple[int, int, int]
    train: Split
    validation: Split
    notes: tuple[str, ...] = ()
    identity: dict = field(default_factory=dict)
    """What the samples are beyond their count, for the run directory's fingerprint: how they
    were split ("split", ``split_identity``) and which file has which label ("labels",
    ``label_table_digest``), where the source can tell; an image folder adds its "files"
    (``FileTable``)."""

    in_memory: ClassVar[str | None] = None
    """Why this source needs no cache and never fails to decode (its pixels are in memory), or
    None for a source read from files."""

    def shard_records(self, split: Split, world: World, *, seed: int,
                      by_file: bool = False) -> tf.data.Dataset:
        """The records of ``split`` this rank owns, undecoded and in list order: what the rank
        reads. ``by_file``: TFRecord shards shared out as whole files, not record by record.

        Here, for a split that lists its samples with their labels: ``(source, label)`` of every
        size-th sample (the split is already shuffled with the shared seed, split_indices)."""
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((rank_share(split.sources, world),
                                                   rank_share(split.labels, world)))

    def rank_records(self, split: Split, world: World, *, shuffle: bool, seed: int,
                     by_file: bool, pass_index,
                     failures: DecodeFailures | None = None) -> tf.data.Dataset:
        """``(position, record)`` of this rank's records of ``split`` for pass ``pass_index`` (an
        int64 tensor: a training pass's, inside the pipeline's ``flat_map`` over passes, or the
        validation pass's 0), in that pass's
        order when ``shuffle``: where ``random_access``, ``pass_positions``' order, so a pass
        read from a store of decoded samples is the same pass. ``position`` says which sample
        it is for ``sample_namer`` and the store. A source that knows how many records each
        file holds checks them with ``failures.count_file``.

        Here, for a source with ``random_access``: its ``records_at`` the pass's positions."""
        count = self.samples_for_rank(split, world, seed=seed, by_file=by_file)
        return self.records_at(split, world, self.pass_positions(
            count, shuffle=shuffle, seed=seed + world.rank, pass_index=pass_index))

    def records_at(self, split: Split, world: World, positions: tf.data.Dataset
                   ) -> tf.data.Dataset:
        """``(position, record)`` for each of ``positions`` in this rank's share of ``split``:
        a source with ``random_access`` reads any sample in any order."""
        raise NotImplementedError(f"{type(self).__name__} has no random access: it gives "
                                  "its records by rank_records alone")

    random_access: ClassVar[bool] = True
    """``records_at`` reads any pass in ``pass_positions``' order (a file list, an array). Not
    TFRecords, read in file order and shuffled in blocks: there a pass read from the store is
    a whole permutation, another order than the files', and a resume inside an epoch re-runs it
    (``TrainingStart.exact``)."""

    def pass_positions(self, count: int, *, shuffle: bool, seed: int, pass_index
                       ) -> tf.data.Dataset:
        """The positions ``0 .. count-1`` in the order of pass ``pass_index`` (see
        ``pass_order``): the order of a pass read from the store."""
        import tensorflow as tf

        if not shuffle:
            return tf.data.Dataset.range(count)
        return tf.data.Dataset.from_tensor_slices(pass_order(count, seed=seed,
                                                             pass_index=pass_index))

    def reader(self) -> Callable:
        """``record -> (encoded image bytes, int64 label)``, for a source read from files."""
        raise NotImplementedError(f"{type(self).__name__} holds no encoded images")

    def decoder(self, to_pixels: Callable) -> Callable:
        """``record -> (uint8 image, int64 label)``, for ``Dataset.map``: its encoded image made
        pixels by ``to_pixels`` (``augment.pixel_decoder``)."""
        read = self.reader()

        def decode(*record):
            encoded, label = read(*record)
            return to_pixels(encoded), label

        return decode

    def sample_namer(self, split: Split, world: World, *, by_file: bool
                     ) -> Callable[[int], str]:
        """Position (from ``rank_records``) -> what to call that sample in a message."""
        return lambda position: f"sample {position} of this rank's share"

    def samples_for_rank(self, split: Split, world: World, *, seed: int, by_file: bool) -> int:
        """How many records ``rank_records`` gives this rank each pass."""
        return samples_for_rank(split.num_samples, world)

    def check_sharding(self, world: World, batch_size: int, *, seed: int, by_file: bool) -> None:
        """Raise UserError when some rank could not fill one training batch from its share."""


def split_indices(num_samples: int, validation_fraction: float, seed: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic shuffled split: (train indices, validation indices), the same on every rank."""
    order = np.random.default_rng(seed).permutation(num_samples)
    num_validation = int(round(num_samples * validation_fraction))
    if validation_fraction > 0 and num_samples > 1:
        num_validation = max(1, min(num_validation, num_samples - 1))
    return order[num_validation:], order[:num_validation]


def pass_order(count: int, *, seed: int, pass_index):
    """The positions ``0 .. count-1`` in the random permutation of pass ``pass_index`` (an
    int64 tensor), as a tensor.

    A permutation of int64 positions costs milliseconds, not a buffer of records to fill, so the
    first step never waits for it whatever the data's size; and unlike a shuffle buffer it is a
    fresh, complete order every pass. Stateless with (seed, pass): a pass is the same in every
    process and every iterator, so a resumed run reads the pass it stopped in, in its order.
    """
    import tensorflow as tf

    # pass + 1: the seeds of the first passes stay those a pass counter gave before (its +1).
    pass_seed = tf.stack([tf.constant(seed, tf.int64), tf.cast(pass_index, tf.int64) + 1])
    return tf.random.experimental.stateless_shuffle(tf.range(count, dtype=tf.int64),
                                                    seed=pass_seed)
