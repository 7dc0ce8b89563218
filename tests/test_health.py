"""hvdtrain.health's verdicts (pure), and the launcher's --health-check on real ranks.

The slow link and the perturbed rank across real nodes are in test_multinode.py.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env, integration
from hvdtrain.health import RankReport, device_findings, disagreeing, rate_text, slow_links

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
    uneven = reports(1.0, 1.0, 1.0)[:2] + [RankReport(2, "node3", 1, 0, 1, 1.0)]
    assert device_findings(uneven, 0) == (
        [], ["node3: 1 core(s) per rank against 4 median (a smaller CPU share)"])


@integration
@pytest.mark.timeout(300)
def test_a_rank_computing_other_numbers_fails_the_check_before_the_job(tmp_path):
    """The launcher, 3 ranks on this machine, rank 2 nudged (the check's test-only variable):
    its lines only, exit 2, the job never started."""
    result = subprocess.run(
        [sys.executable, "-m", "hvdtrain.launch", "--np", "3", "--health-check", "hvdtrain.cnn",
         "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=240,
        env=clean_env(HVDTRAIN_HEALTH_TEST_PERTURB_RANK="2"))
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2, lines
    assert lines[0].startswith("hvdtrain.health: failed: rank 2 on ") and \
        " other rank(s) computed " in lines[0], lines
    assert lines[1].startswith("hvdtrain.health: FAILED: 3 rank(s) on 1 node(s)"), lines
    assert len(lines) == 2, lines
    assert not (tmp_path / "run").exists()


def test_with_two_nodes_a_slow_sender_is_named_not_its_receiver():
    rates = {("node1", "node2"): 9 * GBIT, ("node2", "node1"): 94 * MBIT}
    assert slow_links(rates, 0.25) == ["node2: 94 Mbit/s out against 4.55 Gbit/s median"]
