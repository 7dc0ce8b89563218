"""A job's fixed costs: where its time outside the epochs went, on rank 0.

A ``Timeline`` holds the milestones a job reached, in seconds since its origin: the process's
start for the first job of a process (the interpreter's own start-up and every import count),
the job's start for a later one in the same process. The phases between consecutive milestones
are named in ``MILESTONES``; a milestone a job did not reach (no training step on a run whose
epochs were all done, no pipelines of its own for a task's datasets) folds its phase into the
next one. Rank 0 writes it into its run directory (``rundir.TIMELINE_FILE``) and prints it in one
line after the summary. Plain clocks, no TensorFlow: importing this is instant.

Not in it: what came before the process (horovodrun's and mpirun's own start), and what comes
after the summary (the interpreter's and horovod's shutdown at exit).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from hvdtrain import STARTED

#: (milestone, the phase that ends there), in the order a job reaches them.
MILESTONES: tuple[tuple[str, str], ...] = (
    ("hvdtrain_imported", "python"),       # the interpreter started, site and hvdtrain imported
    ("imported", "imports"),               # flags parsed; TensorFlow, Keras, hvdtrain.training.train
    ("runtime_started", "runtime"),        # hvd.init (or a strategy), devices and threads pinned
    ("data_listed", "data"),               # rank 0 listed the data (or the task built its own)
    ("pipelines_built", "pipelines"),      # every rank's tf.data pipelines, then the banner
    ("model_compiled", "model"),           # built, variables and optimizer slots made, compiled
    ("run_dir_ready", "run_dir"),          # checked and locked, resumed, tracker, callbacks
    ("first_step_done", "first_step"),     # fit's first step: tracing, compiling, first batch
    ("training_done", "epochs"),           # the last epoch ended, its checkpoint written
    ("fit_returned", "train_end"),         # the callbacks' train end: final curves, TensorBoard
    ("exported", "export"),                # rank 0's model.keras, the tracker's end
    ("finished", "job_end"),               # the job's own after-training work, the summary
)
PHASES = tuple(phase for _, phase in MILESTONES)
#: The phases before the first step, and those after the last epoch.
STARTUP = PHASES[:PHASES.index("first_step") + 1]
AFTER_TRAINING = PHASES[PHASES.index("epochs") + 1:]
_MILESTONE_NAMES = frozenset(name for name, _ in MILESTONES)

_process_origin_taken = False
"""Whether a job of this process already took the process's start as its origin."""


@dataclass
class Timeline:
    """The milestones one job reached, in seconds since ``origin``."""

    origin: float
    """``time.monotonic()`` at the origin."""
    origin_is_process_start: bool
    """Whether the origin is the process's start (else the job's)."""
    marks: dict[str, float] = field(default_factory=dict)
    """Milestone (``MILESTONES``) -> seconds since the origin when it was reached."""

    @classmethod
    def start(cls) -> Timeline:
        """A job's timeline: from the process's start for the process's first job, else from
        now (a later job's imports were paid by the first)."""
        global _process_origin_taken
        age = None if _process_origin_taken else process_age()
        _process_origin_taken = True
        now = time.monotonic()
        if age is None:
            return cls(origin=now, origin_is_process_start=False)
        timeline = cls(origin=now - age, origin_is_process_start=True)
        timeline.marks["hvdtrain_imported"] = max(0.0, STARTED - timeline.origin)
        return timeline

    def mark(self, milestone: str) -> None:
        """Record that the job reached ``milestone`` now."""
        assert milestone in _MILESTONE_NAMES, milestone
        self.marks[milestone] = time.monotonic() - self.origin

    def seconds(self, milestone: str) -> float | None:
        """Seconds from the origin to ``milestone``, or None if the job did not reach it."""
        return self.marks.get(milestone)

    def phases(self) -> dict[str, float]:
        """Seconds of each phase that ended at a milestone reached, in order; each starts at the
        previous milestone reached (or the origin)."""
        phases, previous = {}, 0.0
        for milestone, phase in MILESTONES:
            if milestone in self.marks:
                phases[phase] = self.marks[milestone] - previous
                previous = self.marks[milestone]
        return phases

    def to_dict(self) -> dict:
        """What the run directory keeps: the origin (as wall-clock time, to line it up with
        other processes' clocks), the milestones, the phases and their two sums."""
        phases = self.phases()
        origin_unix = time.time() - (time.monotonic() - self.origin)
        return {"origin": "process start" if self.origin_is_process_start else "job start",
                "origin_unix_seconds": round(origin_unix, 3),
                "milestones": {name: round(seconds, 3) for name, seconds in self.marks.items()},
                "phases": {name: round(seconds, 3) for name, seconds in phases.items()},
                "startup_seconds": round(_total(phases, STARTUP), 3),
                "after_training_seconds": round(_total(phases, AFTER_TRAINING), 3)}

    def describe(self) -> str:
        """One line: 'start-up 15.7 s (python 0.1, imports 4.1, ...); epochs 6.3 s; after
        training 2.0 s (train end 0.6, export 1.3, job end 0.1)'."""
        phases = self.phases()
        origin = "" if self.origin_is_process_start else " since the job started"
        parts = [f"start-up{origin} {_total(phases, STARTUP):.1f} s ({_listed(phases, STARTUP)})"
                 + ("" if "first_step" in phases else ", no training step")]
        if "epochs" in phases:
            parts.append(f"epochs {phases['epochs']:.1f} s")
        if any(phase in phases for phase in AFTER_TRAINING):
            parts.append(f"after training {_total(phases, AFTER_TRAINING):.1f} s "
                         f"({_listed(phases, AFTER_TRAINING)})")
        return "; ".join(parts)


def _total(phases: dict[str, float], names: tuple[str, ...]) -> float:
    # To the millisecond timeline.json keeps, so that the line shows the recorded sum as it
    # rounds (3.2504 s was "3.3" on the line and 3.25, "3.2", in the record).
    return round(sum(phases.get(name, 0.0) for name in names), 3)


def _listed(phases: dict[str, float], names: tuple[str, ...]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {phases[name]:.1f}" for name in names
                     if name in phases)


def process_age() -> float | None:
    """Seconds since this process started, or None where there is no /proc.

    Linux's /proc/self/stat gives the start in clock ticks since boot (10 ms each), on the clock
    ``CLOCK_BOOTTIME`` reads. A rank started by mpirun or srun started there: the launcher's own
    start before it is not counted.
    """
    try:
        with open("/proc/self/stat") as stat:
            # pid (comm) state ...: comm may hold spaces, so count fields after its ')'; the
            # start time is field 22, the 20th after it.
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
