"""`hvdtrain predict --run-dir RUN --output PATH (--data-dir DIR | --files LIST | --tfrecords
SHARDS)`: a run's model over new inputs, one row per input in their order, on any number of
ranks.

Launched like a job (``horovodrun -np 8 python -m hvdtrain.predict ...``, the launcher, an sbatch
template's program) or as one process. How it goes:

* rank 0 lists the inputs (``inputs.py``, ``records.py``: an image folder at any depth, a list of
  files, TFRecord shards) and cuts them into parts of ``--part-size``; every rank gets the
  listing;
* each rank predicts the parts not yet finished, every size-th one, reading a part at a time
  (memory stays flat whatever the inputs' number), and writes each into ``OUTPUT.parts``
  whole (``parts.py``);
* rank 0 merges the parts in order into ``--output`` (CSV, JSON lines or Parquet by its suffix,
  ``formats.py``), renamed into place whole, and removes the parts.

A row holds the input (its path, the line of the list, or ``SHARD:N``), the top-k classes and
their probabilities for a classifier (``--raw``: the model's outputs, for a model of one's own),
and ``error``: why an input gave no image (a file that does not decode is a row that says so,
never a crash; an input the dataset drops is read again alone, so a corrupt record costs no other
record of its shard its prediction). Images are decoded as the run's validation decodes them. A
run stopped part-way resumes from its finished parts when the same command runs again, on any
number of ranks.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Iterator, Sequence

import hvdtrain
from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import UserError, as_one_line, leave, reported
from hvdtrain.flags import OneLineParser
from hvdtrain.rundir import COPY_IT_DOWN, COPY_IT_UP, MODEL_FILE, require_file_system_path
from hvdtrain.runmodel import (check_model_flags, check_writable, few_names, recorded_image_shape,
                               require_model_file, run_config, scored_model)

PROGRAM = "hvdtrain.predict"
DEFAULT_PART_SIZE = 10_000
DEFAULT_TOP_K = 5


@dataclasses.dataclass(frozen=True)
class Request:
    run_dir: str
    checkpoint: str | None
    """None: model.keras; 'latest' or a checkpoint's number."""
    source: tuple[str, str]
    """(kind, where): ('data_dir', DIR), ('files', LIST) or ('tfrecords', SHARDS)."""
    output: str
    top_k: int
    raw: bool
    batch_size: int | None
    part_size: int
    overwrite: bool
    progress_seconds: float


def main(argv: Sequence[str] | None = None) -> None:
    with reported(error_name(PROGRAM)):
        status = run(parse(argv))
    leave(status)


def parse(argv: Sequence[str] | None) -> Request:
    from hvdtrain.predict.formats import format_of

    parser = OneLineParser(
        prog=usage_name(PROGRAM),
        description="Predict with a run directory's model over an image folder (at any depth), "
                    "a list of files or TFRecord shards, on any number of ranks: one row per "
                    "input, in input order, to CSV, JSON lines or Parquet. "
                    "docs/after-training.md.")
    parser.add_argument("--run-dir", required=True, help="the run directory of the model")
    parser.add_argument("--output", required=True,
                        help="the file to write: .csv, .jsonl or .parquet (its parts are kept "
                             "in OUTPUT.parts until it is whole)")
    parser.add_argument("--data-dir", help="an image folder: every PNG/JPEG/GIF/BMP file in it "
                                           "at any depth, in the order of their paths")
    parser.add_argument("--files", help="a text file naming one image file a line, in that "
                                        "order (relative paths: from the list's folder)")
    parser.add_argument("--tfrecords", help="TFRecord shards: a folder of *.tfrecord (as "
                                            "`hvdtrain convert` writes) or a glob")
    parser.add_argument("--checkpoint", metavar="latest|N",
                        help="predict with this checkpoint's weights (its number, or the "
                             "newest) instead of the run's model.keras (classifier runs)")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                        help="classes per row, the most probable first (at most the model's "
                             "classes; default %(default)s)")
    parser.add_argument("--raw", action="store_true",
                        help="write the model's outputs as they are (a list per row) instead "
                             "of classes: for a model of one's own")
    parser.add_argument("--batch-size", type=int,
                        help="inputs per rank per batch (default: the run's batch per worker)")
    parser.add_argument("--part-size", type=int, default=DEFAULT_PART_SIZE,
                        help="inputs per part: what a stopped run loses at most per rank, and "
                             "what a rank holds at once (default %(default)s)")
    parser.add_argument("--progress-seconds", type=float, default=30.0,
                        help="seconds between rank 0's progress lines (default %(default)s; 0: "
                             "none)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace --output when it exists (once the new one is whole)")
    parser.add_argument("--keras", choices=("2", "3"), default=hvdtrain.KERAS,
                        help="the Keras the run trained with (it says so in one line otherwise)")
    args = parser.parse_args(argv)
    check_model_flags(args.keras, args.checkpoint, PROGRAM)
    given = [(kind, value) for kind, value in (("data_dir", args.data_dir),
                                               ("files", args.files),
                                               ("tfrecords", args.tfrecords)) if value]
    if len(given) != 1:
        raise UserError("name the inputs once: --data-dir, --files or --tfrecords")
    for flag, path, remedy in (("--run-dir", args.run_dir, COPY_IT_DOWN),
                               (f"--{given[0][0].replace('_', '-')}", given[0][1], COPY_IT_DOWN),
                               ("--output", args.output, COPY_IT_UP)):
        require_file_system_path(flag, path, remedy)
    for flag, value in (("--top-k", args.top_k), ("--part-size", args.part_size),
                        ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.progress_seconds < 0:
        raise UserError(f"--progress-seconds must be >= 0, got {args.progress_seconds}")
    format_of(args.output)
    return Request(args.run_dir, args.checkpoint, given[0], os.path.abspath(args.output),
                   args.top_k, args.raw, args.batch_size, args.part_size, args.overwrite,
                   args.progress_seconds)


def run(request: Request) -> int:
    """Predict as ``request`` asks, on every rank; rank 0 writes the output and prints."""
    from hvdtrain.cnn import PROGRAM as CLASSIFIER, ClassifierConfig
    from hvdtrain.export import read_run_config

    recorded = read_run_config(request.run_dir)
    is_classifier = recorded.get("program") == CLASSIFIER
    if not is_classifier and not request.raw:
        raise UserError(f"{request.run_dir} is a run of {recorded.get('program')}, not of the "
                        "classifier: pass --raw to write its model's outputs")
    if request.checkpoint is not None and not is_classifier:
        raise UserError("--checkpoint rebuilds the classifier's network; for a run of "
                        f"{recorded.get('program')}, predict with its {MODEL_FILE}")
    require_model_file(request.run_dir, request.checkpoint, can_load_checkpoint=is_classifier)
    config = run_config(request.run_dir, recorded, ClassifierConfig) if is_classifier else None
    from hvdtrain.runtime import make_runtime  # TensorFlow: after the arguments and the run

    threads = recorded.get("config", {}).get("threads_per_worker")
    runtime = make_runtime("auto", threads_per_worker=threads)
    return Prediction(request, recorded, config, runtime).run()


class Prediction:
    def __init__(self, request: Request, recorded: dict, config, runtime):
        self.request, self.recorded, self.config, self.runtime = request, recorded, config, runtime

    def run(self) -> int:
        from hvdtrain.predict.parts import Parts

        started = time.monotonic()
        request, runtime = self.request, self.runtime
        # Rank 0 lists (a shared file system is read once) and the others receive the list.
        inputs = runtime.from_chief(self.list_inputs)
        model, model_source = self.model()
        image_shape = self.image_shape(model)
        classes = None if request.raw else self.class_names(model)
        converted_from = getattr(inputs, "class_names", None)
        if classes is not None and converted_from and tuple(converted_from) != tuple(classes):
            raise UserError(f"the shards' classes ({few_names(converted_from)}, as their "
                            f"dataset.json says) are not the model's ({few_names(classes)}): "
                            "predict shards converted from folders of the model's classes, or "
                            "pass --raw")
        parts = Parts(request.output, len(inputs), request.part_size)

        def identity() -> dict:
            """What the parts are of: a resume merges only parts of the same prediction."""
            return {"inputs": inputs.digest(), "count": len(inputs),
                    "model": _identity_of(model_source), "part_size": request.part_size,
                    "outputs": "raw" if request.raw else f"top {self.top_k(classes)}",
                    "image_shape": list(image_shape)}

        # Rank 0 checks where it writes and finds what a stopped run finished before anyone
        # predicts: a refusal reaches every rank.
        finished = set(runtime.from_chief(lambda: self.prepare(parts, identity())))
        todo = [part for part in range(parts.num_parts) if part not in finished]
        runtime.print0(self.banner(inputs, parts, len(finished), model_source))
        # Every size-th part left, and no collective from here on: a rank with a part more
        # than another (or none) finishes later (or at once), and rank 0 merges once it finds
        # every part (Parts.wait_for_all says why not a collective).
        mine = todo[runtime.world.rank::runtime.world.size]
        predictor = Predictor(model, image_shape, self.config, classes, self.top_k(classes),
                              self.batch_size(), runtime.devices.threads)
        def inputs_of(chosen: list[int]) -> int:
            return sum(parts.bounds(part)[1] - parts.bounds(part)[0] for part in chosen)

        left = inputs_of(todo)
        progress = Progress(runtime, left, inputs_of(mine), request.progress_seconds)
        stream = predictor.stream(inputs, [parts.bounds(part) for part in mine], progress)
        for part in mine:
            parts.write(part, _rows_of_one_range(stream))
        if not runtime.world.is_chief:
            return 0
        parts.wait_for_all(lambda line: print(f"{error_name(PROGRAM)}: {line}", flush=True),
                           request.progress_seconds)
        written, failed = self.merge(parts, classes)
        seconds = time.monotonic() - started
        unread = f", {failed} could not be read (their rows say why)" if failed else ""
        print(f"{error_name(PROGRAM)}: wrote {request.output}: {written} rows{unread}; {left} "
              f"predicted on {runtime.world.size} rank(s) in {seconds:.1f} s", flush=True)
        return 0

    # --- what is read, with what ---------------------------------------------------------------
    def list_inputs(self):
        from hvdtrain.predict.inputs import list_file_list, list_folder
        from hvdtrain.predict.records import list_records

        kind, where = self.request.source
        lister = {"data_dir": list_folder, "files": list_file_list,
                  "tfrecords": list_records}[kind]
        return lister(where)

    def model(self):
        shape = recorded_image_shape(self.recorded)
        classes = self.recorded.get("class_names")
        if self.request.checkpoint is not None and (shape is None or not classes):
            raise UserError(f"{self.request.run_dir}'s config.json does not say its images' "
                            "shape and classes (a run of an older hvdtrain): predict with its "
                            f"{MODEL_FILE}")
        from hvdtrain.models import build_classifier

        return scored_model(self.request.run_dir, self.request.checkpoint, self.recorded,
                            self.config, self.runtime,
                            lambda: build_classifier(self.config.model, shape, len(classes)))

    def image_shape(self, model) -> tuple[int, int, int]:
        """What every input is decoded to: the model's input (the run's images when the model
        takes any size)."""
        takes = tuple(getattr(model, "input_shape", (None,))[1:])
        if len(takes) == 3 and None not in takes:
            return takes
        recorded = recorded_image_shape(self.recorded)
        if recorded is None or len(takes) != 3:
            raise UserError(f"the model takes inputs of shape {takes}, not images "
                            "(height x width x channels): predict reads images")
        return recorded

    def class_names(self, model) -> tuple[str, ...]:
        from hvdtrain.export import class_names_of

        return class_names_of(self.recorded, model)

    def top_k(self, classes) -> int:
        return 0 if classes is None else min(self.request.top_k, len(classes))

    def batch_size(self) -> int:
        return (self.request.batch_size
                or self.recorded.get("plan", {}).get("per_worker_batch_size")
                or (self.config.batch_size if self.config else 32))

    # --- where it is written -------------------------------------------------------------------
    def prepare(self, parts, identity: dict) -> list[int]:
        output = self.request.output
        check_writable(output)
        if os.path.exists(output) and not self.request.overwrite:
            raise UserError(f"--output {output} exists: pass --overwrite to replace it (once "
                            "the new one is whole), or name another file")
        os.makedirs(os.path.dirname(output), exist_ok=True)
        return parts.prepare(identity)

    def merge(self, parts, classes) -> tuple[int, int]:
        """The parts into the output, whole under its name (rundir.replace_atomically); then
        the parts are removed. (rows, rows that say an input gave no image)."""
        from hvdtrain.predict.formats import format_of, open_writer
        from hvdtrain.rundir import replace_atomically

        output = self.request.output
        columns = ["input", *_class_columns(self.top_k(classes)), "error"] \
            if classes is not None else ["input", "output", "error"]
        counts = (0, 0)

        def write(staging: str) -> None:
            nonlocal counts
            writer = open_writer(staging, format_of(output), columns, ("output",))
            try:
                counts = parts.merge(writer)
            finally:
                writer.close()

        try:
            replace_atomically(output, write)
        except OSError as error:
            raise UserError(f"cannot write {output}: {as_one_line(error)}") from None
        parts.remove()
        return counts

    def banner(self, inputs, parts, finished: int, model_source: str) -> str:
        lines = [f"{error_name(PROGRAM)}: {inputs.description}; model {model_source}; "
                 f"{parts.num_parts} part(s) of up to {parts.part_size} on "
                 f"{self.runtime.world.size} rank(s)"]
        if finished:
            lines.append(f"{error_name(PROGRAM)}: resuming: {finished} of "
                         f"{parts.num_parts} part(s) already in {parts.directory}")
        lines += [f"{error_name(PROGRAM)}: {note}" for note in inputs.notes]
        return "\n".join(lines)


class Predictor:
    """A range of inputs -> blocks of rows, in input order (one batch's rows a block)."""

    def __init__(self, model, image_shape, config, classes, top_k: int, batch_size: int,
                 threads: int | None):
        import tensorflow as tf

        from hvdtrain.data.augment import pixel_decoder

        self.model, self.image_shape, self.classes = model, image_shape, classes
        self.top_k, self.batch_size, self.threads = top_k, batch_size, threads
        self.augment = bool(config and config.augment)
        input_dtype = model.inputs[0].dtype if getattr(model, "inputs", None) else tf.uint8

        @tf.function(reduce_retracing=True)
        def infer(images):
            outputs = tf.cast(model(tf.cast(images, input_dtype), training=False), tf.float32)
            if classes is None:
                return outputs, outputs
            probabilities, indices = tf.math.top_k(tf.nn.softmax(outputs), k=top_k)
            return probabilities, indices

        self.infer = infer
        # Traced once: each part's dataset calls it instead of tracing the decoder anew (a
        # third of a second a part on 2 cores).
        # Decoded as the run's validation decoded (the central crop follows: center_cropped).
        self.decode = tf.function(pixel_decoder(self.image_shape, augment=self.augment),
                                  input_signature=[tf.TensorSpec([], tf.string)])

    def stream(self, inputs, ranges: list[tuple[int, int]], progress
               ) -> Iterator[tuple[int, list[dict], bool]]:
        """``(which range, its next rows, whether they end it)`` over ``ranges`` in order: one
        dataset for all of them."""
        import tensorflow as tf

        from hvdtrain.data.augment import center_cropped

        if not ranges:
            return
        images = (inputs.encoded(ranges)
                  .map(lambda index, encoded: (self.decode(encoded), index),
                       num_parallel_calls=tf.data.AUTOTUNE)  # keeps order
                  # An input that did not read or decode: a gap in the numbers, read
                  # again alone (rows_read_alone).
                  .ignore_errors())
        if self.augment:
            images = center_cropped(images, self.image_shape)
        images = images.batch(self.batch_size).prefetch(tf.data.AUTOTUNE)
        if self.threads:
            options = tf.data.Options()
            options.threading.private_threadpool_size = max(2, self.threads)
            images = images.with_options(options)
        current = 0
        start, stop = ranges[0]
        expected = start
        for batch, indices in images:
            first, second = (values.numpy() for values in self.infer(batch))
            rows = []
            for row, index in enumerate(indices.numpy().tolist()):
                while index >= stop:  # the range is done: its last inputs failed, if any
                    rows += self.rows_read_alone(inputs, expected, stop)
                    progress.advance(len(rows))
                    yield current, rows, True
                    current, rows = current + 1, []
                    start, stop = ranges[current]
                    expected = start
                rows += self.rows_read_alone(inputs, expected, index)
                rows.append(self.row(inputs.key(index), first[row], second[row]))
                expected = index + 1
            progress.advance(len(rows))
            yield current, rows, False
        for current in range(current, len(ranges)):
            rows = self.rows_read_alone(inputs, expected, ranges[current][1])
            progress.advance(len(rows))
            yield current, rows, True
            if current + 1 < len(ranges):
                expected = ranges[current + 1][0]

    def row(self, key: str, first, second) -> dict:
        if self.classes is None:
            return {"input": key, "output": first.reshape(-1).tolist(), "error": None}
        row = {"input": key}
        for rank, (probability, index) in enumerate(zip(first.tolist(), second.tolist()), 1):
            row[f"class_{rank}"] = self.classes[index]
            row[f"probability_{rank}"] = probability
        row["error"] = None
        return row

    def rows_read_alone(self, inputs, start: int, stop: int) -> list[dict]:
        """The rows of inputs ``start`` to ``stop``, which the dataset dropped (a read or a
        decode raised in it; a TFRecord file's read ends at a corrupt record, dropping the rest
        of its run): each read and decoded again by itself and predicted a batch at a time, so
        only an input that fails alone too is a row that says why."""
        import tensorflow as tf

        from hvdtrain.data.augment import center_cropped
        from hvdtrain.errors import op_error_line
        from hvdtrain.predict.inputs import InputFailure

        rows = []
        for begin in range(start, stop, self.batch_size):  # a batch of images held at a time
            chunk = range(begin, min(begin + self.batch_size, stop))
            images, reasons = {}, {}
            for index in chunk:
                try:
                    encoded = inputs.read_alone(index)
                except InputFailure as failure:
                    reasons[index] = str(failure)
                    continue
                try:
                    images[index] = self.decode(tf.constant(encoded))
                except Exception as error:  # noqa: BLE001 - whatever TensorFlow's decoders raise
                    reasons[index] = f"not an image hvdtrain decodes: {op_error_line(error)}"
            predicted = {}
            if images:
                batch = tf.stack(list(images.values()))
                if self.augment:  # cropped by the stream's own function (on a batch: the same)
                    batch = center_cropped(tf.data.Dataset.from_tensors((batch,)),
                                           self.image_shape).get_single_element()[0]
                first, second = (values.numpy() for values in self.infer(batch))
                predicted = {index: self.row(inputs.key(index), first[place], second[place])
                             for place, index in enumerate(images)}
            rows += [predicted[index] if index in predicted
                     else self.failed(inputs.key(index), reasons[index]) for index in chunk]
        return rows

    def failed(self, key: str, reason: str) -> dict:
        if self.classes is None:
            return {"input": key, "output": None, "error": reason}
        return {"input": key, **dict.fromkeys(_class_columns(self.top_k)), "error": reason}


def _rows_of_one_range(stream) -> Iterator[list[dict]]:
    """``Predictor.stream``'s blocks up to the end of its current range."""
    for _, rows, ended in stream:
        yield rows
        if ended:
            return


def _class_columns(top_k: int) -> list[str]:
    return [name for rank in range(1, top_k + 1)
            for name in (f"class_{rank}", f"probability_{rank}")]


def _identity_of(model_source: str) -> dict:
    """The model a prediction used: its file, and the file's size and time (a checkpoint's
    index file's)."""
    path = model_source if os.path.isfile(model_source) else f"{model_source}.index"
    status = os.stat(path)
    return {"path": os.path.abspath(model_source), "bytes": status.st_size,
            "mtime_ns": status.st_mtime_ns}


class Progress:
    """Rank 0's line every ``seconds``: the inputs left, done as far as rank 0 is through its
    own share of them (an estimate: the ranks' shares differ by a part at most)."""

    def __init__(self, runtime, total: int, own: int, seconds: float):
        self.runtime, self.total, self.own, self.seconds = runtime, total, own, seconds
        self.done = 0
        self.started = self.last = time.monotonic()

    def advance(self, inputs: int) -> None:
        if not inputs:
            return
        self.done += inputs
        now = time.monotonic()
        if self.seconds and now - self.last >= self.seconds:
            self.last = now
            estimate = round(self.total * self.done / max(self.own, 1))
            rate = estimate / max(now - self.started, 1e-9)
            self.runtime.print0(f"{error_name(PROGRAM)}: about {min(estimate, self.total)} of "
                                f"{self.total} inputs predicted ({rate:.0f}/s)")
