"""Experiment tracking (``--track``): rank 0 mirrors the run into a tracker; training calls it
without asking whether there is one.

A ``Tracker`` is what training needs of one: the checkpointed epochs (``log_epochs``), the run's
end (``finish``) and a failure (``fail``). ``start`` chooses it from ``config.track``, once:

* ``off``         ``NullTracker``, which does nothing (also every rank but 0);
* ``mlflow``      an MLflow run per run directory (``tracking/mlflow.py``, the only module that
                  imports mlflow, imported only when chosen);
* ``jsonl:PATH``  one JSON object per line appended to a local file (``tracking/jsonlines.py``).

A new tracker is one module here with ``check`` (rank 0, before the data is read: a refusal is
one line on every rank) and ``start`` (rank 0: its ``Tracker``, and the start line), and its
name in ``_implementation``. This module imports neither Keras nor a tracker's package, so the
config can check ``--track`` with it.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Protocol

#: ``--track jsonl:PATH``'s prefix.
JSONL_PREFIX = "jsonl:"
#: How a run ends, as ``Tracker.finish`` takes it: trained to the end, stopped by a signal after a
#: checkpoint (a rerun goes on), or raised.
STATUSES = ("FINISHED", "KILLED", "FAILED")


class Tracker(Protocol):
    """Rank 0's handle on the run's tracker. None of its calls raises or stalls training."""

    def log_epochs(self, rows: list[dict]) -> None:
        """At an epoch's end, once its checkpoint is written: ``rows`` is every completed
        epoch's metrics.json row; the tracker logs those it lacks."""

    def finish(self, status: str, model_file: str | None) -> None:
        """The run ended with ``status`` (one of ``STATUSES``); ``model_file`` is the run
        directory's exported model (its name), if any."""

    def fail(self) -> None:
        """Training raised: the run ends FAILED."""


class NullTracker:
    """No tracking: every call does nothing."""

    def log_epochs(self, rows: list[dict]) -> None:
        pass

    def finish(self, status: str, model_file: str | None) -> None:
        pass

    def fail(self) -> None:
        pass


def check_track(track: str) -> None:
    """``ValueError`` unless ``track`` is one of ``--track``'s forms (the config's check)."""
    if track in ("off", "mlflow") or (track.startswith(JSONL_PREFIX)
                                      and len(track) > len(JSONL_PREFIX)):
        return
    raise ValueError(f"--track must be off, mlflow or jsonl:PATH, got {track!r}")


def jsonl_path(track: str) -> str:
    """The file of ``--track jsonl:PATH``."""
    return track[len(JSONL_PREFIX):]


def check(config, runtime) -> None:
    """Before the data is read, with every rank waiting: rank 0 checks it can track as asked
    (mlflow installed and its server answering, a JSON-lines file it may append to), so a
    refusal is one line on every rank before the data is listed or the run directory made."""
    implementation = _implementation(config.track)
    if implementation is not None:
        runtime.from_chief(lambda: implementation.check(config))


def start(program: str, config, runtime, run_dir, sections: Mapping[str, Mapping[str, Any]],
          rows: list[dict], job: str | None) -> Tracker:
    """Rank 0 starts (or reopens) the run while every rank waits, a refusal ending them all,
    and prints its start line. ``sections`` are the run's parameters ({'config': {...},
    'plan': {...}, ...}), ``rows`` the epochs metrics.json already has, ``job`` the
    scheduler's name for this job. Returns rank 0's tracker; every other rank's is a
    ``NullTracker``."""
    implementation = _implementation(config.track)
    if implementation is None:
        return NullTracker()
    started: list[Tracker] = []

    def open_run() -> str:
        tracker, line = implementation.start(program, config, run_dir, sections, rows, job)
        started.append(tracker)
        return line

    runtime.print0(runtime.from_chief(open_run))
    return started[0] if started else NullTracker()


@contextlib.contextmanager
def failure_marked(tracker: Tracker) -> Iterator[None]:
    """Training inside: an exception marks the run FAILED in the tracker, then goes on up."""
    try:
        yield
    except BaseException:
        tracker.fail()
        raise


def _implementation(track: str):
    """The module of ``--track``'s tracker, imported now (a job never imports the others), or
    None for ``off``."""
    if track == "mlflow":
        from hvdtrain.tracking import mlflow
        return mlflow
    if track.startswith(JSONL_PREFIX):
        from hvdtrain.tracking import jsonlines
        return jsonlines
    return None
