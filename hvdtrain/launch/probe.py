"""What the launcher asks the ranks' interpreter, run as a child process: before the start
``python -m hvdtrain.launch.probe build`` or ``... module NAME``; while the job runs, on another
host, ``... ranks MARKER`` (which ranks of an attempt still run there). ``ask`` is the
launcher's side.

Asked of ``--python``, which may be another interpreter than the launcher's, in the launcher's
working directory and environment, which the ranks inherit; it also keeps TensorFlow and a
user's packages out of the launcher. The answer is one line, ``MARKER {json}``, on stdout.
"""
from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys
from typing import Mapping, Sequence

MARKER = "HVDTRAIN_PROBE"


def build() -> dict:
    """What horovod was built with (TensorFlow, MPI, Gloo) and this node's GPU count."""
    from hvdtrain.errors import first_line

    result = {"tensorflow": False, "mpi": False, "gloo": False, "gpus": 0}
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


def module(name: str) -> dict:
    """Whether ``python -m NAME`` would find no module NAME (find_spec finds nothing, or a
    parent package is missing). A parent package that fails to import for another reason is
    left to the ranks, which report it in full."""
    try:
        missing = importlib.util.find_spec(name) is None
    except ModuleNotFoundError as error:
        missing = error.name is not None and (name + ".").startswith(error.name + ".")
    return {"missing": missing}


def ranks(marker: str) -> dict:
    """The ranks of one attempt (its ATTEMPT_VARIABLE=VALUE marker) still running on this host."""
    from hvdtrain.launcher_env import marked

    return {"ranks": sorted({process.rank for process in marked(marker, this_host_only=True)
                             if process.rank is not None})}


def ask(python: str, question: list[str], timeout: float,
        env: Mapping[str, str] | None = None,
        on: Sequence[str] = ()) -> tuple[dict | None, str]:
    """The launcher's side: the answer of ``python`` (None without one) and its stderr; ``on``:
    the command that runs it on another host (ssh, srun), which gets the probe as one string."""
    command = [python, "-m", "hvdtrain.launch.probe", *question]
    completed = subprocess.run([*on, shlex.join(command)] if on else command,
                               capture_output=True, text=True, timeout=timeout, env=env)
    for line in completed.stdout.splitlines():
        if line.startswith(MARKER + " "):
            return json.loads(line.removeprefix(MARKER + " ")), completed.stderr
    return None, completed.stderr


def main(argv: list[str]) -> None:
    questions = {"build": build, "module": module, "ranks": ranks}
    answer = questions[argv[0]](*argv[1:])
    print(f"{MARKER} {json.dumps(answer)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
