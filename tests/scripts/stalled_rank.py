"""A job whose last rank never reaches the next collective, as a rank stuck in I/O would."""
import os
import time

import hvdtrain  # noqa: F401  (Keras 2 before TensorFlow)
from hvdtrain.errors import reported


def main() -> None:
    from hvdtrain.runtime.horovod import HorovodRuntime

    runtime = HorovodRuntime()
    print(f"rank {runtime.world.rank}: stall shutdown after "
          f"{os.environ.get('HOROVOD_STALL_SHUTDOWN_TIME_SECONDS')} s", flush=True)
    if runtime.world.rank == runtime.world.size - 1:
        time.sleep(600)
    runtime.max_over_ranks(1)


with reported("stalled_rank"):
    main()
