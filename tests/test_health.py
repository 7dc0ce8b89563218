"""hvdtrain.health's verdicts (pure), and the launcher's --health-check on real ranks.

The slow link and the perturbed rank across real nodes are in test_multinode.py.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, clean_env, integration
from hvdtrain.errors import EXIT_USAGE
from hvdtrain.launch.health_check import (HEALTH_SECONDS, PTX_JIT_SECONDS, health_seconds,
                                          run_health_check)
from hvdtrain.launch.paths import Launch
from hvdtrain.launch.supervise import SignalForwarder
from hvdtrain.health import (AllreduceTiming, RankReport, allreduce_findings, device_findings,
                             disagreeing, nccl_hints, rate_text, slow_links, time_allreduce)
from hvdtrain.launcher_env import marked
from processes import process_group

GBIT, MBIT = 1e9, 1e6


def test_rates_read_as_people_write_them():
    assert [rate_text(r) for r in (9.1e9, 94e6, 5e3)] == ["9.1 Gbit/s", "94 Mbit/s", "5 kbit/s"]


def test_a_node_whose_every_outgoing_link_is_slow_is_named_once():
    rates = {("node1", "node2"): 9 * GBIT, ("node2", "node3"): 94 * MBIT,
             ("node3", "node1"): 9.2 * GBIT, ("node2", "node1"): 90 * MBIT,
             ("node1", "node3"): 9.1 * GBIT, ("node3", "node2"): 8.9 * GBIT}
    assert slow_links(rates, 0.25) == ["node2: 90 Mbit/s out against 8.95 Gbit/s median"]


def test_a_single_slow_link_is_named_as_a_link():
    rates = {("node1", "node2"): 9 * GBIT, ("node2", "node3"): 9 * GBIT,
             ("node3", "node1"): 1 * GBIT, ("node2", "node1"): 9 * GBIT,
             ("node1", "node3"): 9 * GBIT, ("node3", "node2"): 9 * GBIT}
    assert slow_links(rates, 0.25) == ["link node3 -> node1: 1 Gbit/s against 9 Gbit/s median"]
    assert slow_links({key: 9 * GBIT for key in rates}, 0.25) == []
    assert slow_links({}, 0.25) == []


def reports(*results: float, gpus: int = 0, cores: int = 4) -> list[RankReport]:
    return [RankReport(rank, f"node{rank + 1}", 1, gpus, cores, result)
            for rank, result in enumerate(results)]


def test_the_rank_that_computes_other_numbers_is_named():
    assert disagreeing(reports(5.0, 5.0, 5.0)) == []
    assert disagreeing(reports(5.0, 5.0 * (1 + 1e-7), 5.0)) == []  # within the tolerance
    assert disagreeing(reports(5.0, 5.005, 5.0)) == [
        "rank 1 on node2 computed 5.005 where 2 other rank(s) computed 5: a faulty device or "
        "math library"]
    [tie] = disagreeing(reports(5.0, 5.005))
    assert tie.startswith("the ranks computed different numbers and no result has a majority "
                          "(rank 0 on node1 5, rank 1 on node2 5.005)")


def test_a_node_short_of_gpus_fails_and_a_small_cpu_share_warns():
    two_per_node = [RankReport(r, f"node{r // 2 + 1}", 2, 2 if r < 2 else 1, 8, 1.0)
                    for r in range(4)]
    assert device_findings(two_per_node, 1) == (
        ["node2 shows 1 GPU(s); its 2 rank(s) need 2 (a GPU lost, or CUDA_VISIBLE_DEVICES?)"], [])
    assert device_findings(two_per_node, 0) == ([], [])
    # srun --gpus-per-task=1: each of a node's 4 ranks sees its own one GPU, as the ranks
    # accept (runtime.base.choose_gpu); one rank that sees none fails its node.
    per_task = [RankReport(r, "node1", 4, 1, 8, 1.0, gpu_of_its_own=True) for r in range(4)]
    assert device_findings(per_task, 1) == ([], [])
    lost = per_task[:3] + [RankReport(3, "node1", 4, 0, 8, 1.0, gpu_of_its_own=False)]
    assert device_findings(lost, 1) == (
        ["node1 shows 0 GPU(s); its 4 rank(s) need 4 (a GPU lost, or CUDA_VISIBLE_DEVICES?)"], [])
    uneven = reports(1.0, 1.0, 1.0)[:2] + [RankReport(2, "node3", 1, 0, 1, 1.0)]
    assert device_findings(uneven, 0) == (
        [], ["node3: 1 core(s) per rank against 4 median (a smaller CPU share)"])


@integration
@pytest.mark.timeout(300)
def test_a_rank_computing_other_numbers_fails_the_check_before_the_job(tmp_path):
    """The launcher, 3 ranks on this machine, rank 2 nudged (the check's test-only variables:
    other numbers, and zeros for one tensor of the fused group): its lines only, exit 2, the job
    never started."""
    result = subprocess.run(
        [sys.executable, "-m", "hvdtrain.launch", "--np", "3", "--health-check", "hvdtrain.cnn",
         "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=240,
        env=clean_env(HVDTRAIN_HEALTH_TEST_PERTURB_RANK="2", HVDTRAIN_HEALTH_TEST_STALE_RANK="2"))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2, lines
    assert lines[0].startswith("hvdtrain.health: failed: rank 2 on ") and \
        " other rank(s) computed " in lines[0], lines
    # The fused group: every rank got rank 2's zeros in its average (3 ranks send 1, 2, 0 times
    # a pattern of 1..7 where 2 is due: up to 7 off), one line for all.
    assert lines[1] == ("hvdtrain.health: failed: every rank: the MPI allreduce of grouped "
                        "tensors (through the fusion buffer) returned values off the due "
                        "average: float32[65539] up to 7 off"), lines
    # The summary names horovod's allreduce among the 3 ranks (the job's own runtime, over
    # MPI), without a bandwidth: an allreduce that returned wrong values has none worth saying.
    assert re.match(r"hvdtrain\.health: FAILED: 3 rank\(s\) on 1 node\(s\), one node, no links, "
                    r"allreduce \(MPI\), [\d.]+ s$", lines[2]), lines
    assert len(lines) == 3, lines
    assert not (tmp_path / "run").exists()


def tagged(tag: str) -> list:
    """The processes on this machine whose environment holds ``tag`` (NAME=VALUE)."""
    return marked(tag)


def wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {seconds:g} s")
        time.sleep(0.1)


@integration
@pytest.mark.timeout(120)
def test_a_stop_signal_or_a_killed_launcher_during_the_check_leaves_nothing_running(tmp_path):
    """Ctrl-C to the launcher while the check runs: it stops the check's ranks and exits 130 (it
    used to wait for the check and exit 0); a SIGKILLed launcher: its watcher ends them (it used
    to start only after the check). The ranks take a minute to start (a sitecustomize that
    sleeps in them only), so only a stop ends them in seconds, and no TensorFlow is loaded."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, time\nif 'OMPI_COMM_WORLD_RANK' in os.environ:\n    time.sleep(60)\n")
    for stop in (signal.SIGINT, signal.SIGKILL):
        tag = f"HVDTRAIN_TEST_TAG={os.getpid()}.{stop}"  # on the launcher and all it starts
        env = clean_env(PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', REPO)}",
                        **dict([tag.split("=")]))
        with process_group(
                [sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--via", "mpirun",
                 "--skip-preflight", "--health-check-only", "hvdtrain.cnn"], cwd=REPO, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as launcher:
            try:
                wait_for(lambda: sum(p.rank is not None for p in tagged(tag)) == 2, 30,
                         "the check's 2 ranks did not start")
                launcher.send_signal(stop)
                output, _ = launcher.communicate(timeout=20)
                wait_for(lambda: not tagged(tag), 20,
                         f"processes of the check outlived the launcher ({stop.name})")
            finally:
                # What left the launcher's group (its own session) is found by the tag.
                for process in tagged(tag):
                    try:
                        os.kill(process.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if stop == signal.SIGINT:
            assert launcher.returncode == 130, output
            assert output.splitlines()[-1] == ("hvdtrain.launch: the health check stopped on "
                                               "SIGINT; not starting the job"), output
            assert "Traceback" not in output, output


def test_with_two_nodes_a_slow_sender_is_named_not_its_receiver():
    rates = {("node1", "node2"): 9 * GBIT, ("node2", "node1"): 94 * MBIT}
    assert slow_links(rates, 0.25) == ["node2: 94 Mbit/s out against 4.55 Gbit/s median"]


def timing(seconds: float, ranks: int = 4, transport: str = "NCCL") -> AllreduceTiming:
    return AllreduceTiming(64 * 2**20, seconds, ranks, transport)


def test_bus_bandwidth_is_what_every_link_of_a_ring_carries():
    # nccl-tests: busbw = algbw x 2 (n - 1) / n; 64 MiB in 0.1 s over 4 ranks.
    assert timing(0.1).bus_bits_per_second() == pytest.approx(64 * 2**20 * 8 / 0.1 * 1.5)
    assert timing(0.1, ranks=1).bus_bits_per_second() == 0.0


def test_an_nccl_allreduce_far_below_the_links_is_a_warning_unless_a_slow_link_explains_it():
    ranks = reports(1.0, 1.0, 1.0, 1.0)
    slow = timing(64 * 2**20 * 8 * 1.5 / (1 * GBIT))  # 1 Gbit/s per link
    assert allreduce_findings(ranks, slow, 10 * GBIT, False, 0.25) == ([], [
        "the NCCL allreduce carried 1 Gbit/s per link against the MPI links' 10 Gbit/s median: "
        "NCCL on another interface or transport than MPI?"])
    assert allreduce_findings(ranks, slow, 10 * GBIT, True, 0.25) == ([], [])
    assert allreduce_findings(ranks, slow, 3 * GBIT, False, 0.25) == ([], [])
    assert allreduce_findings(ranks, slow, None, False, 0.25) == ([], [])  # one node
    # MPI's allreduce is not held against the links it was timed over.
    assert allreduce_findings(ranks, timing(slow.seconds, transport="MPI"), 10 * GBIT, False,
                              0.25) == ([], [])


def test_wrong_sums_fail_in_one_line_when_every_rank_saw_them():
    def with_problems(*problems: str) -> list[RankReport]:
        return [RankReport(rank, f"node{rank + 1}", 1, 0, 4, 1.0, problem)
                for rank, problem in enumerate(problems)]

    off = "returned values up to 0.001 off the due average 2"
    assert allreduce_findings(with_problems(off, off, off), timing(1.0, 3, "MPI"), None, False,
                              0.25) == ([f"every rank: the MPI allreduce {off}"], [])
    assert allreduce_findings(with_problems("", "failed: NCCL error", ""), timing(1.0, 3), None,
                              False, 0.25) == (
        ["rank 1 on node2: the NCCL allreduce failed: NCCL error"], [])


def test_nccl_hints_name_the_switches_that_are_set_and_the_interface_that_is_not():
    assert nccl_hints({}, 1) == [
        "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET in the job's environment makes every rank "
        "print the transport (IB, Socket) and the interface NCCL chose"]
    hints = nccl_hints({"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "0"}, 2)
    assert hints[1:] == [
        "NCCL_SOCKET_IFNAME is not set, so NCCL picks a socket interface itself (docker0, a "
        "management network?): --network-interface IFACE sets it",
        "NCCL_IB_DISABLE=1 turns off InfiniBand (NCCL runs over sockets)"]
    assert len(nccl_hints({"NCCL_SOCKET_IFNAME": "ib0"}, 2)) == 1


class ScriptedRuntime:
    """The part of a runtime time_allreduce uses, with a scripted allreduce: what the check
    makes of a collective that returns wrong values or raises (horovod's real one runs in the
    launcher test below and across nodes in test_multinode)."""

    def __init__(self, rank: int, size: int, allreduce):
        self.world = type("World", (), {"rank": rank, "size": size})()
        self.allreduce = allreduce


def test_the_allreduce_check_reads_the_sums_and_turns_an_error_into_its_finding():
    import tensorflow as tf

    due = tf.fill([8], 1.5)  # ranks 0 and 1 send 1 and 2
    seconds, problem = time_allreduce(ScriptedRuntime(0, 2, lambda tensor, name: due), 8)
    assert problem == "" and 0 < seconds < 5
    _, problem = time_allreduce(ScriptedRuntime(0, 2, lambda tensor, name: due * 1.01), 8)
    assert problem == "returned values up to 0.015 off the due average 1.5"

    def broken(tensor, name):
        raise RuntimeError("ncclCommInitRank failed: unhandled system error\nmore")

    _, problem = time_allreduce(ScriptedRuntime(1, 2, broken), 8)
    assert problem == "failed: RuntimeError: ncclCommInitRank failed: unhandled system error more"


def test_a_first_gpu_run_gets_time_for_ptx_jit_and_a_line_naming_it(tmp_path, capsys):
    cache = tmp_path / "ComputeCache"
    env = {"CUDA_CACHE_PATH": str(cache)}
    assert health_seconds(0, env) == HEALTH_SECONDS
    assert health_seconds(4, env) == HEALTH_SECONDS + PTX_JIT_SECONDS  # nothing compiled yet
    cache.mkdir()
    (cache / "index").write_bytes(b"\0")
    assert health_seconds(4, env) == HEALTH_SECONDS
    # A check that runs out of time on a GPU node: one line, naming the PTX compile too.
    status = run_health_check(Launch(("sleep", "30"), {}), SignalForwarder(), timeout=0.5,
                              gpus_per_node=4)
    said = capsys.readouterr()
    lines = [line for line in (said.out + said.err).splitlines() if line.strip()]
    assert status == EXIT_USAGE and len(lines) == 1, lines
    assert "did not finish in 0.5 s" in lines[0] and "JIT-compile its PTX" in lines[0], lines
