"""Checkpoints and resume, in one place: what a checkpoint holds, who writes it, how a run resumes.

* Rank 0 alone writes and reads checkpoints (run directories need not be shared between nodes);
  ``tf.train.CheckpointManager`` makes each save atomic and keeps the newest few.
* A checkpoint holds the model, the optimizer (slots, step counter, loss scale) and the epoch to
  resume at. ``restore_or_start`` reads the newest loadable one on rank 0 and broadcasts every
  variable of it, so all ranks continue from identical state.
* ``SaveCheckpoint`` writes one after every completed epoch and, when asked, every N steps or
  minutes within one; a preemption stop writes its own at once (``SaveOnStop``, called by
  ``preemption.PreemptionCheck``). A run resumed from one written within an epoch goes on at its
  next step when the data can start there (hvdtrain's image data), else it re-runs that epoch.
"""
from __future__ import annotations

import logging
import posixpath
import re
import time
from dataclasses import dataclass
from typing import Callable

import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain.errors import UserError, first_line, op_error_line
from hvdtrain.training.preemption import StopRequest
from hvdtrain.rundir import RunDir


class Checkpoints:
    """Model + optimizer + "epoch to resume at", via tf.train.CheckpointManager on rank 0.

    CheckpointManager writes the data files first and only then atomically rewrites the
    ``checkpoint`` index that names the latest one, so a crash mid-save leaves the previous
    checkpoint as the latest; it also deletes all but the newest ``keep``.
    """

    def __init__(self, run_dir: RunDir, model: keras.Model, keep: int,
                 plan_facts: dict | None = None):
        self.model = model
        self.run_dir = run_dir
        self.plan_facts = plan_facts
        """What the position of a checkpoint written within an epoch depends on (steps per
        epoch, workers, batch per worker) and the plan's rate: written beside every checkpoint
        (``ckpt-N.json``), since config.json may already hold a later start's plan."""
        self.resume_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="resume_epoch")
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                              resume_epoch=self.resume_epoch)
        if run_dir.is_chief:
            _recover_index(run_dir)
        self.manager = (tf.train.CheckpointManager(self.checkpoint, run_dir.checkpoints,
                                                   max_to_keep=keep)
                        if run_dir.is_chief else None)
        self.refused_non_finite = False
        """A save was refused for weights that are not finite (said once)."""

    def restore_latest(self, written_otherwise: Callable[[], str | None] = lambda: None
                       ) -> tuple[int, str | None]:
        """Rank 0: restore the newest loadable checkpoint -> (epoch to resume at, its path).

        A checkpoint that cannot be read (truncated, emptied or bit-flipped by a crash or a
        full disk: its reader fails, or TensorFlow's checksums do) is named in one line and
        the next older one is tried; the next save reuses its number and replaces it. One that
        reads but does not fit this model counts against the run directory, not the file.
        """
        unreadable, mismatched = [], []
        for path in reversed(self.manager.checkpoints):
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
                return int(self.resume_epoch.numpy()), path
            except (AssertionError, ValueError) as error:  # read, but not this model's values
                mismatched.append(f"{path}: {first_line(error)}")
            except Exception as error:  # noqa: BLE001 - a damaged file fails its reader anyhow
                # (IndexError from a truncated one, DataLossError from a checksum)
                unreadable.append(path)
                print(f"checkpoint {path} cannot be read ({_reading_error(error)}); trying the "
                      "next older one", flush=True)
        if unreadable or mismatched:
            # The failed restores stay attached to the model: as the process ends, TensorFlow
            # would log a WARNING for every value the checkpoint holds that this model lacks,
            # under the one line below that already says so.
            tf.get_logger().setLevel(logging.ERROR)
            # A flag that changes what the checkpoint holds (another Keras, a loss scale or none)
            # is named: the files are fine.
            why = written_otherwise()
            if why:
                raise UserError(why)
        if mismatched:
            raise UserError(f"no checkpoint in {self.manager.directory} could be restored into "
                            f"this model (first: {mismatched[0]}); use another --run-dir")
        if unreadable:
            raise UserError(f"no checkpoint in {self.manager.directory} can be read (each is "
                            "named above): move the run directory away to start afresh, or use "
                            "another --run-dir")
        return 0, None

    def save(self, resume_epoch: int, step: int = 0) -> str | None:
        """Rank 0: a checkpoint of the state now, to resume at epoch ``resume_epoch`` (0-based)
        after its first ``step`` steps; beside it ``ckpt-N.json`` says so, with the plan's facts
        (another one's steps differ). None, and nothing written, while a weight is NaN or
        infinite."""
        if not _all_finite(self.model.weights):
            # On N ranks a NaN that one rank's loss caught reaches every rank's weights through
            # the averaged gradient before the ranks agree to stop (TerminateOnNaN on that rank),
            # and rank 0's own loss may still be finite: a checkpoint now would resume as NaN.
            if not self.refused_non_finite:
                self.refused_non_finite = True
                print(f"not writing a checkpoint: the model's weights hold NaN or infinite "
                      f"values; the run keeps {self.manager.latest_checkpoint or 'no checkpoint'}",
                      flush=True)
            return None
        self.resume_epoch.assign(resume_epoch)
        path = self.manager.save()
        if self.plan_facts is not None:
            self.run_dir.write_json(_position_file(path), {"epoch": resume_epoch, "step": step,
                                                           **self.plan_facts})
            kept = {_position_file(kept) for kept in self.manager.checkpoints}
            for name in tf.io.gfile.listdir(self.run_dir.checkpoints):
                if name.endswith(".json") and f"checkpoints/{name}" not in kept:
                    tf.io.gfile.remove(posixpath.join(self.run_dir.checkpoints, name))
        return path

    def written_under(self, path: str) -> dict:
        """Rank 0: what ``save`` wrote beside the checkpoint ``path`` ({} for one written
        before hvdtrain wrote it, or unreadable)."""
        found = self.run_dir.read_json(_position_file(path), {})
        return found if isinstance(found, dict) else {}


def _all_finite(variables) -> bool:
    """Whether every floating-point value of ``variables`` is finite (one answer from the
    device, not the weights)."""
    checks = [tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(variable)))
              for variable in variables if tf.as_dtype(variable.dtype).is_floating]
    return bool(tf.reduce_all(checks)) if checks else True


def _position_file(path: str) -> str:
    return f"checkpoints/{posixpath.basename(path)}.json"


def checkpoint_numbers(directory: str) -> list[int]:
    """The N of every ``ckpt-N`` checkpoint in ``directory`` (by its ``.index`` file), in
    ascending order; none when there is no such directory."""
    if not tf.io.gfile.isdir(directory):
        return []
    return sorted(int(found.group(1)) for found in map(
        re.compile(r"ckpt-(\d+)\.index").fullmatch, tf.io.gfile.listdir(directory)) if found)


def _recover_index(run_dir: RunDir) -> None:
    """Rank 0: rewrite CheckpointManager's ``checkpoint`` index from the checkpoints beside it
    when it cannot be read (emptied by a node crash, garbled): the manager would fail on an empty
    one and start afresh, forking the run's history, on any other, without a word."""
    directory = run_dir.checkpoints
    index = posixpath.join(directory, "checkpoint")
    if not tf.io.gfile.exists(index):
        return
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel(logging.ERROR)  # TensorFlow's two warnings for a garbled one
    try:
        if tf.train.get_checkpoint_state(directory) is not None:
            return
    except ValueError:  # "Invalid checkpoint state"
        pass
    finally:
        logger.setLevel(level)
    numbers = checkpoint_numbers(directory)
    if numbers:  # CheckpointState's text format; the manager lists only timestamped ones
        run_dir.write_text("checkpoints/checkpoint", "".join(
            [f'model_checkpoint_path: "ckpt-{numbers[-1]}"\n']
            + [f'all_model_checkpoint_paths: "ckpt-{number}"\n' for number in numbers]
            + [f"all_model_checkpoint_timestamps: {time.time()}\n" for _ in numbers]))
    else:
        tf.io.gfile.remove(index)
    print(f"{index} cannot be read; rebuilt it from the {len(numbers)} checkpoint(s) beside it",
          flush=True)


def _reading_error(error: Exception) -> str:
    """``Type: first line``, without the internal op name TensorFlow wraps its errors in."""
    return f"{type(error).__name__}: {op_error_line(error)}"


def variables_bytes(variables) -> int:
    return sum(v.shape.num_elements() * v.dtype.size for v in variables)


def training_state(model: keras.Model) -> list[tf.Variable]:
    """Every variable a checkpoint of the model and its optimizer holds, each once, as the
    ``tf.Variable`` that stores it (what horovod's broadcast assigns to).

    Read from the checkpoint's object graph rather than ``model.variables`` and
    ``optimizer.variables``: tf_keras' LossScaleOptimizer lists neither its current loss scale nor
    its good-step counter there, and a rank that missed them after a resume would unscale its
    gradients by another factor than rank 0 (the replicas drift apart). Keras 3 variables wrap
    their ``tf.Variable`` (``.value`` outside a layer's call).
    """
    keras_variable = getattr(keras, "Variable", None)  # Keras 3 only
    root = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    unique = {}
    for trackable in tf.train.TrackableView(root).descendants():  # holds root weakly
        if keras_variable is not None and isinstance(trackable, keras_variable):
            trackable = trackable.value
        if isinstance(trackable, tf.Variable):
            unique.setdefault(id(trackable), trackable)
    return list(unique.values())


@dataclass(frozen=True)
class StartPoint:
    """Where every rank starts: the epoch, and the steps of it already trained."""

    epoch: int
    """Whole epochs done."""
    step: int = 0
    """Steps of the next epoch done (a checkpoint written within an epoch); 0 at its start."""
    checkpoint: str | None = None
    """The checkpoint it came from, or None for a fresh start."""
    written_under: dict | None = None
    """The checkpoint's ``ckpt-N.json`` (the plan's facts when it was written), or None."""
    rerun_steps: int = 0
    """Steps of the epoch the checkpoint was written after that run again: its epoch starts
    again from its first step, with weights that trained on them (``rerun_because``)."""
    rerun_because: str | None = None
    """Why the data could not start at the checkpoint's step."""


def restore_or_start(checkpoints: Checkpoints, runtime, state_variables: list,
                      steps_per_epoch: int,
                      written_otherwise: Callable[[], str | None],
                      starts_anywhere_but: str | None) -> StartPoint:
    """Where to start, the same on every rank, and every rank holding the state to start from:
    rank 0's restored (or freshly initialised) variables.

    A checkpoint written within an epoch (every N steps, or at a stop) says at which step
    (``ckpt-N.json``): when the data can start at any step (``starts_anywhere_but`` None, else
    why not) and under the plan it was written under (the same steps per epoch, workers and
    batch per worker: the same passes on every rank), the run goes on at the next step;
    otherwise that epoch starts again, and the StartPoint says why. The optimizer's step count is
    set to match, so the schedule follows the epochs (and a resume on another world size stays
    right)."""
    def restore() -> StartPoint:
        epoch, path = checkpoints.restore_latest(written_otherwise)
        facts = checkpoints.written_under(path) if path else {}
        step = int(facts.get("step", 0)) if facts.get("epoch") == epoch else 0
        rerun, because = 0, None
        if 0 < step < steps_per_epoch:
            changed = [name for name, value in (checkpoints.plan_facts or {}).items()
                       if name != "learning_rate" and facts.get(name) != value]
            because = starts_anywhere_but or (
                f"the plan changed since ({', '.join(changed).replace('_', ' ')})"
                if changed else None)
            if because:
                rerun, step = step, 0
        checkpoints.model.optimizer.iterations.assign(epoch * steps_per_epoch + step)
        return StartPoint(epoch, step, path, facts or None, rerun, because)

    # Rank 0 alone reads the checkpoint; everyone learns where to start, and the broadcast hands
    # its weights and optimizer state to every rank (fresh random initialisations differ per
    # rank). No other rank opens a checkpoint, so the ranks cannot resume from different ones,
    # however many rank 0 finds damaged and skips.
    start = runtime.from_chief(restore)
    runtime.broadcast_variables(state_variables)
    return start


class SaveCheckpoint(keras.callbacks.Callback):
    """Rank 0: a checkpoint after every completed epoch (a stop writes its own: SaveOnStop), and
    within epochs every ``every_steps`` steps or ``every_minutes`` minutes.

    One written within an epoch holds that epoch as the one to resume at, and the optimizer's
    step count, from which ``restore_or_start`` finds the step."""

    def __init__(self, checkpoints: Checkpoints, request: StopRequest,
                 every_steps: int | None = None, every_minutes: float | None = None):
        super().__init__()
        self._supports_tf_logs = True  # its batch hook reads no metrics
        self.checkpoints = checkpoints
        self.request = request
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self.steps_since, self.saved_at, self.last_batch = 0, time.monotonic(), 0

    def on_epoch_begin(self, epoch, logs=None):
        self.last_batch = 0

    def on_train_batch_end(self, batch, logs=None):
        if not (self.every_steps or self.every_seconds):
            return
        # Counted in batches, not calls: with steps_per_execution one call covers many.
        self.steps_since += batch + 1 - self.last_batch
        self.last_batch = batch + 1
        if batch + 1 >= self.params["steps"] or self.request.agreed or self.request.by_job:
            return  # the epoch's end (or the stop) writes its own
        if self.model.stop_training or self.request.job_asked:
            return  # a stop the job asked for (a NaN?) is being agreed on: keep the last one
        if (self.every_steps and self.steps_since >= self.every_steps) or (
                self.every_seconds and time.monotonic() - self.saved_at >= self.every_seconds):
            self._save(resume_epoch=self.request.epoch,
                       step=self.request.steps_before + batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        # A stop the job's callbacks made mid-epoch (TerminateOnNaN) keeps the last whole
        # epoch's checkpoint: these weights are no epoch's (and may be NaN).
        if not self.request.saved and not (self.request.by_job and self.request.mid_epoch):
            self._save(resume_epoch=epoch + 1)

    def _save(self, resume_epoch: int, step: int = 0) -> None:
        self.checkpoints.save(resume_epoch=resume_epoch, step=step)
        self.steps_since, self.saved_at = 0, time.monotonic()


class SaveOnStop:
    """``PreemptionCheck``'s ``on_stop``: the moment the ranks agree to stop, rank 0 writes the
    checkpoint, before Keras' end-of-epoch validation eats into Slurm's warning time; the
    epoch's own ``SaveCheckpoint`` then writes nothing more."""

    def __init__(self, checkpoints: Checkpoints, request: StopRequest, is_chief: bool):
        self.checkpoints = checkpoints
        self.request = request
        self.is_chief = is_chief

    def __call__(self, epoch: int, mid_epoch: bool, step: int = 0) -> None:
        if self.is_chief:  # resumed at its step (restore_or_start), or the epoch re-run
            self.checkpoints.save(resume_epoch=epoch if mid_epoch else epoch + 1,
                                  step=step if mid_epoch else 0)
            self.request.saved = True
