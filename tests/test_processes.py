"""tests/processes.py: a job's whole process group is gone after its block."""
from __future__ import annotations

import subprocess

import pytest

from processes import live_processes_in_group, process_group

# A shell that starts a child and says its pid: both ignore SIGTERM (inherited across exec), so
# only the SIGKILL after the grace ends them. "exit": the shell leaves its child behind at once.
STARTS_A_CHILD = "trap '' TERM; sleep 60 & echo $!; {}"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("parent_ends", ["wait", "exit"])
def test_the_leader_and_the_child_it_started_are_gone_after_the_block(parent_ends):
    with process_group(["sh", "-c", STARTS_A_CHILD.format(parent_ends)], grace_seconds=0.2,
                       stdout=subprocess.PIPE, text=True) as parent:
        child = int(parent.stdout.readline())
        if parent_ends == "exit":
            parent.wait()
        assert child in live_processes_in_group(parent.pid)
    assert parent.returncode is not None
    assert live_processes_in_group(parent.pid) == []


def test_a_group_that_ended_in_the_block_is_no_error():
    with process_group(["true"]) as done:
        done.wait()
    assert done.returncode == 0
