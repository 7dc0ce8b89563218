"""The command that starts every rank, one function per launch path (horovodrun, mpirun, srun).

``build_launch`` decides what every path shares (how many ranks on which hosts, horovod's tuning,
the program, the network interfaces) into a ``Plan``; the path's entry in ``LAUNCH_PATHS`` turns
the plan into its command. A new path is one function and one entry (and, if it needs a
horovod feature, one line in ``preflight``). Pure: nothing here starts a process.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping

from hvdtrain import default_keras
from hvdtrain.credentials import without_userinfo
from hvdtrain.launch import container
from hvdtrain.launch.options import (LaunchOptions, host_slots, keras_2_reason, parse_hosts,
                                     program_command, ranks_keras, shell_words)
from hvdtrain.launch.slurm import Allocation
from hvdtrain.launcher_env import is_identity

#: Variables of the launcher's environment never passed on to remote ranks, as horovodrun leaves
#: them out (horovod/runner/common/util/env.py): bash's exported functions, the previous
#: directory, horovodrun's own secret, and which GPUs this host shows: every host has its own
#: (a launcher shell that hides its GPUs with CUDA_VISIBLE_DEVICES="" would hide every host's).
_NOT_FORWARDED = re.compile(r"BASH_FUNC_.*|OLDPWD|_HOROVOD_SECRET_KEY|.*CUDA_VISIBLE_DEVICES")


@dataclass(frozen=True)
class Launch:
    argv: tuple[str, ...]
    """The command that starts every rank."""
    env: dict[str, str]
    """Variables added to (or changed in) the environment the command runs with."""
    notes: tuple[str, ...] = ()
    """What the launcher derived (allocation, rank count, restarts), for --dry-run."""


@dataclass(frozen=True)
class Plan:
    """What every launch path is told: the same for all of them."""

    options: LaunchOptions
    allocation: Allocation | None
    """The Slurm allocation the launcher runs in, or None outside Slurm."""
    np: int
    """Ranks to start."""
    hosts: str
    """The hosts and their slots in -H syntax (node1:4,node2:4)."""
    program: list[str]
    """What every rank runs (program_command)."""
    env: dict[str, str]
    """Variables every rank must see (horovod's tuning, the Keras choice); a path adds its own."""
    interfaces: str | None
    """The network interfaces the ranks talk over, comma-separated; None: each transport's pick."""
    binding: list[str]
    """--binding-args, split."""
    running_as_root: bool
    forwarded: tuple[str, ...] = ()
    """Outside Slurm, the names of the launcher's environment the ranks on every host must get
    too, as from the user's shell (inside an allocation Slurm passes the environment on)."""


def horovodrun_command(plan: Plan) -> list[str]:
    options = plan.options
    # The horovodrun next to the ranks' interpreter, so both come from the same venv.
    horovodrun = os.path.join(os.path.dirname(options.python), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun") or "horovodrun"
    argv = [horovodrun, "-np", str(plan.np), "-H", plan.hosts]
    if lost_node_mpirun_args(plan):  # with the equal sign, as horovodrun's help asks
        argv.append(f"--mpi-args={shlex.join(lost_node_mpirun_args(plan))}")
    if options.controller:
        argv.append(f"--{options.controller}")
    if plan.interfaces:  # horovodrun passes it on to mpirun's MCA options or to Gloo
        argv += ["--network-interface", plan.interfaces]
    if plan.binding:
        argv += ["--binding-args", options.binding_args]
    return argv + plan.program


def lost_node_mpirun_args(plan: Plan) -> list[str]:
    """mpirun's extra arguments inside an allocation that lost a node (--min-nodes): OpenMPI
    starts its daemons with an srun step, which waited forever for the CPUs the failed step still
    held in Slurm's books (tried on the local Slurm); --overlap lets it share them."""
    if plan.allocation is None or not plan.allocation.dropped:
        return []
    return ["--mca", "plm_slurm_args", "--overlap"]


def mpirun_command(plan: Plan) -> list[str]:
    # Inside an allocation OpenMPI reads hosts and slots itself and starts remote daemons
    # through Slurm; -np keeps the count explicit. Outside, -H names the hosts' slots.
    argv = ["mpirun", "-np", str(plan.np)]
    if plan.allocation is None or plan.allocation.dropped:  # not every host of the allocation
        argv += ["-H", plan.hosts]
    argv += lost_node_mpirun_args(plan)
    if plan.interfaces:
        argv += ["--mca", "btl_tcp_if_include", plan.interfaces,
                 "--mca", "oob_tcp_if_include", plan.interfaces]
    if plan.running_as_root and plan.options.allow_run_as_root:
        argv.append("--allow-run-as-root")
    # One process per slot with no core binding, as horovodrun does by default: ranks size
    # their own thread pools (hvdtrain.runtime.configure_devices).
    argv += plan.binding or ["--bind-to", "none", "--map-by", "slot"]
    # Remote ranks see only the variables passed with -x (each takes its value from mpirun's
    # environment): the user's, as horovodrun passes them, and the launcher's own.
    for name in sorted({*plan.env, *plan.forwarded}):
        argv += ["-x", name]
    return argv + plan.program


def srun_command(plan: Plan) -> list[str]:
    if plan.interfaces:  # srun passes the environment on; each rank's MPI reads these
        plan.env["OMPI_MCA_btl_tcp_if_include"] = plan.interfaces
        plan.env["OMPI_MCA_oob_tcp_if_include"] = plan.interfaces
    flags, program = [], plan.program
    if plan.options.container:
        runtime = plan.options.container_runtime
        flags, program = container.wrap(runtime, plan.options.container, plan.program,
                                        container.job_roots(plan.options), os.getcwd())
        plan.env.update(container.rank_env(runtime, os.environ))
    # Hosts left out (--min-nodes) are named away: srun would take the job's node count and
    # list from its environment. --overlap: the failed step may still hold its CPUs in Slurm's
    # books until the lost node is declared down.
    hosts = ([f"--nodes={len(plan.allocation.hosts)}",
              f"--nodelist={','.join(plan.allocation.hosts)}", "--overlap"]
             if plan.allocation.dropped else [])
    # Each rank its allocation's cores: srun 22.05-23.02 does not take --cpus-per-task from
    # SLURM_CPUS_PER_TASK (Slurm 22.05's release notes; 23.11 restored it), and a step without
    # it binds each task to one core, which then decodes the data for a whole GPU.
    cpus = plan.allocation.cpus_per_task
    per_task = ([f"--cpus-per-task={cpus}"] if cpus and not any(
        arg.startswith(("--cpus-per-task", "-c")) for arg in plan.binding) else [])
    # A rank that dies must end the step: by default srun lets the others run on, and they
    # would wait in their next allreduce forever.
    return ["srun", "--mpi=pmix", *hosts, f"--ntasks={plan.np}", *per_task,
            "--kill-on-bad-exit=1", *plan.binding, *flags, *program]


#: --via NAME -> the function that writes its command.
LAUNCH_PATHS: dict[str, Callable[[Plan], list[str]]] = {
    "horovodrun": horovodrun_command,
    "mpirun": mpirun_command,
    "srun": srun_command,
}


def build_launch(options: LaunchOptions, allocation: Allocation | None, gpus: int,
                 running_as_root: bool = False,
                 interfaces: tuple[str, ...] | None = None,
                 environment: Mapping[str, str] | None = None) -> Launch:
    """The exact command for these options and this allocation.

    ``interfaces``: the network interfaces the ranks must talk over (the network check's choice,
    or --network-interface); None leaves the choice to MPI, Gloo and NCCL. ``environment``: the
    launcher's, which the ranks on every host get too (less who the launcher itself is, should
    it run inside another job). The options are checked (``options.check_options``).
    """
    notes = []
    if allocation is not None:
        np = options.np or allocation.num_tasks
        hosts = allocation.host_slots()
        notes.append(f"Slurm job {allocation.job_id}: {len(allocation.hosts)} node(s), "
                     f"{hosts}, {allocation.gpus_per_host or 0} GPU(s) per node")
    elif options.hosts is not None:
        slots = parse_hosts(options.hosts)
        np = options.np or sum(count for _, count in slots)
        hosts = host_slots(slots)
        notes.append(f"no Slurm allocation: {np} rank(s) on {hosts}")
    else:
        np = options.np or max(1, gpus)
        hosts = f"localhost:{np}"
        notes.append(f"no Slurm allocation: {np} rank(s) on this machine"
                     + ("" if options.np else f" (one per GPU; {gpus} GPU(s) seen)"))
    env = horovod_tuning_env(options)
    # hvdtrain chooses its Keras at import, in each rank: tell every rank, on every node, the
    # one choice (a Keras 3 process exports HVDTRAIN_KERAS=3 to whatever it starts, and the
    # ranks would inherit it from a launcher started by one).
    launcher_env = os.environ if environment is None else environment
    env["HVDTRAIN_KERAS"] = ranks_keras(options, launcher_env)
    if options.keras == "auto" and env["HVDTRAIN_KERAS"] != default_keras(launcher_env):
        notes.append(f"Keras 2: {options.program} {keras_2_reason(options.program)} "
                     "(--keras 3 to override)")
    interface_list = ",".join(interfaces) if interfaces else None
    if interface_list:
        # Every transport picks its own interface, and each can pick one that connects nothing
        # (docker0 on every node): MPI's TCP transport and its out-of-band channel, NCCL on GPU
        # nodes, horovod's Gloo. Pin them all to the interfaces that connect the hosts.
        env["NCCL_SOCKET_IFNAME"] = interface_list
        notes.append(f"network interface(s): {interface_list}")
    plan = Plan(options=options, allocation=allocation, np=np, hosts=hosts,
                program=program_command(options, launcher_env), env=env, interfaces=interface_list,
                binding=shell_words(options.binding_args or "",
                                    f"--binding-args {options.binding_args!r}"),
                running_as_root=running_as_root,
                forwarded=forwarded_names(environment or {}) if allocation is None else ())
    argv = LAUNCH_PATHS[options.via](plan)
    if options.max_restarts:
        notes.append(f"up to {options.max_restarts} restart(s) after a failure")
    return Launch(tuple(argv), plan.env, tuple(notes))


def forwarded_names(environment: Mapping[str, str]) -> tuple[str, ...]:
    """The variables to pass on to remote ranks: all but identity variables (a rank must not
    take itself for the launcher's own rank, should the launcher run inside another job) and
    the shell's own."""
    return tuple(sorted(name for name in environment
                        if not is_identity(name) and not _NOT_FORWARDED.fullmatch(name)))


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
    if options.hierarchical_allreduce:
        env["HOROVOD_HIERARCHICAL_ALLREDUCE"] = "1"
    if not options.stall_check:
        env["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    if options.stall_check_warning_seconds is not None:
        env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(options.stall_check_warning_seconds)
    shutdown_seconds = options.stall_check_shutdown_seconds
    if shutdown_seconds is not None:
        env["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(shutdown_seconds)
        if options.stall_check_warning_seconds is None and shutdown_seconds < 60:
            # Horovod inspects stalls every HOROVOD_STALL_CHECK_TIME_SECONDS (60): a shorter
            # shutdown limit would only be seen at the next inspection (and horovod warns).
            env["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(shutdown_seconds)
    return env


def job_hosts(options: LaunchOptions, allocation: Allocation | None) -> list[str]:
    """The hosts the ranks will run on."""
    if allocation is not None:
        return list(allocation.hosts)
    if options.hosts is not None:
        return [host for host, _ in parse_hosts(options.hosts)]
    return ["localhost"]


def describe(launch: Launch) -> str:
    """The launch as a shell would run it (--dry-run)."""
    lines = [f"# {note}" for note in launch.notes]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(launch.env.items())]
    lines.append(command_line(launch))
    return "\n".join(lines)


def command_line(launch: Launch) -> str:
    """The launch's command as printed: a URL's user-info (a tracking password) is left out
    (hvdtrain.credentials)."""
    return without_userinfo(shlex.join(launch.argv))
