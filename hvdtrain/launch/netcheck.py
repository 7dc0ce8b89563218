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

Other users share the nodes: they can connect to any port the launcher opens and read every
command line in ``/proc``. So only the probes the launcher started take part:

- the launcher listens on one address, the one the probes reach it at (``rendezvous_address``);
- each probe gets a fresh random token on its stdin (never on a command line) and answers the
  launcher's challenge with an HMAC of it, so the token never crosses the network either. The
  probes trust the launcher without a proof: it holds the only address and port they connect to
  for as long as they run, and changing a TCP connection in flight takes root on the network;
- a host registers once, and every name a probe reports is checked before anything uses it
  (an interface name goes on to horovodrun, which formats it into a ``/bin/sh -c`` command);
- every wait on either side ends at a deadline the launcher sets, and the launcher reads all
  connections at once, so a peer that sends slowly or nothing holds up only itself;
- a malformed message is one line: a stranger's is refused, a probe's ends the check.

Everything here but ``main`` (the probe) runs in the launcher; neither side imports TensorFlow.
"""
from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import os
import re
import secrets
import select
import selectors
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hvdtrain.launch import remote

#: The probe's public name, the one it is started by on every host (hvdtrain/netcheck.py
#: runs ``main``).
PROGRAM = "hvdtrain.netcheck"
#: Seconds one TCP connection attempt may take before the peer counts as unreachable. A LAN
#: answers in milliseconds; a dropped SYN is retried after 1 s and 3 s by the kernel.
CONNECT_TIMEOUT_SECONDS = 5.0
#: Seconds for every probe to start and report (an srun step or ssh, then a Python start-up), and
#: again for every probe to send the results of its tests.
STARTUP_TIMEOUT_SECONDS = 60.0
#: A Linux interface name (at most IFNAMSIZ - 1 = 15 bytes) in characters a shell takes as they
#: are, not starting with "-" (an option to horovodrun and mpirun).
INTERFACE_NAME = re.compile(r"[A-Za-z0-9_.@][A-Za-z0-9_.@-]{0,14}")
#: What a probe may call its host (the first label of its host name).
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,62}")
#: The longest registration (a host's interfaces: a few hundred bytes) and the longest results
#: message (64 hosts x 16 interfaces is ~60 KB) the launcher reads; anything longer is refused,
#: so no peer can make it hold more.
REGISTRATION_BYTES = 64 * 1024
MESSAGE_BYTES = 4 * 1024 * 1024
#: Connections the launcher keeps waiting for a proof at once; past it the oldest is dropped,
#: so a flood of idle connections cannot use up its files (a probe answers in milliseconds).
MAX_UNPROVEN = 64


class NetworkError(Exception):
    """The nodes cannot all reach each other: one line naming the host and the interface."""


class ProtocolError(ValueError):
    """A message that is not what this protocol sends: from a stranger, or a broken probe."""


@dataclass(frozen=True)
class NetworkPlan:
    """What the check found, for the launcher."""

    interfaces: tuple[str, ...] | None
    """Interfaces to restrict the job's traffic to, or None: every shared interface works."""
    note: str
    """One line for the launcher's output: what was checked and what was chosen."""


def is_interface_name(name: object) -> bool:
    """Whether ``name`` is one Linux could give an interface and a shell reads as one word."""
    return isinstance(name, str) and bool(INTERFACE_NAME.fullmatch(name)) and name not in (".",
                                                                                             "..")


def local_interfaces() -> dict[str, str]:
    """{interface: IPv4 address} of this host's interfaces that are up, loopback aside (and any
    whose name the job could not be told to use)."""
    import psutil  # horovod's dependency; imported here so the launcher's start stays light

    stats = psutil.net_if_stats()
    found = {}
    for name, addresses in psutil.net_if_addrs().items():
        if name == "lo" or not is_interface_name(name) or not (stats.get(name)
                                                                and stats[name].isup):
            continue
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                found[name] = address.address
                break
    return found


# --- the wire: one JSON object per line, every read under a deadline -------------------------------
def proof(token: str, challenge: str) -> str:
    """What a probe answers the launcher's challenge with: only a holder of the token can."""
    return hmac.new(token.encode(), challenge.encode(), "sha256").hexdigest()


def parse(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        raise ProtocolError(f"a message that is not JSON: {line[:40]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a message that is not a JSON object: {line[:40]!r}")
    return message


def field(message: dict, key: str, kind: type):
    value = message.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ProtocolError(f"a message whose {key!r} is not a {kind.__name__}")
    return value


def send(connection: socket.socket, message: dict, deadline: float) -> None:
    connection.settimeout(max(0.001, deadline - time.monotonic()))
    connection.sendall((json.dumps(message) + "\n").encode())


def receive(connection: socket.socket, unread: bytearray, deadline: float, what: str) -> dict:
    """The next message on ``connection`` (``unread`` holds what came after the last one)."""
    while b"\n" not in unread:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what} did not come in time")
        connection.settimeout(remaining)
        try:
            chunk = connection.recv(65536)
        except TimeoutError:
            continue  # the deadline has passed: said above
        if not chunk:
            raise ConnectionError(f"connection closed while waiting for {what}")
        unread += chunk
        if len(unread) > MESSAGE_BYTES:
            raise ProtocolError(f"{what} longer than {MESSAGE_BYTES} bytes")
    line, _, rest = bytes(unread).partition(b"\n")
    unread[:] = rest
    return parse(line)


# --- the probe (one per host) ----------------------------------------------------------------------
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


def tests_to_run(table: dict, host: str, interfaces: Mapping[str, str]
                 ) -> list[tuple[str, str, tuple[str, int]]]:
    """(interface, peer, its address and port) for each connection this host must try."""
    try:
        return [(name, peer, (str(addresses[name][0]), int(addresses[name][1])))
                for name in table["interfaces"] if name in interfaces
                for peer, addresses in table["hosts"].items()
                if peer != host and name in addresses]
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        raise ProtocolError("a malformed table of hosts from the launcher") from None


def probe(rendezvous: str, port: int, token: str, timeout: float, wait: float) -> int:
    host = socket.gethostname().split(".")[0]
    interfaces = local_interfaces()
    listeners = {}
    for name, address in interfaces.items():
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(64)
        listeners[name] = listener
    try:
        connection = socket.create_connection((rendezvous, port), timeout=timeout)
    except OSError as error:
        print(f"{PROGRAM}: {host} cannot reach the launcher at {rendezvous} port {port} "
              f"({error.strerror or error}; this host's interfaces: "
              f"{', '.join(interfaces) or 'none'})", file=sys.stderr, flush=True)
        return 1
    stop = threading.Event()
    for listener in listeners.values():
        threading.Thread(target=serve, args=(listener, stop), daemon=True).start()
    # Each wait for the launcher ends after ``wait`` seconds: the launcher's own deadline for
    # that step, which started before this probe did, so the probe never gives up first.
    unread = bytearray()
    try:
        with connection:
            hello = receive(connection, unread, time.monotonic() + wait,
                            "the launcher's challenge")
            send(connection, {"host": host, "proof": proof(token, field(hello, "challenge", str)),
                              "interfaces": {name: [interfaces[name], listener.getsockname()[1]]
                                             for name, listener in listeners.items()}},
                 time.monotonic() + wait)
            table = receive(connection, unread, time.monotonic() + wait, "the table of hosts")
            tests = tests_to_run(table, host, interfaces)
            with ThreadPoolExecutor(max_workers=max(1, min(64, len(tests)))) as pool:
                outcomes = list(pool.map(lambda test: reach(interfaces[test[0]], test[2],
                                                            timeout), tests))
            results = {}
            for (name, peer, _), outcome in zip(tests, outcomes):
                results.setdefault(name, {})[peer] = outcome
            send(connection, {"results": results}, time.monotonic() + wait)
            # Keep listening until every host is done.
            receive(connection, unread, time.monotonic() + wait, "the end of the check")
    except (OSError, ProtocolError) as error:
        print(f"{PROGRAM}: {host}: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        stop.set()
    return 0


# --- the launcher's side ---------------------------------------------------------------------------
def registration_of(message: dict) -> tuple[str, dict]:
    """(host, {"interfaces": {name: [address, port]}}) from a proven probe's first message."""
    host = field(message, "host", str)
    if not HOST_NAME.fullmatch(host):
        raise ProtocolError(f"a probe reported the host name {host[:70]!r}, which no host has")
    interfaces = field(message, "interfaces", dict)
    for name, endpoint in interfaces.items():
        if not is_interface_name(name):
            raise ProtocolError(f"{host} reported the interface name {name[:40]!r}, which no "
                                "network interface can have")
        if not (isinstance(endpoint, list) and len(endpoint) == 2 and is_ipv4(endpoint[0])
                and type(endpoint[1]) is int and 0 < endpoint[1] < 65536):
            raise ProtocolError(f"{host} reported {name} at {str(endpoint)[:40]}, which is no "
                                "IPv4 address and port")
    return host, {"interfaces": interfaces}


def is_ipv4(text: object) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def results_of(host: str, message: dict, names: Sequence[str],
               registrations: Mapping[str, dict]) -> dict:
    """{interface: {peer: outcome}} from ``host``'s second message, each peer one it could test."""
    try:
        results = field(message, "results", dict)
        for name, outcomes in results.items():
            if name not in names or not isinstance(outcomes, dict):
                raise ProtocolError(f"results for {name[:40]!r}, which it was not asked to test")
            for peer, outcome in outcomes.items():
                if peer not in registrations or name not in registrations[peer]["interfaces"]:
                    raise ProtocolError(f"a result for {peer[:40]!r} on {name}, which did not "
                                        "register that interface")
                if not (isinstance(outcome, str) and outcome.isprintable()
                        and len(outcome) <= 200):
                    raise ProtocolError("an outcome that is not one short line")
    except ProtocolError as error:
        raise ProtocolError(f"{host}'s probe sent {error}") from None
    return results


class Rendezvous:
    """The launcher's end of the check: accepts connections, challenges each, and reads them all
    at once, so a peer that sends slowly (or nothing) holds up only itself."""

    def __init__(self, server: socket.socket, token: str):
        self.server = server
        self.token = token
        self.selector = selectors.DefaultSelector()
        self.selector.register(server, selectors.EVENT_READ)
        self.unread: dict[socket.socket, bytearray] = {}
        self.challenges: dict[socket.socket, str] = {}  # not proven yet, oldest first
        self.hosts: dict[socket.socket, str] = {}  # proven: the host its probe registered
        self.registrations: dict[str, dict] = {}
        self.refused: list[str] = []  # why each stranger's connection was closed

    def wait(self, until: float) -> list[tuple[str, dict]]:
        """(host, message) for what the registered probes sent until ``until``; meanwhile new
        connections are challenged, and registered or refused once they answer."""
        received = []
        for key, _ in self.selector.select(max(0.0, until - time.monotonic())):
            connection = key.fileobj
            if connection is self.server:
                self.accept()
            elif connection in self.hosts:
                host = self.hosts[connection]
                try:
                    received += [(host, parse(line))
                                 for line in self.lines(connection, MESSAGE_BYTES)]
                except (OSError, ProtocolError) as error:
                    raise ProtocolError(f"{host}'s probe: {error}") from None
            else:
                try:
                    lines = self.lines(connection, REGISTRATION_BYTES)
                    if len(lines) > 1:  # a probe says nothing more until it has the table
                        raise ProtocolError("more than one message before the table of hosts")
                    if lines:
                        self.register(connection, lines[0])
                except (OSError, ProtocolError) as error:
                    self.refuse(connection, str(error))
        return received

    def accept(self) -> None:
        try:
            connection, _ = self.server.accept()
        except OSError:  # gone before it was accepted
            return
        if len(self.challenges) >= MAX_UNPROVEN:
            self.refuse(next(iter(self.challenges)), "too many connections at once")
        challenge = secrets.token_hex(16)
        connection.setblocking(False)
        try:  # a few bytes into an empty socket buffer: never waits
            connection.sendall((json.dumps({"challenge": challenge}) + "\n").encode())
        except OSError:
            connection.close()
            return
        self.selector.register(connection, selectors.EVENT_READ)
        self.unread[connection] = bytearray()
        self.challenges[connection] = challenge

    def lines(self, connection: socket.socket, limit: int) -> list[bytes]:
        """The whole lines that arrived on ``connection`` (ready to read)."""
        try:
            chunk = connection.recv(65536)
        except BlockingIOError:
            return []
        if not chunk:
            raise ConnectionError("the connection closed")
        *lines, rest = (self.unread[connection] + chunk).split(b"\n")
        if len(rest) > limit:
            raise ProtocolError(f"a message longer than {limit} bytes")
        self.unread[connection] = bytearray(rest)
        return lines

    def register(self, connection: socket.socket, line: bytes) -> None:
        """Register the host ``line`` names if it proves the token (raises ProtocolError if not,
        NetworkError for a proven probe that reports nonsense or a host already registered)."""
        message = parse(line)
        answer = message.get("proof")
        expected = proof(self.token, self.challenges.pop(connection))
        if not (isinstance(answer, str) and hmac.compare_digest(answer.encode(),
                                                                expected.encode())):
            raise ProtocolError("no proof of the token")
        try:
            host, registration = registration_of(message)
        except ProtocolError as error:
            raise NetworkError(f"a network probe's report is malformed: {error}") from None
        # Once, never last-wins: two proven probes calling themselves the same host mean the
        # host list names one machine twice, and the table would test only one of them.
        if host in self.registrations:
            raise NetworkError(f"two network probes reported the host name {host}; name each "
                               "host once in --hosts")
        self.hosts[connection] = host
        self.registrations[host] = registration

    def refuse(self, connection: socket.socket, why: str) -> None:
        self.refused.append(why)
        self.drop(connection)

    def drop(self, connection: socket.socket) -> None:
        self.selector.unregister(connection)
        self.unread.pop(connection)
        self.challenges.pop(connection, None)
        connection.close()

    def stop_accepting(self) -> None:
        """Every host has registered: refuse anyone else from now on."""
        self.selector.unregister(self.server)
        for connection in list(self.challenges):
            self.refuse(connection, "came after every host had registered")

    def send_each(self, message: dict, deadline: float) -> None:
        for connection, host in self.hosts.items():
            try:
                send(connection, message, deadline)
            except OSError as error:
                raise NetworkError(f"the network check failed: cannot reach {host}'s probe: "
                                   f"{error}") from None
            connection.setblocking(False)

    def close(self) -> None:
        for connection in list(self.unread):
            self.drop(connection)
        self.selector.close()

    def refusals(self) -> str:
        """A clause on the connections refused, for an error line ("" if none)."""
        if not self.refused:
            return ""
        return (f" (refused {len(self.refused)} connection(s) that did not prove the check's "
                f"token; the last: {self.refused[-1]})")


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



def rendezvous_address(remote_hosts: Sequence[str]) -> str:
    """Where the launcher listens for the probes: this host's address on its route to the first
    other host (the network ssh and srun reach that host over, so the one its probe can answer
    on), or loopback when every host is this one (by name, or by an address of 127.x)."""
    for host in remote_hosts:
        try:
            address = socket.gethostbyname(host)
            if ipaddress.IPv4Address(address).is_loopback:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
                route.connect((address, 9))  # sends nothing: asks the routing table
                return route.getsockname()[0]
        except OSError as error:
            raise NetworkError(f"cannot find this host's address on {host}'s network "
                               f"({error.strerror or error}); make {host} resolvable here (DNS "
                               "or /etc/hosts), or skip the check with --skip-preflight") from None
    return "127.0.0.1"


def check(hosts: Sequence[str], interface: str | None,
          start_probes: Callable[[list[str]], list[subprocess.Popen]], *, listen_on: str,
          timeout: float = CONNECT_TIMEOUT_SECONDS,
          startup_timeout: float = STARTUP_TIMEOUT_SECONDS) -> NetworkPlan:
    """Run the check across ``hosts`` (raises NetworkError when they cannot talk).

    ``start_probes(args)`` starts ``python -m hvdtrain.netcheck ARGS`` once on every host, each
    reading its stdin from the process it returns (whose stdin is a pipe and whose output is read
    for errors). ``listen_on``: the address the probes reach the launcher at
    (``rendezvous_address``). ``startup_timeout`` bounds each of the two waits for the probes:
    for their reports, then for their results.
    """
    token = secrets.token_hex(16)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind((listen_on, 0))
        server.listen(len(hosts) + 8)
        port = server.getsockname()[1]
        processes = start_probes(["--rendezvous", listen_on, "--port", str(port),
                                  "--timeout", f"{timeout:g}", "--wait", f"{startup_timeout:g}"])
        hand_over(token, processes)
        rendezvous = Rendezvous(server, token)

        def failure(message: str) -> NetworkError:
            rendezvous.close()  # first: a probe waiting on the launcher ends now, not later
            said = probes_said(processes)
            return NetworkError(message + (f": {said}" if said else ""))

        try:
            deadline = time.monotonic() + startup_timeout
            while len(rendezvous.registrations) < len(hosts):
                if time.monotonic() > deadline:
                    raise failure(probes_missing(hosts, rendezvous,
                                                 f"within {startup_timeout:g} s"))
                if all(p.poll() is not None for p in processes):
                    raise failure(probes_missing(hosts, rendezvous, "before their probes ended"))
                for host, _ in rendezvous.wait(min(deadline, time.monotonic() + 0.5)):
                    raise ProtocolError(f"{host}'s probe spoke before it had the table of hosts")
            rendezvous.stop_accepting()
            registrations = rendezvous.registrations
            names = common_interfaces(registrations)
            if interface and interface not in names:
                names.append(interface)
            deadline = time.monotonic() + startup_timeout
            rendezvous.send_each({"hosts": {host: r["interfaces"] for host, r in
                                            registrations.items()}, "interfaces": names}, deadline)
            results = {}
            while len(results) < len(registrations):
                if time.monotonic() > deadline:
                    late = ", ".join(host for host in registrations if host not in results)
                    raise failure(f"the network probe on {late} did not send its results within "
                                  f"{startup_timeout:g} s")
                for host, message in rendezvous.wait(min(deadline, time.monotonic() + 0.5)):
                    if host in results:
                        raise ProtocolError(f"{host}'s probe sent its results twice")
                    results[host] = results_of(host, message, names, registrations)
            rendezvous.send_each({"done": True}, time.monotonic() + startup_timeout)
        except (OSError, ProtocolError) as error:
            raise failure(f"the network check failed: {error}") from None
        except BaseException as error:
            # A stop (what the launcher's signal handler raises, Ctrl-C): the probes end now,
            # not after the grace the finally below gives them.
            if not isinstance(error, Exception):
                end_probes(processes, grace=0)
            raise
        finally:
            rendezvous.close()
            end_probes(processes)
    # In the job's host order (they reported in the order they started), so messages are stable.
    ordered = sorted(registrations, key=lambda host: hosts.index(host) if host in hosts
                     else len(hosts))
    return decide(interface, {host: registrations[host] for host in ordered}, results)


def hand_over(token: str, processes: list[subprocess.Popen]) -> None:
    """The token goes to every probe on its stdin: a command line is readable by every user of
    the host (/proc/PID/cmdline), and ssh would not carry the environment."""
    for process in processes:
        try:
            process.stdin.write(token + "\n")
            process.stdin.close()
        except OSError:
            pass  # a probe that has already ended: what it printed says why


def probes_missing(hosts: Sequence[str], rendezvous: Rendezvous, when: str) -> str:
    """One line: which hosts' probes never reported, and any connections refused meanwhile."""
    missing = [host for host in hosts if host not in rendezvous.registrations]
    return (f"the network probe on {', '.join(missing) or 'some host'} did not report {when}"
            + rendezvous.refusals())


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
    """Wait up to ``grace`` seconds for the probes to end, then kill those left (0: at once)."""
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            if grace:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        if process.poll() is None:
            process.kill()
            process.wait()


def probe_command(python: str, args: Sequence[str]) -> list[str]:
    return [python, "-m", PROGRAM, *args]


def start_with_srun(python: str, num_hosts: int) -> Callable[[list[str]], list]:
    """Probes as one Slurm step, one task per node of the allocation, each given srun's stdin."""
    def start(args):
        return [subprocess.Popen(
            remote.on_every_node(num_hosts, probe_command(python, args)),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "SLURM_CPUS_PER_TASK": "1"})]
    return start


def start_with_ssh(python: str, hosts: Sequence[str], local_names: Sequence[str]
                   ) -> Callable[[list[str]], list]:
    """Probes over ssh (as horovodrun and mpirun reach hosts outside Slurm); this host's directly."""
    def start(args):
        processes = []
        for host in hosts:
            command = probe_command(python, args)
            if host not in local_names:
                command = remote.on_host(host, command, in_allocation=False, cwd=os.getcwd())
            processes.append(subprocess.Popen(command, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
        return processes
    return start


def read_token(wait: float) -> str:
    """The check's token, which the launcher writes to the probe's stdin."""
    ready, _, _ = select.select([sys.stdin], [], [], wait)
    token = sys.stdin.readline().strip() if ready else ""
    if not token:
        raise SystemExit(f"{PROGRAM}: no token on stdin within {wait:g} s (hvdtrain.launch "
                         "starts this probe and writes it there)")
    return token


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}",
                                     description="The per-host probe of hvdtrain.launch's "
                                                 "network check (see the module docstring); "
                                                 "reads the check's token on stdin.")
    parser.add_argument("--rendezvous", required=True, help="the launcher's address")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=CONNECT_TIMEOUT_SECONDS,
                        help="seconds for each test connection")
    parser.add_argument("--wait", type=float, default=STARTUP_TIMEOUT_SECONDS,
                        help="seconds to wait for each of the launcher's messages")
    args = parser.parse_args(argv)
    sys.exit(probe(args.rendezvous, args.port, read_token(args.wait), args.timeout, args.wait))

