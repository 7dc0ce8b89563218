"""tf.distribute backends: one process driving several replicas (``mirrored``, ``tpu``).

Keras splits each batch between the strategy's replicas and all-reduces the gradients itself, so
these backends only supply the strategy's scope and their defaults; they never import horovod.
"""
from __future__ import annotations

import glob
import importlib.util
import os
from typing import Mapping

from hvdtrain.errors import UserError, first_line
from hvdtrain.runtime.base import Devices, Runtime, World, configure_devices

# What a TPU looks like from the host: a named TPU (Cloud TPU node / TPU VM), a Colab TPU, or the
# local device files of a TPU VM (/dev/accel* on v2-v4, /dev/vfio/* on v5e and later; VFIO is also
# used for other passthrough devices, so it only counts where libtpu is installed).
TPU_VARIABLES = ("TPU_NAME", "COLAB_TPU_ADDR")


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


def local_tpu_devices() -> list[str]:
    devices = glob.glob("/dev/accel*")
    if importlib.util.find_spec("libtpu") is not None:
        devices += glob.glob("/dev/vfio/[0-9]*")
    return sorted(devices)


def mirrored_runtime(threads_per_worker: int | None) -> StrategyRuntime:
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


def tpu_runtime() -> StrategyRuntime:
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
