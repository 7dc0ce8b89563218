"""What horovod's background thread costs the compute around it, without TensorFlow in the way.

Run as 2 ranks (`mpirun -np 2 python -m benchmarks.overhead MODE --json F`). Each rank does
single-threaded numpy work for a fixed time and counts the steps; the two ranks share the cores
as the ranks of a training job do. MODE:

  none                no horovod: what the two cores do
  horovod             horovod initialised as hvdtrain does it (idle; MPI yields when waiting)
  horovod-busy-poll   the same with OpenMPI's default busy-polling

Horovod is never given work here, so any slowdown is the price of its background thread's 1 ms
cycles, in which the ranks coordinate with each other even when idle. Each rank writes its own
result (F.<rank>); nothing here calls MPI but horovod.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Sequence

# One BLAS thread per rank, as the training job's one intra-op thread (set before numpy loads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

from hvdtrain.launcher_env import launch_rank  # noqa: E402

MODES = ("none", "horovod", "horovod-busy-poll")


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", required=True, help="prefix; each rank writes <json>.<rank>")
    args = parser.parse_args(argv)
    rank = launch_rank()
    if args.mode != "none":
        if args.mode == "horovod-busy-poll":
            os.environ["OMPI_MCA_mpi_yield_when_idle"] = "0"
        from hvdtrain.runtime.horovod import HorovodRuntime

        runtime = HorovodRuntime(threads_per_worker=1)
        runtime.barrier()  # both ranks are up and cycling before the clock starts
    matrix = np.random.default_rng(rank).random((192, 192), dtype=np.float32)
    for _ in range(500):
        matrix @ matrix
    start, cpu_start, steps = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - start < args.seconds:
        for _ in range(120):
            matrix @ matrix
        steps += 1
    elapsed = time.perf_counter() - start
    with open(f"{args.json}.{rank}", "w") as file:
        json.dump({"mode": args.mode, "steps_per_sec": steps / elapsed,
                   "cpu_per_wall": (time.process_time() - cpu_start) / elapsed}, file)
    if args.mode != "none":
        runtime.barrier()  # nobody shuts horovod down while the other still measures
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
