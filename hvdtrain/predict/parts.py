"""`hvdtrain predict`'s parts: the inputs cut into parts of ``part_size``, each predicted by one
rank into ``OUTPUT.parts/part-NNNNNN.jsonl`` (written beside, renamed into place whole), then
merged in order into the output by rank 0, which removes the parts.

A run stopped part-way (a crash, a preemption, a node lost) leaves its finished parts; the same
command run again, on any number of ranks, predicts only the others. The directory's
``predict.json`` says what its parts are of (the inputs, the model, the options): parts of
anything else are never merged in.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from hvdtrain.errors import RankError, UserError, as_one_line

MANIFEST = "predict.json"
PART = re.compile(r"part-(\d{6})\.jsonl")
#: Rows read back at a time when merging.
MERGE_BLOCK = 4096


class Parts:
    def __init__(self, output: str, count: int, part_size: int):
        self.output, self.count, self.part_size = output, count, part_size
        self.directory = output + ".parts"

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
        (the others' half-written files removed); the finished parts' numbers."""
        directory = self.directory
        if not os.path.lexists(directory):
            try:
                os.mkdir(directory)  # not exist_ok: made here, or refused below next time
                _write_atomically(os.path.join(directory, MANIFEST),
                                  json.dumps(identity, indent=2) + "\n")
            except OSError as error:
                raise UserError(f"cannot make {directory}: {as_one_line(error)}") from None
            return []
        status = os.lstat(directory)
        if os.path.islink(directory) or not os.path.isdir(directory) \
                or status.st_uid != os.getuid():
            raise UserError(f"{directory} exists and is not a directory of yours that predict "
                            "made: remove it, or name another --output")
        try:
            with open(os.path.join(directory, MANIFEST)) as file:
                recorded = json.load(file)
        except (OSError, ValueError):
            recorded = None
        if recorded != identity:
            changed = (", ".join(sorted(key for key in identity
                                        if recorded.get(key) != identity[key]))
                       if isinstance(recorded, dict) else "it holds no predict.json")
            raise UserError(f"{directory} holds the parts of another prediction ({changed} "
                            "differ): remove it to start over, or name another --output")
        finished = []
        for name in os.listdir(directory):
            match = PART.fullmatch(name)
            if match and int(match.group(1)) < self.num_parts:
                finished.append(int(match.group(1)))
            elif name != MANIFEST:
                os.remove(os.path.join(directory, name))  # a part a stopped rank was writing
        return sorted(finished)

    # --- each rank --------------------------------------------------------------------------------
    def writing(self, part: int) -> PartFile:
        """Part ``part``'s file, written beside and renamed into place by ``finish``."""
        return PartFile(self.path(part))

    # --- rank 0, once every rank is done --------------------------------------------------------
    def merge(self, writer) -> int:
        """Every part's rows, in order, into ``writer``; the rows written."""
        missing = [part for part in range(self.num_parts)
                   if not os.path.isfile(self.path(part))]
        if missing:
            raise UserError(f"{len(missing)} part(s) are not in {self.directory} (first: "
                            f"{os.path.basename(self.path(missing[0]))}), though their ranks "
                            "finished: the --output folder must be on a file system every "
                            "rank's node shares")
        rows = 0
        for part in range(self.num_parts):
            with open(self.path(part), encoding="utf-8") as file:
                block = []
                for line in file:
                    block.append(json.loads(line))
                    if len(block) == MERGE_BLOCK:
                        writer.write(block)
                        rows, block = rows + len(block), []
                if block:
                    writer.write(block)
                    rows += len(block)
        return rows

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


class PartFile:
    def __init__(self, path: str):
        self.path = path
        try:
            self.file = tempfile.NamedTemporaryFile(
                "w", dir=os.path.dirname(path), delete=False, suffix=".tmp",
                prefix=f".{os.path.basename(path)}.", encoding="utf-8")
        except OSError as error:
            raise self.failed(error) from None

    def write(self, rows: list[dict]) -> None:
        try:
            self.file.writelines(json.dumps(row) + "\n" for row in rows)
        except OSError as error:
            raise self.failed(error) from None

    def finish(self) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.file.name, self.path)
        except OSError as error:
            raise self.failed(error) from None

    def failed(self, error: OSError) -> RankError:
        # Each rank writes its own parts: a folder only rank 0's node sees is one reason.
        return RankError(f"cannot write {self.path}: {as_one_line(error)} (the --output folder "
                         "must be on a file system every rank's node shares)")


def _write_atomically(path: str, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False,
                                     suffix=".tmp") as file:
        file.write(text)
    os.replace(file.name, path)
