"""The runtime every backend refines: the world's facts, device placement, and ``Runtime``.

``Runtime`` is one process on one device with no collectives (the ``single`` backend); the
horovod backend (``runtime/horovod.py``) and the tf.distribute strategies (``runtime/strategy.py``)
override its methods. Nothing here imports horovod, and nothing here chooses a backend (the
factory in ``runtime/__init__.py`` does).
"""
from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Sequence, TypeVar

from hvdtrain.errors import RankError, UserError
from hvdtrain.gpus import cpu_allowed, given_gpus, gpu_of_its_own, not_seen

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    """The facts about this process that every other module asks for, and nothing more."""

    rank: int = 0
    """Index of this process among the processes feeding data (0 = chief)."""
    local_rank: int = 0
    """Index of this process among those on this node (picks the GPU)."""
    size: int = 1
    """Number of processes feeding data."""
    local_size: int = 1
    """Number of those processes on this node."""
    replicas_per_process: int = 1
    """Model replicas each process drives (devices of a tf.distribute strategy; 1 for horovod)."""
    backend: str = "single"

    @property
    def num_replicas(self) -> int:
        """Data-parallel width: the ``workers`` of the batch and learning-rate arithmetic."""
        return self.size * self.replicas_per_process

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


def cpu_threads_per_local_rank(cpu_sets: Sequence[AbstractSet[int]]) -> list[int]:
    """Intra-op threads for each of a node's ranks on CPU, from the cores each may run on.

    ``cpu_sets`` holds every local rank's CPU affinity (``os.sched_getaffinity``), in local-rank
    order. Ranks whose sets overlap, directly or through another rank, compete for the same
    cores, so they split the union of their sets evenly: 4 ranks sharing a Slurm job's 8-core
    cpuset get 2 each, whatever the node's size. A rank whose cores no other rank shares (the
    launcher bound it: mpirun --bind-to core, srun --cpu-bind) keeps them all. A rank never gets
    more threads than its own cores, nor fewer than one.
    """
    groups: list[tuple[set[int], list[int]]] = []  # (cores, local ranks): pairwise disjoint
    for local_rank, cores in enumerate(cpu_sets):
        union, members = set(cores), [local_rank]
        for group in [group for group in groups if not group[0].isdisjoint(union)]:
            groups.remove(group)
            union |= group[0]
            members += group[1]
        groups.append((union, members))
    threads = [1] * len(cpu_sets)
    for union, members in groups:
        for local_rank in members:
            threads[local_rank] = max(1, min(len(cpu_sets[local_rank]),
                                             len(union) // len(members)))
    return threads


def choose_gpu(num_visible_gpus: int, local_rank: int, local_size: int,
               cuda_visible_devices: str | None) -> int | None:
    """Which of the visible GPUs this rank uses; ``None`` on a machine without GPUs.

    One GPU per local rank. When the scheduler already isolated one GPU per task (srun
    --gpus-per-task / --gpu-bind, so CUDA_VISIBLE_DEVICES names a single device), that GPU is
    this rank's.
    """
    if num_visible_gpus == 0:
        return None
    if local_rank < num_visible_gpus:
        return local_rank
    if num_visible_gpus == 1 and gpu_of_its_own(cuda_visible_devices):
        return 0
    raise RankError(
        f"local rank {local_rank} has no GPU: this node shows {num_visible_gpus} GPU(s) to "
        f"{local_size} local ranks; launch at most {num_visible_gpus} ranks per node")


def placement(host_of_rank: list[str]) -> str:
    """'node1[0-3] node2[4-7]': which ranks run where (ranks listed in rank order)."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(host_of_rank):
        groups.setdefault(host, []).append(rank)
    return " ".join(f"{host}[{rank_ranges(ranks)}]" for host, ranks in groups.items())


def host_of_each_rank(placement_text: str) -> dict[int, str]:
    """``placement``'s text read back ({0: 'node1', ...}): the launcher reads it in the banner."""
    return {rank: host for host, ranges in re.findall(r"(\S+?)\[([\d,-]+)\]", placement_text)
            for rank in ranks_in(ranges)}


def ranks_in(ranges: str) -> list[int]:
    """[0, 1, 2, 3, 6] for '0-3,6' (``rank_ranges`` read back)."""
    ranks = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        ranks.extend(range(int(first), int(last or first) + 1))
    return ranks


def rank_ranges(numbers: list[int]) -> str:
    """'0-3,6' for [0, 1, 2, 3, 6] (sorted numbers)."""
    parts, start = [], numbers[0]
    for previous, current in zip(numbers, numbers[1:] + [None]):
        if current != previous + 1:
            parts.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(parts)


@dataclass(frozen=True)
class Devices:
    """What this process computes on."""

    kind: str
    """'cpu', 'gpu' or 'tpu' (names output files such as the autoencoder's cpu.png)."""
    description: str
    """One line for the start-up banner."""
    threads: int | None = None
    """This process's share of CPU threads (sizes the input pipeline too); None: TF's default."""
    prefetch_to: str | None = None
    """The device the input pipeline leaves each batch on (a GPU rank's own GPU, so the copy
    overlaps the step before it); None: host memory."""


def configure_devices(world: World, threads_per_worker: int | None,
                      local_cpu_sets: Sequence[AbstractSet[int]] | None = None) -> Devices:
    """Pin this rank to its GPU, or size its CPU thread pools.

    ``local_cpu_sets`` are the cores each rank on this node may run on, in local-rank order, as
    the ranks exchanged them before TensorFlow started; ``None`` when this process is alone on
    its node. Must run before TensorFlow creates its runtime. A process that already did (a test
    that trains twice) keeps its first configuration.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    given = given_gpus(os.environ)
    if not gpus and given and not cpu_allowed(os.environ):
        # The same on every rank of this node: its local rank 0 says it, the others exit too.
        error = RankError if world.local_rank == 0 else UserError
        raise error(not_seen(given, tf.__version__, tf.test.is_built_with_cuda()))
    index = choose_gpu(len(gpus), world.local_rank, world.local_size,
                       os.environ.get("CUDA_VISIBLE_DEVICES"))
    cores = os.cpu_count() or 1
    if threads_per_worker is not None and threads_per_worker > cores:
        # More threads than cores only contend (100,000 once made 30k threads and 15 GB
        # before a step). This node's own count: nodes differ, so this rank's line.
        raise RankError(f"--threads-per-worker {threads_per_worker} is more than this "
                        f"node's {cores} core(s)")
    # This rank's share of the node's cores, GPU or not: on a GPU rank TensorFlow would size
    # its pools (and the input pipeline's) to every core of the node, 4 ranks to 4x the cores.
    threads = threads_per_worker or cpu_threads_per_local_rank(
        local_cpu_sets or [os.sched_getaffinity(0)])[world.local_rank]
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # Ops mostly run one after another in a small model; more inter-op threads than cores
        # only adds contention between ranks sharing the node.
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        if index is not None:
            # One GPU per rank; memory growth so a rank never grabs memory it doesn't use.
            tf.config.experimental.set_memory_growth(gpus[index], True)
            tf.config.set_visible_devices(gpus[index], "GPU")
            # The only GPU this process now sees is /gpu:0: batches are prefetched there, so
            # each one's copy from host memory overlaps the step before it.
            return Devices("gpu", f"GPU {index} of {len(gpus)}, {threads} CPU thread(s)",
                           threads, prefetch_to="/gpu:0")
        return Devices("cpu", f"CPU, {threads} thread(s)", threads)
    except RuntimeError:  # TensorFlow already initialised in this process: keep its settings
        kind = "gpu" if tf.config.get_visible_devices("GPU") else "cpu"
        return Devices(kind, f"{kind.upper()} as configured earlier in this process")


class Runtime:
    """One process, one device: no collectives. Every other backend refines this."""

    def __init__(self, world: World, devices: Devices):
        self.world = world
        self.devices = devices

    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which models and optimizers are built (a strategy's scope)."""
        return contextlib.nullcontext()

    def distribute_optimizer(self, optimizer, *, fp16_allreduce: bool, grad_accum_steps: int):
        """The optimizer that keeps the replicas in step (as given: nothing to keep in step).

        ``fp16_allreduce`` is moot without an allreduce of our own (a strategy reduces in its own
        precision); gradient accumulation is horovod's.
        """
        if grad_accum_steps > 1:
            raise UserError(f"--grad-accum-steps needs the horovod backend; this run uses "
                            f"'{self.world.backend}' (pass --backend horovod)")
        return optimizer

    def keep_collectives_out_of_xla(self, model) -> bool:
        """After ``compile``: a step Keras compiles with XLA must hold none of this runtime's
        collectives; whether its step was split around them (nothing to split without any)."""
        return False

    def broadcast_variables(self, variables: list) -> None:
        """Make every rank hold rank 0's values."""

    def sync_callbacks(self) -> list:
        """Keras callbacks that must come first in the list (metric averaging)."""
        return []

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def from_chief(self, compute: Callable[[], T]) -> T:
        """Rank 0 runs ``compute``; every rank returns its result or raises its ``UserError``.

        For work one rank should do for all (list the data, check the run directory, read the
        checkpoint): the other ranks wait in the broadcast, and a refusal reaches every rank, so
        they all exit together instead of waiting in a later collective. Other exceptions are
        bugs and end rank 0 (the launcher then stops the rest).
        """
        outcome: tuple[T | None, UserError | None] = (None, None)
        if self.world.is_chief:
            try:
                outcome = (compute(), None)
            except UserError as error:
                outcome = (None, error)
        result, error = self.broadcast_object(outcome)
        if error is not None:
            raise error
        return result

    def allgather_object(self, obj: Any) -> list:
        return [obj]

    def barrier(self) -> None:
        """Return on every rank only once all ranks got here."""

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` any rank passed, on every rank. A collective: all ranks call it."""
        return value

    def stall_limit_seconds(self) -> float | None:
        """After how long without a step a rank gives up on its peers (None: never)."""
        return None

    def default_steps_per_execution(self) -> int:
        return 1

    def steps_per_call(self, steps_per_execution: int | None) -> int:
        """The steps one call of the compiled training function runs: ``--steps-per-execution``,
        else this backend's default."""
        return steps_per_execution or self.default_steps_per_execution()

    def default_precision(self) -> str:
        return "fp32"

    def print0(self, *args: Any) -> None:
        """Print from the chief only, flushed (ranks' stdout is interleaved by the launcher)."""
        if self.world.is_chief:
            print(*args, flush=True)
