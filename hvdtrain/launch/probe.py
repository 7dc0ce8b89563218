"""What the launcher asks the ranks' interpreter, run as a child process: before the start
``python -m hvdtrain.launch.probe build module NAME`` (both questions, one interpreter); while the
job runs, on another host, ``... ranks MARKER`` (which ranks of an attempt still run there).
``ask`` is the launcher's side.

Asked of ``--python``, which may be another interpreter than the launcher's, in the launcher's
working directory and environment, which the ranks inherit; it also keeps TensorFlow and a
user's packages out of the launcher. The answer is one line, ``MARKER {json}``, on stdout: each
question's answer under its name.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from typing import Mapping, Sequence

MARKER = "HVDTRAIN_PROBE"


def build() -> dict:
    """What horovod was built with (TensorFlow, MPI, Gloo, NCCL) and the GPUs TensorFlow lists on
    this node; ``asked`` says where the answer came from.

    TensorFlow takes seconds to import, and horovodrun, then every rank, import it again. So
    when the answer is certain without it, it is not imported: horovod's build record (patch
    0004, written by the install's ``horovodrun --check-build``) is current, and this TensorFlow
    is a build without CUDA or ROCm, which lists no GPU whatever the node has. A GPU build (only
    TensorFlow itself can say which GPUs it can use), or no current record, imports it once.
    """
    recorded = recorded_build()
    return {**(recorded if recorded is not None else imported_build()), **gpu_build()}


def imported_build() -> dict:
    """``build``'s answer from TensorFlow and horovod themselves (both imported)."""
    from hvdtrain.errors import first_line

    result = {"tensorflow": False, "mpi": False, "gloo": False, "gpus": 0, "asked": "tensorflow"}
    try:
        import tensorflow as tf

        result["gpus"] = len(tf.config.list_physical_devices("GPU"))
        result["tensorflow_version"] = tf.__version__
        result["cuda"] = tf.test.is_built_with_cuda()
        from hvdtrain.runtime.horovod import build_info

        result.update(build_info())
    except Exception as error:  # any import failure is the answer, reported by the launcher
        result["error"] = f"{type(error).__name__}: {first_line(error)}"
    return result


def gpu_build() -> dict:
    """What horovod's GPU build needs (its record, ``hvdtrain.gpus.GPU_BUILD_RECORD``) and what
    this node's ``nvidia-smi`` says of its GPUs; {} for a CPU build (no record). Read, not
    imported: the launcher's preflight holds one against the other."""
    from hvdtrain.gpus import GPU_BUILD_RECORD, NVIDIA_SMI_QUERY

    horovod = importlib.util.find_spec("horovod")
    if horovod is None or not horovod.submodule_search_locations:
        return {}
    path = os.path.join(horovod.submodule_search_locations[0], "tensorflow", GPU_BUILD_RECORD)
    try:
        with open(path) as record_file:
            record = json.load(record_file)
    except (OSError, ValueError):
        return {}
    try:
        listing = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True, timeout=30)
        gpus = listing.stdout.splitlines() if listing.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    return {"gpu_build": record, "nvidia_gpus": gpus}


def recorded_build() -> dict | None:
    """``build``'s answer without importing TensorFlow, or None when only an import can give it
    (see ``from_record``)."""
    from hvdtrain.cli import TENSORFLOW_DISTRIBUTIONS, first_installed

    tensorflow = importlib.util.find_spec("tensorflow")
    if tensorflow is None:
        return None
    info = tensorflow_build_info(os.path.dirname(tensorflow.origin))
    if info is None:
        return None
    # horovod's own reader of its record (patch 0004): only the runtime runs horovod; this reads
    # a file horovod wrote and loads none of its extensions. A horovod that does not import, or
    # one without the patch, is left to the full check, which reports what is wrong.
    try:
        from horovod.common.util import recorded_build_checks
    except Exception:  # noqa: BLE001 - any failure: the import path says it in full
        return None
    return from_record(info, recorded_build_checks("tensorflow"),
                       first_installed(TENSORFLOW_DISTRIBUTIONS) or "")


def tensorflow_build_info(package_dir: str) -> dict | None:
    """TensorFlow's own build facts (what ``tf.sysconfig.get_build_info()`` returns), from the
    generated file it reads, loaded by path: by name it would import TensorFlow first."""
    path = os.path.join(package_dir, "python", "platform", "build_info.py")
    try:
        spec = importlib.util.spec_from_file_location("_tensorflow_build_info", path)
        info = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(info)
        return dict(info.build_info)
    except (OSError, AttributeError, SyntaxError, TypeError):
        return None


def from_record(tensorflow_build: Mapping, checks: Mapping | None,
                tensorflow_version: str) -> dict | None:
    """``build``'s answer from horovod's build record (``checks``, None: missing or stale) and
    TensorFlow's build facts, or None when TensorFlow must be asked: a CUDA or ROCm build, whose
    GPU count only its import can tell (a CPU build lists none, whatever the node has)."""
    if checks is None or tensorflow_build.get("is_cuda_build") \
            or tensorflow_build.get("is_rocm_build"):
        return None
    return {"tensorflow": bool(checks["built"]), "mpi": bool(checks["built with MPI"]),
            "gloo": bool(checks["built with Gloo"]), "nccl": bool(checks["built with NCCL"]),
            "gpus": 0, "cuda": False, "tensorflow_version": tensorflow_version, "asked": "record"}


def module(name: str) -> dict:
    """Whether ``python -m NAME`` would find no module NAME (find_spec finds nothing, or a
    parent package is missing). A parent package that fails to import for another reason is
    left to the ranks, which report it in full."""
    try:
        missing = importlib.util.find_spec(name) is None
    except ModuleNotFoundError as error:
        missing = error.name is not None and (name + ".").startswith(error.name + ".")
    return {"missing": missing}


def ranks(marker: str) -> list[int]:
    """The ranks of one attempt (its ATTEMPT_VARIABLE=VALUE marker) still running on this host."""
    from hvdtrain.launcher_env import marked

    return sorted({process.rank for process in marked(marker, this_host_only=True)
                   if process.rank is not None})


def ask(python: str, questions: list[str], timeout: float,
        env: Mapping[str, str] | None = None,
        on: Sequence[str] = ()) -> tuple[dict | None, str]:
    """The launcher's side: every answer of ``python`` by question (None without an answer) and
    its stderr; ``questions``: names, each followed by its argument if it takes one
    (``["build", "module", "hvdtrain.cnn"]``); ``on``: the command that runs it on another host
    (ssh, srun), which gets the probe as one string."""
    command = [python, "-m", "hvdtrain.launch.probe", *questions]
    completed = subprocess.run([*on, shlex.join(command)] if on else command,
                               capture_output=True, text=True, timeout=timeout, env=env)
    for line in completed.stdout.splitlines():
        if line.startswith(MARKER + " "):
            return json.loads(line.removeprefix(MARKER + " ")), completed.stderr
    return None, completed.stderr


#: Each question and how many arguments follow its name.
QUESTIONS = {"build": (build, 0), "module": (module, 1), "ranks": (ranks, 1)}


def main(argv: list[str]) -> None:
    answers = {}
    while argv:
        question, arguments = QUESTIONS[argv[0]]
        answers[argv[0]] = question(*argv[1:1 + arguments])
        argv = argv[1 + arguments:]
    print(f"{MARKER} {json.dumps(answers)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
