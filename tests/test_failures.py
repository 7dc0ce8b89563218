"""A failed job's one line: what the launcher reads in the job's output (excerpts below are as
horovodrun/mpirun printed them for 4 ranks on 2 nodes of the local cluster, trimmed), what it
keeps from the console (mpirun's and horovodrun's pages after a failure), and the ranks' side: one
report, by rank 0, the others into their own logs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import integration, run_job
from hvdtrain import errors, ranklog
from hvdtrain.launch.failures import EndBanners, JobOutput, relay
from hvdtrain.runtime.base import host_of_each_rank, placement

BANNER = """\
[1,0]<stdout>:hvdtrain.cnn | backend horovod | 4 process(es), 4 worker(s) | CPU, 1 thread(s)
[1,0]<stdout>:placement: node1[0-1] node2[2-3]
[1,0]<stdout>:run dir: /runs/cnn
[1,0]<stdout>:Epoch 1/400
"""

STALL = """\
[1,3]<stdout>:rank 3: stalling at batch 30
[1,0]<stderr>:[2026-11-24 23:18:52[1,0]<stderr>:.766300: W horovod/common/stall_inspector.cc:107] \
One or more tensors were submitted to be reduced, gathered or broadcasted by subset of ranks
[1,0]<stderr>:Missing ranks:
[1,0]<stderr>:3: [PartitionedCall/DistributedAdam_Allreduce/cond/HorovodAllreduce_grads_0]
[1,0]<stderr>:[[1,0]<stderr>:2026-11-24 23:18:54[1,0]<stderr>:.[1,0]<stderr>:767602
[1,0]<stderr>:Missing ranks:
[1,0]<stderr>:3!: [PartitionedCall/DistributedAdam_Allreduce/cond/HorovodAllreduce_grads_0]
[1,0]<stderr>:One or more rank (marked by "!") is stalled for longer than 6 seconds. Will shutdown.
[1,0]<stderr>:hvdtrain.cnn: rank 0: horovod shut the job down: a rank failed (its error is above) \
or stalled in a collective past the stall limit (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); its log: \
/runs/cnn/logs/rank-0.log
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
  Process name: [[17035,1],2]
  Exit code:    1
"""

KILLED = """\
[node1:26271] [[11767,0],0] ORTE_ERROR_LOG: Data unpack would read past end of buffer
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun noticed that process rank 3 with PID 26385 on node node2 exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""

CRASHED = """\
Connection to node2 closed by remote host.
--------------------------------------------------------------------------
ORTE has lost communication with a remote daemon.

  HNP daemon   : [[8800,0],0] on node node1
  Remote daemon: [[8800,0],1] on node node2

  Local host: node1
  Local PID:  27000
  Peer host:  node2
"""

GLOO_KILLED = """\
[0]<stdout>:placement: node1[0-1] node2[2-3]
[2]<stderr>:[2026-11-24 23:14:50.795788: E horovod/common/operations.cc:697] [2]: Horovod \
background loop uncaught exception
Process 3 exit with status code 255.
Terminating remaining workers after failure of Process 3.
Process 2 exit with status code 255.
"""

LINK_DOWN = """\
[1,0]<stderr>:hvdtrain: rank 0 on node1: no training step finished in 27 s: a peer stopped \
answering (a node or its network link down?); ending this rank so that the job ends; its log: \
/runs/cnn/logs/rank-0.log
"""


# What OpenMPI 4.1.4 and horovod 0.28.1 (horovodrun --gloo) print after rank 1 of 2 exited 3
# on one node (`--via mpirun` and `--controller gloo`); horovodrun's traceback trimmed.
PRIMARY_JOB = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
"""

MPIRUN_EXITED = PRIMARY_JOB + """\
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[27322,1],1]
  Exit code:    3
--------------------------------------------------------------------------
"""

GLOO_EXITED = """\
Process 1 exit with status code 3.
Terminating remaining workers after failure of Process 1.
[0]<stderr>:Terminated
Process 0 exit with status code 143.
Traceback (most recent call last):
  File "/venv/bin/horovodrun", line 6, in <module>
    sys.exit(run_commandline())
             ^^^^^^^^^^^^^^^^^
  File "/venv/lib/python3.11/site-packages/horovod/runner/gloo_run.py", line 284, in launch_gloo
    raise RuntimeError('Horovod detected that one or more processes exited with non-zero '
RuntimeError: Horovod detected that one or more processes exited with non-zero status, thus \
causing the job to be terminated. The first process to do so was:
Process name: 1
Exit code: 3

"""


def read(*texts: str) -> tuple[JobOutput, list[str]]:
    """The findings, and the lines that would reach the console (as one stream)."""
    output, banners = JobOutput(), EndBanners()
    shown = [line for text in texts for read_line in text.splitlines(keepends=True)
             if output.read(read_line) for line in banners.pass_on(read_line.encode())]
    return output, [line.decode() for line in shown + banners.rest()]


def test_a_stall_names_the_rank_horovod_found_missing_its_host_and_its_log():
    output, shown = read(BANNER, STALL)
    assert output.verdict("/runs/cnn/logs") == (
        "rank 3 on node2 stalled: the other ranks waited for it in a collective past horovod's "
        "stall limit (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS); its log: /runs/cnn/logs/rank-3.log")
    # Rank 0's own report is what the end line says: kept from the console (it is in its log).
    assert not any("horovod shut the job down" in line for line in shown)
    assert sum("Missing ranks" in line for line in shown) == 2  # horovod's own lines stay


def test_other_ranks_lines_between_horovods_lines_do_not_hide_the_stalled_rank():
    lines = STALL.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if "3!:" in line)
    output, _ = read(BANNER, *lines[:at], "[1,1]<stdout>:a line of rank 1\n",
                     "[1,0]<stdout>:rank 0's progress\n", *lines[at:])
    assert output.stalled == {3}


def test_a_rank_only_late_at_horovods_warning_is_not_the_cause():
    warning_only = STALL.split("[1,0]<stderr>:[[1,0]")[0]
    output, _ = read(BANNER, warning_only, KILLED.replace("rank 3", "rank 1").replace(
        "node node2", "node node1"))
    assert output.stalled == set()
    assert output.verdict("/l").startswith("rank 1 on node1 ended on SIGKILL")


def test_a_killed_rank_is_named_with_its_signal_and_its_log():
    output, shown = read(BANNER, KILLED)
    assert output.verdict("/runs/cnn/logs/") == (
        "rank 3 on node2 ended on SIGKILL (killed: the out-of-memory killer, or by hand); its "
        "log: /runs/cnn/logs/rank-3.log")
    # mpirun's pages say what the end line says; its other message stays.
    assert shown == [*BANNER.splitlines(keepends=True), KILLED.splitlines(keepends=True)[0]]


def test_a_lost_node_names_the_node_and_the_ranks_that_ran_there():
    output, _ = read(BANNER, CRASHED)
    assert output.verdict("/l") == ("node2 stopped answering (crashed, or its network is down) "
                                    "with ranks 2-3 on it; their logs: /l/rank-<K>.log for K in "
                                    "2-3")
    # Before rank 0's banner there is no placement: the node alone, no log to guess.
    output, _ = read(CRASHED)
    assert output.verdict("/l") == "node2 stopped answering (crashed, or its network is down)"


SRUN_KILLED = """\
  Local host: node1
  Peer host:  node2
--------------------------------------------------------------------------
srun: error: node2: task 3: Killed
srun: launch/slurm: _step_signal: Terminating StepId=1.1
slurmstepd-node1: error: *** STEP 1.1 ON node1 CANCELLED AT 2026-11-24T23:29:05 ***
srun: Job step aborted: Waiting up to 12 seconds for job step to finish.
srun: error: node2: task 2: Killed
srun: error: node1: tasks 0-1: Killed
"""


def test_gloo_and_srun_name_the_first_rank_that_failed():
    output, _ = read(GLOO_KILLED)
    assert output.verdict(None) == "rank 3 on node2 failed first (exit status 255)"
    output, _ = read(SRUN_KILLED)
    assert output.verdict("/l") == "rank 3 on node2 failed first (killed); its log: /l/rank-3.log"
    output, _ = read("srun: error: gpu07: tasks 4-7: Exited with exit code 1\n")
    assert output.verdict(None) == "ranks 4-7 on gpu07 failed first (exited with exit code 1)"


def test_mpirun_and_horovodruns_pages_after_a_failure_give_way_to_the_end_line():
    rank_lines = BANNER + "[1,1]<stdout>:rank 1's last words\n"
    output, shown = read(rank_lines, MPIRUN_EXITED)
    assert output.verdict("/l") == ("rank 1 on node1 failed first (exit status 3); its log: "
                                    "/l/rank-1.log")
    assert shown == rank_lines.splitlines(keepends=True)
    output, shown = read(GLOO_EXITED)
    assert output.verdict(None) == "rank 1 failed first (exit status 3)"
    assert shown == ["[0]<stderr>:Terminated\n"]  # a rank's line (its shell's), however terse
    # After a report every rank reached, rank 0 exits first: the report is the finding.
    output, _ = read(BANNER, LINK_DOWN, MPIRUN_EXITED.replace(",1]", ",0]"))
    assert output.verdict(None).startswith("no training step finished in 27 s on rank 0")


@pytest.mark.parametrize("text", [
    # A rank's own traceback (--via mpirun tags no line), and a RuntimeError not horovodrun's.
    "Traceback (most recent call last):\n  File \"train.py\", line 3, in <module>\n"
    "    raise RuntimeError('x')\nRuntimeError: x\n",
    GLOO_EXITED.split("Traceback")[1].replace("Horovod detected", "Horovod found"),
    CRASHED,  # another page of mpirun's: the user needs it
    "-" * 74 + "\n",  # a rank's rule, alone
    "-" * 74 + "\nrank 0: " + "-" * 74 + "\n",
    MPIRUN_EXITED.replace(PRIMARY_JOB, "")[:-76],  # a page cut short: its last rule never came
    PRIMARY_JOB.replace("a non-zero exit code", "rank 0: epoch 3\na non-zero exit code"),
    "  Process name: [[27322,1],1]\n  Exit code:    3\n",  # only inside mpirun's page
], ids=["rank-traceback", "other-runtime-error", "other-mpi-page", "lone-rule", "rules",
        "page-cut-short", "page-interrupted", "bare-fields"])
def test_what_is_not_exactly_such_a_page_is_shown_whole_and_in_order(text):
    _, shown = read(text)
    assert "".join(shown) == text


@integration
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode, via, status, end", [
    ("user-error-on-rank-0", "horovodrun", 2,
     "job exited 2 (a user error: it would fail the same way again)"),
    # horovodrun --gloo exits 1 whatever the ranks' statuses
    ("user-error", "gloo", 1, "job exited 1: rank 0 failed first (exit status 2)"),
    ("crash", "mpirun", 3, "job exited 3: rank 1 failed first (exit status 3)")],
    ids=["user-error-on-rank-0", "user-error", "crash"])
def test_a_failed_jobs_last_line_is_the_launchers_and_every_other_line_a_ranks(
        mode, via, status, end):
    via_flags = ["--controller", "gloo"] if via == "gloo" else ["--via", via]
    script = Path(__file__).parent / "scripts" / "failing_rank.py"
    result = run_job([sys.executable, "-m", "hvdtrain.launch", "--np", "2", *via_flags,
                      "--skip-preflight", str(script), mode], timeout=50, check=False)
    lines = result.stdout.splitlines()
    assert result.returncode == status, result.stdout
    assert lines[-1] == f"hvdtrain.launch: {end}", result.stdout
    said = [line for line in lines if "error" in line and not line.startswith("hvdtrain.launch")]
    assert len(said) == (mode != "crash"), result.stdout
    # The launcher's command line, the ranks' own lines (horovodrun tags them; gloo's rank that
    # horovodrun ended says so through its shell), the end line: no page of mpirun's.
    foreign = [line for line in lines[1:-1] if "failing_rank" not in line
               and not re.fullmatch(r"\[\d+\]<stderr>:Terminated", line)]
    assert not foreign and lines[0].startswith("hvdtrain.launch: "), result.stdout


def test_the_watchdogs_report_becomes_the_end_line():
    output, shown = read(BANNER, LINK_DOWN)
    assert output.verdict("/l") == ("no training step finished in 27 s on rank 0 on node1: a peer "
                                    "stopped answering (a node or its network link down?); its "
                                    "log: /l/rank-0.log")
    assert shown == BANNER.splitlines(keepends=True)


def test_output_it_does_not_understand_leaves_the_generic_line():
    output, shown = read(BANNER, "[1,1]<stderr>:Segmentation fault\n")
    assert output.verdict("/l") is None and len(shown) == 5


def test_the_relay_copies_every_line_in_order_through_a_real_pipe():
    reader, writer = os.pipe()
    copied_reader, copied_writer = os.pipe()
    output = JobOutput()
    with open(reader, "rb") as source, open(copied_writer, "wb") as destination:
        thread = relay(source, destination, output)
        with open(writer, "wb") as job:
            job.write((BANNER + LINK_DOWN + "last words, no newline").encode())
        thread.join(10)
        assert not thread.is_alive()
    with open(copied_reader, "rb") as copied:
        assert copied.read().decode() == BANNER + "last words, no newline"
    assert output.no_step == ("0", "node1", "27")


@pytest.mark.parametrize("hosts", [["a"], ["n1", "n1", "n2", "n2"], ["g01", "g02", "g01", "x-ib"]])
def test_the_placement_line_reads_back(hosts):
    assert host_of_each_rank(placement(hosts)) == dict(enumerate(hosts))


def test_a_report_every_rank_reaches_is_printed_by_rank_0_and_logged_by_the_others(tmp_path):
    log = tmp_path / "rank-1.log"
    script = (
        "import sys, time; from hvdtrain import errors, ranklog\n"
        f"ranklog._current = {str(log)!r}\n"
        "rank = int(sys.argv[1]); started = time.monotonic()\n"
        "errors.report_once(errors.shut_down_report('job', rank, ranklog.current()), rank)\n"
        "print(time.monotonic() - started)\n")
    shown = {rank: subprocess.run([sys.executable, "-c", script, str(rank)], capture_output=True,
                                  text=True, timeout=60, check=True)
             for rank in (0, 1)}
    assert "job: rank 0: horovod shut the job down" in shown[0].stderr
    assert errors.SHUT_DOWN_REPORT.search(shown[0].stderr)
    assert shown[1].stderr == ""
    assert "job: rank 1: horovod shut the job down" in log.read_text()
    assert ranklog.current() is None  # this process never had a rank log
    # The others wait before they exit: rank 0's line must be out before mpirun ends the job.
    seconds = {rank: float(result.stdout) for rank, result in shown.items()}
    assert seconds[1] >= errors.REPORT_GRACE_SECONDS and seconds[0] < 1.0, seconds


@pytest.mark.parametrize("environ, seconds", [
    ({}, None),  # horovod's stall shutdown off (its own default): no watchdog either
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"}, 540),  # 4 inspections of 60 s after it
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6", "HOROVOD_STALL_CHECK_TIME_SECONDS": "2"}, 14),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "6", "HOROVOD_STALL_CHECK_DISABLE": "1"}, None)])
def test_the_watchdog_leaves_horovod_time_to_name_the_stalled_rank(environ, seconds):
    from hvdtrain.runtime.horovod import watchdog_seconds

    assert watchdog_seconds(environ) == seconds
