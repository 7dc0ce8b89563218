"""The local clusters refuse a state directory that root did not make (tests/cluster/: the checks
are lib.sh's, used by cluster-local.sh and slurm-local.sh).

The state directory holds root's ssh key pair, the authorized_keys of every node's sshd and the
munge key. Once it lived in /var/tmp, where any user could create it first, with a key pair of
their own that `up` then reused and authorized: that user logged into node1 as root. Here a
directory is planted where the scripts keep their state (the default path, read from each
script's `use_knobs` line), owned by user nobody with nobody's key pair, or root's but
group/world writable, or a symlink, and `up` must refuse it: a non-zero exit, exactly one line on
stderr naming the directory, and nothing started or changed (no network namespace, no
sshd/slurmd/slurmctld/munged, nothing written into the planted directory, /etc/hosts as it was).

Root only (it plants in /run and runs `up`); skips when a cluster is up or its state directory
exists, so that a running cluster is never touched.
"""
from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cluster_helpers import CLUSTER, SLURM_LOCAL
from conftest import REPO, integration

LIB = REPO / "tests" / "cluster" / "lib.sh"
DAEMONS = ("sshd", "slurmd", "slurmctld", "munged")
TIMEOUT = 120


def default_state_dir(script: Path, knob: str) -> Path:
    """The state directory the script uses when ``knob`` is not set: its ``use_knobs PREFIX
    DEFAULT`` line (lib.sh), where the knob is ``PREFIX_DIR``."""
    prefix = knob.removesuffix("_DIR")
    match = re.search(rf"^use_knobs {prefix} (\S+)$", script.read_text(), re.M)
    assert match, f"no 'use_knobs {prefix} DEFAULT' in {script}"
    return Path(match.group(1))


CLUSTER_DIR = default_state_dir(CLUSTER, "HVDTRAIN_CLUSTER_DIR")
SLURM_DIR = default_state_dir(SLURM_LOCAL, "HVDTRAIN_SLURM_DIR")


def test_scripts_keep_sshd_strict_and_no_fixed_names_in_tmp():
    for script in (CLUSTER, SLURM_LOCAL, LIB):
        text = script.read_text()
        assert not re.search(r"/tmp/hvdtrain", text), f"{script.name} names a fixed path in /tmp"
        assert not re.search(r"(^|[\s=\"'])/var/tmp/", text, re.M), f"{script.name} uses /var/tmp"
    cluster = CLUSTER.read_text()
    assert re.search(r"^StrictModes yes$", cluster, re.M)
    assert not re.search(r"^StrictModes no", cluster, re.M)
    for state_dir in (CLUSTER_DIR, SLURM_DIR):
        assert state_dir.is_absolute() and not str(state_dir).startswith(("/tmp/", "/var/tmp/"))


# --- planting (root) ---------------------------------------------------------------------------
def unavailable_reason(state_dir: Path) -> str | None:
    if os.geteuid() != 0:
        return "plants a state directory in /run and runs `up`: needs root"
    missing = [tool for tool in ("ip", "pgrep", "stat", "bash") if shutil.which(tool) is None]
    if missing:
        return f"missing tools: {' '.join(missing)}"
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return "no user nobody to own the planted directory"
    if os.path.lexists(state_dir):
        return f"{state_dir} exists (a cluster is up, or left over): not touching it"
    if "hvdt-" in netns():
        return "a cluster-local.sh network namespace exists (a cluster is up): not touching it"
    return None


def netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=30).stdout


def daemon_pids() -> set[str]:
    pids = set()
    for name in DAEMONS:
        found = subprocess.run(["pgrep", "-x", name], capture_output=True, text=True, timeout=30)
        pids.update(f"{name}:{pid}" for pid in found.stdout.split())
    return pids


def listing(path: Path) -> list[tuple]:
    """Every entry under ``path`` (itself included) with its owner and mode."""
    if not path.exists():
        return []
    entries = []
    for root, dirs, files in os.walk(path):
        for name in [""] + dirs + files:
            entry = Path(root, name)
            info = entry.lstat()
            entries.append((str(entry), info.st_uid, info.st_mode))
    return sorted(entries)


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as mountinfo:
        points = [line.split()[4] for line in mountinfo]
    return [point for point in points if point.startswith(f"{path.resolve()}/")]


def plant(state_dir: Path, kind: str, tmp_path: Path) -> Path:
    """Make ``state_dir`` as an attacker (or a careless admin) would; returns what to inspect."""
    nobody = pwd.getpwnam("nobody")
    if kind == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir()
        os.chown(target, nobody.pw_uid, nobody.pw_gid)
        state_dir.symlink_to(target)
        return target
    state_dir.mkdir()
    if kind == "owned-by-nobody":
        # What the issue describes: nobody's directory with nobody's key pair and the marker.
        os.chmod(state_dir, 0o755)
        marker = ".hvdtrain-cluster-local" if state_dir == CLUSTER_DIR else ".hvdtrain-slurm-local"
        (state_dir / marker).touch()
        ssh = state_dir / "ssh"
        ssh.mkdir(mode=0o700)
        key = ssh / "id_ed25519"
        if shutil.which("ssh-keygen"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nobody",
                            "-f", str(key)], check=True, capture_output=True, timeout=30)
        else:
            key.write_text("not a key\n")
            key.with_suffix(".pub").write_text("ssh-ed25519 AAAA nobody\n")
        for root, dirs, files in os.walk(state_dir):
            for name in [""] + dirs + files:
                os.lchown(Path(root, name), nobody.pw_uid, nobody.pw_gid)
    elif kind == "group-writable":
        os.chmod(state_dir, 0o775)
    elif kind == "world-writable":
        os.chmod(state_dir, 0o777)
    else:
        raise ValueError(kind)
    return state_dir


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HVDTRAIN_CLUSTER_", "HVDTRAIN_SLURM_", "SLURM_"))}
    env.update(HVDTRAIN_CLUSTER_TIMEOUT="20", HVDTRAIN_SLURM_TIMEOUT="20", **extra)
    return env


def assert_refused(script: Path, args: list[str], state_dir: Path, inspect: Path, down: Path,
                   env: dict[str, str]) -> None:
    """``script up`` must refuse ``state_dir`` in one line and leave everything as it was."""
    before = (netns(), daemon_pids(), listing(inspect), Path("/etc/hosts").read_text())
    try:
        result = subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                                timeout=TIMEOUT, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as timed_out:
        subprocess.run(["bash", str(down), "down"], capture_output=True, timeout=300, env=env)
        pytest.fail(f"{script.name} {' '.join(args)} did not refuse within {TIMEOUT}s: {timed_out}")
    after = (netns(), daemon_pids(), listing(inspect), Path("/etc/hosts").read_text())
    if result.returncode == 0 or after[0] != before[0] or after[1] - before[1]:
        # Not refused (or not before starting things): take down what it brought up, and any
        # namespace still bound into the planted directory.
        subprocess.run(["bash", str(down), "down"], capture_output=True, timeout=300, env=env)
        for mount_point in mounts_under(inspect):
            subprocess.run(["umount", "-l", mount_point], capture_output=True, timeout=30)
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode != 0, output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and str(state_dir) in lines[0], output
    assert "refusing" in lines[0], output
    assert not result.stdout.strip(), output
    assert after[0] == before[0], f"network namespaces changed:\n{before[0]}->\n{after[0]}"
    assert not after[1] - before[1], f"daemons started: {sorted(after[1] - before[1])}"
    assert after[2] == before[2], "the planted directory was written to"
    assert after[3] == before[3], "/etc/hosts changed"


KINDS = ["owned-by-nobody", "group-writable", "world-writable", "symlink"]


@integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_cluster_up_refuses_a_planted_state_dir(kind, tmp_path):
    reason = unavailable_reason(CLUSTER_DIR)
    if reason:
        pytest.skip(reason)
    inspect = plant(CLUSTER_DIR, kind, tmp_path)
    try:
        assert_refused(CLUSTER, ["up", "--nodes", "2"], CLUSTER_DIR, inspect, CLUSTER,
                       clean_env())
        assert not Path("/etc/ssh/ssh_config.d/hvdtrain-cluster.conf").exists()
    finally:
        remove(CLUSTER_DIR)


@integration
@pytest.mark.timeout(300)
def test_cluster_up_refuses_a_state_dir_under_a_world_writable_parent(tmp_path):
    """The issue's attack as it was: nobody's directory and key pair in /tmp-like space, now only
    reachable through HVDTRAIN_CLUSTER_DIR; refused for its parent (sshd's StrictModes would
    refuse it too)."""
    reason = unavailable_reason(CLUSTER_DIR)
    if reason:
        pytest.skip(reason)
    os.chmod(tmp_path, 0o1777)  # a /var/tmp of its own
    state_dir = tmp_path / "hvdtrain-cluster"
    nobody = pwd.getpwnam("nobody")
    state_dir.mkdir(mode=0o755)
    os.chown(state_dir, nobody.pw_uid, nobody.pw_gid)
    env = clean_env(HVDTRAIN_CLUSTER_DIR=str(state_dir))
    assert_refused(CLUSTER, ["up", "--nodes", "2"], state_dir, state_dir, CLUSTER, env)
    assert not CLUSTER_DIR.exists()


@integration
@pytest.mark.timeout(300)
def test_cluster_up_refuses_a_foreign_ssh_dir_inside_its_own_state_dir(tmp_path):
    """Root's 0711 state directory (as up makes it) but an ssh/ of nobody's with nobody's key
    pair: refused before anything is made or started."""
    reason = unavailable_reason(CLUSTER_DIR)
    if reason:
        pytest.skip(reason)
    if not all(shutil.which(p) or Path("/usr/sbin", p).exists() for p in ("sshd", "slurmd")):
        pytest.skip("sshd/slurmd not installed: up would install them before it looks inside")
    CLUSTER_DIR.mkdir(mode=0o711)
    try:
        os.chmod(CLUSTER_DIR, 0o711)
        ssh = CLUSTER_DIR / "ssh"
        ssh.mkdir(mode=0o700)
        nobody = pwd.getpwnam("nobody")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nobody",
                        "-f", str(ssh / "id_ed25519")], check=True, capture_output=True,
                       timeout=30)
        for entry in [ssh, *ssh.iterdir()]:
            os.chown(entry, nobody.pw_uid, nobody.pw_gid)
        assert_refused(CLUSTER, ["up", "--nodes", "2"], ssh, CLUSTER_DIR, CLUSTER, clean_env())
    finally:
        remove(CLUSTER_DIR)


@integration
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_slurm_up_refuses_a_planted_state_dir(kind, tmp_path):
    reason = unavailable_reason(SLURM_DIR)
    if reason:
        pytest.skip(reason)
    conf = Path("/etc/slurm/slurm.conf")
    if conf.exists():
        pytest.skip(f"{conf} exists (a Slurm is configured): not touching it")
    inspect = plant(SLURM_DIR, kind, tmp_path)
    try:
        assert_refused(SLURM_LOCAL, ["up"], SLURM_DIR, inspect, SLURM_LOCAL, clean_env())
        assert not conf.exists()
    finally:
        remove(SLURM_DIR)
