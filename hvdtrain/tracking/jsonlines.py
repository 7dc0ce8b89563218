"""``--track jsonl:PATH``: rank 0 appends the run to a local file, one JSON object per line (a
``hvdtrain.tracking`` tracker).

Each line is an event of one run directory, in the order they happened::

    {"event": "start", "time": ..., "run_dir": ..., "program": ..., "job": ...,
     "epochs_done": 0, "params": {"config": {...}, "plan": {...}, "world": {...}, "run": {...}}}
    {"event": "epoch", "time": ..., "run_dir": ..., "epoch": 1, "metrics": {"loss": ..., ...}}
    {"event": "finish", "time": ..., "run_dir": ..., "status": "FINISHED", "model_file": ...}

An epoch is written once its checkpoint is. Every start of the run directory (a rerun, a
restart, a requeue) appends its own ``start``, naming the epochs its checkpoint holds; an epoch
trained again after a resume from an older checkpoint appears again, and the last line of an
epoch counts. Several jobs may append to one file (a sweep): ``run_dir`` tells their lines apart,
and each line goes in with one ``write`` of an ``O_APPEND`` descriptor, whole.

The file is this user's own: PATH is opened with ``O_NOFOLLOW`` (a symbolic link there, which
anyone who can write to its directory could plant, is refused, never followed), and must be a
plain file with one link, owned by this user; it is created (mode 0666 less the umask) when
missing, in a directory that must exist. A PATH that breaks a rule is one line on every rank
before the data is read. A write that fails once training runs (a full disk; a line cut short too,
whose newline then follows) costs one line;
training goes on.
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping

from hvdtrain.errors import UserError
from hvdtrain.rundir import NotAPlainFile, RunDir, is_url, open_plain_file
from hvdtrain.tracking import jsonl_path


def check(config) -> None:
    """Rank 0, before the data is read: ``UserError`` unless the file may be appended to."""
    os.close(open_for_append(jsonl_path(config.track)))


def start(program: str, config, run_dir: RunDir, sections: Mapping[str, Mapping[str, Any]],
          rows: list[dict], job: str | None) -> tuple["JsonLinesTracker", str]:
    """Rank 0: the file opened, the run's ``start`` line appended, and the start line."""
    path = jsonl_path(config.track)
    tracker = JsonLinesTracker(open_for_append(path), path, run_dir.path, rows)
    tracker.append({"event": "start", "program": program, "job": job,
                    "epochs_done": tracker.logged_through, "params": sections})
    return tracker, f"tracking: appending to {os.path.abspath(path)} (JSON lines)"


def open_for_append(path: str) -> int:
    """A descriptor appending to ``path``, this user's plain file (created when missing);
    ``UserError`` naming the rule it breaks."""
    shown = f"--track jsonl:{path}"
    if is_url(path):
        raise UserError(f"{shown}: the JSON-lines tracker appends to a local file, not a URL")
    try:
        # O_NONBLOCK: a FIFO planted there is refused at once, not waited on for a reader.
        descriptor, found = open_plain_file(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC)
    except NotAPlainFile as error:
        if error.what == NotAPlainFile.SYMBOLIC_LINK:
            raise UserError(f"{shown}: {path} is a symbolic link, which hvdtrain never follows "
                            "(whoever can write to its directory may have planted it): name "
                            "the file itself") from None
        raise UserError(f"{shown}: {path} is {error.what}, which this job does not append to: "
                        "name a file of your own") from None
    except OSError as error:
        raise UserError(f"{shown}: cannot append to {path}: {error.strerror or error}") from None
    if found.st_uid != os.getuid():
        os.close(descriptor)
        raise UserError(f"{shown}: {path} is owned by another user (uid {found.st_uid}), which "
                        "this job does not append to: name a file of your own")
    return descriptor


class JsonLinesTracker:
    """Rank 0's appender of one run directory's events (see the module)."""

    def __init__(self, descriptor: int, path: str, run_dir: str, rows: list[dict]):
        self.descriptor = descriptor
        self.path = path
        self.run_dir = run_dir
        self.logged_through = rows[-1]["epoch"] if rows else 0
        """The last epoch written (or that the checkpoint already held at start)."""
        self._finished = False
        self._said = False
        self._unterminated = False
        """A line of ours was cut and its newline could not be written yet."""

    def log_epochs(self, rows: list[dict]) -> None:
        for row in rows:
            if row["epoch"] > self.logged_through:
                self.append({"event": "epoch", "epoch": row["epoch"],
                             "metrics": {key: value for key, value in row.items()
                                         if key != "epoch"}})
                self.logged_through = row["epoch"]

    def finish(self, status: str, model_file: str | None) -> None:
        if self._finished:
            return
        self._finished = True
        self.append({"event": "finish", "status": status, "model_file": model_file})
        os.close(self.descriptor)

    def fail(self) -> None:
        self.finish("FAILED", model_file=None)

    def append(self, event: dict) -> None:
        """One line, in one write (O_APPEND puts it whole at the end even with other writers).

        A short write (a full disk) cuts the line: that is a failure too, and the file must not
        be left without its newline, or the next line appended (this job's or another's) would
        be glued to the cut one and both lost. So a newline follows at once, or, when that
        cannot be written either, starts the next line this tracker writes."""
        line = json.dumps({"event": event["event"],
                           "time": datetime.datetime.now().isoformat(timespec="seconds"),
                           "run_dir": self.run_dir, **event}, default=str) + "\n"
        data = (b"\n" if self._unterminated else b"") + line.encode()
        try:
            written = os.write(self.descriptor, data)
        except OSError as error:
            self._say(error.strerror or str(error))
            return
        if written == len(data):
            self._unterminated = False
            return
        self._unterminated = True
        self._say(f"a short write, {written} of {len(data)} bytes: is the disk full?")
        try:
            self._unterminated = os.write(self.descriptor, b"\n") != 1
        except OSError:
            pass

    def _say(self, why: str) -> None:
        if not self._said:
            self._said = True
            print(f"hvdtrain: tracking: cannot append to {self.path} ({why}); training goes on, "
                  "metrics.json keeps every epoch", flush=True)
