"""How much memory this job may use on this node: the least of Slurm's request, the memory
cgroup this process runs in (v1 or v2, its ancestors included), and the node's available memory.
The first two are totals: what the ranks already hold (TensorFlow, the model) is not taken off,
which is why the cache gets only a share of the least (data.cache.DEFAULT_MEMORY_FRACTION).

A Slurm job given ``--mem=32G`` on a 512 GB node is killed by its cgroup at 32 GB, whatever the
node has free; a cache sized against the node would be OOM-killed mid-epoch. Everything here is
read from files (``/proc``, the cgroup file system) and the environment, and every reader takes
its roots as arguments, so tests feed it real files of their own.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

UNLIMITED_V1 = 1 << 60
"""cgroup v1 writes 'no limit' as the largest page-aligned int64 (9223372036854771712)."""


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str
    """What set it, in words for the banner: "Slurm --mem 600M", "cgroup v2 memory.max 1.0 GB"."""


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 1e9:.1f} GB"


def slurm_limit(environ: Mapping[str, str]) -> MemoryLimit | None:
    """Slurm's request for this node: --mem, or --mem-per-cpu x the CPUs the job has here, or
    --mem-per-gpu x its GPUs here. Slurm's variables are in MB; 0 means the whole node."""
    def megabytes(name: str) -> int:
        try:
            return int(environ.get(name, "0") or 0)
        except ValueError:
            return 0

    per_node = megabytes("SLURM_MEM_PER_NODE")
    if per_node > 0:
        return MemoryLimit(per_node * 2**20, f"Slurm --mem {per_node}M")
    per_cpu = megabytes("SLURM_MEM_PER_CPU")
    cpus = cpus_on_this_node(environ)
    if per_cpu > 0 and cpus:
        return MemoryLimit(per_cpu * cpus * 2**20, f"Slurm --mem-per-cpu {per_cpu}M x {cpus} CPUs")
    per_gpu = megabytes("SLURM_MEM_PER_GPU")
    gpus = megabytes("SLURM_GPUS_ON_NODE")
    if per_gpu > 0 and gpus > 0:
        return MemoryLimit(per_gpu * gpus * 2**20, f"Slurm --mem-per-gpu {per_gpu}M x {gpus} GPUs")
    return None


def cpus_on_this_node(environ: Mapping[str, str]) -> int:
    """SLURM_CPUS_ON_NODE, else this node's entry of SLURM_JOB_CPUS_PER_NODE ("4(x2),2")."""
    try:
        return int(environ["SLURM_CPUS_ON_NODE"])
    except (KeyError, ValueError):
        pass
    counts = []
    for part in environ.get("SLURM_JOB_CPUS_PER_NODE", "").split(","):
        count, _, repeat = part.partition("(x")
        try:
            counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
        except ValueError:
            return 0
    try:
        return counts[int(environ.get("SLURM_NODEID", "0"))]
    except (IndexError, ValueError):
        return 0


def _cgroup_paths(proc: str) -> dict[str, str]:
    """{"v1": path, "v2": path} of this process's memory cgroup, from /proc/self/cgroup."""
    paths = {}
    try:
        with open(os.path.join(proc, "self", "cgroup")) as lines:
            for line in lines:
                hierarchy, controllers, path = line.rstrip("\n").split(":", 2)
                if hierarchy == "0" and controllers == "":
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except (OSError, ValueError):
        pass
    return paths


def _mounts(proc: str) -> list[tuple[str, str, str, str]]:
    """(fstype, mount root, mount point, super options) of every cgroup file system mounted."""
    found = []
    try:
        with open(os.path.join(proc, "self", "mountinfo")) as lines:
            for line in lines:
                before, _, after = line.rstrip("\n").partition(" - ")
                fields, tail = before.split(), after.split()
                if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
                    found.append((tail[0], fields[3], fields[4], tail[2]))
    except OSError:
        pass
    return found


def _read_limit(path: str) -> int | None:
    try:
        with open(path) as file:
            value = file.read().strip()
    except OSError:
        return None
    if value in ("", "max"):
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return None if number >= UNLIMITED_V1 else number


def cgroup_directory(proc: str = "/proc") -> tuple[str, str] | None:
    """(version, directory) of this process's memory cgroup: v1's memory controller if mounted,
    else v2 when its mount offers the memory controller."""
    paths, mounts = _cgroup_paths(proc), _mounts(proc)
    if "v1" in paths:
        for fstype, root, point, options in mounts:
            if fstype == "cgroup" and "memory" in options.split(","):
                directory = _inside(point, root, paths["v1"])
                return ("v1", directory) if directory else None
    if "v2" in paths:
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                directory = _inside(point, root, paths["v2"])
                if directory is None:
                    return None
                try:
                    with open(os.path.join(point, "cgroup.controllers")) as controllers:
                        if "memory" not in controllers.read().split():
                            return None  # a hybrid host's v2 mount without memory
                except OSError:
                    return None
                return "v2", directory
    return None


def _inside(mount_point: str, mount_root: str, path: str) -> str | None:
    """Where cgroup ``path`` is in a mount of ``mount_root`` at ``mount_point``; None when it is
    not in that sub-tree. A container without its own cgroup namespace sees the host's path in
    /proc/self/cgroup but has only a sub-tree (the mount root) mounted."""
    if os.path.commonpath([path, mount_root]) != mount_root:
        return None
    relative = os.path.relpath(path, mount_root)
    relative = "" if relative == "." else relative
    return os.path.normpath(os.path.join(mount_point, relative))


def cgroup_limit(proc: str = "/proc") -> MemoryLimit | None:
    """The least memory limit on this process's cgroup and its ancestors (Slurm sets it on the
    job's cgroup; a rank sits in the step's or task's below it)."""
    found = cgroup_directory(proc)
    if found is None:
        return None
    version, directory = found
    mount_point = next((point for fstype, _, point, options in _mounts(proc)
                        if os.path.commonpath([directory, point]) == point
                        and (fstype == "cgroup2") == (version == "v2")), None)
    if mount_point is None:
        return None
    files = ("memory.max", "memory.high") if version == "v2" else ("memory.limit_in_bytes",)
    best: MemoryLimit | None = None
    current = directory
    while True:
        for name in files:
            value = _read_limit(os.path.join(current, name))
            if value is not None and (best is None or value < best.bytes):
                best = MemoryLimit(value, f"cgroup {version} {name} {_size(value)}")
        if os.path.normpath(current) == os.path.normpath(mount_point) or current in ("/", ""):
            return best
        current = os.path.dirname(current)


def node_available(proc: str = "/proc") -> MemoryLimit:
    """MemAvailable of this node (Linux), else total physical memory."""
    try:
        with open(os.path.join(proc, "meminfo")) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    value = int(line.split()[1]) * 1024
                    return MemoryLimit(value, f"the node's available memory {_size(value)}")
    except (OSError, ValueError, IndexError):
        pass
    value = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return MemoryLimit(value, f"the node's memory {_size(value)}")


def job_memory_limit(environ: Mapping[str, str] | None = None,
                     proc: str = "/proc") -> MemoryLimit:
    """The least of Slurm's request, the cgroup limit and the node's available memory."""
    try:
        cgroup = cgroup_limit(proc)
    except (OSError, ValueError):  # an unusual mount layout: no cgroup limit found, not a crash
        cgroup = None
    limits = [limit for limit in (slurm_limit(os.environ if environ is None else environ),
                                  cgroup, node_available(proc)) if limit is not None]
    return min(limits, key=lambda limit: limit.bytes)
