"""The `hvdtrain` command: `hvdtrain COMMAND [flags]` (or `python -m hvdtrain COMMAND`), one
entry point for every tool.

Each command is a module that also runs as `python -m MODULE` (what the launcher starts on every
rank). Nothing here imports TensorFlow: `hvdtrain --help`, `--version` and every command's
`--help` answer at once, on a machine without the stack too.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import subprocess
import sys
from typing import Sequence

from hvdtrain.errors import EXIT_USAGE, checkout_top

#: command -> (the module it runs, what it does). The first word of the help is the module's.
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("hvdtrain.cnn", "train the image classifier (a built-in network or your own)"),
    "autoencoder": ("hvdtrain.autoencoder", "train the convolutional autoencoder"),
    "launch": ("hvdtrain.launch", "start a job's ranks (horovodrun, mpirun or srun), pass "
                                  "signals on, restart"),
    "slurm": ("hvdtrain.slurm", "write an sbatch script (or the shipped templates)"),
    "examples": ("hvdtrain.shipped", "write the shipped examples (a model file, a job through "
                                     "the API) into a directory"),
    "evaluate": ("hvdtrain.evaluate", "score a run's model (classifier, autoencoder) over its "
                                      "validation split or other data, every sample once, on "
                                      "any number of ranks"),
    "predict": ("hvdtrain.predict", "a run's model over an image folder, a list of files or "
                                    "TFRecords: one row per input, in order, on any number of "
                                    "ranks"),
    "export": ("hvdtrain.export", "write a run directory's model as a SavedModel that serves "
                                  "(no horovod ops)"),
    "convert": ("hvdtrain.tfrecords", "convert an image folder into TFRecord shards"),
    "stack": ("hvdtrain.stack", "check that TensorFlow, Keras, horovod and MPI work together"),
    "health": ("hvdtrain.health", "the pre-job health check of the nodes (run by `launch "
                                  "--health-check`)"),
    "gpu-check": ("hvdtrain.gpucheck", "the acceptance run for a new GPU node: build, driver, "
                                       "health check, jobs under both Kerases, one table"),
}
#: Other names a command answers to: the modules' own.
ALIASES = {"cnn": "train", "tfrecords": "convert", "gpucheck": "gpu-check"}
COMMAND = "hvdtrain"

_invoked_as: dict[str, str] = {}  # module -> "hvdtrain COMMAND", for the running command


def usage_name(module: str) -> str:
    """How a command's usage line names it: `hvdtrain COMMAND` when started through this
    command, else `python -m MODULE`."""
    return _invoked_as.get(module, f"python -m {module}")


def error_name(module: str) -> str:
    """How a command's errors name it: `hvdtrain COMMAND` when started through this command,
    else the module."""
    return _invoked_as.get(module, module)


def started_as_command(module: str) -> bool:
    return module in _invoked_as


def versions() -> str:
    """hvdtrain's version (and commit, in a checkout) and the installed stack's, read from the
    installed distributions' metadata: nothing is imported."""
    import hvdtrain

    line = f"hvdtrain {hvdtrain.__version__}"
    commit = _checkout_commit()
    if commit:
        line += f" (commit {commit})"
    for label, distributions in (("TensorFlow", TENSORFLOW_DISTRIBUTIONS),
                                 ("Keras", ("keras",)), ("tf_keras", ("tf_keras",)),
                                 ("horovod", ("horovod",))):
        line += f", {label} {first_installed(distributions) or 'not installed'}"
    return line + f", Python {sys.version.split()[0]}"


#: The names TensorFlow is installed under (one of them per environment).
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-gpu")


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (from its metadata: nothing imported)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def first_installed(distributions: tuple[str, ...]) -> str | None:
    """The version of the first of ``distributions`` that is installed (a package installed
    under one of several names, as TensorFlow is)."""
    return next(filter(None, map(installed_version, distributions)), None)


def _checkout_commit() -> str | None:
    top = checkout_top()
    if top is None or not os.path.exists(os.path.join(top, ".git")):
        return None
    try:
        result = subprocess.run(["git", "-C", top, "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def help_text() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"usage: {COMMAND} COMMAND [flags]  ({COMMAND} COMMAND --help: its flags)", "",
             "Data-parallel TensorFlow/Keras training on 1 to many GPUs with horovod.", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "options:", f"  {'--version':<{width}}  hvdtrain's version and the stack's",
              f"  {'--help':<{width}}  this list", "",
              "Each command also runs as `python -m MODULE` ("
              + "".join(f"{name}: {module}, " for name, (module, _) in COMMANDS.items()
                        if module != f"{COMMAND}.{name}")
              + f"the others {COMMAND}.NAME).",
              "Docs: docs/cli.md (every flag), README.md."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(help_text())
        sys.exit(0 if args else EXIT_USAGE)
    if args[0] == "--version":
        print(versions())
        sys.exit(0)
    name = ALIASES.get(args[0], args[0])
    if name not in COMMANDS:
        close = difflib.get_close_matches(args[0], [*COMMANDS, *ALIASES], n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"{COMMAND}: error: no command {args[0]!r}{hint} (commands: "
              f"{', '.join(COMMANDS)}; {COMMAND} --help)", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    module_name = COMMANDS[name][0]
    _invoked_as[module_name] = f"{COMMAND} {name}"
    module = importlib.import_module(module_name if module_name != "hvdtrain.launch"
                                     else "hvdtrain.launch.__main__")
    # Each module's main(argv) exits with the command's status (stack's returns it).
    sys.exit(module.main(args[1:]) or 0)
