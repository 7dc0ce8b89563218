"""The training run every job shares: plan, data, compile, resume, fit, save.

A job (``hvdtrain.cnn``, ``hvdtrain.autoencoder``) supplies a ``Task``: how to build its model,
its loss and metrics, and how to turn (image, label) batches into (input, target) pairs. The rest
(scaling, checkpoints, callbacks, outputs) is the same for every job and every backend.
"""
from __future__ import annotations

import dataclasses
import os
import platform
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Callable

import tensorflow as tf
import tf_keras as keras

from hvdtrain import __version__
from hvdtrain.callbacks import (BatchNormStatistics, DecodeFailureReport, LearningRateLog,
                                MetricsLog, PreemptionCheck, SaveCheckpoint, StopRequest,
                                StopSignals, Throughput, batch_norm_layers)
from hvdtrain.config import TrainConfig
from hvdtrain.data import Listing, Pipelines, build_pipelines, load_listing
from hvdtrain.errors import EXIT_PREEMPTED, UserError, first_line
from hvdtrain.plan import TrainingPlan, make_plan
from hvdtrain.rundir import MODEL_FILE, RunDir, ensure_writable
from hvdtrain.runtime import Runtime, make_runtime, placement
from hvdtrain.slurm import job_label


@dataclass(frozen=True)
class Task:
    build_model: Callable[[Listing], keras.Model]
    loss: Callable[[], keras.losses.Loss]
    metrics: Callable[[], list]
    to_pairs: Callable | None = None
    """Map from batched (images, labels) to (inputs, targets); None keeps them as they are."""


@dataclass
class TrainingResult:
    model: keras.Model
    plan: TrainingPlan
    pipelines: Pipelines
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
    return make_runtime(config.backend, threads_per_worker=config.threads_per_worker,
                        needs_horovod=config.grad_accum_steps > 1)


def run(program: str, config: TrainConfig, runtime: Runtime, task: Task) -> TrainingResult:
    """Data -> plan -> pipelines -> banner -> fit: a whole job once the runtime is up."""
    request = StopRequest()
    with StopSignals(runtime.world.rank, request):  # a stop signal is recorded, never fatal
        listing = load_listing(config, runtime)  # rank 0 lists and checks, everyone receives
        plan = plan_for(config, runtime, listing)  # batch sizes, learning rate, steps
        pipelines = make_pipelines(config, runtime, listing, plan)  # sharded tf.data per rank
        runtime.print0(banner(program, runtime, listing, plan, config))
        return fit(program, config, runtime, listing, plan, pipelines, task, request)


def plan_for(config: TrainConfig, runtime: Runtime, listing: Listing) -> TrainingPlan:
    try:
        return make_plan(
            batch_size=config.batch_size, batch_policy=config.batch_policy,
            learning_rate=config.learning_rate, lr_scaling=config.lr_scaling,
            warmup_epochs=config.warmup_epochs, grad_accum_steps=config.grad_accum_steps,
            epochs=config.epochs, num_workers=runtime.world.num_replicas,
            num_train_samples=listing.train.num_samples,
            num_validation_samples=listing.validation.num_samples,
            steps_per_epoch=config.steps_per_epoch)
    except ValueError as error:
        raise UserError(str(error)) from None


def make_pipelines(config: TrainConfig, runtime: Runtime, listing: Listing,
                   plan: TrainingPlan) -> Pipelines:
    # A process driving several replicas (tf.distribute) feeds all of them: Keras splits its
    # batch between the replicas. A horovod rank feeds exactly one.
    per_process = runtime.world.replicas_per_process
    return build_pipelines(
        listing, runtime.world,
        batch_size=plan.per_worker_batch_size * per_process,
        validation_batch_size=plan.validation_batch_size * per_process,
        validation_steps=plan.validation_steps, seed=config.seed, cache=config.cache,
        tfrecord_sharding=config.tfrecord_sharding, on_bad_image=config.on_bad_image,
        threads=runtime.devices.threads)


def banner(program: str, runtime: Runtime, listing: Listing, plan: TrainingPlan,
           config: TrainConfig) -> str:
    """The start-up summary. A collective (it gathers every rank's host): call it on all ranks."""
    world = runtime.world
    lines = [f"{program} | backend {world.backend} | {world.size} process(es), "
             f"{world.num_replicas} worker(s) | {runtime.devices.description}",
             f"placement: {placement(runtime.allgather_object(socket.gethostname()))}",
             f"data: {listing.description}", *listing.notes, *plan.describe(),
             f"run dir: {config.run_dir}"]
    return "\n".join(lines)


def learning_rate_schedule(plan: TrainingPlan, decay: str):
    """Linear warm-up from the base to the scaled rate (Goyal et al.), then cosine or constant.

    Keras' CosineDecay does both; alpha=1 turns its decay into a constant. A schedule runs inside
    the compiled step, unlike horovod's LearningRateWarmupCallback, a Python call per batch.
    """
    warmup = plan.warmup_steps
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=plan.base_learning_rate if warmup else plan.learning_rate,
        decay_steps=max(1, plan.total_steps - warmup),
        alpha=0.0 if decay == "cosine" else 1.0,
        warmup_target=plan.learning_rate if warmup else None,
        warmup_steps=warmup,
    )


class Checkpoints:
    """Model + optimizer + "epoch to resume at", via tf.train.CheckpointManager on rank 0.

    CheckpointManager writes the data files first and only then atomically rewrites the
    ``checkpoint`` index that names the latest one, so a crash mid-save leaves the previous
    checkpoint as the latest; it also deletes all but the newest ``keep``.
    """

    def __init__(self, run_dir: RunDir, model: keras.Model, keep: int):
        self.resume_epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="resume_epoch")
        self.checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                              resume_epoch=self.resume_epoch)
        self.manager = (tf.train.CheckpointManager(self.checkpoint, run_dir.checkpoints,
                                                   max_to_keep=keep)
                        if run_dir.is_chief else None)

    def restore_latest(self) -> tuple[int, str | None]:
        """Rank 0: restore the newest loadable checkpoint -> (epoch to resume at, its path)."""
        errors = []
        for path in reversed(self.manager.checkpoints):
            try:
                self.checkpoint.restore(path).assert_existing_objects_matched()
                return int(self.resume_epoch.numpy()), path
            except (AssertionError, ValueError, tf.errors.OpError) as error:
                errors.append(f"{path}: {first_line(error)}")
        if errors:
            raise UserError(f"no checkpoint in {self.manager.directory} could be restored into "
                            f"this model (first: {errors[0]}); use another --run-dir")
        return 0, None

    def save(self, resume_epoch: int) -> str:
        self.resume_epoch.assign(resume_epoch)
        return self.manager.save()


def variables_bytes(variables) -> int:
    return sum(v.shape.num_elements() * v.dtype.size for v in variables)


def training_state(model: keras.Model) -> list[tf.Variable]:
    """Every variable a checkpoint of the model and its optimizer holds, each once.

    Read from the checkpoint's object graph rather than ``model.variables`` and
    ``optimizer.variables``: tf_keras' LossScaleOptimizer lists neither its current loss scale nor
    its good-step counter there, and a rank that missed them after a resume would unscale its
    gradients by another factor than rank 0 (the replicas drift apart).
    """
    root = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    unique = {}
    for trackable in tf.train.TrackableView(root).descendants():  # holds root weakly
        if isinstance(trackable, tf.Variable):
            unique.setdefault(id(trackable), trackable)
    return list(unique.values())


def fit(program: str, config: TrainConfig, runtime: Runtime, listing: Listing,
        plan: TrainingPlan, pipelines: Pipelines, task: Task,
        request: StopRequest) -> TrainingResult:
    world = runtime.world
    run_dir = RunDir(config.run_dir, is_chief=world.is_chief)
    # Each rank draws its own dropout masks and augmentations (seed + rank): identical draws would
    # make N ranks N copies of one sample's noise. Weights still start equal: rank 0's are
    # broadcast below.
    keras.utils.set_random_seed(config.seed + world.rank)
    precision = runtime.default_precision() if config.precision == "auto" else config.precision
    keras.mixed_precision.set_global_policy("float32" if precision == "fp32" else precision)

    # --- model and optimizer ------------------------------------------------------------------
    schedule = learning_rate_schedule(plan, config.lr_decay)
    with runtime.scope():
        try:
            model = task.build_model(listing)
        except ValueError as error:  # the data does not fit the model (e.g. its image size)
            raise UserError(str(error)) from None
        optimizer = runtime.distribute_optimizer(
            keras.optimizers.Adam(learning_rate=schedule),
            fp16_allreduce=config.fp16_allreduce, grad_accum_steps=config.grad_accum_steps)
        # Samples read from files carry a weight (0 for one that did not decode, see
        # data.DecodeFailures): the metrics must honour it as the loss does.
        weighted = len(pipelines.train.element_spec) == 3
        model.compile(optimizer=optimizer, loss=task.loss(),
                      metrics=None if weighted else task.metrics(),
                      weighted_metrics=task.metrics() if weighted else None,
                      steps_per_execution=(config.steps_per_execution
                                           or runtime.default_steps_per_execution()))
        # Create the optimizer's slots now, so a checkpoint restores them immediately and the
        # broadcast below covers them.
        model.optimizer.build(model.trainable_variables)
    state_variables = training_state(model)

    # --- run directory and resume ---------------------------------------------------------------
    # Rank 0 also takes the run directory's lock, held until this process ends: a second job on
    # the same directory (a duplicate sbatch, a requeued job whose old copy still runs) is
    # refused on every rank, naming the holder, before it writes anything.
    lock_note = ensure_writable(run_dir, runtime, bytes_needed=(config.keep_checkpoints + 1)
                                * variables_bytes(state_variables) + 2**20,
                                job=job_label(os.environ))
    if lock_note:
        runtime.print0(lock_note)
    checkpoints = Checkpoints(run_dir, model, config.keep_checkpoints)
    restored: tuple[int, str | None] | UserError = (0, None)
    if world.is_chief:
        try:
            restored = checkpoints.restore_latest()
        except UserError as error:
            restored = error
        else:
            # A run stopped mid-epoch re-runs that epoch; restart its step count there too, so
            # the schedule follows the epochs (and a resume on another world size stays right).
            model.optimizer.iterations.assign(restored[0] * plan.steps_per_epoch)
    # Rank 0 alone reads the checkpoint (run directories need not be shared); everyone learns the
    # epoch, and the broadcast below hands its weights and optimizer state to every rank.
    restored = runtime.broadcast_object(restored)
    if isinstance(restored, UserError):
        raise restored
    initial_epoch, restored_from = restored
    runtime.broadcast_variables(state_variables)
    # Rank 0 keeps the metrics of the epochs a resumed run already has (and drops any later
    # rows an interrupted run wrote after its last checkpoint).
    earlier_rows = run_dir.read_json("metrics.json", []) if world.is_chief and restored_from else []
    rows = [row for row in earlier_rows if row.get("epoch", 0) <= initial_epoch]

    run_dir.write_json("config.json", {
        "program": program, "config": config.to_dict(), "plan": plan.to_dict(),
        "world": dataclasses.asdict(world), "precision": precision,
        "resumed_from": restored_from, "versions": _versions()})
    if restored_from:
        runtime.print0(f"resuming from {restored_from}: {initial_epoch} epoch(s) done")

    # --- fit ------------------------------------------------------------------------------------
    def save_on_stop(epoch: int, mid_epoch: bool) -> None:
        if world.is_chief:  # an epoch cut short is re-run from its start on resume
            checkpoints.save(resume_epoch=epoch if mid_epoch else epoch + 1)
            request.saved = True

    train, validation = pipelines.train, pipelines.validation
    if task.to_pairs is not None:
        train = with_targets(train, task.to_pairs)
        validation = with_targets(validation, task.to_pairs) if validation is not None else None

    throughput = Throughput(plan.global_batch_size)
    callbacks = [
        *runtime.sync_callbacks(),  # first: the callbacks after it read averaged metrics
        throughput,
        LearningRateLog(schedule),
        PreemptionCheck(runtime, request, config.signal_check_every_steps, save_on_stop),
    ]
    norm_layers = batch_norm_layers(model)
    if world.size > 1 and norm_layers and config.bn_recompute_batches:
        # Before validation and the checkpoint, which read the statistics (see the callback).
        callbacks.append(BatchNormStatistics(runtime, norm_layers, train,
                                             config.bn_recompute_batches))
    if pipelines.decode_failures:
        callbacks.append(DecodeFailureReport(runtime, pipelines.decode_failures,
                                             config.on_bad_image))
    if world.is_chief:
        # Metrics before the checkpoint: a crash between the two then costs a repeated epoch,
        # never a missing row.
        callbacks += [MetricsLog(run_dir, rows, request, throughput),
                      SaveCheckpoint(checkpoints, request)]
        if config.tensorboard:
            callbacks.append(keras.callbacks.TensorBoard(run_dir.tensorboard,
                                                         profile_batch=0))
    # A signal that came before training (while listing data or building the model): stop now,
    # all ranks together; nothing new to save.
    request.agreed = runtime.max_over_ranks(request.received)
    if request.agreed:
        request.epoch = initial_epoch
    elif initial_epoch < config.epochs:
        model.fit(train, epochs=config.epochs, initial_epoch=initial_epoch,
                  steps_per_epoch=plan.steps_per_epoch, validation_data=validation,
                  callbacks=callbacks, verbose=_verbosity(world))
    else:
        runtime.print0(f"{initial_epoch} of {config.epochs} epochs already done; nothing to train")

    if request.agreed:
        runtime.print0(f"stopped by {_signal_name(request.agreed)} in epoch "
                       f"{request.epoch + 1}; checkpoint written, rerun to resume")
        # Nobody leaves before rank 0 has written the checkpoint: the ranks exit non-zero, and
        # mpirun kills the rest of a job as soon as one rank does so.
        runtime.barrier()
        # SIGUSR1 (Slurm's warning before the time limit) asks to be run again: exit 75, which
        # the sbatch templates answer with `scontrol requeue`. SIGTERM is a plain stop.
        exit_code = EXIT_PREEMPTED if request.agreed == signal.SIGUSR1 else 128 + request.agreed
        return TrainingResult(model, plan, pipelines, run_dir, initial_epoch, rows, exit_code)
    if config.export and world.is_chief:
        # The exported model carries no optimizer: the distributed optimizer is a class horovod
        # makes on the fly, which a serving or fine-tuning process could not deserialize.
        inference_model = keras.models.clone_model(model)
        inference_model.set_weights(model.get_weights())
        run_dir.write_with(MODEL_FILE, inference_model.save, suffix=".keras")
    return TrainingResult(model, plan, pipelines, run_dir, initial_epoch, rows, 0)


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
    return f"done: {len(result.rows)} epoch(s){': ' + shown if shown else ''}; outputs in " \
           f"{result.run_dir.path}"


def _verbosity(world) -> int:
    if not world.is_chief:
        return 0  # one progress display per job, not one per rank
    # A live bar only for one process on a terminal. mpirun hands every rank a pseudo-terminal,
    # where a bar's carriage returns turn into a wall of prefixed fragments: a line per epoch.
    return 1 if world.size == 1 and sys.stdout.isatty() else 2


def _signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def _versions() -> dict:
    return {"hvdtrain": __version__, "tensorflow": tf.__version__,
            "tf_keras": keras.__version__, "python": platform.python_version()}
