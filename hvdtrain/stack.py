"""What a stack hvdtrain did not install gives it: ``python -m hvdtrain.stack``.

``scripts/install.sh`` builds hvdtrain's own pinned stack. On a stack someone else built (an NGC
TensorFlow container, a site's modules) ``HVDTRAIN_STACK=existing`` installs hvdtrain alone,
without its dependencies (so that pip changes nothing of that stack), builds horovod against its
TensorFlow when it has none, and runs this check in the same interpreter: one line per problem
and exit status 2, or one line saying what was found. The facts come from the launcher's own probe (``launch.probe.build``:
horovod's TensorFlow extension, its controllers, the GPUs), plus the versions and the tools around
them; the rules (``problems``) are pure.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Sequence

from hvdtrain.cli import (TENSORFLOW_DISTRIBUTIONS, error_name, first_installed, installed_version,
                          usage_name)
from hvdtrain.errors import EXIT_USAGE, UserError
from hvdtrain.flags import OneLineParser
from hvdtrain.launch.probe import ask

#: The TensorFlow minors horovod is built and hvdtrain tested on (docs/stack.md has the matrix:
#: the whole suite on the newest, the distributed subset on the others).
TESTED_TENSORFLOW = ("2.18", "2.19", "2.20", "2.21")
#: hvdtrain selects Keras 2 with TF_USE_LEGACY_KERAS, which TensorFlow reads from 2.16 on.
OLDEST_TENSORFLOW = (2, 16)
#: What hvdtrain imports besides TensorFlow and horovod (setup.cfg; mpi4py for the horovod backend).
REQUIREMENTS = {"numpy": "numpy", "sklearn": "scikit-learn", "matplotlib": "matplotlib",
                "PIL": "pillow", "mpi4py": "mpi4py"}
PROGRAM = "hvdtrain.stack"


@dataclass(frozen=True)
class Stack:
    """What this interpreter has."""

    python: tuple[int, int]
    tensorflow: str | None
    tf_keras: str | None
    keras: str | None
    horovod: str | None
    horovod_error: str | None
    """Why horovod's TensorFlow extension did not load (built against another TensorFlow...)."""
    mpi: bool = False
    gloo: bool = False
    nccl: bool = False
    gpus: int = 0
    mpirun: str | None = None
    missing: tuple[str, ...] = ()
    """hvdtrain's own requirements that are not installed (their pip names)."""


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(char for char in minor if char.isdigit()) or 0)


def gather() -> Stack:
    """This interpreter's stack. horovod is loaded in a child, as a rank would load it: with
    Keras 2 when tf_keras is there, else Keras 3 (hvdtrain chooses at import)."""
    tensorflow = first_installed(TENSORFLOW_DISTRIBUTIONS)
    horovod, tf_keras = installed_version("horovod"), installed_version("tf_keras")
    built = {}
    if tensorflow and horovod:
        keras = {"HVDTRAIN_KERAS": "2" if tf_keras else "3", "TF_CPP_MIN_LOG_LEVEL": "3"}
        answer, stderr = ask(sys.executable, ["build"], timeout=300, env={**os.environ, **keras})
        built = (answer or {}).get("build") or {
            "error": (stderr.strip().splitlines() or ["no answer"])[-1]}
    return Stack(python=sys.version_info[:2], tensorflow=tensorflow, tf_keras=tf_keras,
                 keras=installed_version("keras"), horovod=horovod, horovod_error=built.get("error"),
                 mpi=built.get("mpi", False), gloo=built.get("gloo", False),
                 nccl=built.get("nccl", False), gpus=built.get("gpus", 0),
                 mpirun=shutil.which("mpirun"),
                 missing=tuple(name for module, name in REQUIREMENTS.items()
                               if importlib.util.find_spec(module) is None))


def problems(stack: Stack) -> list[str]:
    """What keeps hvdtrain's horovod path from running on this stack, one line each."""
    found = []
    if not (3, 10) <= stack.python <= (3, 12):
        found.append(f"Python {stack.python[0]}.{stack.python[1]}: hvdtrain runs on 3.10-3.12")
    if stack.tensorflow is None:
        found.append("no TensorFlow in this environment: use the stack's own Python (the one "
                     "`import tensorflow` works in), or hvdtrain's install (HVDTRAIN_STACK unset)")
        return found
    tensorflow = _minor(stack.tensorflow)
    if tensorflow < OLDEST_TENSORFLOW:
        found.append(f"TensorFlow {stack.tensorflow}: hvdtrain needs 2.16 or newer (its Keras "
                     "selection, TF_USE_LEGACY_KERAS)")
    if stack.tf_keras and _minor(stack.tf_keras) != tensorflow:
        found.append(f"tf_keras {stack.tf_keras} beside TensorFlow {stack.tensorflow}: they must "
                     f"match: pip install --no-deps 'tf_keras=={tensorflow[0]}.{tensorflow[1]}.*'")
    if stack.tf_keras is None and (stack.keras is None or _minor(stack.keras) < (3, 0)):
        found.append(f"no Keras hvdtrain can use: pip install 'keras>=3' (the default), or "
                     f"--no-deps 'tf_keras=={tensorflow[0]}.{tensorflow[1]}.*' for --keras 2")
    rebuild = ("HOROVOD_WITH_TENSORFLOW=1 pip install --no-build-isolation --no-cache-dir "
               "horovod==0.28.1")
    if stack.horovod is None:
        found.append(f"no horovod in this environment: {rebuild} (with "
                     "HOROVOD_GPU_OPERATIONS=NCCL on GPUs), or an image that has it")
    elif stack.horovod_error:
        found.append(f"horovod {stack.horovod} does not load with TensorFlow {stack.tensorflow} "
                     f"({stack.horovod_error}): rebuild it against this TensorFlow: {rebuild}")
    else:
        if not (stack.mpi or stack.gloo):
            found.append(f"horovod {stack.horovod} has neither MPI nor Gloo: rebuild it with "
                         "HOROVOD_WITH_MPI=1 or HOROVOD_WITH_GLOO=1")
        if stack.mpi and not stack.gloo and stack.mpirun is None:
            found.append("horovod has only MPI, and there is no mpirun on PATH: load the MPI "
                         "module it was built with")
        if stack.gpus and not stack.nccl:
            found.append(f"{stack.gpus} GPU(s) here, but horovod was built without NCCL: "
                         "gradients would be averaged through host memory; rebuild with "
                         "HOROVOD_GPU_OPERATIONS=NCCL")
    if stack.missing:
        found.append(f"hvdtrain's own requirements are missing: pip install "
                     f"{' '.join(stack.missing)}")
    return found


def describe(stack: Stack) -> str:
    """The stack in one line, with what it was not tested on."""
    keras = (f"Keras {stack.keras}" + (f" + tf_keras {stack.tf_keras}" if stack.tf_keras
                                       else " (no tf_keras: no --keras 2)"))
    if stack.keras is None or _minor(stack.keras) < (3, 0):
        keras = f"tf_keras {stack.tf_keras} only (run with --keras 2)"
    controllers = [name for name, built in (("MPI", stack.mpi), ("Gloo", stack.gloo),
                                            ("NCCL", stack.nccl)) if built]
    line = (f"TensorFlow {stack.tensorflow}, {keras}, horovod {stack.horovod} "
            f"({' + '.join(controllers)}), {stack.gpus} GPU(s)")
    if ".".join(map(str, _minor(stack.tensorflow))) not in TESTED_TENSORFLOW:
        line += (f"; hvdtrain's tests run on TensorFlow {TESTED_TENSORFLOW[0]}-"
                 f"{TESTED_TENSORFLOW[-1]} only")
    return line


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=usage_name(PROGRAM),
        description="Check that this Python's TensorFlow, Keras, horovod (its TensorFlow "
                    "extension and controllers), MPI and GPUs work together for hvdtrain: one "
                    "line per problem and exit status 2, or one line saying what was found. "
                    "scripts/install.sh runs it on a stack it did not build "
                    "(HVDTRAIN_STACK=existing).")
    try:
        parser.parse_args(argv)
    except UserError as error:
        print(f"{error_name(PROGRAM)}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    stack = gather()
    found = problems(stack)
    for problem in found:
        print(f"{PROGRAM}: {problem}", file=sys.stderr)
    if found:
        return EXIT_USAGE
    print(f"{PROGRAM}: ok: {describe(stack)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
