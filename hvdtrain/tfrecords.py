"""Write TFRecord shards from an image folder: `python -m hvdtrain.tfrecords --data-dir D --out O`.

Each record holds an encoded image under ``image`` (decoding happens in the training pipeline,
after sharding) and its class index under ``label`` (int64); ``hvdtrain.data.records`` owns the
format and reads it. The image is the file's bytes unchanged (PNG/JPEG/GIF/BMP) when its shorter
side is at most ``--max-resolution`` pixels (default: what training at ``--image-size`` decodes
to with ``--augment``, 256 for 224; ``off`` keeps every file as it is), else a JPEG of it resized
once to that shorter side (see MaxResolution).
The train/validation split is the same one ``--data-dir`` training uses (same seed, same
fraction), and sample i of a split goes to shard i mod N, so what a shard holds does not depend
on how many workers wrote it. Output::

    O/train-00000-of-00004.tfrecord ...  O/validation-00000-of-00001.tfrecord  O/dataset.json

``dataset.json`` records class names, image size, the record count of every shard (so training
does not have to count records at start-up) and the limit images were stored at.

Workers: ``--workers`` processes (default: one per core this process may use, fewer for a small
folder) each write whole shards. A worker reads a file once, checks its first bytes and skips any
file that is unreadable or no PNG/JPEG/GIF/BMP image, or with a size limit one whose header (or,
to resize it, whose pixels) Pillow cannot decode (counted in ``dataset.json``'s "skipped");
with ``--on-bad-image fail`` the first such file stops the conversion and nothing is kept.
Progress goes to stderr: records done, records/s and the time left, on one line redrawn in place
on a terminal, as a line every 10 s in a log file (``--quiet``: none).

Interruptions: shards are written into ``O.partial/``, each under a temporary name renamed once
complete, beside a ``plan.json`` of what defines the output (data folder, a fingerprint of its
files and labels, split, shards). Rerunning the same command after Ctrl-C, a kill or a lost node
keeps the complete shards and writes the rest; a rerun with other arguments or changed data (the
plan's fingerprint, and the size and modification time of every file of a complete shard, kept in
its marker in ``done/``) is refused, and so is a second converter while one holds the directory's
lock. At the end ``O.partial/`` becomes ``O``: ``O`` is either complete or absent.
"""
from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import concurrent.futures
import dataclasses
import io
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, TextIO

from hvdtrain.cli import error_name, usage_name
from hvdtrain.data.augment import CENTER_FRACTION
from hvdtrain.data.folder import FolderListing, list_image_folder
from hvdtrain.data.images import converter_pixels_limit, image_format_of_bytes
from hvdtrain.data.listing import DEFAULT_FILE_IMAGE_SIZE
from hvdtrain.data.records import (METADATA, SPLIT_BY_NAME, TRAIN, VALIDATION,
                                   serialize_example, shard_name, shorter_side_decoded)
from hvdtrain.errors import UserError, first_line, reported
from hvdtrain.flags import FlagHelpFormatter, OneLineParser
from hvdtrain.rundir import current_umask, replace_atomically, require_file_system_path

if TYPE_CHECKING:
    from multiprocessing.sharedctypes import Synchronized
    from multiprocessing.synchronize import Event

PROGRAM = "hvdtrain.tfrecords"
STAGING_SUFFIX = ".partial"
PLAN = "plan.json"
DONE_DIR = "done"
"""Sub-directory of the staging directory with one JSON marker per complete shard."""
REPORT_SECONDS = 0.25
"""How often a worker adds its processed files to the shared count (and checks it should go on)."""
TERMINAL_SECONDS = 0.25
"""Redraw interval of the progress line on a terminal."""
LOG_SECONDS = 10.0
"""Interval between progress lines when stderr is a file or pipe (CI, Slurm logs)."""
RATE_WINDOW_SECONDS = 30.0
"""The progress line's records/s, and so its ETA, are over this last stretch: the current speed
(not diluted by the workers' start-up, following a file system that slows down)."""
FILES_PER_WORKER = 5000
"""The default starts a worker per this many files at most: each worker process imports
TensorFlow (~2.5 s, ~0.45 GB), which a small folder does not pay back."""
DEFAULT_JPEG_QUALITY = 90
"""Quality of the JPEGs resized images are stored as (libjpeg's 1-100 scale; FFCV's default)."""


class BadImageError(UserError):
    """A file that is no readable image, with --on-bad-image fail."""


class TooManyPixels(Exception):
    """An image whose decode for resizing would exceed the converter's pixel limit."""


class _Stopped(Exception):
    """Raised in a worker told to stop (Ctrl-C, or another worker failed)."""


@dataclass(frozen=True)
class ShardTask:
    """One output file and its samples, in record order."""

    name: str
    paths: list[str]
    labels: list[int]


@dataclass(frozen=True)
class MaxResolution:
    """The largest image a shard stores: an image whose shorter side is over ``shorter_side``
    pixels is stored resized to that shorter side (aspect ratio kept) as a JPEG of
    ``jpeg_quality``; any other is stored as its file's bytes, unchanged.

    The shorter side, not the longer (FFCV's max_resolution): training resizes an image to a
    square (or crops a square from it), so it needs ``shorter_side`` pixels along both axes, and a
    limit on the longer side would leave a 4:3 photo's shorter side at 3/4 of that, upsampled.
    """

    shorter_side: int
    jpeg_quality: int

    def __post_init__(self):
        if self.shorter_side < 1:
            raise UserError(f"--max-resolution must be at least 1 (or off), got "
                            f"{self.shorter_side}")
        if not 1 <= self.jpeg_quality <= 100:
            raise UserError(f"--jpeg-quality must be in 1..100, got {self.jpeg_quality}")

    def stored(self, encoded: bytes, image_format: str) -> tuple[bytes, bool] | None:
        """(what a shard stores for a file of ``image_format``, whether it was resized); None
        when its header or, for one to resize, its pixels do not decode. TooManyPixels when the
        pixels to decode for resizing it (a JPEG's at its DCT scale) are over
        ``converter_pixels_limit``.

        Resized images become JPEGs, RGB or gray as their pixels are, whatever their format: what
        training decodes (1 or 3 channels) has no alpha, so alpha is dropped the way TensorFlow's
        decoders drop it, and a JPEG decodes faster and, unlike PNG, can decode just a crop
        window. EXIF orientation is not applied (TensorFlow does not apply it either), so the
        pixels keep the orientation training saw in the original.
        """
        from PIL import Image

        # Pillow's own bound (its decompression bomb check, at open, on the full size) would
        # refuse a large image that is kept as it is, or a JPEG that decodes scaled down: the
        # pixels actually decoded are bounded below instead.
        Image.MAX_IMAGE_PIXELS = None
        try:
            image = Image.open(io.BytesIO(encoded), formats=[image_format])
            width, height = image.size
            if min(width, height) <= self.shorter_side:
                return encoded, False
            scale = self.shorter_side / min(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            # A JPEG decodes already scaled down by 2, 4 or 8 in the DCT (much less work), to
            # no less than twice the size, so the filter below still makes the last step.
            image.draft(None, (2 * size[0], 2 * size[1]))
            if image.size[0] * image.size[1] > converter_pixels_limit(self.shorter_side):
                raise TooManyPixels(f"{width}x{height}")
            # Pillow's bilinear filter widens with the scale (antialiased, torchvision's default
            # for Resize): 2.0 ms a 500x375 photo on one core where Lanczos took 3.7.
            pixels = _without_alpha(image).resize(size, Image.Resampling.BILINEAR)
            stored = io.BytesIO()
            pixels.save(stored, "JPEG", quality=self.jpeg_quality)
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError):
            return None  # what Pillow raises for a damaged file (OSError: cut short)
        return stored.getvalue(), True


def _without_alpha(image):
    """The image as 8-bit gray ("L") or RGB, what a JPEG stores."""
    from PIL import Image

    if image.mode in ("I", "I;16"):  # 16-bit gray PNG: keep the high byte, as TensorFlow does
        import numpy as np

        return Image.fromarray((np.asarray(image) >> 8).clip(0, 255).astype(np.uint8))
    if image.mode in ("P", "PA"):  # a palette's transparency converts through RGBA (no warning)
        image = image.convert("RGBA")
    stored_mode = "L" if image.mode in ("1", "L", "LA") else "RGB"
    return image if image.mode == stored_mode else image.convert(stored_mode)


@dataclass(frozen=True)
class ShardDone:
    """A complete shard; also its marker in DONE_DIR, read back by a resumed run."""

    name: str
    records: int
    skipped: int
    """Files not written: unreadable, or no image."""
    first_skipped: str | None
    """The skipped path that sorts first (None when none was skipped)."""
    resized: int = 0
    """Records stored resized (see MaxResolution)."""
    per_class: dict[str, int] = dataclasses.field(default_factory=dict)
    """Records of each label (its index, a string in JSON)."""
    files: list | None = None
    """Each path's [size, modification time in ns] when it was read (null: unreadable): a
    resumed run refuses a shard whose files changed since."""
    too_large: int = 0
    """Files not written because resizing them decodes too many pixels (TooManyPixels)."""
    first_too_large: str | None = None


@dataclass(frozen=True)
class Conversion:
    """What ``write_dataset`` did."""

    metadata: dict
    """The contents of dataset.json."""
    resumed_shards: int
    """Shards an earlier, interrupted run had completed."""
    records_written: int
    """Records this run wrote (not counting resumed shards)."""
    seconds: float


def staging_dir(out_dir: str) -> str:
    """Where the shards of ``out_dir`` are written until all are complete."""
    return os.path.abspath(out_dir) + STAGING_SUFFIX


def convert(data_dir: str, out_dir: str, *, shards: int, validation_shards: int,
            validation_fraction: float, seed: int, image_size: int, channels: int = 3,
            max_resolution: int | None = None, jpeg_quality: int = DEFAULT_JPEG_QUALITY,
            on_bad_image: str = "skip", workers: int | None = None,
            progress: bool = False) -> dict:
    """Write the shards of an image folder (see the module docstring); returns dataset.json's
    contents. ``max_resolution``: the largest shorter side stored, in pixels (None: the default
    for ``image_size``, 0: every file unchanged). ``progress`` shows the progress line and the
    resume note on stderr."""
    def to_stderr(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    return write_dataset(data_dir, out_dir, shards=shards, validation_shards=validation_shards,
                         validation_fraction=validation_fraction, seed=seed,
                         image_size=image_size, channels=channels,
                         max_resolution=max_resolution, jpeg_quality=jpeg_quality,
                         on_bad_image=on_bad_image, workers=workers,
                         progress_stream=sys.stderr if progress else None,
                         notify=to_stderr if progress else lambda line: None).metadata


def max_resolution_for(image_size: int, max_resolution: int | None,
                       jpeg_quality: int) -> MaxResolution | None:
    """The limit ``max_resolution`` pixels asks for (None: what training at ``image_size``
    decodes to with --augment, the larger need; 0: none, every file is stored unchanged)."""
    if max_resolution == 0:
        return None
    if max_resolution is None:
        max_resolution = shorter_side_decoded(image_size, augment=True)
    return MaxResolution(max_resolution, jpeg_quality)


def write_dataset(data_dir: str, out_dir: str, *, shards: int, validation_shards: int,
                  validation_fraction: float, seed: int, image_size: int, channels: int,
                  max_resolution: int | None, jpeg_quality: int, on_bad_image: str,
                  workers: int | None, progress_stream: TextIO | None,
                  notify: Callable[[str], None]) -> Conversion:
    """``convert`` with the details the command line reports. ``notify`` gets the line saying a
    run resumes; ``progress_stream`` the progress line (None: no progress)."""
    started = time.monotonic()
    # Values training refuses for the same folder (config.py): a split of -0.5 or 1.0 is nonsense.
    if not 0 <= validation_fraction < 1:
        raise UserError(f"--validation-fraction must be in [0, 1), got {validation_fraction}")
    if image_size < 1:
        raise UserError(f"--image-size must be at least 1, got {image_size}")
    limit = max_resolution_for(image_size, max_resolution, jpeg_quality)
    # The output checks are cheap, the listing is not: a mistyped --out fails first.
    require_file_system_path("--out", out_dir, "write the shards to a file system path, then "
                             "copy them up (training reads --tfrecords at a URL)")
    _check_out(out_dir, data_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out {out_dir} is a file; name a new directory")
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise UserError(f"--out {out_dir} exists and is not empty; choose a new directory")
    staging = staging_dir(out_dir)
    if os.path.islink(staging) or os.path.exists(staging) and not os.path.isdir(staging):
        raise UserError(f"{staging} (where --out {out_dir} is written) is a "
                        f"{'link' if os.path.islink(staging) else 'file'}; remove it")
    # An unfinished conversion's directory is locked before the listing (minutes on a large
    # folder): a second converter on it is refused at once.
    # Held from here to the end: two identical commands at once would otherwise both "resume",
    # each removing the other's shards in flight.
    lock = _locked(staging, staging) if os.path.isdir(staging) else None
    try:
        listing = list_image_folder(data_dir, image_size=image_size,
                                    validation_fraction=validation_fraction, seed=seed,
                                    on_bad_image=on_bad_image, channels=channels)
        tasks = _shard_tasks(listing, shards, validation_shards)
        plan = {"data_dir": os.path.abspath(data_dir),
                "samples": sum(len(task.paths) for task in tasks), "shards": shards,
                "validation_shards": validation_shards,
                "validation_fraction": validation_fraction, "seed": seed,
                "split": SPLIT_BY_NAME,
                "image_size": image_size, "channels": channels,
                # null (off) in both: a plan written before the limit existed stored originals.
                "max_resolution": limit.shorter_side if limit else None,
                "jpeg_quality": limit.jpeg_quality if limit else None,
                # The folder's (file, label) table (data.listing.label_table_digest): changed
                # data are refused on a resume, and training from the folder computes the same.
                "files_sha256": listing.identity["labels"]}
        if lock is None:
            resumed, lock = {}, _create_staging(staging, plan, out_dir)
        else:
            resumed = _complete_shards(staging, plan, tasks)
    except BaseException:
        if lock is not None:
            os.close(lock)
        raise
    try:
        return _write_staged(listing, tasks, plan, staging, out_dir, resumed, limit=limit,
                             on_bad_image=on_bad_image, workers=workers,
                             progress_stream=progress_stream, notify=notify, started=started)
    finally:
        os.close(lock)


def _write_staged(listing: FolderListing, tasks: list[ShardTask], plan: dict, staging: str,
                  out_dir: str, resumed: dict[str, ShardDone], *, limit: MaxResolution | None,
                  on_bad_image: str, workers: int | None, progress_stream: TextIO | None,
                  notify: Callable[[str], None], started: float) -> Conversion:
    """``write_dataset``'s work once it holds the staging directory's lock."""
    data_dir = listing.root
    if resumed:
        notify(f"resuming {staging}: {len(resumed)} of {len(tasks)} shards were complete")
    to_write = [task for task in tasks if task.name not in resumed]
    progress = Progress(total=plan["samples"],
                        done=sum(done.records + done.skipped + done.too_large
                                 for done in resumed.values()),
                        stream=progress_stream)
    try:
        earlier_bad = sorted(done.first_skipped for done in resumed.values() if done.skipped)
        if on_bad_image == "fail" and earlier_bad:
            raise BadImageError(_not_an_image(earlier_bad[0]))
        written = _write_shards(to_write, staging, limit, on_bad_image, workers, progress)
    except BadImageError:
        # The data has to change before a rerun, which would not match this plan anyway.
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        progress.close()
    complete = {**resumed, **{done.name: done for done in written}}
    per_class = collections.Counter()
    for done in complete.values():
        per_class.update({int(label): count for label, count in done.per_class.items()})
    empty = [name for label, name in enumerate(listing.class_names) if not per_class[label]]
    if empty:
        # Training would never see the class, yet count it among the classes it predicts.
        shutil.rmtree(staging, ignore_errors=True)
        more = f" (and {len(empty) - 1} other class(es))" if len(empty) > 1 else ""
        raise UserError(f"no file of class folder {os.path.join(data_dir, empty[0])}{more} is a "
                        "readable PNG/JPEG/GIF/BMP image; fix or remove its files")
    metadata = {"source": os.path.abspath(data_dir), "class_names": listing.class_names,
                **{key: plan[key] for key in ("image_size", "channels", "seed",
                                              "validation_fraction", "split")},
                "counts": {task.name: complete[task.name].records for task in tasks},
                "files_sha256": plan["files_sha256"],
                # Each shard's size: a reader finds a shard cut short (or grown) by its size, with
                # one stat per shard, before it trains on it (data/records.py).
                "bytes": {task.name: os.path.getsize(os.path.join(staging, task.name))
                          for task in tasks},
                "max_resolution": {**dataclasses.asdict(limit),
                                   "resized": sum(done.resized for done in complete.values())
                                   } if limit else None,
                "skipped": list(listing.notes) + _skipped_notes(complete.values(), data_dir)}
    try:
        _finish(staging, out_dir, metadata)
    except OSError as error:
        raise UserError(f"cannot finish {out_dir}: {error.strerror or error}; rerun the same "
                        "command to resume once that is fixed") from None
    return Conversion(metadata, resumed_shards=len(resumed),
                      records_written=sum(done.records for done in written),
                      seconds=time.monotonic() - started)


def _shard_tasks(listing: FolderListing, shards: int, validation_shards: int) -> list[ShardTask]:
    """Every shard of the output, in name order: sample i of a split goes to shard i mod N."""
    tasks = []
    for prefix, split, requested in ((TRAIN, listing.train, shards),
                                     (VALIDATION, listing.validation, validation_shards)):
        if not split.num_samples:
            continue
        paths, labels = [listing.path(source) for source in split.sources], split.labels.tolist()
        count = max(1, min(requested, len(paths)))
        tasks += [ShardTask(shard_name(prefix, shard, count), paths[shard::count],
                            labels[shard::count]) for shard in range(count)]
    return tasks


def _check_out(out_dir: str, data_dir: str) -> None:
    """--out, whole, before any work: the finished staging directory is renamed to it, so it must
    be a name of its own (no link, not the directory this runs in or one holding it), outside
    the data it is made from."""
    if os.path.islink(out_dir):
        raise UserError(f"--out {out_dir} is a link; name a new directory (the finished shards "
                        "are renamed into place, which would replace the link)")
    out, here = os.path.abspath(out_dir), os.getcwd()
    if here == out or here.startswith(out.rstrip(os.sep) + os.sep):
        raise UserError(f"--out {out_dir} is the directory this runs in, or holds it; name a new "
                        "directory")
    data, real_out = os.path.realpath(data_dir), os.path.realpath(out)
    if real_out == data or real_out.startswith(data.rstrip(os.sep) + os.sep):
        raise UserError(f"--out {out_dir} is inside --data-dir {data_dir}, where it would be "
                        "listed as a class; write it elsewhere")


def _locked(directory: str, staging: str) -> int:
    """An open descriptor of ``directory`` holding its exclusive lock (released when closed or
    when the process ends, however it ends), or one line when another converter holds it."""
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise UserError(f"another converter is writing {staging} now; wait for it to finish, "
                        "or write elsewhere with another --out") from None
    return descriptor


def _complete_shards(staging: str, plan: dict, tasks: list[ShardTask]) -> dict[str, ShardDone]:
    """The shards an earlier run of the same plan completed in ``staging`` (its lock held).
    Refuses a staging directory of another plan, and one whose complete shards were made of
    files that changed since."""
    try:
        with open(os.path.join(staging, PLAN)) as file:
            recorded = json.load(file)
    except (OSError, ValueError):
        raise UserError(f"{staging} exists but has no readable {PLAN}; delete it to start "
                        "over") from None
    differences = [_difference(key, recorded.get(key), value) for key, value in plan.items()
                   if recorded.get(key) != value]
    if differences:
        raise UserError(f"{staging} holds an unfinished conversion of other data or arguments "
                        f"({'; '.join(differences)}): rerun with the original arguments to "
                        f"resume it, or delete {staging} to start over")
    # Partial shards of the interrupted run; their writers are gone (workers exit once the
    # converter that started them is), and the shards are rewritten from the start.
    for entry in os.scandir(staging):
        if entry.name.endswith(".tmp"):
            os.remove(entry.path)
    complete = {}
    for task in tasks:
        done = _marker(os.path.join(staging, DONE_DIR, task.name + ".json"), task)
        if done is None or not os.path.exists(os.path.join(staging, task.name)):
            continue  # written again
        changed = next((path for path, then in zip(task.paths, done.files)
                        if then != _file_stat(path)), None)
        if changed is not None:
            raise UserError(f"{changed} changed (size or modification time) since the "
                            f"interrupted run stored it in {staging}; delete {staging} to start "
                            "over")
        complete[task.name] = done
    return complete


def _marker(path: str, task: ShardTask) -> ShardDone | None:
    """A shard's done marker, or None when it is missing or unusable (empty after a full disk,
    cut short, or written by a version that recorded no file stats): the shard is rewritten."""
    try:
        with open(path) as file:
            done = ShardDone(**json.load(file))
    except (OSError, ValueError, TypeError):
        return None
    if done.name != task.name or done.files is None or len(done.files) != len(task.paths):
        return None
    return done


def _file_stat(path: str) -> list[int] | None:
    """[size, modification time in ns] of a file (None: it cannot be read)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns]


def _difference(key: str, then: object, now: object) -> str:
    if key == "files_sha256":
        return "the folder's files or labels changed"
    return f"{key} {'off' if then is None else then} then, {'off' if now is None else now} now"


def _create_staging(staging: str, plan: dict, out_dir: str) -> int:
    """Make ``staging`` with its plan and an empty DONE_DIR, all at once (built under a temporary
    name, locked before it gets its name): a staging directory without its plan is never left
    behind, and no other converter can take it. Returns the lock's descriptor."""
    parent = os.path.dirname(staging)
    try:
        os.makedirs(parent, exist_ok=True)
        building = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(staging)}.")
    except OSError as error:
        raise UserError(f"--out {out_dir}: cannot create it ({error.strerror or error})") from None
    lock = _locked(building, staging)
    try:
        # mkdtemp makes 0700; shards are for other users too.
        os.chmod(building, 0o777 & ~current_umask())
        os.mkdir(os.path.join(building, DONE_DIR))
        _write_json(os.path.join(building, PLAN), plan)
        os.rename(building, staging)
    except OSError as error:
        shutil.rmtree(building, ignore_errors=True)
        os.close(lock)
        if error.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise UserError(f"another converter is writing {staging} now; wait for it to "
                            "finish, or write elsewhere with another --out") from None
        raise UserError(f"cannot write {staging}: {error.strerror or error}") from None
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        os.close(lock)
        raise
    return lock


def _write_json(path: str, value: dict) -> None:
    """Write ``path`` whole or not at all (a kill mid-write leaves only a .tmp file)."""
    replace_atomically(path, json.dumps(value, indent=2).encode(), suffix=".tmp")


def _skipped_notes(shards: Iterable[ShardDone], data_dir: str) -> list[str]:
    shards = list(shards)
    notes = []
    skipped = [done for done in shards if done.skipped]
    if skipped:
        first = min(done.first_skipped for done in skipped)
        notes.append(f"skipped {sum(done.skipped for done in skipped)} file(s) in {data_dir} that "
                     f"are not readable PNG/JPEG/GIF/BMP images (first: {first})")
    too_large = [done for done in shards if done.too_large]
    if too_large:
        first = min(done.first_too_large for done in too_large)
        notes.append(f"skipped {sum(done.too_large for done in too_large)} file(s) in {data_dir} "
                     "that decode to more pixels than the converter's limit to be resized "
                     f"(first: {first}; see --max-resolution)")
    return notes


def _too_many_pixels(path: str, size: str, limit: MaxResolution) -> str:
    return (f"{path} ({size}) decodes to more than {converter_pixels_limit(limit.shorter_side)} "
            "pixels to be resized; shrink it, raise --max-resolution (the limit is 16 times its "
            "square, at least 2^28) or pass --on-bad-image skip")


def _not_an_image(path: str) -> str:
    return (f"{path} is not a readable PNG/JPEG/GIF/BMP image; remove it or pass "
            "--on-bad-image skip")


def _finish(staging: str, out_dir: str, metadata: dict) -> None:
    _write_json(os.path.join(staging, METADATA), metadata)
    if os.path.isdir(out_dir):
        os.rmdir(out_dir)  # empty, checked at the start
    os.replace(staging, out_dir)
    # The bookkeeping goes after the rename: a kill in between leaves a complete output with
    # two extra entries, never finished shards stuck in a staging directory without its plan.
    os.remove(os.path.join(out_dir, PLAN))
    shutil.rmtree(os.path.join(out_dir, DONE_DIR))


# --- writing shards ------------------------------------------------------------------------------
def _write_shards(tasks: list[ShardTask], staging: str, max_resolution: MaxResolution | None,
                  on_bad_image: str, workers: int | None, progress: Progress) -> list[ShardDone]:
    if not tasks:
        return []
    count = _worker_count(workers, tasks)
    if count == 1:
        # No process to start (and no TensorFlow import to wait for); the same shards.
        def add(files: int) -> None:
            progress.set(progress.done + files)

        return [write_shard(task, staging, max_resolution=max_resolution,
                            on_bad_image=on_bad_image, report=add) for task in tasks]
    return _write_in_workers(tasks, staging, max_resolution, on_bad_image, count, progress)


def _worker_count(requested: int | None, tasks: list[ShardTask]) -> int:
    if requested is None:
        files = sum(len(task.paths) for task in tasks)
        # The cores this process may use: a Slurm job's share, not the whole node.
        requested = min(len(os.sched_getaffinity(0)), max(1, files // FILES_PER_WORKER))
    return min(requested, len(tasks))  # a worker writes whole shards


@dataclass(frozen=True)
class WorkerLink:
    """What a worker process shares with the converter that started it."""

    staging: str
    max_resolution: MaxResolution | None
    on_bad_image: str
    processed: Synchronized
    """Files all workers have processed (written or skipped)."""
    stop: Event
    """Set when the converter gives up: Ctrl-C, or another worker failed."""

    def report(self, files: int) -> None:
        if self.stop.is_set():
            raise _Stopped()
        with self.processed.get_lock():
            self.processed.value += files


_worker_link: WorkerLink | None = None
"""Set in each worker process by _start_worker."""


def _start_worker(link: WorkerLink) -> None:
    global _worker_link
    _worker_link = link
    # Ctrl-C reaches the whole process group; the converter stops the workers itself (stop), so
    # they print no traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_converter, daemon=True).start()


def _exit_with_converter() -> None:
    """End this worker when the converter ends without stopping it (SIGKILL, a lost Slurm step):
    an orphan would wait for its next shard forever, or race the rerun writing the same one."""
    multiprocessing.connection.wait([multiprocessing.parent_process().sentinel])
    os._exit(1)


def _write_shard_in_worker(task: ShardTask) -> ShardDone:
    link = _worker_link
    return write_shard(task, link.staging, max_resolution=link.max_resolution,
                       on_bad_image=link.on_bad_image, report=link.report)


def _write_in_workers(tasks: list[ShardTask], staging: str,
                      max_resolution: MaxResolution | None, on_bad_image: str, workers: int,
                      progress: Progress) -> list[ShardDone]:
    # spawn: TensorFlow is not fork-safe, and this process never imports it.
    context = multiprocessing.get_context("spawn")
    processed = context.Value("q", 0)
    stop = context.Event()
    link = WorkerLink(staging, max_resolution, on_bad_image, processed, stop)
    already_done = progress.done
    written = []
    with _CtrlC() as ctrl_c:
        executor = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=context, initializer=_start_worker, initargs=(link,))
        try:
            pending = {executor.submit(_write_shard_in_worker, task) for task in tasks}
            while pending and not ctrl_c.pressed:
                finished, pending = concurrent.futures.wait(
                    pending, timeout=REPORT_SECONDS,
                    return_when=concurrent.futures.FIRST_COMPLETED)
                written += [future.result() for future in finished]
                progress.set(already_done + processed.value)
            if ctrl_c.pressed:
                raise KeyboardInterrupt
        except concurrent.futures.BrokenExecutor:
            raise UserError("a worker process died (out of memory? killed?); rerun the same "
                            "command to resume") from None
        finally:
            stop.set()  # after an error or Ctrl-C, the workers still writing give up in 0.25 s
            executor.shutdown(wait=True, cancel_futures=True)
    return written


class _CtrlC:
    """Ctrl-C (SIGINT) as a flag the loop reads, while in this context.

    A KeyboardInterrupt raised wherever it lands can land inside concurrent.futures.wait while
    it holds the futures' locks, and the executor's shutdown then waits for them forever. Only
    the main thread receives signals: elsewhere the flag is never set.
    """

    def __init__(self):
        self.pressed = False
        self._previous = None

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._press)
        return self

    def __exit__(self, *exception) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    def _press(self, signum: int, frame) -> None:
        self.pressed = True


def write_shard(task: ShardTask, staging: str, *, max_resolution: MaxResolution | None,
                on_bad_image: str, report: Callable[[int], None]) -> ShardDone:
    """Write one shard under a temporary name, rename it, then mark it complete in DONE_DIR.

    ``report`` gets the number of files processed since its last call, every REPORT_SECONDS and
    at the end. A file that is unreadable or no image is skipped, or raises BadImageError with
    ``on_bad_image`` "fail". ``max_resolution``: the largest image stored (None: every file
    unchanged).
    """
    import tensorflow as tf

    final = os.path.join(staging, task.name)
    records = skipped = resized = too_large = 0
    first_too_large = None
    per_class: collections.Counter = collections.Counter()
    files = []
    first_skipped = None
    report(0)  # a worker told to stop does not start another shard
    unreported, reported_at = 0, time.monotonic()

    def write_records(temporary: str) -> None:
        nonlocal records, skipped, resized, first_skipped, unreported, reported_at, too_large
        nonlocal first_too_large
        with tf.io.TFRecordWriter(temporary) as writer:
            for path, label in zip(task.paths, task.labels):
                # Before the read: a file changed while it is read is changed for a resume.
                files.append(_file_stat(path))
                try:
                    stored = _stored_image(path, max_resolution)
                except TooManyPixels as size:
                    if on_bad_image == "fail":
                        raise BadImageError(_too_many_pixels(path, str(size),
                                                             max_resolution)) from None
                    too_large += 1
                    first_too_large = min(first_too_large or path, path)
                else:
                    if stored is not None:
                        writer.write(serialize_example(stored[0], label))
                        records += 1
                        per_class[str(label)] += 1
                        resized += stored[1]
                    elif on_bad_image == "fail":
                        raise BadImageError(_not_an_image(path))
                    else:
                        skipped += 1
                        first_skipped = min(first_skipped or path, path)
                unreported += 1
                if time.monotonic() - reported_at >= REPORT_SECONDS:
                    report(unreported)
                    unreported, reported_at = 0, time.monotonic()

    try:
        # A .tmp name: a resumed conversion removes those of the interrupted one.
        replace_atomically(final, write_records, suffix=".tmp")
        done = ShardDone(task.name, records, skipped, first_skipped, resized, dict(per_class),
                         files, too_large, first_too_large)
        _write_json(os.path.join(staging, DONE_DIR, task.name + ".json"), dataclasses.asdict(done))
    except (OSError, tf.errors.OpError) as error:
        # A full disk, a lost mount: the complete shards stay, a rerun writes the rest.
        raise UserError(f"cannot write {final}: {first_line(error)}; rerun the same command to "
                        "resume once that is fixed") from None
    report(unreported)
    return done


def _stored_image(path: str, max_resolution: MaxResolution | None) -> tuple[bytes, bool] | None:
    """(what a shard stores for the file, whether it was resized); None when the file is
    unreadable or no image (with a limit: also when its header, or the pixels of one to resize,
    do not decode); TooManyPixels from ``MaxResolution.stored``. Its first bytes are checked
    before the rest is read: a large file of another kind is never read whole."""
    try:
        with open(path, "rb") as file:
            head = file.read(16)
            image_format = image_format_of_bytes(head)
            if image_format is None:
                return None
            encoded = head + file.read()
    except OSError:
        return None
    if max_resolution is None:
        return encoded, False
    return max_resolution.stored(encoded, image_format)


# --- progress ------------------------------------------------------------------------------------
class Progress:
    """Files processed out of all, on a stream: one line redrawn in place on a terminal, a new
    line every LOG_SECONDS otherwise (a log file keeps every line it gets). No stream: silent."""

    def __init__(self, *, total: int, done: int, stream: TextIO | None):
        self.total = total
        self.done = done
        self._done_before = done  # resumed shards: not part of this run's speed
        self._stream = stream
        self._terminal = stream is not None and stream.isatty()
        self._started = self._shown_at = time.monotonic()
        self._recent = collections.deque([(self._started, done)])
        """(time, done) over the last RATE_WINDOW_SECONDS, and one before."""
        self._show(final=False)  # at once: the total, before the workers have started

    def set(self, done: int) -> None:
        self.done = done
        now = time.monotonic()
        if done == self._done_before:  # still starting: the speed counts from the first file on
            self._recent = collections.deque([(now, done)])
        else:
            self._recent.append((now, done))
            while len(self._recent) > 2 and now - self._recent[1][0] >= RATE_WINDOW_SECONDS:
                self._recent.popleft()
        interval = TERMINAL_SECONDS if self._terminal else LOG_SECONDS
        if now - self._shown_at >= interval:
            self._show(final=False)

    def close(self) -> None:
        """The last line: how far it got, and how fast on average."""
        self._show(final=True)
        if self._terminal:
            self._stream.write("\n")

    def _show(self, *, final: bool) -> None:
        if self._stream is None:
            return
        self._shown_at = now = time.monotonic()
        if final:
            elapsed = now - self._started
            rate = (self.done - self._done_before) / elapsed if elapsed > 0 else 0.0
            tail = f"{_clock(elapsed)} elapsed"
        else:
            since, done_then = self._recent[0]
            rate = (self.done - done_then) / (now - since) if now > since else 0.0
            tail = f"ETA {_clock((self.total - self.done) / rate) if rate > 0 else '--'}"
        line = (f"{self.done}/{self.total} records ({100 * self.done // self.total}%) | "
                f"{rate:.0f} records/s | {tail}")
        # \x1b[K clears what a longer previous line left on the terminal.
        self._stream.write(f"\r{line}\x1b[K" if self._terminal else line + "\n")
        self._stream.flush()


def _clock(seconds: float) -> str:
    """1h02m03s, 2m05s."""
    minutes, second = divmod(int(seconds), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}h{minute:02d}m{second:02d}s" if hours else f"{minute}m{second:02d}s"


# --- command line --------------------------------------------------------------------------------
def run(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=usage_name(PROGRAM), formatter_class=FlagHelpFormatter,
        description="Convert an image folder (one sub-folder per class) into TFRecord shards for "
                    "--tfrecords: the same train/validation split as --data-dir training, written "
                    "in parallel into OUT.partial and renamed to OUT when complete (rerun the same "
                    "command after an interruption to finish it). Images larger than training at "
                    "--image-size needs are stored resized (--max-resolution). Unreadable files "
                    "are skipped and counted in OUT/dataset.json. docs/data.md has the rest.")
    parser.add_argument("--data-dir", required=True, help="image folder, one sub-folder per class")
    parser.add_argument("--out", required=True,
                        help="new directory for the shards (written in OUT.partial until done)")
    parser.add_argument("--shards", type=int, default=4,
                        help="training shards; at least the number of ranks that will read them "
                             "with --tfrecord-sharding file, and at least --workers to keep every "
                             "worker busy (default 4)")
    parser.add_argument("--validation-shards", type=int, default=1, help="(default 1)")
    parser.add_argument("--validation-fraction", type=float, default=0.2, help="(default 0.2)")
    parser.add_argument("--seed", type=int, default=42, help="split seed (default 42)")
    parser.add_argument("--image-size", type=int, default=DEFAULT_FILE_IMAGE_SIZE,
                        help="size training resizes to, recorded in dataset.json; sets the "
                             "default --max-resolution (default 64)")
    parser.add_argument("--channels", type=int, choices=(1, 3), default=3,
                        help="channels training decodes to, recorded in dataset.json (default 3)")
    parser.add_argument("--max-resolution", type=_pixels_or_off, default=None, metavar="PIXELS",
                        help="largest shorter side stored: an image with a larger one is "
                             "stored resized to it (aspect ratio kept) as a JPEG, any other as "
                             "its file, byte for byte; off (or 0) keeps every file (default: "
                             "what training at --image-size decodes to with --augment, "
                             f"--image-size / {CENTER_FRACTION}: "
                             f"{shorter_side_decoded(224, augment=True)} for 224, "
                             f"{shorter_side_decoded(64, augment=True)} for 64)")
    parser.add_argument("--jpeg-quality", type=int, default=DEFAULT_JPEG_QUALITY,
                        help="quality (1-100) of the JPEGs resized images are stored as "
                             f"(default {DEFAULT_JPEG_QUALITY})")
    parser.add_argument("--on-bad-image", choices=("skip", "fail"), default="skip",
                        help="a file that is unreadable or no PNG/JPEG/GIF/BMP image: skip and "
                             "count it, or stop (and keep nothing) (default skip)")
    parser.add_argument("--workers", type=int, default=None,
                        help="processes writing shards in parallel; each imports TensorFlow "
                             "(~0.5 GB) (default: one per core this process may use, but no more "
                             f"than one per {FILES_PER_WORKER} files)")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    args = parser.parse_args(argv)
    if args.shards < 1 or args.validation_shards < 1:
        raise UserError("--shards and --validation-shards must be at least 1")
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be at least 1")
    try:
        conversion = write_dataset(
            args.data_dir, args.out, shards=args.shards, validation_shards=args.validation_shards,
            validation_fraction=args.validation_fraction, seed=args.seed,
            image_size=args.image_size, channels=args.channels,
            max_resolution=args.max_resolution, jpeg_quality=args.jpeg_quality,
            on_bad_image=args.on_bad_image, workers=args.workers,
            progress_stream=None if args.quiet else sys.stderr,
            notify=lambda line: print(line, flush=True))
    except KeyboardInterrupt:
        staging = staging_dir(args.out)
        then = (f"rerun the same command to resume from {staging}" if os.path.isdir(staging)
                else "nothing was written")
        print(f"{PROGRAM}: interrupted; {then}", file=sys.stderr, flush=True)
        return 130
    counts = conversion.metadata["counts"]
    for note in conversion.metadata["skipped"]:
        print(note)
    limit = conversion.metadata["max_resolution"]
    if limit:
        print(f"{limit['resized']} of {sum(counts.values())} images had a shorter side over "
              f"{limit['shorter_side']} pixels and were stored resized to it (JPEG quality "
              f"{limit['jpeg_quality']}; --max-resolution off keeps the files)")
    resumed = (f"; {conversion.resumed_shards} shard(s) came from the interrupted run"
               if conversion.resumed_shards else "")
    print(f"wrote {sum(counts.values())} records in {len(counts)} shards to {args.out} in "
          f"{conversion.seconds:.1f} s ({conversion.records_written / conversion.seconds:.0f} "
          f"records/s{resumed})")
    return 0


def _pixels_or_off(text: str) -> int:
    """--max-resolution: a number of pixels, or 0 for 'off'."""
    if text == "off":
        return 0
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of pixels or off, not {text!r}") from None


def main(argv: Sequence[str] | None = None) -> None:
    with reported(error_name(PROGRAM)):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
