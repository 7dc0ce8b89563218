"""Where a job runs: the world's facts and the backend that owns them.

Training code sees one object, a ``Runtime``: its ``world`` (rank, size, ...) and a handful of
named collectives (wrap the optimizer, broadcast, agree, ``from_chief``). Which backend stands
behind it is decided once, here, by ``select_backend``; this factory sits above the backends, which
import only ``runtime.base``:

* ``single``   one process, one device (``runtime.base.Runtime`` itself);
* ``horovod``  one process per device, MPI/Gloo collectives (``runtime/horovod.py``, the only
               module that imports horovod, imported only when chosen: TPU VMs usually lack it);
* ``mirrored`` ``tf.distribute.MirroredStrategy`` over this host's GPUs, no MPI;
* ``tpu``      ``tf.distribute.TPUStrategy`` through a TPU cluster resolver.
"""
from __future__ import annotations

import os
from typing import Callable, Mapping

from hvdtrain.errors import UserError, rebuild_the_stack
from hvdtrain.launcher_env import launched_as
from hvdtrain.runtime.base import (Devices, Runtime, World, choose_gpu, configure_devices,
                                   cpu_threads_per_local_rank, placement)
from hvdtrain.runtime.strategy import (TPU_VARIABLES, local_tpu_devices, mirrored_runtime,
                                       tpu_address, tpu_runtime)

__all__ = ["Devices", "Runtime", "World", "choose_gpu", "configure_devices",
           "cpu_threads_per_local_rank", "make_runtime", "placement", "select_backend",
           "tpu_address"]


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
    if any(env.get(name) for name in TPU_VARIABLES) or find_tpu_devices():
        return "tpu"
    return "single"


def check_launch(chosen: str, backend: str) -> None:
    """A launcher's several ranks need the horovod backend (``chosen``: ``backend`` resolved)."""
    launched = launched_as()
    if chosen != "horovod" and launched and launched[1] != 1:
        # Every process would think it is the only one (and rank 0), train alone, and write
        # into the same run directory as the others.
        ranks = launched[1] or "several"
        raise UserError(f"started as {ranks} ranks by a launcher, but --backend {backend} runs "
                        "one process; use --backend horovod (or auto), or start one process")


def make_runtime(backend: str, *, threads_per_worker: int | None = None,
                 needs_horovod: bool = False) -> Runtime:
    """Start the runtime for ``--backend`` (after ``auto`` is resolved)."""
    chosen = select_backend(backend, needs_horovod=needs_horovod)
    check_launch(chosen, backend)
    if chosen == "horovod":
        try:
            from hvdtrain.runtime.horovod import HorovodRuntime
        except ImportError as error:
            raise UserError(f"the horovod backend needs horovod ({error}); "
                            f"{rebuild_the_stack()}, or use --backend single") from None
        return HorovodRuntime(threads_per_worker=threads_per_worker)
    if chosen == "tpu":
        return tpu_runtime()
    if chosen == "mirrored":
        return mirrored_runtime(threads_per_worker)
    if chosen == "single":
        world = World()
        return Runtime(world, configure_devices(world, threads_per_worker))
    raise UserError(f"unknown backend {chosen!r}")
