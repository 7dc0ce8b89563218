"""Everything hvdtrain knows about Slurm: reading an allocation, and writing sbatch scripts.

* ``Allocation.from_env`` maps the ``SLURM_*`` variables of a job to hosts, tasks and GPUs per host
  (the node list expanded in Python, as ``scontrol show hostnames`` would, so the launcher needs
  no Slurm command inside a container). The launcher uses it; training code never reads ``SLURM_*``.
* ``SbatchJob`` + ``render`` write a complete, commented sbatch script. The templates shipped in
  ``slurm/`` are exactly what ``render`` produces for ``TEMPLATES`` (a golden-file test keeps them in
  step); ``python -m hvdtrain.slurm render ...`` writes a custom one.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import shlex
import sys
import textwrap
from dataclasses import MISSING, dataclass, fields
from typing import Mapping, Sequence

from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import UserError, reported
from hvdtrain.flags import FlagHelpFormatter, OneLineParser, field_docs
from hvdtrain.launch.options import MODULE_NAME, VIAS
from hvdtrain.shipped import write_new_files

#: The public name, ``python -m hvdtrain.slurm`` (hvdtrain/slurm.py runs ``main``).
PROGRAM = "hvdtrain.slurm"


# --- reading an allocation -------------------------------------------------------------------------
def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm's hostlist syntax expanded, as ``scontrol show hostnames`` does, in Python: inside a
    container (Enroot/pyxis, Apptainer, Charliecloud) ``scontrol`` is usually missing.

    ``node[1-3,7],gpu[01-02]`` -> node1 node2 node3 node7 gpu01 gpu02. Items are separated by
    commas or whitespace outside brackets; a bracket holds numbers and ranges, each range padded
    to the width of its first number (``[08-10]``: 08 09 10; ``[1-010]``: 1 ... 10); several
    brackets in one item give every combination, the first bracket slowest
    (``rack[1-2]-n[1-2]``: rack1-n1 rack1-n2 rack2-n1 rack2-n2). Order and repeats are kept.
    """
    hosts: list[str] = []
    for item in _hostlist_items(nodelist):
        # "a[1-2]b[3]c" -> ["a", "1-2", "b", "3", "c"]: literals at even positions.
        pieces = re.split(r"\[([^\[\]]*)\]", item)
        if any("[" in piece or "]" in piece for piece in pieces[::2]):
            raise UserError(f"cannot read Slurm's node list {nodelist!r}: unbalanced brackets")
        choices = [[piece] for piece in pieces]
        choices[1::2] = [_bracket_numbers(piece, nodelist) for piece in pieces[1::2]]
        hosts += ["".join(combination) for combination in itertools.product(*choices)]
    return hosts


def _hostlist_items(nodelist: str) -> list[str]:
    """The comma- or space-separated items of a node list (separators inside brackets kept)."""
    items, current, depth = [], "", 0
    for char in nodelist:
        depth += (char == "[") - (char == "]")
        if depth == 0 and (char == "," or char.isspace()):
            items.append(current)
            current = ""
        else:
            current += char
    return [item for item in [*items, current] if item]


def _bracket_numbers(ranges: str, nodelist: str) -> list[str]:
    """'01-03,7' -> ['01', '02', '03', '7']."""
    numbers = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise UserError(f"cannot read Slurm's node list {nodelist!r}: bad range [{ranges}]")
        low, high = match.group(1), match.group(2) or match.group(1)
        numbers += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return numbers


def expand_tasks_per_node(value: str) -> list[int]:
    """Slurm's compressed counts, e.g. '4(x2),2' -> [4, 4, 2]."""
    counts = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise UserError(f"cannot read SLURM_TASKS_PER_NODE={value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def gpus_from_env(env: Mapping[str, str]) -> int | None:
    """GPUs per node Slurm granted, or None when the job asked for none."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS_PER_NODE"):
        match = re.search(r"(\d+)$", env.get(name, ""))  # "4" or "a100:4"
        if match:
            return int(match.group(1))
    if env.get("SLURM_JOB_GPUS"):  # "0,1,2,3"
        return len(env["SLURM_JOB_GPUS"].split(","))
    return None


@dataclass(frozen=True)
class Allocation:
    """The hosts of a job and how many ranks and GPUs each one has."""

    hosts: tuple[str, ...]
    slots: tuple[int, ...]
    """Tasks (ranks) per host, in host order."""
    gpus_per_host: int | None = None
    job_id: str | None = None
    dropped: tuple[str, ...] = ()
    """Hosts of the job left out (--min-nodes: they stopped answering); the launch paths then
    name the hosts they use, since srun and mpirun would otherwise take the whole job's."""
    cpus_per_task: int | None = None
    """The cores the job asked for each task (SLURM_CPUS_PER_TASK), None when it did not say."""

    @property
    def num_tasks(self) -> int:
        return sum(self.slots)

    @property
    def max_slots_per_host(self) -> int:
        return max(self.slots)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation | None:
        """The allocation this process runs in, or None outside Slurm."""
        if not env.get("SLURM_JOB_ID"):
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise UserError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not")
        hosts = expand_hostlist(nodelist)
        tasks_value = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_TASKS_PER_NODE")
        if tasks_value:
            slots = expand_tasks_per_node(tasks_value)
        elif env.get("SLURM_NTASKS_PER_NODE", "").isdigit():
            slots = [int(env["SLURM_NTASKS_PER_NODE"])] * len(hosts)
        else:
            slots = [1] * len(hosts)
        if len(slots) != len(hosts):
            raise UserError(f"Slurm lists {len(hosts)} host(s) ({nodelist}) but task counts for "
                            f"{len(slots)} ({tasks_value})")
        cpus = env.get("SLURM_CPUS_PER_TASK", "")
        return cls(tuple(hosts), tuple(slots), gpus_from_env(env), env.get("SLURM_JOB_ID"),
                   cpus_per_task=int(cpus) if cpus.isdigit() else None)

    def host_slots(self) -> str:
        """horovodrun/mpirun -H syntax: 'node1:4,node2:4'."""
        return ",".join(f"{host}:{slots}" for host, slots in zip(self.hosts, self.slots))


# --- writing sbatch scripts ------------------------------------------------------------------------
@dataclass(kw_only=True, frozen=True)
class SbatchJob:
    name: str
    """Slurm job name (also names the run directory and log file)."""
    description: str = "hvdtrain data-parallel training job"
    nodes: int = 1
    """Nodes the job asks for (#SBATCH --nodes)."""
    gpus_per_node: int = 0
    """GPUs per node (--gres=gpu:N); 0 for a CPU job."""
    tasks_per_node: int | None = None
    """Ranks per node; default one per GPU (or 4 on CPU)."""
    cpus_per_task: int = 8
    """CPU cores per rank: input pipeline and TensorFlow threads."""
    time: str = "02:00:00"
    """Time limit, as sbatch --time takes it: minutes, hours:minutes:seconds, days-hours, ..."""
    partition: str | None = None
    """Leave unset to take it from `sbatch -p` or $SBATCH_PARTITION at submission."""
    account: str | None = None
    """Leave unset to take it from `sbatch -A` or $SBATCH_ACCOUNT at submission."""
    module: str = "hvdtrain.cnn"
    """What every rank runs by default: a module, or a script path (train.py) run as a script."""
    args: tuple[str, ...] = ()
    """Training arguments baked into the script (more can follow `sbatch script.sh ...`)."""
    signal_seconds: int = 120
    """Seconds before the time limit Slurm sends USR1: time to finish a step and checkpoint."""
    max_requeues: int = 3
    """Default cap on requeues (HVDTRAIN_MAX_REQUEUES): a job that keeps stopping for requeue
    without ever finishing must not loop forever. A job that needs more time-limit windows than
    this raises it at submission."""
    via: str = ""
    """How the launcher starts the ranks: horovodrun, mpirun or srun (default: horovodrun on one
    node, mpirun across nodes)."""
    python: str = ".venv/bin/python"
    """The interpreter with hvdtrain installed that the script runs the launcher with
    (HVDTRAIN_PYTHON at submission overrides it). An absolute path runs from any directory;
    the repository's templates use its venv, relative to the repository's root."""

    def __post_init__(self):
        if not self.via:
            # Across nodes, mpirun starts its remote daemons through Slurm itself; horovodrun
            # would first insist on ssh access to every node, which a Slurm cluster need not give.
            object.__setattr__(self, "via", "mpirun" if self.nodes > 1 else "horovodrun")
        if self.nodes < 1 or self.gpus_per_node < 0 or self.cpus_per_task < 1:
            raise ValueError("nodes and cpus_per_task must be >= 1, gpus_per_node >= 0")
        if self.tasks_per_node is not None and self.tasks_per_node < 1:
            raise ValueError("tasks_per_node must be >= 1")
        if self.max_requeues < 0:
            raise ValueError("max_requeues must be >= 0")
        if self.signal_seconds < 1:
            raise ValueError(f"signal_seconds must be >= 1, got {self.signal_seconds}")
        if self.via not in VIAS:
            raise ValueError(f"via must be one of {', '.join(VIAS)}, got {self.via!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ValueError(f"job name {self.name!r}: use letters, digits, '.', '_' or '-'")
        # These land inside #SBATCH lines and a shell default (${VAR:-module}), where quoting
        # does not help: allow only what such names are made of.
        if not (MODULE_NAME.fullmatch(self.module)
                or re.fullmatch(r"[A-Za-z0-9_./-]+\.py", self.module)):
            raise ValueError(f"module {self.module!r}: a Python module path like hvdtrain.cnn "
                             "or a script path like train.py")
        if not re.fullmatch(r"[A-Za-z0-9_./+@-]+", self.python):
            raise ValueError(f"python {self.python!r}: an interpreter path of letters, digits "
                             "and . / _ + @ -")
        for label, value in (("partition", self.partition), ("account", self.account)):
            if value is not None and not re.fullmatch(r"[A-Za-z0-9_.,-]+", value):
                raise ValueError(f"{label} {value!r}: use letters, digits, '.', ',', '_' or '-'")
        # sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
        # days-hours:minutes, days-hours:minutes:seconds, or UNLIMITED/INFINITE.
        if not re.fullmatch(r"\d+(:\d{2}){0,2}|\d+-\d{1,2}(:\d{2}){0,2}|UNLIMITED|INFINITE",
                            self.time):
            raise ValueError(f"time {self.time!r}: use minutes, hours:minutes:seconds or "
                             "days-hours:minutes:seconds, as sbatch --time takes it")

    @property
    def ranks_per_node(self) -> int:
        return self.tasks_per_node or self.gpus_per_node or 4


TEMPLATES: dict[str, SbatchJob] = {
    "1gpu.sh": SbatchJob(name="hvdtrain-1gpu", description="one GPU, one rank",
                         gpus_per_node=1),
    "2gpu.sh": SbatchJob(name="hvdtrain-2gpu", description="one node, 2 GPUs, 2 ranks",
                         gpus_per_node=2),
    "4gpu.sh": SbatchJob(name="hvdtrain-4gpu", description="one node, 4 GPUs, 4 ranks",
                         gpus_per_node=4),
    "multinode.sh": SbatchJob(name="hvdtrain-multinode",
                              description="N nodes x 4 GPUs (default 2 nodes; sbatch -N 8 for 8)",
                              nodes=2, gpus_per_node=4),
    "cpu.sh": SbatchJob(name="hvdtrain-cpu", description="one node, 4 CPU ranks, no GPU",
                        gpus_per_node=0, tasks_per_node=4, cpus_per_task=2),
}


#: What a submitted template reads at submission besides its flags: variable -> what it means
#: ({module}, {via}, {python}, {max_requeues}: the template's defaults, which are the flags on its exec
#: line). The launcher applies them (``hvdtrain.launch --sbatch``); each template lists them.
BATCH_VARIABLES = {
    "HVDTRAIN_MODULE": "what every rank runs (default {module}): a module, run as `python "
                       "-m MODULE --run-dir DIR [flags]`, or a script path (train.py, or any path "
                       "with a /), run as `python train.py [flags]`; a script finds the run "
                       "directory in HVDTRAIN_RUN_DIR",
    "HVDTRAIN_ARGS": "extra training flags, split as a shell would (before the flags given after "
                     "the script, which win)",
    "HVDTRAIN_RUN_DIR": "run directory (default runs/<job name>-<job id>; kept on requeue, so a "
                        "requeued job resumes from its checkpoint)",
    "HVDTRAIN_PYTHON": "interpreter with hvdtrain installed (default {python})",
    "HVDTRAIN_MAX_RESTARTS": "times the launcher restarts a failed job (a rank died) inside this "
                             "allocation (default 0)",
    "HVDTRAIN_MIN_NODES": "with HVDTRAIN_MAX_RESTARTS: after a node is lost, restart on the "
                          "nodes left while at least this many are (submit with --no-kill, "
                          "or Slurm ends the job with the node; default 0: off)",
    "HVDTRAIN_HEALTH_CHECK": "1: before the job, check every node's GPUs or CPU share, the "
                             "links between nodes and the ranks' numbers (hvdtrain.health); a "
                             "failure ends the job with exit 2",
    "HVDTRAIN_VIA": "what starts the ranks: horovodrun, mpirun or srun (default {via})",
    "HVDTRAIN_NETWORK_INTERFACE": "the interface(s) the ranks talk over (eth0, or eth0,ib0; "
                                  "default: the launcher checks which connect every node)",
    "HVDTRAIN_CONTAINER": "run every rank in this image (a SquashFS for Charliecloud's ch-run, "
                          "or what srun --container-image takes where Slurm has pyxis); "
                          "implies HVDTRAIN_VIA=srun",
    "HVDTRAIN_MAX_REQUEUES": "requeues after which a preempted job stops instead (default "
                             "{max_requeues}; counts Slurm's own requeues too; raise it for a job "
                             "that needs more time-limit windows)",
}


def default_run_dir(env: Mapping[str, str]) -> str:
    """A job's run directory unless HVDTRAIN_RUN_DIR names one: the same on every requeue of the
    job (its id stays), so a requeued job resumes from its own checkpoint."""
    return f"runs/{env.get('SLURM_JOB_NAME', 'job')}-{env['SLURM_JOB_ID']}"


@dataclass(frozen=True)
class Requeue:
    """What to do with a job that stopped for requeue (exit 75: Slurm's time-limit warning
    arrived and the ranks wrote a checkpoint)."""

    job: str | None
    """The id to hand to ``scontrol requeue``; None: the cap is reached, leave it stopped."""
    message: str
    """The launcher's line about it."""


def requeue_decision(env: Mapping[str, str], max_requeues: int, run_dir: str) -> Requeue:
    """The requeue rule: requeue this job (only this task of an array) unless it was requeued
    ``max_requeues`` times already (``SLURM_RESTART_COUNT``, which counts Slurm's own requeues
    too), so a job that never finishes cannot loop forever."""
    requeued = int(env.get("SLURM_RESTART_COUNT") or 0)
    if requeued >= max_requeues:
        return Requeue(None, f"job {env['SLURM_JOB_ID']} was requeued {requeued} time(s) already "
                             f"(HVDTRAIN_MAX_REQUEUES={max_requeues}); not requeueing it. To "
                             f"resume, submit again with HVDTRAIN_RUN_DIR={run_dir}")
    # An array task requeues itself alone: the id of one of its tasks is also the array's id,
    # which `scontrol requeue` reads as every task of the array.
    task = env.get("SLURM_ARRAY_TASK_ID")
    job = f"{env['SLURM_ARRAY_JOB_ID']}_{task}" if task else env["SLURM_JOB_ID"]
    return Requeue(job, f"requeueing job {job}; the next run resumes from {run_dir}")


def render(job: SbatchJob) -> str:
    """The complete sbatch script for ``job``: its #SBATCH lines and one exec of the launcher,
    which does the rest (``hvdtrain.launch --sbatch``). Training arguments are shell-quoted; the
    other values are validated by SbatchJob to contain nothing a shell or #SBATCH line would
    read."""
    directives = [
        f"--job-name={job.name}",
        f"--nodes={job.nodes}",
        f"--ntasks-per-node={job.ranks_per_node}",
        *([f"--gres=gpu:{job.gpus_per_node}"] if job.gpus_per_node else []),
        f"--cpus-per-task={job.cpus_per_task}",
        f"--time={job.time}",
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--account={job.account}"] if job.account else []),
        # Slurm signals the batch process (B:, the launcher) this long before the time limit;
        # the launcher forwards it to the ranks, which checkpoint and exit 75, then requeues.
        f"--signal=B:USR1@{job.signal_seconds}",
        "--requeue",
        "--open-mode=append",  # a requeued run appends to the same log
        "--output=slurm-%x-%j.out",
    ]
    variables = []
    for name, meaning in BATCH_VARIABLES.items():
        wrapped = textwrap.wrap(meaning.format(module=job.module, via=job.via, python=job.python,
                                               max_requeues=job.max_requeues), 96 - 27,
                                break_on_hyphens=False)
        variables.append(f"#   {name:<23}{wrapped[0]}" if len(name) < 23
                         else f"#   {name}\n#   {'':<23}{wrapped[0]}")
        variables += [f"#   {'':<23}{line}" for line in wrapped[1:]]
    launch = ["--via", job.via, "--max-requeues", str(job.max_requeues), "--",
              job.module, *job.args]
    lines = [
        "#!/bin/bash",
        f"# {job.description}.",
        "# Generated by `python -m hvdtrain.slurm` - edit hvdtrain/launch/slurm.py, not this file.",
        "#",
        ("# Submit from any directory:" if os.path.isabs(job.python)
         else "# Submit from the repository root (after `make install`):"),
        "#   sbatch path/to/this/script.sh [training flags...]",
        "# Override without editing: sbatch flags (-p PARTITION -A ACCOUNT -t TIME -N NODES ...),",
        "# $SBATCH_PARTITION / $SBATCH_ACCOUNT, and these variables:",
        *"\n".join(variables).splitlines(),
        *[f"#SBATCH {directive}" for directive in directives],
        "",
        "# The launcher reads the allocation, starts the ranks, passes Slurm's USR1 on to them and",
        "# requeues the job once they have written a checkpoint (its --help: the --sbatch flag).",
        f'exec "${{HVDTRAIN_PYTHON:-{job.python}}}" -m hvdtrain.launch --sbatch \\',
        "    " + shlex.join(launch) + ' "$@"',
        "",
    ]
    return "\n".join(lines)


def run(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog=usage_name(PROGRAM),
                           description="Write sbatch scripts that run an hvdtrain job through the "
                                       "launcher (requeue on preemption included); the shipped "
                                       "templates in slurm/ are what `render` writes for them. "
                                       "docs/slurm.md has the rest.")
    commands = parser.add_subparsers(dest="command", required=True)
    render_parser = commands.add_parser(
        "render", help="print an sbatch script", formatter_class=FlagHelpFormatter,
        description="Print a complete, commented sbatch script for the job the flags describe; "
                    "training flags after -- are baked into it.")
    docs = field_docs(SbatchJob)
    for spec in fields(SbatchJob):
        if spec.name in ("description", "args"):
            continue
        kind = int if spec.name in ("nodes", "gpus_per_node", "tasks_per_node", "cpus_per_task",
                                    "signal_seconds", "max_requeues") else str
        help_text = docs.get(spec.name)
        if spec.name == "python":  # None: the interpreter running this command (it has hvdtrain)
            help_text += " Default here: the Python running this command."
        render_parser.add_argument("--" + spec.name.replace("_", "-"), type=kind,
                                   required=spec.name == "name", help=help_text,
                                   default=None if spec.default is MISSING or spec.name == "python"
                                   else spec.default)
    render_parser.add_argument("args", nargs=argparse.REMAINDER,
                               help="training flags baked into the script (after --)")
    templates_parser = commands.add_parser(
        "templates", help="write the shipped templates into a directory",
        description="Write the templates hvdtrain ships (1gpu.sh, 2gpu.sh, 4gpu.sh, "
                    "multinode.sh, cpu.sh) into DIRECTORY, each running the launcher with this "
                    "Python, so they submit from any directory. Existing files are not touched.")
    templates_parser.add_argument("directory", help="where the scripts go (made if missing)")
    options = parser.parse_args(argv)
    if options.command == "templates":
        for path in write_templates(options.directory, sys.executable):
            print(path)
        return 0
    values = {k: v for k, v in vars(options).items() if k not in ("command", "args")}
    values["python"] = values["python"] or sys.executable
    args = tuple(a for a in options.args if a != "--")
    try:
        job = SbatchJob(description=f"{values['name']}: custom hvdtrain job", args=args, **values)
    except ValueError as error:
        raise UserError(str(error)) from None
    sys.stdout.write(render(job))
    return 0


def write_templates(directory: str, python: str) -> list[str]:
    """Every template, run with ``python``, as an executable script in ``directory``; the
    paths written. A file already there is refused (one line) before anything is written."""
    try:
        scripts = {name: render(dataclasses.replace(template, python=python)).encode()
                   for name, template in TEMPLATES.items()}
    except ValueError as error:
        raise UserError(f"cannot write the templates into {directory}: {error}") from None
    return write_new_files(directory, scripts, "templates", mode=0o755)


def main(argv: Sequence[str] | None = None) -> None:
    with reported(error_name(PROGRAM)):
        sys.exit(run(argv))

