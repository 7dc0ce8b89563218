"""The network check's decision (pure), the real check between processes on this machine, and
what a neighbour on the same host can (not) do to it.

The check across real hosts, with an interface that connects nothing, is in test_multinode.py.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time

import pytest

from hvdtrain.errors import UserError
from hvdtrain.launch import netcheck
from hvdtrain.launch.netcheck import NetworkError, decide
from hvdtrain.launch.options import LaunchOptions, check_options


def registration(**interfaces):
    return {"interfaces": {name: [address, 1000] for name, address in interfaces.items()}}


HOSTS = {"node1": registration(eth0="10.0.0.1", docker0="172.17.0.1"),
         "node2": registration(eth0="10.0.0.2", docker0="172.17.0.1")}


def results(broken=()):
    """Every host reaches every other on every interface, except the (interface) in broken."""
    return {host: {name: {peer: ("No route to host after 3.0 s" if name in broken else "ok")
                          for peer in HOSTS if peer != host}
                   for name in ("eth0", "docker0")}
            for host in HOSTS}


def test_all_interfaces_connect_so_nothing_is_restricted():
    plan = decide(None, HOSTS, results())
    assert plan.interfaces is None and "eth0, docker0" in plan.note


def test_an_interface_that_connects_nothing_is_left_out():
    plan = decide(None, HOSTS, results(broken={"docker0"}))
    assert plan.interfaces == ("eth0",)
    assert "docker0 does not connect the nodes (node1 cannot reach node2 on docker0" in plan.note


def test_a_named_interface_that_does_not_connect_is_one_line_naming_host_and_interface():
    with pytest.raises(NetworkError) as caught:
        decide("docker0", HOSTS, results(broken={"docker0"}))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("node1 cannot reach node2 on docker0 (172.17.0.1): No route")
    assert message.endswith("eth0 connects every node")


def test_a_named_interface_a_host_lacks():
    hosts = {**HOSTS, "node3": registration(ens3="10.0.0.3")}
    with pytest.raises(NetworkError, match=r"^node3 has no network interface eth0 \(it has: ens3"):
        decide("eth0", hosts, {host: {} for host in hosts})


def test_no_interface_connects_everyone():
    with pytest.raises(NetworkError, match="no network interface connects every node: node1 "
                                           "cannot reach node2 on eth0"):
        decide(None, HOSTS, results(broken={"eth0", "docker0"}))


def test_no_interface_in_common():
    hosts = {"a": registration(eth0="10.0.0.1"), "b": registration(ens3="10.0.0.2")}
    with pytest.raises(NetworkError, match=r"no network interface name in common \(a: eth0; "
                                           r"b: ens3\)"):
        decide(None, hosts, {"a": {}, "b": {}})


def test_probes_that_never_report_end_the_check_with_what_they_said():
    # Real probe processes, pointed at a port nobody listens on: the check gives up in time.
    def start(args):
        args = [*args]
        args[args.index("--port") + 1] = "9"  # discard: closed here
        return [started([sys.executable, "-m", "hvdtrain.netcheck", *args])]

    with pytest.raises(NetworkError, match="the network probe on hostA did not report before "
                                           "their probes ended: .*cannot reach the launcher"):
        netcheck.check(["hostA"], None, start, listen_on=LOOPBACK, timeout=1, startup_timeout=30)


def test_two_probes_on_this_machine_reach_each_other():
    # Two real probes on one host reporting under two names: the whole protocol, no network
    # namespaces needed (those are in test_multinode.py).
    def start(args):
        return [started(probe_as(name, args)) for name in ("first", "second")]

    plan = netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=2,
                          startup_timeout=60)
    assert plan.interfaces is None, plan


def test_a_probe_waits_for_a_host_that_starts_later_than_its_connect_timeout():
    # The second probe starts 3 s after the first, whose connect timeout is 1 s: the first waits
    # for the table of hosts anyway (it once gave up after its connect timeout, on a loaded
    # machine whose other host was slow to start over ssh: "connection closed while waiting
    # for node1's results").
    def start(args):
        return [started(probe_as("first", args)), started(probe_as("second", args, after=3))]

    plan = netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=1,
                          startup_timeout=60)
    assert plan.interfaces is None, plan


LOOPBACK = "127.0.0.1"
PROBE_AS = """
import socket, sys
name = sys.argv.pop(1)
socket.gethostname = lambda: name
from hvdtrain.launch import netcheck
netcheck.main(sys.argv[1:])
"""


def probe_as(name, args, after=0):
    """A real probe that reports this host as ``name``, started ``after`` seconds late."""
    command = [sys.executable, "-c", PROBE_AS, name, *args]
    return ["sh", "-c", f"sleep {after} && exec {shlex.join(command)}"] if after else command


def started(command):
    """A probe process as the launcher starts one: the token goes to its stdin."""
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)



# --- what other users of the host can do -----------------------------------------------------------
#: A neighbour: another user of the host, who reads every process's command line (and tries its
#: environment) in /proc, then tries every word it found there as the check's token, registering
#: as both hosts with an interface name that is a shell command. Only the standard library, so
#: the system's Python runs it as user nobody. Prints what it achieved, as JSON.
NEIGHBOUR = r"""
import hmac, json, os, re, socket, sys, time
hosts = sys.argv[1:]
port, address, words, environments = None, None, [], 0
deadline = time.monotonic() + 10
while port is None and time.monotonic() < deadline:  # until the probes appear
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            text = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            continue
        text = text.replace("\0", " ")
        found = re.search(r"--rendezvous ([0-9.]+).* --port ([0-9]+)", text)
        if not found:
            continue
        address, port = found.group(1), int(found.group(2))
        words += text.split()
        try:
            words += open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
            environments += 1
        except OSError:
            pass
    time.sleep(0.02)
# What a token looks like first (secrets.token_hex), then every other word.
words = sorted(set(words), key=lambda word: not re.fullmatch("[0-9a-f]{16,}", word))

def registration(token, host):
    connection = socket.create_connection((address, port), timeout=5)
    connection.settimeout(0.3)
    try:  # the launcher's challenge, if it sends one
        challenge = json.loads(connection.recv(4096)).get("challenge", "")
    except (OSError, ValueError):
        challenge = ""
    connection.settimeout(5)
    proof = hmac.new(token.encode(), challenge.encode(), "sha256").hexdigest()
    connection.sendall(json.dumps({"host": host, "token": token, "proof": proof, "interfaces": {
        "x;touch PWNED;": ["127.0.0.1", 9]}}).encode() + b"\n")
    return connection

registered = False
for word in words if port else []:
    if registered:
        break
    try:
        connections = [registration(word, host) for host in hosts]
    except OSError:  # the check is over
        break
    for host, connection in zip(hosts, connections):
        try:
            table = json.loads(connection.makefile("rb").readline() or b"{}")
        except (OSError, ValueError):
            table = {}
        if "hosts" in table:  # taken for a probe: report that the injected interface works
            registered = True
            connection.sendall(json.dumps({"results": {"x;touch PWNED;": {
                peer: "ok" for peer in hosts if peer != host}}}).encode() + b"\n")
    for connection in connections if registered else []:  # until the launcher is done
        connection.makefile("rb").readline()
print(json.dumps({"port_seen": port is not None, "words_tried": len(words),
                  "environments_read": environments, "registered": registered}))
"""
#: A Python user nobody can run (the venv's may sit under /root).
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root (to run the neighbour as user nobody) and /usr/bin/python3")
def test_a_neighbour_who_reads_proc_gets_no_token_and_cannot_register_or_inject():
    # The probes start 2 s late, so the neighbour tries everything before they register.
    neighbour = {}

    def start(args):
        probes = [started(probe_as(name, args, after=2)) for name in ("first", "second")]
        neighbour["process"] = subprocess.Popen(
            ["runuser", "-u", "nobody", "--", SYSTEM_PYTHON, "-c", NEIGHBOUR, "first", "second"],
            stdout=subprocess.PIPE, text=True, cwd="/")
        return probes

    try:
        plan = netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=2,
                              startup_timeout=30)
        said, _ = neighbour["process"].communicate(timeout=30)
    finally:
        neighbour["process"].kill()
    report = json.loads(said)
    assert report["port_seen"] and report["words_tried"] > 0, report
    assert report["environments_read"] == 0, report  # another user's environment is closed
    assert not report["registered"], report
    assert plan.interfaces is None and "PWNED" not in plan.note, plan


@pytest.mark.timeout(60)
def test_the_launcher_listens_only_on_the_address_the_probes_reach():
    # Told 127.0.0.1, it does not answer on 127.0.0.2 (a wildcard listener would).
    elsewhere = []

    def start(args):
        port = int(args[args.index("--port") + 1])
        try:
            socket.create_connection(("127.0.0.2", port), timeout=2).close()
            elsewhere.append("answered")
        except ConnectionRefusedError:
            elsewhere.append("refused")
        return [started(probe_as(name, args)) for name in ("first", "second")]

    netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=1,
                   startup_timeout=20)
    assert elsewhere == ["refused"]


def test_the_rendezvous_is_on_the_route_to_the_other_hosts_or_loopback():
    assert netcheck.rendezvous_address([]) == LOOPBACK
    assert netcheck.rendezvous_address(["localhost"]) == LOOPBACK
    # A host at one of this host's own addresses is reached from that address.
    for address in netcheck.local_interfaces().values():
        assert netcheck.rendezvous_address([address]) == address


#: A peer that sends one byte every half second for 30 s, never a whole line.
TRICKLER = """
import socket, sys, time
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])))
for _ in range(60):
    connection.sendall(b"{")
    time.sleep(0.5)
"""


def trickling_peer(args):
    """A trickler connected to the launcher of ``args`` before any probe."""
    address = args[args.index("--rendezvous") + 1].split(",")[0]
    trickler = subprocess.Popen([sys.executable, "-c", TRICKLER, address,
                                 args[args.index("--port") + 1]])
    time.sleep(0.5)
    return trickler


@pytest.mark.timeout(60)
def test_a_trickling_peer_cannot_hold_the_check_past_its_deadline():
    tricklers = []

    def start(args):  # only one of the two hosts' probes: the check must end at its deadline
        tricklers.append(trickling_peer(args))
        return [started(probe_as("first", args))]

    began = time.monotonic()
    try:
        with pytest.raises(NetworkError, match="^the network probe on second did not report "
                                               "within 3 s"):
            netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=1,
                           startup_timeout=3)
    finally:
        tricklers[0].kill()
    assert time.monotonic() - began < 3 + 2


@pytest.mark.timeout(60)
def test_a_trickling_peer_holds_up_no_probe():
    tricklers = []

    def start(args):
        tricklers.append(trickling_peer(args))
        return [started(probe_as(name, args)) for name in ("first", "second")]

    began = time.monotonic()
    try:
        plan = netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=1,
                              startup_timeout=20)
    finally:
        tricklers[0].kill()
    assert plan.interfaces is None, plan
    assert time.monotonic() - began < 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("junk", [b"[]\n", b'"eth0"\n', b"not json\n", b"\xff\xfe\n",
                                  b'{"host": "first", "proof": 1, "interfaces": []}\n'])
def test_a_strangers_bad_message_is_refused_and_the_check_goes_on(junk):
    strangers = []

    def start(args):  # the stranger's message is there before the probes start
        strangers.append(socket.create_connection((LOOPBACK, int(args[args.index("--port") + 1]))))
        strangers[0].sendall(junk)
        return [started(probe_as(name, args, after=1)) for name in ("first", "second")]

    try:
        plan = netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=1,
                              startup_timeout=20)
    finally:
        strangers[0].close()
    assert plan.interfaces is None, plan


#: A probe with the token (the launcher's own process) that reports ``interfaces``, then sends
#: ``results`` (one line, as is) for its results.
BROKEN_PROBE = """
import hmac, json, socket, sys
address, port, interfaces, results = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
token = sys.stdin.readline().strip()
connection = socket.create_connection((address, port))
wire = connection.makefile("rwb")
challenge = json.loads(wire.readline())["challenge"]
proof = hmac.new(token.encode(), challenge.encode(), "sha256").hexdigest()
wire.write(json.dumps({"host": "first", "proof": proof, "interfaces": json.loads(interfaces)})
           .encode() + b"\\n")
wire.flush()
wire.readline()
wire.write(results.encode() + b"\\n")
wire.flush()
wire.readline()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interfaces, results, error", [
    ('{"x;touch PWNED;": ["127.0.0.1", 9]}', "", "a network probe's report is malformed: first "
     "reported the interface name 'x;touch PWNED;', which no network interface can have"),
    ('{"eth0": ["127.0.0.1", "9"]}', "", "first reported eth0 at ['127.0.0.1', '9'], which is no "
     "IPv4 address and port"),
    ("{}", "[]", "the network check failed: first's probe: a message that is not a JSON object"),
    ("{}", "not json", "the network check failed: first's probe: a message that is not JSON"),
    ("{}", '{"results": []}', "the network check failed: first's probe sent a message whose "
     "'results' is not a dict"),
    ("{}", '{"results": {"eth0": {"second": "ok"}}}', "the network check failed: first's probe "
     "sent results for 'eth0', which it was not asked to test"),
])
def test_a_probes_bad_message_is_one_line(interfaces, results, error):
    def start(args):
        return [started([sys.executable, "-c", BROKEN_PROBE, LOOPBACK,
                         args[args.index("--port") + 1], interfaces, results])]

    with pytest.raises(NetworkError) as caught:
        netcheck.check(["first"], None, start, listen_on=LOOPBACK, timeout=1, startup_timeout=10)
    message = str(caught.value)
    assert "\n" not in message and error in message, message


@pytest.mark.timeout(60)
def test_a_host_registers_once():
    def start(args):
        return [started(probe_as("first", args)), started(probe_as("first", args))]

    with pytest.raises(NetworkError, match="^two network probes reported the host name first; "
                                           "name each host once in --hosts"):
        netcheck.check(["first", "second"], None, start, listen_on=LOOPBACK, timeout=1,
                       startup_timeout=20)


@pytest.mark.timeout(30)
def test_a_probe_gives_up_on_a_launcher_that_goes_quiet():
    # A launcher that challenges, then never sends the table: the probe ends after --wait.
    with socket.create_server((LOOPBACK, 0)) as launcher:
        args = ["--rendezvous", LOOPBACK, "--port", str(launcher.getsockname()[1]),
                "--timeout", "1", "--wait", "2"]
        probe = started(probe_as("first", args))
        probe.stdin.write("0" * 32 + "\n")
        probe.stdin.close()
        connection, _ = launcher.accept()
        with connection:
            connection.sendall(b'{"challenge": "00"}\n')
            began = time.monotonic()
            output = probe.stdout.read()  # until the probe ends
            probe.wait()
    assert probe.returncode == 1
    assert output.strip() == "hvdtrain.netcheck: first: the table of hosts did not come in time"
    assert time.monotonic() - began < 2 + 3


def test_an_interface_name_a_shell_would_split_never_reaches_a_command():
    good = ("eth0", "ib0", "enp3s0f1", "bond0.100", "br-1a2b", "wg_0", "a" * 15)
    bad = ("", "x;touch PWNED;", "a" * 16, "eth 0", "eth0/1", "eth0:1", "-x", ".", "..", "$(id)",
           "eth0\n", "é", None, 3)
    assert [name for name in good if not netcheck.is_interface_name(name)] == []
    assert [name for name in bad if netcheck.is_interface_name(name)] == []
    options = LaunchOptions(program="hvdtrain.cnn", network_interface="eth0,x;touch PWNED;")
    with pytest.raises(UserError, match=r"^--network-interface: 'x;touch PWNED;' is no network "
                                        r"interface name"):
        check_options(options, None)
