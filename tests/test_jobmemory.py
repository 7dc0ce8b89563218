"""hvdtrain.jobmemory: the job's memory limit from Slurm's variables, the cgroup file system and
/proc, read from real files (trees written here, and this machine's own), and a real child
memory cgroup that a job runs in."""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import LAUNCHED_RANKS, clean_env
from hvdtrain.jobmemory import (MemoryLimit, cgroup_directory, cgroup_limit, cpus_on_this_node,
                                job_memory_limit, node_available, slurm_limit)

GIB = 2**30


@pytest.mark.parametrize("environ, expected", [
    ({"SLURM_MEM_PER_NODE": "600"}, MemoryLimit(600 * 2**20, "Slurm --mem 600M")),
    ({"SLURM_MEM_PER_CPU": "100", "SLURM_CPUS_ON_NODE": "4"},
     MemoryLimit(400 * 2**20, "Slurm --mem-per-cpu 100M x 4 CPUs")),
    ({"SLURM_MEM_PER_CPU": "100", "SLURM_JOB_CPUS_PER_NODE": "4(x2),2", "SLURM_NODEID": "2"},
     MemoryLimit(200 * 2**20, "Slurm --mem-per-cpu 100M x 2 CPUs")),
    ({"SLURM_MEM_PER_GPU": "1000", "SLURM_GPUS_ON_NODE": "4"},
     MemoryLimit(4000 * 2**20, "Slurm --mem-per-gpu 1000M x 4 GPUs")),
    ({"SLURM_MEM_PER_NODE": "0"}, None),  # --mem=0: the whole node
    ({}, None),
])
def test_slurms_request_for_this_node(environ, expected):
    assert slurm_limit(environ) == expected


def test_cpus_on_a_node_from_slurms_compressed_list():
    assert cpus_on_this_node({"SLURM_JOB_CPUS_PER_NODE": "4(x2),2", "SLURM_NODEID": "1"}) == 4
    assert cpus_on_this_node({"SLURM_JOB_CPUS_PER_NODE": "4(x2),2", "SLURM_NODEID": "5"}) == 0


def write_tree(root: Path, files: dict[str, str]) -> str:
    """A fake /proc and cgroup mount under ``root``: real files; returns the proc path."""
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root / "proc")


def mountinfo(root: Path, *mounts: tuple[str, str, str, str]) -> str:
    """Lines of /proc/self/mountinfo: (fstype, mount root, mount point under root, options)."""
    return "".join(f"{30 + n} 20 0:{40 + n} {mount_root} {root}{point} rw,relatime - {fstype} "
                   f"{fstype} {options}\n"
                   for n, (fstype, mount_root, point, options) in enumerate(mounts))


def test_cgroup_v2_takes_the_least_limit_of_the_cgroup_and_its_ancestors(tmp_path):
    job = "/sys/fs/cgroup/slurm/job_7"
    proc = write_tree(tmp_path, {
        "proc/self/cgroup": "0::/slurm/job_7/step_0/task_0\n",
        "proc/self/mountinfo": mountinfo(tmp_path, ("cgroup2", "/", "/sys/fs/cgroup",
                                                    "rw,nsdelegate")),
        "/sys/fs/cgroup/cgroup.controllers": "cpu io memory pids\n",
        f"{job}/memory.max": f"{GIB}\n",
        f"{job}/memory.high": "max\n",
        f"{job}/step_0/memory.max": "max\n",
        f"{job}/step_0/task_0/memory.max": "max\n",
        f"{job}/step_0/task_0/memory.high": f"{3 * GIB}\n",
    })
    assert cgroup_directory(proc) == ("v2", f"{tmp_path}{job}/step_0/task_0")
    assert cgroup_limit(proc) == MemoryLimit(GIB, "cgroup v2 memory.max 1.1 GB")


def test_cgroup_v1_on_a_hybrid_host_and_a_containers_mount_root(tmp_path):
    # The memory controller on v1; a v2 mount without it (as on this machine) does not count.
    # In a container without a cgroup namespace, /proc/self/cgroup names the host's path and
    # only the container's sub-tree is mounted.
    proc = write_tree(tmp_path, {
        "proc/self/cgroup": "4:memory:/docker/abc\n0::/docker/abc\n",
        "proc/self/mountinfo": mountinfo(
            tmp_path, ("cgroup", "/docker/abc", "/sys/fs/cgroup/memory", "rw,memory"),
            ("cgroup2", "/docker/abc", "/sys/fs/cgroup/unified", "rw")),
        "/sys/fs/cgroup/unified/cgroup.controllers": "hugetlb\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2 * GIB}\n",
    })
    assert cgroup_directory(proc) == ("v1", f"{tmp_path}/sys/fs/cgroup/memory")
    assert cgroup_limit(proc) == MemoryLimit(2 * GIB, "cgroup v1 memory.limit_in_bytes 2.1 GB")


def test_a_sibling_cgroup_sharing_a_name_prefix_is_not_inside_the_mount(tmp_path):
    # Mount root /docker/abc, own cgroup /docker/abcdef/x: not in the mounted sub-tree (a prefix
    # of a name is not a parent directory), so this process's cgroup is unknown: no limit is
    # read from a cgroup that is not its own, and nothing raises.
    proc = write_tree(tmp_path, {
        "proc/self/cgroup": "4:memory:/docker/abcdef/x\n",
        "proc/self/mountinfo": mountinfo(tmp_path, ("cgroup", "/docker/abc",
                                                    "/sys/fs/cgroup/memory", "rw,memory")),
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": f"{GIB}\n",
        "proc/meminfo": "MemAvailable: 4000000 kB\n",
    })
    assert cgroup_directory(proc) is None
    assert cgroup_limit(proc) is None
    assert job_memory_limit({}, proc).source == "the node's available memory 4.1 GB"


def test_no_limit_is_none_and_the_least_limit_names_itself(tmp_path):
    proc = write_tree(tmp_path, {
        "proc/self/cgroup": "4:memory:/\n",
        "proc/self/mountinfo": mountinfo(tmp_path, ("cgroup", "/", "/sys/fs/cgroup/memory",
                                                    "rw,memory")),
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
        "proc/meminfo": "MemTotal: 100 kB\nMemAvailable: 4000000 kB\n",
    })
    assert cgroup_limit(proc) is None
    assert node_available(proc) == MemoryLimit(4_096_000_000, "the node's available memory 4.1 GB")
    assert job_memory_limit({}, proc).source == "the node's available memory 4.1 GB"
    assert job_memory_limit({"SLURM_MEM_PER_NODE": "600"}, proc).source == "Slurm --mem 600M"


def test_this_machines_own_limit_reads_without_error():
    limit = job_memory_limit({})
    assert 0 < limit.bytes and limit.source


def own_memory_cgroup() -> tuple[str, str] | None:
    return cgroup_directory("/proc")


@pytest.mark.skipif(LAUNCHED_RANKS > 1, reason="creates and removes one cgroup: one process does")
@pytest.mark.timeout(120)
def test_a_job_in_a_child_memory_cgroup_budgets_against_it(tmp_path):
    found = own_memory_cgroup()
    if found is None:
        pytest.skip("no memory cgroup here")
    version, parent = found
    child = Path(parent) / f"hvdtrain-test-{uuid.uuid4().hex[:8]}"
    try:
        child.mkdir()
    except OSError as error:
        pytest.skip(f"cannot create a memory cgroup under {parent}: {error.strerror}")
    try:
        limit_file = "memory.limit_in_bytes" if version == "v1" else "memory.max"
        try:
            (child / limit_file).write_text(str(2 * GIB))
        except OSError as error:
            pytest.skip(f"cannot set {limit_file} in {child}: {error.strerror}")
        # A shell moves itself into the cgroup, then becomes the job (no preexec_fn in pytest).
        code = ("from hvdtrain.data.cache import memory_budget; "
                "print(memory_budget(None))")
        result = subprocess.run(
            ["sh", "-c", f'echo $$ > "{child}/cgroup.procs" && exec "$0" -c "$1"',
             sys.executable, code], capture_output=True, text=True, timeout=60, env=clean_env())
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"half of cgroup {version} {limit_file} 2.1 GB" in result.stdout, result.stdout
        assert f"({GIB}, " in result.stdout  # half of 2 GiB
    finally:
        child.rmdir()
