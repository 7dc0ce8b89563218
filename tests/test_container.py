"""Containers: the launcher's --container rules (pure) and containers/oci_archive.py on a small
root, read back by skopeo (which checks every digest). The image itself is built and run across
two nodes in tests/test_multinode.py."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile

import pytest

from conftest import REPO, apt_install, integration
from hvdtrain.errors import UserError
from hvdtrain.launch import container
from hvdtrain.launch.options import LaunchOptions, check_options, program_command
from hvdtrain.launch.paths import build_launch
from hvdtrain.launch.slurm import Allocation


def test_auto_takes_pyxis_where_srun_has_it_else_charliecloud():
    assert container.choose_runtime("auto", srun_has_pyxis=True, have_ch_run=True) == "pyxis"
    assert container.choose_runtime("auto", srun_has_pyxis=False, have_ch_run=True) == \
        "charliecloud"
    assert container.choose_runtime("charliecloud", srun_has_pyxis=True, have_ch_run=True) == \
        "charliecloud"
    with pytest.raises(UserError, match="has no --container-image"):
        container.choose_runtime("pyxis", srun_has_pyxis=False, have_ch_run=True)
    with pytest.raises(UserError, match="pyxis plugin .* or Charliecloud's ch-run"):
        container.choose_runtime("auto", srun_has_pyxis=False, have_ch_run=False)


def test_the_job_directories_are_bound_by_their_top_directory():
    assert container.shared_roots(["/work/me/project", "/work/me/runs/x", "/tmp/y"]) == \
        ["/work", "/tmp"]
    with pytest.raises(UserError, match="under /opt, which the image has itself"):
        container.shared_roots(["/opt/project"])
    with pytest.raises(UserError, match="under /usr"):
        container.shared_roots(["/scratch/a", "/usr/local/runs"])


MOUNT_POINT_FIRST = ["sh", "-c", 'mkdir -p "/var/tmp/$USER.ch/mnt" && exec "$@"', "sh"]


def test_each_runtime_wraps_the_rank_command_its_way(tmp_path):
    program = ["python", "-m", "hvdtrain.cnn"]
    flags, command = container.wrap("charliecloud", "/work/img.sqfs", program, ["/work"],
                                    "/work/me")
    assert flags == [] and command == [*MOUNT_POINT_FIRST, "ch-run", "--set-env", "--bind=/work",
                                       "--cd=/work/me", "/work/img.sqfs", "--", *program]
    # A directory image mounts nothing, so ch-run makes no mount point.
    _, command = container.wrap("charliecloud", str(tmp_path), program, ["/work"], "/work/me")
    assert command[0] == "ch-run"
    flags, command = container.wrap("pyxis", "docker://nvcr.io#nvidia/tensorflow:25.02-tf2-py3",
                                    program, ["/work", "/scratch"], "/work/me")
    assert command == program and flags == [
        "--container-image=docker://nvcr.io#nvidia/tensorflow:25.02-tf2-py3",
        "--container-mounts=/work:/work,/scratch:/scratch", "--container-workdir=/work/me"]
    # The launcher's probes run in the image with ch-run; with pyxis each would be a job step.
    assert container.probe_prefix("charliecloud", "/i.sqfs", ["/work"], "/work") == (
        *MOUNT_POINT_FIRST, "ch-run", "--set-env", "--bind=/work", "--cd=/work", "/i.sqfs", "--",
        "sh", "-c")
    assert container.probe_prefix("pyxis", "/i.sqfs", ["/work"], "/work") is None


def test_charliecloud_ranks_get_what_pmix_and_openmpi_need_unless_set():
    env = container.rank_env("charliecloud", {"USER": "me", "PMIX_MCA_gds": "ds21"})
    assert env == {"OMPI_MCA_btl_vader_single_copy_mechanism": "none"}
    assert container.rank_env("charliecloud", {})["USER"]
    assert container.rank_env("pyxis", {}) == {}


def test_the_ranks_run_the_images_python():
    options = LaunchOptions(program="hvdtrain.cnn", program_args=("--epochs", "2"),
                            via="srun", container="/work/img.sqfs")
    assert program_command(options) == ["python", "-m", "hvdtrain.cnn", "--epochs", "2"]
    assert program_command(LaunchOptions(program="hvdtrain.cnn"))[0] == sys.executable


def test_srun_starts_every_rank_in_ch_run(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    options = LaunchOptions(program="hvdtrain.cnn", via="srun", container="/work/img.sqfs",
                            container_runtime="charliecloud")
    allocation = Allocation.from_env({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]",
                                      "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4"})
    launch = build_launch(options, allocation, gpus=0)
    assert list(launch.argv) == [
        "srun", "--mpi=pmix", "--ntasks=4", "--kill-on-bad-exit=1", *MOUNT_POINT_FIRST, "ch-run",
        "--set-env", "--bind=/tmp", f"--cd={tmp_path}", "/work/img.sqfs", "--", "python", "-m",
        "hvdtrain.cnn"]
    assert launch.env["PMIX_MCA_gds"] == "hash"


def test_a_container_needs_srun():
    with pytest.raises(UserError, match="--container needs --via srun"):
        check_options(LaunchOptions(program="hvdtrain.cnn", via="mpirun",
                                    container="/work/img.sqfs"), None)


@integration
def test_an_oci_archive_of_a_small_root_reads_back_with_its_digests(tmp_path):
    """containers/oci_archive.py writes what skopeo accepts: skopeo copy checks the digest of
    every blob and the manifest; the layer holds the root's files, links and modes."""
    if shutil.which("skopeo") is None:
        install = apt_install("skopeo")
        if install.returncode != 0:
            pytest.skip(f"skopeo is not installed and apt-get could not install it: "
                        f"{(install.stderr or install.stdout).strip().splitlines()[-1:]}")
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "hello").write_text("#!/bin/sh\necho hello\n")
    (root / "usr" / "bin" / "hello").chmod(0o755)
    (root / "etc").mkdir()
    (root / "etc" / "environment").write_text("PATH=/usr/bin\n")
    (root / "bin").symlink_to("usr/bin")
    archive = tmp_path / "image.oci.tar"
    subprocess.run([sys.executable, str(REPO / "containers" / "oci_archive.py"), str(root),
                    str(archive), "--env", "PATH=/usr/bin"], check=True, timeout=60)
    inspected = json.loads(subprocess.run(["skopeo", "inspect", f"oci-archive:{archive}"],
                                          capture_output=True, text=True, check=True,
                                          timeout=60).stdout)
    assert inspected["Env"] == ["PATH=/usr/bin"] and inspected["Os"] == "linux"
    copied = tmp_path / "copied"
    subprocess.run(["skopeo", "copy", "--quiet", f"oci-archive:{archive}", f"dir:{copied}"],
                   check=True, capture_output=True, timeout=60)
    layer = copied / inspected["Layers"][0].split(":")[1]
    with tarfile.open(layer) as tar:
        members = {member.name: member for member in tar.getmembers()}
    assert set(members) == {"bin", "etc", "etc/environment", "usr", "usr/bin", "usr/bin/hello"}
    assert members["bin"].issym() and members["bin"].linkname == "usr/bin"
    assert members["usr/bin/hello"].mode & 0o777 == 0o755
    assert not (tmp_path / "image.oci.tar.partial").exists()


@integration
def test_the_build_script_refuses_in_one_line_without_root_or_with_bad_formats(tmp_path):
    result = subprocess.run(["bash", str(REPO / "containers" / "build.sh"), "--formats", "zip",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert result.stderr.startswith("containers/build.sh: ")


SECRET = "s3cr3t-of-the-build-host"
#: A made-up build machine whose apt and pip settings hold SECRET (paths under HOST_ROOT).
BUILD_HOST = {
    "etc/apt/sources.list.d/debian.sources": (
        f"Types: deb\nURIs: https://alice:{SECRET}@mirror.example/debian\n"
        "Suites: bookworm bookworm-updates\nComponents: main\n"),
    "etc/apt/apt.conf.d/80proxy": f'Acquire::http::Proxy "http://bob:{SECRET}@proxy.example";\n',
    "etc/apt/auth.conf.d/mirror.conf": f"machine mirror.example login alice password {SECRET}\n",
    "etc/pip.conf": f"[global]\nindex-url = https://carol:{SECRET}@pypi.example/simple\n",
    "usr/local/share/ca-certificates/site.crt": "a site CA\n",
    "etc/resolv.conf": "nameserver 192.0.2.53\n",
}


def test_the_image_root_keeps_none_of_the_build_hosts_credentials(tmp_path):
    """The steps of containers/build.sh that put this machine's settings into the image root
    (scripts/debian-root.sh), on a made-up machine: apt's proxy password and login and pip's
    index tokens reach the root for the install, and none is left in what is packed. The whole
    build (debootstrap, TensorFlow and horovod installed in the root) takes many minutes and runs
    in tests/test_multinode.py; the steps that copy and remove are all of it that touches them."""
    host, home, root = tmp_path / "host", tmp_path / "home", tmp_path / "root"
    for path, text in {**BUILD_HOST, "../home/.config/pip/pip.conf": f"token = {SECRET}\n"}.items():
        (host / path).parent.mkdir(parents=True, exist_ok=True)
        (host / path).write_text(text)
    (root / "etc" / "apt").mkdir(parents=True)
    (root / "etc" / "apt" / "sources.list").write_text(f"deb https://alice:{SECRET}@m/ bookworm\n")
    script = ('set -euo pipefail; die() { echo "$*" >&2; exit 1; }; source "$0"; '
              'copy_host_access "$1"; grep -rl "$2" "$1" | sort >"$3"; '
              'remove_host_credentials "$1"')
    during = tmp_path / "during-install.txt"
    subprocess.run(["bash", "-c", script, str(REPO / "scripts" / "debian-root.sh"), str(root),
                    SECRET, str(during)], check=True, timeout=60,
                   env={"PATH": "/usr/bin:/bin", "HOME": str(home), "HOST_ROOT": str(host)})
    assert during.read_text().splitlines() == [str(root / path) for path in (
        "etc/apt/apt.conf.d/80proxy", "etc/apt/auth.conf.d/mirror.conf",
        "etc/apt/sources.list.d/debian.sources", "etc/pip.conf", "root/.config/pip/pip.conf")]
    left = subprocess.run(["grep", "-rl", SECRET, str(root)], capture_output=True, text=True)
    assert left.returncode == 1 and left.stdout == "", left.stdout
    # What the image needs to reach the archives stays: the mirror (without the login), the CAs.
    assert "URIs: https://mirror.example/debian\n" in \
        (root / "etc/apt/sources.list.d/debian.sources").read_text()
    assert (root / "usr/local/share/ca-certificates/site.crt").read_text() == "a site CA\n"
    # containers/build.sh removes them after the install, before it packs anything.
    build = (REPO / "containers" / "build.sh").read_text()
    removed = build.index('remove_host_credentials "$root"')
    assert build.index("bash scripts/install.sh") < removed < build.index('mksquashfs "$root"')
    assert removed < build.index('oci_archive.py" "$root"')
