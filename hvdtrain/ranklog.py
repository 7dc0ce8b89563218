"""A log file per rank: ``RUN_DIR/logs/rank-K.log``, whatever started the ranks.

On several nodes a rank's output reaches the user only through the launcher's pipe, prefixed and
interleaved with the other ranks', and is gone once the terminal is. Each rank therefore also
copies its own output into a file of its own, from the moment its run directory is checked and
locked. The copy is made at the file-descriptor level, by a ``tee`` process per stream, so it
includes what TensorFlow's and horovod's C++ code print, and what was written up to a crash:
the tee drains the pipe after its rank died.

Only for run directories on a file system: a ``gs://`` run directory gets no rank logs.
"""
from __future__ import annotations

import os
import subprocess
import sys

LOGS = "logs"
_current: str | None = None


def log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, LOGS, f"rank-{rank}.log")


def current() -> str | None:
    """This process's rank log, once ``start`` has run (named in its failure line)."""
    return _current


def note(line: str) -> None:
    """Write ``line`` into this process's rank log only, not to the console (none: nothing)."""
    if _current is not None:
        with open(_current, "a") as log:
            log.write(line + "\n")


def start(run_dir: str, rank: int, header: str = "") -> str:
    """Copy this process's stdout and stderr into its rank log from now on; returns the path.

    ``header`` (the start-up banner, printed before the log existed) is written first. Once per
    process: a second call (a test that trains twice) keeps the first log.
    """
    global _current
    if _current is not None:
        return _current
    path = log_path(run_dir, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as log:
        log.write(header + "\n" if header else "")
    sys.stdout.flush()
    sys.stderr.flush()
    for stream in (1, 2):
        read_end, write_end = os.pipe()
        # The tee must outlive its rank until it has drained what the rank wrote, so nothing
        # meant for the rank may stop it: a session of its own (out of reach of a kill of the
        # rank's process group), stop signals ignored (the launcher forwards SIGUSR1/SIGTERM to
        # every process of the job; the rank checkpoints, a tee would just die), and -p to keep
        # writing the file when the launcher's pipe is gone. It ends at end of file, when the
        # rank's last copy of the pipe closes.
        subprocess.Popen(["sh", "-c", 'trap "" HUP INT TERM USR1 USR2; exec tee -a -p "$0"', path],
                         stdin=read_end, stdout=stream, stderr=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
        os.close(read_end)
        os.dup2(write_end, stream)
        os.close(write_end)
    _current = path
    return path
