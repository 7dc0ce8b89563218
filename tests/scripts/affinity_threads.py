"""One rank of a job: start the horovod runtime and print, as one JSON line, what it decided.

The line holds this rank's cores, the cores its local peers reported in the exchange, the threads
chosen, and the intra-/inter-op threads TensorFlow really runs with; then one collective proves
horovod works on top of the exchange.
"""
import json
import os

import hvdtrain  # noqa: F401  (Keras 2 before TensorFlow)
from hvdtrain.errors import reported


def main() -> None:
    import tensorflow as tf

    from hvdtrain.runtime.horovod import HorovodRuntime, local_cpu_sets

    runtime = HorovodRuntime()
    world = runtime.world
    print("affinity " + json.dumps({
        "rank": world.rank, "local_rank": world.local_rank, "local_size": world.local_size,
        "controller": runtime.controller(),
        "own": sorted(os.sched_getaffinity(0)),
        "exchanged": [sorted(cores) for cores in local_cpu_sets(world)],
        "threads": runtime.devices.threads,
        "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
        "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        "ranks_answering": runtime.max_over_ranks(world.rank) + 1,
    }), flush=True)


with reported("affinity_threads"):
    main()
