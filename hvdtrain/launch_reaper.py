"""Ends a job whose launcher died: ``python -m hvdtrain.launch_reaper FD LAUNCHER_PID``.

Started by ``hvdtrain.launch`` (see ``launch.reaper``) in a session of its own, holding the read end
of a pipe whose write end only the launcher has. The launcher writes "done" before it exits
normally; end of file without it means the launcher was killed (SIGKILL, or SIGHUP when its
terminal or ssh connection went away). Then every process of the job on this host gets SIGTERM:
mpirun passes it to the ranks on every node, and the ranks stop together after writing a
checkpoint. What is still alive after ``GRACE_SECONDS`` gets SIGKILL.
"""
from __future__ import annotations

import os
import signal
import sys
import time

from hvdtrain.launch import ATTEMPT_VARIABLE, attempt_processes

#: Seconds the job gets to checkpoint and stop after SIGTERM.
GRACE_SECONDS = 60.0


def tell(message: str) -> None:
    try:  # the launcher's terminal may be gone with it
        print(f"hvdtrain.launch: {message}", file=sys.stderr, flush=True)
    except OSError:
        pass


def signal_all(pids, signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


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
    tell(f"the launcher (pid {launcher_pid}) died; stopping its job (SIGTERM to "
         f"{len(job)} process(es), SIGKILL after {GRACE_SECONDS:g} s)")
    signal_all(job, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    while (left := attempt_processes(marker, whole=False)) and time.monotonic() < deadline:
        time.sleep(0.5)
    signal_all(left, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
