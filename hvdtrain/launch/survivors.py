"""``--min-nodes N``: a lost host does not end the job.

After an attempt failed in a way worth a restart, the launcher asks every host of the job whether
it still answers, over the channel the ranks are started with: ssh outside Slurm (as horovodrun
and mpirun reach hosts), an srun step inside an allocation (the node's slurmd). A host that does
not (crashed, its link down, its daemon gone) is dropped; when at least N hosts are left the job
restarts on them, from its last checkpoint, at the smaller world size (an hvdtrain job plans
again for the workers it has: see hvdtrain.training.plan). Fewer than N left: one line, and the job ends.

Inside Slurm the job must outlive the node: ``sbatch --no-kill`` (Slurm then takes the failed node
out of the job instead of ending it), e.g. ``sbatch --no-kill -N 2-3 slurm/multinode.sh`` with
``HVDTRAIN_MIN_NODES=2``. The restarted step names the nodes it uses (``srun --nodelist``,
``mpirun -H``), whatever Slurm still lists.
"""
from __future__ import annotations

import dataclasses
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

from hvdtrain.errors import UserError
from hvdtrain.launch.options import LaunchOptions, host_slots, parse_hosts
from hvdtrain.launch.remote import on_host
from hvdtrain.launch.slurm import Allocation

#: Seconds a host has to answer ssh (its ConnectTimeout is 10) before it counts as gone.
ANSWER_SECONDS = 30.0


def host_problem(host: str, in_allocation: bool = False,
                 timeout: float = ANSWER_SECONDS) -> str | None:
    """None when ``host`` answers (ssh, or inside an allocation an srun step there); otherwise
    why it counts as gone, in a few words."""
    channel = "srun" if in_allocation else "ssh"
    try:
        answered = subprocess.run(on_host(host, ["true"], in_allocation), capture_output=True,
                                  text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"no answer over {channel} in {timeout:g} s"
    if answered.returncode == 0:
        return None
    said = (answered.stderr.strip().splitlines() or [f"exit {answered.returncode}"])[-1]
    return f"{channel}: {said.strip()}"


def hosts_left(hosts: list[tuple[str, int]], problems: Mapping[str, str | None],
               min_nodes: int) -> list[tuple[str, int]]:
    """The hosts (and their slots) without a problem, in order; ``UserError`` naming what was
    lost when fewer than ``min_nodes`` are left."""
    left = [(host, slots) for host, slots in hosts if not problems.get(host)]
    if len(left) < min_nodes:
        raise UserError(f"{lost(problems)}; {len(left)} host(s) left, fewer than --min-nodes "
                        f"{min_nodes}: not restarting")
    return left


def lost(problems: Mapping[str, str | None]) -> str:
    return ", ".join(f"{host} is gone ({why})" for host, why in problems.items() if why)


class Survivors:
    """The job's hosts as they are now; ``after_failure`` drops the ones that stopped answering
    and rebuilds the launch for the rest (``rebuild``: (options, allocation) -> what the
    attempts run with)."""

    def __init__(self, options: LaunchOptions, allocation: Allocation | None,
                 rebuild: Callable[[LaunchOptions, Allocation | None], Any],
                 ask: Callable[[str], str | None] | None = None):
        self.options, self.allocation = options, allocation
        self.hosts = (list(zip(allocation.hosts, allocation.slots)) if allocation
                      else parse_hosts(options.hosts))
        self.rebuild = rebuild
        self.ask = ask or (lambda host: host_problem(host, in_allocation=allocation is not None))

    def after_failure(self) -> tuple[Any, str] | None:
        """None when every host still answers (restart as before); else what ``rebuild`` made
        of the hosts left, and a few words for the restart line. ``UserError``: too few left."""
        with ThreadPoolExecutor(max_workers=min(32, len(self.hosts))) as pool:
            answers = dict(zip((host for host, _ in self.hosts),
                               pool.map(self.ask, (host for host, _ in self.hosts))))
        if not any(answers.values()):
            return None
        left = hosts_left(self.hosts, answers, self.options.min_nodes)
        self.hosts = left
        # Every slot of the hosts left: a rank count given with --np was for all of them.
        self.options = dataclasses.replace(self.options, np=None)
        if self.allocation is None:
            self.options = dataclasses.replace(self.options, hosts=host_slots(left))
        else:
            self.allocation = dataclasses.replace(
                self.allocation, hosts=tuple(host for host, _ in left),
                slots=tuple(slots for _, slots in left),
                dropped=(*self.allocation.dropped,
                         *(host for host, why in answers.items() if why)))
        ranks = sum(slots for _, slots in left)
        return (self.rebuild(self.options, self.allocation),
                f"on the {len(left)} host(s) left ({host_slots(left)}, {ranks} rank(s)) since "
                f"{lost(answers)},")
