"""Keras callbacks of a training run, in the order ``train.fit`` lists them.

Only ``PreemptionCheck`` communicates (it is a collective: every rank must reach it equally
often); the rest are local. Callbacks that write files are only attached on rank 0.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass

import tf_keras as keras

from hvdtrain.plots import plot_curves
from hvdtrain.rundir import RunDir


@dataclass
class StopRequest:
    """A stop signal as this rank saw it, and as all ranks agreed on it."""

    received: int = 0
    """Signal number this rank caught (0: none yet)."""
    agreed: int = 0
    """Signal number all ranks agreed to stop on, at the same step (0: keep training)."""
    epoch: int | None = None
    """The epoch in which training stopped."""
    mid_epoch: bool = False
    """True when steps of that epoch were left undone (it is re-run on resume)."""


class PreemptionCheck(keras.callbacks.Callback):
    """Stop all ranks at the same step when any rank caught SIGUSR1 or SIGTERM.

    Slurm sends ``--signal=B:USR1@<seconds>`` before the time limit (the sbatch templates forward
    it to the ranks). The handler only records the signal; every ``check_every`` batches the ranks
    agree on it with one small collective, so they all leave ``fit`` after the same step and no rank
    is left waiting in an allreduce. ``train.fit`` then writes the checkpoint.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, runtime, request: StopRequest, check_every: int):
        super().__init__()
        # Reads no metrics per batch: Keras then need not copy them out of the step every batch.
        self._supports_tf_logs = True
        self.runtime = runtime
        self.request = request
        self.check_every = check_every
        self.calls = 0
        self._previous_handlers = {}

    def install(self) -> None:
        for signum in self.SIGNALS:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()

    def _on_signal(self, signum, frame) -> None:
        if not self.request.received:
            print(f"rank {self.runtime.world.rank}: caught {signal.Signals(signum).name}; "
                  "stopping after the current step to write a checkpoint",
                  file=sys.stderr, flush=True)
        self.request.received = signum

    def on_train_batch_end(self, batch, logs=None):
        self.calls += 1
        if self.calls % self.check_every:
            return
        agreed = self.runtime.max_over_ranks(self.request.received)
        if agreed:
            self.request.agreed = agreed
            self.request.mid_epoch = batch + 1 < self.params["steps"]
            self.model.stop_training = True

    def on_epoch_begin(self, epoch, logs=None):
        self.request.epoch = epoch


class Throughput(keras.callbacks.Callback):
    """Per-epoch wall time, process CPU time and global samples per second of the training part."""

    def __init__(self, global_batch_size: int):
        super().__init__()
        self._supports_tf_logs = True  # as PreemptionCheck: batch hooks read no metrics
        self.global_batch_size = global_batch_size
        self.timings: dict[str, float] = {}

    def on_epoch_begin(self, epoch, logs=None):
        self.start, self.cpu_start, self.steps, self.train_end = (
            time.perf_counter(), time.process_time(), 0, None)

    def on_train_batch_end(self, batch, logs=None):
        self.steps = batch + 1  # batch index of the last step run (steps_per_execution aware)

    def on_test_begin(self, logs=None):
        self.train_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        now = time.perf_counter()
        train_seconds = (self.train_end or now) - self.start
        logs["samples_per_sec"] = self.steps * self.global_batch_size / max(train_seconds, 1e-9)
        # Timings go to metrics.csv, not the progress line.
        self.timings = {"train_seconds": train_seconds, "epoch_seconds": now - self.start,
                        "cpu_seconds": time.process_time() - self.cpu_start}


class LearningRateLog(keras.callbacks.Callback):
    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_end(self, epoch, logs=None):
        logs["learning_rate"] = float(self.schedule(self.model.optimizer.iterations))


class SaveCheckpoint(keras.callbacks.Callback):
    """Rank 0: a checkpoint after every completed epoch (and after a cut-short one)."""

    def __init__(self, checkpoints, request: StopRequest):
        super().__init__()
        self.checkpoints = checkpoints
        self.request = request

    def on_epoch_end(self, epoch, logs=None):
        # An epoch cut short is saved as "resume at this epoch": it is re-run from its start.
        self.checkpoints.save(resume_epoch=epoch if self.request.mid_epoch else epoch + 1)


class MetricsLog(keras.callbacks.Callback):
    """Rank 0: metrics.csv, metrics.json and curves.png, rewritten after every completed epoch."""

    def __init__(self, run_dir: RunDir, rows: list[dict], request: StopRequest,
                 throughput: Throughput):
        super().__init__()
        self.run_dir = run_dir
        self.rows = rows
        self.request = request
        self.throughput = throughput

    def on_epoch_end(self, epoch, logs=None):
        if self.request.mid_epoch:
            return  # a cut-short epoch is not a data point; it is re-run on resume
        self.rows.append({"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()},
                          **self.throughput.timings})
        self.run_dir.write_csv("metrics.csv", self.rows)
        self.run_dir.write_json("metrics.json", self.rows)
        self.run_dir.write_with("curves.png", lambda path: plot_curves(self.rows, path))

