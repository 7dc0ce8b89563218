"""The run directory: every file a job writes goes through here, and only rank 0 writes.

Layout of ``<run_dir>``::

    config.json        resolved config, training plan, world, versions
    checkpoints/       tf.train.CheckpointManager files (ckpt-N.index/.data, checkpoint)
    metrics.csv/.json  one row per completed epoch (loss, accuracy, samples/s, seconds, ...)
    curves.png         training curves, redrawn after every epoch
    tensorboard/       TensorBoard event files
    model.keras        the final model, without optimizer state

Each file is written to a temporary name and renamed into place, so a crash never leaves a
half-written file under the real name.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from hvdtrain.errors import UserError


class RunDir:
    def __init__(self, path: str | os.PathLike, *, is_chief: bool):
        self.path = Path(path)
        self.is_chief = is_chief

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def model_file(self) -> Path:
        return self.path / "model.keras"

    def problem(self, bytes_needed: int = 0) -> str | None:
        """Why rank 0 could not write here, or None. Checked before training, not after."""
        try:
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-test-"):
                pass
        except OSError as error:
            return f"run directory {self.path} is not writable: {error.strerror or error}"
        free = shutil.disk_usage(self.path).free
        if free < bytes_needed:
            return (f"run directory {self.path} has {free / 2**20:.1f} MiB free; checkpoints "
                    f"need about {bytes_needed / 2**20:.1f} MiB")
        return None

    def write_text(self, name: str, text: str) -> None:
        if self.is_chief:
            self._atomic(name, lambda tmp: Path(tmp).write_text(text))

    def write_json(self, name: str, obj: Any) -> None:
        self.write_text(name, json.dumps(obj, indent=2, default=str) + "\n")

    def read_json(self, name: str, default: Any = None) -> Any:
        try:
            return json.loads((self.path / name).read_text())
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
        """Let ``writer(tmp_path)`` produce the file (a plot, a Keras model), then rename it."""
        if self.is_chief:
            self._atomic(name, writer, suffix)

    def _atomic(self, name: str, writer: Callable[[str], Any], suffix: str = "") -> None:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.",
                                       suffix=suffix or target.suffix)
        os.close(handle)
        try:
            writer(tmp)
            # mkstemp makes 0600; give the usual permissions.
            os.chmod(tmp, 0o666 & ~current_umask())
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise


def current_umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def ensure_writable(run_dir: RunDir, runtime, bytes_needed: int) -> None:
    """Rank 0 checks; every rank raises the same one-line error if it failed."""
    problem = run_dir.problem(bytes_needed) if run_dir.is_chief else None
    problem = runtime.broadcast_object(problem)
    if problem:
        raise UserError(problem)
