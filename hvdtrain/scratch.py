"""A rank's scratch directory, removed however the rank ends.

``$TMPDIR/hvdtrain-<host>-<pid>/`` takes what a rank writes to temporary storage: its disk cache
(a rank's decoded share: 7.9 GB for ImageNet at 224x224) and Python's temporary files
(TensorFlow's autograph writes one per function it converts). An exit handler removes it on a
normal exit; for every other end (``os._exit`` from the stall watchdog, SIGKILL, the OOM killer)
a janitor does: ``python -m hvdtrain.scratch FD``, started in a session of its own (a signal to
the job's process group does not reach it) with the read end of a pipe whose only write end the
rank holds. The rank writes the directories to remove into the pipe; the kernel closes its end
when the rank ends, for any reason, and on that end of file the janitor removes them. Should the
janitor be killed too (a whole job torn down at once), the next job on the host removes the
directories of processes that no longer exist.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

PREFIX = "hvdtrain-"

_scratch: str | None = None
_janitor_pipe: int | None = None
"""This process's end of its janitor's pipe: open for as long as the process runs."""


def use_rank_scratch() -> str:
    """This process's scratch directory, created on first use and made Python's temporary
    directory (``tempfile``) from then on."""
    global _scratch
    if _scratch is None:
        _scratch = own_directory(tempfile.gettempdir(), PREFIX)
        tempfile.tempdir = _scratch
    return _scratch


def own_directory(parent: str, prefix: str) -> str:
    """A new directory ``<parent>/<prefix><host>-<pid>`` of this process, removed when it ends
    (see the module's docstring). Those of processes on this host that no longer exist go
    first."""
    host = socket.gethostname()
    remove_stale(parent, f"{prefix}{host}-")
    directory = os.path.join(parent, f"{prefix}{host}-{os.getpid()}")
    os.makedirs(directory, exist_ok=True)
    remove_when_gone(directory)
    return directory


def remove_when_gone(directory: str) -> None:
    """Have ``directory`` removed when this process ends, however it ends."""
    global _janitor_pipe
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # at once, on a normal exit
    if _janitor_pipe is None:
        read_end, _janitor_pipe = os.pipe()  # neither end is inherited by programs started later
        # Forked with vfork (no preexec_fn): nothing of an MPI rank's memory, or its network
        # registrations, is copied into the child.
        subprocess.Popen([sys.executable, "-m", "hvdtrain.scratch", str(read_end)],
                         pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(read_end)
    os.write(_janitor_pipe, os.fsencode(directory) + b"\0")


def remove_stale(parent: str, prefix: str) -> None:
    """Remove ``<parent>/<prefix><pid>`` directories whose process no longer exists."""
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for name in entries:
        pid = name[len(prefix):]
        if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def janitor(read_end: int) -> None:
    """Collect directory names until the watched process's end of the pipe closes, then remove
    them."""
    # A job being torn down (Slurm signals every process of the step, SIGKILL only after its
    # KillWait) must not stop the janitor before the process it watches is gone.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    received = b""
    while chunk := os.read(read_end, 65536):
        received += chunk
    for name in filter(None, received.split(b"\0")):
        shutil.rmtree(os.fsdecode(name), ignore_errors=True)


if __name__ == "__main__":
    janitor(int(sys.argv[1]))
