"""`hvdtrain evaluate --run-dir RUN`: a run of hvdtrain's own jobs (the classifier, the
autoencoder) scored over a split of its data (or other data), every sample exactly once, on any
number of ranks.

Launched like a job (``horovodrun -np 4 python -m hvdtrain.evaluate --run-dir RUN``, the
launcher, an sbatch template's program) or as one process. The model is the run's
``model.keras``, or with ``--checkpoint latest|N`` the weights of one of its checkpoints. The
data is the run's own (its flags in config.json) and its validation split by default; the data
flags name other data, and ``--split all`` every sample of it.

How every sample counts once: each rank reads its share of the split exactly as validation
during training does (``build_pipelines``' validation side: every size-th sample, the last batch
partial, no cache), and sums the per-sample loss (and a classifier's confusion matrix) over it;
rank 0 adds the ranks' sums. No collective runs per batch, so shares a sample apart need no
padding. A file that does not decode is counted as skipped, never scored, never a crash. The loss
is the job's (the run's ``--label-smoothing`` included, and the penalties of the model's own
regularizers) and a classifier's accuracy the argmax's, as Keras' ``evaluate`` of the compiled
model computes them in one process.

Rank 0 writes ``evaluation-NAME.json`` into the run directory (or ``--output``) atomically and
prints one summary line.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Callable, Sequence

import hvdtrain
from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import UserError, as_one_line, leave, reported
from hvdtrain.flags import OneLineParser
from hvdtrain.rundir import COPY_IT_DOWN, COPY_IT_UP, RunDir, require_file_system_path
from hvdtrain.runmodel import (check_model_flags, check_writable, few_names, require_model_file,
                               run_config, scored_model)

PROGRAM = "hvdtrain.evaluate"
SPLITS = ("validation", "train", "all")


@dataclasses.dataclass(frozen=True)
class ScoredJob:
    """What evaluate takes from a job it scores: its flags and its Task (model, loss, pairs)."""

    config_class: type
    """Its flags, as config.json records them."""
    task: Callable
    """config -> the job's Task."""
    classifies: bool
    """Its outputs are class logits: accuracy, per class, and the confusion matrix."""


def scored_jobs() -> dict[str, ScoredJob]:
    """The jobs evaluate scores, by the program config.json names (TensorFlow-free imports)."""
    from hvdtrain import autoencoder, cnn

    return {cnn.PROGRAM: ScoredJob(cnn.ClassifierConfig, cnn.classifier_of, True),
            autoencoder.PROGRAM: ScoredJob(autoencoder.ImageConfig,
                                           lambda config: autoencoder.RECONSTRUCTOR, False)}


#: Seconds between rank 0's progress lines on a long evaluation.
PROGRESS_SECONDS = 30.0


@dataclasses.dataclass(frozen=True)
class Request:
    run_dir: str
    checkpoint: str | None
    """None: model.keras; 'latest' or a checkpoint's number."""
    split: str
    data_flags: dict
    """The data flags given (data, data_dir, tfrecords), which replace the run's own."""
    batch_size: int | None
    output: str | None
    name: str | None


def main(argv: Sequence[str] | None = None) -> None:
    with reported(error_name(PROGRAM)):
        status = run(parse(argv))
    leave(status)


def parse(argv: Sequence[str] | None) -> Request:
    parser = OneLineParser(
        prog=usage_name(PROGRAM),
        description="Score a run directory's model (the classifier's or the autoencoder's) "
                    "over its validation split (or other data): the loss, and a classifier's "
                    "accuracy, per-class accuracy and confusion matrix, every sample exactly "
                    "once on any number of ranks. docs/after-training.md.")
    parser.add_argument("--run-dir", required=True,
                        help="the run directory of a classifier or autoencoder job")
    parser.add_argument("--checkpoint", metavar="latest|N",
                        help="score the weights of this checkpoint (its number, or the newest) "
                             "instead of the run's model.keras")
    parser.add_argument("--split", choices=SPLITS, default="validation",
                        help="which samples of the data: the held-out ones (as the run split "
                             "them), the training ones, or all")
    parser.add_argument("--data-dir", help="an image folder instead of the run's data")
    parser.add_argument("--tfrecords", help="TFRecord shards instead of the run's data")
    parser.add_argument("--data", choices=("digits", "synthetic"),
                        help="embedded data instead of the run's data")
    parser.add_argument("--batch-size", type=int,
                        help="samples per rank per batch (default: the run's batch size)")
    parser.add_argument("--output", help="the JSON file to write (default: "
                                         "RUN/evaluation-NAME.json)")
    parser.add_argument("--name", help="NAME in the default output file (default: the split, "
                                       "and the data's name when it is not the run's)")
    parser.add_argument("--keras", choices=("2", "3"), default=hvdtrain.KERAS,
                        help="the Keras the run trained with (it says so in one line otherwise)")
    args = parser.parse_args(argv)
    check_model_flags(args.keras, args.checkpoint, PROGRAM)
    require_file_system_path("--run-dir", args.run_dir, COPY_IT_DOWN)
    if args.output:
        require_file_system_path("--output", args.output, COPY_IT_UP)
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.name is not None and not re.fullmatch(r"[\w.-]+", args.name):
        raise UserError(f"--name must be letters, digits, '_', '-' or '.', got {args.name!r}")
    given = {name: value for name, value in (("data", args.data), ("data_dir", args.data_dir),
                                             ("tfrecords", args.tfrecords)) if value}
    if len(given) > 1:
        raise UserError("name one data source: --data-dir, --tfrecords or --data")
    return Request(args.run_dir, args.checkpoint, args.split, given, args.batch_size,
                   args.output, args.name)


def run(request: Request) -> int:
    """Score the run's model as ``request`` asks, on every rank; rank 0 writes and prints."""
    from hvdtrain.export import read_run_config

    recorded = read_run_config(request.run_dir)
    jobs = scored_jobs()
    job = jobs.get(recorded.get("program"))
    if job is None:
        raise UserError(f"{request.run_dir} is a run of {recorded.get('program')}; evaluate "
                        f"scores runs of hvdtrain's own jobs ({', '.join(jobs)}): score a job "
                        "of your own with its model.keras in your own script")
    require_model_file(request.run_dir, request.checkpoint, can_load_checkpoint=True)
    config = run_config(request.run_dir, recorded, job.config_class, request.data_flags)
    from hvdtrain.training import train  # TensorFlow: after the arguments and the run are read

    runtime = train.start_runtime(config)
    return Evaluation(request, recorded, config, runtime, job).run()


class Evaluation:
    def __init__(self, request: Request, recorded: dict, config, runtime, job: ScoredJob):
        self.request, self.recorded, self.config, self.runtime = request, recorded, config, runtime
        self.job, self.task = job, job.task(config)

    def run(self) -> int:
        from hvdtrain.data import load_listing

        started = time.monotonic()
        listing = load_listing(self.config, self.runtime)
        if self.job.classifies:
            self.check_classes(listing.class_names)
        splits = self.splits(listing)
        model, model_source = scored_model(self.request.run_dir, self.request.checkpoint,
                                           self.recorded, self.config, self.runtime,
                                           lambda: self.task.build_model(listing))
        self.check_image_shape(model, listing.image_shape)
        path = self.output_path(model_source)
        # Rank 0 writes the result: it checks where, before anyone scores (a refusal reaches
        # every rank).
        self.runtime.from_chief(lambda: check_writable(path))
        totals = self.score(model, listing, splits)
        # Rank 0 adds the ranks' sums: each sample was in exactly one rank's share.
        everyone = self.runtime.allgather_object(totals)
        if not self.runtime.world.is_chief:
            return 0
        result = self.result(everyone, listing, model_source, time.monotonic() - started)
        try:
            RunDir(os.path.dirname(path), is_chief=True).write_json(os.path.basename(path),
                                                                     result)
        except OSError as error:
            raise UserError(f"cannot write {path}: {as_one_line(error)}") from None
        print(f"{error_name(PROGRAM)}: {summary(result)}; wrote {path}", flush=True)
        return 0

    # --- what is scored --------------------------------------------------------------------------
    def check_classes(self, class_names: tuple[str, ...]) -> None:
        trained = self.recorded.get("class_names")
        if trained is not None and list(class_names) != list(trained):
            raise UserError(f"the data's classes ({few_names(class_names)}) are not the ones "
                            f"the model was trained on ({few_names(trained)}): score data with the "
                            "same class folders (or TFRecords converted from them)")

    def splits(self, listing) -> list:
        split = self.request.split
        chosen = {"validation": [listing.validation], "train": [listing.train],
                  "all": [listing.train, listing.validation]}[split]
        chosen = [part for part in chosen if part.num_samples]
        if not chosen:
            held = ("the run held out no validation samples (--validation-fraction 0)"
                    if split == "validation" else f"the data has no {split} samples")
            raise UserError(f"{held}: pass --split all, or name other data")
        return chosen

    def check_image_shape(self, model, image_shape: tuple[int, int, int]) -> None:
        takes = tuple(getattr(model, "input_shape", (None,))[1:])
        if takes and None not in takes and takes != tuple(image_shape):
            raise UserError(f"the model takes {_shape(takes)} images and this data decodes to "
                            f"{_shape(image_shape)} at the run's --image-size and --channels: "
                            "score images of the kind the run trained on")

    # --- scoring ---------------------------------------------------------------------------------
    def score(self, model, listing, splits) -> dict:
        """This rank's sums over its share of ``splits``: the samples listed and scored, the
        loss summed over them and (a classifier's) the confusion matrix."""
        import numpy as np
        import tensorflow as tf

        from hvdtrain.data import build_pipelines
        from hvdtrain.data.cache import CacheChoice

        world, config = self.runtime.world, self.config
        classes = len(listing.class_names) if self.job.classifies else 0
        sums = batch_sums(model, self.task.loss(), classes)
        to_pairs = self.task.to_pairs or (lambda images, labels: (images, labels))

        # The run's batch per worker (under --batch-policy global, --batch-size is the job's).
        batch_size = (self.request.batch_size
                      or self.recorded.get("plan", {}).get("per_worker_batch_size")
                      or config.batch_size)
        loss_sum, scored, confusion, samples = 0.0, 0.0, np.zeros((classes, classes)), 0
        progress = Progress(self.runtime, sum(part.num_samples for part in splits))
        for split in splits:
            # Validation's own reading of a split (every size-th sample, the last batch partial),
            # without a cache: each sample is read once.
            pipelines = build_pipelines(
                dataclasses.replace(listing, validation=split), world, batch_size=1,
                validation_batch_size=batch_size, seed=config.seed,
                cache=CacheChoice("off", "each sample is read once"),
                tfrecord_sharding="example", augment=config.augment,
                threads=self.runtime.devices.threads)
            for batch in pipelines.validation:
                images, labels = batch[0], batch[1]
                weights = (batch[2] if len(batch) == 3
                           else tf.ones(tf.shape(labels)[:1], tf.float32))
                batch_loss, batch_scored, batch_confusion = sums(*to_pairs(images, labels),
                                                                 weights)
                loss_sum += float(batch_loss)
                scored += float(batch_scored)
                confusion += batch_confusion.numpy()
                progress.advance(int(tf.shape(labels)[0]) * world.size)
            samples += pipelines.validation_samples
        # A sample that did not decode is a blank of weight 0 (DecodeFailures): listed, not
        # scored, in no cell of the confusion matrix.
        return {"listed": samples, "scored": round(scored), "loss_sum": loss_sum,
                "confusion": confusion.round().astype(np.int64).tolist()}

    # --- the result ------------------------------------------------------------------------------
    def result(self, everyone: list[dict], listing, model_source: str, seconds: float) -> dict:
        import numpy as np

        scored = sum(rank["scored"] for rank in everyone)
        request = self.request
        result = {
            "run_dir": os.path.abspath(request.run_dir),
            "model": model_source,
            "data": listing.description,
            "split": request.split,
            "ranks": self.runtime.world.size,
            "samples": scored,
            "skipped": sum(rank["listed"] for rank in everyone) - scored,
            "loss": sum(rank["loss_sum"] for rank in everyone) / scored if scored else None,
        }
        if self.job.classifies:
            confusion = np.sum([np.array(rank["confusion"]) for rank in everyone], axis=0)
            per_class_samples = confusion.sum(axis=1)
            result.update({
                "accuracy": float(np.trace(confusion) / scored) if scored else None,
                "per_class_accuracy": {
                    name: (float(confusion[index, index] / per_class_samples[index])
                           if per_class_samples[index] else None)
                    for index, name in enumerate(listing.class_names)},
                "class_names": list(listing.class_names),
                "confusion_matrix": confusion.astype(int).tolist(),
                "confusion_matrix_axes": "rows: true class, columns: predicted class",
            })
        return {**result, "seconds": round(seconds, 2)}

    def output_path(self, model_source: str) -> str:
        """--output, or RUN/evaluation-NAME.json: NAME the split, then the data's name when it
        is not the run's, then the checkpoint's when it is not model.keras."""
        request = self.request
        if request.output:
            return os.path.abspath(request.output)
        name = request.name
        if name is None:
            name = request.split
            if request.data_flags:
                name += f"-{_data_name(self.config)}"
            if request.checkpoint is not None:
                name += f"-{os.path.basename(model_source)}"  # ckpt-N
        return os.path.join(os.path.abspath(request.run_dir), f"evaluation-{name}.json")


class Progress:
    """Rank 0's line every ``PROGRESS_SECONDS`` on a long evaluation (rank 0's count times the
    ranks: an estimate of everyone's)."""

    def __init__(self, runtime, total: int):
        self.runtime, self.total, self.done = runtime, total, 0
        self.last = time.monotonic()

    def advance(self, samples: int) -> None:
        self.done += samples
        if time.monotonic() - self.last >= PROGRESS_SECONDS:
            self.last = time.monotonic()
            self.runtime.print0(f"{error_name(PROGRAM)}: about {min(self.done, self.total)} of "
                                f"{self.total} samples scored")


def batch_sums(model, loss, classes: int):
    """A function of a batch (inputs, targets, weights) to its summed loss, the samples it
    scored and (``classes`` above 0) its confusion matrix, counted as Keras' ``evaluate`` counts
    them: each sample's loss (its mean over the sample's values: an image's pixels) plus the
    penalties the model's layers add themselves (weight and activity regularizers; Keras adds
    their sum to each batch's mean loss and averages the batches by their sizes), for the
    samples of weight 1 only."""
    import tensorflow as tf

    per_sample = loss.call if hasattr(loss, "call") else loss  # unreduced, as Keras has it

    @tf.function(reduce_retracing=True)
    def sums(inputs, targets, weights):
        outputs = tf.cast(model(inputs, training=False), tf.float32)
        weights = tf.cast(weights, tf.float32)
        losses = tf.cast(per_sample(targets, outputs), tf.float32)
        losses = tf.reduce_mean(tf.reshape(losses, [tf.shape(losses)[0], -1]), axis=1)
        # Read after the call, so the activity penalties are this batch's.
        penalty = tf.add_n([tf.cast(tf.reduce_sum(term), tf.float32) for term in model.losses]
                           or [tf.constant(0.0)])
        if classes:
            confusion = tf.math.confusion_matrix(tf.reshape(targets, [-1]),
                                                 tf.argmax(outputs, axis=-1), classes,
                                                 weights=weights, dtype=tf.float64)
        else:
            confusion = tf.zeros((0, 0), tf.float64)
        return (tf.reduce_sum(tf.cast((losses + penalty) * weights, tf.float64)),
                tf.reduce_sum(weights), confusion)

    return sums


def summary(result: dict) -> str:
    per_class = {name: value for name, value in result.get("per_class_accuracy", {}).items()
                 if value is not None}
    lowest = min(per_class, key=per_class.get) if per_class else None
    skipped = f" ({result['skipped']} did not decode, not scored)" if result["skipped"] else ""
    scores = "nothing to score"
    if result["samples"]:
        scores = f"loss {result['loss']:.4f}" + (
            f", accuracy {result['accuracy']:.4f}" if "accuracy" in result else "")
    return (f"{result['samples']} samples{skipped} ({result['split']} of {result['data']}) on "
            f"{result['ranks']} rank(s): {scores}"
            + (f", lowest class {lowest} {per_class[lowest]:.4f}" if lowest is not None else ""))


def _data_name(config) -> str:
    """The data's own name, for a file name: its folder's, or the embedded set's."""
    source = config.source
    if not source.from_files:
        return config.data
    base = os.path.basename(source.described().rstrip("/"))
    return re.sub(r"[^\w.-]+", "_", base).strip("._") or "data"


def _shape(shape) -> str:
    return "x".join(str(size) for size in shape)


if __name__ == "__main__":
    main()
