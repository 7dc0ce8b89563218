"""Every launch path across two hosts: 2 nodes x 2 ranks on tests/cluster/cluster-local.sh.

The nodes are network namespaces with their own hostnames, sshd and slurmd, sharing this file
system; the module fixture brings the cluster up and takes it down again if it started it
(tests/cluster_helpers.py reaches the cluster, its nodes and its jobs). Each job trains
hvdtrain.cnn's tiny preset through tests/scripts/multinode_probe.py (the same job, with
rank-seeded initial weights and a report of what every rank saw) and must show:

* rank 0's banner `placement: node1[0-1] node2[2-3]`;
* each rank's local_rank and cross (node) rank right for its host;
* weights that differed before the broadcast and are identical on all 4 ranks after training;
* >= 0.95 validation accuracy on the digits;
* only rank 0's files in the run directory (besides each rank's own log).

The health check runs on the same 2 nodes; at the end the cluster grows to 3 nodes x 1 rank for
a lost node (--min-nodes: through the launcher over ssh, and through sbatch --no-kill).

Runs as root only (namespaces, sshd, slurmd); elsewhere it skips with the reason.
"""
from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import ContextManager

import pytest

from conftest import (FAKE_GPU_NODES, REPO, RESUMED, VENV_BIN, apt_install, clean_env,
                      have_command, integration, run_job)
from cluster_helpers import (CLUSTER, JOB_TIMEOUT, LIVE_STATES, assert_nothing_left, cluster_up,
                             crash_node, epochs_done, job_processes, job_snapshot, job_state,
                             kill_processes_mentioning, on_node1, processes_mentioning,
                             resumed_from, sbatch, started_job, unavailable_reason, wait_for_epoch,
                             wait_for_job, wait_until)
from hvdtrain.launcher_env import processes
from hvdtrain.scratch import PREFIX as SCRATCH_PREFIX
from processes import process_group

pytestmark = [integration, pytest.mark.timeout(600)]
PROBE = REPO / "tests" / "scripts" / "multinode_probe.py"
PYTHON = str(VENV_BIN / "python")
#: The tiny preset's 3 epochs reach ~0.93 on 4 ranks, 5 reach 0.972 (4 ranks on one host,
#: 2026-11-30; check_job asks 0.95); epochs after the first take 1-2 s on 2 cores.
EPOCHS = 5
JOB_ARGS = ("--preset", "tiny", "--epochs", str(EPOCHS), "--tensorboard")
#: What 2 nodes x 2 ranks must report: rank -> (host, local_rank, cross_rank).
EXPECTED_RANKS = {0: ("node1", 0, 0), 1: ("node1", 1, 0), 2: ("node2", 0, 1), 3: ("node2", 1, 1)}
PLACEMENT = "placement: node1[0-1] node2[2-3]"


@pytest.fixture(scope="module")
def cluster_env() -> dict[str, str]:
    """The environment for jobs on the cluster: clean_env plus the cluster's SLURM_CONF."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    was_up = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True,
                            timeout=120).returncode == 0
    cluster_up()
    exported = subprocess.run(["bash", str(CLUSTER), "env"], capture_output=True, text=True,
                              check=True, timeout=30).stdout
    slurm_conf = re.search(r"SLURM_CONF=(\S+)", exported).group(1)
    yield clean_env(SLURM_CONF=slurm_conf, TF_CPP_MIN_LOG_LEVEL="2", **FAKE_GPU_NODES)
    if not was_up:
        down = subprocess.run(["bash", str(CLUSTER), "down"], capture_output=True, text=True,
                              timeout=300)
        assert down.returncode == 0, down.stdout + down.stderr
        assert_nothing_left()


@pytest.fixture
def run_dir(tmp_path):
    """A run directory on the shared file system; whatever of its job is left is killed after."""
    path = tmp_path / "run"
    yield path
    kill_processes_mentioning(path)


def check_job(output: str, run_dir: Path) -> None:
    """Everything a 2 x 2 job must show (see the module docstring)."""
    assert PLACEMENT in output, output[-4000:]
    probe = re.search(r"MULTINODE_PROBE (\{.*\})", output)
    assert probe, f"no probe line from rank 0:\n{output[-4000:]}"
    ranks = sorted(json.loads(probe.group(1))["ranks"], key=lambda facts: facts["rank"])
    seen = {facts["rank"]: (facts["hostname"], facts["local_rank"], facts["cross_rank"])
            for facts in ranks}
    assert seen == EXPECTED_RANKS, ranks
    assert {(f["size"], f["local_size"], f["cross_size"], f["status"]) for f in ranks} == \
        {(4, 2, 2, 0)}, ranks
    assert len({facts["initial"] for facts in ranks}) == 4, "ranks started from the same weights"
    finals = {facts["final"] for facts in ranks}
    assert len(finals) == 1, f"weights differ between ranks after training: {ranks}"
    assert finals != {ranks[0]["initial"]}, "training did not change the weights"

    rows = json.loads((run_dir / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == list(range(1, EPOCHS + 1))
    assert rows[-1]["val_accuracy"] >= 0.95, rows[-1]

    # Only rank 0 writes, except each rank's own log. TensorBoard names its files after the
    # writer's host and pid: one writer, on node1.
    files = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    top = {name.split("/")[0] for name in files}
    assert top <= {".lock", "checkpoints", "config.json", "curves.png", "logs", "metrics.csv",
                   "metrics.json", "model.keras", "tensorboard", "timeline.json"}, files
    assert {"config.json", "metrics.json", "model.keras", "checkpoints", "timeline.json"} <= top, \
        files
    # Each rank's own log, written by that rank on its node, starting with where it ran.
    logs = [name for name in files if name.startswith("logs/")]
    assert logs == [f"logs/rank-{rank}.log" for rank in range(4)], logs
    for rank, (host, _, _) in EXPECTED_RANKS.items():
        first = (run_dir / "logs" / f"rank-{rank}.log").read_text().splitlines()[0]
        assert first.startswith(f"hvdtrain.cnn: rank {rank} of 4 on {host}, pid "), first
    writers = {tuple(Path(name).name.split(".")[4:6]) for name in files
               if name.startswith("tensorboard/")}
    assert len(writers) == 1 and next(iter(writers))[0] == "node1", files


#: horovodrun's own interface probe tries eth1 too and needs 25-45 s here to give up on it (its
#: default --start-timeout is 30 s, measured: "Timed out waiting for tasks to update
#: task-to-task addresses"; docs/launching.md says so). That wait is horovodrun's, before any
#: rank starts, so both controllers are told the interface and skip the probe.
HOROVODRUN_NETWORK = ("--network-interface", "eth0")


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_horovodrun_from_node1(cluster_env, run_dir, controller):
    started = time.monotonic()
    result = run_job(on_node1(str(VENV_BIN / "horovodrun"), "-np", "4", "-H", "node1:2,node2:2",
                              f"--{controller}", *HOROVODRUN_NETWORK, PYTHON,
                              str(PROBE), "--run-dir", str(run_dir), *JOB_ARGS),
                     timeout=JOB_TIMEOUT, env=cluster_env)
    check_job(result.stdout, run_dir)
    print(f"horovodrun --{controller}: {time.monotonic() - started:.0f} s")


#: What the launcher says when it keeps the job off the dead-end interface.
AVOIDED_ETH1 = "network: using eth0; eth1 does not connect the nodes (node"


@pytest.mark.parametrize("via", ["mpirun", "srun"])
def test_sbatch_multinode_template(cluster_env, run_dir, tmp_path, via):
    # The shipped template, unedited: sbatch flags for 2 ranks per node, the probe as the
    # program, HVDTRAIN_VIA for srun. Plain mpirun would hang on eth1 (measured: "Open MPI failed
    # to TCP connect to a peer MPI process", still running 90 s later); the launcher's network
    # check keeps the ranks on eth0: found by itself under srun, and named by
    # HVDTRAIN_NETWORK_INTERFACE under mpirun (test_a_named_interface_in_slurm names one that
    # connects nothing; the preemption test's template job finds eth0 by itself under mpirun).
    started = time.monotonic()
    log = tmp_path / "slurm.out"
    env = {**cluster_env, "HVDTRAIN_MODULE": str(PROBE), "HVDTRAIN_RUN_DIR": str(run_dir),
           "HVDTRAIN_VIA": via}
    if via == "mpirun":
        env["HVDTRAIN_NETWORK_INTERFACE"] = "eth0"
    job_id = sbatch(env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    "slurm/multinode.sh", "--run-dir", str(run_dir), *JOB_ARGS)
    output = wait_for_job(env, job_id, log)
    assert {"mpirun": "mpirun -np 4", "srun": "srun --mpi=pmix --ntasks=4"}[via] in output, \
        output[-3000:]
    if via == "mpirun":
        assert "network: eth0 connects every node (node1, node2)" in output, output[-3000:]
        assert "--mca btl_tcp_if_include eth0" in output, output[-3000:]
    else:
        assert AVOIDED_ETH1 in output, output[-3000:]
    check_job(output, run_dir)
    print(f"sbatch slurm/multinode.sh via {via}: {time.monotonic() - started:.0f} s")


@pytest.mark.parametrize("via", ["horovodrun"])
def test_launcher_in_a_two_node_allocation(cluster_env, run_dir, tmp_path, via):
    # hvdtrain.launch reads the allocation: -np 4 -H node1:2,node2:2 for horovodrun (over ssh).
    # The batch script runs on node1. (srun is the template test's second case.)
    started = time.monotonic()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -euo pipefail\ncd " + str(REPO) + "\n"
                      f'exec {PYTHON} -m hvdtrain.launch --via {via} -- "$@"\n')
    log = tmp_path / "slurm.out"
    job_id = sbatch(cluster_env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    str(script), str(PROBE), "--run-dir", str(run_dir), *JOB_ARGS)
    output = wait_for_job(cluster_env, job_id, log)
    derived = {"horovodrun": "-np 4 -H node1:2,node2:2", "srun": "--ntasks=4"}[via]
    assert derived in output, output[-3000:]
    check_job(output, run_dir)
    print(f"hvdtrain.launch --via {via}: {time.monotonic() - started:.0f} s")


# --- a CPU per node (the network bench's setting) ------------------------------------------------
def test_mpirun_outside_slurm_brings_the_users_environment_to_every_rank(cluster_env, run_dir):
    """--via mpirun --hosts: remote ranks get only what mpirun passes with -x; the launcher
    passes the user's environment on, as horovodrun does."""
    env = {**cluster_env, "HVDTRAIN_PROBE_VARIABLE": "exported on node1"}
    result = run_job(on_node1(PYTHON, "-m", "hvdtrain.launch", "--via", "mpirun", "--hosts",
                              "node1:2,node2:2", str(PROBE), "--run-dir", str(run_dir), *JOB_ARGS),
                     timeout=JOB_TIMEOUT, env=env)
    check_job(result.stdout, run_dir)
    ranks = json.loads(re.search(r"MULTINODE_PROBE (\{.*\})", result.stdout).group(1))["ranks"]
    assert {(f["hostname"], f["user_variable"]) for f in ranks} == {
        ("node1", "exported on node1"), ("node2", "exported on node1")}, ranks


def test_pinned_nodes_run_on_a_cpu_of_their_own(cluster_env):
    """`up --pin-cpus`: what `exec` and ssh start on node K runs on the K-th allowed CPU; the
    next plain `up` gives every CPU back."""
    cpus = sorted(os.sched_getaffinity(0))

    def affinity(node: str, via_ssh: bool) -> str:
        show = "taskset -pc $$ | sed 's/.*: //'"
        command = (["ssh", node, show] if via_ssh else ["bash", "-c", show])
        start = "node1" if via_ssh else node
        return subprocess.run(["bash", str(CLUSTER), "exec", start, *command], capture_output=True,
                              text=True, check=True, timeout=60).stdout.strip()

    pinned = subprocess.run(["bash", str(CLUSTER), "up", "--nodes", "2", "--isolated-iface",
                             "--pin-cpus"], capture_output=True, text=True, timeout=900)
    try:
        assert pinned.returncode == 0, pinned.stdout + pinned.stderr
        seen = {(node, via_ssh): affinity(node, via_ssh)
                for node in ("node1", "node2") for via_ssh in (False, True)}
    finally:
        cluster_up()
    assert seen == {(node, via_ssh): str(cpus[k % len(cpus)])
                    for k, node in enumerate(("node1", "node2")) for via_ssh in (False, True)}
    # Unpinned again: a node's processes may use every allowed CPU ("0,1" or "0-3,6" ...).
    unpinned = set()
    for part in affinity("node2", True).split(","):
        first, _, last = part.partition("-")
        unpinned.update(range(int(first), int(last or first) + 1))
    assert unpinned == set(cpus)


# --- the network interface, named --------------------------------------------------------------
def test_a_named_interface_that_connects_nothing_fails_in_one_line(cluster_env, run_dir):
    # Outside Slurm (hosts given, probes over ssh) and inside (probes as an srun step).
    started = time.monotonic()
    result = run_job(on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", "node1:2,node2:2",
                              "--network-interface", "eth1", "hvdtrain.cnn", "--run-dir",
                              str(run_dir)), timeout=120, env=cluster_env, check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    assert time.monotonic() - started < 60
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(r"hvdtrain\.launch: error: network check: node[12] cannot reach node[12] "
                        r"on eth1 \(10\.78\.0\.1[12]\): .*--network-interface eth1; eth0 "
                        r"connects every node", lines[0]), lines[0]
    assert not run_dir.exists(), "a rank started"


@pytest.mark.timeout(180)
def test_a_stop_signal_during_the_network_check_ends_it_and_every_probe_at_once(cluster_env,
                                                                                 run_dir, tmp_path):
    """Ctrl-C (SIGINT to the launcher's process group) and a SIGTERM to the launcher alone while
    the check waits for node1's probe, which a sitecustomize holds for a minute (node2's, over
    ssh, does not see it): the launcher exits with the signal's status in one line within
    seconds, and no probe is left on either node. It used to wait 10 s for the held probe."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys, time\nif 'hvdtrain.netcheck' in sys.orig_argv:\n    time.sleep(60)\n")
    env = {**cluster_env, "PYTHONPATH": f"{tmp_path}:{REPO}"}

    def probes() -> list[str]:
        return processes_mentioning("hvdtrain.netcheck")

    for stop, to_group in ((signal.SIGINT, True), (signal.SIGTERM, False)):
        try:
            with process_group(
                    on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", "node1:1,node2:1",
                             "hvdtrain.cnn", "--run-dir", str(run_dir)), cwd=REPO, env=env,
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as launcher:
                # node1's probe, ssh to node2 and node2's probe: the check is under way.
                wait_until(lambda: len(probes()) >= 3, 60, lambda: f"the probes: {probes()}")
                time.sleep(1)
                os.killpg(launcher.pid, stop) if to_group else launcher.send_signal(stop)
                signalled = time.monotonic()
                output, _ = launcher.communicate(timeout=30)
                stopped_in = time.monotonic() - signalled
                wait_until(lambda: not probes(), 20, lambda: f"probes left: {probes()}")
        finally:
            for line in probes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(line.split(":")[0]), signal.SIGKILL)
        assert launcher.returncode == 128 + stop, output
        assert output.splitlines() == [f"hvdtrain.launch: {stop.name} before the ranks started; "
                                       "not starting them"], output
        assert stopped_in < 5, f"{stop.name}: the launcher took {stopped_in:.1f} s to stop"
        assert not run_dir.exists()


def test_a_named_interface_in_slurm(cluster_env, run_dir, tmp_path):
    log = tmp_path / "slurm.out"
    env = {**cluster_env, "HVDTRAIN_NETWORK_INTERFACE": "eth1", "HVDTRAIN_RUN_DIR": str(run_dir)}
    job_id = sbatch(env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    "slurm/multinode.sh", *JOB_ARGS)
    with pytest.raises(AssertionError, match="is FAILED"):
        wait_for_job(env, job_id, log)
    output = log.read_text()
    assert re.search(r"hvdtrain\.launch: error: network check: node[12] cannot reach node[12] on "
                     r"eth1 ", output), output[-3000:]
    assert not run_dir.exists()
    # Told the right one, the same template trains: test_sbatch_multinode_template[mpirun].


# --- faults across hosts -------------------------------------------------------------------------
LONG_JOB = ("hvdtrain.cnn", "--preset", "tiny", "--epochs", "400", "--no-tensorboard")


def launch_on_node1(run_dir: Path, *launcher_args: str) -> list[str]:
    return on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", "node1:2,node2:2",
                    *launcher_args, *LONG_JOB, "--run-dir", str(run_dir))


def one_failure_line(output: str) -> str:
    """The job's failure, said once: the launcher's end line (returned, without its prefix), and
    no rank's report of it beside (rank 0's is in the end line, the others' in their logs)."""
    ends = re.findall(r"^hvdtrain\.launch: job exited \d+: (.*)$", output, re.MULTILINE)
    assert len(ends) == 1, output[-4000:]
    assert "horovod shut the job down" not in output, output[-4000:]
    assert "no training step finished" not in output.replace(ends[0], ""), output[-4000:]
    return ends[0]


class FaultedRun:
    """One run directory that the fault tests below share, in file order: each fault's job
    starts by resuming from the checkpoint the previous fault left (its proof that the ranks
    stopped with one), and whatever fault comes last is resumed by the fixture. Four faults thus
    need five jobs, not eight; `-k` one of them still ends with its resume."""

    def __init__(self, path: Path, env: dict[str, str]):
        self.path, self.env = path, env
        self.done_at_fault: int | None = None
        """Epochs in metrics.json when the last fault hit; None: no fault to resume from."""

    def start(self, log: Path, *launcher_args: str) -> ContextManager[subprocess.Popen]:
        """The fault tests' job, running for the block (`started_job`)."""
        return started_job(launch_on_node1(self.path, *launcher_args), log, self.env)

    def wait_for_training(self, log: Path) -> None:
        """Until the job has trained 3 epochs of its own (after a resume, when one was due)."""
        first = 0
        if self.done_at_fault is not None:
            wait_until(lambda: resumed_from(log.read_text()) is not None, 240,
                       f"the resume in {log}:\n{log.read_text()[-3000:]}")
            first = resumed_from(log.read_text())
            # The fault may cost the epoch it interrupted, never more.
            assert first >= self.done_at_fault - 1, (first, self.done_at_fault)
            self.done_at_fault = None
        wait_for_epoch(log, first + 3)

    def faulted(self) -> None:
        """The fault hit and the job is gone: the next job must resume from its checkpoint."""
        self.done_at_fault = epochs_done(self.path)

    def resume(self) -> None:
        """The same job again, for 2 more epochs, resumes from the last checkpoint."""
        done = epochs_done(self.path)
        result = run_job(on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", "node1:2,node2:2",
                                  *LONG_JOB[:3], "--epochs", str(done + 2), "--no-tensorboard",
                                  "--run-dir", str(self.path)), timeout=JOB_TIMEOUT, env=self.env)
        resumed = resumed_from(result.stdout)
        assert resumed is not None and resumed >= self.done_at_fault - 1, result.stdout[-3000:]
        assert f"done: {done + 2} epoch(s)" in result.stdout, result.stdout[-3000:]
        self.done_at_fault = None


@pytest.fixture(scope="class")
def shared_faulted_run(cluster_env, tmp_path_factory):
    run = FaultedRun(tmp_path_factory.mktemp("faults") / "run", cluster_env)
    yield run
    if run.done_at_fault is not None:  # the last fault's checkpoint, resumed
        cluster_up()  # a failed test may have left a node down
        run.resume()


@pytest.fixture
def faulted_run(shared_faulted_run):
    """The shared run; whatever of a test's job is left (a failure) is killed after the test."""
    yield shared_faulted_run
    kill_processes_mentioning(shared_faulted_run.path)


class TestFaultsOnOneRun:
    """The faults that share one run (FaultedRun), in file order; the last one's checkpoint is
    resumed as the class ends, while the cluster still has its 2 nodes (at the module's end it
    had to be shrunk back from the lost-node tests' 3 first)."""

    @pytest.mark.parametrize("how", ["SIGKILL", "ssh connection lost"])
    def test_the_launchers_death_leaves_no_rank_on_any_node(self, cluster_env, faulted_run,
                                                            tmp_path, how):
        log = tmp_path / "job.out"
        run_dir = faulted_run.path
        command = launch_on_node1(run_dir)
        if how == "ssh connection lost":
            # A user's terminal on node1: ssh with a terminal, the launcher in the foreground.
            remote = " ".join(f"{name}={value}" for name, value in cluster_env.items()
                              if name.startswith(("OMPI_", "TF_", "PYTHON")))
            command = ["ssh", "-tt", "node1", f"cd {REPO} && exec env {remote} "
                       + " ".join(command[command.index(PYTHON):])]
        with started_job(command, log, cluster_env) as job:
            faulted_run.wait_for_training(log)
            assert len(job_processes(run_dir)) >= 4
            if how == "SIGKILL":
                launcher = next(int(line.split(":")[0]) for line in job_processes(run_dir)
                                if "hvdtrain.launch" in line)
                os.kill(launcher, signal.SIGKILL)
            else:
                os.kill(job.pid, signal.SIGKILL)  # the ssh client: the connection drops
            seconds = wait_until(lambda: not job_processes(run_dir), 120,
                                 f"the job outlived its launcher: {job_processes(run_dir)}")
        print(f"{how}: the job was gone {seconds:.0f} s later")
        if how == "SIGKILL":
            assert "the launcher (pid" in log.read_text() and "died; stopping its job" in \
                log.read_text(), log.read_text()[-3000:]
        # The ranks stopped on the SIGTERM the launcher's watcher sent: the next job resumes.
        faulted_run.faulted()


    def test_a_rank_killed_on_node2_ends_the_job_in_one_line_naming_it(self, cluster_env,
                                                                       faulted_run, tmp_path):
        log = tmp_path / "job.out"
        with faulted_run.start(log) as job:
            faulted_run.wait_for_training(log)
            rank_3 = [process.pid for process in processes() if process.rank == 3
                      and "hvdtrain.cnn" in process.argv and str(faulted_run.path) in process.argv]
            assert len(rank_3) == 1, job_processes(faulted_run.path)
            os.kill(rank_3[0], signal.SIGKILL)  # as the OOM killer does
            wait_until(lambda: job.poll() is not None, 60, "the job to end")
            output = log.read_text()
        assert job.returncode not in (0, None), output[-3000:]
        assert one_failure_line(output) == (
            "rank 3 on node2 ended on SIGKILL (killed: the out-of-memory killer, or by hand); its "
            f"log: {faulted_run.path}/logs/rank-3.log")
        faulted_run.faulted()


    def test_a_link_down_ends_the_job_instead_of_hanging(self, cluster_env, faulted_run, tmp_path):
        # Linux retries the allreduce's TCP segments for ~15 minutes; horovod's stall check is stuck
        # behind them. The ranks' stall watchdog (limit below) and the launcher end the job. The
        # tiny preset's steps take milliseconds and its epoch ends about a second: 15 s is no step.
        limit, inspections = 15, 3
        # The watchdog leaves horovod's inspector 4 inspections after the limit (see
        # HorovodRuntime.stall_limit_seconds): a short interval keeps the test short.
        watchdog = limit + 4 * inspections
        log = tmp_path / "job.out"
        with faulted_run.start(log, "--stall-check-shutdown-seconds", str(limit),
                               "--stall-check-warning-seconds", str(inspections)) as job:
            try:
                faulted_run.wait_for_training(log)
                subprocess.run(["ip", "-n", "hvdt-node2", "link", "set", "eth0", "down"],
                               check=True)
                budget = watchdog + launch_module().ORPHANED_COMMAND_SECONDS + 30
                seconds = wait_until(lambda: job.poll() is not None, budget, "the job to end")
            finally:
                subprocess.run(["ip", "-n", "hvdt-node2", "link", "set", "eth0", "up"], check=True)
            output = log.read_text()
            assert job.returncode != 0
            assert re.fullmatch(rf"no training step finished in {watchdog} s on rank 0 on node1: "
                                rf".*; its log: {faulted_run.path}/logs/rank-0.log|node2 stopped "
                                r"answering.*", one_failure_line(output)), output[-3000:]
            print(f"link down: the job ended {seconds:.0f} s later (watchdog {watchdog} s)")
            # With the link back, node2's leftovers (its ranks ended by their own watchdogs; orted's
            # connection resets) go too; checked before the block ends what is left of the group.
            wait_until(lambda: not job_processes(faulted_run.path), 90,
                       f"orphans: {job_processes(faulted_run.path)}")
        faulted_run.faulted()


def test_the_orphan_guard_waits_while_rank_0_elsewhere_writes_its_last_checkpoint(
        cluster_env, tmp_path):
    """--hosts node2:2,node1:2 started on node1 puts rank 0 on node2. The ranks on node1 end at
    once, and rank 0 takes longer to write its last checkpoint than the guard gives a command
    whose ranks on this host are gone (it used to end such a job): the launcher asks node2,
    waits for rank 0, and the job ends well. Gloo, whose ranks leave without MPI's closing
    barrier, so node1's ranks really are gone."""
    run_dir, seconds = tmp_path / "run", 45
    assert seconds > launch_module().ORPHANED_COMMAND_SECONDS + 10
    result = run_job(on_node1(PYTHON, "-m", "hvdtrain.launch", "--controller", "gloo",
                              "--hosts", "node2:2,node1:2", "--network-interface", "eth0",
                              str(REPO / "tests" / "scripts" / "slow_last_checkpoint.py"),
                              str(run_dir), str(seconds)), timeout=JOB_TIMEOUT, env=cluster_env)
    assert f"rank 0 on node2: writing the last checkpoint ({seconds} s)" in result.stdout, \
        result.stdout
    assert "rank 0 still runs on node2: waiting for it" in result.stdout, result.stdout
    assert "rank 0: last checkpoint written" in result.stdout, result.stdout
    assert (run_dir / "last-checkpoint").stat().st_size == seconds << 16


def test_a_rank_stalled_on_node2_ends_the_job_in_one_line_naming_it(cluster_env, tmp_path):
    """Rank 3 (node2) stops answering mid-epoch, as a rank stuck reading a hung file system:
    horovod's stall inspector names it, the launcher says so once; ranks 1 and 2, which saw
    horovod shut down too, say it only in their own logs."""
    run_dir = tmp_path / "run"
    # A limit well above the ranks' skew at the first steps (tracing): at 6 s, on a machine
    # half as fast, horovod ended the job for rank 0, still tracing its step on a shared core.
    limit, inspections = 20, 4
    started = time.monotonic()
    result = run_job(on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", "node1:2,node2:2",
                              "--stall-check-shutdown-seconds", str(limit),
                              "--stall-check-warning-seconds", str(inspections), *LONG_JOB,
                              "--model", f"{REPO}/tests/scripts/stalling_model.py:build",
                              "--run-dir", str(run_dir)),
                     timeout=JOB_TIMEOUT, check=False,
                     env={**cluster_env, "HVDTRAIN_TEST_STALL_RANK": "3",
                          "HVDTRAIN_TEST_STALL_AFTER": "30"})
    output = result.stdout
    assert result.returncode not in (0, 2), output[-3000:]
    assert "rank 3: stalling at batch 30" in output, output[-3000:]
    assert one_failure_line(output) == (
        "rank 3 on node2 stalled: the other ranks waited for it in a collective past horovod's "
        f"stall limit (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); its log: {run_dir}/logs/rank-3.log")
    for rank in (1, 2):
        assert f"rank {rank}: horovod shut the job down" in (
            run_dir / "logs" / f"rank-{rank}.log").read_text()
    print(f"stall: the job ended {time.monotonic() - started:.0f} s after its start")


# A step the batch script started and left running holds node2's two CPUs (a monitor started with
# a plain srun, say), so the srun step through which mpirun starts its daemon there waits; Open
# MPI sends that srun's messages to /dev/null and starts no rank anywhere until every daemon
# has reported: the job would stay RUNNING without a word. The launcher ends it at its deadline.
@pytest.mark.timeout(300)
def test_a_job_whose_ranks_never_start_ends_at_the_startup_deadline(cluster_env, run_dir,
                                                                    tmp_path):
    # After the fault tests (node2's link down, ranks killed) the job once sat 240 s unstarted
    # in CI, why unrecorded (the snapshot now says); here node2's link down for 100 s left it
    # not responding until 20 s after the link came back. cluster_up waits for every node to be
    # usable and resumes one left down or drained.
    cluster_up()
    deadline = 20
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\ncd " + str(REPO) + "\n"
        "srun --nodes=1 --ntasks=2 --nodelist=node2 sleep 600 &\n"
        'until squeue --steps --noheader --jobs "$SLURM_JOB_ID" | grep -q sleep; do\n'
        "  sleep 0.5\ndone\n"
        f"exec {PYTHON} -m hvdtrain.launch --via mpirun --skip-preflight "
        f'--network-interface eth0 --startup-timeout {deadline} -- "$@"\n')
    log = tmp_path / "slurm.out"
    started = time.monotonic()
    job_id = sbatch(cluster_env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    str(script), *LONG_JOB, "--run-dir", str(run_dir))
    try:
        wait_until(lambda: job_state(cluster_env, job_id) not in LIVE_STATES, 240,
                   lambda: f"the job's end; {job_snapshot(cluster_env, job_id)}")
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, env=cluster_env)
    output = log.read_text()
    assert job_state(cluster_env, job_id) == "FAILED", output[-3000:]
    assert one_failure_line(output) == (
        f"no rank started within {deadline} s: mpirun starts the ranks only once it has reached "
        "every node, and it did not reach one (a node down or unreachable; in Slurm, another "
        "step of this job holding a node's CPUs, e.g. an srun without --overlap left running: "
        "squeue --steps lists them)"), output[-3000:]
    assert "placement:" not in output and not (run_dir / "logs").exists(), output[-3000:]
    print(f"startup deadline: the job ended {time.monotonic() - started:.0f} s after sbatch")


def launch_module():
    from hvdtrain.launch import supervise

    return supervise


# Two jobs' starts (4 ranks importing TensorFlow on 2 cores the other lane shares) and a requeue.
# On a machine half as fast the whole test took 395 s in one CI run, and in the next the first
# epoch was not there after 300 s (what the job was doing went unrecorded): the first epoch now
# gets JOB_TIMEOUT, and a job that ended before it fails the test at once, with its state and log.
@pytest.mark.timeout(JOB_TIMEOUT * 2 + 180)
def test_usr1_preemption_of_a_two_node_job_requeues_and_resumes(cluster_env, run_dir, tmp_path):
    log = tmp_path / "slurm.out"
    env = {**cluster_env, "HVDTRAIN_RUN_DIR": str(run_dir)}
    job_id = sbatch(env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    "slurm/multinode.sh", "--preset", "tiny", "--epochs", "12",
                    "--no-tensorboard")
    try:
        # Until its first epoch, or the job's end (which fails the test with its log at once).
        def job_now() -> str:
            return (f"job {job_id} is {job_state(env, job_id)}; {job_snapshot(env, job_id)}\n"
                    f"its log:\n{log.read_text()[-3000:] if log.exists() else '(no log yet)'}")

        wait_until(lambda: (run_dir / "metrics.json").exists()
                   or job_state(env, job_id) not in LIVE_STATES, JOB_TIMEOUT,
                   lambda: f"a first epoch; {job_now()}")
        assert (run_dir / "metrics.json").exists(), job_now()
        # What Slurm does at --signal=B:USR1@120, now: USR1 to the batch shell on node1.
        run_job(["scancel", "--signal=USR1", "--batch", job_id], timeout=30, env=env)
        wait_until(lambda: "Restarts=1" in subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True,
            env=env).stdout, 120, "the requeue")
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30, env=env)
        raise
    output = wait_for_job(env, job_id, log)
    stopped = re.search(r"stopped by SIGUSR1 in epoch (\d+)", output)
    resumed = re.search(RESUMED, output)
    assert stopped and resumed, output[-5000:]
    assert f"job {job_id} run 1 on node[1-2]" in output
    assert output.count("placement: node1[0-1] node2[2-3]") == 2
    epochs = [row["epoch"] for row in json.loads((run_dir / "metrics.json").read_text())]
    assert epochs == list(range(1, 13)), epochs


# --- the health check across the nodes ------------------------------------------------------------
@pytest.mark.timeout(300)
def test_the_health_check_names_a_slow_node_and_a_rank_computing_other_numbers(cluster_env,
                                                                               tmp_path):
    """node2's link out shaped to 100 Mbit/s (tc tbf) and rank 3 (on node2) told to nudge its
    result (the check's test-only variable): --health-check before a job names both, one line
    each, and ends with exit 2 before the job starts."""
    run_dir = tmp_path / "run"
    shape = ["tc", "-n", "hvdt-node2", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
             "100mbit", "burst", "64kb", "latency", "400ms"]
    subprocess.run(shape, check=True, capture_output=True, timeout=30)
    try:
        started = time.monotonic()
        result = run_job(on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", "node1:2,node2:2",
                                  "--health-check", *LONG_JOB, "--run-dir", str(run_dir)),
                         timeout=240, check=False,
                         env={**cluster_env, "HVDTRAIN_HEALTH_TEST_PERTURB_RANK": "3"})
        seconds = time.monotonic() - started
    finally:
        subprocess.run(["tc", "-n", "hvdt-node2", "qdisc", "del", "dev", "eth0", "root"],
                       capture_output=True, timeout=30)
    said = [line for line in result.stdout.splitlines() if "hvdtrain.health:" in line]
    assert result.returncode == 2, result.stdout[-3000:]
    assert said[0].startswith("hvdtrain.health: failed: rank 3 on node2 computed "), said
    assert re.fullmatch(r"hvdtrain\.health: warning: node2: [\d.]+ Mbit/s out against "
                        r"[\d.]+ [GM]bit/s median", said[1]), said
    assert re.match(r"hvdtrain\.health: FAILED: 4 rank\(s\) on 2 node\(s\), links .* median, "
                    r"allreduce 16 MiB [\d.]+ [GMk]bit/s bus \(MPI\), ", said[2]), said
    assert len(said) == 3 and "Epoch" not in result.stdout and not run_dir.exists()
    print(f"health check, 2 nodes x 2 ranks: {seconds:.0f} s; {said[1]}")


# --- in a container image (containers/build.sh), with Charliecloud ------------------------------


@pytest.fixture(scope="module", autouse=True)
def container_build(cluster_env, tmp_path_factory):
    """containers/build.sh, started as this module starts: its minutes of downloads, unpacking
    and mksquashfs overlap the tests before the container tests, which mostly wait on daemons
    and timeouts (at the lowest priority, so it does not slow their ranks). Yields the running
    build (its output directory and log); the container tests wait for it."""
    if not have_command("ch-run"):
        install = apt_install("charliecloud-runtime")
        assert install.returncode == 0, install.stdout + install.stderr
    out = tmp_path_factory.mktemp("images")
    planted = plant_build_host_credentials()
    try:
        # --reuse-caches: the pip cache and compiled horovod of this machine's own install (the
        # image is the same; a clean build compiles horovod again, ~4 minutes more).
        # --mount-point: the repository's top directory, which a clone may have anywhere
        # (/check, say) and which ch-run binds only onto a directory the image has.
        # A build cut short gets 2 minutes to clean up after itself on SIGTERM.
        with (out / "build.log").open("w") as log, process_group(
                ["nice", "-n", "19", "bash", str(REPO / "containers" / "build.sh"), "--out",
                 str(out), "--formats", "squash", "--reuse-caches", "--mount-point",
                 top_directory(REPO)],
                grace_seconds=120, stdout=log, stderr=subprocess.STDOUT) as build:
            yield build, out
    finally:
        for path in reversed(planted):
            path.rmdir() if path.is_dir() else path.unlink()
    # ch-run's SquashFS mount point (the ranks made it; ch-run leaves it): empty once they ended.
    mount_point = Path("/var/tmp") / f"{os.environ.get('USER') or getpass.getuser()}.ch"
    for directory in (mount_point / "mnt", mount_point):
        with contextlib.suppress(OSError):
            directory.rmdir()


#: In this machine's apt and pip settings while the image builds (plant_build_host_credentials).
BUILD_HOST_SECRET = f"s3cr3t-{os.getpid()}-of-the-build-host"


def plant_build_host_credentials() -> list[Path]:
    """A proxy password and a login in this machine's apt settings, and a file in pip's
    configuration directory, all with BUILD_HOST_SECRET, for the build to copy into the image
    root (scripts/debian-root.sh's copy_host_access) and to remove before packing. Apt reads
    them for mirror.invalid alone, so nothing else on this machine changes. Returns what was
    made, directories first, for the fixture to remove: never an existing file."""
    tag = f"hvdtrain-test-{os.getpid()}"
    files = {
        Path("/etc/apt/apt.conf.d") / f"99{tag}":
            f'Acquire::http::Proxy::mirror.invalid "http://bob:{BUILD_HOST_SECRET}@proxy.invalid";\n',
        Path("/etc/apt/auth.conf.d") / f"{tag}.conf":
            f"machine mirror.invalid login alice password {BUILD_HOST_SECRET}\n",
        Path.home() / ".config" / "pip" / f"{tag}.conf":
            f"[{tag}]\ntoken = {BUILD_HOST_SECRET}\n",
    }
    made = []
    for path, text in files.items():
        missing = [parent for parent in reversed(path.parents) if not parent.exists()]
        for directory in missing:
            directory.mkdir(mode=0o755)
            made.append(directory)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
            file.write(text)
        made.append(path)
    return made


def top_directory(path: Path) -> str:
    """/work for /work/main: what a container binds to see the repository."""
    return "/" + path.parts[1]


@pytest.fixture
def container_image(container_build) -> Path:
    build, out = container_build
    try:
        build.wait(timeout=1500)
    except subprocess.TimeoutExpired:
        log = (out / "build.log").read_text()
        pytest.fail(f"containers/build.sh did not finish:\n{log[-3000:]}")
    log = (out / "build.log").read_text()
    assert build.returncode == 0, log[-3000:]
    print(log)
    return out / "hvdtrain-cpu.sqfs"


@pytest.mark.timeout(1800)
def test_the_image_keeps_none_of_the_build_hosts_credentials(container_image):
    """The real build, with credentials planted in this machine's apt and pip settings
    (plant_build_host_credentials): they reach the root for the install, and no file of the
    packed image holds the secret. grep runs in the image (ch-run, with a private /tmp and
    without this machine's passwd) over every top directory but the kernel's, binary files
    skipped after their first block; the text only /etc/environment has shows that it reads
    the image's files."""
    log = (container_image.parent / "build.log").read_text()
    removed = re.search(r"^\[container\] removed from the root what the install used of this "
                        r"machine's settings: (.*)$", log, re.MULTILINE)
    assert removed, log[-3000:]
    tag = f"hvdtrain-test-{os.getpid()}"
    for planted in (f"/etc/apt/apt.conf.d/99{tag}", "/etc/apt/auth.conf.d", "/root/.config/pip"):
        assert planted in removed.group(1).split(), removed.group(0)
    # What containers/build.sh writes to /etc/environment, put together here: the image holds
    # the repository, this file too, which must not contain it whole.
    known = "PATH=" + '"' + "/opt/hvdtrain/.venv/bin:"
    grep = "grep -rlIF -e \"$0\" -e \"$1\" $(ls -d /* | grep -vxE '/(proc|sys|dev|tmp)')"
    found = subprocess.run(["ch-run", "--private-tmp", "--no-passwd", str(container_image), "--",
                            "sh", "-c", grep, BUILD_HOST_SECRET, known], capture_output=True,
                           text=True, timeout=600, env={**os.environ, "USER": getpass.getuser()})
    assert found.stdout.split() == ["/etc/environment"], found.stdout + found.stderr
    print(f"the image's files hold none of the build host's credentials: {removed.group(0)}")


@pytest.mark.timeout(1800)
def test_srun_ch_run_trains_in_the_image_on_both_nodes(cluster_env, container_image, run_dir,
                                                       tmp_path):
    """What docs/containers.md shows for Charliecloud by hand: srun starts ch-run for every rank."""
    started = time.monotonic()
    script, log = tmp_path / "job.sh", tmp_path / "slurm.out"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\ncd " + str(REPO) + "\n"
        "export PMIX_MCA_gds=hash OMPI_MCA_btl_vader_single_copy_mechanism=none\n"
        # Each node's eth1 connects nothing (cluster_up): by hand, a user names the interface
        # (the launcher's network check finds it itself).
        "export OMPI_MCA_btl_tcp_if_include=eth0 OMPI_MCA_oob_tcp_if_include=eth0\n"
        # ch-run needs $USER, which a login shell has and this test's environment may not.
        'export USER="${USER:-$(id -un)}"\n'
        # ch-run 0.31 races on making its mount point when a node's ranks start together.
        'srun --ntasks-per-node=1 mkdir -p "/var/tmp/$USER.ch/mnt"\n'
        f"srun --mpi=pmix ch-run --set-env --bind={top_directory(REPO)} --cd=$PWD "
        f"{container_image} -- "
        f'python {PROBE} "$@"\n')
    job_id = sbatch(cluster_env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    str(script), "--run-dir", str(run_dir), *JOB_ARGS)
    output = wait_for_job(cluster_env, job_id, log)
    check_job(output, run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["versions"]["python"] == "3.11.2", config["versions"]  # the image's Debian one
    print(f"srun ch-run: {time.monotonic() - started:.0f} s")


@pytest.mark.timeout(900)
def test_the_template_runs_the_ranks_in_the_image(cluster_env, container_image, run_dir,
                                                  tmp_path):
    """slurm/multinode.sh, unedited, with HVDTRAIN_CONTAINER: the launcher (on this machine's
    Python) checks the image's horovod in the image, then srun wraps every rank in ch-run."""
    started = time.monotonic()
    log = tmp_path / "slurm.out"
    env = {**cluster_env, "HVDTRAIN_MODULE": str(PROBE), "HVDTRAIN_RUN_DIR": str(run_dir),
           "HVDTRAIN_CONTAINER": str(container_image)}
    job_id = sbatch(env, log, "-N", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                    "slurm/multinode.sh", "--run-dir", str(run_dir), *JOB_ARGS)
    output = wait_for_job(env, job_id, log)
    # The working directory's top directory and the run directory's (under /tmp), each once.
    binds = " ".join(f"--bind={top}" for top in dict.fromkeys([top_directory(REPO), "/tmp"]))
    # Each rank makes ch-run's mount point first (mkdir -p; ch-run 0.31's own mkdir races).
    # --cpus-per-task restated from the allocation (srun 22.05-23.02 does not read it).
    assert ("srun --mpi=pmix --ntasks=4 --cpus-per-task=1 --kill-on-bad-exit=1 sh -c 'mkdir -p "
            '"/var/tmp/$USER.ch/mnt" && exec "$@"\' sh '
            f"ch-run --set-env {binds} --cd={REPO} {container_image} -- python -m "
            f"hvdtrain.script {PROBE}") in output, output[-3000:]
    check_job(output, run_dir)
    print(f"sbatch slurm/multinode.sh with HVDTRAIN_CONTAINER: {time.monotonic() - started:.0f} s")


@pytest.mark.timeout(300)
def test_a_directory_the_image_cannot_bind_onto_is_one_line(cluster_env, container_image,
                                                            tmp_path):
    """A run directory under a top directory the image lacks: ch-run would fail in every rank
    ("can't mkdir ... Read-only file system"); the launcher says so once, before anything. It
    runs in an allocation (--via srun outside one is refused first, with the other options)."""
    absent = Path(f"/hvdtrain-absent-{os.getpid()}")
    assert not absent.exists()
    script, log = tmp_path / "job.sh", tmp_path / "slurm.out"
    script.write_text(
        f"#!/bin/bash\ncd {REPO}\n"
        'export USER="${USER:-$(id -un)}"\n'  # ch-run's mount point is named after $USER
        f"{PYTHON} -m hvdtrain.launch --via srun --container {container_image} hvdtrain.cnn "
        f"--run-dir {absent / 'run'}\n"
        'echo "launcher exit $?"\n')
    job_id = sbatch(cluster_env, log, "-N", "1", "--ntasks-per-node=1", str(script))
    lines = wait_for_job(cluster_env, job_id, log).strip().splitlines()
    assert lines[-1] == "launcher exit 2" and len(lines) == 2, lines
    assert (f"has no {absent} to bind this machine's onto" in lines[0]
            and f"containers/build.sh --mount-point {absent}" in lines[0]), lines
    assert not absent.exists()


# --- a lost node: --min-nodes restarts on the nodes left (3 nodes x 1 rank) -----------------------
THREE_HOSTS = "node1:1,node2:1,node3:1"


@pytest.fixture
def three_nodes(cluster_env):
    """The cluster with a third node (cluster-local.sh resizes: down, then up with 3); module
    teardown takes it down as usual. After the test, what the crashed node3's processes left in
    the /tmp it shares with this machine (on a real cluster, its own disk) goes: their scratch
    directories and Open MPI's session directory, which nothing of theirs lived to remove."""
    up = subprocess.run(["bash", str(CLUSTER), "up", "--nodes", "3", "--isolated-iface"],
                        capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, (up.stdout + up.stderr)[-3000:]
    yield cluster_env
    tmp = Path(tempfile.gettempdir())
    for left in [*tmp.glob(f"{SCRATCH_PREFIX}node3-*"), *tmp.glob("ompi.node3.*")]:
        shutil.rmtree(left, ignore_errors=True)


def check_went_on_without_node3(output: str, run_dir: Path, epochs: int, channel: str) -> str:
    """One restart line naming node3 as gone (asked over ``channel``), every epoch once, the
    first on 3 workers and the last on 2, and the end; the restart line."""
    restarts = re.findall(r"^hvdtrain\.launch: job exited \d+.*; restart 1 of 2 on the 2 "
                          r"host\(s\) left \(node1:1,node2:1, 2 rank\(s\)\) since node3 is gone "
                          rf"\({channel}: .*\), in 3 s .*$", output, re.MULTILINE)
    assert len(restarts) == 1, output[-4000:]
    rows = json.loads((run_dir / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == list(range(1, epochs + 1)), rows
    workers = [row["workers"] for row in rows]
    assert workers[0] == 3 and workers[-1] == 2 and workers == sorted(workers, reverse=True)
    assert f"done: {epochs} epoch(s)" in output
    return restarts[0]


def node_loss_job(run_dir: Path, min_nodes: int, epochs: int) -> list[str]:
    return on_node1(PYTHON, "-m", "hvdtrain.launch", "--hosts", THREE_HOSTS, "--min-nodes",
                    str(min_nodes), "--max-restarts", "2", "hvdtrain.cnn", "--preset", "tiny",
                    "--tensorboard", "--epochs", str(epochs), "--run-dir", str(run_dir))


@pytest.mark.timeout(600)
def test_a_crashed_node_is_dropped_and_the_job_finishes_on_the_nodes_left(three_nodes, run_dir,
                                                                          tmp_path):
    log, epochs = tmp_path / "job.out", 8
    with started_job(node_loss_job(run_dir, 2, epochs), log, three_nodes) as job:
        wait_for_epoch(log, 3)
        crash_node("node3")
        crashed = time.monotonic()
        back = wait_until(lambda: "resized: worker(s) 3 -> 2" in log.read_text(), 240,
                          f"the resume on 2 nodes:\n{log.read_text()[-3000:]}")
        wait_until(lambda: job.poll() is not None, 300, "the job to end")
        output = log.read_text()
        assert job.returncode == 0, output[-4000:]
        restart = check_went_on_without_node3(output, run_dir, epochs, "ssh")
        print(f"node3 crashed: the resume on node1 and node2 {back:.0f} s later, the job done "
              f"{time.monotonic() - crashed:.0f} s later; restart line: {restart}")
        # Checked before the block ends what is left of the job's group.
        wait_until(lambda: not job_processes(run_dir), 30, f"orphans: {job_processes(run_dir)}")


@pytest.mark.timeout(600)
def test_fewer_nodes_left_than_min_nodes_ends_the_job_in_one_line(three_nodes, run_dir,
                                                                   tmp_path):
    log = tmp_path / "job.out"
    with started_job(node_loss_job(run_dir, 3, 400), log, three_nodes) as job:
        wait_for_epoch(log, 3)
        crash_node("node3")
        wait_until(lambda: job.poll() is not None, 240, "the job to end")
        output = log.read_text()
        assert job.returncode not in (0, None), output[-3000:]
        # The crash named once, with the rank it took and its log, then why there is no restart.
        assert re.fullmatch(
            r"node3 stopped answering \(crashed, or its network is down\) with rank 2 on it; its "
            rf"log: {re.escape(str(run_dir))}/logs/rank-2\.log; node3 is gone \(ssh: .*\); 2 "
            r"host\(s\) left, fewer than --min-nodes 3: not restarting",
            one_failure_line(output)), output[-3000:]
        assert "resuming from" not in output
        # Checked before the block ends what is left of the job's group.
        wait_until(lambda: not job_processes(run_dir), 30, f"orphans: {job_processes(run_dir)}")


@pytest.mark.timeout(900)
def test_sbatch_no_kill_goes_on_without_the_crashed_node(three_nodes, run_dir, tmp_path):
    """The multinode template, unedited, submitted with --no-kill -N 2-3 and
    HVDTRAIN_MIN_NODES=2: node3 crashes mid-training, Slurm keeps the job, the launcher restarts
    it on node1 and node2, and the job COMPLETES with every epoch once."""
    log, epochs = tmp_path / "slurm.out", 8
    env = {**three_nodes, "HVDTRAIN_RUN_DIR": str(run_dir), "HVDTRAIN_MIN_NODES": "2",
           "HVDTRAIN_MAX_RESTARTS": "2"}
    # --ntasks: with --ntasks-per-node (the template's), Slurm 22.05 fixes the task count from
    # the smallest node count and allocated 2 nodes of 3 idle ones.
    job_id = sbatch(env, log, "--no-kill", "-N", "2-3", "--ntasks=3", "--ntasks-per-node=1",
                    "--cpus-per-task=1", "slurm/multinode.sh", "--preset", "tiny", "--tensorboard",
                    "--epochs", str(epochs))
    wait_for_epoch(log, 3)
    assert f"job {job_id} run 0 on node[1-3]" in log.read_text(), log.read_text()[-3000:]
    crash_node("node3")
    crashed = time.monotonic()
    back = wait_until(lambda: "resized: worker(s) 3 -> 2" in log.read_text(), 300,
                      f"the resume on 2 nodes:\n{log.read_text()[-3000:]}")
    wait_until(lambda: f"done: {epochs} epoch(s)" in log.read_text(), 300,
               f"the end of training:\n{log.read_text()[-3000:]}")
    trained = time.monotonic() - crashed
    # The job stays COMPLETING until Slurm declares node3 down (SlurmdTimeout, 120 s here):
    # what an administrator, or that timeout, does.
    subprocess.run(["scontrol", "update", "nodename=node3", "state=down", "reason=crashed"],
                   check=True, capture_output=True, timeout=30, env=env)
    output = wait_for_job(env, job_id, log)
    restart = check_went_on_without_node3(output, run_dir, epochs, "srun")
    print(f"sbatch --no-kill: node3 crashed; the resume on node1 and node2 {back:.0f} s later, "
          f"training done {trained:.0f} s later; restart line: {restart}")
