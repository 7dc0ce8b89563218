"""Allreduce bandwidth: horovod's allreduce against mpi4py's Allreduce in the same processes.

Run as ranks: `mpirun -np 2 python -m benchmarks.allreduce --json out.json` (MPI controller,
both libraries measured in the same processes, interleaved), or under `horovodrun --gloo -np 2`
(Gloo controller; mpi4py is then not started, since there is no MPI job). Every timed call starts
after a barrier, so no rank's timer includes waiting for a late peer, and ends when the reduced
buffer is ready. Bandwidth is the algorithm bandwidth: bytes reduced per second.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from benchmarks.harness import interleave
from hvdtrain.runtime.horovod import HorovodRuntime
from hvdtrain.rundir import RunDir


def measure(runtime: HorovodRuntime, sizes_mb: list[float], repeats: int, warmup: int,
            with_mpi4py: bool) -> dict:
    import tensorflow as tf

    comm = None
    if with_mpi4py:
        from mpi4py import MPI  # after hvd.init(): mpi4py joins the MPI job horovod started

        comm = MPI.COMM_WORLD

    barrier = comm.Barrier if comm is not None else runtime.barrier

    results = {}
    for size_mb in sizes_mb:
        count = int(size_mb * 2**20 / 4)  # float32 elements
        data = np.full(count, 1.0 + runtime.world.rank, dtype=np.float32)
        tensor = tf.constant(data)
        received = np.empty_like(data)
        expected = sum(1.0 + r for r in range(runtime.world.size))

        def run_horovod(fp16: bool):
            reduced = runtime.allreduce(tensor, fp16_compression=fp16,
                                        name=f"bench_{size_mb}_{int(fp16)}")
            return float(reduced[0]) * runtime.world.size  # waits for the result

        def run_mpi4py():
            comm.Allreduce(data, received, op=MPI.SUM)
            return float(received[0])

        calls = {"horovod": lambda: run_horovod(False), "horovod_fp16": lambda: run_horovod(True)}
        if comm is not None:
            calls["mpi4py"] = run_mpi4py

        def timed(name: str) -> dict:
            barrier()
            start = time.perf_counter()
            value = calls[name]()
            elapsed = time.perf_counter() - start
            assert abs(value - expected) < 1e-2 * expected, (name, value, expected)
            return {"seconds": elapsed}

        runs = interleave({name: (lambda name=name: timed(name)) for name in calls},
                          repeats=repeats, warmup=warmup, log=lambda line: None)
        seconds = {name: [run["seconds"] for run in values] for name, values in runs.items()}
        results[str(size_mb)] = {
            name: {"seconds": values, "median_seconds": statistics.median(values),
                   "gb_per_second": count * 4 / statistics.median(values) / 1e9}
            for name, values in seconds.items()}
    return results


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.allreduce",
                                     description=__doc__)
    parser.add_argument("--sizes-mb", default="1,4,16,64,256",
                        help="comma-separated buffer sizes in MiB (default 1,4,16,64,256)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", required=True, help="where rank 0 writes the results")
    args = parser.parse_args(argv)
    runtime = HorovodRuntime(threads_per_worker=1)
    controller = runtime.controller()
    results = measure(runtime, [float(s) for s in args.sizes_mb.split(",")], args.repeats,
                      args.warmup, with_mpi4py=controller == "mpi")
    out = Path(args.json)
    RunDir(out.parent, is_chief=runtime.world.is_chief).write_json(
        out.name, {"controller": controller, "ranks": runtime.world.size, "sizes": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
