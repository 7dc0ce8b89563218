"""Keras callbacks of a training run, in the order ``train.fit`` lists them.

Only ``PreemptionCheck`` communicates (it is a collective: every rank must reach it equally
often); the rest are local. Callbacks that write files are only attached on rank 0.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable

import tf_keras as keras

from hvdtrain.errors import UserError
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
    saved: bool = False
    """Rank 0 already wrote the checkpoint for this stop."""


class StopSignals:
    """Records SIGUSR1 and SIGTERM from the start of a run to its end, instead of dying of them.

    Slurm sends ``--signal=B:USR1@<seconds>`` before the time limit (the sbatch templates forward
    it to the ranks). Installed for the whole run, not just ``fit``: a signal that arrives while
    the data is listed or the model exported must not kill a rank either.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, rank: int, request: StopRequest):
        self.rank = rank
        self.request = request
        self._previous = {}

    def __enter__(self) -> StopSignals:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum, frame) -> None:
        if not self.request.received:
            print(f"rank {self.rank}: caught {signal.Signals(signum).name}; stopping after the "
                  "current step to write a checkpoint", file=sys.stderr, flush=True)
        self.request.received = signum


class PreemptionCheck(keras.callbacks.Callback):
    """Stop all ranks at the same step when any rank caught a stop signal.

    Every ``check_every`` batches the ranks agree on ``request.received`` with one small
    collective, so they all leave ``fit`` after the same step and no rank is left waiting in an
    allreduce. On agreement ``on_stop(epoch, mid_epoch)`` runs at once (rank 0 writes the
    checkpoint there, before Keras' end-of-epoch validation eats into Slurm's warning time).
    """

    def __init__(self, runtime, request: StopRequest, check_every: int,
                 on_stop: Callable[[int, bool], None]):
        super().__init__()
        # Reads no metrics per batch: Keras then need not copy them out of the step every batch.
        self._supports_tf_logs = True
        self.runtime = runtime
        self.request = request
        self.check_every = check_every
        self.on_stop = on_stop
        self.next_check = check_every

    def on_epoch_begin(self, epoch, logs=None):
        self.request.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        # Counted in batches, not calls: with steps_per_execution one call covers many batches.
        # Every rank sees the same batch numbers, so every rank checks at the same steps.
        steps = self.params["steps"]
        done = self.request.epoch * steps + batch + 1
        if done < self.next_check:
            return
        self.next_check = done + self.check_every
        agreed = self.runtime.max_over_ranks(self.request.received)
        if agreed:
            self.request.agreed = agreed
            self.request.mid_epoch = batch + 1 < steps
            self.model.stop_training = True
            self.on_stop(self.request.epoch, self.request.mid_epoch)


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
        mine = (sum(count for count, _ in local), next((name for _, name in local if name), None))
        everyone = self.runtime.allgather_object(mine)
        skipped = sum(count for count, _ in everyone)
        if not skipped:
            return
        example = next(name for _, name in everyone if name)
        message = f"{skipped} sample(s) did not decode in epoch {epoch + 1} (e.g. {example})"
        if self.on_bad_image == "fail":
            raise UserError(f"{message}; remove them or pass --on-bad-image skip")
        logs["skipped_samples"] = skipped
        self.runtime.print0(f"{message}; each was replaced by a blank sample of weight 0")


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
    """

    def __init__(self, runtime, layers: list, batches, num_batches: int):
        super().__init__()
        self.runtime = runtime
        self.layers = layers
        self.batches = batches
        self.num_batches = num_batches
        self._iterator = None
        self._forward = None
        self._done_this_epoch = False

    def on_epoch_begin(self, epoch, logs=None):
        self._done_this_epoch = False

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
            self._iterator = iter(self.batches)
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
    return [layer for layer in model.submodules
            if isinstance(layer, keras.layers.BatchNormalization)]


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

    def row(self, epoch: int, logs: dict | None) -> dict:
        """One row of metrics.json: the 1-based epoch, its (averaged) metrics, its timings."""
        return {"epoch": epoch + 1, **{k: float(v) for k, v in (logs or {}).items()},
                **self.timings}


class LearningRateLog(keras.callbacks.Callback):
    def __init__(self, schedule):
        super().__init__()
        self.schedule = schedule

    def on_epoch_end(self, epoch, logs=None):
        logs["learning_rate"] = float(self.schedule(self.model.optimizer.iterations))


class SaveCheckpoint(keras.callbacks.Callback):
    """Rank 0: a checkpoint after every completed epoch (a stop writes its own, see train.fit)."""

    def __init__(self, checkpoints, request: StopRequest):
        super().__init__()
        self.checkpoints = checkpoints
        self.request = request

    def on_epoch_end(self, epoch, logs=None):
        if not self.request.saved:
            self.checkpoints.save(resume_epoch=epoch + 1)


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
        self.rows.append(self.throughput.row(epoch, logs))
        self.run_dir.write_csv("metrics.csv", self.rows)
        self.run_dir.write_json("metrics.json", self.rows)
        self.run_dir.write_with("curves.png", lambda path: plot_curves(self.rows, path))

