"""Keras callbacks of a training run that are neither checkpointing (``checkpoint.py``) nor
preemption (``preemption.py``): data problems, batch-norm statistics, throughput, metrics, the
tracker's epochs.

``DecodeFailureReport`` and ``BatchNormStatistics`` are collectives (attached on every rank or
none); the rest are local. Callbacks that write files are only attached on rank 0.
"""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from typing import Iterator

import numpy as np
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain import ranklog
from hvdtrain.errors import RankError, UserError, no_step_report, report_once
from hvdtrain.plots import curves_title, plot_curves
from hvdtrain.training.preemption import StopRequest
from hvdtrain.rundir import RunDir
from hvdtrain.timeline import Timeline
from hvdtrain.tracking import Tracker


class DecodeFailureReport(keras.callbacks.Callback):
    """At each epoch's end: how many samples no rank could decode, summed over the ranks.

    A collective (every rank gathers the counts), so it is attached on every rank or none. The
    count goes into the epoch's metrics as ``skipped_samples`` and rank 0 names an example; with
    ``--on-bad-image fail`` every rank raises the same one-line error instead.
    """

    def __init__(self, runtime, failures, on_bad_image: str):
        super().__init__()
        self.runtime = runtime
        self.failures = failures
        self.on_bad_image = on_bad_image

    def on_epoch_end(self, epoch, logs=None):
        local = [counter.take_new() for counter in self.failures]
        miscounted = next(filter(None, (counter.miscounted_file() for counter in self.failures)),
                          None)
        mine = (sum(count for count, _ in local), next((name for _, name in local if name), None),
                miscounted)
        everyone = self.runtime.allgather_object(mine)
        # Records missing from a file are no images that did not decode: whatever
        # --on-bad-image says, every rank stops here, with the same line.
        miscounted = next((file for _, _, file in everyone if file), None)
        if miscounted:
            raise UserError(f"TFRecord shard {miscounted} (cut short or changed since it was "
                            "written: an interrupted copy?); copy the shards again, or convert "
                            "the images again")
        skipped = sum(count for count, _, _ in everyone)
        if not skipped:
            return
        example = next(name for _, name, _ in everyone if name)
        message = f"{skipped} sample(s) did not decode in epoch {epoch + 1} (e.g. {example})"
        if self.on_bad_image == "fail":
            raise UserError(f"{message}; remove them or pass --on-bad-image skip")
        logs["skipped_samples"] = skipped
        self.runtime.print0(f"{message}; each was replaced by a blank sample of weight 0")


class ValidationShare(keras.callbacks.Callback):
    """Each rank's validation metrics weighed by its share of the validation samples, just
    before the average over the ranks: the average is then the metric over every sample once.

    A rank validates its own share of the split, which may be a sample short of another's (and
    a batch, plan.py), so a plain average of the ranks' means would count the samples of the
    shorter shares more. Each rank's ``val_`` values are scaled by ``samples * ranks / total``,
    so the average over the ranks is ``sum(samples x mean) / total``: for a metric that is a
    mean over samples (the loss, accuracy, a mean error), its value over all of them; any
    other (an AUC) is each rank's value weighed by its samples. Local: every rank knows the
    split's total.
    """

    def __init__(self, samples: int, ranks: int, total: int):
        super().__init__()
        self.weight = samples * ranks / total

    def on_epoch_end(self, epoch, logs=None):
        for name in list(logs or ()):
            if name.startswith("val_"):
                logs[name] = float(logs[name]) * self.weight


class BatchNormStatistics(keras.callbacks.Callback):
    """Batch-norm statistics recomputed from the current weights before each epoch's validation
    and checkpoint, over ``num_batches`` training batches per rank, averaged over the ranks.

    Keras updates a batch-norm layer's moving mean and variance once per step, from the batch of
    one rank, with momentum 0.99 (a memory of ~100 steps). Data parallelism divides the steps per
    epoch by the number of ranks, so after the same epochs the averages of N ranks trail the
    weights N times further: the autoencoder reached val_loss 0.0068 in 20 epochs on one process
    and 0.046 on two. Recomputing them ("precise BN", Wu & Johnson 2021) gives N ranks the
    statistics of the weights they validate and save. A collective (every rank gathers every
    rank's sums), so it runs on every rank or none.

    The batches are the training stream's from its start, ``num_batches`` an epoch; a run
    resumed at epoch E (``data_start``: hvdtrain's image data) reads them on from E x
    ``num_batches``, as the run never stopped would, so it saves the same statistics.
    """

    def __init__(self, runtime, layers: list, batches, num_batches: int, data_start=None):
        super().__init__()
        self.runtime = runtime
        self.layers = layers
        self.batches = batches
        self.num_batches = num_batches
        self.data_start = data_start
        self._iterator = None
        self._forward = None
        self._done_this_epoch = False
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._done_this_epoch = False
        self._epoch = epoch

    def on_test_begin(self, logs=None):
        if not self._done_this_epoch:  # fit's validation: recompute before it
            self.recompute()

    def on_epoch_end(self, epoch, logs=None):
        if not self._done_this_epoch:  # no validation this epoch: before the checkpoint
            self.recompute()

    def recompute(self) -> None:
        import numpy as np
        import tensorflow as tf

        self._done_this_epoch = True
        if self._iterator is None:
            self._iterator = (iter(self.batches) if self.data_start is None else
                              self.data_start.iterator_at(self.batches,
                                                          self._epoch * self.num_batches))
        momentums = [layer.momentum for layer in self.layers]
        for layer in self.layers:
            # Momentum 0: one training-mode pass leaves exactly that batch's statistics.
            layer.momentum = 0.0
        if self._forward is None:
            model = self.model
            self._forward = tf.function(lambda inputs: model(inputs, training=True))
        sums = [[np.zeros(layer.moving_mean.shape, np.float64) for _ in range(2)]
                for layer in self.layers]
        try:
            for _ in range(self.num_batches):
                self._forward(next(self._iterator)[0])
                for (mean_sum, square_sum), layer in zip(sums, self.layers):
                    mean = layer.moving_mean.numpy().astype(np.float64)
                    mean_sum += mean
                    square_sum += layer.moving_variance.numpy() + mean ** 2
        finally:
            for layer, momentum in zip(self.layers, momentums):
                layer.momentum = momentum
        # Every rank ran the same number of equal batches: the mean of the ranks' means is the
        # mean over all of them, and so is that of E[x^2].
        gathered = self.runtime.allgather_object(sums)
        for index, layer in enumerate(self.layers):
            mean = np.mean([rank[index][0] for rank in gathered], axis=0) / self.num_batches
            square = np.mean([rank[index][1] for rank in gathered], axis=0) / self.num_batches
            layer.moving_mean.assign(mean.astype(np.float32))
            layer.moving_variance.assign(np.maximum(square - mean ** 2, 0).astype(np.float32))


def batch_norm_layers(model) -> list:
    # Nested models and layers included. `submodules` (tf.Module's) exists in tf_keras only;
    # both Kerases walk their layer tree with _flatten_layers.
    return [layer for layer in model._flatten_layers(include_self=False, recursive=True)
            if isinstance(layer, keras.layers.BatchNormalization)]


class TensorBoardLog(keras.callbacks.TensorBoard):
    """Keras' TensorBoard callback, with its two one-time costs moved out of the first batch, and
    its batches counted over the run rather than each ``fit``.

    Keras' callback pays them in the first ``on_train_batch_end``: its first ``tf.summary`` call
    imports TensorBoard's summary package (~50 ms here), and it writes the training graph. tf_keras
    times the first batches' hooks, and against a small model's few-millisecond steps it then
    warns on every job that the callbacks are slow (it did in `make train`). Here the import
    happens when the callback is made and the graph is written at the end of the first epoch:
    the same graph (the training function is traced at the first step), off the timed hooks.

    Keras counts the batches it profiles (``profile_batch``) and logs from 1 in every ``fit``; a
    run resumed inside an epoch fits twice (``train_epochs``), and profiled the same steps
    twice. Here the count goes on from the fits before. A batch is one call of the training
    function: ``steps_per_call`` steps (``--steps-per-execution``), so the profile of steps
    ``profile_steps`` is that of the calls holding them.
    """

    def __init__(self, log_dir: str, profile_steps: tuple[int, int] | None,
                 steps_per_call: int = 1):
        calls = tuple(-(-step // steps_per_call) for step in profile_steps or (0, 0))
        super().__init__(log_dir, profile_batch=calls)
        import tensorboard.summary.v2  # noqa: F401  (what tf.summary imports at its first call)
        self.batches_before = 0
        """Batches of the run's earlier fits."""

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)  # Keras' count starts at 0 here
        self._global_train_batch = self.batches_before

    def set_model(self, model):
        super().set_model(model)
        self._graph_pending = self._should_write_train_graph  # both Kerases set it here
        self._should_write_train_graph = False

    def _write_pending_graph(self):
        if self._graph_pending:
            self._graph_pending = False
            self._write_keras_model_train_graph()

    def on_epoch_end(self, epoch, logs=None):
        self._write_pending_graph()
        super().on_epoch_end(epoch, logs)

    def on_train_end(self, logs=None):
        self._write_pending_graph()  # a run stopped inside its first epoch
        super().on_train_end(logs)
        self.batches_before = self._global_train_batch


class Throughput(keras.callbacks.Callback):
    """Per-epoch wall time, process CPU time and global samples per second of the training part,
    and the world size the epoch ran on (a resumed run may run on another)."""

    def __init__(self, global_batch_size: int, num_workers: int = 1, input_wait=None):
        super().__init__()
        self._supports_tf_logs = True  # as PreemptionCheck: batch hooks read no metrics
        self.global_batch_size = global_batch_size
        self.num_workers = num_workers
        self.input_wait = input_wait
        """An ``InputWait`` (training/profile.py): the steps' wait for their batches."""
        self.timings: dict[str, float] = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.cpu_start, self.steps, self.train_end = (
            time.perf_counter(), time.process_time(), 0, None)
        self.wait_start = self.input_wait.seconds() if self.input_wait else 0.0
        self.waited = None

    def on_train_batch_end(self, batch, logs=None):
        self.steps = batch + 1  # batch index of the last step run (steps_per_execution aware)

    def on_test_begin(self, logs=None):
        self.train_end = time.perf_counter()
        self._read_wait()  # before the batch-norm pass, which reads training batches too

    def _read_wait(self) -> None:
        if self.input_wait is not None and self.input_wait.measured and self.waited is None:
            self.waited = self.input_wait.seconds() - self.wait_start

    def on_epoch_end(self, epoch, logs=None):
        now = time.perf_counter()
        self._read_wait()
        train_seconds = (self.train_end or now) - self.start
        logs["samples_per_sec"] = self.steps * self.global_batch_size / max(train_seconds, 1e-9)
        # Timings go to metrics.csv, not the progress line.
        self.timings = {"train_seconds": train_seconds, "epoch_seconds": now - self.start,
                        "cpu_seconds": time.process_time() - self.cpu_start}
        if self.waited is not None:
            # Rank 0's steps: waiting for their batches, and everything else (the compute, the
            # average, the callbacks).
            self.timings["input_wait_seconds"] = self.waited
            self.timings["compute_seconds"] = max(train_seconds - self.waited, 0.0)
        resident = resident_megabytes()
        if resident is not None:
            # Rank 0's own memory now: flat over epochs unless something (a cache) keeps growing.
            self.timings["resident_mb"] = resident

    def row(self, epoch: int, logs: dict | None) -> dict:
        """One row of metrics.json: the 1-based epoch, the workers it ran on, its (averaged)
        metrics, its timings."""
        return {"epoch": epoch + 1, "workers": self.num_workers,
                **{k: float(v) for k, v in (logs or {}).items()}, **self.timings}


def resident_megabytes() -> float | None:
    """This process's resident memory now (Linux /proc), or None where there is no /proc."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Progress(keras.callbacks.Callback):
    """Rank 0's progress inside an epoch: a line every ``interval_seconds`` (step, samples/s,
    loss, time left in the epoch), and the job's timeline at the first step and the training's
    end.

    Under a launcher Keras prints one line per epoch, so an ImageNet epoch would show nothing for
    an hour. Plain lines, no carriage returns: they stay readable in a Slurm log and under
    horovodrun's per-rank prefixes. Only the first step of this run is timed, and its
    ``first_step_seconds`` (from the timeline's origin: the process's start, for its first job)
    joins the first epoch's metrics (after the ranks' metric averaging, so it is rank 0's own).
    """

    def __init__(self, global_batch_size: int, steps_per_epoch: int, epochs: int,
                 interval_seconds: float, timeline: Timeline, print_line=print):
        super().__init__()
        self._supports_tf_logs = True  # the loss is read (a device sync) only when printing
        self.global_batch_size = global_batch_size
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self.interval_seconds = interval_seconds
        self.timeline = timeline
        self.print_line = print_line
        self.first_step_seconds: float | None = None
        self._recorded = False

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epoch_start = self.last_line = time.monotonic()
        # Steps of this epoch run before this fit: a fit of an epoch's remaining steps (a resume
        # inside it) numbers its batches from 0.
        self.steps_resumed = self.steps_per_epoch - self.params.get("steps", self.steps_per_epoch)
        self.steps_before_rate = self.steps_resumed

    def on_train_batch_end(self, batch, logs=None):
        now = time.monotonic()
        steps_done = self.steps_resumed + batch + 1  # the epoch's
        if self.first_step_seconds is None:
            self.timeline.mark("first_step_done")
            self.first_step_seconds = self.timeline.seconds("first_step_done")
            self.print_line(f"first step done {self.first_step_seconds:.1f} s after start")
            # The rate of this epoch leaves out start-up (tracing, filling buffers).
            self.epoch_start = self.last_line = now
            self.steps_before_rate = steps_done
            return
        if not self.interval_seconds or now - self.last_line < self.interval_seconds:
            return
        self.last_line = now
        self.print_line(self.line(steps_done, now, logs))

    def line(self, steps_done: int, now: float, logs) -> str:
        counted = steps_done - self.steps_before_rate
        elapsed = max(now - self.epoch_start, 1e-9)
        rate = counted / elapsed
        left = (self.steps_per_epoch - steps_done) / rate if rate > 0 else float("nan")
        loss = (logs or {}).get("loss")
        loss_text = f" | loss {float(loss):.4f}" if loss is not None else ""
        return (f"epoch {self.epoch + 1}/{self.epochs} step {steps_done}/{self.steps_per_epoch} "
                f"({100 * steps_done / self.steps_per_epoch:.0f}%) | "
                f"{rate * self.global_batch_size:.1f} samples/s{loss_text} | "
                f"epoch ends in {format_duration(left)}")

    def on_epoch_end(self, epoch, logs=None):
        if self.first_step_seconds is not None and not self._recorded and logs is not None:
            logs["first_step_seconds"] = self.first_step_seconds
            self._recorded = True

    def on_train_end(self, logs=None):
        # Before the train-end work of the callbacks after this one (MetricsLog's final curves,
        # TensorBoard's close), which the timeline counts after training.
        self.timeline.mark("training_done")


def format_duration(seconds: float) -> str:
    if seconds != seconds:  # nan: no rate yet
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


class StallWatchdog(keras.callbacks.Callback):
    """Ends this rank when training has made no progress for ``limit_seconds``.

    Horovod's stall check (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) runs on its background thread
    between two collectives. When a node's network link goes down in the middle of an allreduce,
    that thread waits in a TCP send or receive the kernel keeps retrying for ~15 minutes, so the
    check never runs and the job hangs (measured on the local cluster: still running 150 s after
    the link went down with a 30 s limit). This watch has a thread of its own and no collective:
    when no training step and no epoch boundary passed for its limit, rank 0 prints one line (the
    others write it into their logs) and the rank exits with status 1, and the launcher (mpirun,
    srun) then ends the other ranks. Its limit leaves horovod's inspector the first word when it
    can speak (see ``runtime.horovod.watchdog_seconds``): it names the stalled rank; this watch
    cannot.

    Armed from the first finished step (the first one includes tracing and compilation), paused
    during validation (no collectives, and a large validation set takes its time). Local: every
    rank watches itself.
    """

    def __init__(self, limit_seconds: float, rank: int, poll_seconds: float = 1.0):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks read no metrics
        self.limit_seconds = limit_seconds
        self.rank = rank
        self.poll_seconds = min(poll_seconds, limit_seconds / 4)
        self.last_progress: float | None = None
        self.paused = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _progress(self) -> None:
        self.last_progress = time.monotonic()

    def on_train_begin(self, logs=None):
        self._done.clear()
        self._thread = threading.Thread(target=self._watch, name="hvdtrain-stall-watchdog",
                                        daemon=True)
        self._thread.start()

    def on_train_batch_end(self, batch, logs=None):
        self._progress()

    def on_epoch_begin(self, epoch, logs=None):
        if self.last_progress is not None:
            self._progress()

    def on_epoch_end(self, epoch, logs=None):
        self._progress()

    def on_test_begin(self, logs=None):
        self.paused = True

    def on_test_end(self, logs=None):
        self.paused = False
        self._progress()

    def on_train_end(self, logs=None):
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(self.poll_seconds):
            last = self.last_progress
            if self.paused or last is None or time.monotonic() - last < self.limit_seconds:
                continue
            report_once(no_step_report(self.rank, socket.gethostname(), self.limit_seconds,
                                       ranklog.current()), self.rank)
            # Not an exception: the main thread is blocked in the collective that never returns.
            os._exit(1)


class LearningRateLog(keras.callbacks.Callback):
    """The rate at the epoch's end into its logs: the schedule's at the step reached, or the
    optimizer's own when the rate is a plain number (which a callback such as ReduceLROnPlateau
    may have changed)."""

    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self.model.optimizer
        if isinstance(self.schedule, keras.optimizers.schedules.LearningRateSchedule):
            logs["learning_rate"] = float(self.schedule(optimizer.iterations))
        else:
            logs["learning_rate"] = float(np.asarray(optimizer.learning_rate))


class MetricsLog(keras.callbacks.Callback):
    """Rank 0: metrics.csv and metrics.json after every completed epoch; curves.png at most every
    ``plot_every_seconds`` and when training ends.

    Why the plot is throttled: the ranks move in lock-step, so rank 0's time in matplotlib is time
    every rank waits. Redrawing after every short epoch took ~40% of rank 0's main-thread CPU in
    a 2-rank job with 0.7 s epochs (py-spy; docs/benchmarks.md, "Two ranks at the ceiling").
    """

    def __init__(self, run_dir: RunDir, rows: list[dict], request: StopRequest,
                 throughput: Throughput, plot_every_seconds: float = 60.0):
        super().__init__()
        self.run_dir = run_dir
        self.rows = rows
        self.request = request
        self.throughput = throughput
        self.plot_every_seconds = plot_every_seconds
        self.last_plot: float | None = None  # monotonic time of the last curves.png
        self.plotted_rows = 0

    def on_epoch_end(self, epoch, logs=None):
        if self.request.mid_epoch:
            return  # a cut-short epoch is not a data point; the resume finishes it
        self.rows.append(self.throughput.row(epoch, logs))
        with self._writing("metrics.json"):
            self.run_dir.write_csv("metrics.csv", self.rows)
            self.run_dir.write_json("metrics.json", self.rows)
        if self.last_plot is None or time.monotonic() - self.last_plot >= self.plot_every_seconds:
            self._plot()

    def on_train_end(self, logs=None):
        if self.rows and self.plotted_rows != len(self.rows):
            self._plot()

    def _plot(self) -> None:
        with self._writing("curves.png"):
            title = curves_title(os.path.basename(self.run_dir.path.rstrip("/")), self.rows,
                                 self.throughput.global_batch_size, self.throughput.num_workers)
            self.run_dir.write_with("curves.png",
                                    lambda path: plot_curves(self.rows, path, title))
        self.last_plot, self.plotted_rows = time.monotonic(), len(self.rows)

    @contextlib.contextmanager
    def _writing(self, name: str) -> Iterator[None]:
        """A run directory that filled up (or went away) mid-run: rank 0's one line, exit 2,
        which the launcher does not restart (a restart would fail the same way)."""
        try:
            yield
        except OSError as error:
            raise RankError(f"cannot write {name} in {self.run_dir.path}: "
                            f"{error.strerror or error}; make room there (or pass another "
                            "--run-dir), then run the job again: it resumes from its last "
                            "checkpoint") from None


class TrackEpochs(keras.callbacks.Callback):
    """Rank 0, after SaveCheckpoint: each completed epoch's row to the tracker, once its
    checkpoint exists."""

    def __init__(self, tracker: Tracker, rows: list[dict], request: StopRequest):
        super().__init__()
        self.tracker = tracker
        self.rows = rows
        self.request = request

    def on_epoch_end(self, epoch, logs=None):
        if not self.request.mid_epoch:  # a cut-short epoch has no row (MetricsLog)
            self.tracker.log_epochs(self.rows)
