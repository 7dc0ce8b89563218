"""Launcher and Slurm renderer: allocation -> command, preflight, quoting, golden templates,
which exits restart; and (integration tier) a plain horovod script run through the launcher."""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, clean_env, integration, run_job
from hostlists import BAD_HOSTLISTS, HOSTLISTS
from hvdtrain.errors import UserError
from hvdtrain.launch.options import (VIAS, LaunchOptions, check_options, is_script_path,
                                     parse_options)
from hvdtrain.launch.paths import LAUNCH_PATHS, build_launch, describe, horovod_tuning_env
from hvdtrain.launch.preflight import Build, preflight
from hvdtrain.launch.sbatch import batch_options
from hvdtrain.launch.supervise import (ATTEMPT_VARIABLE, StartupDeadline, judge_exit,
                                       rank_zero_host, wait_for_job)
from hvdtrain.launcher_env import child_env, marked
from hvdtrain.launch.slurm import (TEMPLATES, Allocation, Requeue, SbatchJob, expand_hostlist,
                                   expand_tasks_per_node, render, requeue_decision)
from processes import process_group
from slurm_templates import COMMAND as WRITE_TEMPLATES

GOOD_BUILD = Build(tensorflow=True, mpi=True, gloo=True)
PY = "/venv/bin/python"


def allocation(**env):
    return Allocation.from_env({"SLURM_JOB_ID": "42", **env})


def options(**changes) -> LaunchOptions:
    return LaunchOptions(**{"program": "hvdtrain.cnn", "python": PY, **changes})


@pytest.mark.parametrize("nodelist, hosts", HOSTLISTS.items())
def test_slurm_node_lists_expand_in_python(nodelist, hosts):
    # As Slurm 22.05's `scontrol show hostnames` prints them (compared with it in test_slurm.py).
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", BAD_HOSTLISTS)
def test_a_node_list_slurm_would_not_write_is_one_clear_error(nodelist):
    with pytest.raises(UserError, match=r"cannot read Slurm's node list"):
        expand_hostlist(nodelist)


@pytest.mark.parametrize("value, expected", [
    ("4", [4]), ("4(x2)", [4, 4]), ("4(x2),2", [4, 4, 2]), ("1,2,3", [1, 2, 3])])
def test_tasks_per_node(value, expected):
    assert expand_tasks_per_node(value) == expected


def test_outside_slurm_is_horovodrun_on_localhost():
    launch = build_launch(options(np=3), None, gpus=0)
    assert launch.argv[1:5] == ("-np", "3", "-H", "localhost:3")
    assert launch.argv[-3:] == (PY, "-m", "hvdtrain.cnn")


def test_outside_slurm_defaults_to_one_rank_per_gpu_or_one_on_cpu():
    assert build_launch(options(), None, gpus=4).argv[1:5] == ("-np", "4", "-H", "localhost:4")
    assert build_launch(options(), None, gpus=0).argv[1:3] == ("-np", "1")


def test_single_node_allocation():
    alloc = allocation(SLURM_JOB_NODELIST="gpu01", SLURM_TASKS_PER_NODE="4",
                       SLURM_GPUS_ON_NODE="4")
    launch = build_launch(options(), alloc, gpus=4)
    assert launch.argv[1:5] == ("-np", "4", "-H", "gpu01:4")


def test_two_node_allocation_gives_np_and_hosts():
    alloc = allocation(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_TASKS_PER_NODE="4(x2)",
                       SLURM_GPUS_PER_NODE="a100:4")
    assert alloc.gpus_per_host == 4
    horovodrun = build_launch(options(), alloc, gpus=4).argv
    assert horovodrun[1:5] == ("-np", "8", "-H", "gpu01:4,gpu02:4")
    mpirun = build_launch(options(via="mpirun"), alloc, gpus=4).argv
    assert mpirun[:3] == ("mpirun", "-np", "8") and "-H" not in mpirun  # OpenMPI reads Slurm
    srun = build_launch(options(via="srun"), alloc, gpus=4).argv
    assert srun[:4] == ("srun", "--mpi=pmix", "--ntasks=8", "--kill-on-bad-exit=1")
    # The cores per task the job asked for, restated on the srun line: srun 22.05-23.02 does
    # not take them from SLURM_CPUS_PER_TASK and would bind each rank to one core.
    with_cpus = allocation(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_TASKS_PER_NODE="4(x2)",
                           SLURM_GPUS_PER_NODE="a100:4", SLURM_CPUS_PER_TASK="12")
    srun = build_launch(options(via="srun"), with_cpus, gpus=4).argv
    assert srun[:5] == ("srun", "--mpi=pmix", "--ntasks=8", "--cpus-per-task=12",
                        "--kill-on-bad-exit=1")
    bound = build_launch(options(via="srun", binding_args="--cpus-per-task=6"), with_cpus,
                         gpus=4).argv
    assert [arg for arg in bound if arg.startswith("--cpus-per-task")] == ["--cpus-per-task=6"]


def test_cpu_allocation_with_uneven_tasks():
    alloc = allocation(SLURM_JOB_NODELIST="cpu[1-3]", SLURM_TASKS_PER_NODE="2(x2),1")
    assert alloc.gpus_per_host is None
    assert build_launch(options(), alloc, gpus=0).argv[1:5] == ("-np", "5", "-H",
                                                                "cpu1:2,cpu2:2,cpu3:1")


def test_tuning_reaches_every_rank_as_horovod_variables():
    env = horovod_tuning_env(options(fusion_threshold_mb=32, cycle_time_ms=0.5, autotune=True,
                                     timeline_filename="/tmp/t.json", stall_check=False,
                                     stall_check_shutdown_seconds=90,
                                     hierarchical_allreduce=True))
    assert env == {"HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "0.5",
                   "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                   "HOROVOD_AUTOTUNE": "1", "HOROVOD_TIMELINE": "/tmp/t.json",
                   "HOROVOD_STALL_CHECK_DISABLE": "1",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "90"}
    mpirun = build_launch(options(via="mpirun", fusion_threshold_mb=32), None, gpus=0).argv
    assert ("-x", "HOROVOD_FUSION_THRESHOLD") == mpirun[mpirun.index("-x"):][:2]


def test_every_flag_reaches_the_launch_options():
    parsed = parse_options([
        "--np", "3", "--via", "mpirun", "--controller", "mpi", "--python", PY, "--dry-run",
        "--skip-preflight", "--timeline-filename", "t.json", "--autotune",
        "--autotune-log-file", "a.csv", "--fusion-threshold-mb", "32", "--cycle-time-ms", "0.5",
        "--hierarchical-allreduce", "--stall-check-warning-seconds", "30",
        "--stall-check-shutdown-seconds", "90",
        "--no-stall-check", "--binding-args", "--bind-to core", "--allow-run-as-root",
        "--max-restarts", "2", "--min-nodes", "1", "-H", "node1:2", "--network-interface", "eth0",
        "--keras", "3",
        "hvdtrain.cnn", "--preset", "tiny", "--epochs", "2"], "doc")
    assert parsed == LaunchOptions(
        program="hvdtrain.cnn", program_args=("--preset", "tiny", "--epochs", "2"), np=3,
        via="mpirun", controller="mpi", python=PY, max_restarts=2, min_nodes=1,
        timeline_filename="t.json",
        autotune=True,
        autotune_log_file="a.csv", fusion_threshold_mb=32.0, cycle_time_ms=0.5,
        hierarchical_allreduce=True, stall_check_warning_seconds=30,
        stall_check_shutdown_seconds=90, stall_check=False,
        binding_args="--bind-to core", allow_run_as_root=True, dry_run=True,
        skip_preflight=True, hosts="node1:2", network_interface="eth0", keras="3")
    defaults = parse_options(["hvdtrain.cnn"], "doc")
    assert defaults == LaunchOptions(program="hvdtrain.cnn") and not defaults.dry_run
    # Every field is a flag, every flag a field: the help is generated from the fields.
    help_text = subprocess.run([sys.executable, "-m", "hvdtrain.launch", "--help"],
                               capture_output=True, text=True, check=True).stdout
    for field in dataclasses.fields(LaunchOptions):
        if field.name not in ("program", "program_args"):
            assert "--" + field.name.replace("_", "-") in help_text, field.name


def test_every_launch_path_has_its_command():
    assert tuple(LAUNCH_PATHS) == VIAS


def test_hostile_values_are_quoted_never_interpreted():
    hostile = "x; rm -rf / #"
    launch = build_launch(options(program_args=("--run-dir", hostile, "$(reboot)")), None,
                          gpus=0)
    assert launch.argv[-3:] == ("--run-dir", hostile, "$(reboot)")  # one argv entry each
    printed = describe(launch).splitlines()[-1]
    assert shlex.split(printed)[-3:] == ["--run-dir", hostile, "$(reboot)"]
    script = render(SbatchJob(name="job", args=("--run-dir", hostile, "`reboot`")))
    assert "'x; rm -rf / #'" in script and "'`reboot`'" in script
    for field, value in (("module", 'x}"; reboot; #'), ("partition", "gpu\n#SBATCH --x"),
                         ("account", "a b"), ("name", "a;b")):
        with pytest.raises(ValueError, match=field if field != "name" else "job name"):
            SbatchJob(**{"name": "job", field: value})


@pytest.mark.parametrize("build, alloc_env, np, via, message", [
    (Build(tensorflow=False, mpi=False, gloo=False, error="ImportError: no module"), None, None,
     "horovodrun", "horovod cannot run TensorFlow jobs"),
    (Build(tensorflow=False, mpi=False, gloo=False,
           error="NotFoundError: mpi_lib.so: undefined symbol: _ZN10tensorflow8OpKernel"),
     None, None, "horovodrun", "compiled against a different TensorFlow"),
    (Build(tensorflow=True, mpi=False, gloo=False), None, None, "horovodrun",
     "built without a controller"),
    (Build(tensorflow=True, mpi=False, gloo=True), None, None, "mpirun", "needs horovod built with MPI"),
    (GOOD_BUILD, dict(SLURM_JOB_NODELIST="gpu01", SLURM_TASKS_PER_NODE="4"), 8, "horovodrun",
     "--np 8 but the Slurm allocation has 4 task(s)"),
    (GOOD_BUILD, dict(SLURM_JOB_NODELIST="gpu01", SLURM_TASKS_PER_NODE="4",
                      SLURM_GPUS_ON_NODE="2"), None, "horovodrun",
     "4 ranks per node but only 2 GPU(s) per node"),
    (Build(tensorflow=True, mpi=True, gloo=True, gpus=2), None, 4, "horovodrun",
     "this machine has 2 GPU(s)"),
])
def test_preflight_problems_are_one_line_each(build, alloc_env, np, via, message):
    alloc = allocation(**alloc_env) if alloc_env else None
    problems = preflight(build, alloc, np, options(via=via), running_as_root=False, env={})
    assert len(problems) == 1 and message in problems[0], problems
    assert "\n" not in problems[0]


def test_preflight_accepts_a_good_setup():
    alloc = allocation(SLURM_JOB_NODELIST="gpu01", SLURM_TASKS_PER_NODE="4",
                       SLURM_GPUS_ON_NODE="4")
    assert preflight(GOOD_BUILD, alloc, None, options(), running_as_root=False, env={}) == []


def test_mpirun_as_root_needs_the_openmpi_variables_or_the_flag():
    problems = preflight(GOOD_BUILD, None, 2, options(via="mpirun"), running_as_root=True, env={})
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in problems[0]
    root_env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    assert preflight(GOOD_BUILD, None, 2, options(via="mpirun"), running_as_root=True,
                     env=root_env) == []
    flagged = options(via="mpirun", allow_run_as_root=True)
    assert preflight(GOOD_BUILD, None, 2, flagged, running_as_root=True, env={}) == []
    assert "--allow-run-as-root" in build_launch(flagged, None, 0, running_as_root=True).argv
    # horovodrun adds the flag itself.
    assert preflight(GOOD_BUILD, None, 2, options(), running_as_root=True, env={}) == []


def test_srun_outside_slurm_and_gloo_with_mpirun_are_refused():
    with pytest.raises(UserError, match="needs a Slurm allocation"):
        check_options(options(via="srun"), None)
    with pytest.raises(UserError, match="--controller gloo needs --via horovodrun"):
        check_options(options(via="mpirun", controller="gloo"), None)


@pytest.mark.parametrize("file_name", sorted(TEMPLATES))
def test_shipped_templates_are_what_the_renderer_writes(file_name):
    shipped = (REPO / "slurm" / file_name).read_text()
    assert shipped == render(TEMPLATES[file_name]), (
        f"slurm/{file_name} is out of date: run `{WRITE_TEMPLATES}`")


@pytest.mark.parametrize("file_name", sorted(TEMPLATES))
def test_templates_are_valid_bash_with_requeue_and_signal(file_name):
    path = REPO / "slurm" / file_name
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    text = path.read_text()
    for directive in ("--signal=B:USR1@", "--requeue", "--open-mode=append"):
        assert f"#SBATCH {directive}" in text
    assert text.count("-m hvdtrain.launch") == 1
    assert "-np" not in text  # the launcher derives it from the allocation


def test_4gpu_template_matches_the_promise():
    text = (REPO / "slurm" / "4gpu.sh").read_text()
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --ntasks-per-node=4\n" in text
    assert "#SBATCH --gres=gpu:4\n" in text


def test_render_cli_writes_a_custom_script():
    result = subprocess.run(
        [sys.executable, "-m", "hvdtrain.slurm", "render", "--name", "big", "--nodes", "8",
         "--gpus-per-node", "8", "--time", "1-00:00:00", "--partition", "a100",
         "--", "--epochs", "90"], capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=8" in result.stdout and "#SBATCH --gres=gpu:8" in result.stdout
    assert "#SBATCH --partition=a100" in result.stdout
    assert '-- hvdtrain.cnn --epochs 90 "$@"' in result.stdout
    # Across nodes inside Slurm, a path that needs no ssh between nodes; on one, horovodrun's.
    assert "--via mpirun " in result.stdout
    assert "--via horovodrun " in render(SbatchJob(name="one", gpus_per_node=8))
    assert "--via srun " in render(SbatchJob(name="told", nodes=8, via="srun"))
    bad = subprocess.run([sys.executable, "-m", "hvdtrain.slurm", "render", "--name", "a b"],
                         capture_output=True, text=True, timeout=60, env=clean_env())
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "job name" in bad.stderr


@pytest.mark.parametrize("time", ["120", "30:00", "02:00:00", "1-12", "1-12:30", "1-00:00:00",
                                  "UNLIMITED"])
def test_a_rendered_time_limit_takes_every_form_sbatch_takes(time):
    assert f"#SBATCH --time={time}\n" in render(SbatchJob(name="x", time=time))


@pytest.mark.parametrize("changes, message", [
    ({"time": "12:3"}, "time '12:3': use minutes"), ({"time": "1-"}, "time '1-'"),
    ({"signal_seconds": -5}, "signal_seconds must be >= 1, got -5")])
def test_a_bad_rendered_job_is_refused(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SbatchJob(name="x", **changes)



# --- what runs on every rank: a module or a script --------------------------------------------
def test_a_script_path_runs_as_python_script_under_every_launcher(tmp_path):
    script = tmp_path / "my jobs" / "train.py"
    script.parent.mkdir()
    script.write_text("import tf_keras\n")  # written for Keras 2
    alloc = allocation(SLURM_JOB_NODELIST="gpu01", SLURM_TASKS_PER_NODE="2")
    for via in ("horovodrun", "mpirun", "srun"):
        argv = build_launch(options(program=str(script), program_args=("--lr", "0.1"), via=via),
                            alloc, gpus=0, environment={}).argv
        # Through hvdtrain.script, which selects Keras 2 for a script written for it first.
        assert argv[-6:] == (PY, "-m", "hvdtrain.script", str(script), "--lr", "0.1"), (via, argv)
        keras_3 = build_launch(options(program=str(script), via=via, keras="3"), alloc,
                               gpus=0, environment={}).argv
        assert keras_3[-2:] == (PY, str(script)) and "-m" not in keras_3, (via, keras_3)
    module = build_launch(options(program_args=("--lr", "0.1")), None, gpus=0).argv
    assert module[-5:] == (PY, "-m", "hvdtrain.cnn", "--lr", "0.1")


def test_what_counts_as_a_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train").write_text("")  # an existing file without .py is run as a script
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "run.py").write_text("import tf_keras\n")  # Keras 2: hvdtrain.script
    for program, expected in (("train", [PY, "train"]),
                              ("sub/run.py", [PY, "-m", "hvdtrain.script", "sub/run.py"]),
                              ("mypackage.train", [PY, "-m", "mypackage.train"])):
        assert list(build_launch(options(program=program), None, gpus=0,
                                 environment={}).argv[-len(expected):]) == expected
    for program, message in (("missing.py", "no such script: missing.py"),
                             ("sub/missing", "no such script: sub/missing"),
                             ("not a-module", "neither a module name")):
        with pytest.raises(UserError, match=message):
            check_options(options(program=program), None)


def launcher_cli(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    """The launcher's command line, for what it prints before starting anything."""
    return subprocess.run([sys.executable, "-m", "hvdtrain.launch", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60, env=clean_env())


def test_dry_run_shows_a_script_path_as_python_script():
    result = launcher_cli("--dry-run", "--skip-preflight", "--np", "2", "--",
                          "tests/scripts/hello_horovod.py", "--greeting", "hi there")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.splitlines()[-1])
    assert command[1:5] == ["-np", "2", "-H", "localhost:2"]
    # Keras 3 (the default): hello_horovod.py imports neither horovod's Keras API nor tf_keras.
    assert command[-4:] == [sys.executable, "tests/scripts/hello_horovod.py", "--greeting",
                            "hi there"]


def test_a_missing_script_is_one_line_and_exit_2():
    result = launcher_cli("--np", "2", "--", "tests/scripts/no_such_script.py")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "hvdtrain.launch: error: no such script: tests/scripts/no_such_script.py (a script path "
        "runs as `python PATH`, a module name like hvdtrain.cnn as `python -m MODULE`)"]


def test_options_are_checked_before_any_step_even_a_dry_run():
    # The health check's rule was once checked only when the check ran: --dry-run passed it.
    result = launcher_cli("--dry-run", "--skip-preflight", "--controller", "gloo",
                          "--health-check", "hvdtrain.cnn")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [
        "hvdtrain.launch: error: --health-check talks MPI between the ranks: use --controller mpi"]


@pytest.mark.parametrize("module", ["hvdtrain.cnnn", "hvdtrin.cnn"])
def test_a_missing_module_is_one_line_and_no_attempt_even_with_restarts(module):
    started = time.monotonic()
    result = launcher_cli("--np", "2", "--max-restarts", "3", "--", module, "--epochs", "1")
    seconds = time.monotonic() - started
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"hvdtrain.launch: error: no module named {module!r} in the ranks' Python "
        f"({sys.executable}): check the name, or pass a script path"]
    assert result.stdout == ""  # no "job exited ...; restart 1 of 3" line: nothing started
    # Refused before the horovod probe, let alone a launch and 3 restarts 3 s apart.
    assert seconds < 30, seconds


def test_the_module_check_asks_the_ranks_python_in_the_launchers_directory(tmp_path):
    (tmp_path / "in_the_directory.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "only_for_the_ranks.py").write_text("")
    ranks_python = tmp_path / "ranks-python"
    ranks_python.write_text(f"#!/bin/sh\nPYTHONPATH={elsewhere} exec {sys.executable} \"$@\"\n")
    ranks_python.chmod(0o755)
    dry_run = ("--dry-run", "--skip-preflight", "--np", "1")
    # `python -m` finds modules in the working directory, which the ranks start in.
    assert launcher_cli(*dry_run, "--", "in_the_directory", cwd=tmp_path).returncode == 0
    mine = launcher_cli(*dry_run, "--", "only_for_the_ranks", cwd=tmp_path)
    assert mine.returncode == 2 and "no module named 'only_for_the_ranks'" in mine.stderr
    theirs = launcher_cli(*dry_run, "--python", str(ranks_python), "--", "only_for_the_ranks",
                          cwd=tmp_path)
    assert theirs.returncode == 0, theirs.stderr
    assert shlex.split(theirs.stdout.splitlines()[-1])[-3:] == [
        str(ranks_python), "-m", "only_for_the_ranks"]


def test_a_template_gives_run_dir_to_a_module_only_by_the_launchers_rule(tmp_path, monkeypatch):
    """--sbatch decides with is_script_path, the rule that decides how the program runs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train").write_text("")
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "hvdtrain-cpu"}
    for program in ("hvdtrain.cnn", "pkg.mod", "train.py", "dir/train", "./train", "train"):
        batch, run_dir = batch_options(options(sbatch=True, program_args=("--epochs", "2")),
                                       {**job, "HVDTRAIN_MODULE": program})
        assert run_dir == "runs/hvdtrain-cpu-7" and batch.program == program
        expected = ("--epochs", "2") if is_script_path(program) else (
            "--run-dir", "runs/hvdtrain-cpu-7", "--epochs", "2")
        assert batch.program_args == expected, program


def test_a_templates_variables_override_its_flags():
    env = {"SLURM_JOB_ID": "7", "HVDTRAIN_VIA": "srun", "HVDTRAIN_RUN_DIR": "/scratch/r",
           "HVDTRAIN_ARGS": "--epochs 5 --run-name 'a b'", "HVDTRAIN_MAX_RESTARTS": "2",
           "HVDTRAIN_MAX_REQUEUES": "9", "HVDTRAIN_NETWORK_INTERFACE": "ib0",
           "HVDTRAIN_MIN_NODES": "2", "HVDTRAIN_HEALTH_CHECK": "1"}
    batch, run_dir = batch_options(options(sbatch=True, via="mpirun", max_requeues=3,
                                           program_args=("--epochs", "6")), env)
    assert (batch.via, run_dir, batch.max_restarts, batch.max_requeues, batch.network_interface,
            batch.min_nodes, batch.health_check) == ("srun", "/scratch/r", 2, 9, "ib0", 2, True)
    # The flags after the script come last, so they win over HVDTRAIN_ARGS.
    assert batch.program_args == ("--run-dir", "/scratch/r", "--epochs", "5", "--run-name",
                                  "a b", "--epochs", "6")
    unset = batch_options(options(sbatch=True, via="mpirun", max_requeues=3),
                          {"SLURM_JOB_ID": "7", "HVDTRAIN_VIA": ""})[0]
    assert (unset.via, unset.max_requeues, unset.max_restarts) == ("mpirun", 3, 0)
    for name, value, message in (("HVDTRAIN_MAX_REQUEUES", "three", "must be a whole number"),
                                 ("HVDTRAIN_MAX_RESTARTS", "-1", "must be a whole number"),
                                 ("HVDTRAIN_VIA", "ssh", "HVDTRAIN_VIA must be one of"),
                                 ("HVDTRAIN_HEALTH_CHECK", "yes", "must be 0 or 1"),
                                 ("HVDTRAIN_ARGS", "'unclosed", "HVDTRAIN_ARGS")):
        with pytest.raises(UserError, match=message):
            batch_options(options(sbatch=True), {"SLURM_JOB_ID": "7", name: value})
    with pytest.raises(UserError, match="SLURM_JOB_ID is not set"):
        batch_options(options(sbatch=True), {})


def test_a_templates_container_runs_through_srun_unless_told_otherwise():
    job = {"SLURM_JOB_ID": "7", "HVDTRAIN_CONTAINER": "/work/img.sqfs"}
    batch = batch_options(options(sbatch=True, via="mpirun"), job)[0]
    assert (batch.container, batch.via) == ("/work/img.sqfs", "srun")
    told = batch_options(options(sbatch=True, via="mpirun"), {**job, "HVDTRAIN_VIA": "mpirun"})[0]
    assert told.via == "mpirun"  # and container.prepare refuses it in one line
    assert batch_options(options(sbatch=True, via="mpirun"), {"SLURM_JOB_ID": "7"})[0] \
        .container is None


# --- restarts ----------------------------------------------------------------------------------
@pytest.mark.parametrize("status, stop_signal, restart, reason", [
    (137, None, True, "a rank ended on SIGKILL"),  # kill -9, the OOM killer
    (134, None, True, "a rank ended on SIGABRT"),
    (1, None, True, "a rank failed"),  # an exception, a lost peer, an NCCL error
    (0, None, False, "finished"),
    (2, None, False, "a user error"),  # bad flags or data: it would fail the same way
    (75, None, False, "stopped for preemption"),  # the sbatch script requeues it
    (143, None, False, "stopped on SIGTERM"),  # e.g. scancel signalling every process
    (130, None, False, "stopped on SIGINT"),
    (127, None, False, "could not be started"),
    (137, signal.SIGTERM, False, "stopped on SIGTERM"),  # forwarded by the launcher: a stop
    (1, signal.SIGUSR1, False, "stopped on SIGUSR1"),
])
def test_which_exits_restart(status, stop_signal, restart, reason):
    verdict = judge_exit(status, stop_signal)
    assert verdict.restart == restart and reason in verdict.reason, verdict


def test_max_restarts_is_refused_where_exit_statuses_are_lost():
    with pytest.raises(UserError, match="horovodrun --gloo reports as 1"):
        check_options(options(controller="gloo", max_restarts=1), None)
    with pytest.raises(UserError, match="--max-restarts must be 0 or more"):
        check_options(options(max_restarts=-1), None)
    launch = build_launch(options(max_restarts=2), None, gpus=0)
    assert "# up to 2 restart(s) after a failure" in describe(launch)
    with pytest.raises(UserError, match=r"--startup-timeout must be 0 \(none\) or more, got -5"):
        check_options(options(startup_timeout=-5), None)


# --- requeues after Slurm's time-limit warning ---------------------------------------------------
def test_the_requeue_rule_caps_requeues_and_requeues_only_its_own_array_task():
    job = {"SLURM_JOB_ID": "12"}
    assert requeue_decision(job, 3, "runs/r") == Requeue(
        "12", "requeueing job 12; the next run resumes from runs/r")
    assert requeue_decision({**job, "SLURM_RESTART_COUNT": "2"}, 3, "runs/r").job == "12"
    capped = requeue_decision({**job, "SLURM_RESTART_COUNT": "3"}, 3, "runs/r")
    assert capped.job is None and capped.message == (
        "job 12 was requeued 3 time(s) already (HVDTRAIN_MAX_REQUEUES=3); not requeueing it. "
        "To resume, submit again with HVDTRAIN_RUN_DIR=runs/r")
    assert requeue_decision(job, 0, "runs/r").job is None  # 0: never requeue
    # An array task's own id can be the array's id, which would requeue every task.
    task = {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "0"}
    assert requeue_decision(task, 3, "runs/r").job == "12_0"


@pytest.mark.parametrize("file_name", sorted(TEMPLATES))
def test_templates_exec_the_launcher_with_their_defaults_as_flags(file_name):
    text = (REPO / "slurm" / file_name).read_text()
    job = TEMPLATES[file_name]
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert body == ['exec "${HVDTRAIN_PYTHON:-.venv/bin/python}" -m hvdtrain.launch --sbatch \\',
                    f'    --via {job.via} --max-requeues {job.max_requeues} -- {job.module} "$@"']
    custom = render(SbatchJob(name="long", max_requeues=20))
    assert "--max-requeues 20 --" in custom and "(default 20;" in custom


@pytest.mark.parametrize("name, value, remedy", [
    ("HVDTRAIN_MAX_REQUEUES", "three", "give it in digits 0-9 (e.g. HVDTRAIN_MAX_REQUEUES=2), "
                                       "or unset it"),
    # str.isdigit takes '²', which int() refuses: it was a traceback
    ("HVDTRAIN_MAX_RESTARTS", "\u00b2", "give it in digits 0-9 (e.g. HVDTRAIN_MAX_RESTARTS=2), "
                                       "or unset it"),
    # read at the end of a preempted job to cap its requeues: a traceback there, after training
    ("SLURM_RESTART_COUNT", "x", "Slurm sets it to the job's requeue count; unset it")])
def test_a_bad_job_variable_stops_the_template_with_one_line(tmp_path, name, value, remedy):
    """The template execs the launcher, which refuses the variable before anything starts."""
    script = tmp_path / "job.sh"
    script.write_text(render(TEMPLATES["cpu.sh"]))
    env = clean_env(HVDTRAIN_RUN_DIR=str(tmp_path / "run"), HVDTRAIN_PYTHON=sys.executable,
                    SLURM_JOB_ID="7", **{name: value})
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                            env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"hvdtrain.launch: error: {name} must be a whole "
                                          f"number, got {value!r}: {remedy}"]
    assert not (tmp_path / "run").exists()


# --- a user's own horovod script through the launcher (integration tier) ------------------------
@integration
@pytest.mark.timeout(150)
def test_a_plain_horovod_script_runs_on_two_ranks_through_the_launcher():
    result = run_job([sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--",
                      "tests/scripts/hello_horovod.py", "--greeting", "hi there"], timeout=140)
    lines = re.findall(r"rank (\d) of (\d): sum (\d+) args (.*?\])", result.stdout)
    assert sorted(lines) == [("0", "2", "1", "['--greeting', 'hi there']"),
                             ("1", "2", "1", "['--greeting', 'hi there']")], result.stdout[-3000:]


@integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize("full", [("stdout",), ("stdout", "stderr")])
def test_a_full_disk_under_the_launchers_output_neither_hangs_nor_fails_the_job(tmp_path, full):
    """stdout (and stderr: slurm-*.out holds both) on /dev/full, which fails every write with
    ENOSPC: the relay must keep draining the job's pipes (1 MB per rank and stream, well past
    a pipe's 64 KB) and the launcher exit 0 with the job, saying once what it could not show."""
    job = tmp_path / "chatty.py"
    job.write_text("import sys\nfor stream in (sys.stdout, sys.stderr):\n"
                   "    stream.write(('x' * 1023 + '\\n') * 1024)\n")
    streams = {name: open("/dev/full", "w") if name in full else subprocess.PIPE
               for name in ("stdout", "stderr")}
    with process_group([sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--via", "mpirun",
                        "--skip-preflight", "--", str(job)], cwd=REPO, env=clean_env(), text=True,
                       **streams) as launcher:
        _, said = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, said
    if said is not None:  # stderr works: one line about stdout, then not a line of the job's
        lost = [line for line in said.splitlines() if "cannot write" in line]
        assert lost == ["hvdtrain.launch: cannot write the job's output to stdout (No space left "
                        "on device): not showing it there any more; the job goes on"], \
            said[-2000:]
        assert "Traceback" not in said and said.count("x" * 1023) == 2 * 1024, said[-2000:]


@integration
@pytest.mark.timeout(90)
@pytest.mark.parametrize("stop, to_group", [(signal.SIGINT, True), (signal.SIGTERM, False)])
def test_a_stop_signal_during_the_preflight_probe_stops_the_launcher_in_one_line(
        stop, to_group, tmp_path):
    """Ctrl-C reaches the whole foreground group (the probe too: it used to read "cannot import
    hvdtrain/horovod: KeyboardInterrupt", exit 2); a SIGTERM reaches the launcher alone (which
    used to wait for the probe). Both: the signal's status, one line. The ranks' Python is slow
    to start here (as on a loaded node or a slow shared file system): the probe answers from
    horovod's build record in well under a second, too fast to be caught otherwise."""
    tag = f"HVDTRAIN_TEST_TAG={os.getpid()}.{stop}"  # on the launcher and all it starts
    slow_python = tmp_path / "slow-python"
    slow_python.write_text(f"#!{sys.executable}\nimport os, sys, time\ntime.sleep(60)\n"
                           f"os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n")
    slow_python.chmod(0o755)

    def probes():
        return [process for process in marked(tag) if "hvdtrain.launch.probe" in process.argv]

    with process_group([sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--python",
                        str(slow_python), "--", "hvdtrain.cnn"], cwd=REPO, text=True,
                       env=clean_env(**dict([tag.split("=")])), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT) as launcher:
        deadline = time.monotonic() + 30
        while not any("build" in process.argv for process in probes()):
            assert launcher.poll() is None and time.monotonic() < deadline, "no probe started"
            time.sleep(0.05)
        if to_group:
            os.killpg(launcher.pid, stop)
        else:
            launcher.send_signal(stop)
        output, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + stop, output
        assert output.splitlines() == [f"hvdtrain.launch: {stop.name} before the ranks started; "
                                       "not starting them"], output
        assert not probes()


# --- several hosts: --hosts and the network interface --------------------------------------------
def test_mpirun_outside_slurm_passes_the_users_environment_on_but_not_who_it_is():
    shell = {"FOO": "1", "PATH": "/bin", "OLDPWD": "/x", "BASH_FUNC_f%%": "() { :; }",
             "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0", "SLURM_PROCID": "0",
             "HOROVOD_RANK": "0", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
             "OMPI_ALLOW_RUN_AS_ROOT": "1",
             # The user's horovod and NCCL tuning goes to every rank; which GPUs this host
             # shows (here: none, hidden on purpose) stays home, as under horovodrun.
             "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "NCCL_IB_HCA": "mlx5_0",
             "CUDA_VISIBLE_DEVICES": ""}
    argv = build_launch(options(via="mpirun", hosts="node1:2,node2:2", fusion_threshold_mb=32),
                        None, gpus=0, environment=shell).argv
    exported = [argv[i + 1] for i, arg in enumerate(argv) if arg == "-x"]
    assert exported == ["FOO", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_HIERARCHICAL_ALLREDUCE",
                        "HVDTRAIN_KERAS", "NCCL_IB_HCA", "OMPI_ALLOW_RUN_AS_ROOT", "PATH"]
    # Inside an allocation Slurm passes the environment on: only the launcher's own variables.
    inside = build_launch(options(via="mpirun", fusion_threshold_mb=32),
                          allocation(SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2(x2)"),
                          gpus=0, environment=shell).argv
    assert [inside[i + 1] for i, arg in enumerate(inside) if arg == "-x"] == [
        "HOROVOD_FUSION_THRESHOLD", "HVDTRAIN_KERAS"]


@pytest.mark.parametrize("keras", ["2", "3"])
def test_every_rank_gets_the_launchers_keras_whatever_its_environment_holds(keras):
    # A Keras 3 process exports HVDTRAIN_KERAS=3 to what it starts: a launcher it starts
    # without --keras 3 still gives its ranks Keras 2, as its help says.
    for via in ("horovodrun", "mpirun"):
        launch = build_launch(options(via=via, keras=keras), None, gpus=0,
                              environment={"HVDTRAIN_KERAS": "3" if keras == "2" else "2"})
        assert launch.env["HVDTRAIN_KERAS"] == keras


def test_the_orphan_guard_asks_rank_0s_host_only_when_it_is_another_one():
    local = {"localhost", "node1"}
    assert rank_zero_host(["node1", "node2"], local, PY, in_allocation=False) is None
    assert rank_zero_host(["localhost"], local, PY, in_allocation=False) is None
    outside = rank_zero_host(["node2", "node1"], local, PY, in_allocation=False)
    assert outside.host == "node2" and outside.command[0] == "ssh" \
        and outside.command[-1] == "node2" and "BatchMode=yes" in outside.command
    inside = rank_zero_host(["gpu07", "node1"], local, PY, in_allocation=True)
    assert inside.command[:2] == ("srun", "--overlap") and "--nodelist=gpu07" in inside.command
    assert inside.command[-2:] == ("sh", "-c")  # the probe is one shell command, as for ssh


def test_another_host_is_reached_over_ssh_outside_slurm_and_an_srun_step_inside(tmp_path):
    from hvdtrain.launch.remote import on_every_node, on_host

    ssh = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert on_host("node2", ["true"], in_allocation=False) == [*ssh, "node2", "true"]
    assert on_host("gpu07", [PY, "-m", "hvdtrain.launch.probe", "ranks", "A=1 2"],
                   in_allocation=True) == [
        "srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu07", "--kill-on-bad-exit=0",
        "sh", "-c", f"{PY} -m hvdtrain.launch.probe ranks 'A=1 2'"]
    where = tmp_path / "a dir"
    where.mkdir()
    line = f"cd '{where}' && exec pwd"
    assert on_host("node2", ["pwd"], in_allocation=False, cwd=str(where)) == [*ssh, "node2", line]
    # What ssh gives the remote shell runs there as given (here, in this host's shell).
    assert subprocess.run(["sh", "-c", line], capture_output=True, text=True,
                          check=True).stdout.strip() == str(where)
    assert on_every_node(3, [PY, "-m", "hvdtrain.netcheck"]) == [
        "srun", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
        "--input=all", PY, "-m", "hvdtrain.netcheck"]


@integration
def test_a_launch_that_starts_no_rank_on_rank_0s_host_ends_at_the_startup_deadline():
    """Real processes: a command that never forks a rank (as mpirun waiting for a node's daemon)
    is ended once the deadline passes; one whose rank started is waited for to its own end."""
    def launched(marker: str, command: list[str]) -> subprocess.Popen:
        name, value = marker.split("=", 1)
        return subprocess.Popen(command, env={**child_env(), name: value}, start_new_session=True)

    marker = f"{ATTEMPT_VARIABLE}=startup-test.0"
    never = launched(marker, ["sleep", "60"])
    deadline, started = StartupDeadline(2.0), time.monotonic()
    assert wait_for_job(never, marker, startup=deadline) == 1
    took = time.monotonic() - started
    assert never.poll() is not None and 2.0 <= took < 15, took
    assert deadline.missed_by == "sleep"
    assert deadline.explained().startswith(
        "no rank started within 2 s: sleep starts the ranks only once it has reached every node")

    # The rank is a process of its own with a launcher's rank variable, like mpirun's children.
    forks_a_rank = [sys.executable, "-c", "import os, subprocess; subprocess.run(['sleep', '5'], "
                    "env={**os.environ, 'OMPI_COMM_WORLD_RANK': '0'}, check=True)"]
    marker = f"{ATTEMPT_VARIABLE}=startup-test.1"
    deadline = StartupDeadline(2.0)
    assert wait_for_job(launched(marker, forks_a_rank), marker, startup=deadline) == 0
    assert deadline.missed_by is None
    # Rank 0 on another host: this host may hold no rank at all; no deadline here.
    marker = f"{ATTEMPT_VARIABLE}=startup-test.2"
    elsewhere = rank_zero_host(["node2"], {"node1"}, PY, in_allocation=False)
    deadline = StartupDeadline(1.0)
    assert wait_for_job(launched(marker, ["sleep", "4"]), marker, elsewhere,
                        startup=deadline) == 0
    assert deadline.missed_by is None


def test_hosts_outside_slurm_give_the_rank_count_and_the_host_list():
    launch = build_launch(options(hosts="node1:2,node2:2"), None, gpus=0)
    assert launch.argv[1:5] == ("-np", "4", "-H", "node1:2,node2:2")
    mpirun = build_launch(options(hosts="node1:2,node2", via="mpirun"), None, gpus=0).argv
    assert mpirun[1:5] == ("-np", "3", "-H", "node1:2,node2:1")


@pytest.mark.parametrize("hosts", ["node1:0", "node1:00", "node1:2,node1:2", "node1:x", "a b:2",
                                   ""])
def test_bad_hosts_are_one_line_errors(hosts):
    with pytest.raises(UserError, match="--hosts"):
        check_options(options(hosts=hosts), None)


@pytest.mark.parametrize("changes, message", [
    # Checked here, not only by the preflight that --skip-preflight skips (0 planned 1 rank;
    # -2 reached horovodrun as -np -2, a traceback).
    ({"np": 0}, "--np must be at least 1, got 0"),
    ({"np": -2}, "--np must be at least 1, got -2"),
    ({"binding_args": "--bind-to 'core"}, "--binding-args \"--bind-to 'core\": No closing"),
    ({"max_requeues": -1}, "--max-requeues must be 0 or more, got -1"),
    # Horovod takes whatever its variables say.
    ({"fusion_threshold_mb": -1.0}, "--fusion-threshold-mb must be a number >= 0, got -1.0"),
    ({"cycle_time_ms": float("nan")}, "--cycle-time-ms must be a number >= 0, got nan"),
    ({"stall_check_shutdown_seconds": -1},
     "--stall-check-shutdown-seconds must be a number >= 0, got -1"),
    ({"stall_check_warning_seconds": 0},
     "--stall-check-warning-seconds must be a number >= 1, got 0"),
    ({"controller": "gloo", "health_check": True},
     "--health-check talks MPI between the ranks: use --controller mpi"),
])
def test_bad_launch_options_are_one_line_errors_without_the_preflight(changes, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check_options(options(**changes), None)


@pytest.mark.parametrize("module, argv, message", [
    ("hvdtrain.launch", ["--np", "abc", "hvdtrain.cnn"],
     "hvdtrain.launch: error: argument --np/-np: invalid int value: 'abc' (see --help)"),
    ("hvdtrain.slurm", ["render", "--name", "x", "--nodes", "two"],
     "hvdtrain.slurm: error: argument --nodes: invalid int value: 'two' (see --help)"),
    ("hvdtrain.launch", ["--n", "2", "hvdtrain.cnn"],  # no abbreviation stands for a flag
     "hvdtrain.launch: error: unrecognized arguments"),
])
def test_a_command_line_argparse_refuses_is_one_line_under_the_programs_name(module, argv,
                                                                            message):
    result = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(message), result.stderr


def test_hosts_inside_an_allocation_are_refused():
    alloc = allocation(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_TASKS_PER_NODE="4(x2)")
    with pytest.raises(UserError, match="outside Slurm"):
        check_options(options(hosts="a:1,b:1"), alloc.hosts)


def test_the_network_interface_reaches_every_transport():
    alloc = allocation(SLURM_JOB_NODELIST="gpu[01-02]", SLURM_TASKS_PER_NODE="4(x2)",
                       SLURM_GPUS_ON_NODE="4")
    horovodrun = build_launch(options(), alloc, gpus=4, interfaces=("eth0",))
    assert horovodrun.argv[horovodrun.argv.index("--network-interface") + 1] == "eth0"
    mpirun = build_launch(options(via="mpirun"), alloc, gpus=4, interfaces=("eth0", "ib0"))
    argv = " ".join(mpirun.argv)
    assert "--mca btl_tcp_if_include eth0,ib0 --mca oob_tcp_if_include eth0,ib0" in argv
    # NCCL (GPU allreduce) picks its own interface: pinned too, and passed to remote ranks.
    assert mpirun.env["NCCL_SOCKET_IFNAME"] == "eth0,ib0" and "-x NCCL_SOCKET_IFNAME" in argv
    srun = build_launch(options(via="srun"), alloc, gpus=4, interfaces=("eth0",))
    assert srun.env["OMPI_MCA_btl_tcp_if_include"] == "eth0"
    assert srun.env["OMPI_MCA_oob_tcp_if_include"] == "eth0"
    untold = build_launch(options(via="mpirun"), alloc, gpus=4)
    assert "btl_tcp_if_include" not in " ".join(untold.argv)
    assert "NCCL_SOCKET_IFNAME" not in untold.env


def test_a_short_stall_limit_shortens_horovods_inspection_interval():
    env = horovod_tuning_env(options(stall_check_shutdown_seconds=30))
    assert env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "30"
    assert env["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "30"
    told = horovod_tuning_env(options(stall_check_shutdown_seconds=30,
                                      stall_check_warning_seconds=10))
    assert told["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "10"


# --- --min-nodes: restart on the hosts left ------------------------------------------------------
TWO_NODES = Allocation(("node1", "node2"), (2, 2), job_id="7")


@pytest.mark.parametrize("flags, allocation, message", [
    ({"min_nodes": 2, "max_restarts": 1}, None, "--min-nodes needs several hosts"),
    ({"min_nodes": 2, "hosts": "a:1,b:1"}, None, "give --max-restarts too"),
    ({"min_nodes": 3, "hosts": "a:1,b:1", "max_restarts": 1}, None,
     "--min-nodes 3 is more than the 2 host(s) of --hosts a:1,b:1"),
    ({"min_nodes": 3, "max_restarts": 1}, TWO_NODES,
     "--min-nodes 3 is more than the allocation's 2 node(s)"),
])
def test_min_nodes_that_cannot_work_is_one_line(flags, allocation, message):
    with pytest.raises(UserError, match=re.escape(message)):
        check_options(options(**flags), allocation and allocation.hosts)
    check_options(options(min_nodes=2, hosts="a:1,b:1,c:1", max_restarts=1), None)
    check_options(options(min_nodes=1, max_restarts=1), TWO_NODES.hosts)


def test_the_hosts_that_stop_answering_are_dropped_until_too_few_are_left():
    from hvdtrain.launch.survivors import Survivors

    gone: set[str] = set()
    survivors = Survivors(options(min_nodes=2, hosts="node1:2,node2:2,node3:2", np=6,
                                  max_restarts=3), None,
                          rebuild=lambda opts, allocation: build_launch(opts, allocation, gpus=0),
                          ask=lambda host: "ssh: Connection refused" if host in gone else None)
    assert survivors.after_failure() is None  # every host answers: restart as before
    gone.add("node3")
    launch, words = survivors.after_failure()
    assert words == ("on the 2 host(s) left (node1:2,node2:2, 4 rank(s)) since node3 is gone "
                     "(ssh: Connection refused),")
    assert launch.argv[1:5] == ("-np", "4", "-H", "node1:2,node2:2")
    gone.add("node1")
    with pytest.raises(UserError, match=re.escape(
            "node1 is gone (ssh: Connection refused); 1 host(s) left, fewer than --min-nodes 2: "
            "not restarting")):
        survivors.after_failure()


@pytest.mark.parametrize("via, names_the_hosts", [
    ("srun", ("--nodes=2", "--nodelist=node1,node3", "--overlap")),
    ("mpirun", ("-H", "node1:1,node3:1", "--mca", "plm_slurm_args", "--overlap")),
    ("horovodrun", ("-H", "node1:1,node3:1", "--mpi-args=--mca plm_slurm_args --overlap"))])
def test_in_slurm_the_restart_names_the_nodes_left(via, names_the_hosts):
    from hvdtrain.launch.survivors import Survivors

    allocation = Allocation(("node1", "node2", "node3"), (1, 1, 1), job_id="8")
    before = build_launch(options(via=via), allocation, gpus=0).argv
    assert "--nodelist=node1,node3" not in before and "node1:1,node3:1" not in before
    survivors = Survivors(options(via=via, min_nodes=2, max_restarts=1), allocation,
                          rebuild=lambda opts, alloc: build_launch(opts, alloc, gpus=0),
                          ask=lambda host: "srun: error: Unable to contact" if host == "node2"
                          else None)
    launch, words = survivors.after_failure()
    assert survivors.allocation.dropped == ("node2",)
    start = next(i for i, arg in enumerate(launch.argv) if arg == names_the_hosts[0])
    assert launch.argv[start:start + len(names_the_hosts)] == names_the_hosts, launch.argv
    assert words.startswith("on the 2 host(s) left (node1:1,node3:1, 2 rank(s)) since node2 is")


def test_a_host_that_does_not_resolve_does_not_answer():
    from hvdtrain.launch.survivors import host_problem

    problem = host_problem("hvdtrain-no-such-host.invalid")
    assert problem and problem.startswith("ssh: ") and "hvdtrain-no-such-host.invalid" in problem


def test_a_restart_after_a_host_is_dropped_runs_the_rebuilt_launch(capsys):
    """run_attempts with real processes: the first attempt fails, the survivors' launch runs."""
    from hvdtrain.launch.paths import Launch
    from hvdtrain.launch.supervise import SignalForwarder, run_attempts

    class Dropped:
        def after_failure(self):
            return ((Launch(("sh", "-c", "echo on-the-rest"), {}), None),
                    "on the hosts left since node3 is gone (test),")

    status = run_attempts(Launch(("sh", "-c", "exit 1"), {}), 1, SignalForwarder(),
                          survivors=Dropped())
    captured = capsys.readouterr()
    assert status == 0 and "on-the-rest" in captured.out, captured
    assert ("job exited 1 (a rank failed); restart 1 of 1 on the hosts left since node3 is gone "
            "(test), in 3 s") in captured.err, captured


def test_a_stop_before_launch_kills_the_launchers_own_children_only():
    """kill_children (the launcher's last step on a stop before the ranks start): a probe whose
    start a signal interrupted is ended; a process of someone else's is not."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        script = ("import subprocess; from hvdtrain.launch.supervise import kill_children; "
                  "child = subprocess.Popen(['sleep', '30']); kill_children(); "
                  "print(child.wait(timeout=10))")
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=60, cwd=REPO)
        assert result.stdout.strip() == str(-signal.SIGKILL), result.stdout + result.stderr
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_templates_written_outside_the_checkout_run_this_python_from_any_directory(tmp_path):
    from hvdtrain.launch.slurm import write_templates

    written = write_templates(str(tmp_path / "slurm"), "/opt/site/bin/python")
    assert sorted(os.path.basename(path) for path in written) == sorted(TEMPLATES)
    for path in written:
        script = Path(path).read_text()
        assert 'exec "${HVDTRAIN_PYTHON:-/opt/site/bin/python}" -m hvdtrain.launch' in script
        assert "# Submit from any directory:" in script and os.access(path, os.X_OK)
    with pytest.raises(UserError, match=r"4gpu\.sh.* already exist\(s\); not overwriting"):
        write_templates(str(tmp_path / "slurm"), "/opt/site/bin/python")
    # The repository's own templates keep its venv, relative to the repository's root.
    assert 'exec "${HVDTRAIN_PYTHON:-.venv/bin/python}"' in render(TEMPLATES["4gpu.sh"])
