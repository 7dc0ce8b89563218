"""Never train on the CPU where GPUs were given (hvdtrain.gpus).

This machine has no GPU and the CPU TensorFlow wheel: exactly what a GPU node looks like after a
CPU install. The integration tests give real ranks and the real launcher the environment a Slurm
GPU allocation sets (CUDA_VISIBLE_DEVICES, SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS) and check that
they stop in one line before anything is written, and that the opt-out trains anyway.
"""
from __future__ import annotations

import pytest

from conftest import VENV_BIN, clean_env, integration, mpirun_job, one_error, run_job
from hvdtrain.gpus import ALLOW_CPU, given_gpus, gpu_of_its_own, not_seen, visible_devices
from hvdtrain.launch.options import LaunchOptions
from hvdtrain.launch.preflight import Build, count_gpus_without_tensorflow, preflight

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
