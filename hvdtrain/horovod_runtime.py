"""The horovod backend: the only module in hvdtrain that imports horovod.

One process per GPU (or per CPU share), started by horovodrun, mpirun or srun. Everything
distributed that the training code needs goes through the methods below, each with the reason it
exists.
"""
from __future__ import annotations

import os
from typing import Any

import horovod.tensorflow as hvd_tf
import horovod.tensorflow.keras as hvd
import tensorflow as tf

from hvdtrain.runtime import Runtime, World, configure_devices


def build_info() -> dict:
    """What this horovod was compiled with (importing this module proves its TF extension loads)."""
    return {"tensorflow": True, "mpi": bool(hvd_tf.mpi_built()),
            "gloo": bool(hvd_tf.gloo_built())}


class HorovodRuntime(Runtime):
    def __init__(self, *, threads_per_worker: int | None = None):
        # OpenMPI busy-polls while a rank waits for its peers. Horovod waits on a background
        # thread that wakes every cycle (1 ms) and shares the cores with TensorFlow's compute
        # threads, so that polling steals the cores the model needs: on 2 cores an idle horovod
        # cost the compute around it ~40% with polling and ~3% with yielding, and 2 training
        # ranks went from 1.0x to ~1.8x one rank (docs/benchmarks.md). Set it to 0 to override.
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
        # Horovod: start the MPI/Gloo controller; it learns rank and size from the launcher.
        hvd.init()
        world = World(rank=hvd.rank(), local_rank=hvd.local_rank(), size=hvd.size(),
                      local_size=hvd.local_size(), backend="horovod")
        # Horovod: one GPU per local rank (or a fair share of the cores), before TF starts.
        super().__init__(world, configure_devices(world, threads_per_worker))

    def distribute_optimizer(self, optimizer, *, fp16_allreduce: bool, grad_accum_steps: int):
        if self.world.size == 1 and grad_accum_steps == 1:
            # A world of one has nothing to average; horovod's allreduce would still pass every
            # step through its background thread (up to a 1 ms cycle of latency per step).
            return optimizer
        # Horovod: average the gradients of all ranks with an allreduce before each update, so
        # every rank applies the same update and the replicas stay identical.
        compression = hvd.Compression.fp16 if fp16_allreduce else hvd.Compression.none
        return hvd.DistributedOptimizer(
            optimizer,
            compression=compression,
            # Horovod: accumulate this many local backward passes per allreduce + update; the
            # accumulated sum is divided by the count so the update is a mean over the samples.
            backward_passes_per_step=grad_accum_steps,
            average_aggregated_gradients=grad_accum_steps > 1,
        )

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

    def barrier(self) -> None:
        # Horovod 0.28 has no TensorFlow barrier op; a one-element allreduce is one.
        self.max_over_ranks(0)

    def allreduce(self, tensor, *, fp16_compression: bool = False, name: str | None = None):
        """Average a tensor over ranks (used by the allreduce benchmark)."""
        compression = hvd_tf.Compression.fp16 if fp16_compression else hvd_tf.Compression.none
        return hvd_tf.allreduce(tensor, op=hvd_tf.Average, compression=compression, name=name)

    def controller(self) -> str:
        return "mpi" if hvd_tf.mpi_enabled() else "gloo" if hvd_tf.gloo_enabled() else "unknown"
