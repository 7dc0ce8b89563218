"""The launcher's own lines: every one starts with ``hvdtrain.launch:`` so that, between the
ranks' output, it is clear who speaks.

The launcher's stdout and stderr may fail under it (a full or over-quota ``slurm-*.out``, a
closed terminal): a line that cannot be written is lost, never the job (see ``lost_stream``)."""
from __future__ import annotations

import sys
import threading

PROGRAM = "hvdtrain.launch"

_lost_streams: set[str] = set()
_lost_lock = threading.Lock()


def say(message: str, file=None) -> None:
    try:
        print(f"{PROGRAM}: {message}", file=file or sys.stderr, flush=True)
    except (OSError, ValueError):  # the console is full or gone; the job goes on
        pass


def error(message: str) -> None:
    say(f"error: {message}")


def show(line: str) -> None:
    """A line of the job's (the health check's findings) on the launcher's stdout."""
    try:
        print(line, flush=True)
    except (OSError, ValueError) as failure:
        lost_stream("stdout", failure, None)


def lost_stream(name: str, failure: Exception, logs_dir: str | None) -> None:
    """Say, once per stream and on the other one, that the job's output can no longer be
    written to the launcher's ``name`` ("stdout" or "stderr")."""
    with _lost_lock:
        if name in _lost_streams:
            return
        _lost_streams.add(name)
    why = getattr(failure, "strerror", None) or failure
    kept = (f"; each rank's output is in {logs_dir}/rank-<K>.log" if logs_dir
            else "; the job goes on")
    say(f"cannot write the job's output to {name} ({why}): not showing it there any more{kept}",
        file=sys.stdout if name == "stderr" else sys.stderr)
