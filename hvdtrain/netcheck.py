"""Can every node reach every other node, and on which network interface?

The classic multi-node hang: every node has an interface in the same subnet that connects nothing
(``docker0``, a libvirt bridge, a second NIC on another switch). Open MPI's TCP transport sees one
subnet and tries it; the ranks wait for a peer that never answers, and the job hangs until someone
kills it. horovodrun probes interfaces itself; ``mpirun`` and ``srun`` do not.

So before a job on several hosts starts, ``hvdtrain.launch`` runs one small probe per host (through
``srun`` inside Slurm, ``ssh`` outside it) and acts as their rendezvous:

1. every probe listens on each of its IPv4 interfaces (loopback aside) and reports the addresses
   and ports to the launcher;
2. the launcher sends every probe the table of all of them;
3. every probe opens a TCP connection to every other host on each interface the hosts share by
   name, from its own address on that interface, and reports what worked;
4. the launcher decides: an interface given with ``--network-interface`` must connect every pair
   of hosts, or the launch fails with one line naming the host and the interface; without one, the
   interfaces that connect everyone are passed on (nothing is passed when all of them do).

Everything here but ``main`` (the probe) runs in the launcher; neither side imports TensorFlow.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

PROGRAM = "hvdtrain.netcheck"
#: Seconds one TCP connection attempt may take before the peer counts as unreachable. A LAN
#: answers in milliseconds; a dropped SYN is retried after 1 s and 3 s by the kernel.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Seconds for every probe to start and report (an srun step or ssh, then a Python start-up).
STARTUP_TIMEOUT_SECONDS = 60.0


class NetworkError(Exception):
    """The nodes cannot all reach each other: one line naming the host and the interface."""


@dataclass(frozen=True)
class NetworkPlan:
    """What the check found, for the launcher."""

    interfaces: tuple[str, ...] | None
    """Interfaces to restrict the job's traffic to, or None: every shared interface works."""
    note: str
    """One line for the launcher's output: what was checked and what was chosen."""


def local_interfaces() -> dict[str, str]:
    """{interface: IPv4 address} of this host's interfaces that are up, loopback aside."""
    import psutil  # horovod's dependency; imported here so the launcher's start stays light

    stats = psutil.net_if_stats()
    found = {}
    for name, addresses in psutil.net_if_addrs().items():
        if name == "lo" or not (stats.get(name) and stats[name].isup):
            continue
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                found[name] = address.address
                break
    return found


# --- the wire: one JSON object per line -------------------------------------------------------------
def send(connection: socket.socket, message: dict) -> None:
    connection.sendall((json.dumps(message) + "\n").encode())


def receive(reader, what: str) -> dict:
    line = reader.readline()
    if not line:
        raise ConnectionError(f"connection closed while waiting for {what}")
    return json.loads(line)


# --- the probe (one per host) ----------------------------------------------------------------------
def connect_first(addresses: Sequence[str], port: int, timeout: float) -> socket.socket | None:
    """A connection to whichever of ``addresses`` answers first, or None."""
    def attempt(address):
        try:
            return socket.create_connection((address, port), timeout=timeout)
        except OSError:
            return None

    with ThreadPoolExecutor(max_workers=max(1, len(addresses))) as pool:
        connections = list(pool.map(attempt, addresses))
    winner = next((c for c in connections if c is not None), None)
    for connection in connections:
        if connection is not None and connection is not winner:
            connection.close()
    return winner


def reach(source: str, target: tuple[str, int], timeout: float) -> str:
    """"ok", or why a TCP connection from ``source`` to ``target`` failed."""
    started = time.monotonic()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            connection.bind((source, 0))
            connection.connect(target)
            connection.sendall(b"hvdtrain.netcheck\n")
        return "ok"
    except socket.timeout:
        return f"no answer within {timeout:g} s"
    except OSError as error:
        return f"{error.strerror or error} after {time.monotonic() - started:.1f} s"


def serve(listener: socket.socket, stop: threading.Event) -> None:
    """Accept the other probes' test connections until told to stop."""
    listener.settimeout(0.2)
    while not stop.is_set():
        try:
            connection, _ = listener.accept()
        except socket.timeout:
            continue
        except OSError:
            return
        connection.close()


def probe(rendezvous: Sequence[str], port: int, token: str, timeout: float) -> int:
    host = socket.gethostname().split(".")[0]
    interfaces = local_interfaces()
    listeners = {}
    for name, address in interfaces.items():
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(64)
        listeners[name] = listener
    connection = connect_first(rendezvous, port, timeout)
    if connection is None:
        print(f"{PROGRAM}: {host} cannot reach the launcher at {', '.join(rendezvous)} port "
              f"{port} on any of its interfaces ({', '.join(interfaces) or 'none'})",
              file=sys.stderr, flush=True)
        return 1
    # ``timeout`` was for connecting. The table comes once every host's probe has reported,
    # which a host slow to start (ssh, Python) delays by seconds; the launcher keeps the
    # deadline, and its end (or its killing this probe) closes the connection.
    connection.settimeout(None)
    stop = threading.Event()
    servers = [threading.Thread(target=serve, args=(listener, stop), daemon=True)
               for listener in listeners.values()]
    for server in servers:
        server.start()
    with connection, connection.makefile("r") as reader:
        send(connection, {"token": token, "host": host, "interfaces": {
            name: [interfaces[name], listener.getsockname()[1]]
            for name, listener in listeners.items()}})
        plan = receive(reader, "the table of hosts")
        tests = [(name, peer, tuple(addresses[name]))
                 for name in plan["interfaces"] if name in interfaces
                 for peer, addresses in plan["hosts"].items()
                 if peer != host and name in addresses]
        with ThreadPoolExecutor(max_workers=max(1, min(64, len(tests)))) as pool:
            outcomes = list(pool.map(lambda test: reach(interfaces[test[0]], test[2], timeout),
                                     tests))
        results = {}
        for (name, peer, _), outcome in zip(tests, outcomes):
            results.setdefault(name, {})[peer] = outcome
        send(connection, {"results": results})
        receive(reader, "the end of the check")  # keep listening until every host is done
    stop.set()
    return 0


# --- the launcher's side ---------------------------------------------------------------------------
def common_interfaces(registrations: Mapping[str, dict]) -> list[str]:
    """Interface names every host has, in the first host's order."""
    tables = [registration["interfaces"] for registration in registrations.values()]
    return [name for name in tables[0] if all(name in table for table in tables[1:])]


def first_failure(name: str, registrations: Mapping[str, dict],
                  results: Mapping[str, dict]) -> str | None:
    """The first host pair that cannot connect on interface ``name``, as one phrase."""
    for host in registrations:
        for peer, outcome in sorted(results[host].get(name, {}).items()):
            if outcome != "ok":
                address = registrations[peer]["interfaces"][name][0]
                return f"{host} cannot reach {peer} on {name} ({address}): {outcome}"
    return None


def decide(interface: str | None, registrations: Mapping[str, dict],
           results: Mapping[str, dict]) -> NetworkPlan:
    """Which interfaces the job may use, from what every host reported (pure)."""
    hosts = ", ".join(registrations)
    common = common_interfaces(registrations)
    failures = {name: first_failure(name, registrations, results) for name in common}
    working = [name for name in common if failures[name] is None]
    if interface is not None:
        missing = [host for host, registration in registrations.items()
                   if interface not in registration["interfaces"]]
        if missing:
            has = ", ".join(registrations[missing[0]]["interfaces"]) or "none"
            raise NetworkError(f"{missing[0]} has no network interface {interface} (it has: "
                               f"{has}); pass one that every node has to --network-interface")
        if failures[interface]:
            hint = (f"; {', '.join(working)} connects every node" if working else "")
            raise NetworkError(f"{failures[interface]}; the nodes cannot talk over "
                               f"--network-interface {interface}{hint}")
        return NetworkPlan((interface,), f"network: {interface} connects every node ({hosts})")
    if not common:
        listing = "; ".join(f"{host}: {', '.join(r['interfaces']) or 'none'}"
                            for host, r in registrations.items())
        raise NetworkError(f"the nodes have no network interface name in common ({listing}); "
                           "pass the one to use with --network-interface")
    if not working:
        raise NetworkError(f"no network interface connects every node: "
                           f"{'; '.join(failures[name] for name in common)}")
    if len(working) == len(common):
        return NetworkPlan(None, f"network: every node reaches every other on "
                                 f"{', '.join(common)} ({hosts})")
    broken = [name for name in common if name not in working]
    return NetworkPlan(tuple(working), f"network: using {', '.join(working)}; "
                       f"{', '.join(broken)} does not connect the nodes "
                       f"({failures[broken[0]]})")


def check(hosts: Sequence[str], interface: str | None,
          start_probes: Callable[[list[str]], list[subprocess.Popen]],
          timeout: float = CONNECT_TIMEOUT_SECONDS,
          startup_timeout: float = STARTUP_TIMEOUT_SECONDS) -> NetworkPlan:
    """Run the check across ``hosts`` (raises NetworkError when they cannot talk).

    ``start_probes(args)`` starts ``python -m hvdtrain.netcheck ARGS`` once on every host and
    returns the processes (their output is read for errors).
    """
    token = secrets.token_hex(8)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("0.0.0.0", 0))
        server.listen(len(hosts) + 8)
        port = server.getsockname()[1]
        mine = ["127.0.0.1", *local_interfaces().values()]
        processes = start_probes(["--rendezvous", ",".join(mine), "--port", str(port),
                                  "--token", token, "--timeout", f"{timeout:g}"])
        connections: dict[str, tuple[socket.socket, object]] = {}
        registrations: dict[str, dict] = {}
        try:
            deadline = time.monotonic() + startup_timeout
            server.settimeout(0.5)
            while len(registrations) < len(hosts):
                if time.monotonic() > deadline:
                    raise NetworkError(probes_missing(hosts, registrations, processes,
                                                      f"within {startup_timeout:g} s"))
                if all(p.poll() is not None for p in processes):
                    raise NetworkError(probes_missing(hosts, registrations, processes,
                                                      "before their probes ended"))
                try:
                    connection, _ = server.accept()
                except socket.timeout:
                    continue
                connection.settimeout(startup_timeout)
                reader = connection.makefile("r")
                try:
                    hello = receive(reader, "a probe's report")
                except (OSError, ValueError):
                    connection.close()
                    continue
                if hello.get("token") != token:  # not one of ours
                    connection.close()
                    continue
                connections[hello["host"]] = (connection, reader)
                registrations[hello["host"]] = hello
            names = common_interfaces(registrations)
            if interface and interface not in names:
                names.append(interface)
            table = {host: r["interfaces"] for host, r in registrations.items()}
            for connection, _ in connections.values():
                send(connection, {"hosts": table, "interfaces": names})
            results = {host: receive(reader, f"{host}'s results")["results"]
                       for host, (_, reader) in connections.items()}
            for connection, _ in connections.values():
                send(connection, {"done": True})
        except (OSError, ValueError) as error:
            said = probes_said(processes)
            raise NetworkError(f"the network check failed: {error}"
                               + (f" (a probe said: {said})" if said else "")) from None
        finally:
            for connection, reader in connections.values():
                reader.close()
                connection.close()
            end_probes(processes)
    # In the job's host order (they reported in the order they started), so messages are stable.
    ordered = sorted(registrations, key=lambda host: hosts.index(host) if host in hosts
                     else len(hosts))
    return decide(interface, {host: registrations[host] for host in ordered}, results)


def probes_missing(hosts: Sequence[str], registrations: Mapping[str, dict],
                   processes: list[subprocess.Popen], when: str) -> str:
    """One line: which hosts' probes never reported, with what a probe said."""
    missing = [host for host in hosts if host not in registrations]
    said = probes_said(processes)
    return (f"the network probe on {', '.join(missing) or 'some host'} did not report {when}"
            + (f": {said}" if said else ""))


def probes_said(processes: list[subprocess.Popen]) -> str:
    """The last line the first probe that printed anything printed, once they have ended."""
    end_probes(processes)
    for process in processes:
        output = process.stdout.read() if process.stdout else ""
        lines = [line.strip() for line in (output or "").splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return ""


def end_probes(processes: list[subprocess.Popen], grace: float = 10.0) -> None:
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: How the launcher reaches another host outside Slurm, as horovodrun and mpirun do: never a
#: password prompt, and a bounded wait for a host that does not answer.
SSH = ("ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10")


def probe_command(python: str, args: Sequence[str]) -> list[str]:
    return [python, "-m", "hvdtrain.netcheck", *args]


def start_with_srun(python: str, num_hosts: int) -> Callable[[list[str]], list]:
    """Probes as one Slurm step, one task per node of the allocation."""
    def start(args):
        return [subprocess.Popen(
            ["srun", f"--nodes={num_hosts}", f"--ntasks={num_hosts}", "--ntasks-per-node=1",
             "--kill-on-bad-exit=0", *probe_command(python, args)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "SLURM_CPUS_PER_TASK": "1"})]
    return start


def start_with_ssh(python: str, hosts: Sequence[str], local_names: Sequence[str]
                   ) -> Callable[[list[str]], list]:
    """Probes over ssh (as horovodrun and mpirun reach hosts outside Slurm); this host's directly."""
    import shlex

    def start(args):
        processes = []
        for host in hosts:
            command = probe_command(python, args)
            if host not in local_names:
                command = [*SSH, host,
                           f"cd {shlex.quote(os.getcwd())} && exec {shlex.join(command)}"]
            processes.append(subprocess.Popen(command, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))
        return processes
    return start


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}",
                                     description="The per-host probe of hvdtrain.launch's "
                                                 "network check (see the module docstring).")
    parser.add_argument("--rendezvous", required=True, help="the launcher's addresses, a,b,c")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--timeout", type=float, default=CONNECT_TIMEOUT_SECONDS)
    args = parser.parse_args(argv)
    sys.exit(probe(args.rendezvous.split(","), args.port, args.token, args.timeout))


if __name__ == "__main__":
    main()
