"""The test tiers (tests/conftest.py): `make test-fast` is the pure tier, and a test that starts
jobs cannot slip into it unmarked: the collection check finds a job starter however a test's code
reaches it. Pure tests."""
from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

import conftest
from conftest import REPO, clean_env, refers_to_a_job_starter

#: Test code as a test file would hold it (compiled as one, below).
SAMPLES = '''
def calls_one(tmp_path):
    mpirun_job(2, "hvdtrain.cnn", "--run-dir", str(tmp_path))

def ranks():
    return [*mpirun_ranks(2), "python", "train.py"]

def calls_a_helper_that_calls_one():
    run_job(ranks(), timeout=60)

class Server:
    def wait(self, run_dir, job, log):
        wait_for_first_epoch(run_dir, job, log)

def uses_a_class_whose_method_calls_one(tmp_path):
    Server().wait(tmp_path, None, None)

def calls_one_in_a_nested_function():
    return lambda: horovodrun(2, "hvdtrain.cnn")

def runs_a_command_of_its_own():
    run_job(["true"], timeout=60)

def calls_itself(depth):
    return calls_itself(depth - 1) if depth else run_job(["true"], timeout=60)
'''


@pytest.fixture(scope="module")
def samples() -> dict:
    names = {name: getattr(conftest, name) for name in (
        "horovodrun", "mpirun_job", "mpirun_ranks", "run_job", "wait_for_first_epoch")}
    exec(compile(SAMPLES, str(REPO / "tests" / "samples_of_test_code.py"), "exec"), names)
    return names


@pytest.mark.parametrize("name", ["calls_one", "calls_a_helper_that_calls_one",
                                  "uses_a_class_whose_method_calls_one",
                                  "calls_one_in_a_nested_function"])
def test_a_job_starter_is_found_however_the_test_reaches_it(samples, name):
    assert refers_to_a_job_starter(samples[name])


@pytest.mark.parametrize("name", ["runs_a_command_of_its_own", "calls_itself"])
def test_a_command_the_test_runs_itself_is_left_to_its_author(samples, name):
    assert not refers_to_a_job_starter(samples[name])


def test_make_test_fast_runs_the_pure_tier_and_prints_its_slowest_tests():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(["make", "-n", "-C", str(REPO), "--no-print-directory", "test-fast"],
                            capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.returncode == 0, result.stderr
    [command] = [shlex.split(line) for line in result.stdout.splitlines() if " -m pytest " in line]
    assert "tests/" in command and "mpirun" not in command, command
    assert command[command.index("-m", command.index("pytest")):][:2] == ["-m", "not integration"]
    assert any(word.startswith("--durations=") for word in command), command
