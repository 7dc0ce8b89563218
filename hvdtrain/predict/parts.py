"""`hvdtrain predict`'s parts: the inputs cut into parts of ``part_size``, each predicted by one
rank into ``OUTPUT.parts/part-NNNNNN.jsonl`` (written beside, renamed into place whole), then
merged in order into the output by rank 0, which removes the parts.

A run stopped part-way (a crash, a preemption, a node lost) leaves its finished parts; the same
command run again, on any number of ranks, predicts only the others. The directory's
``predict.json`` says what its parts are of (the inputs, the model, the options): parts of
anything else are never merged in. The directory is its owner's alone (0700): nobody else can
put a part into it.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import time
from typing import Callable, Iterable

from hvdtrain.errors import RankError, UserError, as_one_line
from hvdtrain.rundir import replace_atomically

MANIFEST = "predict.json"
PART = re.compile(r"part-(\d{6})\.jsonl")
#: Rows handed to the output's writer at a time when merging (a Parquet row group).
MERGE_BLOCK = 65_536
#: Seconds rank 0 waits for the other ranks' parts while nothing in the directory changes
#: (a part being written grows every few rows), before it says so and ends the job.
IDLE_SECONDS = 900.0


class Parts:
    def __init__(self, output: str, count: int, part_size: int):
        self.output, self.count, self.part_size = output, count, part_size
        self.directory = output + ".parts"
        self._lock: int | None = None

    @property
    def num_parts(self) -> int:
        return -(-self.count // self.part_size)

    def bounds(self, part: int) -> tuple[int, int]:
        start = part * self.part_size
        return start, min(start + self.part_size, self.count)

    def path(self, part: int) -> str:
        return os.path.join(self.directory, f"part-{part:06d}.jsonl")

    # --- rank 0, before anyone predicts ---------------------------------------------------------
    def prepare(self, identity: dict) -> list[int]:
        """Make the directory, or find the parts a stopped run of the same prediction finished
        (the others' half-written files removed); the finished parts' numbers. Rank 0 holds a
        lock on it until the output is merged: a second predict into it is refused."""
        directory, manifest = self.directory, os.path.join(self.directory, MANIFEST)
        if not os.path.lexists(directory):
            try:
                os.mkdir(directory, 0o700)  # not exist_ok: made here, or checked below
                replace_atomically(manifest, (json.dumps(identity, indent=2) + "\n").encode())
            except OSError as error:
                raise UserError(f"cannot make {directory}: {as_one_line(error)}") from None
            self._take_lock(manifest)
            return []
        status = os.lstat(directory)
        if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.getuid() \
                or status.st_mode & 0o077:
            raise UserError(f"{directory} exists and is not a directory of yours that predict "
                            "made (a link, another user's, or open to others): remove it, or "
                            "name another --output")
        try:
            with open(manifest) as file:
                recorded = json.load(file)
        except (OSError, ValueError):
            recorded = None
        if recorded != identity:
            changed = (", ".join(sorted(key for key in identity
                                        if recorded.get(key) != identity[key]))
                       if isinstance(recorded, dict) else "it holds no predict.json")
            raise UserError(f"{directory} holds the parts of another prediction ({changed} "
                            "differ): remove it to start over, or name another --output")
        self._take_lock(manifest)
        finished = []
        for name in os.listdir(directory):
            match = PART.fullmatch(name)
            path = os.path.join(directory, name)
            if match and int(match.group(1)) < self.num_parts and os.path.isfile(path):
                finished.append(int(match.group(1)))
            elif name != MANIFEST and not os.path.isdir(path):
                os.remove(path)  # a part a stopped rank was writing
        return sorted(finished)

    def _take_lock(self, manifest: str) -> None:
        try:
            self._lock = os.open(manifest, os.O_RDONLY | os.O_NOFOLLOW)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UserError(f"another hvdtrain predict is writing {self.output} (it holds "
                            f"{manifest}): wait for it, or name another --output") from None

    # --- each rank --------------------------------------------------------------------------------
    def write(self, part: int, rows: Iterable[list[dict]]) -> int:
        """Part ``part``'s ``rows`` (blocks of them), on disk whole under its name; the rows."""
        path, written = self.path(part), 0

        def write_to(tmp: str) -> None:
            nonlocal written
            with open(tmp, "w", encoding="utf-8") as file:
                for block in rows:
                    file.writelines(json.dumps(row) + "\n" for row in block)
                    written += len(block)

        try:
            replace_atomically(path, write_to)
        except OSError as error:
            # Each rank writes its own parts: a folder only rank 0's node sees is one reason.
            raise RankError(f"cannot write {path}: {as_one_line(error)} (the --output folder "
                            "must be on a file system every rank's node shares)") from None
        return written

    # --- rank 0, once its own parts are written -------------------------------------------------
    def wait_for_all(self, say: Callable[[str], None], every_seconds: float) -> None:
        """Return once every part is in the directory. The ranks finish at their own pace and
        run no collective at the end (a rank that waited in one longer than horovod's stall
        limit would end the job), so rank 0 looks for their parts; one line, and the job ends,
        when none came and nothing changed for ``IDLE_SECONDS``."""
        last_change, said = time.monotonic(), time.monotonic()
        seen: dict[str, float] = {}
        while True:
            missing = [part for part in range(self.num_parts)
                       if not os.path.isfile(self.path(part))]
            if not missing:
                return
            now = time.monotonic()
            current = _mtimes(self.directory)
            if current != seen:
                seen, last_change = current, now
            if now - last_change > IDLE_SECONDS:
                raise UserError(
                    f"{len(missing)} part(s) are not in {self.directory} (first: "
                    f"{os.path.basename(self.path(missing[0]))}) and nothing there changed for "
                    f"{IDLE_SECONDS:.0f} s: a rank stalled, or the --output folder is not on a "
                    "file system every rank's node shares")
            if every_seconds and now - said >= every_seconds:
                said = now
                say(f"waiting for {len(missing)} part(s) of the other ranks")
            time.sleep(0.2)

    def merge(self, writer) -> tuple[int, int]:
        """Every part's rows, in order, into ``writer``; (rows, rows with an error)."""
        rows, failed, block = 0, 0, []
        for part in range(self.num_parts):
            start, stop = self.bounds(part)
            counted = 0
            with open(self.path(part), encoding="utf-8") as file:
                for line in file:
                    row = json.loads(line)
                    failed += row["error"] is not None
                    block.append(row)
                    counted += 1
                    if len(block) == MERGE_BLOCK:
                        writer.write(block)
                        rows, block = rows + len(block), []
            if counted != stop - start:  # never expected: a part is renamed into place whole
                raise UserError(f"{self.path(part)} holds {counted} rows, not {stop - start}: "
                                f"remove it and run the same command again")
        if block:
            writer.write(block)
            rows += len(block)
        return rows, failed

    def release(self) -> None:
        """Let another predict into the directory (as this process's end would)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def remove(self) -> None:
        self.release()
        shutil.rmtree(self.directory, ignore_errors=True)


def _mtimes(directory: str) -> dict[str, float]:
    try:
        with os.scandir(directory) as entries:
            return {entry.name: entry.stat().st_mtime for entry in entries}
    except OSError:
        return {}
