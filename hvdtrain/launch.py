"""Start a training module on the right ranks: `python -m hvdtrain.launch [options] -- MODULE [args]`.

Outside Slurm it runs ``horovodrun -np N`` on this machine (N: the GPU count, or 1 on CPU). Inside a
Slurm allocation it reads the hosts, tasks and GPUs per node from the allocation and passes them on
(``-np``/``-H`` to horovodrun, or lets ``mpirun``/``srun --mpi=pmix`` read the allocation; pick
with ``--via``). Before launching it checks horovod's build, the GPUs per node and the rank count;
each problem is one line and exit status 2. ``--dry-run`` prints the command and environment.

Signals: SIGUSR1, SIGTERM and SIGINT are forwarded to the ranks (SIGUSR1 is Slurm's warning before
the time limit; the ranks write a checkpoint and exit 75). The exit status is the job's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from hvdtrain.errors import EXIT_PREEMPTED, EXIT_USAGE, UserError, reported
from hvdtrain.slurm import Allocation

PROGRAM = "hvdtrain.launch"
VIAS = ("horovodrun", "mpirun", "srun")
_FORWARDED_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


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
    module: str
    module_args: tuple[str, ...] = ()
    np: int | None = None
    via: str = "horovodrun"
    controller: str | None = None  # "mpi" or "gloo" (horovodrun only)
    python: str = sys.executable
    timeline_filename: str | None = None
    autotune: bool = False
    autotune_log_file: str | None = None
    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    stall_check_warning_seconds: int | None = None
    stall_check_shutdown_seconds: int | None = None
    no_stall_check: bool = False
    binding_args: str | None = None
    allow_run_as_root: bool = False


@dataclass(frozen=True)
class Launch:
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables added to (or changed in) the environment the command runs with."""
    notes: tuple[str, ...] = ()
    exit_codes_collapsed: bool = False
    """horovodrun --gloo reports every failed job as 1, whatever its ranks exited with."""


def probe_build(python: str) -> Build:
    """Ask a child interpreter what horovod was built with, and how many GPUs this node has."""
    code = r"""
import json, hvdtrain
from hvdtrain.errors import first_line
result = {"tensorflow": False, "mpi": False, "gloo": False, "gpus": 0}
try:
    import tensorflow as tf
    result["gpus"] = len(tf.config.list_physical_devices("GPU"))
    from hvdtrain.horovod_runtime import build_info
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
    if options.controller == "gloo" and options.via != "horovodrun":
        raise UserError("--controller gloo needs --via horovodrun (it runs the Gloo rendezvous)")
    return env


def build_launch(options: LaunchOptions, allocation: Allocation | None, gpus: int,
                 running_as_root: bool = False) -> Launch:
    """The exact command for these options and this allocation (pure: no processes started)."""
    notes = []
    if allocation is not None:
        np = options.np or allocation.num_tasks
        hosts = allocation.host_slots()
        notes.append(f"Slurm job {allocation.job_id}: {len(allocation.hosts)} node(s), "
                     f"{hosts}, {allocation.gpus_per_host or 0} GPU(s) per node")
    else:
        np = options.np or max(1, gpus)
        hosts = f"localhost:{np}"
        notes.append(f"no Slurm allocation: {np} rank(s) on this machine"
                     + ("" if options.np else f" (one per GPU; {gpus} GPU(s) seen)"))
    env = horovod_tuning_env(options)
    collapsed = False
    program = [options.python, "-m", options.module, *options.module_args]
    binding = shlex.split(options.binding_args) if options.binding_args else []

    if options.via == "horovodrun":
        # The horovodrun next to the ranks' interpreter, so both come from the same venv.
        horovodrun = os.path.join(os.path.dirname(options.python), "horovodrun")
        if not os.path.exists(horovodrun):
            horovodrun = shutil.which("horovodrun") or "horovodrun"
        argv = [horovodrun, "-np", str(np), "-H", hosts]
        if options.controller:
            argv.append(f"--{options.controller}")
        collapsed = options.controller == "gloo"
        if binding:
            argv += ["--binding-args", options.binding_args]
        argv += program
    elif options.via == "mpirun":
        # Inside an allocation OpenMPI reads hosts and slots itself and starts remote daemons
        # through Slurm; -np keeps the count explicit. Outside, -H names this machine's slots.
        argv = ["mpirun", "-np", str(np)]
        if allocation is None:
            argv += ["-H", hosts]
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
    else:
        raise UserError(f"--via must be one of {', '.join(VIAS)}, got {options.via!r}")
    return Launch(tuple(argv), env, tuple(notes),
                  exit_codes_collapsed=options.via == "horovodrun" and collapsed)


def describe(launch: Launch) -> str:
    lines = [f"# {note}" for note in launch.notes]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(launch.env.items())]
    lines.append(shlex.join(launch.argv))
    return "\n".join(lines)


def local_ranks_under(root: int) -> list[int]:
    """PIDs of the rank processes started under ``root`` on this machine (any depth)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    ranks, todo = [], list(parents.get(root, []))
    while todo:
        pid = todo.pop()
        todo += parents.get(pid, [])
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                variables = environ.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith((b"HOROVOD_RANK=", b"OMPI_COMM_WORLD_RANK=")) for v in variables):
            ranks.append(pid)
    return ranks


def run_forwarding_signals(launch: Launch) -> int:
    """Run the command in its own process group; forward stop signals to the ranks."""
    def ignore_usr1_in_shells():
        # horovodrun execs `/bin/sh -c mpirun ...`; a shell that starts with SIGUSR1 ignored keeps
        # ignoring it, so the group signal below stops at mpirun (which forwards it to every rank,
        # on every node) instead of killing the shell. Python ranks install their own handler.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)

    process = subprocess.Popen(launch.argv, env={**os.environ, **launch.env},
                               start_new_session=True, preexec_fn=ignore_usr1_in_shells)

    forwarded = []

    def forward(signum, frame):
        forwarded.append(signum)
        try:
            os.killpg(process.pid, signum)
        except ProcessLookupError:
            pass
        # horovodrun --gloo starts each rank in a session of its own, out of the group's reach;
        # signal the ranks on this machine directly (twice is harmless: the handler records).
        for pid in local_ranks_under(process.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for signum in _FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    returncode = process.wait()  # resumes by itself after each forwarded signal
    if returncode == 1 and launch.exit_codes_collapsed and signal.SIGUSR1 in forwarded:
        # The ranks stopped on the forwarded SIGUSR1 (exit 75, checkpoint written), but Gloo's
        # horovodrun turned that into 1; give the sbatch script the status it requeues on.
        print(f"{PROGRAM}: the ranks stopped on SIGUSR1; exiting {EXIT_PREEMPTED} so the job "
              "is requeued", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED
    return returncode if returncode >= 0 else 128 - returncode


def parse_options(argv: Sequence[str] | None) -> tuple[LaunchOptions, bool, bool]:
    parser = argparse.ArgumentParser(
        prog=f"python -m {PROGRAM}", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [options] [--] MODULE [training flags...]")
    parser.add_argument("--np", type=int, help="number of ranks (default: the allocation's tasks, "
                                               "else this machine's GPUs, else 1)")
    parser.add_argument("--via", choices=VIAS, default="horovodrun",
                        help="what starts the ranks (default horovodrun)")
    parser.add_argument("--controller", choices=("mpi", "gloo"),
                        help="horovod controller (horovodrun only; default: horovodrun's choice, MPI)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter of the ranks (default: this one)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the command and environment, start nothing")
    parser.add_argument("--skip-preflight", action="store_true",
                        help="don't check horovod's build and GPUs first (saves ~3 s)")
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
    parser.add_argument("module", help="training module, e.g. hvdtrain.cnn")
    parser.add_argument("module_args", nargs=argparse.REMAINDER,
                        help="flags for the training module")
    args = parser.parse_args(argv)
    # Every LaunchOptions field is a flag of the same name.
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(LaunchOptions)}
    options = LaunchOptions(**{**values, "module_args": tuple(args.module_args)})
    return options, args.dry_run, args.skip_preflight


def run(argv: Sequence[str] | None = None) -> int:
    # A stop signal during the preflight probe (seconds) must not kill the launcher: record it,
    # and if it came before any rank started, stop with the status it asks for.
    early: list[int] = []
    for signum in _FORWARDED_SIGNALS:
        signal.signal(signum, lambda number, frame: early.append(number))
    options, dry_run, skip_preflight = parse_options(argv)
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
    launch = build_launch(options, allocation, gpus, running_as_root)
    if dry_run:
        print(describe(launch))
        return 0
    if early:
        print(f"{PROGRAM}: {signal.Signals(early[0]).name} before the ranks started; not "
              "starting them", file=sys.stderr, flush=True)
        return EXIT_PREEMPTED if early[0] == signal.SIGUSR1 else 128 + early[0]
    print(f"{PROGRAM}: {shlex.join(launch.argv)}", file=sys.stderr, flush=True)
    return run_forwarding_signals(launch)


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))


if __name__ == "__main__":
    main()
