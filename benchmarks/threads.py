"""Where each rank's CPU goes: per-thread CPU of every running training process over a window.

    python -m benchmarks.threads --seconds 10 [--match hvdtrain.cnn]

Run it on a node while a job trains (inside an epoch: epoch-end work such as checkpoints is
not training). It reads each thread's user + system time from /proc twice and prints, per
process, the cores each thread used. Ranks are named from the launcher's environment
(OMPI_COMM_WORLD_RANK, HOROVOD_RANK or SLURM_PROCID). Threads are unnamed in TensorFlow's
CPU build, so they are told apart by role: "main" is the Python thread that runs Keras' loop
and the callbacks; on a horovod rank with one compute thread, the busiest other thread is
TensorFlow's compute and the next is horovod's background loop (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK=", "HOROVOD_RANK=", "SLURM_PROCID=")


def training_processes(match: str) -> dict[int, str]:
    """pid -> rank (or "pid N") of every Python process whose command line contains ``match``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_text().split("\0")
            environment = (entry / "environ").read_text().split("\0")
        except OSError:
            continue  # gone, or not ours to read
        if "python" not in os.path.basename(argv[0]) or not any(match in a for a in argv[1:]):
            continue
        rank = next((v.split("=", 1)[1] for v in environment if v.startswith(RANK_VARIABLES)),
                    None)
        found[int(entry.name)] = f"rank {rank}" if rank is not None else f"pid {entry.name}"
    return found


def thread_ticks(pid: int) -> dict[int, int]:
    """tid -> user + system clock ticks so far."""
    ticks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        ticks[int(task.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the window")
    parser.add_argument("--match", default="hvdtrain", help="text in the processes' command line")
    args = parser.parse_args(argv)
    processes = training_processes(args.match)
    if not processes:
        print(f"no running Python process matches {args.match!r}")
        return 1
    before = {pid: thread_ticks(pid) for pid in processes}
    start = time.monotonic()
    time.sleep(args.seconds)
    for pid, name in sorted(processes.items(), key=lambda item: item[1]):
        try:
            after = thread_ticks(pid)
        except OSError:
            print(f"{name} (pid {pid}): ended during the window")
            continue
        wall = time.monotonic() - start
        used = {tid: (ticks - before[pid].get(tid, 0)) / CLOCK_TICKS / wall
                for tid, ticks in after.items()}
        busy = sorted(((cores, tid) for tid, cores in used.items() if cores >= 0.01),
                      reverse=True)
        print(f"{name} (pid {pid}): {sum(used.values()):.2f} cores")
        for cores, tid in busy:
            print(f"  {cores:5.2f}  thread {tid}{'  main' if tid == pid else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
