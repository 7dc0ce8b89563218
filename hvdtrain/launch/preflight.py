"""Before any rank starts: everything that would make the launch fail, one line each.

A mistake found here costs seconds instead of a launch (or one per ``--max-restarts``): a
module the ranks' Python cannot find, a horovod built without what the launch path needs, more
ranks than tasks or GPUs, OpenMPI's refusal to run as root. The facts come from the ranks' own
interpreter (``hvdtrain.launch.probe``, asked once), the rules are pure (``preflight``).
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from hvdtrain.errors import UserError, rebuild_the_stack
from hvdtrain.gpus import (cpu_allowed, given_gpus, gpu_build_problems, not_seen,
                           visible_devices)
from hvdtrain.launch.probe import ask
from hvdtrain.launch.options import LaunchOptions
from hvdtrain.launch.slurm import Allocation


@dataclass(frozen=True)
class Build:
    """What the installed horovod can do, probed in a child interpreter (TensorFlow is heavy)."""

    tensorflow: bool
    mpi: bool
    gloo: bool
    nccl: bool = False
    gpus: int = 0
    """GPUs TensorFlow lists on this node."""
    tensorflow_version: str = ""
    cuda: bool = False
    """TensorFlow was built with CUDA (tensorflow[and-cuda]), not tensorflow-cpu."""
    error: str | None = None
    """Why the horovod TensorFlow extension did not load (e.g. built against another TF)."""
    asked: str = "tensorflow"
    """Where the answer came from: "record" (horovod's build record, TensorFlow without GPU
    support: nothing imported) or "tensorflow" (imported)."""
    gpu_build: dict | None = None
    """What horovod's GPU build needs of a node (hvdtrain.gpus.GPU_BUILD_RECORD); None for a
    CPU build."""
    nvidia_gpus: tuple[str, ...] = ()
    """nvidia-smi's line for each GPU of this node (hvdtrain.gpus.NVIDIA_SMI_QUERY)."""


def probe(python: str, module: str | None, *, build: bool,
          on: Sequence[str] | None = None) -> Build | None:
    """Ask the ranks' interpreter, once, everything the launcher checks before the start (``on``:
    what runs it in the ranks' container); each start of it costs a second, and an import of
    TensorFlow several, before any rank runs.

    ``module``: refuse a module the ranks' ``python -m`` would not find (a mistyped name fails
    the same way on every attempt); None for a script. ``build``: what horovod was built with
    and the GPUs this node has (None without it). Asked about the module alone, a check that
    cannot finish in time, or a Python without hvdtrain, lets the ranks find out."""
    questions = (["build"] if build else []) + (["module", module] if module else [])
    if not questions:
        return None
    try:
        answers, stderr = ask(python, questions, timeout=300 if build else 60, on=on or (),
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except subprocess.TimeoutExpired:
        if not build:
            return None
        raise UserError(f"{python} did not answer the horovod build check in 300 s") from None
    except OSError as error:
        raise UserError(f"could not run {python}: {error.strerror or error}") from None
    if answers is None:
        if not build:
            return None
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"{python} cannot import hvdtrain/horovod: {tail}")
    if module and answers["module"]["missing"]:
        raise UserError(f"no module named {module!r} in the ranks' Python ({python}): check the "
                        "name, or pass a script path")
    if not build:
        return None
    return Build(**{**answers["build"], "nvidia_gpus": tuple(answers["build"].get("nvidia_gpus",
                                                                                 ()))})


def count_gpus_without_tensorflow() -> int:
    """This machine's NVIDIA GPUs, for --skip-preflight (the probe otherwise asks TensorFlow)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len(visible_devices(visible))
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.stdout.splitlines() if line.startswith("GPU "))


def preflight(build: Build, allocation: Allocation | None, np: int | None,
              options: LaunchOptions, *, running_as_root: bool,
              env: Mapping[str, str]) -> list[str]:
    """Everything that would make the launch fail, one line each (empty: go ahead)."""
    problems = []
    if not build.tensorflow:
        detail = f" ({build.error})" if build.error else ""
        if build.error and "undefined symbol" in build.error:
            detail = (" (its TensorFlow extension does not load: it was compiled against a "
                      f"different TensorFlow than the one installed: {build.error})")
        problems.append(f"horovod cannot run TensorFlow jobs{detail}; to rebuild it, "
                        f"{rebuild_the_stack()}")
    elif not (build.mpi or build.gloo):
        problems.append("horovod was built without a controller (neither MPI nor Gloo); to "
                        f"rebuild it, {rebuild_the_stack()}")
    elif options.controller == "gloo" and not build.gloo:
        problems.append("--controller gloo, but horovod was built without Gloo")
    elif (options.controller == "mpi" or options.via in ("mpirun", "srun")) and not build.mpi:
        problems.append(f"--via {options.via} needs horovod built with MPI; it was built without")
    if allocation is not None:
        if np is not None and np > allocation.num_tasks:
            problems.append(f"--np {np} but the Slurm allocation has {allocation.num_tasks} "
                            f"task(s) ({allocation.host_slots()}); ask sbatch for more tasks")
        gpus = allocation.gpus_per_host if allocation.gpus_per_host is not None else build.gpus
        if gpus and allocation.max_slots_per_host > gpus:
            problems.append(f"{allocation.max_slots_per_host} ranks per node but only {gpus} "
                            "GPU(s) per node; use --ntasks-per-node <= --gres=gpu:N")
    elif np is not None and build.gpus and np > build.gpus:
        problems.append(f"--np {np} but this machine has {build.gpus} GPU(s); one rank per GPU")
    if build.gpu_build and build.gpus:
        # horovod checks none of its own kernel launches: a build this node cannot run would
        # average stale memory without an error (docs/install.md).
        problems += gpu_build_problems(build.gpu_build, build.nvidia_gpus)
    given = given_gpus(env)
    if build.tensorflow and not build.gpus and given and not cpu_allowed(env):
        # TensorFlow's count, not Slurm's: the ranks would train on the CPU without a word.
        problems.append(not_seen(given, build.tensorflow_version, build.cuda))
    root_ok = env.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and \
        env.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"
    if running_as_root and options.via == "mpirun" and not (root_ok or options.allow_run_as_root):
        problems.append("running as root: OpenMPI refuses unless OMPI_ALLOW_RUN_AS_ROOT=1 and "
                        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set (or --allow-run-as-root)")
    return problems
