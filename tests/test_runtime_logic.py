"""Backend selection, GPU choice and CPU thread shares: decided without touching hardware."""
import pytest

from hvdtrain.errors import RankError, UserError, first_line
from hvdtrain.runtime import (choose_gpu, cpu_threads_per_worker, make_runtime, placement,
                              select_backend, tpu_address)

NO_TPU = lambda: []  # noqa: E731
A_TPU_VM = lambda: ["/dev/accel0"]  # noqa: E731


@pytest.mark.parametrize("env, devices, expected", [
    ({}, NO_TPU, "single"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, NO_TPU, "horovod"),  # horovodrun --gloo
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"}, NO_TPU, "horovod"),  # mpirun
    ({"PMIX_RANK": "0", "SLURM_PROCID": "0"}, NO_TPU, "horovod"),  # srun --mpi=pmix: no size
    ({"PMI_SIZE": "2", "PMI_RANK": "1"}, NO_TPU, "horovod"),  # srun --mpi=pmi2
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}, NO_TPU, "single"),  # batch script, no step
    ({"TPU_NAME": "my-tpu"}, NO_TPU, "tpu"),
    ({"COLAB_TPU_ADDR": "10.0.0.2:8470"}, NO_TPU, "tpu"),
    ({}, A_TPU_VM, "tpu"),
    ({"TPU_NAME": "t", "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, A_TPU_VM,
     "horovod"),  # started as ranks: the user asked for horovod
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}, NO_TPU, "single"),  # -np 1
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "1"}, NO_TPU, "single"),
])
def test_auto_backend(env, devices, expected):
    assert select_backend("auto", env, devices) == expected


def test_one_rank_keeps_horovod_when_the_job_needs_it():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert select_backend("auto", env, NO_TPU, needs_horovod=True) == "horovod"


def test_a_one_process_backend_under_a_multi_rank_launcher_is_refused(monkeypatch):
    not_launched(monkeypatch)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    for backend in ("single", "mirrored", "tpu"):
        with pytest.raises(UserError, match=f"started as 4 ranks .* --backend {backend} runs one"):
            make_runtime(backend)


@pytest.mark.parametrize("requested", ["horovod", "tpu", "mirrored", "single"])
def test_explicit_backend_is_kept(requested):
    assert select_backend(requested, {"TPU_NAME": "x", "HOROVOD_RANK": "0"}, A_TPU_VM) == requested


def test_tpu_address():
    assert tpu_address({"TPU_NAME": "pod"}, []) == "pod"
    assert tpu_address({"COLAB_TPU_ADDR": "1.2.3.4:8470"}, []) == "grpc://1.2.3.4:8470"
    assert tpu_address({}, ["/dev/accel0"]) == "local"
    assert tpu_address({}, []) is None


def not_launched(monkeypatch):
    """This process as if started by hand (the tests also run as ranks under mpirun)."""
    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMI_RANK", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_tpu_backend_without_a_tpu_says_what_it_looked_for(monkeypatch):
    not_launched(monkeypatch)
    for name in ("TPU_NAME", "COLAB_TPU_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UserError) as error:
        make_runtime("tpu")
    assert "no TPU found" in str(error.value) and "TPU_NAME" in str(error.value)
    assert "/dev/accel" in str(error.value)


@pytest.mark.parametrize("gpus, local_rank, local_size, visible, expected", [
    (0, 0, 4, None, None),
    (4, 0, 4, None, 0),
    (4, 3, 4, None, 3),
    (8, 2, 4, None, 2),
    (1, 3, 4, "3", 0),  # srun --gpus-per-task: each task sees only its own GPU
])
def test_one_gpu_per_local_rank(gpus, local_rank, local_size, visible, expected):
    assert choose_gpu(gpus, local_rank, local_size, visible) == expected


def test_more_local_ranks_than_gpus_names_the_rank():
    with pytest.raises(RankError, match="local rank 2 has no GPU.*2 GPU"):
        choose_gpu(2, 2, 4, None)


@pytest.mark.parametrize("available, machine, local_size, expected", [
    (2, 2, 1, 2),
    (2, 2, 2, 1),
    (2, 2, 4, 1),  # never 0
    (64, 64, 4, 16),
    (4, 64, 4, 4),  # the launcher bound this rank to 4 cores: they are its share
    (32, 64, 4, 8),  # a Slurm job's cpuset of 32 cores shared by its 4 ranks
])
def test_cpu_threads_never_oversubscribe(available, machine, local_size, expected):
    assert cpu_threads_per_worker(available, machine, local_size) == expected


def test_placement_groups_ranks_by_host():
    assert placement(["vm"]) == "vm[0]"
    assert placement(["a", "a", "b", "b"]) == "a[0-1] b[2-3]"
    assert placement(["a", "b", "a", "b", "a"]) == "a[0,2,4] b[1,3]"


@pytest.mark.parametrize("error, expected", [
    (ValueError("bad shape\n  at layer 3\n  ..."), "bad shape"),
    (RuntimeError("\n\n  undefined symbol: _ZN10tf\nmore"), "undefined symbol: _ZN10tf"),
    (AssertionError(), "AssertionError"),  # no message: an error line still says something
    (OSError("   "), "OSError"),
])
def test_first_line_of_an_error(error, expected):
    assert first_line(error) == expected
