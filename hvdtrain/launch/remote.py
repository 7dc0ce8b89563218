"""Reaching another host of the job: ssh outside Slurm, an srun step inside an allocation.

The launcher asks other hosts things before and during a job: the network probe (netcheck),
whether a host still answers (survivors), whether rank 0 still runs there (supervise). It reaches
them the way the ranks reach them: outside Slurm over ssh, as horovodrun and mpirun do; inside an
allocation as a step of the job, through the node's slurmd, which needs no ssh between nodes.
Only the commands are built here: each caller starts its own and decides what its stdin is.
"""
from __future__ import annotations

import shlex
from typing import Sequence

#: ssh as the launcher runs it: never a password prompt, and a bounded wait for a host that
#: does not answer.
SSH = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")


def shell_on(host: str, in_allocation: bool) -> tuple[str, ...]:
    """What runs one shell command line, given as the next argument, on ``host``: ssh, or
    inside an allocation a one-task step pinned to the node (``--overlap``: beside the job's own
    step, which holds the node's CPUs)."""
    if in_allocation:
        return ("srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                "--kill-on-bad-exit=0", "sh", "-c")
    return (*SSH, host)


def on_host(host: str, argv: Sequence[str], in_allocation: bool,
            cwd: str | None = None) -> list[str]:
    """The command that runs ``argv`` on ``host`` (see ``shell_on``), in directory ``cwd`` when
    given (srun starts in this one already, ssh in the home directory)."""
    line = shlex.join(argv)
    if cwd is not None:
        line = f"cd {shlex.quote(cwd)} && exec {line}"
    return [*shell_on(host, in_allocation), line]


def on_every_node(num_nodes: int, argv: Sequence[str]) -> list[str]:
    """One srun step that runs ``argv`` once on each of the allocation's ``num_nodes`` nodes,
    every task reading the step's stdin (``--input=all``)."""
    return ["srun", f"--nodes={num_nodes}", f"--ntasks={num_nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=0", "--input=all", *argv]
