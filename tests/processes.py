"""Jobs a test starts in a session of their own, and the one place that ends them.

A job a test starts (a launcher, mpirun, a server, a converter) runs as the leader of a new
session, hence of a process group of its own: the test can signal the whole group as a terminal's
Ctrl-C does, and whatever the job started and left behind is found by its group after the leader
has gone. `process_group` starts such a job for a with-block and, however the block ends, ends what
is left of the group; the signals a test sends inside the block stay the test's own.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

#: What is left of a group gets this long to exit on SIGTERM (a launcher stops its ranks on it)
#: before SIGKILL.
GRACE_SECONDS = 2.0
#: How long SIGKILLed processes may take to be gone (a process leaves uninterruptible sleep
#: first); a group still there after it is left alone, not an error.
KILLED_WITHIN_SECONDS = 10.0


def live_processes_in_group(group: int) -> list[int]:
    """Processes of a process group that have not exited (zombies do not count: PID 1 of a
    container may never reap them)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...; comm may hold spaces, so split after its ')'.
            state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue  # exited while being read
        if int(pgrp) == group and state != "Z":
            alive.append(int(stat.parent.name))
    return alive


@contextlib.contextmanager
def process_group(args: list[str], *, grace_seconds: float = GRACE_SECONDS,
                  **popen_args) -> Iterator[subprocess.Popen]:
    """``subprocess.Popen(args, **popen_args)`` as the leader of a new session, for the block;
    after it, whatever is left of its group is ended (`end_group`), the leader reaped and its
    pipes closed."""
    with subprocess.Popen(args, start_new_session=True, **popen_args) as leader:
        try:
            yield leader
        finally:
            end_group(leader, grace_seconds)


def end_group(leader: subprocess.Popen, grace_seconds: float = GRACE_SECONDS) -> None:
    """SIGTERM to what is left of the leader's process group, ``grace_seconds`` for it to exit,
    then SIGKILL to what is still there; reaps the leader. A group already gone is no error."""
    def running() -> bool:
        # The leader's pid names the group as long as a member lives, reaped leader or not: it is
        # not given to another process meanwhile, so the signals below reach this job only.
        return leader.poll() is None or bool(live_processes_in_group(leader.pid))

    for signum, seconds in ((signal.SIGTERM, grace_seconds),
                            (signal.SIGKILL, KILLED_WITHIN_SECONDS)):
        if not running():
            break
        with contextlib.suppress(ProcessLookupError):  # the last of it exited meanwhile
            os.killpg(leader.pid, signum)
        deadline = time.monotonic() + seconds
        while running() and time.monotonic() < deadline:
            time.sleep(0.02)
    leader.wait()
