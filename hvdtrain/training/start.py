"""Where a run starts: its run directory (checked and locked by rank 0), the checkpoint it
resumes from and what earlier runs recorded, and the experiment it belongs to."""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import platform
import socket
from dataclasses import dataclass

import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain import KERAS, __version__, ranklog, tracking
from hvdtrain.training.checkpoint import Checkpoints, restore_or_start, variables_bytes
from hvdtrain.training.config import TrainConfig
from hvdtrain.data import ImageDatasets
from hvdtrain.launcher_env import job_label
from hvdtrain.models.user import is_user_model
from hvdtrain.training.plan import TrainingPlan, resize_notes
from hvdtrain.rundir import CONFIG_FILE, FINGERPRINT, RunDir, ensure_writable, is_url
from hvdtrain.runtime import Runtime
from hvdtrain.task import Datasets
from hvdtrain.tracking import Tracker
from hvdtrain.training.optimizers import rate_factor, rescale_rate


@dataclass
class RunStart:
    """Where a run starts: its run directory and checkpoints, and what earlier runs did."""

    run_dir: RunDir
    checkpoints: Checkpoints
    initial_epoch: int
    """Epochs already completed (from a checkpoint)."""
    initial_step: int
    """Steps of the next epoch already trained (a checkpoint written within it), else 0."""
    restored_from: str | None
    """The checkpoint this run resumed from, or None."""
    rows: list[dict]
    """Rank 0: the metrics.json rows of the epochs done (empty on the other ranks)."""


def claim_run_dir(program: str, config: TrainConfig, runtime: Runtime,
                  experiment: dict[str, str], state_variables: list,
                  banner_text: str, file_table=None) -> RunDir:
    """The run directory, checked and locked by rank 0 (every rank refused alike), and every
    rank's own log beside it."""
    world = runtime.world
    run_dir = RunDir(config.run_dir, is_chief=world.is_chief)
    # Rank 0 also takes the run directory's lock, held until this process ends: a second job on
    # the same directory (a duplicate sbatch, a requeued job whose old copy still runs) is
    # refused on every rank, naming the holder, before it writes anything. So is a directory
    # that recorded another experiment, whose checkpoint would go on training on this data.
    lock_note = ensure_writable(run_dir, runtime, bytes_needed=(config.keep_checkpoints + 1)
                                * variables_bytes(state_variables) + 2**20,
                                job=job_label(os.environ), fingerprint=experiment,
                                accept_change=config.accept_experiment_change,
                                file_table=file_table)
    if config.rank_logs and not is_url(run_dir.path):
        # Every rank's own output, kept beside the run: after a failure on another node the
        # launcher's terminal may be gone, and its stream interleaves all ranks.
        ranklog.start(run_dir.path, world.rank, header=rank_log_header(program, world)
                      + ("\n" + banner_text if world.is_chief and banner_text else ""))
    if lock_note:
        runtime.print0(lock_note)
    return run_dir


def resume(config: TrainConfig, runtime: Runtime, plan: TrainingPlan, run_dir: RunDir,
           model: keras.Model, state_variables: list, precision: str, schedule,
           datasets: Datasets) -> RunStart:
    """Every rank at the newest checkpoint's state (rank 0's, broadcast), or at the start."""
    world = runtime.world
    checkpoints = Checkpoints(run_dir, model, config.keep_checkpoints, plan_facts={
        "steps_per_epoch": plan.steps_per_epoch, "workers": plan.num_workers,
        "per_worker_batch": plan.per_worker_batch_size, "learning_rate": plan.learning_rate})
    earlier = run_dir.read_json(CONFIG_FILE, {}) if world.is_chief else {}
    point = restore_or_start(
        checkpoints, runtime, state_variables, plan.steps_per_epoch,
        lambda: written_otherwise(run_dir, config, precision),
        starts_anywhere_but(config, runtime, plan, datasets))
    initial_epoch, restored_from = point.epoch, point.checkpoint
    # Rank 0 keeps the metrics of the epochs a resumed run already has (and drops any later
    # rows an interrupted run wrote after its last checkpoint).
    earlier_rows = run_dir.read_json("metrics.json", []) if world.is_chief and restored_from else []
    rows = [row for row in earlier_rows if row.get("epoch", 0) <= initial_epoch]
    if restored_from:
        # The plan the checkpoint was written under: a resume on another world size (a lost
        # node, a requeue into a bigger allocation) says what moved with it.
        resized = resize_notes(earlier.get("plan"), plan)
        if not isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            # A plain rate is the optimizer's own variable, restored with it (as a callback such
            # as ReduceLROnPlateau left it): scaled by the new plan's rate over the old one's,
            # it is what a fresh start at this size would have had after the same reductions.
            rescale_rate(model.optimizer, runtime.from_chief(
                lambda: rate_factor(point.written_under or earlier.get("plan"), plan)))
        runtime.print0(f"resuming from {restored_from}: {initial_epoch} epoch(s)"
                       + (f" and {point.step} of {plan.steps_per_epoch} steps" if point.step
                          else "") + " done"
                       + (f"; resized: {', '.join(resized)} (the schedule follows the epochs)"
                          if resized else "")
                       + (f"; it was written after {point.rerun_steps} step(s) of epoch "
                          f"{initial_epoch + 1}, which starts again from its first step "
                          f"({point.rerun_because}): its weights trained on those step(s) "
                          "already" if point.rerun_steps else ""))
    return RunStart(run_dir, checkpoints, initial_epoch, point.step, restored_from, rows)


def starts_anywhere_but(config: TrainConfig, runtime: Runtime, plan: TrainingPlan,
                        datasets: Datasets) -> str | None:
    """None when a checkpoint written within an epoch can resume at its step, with every batch
    trained once, else why not: the data can start at any step (hvdtrain's image data: its
    passes are functions of their index, ``data.pipeline.TrainingStart``), no accumulated
    gradients were lost with the checkpoint, and every epoch consumes exactly its steps'
    batches (steps_per_execution dividing them)."""
    start = getattr(datasets, "start", None)
    per_call = runtime.steps_per_call(config.steps_per_execution)
    if start is None:
        return "a job's own datasets cannot start part-way"
    if not start.exact:
        return "TFRecords read through a cache cannot start part-way"
    if config.grad_accum_steps > 1:
        return "its accumulated gradients were not kept (--grad-accum-steps)"
    if plan.steps_per_epoch % per_call:
        return (f"--steps-per-execution {per_call} does not divide the {plan.steps_per_epoch} "
                "steps per epoch")
    return None


def written_otherwise(run_dir: RunDir, config: TrainConfig, precision: str) -> str | None:
    """Rank 0, when no checkpoint restores: the flag whose change made the checkpoints another
    shape (another Keras; a loss scale in the optimizer, or none), from config.json, or None."""
    earlier = run_dir.read_json(CONFIG_FILE, {})
    if not isinstance(earlier, dict):
        return None
    keras_then = (earlier.get("config") or {}).get("keras")
    if keras_then and keras_then != config.keras:
        return (f"the checkpoints in {run_dir.checkpoints} were written by Keras {keras_then} "
                f"and this run is Keras {config.keras}, whose checkpoints differ: resume with "
                f"--keras {keras_then}, or use another --run-dir")
    precision_then = earlier.get("precision")
    if precision_then and (precision_then == "mixed_float16") != (precision == "mixed_float16"):
        return (f"the checkpoints in {run_dir.checkpoints} were written with --precision "
                f"{precision_then} and this run uses {precision}; mixed_float16's optimizer "
                f"holds a loss scale, the others' none: resume with --precision "
                f"{precision_then}, or use another --run-dir")
    return None


def record_start(program: str, config: TrainConfig, runtime: Runtime, plan: TrainingPlan,
                 start: RunStart, precision: str, experiment: dict[str, str],
                 datasets: Datasets) -> Tracker:
    """The tracker started (rank 0's; a NullTracker elsewhere) and config.json written, with
    the classes' names of hvdtrain's image data (what ``hvdtrain export`` serves)."""
    class_names = datasets.class_names if isinstance(datasets, ImageDatasets) else ()
    world = runtime.world
    tracker = tracking.start(program, config, runtime, start.run_dir, {
        "config": config.to_dict(), "plan": plan.to_dict(), "world": dataclasses.asdict(world),
        "run": {"program": program, "precision": precision, **_versions()}}, start.rows,
        job=job_label(os.environ))
    start.run_dir.write_json(CONFIG_FILE, {
        "program": program, "config": config.to_dict(), "plan": plan.to_dict(),
        "world": dataclasses.asdict(world), "precision": precision,
        "resumed_from": start.restored_from, "versions": _versions(), FINGERPRINT: experiment,
        **({"class_names": list(class_names)} if class_names else {})})
    return tracker


def fingerprint(program: str, config: TrainConfig, datasets: Datasets,
                plan: TrainingPlan) -> dict[str, str]:
    """What the run trains, as its run directory records it (rundir.experiment_changes): the
    model (--model, a file by its name; else the job's own), and for hvdtrain's image data its
    kind, classes and sample count (from the listing rank 0 made: nothing is read again), the
    image shape, the split and the (file, label) table. Not where the data or the model file
    sit: a job that stages its data on a node's local disk, or a moved checkout, resumes its
    run."""
    model = str(getattr(config, "model", None) or program)  # hvdtrain.cnn's --model
    if is_user_model(model):
        path, _, function = model.rpartition(":")
        model = f"{os.path.basename(path)}:{function}"
    parts = {"model": model}
    if isinstance(datasets, ImageDatasets):
        names = hashlib.sha256("\n".join(datasets.class_names).encode()).hexdigest()[:8]
        samples = plan.num_train_samples + plan.num_validation_samples
        parts.update(
            # As run directories recorded it before "samples" (compared only for those).
            data=f"{config.source.label}, {samples} samples",
            # An image folder and the TFRecords converted from it are the same samples.
            samples=f"{samples}, " + ("from image files" if config.source.from_files
                                      else config.source.label),
            classes=f"{len(datasets.class_names)} (names {names})",
            images="x".join(map(str, datasets.image_shape)))
        # Which samples are validation and which file has which label: a resume under another
        # seed or fraction would validate on samples it trained on, one with two class folders
        # swapped would train with the labels inverted (data.listing.split_identity,
        # label_table_digest; the converter records the same, so a folder's TFRecords resume it).
        identity = datasets.identity
        if "split" in identity:
            parts["split"] = identity["split"]
        if "labels" in identity:
            parts["labels"] = f"(file, label) table {identity['labels'][:12]}"
    return parts


def rank_log_header(program: str, world) -> str:
    return (f"{program}: rank {world.rank} of {world.size} on {socket.gethostname()}, pid "
            f"{os.getpid()}, started {datetime.datetime.now().isoformat(timespec='seconds')}")


def keras_name() -> str:
    """'Keras 3.15.1' or 'Keras 2.18.0 (tf_keras)': for the banner and config.json."""
    return f"Keras {keras.__version__}" + (" (tf_keras)" if KERAS == "2" else "")


def _versions() -> dict:
    return {"hvdtrain": __version__, "tensorflow": tf.__version__,
            "keras": keras_name(), "python": platform.python_version()}
