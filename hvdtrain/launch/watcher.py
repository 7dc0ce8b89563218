"""Ends a job whose launcher died: ``watching(python)`` around the job in the launcher, and this
module's ``main`` in a process of its own (``python -m hvdtrain.launch.watcher FD LAUNCHER_PID``).

The ranks run in a session of their own (so that forwarded signals reach them, not the user's
shell), so a launcher killed with SIGKILL, or whose terminal or ssh connection went away
(SIGHUP), would leave them training, on every node, holding the GPUs and the run directory. The
watcher holds the read end of a pipe whose write end only the launcher has. The launcher writes
"done" before it exits normally; end of file without it means the launcher died. Then the job
is stopped as a SIGTERM to the launcher would stop it (``supervise.stop_job``: its ranks here get
SIGTERM, mpirun passes the stand-in to the ranks of every node; they checkpoint and stop
together), and what is still alive after ``GRACE_SECONDS`` gets SIGKILL
(``supervise.end_attempt``: the ranks' scratch janitors last).
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from hvdtrain.launch.console import say
from hvdtrain.launch.supervise import ATTEMPT_VARIABLE, attempt_processes, end_attempt, stop_job

#: Seconds the job gets to checkpoint and stop after SIGTERM.
GRACE_SECONDS = 60.0


@contextlib.contextmanager
def watching(python: str):
    """While the job runs, a watcher that ends it if this launcher dies."""
    read_end, write_end = os.pipe()
    watcher = subprocess.Popen([python, "-m", __name__, str(read_end), str(os.getpid())],
                               pass_fds=(read_end,), start_new_session=True,
                               stdin=subprocess.DEVNULL)
    os.close(read_end)
    try:
        yield
    finally:
        try:
            os.write(write_end, b"done")
        except OSError:  # the watcher is gone already; nothing to tell it
            pass
        os.close(write_end)
        watcher.wait()


def main(argv: list[str]) -> int:
    read_end, launcher_pid = int(argv[0]), int(argv[1])
    said = b""
    while chunk := os.read(read_end, 64):
        said += chunk
    if said == b"done":
        return 0
    marker = f"{ATTEMPT_VARIABLE}={launcher_pid}."  # every attempt of that launcher
    job = attempt_processes(marker, whole=False)
    if not job:
        return 0
    with contextlib.suppress(OSError):  # the launcher's terminal may be gone with it
        say(f"the launcher (pid {launcher_pid}) died; stopping its job of {len(job)} "
            f"process(es) here as a SIGTERM to the launcher would (SIGKILL after "
            f"{GRACE_SECONDS:g} s)")
    stop_job(job, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while (left := attempt_processes(marker, whole=False)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        end_attempt(None, marker, whole=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
