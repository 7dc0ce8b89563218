"""Backend selection, GPU choice and CPU thread shares: decided without touching hardware."""
import random

import pytest

from hvdtrain.errors import RankError, UserError, first_line
from hvdtrain.runtime import (choose_gpu, cpu_threads_per_local_rank, make_runtime, placement,
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


SLURM_CPUSET = frozenset(range(8))  # a job's 8 cores of a 64-core node, cores 0-7


@pytest.mark.parametrize("cpu_sets, expected", [
    # 4 ranks left unbound in one 8-core cpuset all run on the same 8 cores, whatever the node's
    # size (the rule this replaced gave each 8: 32 threads on 8 cores).
    ([SLURM_CPUSET] * 4, [2, 2, 2, 2]),
    ([frozenset(range(32))] * 4, [8, 8, 8, 8]),
    ([frozenset(range(64))] * 4, [16, 16, 16, 16]),
    # srun --cpu-bind / mpirun --bind-to: each rank's cores are its own
    ([frozenset({2 * i, 2 * i + 1}) for i in range(4)], [2, 2, 2, 2]),
    ([SLURM_CPUSET], [8]),  # one rank bound alone to 8 cores keeps them
    ([frozenset({0, 1})], [2]),  # a single rank on a 2-core machine
    ([frozenset({0})] * 2, [1, 1]),  # never 0: 2 ranks under taskset -c 0
    ([frozenset({0, 1})] * 3, [1, 1, 1]),
    ([SLURM_CPUSET] * 3, [2, 2, 2]),  # 8 // 3: rounded down, so never oversubscribed
    # partial overlap: ranks 0 and 1 compete for cores 2-3, so they split 0-5; rank 2 is alone
    ([frozenset({0, 1, 2, 3}), frozenset({2, 3, 4, 5}), frozenset({6, 7})], [3, 3, 2]),
    # overlap through a third rank: 0 and 2 share no core, but both compete with 1
    ([frozenset({0, 1}), frozenset({1, 2}), frozenset({2, 3})], [1, 1, 1]),
    # a later rank joins two groups found so far into one
    ([frozenset({0}), frozenset({2}), frozenset({0, 1, 2})], [1, 1, 1]),
    # mixed: two ranks share 0-7, two more are bound to 8-11 and 12-15
    ([SLURM_CPUSET, SLURM_CPUSET, frozenset(range(8, 12)), frozenset(range(12, 16))],
     [4, 4, 4, 4]),
    # never more threads than a rank's own cores: the second rank may only run on core 7
    ([SLURM_CPUSET, frozenset({7})], [4, 1]),
])
def test_ranks_sharing_cores_split_them(cpu_sets, expected):
    assert cpu_threads_per_local_rank(cpu_sets) == expected


def test_no_group_of_ranks_gets_more_threads_than_its_cores():
    generator = random.Random(0)
    for _ in range(2000):
        cpu_sets = [frozenset(generator.sample(range(16), generator.randint(1, 8)))
                    for _ in range(generator.randint(1, 8))]
        threads = cpu_threads_per_local_rank(cpu_sets)
        for local_rank, cores in enumerate(cpu_sets):
            assert 1 <= threads[local_rank] <= len(cores), (cpu_sets, threads)
            # the ranks that compete with this one (transitively) and the cores they span
            group, spanned = {local_rank}, set(cores)
            while True:
                joined = {other for other, theirs in enumerate(cpu_sets)
                          if other not in group and not spanned.isdisjoint(theirs)}
                if not joined:
                    break
                group |= joined
                spanned.update(*(cpu_sets[other] for other in joined))
            assert sum(threads[other] for other in group) <= max(len(spanned), len(group)), \
                (cpu_sets, threads)


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


def test_first_line_of_a_tensorflow_graph_error_is_the_ops_own_message():
    import tensorflow as tf

    @tf.function
    def checked(x):
        tf.debugging.assert_less(x, 1.0, message="too big")
        return x

    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        checked(tf.constant(2.0))
    assert str(caught.value).startswith("Graph execution error:")
    assert first_line(caught.value).startswith("assertion failed: [too big] [Condition x < y")


def test_more_threads_per_worker_than_the_nodes_cores_is_this_ranks_one_line():
    # Once 100,000: 30k threads and 15 GB before a step. Nodes differ: a RankError, printed by
    # the rank that sees it.
    import os

    from hvdtrain.runtime import World
    from hvdtrain.runtime.base import configure_devices

    cores = os.cpu_count()
    with pytest.raises(RankError, match=f"--threads-per-worker {cores + 1} is more than this "
                                        f"node's {cores} core"):
        configure_devices(World(), threads_per_worker=cores + 1)
