"""Where a job runs: the world's facts and the backend that owns them.

Training code sees one object, a ``Runtime``: its ``world`` (rank, size, ...) and a handful of
methods (wrap the optimizer, broadcast, agree). Which backend stands behind it is decided once, by
``select_backend``; the backends are

* ``single``   one process, one device (this class itself);
* ``horovod``  one process per device, MPI/Gloo collectives (``hvdtrain.horovod_runtime``, the only
               module that imports horovod, imported only when chosen: TPU VMs usually lack it);
* ``mirrored`` ``tf.distribute.MirroredStrategy`` over this host's GPUs, no MPI;
* ``tpu``      ``tf.distribute.TPUStrategy`` through a TPU cluster resolver.
"""
from __future__ import annotations

import contextlib
import glob
import importlib.util
import os
from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Mapping, Sequence

from hvdtrain.errors import RankError, UserError, first_line, launched_as

# What a TPU looks like from the host: a named TPU (Cloud TPU node / TPU VM), a Colab TPU, or the
# local device files of a TPU VM (/dev/accel* on v2-v4, /dev/vfio/* on v5e and later; VFIO is also
# used for other passthrough devices, so it only counts where libtpu is installed).
_TPU_VARIABLES = ("TPU_NAME", "COLAB_TPU_ADDR")


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


def select_backend(requested: str, env: Mapping[str, str] | None = None,
                   tpu_devices: Callable[[], list[str]] | None = None, *,
                   needs_horovod: bool = False) -> str:
    """Resolve ``--backend auto``: horovod when launched as several ranks, else a TPU if one is
    visible, else one process. A launcher that started a single rank gets ``single``, unless the
    job needs a horovod feature (gradient accumulation): horovod would only add its background
    thread (about 3% of the step time, docs/benchmarks.md)."""
    if requested != "auto":
        return requested
    env = os.environ if env is None else env
    launched = launched_as(env)
    if launched and (launched[1] != 1 or needs_horovod):
        return "horovod"
    find_tpu_devices = tpu_devices or local_tpu_devices
    if any(env.get(name) for name in _TPU_VARIABLES) or find_tpu_devices():
        return "tpu"
    return "single"


def local_tpu_devices() -> list[str]:
    devices = glob.glob("/dev/accel*")
    if importlib.util.find_spec("libtpu") is not None:
        devices += glob.glob("/dev/vfio/[0-9]*")
    return sorted(devices)


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
    isolated = cuda_visible_devices is not None and len(cuda_visible_devices.split(",")) == 1
    if num_visible_gpus == 1 and isolated:
        return 0
    raise RankError(
        f"local rank {local_rank} has no GPU: this node shows {num_visible_gpus} GPU(s) to "
        f"{local_size} local ranks; launch at most {num_visible_gpus} ranks per node")


def placement(host_of_rank: list[str]) -> str:
    """'node1[0-3] node2[4-7]': which ranks run where (ranks listed in rank order)."""
    groups: dict[str, list[int]] = {}
    for rank, host in enumerate(host_of_rank):
        groups.setdefault(host, []).append(rank)
    return " ".join(f"{host}[{_ranges(ranks)}]" for host, ranks in groups.items())


def _ranges(numbers: list[int]) -> str:
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
    index = choose_gpu(len(gpus), world.local_rank, world.local_size,
                       os.environ.get("CUDA_VISIBLE_DEVICES"))
    try:
        if index is not None:
            # One GPU per rank; memory growth so a rank never grabs memory it doesn't use.
            tf.config.experimental.set_memory_growth(gpus[index], True)
            tf.config.set_visible_devices(gpus[index], "GPU")
            return Devices("gpu", f"GPU {index} of {len(gpus)}")
        threads = threads_per_worker or cpu_threads_per_local_rank(
            local_cpu_sets or [os.sched_getaffinity(0)])[world.local_rank]
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        # Ops mostly run one after another in a small model; more inter-op threads than cores
        # only adds contention between ranks sharing the node.
        tf.config.threading.set_inter_op_parallelism_threads(threads)
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

    def broadcast_variables(self, variables: list) -> None:
        """Make every rank hold rank 0's values."""

    def sync_callbacks(self) -> list:
        """Keras callbacks that must come first in the list (metric averaging)."""
        return []

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def allgather_object(self, obj: Any) -> list:
        return [obj]

    def barrier(self) -> None:
        """Return on every rank only once all ranks got here."""

    def max_over_ranks(self, value: int) -> int:
        """The largest ``value`` any rank passed, on every rank. A collective: all ranks call it."""
        return value

    def default_steps_per_execution(self) -> int:
        return 1

    def default_precision(self) -> str:
        return "fp32"

    def print0(self, *args: Any) -> None:
        """Print from the chief only, flushed (ranks' stdout is interleaved by the launcher)."""
        if self.world.is_chief:
            print(*args, flush=True)


class StrategyRuntime(Runtime):
    """One process driving several replicas through a tf.distribute strategy (mirrored, TPU)."""

    def __init__(self, strategy, backend: str, devices: Devices):
        self.strategy = strategy
        world = World(replicas_per_process=strategy.num_replicas_in_sync, backend=backend)
        super().__init__(world, devices)

    def scope(self):
        # Variables created in the scope are mirrored on every replica; Keras fit then splits
        # each global batch between the replicas and all-reduces the gradients itself.
        return self.strategy.scope()

    def default_steps_per_execution(self) -> int:
        # Each host -> TPU round trip costs milliseconds; run many steps per call on TPU.
        return 32 if self.world.backend == "tpu" else 1

    def default_precision(self) -> str:
        # TPUs compute in bfloat16 natively and need no loss scaling for it.
        return "mixed_bfloat16" if self.world.backend == "tpu" else "fp32"


def make_runtime(backend: str, *, threads_per_worker: int | None = None,
                 needs_horovod: bool = False) -> Runtime:
    """Start the runtime for ``--backend`` (after ``auto`` is resolved)."""
    chosen = select_backend(backend, needs_horovod=needs_horovod)
    launched = launched_as()
    if chosen != "horovod" and launched and launched[1] != 1:
        # Every process would think it is the only one (and rank 0), train alone, and write
        # into the same run directory as the others.
        ranks = launched[1] or "several"
        raise UserError(f"started as {ranks} ranks by a launcher, but --backend {backend} runs "
                        "one process; use --backend horovod (or auto), or start one process")
    if chosen == "horovod":
        try:
            from hvdtrain.horovod_runtime import HorovodRuntime
        except ImportError as error:
            raise UserError(f"the horovod backend needs horovod ({error}); run `make install`, "
                            "or use --backend single") from None
        return HorovodRuntime(threads_per_worker=threads_per_worker)
    if chosen == "tpu":
        return _tpu_runtime()
    if chosen == "mirrored":
        return _mirrored_runtime(threads_per_worker)
    if chosen == "single":
        world = World()
        return Runtime(world, configure_devices(world, threads_per_worker))
    raise UserError(f"unknown backend {chosen!r}")


def _mirrored_runtime(threads_per_worker: int | None) -> StrategyRuntime:
    import tensorflow as tf

    world = World(backend="mirrored")
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        devices = None  # all of this host's GPUs
        described = Devices("gpu", f"{len(gpus)} GPU(s)")
    else:
        # Without GPUs, HVDTRAIN_CPU_REPLICAS splits the CPU into that many logical devices: it
        # is how the mirrored path is exercised for real on a laptop or CI.
        replicas = int(os.environ.get("HVDTRAIN_CPU_REPLICAS", "1"))
        cpu = tf.config.list_physical_devices("CPU")[0]
        try:
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
        except RuntimeError:
            pass  # already initialised in this process; use the devices it has
        configure_devices(world, threads_per_worker)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")][:replicas]
        described = Devices("cpu", f"{len(devices)} logical CPU device(s)")
    strategy = tf.distribute.MirroredStrategy(devices=devices)
    return StrategyRuntime(strategy, "mirrored", described)


def tpu_address(env: Mapping[str, str], tpu_devices: list[str]) -> str | None:
    """What to hand TPUClusterResolver, or None when no TPU is in sight."""
    if env.get("TPU_NAME"):
        return env["TPU_NAME"]
    if env.get("COLAB_TPU_ADDR"):
        return "grpc://" + env["COLAB_TPU_ADDR"]
    if tpu_devices:
        return "local"  # a TPU VM: the TPU is attached to this host
    return None


def _tpu_runtime() -> StrategyRuntime:
    address = tpu_address(os.environ, local_tpu_devices())
    if address is None:
        raise UserError("--backend tpu: no TPU found (looked for $TPU_NAME, $COLAB_TPU_ADDR and "
                        "TPU device files /dev/accel*, /dev/vfio/*)")
    import tensorflow as tf

    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
        tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise UserError(f"--backend tpu: could not connect to TPU '{address}': "
                        f"{first_line(error)}") from None
    strategy = tf.distribute.TPUStrategy(resolver)
    cores = strategy.num_replicas_in_sync
    return StrategyRuntime(strategy, "tpu", Devices("tpu", f"TPU '{address}', {cores} cores"))

