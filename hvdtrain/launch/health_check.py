"""``--health-check`` / ``--health-check-only``: hvdtrain.health on every rank, through the job's
own launch, before the job (see hvdtrain.health for what it checks).

The launcher shows the check's own lines only (rank 0's findings and its summary), not
mpirun's or srun's page about a non-zero exit: a failed check is its lines and exit 2.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from typing import Mapping

from hvdtrain.errors import EXIT_USAGE, signal_name, stop_status
from hvdtrain.launch.console import error, say, show
from hvdtrain.launch.options import HEALTH_PROGRAM, LaunchOptions
from hvdtrain.launch.paths import Launch
from hvdtrain.launch.supervise import ATTEMPT_VARIABLE, SignalForwarder, end_attempt

#: Seconds for the whole check: every rank's Python and TensorFlow start, a matrix product, and
#: two transfers over every link of the ring.
HEALTH_SECONDS = 300.0
#: ...plus, on a GPU node's first run, TensorFlow compiling its PTX for a GPU its wheel has no
#: machine code for: TensorFlow warns this "could take 30 minutes or longer" (tensorflow#62320).
#: CUDA's compute cache keeps the result, so later runs do not wait.
PTX_JIT_SECONDS = 1800.0
MARK = f"{HEALTH_PROGRAM}: "


def compute_cache(env: Mapping[str, str]) -> str:
    """Where CUDA keeps the code it JIT-compiled (CUDA_CACHE_PATH, default ~/.nv/ComputeCache)."""
    return env.get("CUDA_CACHE_PATH") or os.path.join(os.path.expanduser("~"), ".nv",
                                                      "ComputeCache")


def health_seconds(gpus_per_node: int, env: Mapping[str, str]) -> float:
    """The check's time limit: longer on GPU nodes while CUDA's compute cache is empty."""
    cache = compute_cache(env)
    first_gpu_run = gpus_per_node > 0 and not (os.path.isdir(cache) and os.listdir(cache))
    return HEALTH_SECONDS + (PTX_JIT_SECONDS if first_gpu_run else 0)


def health_options(options: LaunchOptions, gpus_per_node: int) -> LaunchOptions:
    """The job's options with hvdtrain.health as the program (and no restarts)."""
    return dataclasses.replace(
        options, program=HEALTH_PROGRAM, max_restarts=0,
        program_args=("--gpus-per-rank", "1" if gpus_per_node else "0"))


def run_health_check(launch: Launch, signals: SignalForwarder, timeout: float = HEALTH_SECONDS,
                     gpus_per_node: int = 0) -> int:
    """Run the check; show its lines; its exit status (EXIT_USAGE when it failed, or when it
    could not run or finish, with one line saying so; a stop signal's status after one)."""
    # Marked and signalled as an attempt of the job is: a stop signal stops the check's ranks,
    # and the watcher ends them if the launcher dies (see watcher.py).
    marker = f"{ATTEMPT_VARIABLE}={os.getpid()}.health"
    process = signals.start(launch, marker, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    if process is None:
        return stop_status(signals.first)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        ptx = (f"; on a GPU node's first run TensorFlow may JIT-compile its PTX for the GPU "
               f"for 30 minutes or more: run it again, CUDA keeps what it compiled in "
               f"{compute_cache(os.environ)} (make room with CUDA_CACHE_MAXSIZE)"
               if gpus_per_node else "")
        error(f"the health check did not finish in {timeout:g} s (a rank that does not "
              f"start, or a link that carries nothing?{ptx})")
        return EXIT_USAGE
    finally:
        signals.ended()
        end_attempt(process.pid, marker)  # nothing of the check runs beside the job
    if signals.received:
        say(f"the health check stopped on {signal_name(signals.first)}; not starting the job")
        return stop_status(signals.first)
    said = [line[line.index(MARK):] for line in output.splitlines() if MARK in line]
    for line in said:
        show(line)
    if process.returncode == 0 or (said and process.returncode == EXIT_USAGE):
        return process.returncode
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "no output")
    error(f"the health check could not run (exit {process.returncode}): {last.strip()}")
    return EXIT_USAGE
