"""Where each rank's CPU goes: per-thread CPU of every running training process over a window.

    python -m benchmarks.threads --seconds 10 [--match hvdtrain.cnn]   # beside a running job
    python -m benchmarks threads                                        # the stored comparison

Run it on a node while a job trains (inside an epoch: epoch-end work such as checkpoints is
not training). It reads each thread's user + system time from /proc twice and prints, per
process, the cores each thread used. Ranks are named from the launcher's environment
(``hvdtrain.launcher_env``). Threads are unnamed in TensorFlow's
CPU build, so they are told apart by role: "main" is the Python thread that runs Keras' loop
and the callbacks; on a horovod rank with one compute thread, the busiest other thread is
TensorFlow's compute and the next is horovod's background loop (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from hvdtrain.launcher_env import processes

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def training_processes(match: str) -> dict[int, str]:
    """pid -> rank (or "pid N") of every Python process whose command line contains ``match``."""
    found = {}
    for process in processes():
        argv = process.argv
        if not argv or "python" not in os.path.basename(argv[0]) \
                or not any(match in a for a in argv[1:]):
            continue
        if any(os.path.basename(a) in ("horovodrun", "mpirun") for a in argv[1:3]):
            continue  # the launcher, not a rank
        rank = process.rank
        found[process.pid] = f"rank {rank}" if rank is not None else f"pid {process.pid}"
    # A process starting a child (subprocess forks, then execs) has a copy with its own command
    # line until the exec: a rank's janitor or tee just started is not another training process.
    return {pid: name for pid, name in found.items() if _parent(pid) not in found}


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])  # after "pid (comm) state"


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


def window(processes: dict[int, str], seconds: float) -> dict[str, dict]:
    """Per process: the cores each of its threads used over ``seconds``, busiest first.

    Threads are unnamed in TensorFlow's CPU build, so a thread's role is read from its rank
    here (``main`` is the Python thread; see the module's docstring), not from a name.
    """
    before = {pid: thread_ticks(pid) for pid in processes}
    start = time.monotonic()
    time.sleep(seconds)
    measured = {}
    for pid, name in sorted(processes.items(), key=lambda item: item[1]):
        after = thread_ticks(pid)
        wall = time.monotonic() - start
        used = {tid: (ticks - before[pid].get(tid, 0)) / CLOCK_TICKS / wall
                for tid, ticks in after.items()}
        others = sorted((cores for tid, cores in used.items() if tid != pid), reverse=True)
        measured[name] = {"main": used.get(pid, 0.0), "others": others,
                          "total": sum(used.values())}
    return measured


# The stored comparison: where the cores go in 2 horovod ranks against 2 independent jobs.
JOBS = ("horovodrun -np 2", "2 independent --backend single jobs", "horovodrun --gloo -np 2")


def _job(kind: str, training: list[str], marker: str) -> list[list[str]]:
    from benchmarks.suite import BIN

    cnn = [sys.executable, "-m", "hvdtrain.cnn", *training, "--run-dir"]
    if kind == "2 independent --backend single jobs":
        return [[*cnn, f"{marker}-{index}", "--backend", "single"] for index in (0, 1)]
    gloo = ["--gloo"] if "gloo" in kind else []
    return [[str(BIN / "horovodrun"), *gloo, "-np", "2", *cnn, marker]]


def profile(s, workdir: Path, log: Callable[[str], None], *, seconds: float = 10.0,
            settle: float = 12.0) -> dict:
    """Each job of JOBS trains one long epoch; its threads are measured from ``settle`` seconds
    after the start (tracing done), or once both its processes run if they start later, for
    ``seconds``, inside that epoch."""
    from benchmarks.suite import BenchmarkFailed, _env, _training_args

    steps = 100_000  # an epoch far longer than the window: no epoch-end work inside it
    training = [*_training_args(s, "synthetic"), "--threads-per-worker", "1"]
    training[training.index("--epochs") + 1] = "1"
    training[training.index("--steps-per-epoch") + 1] = str(steps)
    result = {"seconds": seconds, "settle": settle, "jobs": {}}
    for index, kind in enumerate(JOBS):
        marker = str(workdir / f"threads-{index}")
        log(f"threads: {kind}, {seconds:g} s window after {settle:g} s")
        started = [subprocess.Popen(argv, env=_env(), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
                   for argv in _job(kind, training, marker)]
        try:
            begun = time.monotonic()
            time.sleep(settle)
            processes = training_processes(marker)
            while len(processes) < 2 and time.monotonic() - begun < 120:  # a slow start
                if any(p.poll() is not None for p in started):
                    break
                time.sleep(0.2)
                processes = training_processes(marker)
            if len(processes) != 2 or any(p.poll() is not None for p in started):
                raise BenchmarkFailed(f"threads: {kind}: expected 2 training processes, found "
                                      f"{len(processes)}")
            measured = window(processes, seconds)
            if any(p.poll() is not None for p in started):
                raise BenchmarkFailed(f"threads: {kind} ended inside the window")
            result["jobs"][kind] = measured
        finally:
            for process in started:  # the whole session: horovodrun, mpirun and the ranks
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
            # A launcher may start its ranks in a session of their own: end them by name too,
            # before the scratch directory they write into goes.
            for pid in training_processes(marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return result


def _cores(value: float) -> str:
    return f"{value:.2f}"


def markdown(result: dict) -> str:
    """One row per process: the main thread, the two busiest others, the rest, the total."""
    from benchmarks.report import measured_on

    where = measured_on(result["machine"])
    lines = ["| job | process | main (Python) thread | busiest other thread | second busiest | "
             "all other threads | total | measured on |", "|---|---|---|---|---|---|---|---|"]
    for kind, processes in result["jobs"].items():
        for position, (name, row) in enumerate(processes.items()):
            others = row["others"] + [0.0, 0.0]
            lines.append(f"| {kind if position == 0 else ''} | {name} | {_cores(row['main'])} | "
                         f"{_cores(others[0])} | {_cores(others[1])} | "
                         f"{_cores(sum(others[2:]))} | {_cores(row['total'])} | {where} |")
    return "\n".join(lines)


def run(s, out: Path, log: Callable[[str], None], *, quick: bool = False) -> dict:
    import tempfile

    from benchmarks.report import machine

    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-threads-") as scratch:
        # Quick checks the harness: its window may hold start-up rather than training.
        result = profile(s, Path(scratch), log, seconds=2.0 if quick else 10.0,
                         settle=0.0 if quick else 12.0)
    result["machine"] = machine()
    out.mkdir(parents=True, exist_ok=True)
    (out / "threads.json").write_text(json.dumps(result, indent=1))
    (out / "threads.md").write_text(markdown(result) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the window")
    parser.add_argument("--match", default="hvdtrain", help="text in the processes' command line")
    args = parser.parse_args(argv)
    processes = training_processes(args.match)
    if not processes:
        print(f"no running Python process matches {args.match!r}")
        return 1
    try:
        measured = window(processes, args.seconds)
    except OSError as error:
        print(f"a process ended during the window: {error}")
        return 1
    for name, row in measured.items():
        print(f"{name}: {row['total']:.2f} cores; main thread {row['main']:.2f}; others "
              + ", ".join(f"{cores:.2f}" for cores in row["others"] if cores >= 0.01))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
