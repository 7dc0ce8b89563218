"""The network check's decision (pure), and the real check between processes on this machine.

The check across real hosts, with an interface that connects nothing, is in test_multinode.py.
"""
from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from hvdtrain import netcheck
from hvdtrain.netcheck import NetworkError, decide


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
        return [subprocess.Popen([sys.executable, "-m", "hvdtrain.netcheck", *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]

    with pytest.raises(NetworkError, match="the network probe on hostA did not report before "
                                           "their probes ended: .*cannot reach the launcher"):
        netcheck.check(["hostA"], None, start, timeout=1, startup_timeout=30)


def test_two_probes_on_this_machine_reach_each_other():
    # Two real probes on one host reporting under two names: the whole protocol, no network
    # namespaces needed (those are in test_multinode.py).
    def start(args):
        return [subprocess.Popen([sys.executable, "-c", PROBE_AS, name, *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for name in ("first", "second")]

    plan = netcheck.check(["first", "second"], None, start, timeout=2, startup_timeout=60)
    assert plan.interfaces is None, plan


def test_a_probe_waits_for_a_host_that_starts_later_than_its_connect_timeout():
    # The second probe starts 3 s after the first, whose connect timeout is 1 s: the first waits
    # for the table of hosts anyway (it once gave up after its connect timeout, on a loaded
    # machine whose other host was slow to start over ssh: "connection closed while waiting
    # for node1's results").
    def start(args):
        late = f"sleep 3 && exec {shlex.join([sys.executable, '-c', PROBE_AS, 'second', *args])}"
        return [subprocess.Popen([sys.executable, "-c", PROBE_AS, "first", *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                subprocess.Popen(["sh", "-c", late], stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)]

    plan = netcheck.check(["first", "second"], None, start, timeout=1, startup_timeout=60)
    assert plan.interfaces is None, plan


PROBE_AS = """
import socket, sys
name = sys.argv.pop(1)
socket.gethostname = lambda: name
from hvdtrain import netcheck
netcheck.main(sys.argv[1:])
"""
