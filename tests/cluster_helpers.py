"""The local test clusters and the jobs on them, for the tests that use them.

tests/cluster/cluster-local.sh makes nodes of network namespaces that share this kernel, its
/proc and this file system, each with its own hostname, sshd and slurmd (tests/test_multinode.py);
tests/cluster/slurm-local.sh runs a single-node Slurm on this machine (tests/test_slurm.py). Here:
bringing the multi-node cluster up and checking that `down` left nothing, running a command on a
node, crashing one, submitting a Slurm job and waiting for its end (or saying where it stands),
starting a job in a process group of its own, and finding, waiting for and killing a job's
processes on every node.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from conftest import REPO, RESUMED, run_job
from benchmarks.threads import CLOCK_TICKS, thread_ticks
from hvdtrain.launcher_env import processes
from processes import process_group

CLUSTER = REPO / "tests" / "cluster" / "cluster-local.sh"
SLURM_LOCAL = REPO / "tests" / "cluster" / "slurm-local.sh"
#: The cluster's state directory (cluster-local.sh's default): keys, configuration, logs.
STATE_DIR = Path("/run/hvdtrain-cluster")
#: Seconds a job on the cluster gets to finish.
JOB_TIMEOUT = 420
LIVE_STATES = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "")
"""A job's states before its end ("" while squeue and scontrol do not know it yet)."""


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local multi-node cluster needs root (network namespaces, sshd, slurmd)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True,
                           timeout=30)
    if probe.returncode != 0:
        return f"network/UTS namespaces unavailable here: {probe.stderr.strip()}"
    return None


def cluster_up() -> None:
    """Bring the cluster up (idempotent: restarts what a test killed). Every node gets a second
    interface, eth1, in one subnet that connects nothing (docker0 on a real cluster's nodes), so
    every job here also proves that the launchers keep off it."""
    up = subprocess.run(["bash", str(CLUSTER), "up", "--nodes", "2", "--isolated-iface"],
                        capture_output=True, text=True, timeout=900)
    if up.returncode != 0:
        pytest.fail(f"tests/cluster/cluster-local.sh up failed:\n{(up.stdout + up.stderr)[-3000:]}")


def assert_nothing_left() -> None:
    """What `down` promises: no namespace, link, daemon, /etc entry or state directory."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    daemons = subprocess.run(["pgrep", "-af", "hvdtrain-cluster"], capture_output=True,
                             text=True).stdout
    assert "hvdt-" not in namespaces + links, namespaces + links
    assert not daemons.strip(), daemons
    assert "hvdtrain tests/cluster/cluster-local.sh" not in Path("/etc/hosts").read_text()
    assert not Path("/etc/ssh/ssh_config.d/hvdtrain-cluster.conf").exists()
    assert not STATE_DIR.exists()
    assert not list(Path("/tmp").glob("hvdtrain-cluster-tmpfs.*"))


def on_node1(*command: str) -> list[str]:
    return ["bash", str(CLUSTER), "exec", "node1", *command]


def crash_node(node: str) -> None:
    """Every process in the node's namespace dies at once (ranks, orted, sshd, slurmd)."""
    pids = subprocess.run(["ip", "netns", "pids", f"hvdt-{node}"], capture_output=True,
                          text=True, check=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def sbatch(env: dict[str, str], log: Path, *args: str) -> str:
    job_id = run_job(["sbatch", "--parsable", f"--output={log}", *args], timeout=60,
                     env=env).stdout.strip().split(";")[0]
    return job_id


def job_state(env: dict[str, str], job_id: str) -> str:
    shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                           timeout=30, env=env).stdout
    return (re.search(r"\bJobState=(\S+)", shown) or [None, ""])[1]


def wait_for_job(env: dict[str, str], job_id: str, log: Path) -> str:
    """The job's output once it has ended; fails unless it COMPLETED."""
    deadline = time.monotonic() + JOB_TIMEOUT
    state = ""
    try:
        while time.monotonic() < deadline:
            state = job_state(env, job_id)
            # A job that requeues itself goes from RUNNING to PENDING (BeginTime), never
            # through an end state: an end state is final.
            if state not in LIVE_STATES:
                break
            time.sleep(2)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, env=env)
    output = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", f"job {job_id} is {state}; log:\n{output[-5000:]}"
    return output


def job_snapshot(env: dict[str, str], job_id: str) -> str:
    """Where a Slurm job stands, for a failure message: its steps, each of its processes on
    every node (those whose environment names the job) with its threads' CPU seconds, the kernel
    function it sleeps in, and the last lines of every slurmd's log. A job that sat RUNNING for
    minutes with nothing in its log, twice in CI (never here), left no trace of where it
    waited: an srun of mpirun's waiting for its step, daemons without ranks, or ranks stuck."""
    def slurm(*command: str) -> str:
        return subprocess.run(command, capture_output=True, text=True, timeout=30,
                              env=env).stdout.rstrip()

    # A job that never left PENDING says why (a node DOWN after a fault test, say).
    state = slurm("squeue", "--noheader", "--jobs", job_id, "--format", "%T %r")
    nodes = slurm("sinfo", "--noheader", "--Node", "--format", "%N %T %E")
    steps = slurm("squeue", "--steps", "--jobs", job_id)
    lines = [f"its state and reason: {state or '(not listed)'}", f"the nodes:\n{nodes}",
             f"its steps:\n{steps}", "its processes (pid, CPU s, waiting in):"]
    for process in processes():
        if process.env.get("SLURM_JOB_ID") != job_id:
            continue
        try:
            wchan = Path(f"/proc/{process.pid}/wchan").read_text()
            cpu = sum(thread_ticks(process.pid).values()) / CLOCK_TICKS
        except OSError:
            continue
        lines.append(f"{process.pid} {cpu:.1f} [{wchan}] {' '.join(process.argv)[:200]}")
    for log in sorted((STATE_DIR / "log").glob("slurmd-*.log")):
        lines += [f"{log.name}:", *log.read_text().splitlines()[-6:]]
    return "\n".join(lines)


def processes_mentioning(text: str) -> list[str]:
    """"PID: command line" of every process on every node (one /proc: the nodes share this
    kernel) whose command line has ``text``."""
    return [f"{process.pid}: {' '.join(process.argv)[:160]}" for process in processes()
            if text in " ".join(process.argv)]


def job_processes(run_dir: Path) -> list[str]:
    """Every process on every node that belongs to the job: the ranks (their --run-dir) and
    their rank-log copies."""
    return processes_mentioning(str(run_dir))


def kill_processes_mentioning(path: Path) -> None:
    """A failed or timed-out job may leave ranks on node2 (not in the launcher's process group)."""
    for line in job_processes(path):
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


@contextlib.contextmanager
def started_job(command: list[str], log: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """``command`` running in a process group of its own for the block, its output in ``log``."""
    with open(log, "w") as output, process_group(command, stdout=output, stderr=subprocess.STDOUT,
                                                 cwd=REPO, env=env,
                                                 stdin=subprocess.DEVNULL) as job:
        yield job


def wait_until(condition, timeout: float, what: str | Callable[[], str]) -> float:
    """Seconds until ``condition()`` held; fails after ``timeout``, saying ``what`` (a callable:
    what it returns then, e.g. a job's log as it is at the failure)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started >= timeout:
            raise AssertionError(f"not within {timeout:g} s: "
                                 f"{what() if callable(what) else what}")
        time.sleep(0.5)
    return time.monotonic() - started


def wait_for_epoch(log: Path, epoch: int, timeout: float = 240) -> None:
    """Until ``log`` (which a job still pending has not made yet) shows the epoch's start."""
    def text() -> str:
        return log.read_text() if log.exists() else ""
    wait_until(lambda: f"Epoch {epoch}/" in text(), timeout,
               f"epoch {epoch} in {log}:\n{text()[-3000:]}")


def epochs_done(run_dir: Path) -> int:
    return len(json.loads((run_dir / "metrics.json").read_text()))


def resumed_from(output: str) -> int | None:
    found = re.search(RESUMED, output)
    return int(found.group(1)) if found else None
