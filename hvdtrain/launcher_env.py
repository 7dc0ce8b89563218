"""Who started a process: the rank and size a launcher announced, before any runtime exists.

The one place that knows the launchers' variables (horovodrun, mpirun, srun), read for four
things: which rank prints an early error (``errors.reported``) and what ``--backend auto``
means (``runtime.select_backend``); what a process started from inside a job must not inherit
(``child_env``: the benchmarks' and the tests' jobs); which processes on this machine are ranks
(``processes``: the launcher's supervision, the benchmarks, the tests); and which scheduler job
a process belongs to (``job_label``: the run directory's lock, the trackers). Imports nothing
from hvdtrain, so the launcher and the error handling can use it without loading TensorFlow.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Mapping

# What launchers tell each process before it starts, as (rank, size) variables, in order of
# trust: horovodrun (Gloo), OpenMPI's mpirun, PMI-1/2 (srun --mpi=pmi2, MPICH), PMIx (srun
# --mpi=pmix, which names the rank but not the size). Read only to decide who prints an error
# that happens before the runtime starts, and which backend `auto` means; once horovod runs,
# the runtime asks horovod.
_LAUNCHER_VARIABLES = (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK",
                                                         "OMPI_COMM_WORLD_SIZE"),
                       ("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None))

#: Prefixes of the variables through which a launcher or a scheduler tells a process who it is
#: and how to reach the rest of its job: OpenMPI's (rank, and the daemon's address an MPI_Init
#: connects to), PMI/PMIx's, Slurm's (job, step, task). A process started from inside a rank or a
#: job step that inherited them would take itself for part of that job: a launcher would read
#: someone else's allocation, an MPI program would join another program's daemon.
IDENTITY_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_")
#: ...except these, which a user sets to allow something, not to say who a process is.
NOT_IDENTITY = frozenset({"OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"})
#: horovod's identity: what horovodrun's Gloo launch and its elastic driver tell each rank (its
#: place, the rendezvous it meets at). The rest of HOROVOD_* is tuning a user sets for the whole
#: job (HOROVOD_HIERARCHICAL_ALLREDUCE, HOROVOD_FUSION_THRESHOLD, ...), passed on to every rank.
HOROVOD_IDENTITY = frozenset({
    "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_CONTROLLER",
    "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_GLOO_IFACE", "HOROVOD_ELASTIC"})


def launched_as(env: Mapping[str, str] | None = None) -> tuple[int, int | None] | None:
    """(rank, size) as a launcher announced them; size None if it didn't; None if no launcher."""
    env = os.environ if env is None else env
    for rank_name, size_name in _LAUNCHER_VARIABLES:
        rank = env.get(rank_name, "")
        if rank.isdigit():
            size = env.get(size_name or "", "")
            return int(rank), int(size) if size.isdigit() else None
    return None


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank as the launcher announced it (0 when not launched by one)."""
    launched = launched_as(env)
    return launched[0] if launched else 0


def is_identity(name: str) -> bool:
    """Whether a variable says which job and rank a process belongs to (see IDENTITY_PREFIXES
    and HOROVOD_IDENTITY)."""
    return (name.startswith(IDENTITY_PREFIXES) and name not in NOT_IDENTITY) or \
        name in HOROVOD_IDENTITY


def child_env(env: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment for a job started from inside another one (a benchmark's run, a test's):
    ``env`` (default this process's) without the identity variables, plus ``extra``."""
    env = os.environ if env is None else env
    return {**{name: value for name, value in env.items() if not is_identity(name)}, **extra}


@dataclass(frozen=True)
class Process:
    """One process on this machine, as /proc shows it."""

    pid: int
    argv: tuple[str, ...]
    env: dict[str, str]
    uts_namespace: str
    """Whose hostname it sees (/proc/PID/ns/uts): the same for every process of one machine,
    except in containers that give themselves a hostname, and, in the test cluster, per node."""

    @property
    def rank(self) -> int | None:
        """The rank its launcher gave it; None for anything else (a launcher, mpirun, a shell)."""
        launched = launched_as(self.env)
        return launched[0] if launched else None


def processes(proc: str = "/proc") -> Iterator[Process]:
    """Every process of this machine whose command line and environment this user may read
    (other users' processes, and those that exit while being read, are left out)."""
    for entry in os.listdir(proc):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().decode(errors="replace").split("\0")
            with open(f"{proc}/{entry}/environ", "rb") as environ:
                variables = environ.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        try:
            uts_namespace = os.readlink(f"{proc}/{entry}/ns/uts")
        except OSError:
            uts_namespace = ""
        env = dict(v.split("=", 1) for v in variables if "=" in v)
        yield Process(int(entry), tuple(argv[:-1] if argv and not argv[-1] else argv), env,
                      uts_namespace)


def own_uts_namespace(proc: str = "/proc") -> str:
    """This process's UTS namespace, to compare with ``Process.uts_namespace``."""
    return os.readlink(f"{proc}/self/ns/uts")


def marked(marker: str, *, prefix: bool = False, this_host_only: bool = False) -> list[Process]:
    """The processes whose environment holds ``marker`` (NAME=VALUE; with ``prefix``, a value
    that starts with VALUE), as a launcher marks everything it starts. With ``this_host_only``,
    only those that see this process's hostname (the nodes of the test cluster share one /proc;
    a real node's /proc shows only its own processes anyway)."""
    name, value = marker.split("=", 1)
    namespace = own_uts_namespace() if this_host_only else None
    return [process for process in processes()
            if (process.env.get(name, "").startswith(value) if prefix
                else process.env.get(name) == value)
            and (namespace is None or process.uts_namespace == namespace)]


def job_label(env: Mapping[str, str]) -> str | None:
    """Slurm's name for the job this process is part of ('Slurm job 1234', '1234_7' for an array
    task, ', restart 2' after a requeue), or None outside Slurm. The run directory's lock records
    it, so that a second job refused there can say which job holds it."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    return f"Slurm job {job_id}" + (f", restart {restarts}" if restarts not in ("", "0") else "")
