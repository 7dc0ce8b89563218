"""Never train on the CPU where GPUs were given (hvdtrain.gpus).

This machine has no GPU and the CPU TensorFlow wheel: exactly what a GPU node looks like after a
CPU install. The integration tests give real ranks and the real launcher the environment a Slurm
GPU allocation sets (CUDA_VISIBLE_DEVICES, SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS) and check that
they stop in one line before anything is written, and that the opt-out trains anyway.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import REPO, VENV_BIN, clean_env, integration, mpirun_job, one_error, run_job
from hvdtrain import gpucheck
from hvdtrain.gpus import (ALLOW_CPU, GPU_BUILD_RECORD, given_gpus, gpu_build_problems,
                           gpu_of_its_own, not_seen, runs_on, visible_devices)
from hvdtrain.launch import probe as probe_module
from hvdtrain.launch.options import LaunchOptions
from hvdtrain.launch.preflight import Build, count_gpus_without_tensorflow, preflight

SCRIPTS = REPO / "tests" / "scripts"

#: What `sbatch --gres=gpu:4` puts in a task's environment on a 4-GPU node.
GPU_ALLOCATION = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4",
                  "SLURM_JOB_GPUS": "0,1,2,3"}


@pytest.mark.parametrize("env, given", [
    (GPU_ALLOCATION, "CUDA_VISIBLE_DEVICES=0,1,2,3"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5a1c"}, "CUDA_VISIBLE_DEVICES=GPU-5a1c"),
    ({"SLURM_GPUS_ON_NODE": "2"}, "SLURM_GPUS_ON_NODE=2"),
    ({"SLURM_JOB_GPUS": "1"}, "SLURM_JOB_GPUS=1"),
    # An index list: "0" is GPU 0, not a count of none.
    ({"SLURM_JOB_GPUS": "0"}, "SLURM_JOB_GPUS=0"),
    ({"SLURM_STEP_GPUS": "0,1"}, "SLURM_STEP_GPUS=0,1"),
    ({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, "CUDA_VISIBLE_DEVICES=0,-1,1"),
    ({"SLURM_GPUS_PER_NODE": "a100:4"}, "SLURM_GPUS_PER_NODE=a100:4"),
    # Hidden on purpose, or none granted: no GPU was given.
    ({"CUDA_VISIBLE_DEVICES": ""}, None),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
    # Hidden inside a GPU allocation: the explicit hiding wins (a user's choice, or Slurm's
    # NoDevFiles on a step without GPUs, while the job's SLURM_JOB_GPUS is inherited).
    ({**GPU_ALLOCATION, "CUDA_VISIBLE_DEVICES": ""}, None),
    ({**GPU_ALLOCATION, "CUDA_VISIBLE_DEVICES": "-1"}, None),
    ({"SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
    ({"SLURM_GPUS_ON_NODE": "0"}, None),
    ({"SLURM_GPUS_PER_NODE": "a100:0"}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_TASKS_PER_NODE": "4"}, None),
])
def test_which_environments_gave_gpus(env, given):
    assert given_gpus(env) == given


def test_cuda_visible_devices_is_read_as_cuda_reads_it(monkeypatch):
    assert visible_devices("0,1,2,3") == ["0", "1", "2", "3"]
    assert visible_devices("GPU-5a1c, 2") == ["GPU-5a1c", "2"]
    assert visible_devices("1,-1,2") == ["1"]  # CUDA stops at the first entry that is no device
    assert visible_devices("") == visible_devices("-1") == visible_devices("NoDevFiles") == []
    assert gpu_of_its_own("3") and not gpu_of_its_own("0,1") and not gpu_of_its_own(None)
    assert not gpu_of_its_own("NoDevFiles")
    # --skip-preflight counts GPUs without TensorFlow: NoDevFiles is none.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")
    assert count_gpus_without_tensorflow() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert count_gpus_without_tensorflow() == 2


def test_the_line_names_the_cause_and_the_fix():
    cpu_wheel = not_seen("SLURM_GPUS_ON_NODE=4", "2.21.0", built_with_cuda=False)
    assert "CPU-only build" in cpu_wheel and "tensorflow[and-cuda]==2.21.0" in cpu_wheel
    no_driver = not_seen("SLURM_GPUS_ON_NODE=4", "2.21.0", built_with_cuda=True)
    assert "libcuda.so.1" in no_driver and "nvidia-smi" in no_driver
    for line in (cpu_wheel, no_driver):
        assert "\n" not in line and f"{ALLOW_CPU}=1" in line and "SLURM_GPUS_ON_NODE=4" in line


def test_preflight_asks_tensorflow_not_slurm():
    options = LaunchOptions(program="hvdtrain.cnn")
    cpu_build = Build(tensorflow=True, mpi=True, gloo=True, gpus=0, tensorflow_version="2.21.0")
    [problem] = preflight(cpu_build, None, 2, options, running_as_root=False, env=GPU_ALLOCATION)
    assert problem.startswith("GPUs were given (CUDA_VISIBLE_DEVICES=0,1,2,3)"), problem
    assert preflight(cpu_build, None, 2, options, running_as_root=False,
                     env={**GPU_ALLOCATION, ALLOW_CPU: "1"}) == []
    gpu_build = Build(tensorflow=True, mpi=True, gloo=True, nccl=True, gpus=4, cuda=True)
    assert preflight(gpu_build, None, 4, options, running_as_root=False,
                     env=GPU_ALLOCATION) == []
    # GPUs hidden on purpose inside a GPU allocation: CPU ranks, as asked.
    for hidden in ("", "-1", "NoDevFiles"):
        assert preflight(cpu_build, None, 2, options, running_as_root=False,
                         env={**GPU_ALLOCATION, "CUDA_VISIBLE_DEVICES": hidden}) == []


@integration
@pytest.mark.timeout(300)
def test_ranks_given_gpus_on_cpu_tensorflow_stop_in_one_line_and_the_opt_out_trains(tmp_path):
    run_dir = tmp_path / "run"
    refused = mpirun_job(2, "hvdtrain.cnn", "--preset", "tiny", "--run-dir", str(run_dir),
                         check=False, env=clean_env(**GPU_ALLOCATION))
    line = one_error(refused)
    assert "GPUs were given (CUDA_VISIBLE_DEVICES=0,1,2,3)" in line and "CPU-only" in line, line
    assert not run_dir.exists()
    # The launcher refuses before it starts a rank: its probe asks the ranks' TensorFlow. (As
    # the `hvdtrain` command, with horovodrun's spelling of --np.)
    launcher = run_job([str(VENV_BIN / "hvdtrain"), "launch", "-np", "2", "hvdtrain.cnn",
                        "--preset", "tiny", "--run-dir", str(run_dir)], timeout=120, check=False,
                       env=clean_env(**GPU_ALLOCATION))
    assert "CPU-only" in one_error(launcher, "hvdtrain.launch") and not run_dir.exists()
    # One process, one short epoch: the opt-out trains where Slurm said GPUs.
    allowed = run_job([str(VENV_BIN / "hvdtrain"), "train", "--preset", "tiny", "--epochs", "1",
                       "--no-tensorboard", "--run-dir", str(run_dir)], timeout=180,
                      env=clean_env(**GPU_ALLOCATION, **{ALLOW_CPU: "1"}))
    assert "CPU, " in allowed.stdout and (run_dir / "metrics.json").exists(), allowed.stdout[-2000:]


#: What the from-wheels GPU build records (scripts/gpu_toolchain.py: CUDA 13's nvcc, 7.5/8.0/9.0).
WHEEL_BUILD = {"cuda": "13.0", "architectures": [75, 80, 90]}


@pytest.mark.parametrize("capability, runs", [
    ("7.0", False), ("6.0", False),  # V100, P100: older than any code in the build
    ("7.5", True), ("8.0", True), ("8.6", True), ("8.9", True), ("9.0", True),
    ("10.0", True), ("12.0", True),  # Blackwell: 9.0's PTX, compiled by the driver
])
def test_which_gpus_the_build_has_code_for(capability, runs):
    assert runs_on(WHEEL_BUILD["architectures"], capability) is runs


def test_a_driver_or_gpu_the_build_cannot_run_on_is_one_line_each():
    # nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader, as on nodes
    # with an R580 driver and A100s, an R550 driver, and V100s.
    a100s = ["NVIDIA A100-SXM4-80GB, 580.65.06, 8.0"] * 4
    assert gpu_build_problems(WHEEL_BUILD, a100s) == []
    [old] = gpu_build_problems(WHEEL_BUILD, ["NVIDIA H100 80GB HBM3, 550.54.15, 9.0"] * 8)
    assert old.startswith("the NVIDIA driver 550.54.15 is older than horovod's GPU build needs "
                          "(CUDA 13.0: driver 580 or newer)"), old
    [v100] = gpu_build_problems(WHEEL_BUILD, ["Tesla V100-SXM2-32GB, 580.65.06, 7.0"] * 4)
    assert v100.startswith("Tesla V100-SXM2-32GB (compute capability 7.0) has no code in "
                           "horovod's GPU build (built for 7.5, 8.0, 9.0)"), v100
    assert len(gpu_build_problems(WHEEL_BUILD, ["Tesla V100, 550.1, 7.0"])) == 2
    # A build on the node's own toolkit with nvcc's default architectures: the driver alone.
    assert gpu_build_problems({"cuda": "12.4", "architectures": None},
                              ["Tesla V100, 535.1, 7.0"]) == []
    assert gpu_build_problems(WHEEL_BUILD, ["garbled"]) == []


def test_preflight_refuses_a_gpu_build_the_node_cannot_run():
    options = LaunchOptions(program="hvdtrain.cnn")
    build = Build(tensorflow=True, mpi=True, gloo=True, nccl=True, gpus=4, cuda=True,
                  gpu_build=WHEEL_BUILD,
                  nvidia_gpus=("Tesla V100-SXM2-32GB, 535.104.05, 7.0",) * 4)
    problems = preflight(build, None, 4, options, running_as_root=False, env=GPU_ALLOCATION)
    assert len(problems) == 2 and "driver 535.104.05 is older" in problems[0], problems
    fine = Build(tensorflow=True, mpi=True, gloo=True, nccl=True, gpus=4, cuda=True,
                 gpu_build=WHEEL_BUILD, nvidia_gpus=("NVIDIA A100, 580.65.06, 8.0",) * 4)
    assert preflight(fine, None, 4, options, running_as_root=False, env=GPU_ALLOCATION) == []


def test_the_probe_reads_the_builds_record_and_asks_nvidia_smi(tmp_path, monkeypatch):
    """The launcher's probe, in the ranks' interpreter: horovod's GPU record beside its
    TensorFlow extension, and nvidia-smi's answer (a stand-in answering as a node with two A100s
    does: this machine has none)."""
    package = tmp_path / "site" / "horovod"
    (package / "tensorflow").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        "#!/bin/sh\n[ \"$*\" = '--query-gpu=name,driver_version,compute_cap "
        "--format=csv,noheader' ] || exit 6\n"
        "printf 'NVIDIA A100-SXM4-80GB, 580.65.06, 8.0\\nNVIDIA A100-SXM4-80GB, 580.65.06, 8.0\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for name in [name for name in sys.modules if name == "horovod" or name.startswith("horovod.")]:
        monkeypatch.delitem(sys.modules, name)
    assert probe_module.gpu_build() == {}  # a CPU build: no record
    (package / "tensorflow" / GPU_BUILD_RECORD).write_text(json.dumps(WHEEL_BUILD))
    assert probe_module.gpu_build() == {
        "gpu_build": WHEEL_BUILD,
        "nvidia_gpus": ["NVIDIA A100-SXM4-80GB, 580.65.06, 8.0"] * 2}


def test_the_gpu_checks_rows_name_what_failed():
    results = {"3": {"Keras 3, XLA off": {"exit": 0, "ranks_identical": True, "loss": 1.9,
                                          "samples_per_sec": 812.4, "xla": True},
                     "Keras 3, mixed_float16 + fp16 allreduce + accumulation": {
                         "exit": 0, "ranks_identical": False, "loss": 2.0,
                         "samples_per_sec": 1.0, "xla": False},
                     "Keras 3, steps_per_execution 4": {"error": "OpError: boom"},
                     "Keras 3, XLA on": {"exit": 0, "ranks_identical": True,
                                         "loss": float("nan"), "samples_per_sec": 1.0,
                                         "xla": True}},
               "2-error": "exit 1: hvdtrain.launch: job exited 1: rank 1 failed"}
    rows = {row.check: (row.result, row.detail) for row in gpucheck.job_rows(results)}
    assert rows["job: Keras 3, XLA off"] == ("pass", "812 samples/s, loss 1.900, ranks "
                                                     "identical, step compiled with XLA")
    assert rows["job: Keras 3, mixed_float16 + fp16 allreduce + accumulation"] == (
        "FAIL", "the ranks hold different weights")
    assert rows["job: Keras 3, steps_per_execution 4"] == ("FAIL", "OpError: boom")
    assert rows["job: Keras 3, XLA on"] == ("FAIL", "loss nan")
    assert {row.detail for row in gpucheck.job_rows({})} == {"the job wrote no result"}
    assert rows["job: Keras 2"] == ("FAIL", results["2-error"])
    assert gpucheck.checked_build(
        "Available Controllers:\n    [X] MPI\n    [ ] Gloo\n\nAvailable Tensor Operations:\n"
        "    [X] NCCL\n    [X] MPI\n") == "controllers MPI; tensor operations NCCL, MPI"


@integration
@pytest.mark.timeout(900)
def test_gpu_check_runs_here_given_a_gpu_nodes_answer_and_says_what_it_could_not_check(
        tmp_path):
    """The acceptance run on this machine (no GPU: CPU ranks), with every interpreter it starts
    given TensorFlow's GPU-node answer to Keras (tests/scripts/gpu_node_answer.py, through
    --python). So Keras 3 compiles the step with XLA as on a GPU node, where the whole step
    compiled failed at its first step ("No registered 'HorovodAllreduce' OpKernel for
    XLA_CPU_JIT"; XLA_GPU_JIT on a GPU): 2 real ranks train with horovod's average between the
    compiled parts under mixed_float16, fp16 allreduce, accumulation and steps_per_execution,
    and tf_keras, which compiles no step, as before. Every row passes or says it could not be
    checked, and the table is printed and saved."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nif [ "$1" = "-m" ]; then exec {sys.executable} '
                      f'{SCRIPTS / "gpu_node_answer.py"} "$@"; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (bin_dir / "horovodrun").symlink_to(VENV_BIN / "horovodrun")
    out = tmp_path / "check"
    result = run_job([str(python), "-m", "hvdtrain.gpucheck", "--python", str(python),
                      "--out", str(out)], timeout=800, check=False, env=clean_env())
    assert result.returncode == 0, result.stdout[-4000:]
    saved = json.loads((out / "gpu-check.json").read_text())
    rows = {row["check"]: row for row in saved["rows"]}
    assert [check for check in rows if check.startswith("job: ")] == [
        f"job: {name}" for name, _, _ in gpucheck.VARIANTS]
    assert {row["result"] for name, row in rows.items() if name != "driver and GPUs"
            and not name.startswith("GPU kernels")} == {"pass"}, saved
    assert rows["driver and GPUs"]["result"] == "not checked"
    assert rows["GPU kernels, NCCL, XLA on a GPU"]["result"] == "not checked"
    compiled = {name for name, row in rows.items() if "step compiled with XLA" in row["detail"]}
    assert compiled == {f"job: {name}" for name, keras, flags in gpucheck.VARIANTS
                        if keras == "3" and "off" not in flags}, compiled
    assert "2 CPU rank(s): no GPU here" in saved["header"]
    assert "allreduce 16 MiB" in rows[
        "health: devices, numbers, allreduce values, fused group"]["detail"]
    # The same table on the screen and in the markdown file.
    for row in saved["rows"]:
        assert row["detail"] in result.stdout and row["detail"] in (
            out / "gpu-check.md").read_text()
    # A second run never mixes into the first one's directory.
    again = run_job([str(VENV_BIN / "hvdtrain"), "gpu-check", "--out", str(out)], timeout=60,
                    check=False, env=clean_env())
    assert again.returncode == 2 and "is not empty" in again.stdout, again.stdout
