"""A rank's scratch directory (hvdtrain.scratch) in a $TMPDIR other users share: never one they
made first, and the stale sweep removes only this user's directories of processes provably gone.
Real processes of real users (root, nobody, daemon) on the real file system; needs root, as CI
runs."""
from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.getuid() != 0, reason="acts as other users: needs root")]

#: Prints its pid, waits for a line, makes its scratch and its disk cache's directory (as a rank
#: does), prints both and waits for stdin to close.
RANK = """
import os, sys
print(os.getpid(), flush=True)
sys.stdin.readline()
from hvdtrain.data.cache import CacheChoice, process_cache_dir
from hvdtrain.scratch import use_rank_scratch
print(use_rank_scratch(), process_cache_dir(CacheChoice("disk", "test")), flush=True)
sys.stdin.read()
"""


def python_for(user: str) -> str:
    # The venv's python lives under root's 0700 home: another user runs the system's (3.11
    # too; the scratch code is the standard library's only).
    return sys.executable if user == "root" else "/usr/bin/python3"


def start_rank(user: str, tmpdir: Path, *prefix: str) -> subprocess.Popen:
    as_user = [] if user == "root" else ["runuser", "-u", user, "--"]
    return subprocess.Popen([*prefix, *as_user, python_for(user), "-c", RANK],
                            env={"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO),
                                 "TMPDIR": str(tmpdir)},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def rank_pid(rank: subprocess.Popen) -> int:
    return int(rank.stdout.readline())


def rank_directories(rank: subprocess.Popen) -> tuple[Path, Path]:
    rank.stdin.write("go\n")
    rank.stdin.flush()
    scratch, cache = rank.stdout.readline().split()
    return Path(scratch), Path(cache)


def sweep(user: str, tmpdir: Path) -> None:
    """A rank of ``user`` starting with ``tmpdir`` (its start sweeps), then ending."""
    rank = start_rank(user, tmpdir)
    rank_pid(rank)
    rank_directories(rank)
    rank.communicate(timeout=30)
    assert rank.returncode == 0


def killed_rank_directory(user: str, tmpdir: Path) -> Path:
    """The scratch directory of a rank of ``user`` SIGKILLed together with its janitor: left for
    a sweep."""
    rank = start_rank(user, tmpdir)
    pid = rank_pid(rank)
    scratch, _ = rank_directories(rank)
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for process in [*children, pid]:  # the janitor first: it would remove the directory
        os.kill(int(process), signal.SIGKILL)
    rank.communicate(timeout=30)
    assert scratch.is_dir()
    return scratch


def owner_of(path: Path) -> str:
    return pwd.getpwuid(path.lstat().st_uid).pw_name


@pytest.fixture
def shared_tmp():
    """A /tmp of its own for the test: world-writable and sticky, as /tmp is."""
    path = Path(tempfile.mkdtemp(prefix="hvdtrain-test-tmp-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def plant(path: Path, user: str, victim: Path) -> None:
    """What ``user`` could make in advance of a rank whose pid they guess: its directory by the
    name it had (``hvdtrain-<host>-<pid>``), open to all (0777), and the disk cache inside it
    with ``samples`` a symlink to ``victim``."""
    uid = pwd.getpwnam(user).pw_uid
    cache = path / f"hvdtrain-cache-{path.name.removeprefix('hvdtrain-')}" / "training"
    cache.mkdir(parents=True)
    (cache / "samples").symlink_to(victim)
    for made in [path, *path.rglob("*")]:
        os.lchown(made, uid, uid)
        if not made.is_symlink():
            made.chmod(0o777)


def tree(path: Path) -> list[tuple[str, int, int]]:
    return sorted((str(entry), entry.lstat().st_uid, entry.lstat().st_mode)
                  for entry in [path, *path.rglob("*")])


@pytest.mark.parametrize("user,planter", [("root", "nobody"), ("nobody", "daemon")])
def test_a_planted_scratch_directory_is_never_used(shared_tmp, user, planter):
    victim = shared_tmp / "victim"
    victim.write_text("the victim's\n")
    os.chown(victim, pwd.getpwnam(user).pw_uid, -1)
    victim.chmod(0o600)
    rank = start_rank(user, shared_tmp)
    pid = rank_pid(rank)
    planted = shared_tmp / f"hvdtrain-{socket.gethostname()}-{pid}"
    plant(planted, planter, victim)
    planted_tree = tree(planted)
    scratch, cache = rank_directories(rank)
    try:
        assert planted not in (scratch, *scratch.parents)
        assert cache.parent == scratch  # the disk cache lies in the rank's own scratch
        for made in (scratch, cache):
            assert owner_of(made) == user and stat.S_IMODE(made.lstat().st_mode) == 0o700
        assert tree(planted) == planted_tree  # untouched, and not swept: it is not the rank's
    finally:
        rank.communicate(timeout=30)
    assert not scratch.exists()
    assert victim.read_text() == "the victim's\n"


def test_a_disk_cache_never_writes_through_a_planted_samples_file(tmp_path):
    """The disk store makes its file and never opens one that was there, nor follows a
    symlink (what a planted directory held, above)."""
    import numpy as np
    import tensorflow as tf

    from hvdtrain.data.store import SampleStore

    victim = tmp_path / "victim"
    victim.write_bytes(b"the victim's\n")
    split = tmp_path / "cache" / "training"
    split.mkdir(parents=True)
    (split / "samples").symlink_to(victim)
    with pytest.raises(FileExistsError):
        store = SampleStore((2, 2, 3), str(split))
        store._write(tf.constant([0], tf.int64), tf.constant(np.full((1, 2, 2, 3), 7, np.uint8)))
    assert victim.read_bytes() == b"the victim's\n"


@pytest.mark.parametrize("user,planter", [("root", "nobody"), ("nobody", "daemon")])
def test_the_sweep_leaves_another_users_directories(shared_tmp, user, planter):
    """Even as root: another user's directories, whether their process is gone or not, and
    whatever their name and marker say."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    named = shared_tmp / f"hvdtrain-{socket.gethostname()}-{gone.pid}"
    plant(named, planter, shared_tmp / "victim")
    killed = killed_rank_directory(planter, shared_tmp)
    before = {path: tree(path) for path in (named, killed)}
    sweep(user, shared_tmp)
    assert {path: tree(path) for path in (named, killed)} == before


def test_the_sweep_leaves_a_live_process_in_another_pid_namespace(shared_tmp):
    """A container sharing /tmp: its rank's pid means nothing in this pid namespace, where no
    process has it."""
    # The rank's pid in its namespace (where sh is 1): one no process has here.
    pid = next(pid for pid in range(30000, 1000, -1) if not Path(f"/proc/{pid}").exists())
    rank = start_rank("root", shared_tmp, "unshare", "--pid", "--fork", "--mount-proc", "sh",
                      "-c", f'echo {pid - 1} >/proc/sys/kernel/ns_last_pid && "$0" "$@"; exit $?')
    try:
        assert rank_pid(rank) == pid
        scratch, cache = rank_directories(rank)
        sweep("root", shared_tmp)
        assert scratch.is_dir() and cache.is_dir()
    finally:
        rank.communicate(timeout=30)
    assert not scratch.exists()  # removed by its own process


@pytest.mark.parametrize("user", ["root", "nobody"])
def test_the_sweep_removes_this_users_directory_of_a_dead_process(shared_tmp, user):
    left = killed_rank_directory(user, shared_tmp)
    # Fresh and private: a random name, not the pid's; mode 0700.
    assert stat.S_IMODE(left.lstat().st_mode) == 0o700
    assert not left.name.removeprefix(f"hvdtrain-{socket.gethostname()}-").isdigit()
    sweep(user, shared_tmp)
    assert not left.exists()


def test_a_forked_childs_exit_leaves_its_parents_scratch(shared_tmp):
    forking = """
import os, sys
from hvdtrain.scratch import use_rank_scratch
scratch = use_rank_scratch()
if os.fork() == 0:
    sys.exit(0)  # runs the exit handlers it inherited
os.wait()
print(os.path.isdir(scratch))
"""
    result = subprocess.run([sys.executable, "-c", forking], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO), "TMPDIR": str(shared_tmp)}, timeout=30)
    assert result.stdout == "True\n", result.stderr
