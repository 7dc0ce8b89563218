"""The run directory: every file a job writes goes through here, and only rank 0 writes.

Layout of ``<run_dir>``::

    config.json        resolved config, training plan, world, versions, and the fingerprint of
                       what the directory trains (``other_experiment``)
    checkpoints/       tf.train.CheckpointManager files (ckpt-N.index/.data, checkpoint)
    metrics.csv/.json  one row per completed epoch (loss, accuracy, samples/s, seconds, ...)
    timeline.json      where the last run's time outside its epochs went (``timeline.Timeline``)
    curves.png         training curves, redrawn after every epoch
    tensorboard/       TensorBoard event files
    model.keras        the final model, without optimizer state
    .lock              held by the job writing here; names its host, pid and scheduler job

Each file is written to a temporary name and renamed into place, so a crash never leaves a
half-written file under the real name (``replace_atomically``). Nothing here opens a file another
user could have planted: temporary files get fresh random names, and ``.lock`` is never followed
if it is a link.

A run directory may also be a URL of a file system TensorFlow knows (``gs://bucket/run``, as TPU
jobs use; ``s3://``, ``hdfs://``, ``ram://``): it is then read and written through
``tf.io.gfile``, and paths are kept as strings, since pathlib folds ``gs://b`` into ``gs:/b``.
"""
from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import io
import json
import os
import posixpath
import re
import shutil
import socket
import stat
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from hvdtrain.errors import UserError, first_line

MODEL_FILE = "model.keras"
#: What rank 0 exports instead of MODEL_FILE for a model that cannot be rebuilt from its config.
WEIGHTS_FILE = "model.weights.h5"
LOCK_FILE = ".lock"
CONFIG_FILE = "config.json"
TIMELINE_FILE = "timeline.json"
FINGERPRINT = "fingerprint"
"""config.json's record of what the run directory trains (``experiment_changes``)."""
FILES_FILE = "files.npz"
"""The image folder's file table at the run's start (data.listing.FileTable): on a resume it
tells files removed since from any other change of the data."""

# How long a job refused by the lock waits for the holder to write its name into the lock file
# (the holder writes it just after taking the lock): seconds.
_HOLDER_WAIT_SECONDS = 2.0
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")

_held_locks: dict[str, int] = {}
"""Lock file (real path) -> the open descriptor that holds its flock, for this process's life."""


def is_url(path: str) -> bool:
    """True for a path that names its file system (gs://bucket/run), read through tf.io.gfile."""
    return _URL.match(path) is not None


#: What a command that takes file system paths only says to a URL, by what the path is for.
COPY_IT_DOWN = "copy it to a file system first (gcloud storage cp -r, gsutil -m cp -r)"
COPY_IT_UP = "write to a file system path, then copy it up"


def require_file_system_path(flag: str, path: str, remedy: str) -> None:
    """One line for a URL given to a command that reads or writes through the file system's own
    calls (hvdtrain evaluate, predict, export), which would take ``gs://b/x`` for a relative
    path and read or write ``./gs:/b/x``."""
    if is_url(path):
        raise UserError(f"{flag} {path}: this command takes file system paths, not URLs: "
                        f"{remedy}")


def nearest_existing(path: str) -> str | None:
    """``path``, or its closest ancestor that exists; None when none of them does (a relative
    path whose first part is missing)."""
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


class RunDir:
    """Rank 0's reader and writer of one run directory, on a local disk or behind a URL."""

    path: str
    """The directory as a string (a URL keeps its scheme)."""
    remote: bool
    """True when the directory is a URL, reached through tf.io.gfile."""
    is_chief: bool
    """Only the chief writes; the writes of every other rank are no-ops."""
    lock_note: str | None
    """Why this process writes here without holding the lock (set by ``lock``), or None."""

    def __init__(self, path: str | os.PathLike, *, is_chief: bool):
        path = os.fspath(path)
        self.remote = is_url(path)
        self.path = path if self.remote else str(Path(path))
        self.is_chief = is_chief
        self.lock_note = None

    def file(self, name: str) -> str:
        """The path of ``name`` inside the run directory."""
        return posixpath.join(self.path, name)

    @property
    def checkpoints(self) -> str:
        return self.file("checkpoints")

    @property
    def tensorboard(self) -> str:
        return self.file("tensorboard")

    @property
    def model_file(self) -> str:
        return self.file(MODEL_FILE)

    def problem(self, bytes_needed: int = 0) -> str | None:
        """Why rank 0 could not write here, or None. Checked before training, not after."""
        if self.remote:
            return self._remote_problem()
        # The room first, on the nearest directory that exists: a refusal creates nothing.
        free = shutil.disk_usage(nearest_existing(os.path.abspath(self.path))).free
        if free < bytes_needed:
            return (f"run directory {self.path} has {free / 2**20:.1f} MiB free; checkpoints "
                    f"need about {bytes_needed / 2**20:.1f} MiB")
        try:
            os.makedirs(self.checkpoints, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-test-"):
                pass
        except OSError as error:
            return f"run directory {self.path} is not writable: {error.strerror or error}"
        return None

    def _remote_problem(self) -> str | None:
        tf = _tensorflow()
        probe = self.file(f".write-test-{uuid.uuid4().hex}")
        try:
            tf.io.gfile.makedirs(self.checkpoints)
            with tf.io.gfile.GFile(probe, "w") as file:
                file.write("")
            tf.io.gfile.remove(probe)
        except tf.errors.OpError as error:
            return f"run directory {self.path} is not writable: {first_line(error)}"
        # No free-space check: an object store grows on demand and reports no free space.
        return None

    def other_experiment(self, fingerprint: dict[str, str]) -> list[str]:
        """What differs between the experiment this directory recorded and ``fingerprint`` (a
        resume would continue its checkpoint on another one: ``experiment_changes``)."""
        recorded = self.read_json(CONFIG_FILE, {})
        return experiment_changes(
            recorded.get(FINGERPRINT) if isinstance(recorded, dict) else None, fingerprint)

    def lock(self, job: str | None = None) -> str | None:
        """Rank 0: keep other jobs out of this directory until this process ends.

        Returns why it cannot (a live process holds the lock), or None. ``job`` is the
        scheduler's name for this job ("Slurm job 1234"); it goes into the lock file with this
        host and pid, so that a job refused can say who holds the directory.

        An flock, not a pid file: the kernel drops it when its holder dies however it dies
        (SIGKILL, OOM killer), so a dead job never blocks its own resume. On NFS the server keeps
        it, so it holds across nodes; Lustre and BeeGFS do so only when mounted for it (``-o
        flock``, ``tuneUseGlobalFileLocks``), else it guards one node. Another RunDir of the same
        directory in this process finds it already held: it is the same job (a notebook or test
        that trains twice). Where there is no lock (a URL, a file system that refuses locks),
        ``lock_note`` says so and the job runs unguarded.
        """
        if self.remote:
            scheme = self.path.split("://", 1)[0]
            self.lock_note = (f"no run-dir lock on {scheme}:// (it has no file locks): make sure "
                              f"only one job at a time uses {self.path}")
            return None
        # The directory resolved (one key per directory), the lock file itself never followed.
        path = os.path.join(os.path.realpath(self.path), LOCK_FILE)
        if _holds(path):
            return None
        try:
            # A .lock linked to another file (planted by anyone who can write to the directory)
            # would get that file truncated and overwritten with the holder's name.
            descriptor, _ = open_plain_file(path, os.O_RDWR | os.O_CREAT)
        except NotAPlainFile as error:
            return _not_our_lock(path, error.what)
        except OSError as error:
            self.lock_note = f"no run-dir lock: cannot open {path}: {error.strerror or error}"
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(descriptor)
            os.close(descriptor)
            return (f"run directory {self.path} is in use by {holder}; two jobs would overwrite "
                    "each other's checkpoints: wait for it to end, or use another --run-dir")
        except OSError as error:
            os.close(descriptor)
            self.lock_note = (f"no run-dir lock: the file system of {self.path} refuses file "
                              f"locks ({error.strerror or error})")
            return None
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "job": job,
                  "since": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        # Written only now that the lock is ours (opening did not truncate), so the file always
        # names the live holder; fsync pushes it to the server of a shared file system, where a
        # job refused on another node reads it.
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(descriptor)
        _held_locks[path] = descriptor
        return None

    def write_text(self, name: str, text: str) -> None:
        if self.is_chief:
            self._atomic(name, text.encode())

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, json.dumps(obj, indent=2, default=str) + "\n")

    def read_json(self, name: str, default: Any = None) -> Any:
        try:
            return json.loads(self._read_text(name))
        except (OSError, ValueError):
            return default

    def write_csv(self, name: str, rows: Sequence[dict]) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        self.write_text(name, buffer.getvalue())

    def write_with(self, name: str, writer: Callable[[str], None], suffix: str = "") -> None:
        """Let ``writer(tmp_path)`` produce the file (a plot, a Keras model), then rename it.

        ``tmp_path`` is always a local file (Keras and matplotlib write only those); for a URL
        run directory it is copied into place once complete.
        """
        if self.is_chief:
            self._atomic(name, writer, suffix)

    def write_bytes(self, name: str, data: bytes) -> None:
        if self.is_chief:
            self._atomic(name, data)

    def read_bytes(self, name: str) -> bytes:
        """The file's content; OSError when it cannot be read (missing, or a URL's error)."""
        if not self.remote:
            return Path(self.file(name)).read_bytes()
        tf = _tensorflow()
        try:
            with tf.io.gfile.GFile(self.file(name), "rb") as file:
                return file.read()
        except tf.errors.OpError as error:
            raise OSError(first_line(error)) from error

    def _read_text(self, name: str) -> str:
        return self.read_bytes(name).decode()

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(self.file(name))
        return _tensorflow().io.gfile.exists(self.file(name))

    def _atomic(self, name: str, content: bytes | Callable[[str], Any], suffix: str = "") -> None:
        if self.remote:
            self._atomic_remote(name, _as_writer(content), suffix)
            return
        target = Path(self.file(name))
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(str(target), content, suffix)

    def _atomic_remote(self, name: str, writer: Callable[[str], Any], suffix: str) -> None:
        gfile = _tensorflow().io.gfile
        target = self.file(name)
        directory, base = posixpath.split(target)
        suffix = suffix or posixpath.splitext(base)[1]
        gfile.makedirs(directory)
        handle, local = tempfile.mkstemp(prefix=f".{base}.", suffix=suffix)
        os.close(handle)
        staged = posixpath.join(directory, f".{base}.{uuid.uuid4().hex}{suffix}")
        try:
            writer(local)
            gfile.copy(local, staged, overwrite=True)
            # Atomic where the file system renames (HDFS, ram://). On an object store (gs://,
            # s3://) rename is a server-side copy and a delete, and an object appears only once
            # complete, so the real name still never shows a partial file.
            gfile.rename(staged, target, overwrite=True)
        except BaseException:
            if gfile.exists(staged):
                gfile.remove(staged)
            raise
        finally:
            os.unlink(local)


def experiment_changes(recorded: Any, fingerprint: dict[str, str]) -> list[str]:
    """What differs between the fingerprint a run directory recorded and this run's, one
    'part: now was then' each (``data: image folder /a ... was embedded digits ...``).

    A run directory belongs to one experiment: resuming its checkpoint on other data, another
    image shape or another model would train on silently (a checkpoint of the same shapes
    restores into any model of them). What a resume may change (epochs, batch size, learning
    rate, workers: see plan.resize_notes) is never part of a fingerprint. A directory that
    recorded none (made before hvdtrain recorded them), or a part it did not record, differs in
    nothing.
    """
    if not isinstance(recorded, dict):
        return []
    return [f"{part}: {now} was {recorded[part]}" for part, now in fingerprint.items()
            if part in recorded and recorded[part] != now
            and SUPERSEDED.get(part) not in recorded]


#: Fingerprint parts that a later part replaced: compared only with a run directory that
#: recorded the old one alone. "data" named the kind of files ("image folder, 60 samples"), so
#: a folder's TFRecords were another experiment; "samples" does not.
SUPERSEDED = {"data": "samples"}


def replace_atomically(path: str, content: bytes | Callable[[str], Any], suffix: str = "") -> None:
    """Put ``content`` (bytes, or a ``writer(tmp_path)`` that makes the file) at ``path`` whole.

    The rule for every file hvdtrain writes in place of another: a temporary file beside it,
    made by mkstemp (a random name, O_EXCL|O_NOFOLLOW, so nothing planted is opened), its data
    fsync'd, renamed over ``path``, then the directory fsync'd. So after a crash (even of the
    node) ``path`` holds the old file or the new one, never an empty or partial one, and a
    rename that returned is on disk. Bytes are written through the descriptor mkstemp opened; a
    writer (matplotlib, Keras) opens the temporary name again itself, which in a directory
    others may write to they could swap first: keep run directories writable by their owner.
    """
    directory, base = os.path.split(path)
    handle, tmp = tempfile.mkstemp(dir=directory or ".", prefix=f".{base}.",
                                   suffix=suffix or os.path.splitext(base)[1])
    try:
        if callable(content):
            os.close(handle)
            handle = None
            content(tmp)
            handle = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW)
        else:
            with os.fdopen(handle, "wb", closefd=False) as file:
                file.write(content)
        os.fchmod(handle, 0o666 & ~current_umask())  # mkstemp makes 0600: the usual permissions
        os.fsync(handle)
        os.close(handle)
        handle = None
        os.replace(tmp, path)
    except BaseException:
        if handle is not None:
            os.close(handle)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    directory_handle = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory_handle)
    finally:
        os.close(directory_handle)


def _as_writer(content: bytes | Callable[[str], Any]) -> Callable[[str], Any]:
    return content if callable(content) else lambda tmp: Path(tmp).write_bytes(content)


class NotAPlainFile(OSError):
    """What ``open_plain_file`` found at a path instead of a plain file of one link."""

    SYMBOLIC_LINK = "a symbolic link"

    def __init__(self, path: str, what: str):
        super().__init__(f"{path} is {what}")
        self.what = what


def open_plain_file(path: str, flags: int, mode: int = 0o666) -> tuple[int, os.stat_result]:
    """``(descriptor, its stat)`` of ``path`` opened with ``flags``, never through a link:
    ``NotAPlainFile`` when ``path`` is a symbolic link (``O_NOFOLLOW``), a hard link to another
    file, or no plain file at all (a FIFO, a device, a directory); other failures are the
    ``OSError`` of ``open``. Whoever can write to a directory can plant a link in it, which would
    have a job write to (or truncate) whatever file the link names."""
    try:
        descriptor = os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotAPlainFile(path, NotAPlainFile.SYMBOLIC_LINK) from None
        raise
    found = os.fstat(descriptor)
    if not stat.S_ISREG(found.st_mode) or found.st_nlink != 1:
        os.close(descriptor)
        raise NotAPlainFile(path, "not a plain file" if not stat.S_ISREG(found.st_mode)
                            else "a hard link to another file")
    return descriptor, found


def _not_our_lock(path: str, what: str) -> str:
    return (f"{path} is {what}, which hvdtrain never makes (someone who can write to its "
            "directory may be trying to have this job overwrite another file): remove it, check "
            "who can write to the run directory, and start again")


def _holds(path: str) -> bool:
    """True if this process holds the lock on ``path`` (and it is still the file at ``path``)."""
    descriptor = _held_locks.get(path)
    if descriptor is None:
        return False
    held = os.fstat(descriptor)
    try:
        current = os.lstat(path)
    except FileNotFoundError:
        current = None
    if current is not None and (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino):
        return True
    # The directory was deleted (and maybe made again) since: that lock guards nothing now.
    os.close(descriptor)
    del _held_locks[path]
    return False


def _read_holder(descriptor: int) -> str:
    """Who holds the lock, as its lock file says, e.g. 'Slurm job 42, pid 7 on host node3 ...'."""
    deadline = time.monotonic() + _HOLDER_WAIT_SECONDS
    while True:
        try:
            holder = json.loads(os.pread(descriptor, 4096, 0))
        except ValueError:  # the holder has not written its name yet
            holder = None
        if isinstance(holder, dict):
            break
        if time.monotonic() > deadline:
            return "another process (it has not written its name into the lock file)"
        time.sleep(0.05)
    who = f"pid {holder.get('pid')} on host {holder.get('host')}"
    if holder.get("job"):
        who = f"{holder['job']}, {who}"
    return f"{who} (since {holder.get('since')})"


def _tensorflow():
    """TensorFlow, imported when a URL run directory first needs tf.io.gfile: local run
    directories (and tools that write results through RunDir without training) never load it."""
    import tensorflow as tf

    return tf


def current_umask() -> int:
    """The process's umask, read without setting it (so it is never 0, not even for a moment).

    Linux (>= 4.7) shows it in /proc/self/status, read on every call so a later ``os.umask``
    counts. Elsewhere, the umask this module found when it was imported.
    """
    mask = _umask_from_proc()
    return _UMASK_AT_IMPORT if mask is None else mask


def _umask_from_proc() -> int | None:
    """The umask from the ``Umask:`` line (octal) of /proc/self/status, or None without one."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return None


def _umask_at_import() -> int:
    """Without /proc the only way to read the umask is to set it and set it back, and a file
    another thread creates in between (TensorBoard events, tf.data) gets mode 0666/0777. So that
    is done once, when this module is imported, before training starts its threads."""
    mask = _umask_from_proc()
    if mask is None:
        mask = os.umask(0)
        os.umask(mask)
    return mask


_UMASK_AT_IMPORT = _umask_at_import()


#: Fingerprint parts that files removed from an image folder change, and nothing else does
#: when its file table shows only removals (``ensure_writable``).
CHANGED_BY_REMOVED_FILES = ("data", "samples", "labels")


def ensure_writable(run_dir: RunDir, runtime, bytes_needed: int, job: str | None = None,
                    fingerprint: dict[str, str] | None = None, accept_change: bool = False,
                    file_table=None) -> str | None:
    """Rank 0 checks the directory is this experiment's (when given its ``fingerprint``; with
    ``accept_change`` a changed one goes on, said in the note), that it can write here, and
    takes the lock; every rank raises the same one-line error if any failed. ``file_table``
    (an image folder's ``data.listing.FileTable``): files removed since the directory recorded
    its table are no new experiment (each file's side of the split is its own), said in the
    note. Returns rank 0's notes (None on other ranks, or when there is nothing to say)."""
    notes = []

    def check_and_lock() -> None:  # all checks, so the other ranks wait for one verdict
        # The experiment first: a refused run leaves the directory as it found it.
        changes = run_dir.other_experiment(fingerprint) if fingerprint else []
        removed = _files_removed(run_dir, file_table) if changes and file_table else None
        if removed:
            changes = [change for change in changes
                       if change.split(":", 1)[0] not in CHANGED_BY_REMOVED_FILES]
        if changes and not accept_change:
            raise UserError(f"run directory {run_dir.path} holds another experiment "
                            f"({'; '.join(changes)}): use another --run-dir, or "
                            "--accept-experiment-change to train its checkpoint on with this one")
        problem = run_dir.problem(bytes_needed) or run_dir.lock(job)
        if problem:
            raise UserError(problem)
        if removed:
            notes.append(f"run directory {run_dir.path}: {removed} of its image folder's files "
                         "are gone since it started (removed, as a file that does not decode "
                         "may be); the others keep their side of the split, so it resumes")
        if changes:
            notes.append(f"run directory {run_dir.path}: its experiment changed "
                         f"({'; '.join(changes)}); going on from its checkpoint, as "
                         "--accept-experiment-change asks")
        if file_table is not None and not removed and (changes or not run_dir.exists(FILES_FILE)):
            # The table this experiment starts from (a resume that only lost files keeps the
            # one it started with, so that files removed twice are still only removals).
            run_dir.write_bytes(FILES_FILE, file_table.to_bytes())

    runtime.from_chief(check_and_lock)
    notes += [run_dir.lock_note] if run_dir.lock_note else []
    return "\n".join(notes) or None


def _files_removed(run_dir: RunDir, file_table) -> int | None:
    """How many files the table the directory recorded has that ``file_table`` lacks, when that
    is the only difference (``FileTable.files_removed_since``); None otherwise, or when it
    recorded none (a directory from before) or it cannot be read."""
    try:
        recorded = type(file_table).from_bytes(run_dir.read_bytes(FILES_FILE))
    except (OSError, ValueError, KeyError, EOFError):
        return None
    return file_table.files_removed_since(recorded)
