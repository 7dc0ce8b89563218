"""Test tiers and the helpers that keep multi-process tests from hanging.

`pytest tests/` runs every tier in one process: pure logic, collective tests as a world of one,
and integration tests that start their own horovodrun/mpirun/Slurm jobs.
`pytest tests/ -m "not integration"` (`make test-fast`) leaves the integration tier out: what is
left runs in a few minutes, for the inner loop. A test is `integration` when it starts a child
process that imports TensorFlow, an MPI or horovodrun job, a Slurm daemon, network namespaces or
an MLflow server, or otherwise takes more than a few seconds; a test that reaches a job-starting
helper (`JOB_STARTERS`) without the marker stops the run at collection.
`mpirun -np 2 pytest tests/` runs the same files in two processes: the collective tests (those
that take the `runtime` fixture) then run across 2 real ranks; every other test skips there with
one line: an integration test would start every job twice, competing for the same 2 cores, and a
pure test ran in the single-process pass and would only run twice more. Collective tests that
compare ranks, or train whole runs whose subject is the ranks (`multi_rank`), skip in a world of
one, where they would compare rank 0 with itself or repeat the 2-rank pass's work.

Collective tests never assert before the ranks have exchanged their results: `gather_checked`
runs the local part, all-gathers (ok, error) from every rank, and only then asserts, so a failure
on one rank fails the test on all ranks together instead of leaving the others waiting.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable

import pytest

import hvdtrain  # noqa: F401  (selects Keras 2 before anything imports TensorFlow)
from hvdtrain.launcher_env import child_env
from processes import process_group

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
LAUNCHED_RANKS = int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1"))
#: A run's resume line; group 1: the epochs done (a checkpoint within an epoch adds its steps).
RESUMED = r"resuming from \S+: (\d+) epoch\(s\)(?: and \d+ of \d+ steps)? done"

@pytest.fixture(autouse=True)
def no_rank_log_after_the_test():
    """A job run in this process (through the API) starts its rank's log (hvdtrain.ranklog): a
    later test in this process must not find it, or write into it."""
    from hvdtrain import ranklog

    yield
    ranklog._current = None


#: The integration tier (setup.cfg registers the marker): on a module (`pytestmark`) or a test.
#: Under mpirun these tests skip (pytest_collection_modifyitems).
integration = pytest.mark.integration
# Decided from the launcher's environment, the same on every rank: no rank enters a collective
# that the others skipped.
multi_rank = pytest.mark.skipif(
    LAUNCHED_RANKS < 2, reason="about ranks together: runs under mpirun -np 2 pytest tests/")


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if not item.get_closest_marker("integration") and reaches_a_job_starter(item)]
    if unmarked:
        raise pytest.UsageError(
            "these tests start jobs but are not marked integration (conftest.integration):\n  "
            + "\n  ".join(unmarked))
    # Decided from the collected items, the same on every rank: no rank waits in a collective
    # for a test the others skipped.
    if LAUNCHED_RANKS < 2:
        return
    started_alone = pytest.mark.skip(reason="integration tests start their own jobs; they run "
                                            "in the single-process pass (pytest tests/)")
    single_pass = pytest.mark.skip(reason="takes no part in a collective: runs in the "
                                          "single-process pass (pytest tests/)")
    for item in items:
        if item.get_closest_marker("integration"):
            item.add_marker(started_alone)
        elif "runtime" not in getattr(item, "fixturenames", ()):
            item.add_marker(single_pass)


@pytest.fixture(scope="session")
def runtime():
    """This process's horovod runtime: a world of 1 under plain pytest, of N under mpirun."""
    from hvdtrain.runtime.horovod import HorovodRuntime

    return HorovodRuntime()


def gather_checked(runtime, local: Callable[[], Any]) -> list[Any]:
    """Run ``local()`` on every rank, gather the results, then fail together if any rank failed."""
    try:
        outcome = ("ok", local())
    except Exception:  # noqa: BLE001 - reported below, on every rank
        outcome = ("error", traceback.format_exc())
    outcomes = runtime.allgather_object(outcome)
    failures = [f"rank {rank}:\n{detail}" for rank, (status, detail) in enumerate(outcomes)
                if status == "error"]
    assert not failures, "\n".join(failures)
    return [value for _, value in outcomes]


def assert_same_on_all_ranks(per_rank: list[list], what: str) -> None:
    """Every rank's arrays (weights, optimizer state) equal rank 0's, variable by variable."""
    import numpy as np

    for rank, values in enumerate(per_rank[1:], start=1):
        assert len(values) == len(per_rank[0])
        for index, (mine, theirs) in enumerate(zip(per_rank[0], values)):
            np.testing.assert_allclose(theirs, mine, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{what}: rank {rank} differs at variable {index}")


@pytest.fixture
def shared_dir(runtime, tmp_path_factory):
    """One directory all ranks agree on (rank 0's temporary directory)."""
    path = str(tmp_path_factory.mktemp("shared")) if runtime.world.is_chief else None
    return Path(runtime.broadcast_object(path))


#: The test clusters' nodes declare four GPUs that are plain files (tests/cluster/lib.sh), so their
#: jobs run CPU ranks where Slurm gave GPUs: hvdtrain refuses that unless told (hvdtrain.gpus).
FAKE_GPU_NODES = {"HVDTRAIN_ALLOW_CPU": "1"}


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a job a test starts, as from the user's shell: none of this process's
    MPI/horovod/Slurm identity, nor the parent make's (`make test` runs lanes under make -j2,
    whose job-server flags would make a test's own `make train` warn)."""
    env = {k: v for k, v in child_env().items() if not k.startswith("MAKE") and k != "MFLAGS"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PATH=f"{VENV_BIN}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               # `make test` runs two lanes of jobs on 2 cores, more ranks than cores, which
               # Open MPI cannot see (each job's host has as many slots as ranks): a process
               # waiting in a collective would spin on a core another job's rank needs. hvdtrain's
               # ranks yield by themselves (HorovodRuntime); this tells the other MPI programs
               # the tests start (plain horovod scripts, mpi4py in the health check) the same.
               OMPI_MCA_mpi_yield_when_idle="1")
    env.update(extra)
    return env


@contextlib.contextmanager
def small_disk_at(mount_point: Path, size: str):
    """A real, small file system (tmpfs of ``size``, e.g. "4m") mounted on the new directory
    ``mount_point`` for the block, unmounted after; skips the test where it cannot be mounted
    (it needs root, as CI runs)."""
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


def run_job(args: list[str], *, timeout: float, cwd: Path = REPO, env: dict | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """Run a command (a horovodrun job, a CLI) to completion in a process group of its own, which
    is killed on timeout; whatever the command left of the group is ended after it."""
    with process_group(args, cwd=cwd, env=env or clean_env(), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as process:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)  # at once, for the output it wrote until then
            output, _ = process.communicate()
            pytest.fail(f"{' '.join(args)} did not finish in {timeout} s; output:\n"
                        f"{output[-4000:]}")
    result = subprocess.CompletedProcess(args, process.returncode, output, None)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {result.returncode}; output:\n{output[-6000:]}")
    return result


def horovodrun(np: int, module: str, *args: str, timeout: float = 300, check: bool = True,
               env: dict | None = None) -> subprocess.CompletedProcess:
    return run_job([str(VENV_BIN / "horovodrun"), "-np", str(np), sys.executable, "-m", module,
                    *args], timeout=timeout, check=check, env=env)


def mpirun_ranks(np: int) -> list[str]:
    """What `horovodrun -np N` runs for N ranks on this host (horovod/runner/mpi_run.py), for
    tests whose subject is the job, not horovodrun: horovodrun first imports TensorFlow in a
    child process to check its own build, 3-5 s per job on these 2 cores. The tests of the
    user's commands (tests/test_jobs.py, the examples, the launcher) keep horovodrun."""
    return ["mpirun", "--allow-run-as-root", "--tag-output", "-np", str(np), "-H",
            f"localhost:{np}", "-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1",
            "-mca", "btl", "^openib"]


def mpirun_job(np: int, module: str, *args: str, timeout: float = 300, check: bool = True,
          env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m module args`` in N ranks on this host, started as horovodrun would."""
    return run_job([*mpirun_ranks(np), sys.executable, "-m", module, *args], timeout=timeout,
                   check=check, env=env)


def wait_for_first_epoch(run_dir: Path, job: subprocess.Popen, log: Path,
                         timeout: float = 240, poll_seconds: float = 0.1) -> None:
    """Return once the job's first epoch is in ``run_dir/metrics.json``; fail the test (with the
    job's output) if the job ends first or takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.json").exists():
        if job.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the job ended or never finished an epoch:\n{log.read_text()[-3000:]}")
        time.sleep(poll_seconds)


def apt_install(*packages: str) -> subprocess.CompletedProcess:
    """apt-get install PACKAGES (as root), waiting for an install another test runs: for the
    tools Debian packages and a test needs (Charliecloud, skopeo)."""
    return subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-qq",
                           "--no-install-recommends", *packages], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def have_command(name: str) -> bool:
    return shutil.which(name) is not None


def one_error(result: subprocess.CompletedProcess, program: str = "hvdtrain.cnn") -> str:
    """The single error line of a failed run, checking there is exactly one and no traceback."""
    errors = [l for l in result.stdout.splitlines() if f"{program}: error" in l]
    assert result.returncode != 0, result.stdout[-2000:]
    assert len(errors) == 1, result.stdout[-4000:]
    assert "Traceback" not in result.stdout, result.stdout[-4000:]
    return errors[0]


#: What starts a job of ranks or a training job (and every function of tests/cluster_helpers.py,
#: which reaches the namespace cluster): a test that refers to one of them, in its own code, in a
#: function or class of tests/ it refers to, or in a fixture it takes, is an integration test.
#: A command a test runs itself (run_job, subprocess) is not looked into: whether it starts
#: TensorFlow is for the test's author to say (and --durations to show).
JOB_STARTERS = (horovodrun, mpirun_job, mpirun_ranks, wait_for_first_epoch)
_refers: dict[types.CodeType, bool] = {}


def reaches_a_job_starter(item: pytest.Item) -> bool:
    """Whether the test's function, or a fixture it takes, refers to one of JOB_STARTERS."""
    fixtures = getattr(item, "_fixtureinfo", None)
    functions = [getattr(item, "function", None)] + [
        definition.func for definitions in (fixtures.name2fixturedefs.values() if fixtures else ())
        for definition in definitions]
    return any(refers_to_a_job_starter(function) for function in functions if function)


def refers_to_a_job_starter(function: Callable) -> bool:
    """Whether ``function``'s code uses the name of one of JOB_STARTERS, or of a function or
    class of tests/ that does (its module's names, as the code reads them)."""
    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None:
        return False
    if code not in _refers:
        _refers[code] = False  # meanwhile, for a function that calls itself
        _refers[code] = any(_is_or_reaches_a_job_starter(function.__globals__.get(name))
                            for name in set(_names_in(code)))
    return _refers[code]


def _names_in(code: types.CodeType):
    """The global and attribute names a function's code uses, its nested functions' included."""
    yield from code.co_names
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _names_in(constant)


def _is_or_reaches_a_job_starter(thing: Any) -> bool:
    if any(thing is starter for starter in JOB_STARTERS):
        return True
    if inspect.isclass(thing):
        return any(_is_or_reaches_a_job_starter(member) for member in vars(thing).values()
                   if inspect.isfunction(member))
    if not inspect.isfunction(thing) or not _in_tests(thing.__code__.co_filename):
        return False
    return thing.__module__ == "cluster_helpers" or refers_to_a_job_starter(thing)


@functools.cache
def _in_tests(file_name: str) -> bool:
    return Path(file_name).resolve().parent == REPO / "tests"
