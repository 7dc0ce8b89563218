"""A rank's scratch directory, private to it and removed however the rank ends.

``$TMPDIR/hvdtrain-<host>-<random>/`` takes what a rank writes to temporary storage: its disk
cache (a rank's decoded share: 7.9 GB for ImageNet at 224x224) and Python's temporary files
(TensorFlow's autograph writes one per function it converts, and imports it). Other users share
``$TMPDIR``, so the directory is always a new one (``tempfile.mkdtemp``: a random name, mode
0700; a directory or symlink someone made first is never used) and holds a marker (``MARKER``)
naming the process that made it; only the marker, never the name, says whose it is.

An exit handler removes it on a normal exit; for every other end (``os._exit`` from the stall
watchdog, SIGKILL, the OOM killer) a janitor does: ``python -m hvdtrain.scratch FD PID``, started
in a session of its own (a signal to the job's process group does not reach it) with the read end
of a pipe whose only write end the rank holds. The rank writes the directories to remove into the
pipe; the kernel closes its end when the rank ends, for any reason, and on that end of file the
janitor removes them. Should the janitor be killed too (a whole job torn down at once), the next
job of the same user on the host removes the directories whose process is provably gone.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile

PREFIX = "hvdtrain-"
MARKER = ".hvdtrain-owner"
"""In each directory: JSON naming the process that made it (``_this_process``)."""

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
    """A new private directory ``<parent>/<prefix><host>-<random>`` of this process, removed when
    it ends (see the module's docstring). Stale ones of this user go first (``remove_stale``)."""
    remove_stale(parent, prefix)
    # mkdtemp: mode 0700 under a name nobody could have taken first (mkdir fails on anything
    # that exists, a symlink included, and it tries another name). The host in the name only
    # tells people whose it is; nothing trusts it.
    directory = tempfile.mkdtemp(prefix=f"{prefix}{socket.gethostname()}-", dir=parent)
    try:
        marker = os.open(os.path.join(directory, MARKER),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(marker, "w") as out:
            json.dump(_this_process(), out)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    remove_when_gone(directory)
    return directory


def remove_when_gone(directory: str) -> None:
    """Have ``directory`` (made by ``own_directory``) removed when this process ends, however it
    ends."""
    global _janitor_pipe
    # At once, on a normal exit; the pid is asked then: a forked child's exit leaves it.
    atexit.register(lambda: _remove_own(directory, os.getpid()))
    if _janitor_pipe is None:
        read_end, _janitor_pipe = os.pipe()  # neither end is inherited by programs started later
        # Forked with vfork (no preexec_fn): nothing of an MPI rank's memory, or its network
        # registrations, is copied into the child.
        subprocess.Popen([sys.executable, "-m", "hvdtrain.scratch", str(read_end),
                          str(os.getpid())],
                         pass_fds=(read_end,), start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(read_end)
    os.write(_janitor_pipe, os.fsencode(directory) + b"\0")


def remove_stale(parent: str, prefix: str) -> None:
    """Remove the ``<parent>/<prefix>*`` directories of this user whose process is provably gone.
    Anything else is left: another user's (even as root: a container sharing /tmp), a symlink,
    one without a marker, one of a process in another pid namespace or another boot (its pid says
    nothing here)."""
    if not _proc_is_ours():
        return  # pids could not be checked: nothing is provably gone
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    here = _this_process()
    for name in entries:
        if not name.startswith(prefix):
            continue
        directory = os.path.join(parent, name)
        owner = _owner(directory)
        if (owner is not None and owner["boot_id"] == here["boot_id"]
                and owner["pid_namespace"] == here["pid_namespace"]
                and not _runs(owner["pid"], owner["start_time"])):
            shutil.rmtree(directory, ignore_errors=True)


def _this_process() -> dict:
    """What names this process for as long as it runs, and no other process ever: its pid in its
    pid namespace, in this boot, started at this time (a reused pid starts later)."""
    with open("/proc/sys/kernel/random/boot_id") as boot_id:
        # /proc/self, not /proc/PID: right even where /proc is another pid namespace's.
        return {"pid": os.getpid(), "start_time": _start_time("self"),
                "pid_namespace": os.stat("/proc/self/ns/pid").st_ino,
                "boot_id": boot_id.read().strip()}


def _start_time(pid: int | str) -> int:
    """When process ``pid`` started, in clock ticks since boot (proc(5), /proc/PID/stat field 22);
    FileNotFoundError if there is no such process."""
    with open(f"/proc/{pid}/stat", "rb") as stat_file:
        after_name = stat_file.read().rsplit(b")", 1)[1].split()  # fields 3, 4, ...
    return int(after_name[22 - 3])


def _runs(pid: int, start_time: int) -> bool:
    try:
        return _start_time(pid) == start_time
    except FileNotFoundError:
        return False


def _proc_is_ours() -> bool:
    """True when /proc shows this process's pid namespace (a container may mount another's)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _owner(directory: str) -> dict | None:
    """The marker of ``directory`` if it is this user's private directory (not a symlink, mode
    0700) holding a well-formed one; else None."""
    try:
        info = os.lstat(directory)
        if not (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
                and stat.S_IMODE(info.st_mode) == 0o700):
            return None
        marker = os.open(os.path.join(directory, MARKER), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(marker) as lines:
            owner = json.load(lines)
        if not (isinstance(owner.get("pid"), int) and isinstance(owner.get("start_time"), int)
                and "boot_id" in owner and "pid_namespace" in owner):
            return None
        return owner
    except (OSError, ValueError, AttributeError):
        return None


def _remove_own(directory: str, pid: int) -> None:
    """Remove ``directory`` if it is still the one process ``pid`` made (``_owner``)."""
    owner = _owner(directory)
    if owner is not None and owner["pid"] == pid:
        shutil.rmtree(directory, ignore_errors=True)


def janitor(read_end: int, pid: int) -> None:
    """Collect directory names until the end of the pipe held by process ``pid`` closes, then
    remove them."""
    # A job being torn down (Slurm signals every process of the step, SIGKILL only after its
    # KillWait) must not stop the janitor before the process it watches is gone.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    received = b""
    while chunk := os.read(read_end, 65536):
        received += chunk
    for name in filter(None, received.split(b"\0")):
        _remove_own(os.fsdecode(name), pid)


if __name__ == "__main__":
    janitor(int(sys.argv[1]), int(sys.argv[2]))
