"""Against a real Slurm (slurmctld + slurmd + munge on this machine, tests/cluster/slurm-local.sh).

The session fixture brings the cluster up (installing Slurm when missing and allowed) and takes it
down again if it started it. Jobs run the shipped templates unedited; each test cancels its jobs.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from cluster_helpers import SLURM_LOCAL
from conftest import (FAKE_GPU_NODES, REPO, RESUMED, VENV_BIN, clean_env, integration,
                      run_job)
from hostlists import BAD_HOSTLISTS, HOSTLISTS

pytestmark = [integration, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def slurm_cluster():
    was_up = subprocess.run(["bash", str(SLURM_LOCAL), "status"], capture_output=True,
                            timeout=60).returncode == 0
    if not was_up:
        up = subprocess.run(["bash", str(SLURM_LOCAL), "up"], capture_output=True, text=True,
                            timeout=900)
        if up.returncode != 0:
            message = f"no local Slurm: {(up.stdout + up.stderr).strip().splitlines()[-1:]}"
            if os.environ.get("CI"):
                pytest.fail(message)  # CI runs as root and must exercise the real cluster
            pytest.skip(message)
    yield
    if not was_up:
        subprocess.run(["bash", str(SLURM_LOCAL), "down"], capture_output=True, timeout=300)


class Job:
    def __init__(self, job_id: str, log: Path):
        self.id, self.log = job_id, log

    def field(self, name: str) -> str:
        shown = subprocess.run(["scontrol", "show", "job", self.id], capture_output=True,
                               text=True, timeout=30).stdout
        match = re.search(rf"\b{name}=(\S+)", shown)
        return match.group(1) if match else ""

    def wait(self, *, until: str = "COMPLETED", restarts: int = 0, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state, requeued = self.field("JobState"), int(self.field("Restarts") or 0)
            if state == until and requeued >= restarts:
                return state
            # A job that requeues itself goes from RUNNING to PENDING (Reason=BeginTime: Slurm
            # starts it again cred_expire + 1 s after the requeue, tests/cluster/lib.sh), never
            # through an end state: an end state is final.
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                         "OUT_OF_MEMORY"):
                break
            time.sleep(0.5)
        pytest.fail(f"job {self.id} is {self.field('JobState')} (wanted {until}); log:\n"
                    f"{self.text()[-5000:]}")

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


@pytest.fixture
def submit(slurm_cluster, tmp_path):
    jobs = []

    def sbatch(*args: str, run_dir: Path | None = None, cwd: Path = REPO, **env: str) -> Job:
        """Submit from ``cwd``; the log is slurm-N.out in tmp_path (slurm-N-T.out for array
        task T)."""
        log = tmp_path / f"slurm-{len(jobs)}.out"
        array = any(arg.startswith("--array") for arg in args)
        output = tmp_path / f"slurm-{len(jobs)}-%a.out" if array else log
        env = clean_env(HVDTRAIN_RUN_DIR=str(run_dir or tmp_path / "run"), **FAKE_GPU_NODES, **env)
        job_id = run_job(["sbatch", "--parsable", f"--output={output}", *args], timeout=60,
                         env=env, cwd=cwd).stdout.strip().split(";")[0]
        jobs.append(job_id)
        return Job(job_id, log)

    yield sbatch
    for job_id in jobs:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


#: The USR1 arrives after the first epoch and is acted on within 10 steps (11 per epoch at 4
#: ranks): the job must still be running then. The risk is a fast machine finishing the other
#: 7 tiny epochs before the signal goes through scancel, slurmd, the trap and the launcher
#: (on this one an epoch after the first took under a second at 4 ranks).
PREEMPTED_EPOCHS = 8


@pytest.fixture(scope="module")
def preempted_4gpu_job(slurm_cluster, tmp_path_factory):
    """slurm/4gpu.sh, unedited, preempted after its first epoch: (job, run dir).

    One job serves both tests below: the template's 4-rank launch (a run after a requeue is a
    whole run of the template too) and USR1 -> checkpoint -> requeue -> resume."""
    directory = tmp_path_factory.mktemp("4gpu")
    run_dir, log = directory / "run", directory / "slurm.out"
    job_id = run_job(["sbatch", "--parsable", f"--output={log}", "slurm/4gpu.sh", "--preset",
                      "tiny", "--no-tensorboard", "--epochs", str(PREEMPTED_EPOCHS)], timeout=60,
                     env=clean_env(HVDTRAIN_RUN_DIR=str(run_dir), **FAKE_GPU_NODES), cwd=REPO).stdout.strip()
    job = Job(job_id.split(";")[0], log)
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.json").exists():  # at least one epoch done
            assert time.monotonic() < deadline, job.text()[-3000:]
            time.sleep(0.5)
        # What Slurm does at --signal=B:USR1@120, delivered now: USR1 to the batch shell only.
        subprocess.run(["scancel", "--signal=USR1", "--batch", job.id], check=True, timeout=30)
        job.wait(restarts=1, timeout=600)
        yield job, run_dir
    finally:
        subprocess.run(["scancel", job.id], capture_output=True, timeout=30)


def test_sbatch_4gpu_template_runs_four_ranks(preempted_4gpu_job):
    job, run_dir = preempted_4gpu_job
    log = job.text()
    assert "-np 4 -H" in log  # derived from the allocation, not written in the script
    assert "backend horovod | 4 process(es), 4 worker(s)" in log
    placement = re.search(r"placement: (\S+)\[0-3\]", log)
    assert placement, log[-3000:]
    assert f"done: {PREEMPTED_EPOCHS} epoch(s)" in log
    assert (run_dir / "checkpoints" / "checkpoint").is_file()
    assert json.loads((run_dir / "config.json").read_text())["world"]["size"] == 4


def test_usr1_checkpoints_requeues_and_resumes(preempted_4gpu_job):
    job, run_dir = preempted_4gpu_job
    log = job.text()
    stopped = re.search(r"stopped by SIGUSR1 in epoch (\d+)", log)
    resumed = re.search(RESUMED, log)
    assert stopped and resumed, log[-5000:]
    assert f"requeueing job {job.id}" in log
    assert f"job {job.id} run 1 on" in log  # the second run of the same job
    assert int(resumed.group(1)) in (int(stopped.group(1)) - 1, int(stopped.group(1)))
    epochs = [row["epoch"] for row in json.loads((run_dir / "metrics.json").read_text())]
    assert epochs == list(range(1, PREEMPTED_EPOCHS + 1)), epochs  # none lost or logged twice
    assert f"done: {PREEMPTED_EPOCHS} epoch(s)" in log


@pytest.mark.parametrize("via", ["mpirun", "srun"])
def test_launcher_inside_an_allocation_via_mpirun_and_srun(submit, tmp_path, via):
    command = (f"{VENV_BIN / 'python'} -m hvdtrain.launch --via {via} -- hvdtrain.cnn "
               f"--preset tiny --epochs 1 --no-tensorboard --run-dir {tmp_path / 'run'}")
    job = submit("-n", "2", "--cpus-per-task=1", f"--chdir={REPO}", "--wrap", command)
    job.wait()
    log = job.text()
    assert "backend horovod | 2 process(es)" in log, log[-3000:]
    assert "done: 1 epoch(s)" in log


@pytest.mark.parametrize("memory", [["--mem=600M"], ["-c", "2", "--mem-per-cpu=150M"]])
def test_the_auto_cache_budgets_against_the_jobs_slurm_memory(submit, tmp_path, memory):
    """A job given 600M on this 24 GB node: --cache auto budgets half of 600M, not of the node.
    The decision for 2 local ranks on a real folder of 2,400 files at 224x224 (361 MB decoded
    for the node), made inside the job."""
    from images import make_image_folder

    one = next(make_image_folder(tmp_path / "seed", classes=2, per_class=1).glob("*/*"))
    folder = tmp_path / "images"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
        for index in range(1200):
            os.link(one, folder / name / f"{index}{one.suffix}")
    code = ("import hvdtrain; from hvdtrain.training.config import CacheSetting; "
            "from hvdtrain.data import choose_data_cache; "
            "from hvdtrain.data.folder import list_image_folder; "
            "from hvdtrain.runtime import World; "
            f"listing = list_image_folder({str(folder)!r}, image_size=224, "
            "validation_fraction=0.0, seed=0, on_bad_image='skip'); "
            "print(choose_data_cache(listing, World(rank=0, size=2, local_size=2), "
            "CacheSetting('auto'), "
            "budget_gb=None, validation_samples=0).describe())")
    job = submit(*memory, f"--chdir={REPO}", "--wrap", f"{VENV_BIN / 'python'} -c \"{code}\"")
    job.wait()
    # 2 x 1,200 files x 224 x 224 x 3 bytes; half of 600 MiB, or of 2 x 150 MiB.
    source, budget = (("Slurm --mem 600M", "314.6 MB") if memory == ["--mem=600M"] else
                      ("Slurm --mem-per-cpu 150M x 2 CPUs", "157.3 MB"))
    expected = (f"(auto: 361.3 MB decoded > {budget} budget: half of {source} for 2 local "
                "rank(s);")
    assert expected in job.text() and "cache: disk in " in job.text(), job.text()[-3000:]


def test_node_lists_expand_as_scontrol_show_hostnames_does(slurm_cluster):
    # hvdtrain.launch.slurm.expand_hostlist (tested on these in tests/test_launch.py) against Slurm's
    # own expander, which the launcher no longer needs (containers usually lack it).
    def scontrol_hostnames(nodelist: str) -> subprocess.CompletedProcess:
        return subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=30)

    shown = {nodelist: scontrol_hostnames(nodelist).stdout.split() for nodelist in HOSTLISTS}
    assert shown == HOSTLISTS
    # The lists expand_hostlist refuses are ones Slurm refuses too (or reads as garbage).
    for nodelist in BAD_HOSTLISTS:
        result = scontrol_hostnames(nodelist)
        said = result.stdout + result.stderr
        assert "Invalid hostlist" in said or "]" in result.stdout, (nodelist, said)


def test_dry_run_for_a_simulated_two_node_allocation(slurm_cluster):
    env = clean_env(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="node[07-08]",
                    SLURM_TASKS_PER_NODE="4(x2)", SLURM_GPUS_ON_NODE="4")
    result = run_job([str(VENV_BIN / "python"), "-m", "hvdtrain.launch", "--dry-run",
                      "--skip-preflight", "--", "hvdtrain.cnn", "--epochs", "2"],
                     timeout=60, env=env)
    assert "-np 8 -H node07:4,node08:4" in result.stdout  # expanded in Python, as scontrol would
    assert "# Slurm job 1234: 2 node(s)" in result.stdout


def test_an_array_task_requeues_alone_and_at_most_max_requeues_times(submit, tmp_path):
    """Task 1 stops for requeue (exit 75) on every run, task 0 finishes; HVDTRAIN_MAX_REQUEUES=1.

    Task 1 is the task whose own job id is also the array's id (checked below): there
    `scontrol requeue $SLURM_JOB_ID` would requeue task 0 as well. The program is a script path
    (HVDTRAIN_MODULE), which must get only its own arguments (no --run-dir).
    """
    record = tmp_path / "runs.txt"
    array = submit("--array=0-1", "slurm/cpu.sh", str(record), "75", "--only-task", "1",
                   HVDTRAIN_MODULE="tests/scripts/exit_status.py", HVDTRAIN_MAX_REQUEUES="1")
    finished = Job(f"{array.id}_0", tmp_path / "slurm-0-0.out")
    stopped = Job(f"{array.id}_1", tmp_path / "slurm-0-1.out")
    stopped.wait(until="FAILED", restarts=1, timeout=300)
    finished.wait(timeout=120)
    assert stopped.field("JobId") == array.id  # the task the array's id names
    runs = [line for line in record.read_text().splitlines() if " rank=0 " in line]
    assert sorted(runs) == ["task=0 run=0 rank=0 status=0", "task=1 run=0 rank=0 status=75",
                            "task=1 run=1 rank=0 status=75"], record.read_text()
    assert finished.field("Restarts") == "0" and stopped.field("Restarts") == "1"
    assert stopped.field("ExitCode") == "75:0"
    log = stopped.text()
    assert log.count("requeueing job") == 1, log[-3000:]
    assert f"requeueing job {array.id}_1;" in log
    assert log.count("not requeueing it") == 1, log[-3000:]
    assert "was requeued 1 time(s) already (HVDTRAIN_MAX_REQUEUES=1)" in log


def test_a_plain_horovod_keras_script_runs_unchanged_from_the_cpu_template(submit, tmp_path):
    # Submitted from an empty directory, as a user would from their project: the job runs there.
    project = tmp_path / "project"
    project.mkdir()
    job = submit("--ntasks-per-node=2", str(REPO / "slurm" / "cpu.sh"), cwd=project,
                 HVDTRAIN_MODULE=str(REPO / "examples" / "plain_horovod.py"),
                 HVDTRAIN_PYTHON=str(VENV_BIN / "python"))
    job.wait()
    log = job.text()
    assert "-np 2 -H" in log, log[-3000:]  # from the allocation
    accuracy = dict(re.findall(r"rank (\d) of 2: test accuracy ([\d.]+)", log))
    assert sorted(accuracy) == ["0", "1"], log[-3000:]
    assert accuracy["0"] == accuracy["1"] and float(accuracy["0"]) >= 0.9
    assert sorted(p.name for p in project.iterdir()) == [f"checkpoint-{e}.h5" for e in range(1, 7)]

