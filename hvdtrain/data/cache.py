"""Where decoded images are cached between epochs: in memory, on local disk, or not at all.

Decoding is most of an image pipeline's cost, so a second epoch that reads decoded pixels back is
much cheaper than the first. But a cache in memory grows by the whole decoded data set of the
rank (ImageNet at 128x128 is 63 GB per job), so ``--cache auto`` (the default) sizes it first:

    decoded bytes of this rank's samples x local ranks  <=  the job's memory budget   -> memory
    otherwise, if the node's local disk has room                                      -> disk
    otherwise                                                                         -> off

The budget is half of the least of what Slurm gave the job on this node, the memory cgroup the
rank runs in and the node's available memory (hvdtrain.jobmemory): the local ranks share it.
``choose_cache`` is pure (numbers in, decision out) so the decision is tested without filling
any memory.
"""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from hvdtrain.data.augment import decoded_shape
from hvdtrain.data.shares import samples_for_rank
from hvdtrain.errors import RankError, UserError
from hvdtrain.jobmemory import job_memory_limit
from hvdtrain.runtime.base import World
from hvdtrain.scratch import own_directory

if TYPE_CHECKING:
    from hvdtrain.training.config import CacheSetting
    from hvdtrain.data.listing import Listing

CacheKind = Literal["memory", "disk", "off"]
DEFAULT_MEMORY_FRACTION = 0.5
"""Share of the job's memory (at start) caching may use when no budget is given: the rest is
for the model, TensorFlow, the shuffle buffers and whatever else runs there."""
DISK_HEADROOM = 1.1
"""A disk cache needs this much more free space than it will write (file system overhead)."""
CACHE_DIR_PREFIX = "hvdtrain-cache-"
DISK_ADVICE = ("point --cache disk:DIR or TMPDIR at a larger local disk, or use --cache memory "
               "or off")
"""What to do about a disk cache that does not fit: at the start (here) or mid-run (store.py)."""


@dataclass(frozen=True)
class CacheChoice:
    kind: CacheKind
    reason: str
    """Why, in words for the banner."""
    directory: str | None = None
    """Where a disk cache lives (a directory of this process's own, removed at exit)."""

    def describe(self) -> str:
        where = f" in {self.directory}" if self.directory else ""
        return f"cache: {self.kind}{where} ({self.reason})"


def choose_data_cache(listing: Listing, world: World, setting: CacheSetting, *,
                      budget_gb: float | None, validation_samples: int,
                      augment: bool = False) -> CacheChoice:
    """The cache this rank uses for ``listing``: the --cache ``setting``'s, with ``auto``
    decided by ``choose_cache`` against this node's numbers."""
    if listing.in_memory:
        return CacheChoice("off", listing.in_memory)
    disk_dir = setting.directory or default_disk_dir()
    # Only auto needs the budget (it reads Slurm's variables, the cgroup files and /proc).
    budget, budget_source = memory_budget(budget_gb) if setting.mode == "auto" else (0, "")
    return choose_cache(setting, bytes_per_rank=decoded_bytes_per_rank(listing, world,
                                                                    validation_samples, augment),
                        local_size=world.local_size, memory_budget=budget,
                        budget_source=budget_source, disk_free=free_bytes(disk_dir),
                        disk_dir=disk_dir)


def decoded_bytes_per_rank(listing: Listing, world: World, validation_samples: int,
                           augment: bool = False) -> int:
    """What caching this rank's training share and its validation samples holds, decoded (with
    augmentation: at the larger size the crops are cut from)."""
    height, width, channels = decoded_shape(listing.image_shape, augment=augment)
    training = samples_for_rank(listing.train.num_samples, world)
    return (training + validation_samples) * height * width * channels


def choose_cache(setting: CacheSetting, *, bytes_per_rank: int, local_size: int,
                 memory_budget: int, disk_free: int | None, disk_dir: str,
                 budget_source: str = "the memory budget") -> CacheChoice:
    """The cache for one rank. ``bytes_per_rank``: decoded size of what this rank caches;
    ``memory_budget``: bytes the job's ranks on this node may cache in memory, ``budget_source``
    where that number came from (for the banner); ``disk_free``: free bytes in ``disk_dir``
    (None: unknown, e.g. it does not exist)."""
    disk_dir = setting.directory or disk_dir
    node_bytes = bytes_per_rank * local_size
    need = f"{_size(bytes_per_rank)} decoded per rank x {local_size} local rank(s)"
    if setting.mode == "off":
        return CacheChoice("off", "--cache off")
    if setting.mode == "memory":
        return CacheChoice("memory", f"--cache memory; {need}")
    if setting.mode == "disk":
        if disk_free is not None and node_bytes > disk_free:
            # It would fill the disk mid-epoch; this node's disk, so this rank's line.
            raise RankError(f"--cache disk needs {_size(node_bytes)} in {disk_dir} ({need}), "
                            f"which has {_size(disk_free)} free: {DISK_ADVICE}")
        return CacheChoice("disk", f"--cache disk; {need}", disk_dir)
    budget = f"{_size(memory_budget)} budget: {budget_source} for {local_size} local rank(s)"
    if node_bytes <= memory_budget:
        return CacheChoice("memory", f"auto: {_size(node_bytes)} decoded <= {budget}")
    over = f"auto: {_size(node_bytes)} decoded > {budget}"
    if disk_free is not None and node_bytes * DISK_HEADROOM <= disk_free:
        return CacheChoice("disk", f"{over}; {disk_dir} has {_size(disk_free)} free", disk_dir)
    return CacheChoice("off", f"{over}; {disk_dir} has "
                              f"{_size(disk_free) if disk_free is not None else 'no'} room; "
                              "every epoch decodes again")


def memory_budget(budget_gb: float | None) -> tuple[int, str]:
    """(bytes, where they come from) the job's ranks on this node may cache in memory:
    ``--cache-budget-gb``, or a share of the job's memory limit (hvdtrain.jobmemory)."""
    if budget_gb is not None:
        return int(budget_gb * 1e9), f"--cache-budget-gb {budget_gb:g}"
    limit = job_memory_limit()
    return int(limit.bytes * DEFAULT_MEMORY_FRACTION), f"half of {limit.source}"


def default_disk_dir() -> str:
    """Node-local scratch: $TMPDIR (Slurm sites point it at the job's local disk), else /tmp;
    in a job, the rank's scratch directory there (hvdtrain.scratch)."""
    return tempfile.gettempdir()


def free_bytes(directory: str) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def process_cache_dir(cache: CacheChoice) -> str | None:
    """This process's directory for a disk cache, removed when the process ends, however it
    ends (hvdtrain.scratch)."""
    if cache.kind != "disk":
        return None
    try:
        return own_directory(cache.directory or default_disk_dir(), CACHE_DIR_PREFIX)
    except OSError as error:
        raise UserError(f"--cache disk: cannot create a cache directory in "
                        f"{cache.directory}: {error.strerror or error}") from None


def _size(num_bytes: int | float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"
