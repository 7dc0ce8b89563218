"""The launchers' variables, stated once (hvdtrain.launcher_env): what a child must not inherit,
which processes are ranks (read from a real /proc), and the one stop-signal -> exit-status rule."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from hvdtrain.errors import EXIT_PREEMPTED, stop_status
from hvdtrain.launch.supervise import attempt_processes
from hvdtrain.launcher_env import child_env, is_identity, processes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_child_keeps_the_users_variables_and_drops_who_its_parent_was():
    inside_a_rank = {
        "PATH": "/usr/bin", "HOME": "/root", "FOO": "1", "CUDA_VISIBLE_DEVICES": "0",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:4000", "PMIX_RANK": "1",
        "PMIX_SERVER_URI3": "x", "PMI_RANK": "1", "HOROVOD_RANK": "1",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1", "SLURM_JOB_ID": "42", "SLURM_PROCID": "1"}
    assert child_env(inside_a_rank, EXTRA="x") == {
        "PATH": "/usr/bin", "HOME": "/root", "FOO": "1", "CUDA_VISIBLE_DEVICES": "0",
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "EXTRA": "x"}
    assert is_identity("OMPI_COMM_WORLD_LOCAL_RANK") and not is_identity("HVDTRAIN_RUN_DIR")


def test_processes_reads_ranks_and_attempts_from_a_real_proc():
    base = child_env()
    started = [subprocess.Popen(SLEEPER, env={**base, "HVDTRAIN_LAUNCH_ATTEMPT": "7.0",
                                              "OMPI_COMM_WORLD_RANK": "3"}),
               subprocess.Popen(SLEEPER, env={**base, "HVDTRAIN_LAUNCH_ATTEMPT": "7.0"}),
               subprocess.Popen(SLEEPER, env={**base, "HVDTRAIN_LAUNCH_ATTEMPT": "7.1",
                                              "PMIX_RANK": "0"}),
               subprocess.Popen(SLEEPER, env={**base, "HVDTRAIN_LAUNCH_ATTEMPT": "71.0"})]
    try:
        deadline = time.monotonic() + 20  # until each child's interpreter has its argv
        while time.monotonic() < deadline:
            seen = {p.pid: p for p in processes() if p.pid in {s.pid for s in started}}
            if len(seen) == 4 and all(p.argv == tuple(SLEEPER) for p in seen.values()):
                break
            time.sleep(0.05)
        assert [seen[s.pid].rank for s in started] == [3, None, 0, None]
        rank, helper, next_attempt, other_launcher = (s.pid for s in started)
        assert attempt_processes("HVDTRAIN_LAUNCH_ATTEMPT=7.0") == {rank: True, helper: False}
        # What another host's launcher asks of this one (the orphan guard): rank 3 runs here.
        answer = subprocess.run([sys.executable, "-m", "hvdtrain.launch.probe", "ranks",
                                 "HVDTRAIN_LAUNCH_ATTEMPT=7.0"], capture_output=True, text=True,
                                timeout=60, env=base).stdout
        assert 'HVDTRAIN_PROBE {"ranks": [3]}' in answer.splitlines(), answer
        # Every attempt of launcher 7, and not launcher 71's.
        assert attempt_processes("HVDTRAIN_LAUNCH_ATTEMPT=7.", whole=False) == {
            rank: True, helper: False, next_attempt: True}
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_one_rule_for_how_a_stopped_job_exits():
    assert stop_status(signal.SIGUSR1) == EXIT_PREEMPTED == 75  # requeue me
    assert stop_status(signal.SIGTERM) == 143 and stop_status(signal.SIGINT) == 130
