"""Start a training job on the right ranks: `python -m hvdtrain.launch [options] -- PROGRAM [args]`.

PROGRAM is a module (``hvdtrain.cnn``: every rank runs ``python -m hvdtrain.cnn args``) or a script
path (``train.py``: ``python train.py args``), so a horovod script of your own gets the same start.
Outside Slurm it runs ``horovodrun -np N`` on this machine (N: the GPU count, or 1 on CPU). Inside a
Slurm allocation it reads the hosts, tasks and GPUs per node from the allocation and passes them on
(``-np``/``-H`` to horovodrun, or lets ``mpirun``/``srun --mpi=pmix`` read the allocation; pick
with ``--via``). Before launching it checks that the program exists for the ranks' Python, then
horovod's build, the GPUs per node and the rank count; each problem is one line and exit status 2.
``--dry-run`` prints the command and environment.

Signals: SIGUSR1, SIGTERM and SIGINT are forwarded to the ranks (SIGUSR1 is Slurm's warning before
the time limit; the ranks write a checkpoint and exit 75). The exit status is the job's.

Restarts: with ``--max-restarts N`` a job that failed (a rank died or crashed) is started again in
the same allocation, up to N times; an hvdtrain job resumes from its last checkpoint. A user error
(exit 2), a preemption stop (75) and a stop signal end the job without a restart.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from hvdtrain import netcheck
from hvdtrain.errors import EXIT_PREEMPTED, EXIT_USAGE, UserError, reported
from hvdtrain.slurm import Allocation

PROGRAM = "hvdtrain.launch"
VIAS = ("horovodrun", "mpirun", "srun")
_FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
#: Pause between a failed attempt and the next, in seconds: long enough for the ports and GPU
#: memory of the dead ranks to be released, short next to the minutes a restart saves.
RESTART_DELAY_SECONDS = 3.0
#: Every process of one attempt inherits this variable (launcher pid and attempt number), so the
#: launcher finds them all afterwards, whichever parent they were left with.
ATTEMPT_VARIABLE = "HVDTRAIN_LAUNCH_ATTEMPT"
#: Seconds a launch command (mpirun) may outlive its ranks on this host before the launcher
#: ends it: mpirun needs a moment to collect the exit statuses of every node.
ORPHANED_COMMAND_SECONDS = 30.0


@dataclass(frozen=True)
class Build:
    """What the installed horovod can do, probed in a child interpreter (TensorFlow is heavy)."""

    tensorflow: bool
    mpi: bool
    gloo: bool
    gpus: int = 0
    error: str | None = None
    """Why the horovod TensorFlow extension did not load (e.g. built against another TF)."""


@dataclass(frozen=True)
class LaunchOptions:
    """What every rank runs and how the ranks start: the launcher's flags of the same names."""

    program: str
    """A module (hvdtrain.cnn, run as `python -m hvdtrain.cnn`) or a script path (train.py, run as
    `python train.py`); see program_command."""
    program_args: tuple[str, ...] = ()
    """Arguments for the program, each passed as its own argv entry."""
    np: int | None = None
    """Ranks to start; None: the allocation's tasks, else this machine's GPUs, else 1."""
    via: str = "horovodrun"
    """What starts the ranks: horovodrun, mpirun or srun."""
    controller: str | None = None
    """horovod's controller, "mpi" or "gloo" (horovodrun only); None: horovodrun's choice (MPI)."""
    python: str = sys.executable
    """Interpreter of the ranks."""
    keras: str = "2"
    """The Keras the ranks run: "2" (tf_keras; a script runs through hvdtrain.script, which
    selects it for horovod's Keras API) or "3" (TensorFlow's own: a script runs as is, and
    hvdtrain's jobs and public API get HVDTRAIN_KERAS=3)."""
    max_restarts: int = 0
    """How many times a failed job is started again in the same allocation (judge_exit says
    which failures count)."""
    timeline_filename: str | None = None
    """Horovod timeline file (chrome://tracing)."""
    autotune: bool = False
    """Let horovod tune the fusion buffer and cycle time."""
    autotune_log_file: str | None = None
    """Where horovod's autotuner logs what it tried."""
    fusion_threshold_mb: float | None = None
    """Tensor fusion buffer in MiB (horovod's default: 128)."""
    cycle_time_ms: float | None = None
    """Horovod background thread cycle in ms (horovod's default: 1)."""
    stall_check_warning_seconds: int | None = None
    """Warn when a rank has not joined a collective for this long."""
    stall_check_shutdown_seconds: int | None = None
    """End the job when a rank has stalled for this long."""
    no_stall_check: bool = False
    """Turn horovod's stall check off."""
    binding_args: str | None = None
    """Process binding arguments for mpirun/srun, one string ('--bind-to core')."""
    allow_run_as_root: bool = False
    """Pass --allow-run-as-root to mpirun (horovodrun does so itself)."""
    hosts: str | None = None
    """Outside Slurm: the hosts and their ranks, horovodrun/mpirun -H syntax (node1:2,node2:2);
    None: this machine only. Inside an allocation the allocation decides."""
    network_interface: str | None = None
    """The network interface(s) the ranks talk over (eth0, or eth0,ib0); None: the network
    check picks the ones that connect every host (see hvdtrain.netcheck)."""


@dataclass(frozen=True)
class Launch:
    argv: tuple[str, ...]
    """The command that starts every rank."""
    env: dict[str, str]
    """Variables added to (or changed in) the environment the command runs with."""
    notes: tuple[str, ...] = ()
    """What the launcher derived (allocation, rank count, restarts), for --dry-run."""


def is_script_path(program: str) -> bool:
    """A program names a script when it ends in .py, has a directory part or is an existing file;
    anything else is a module name."""
    return program.endswith(".py") or os.sep in program or os.path.isfile(program)


def program_command(options: LaunchOptions) -> list[str]:
    """What every rank runs: `python -m hvdtrain.script script.py args` (or with --keras 3
    `python script.py args`) or `python -m module args`.

    The ranks start in the launcher's working directory (horovodrun, mpirun and srun all keep
    it), so a relative script path means the same there as here.
    """
    if is_script_path(options.program):
        if not os.path.isfile(options.program):
            raise UserError(f"no such script: {options.program} (a script path runs as `python "
                            "PATH`, a module name like hvdtrain.cnn as `python -m MODULE`)")
        if options.keras == "3":
            return [options.python, options.program, *options.program_args]
        # horovod.tensorflow.keras needs Keras 2; hvdtrain.script selects it, then runs the
        # script exactly as `python script.py args` would.
        return [options.python, "-m", "hvdtrain.script", options.program, *options.program_args]
    if not _MODULE_NAME.fullmatch(options.program):
        raise UserError(f"{options.program!r} is neither a module name (like hvdtrain.cnn) nor "
                        "a script path (like train.py)")
    return [options.python, "-m", options.program, *options.program_args]


# Run by the ranks' interpreter: prints the marker when `python -m NAME` would find no module NAME
# (find_spec finds nothing, or a parent package is missing). A parent package that fails to
# import for another reason is left to the ranks, which report it in full.
_FIND_MODULE = """
import importlib.util, sys
name = sys.argv[1]
try:
    missing = importlib.util.find_spec(name) is None
except ModuleNotFoundError as error:
    missing = error.name is not None and (name + ".").startswith(error.name + ".")
if missing:
    print("HVDTRAIN_NO_MODULE")
"""


def check_module(python: str, module: str) -> None:
    """Refuse a module the ranks' ``python -m`` would not find: a mistyped name fails the same
    way on every attempt, so it must not cost a launch (or one per ``--max-restarts``).

    Asked of the ranks' interpreter (``--python`` may name another one than the launcher's) in
    the launcher's working directory and environment, which the ranks inherit, so it searches
    what ``python -m`` searches; it also keeps the imports of parent packages out of the
    launcher. A check that cannot finish in time lets the ranks find out.
    """
    try:
        completed = subprocess.run([python, "-c", _FIND_MODULE, module], capture_output=True,
                                   text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return
    except OSError as error:
        raise UserError(f"could not run {python}: {error.strerror or error}") from None
    if "HVDTRAIN_NO_MODULE" in completed.stdout.split():
        raise UserError(f"no module named {module!r} in the ranks' Python ({python}): check the "
                        "name, or pass a script path")


@dataclass(frozen=True)
class Verdict:
    """How one attempt of the job ended, and whether starting it again can help."""

    restart: bool
    """True when the failure may not happen again (a rank was killed, crashed or lost a peer)."""
    reason: str
    """What the exit status means, for the launcher's one-line report."""


def judge_exit(status: int, stop_signal: int | None) -> Verdict:
    """The restart rule: which exit statuses of the job are worth another attempt."""
    if stop_signal is not None:
        # Someone asked the job to stop (Slurm's time-limit warning, scancel, Ctrl-C): it stops.
        # After SIGUSR1 the sbatch script requeues it, which restarts it with a fresh time limit.
        return Verdict(False, f"stopped on {signal_name(stop_signal)}")
    if status == 0:
        return Verdict(False, "finished")
    if status == EXIT_USAGE:
        return Verdict(False, "a user error: it would fail the same way again")
    if status == EXIT_PREEMPTED:
        return Verdict(False, "stopped for preemption after a checkpoint; requeue it to resume")
    if status in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        # The ranks were told to stop (e.g. scancel signals every process of a step): a stop.
        return Verdict(False, f"stopped on {signal_name(status - 128)}")
    if status in (126, 127):  # the shell's "cannot execute" / "command not found"
        return Verdict(False, "the command could not be started")
    if 128 < status < 128 + signal.NSIG:
        return Verdict(True, f"a rank ended on {signal_name(status - 128)}")
    return Verdict(True, "a rank failed")


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:  # real-time signals other than SIGRTMIN/SIGRTMAX have no name
        return f"signal {number}"


def probe_build(python: str) -> Build:
    """Ask a child interpreter what horovod was built with, and how many GPUs this node has."""
    code = r"""
import json, hvdtrain
from hvdtrain.errors import first_line
result = {"tensorflow": False, "mpi": False, "gloo": False, "gpus": 0}
try:
    import tensorflow as tf
    result["gpus"] = len(tf.config.list_physical_devices("GPU"))
    from hvdtrain.runtime.horovod import build_info
    result.update(build_info())
except Exception as error:
    result["error"] = f"{type(error).__name__}: {first_line(error)}"
print("HVDTRAIN_PROBE " + json.dumps(result))
"""
    try:
        completed = subprocess.run([python, "-c", code], capture_output=True, text=True,
                                   timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except (OSError, subprocess.TimeoutExpired) as error:
        raise UserError(f"could not run {python} to check the horovod build: {error}") from None
    for line in completed.stdout.splitlines():
        if line.startswith("HVDTRAIN_PROBE "):
            return Build(**json.loads(line.removeprefix("HVDTRAIN_PROBE ")))
    tail = (completed.stderr.strip().splitlines() or ["no output"])[-1]
    raise UserError(f"{python} cannot import hvdtrain/horovod: {tail}")


def count_gpus_without_tensorflow() -> int:
    """This machine's NVIDIA GPUs, for --skip-preflight (the probe otherwise asks TensorFlow)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() not in ("", "-1")])
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
                      f"different TensorFlow than the one installed; rerun `make install`: "
                      f"{build.error})")
        problems.append(f"horovod cannot run TensorFlow jobs{detail}; rebuild it with "
                        "`make install` (HOROVOD_WITH_TENSORFLOW=1)")
    elif not (build.mpi or build.gloo):
        problems.append("horovod was built without a controller (neither MPI nor Gloo); rebuild "
                        "with `make install` (HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1)")
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
    if np is not None and np < 1:
        problems.append(f"--np must be at least 1, got {np}")
    root_ok = env.get("OMPI_ALLOW_RUN_AS_ROOT") == "1" and \
        env.get("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM") == "1"
    if running_as_root and options.via == "mpirun" and not (root_ok or options.allow_run_as_root):
        problems.append("running as root: OpenMPI refuses unless OMPI_ALLOW_RUN_AS_ROOT=1 and "
                        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set (or --allow-run-as-root)")
    return problems


def horovod_tuning_env(options: LaunchOptions) -> dict[str, str]:
    """Horovod's knobs as the environment variables horovod reads in every rank."""
    env = {}
    if options.timeline_filename:
        env["HOROVOD_TIMELINE"] = options.timeline_filename
    if options.autotune:
        env["HOROVOD_AUTOTUNE"] = "1"
    if options.autotune_log_file:
        env["HOROVOD_AUTOTUNE_LOG"] = options.autotune_log_file
    if options.fusion_threshold_mb is not None:
        env["HOROVOD_FUSION_THRESHOLD"] = str(int(options.fusion_threshold_mb * 1024 * 1024))
    if options.cycle_time_ms is not None:
        env["HOROVOD_CYCLE_TIME"] = f"{options.cycle_time_ms:g}"
    if options.no_stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if options.stall_check_warning_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(options.stall_check_warning_seconds)
    if options.stall_check_shutdown_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(options.stall_check_shutdown_seconds)
        if options.stall_check_warning_seconds is None and options.stall_check_shutdown_seconds < 60:
            # Horovod inspects stalls every HOROVOD_STALL_CHECK_TIME_SECONDS (60): a shorter
            # shutdown limit would only be seen at the next inspection (and horovod warns).
            env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(options.stall_check_shutdown_seconds)
    if options.controller == "gloo" and options.via != "horovodrun":
        raise UserError("--controller gloo needs --via horovodrun (it runs the Gloo rendezvous)")
    return env


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """horovodrun's -H syntax, 'node1:2,node2:2' (a host without a count has 1 slot)."""
    parsed = []
    for item in text.split(","):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?::(\d+))?", item.strip())
        if not match or match.group(2) == "0":
            raise UserError(f"--hosts {text!r}: give HOST:RANKS,HOST:RANKS (e.g. node1:2,node2:2)")
        parsed.append((match.group(1), int(match.group(2) or 1)))
    if len({host for host, _ in parsed}) != len(parsed):
        raise UserError(f"--hosts {text!r} names a host twice")
    return parsed


def job_hosts(options: LaunchOptions, allocation: Allocation | None) -> list[str]:
    """The hosts the ranks will run on."""
    if allocation is not None:
        return list(allocation.hosts)
    if options.hosts is not None:
        return [host for host, _ in parse_hosts(options.hosts)]
    return ["localhost"]


def build_launch(options: LaunchOptions, allocation: Allocation | None, gpus: int,
                 running_as_root: bool = False,
                 interfaces: tuple[str, ...] | None = None) -> Launch:
    """The exact command for these options and this allocation (pure: no processes started).

    ``interfaces``: the network interfaces the ranks must talk over (the network check's choice,
    or --network-interface); None leaves the choice to MPI, Gloo and NCCL.
    """
    notes = []
    if allocation is not None:
        if options.hosts is not None:
            raise UserError("--hosts is for outside Slurm; inside an allocation the ranks go "
                            "where Slurm put the tasks (ask sbatch for other nodes instead)")
        np = options.np or allocation.num_tasks
        hosts = allocation.host_slots()
        notes.append(f"Slurm job {allocation.job_id}: {len(allocation.hosts)} node(s), "
                     f"{hosts}, {allocation.gpus_per_host or 0} GPU(s) per node")
    elif options.hosts is not None:
        slots = parse_hosts(options.hosts)
        np = options.np or sum(count for _, count in slots)
        hosts = ",".join(f"{host}:{count}" for host, count in slots)
        notes.append(f"no Slurm allocation: {np} rank(s) on {hosts}")
    else:
        np = options.np or max(1, gpus)
        hosts = f"localhost:{np}"
        notes.append(f"no Slurm allocation: {np} rank(s) on this machine"
                     + ("" if options.np else f" (one per GPU; {gpus} GPU(s) seen)"))
    env = horovod_tuning_env(options)
    if options.keras == "3":
        # hvdtrain chooses its Keras at import, in each rank: tell every rank, on every node.
        env["HVDTRAIN_KERAS"] = "3"
    program = program_command(options)
    binding = shlex.split(options.binding_args) if options.binding_args else []
    interface_list = ",".join(interfaces) if interfaces else None
    if interface_list:
        # Every transport picks its own interface, and each can pick one that connects nothing
        # (docker0 on every node): MPI's TCP transport and its out-of-band channel, NCCL on GPU
        # nodes, horovod's Gloo. Pin them all to the interfaces that connect the hosts.
        env["NCCL_SOCKET_IFNAME"] = interface_list
        notes.append(f"network interface(s): {interface_list}")

    if options.via == "horovodrun":
        # The horovodrun next to the ranks' interpreter, so both come from the same venv.
        horovodrun = os.path.join(os.path.dirname(options.python), "horovodrun")
        if not os.path.exists(horovodrun):
            horovodrun = shutil.which("horovodrun") or "horovodrun"
        argv = [horovodrun, "-np", str(np), "-H", hosts]
        if options.controller:
            argv.append(f"--{options.controller}")
        if interface_list:  # horovodrun passes it on to mpirun's MCA options or to Gloo
            argv += ["--network-interface", interface_list]
        if binding:
            argv += ["--binding-args", options.binding_args]
        argv += program
    elif options.via == "mpirun":
        # Inside an allocation OpenMPI reads hosts and slots itself and starts remote daemons
        # through Slurm; -np keeps the count explicit. Outside, -H names this machine's slots.
        argv = ["mpirun", "-np", str(np)]
        if allocation is None:
            argv += ["-H", hosts]
        if interface_list:
            argv += ["--mca", "btl_tcp_if_include", interface_list,
                     "--mca", "oob_tcp_if_include", interface_list]
        if running_as_root and options.allow_run_as_root:
            argv.append("--allow-run-as-root")
        # One process per slot with no core binding, as horovodrun does by default: ranks size
        # their own thread pools (hvdtrain.runtime.configure_devices).
        argv += binding or ["--bind-to", "none", "--map-by", "slot"]
        for name in sorted(env):  # remote ranks only see variables passed with -x
            argv += ["-x", name]
        argv += program
    elif options.via == "srun":
        if allocation is None:
            raise UserError("--via srun needs a Slurm allocation (run it inside sbatch/salloc)")
        # A rank that dies must end the step: by default srun lets the others run on, and they
        # would wait in their next allreduce forever.
        argv = ["srun", "--mpi=pmix", f"--ntasks={np}", "--kill-on-bad-exit=1", *binding,
                *program]
        if interface_list:  # srun passes the environment on; each rank's MPI reads these
            env["OMPI_MCA_btl_tcp_if_include"] = interface_list
            env["OMPI_MCA_oob_tcp_if_include"] = interface_list
    else:
        raise UserError(f"--via must be one of {', '.join(VIAS)}, got {options.via!r}")
    if options.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {options.max_restarts}")
    if options.max_restarts and options.controller == "gloo":
        # A restart must never repeat a user error (exit 2), and Gloo's horovodrun reports it as 1.
        raise UserError("--max-restarts needs the ranks' exit statuses, which horovodrun --gloo "
                        "reports as 1 whatever they were; use --controller mpi")
    if options.max_restarts:
        notes.append(f"up to {options.max_restarts} restart(s) after a failure")
    return Launch(tuple(argv), env, tuple(notes))


def describe(launch: Launch) -> str:
    lines = [f"# {note}" for note in launch.notes]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(launch.env.items())]
    lines.append(shlex.join(launch.argv))
    return "\n".join(lines)


def attempt_processes(marker: str, whole: bool = True) -> dict[int, bool]:
    """This machine's processes of one attempt, {pid: is a rank}: those whose environment holds
    ``marker`` (set on the launch command, inherited by everything it starts); with ``whole``
    False, a variable that starts with it (every attempt of one launcher)."""
    wanted = marker.encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if wanted in variables if whole else any(v.startswith(wanted) for v in variables):
            found[int(entry)] = any(v.startswith((b"HOROVOD_RANK=", b"OMPI_COMM_WORLD_RANK="))
                                    for v in variables)
    return found


def end_attempt(job_pid: int, marker: str, grace_seconds: float = 30) -> list[int]:
    """Kill what is left on this machine of a failed attempt; the pids still alive after
    ``grace_seconds`` of SIGKILL.

    mpirun takes its ranks down with it when one dies, but a process it lost (a rank's child in
    a session of its own, a Gloo rank) would run on, beside the next attempt: in its allreduce,
    on its GPU, holding the run directory's lock.
    """
    try:
        os.killpg(job_pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_seconds
    while (left := list(attempt_processes(marker))) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return left


class StopSignals:
    """SIGUSR1/SIGTERM/SIGINT sent to the launcher: recorded from the moment it starts (the
    preflight probe takes seconds), and passed on to the ranks of the attempt that is running."""

    def __init__(self):
        self.received: list[int] = []
        self._job_pid: int | None = None
        self._marker = ""
        for signum in _FORWARDED_SIGNALS:
            signal.signal(signum, self._receive)

    def _receive(self, signum, frame):
        self.received.append(signum)
        if self._job_pid is None:
            return
        try:
            os.killpg(self._job_pid, signum)
        except ProcessLookupError:
            pass
        # horovodrun --gloo starts each rank in a session of its own, out of the group's reach;
        # signal the ranks on this machine directly (twice is harmless: the handler records).
        for pid, is_rank in attempt_processes(self._marker).items():
            if is_rank:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    def start(self, launch: Launch, marker: str) -> subprocess.Popen | None:
        """Start the command in its own process group, or None if a stop signal came first."""
        def prepare_child():
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED_SIGNALS)
            # horovodrun execs `/bin/sh -c mpirun ...`; a shell that starts with a signal ignored
            # keeps ignoring it, so the group signal stops at mpirun (which forwards it to every
            # rank, on every node) instead of killing the shell, and the launcher waits until
            # the ranks have checkpointed and mpirun is done. mpirun, srun and the Python ranks
            # install their own handlers.
            for signum in _FORWARDED_SIGNALS:
                signal.signal(signum, signal.SIG_IGN)

        # A signal between the check and Popen would be recorded but reach no rank: hold signals
        # until the job is known, so each one is either "before the start" or forwarded.
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED_SIGNALS)
        try:
            if self.received:
                return None
            name, value = marker.split("=", 1)
            process = subprocess.Popen(launch.argv, env={**os.environ, **launch.env, name: value},
                                       start_new_session=True, preexec_fn=prepare_child)
            self._job_pid, self._marker = process.pid, marker
            return process
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED_SIGNALS)

    def wait(self, process: subprocess.Popen) -> int:
        """The job's exit status (128 + N when it ended on signal N)."""
        returncode = wait_for_job(process, self._marker)
        self._job_pid = None
        status = returncode if returncode >= 0 else 128 - returncode
        if status and self.received:
            # The ranks stopped on the forwarded signal (75 or 143, checkpoint written), but the
            # command reports its own status for that (Gloo's horovodrun: 1 for any failure;
            # mpirun: 1 after a SIGTERM); give the sbatch script the one it acts on.
            stop = status_for_stop(self.received[0])
            if status != stop:
                say(f"the ranks stopped on {signal_name(self.received[0])}; exiting {stop}"
                    + (" so the job is requeued" if stop == EXIT_PREEMPTED else ""))
            return stop
        return status

    def pause(self, seconds: float) -> bool:
        """Sleep, but return early (True) when a stop signal arrives."""
        deadline = time.monotonic() + seconds
        while not self.received and time.monotonic() < deadline:
            time.sleep(0.05)
        return bool(self.received)


def wait_for_job(process: subprocess.Popen, marker: str,
                 grace_seconds: float = ORPHANED_COMMAND_SECONDS) -> int:
    """The command's return code, once it ended; or 1 after ending a command whose ranks on
    this host are gone while it still runs.

    mpirun, once a rank failed, tells the daemons of every node to end theirs and waits for
    their answers. A node whose network link went down never answers (TCP retries for ~15
    minutes), so mpirun would hang long after every rank it could reach has ended. Watched here:
    this host's ranks all ended and the command still runs ``grace_seconds`` later, so the
    launcher ends it.
    """
    ranks_seen, ranks_gone_since = False, None
    while True:
        try:
            return process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        ranks_here = any(attempt_processes(marker).values())
        ranks_seen = ranks_seen or ranks_here
        if not ranks_seen or ranks_here:
            ranks_gone_since = None
            continue
        ranks_gone_since = ranks_gone_since or time.monotonic()
        if time.monotonic() - ranks_gone_since < grace_seconds:
            continue
        say(f"the ranks on this host ended {grace_seconds:g} s ago, but {process.args[0]} "
            "still waits for another node (unreachable?); ending it")
        try:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            pass
        return 1


def say(message: str) -> None:
    print(f"{PROGRAM}: {message}", file=sys.stderr, flush=True)


def status_for_stop(signum: int) -> int:
    """What the launcher exits with after a stop signal: 75 (requeue me) for Slurm's SIGUSR1,
    128 + N for the others."""
    return EXIT_PREEMPTED if signum == signal.SIGUSR1 else 128 + signum


def run_attempts(launch: Launch, max_restarts: int, stops: StopSignals) -> int:
    """Run the job; after a failure worth another attempt, run it again, up to ``max_restarts``
    times. The exit status is the last attempt's."""
    restarts = 0
    while True:
        marker = f"{ATTEMPT_VARIABLE}={os.getpid()}.{restarts}"
        process = stops.start(launch, marker)
        if process is None:
            say(f"{signal_name(stops.first)} before the ranks started; not starting them")
            return status_for_stop(stops.first)
        if not restarts:
            say(shlex.join(launch.argv))
        status = stops.wait(process)
        if status == 0:
            return status
        left = end_attempt(process.pid, marker)
        if left:
            say(f"process(es) {' '.join(map(str, left))} of the failed job would not exit")
        if not max_restarts:
            return status
        verdict = judge_exit(status, stops.first)
        ended = f"job exited {status} ({verdict.reason})"
        if not verdict.restart:
            say(f"{ended}; not restarting")
            return status
        if restarts == max_restarts:
            say(f"{ended}; no restarts left (--max-restarts {max_restarts})")
            return status
        if left:  # they would compete with the new ranks for the GPUs and the run directory
            say(f"{ended}; not restarting beside processes of the failed attempt")
            return status
        restarts += 1
        say(f"{ended}; restart {restarts} of {max_restarts} in {RESTART_DELAY_SECONDS:g} s "
            "(an hvdtrain job resumes from its last checkpoint)")
        if stops.pause(RESTART_DELAY_SECONDS):
            say(f"{signal_name(stops.first)} before the restart; not restarting")
            return status_for_stop(stops.first)


def parse_options(argv: Sequence[str] | None) -> tuple[LaunchOptions, bool, bool]:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROGRAM}", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [--] MODULE|SCRIPT.py [arguments...]")
    parser.add_argument("--np", type=int, help="number of ranks (default: the allocation's tasks, "
                                               "else this machine's GPUs, else 1)")
    parser.add_argument("--via", choices=VIAS, default="horovodrun",
                        help="what starts the ranks (default horovodrun)")
    parser.add_argument("--controller", choices=("mpi", "gloo"),
                        help="horovod controller (horovodrun only; default: horovodrun's "
                             "choice, MPI)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the ranks (default: this one)")
    parser.add_argument("--keras", choices=("2", "3"), default="2",
                        help="the Keras of the ranks: 2 (tf_keras, which horovod.tensorflow.keras "
                             "needs; default) or 3 (TensorFlow's; hvdtrain jobs then use "
                             "hvdtrain's own horovod integration)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and environment, start nothing")
    parser.add_argument("--skip-preflight", action="store_true",
                        help="don't check horovod's build and GPUs first (saves ~3 s)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="start a failed job again in the same allocation up to this many "
                             f"times, {RESTART_DELAY_SECONDS:g} s apart (default 0); not after a "
                             "user error (exit 2), a preemption stop (75) or a stop signal")
    tuning = parser.add_argument_group("horovod tuning (passed to every rank)")
    tuning.add_argument("--timeline-filename", help="write a Horovod timeline (chrome://tracing)")
    tuning.add_argument("--autotune", action="store_true", help="let horovod tune fusion/cycle")
    tuning.add_argument("--autotune-log-file")
    tuning.add_argument("--fusion-threshold-mb", type=float,
                        help="tensor fusion buffer in MiB (horovod default 128)")
    tuning.add_argument("--cycle-time-ms", type=float,
                        help="background thread cycle in ms (horovod default 1)")
    tuning.add_argument("--stall-check-warning-seconds", type=int,
                        help="warn when a rank has not joined a collective for this long")
    tuning.add_argument("--stall-check-shutdown-seconds", type=int,
                        help="end the job when a rank has stalled this long")
    tuning.add_argument("--no-stall-check", action="store_true")
    tuning.add_argument("--binding-args", help="process binding arguments for mpirun/srun, "
                                               "e.g. '--bind-to core --map-by socket'")
    tuning.add_argument("--allow-run-as-root", action="store_true",
                        help="let mpirun start as root (horovodrun does this itself)")
    hosts = parser.add_argument_group("several hosts")
    hosts.add_argument("-H", "--hosts",
                       help="outside Slurm: hosts and ranks per host, node1:2,node2:2 (reached "
                            "over passwordless ssh, as horovodrun does); inside an allocation "
                            "Slurm's hosts are used")
    hosts.add_argument("--network-interface",
                       help="the interface(s) the ranks talk over, e.g. eth0 or eth0,ib0 "
                            "(default: the ones the network check finds connecting every host; "
                            "passed to horovodrun, mpirun's btl/oob_tcp_if_include, Gloo and "
                            "NCCL)")
    parser.add_argument("program", help="what every rank runs: a module (hvdtrain.cnn, run as "
                                        "python -m) or a script path (train.py)")
    parser.add_argument("program_args", nargs=argparse.REMAINDER,
                        help="arguments for the module or script")
    args = parser.parse_args(argv)
    # Every LaunchOptions field is a flag of the same name.
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(LaunchOptions)}
    options = LaunchOptions(**{**values, "program_args": tuple(args.program_args)})
    return options, args.dry_run, args.skip_preflight


def run(argv: Sequence[str] | None = None) -> int:
    stops = StopSignals()
    options, dry_run, skip_preflight = parse_options(argv)
    program_command(options)  # a missing script or module is reported before the ~3 s probe
    if not is_script_path(options.program):
        check_module(options.python, options.program)
    allocation = Allocation.from_env(os.environ)
    running_as_root = os.geteuid() == 0
    build = None if skip_preflight else probe_build(options.python)
    if build is not None:
        problems = preflight(build, allocation, options.np, options,
                             running_as_root=running_as_root, env=os.environ)
        if problems:
            for problem in problems:
                print(f"{PROGRAM}: error: {problem}", file=sys.stderr)
            return EXIT_USAGE
    gpus = build.gpus if build else count_gpus_without_tensorflow()
    interfaces = network_interfaces(options, allocation, check=not (skip_preflight or dry_run))
    launch = build_launch(options, allocation, gpus, running_as_root, interfaces)
    if dry_run:
        print(describe(launch))
        return 0
    with reaper(options.python):
        return run_attempts(launch, options.max_restarts, stops)


def network_interfaces(options: LaunchOptions, allocation: Allocation | None,
                       check: bool) -> tuple[str, ...] | None:
    """The interfaces the ranks must talk over: across several hosts, checked first (a wrong one
    would make the ranks hang in their first allreduce)."""
    told = tuple(options.network_interface.split(",")) if options.network_interface else None
    hosts = job_hosts(options, allocation)
    if len(hosts) < 2 or not check:
        return told
    if allocation is not None:  # Slurm's own channel reaches every node of the allocation
        start = netcheck.start_with_srun(options.python, len(hosts))
    else:  # ssh, which horovodrun and mpirun use to start the remote ranks too
        start = netcheck.start_with_ssh(options.python, hosts, local_host_names())
    started = time.monotonic()
    try:
        plan = netcheck.check(hosts, options.network_interface, start)
    except netcheck.NetworkError as error:
        raise UserError(f"network check: {error}") from None
    say(f"{plan.note} [{time.monotonic() - started:.1f} s]")
    return plan.interfaces if told is None else told


def local_host_names() -> set[str]:
    import socket

    name = socket.gethostname()
    return {"localhost", "127.0.0.1", name, name.split(".")[0]}


@contextlib.contextmanager
def reaper(python: str):
    """While the job runs, a watcher that ends it if this launcher dies.

    The ranks run in a session of their own (so that forwarded signals reach them, not the
    user's shell), so a launcher killed with SIGKILL, or whose terminal or ssh connection went
    away (SIGHUP), would leave them training, on every node, holding the GPUs and the run
    directory. The watcher holds a pipe whose other end only this process has: when it reads end
    of file without the word "done", the launcher died, and it sends SIGTERM to every process of
    the job on this host (mpirun passes it to the ranks of every node; the ranks checkpoint and
    stop together), then SIGKILL to what is left after a grace period.
    """
    read_end, write_end = os.pipe()
    watcher = subprocess.Popen(
        [python, "-m", "hvdtrain.launch_reaper", str(read_end), str(os.getpid())], pass_fds=(read_end,), start_new_session=True,
        stdin=subprocess.DEVNULL)
    os.close(read_end)
    try:
        yield
    finally:
        try:
            os.write(write_end, b"done")
        except OSError:  # the watcher is gone already; nothing to tell it
            pass
        os.close(write_end)
        watcher.wait()


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
