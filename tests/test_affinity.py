"""CPU threads from the ranks' real CPU affinity, in real jobs on this machine's cores.

The collective test checks the exchange between this run's own ranks (a world of 1 under plain
pytest, 2 real ranks under `mpirun -np 2 pytest`). The integration tests each start a job of
tests/scripts/affinity_threads.py under a real launcher and binding (mpirun --bind-to, taskset,
horovodrun over MPI and over Gloo) and check which cores every rank reported in the exchange,
the threads it chose, and that TensorFlow runs with them (so the exchange happened before
TensorFlow started). Jobs run under `taskset` on this machine's first two cores, so the
expectations hold on any machine with two or more.

On two cores every rank of a 2-rank job gets 1 thread, as under the rule this replaced: that
rule went wrong only for ranks sharing a set of at most the machine's cores divided by the
ranks (4 ranks in an 8-core cpuset of a 64-core node), which test_runtime_logic.py simulates.
"""
from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path

import pytest

from conftest import VENV_BIN, clean_env, gather_checked, integration, run_job

pytestmark = pytest.mark.timeout(300)
SCRIPT = str(Path(__file__).parent / "scripts" / "affinity_threads.py")
# (the same core twice on a 1-core machine, where the job tests skip)
FIRST, SECOND = (sorted(os.sched_getaffinity(0)) * 2)[:2]
BOTH = f"{FIRST},{SECOND}"
MPIRUN = ["mpirun", "--oversubscribe"]
MARKER = "affinity "


def starts_a_job(test):
    return integration(pytest.mark.skipif(FIRST == SECOND, reason="needs 2 cores")(test))


def test_every_local_rank_holds_every_local_ranks_cores(runtime):
    from hvdtrain.runtime.horovod import local_cpu_sets

    def local() -> tuple[str, list[list[int]]]:
        cpu_sets = local_cpu_sets(runtime.world)
        assert len(cpu_sets) == runtime.world.local_size
        assert cpu_sets[runtime.world.local_rank] == os.sched_getaffinity(0)
        return socket.gethostname(), [sorted(cores) for cores in cpu_sets]

    by_node: dict[str, list] = {}
    for node, cpu_sets in gather_checked(runtime, local):
        assert by_node.setdefault(node, cpu_sets) == cpu_sets  # the node's ranks agree


def ranks_of(command: list[str], np: int, *, exchanged: bool = True, **env: str) -> list[dict]:
    """Run the job; every rank's report, in rank order, after checks that hold for any job."""
    result = run_job(command + [sys.executable, SCRIPT], timeout=180, env=clean_env(**env))
    # The launcher may prefix a line with a rank tag ("[1,0]<stdout>:"), and two ranks' lines
    # may arrive glued together: decode every object that follows the marker.
    decoder = json.JSONDecoder()
    reports = sorted((decoder.raw_decode(result.stdout, found.end())[0]
                      for found in re.finditer(re.escape(MARKER) + "(?={)", result.stdout)),
                     key=lambda report: report["rank"])
    assert [report["rank"] for report in reports] == list(range(np)), result.stdout[-3000:]
    for report in reports:
        if exchanged:
            assert report["exchanged"] == reports[0]["exchanged"]  # every rank saw the same
        assert report["exchanged"][report["local_rank"]] == report["own"]
        # set_intra_op_parallelism_threads took effect: TensorFlow had not started yet
        assert report["intra_op"] == report["inter_op"] == report["threads"], report
        assert report["ranks_answering"] == np  # horovod's collectives work after the exchange
    return reports


@starts_a_job
def test_unbound_ranks_split_the_cores_they_share():
    reports = ranks_of(["taskset", "-c", BOTH, *MPIRUN, "-np", "2", "--bind-to", "none"], 2)
    assert reports[0]["exchanged"] == [[FIRST, SECOND]] * 2
    assert [report["threads"] for report in reports] == [1, 1]
    assert {report["controller"] for report in reports} == {"mpi"}


@starts_a_job
def test_ranks_bound_to_their_own_cores_keep_them():
    reports = ranks_of(["taskset", "-c", BOTH, *MPIRUN, "-np", "2", "--bind-to", "core"], 2)
    first, second = map(set, reports[0]["exchanged"])
    assert first and second and first.isdisjoint(second)
    assert [report["threads"] for report in reports] == [len(first), len(second)]


@starts_a_job
def test_ranks_confined_to_one_core_get_one_thread_each():
    reports = ranks_of(["taskset", "-c", str(FIRST), *MPIRUN, "-np", "2", "--bind-to", "none"],
                       2)
    assert reports[0]["exchanged"] == [[FIRST]] * 2
    assert [report["threads"] for report in reports] == [1, 1]


@starts_a_job
def test_a_rank_alone_keeps_all_its_cores():
    reports = ranks_of(["taskset", "-c", BOTH, *MPIRUN, "-np", "1", "--bind-to", "none"], 1)
    assert reports[0]["exchanged"] == [[FIRST, SECOND]]
    assert reports[0]["threads"] == 2


@starts_a_job
@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_horovodrun_ranks_exchange_through_their_controller(controller):
    reports = ranks_of(["taskset", "-c", BOTH, str(VENV_BIN / "horovodrun"), f"--{controller}",
                        "-np", "2"], 2)
    assert {report["controller"] for report in reports} == {controller}
    assert reports[0]["exchanged"] == [[FIRST, SECOND]] * 2
    assert [report["threads"] for report in reports] == [1, 1]


@starts_a_job
def test_gloo_ranks_bound_by_their_own_command_are_seen_as_bound():
    # horovodrun binds no Gloo rank; here each rank's command pins it to the core of its local
    # rank, which only an exchange (not an assumption about the launcher) can know.
    pin = 'exec taskset -c "$(echo "$CORES" | cut -d, -f$((HOROVOD_LOCAL_RANK + 1)))" "$@"'
    reports = ranks_of([str(VENV_BIN / "horovodrun"), "--gloo", "-np", "2", "sh", "-c", pin,
                        "pin"], 2, CORES=BOTH)
    assert reports[0]["exchanged"] == [[FIRST], [SECOND]]
    assert [report["threads"] for report in reports] == [1, 1]


@starts_a_job
def test_mpi_without_thread_support_assumes_the_cores_are_shared():
    # HOROVOD_MPI_THREADS_DISABLE: only horovod's thread may call MPI, so no exchange; each rank
    # takes its peers to share its cores, which can only under-use the cores.
    reports = ranks_of(["taskset", "-c", BOTH, *MPIRUN, "-np", "2", "--bind-to", "core"], 2,
                       exchanged=False, HOROVOD_MPI_THREADS_DISABLE="1")
    for report in reports:
        assert report["exchanged"] == [report["own"]] * 2
    assert [report["threads"] for report in reports] == [1, 1]
