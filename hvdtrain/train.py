"""The training run every job shares: data, plan, compile, resume, fit, save.

``hvdtrain/job.py`` runs it for every job with the job's ``Task`` (``hvdtrain/task.py``: how to
build its model, its loss and metrics, and optionally its own datasets); the built-in jobs
(``hvdtrain.cnn``, ``hvdtrain.autoencoder``) are tasks on the image data hvdtrain reads itself.
The rest (scaling, checkpoints, preemption, callbacks, outputs) is the same for every job and
every backend.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import os
import platform
import socket
import sys
from dataclasses import dataclass
from typing import Callable

import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain import KERAS, __version__, ranklog, tracking
from hvdtrain.callbacks import (BatchNormStatistics, DecodeFailureReport, LearningRateLog,
                                MetricsLog, Progress, StallWatchdog, TensorBoardLog,
                                Throughput, TrackEpochs,
                                batch_norm_layers)
from hvdtrain.checkpoint import (Checkpoints, SaveCheckpoint, SaveOnStop, restore_or_start,
                                 training_state, variables_bytes)
from hvdtrain.config import ImageConfig, TrainConfig
from hvdtrain.data import (ImageDatasets, build_pipelines, choose_data_cache,
                           disk_cache_failures_in_one_line, load_listing)
from hvdtrain.errors import UserError, as_one_line, stop_status
from hvdtrain.launcher_env import job_label
from hvdtrain.models.user import is_user_model
from hvdtrain.plan import TrainingPlan, make_plan, per_worker_batch, resize_notes
from hvdtrain.preemption import PreemptionCheck, StopRequest, StopSignals, describe_stop
from hvdtrain.rundir import (CONFIG_FILE, FINGERPRINT, MODEL_FILE, RunDir, ensure_writable,
                             is_url)
from hvdtrain.runtime import Runtime, make_runtime, placement, select_backend
from hvdtrain.task import Datasets, Shard, Task
from hvdtrain.timeline import Timeline
from hvdtrain.tracking import Tracker
from hvdtrain.training.profile import InputWait, input_bound_note
from hvdtrain.training.optimizers import (build_optimizer, describe_optimizer,
                                          learning_rate_schedule, rate_factor, rescale_rate)

#: What rank 0 exports for a model that cannot be rebuilt from its config (``export``).
WEIGHTS_FILE = "model.weights.h5"


@dataclass
class TrainingResult:
    model: keras.Model
    plan: TrainingPlan
    datasets: Datasets
    run_dir: RunDir
    initial_epoch: int
    """Epochs already completed when this run started (from a checkpoint)."""
    rows: list[dict]
    """Per-epoch metrics of every completed epoch, including those of earlier runs."""
    exit_code: int
    """0, or EXIT_PREEMPTED/143 when a signal stopped the run after a checkpoint."""


def start_runtime(config: TrainConfig) -> Runtime:
    """The backend a job's config asks for, started (horovod ranks, a strategy, one process)."""
    # Gradient accumulation is horovod's (backward_passes_per_step), so it keeps horovod even
    # where `auto` would otherwise run a single process.
    needs_horovod = config.grad_accum_steps > 1
    backend = select_backend(config.backend, needs_horovod=needs_horovod)
    # Resolved first, so `auto` landing on a strategy is refused before anything starts.
    if KERAS == "3" and backend == "tpu":
        raise UserError("Keras 3 (the default) runs on the horovod, single and mirrored "
                        "backends; on 'tpu' it has never run here: pass --keras 2")
    if KERAS == "3" and backend == "mirrored" and (config.steps_per_execution or 1) > 1:
        # Keras 3.15's multi-step function under MirroredStrategy fails at its first call
        # ("You must feed a value for placeholder tensor ..."); one step per call trains.
        raise UserError("--steps-per-execution above 1 with --backend mirrored fails inside "
                        "Keras 3: pass --keras 2, or --steps-per-execution 1")
    return make_runtime(backend, threads_per_worker=config.threads_per_worker,
                        needs_horovod=needs_horovod)


def check_keras(config: TrainConfig) -> None:
    """The config's Keras must be the one this process imported (it cannot change afterwards)."""
    if config.keras != KERAS:
        raise UserError(f"this process runs Keras {KERAS} (chosen when hvdtrain was imported), "
                        f"but the config asks for Keras {config.keras}: pass --keras "
                        f"{config.keras} on the command line or set HVDTRAIN_KERAS="
                        f"{config.keras} before importing hvdtrain")


def keras_name() -> str:
    """'Keras 3.15.1' or 'Keras 2.18.0 (tf_keras)': for the banner and config.json."""
    return f"Keras {keras.__version__}" + (" (tf_keras)" if KERAS == "2" else "")


def run(program: str, config: TrainConfig, runtime: Runtime, task: Task,
        timeline: Timeline | None = None) -> TrainingResult:
    """Data -> plan -> banner -> fit: a whole job once the runtime is up. ``timeline``: the
    job's, with its milestones so far (default: one that starts now)."""
    timeline = timeline or Timeline.start()
    check_keras(config)
    tracking.check(config, runtime)  # before the data is read and the run directory made
    request = StopRequest()
    input_wait = InputWait()
    with StopSignals(runtime.world.rank, request):  # a stop signal is recorded, never fatal
        if task.datasets is None:
            plan, datasets, notes = image_data(config, runtime, timeline, input_wait)
        else:
            plan, datasets, notes = task_data(config, runtime, task, input_wait)
            timeline.mark("data_listed")
        summary_lines = banner(program, runtime, datasets, notes, plan, config)
        runtime.print0(summary_lines)
        timeline.mark("pipelines_built")
        return fit(program, config, runtime, plan, datasets, task, request, timeline,
                   summary_lines, input_wait)


def image_data(config: TrainConfig, runtime: Runtime, timeline: Timeline,
               input_wait: InputWait | None = None
               ) -> tuple[TrainingPlan, ImageDatasets, tuple[str, ...]]:
    """The image data the flags name: rank 0 lists and checks it, everyone plans and shards."""
    if not isinstance(config, ImageConfig):
        raise UserError("this task reads hvdtrain's image data, which needs an ImageConfig "
                        "(or give the Task a datasets builder)")
    listing = load_listing(config, runtime)
    plan = plan_for(config, runtime, listing.train.num_samples, listing.validation.num_samples)
    timeline.mark("data_listed")
    # A process driving several replicas (tf.distribute) feeds all of them: Keras splits its
    # batch between the replicas. A horovod rank feeds exactly one.
    per_process = runtime.world.replicas_per_process
    validation_batch_size = plan.validation_batch_size * per_process
    # Each rank sizes its own cache against its node's memory: nodes may differ, and no rank
    # waits for another to decide. The banner shows rank 0's choice.
    cache = choose_data_cache(listing, runtime.world, config.cache,
                              budget_gb=config.cache_budget_gb,
                              validation_samples=plan.validation_steps * validation_batch_size,
                              augment=config.augment)
    datasets = build_pipelines(
        listing, runtime.world,
        batch_size=plan.per_worker_batch_size * per_process,
        validation_batch_size=validation_batch_size,
        validation_steps=plan.validation_steps, seed=config.seed, cache=cache,
        tfrecord_sharding=config.tfrecord_sharding, augment=config.augment,
        threads=runtime.devices.threads, prefetch_to=runtime.devices.prefetch_to,
        input_wait=input_wait)
    return plan, datasets, (*listing.notes, cache.describe())


def task_data(config: TrainConfig, runtime: Runtime, task: Task,
              input_wait: InputWait | None = None
              ) -> tuple[TrainingPlan, Datasets, tuple[str, ...]]:
    """A job's own datasets: built per rank for the planned batch, then counted and agreed on."""
    world = runtime.world
    try:
        per_worker = per_worker_batch(config.batch_size, config.batch_policy, world.num_replicas)
    except ValueError as error:
        raise UserError(str(error)) from None
    batch_size = per_worker * world.replicas_per_process
    datasets = task.datasets(Shard(rank=world.rank, num_shards=world.size, batch_size=batch_size,
                                   validation_batch_size=batch_size, seed=config.seed,
                                   config=config))
    if not isinstance(datasets, Datasets):
        raise UserError(f"the task's datasets builder must return hvdtrain.Datasets, got "
                        f"{type(datasets).__name__}")
    check_elements(datasets)
    steps, validation_steps = agreed_batches(runtime, datasets, config.steps_per_epoch)
    global_batch = per_worker * world.num_replicas
    plan = plan_for(config, runtime, steps * global_batch,
                    validation_steps * global_batch)
    # Endless, so that every epoch (Keras stops each after steps_per_epoch) has its batches.
    train = datasets.train if datasets.train.cardinality() == tf.data.INFINITE_CARDINALITY \
        else datasets.train.repeat()
    if input_wait is not None:
        train = input_wait.timed(train)
    validation = datasets.validation if validation_steps else None
    return plan, dataclasses.replace(datasets, train=train, validation=validation), ()


def check_elements(datasets: Datasets) -> None:
    """Keras trains on (inputs, targets) or (inputs, targets, sample_weights) elements; anything
    else would end in a traceback inside fit. Every rank builds the same structure, so every rank
    refuses alike (before the first collective)."""
    for split, dataset in (("training", datasets.train), ("validation", datasets.validation)):
        if dataset is None:
            continue
        spec = dataset.element_spec
        if isinstance(spec, tuple) and len(spec) in (2, 3):
            continue
        raise UserError(f"the task's {split} dataset must yield (inputs, targets) or (inputs, "
                        f"targets, sample_weights) tuples; its elements are "
                        f"{_describe_element(spec)}")


def _describe_element(spec) -> str:
    if isinstance(spec, tf.TensorSpec):
        return f"single tensors of shape {spec.shape} ({spec.dtype.name})"
    if isinstance(spec, dict):
        return f"dicts with keys {', '.join(map(str, spec))}"
    if isinstance(spec, tuple):
        return f"tuples of {len(spec)}"
    return type(spec).__name__


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


def plan_for(config: TrainConfig, runtime: Runtime, num_train_samples: int,
             num_validation_samples: int) -> TrainingPlan:
    try:
        return make_plan(
            batch_size=config.batch_size, batch_policy=config.batch_policy,
            learning_rate=config.learning_rate, lr_scaling=config.lr_scaling,
            warmup_epochs=config.warmup_epochs, grad_accum_steps=config.grad_accum_steps,
            epochs=config.epochs, num_workers=runtime.world.num_replicas,
            num_train_samples=num_train_samples, num_validation_samples=num_validation_samples,
            steps_per_epoch=config.steps_per_epoch, lr_decay=config.lr_decay,
            lr_milestones=config.milestone_epochs(), lr_gamma=config.lr_gamma)
    except ValueError as error:
        raise UserError(str(error)) from None


def banner(program: str, runtime: Runtime, datasets: Datasets, notes: tuple[str, ...],
           plan: TrainingPlan, config: TrainConfig) -> str:
    """The start-up summary. A collective (it gathers every rank's host): call it on all ranks."""
    world = runtime.world
    lines = [f"{program} | backend {world.backend} | {world.size} process(es), "
             f"{world.num_replicas} worker(s) | {runtime.devices.description} | {keras_name()}",
             f"placement: {placement(runtime.allgather_object(socket.gethostname()))}",
             f"data: {datasets.description}", *notes, *plan.describe(),
             f"run dir: {config.run_dir}"]
    return "\n".join(lines)


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


def fit(program: str, config: TrainConfig, runtime: Runtime, plan: TrainingPlan,
        datasets: Datasets, task: Task, request: StopRequest, timeline: Timeline,
        banner_text: str = "", input_wait: InputWait | None = None) -> TrainingResult:
    """Model -> run directory -> resume -> tracker -> callbacks -> model.fit -> finish, on
    every rank (each step's collectives are entered by all of them)."""
    precision = seed_and_precision(config, runtime)
    train, validation = model_data(datasets, task)
    schedule = learning_rate_schedule(plan)
    model = build_and_compile(config, runtime, task, datasets, train.element_spec, schedule)
    timeline.mark("model_compiled")
    state_variables = training_state(model)
    experiment = fingerprint(program, config, datasets, plan)
    run_dir = claim_run_dir(program, config, runtime, experiment, state_variables, banner_text,
                            file_table=getattr(datasets, "identity", {}).get("files"))
    start = resume(config, runtime, plan, run_dir, model, state_variables, precision, schedule,
                   datasets)
    tracker = record_start(program, config, runtime, plan, start, precision, experiment)
    job_callbacks = make_job_callbacks(config, task, validation is not None)
    callbacks = training_callbacks(config, runtime, plan, datasets, model, train, schedule, start,
                                   tracker, request, timeline, job_callbacks, input_wait)
    timeline.mark("run_dir_ready")
    trains = train_epochs(config, runtime, plan, model, train, validation, callbacks,
                          start, tracker, request, getattr(datasets, "start", None))
    if timeline.seconds("training_done") is not None:  # fit ran (rank 0's Progress saw it end)
        timeline.mark("fit_returned")
    return finish_run(config, runtime, plan, datasets, model, start, tracker, request, trains,
                      timeline, job_callbacks)


def seed_and_precision(config: TrainConfig, runtime: Runtime) -> str:
    """Seed this rank's random draws and set Keras' precision policy; returns the precision
    ('fp32', 'mixed_float16', 'mixed_bfloat16')."""
    # Each rank draws its own dropout masks and augmentations (seed + rank): identical draws would
    # make N ranks N copies of one sample's noise. Weights still start equal: rank 0's are
    # broadcast by restore_or_start.
    keras.utils.set_random_seed(config.seed + runtime.world.rank)
    precision = runtime.default_precision() if config.precision == "auto" else config.precision
    keras.mixed_precision.set_global_policy("float32" if precision == "fp32" else precision)
    return precision


def model_data(datasets: Datasets, task: Task
               ) -> tuple[tf.data.Dataset, tf.data.Dataset | None]:
    """(training, validation) data as the model sees it: the task's ``to_pairs`` applied."""
    train, validation = datasets.train, datasets.validation
    if task.to_pairs is not None:
        train = with_targets(train, task.to_pairs)
        validation = with_targets(validation, task.to_pairs) if validation is not None else None
    return train, validation


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
    checkpoints = Checkpoints(run_dir, model, config.keep_checkpoints)
    earlier = run_dir.read_json(CONFIG_FILE, {}) if world.is_chief else {}
    point = restore_or_start(
        checkpoints, runtime, state_variables, plan.steps_per_epoch,
        lambda: written_otherwise(run_dir, config, precision),
        steps_then=lambda: (earlier.get("plan") or {}).get("steps_per_epoch"),
        # hvdtrain's image data starts at any step (data.pipeline.TrainingStart); a job's own
        # datasets re-run the epoch.
        exact_position=getattr(datasets, "start", None) is not None)
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
                lambda: rate_factor(earlier.get("plan"), plan)))
        runtime.print0(f"resuming from {restored_from}: {initial_epoch} epoch(s)"
                       + (f" and {point.step} of {plan.steps_per_epoch} steps" if point.step
                          else "") + " done"
                       + (f"; resized: {', '.join(resized)} (the schedule follows the epochs)"
                          if resized else ""))
    return RunStart(run_dir, checkpoints, initial_epoch, point.step, restored_from, rows)


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
                 start: RunStart, precision: str, experiment: dict[str, str]) -> Tracker:
    """The tracker started (rank 0's; a NullTracker elsewhere) and config.json written."""
    world = runtime.world
    tracker = tracking.start(program, config, runtime, start.run_dir, {
        "config": config.to_dict(), "plan": plan.to_dict(), "world": dataclasses.asdict(world),
        "run": {"program": program, "precision": precision, **_versions()}}, start.rows,
        job=job_label(os.environ))
    start.run_dir.write_json(CONFIG_FILE, {
        "program": program, "config": config.to_dict(), "plan": plan.to_dict(),
        "world": dataclasses.asdict(world), "precision": precision,
        "resumed_from": start.restored_from, "versions": _versions(), FINGERPRINT: experiment})
    return tracker


def training_callbacks(config: TrainConfig, runtime: Runtime, plan: TrainingPlan,
                       datasets: Datasets, model: keras.Model, train: tf.data.Dataset, schedule,
                       start: RunStart, tracker: Tracker, request: StopRequest,
                       timeline: Timeline, job_callbacks: list,
                       input_wait: InputWait | None = None) -> list:
    """Keras' callbacks, in the order they must run."""
    world = runtime.world
    throughput = Throughput(plan.global_batch_size, plan.num_workers, input_wait)
    callbacks = [
        *runtime.sync_callbacks(),  # first: the callbacks after it read averaged metrics
        throughput,
        LearningRateLog(schedule),
    ]
    stall_limit = runtime.stall_limit_seconds()
    if stall_limit:
        # A peer lost mid-allreduce (its link down) blocks horovod's own stall check; this one
        # has a thread of its own (see the callback).
        callbacks.append(StallWatchdog(stall_limit, world.rank))
    norm_layers = batch_norm_layers(model)
    if world.size > 1 and norm_layers and config.bn_recompute_batches:
        # Before validation and the checkpoint, which read the statistics (see the callback).
        callbacks.append(BatchNormStatistics(runtime, norm_layers, train,
                                             config.bn_recompute_batches))
    decode_failures = getattr(datasets, "decode_failures", ())
    if decode_failures:
        callbacks.append(DecodeFailureReport(runtime, decode_failures, config.on_bad_image))
    # The job's own, after the average (and the skipped samples' count): every rank's
    # EarlyStopping or ReduceLROnPlateau then reads the same numbers and decides the same.
    callbacks += job_callbacks
    if world.is_chief:
        callbacks.append(Progress(plan.global_batch_size, plan.steps_per_epoch, config.epochs,
                                  config.progress_seconds if _verbosity(world) == 2 else 0,
                                  timeline, print_line=runtime.print0))
        # Metrics before the checkpoint: a crash between the two then costs a repeated epoch,
        # never a missing row.
        callbacks += [MetricsLog(start.run_dir, start.rows, request, throughput),
                      SaveCheckpoint(start.checkpoints, request, config.checkpoint_every_steps,
                                     config.checkpoint_every_minutes),
                      # After the checkpoint: the tracker holds checkpointed epochs only.
                      TrackEpochs(tracker, start.rows, request)]
        profile = config.profile_step_range()
        if config.tensorboard or profile:
            # Keras' profile_batch counts the steps of this fit call from 1.
            callbacks.append(TensorBoardLog(start.run_dir.tensorboard,
                                            profile_batch=profile or 0))
    # Last: it holds back a stop the job's callbacks set on one rank until all agree.
    callbacks.append(PreemptionCheck(runtime, request, config.signal_check_every_steps,
                                     SaveOnStop(start.checkpoints, request, world.is_chief),
                                     agree_at_epoch_end=bool(job_callbacks)))
    return callbacks


def make_job_callbacks(config: TrainConfig, task: Task, has_validation: bool) -> list:
    """The job's own callbacks (``Task.callbacks``) and --early-stopping's, on every rank."""
    callbacks = list(task.callbacks()) if task.callbacks is not None else []
    for callback in callbacks:
        if not isinstance(callback, keras.callbacks.Callback):
            raise UserError(f"the task's callbacks builder must return Keras callbacks, got a "
                            f"{type(callback).__name__}")
    if config.early_stopping:
        callbacks.append(keras.callbacks.EarlyStopping(
            monitor="val_loss" if has_validation else "loss", patience=config.early_stopping))
    return callbacks


def describe_job_stop(request: StopRequest, callbacks: list) -> str:
    """Rank 0's line for a run the job's callbacks ended: which, and what it keeps."""
    epoch = request.epoch + 1
    reasons = []
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.EarlyStopping) and callback.stopped_epoch:
            reasons.append(f"{callback.monitor} did not improve for {callback.patience} "
                           f"epoch(s) (EarlyStopping; best {float(callback.best):.4g})")
        elif isinstance(callback, keras.callbacks.TerminateOnNaN) and request.mid_epoch:
            reasons.append("the loss became NaN or infinite (TerminateOnNaN)")
    if not reasons:
        names = ", ".join(sorted({type(callback).__name__ for callback in callbacks}))
        reasons.append(f"the job's callbacks asked to stop ({names})")
    if request.mid_epoch:
        return (f"stopped in epoch {epoch}: {'; '.join(reasons)}; the epoch was cut short, so "
                f"the run keeps the checkpoint of epoch {epoch - 1} and exports no model")
    return f"stopped after epoch {epoch}: {'; '.join(reasons)}"


def train_epochs(config: TrainConfig, runtime: Runtime, plan: TrainingPlan, model: keras.Model,
                 train: tf.data.Dataset, validation: tf.data.Dataset | None, callbacks: list,
                 start: RunStart, tracker: Tracker, request: StopRequest,
                 data_start=None) -> bool:
    """``model.fit`` over the epochs not done yet; returns whether there were any.

    A run resumed inside an epoch fits that epoch's remaining steps first, then the rest: Keras
    runs whole epochs of one length. ``data_start`` (``TrainingStart``) puts the training stream
    at the step each fit starts at (every fit starts a new iterator)."""
    initial_epoch = start.initial_epoch
    # A signal that came before training (while listing data or building the model): stop now,
    # all ranks together; nothing new to save.
    request.agreed = runtime.max_over_ranks(request.received)
    trains = initial_epoch < config.epochs
    if request.agreed:
        request.epoch = initial_epoch
        return trains
    if not trains:
        runtime.print0(f"{initial_epoch} of {config.epochs} epochs already done; nothing to train")
        return trains
    spans = [(initial_epoch, config.epochs, plan.steps_per_epoch, 0)]
    if start.initial_step:
        spans = [(initial_epoch, initial_epoch + 1, plan.steps_per_epoch - start.initial_step,
                  start.initial_step), (initial_epoch + 1, config.epochs, plan.steps_per_epoch, 0)]
    with tracking.failure_marked(tracker), disk_cache_failures_in_one_line():
        for first, last, steps, steps_done in spans:
            if first >= last or request.agreed or request.by_job:
                break
            if data_start is not None:
                data_start.at_step(first * plan.steps_per_epoch + steps_done)
            model.fit(train, epochs=last, initial_epoch=first, steps_per_epoch=steps,
                      validation_data=validation, callbacks=callbacks,
                      verbose=_verbosity(runtime.world),
                      shuffle=False)  # the pipelines shuffle (Keras 3 warns that it cannot)
    return trains


def finish_run(config: TrainConfig, runtime: Runtime, plan: TrainingPlan, datasets: Datasets,
               model: keras.Model, start: RunStart, tracker: Tracker, request: StopRequest,
               trained: bool, timeline: Timeline, job_callbacks: list = ()) -> TrainingResult:
    """A stopped run's exit status once its checkpoint is written; a finished one's model
    exported. The tracker learns either end."""
    world, run_dir = runtime.world, start.run_dir
    if request.agreed:
        runtime.print0(describe_stop(request))
        tracker.finish("KILLED", model_file=None)  # a rerun reopens it
        # Nobody leaves before rank 0 has written the checkpoint: the ranks exit non-zero, and
        # mpirun kills the rest of a job as soon as one rank does so.
        runtime.barrier()
        return TrainingResult(model, plan, datasets, run_dir, start.initial_epoch, start.rows,
                              stop_status(request.agreed))
    if request.by_job:
        runtime.print0(describe_job_stop(request, job_callbacks))
    # A resumed run that found every epoch done has nothing new to export either (an earlier run
    # wrote it); one whose export is missing (it ended before) writes it now. A run its job's
    # callbacks cut short mid-epoch (a NaN loss) exports nothing: its weights are no epoch's.
    cut_short = request.by_job and request.mid_epoch
    if config.export and world.is_chief and not cut_short and (trained
                                                               or not exported(run_dir)):
        note = export(model, run_dir)
        if note:
            runtime.print0(note)
    # Rank 0's tracker is the only one that records it (the others' is a NullTracker).
    tracker.finish("FINISHED", model_file=exported(run_dir) if world.is_chief else None)
    timeline.mark("exported")
    return TrainingResult(model, plan, datasets, run_dir, start.initial_epoch, start.rows, 0)


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
            data=f"{config.data_kind()}, {samples} samples",
            # An image folder and the TFRecords converted from it are the same samples.
            samples=f"{samples}, " + ("from image files" if config.data_dir or config.tfrecords
                                      else config.data_kind()),
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


def exported(run_dir: RunDir) -> str | None:
    """The file an earlier export wrote (model.keras or the weights), or None."""
    return next((name for name in (MODEL_FILE, WEIGHTS_FILE) if run_dir.exists(name)), None)


def export(model: keras.Model, run_dir: RunDir) -> str | None:
    """Rank 0, after the last epoch: ``model.keras``, or the weights when the model has no config.

    Every epoch and checkpoint is done by now, so nothing here may fail the run: a model that
    cannot be rebuilt from its config (a subclassed model without ``get_config``, a layer whose
    config lacks its constructor's arguments) gets ``model.weights.h5`` instead, which loads into
    the same model built in code. Returns the line saying so, or None for ``model.keras``.
    """
    try:
        run_dir.write_with(MODEL_FILE, inference_copy(model).save, suffix=".keras")
        return None
    except Exception as error:  # noqa: BLE001 - whatever the model's own code raises
        reason = as_one_line(error)
    run_dir.write_with(WEIGHTS_FILE, model.save_weights, suffix=".weights.h5")
    return (f"model: wrote {run_dir.file(WEIGHTS_FILE)}, not {MODEL_FILE}: the model cannot be "
            f"rebuilt from its config ({reason}); build it in code and load_weights() this file")


def inference_copy(model: keras.Model) -> keras.Model:
    """The model's architecture and weights, uncompiled: what ``model.keras`` holds.

    No optimizer (the distributed one is a class made on the fly) and no compile state (a job's
    own loss or metric functions would not deserialize in a serving or fine-tuning process).
    """
    if KERAS == "3":
        # Keras 3's clone_model recompiles the clone from the original's compile config. Its
        # from_config finds layer classes by registered name: the model's own classes are named
        # here, so a user's unregistered layer (defined in a --model file) rebuilds too.
        classes = {type(layer).__name__: type(layer)
                   for layer in model._flatten_layers(include_self=True, recursive=True)}
        with keras.saving.custom_object_scope(classes):
            copy = type(model).from_config(model.get_config())
    else:
        copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy


def rank_log_header(program: str, world) -> str:
    return (f"{program}: rank {world.rank} of {world.size} on {socket.gethostname()}, pid "
            f"{os.getpid()}, started {datetime.datetime.now().isoformat(timespec='seconds')}")


#: --jit-compile as each Keras' compile takes it. "auto" is Keras 3's own rule (XLA where
#: TensorFlow lists a GPU); tf_keras' None compiles the optimizer's update only.
KERAS_JIT_COMPILE = {"3": {"auto": "auto", "on": True, "off": False},
                     "2": {"auto": None, "on": True, "off": False}}


def build_and_compile(config: TrainConfig, runtime: Runtime, task: Task, datasets: Datasets,
                      element_spec, schedule) -> keras.Model:
    """The task's model, its variables and the optimizer's slots created, compiled with the
    distributed optimizer. ``element_spec`` is what the model trains on: (inputs, targets[, w])."""
    with runtime.scope():
        try:
            model = task.build_model(datasets)
        except ValueError as error:  # the data does not fit the model (e.g. its image size)
            raise UserError(str(error)) from None
        if not isinstance(model, keras.Model):
            raise UserError(f"the task's build_model must return a keras.Model, got "
                            f"{type(model).__name__}")
        create_variables(model, element_spec[0])
        optimizer = build_optimizer(config, schedule, model, task.optimizer)
        runtime.print0(describe_optimizer(config, model, own=task.optimizer is not None))
        if KERAS == "3" and keras.mixed_precision.global_policy().name == "mixed_float16":
            # Keras 3's compile would wrap the distributed optimizer in a LossScaleOptimizer,
            # whose inf/NaN check would then come before the ranks' average (see
            # runtime/keras3.py); wrapped here, the average comes first. tf_keras' own wrapping
            # already lets horovod's optimizer average first.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer = runtime.distribute_optimizer(
            optimizer,
            fp16_allreduce=config.fp16_allreduce, grad_accum_steps=config.grad_accum_steps)
        # Samples read from files carry a weight (0 for one that did not decode, see
        # data.pipeline.DecodeFailures): the metrics must honour it as the loss does.
        weighted = len(datasets.train.element_spec) == 3
        model.compile(optimizer=optimizer, loss=task.loss(),
                      metrics=None if weighted else task.metrics(),
                      weighted_metrics=task.metrics() if weighted else None,
                      steps_per_execution=(config.steps_per_execution
                                           or runtime.default_steps_per_execution()),
                      jit_compile=KERAS_JIT_COMPILE[KERAS][config.jit_compile])
        if config.jit_compile == "on" and not model.jit_compile:
            # Keras only warns, and trains without XLA.
            raise UserError("--jit-compile on, but a layer of this model says it does not "
                            "support XLA (supports_jit = False); use --jit-compile auto or off")
        # Compiled with XLA, the step must not hold the ranks' average (its ops have no XLA
        # kernel): the runtime splits the step around it.
        split = runtime.keep_collectives_out_of_xla(model)
        if model.jit_compile:
            why = ("Keras' choice: TensorFlow lists a GPU" if config.jit_compile == "auto"
                   else "--jit-compile on")
            runtime.print0(f"xla: the training step is compiled ({why})" + (
                "; the ranks' gradient average runs between its two compiled parts" if split
                else ""))
        # Create the optimizer's slots now, so a checkpoint restores them immediately and the
        # broadcast in restore_or_start covers them.
        model.optimizer.build(model.trainable_variables)
    return model


def create_variables(model: keras.Model, input_spec) -> None:
    """Create the variables of a model that makes them at its first call (a subclassed model, a
    Sequential without an Input): call it once on a batch of zeros shaped like the data.

    The optimizer's slots, the checkpoint restore and rank 0's broadcast all need the variables
    to exist before the first step; Keras would otherwise create them inside it, on each rank
    from its own random initialisation, and the optimizer would not know them.
    """
    if model.built:
        return

    def zeros(spec):
        return tf.zeros([1, *spec.shape[1:]], spec.dtype)  # one sample: the batch size is free

    try:
        model(tf.nest.map_structure(zeros, input_spec), training=False)
    except Exception as error:  # noqa: BLE001 - the model's own code
        raise UserError(f"the model could not be built from the data's inputs {input_spec}: "
                        f"{as_one_line(error)}") from None


def with_targets(dataset: tf.data.Dataset, to_pairs: Callable) -> tf.data.Dataset:
    """Apply a task's (images, labels) -> (inputs, targets), keeping sample weights if any."""
    if len(dataset.element_spec) == 3:
        return dataset.map(lambda images, labels, weights: (*to_pairs(images, labels), weights))
    return dataset.map(to_pairs)


def summary(result: TrainingResult) -> str:
    if result.exit_code:
        return f"stopped early (exit {result.exit_code}); outputs in {result.run_dir.path}"
    last = result.rows[-1] if result.rows else {}
    shown = ", ".join(f"{name} {last[name]:.4g}" for name in
                      ("loss", "accuracy", "val_loss", "val_accuracy", "samples_per_sec")
                      if name in last)
    bound = input_bound_note(last)
    return f"done: {len(result.rows)} epoch(s){': ' + shown if shown else ''}; outputs in " \
           f"{result.run_dir.path}" + (f"\n{bound}" if bound else "")


def _verbosity(world) -> int:
    if not world.is_chief:
        return 0  # one progress display per job, not one per rank
    # A live bar only for one process on a terminal. mpirun hands every rank a pseudo-terminal,
    # where a bar's carriage returns turn into a wall of prefixed fragments: a line per epoch.
    return 1 if world.size == 1 and sys.stdout.isatty() else 2


def _versions() -> dict:
    return {"hvdtrain": __version__, "tensorflow": tf.__version__,
            "keras": keras_name(), "python": platform.python_version()}
