"""The training run every job shares, as a table of contents: data -> plan -> banner -> fit.

``hvdtrain/training/job.py`` runs it for every job with the job's ``Task`` (``hvdtrain/task.py``:
how to build its model, its loss and metrics, and optionally its own datasets); the built-in jobs
(``hvdtrain.cnn``, ``hvdtrain.autoencoder``) are tasks on the image data hvdtrain reads itself.
The parts, each answering one question:

* ``inputs``: which batches each rank feeds (hvdtrain's image data, or the job's own, counted and
  agreed on);
* ``model``: the model, compiled with the distributed optimizer, and what rank 0 exports;
* ``start``: the run directory, and where a run starts (a checkpoint, what earlier runs did);
* ``fit``: the callbacks, ``model.fit`` over the epochs left, and how the run ends;
* ``optimizers``, ``profile``, ``checkpoint``, ``preemption``, ``callbacks``, ``plan``: what those
  use.
"""
from __future__ import annotations

import socket

from hvdtrain import KERAS, tracking
from hvdtrain.training.config import TrainConfig
from hvdtrain.errors import UserError
from hvdtrain.training.plan import TrainingPlan
from hvdtrain.training.preflight import check_backend
from hvdtrain.training.preemption import StopRequest, StopSignals
from hvdtrain.runtime import Runtime, make_runtime, placement, select_backend
from hvdtrain.task import Datasets, Task
from hvdtrain.timeline import Timeline
from hvdtrain.training.profile import InputWait, input_bound_note
from hvdtrain.training.fit import TrainingResult, fit
from hvdtrain.training.inputs import image_data, task_data
from hvdtrain.training.start import keras_name


def start_runtime(config: TrainConfig) -> Runtime:
    """The backend a job's config asks for, started (horovod ranks, a strategy, one process)."""
    # Gradient accumulation is horovod's (backward_passes_per_step), so it keeps horovod even
    # where `auto` would otherwise run a single process.
    needs_horovod = config.grad_accum_steps > 1
    backend = select_backend(config.backend, needs_horovod=needs_horovod)
    # Resolved first, so `auto` landing on a strategy is refused before anything starts.
    check_backend(config, backend)
    return make_runtime(backend, threads_per_worker=config.threads_per_worker,
                        needs_horovod=needs_horovod)


def check_keras(config: TrainConfig) -> None:
    """The config's Keras must be the one this process imported (it cannot change afterwards)."""
    if config.keras != KERAS:
        raise UserError(f"this process runs Keras {KERAS} (chosen when hvdtrain was imported), "
                        f"but the config asks for Keras {config.keras}: pass --keras "
                        f"{config.keras} on the command line or set HVDTRAIN_KERAS="
                        f"{config.keras} before importing hvdtrain")


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
