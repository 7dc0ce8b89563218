"""From a listing to this rank's training and validation ``tf.data`` pipelines.

    this rank's records (shares.py) -> a new order every pass (positions or encoded records)
    -> decode/resize in parallel -> store (memory, disk or off: cache.py, store.py) -> batch
    -> repeat -> prefetch

Once the store holds a rank's whole share, a pass is a new permutation of it read from the
store (store.py says why not tf.data's ``cache()``).

Shuffling comes before decoding so the first step never waits for a buffer of decoded images,
whatever the data's size. The pipeline asks the listing (listing.py) what to read and how to
decode it; it does not know which source that is.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

from hvdtrain.data.augment import (augmented, center_cropped, decode_random_crop, decoded_shape,
                                   pixel_decoder, seed_stream)
from hvdtrain.data.cache import CacheChoice, process_cache_dir
from hvdtrain.data.listing import Listing, Split, pass_order
from hvdtrain.data.store import SampleStore, stored_pass
from hvdtrain.runtime.base import World
from hvdtrain.task import Datasets

if TYPE_CHECKING:
    import tensorflow as tf

POSITION_RING = 1 << 16
"""Positions remembered for naming a sample that failed to decode; far more than the samples in
flight between the sequential numbering and the decode (the parallel map's buffer)."""


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
    validation_samples: int = 0
    """This rank's validation samples: its share of the split, each sample of which is in one
    rank's share (the last batch partial), weighing its validation metrics in the average."""
    pipeline_state: tuple = ()
    """TensorFlow variables the pipelines update (held here so they live as long as them)."""
    identity: dict = field(default_factory=dict)
    """The listing's split and label table (``Listing.identity``), for the run's fingerprint."""
    start: TrainingStart | None = None
    """Where the training stream starts (a resumed run sets it before ``fit``)."""


class TrainingStart:
    """The training stream's first pass and the batches of it already trained, as two variables
    the pipeline reads when an iterator starts: a run resumed from a checkpoint written inside an
    epoch sets them (``at_step``) and reads on from the next batch, in the pass's order.

    A rank's stream is its passes back to back, ``batches_per_pass`` each (its share of the
    samples over its batch, the rest of a pass dropped); the global step count (the optimizer's
    ``iterations``, the same on every rank) is the batches it consumed, so pass and batch follow
    from it on every rank alone.
    """

    def __init__(self, batches_per_pass: int, batch_size: int, exact: bool = True):
        import tensorflow as tf

        self.batches_per_pass, self.batch_size = batches_per_pass, batch_size
        self.exact = exact
        """Every pass comes in the same order however it is read (from the files or the store):
        a resume inside a pass then reads exactly the samples that pass had left."""
        with tf.device("/cpu:0"):  # read from inside tf.data, which runs on the host
            self.first_pass = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.skip_samples = tf.Variable(0, dtype=tf.int64, trainable=False)

    def at_step(self, steps_done: int) -> tuple[int, int]:
        """Start at the batch after ``steps_done`` batches of the stream; (pass, batch)."""
        where = divmod(steps_done, max(self.batches_per_pass, 1))
        self.first_pass.assign(where[0])
        self.skip_samples.assign(where[1] * self.batch_size)
        return where

    def iterator_at(self, stream: tf.data.Dataset, steps_done: int) -> Iterator:
        """An iterator of ``stream`` (one this start positions) after its first ``steps_done``
        batches, leaving where the next iterator starts as it was. The position is read when the
        iterator makes its first batch, so that batch is made before it is put back."""
        next_start = [variable.numpy() for variable in self.variables()]
        self.at_step(steps_done)
        try:
            iterator = iter(stream)
            return itertools.chain([next(iterator)], iterator)
        finally:
            for variable, value in zip(self.variables(), next_start):
                variable.assign(value)

    def stream(self, from_start: Callable) -> tf.data.Dataset:
        """``from_start(first_pass, skip_samples)``, the stream from where it starts, with both
        read when an iterator starts (inside a ``flat_map`` of one element; a dataset built
        outside a function holds the values they had when it was built)."""
        import tensorflow as tf

        return tf.data.Dataset.from_tensors(0).flat_map(
            lambda _: from_start(self.first_pass.read_value(), self.skip_samples.read_value()))

    def variables(self) -> tuple:
        return (self.first_pass, self.skip_samples)


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
            # A file that holds other records than its source said (a TFRecord shard cut
            # short): its missing records are no undecodable images, and ignore_errors, which
            # drops what fails to decode, also drops a read error. Set by ``count_file``.
            self.miscounted = tf.Variable("", dtype=tf.string, trainable=False)
        self._reported = 0

    def take_new(self) -> tuple[int, str | None]:
        """(failures since the last call, a name of the latest one)."""
        total = int(self.count.numpy())
        new, self._reported = total - self._reported, total
        return new, self.name_of(int(self.last_position.numpy())) if new else None

    def miscounted_file(self) -> str | None:
        """'<file> holds N records, not M' for the last file read whose count was wrong."""
        return self.miscounted.numpy().decode() or None

    def count_file(self, records: tf.data.Dataset, path, expected) -> tf.data.Dataset:
        """``records`` of the file ``path``, which should hold ``expected`` of them: when it
        ends with another count (read to its end, or to a read error, after which tf.data's
        record reader goes on to its next file), ``miscounted`` names it. One comparison a
        record; a file whose end is never reached (a training pass Keras stops at its steps)
        is not judged."""
        import tensorflow as tf

        ended = tf.data.Dataset.from_tensors((tf.constant(b""), tf.constant(True)))
        marked = records.map(lambda record: (record, tf.constant(False))).concatenate(ended)

        def judge(count):
            message = tf.strings.join([path, " holds ", tf.strings.as_string(count),
                                       " records, not ", tf.strings.as_string(expected)])
            with tf.control_dependencies([self.miscounted.assign(message)]):
                return tf.identity(count)

        def step(count, element):
            record, is_end = element
            count = tf.cond(is_end & tf.not_equal(count, expected), lambda: judge(count),
                            lambda: count)
            return count + 1, element

        return (marked.scan(tf.constant(0, tf.int64), step)
                .filter(lambda record, is_end: tf.logical_not(is_end))
                .map(lambda record, is_end: record))

    def remember(self, number, position):
        """tf.data step: sample ``number`` of this pass is ``position`` in the list."""
        return self.positions.scatter_nd_update([[number % POSITION_RING]], [position])

    def note(self, last_good, number):
        """tf.data step: record the samples numbered between two decoded ones (at least one) as
        failures."""
        import tensorflow as tf

        latest = tf.gather(self.positions, (number - 1) % POSITION_RING)
        return tf.group(self.count.assign_add(number - last_good - 1),
                        self.last_position.assign(latest))


def build_pipelines(listing: Listing, world: World, *, batch_size: int,
                    validation_batch_size: int, seed: int,
                    cache: CacheChoice = CacheChoice("memory", "default"),
                    tfrecord_sharding: str = "file", augment: bool = False,
                    threads: int | None = None, prefetch_to: str | None = None,
                    input_wait=None) -> ImageDatasets:
    """``batch_size`` and ``validation_batch_size`` are what this process feeds per step: a
    worker's batch for a horovod rank, all of its replicas' batches under a tf.distribute
    strategy (Keras splits them). ``validation_batch_size`` 0: no validation.

    Training data is shuffled *before* decoding (positions in the file list, or encoded records),
    so the first step waits for one batch of decodes, not a decoded shuffle buffer, whatever the
    data set's size; once stored, every pass is a new permutation of the store. ``augment``:
    random-resized crops and flips after the store (augment.py). ``prefetch_to``: the device
    training batches are prefetched to (a GPU rank's GPU), so that each batch's copy from host
    memory overlaps the step before it instead of starting it. ``input_wait``: an
    ``InputWait`` that sums how long the training batches kept their consumer waiting.
    """
    import tensorflow as tf

    if augment and listing.in_memory:
        raise ValueError("augmentation needs images read from files")
    # With augmentation, images are stored with a margin the crops choose from: the central
    # square, aspect ratio kept (augment.py).
    shape = decoded_shape(listing.image_shape, augment=augment)

    by_file = tfrecord_sharding == "file"  # only TFRecords can be shared out by file
    listing.check_sharding(world, batch_size, seed=seed, by_file=by_file)
    decode = listing.decoder(pixel_decoder(listing.image_shape, augment=augment))
    failures, stores = [], []
    cache_dir = process_cache_dir(cache)
    rank_seed = seed + world.rank

    def looked_up(records: tf.data.Dataset) -> tf.data.Dataset:
        """In-memory ``(position, record)`` -> ``(image, label)``: a row lookup, never failing."""
        return records.map(lambda position, record: decode(*_as_tuple(record)),
                           num_parallel_calls=tf.data.AUTOTUNE)

    def pass_maker(split: Split, *, shuffle: bool, split_name: str, by_file: bool,
                   crop: bool = False) -> tuple[Callable, int]:
        """(``one_pass(pass_index, skip)``: this rank's share of ``split`` in pass
        ``pass_index``'s order from its ``skip``-th sample on, decoded; the samples a whole pass
        holds). ``crop``: random-resized crops cut while decoding (no store). What lives as
        long as the pipeline (failure counters, stores) is made here, once; ``one_pass`` runs
        inside the ``flat_map`` over training passes, or once for the validation pass."""
        counter = None
        if not listing.in_memory:
            counter = DecodeFailures(split_name,
                                     listing.sample_namer(split, world, by_file=by_file))
            failures.append(counter)
        num_samples = listing.samples_for_rank(split, world, seed=seed, by_file=by_file)
        store = None
        if not listing.in_memory and cache.kind != "off":
            store = SampleStore(shape, os.path.join(cache_dir, split_name)
                                if cache.kind == "disk" else None)
            stores.append(store)

        def one_pass(pass_index, skip):
            records = listing.rank_records(split, world, shuffle=shuffle, seed=seed,
                                           by_file=by_file, pass_index=pass_index,
                                           failures=counter)
            # Positions skipped (a resumed pass), before anything is decoded.
            records = records.skip(skip)
            remaining = num_samples - skip
            decode_to, image_shape = decode, shape
            if crop:
                read = listing.reader()
                records = tf.data.Dataset.zip(
                    records, seed_stream(rank_seed, pass_index, skip)).map(
                    lambda element, seeds: (element[0], (element[1], seeds)))

                def decode_to(record, seeds):
                    encoded, label = read(*_as_tuple(record))
                    return decode_random_crop(encoded, seeds, listing.image_shape), label

                image_shape = listing.image_shape
            if listing.in_memory:
                return looked_up(records)
            if store is None:
                return _decode_or_blank(records, decode_to, counter, remaining, image_shape)
            # Only a whole pass may mark what it did not store as failed.
            from_source = _decode_or_blank(records, decode, counter, remaining, shape,
                                           store, whole_pass=num_samples,
                                           is_whole=tf.equal(skip, 0))
            order = listing.pass_positions(num_samples, shuffle=shuffle, seed=rank_seed,
                                           pass_index=pass_index).skip(skip)
            return stored_pass(from_source, store, num_samples, order)

        return one_pass, num_samples

    # Without a store every pass decodes: the crop is cut while decoding, which decodes less.
    crop_while_decoding = augment and cache.kind == "off"
    train_pass, train_samples = pass_maker(listing.train, shuffle=True,
                                           split_name="training", by_file=by_file,
                                           crop=crop_while_decoding)
    # A pass read from a store comes in pass_positions' order; a source that reads its files in
    # another (TFRecords) gives a resumed pass, read from the files, another order.
    start = TrainingStart(batches_per_pass=train_samples // batch_size, batch_size=batch_size,
                          exact=listing.random_access or not stores)

    def passes_from(first_pass, skip):
        """The stream as pass after pass, each made anew (a pass's failures are counted, and
        its store asked whether it is complete, when it starts)."""
        def train_batches(pass_index):
            pass_skip = tf.where(tf.equal(pass_index, first_pass), skip,
                                 tf.constant(0, tf.int64))
            samples = train_pass(pass_index, pass_skip)
            if augment and not crop_while_decoding:
                samples = augmented(samples, listing.image_shape,
                                    seeds=seed_stream(rank_seed, pass_index, pass_skip))
            return samples.batch(batch_size, drop_remainder=True)

        return tf.data.Dataset.range(first_pass, 2**62).flat_map(train_batches)

    def positions_from(first_pass, skip):
        """In-memory data as one stream of positions, each pass's order cut to its whole
        batches: no dataset made per pass (one costs milliseconds to start, every epoch). The
        order is rank_records' (pass_order with this rank's seed); ``skip``, whole batches of
        the first pass, is less than ``used``."""
        assert listing.random_access  # an array: any position at any time
        used = start.batches_per_pass * batch_size
        positions = (tf.data.Dataset.range(first_pass, 2**62)
                     .map(lambda pass_index: pass_order(train_samples, seed=rank_seed,
                                                        pass_index=pass_index)[:used])
                     .unbatch()
                     .skip(skip))
        return (looked_up(listing.records_at(listing.train, world, positions))
                .batch(batch_size, drop_remainder=True))

    # Endless: Keras stops each epoch after steps_per_epoch (plan.py). A pass's order is a
    # function of its index, not of a counter: every iterator (fit's, the batch-norm pass's)
    # reads the same passes, and a resumed run starts at the pass and batch it stopped in.
    train = (start.stream(positions_from if listing.in_memory else passes_from)
             .prefetch(tf.data.AUTOTUNE))

    validation, validation_samples = None, 0
    if validation_batch_size:
        validation_pass, validation_samples = pass_maker(listing.validation, shuffle=False,
                                                         split_name="validation", by_file=False)
        # One pass, the same every time (a stored pass asks its store anew, stored_pass).
        first = tf.constant(0, tf.int64)
        validation = validation_pass(first, first)
        if augment:
            validation = center_cropped(validation, listing.image_shape)
        # This rank's whole share, its last batch partial: every sample of the split once over
        # the ranks. A rank may run one batch more than another (validation runs no collective)
        # and the epoch's metrics weigh each rank by its samples (ValidationShare). The count
        # said to Keras: Keras 3 counts a dataset of unknown length by running out of it, and
        # warns on every rank that the "input ran out of data".
        validation = (validation.batch(validation_batch_size)
                      .apply(tf.data.experimental.assert_cardinality(
                          -(-validation_samples // validation_batch_size)))
                      .prefetch(tf.data.AUTOTUNE))
    options = tf.data.Options()
    if threads:
        # The input pipeline gets this rank's share of the cores, like the model does.
        options.threading.private_threadpool_size = max(2, threads)
    train = train.with_options(options)
    validation = validation.with_options(options) if validation is not None else None
    if input_wait is not None:
        # How long each step waits for its batch (training/profile.py); before the device copy.
        train = input_wait.timed(train)
    if prefetch_to:
        # Last, as tf.data requires. Training batches only: their dataset is endless and Keras
        # stops it by steps, while the copy loses the validation set's asserted length, which
        # Keras 3 reads (see above); a validation pass is short and off the training step.
        train = train.apply(tf.data.experimental.prefetch_to_device(prefetch_to))
    return ImageDatasets(train, validation, listing.description, image_shape=listing.image_shape,
                         class_names=listing.class_names, decode_failures=tuple(failures),
                         cache=cache, validation_samples=validation_samples,
                         pipeline_state=(*start.variables(), *stores),
                         identity=dict(listing.identity), start=start)


def _decode_or_blank(records: tf.data.Dataset, decode: Callable, failures: DecodeFailures,
                     num_samples, image_shape: tuple[int, int, int],
                     store: SampleStore | None = None, whole_pass: int | None = None,
                     is_whole=True) -> tf.data.Dataset:
    """Decoded ``(image, label, 1.0)`` of ``(position, record)``, with ``(blank, 0, 0.0)``
    wherever a sample did not decode. Always exactly ``num_samples`` elements (see
    ``DecodeFailures`` for why). With a ``store``, what decodes is stored, what the store holds
    already is read from it instead of decoded, and at the end of a whole pass (``whole_pass``
    samples; ``is_whole`` False for a pass resumed part-way) what did not decode is marked."""
    import tensorflow as tf

    def decode_one(count, element):
        position, record = element
        # Where sample ``count`` of the pass sits in the list, noted before it can fail.
        with tf.control_dependencies([failures.remember(count, position)]):
            record = tf.nest.map_structure(tf.identity, record)
        if store is None:
            return (count, *decode(*_as_tuple(record)))

        def decode_fresh():
            image, label = decode(*_as_tuple(record))
            return image, label, tf.constant(True)

        def from_store():
            return store.read(position), store.labels.lookup(position), tf.constant(False)

        image, label, fresh = tf.cond(store.holds(position), from_store, decode_fresh)
        # Shapes a lookup table cannot know, which Keras needs to build its metrics.
        return (count, position, tf.ensure_shape(image, image_shape),
                tf.ensure_shape(label, []), fresh)

    decoded = (records.enumerate()
               .map(decode_one, num_parallel_calls=tf.data.AUTOTUNE)  # keeps order
               .ignore_errors())
    if store is not None:
        decoded = store.storing(decoded)
    blank = (tf.zeros(image_shape, tf.uint8), tf.constant(0, tf.int64))
    # A sentinel number past the end makes a gap after the last good sample visible too.
    num_samples = tf.cast(num_samples, tf.int64)
    end = tf.data.Dataset.from_tensors((num_samples, *blank))

    def note_gap(last_good, count):
        with tf.control_dependencies([failures.note(last_good, count)]):
            return tf.identity(count)

    def mark_failures(count):
        with tf.control_dependencies([store.mark_failed_where_absent(whole_pass)]):
            return tf.identity(count)

    def count_gaps(last_good, element):
        count = element[0]
        # The variables are touched only where a sample failed: most steps cost a comparison.
        count = tf.cond(count > last_good + 1, lambda: note_gap(last_good, count),
                        lambda: count)
        if store is not None:
            # The sentinel: this pass was whole (it is read only when a sample failed, since
            # take() stops at num_samples). The store learns which positions failed from what
            # it holds, not from the ring, which another iterator may be writing at the time.
            count = tf.cond(tf.logical_and(count == num_samples, is_whole),
                            lambda: mark_failures(count), lambda: count)
        return count, element

    samples = (decoded.concatenate(end)
               .scan(tf.constant(-1, tf.int64), count_gaps)
               .filter(lambda count, image, label: count < num_samples)
               .map(lambda count, image, label: (image, label, tf.constant(1.0))))
    blanks = tf.data.Dataset.from_tensors((*blank, tf.constant(0.0))).repeat(num_samples)
    return samples.concatenate(blanks).take(num_samples)


def _as_tuple(record) -> tuple:
    return record if isinstance(record, tuple) else (record,)
