"""The launcher as the body of an sbatch script (``--sbatch``; every template in slurm/ is its
#SBATCH lines and one ``exec`` of it).

What a template did in bash before, here once: the HVDTRAIN_* variables given at submission
(``slurm.BATCH_VARIABLES``), the run directory that survives a requeue, the
script-or-module dispatch, and after Slurm's time-limit warning (SIGUSR1, forwarded to the ranks
like any stop signal, see ``supervise``), the requeue of exactly this job once the ranks have
written their checkpoint and exited 75. The rule itself is Slurm knowledge:
``slurm.requeue_decision``.
"""
from __future__ import annotations

import dataclasses
import datetime
import subprocess
from typing import Mapping

from hvdtrain.errors import EXIT_PREEMPTED, UserError, first_line
from hvdtrain.launch.console import say
from hvdtrain.launch.options import VIAS, LaunchOptions, is_script_path, shell_words
from hvdtrain.launch.slurm import default_run_dir, requeue_decision


def batch_options(options: LaunchOptions, env: Mapping[str, str]) -> tuple[LaunchOptions, str]:
    """The options of this launch (the script's flags, overridden by the variables given at
    submission) and the run directory; says which run of which job this is (a requeued job's
    log shows each run)."""
    if not env.get("SLURM_JOB_ID"):
        raise UserError("--sbatch is for the body of an sbatch script, and SLURM_JOB_ID is not "
                        "set (submit the script with sbatch)")
    program = env.get("HVDTRAIN_MODULE") or options.program
    image = env.get("HVDTRAIN_CONTAINER") or options.container
    # Containers start through srun (pyxis, or ch-run per task): a container names the path.
    via = env.get("HVDTRAIN_VIA") or ("srun" if image else options.via)
    if via not in VIAS:
        raise UserError(f"HVDTRAIN_VIA must be one of {', '.join(VIAS)}, got {via!r}")
    run_dir = env.get("HVDTRAIN_RUN_DIR") or default_run_dir(env)
    # Read again after the job, to cap the requeues: checked now, before anything starts.
    requeued = whole_number(env, "SLURM_RESTART_COUNT", 0,
                            remedy="Slurm sets it to the job's requeue count; unset it")
    extra_args = shell_words(env.get("HVDTRAIN_ARGS", ""), "HVDTRAIN_ARGS")
    # An hvdtrain module is told its run directory; a script of your own gets only your flags
    # (and finds the directory in HVDTRAIN_RUN_DIR).
    run_dir_args = [] if is_script_path(program) else ["--run-dir", run_dir]
    changed = dataclasses.replace(
        options, program=program, via=via, container=image,
        program_args=(*run_dir_args, *extra_args, *options.program_args),
        max_restarts=whole_number(env, "HVDTRAIN_MAX_RESTARTS", options.max_restarts),
        max_requeues=whole_number(env, "HVDTRAIN_MAX_REQUEUES", options.max_requeues),
        min_nodes=whole_number(env, "HVDTRAIN_MIN_NODES", options.min_nodes),
        health_check=switch(env, "HVDTRAIN_HEALTH_CHECK", options.health_check),
        network_interface=env.get("HVDTRAIN_NETWORK_INTERFACE") or options.network_interface)
    say(f"job {env['SLURM_JOB_ID']} run {requeued} on "
        f"{env.get('SLURM_JOB_NODELIST', '?')}: {program} "
        f"({datetime.datetime.now().astimezone().isoformat(timespec='seconds')})")
    return changed, run_dir


def whole_number(env: Mapping[str, str], name: str, default: int, remedy: str = "") -> int:
    value = env.get(name)
    if not value:
        return default
    # isdigit alone takes '²' and other digits int() refuses
    if not (value.isascii() and value.isdigit()):
        raise UserError(f"{name} must be a whole number, got {value!r}: "
                        + (remedy or f"give it in digits 0-9 (e.g. {name}=2), or unset it"))
    return int(value)


def switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = env.get(name)
    if not value:
        return default
    if value not in ("0", "1"):
        raise UserError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


def requeue_if_stopped(status: int, options: LaunchOptions, run_dir: str,
                       env: Mapping[str, str]) -> None:
    """After the ranks stopped for requeue (exit 75), requeue this job (up to the cap)."""
    if status != EXIT_PREEMPTED:
        return
    decision = requeue_decision(env, options.max_requeues, run_dir)
    say(decision.message)
    if decision.job is None:
        return
    try:
        subprocess.run(["scontrol", "requeue", decision.job], check=True, capture_output=True,
                       text=True, timeout=60)
    except subprocess.CalledProcessError as error:
        why = first_line(RuntimeError(error.stderr or error.stdout or f"exit {error.returncode}"))
        say(f"scontrol requeue failed ({why}); to resume, submit again with "
            f"HVDTRAIN_RUN_DIR={run_dir}")
    except (OSError, subprocess.TimeoutExpired) as error:
        say(f"scontrol requeue failed ({error}); to resume, submit again with "
            f"HVDTRAIN_RUN_DIR={run_dir}")
