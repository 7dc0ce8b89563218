"""The launcher's options: one dataclass whose fields are its flags, the rules on their values
(``check_options``, run once before anything starts), and what every rank runs.

Each field of ``LaunchOptions`` is a flag of the same name, its docstring the flag's help
(``hvdtrain.flags``, as for the training flags), so a new option is one documented field.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
import typing
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

from hvdtrain import default_keras
from hvdtrain.cli import usage_name
from hvdtrain.errors import UserError
from hvdtrain.flags import OneLineParser, ProseHelpFormatter, add_flag, field_docs
from hvdtrain.launch.console import PROGRAM
from hvdtrain.launch.netcheck import is_interface_name

Via = Literal["horovodrun", "mpirun", "srun"]
#: What can start the ranks (one entry each in ``hvdtrain.launch.paths.LAUNCH_PATHS``).
VIAS: tuple[str, ...] = typing.get_args(Via)
#: What --health-check runs on every rank.
HEALTH_PROGRAM = "hvdtrain.health"
#: A name ``python -m`` can run: dotted identifiers.
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class LaunchOptions:
    """What every rank runs and how the ranks start: the launcher's flags of the same names."""

    program: str
    """What every rank runs: a module (hvdtrain.cnn, run as python -m) or a script path
    (train.py, or any path with a /: run as a script)."""
    program_args: tuple[str, ...] = ()
    """Arguments for the module or script, each passed as its own argv entry."""
    np: int | None = None
    """Number of ranks (default: the allocation's tasks, else this machine's GPUs, else 1)."""
    via: Via = "horovodrun"
    """What starts the ranks."""
    controller: Literal["mpi", "gloo"] | None = None
    """Horovod's controller (horovodrun only; default: horovodrun's choice, MPI)."""
    python: str = sys.executable
    """Interpreter of the ranks (default: this one)."""
    keras: Literal["auto", "2", "3"] = "auto"
    """The Keras of the ranks: 3 (TensorFlow's own: a script runs as is, horovod's TensorFlow
    and Keras APIs with hvdtrain's build of horovod, and hvdtrain's jobs use hvdtrain's own
    horovod integration) or 2 (tf_keras: a script runs through hvdtrain.script, which selects
    it). auto: 2 for a script written for Keras 2 (it imports tf_keras or horovod.keras, calls
    an optimizer's variables(), or passes experimental_run_tf_function), else what `import
    keras` gives here (3, or 2 under TF_USE_LEGACY_KERAS=1). Every rank gets HVDTRAIN_KERAS set
    to the choice, whatever the launcher's environment holds."""
    dry_run: bool = False
    """Print the command and environment, start nothing."""
    skip_preflight: bool = False
    """Don't check horovod's build, the GPUs and the network first (saves ~3 s)."""
    max_restarts: int = 0
    """Start a failed job (a rank died or crashed) again in the same allocation up to this many
    times, a few seconds apart; not after a user error (exit 2), a preemption stop (75) or a
    stop signal (docs/failures.md has the exit statuses)."""
    startup_timeout: float = 300.0
    """Seconds the launch command (mpirun, horovodrun, srun) may run on rank 0's host without
    starting a rank there; then the attempt ends in one line (a node it never reached) and
    counts as a failure for --max-restarts. A rank counts from its fork, before Python starts:
    TensorFlow's import and a Charliecloud image's start are not in it (a pyxis image import
    would be: no deadline with pyxis). 0: wait forever."""
    min_nodes: int = 0
    """With --max-restarts, on several hosts (--hosts, or the nodes of a Slurm allocation):
    after a failure, drop the hosts that no longer answer (ssh, or an srun step inside an
    allocation) and restart on the rest (every slot of theirs, from the last checkpoint) when at
    least this many are left; fewer: end with one line (docs/failures.md). 0: off."""
    health_check: bool = False
    """Before the job, run hvdtrain.health on every rank through the same launch: each node's
    GPUs (or CPU share), the links between nodes, the same numbers on every rank; a failure ends
    the launch with its lines and exit 2, a slow link is a warning."""
    health_check_only: bool = False
    """Run that check and nothing else (then MODULE|SCRIPT may be left out): a quick test of an
    allocation or a set of hosts."""
    sbatch: bool = False
    """Run as the body of an sbatch script (the templates in slurm/ exec this): the HVDTRAIN_*
    variables given at submission override these flags (each template lists them), the
    run directory defaults to runs/<job name>-<job id>, and a job the ranks stopped for requeue
    (exit 75, after Slurm's time-limit warning) is requeued with scontrol."""
    max_requeues: int = 3
    """With --sbatch: requeues after which a preempted job stops instead (SLURM_RESTART_COUNT,
    which counts Slurm's own requeues too)."""
    timeline_filename: str | None = None
    """Write a Horovod timeline to this file (chrome://tracing)."""
    autotune: bool = False
    """Let horovod tune the fusion buffer and cycle time."""
    autotune_log_file: str | None = None
    """Where horovod's autotuner logs what it tried."""
    fusion_threshold_mb: float | None = None
    """Tensor fusion buffer in MiB (horovod's default: 128)."""
    cycle_time_ms: float | None = None
    """Horovod background thread cycle in ms (horovod's default: 1)."""
    hierarchical_allreduce: bool = False
    """Average within each node first, then across nodes, then within again
    (HOROVOD_HIERARCHICAL_ALLREDUCE, as horovodrun's flag): one inter-node transfer per node
    instead of one per GPU, often faster on nodes of 4-8 GPUs."""
    stall_check_warning_seconds: int | None = None
    """Warn when a rank has not joined a collective for this long."""
    stall_check_shutdown_seconds: int | None = None
    """End the job when a rank has stalled for this long."""
    stall_check: bool = True
    """Horovod's stall check (--no-stall-check turns it off)."""
    binding_args: str | None = None
    """Process binding arguments for mpirun/srun, one string ('--bind-to core --map-by
    socket')."""
    allow_run_as_root: bool = False
    """Let mpirun start as root (horovodrun does this itself)."""
    hosts: str | None = None
    """Outside Slurm: the hosts and ranks per host, node1:2,node2:2 (reached over passwordless
    ssh, as horovodrun does); inside an allocation Slurm's hosts are used."""
    network_interface: str | None = None
    """The interface(s) the ranks talk over, eth0 or eth0,ib0 (default: the ones the network
    check finds connecting every host; passed to horovodrun, mpirun's btl/oob_tcp_if_include,
    Gloo and NCCL)."""
    container: str | None = None
    """Run every rank in this container image (with --via srun): a SquashFS file or an image
    directory for Charliecloud, or what pyxis takes (./image.sqsh, docker://...). The job's files
    are seen at the same paths (docs/containers.md)."""
    container_runtime: Literal["auto", "charliecloud", "pyxis"] = "auto"
    """How --container runs: pyxis where srun has --container-image, else Charliecloud's
    ch-run for every rank (docs/containers.md)."""
    container_python: str = "python"
    """The ranks' interpreter inside --container (the image's python on its PATH)."""


#: Where --help starts a new section (at this field), and the one short flag.
_SECTIONS = {"sbatch": "in an sbatch script",
             "timeline_filename": "horovod tuning (passed to every rank)",
             "hosts": "several hosts",
             "container": "containers (Slurm's pyxis, or Charliecloud)"}
_SHORT_FLAGS = {"hosts": "-H", "np": "-np"}  # horovodrun's and mpirun's spellings
_POSITIONAL = ("program", "program_args")


def shell_words(text: str, what: str) -> list[str]:
    """``text`` split as a shell would, or one line naming ``what`` and why it cannot be (an
    unclosed quote)."""
    try:
        return shlex.split(text)
    except ValueError as error:
        raise UserError(f"{what}: {error}") from None


def parse_options(argv: Sequence[str] | None, description: str) -> LaunchOptions:
    parser = OneLineParser(
        prog=usage_name(PROGRAM), description=description, formatter_class=ProseHelpFormatter,
        usage="%(prog)s [options] [--] MODULE|SCRIPT.py [arguments...]")
    docs = field_docs(LaunchOptions)
    section = parser
    for field in dataclasses.fields(LaunchOptions):
        if field.name in _POSITIONAL:
            continue
        if field.name in _SECTIONS:
            section = parser.add_argument_group(_SECTIONS[field.name])
        add_flag(section, LaunchOptions, field, field.default, docs[field.name],
                 short=_SHORT_FLAGS.get(field.name))
    parser.add_argument("program", nargs="?", help=docs["program"])
    parser.add_argument("program_args", nargs=argparse.REMAINDER, help=docs["program_args"])
    args = vars(parser.parse_args(argv))
    if args["program"] is None:
        if not args["health_check_only"]:
            parser.error("the following arguments are required: MODULE|SCRIPT")
        args["program"] = HEALTH_PROGRAM
    return LaunchOptions(**{**args, "program_args": tuple(args["program_args"])})


def check_options(options: LaunchOptions, allocation_hosts: Sequence[str] | None) -> None:
    """Every rule on the values of the launch options, checked once before anything starts: a
    ``UserError`` (one line) for the first one broken. ``allocation_hosts``: the hosts of the
    Slurm allocation the launcher runs in, None outside one. What only the live system can tell
    (horovod's build, the GPUs, a host that does not answer, what srun offers) is asked where
    the launcher asks the system."""
    if options.via not in VIAS:
        raise UserError(f"--via must be one of {', '.join(VIAS)}, got {options.via!r}")
    if is_script_path(options.program):
        if not os.path.isfile(options.program):
            raise UserError(f"no such script: {options.program} (a script path runs as `python "
                            "PATH`, a module name like hvdtrain.cnn as `python -m MODULE`)")
    elif not MODULE_NAME.fullmatch(options.program):
        raise UserError(f"{options.program!r} is neither a module name (like hvdtrain.cnn) nor "
                        "a script path (like train.py)")
    if options.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    if options.max_requeues < 0:
        raise UserError(f"--max-requeues must be 0 or more, got {options.max_requeues}")
    # Also with --skip-preflight: 0 would read as "unset" (one rank), -2 reach horovodrun.
    if options.np is not None and options.np < 1:
        raise UserError(f"--np must be at least 1, got {options.np}")
    if options.startup_timeout < 0:
        raise UserError(f"--startup-timeout must be 0 (none) or more, got "
                        f"{options.startup_timeout:g}")
    # Horovod takes whatever its variables say (a negative fusion buffer, a cycle of -1 ms):
    # each must be a finite number; a shutdown limit of 0 is horovod's "never".
    for flag, value, least in (("--fusion-threshold-mb", options.fusion_threshold_mb, 0),
                               ("--cycle-time-ms", options.cycle_time_ms, 0),
                               ("--stall-check-warning-seconds",
                                options.stall_check_warning_seconds, 1),
                               ("--stall-check-shutdown-seconds",
                                options.stall_check_shutdown_seconds, 0)):
        if value is not None and not (math.isfinite(value) and value >= least):
            raise UserError(f"{flag} must be a number >= {least}, got {value}")
    if options.controller == "gloo":
        if options.via != "horovodrun":
            raise UserError("--controller gloo needs --via horovodrun (it runs the Gloo "
                            "rendezvous)")
        if options.max_restarts:
            # A restart must never repeat a user error (exit 2), and Gloo's horovodrun reports
            # it as 1.
            raise UserError("--max-restarts needs the ranks' exit statuses, which horovodrun "
                            "--gloo reports as 1 whatever they were; use --controller mpi")
        if options.health_check or options.health_check_only:
            raise UserError("--health-check talks MPI between the ranks: use --controller mpi")
    if options.via == "srun" and allocation_hosts is None:
        raise UserError("--via srun needs a Slurm allocation (run it inside sbatch/salloc)")
    if options.container and options.via != "srun":
        # mpirun's daemons and horovodrun's ssh start ranks on the hosts themselves, outside
        # any image; srun is what pyxis and ch-run --join are made for.
        raise UserError(f"--container needs --via srun (got --via {options.via})")
    if options.hosts is not None:
        if allocation_hosts is not None:
            raise UserError("--hosts is for outside Slurm; inside an allocation the ranks go "
                            "where Slurm put the tasks (ask sbatch for other nodes instead)")
        parse_hosts(options.hosts)
    # An interface name goes on to horovodrun, which formats it into a /bin/sh -c command.
    for name in options.network_interface.split(",") if options.network_interface else ():
        if not is_interface_name(name):
            raise UserError(f"--network-interface: {name!r} is no network interface name (1 to "
                            "15 of A-Z a-z 0-9 _ . @ -, not starting with -); `ip -br link` "
                            "lists this host's")
    shell_words(options.binding_args or "", f"--binding-args {options.binding_args!r}")
    if options.min_nodes:
        # --min-nodes can only do what it says on several hosts, with restarts.
        if options.min_nodes < 0:
            raise UserError(f"--min-nodes must be 1 or more, got {options.min_nodes}")
        if allocation_hosts is None and options.hosts is None:
            raise UserError("--min-nodes needs several hosts: --hosts, or a Slurm allocation")
        if not options.max_restarts:
            raise UserError("--min-nodes restarts the job on the hosts left: give "
                            "--max-restarts too (each restart counts, whatever its cause)")
        count = len(allocation_hosts) if allocation_hosts is not None \
            else len(parse_hosts(options.hosts))
        if options.min_nodes > count:
            where = f"the allocation's {count} node(s)" if allocation_hosts is not None else \
                f"the {count} host(s) of --hosts {options.hosts}"
            raise UserError(f"--min-nodes {options.min_nodes} is more than {where}")


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """horovodrun's -H syntax, 'node1:2,node2:2' (a host without a count has 1 slot)."""
    parsed = []
    for item in text.split(","):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?::(\d+))?", item.strip())
        if not match or (match.group(2) is not None and int(match.group(2)) == 0):
            raise UserError(f"--hosts {text!r}: give HOST:RANKS,HOST:RANKS (e.g. node1:2,node2:2)")
        parsed.append((match.group(1), int(match.group(2) or 1)))
    if len({host for host, _ in parsed}) != len(parsed):
        raise UserError(f"--hosts {text!r} names a host twice")
    return parsed


def host_slots(hosts: list[tuple[str, int]]) -> str:
    """The -H syntax for (host, ranks) pairs: 'node1:2,node2:2' (parse_hosts' inverse)."""
    return ",".join(f"{host}:{slots}" for host, slots in hosts)


def is_script_path(program: str) -> bool:
    """The script-or-module rule: a program names a script when it ends in .py, has a directory
    part or is an existing file; anything else is a module name."""
    return program.endswith(".py") or os.sep in program or os.path.isfile(program)


#: What only Keras 2 runs in a script, and how the launcher's note says it: an import of tf_keras
#: or of ``horovod.keras`` (horovod's API for the standalone keras 2 package); a call of
#: ``variables()``, a method of Keras 2's optimizers and a list in Keras 3 (horovod's own TF2
#: examples broadcast ``opt.variables()``); ``experimental_run_tf_function``, a Keras 2 compile
#: argument that Keras 3's compile refuses (horovod's tensorflow2_keras_mnist.py passes it).
#: horovod.tensorflow and horovod.tensorflow.keras scripts without any of these run on Keras 3
#: with hvdtrain's build of horovod (patches 0005 and 0006).
_KERAS_2_ONLY = (
    (re.compile(r"^\s*(?:import|from)\s+(?:horovod\.keras|tf_keras)\b", re.MULTILINE),
     "imports tf_keras or horovod.keras"),
    (re.compile(r"\.variables\(\)"), "calls variables(), Keras 2's optimizer method (a list "
                                       "in Keras 3)"),
    (re.compile(r"\bexperimental_run_tf_function\b"), "passes experimental_run_tf_function, a "
                                                        "Keras 2 compile argument"),
)


def keras_2_reason(program: str) -> str | None:
    """Why a script runs on Keras 2 only (see _KERAS_2_ONLY), or None."""
    if not (is_script_path(program) and os.path.isfile(program)):
        return None
    try:
        with open(program, encoding="utf-8", errors="replace") as script:
            text = script.read()
    except OSError:
        return None  # check_options says why the script cannot be run
    return next((reason for pattern, reason in _KERAS_2_ONLY if pattern.search(text)), None)


def ranks_keras(options: LaunchOptions, env: Mapping[str, str]) -> str:
    """The Keras every rank selects ("2" or "3"): --keras, or for auto the script's own need
    (``keras_2_reason``), else what ``import keras`` gives in ``env``."""
    if options.keras != "auto":
        return options.keras
    return "2" if keras_2_reason(options.program) else default_keras(env)


def program_command(options: LaunchOptions, env: Mapping[str, str] = os.environ) -> list[str]:
    """What every rank runs: `python -m hvdtrain.script script.py args` (or on Keras 3
    `python script.py args`) or `python -m module args`.

    The ranks start in the launcher's working directory (horovodrun, mpirun and srun all keep
    it), so a relative script path means the same there as here.
    """
    python = options.container_python if options.container else options.python
    if is_script_path(options.program):
        if ranks_keras(options, env) == "3":
            return [python, options.program, *options.program_args]
        # A script written for Keras 2 (see _KERAS_2_ONLY): hvdtrain.script selects it, then
        # runs the script exactly as `python script.py args` would.
        return [python, "-m", "hvdtrain.script", options.program, *options.program_args]
    return [python, "-m", options.program, *options.program_args]


def run_dir_of(options: LaunchOptions, env: Mapping[str, str]) -> str | None:
    """The job's run directory when the launcher can tell: the last --run-dir among a module's
    arguments (argparse's rule), else HVDTRAIN_RUN_DIR (a script's, from the sbatch templates)."""
    run_dir = None
    if not is_script_path(options.program):
        args = options.program_args
        for index, arg in enumerate(args):
            if arg == "--run-dir" and index + 1 < len(args):
                run_dir = args[index + 1]
            elif arg.startswith("--run-dir="):
                run_dir = arg.split("=", 1)[1]
    return run_dir or env.get("HVDTRAIN_RUN_DIR") or None
