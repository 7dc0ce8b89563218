"""The callbacks in the order they must run, ``model.fit`` over the epochs left (a partial
epoch first after a resume inside one), and how the run ends: exported, or stopped with its
checkpoint."""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain import tracking
from hvdtrain.training.callbacks import (BatchNormStatistics, DecodeFailureReport, LearningRateLog,
                                MetricsLog, Progress, StallWatchdog, TensorBoardLog, Throughput,
                                TrackEpochs, ValidationShare, batch_norm_layers)
from hvdtrain.training.checkpoint import SaveCheckpoint, SaveOnStop, training_state
from hvdtrain.training.config import TrainConfig
from hvdtrain.data import disk_cache_failures_in_one_line
from hvdtrain.errors import UserError, stop_status
from hvdtrain.training.plan import TrainingPlan
from hvdtrain.training.preemption import PreemptionCheck, StopRequest, describe_stop
from hvdtrain.rundir import RunDir
from hvdtrain.runtime import Runtime
from hvdtrain.task import Datasets, Task
from hvdtrain.timeline import Timeline
from hvdtrain.tracking import Tracker
from hvdtrain.training.profile import InputWait
from hvdtrain.training.optimizers import describe_optimizer, learning_rate_schedule, sets_the_rate
from hvdtrain.training.inputs import model_data
from hvdtrain.training.model import build_and_compile, export, exported, seed_and_precision
from hvdtrain.training.start import (RunStart, claim_run_dir, fingerprint, record_start,
                                     resume)


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


def fit(program: str, config: TrainConfig, runtime: Runtime, plan: TrainingPlan,
        datasets: Datasets, task: Task, request: StopRequest, timeline: Timeline,
        banner_text: str = "", input_wait: InputWait | None = None) -> TrainingResult:
    """Model -> run directory -> resume -> tracker -> callbacks -> model.fit -> finish, on
    every rank (each step's collectives are entered by all of them)."""
    precision = seed_and_precision(config, runtime)
    train, validation = model_data(datasets, task)
    job_callbacks = make_job_callbacks(config, task, validation is not None)
    schedule = learning_rate_schedule(plan, settable=sets_the_rate(job_callbacks))
    model = build_and_compile(config, runtime, task, datasets, train.element_spec, schedule)
    timeline.mark("model_compiled")
    state_variables = training_state(model)
    experiment = fingerprint(program, config, datasets, plan)
    run_dir = claim_run_dir(program, config, runtime, experiment, state_variables, banner_text,
                            file_table=getattr(datasets, "identity", {}).get("files"))
    # The banner's last line, once rank 0's log has started (its lines before are the log's
    # header): the log holds it too.
    runtime.print0(describe_optimizer(config, model, own=task.optimizer is not None))
    start = resume(config, runtime, plan, run_dir, model, state_variables, precision, schedule,
                   datasets)
    tracker = record_start(program, config, runtime, plan, start, precision, experiment,
                           datasets)
    callbacks = training_callbacks(config, runtime, plan, datasets, model, train, schedule, start,
                                   tracker, request, timeline, job_callbacks, input_wait)
    timeline.mark("run_dir_ready")
    trains = train_epochs(config, runtime, plan, model, train, validation, callbacks,
                          start, tracker, request, getattr(datasets, "start", None))
    if timeline.seconds("training_done") is not None:  # fit ran (rank 0's Progress saw it end)
        timeline.mark("fit_returned")
    return finish_run(config, runtime, plan, datasets, model, start, tracker, request, trains,
                      timeline, job_callbacks)


def training_callbacks(config: TrainConfig, runtime: Runtime, plan: TrainingPlan,
                       datasets: Datasets, model: keras.Model, train: tf.data.Dataset, schedule,
                       start: RunStart, tracker: Tracker, request: StopRequest,
                       timeline: Timeline, job_callbacks: list,
                       input_wait: InputWait | None = None) -> list:
    """Keras' callbacks, in the order they must run."""
    world = runtime.world
    throughput = Throughput(plan.global_batch_size, plan.num_workers, input_wait)
    callbacks = []
    validation_samples = getattr(datasets, "validation_samples", 0)
    if world.size > 1 and validation_samples:
        # Before the average: hvdtrain's image data validates each sample once, in shares
        # that may differ by one (a job's own datasets validate equal batches on every rank).
        callbacks.append(ValidationShare(validation_samples, world.size,
                                         plan.num_validation_samples))
    callbacks += [
        *runtime.sync_callbacks(),  # then: the callbacks after it read averaged metrics
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
                                             config.bn_recompute_batches,
                                             getattr(datasets, "start", None)))
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
            callbacks.append(TensorBoardLog(
                start.run_dir.tensorboard, profile,
                runtime.steps_per_call(config.steps_per_execution)))
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


def describe_job_stop(request: StopRequest, callbacks: list, latest: str | None = None) -> str:
    """Rank 0's line for a run the job's callbacks ended: which, and what it keeps (``latest``:
    the newest checkpoint)."""
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
        kept = f"its last checkpoint, {latest}," if latest else "no checkpoint"
        return (f"stopped in epoch {epoch}: {'; '.join(reasons)}; the epoch was cut short: the "
                f"run keeps {kept} and exports no model")
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
    spans = [span for span in spans if span[0] < span[1]]
    finalize_pending = False
    with tracking.failure_marked(tracker), disk_cache_failures_in_one_line():
        for index, (first, last, steps, steps_done) in enumerate(spans):
            if request.agreed or request.by_job:
                break
            if data_start is not None:
                data_start.at_step(first * plan.steps_per_epoch + steps_done)
            request.steps_before = steps_done  # the checkpoints' step within the epoch
            finalize_pending = index < len(spans) - 1
            with _not_finalized_if(finalize_pending, model.optimizer):
                model.fit(train, epochs=last, initial_epoch=first, steps_per_epoch=steps,
                          validation_data=validation, callbacks=callbacks,
                          verbose=_verbosity(runtime.world),
                          shuffle=False)  # the pipelines shuffle (Keras 3 warns that it cannot)
    if finalize_pending:  # a stop ended the run after a fit that was not to be its last
        model.optimizer.finalize_variable_values(model.trainable_variables)
    return trains


@contextlib.contextmanager
def _not_finalized_if(more_fits: bool, optimizer):
    """Keras ends every ``fit`` with ``optimizer.finalize_variable_values`` (an optimizer with
    ``use_ema`` copies its moving averages into the weights there): only the run's last fit may,
    or a run resumed inside an epoch would go on from the averages, not the weights."""
    if not more_fits:
        yield
        return
    optimizer.finalize_variable_values = lambda var_list: None  # this object's, for this fit
    try:
        yield
    finally:
        del optimizer.finalize_variable_values


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
        runtime.print0(describe_job_stop(request, job_callbacks, start.checkpoints.manager
                                         and start.checkpoints.manager.latest_checkpoint))
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


def _verbosity(world) -> int:
    if not world.is_chief:
        return 0  # one progress display per job, not one per rank
    # A live bar only for one process on a terminal. mpirun hands every rank a pseudo-terminal,
    # where a bar's carriage returns turn into a wall of prefixed fragments: a line per epoch.
    return 1 if world.size == 1 and sys.stdout.isatty() else 2
