"""Across several hosts, which network interfaces the ranks talk over: checked before the ranks
start (``netcheck``), since a wrong one makes them hang in their first allreduce."""
from __future__ import annotations

import socket
import time

from hvdtrain.errors import UserError
from hvdtrain.launch import netcheck
from hvdtrain.launch.console import say
from hvdtrain.launch.options import LaunchOptions
from hvdtrain.launch.paths import job_hosts
from hvdtrain.launch.slurm import Allocation


def network_interfaces(options: LaunchOptions, allocation: Allocation | None,
                       check: bool) -> tuple[str, ...] | None:
    """The interfaces the ranks must talk over: --network-interface, else the ones the check
    finds connecting every host (None on one host, or without the check: each transport picks)."""
    told = tuple(options.network_interface.split(",")) if options.network_interface else None
    hosts = job_hosts(options, allocation)
    if len(hosts) < 2 or not check:
        return told
    local = local_host_names()
    if allocation is not None:  # Slurm's own channel reaches every node of the allocation
        start = netcheck.start_with_srun(options.python, len(hosts))
    else:  # ssh, which horovodrun and mpirun use to start the remote ranks too
        start = netcheck.start_with_ssh(options.python, hosts, local)
    started = time.monotonic()
    try:
        listen_on = netcheck.rendezvous_address([host for host in hosts if host not in local])
        plan = netcheck.check(hosts, options.network_interface, start, listen_on=listen_on)
    except netcheck.NetworkError as error:
        raise UserError(f"network check: {error}") from None
    say(f"{plan.note} [{time.monotonic() - started:.1f} s]")
    return plan.interfaces if told is None else told


def local_host_names() -> set[str]:
    name = socket.gethostname()
    return {"localhost", "127.0.0.1", name, name.split(".")[0]}
