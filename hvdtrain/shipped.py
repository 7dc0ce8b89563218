"""What hvdtrain ships for users to copy and change: the examples (`hvdtrain examples DIR`), and
the one way such files are written (``write_new_files``; the Slurm templates use it too).

They are package data (hvdtrain/examples/; the repository's examples/ links there), so an
installed hvdtrain writes the same files a checkout has. Writing into a user's directory never
replaces a file there (``write_new_files``): a copy they edited is theirs.
"""
from __future__ import annotations

import importlib.resources
import os
import sys
from typing import Mapping, Sequence

from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import UserError, reported
from hvdtrain.flags import OneLineParser

PROGRAM = "hvdtrain.shipped"


def examples() -> dict[str, bytes]:
    """File name -> contents of every example hvdtrain ships."""
    folder = importlib.resources.files("hvdtrain") / "examples"
    return {entry.name: entry.read_bytes()
            for entry in sorted(folder.iterdir(), key=lambda entry: entry.name)
            if entry.is_file()}  # not a __pycache__ that loading one as --model left


def write_new_files(directory: str, contents: Mapping[str, bytes], what: str,
                    mode: int = 0o644) -> list[str]:
    """Each of ``contents`` (file name -> bytes) as a new file of ``mode`` in ``directory``
    (made if missing); the paths written. A file already there is refused (one line naming
    ``what`` was being written) before anything is written."""
    paths = {name: os.path.join(directory, name) for name in contents}
    existing = [path for path in paths.values() if os.path.lexists(path)]
    if existing:
        raise UserError(f"{', '.join(existing)} already exist(s); not overwriting: remove them "
                        "or choose another directory")
    try:
        os.makedirs(directory, exist_ok=True)
        for name, path in paths.items():
            with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as file:
                file.write(contents[name])
    except OSError as error:
        raise UserError(f"cannot write the {what} into {directory}: {error}") from None
    return list(paths.values())


def run(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog=usage_name(PROGRAM),
                           description="Write the examples hvdtrain ships into DIRECTORY: a "
                                       "model file for --model, a job of its own through the "
                                       "API, and horovod's own Keras example, which the "
                                       "launcher runs unchanged. Existing files are not "
                                       "touched. docs/your-job.md has the rest.")
    parser.add_argument("directory", help="where the files go (made if missing)")
    options = parser.parse_args(argv)
    for path in write_new_files(options.directory, examples(), "examples"):
        print(path)
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    with reported(error_name(PROGRAM)):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
