"""``python -m hvdtrain.launch``: the launcher's steps, in order (see the package's docstring)."""
from __future__ import annotations

import os
import sys
from typing import Sequence

import hvdtrain.launch
from hvdtrain import ranklog
from hvdtrain.errors import EXIT_USAGE, reported, signal_name, stop_status
from hvdtrain.launch import container, sbatch
from hvdtrain.launch.console import PROGRAM, error, say
from hvdtrain.launch.health_check import health_options, health_seconds, run_health_check
from hvdtrain.launch.network import local_host_names, network_interfaces
from hvdtrain.launch.options import check_options, is_script_path, parse_options, run_dir_of
from hvdtrain.launch.paths import build_launch, describe, job_hosts
from hvdtrain.launch.preflight import count_gpus_without_tensorflow, preflight, probe
from hvdtrain.launch.slurm import Allocation
from hvdtrain.launch.supervise import (ATTEMPT_VARIABLE, SignalForwarder, StoppedBeforeLaunch,
                                       kill_children, rank_zero_host, run_attempts)
from hvdtrain.launch.survivors import Survivors
from hvdtrain.launch.watcher import watching


def run(argv: Sequence[str] | None = None) -> int:
    signals = SignalForwarder()  # from the start: the preflight probe takes seconds
    options = parse_options(argv, hvdtrain.launch.__doc__)
    if options.sbatch:  # the body of an sbatch script: the job's variables, its run directory
        options, batch_run_dir = sbatch.batch_options(options, os.environ)
        os.environ["HVDTRAIN_RUN_DIR"] = batch_run_dir  # where a script of your own finds it
    allocation = Allocation.from_env(os.environ)
    # Every mistake in the options, before the probe and anything else starts.
    check_options(options, allocation.hosts if allocation else None)
    # With --container the probes run in the image (Charliecloud), or not at all (pyxis: each
    # would be a job step importing the image; the ranks report a broken image themselves).
    options, probe_on = container.prepare(options)
    probes = not options.container or probe_on is not None
    python = options.container_python if options.container else options.python
    running_as_root = os.geteuid() == 0
    build = None
    if probes:  # one child of the ranks' Python answers both
        build = probe(python, None if is_script_path(options.program) else options.program,
                      build=not options.skip_preflight, on=probe_on)
    if build is not None:
        problems = preflight(build, allocation, options.np, options,
                             running_as_root=running_as_root, env=os.environ)
        if problems:
            for problem in problems:
                error(problem)
            return EXIT_USAGE
    gpus = build.gpus if build else count_gpus_without_tensorflow()
    interfaces = network_interfaces(options, allocation,
                                    check=not (options.skip_preflight or options.dry_run))
    # Remote ranks carry the attempt's marker too (mpirun passes it with -x), so rank 0's host
    # can say whether rank 0 still runs.
    environment = os.environ if options.dry_run else {**os.environ, ATTEMPT_VARIABLE: ""}

    def launch_for(job_options, job_allocation):  # the job, the health check, a restart
        return build_launch(job_options, job_allocation, gpus, running_as_root, interfaces,
                            environment)

    launch = launch_for(options, allocation)
    if options.dry_run:
        print(describe(launch))
        return 0
    run_dir = run_dir_of(options, os.environ)  # None: a job the launcher cannot tell

    def rank_zero_of(job_options, job_allocation):
        return rank_zero_host(job_hosts(job_options, job_allocation), local_host_names(),
                              options.python, in_allocation=job_allocation is not None)

    def relaunch(job_options, job_allocation):  # --min-nodes: the job on the hosts left
        return (launch_for(job_options, job_allocation),
                rank_zero_of(job_options, job_allocation))

    survivors = Survivors(options, allocation, relaunch) if options.min_nodes else None
    # pyxis imports the image inside each task's start, before any rank process exists: minutes
    # for a large image, which a start-up deadline would take for a node never reached.
    pyxis = options.container and options.container_runtime == "pyxis"
    status = 0
    with watching(options.python):  # the health check's ranks too
        if options.health_check or options.health_check_only:
            gpus_per_node = (allocation.gpus_per_host if allocation and allocation.gpus_per_host
                             is not None else gpus)
            status = run_health_check(
                launch_for(health_options(options, gpus_per_node), allocation), signals,
                health_seconds(gpus_per_node, os.environ), gpus_per_node)
        if not (status or options.health_check_only):
            status = run_attempts(launch, options.max_restarts, signals,
                                  rank_zero_of(options, allocation),
                                  logs_dir=run_dir and os.path.join(run_dir, ranklog.LOGS),
                                  survivors=survivors,
                                  startup_seconds=0 if pyxis else options.startup_timeout)
    if options.sbatch:
        sbatch.requeue_if_stopped(status, options, run_dir, os.environ)
    return status


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        try:
            status = run(argv)
        except StoppedBeforeLaunch as stop:  # e.g. Ctrl-C during the preflight probe
            kill_children()
            say(f"{signal_name(stop.signum)} before the ranks started; not starting them")
            status = stop_status(stop.signum)
        sys.exit(status)


if __name__ == "__main__":
    main()
