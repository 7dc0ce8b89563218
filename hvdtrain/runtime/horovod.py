"""The horovod backend: the only module in hvdtrain that imports horovod.

One process per GPU (or per CPU share), started by horovodrun, mpirun or srun. Everything
distributed that the training code needs goes through the methods below, each with the reason it
exists.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any, Mapping

import horovod.tensorflow as hvd_tf
import tensorflow as tf
from horovod.runner.http import http_client

from hvdtrain import KERAS
from hvdtrain.errors import RankError, UserError
from hvdtrain.runtime.base import Runtime, World, configure_devices

if KERAS == "2":
    # horovod's Keras API imports `keras` and needs Keras 2 (tf_keras, which hvdtrain selected);
    # for Keras 3, runtime/keras3.py does its work on horovod's TensorFlow collectives.
    import horovod.tensorflow.keras as hvd
else:
    from hvdtrain.runtime import keras3


#: Seconds a rank may wait in a collective for a peer before horovod ends the job.
STALL_SHUTDOWN_SECONDS = 300


def watchdog_seconds(environ: Mapping[str, str]) -> float | None:
    """How long a rank's stall watchdog waits for a training step (None: it does not watch).

    Horovod, which names the stalled rank, must end a stall it can see before the watchdog
    does. It inspects every HOROVOD_STALL_CHECK_TIME_SECONDS (W, 60) and first takes a waiting
    tensor out of its response cache (up to 2 W), so it acts by its limit + 3 W (measured on 2
    nodes, W=2, limit 6: after 8 s); the watchdog gives it one inspection more.
    """
    if environ.get("HOROVOD_STALL_CHECK_DISABLE") == "1":
        return None
    limit = float(environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "") or 0)
    if limit <= 0:
        return None
    return limit + 4 * float(environ.get("HOROVOD_STALL_CHECK_TIME_SECONDS", "") or 60)


def build_info() -> dict:
    """What this horovod was compiled with (importing this module proves its TF extension loads)."""
    return {"tensorflow": True, "mpi": bool(hvd_tf.mpi_built()),
            "gloo": bool(hvd_tf.gloo_built()), "nccl": bool(hvd_tf.nccl_built())}


@functools.cache
def local_cpu_sets(world: World) -> list[frozenset[int]]:
    """The cores each rank on this node may run on (its CPU affinity), in local-rank order.

    A collective of all ranks, after ``hvd.init()`` but before any TensorFlow op: TensorFlow sizes
    its thread pools once, when its runtime starts, and horovod's own collectives are TensorFlow
    ops that would start it, so the ranks meet through the controller's own channel instead.
    Once per process and world: every rank creates its runtimes in the same order, and later
    ones find the same ranks on the same cores.
    """
    own = frozenset(os.sched_getaffinity(0))
    if world.size == 1:
        return [own]
    if hvd_tf.mpi_enabled():
        return _exchange_through_mpi(own, world)
    return _exchange_through_gloo_rendezvous(own)


def _exchange_through_mpi(own: frozenset[int], world: World) -> list[frozenset[int]]:
    try:
        import mpi4py
    except ImportError as error:
        raise UserError(f"the horovod backend over MPI needs mpi4py ({error}): pip install "
                        "mpi4py (or hvdtrain[horovod])") from None
    # Horovod started MPI and finalizes it at exit (a rank that fails must not wait there for
    # its peers); mpi4py only joins it, as the allreduce benchmark does.
    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        # HOROVOD_MPI_THREADS_DISABLE: horovod's background thread must be MPI's only caller.
        # Without the exchange, assume what an unbound launch gives: all local ranks share
        # this rank's cores (never oversubscribes; under-uses cores the launcher bound).
        return [own] * world.local_size
    # The split horovod makes for its local communicator, so the order is its local_rank.
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return [frozenset(cores) for cores in node.allgather(sorted(own))]
    finally:
        node.Free()


def _exchange_through_gloo_rendezvous(own: frozenset[int]) -> list[frozenset[int]]:
    # horovodrun --gloo starts no MPI job, but its rendezvous server (the key-value store the
    # Gloo ranks met through in hvd.init) serves the whole job and keeps keys in scopes of its
    # clients' choosing. Each rank publishes its cores under its host's scope, then reads its
    # local peers'. Asking is robust where assuming is not: horovodrun does not bind Gloo ranks,
    # but a rank's command may (taskset, numactl).
    env = os.environ
    address, port = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"], env["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    scope = f"hvdtrain_cpus_{env['HOROVOD_HOSTNAME']}"
    http_client.put_data_into_kvstore(address, port, scope, env["HOROVOD_LOCAL_RANK"], sorted(own))
    # As long as Gloo's own rendezvous waits for a missing rank.
    timeout = float(env.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30"))
    deadline = time.monotonic() + timeout
    cpu_sets = []
    for local_rank in range(int(env["HOROVOD_LOCAL_SIZE"])):
        while True:
            try:
                cores = http_client.read_data_from_kvstore(address, port, scope, str(local_rank))
                break
            except RuntimeError:  # not published yet
                if time.monotonic() > deadline:
                    raise RankError(f"local rank {local_rank} did not publish its CPU cores "
                                    f"within {timeout:g} s (HOROVOD_GLOO_TIMEOUT_SECONDS)"
                                    ) from None
                time.sleep(0.05)
        cpu_sets.append(frozenset(cores))
    return cpu_sets


class HorovodRuntime(Runtime):
    def __init__(self, *, threads_per_worker: int | None = None):
        # OpenMPI busy-polls while a rank waits for its peers. Horovod waits on a background
        # thread that wakes every cycle (1 ms) and shares the cores with TensorFlow's compute
        # threads, so that polling steals the cores the model needs: on 2 cores an idle horovod
        # cost the compute around it ~40% with polling and ~3% with yielding, and 2 training
        # ranks went from 1.0x to ~1.8x one rank (docs/benchmarks.md). Set it to 0 to override.
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        # A rank stuck outside the collectives (slow I/O, a peer on a dead node) must end the
        # job, not hang it: horovod's stall inspector then shuts horovod down on every rank
        # (its own default only warns, every minute, forever). Long enough for rank 0's
        # checkpoint and plot between epochs; the variable (or the launcher's
        # --stall-check-shutdown-seconds) overrides it.
        os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(STALL_SHUTDOWN_SECONDS))
        # Checked copies into and out of the fusion buffer on GPU ranks: horovod 0.28.1 does not
        # check its own CUDA kernel launches (the checks in gpu_operations.cc are commented out,
        # horovod#2230), so a batched-copy kernel that cannot run on this GPU or driver (ours
        # are built for compute capability 7.5/8.0/9.0 with CUDA 13) would leave stale memory
        # for NCCL to average, without an error. cudaMemcpyAsync is checked. CPU ranks never
        # copy through it; set the variable to 1 to take horovod's batched kernel again.
        os.environ.setdefault("HOROVOD_BATCH_D2D_MEMCOPIES", "0")
        # horovodrun passes mpirun `-mca btl ^openib`, which replaces Debian's default list
        # (^uct,openib,ofi) and so turns libfabric's BTL back on. A job on one host talks
        # through shared memory and needs none of it, and its set-up in MPI_Init can call
        # exit() when ranks crowd the cores (seen once in CI: 4 ranks on 2 cores, signal 6 from
        # horovod's destructor in that exit). mpirun tells each rank both sizes before MPI_Init
        # reads its MCA variables; any other btl list (the user's) is left as it is.
        single_host = os.environ.get("OMPI_COMM_WORLD_SIZE", "") == os.environ.get(
            "OMPI_COMM_WORLD_LOCAL_SIZE")
        if single_host and os.environ.get("OMPI_MCA_btl") == "^openib":
            os.environ["OMPI_MCA_btl"] = "^openib,ofi"
        # Horovod: start the MPI/Gloo controller; it learns rank and size from the launcher.
        hvd_tf.init()
        world = World(rank=hvd_tf.rank(), local_rank=hvd_tf.local_rank(), size=hvd_tf.size(),
                      local_size=hvd_tf.local_size(), backend="horovod")
        # Ranks that share cores split them: ask which ranks share which before TF starts.
        cpu_sets = local_cpu_sets(world)
        assert len(cpu_sets) == world.local_size, (cpu_sets, world)
        # Horovod: one GPU per local rank (or a fair share of the cores), before TF starts.
        super().__init__(world, configure_devices(world, threads_per_worker, cpu_sets))

    def distribute_optimizer(self, optimizer, *, fp16_allreduce: bool, grad_accum_steps: int):
        if self.world.size == 1 and grad_accum_steps == 1:
            # A world of one has nothing to average; horovod's allreduce would still pass every
            # step through its background thread (up to a 1 ms cycle of latency per step).
            return optimizer
        # Horovod: average the gradients of all ranks with an allreduce before each update, so
        # every rank applies the same update and the replicas stay identical.
        if KERAS == "3":
            return keras3.distribute_optimizer(optimizer, self.allreduce,
                                               fp16_allreduce=fp16_allreduce,
                                               grad_accum_steps=grad_accum_steps)
        compression = hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none
        distributed = hvd.DistributedOptimizer(
            optimizer,
            compression=compression,
            # Horovod: accumulate this many local backward passes per allreduce + update; the
            # accumulated sum is divided by the count so the update is a mean over the samples.
            backward_passes_per_step=grad_accum_steps,
            average_aggregated_gradients=grad_accum_steps > 1,
        )
        # Horovod's Keras 2 optimizer is a new one made from the given one's config, which does
        # not hold what exclude_from_weight_decay set: without this, biases and norm weights
        # would be decayed on 2 ranks and more only.
        for name, value in vars(optimizer).items():
            if name.startswith("_exclude_from_weight_decay"):
                setattr(distributed, name, value)
        return distributed

    def keep_collectives_out_of_xla(self, model) -> bool:
        if KERAS == "3":
            # XLA for the step's compute, horovod's average between its two compiled parts.
            return keras3.keep_collectives_out_of_xla(model)
        # horovod's Keras 2 optimizer (horovod/_keras: its _allreduce) averages in the step,
        # under tf_keras' LossScaleOptimizer for mixed_float16.
        optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
        if model._jit_compile and hasattr(optimizer, "_allreduce"):
            raise UserError("--jit-compile on compiles the whole step, horovod's allreduce "
                            "included, which XLA cannot; on Keras 2 leave it auto (tf_keras "
                            "compiles the optimizer's update with XLA) or use --keras 3")
        return False

    def broadcast_variables(self, variables: list) -> None:
        # Horovod: start every rank from rank 0's weights and optimizer state (fresh random init
        # differs per rank; a resumed run restored them on rank 0 only). This is done before the
        # first step rather than with BroadcastGlobalVariablesCallback, which broadcasts after the
        # first batch: by then a resumed run would have averaged in gradients computed from the
        # other ranks' un-restored weights.
        if variables:
            hvd_tf.broadcast_variables(variables, root_rank=0)

    def sync_callbacks(self) -> list:
        if self.world.size == 1:
            return []  # one rank's metrics are already the job's
        # Horovod: average the epoch's metrics over ranks before any later callback (checkpoint,
        # CSV, early stopping) reads them; each rank only saw its own shard.
        if KERAS == "3":
            return [keras3.MetricAverage(self.allreduce)]
        return [hvd.callbacks.MetricAverageCallback()]

    def broadcast_object(self, obj: Any) -> Any:
        return hvd_tf.broadcast_object(obj, root_rank=0)

    def allgather_object(self, obj: Any) -> list:
        return hvd_tf.allgather_object(obj)

    def max_over_ranks(self, value: int) -> int:
        if self.world.size == 1:
            return value
        # Horovod: every rank gets the same answer and so takes the same branch afterwards (a
        # rank that stopped alone would leave the others waiting in the next allreduce).
        return int(hvd_tf.allreduce(tf.constant(value, tf.int32), op=hvd_tf.Max,
                                    name="hvdtrain_max_over_ranks"))

    def stall_limit_seconds(self) -> float | None:
        # Horovod's own limit, which the user may have changed (the launcher's
        # --stall-check-shutdown-seconds sets it); its stall check off means no limit either.
        return None if self.world.size == 1 else watchdog_seconds(os.environ)

    def barrier(self) -> None:
        # Horovod 0.28 has no TensorFlow barrier op; a one-element allreduce is one.
        self.max_over_ranks(0)

    def allreduce(self, tensor, *, fp16_compression: bool = False, name: str | None = None):
        """Average a tensor over ranks (used by the allreduce benchmark)."""
        compression = hvd_tf.Compression.fp16 if fp16_compression else hvd_tf.Compression.none
        return hvd_tf.allreduce(tensor, op=hvd_tf.Average, compression=compression, name=name)

    def grouped_allreduce(self, tensors: list, *, name: str | None = None) -> list:
        """Average several tensors over ranks as one group: horovod fuses them into one
        buffer (the health check's value check of that path)."""
        return hvd_tf.grouped_allreduce(tensors, op=hvd_tf.Average, name=name)

    def allreduce_transport(self) -> str:
        """What carries this rank's allreduce: horovod sends GPU tensors through NCCL when it
        was built with it (HOROVOD_GPU_OPERATIONS=NCCL), everything else through its
        controller."""
        if self.devices.kind == "gpu" and hvd_tf.nccl_built():
            return "NCCL"
        return self.controller().upper()

    def controller(self) -> str:
        return "mpi" if hvd_tf.mpi_enabled() else "gloo" if hvd_tf.gloo_enabled() else "unknown"
