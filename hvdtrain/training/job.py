"""Every job runs here: flags -> compute -> the training run -> summary.

Users' tasks (``hvdtrain.main(task)``), the classifier (``python -m hvdtrain.cnn``) and the
autoencoder (``python -m hvdtrain.autoencoder``) are all ``main(task, ...)``: a job is its ``Task``
(or a function of the parsed config returning one, when the flags choose the model), its presets
and, optionally, what it does with a finished run (``after``).
"""
from __future__ import annotations

import os
import sys
from typing import Callable, Mapping, Sequence

from hvdtrain.cli import error_name, started_as_command, usage_name
from hvdtrain.training.config import ImageConfig, TrainConfig, parse_config
from hvdtrain.training.preflight import refuse_early
from hvdtrain.data import disk_cache_failures_in_one_line
from hvdtrain.errors import UserError, leave, reported
from hvdtrain.rundir import TIMELINE_FILE
from hvdtrain.scratch import use_rank_scratch
from hvdtrain.task import Task
from hvdtrain.timeline import Timeline

TaskOrFactory = Task | Callable[[TrainConfig], Task]
Presets = Mapping[str, Callable[[], TrainConfig]]


def main(task: TaskOrFactory, argv: Sequence[str] | None = None, *, name: str | None = None,
         presets: Presets | None = None, after: Callable | None = None) -> None:
    """Run a job with hvdtrain's flags from ``argv`` (default ``sys.argv[1:]``) and exit with its
    status: 0, 2 for bad input (one line), 75 or 128+N when a signal stopped it.

    ``task``: the ``Task``, or a function of the parsed config returning it. ``name`` names the
    job in messages and its default run directory (``runs/NAME``; default: the script's file
    name). ``presets`` maps ``--preset`` names to
    functions returning the starting configuration; the default is one preset, ``default``, of
    plain ``TrainConfig`` (an ``ImageConfig`` when the task reads hvdtrain's image data).
    ``after(result, runtime)`` runs on every rank once the run finished without a stop. The
    process ends without Python's finalization (``errors.leave``): exit handlers run and the
    output is flushed, but threads the job left running are not waited for.
    """
    program = name or _program_name()
    with reported(error_name(program)):
        # This process is the job's: what it writes to temporary storage (a disk cache,
        # TensorFlow's autograph files) goes where it is removed however the process ends.
        use_rank_scratch()
        status = run(task, argv, name=program, presets=presets, after=after)
    # As a failed job does: the exit handlers run and the output is flushed, but Python's
    # finalization of TensorFlow's objects is skipped, which took every rank 1-2 s (a 1-process
    # tiny job: 1.05 s from its summary to its exit, 0.03 s without; 2 ranks: 1.1-2.3 s each).
    # Horovod's shutdown is one of those handlers and must stay: its MPI_Finalize waits for every
    # rank, and mpirun ends a job one of whose ranks exited without it.
    leave(status)


def run(task: TaskOrFactory, argv: Sequence[str] | None = None, *, name: str | None = None,
        presets: Presets | None = None, after: Callable | None = None) -> int:
    """``main`` without the exit: returns the job's exit status, raises ``UserError`` for bad
    input (for running a job from your own code or a test)."""
    program = name or _program_name()
    timeline = Timeline.start()  # where the job's time outside its epochs goes
    if presets is None:
        reads_images = isinstance(task, Task) and task.datasets is None
        config_class = ImageConfig if reads_images else TrainConfig
        presets = {"default": lambda: config_class(run_dir=f"runs/{program}")}
    # 1. configuration: a preset, then command-line overrides, validated
    config = parse_config(argv, presets, prog=_usage_name(program),
                          description=_description(program))
    refuse_early(config)
    from hvdtrain.training import train  # TensorFlow: once a job runs, not for --help or a bad flag

    timeline.mark("imported")
    job_task = task if isinstance(task, Task) else task(config)
    if not isinstance(job_task, Task):
        raise UserError(f"the job must be an hvdtrain.Task (or a function of the config "
                        f"returning one), got {type(job_task).__name__}")
    # 2. compute: horovod ranks, a tf.distribute strategy, or one process
    runtime = train.start_runtime(config)
    timeline.mark("runtime_started")
    # 3. data, plan, model, resume, fit, checkpoints, export (hvdtrain/training/train.py)
    result = train.run(program, config, runtime, job_task, timeline)
    # 4. what the job makes of a finished run, then the summary
    if after is not None and result.exit_code == 0:
        with disk_cache_failures_in_one_line():  # it may read the data (the autoencoder does)
            after(result, runtime)
    timeline.mark("finished")
    result.run_dir.write_json(TIMELINE_FILE, timeline.to_dict())  # rank 0's
    runtime.print0(train.summary(result))
    runtime.print0(timeline.describe())
    return result.exit_code


def _program_name() -> str:
    """The script's file name without ``.py`` (``train`` for ``python train.py``)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None) or "hvdtrain-job"
    return os.path.splitext(os.path.basename(path))[0]


def _usage_name(program: str) -> str:
    """How --help's usage line names the job: ``hvdtrain COMMAND`` or ``python -m MODULE`` for
    a module run so, else the script's name."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    run_as_module = spec is not None and spec.name == program
    return usage_name(program) if run_as_module or started_as_command(program) else program


def _description(program: str) -> str | None:
    """The docstring of what runs: the command's module, or the script."""
    main_module = sys.modules.get(program if started_as_command(program) else "__main__")
    doc = getattr(main_module, "__doc__", None)
    return doc.strip() if doc else None
