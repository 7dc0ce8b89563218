"""How hvdtrain installs: package metadata, the Makefile's venv, the CPU TensorFlow wheel.

Pure tests: nothing collective, so under `mpirun -np 2 pytest` both ranks simply run them.
"""
from __future__ import annotations

import configparser
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from conftest import REPO, clean_env

SETUP_CFG = configparser.ConfigParser()
SETUP_CFG.read(REPO / "setup.cfg")
PYTHON_REQUIRES = SpecifierSet(SETUP_CFG["options"]["python_requires"])
INSTALL_REQUIRES = [Requirement(line) for line in
                    SETUP_CFG["options"]["install_requires"].strip().splitlines()]
STAMP = Path(sys.prefix) / ".hvdtrain-installed"


def interpreter(minor: str) -> str | None:
    """A working Python `minor` (e.g. "3.10") on PATH or under pyenv, if this machine has one."""
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which(f"python{minor}"),
                  *sorted(glob.glob(f"{pyenv_root}/versions/{minor}.*/bin/python"))]
    for candidate in filter(None, candidates):
        # pyenv's shims are on PATH for every version but run only the selected ones.
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=30)
        if probe.returncode == 0 and probe.stdout.strip() == minor:
            return candidate
    return None


@pytest.mark.parametrize("minor", ["3.10", "3.11", "3.12"])
def test_metadata_admits_the_pythons_of_tpu_vms_and_colab(minor):
    # TPU VM images and Colab run these, and their path needs no horovod (only install.sh pins 3.11).
    assert PYTHON_REQUIRES.contains(f"{minor}.0") and PYTHON_REQUIRES.contains(f"{minor}.9"), (
        f"python_requires {PYTHON_REQUIRES} refuses Python {minor}")


@pytest.mark.parametrize("minor", ["3.8", "3.9", "3.10", "3.11", "3.12", "3.13"])
def test_every_admitted_python_imports_the_package(minor):
    if not PYTHON_REQUIRES.contains(f"{minor}.0"):
        pytest.skip(f"python_requires {PYTHON_REQUIRES} does not admit {minor}")
    python = interpreter(minor)
    if python is None:
        pytest.skip(f"no Python {minor} on this machine")
    # The modules that need neither TensorFlow nor numpy: what a wrong floor breaks first.
    result = subprocess.run(
        [python, "-c", "import hvdtrain, hvdtrain.training.config, hvdtrain.training.plan, hvdtrain.slurm, "
                       "hvdtrain.launch.__main__, hvdtrain.errors"],
        capture_output=True, text=True, timeout=60,
        env={**clean_env(), "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert result.returncode == 0, (
        f"python_requires {PYTHON_REQUIRES} admits {minor}, but importing hvdtrain with "
        f"{python} fails:\n{result.stderr[-1500:]}")


def test_horovod_stays_out_of_install_requires():
    # horovod (and mpi4py, used only beside it) would make `pip install -e .` build or need MPI
    # on TPU VMs and Colab, which have neither; install.sh compiles horovod for the MPI path.
    names = {requirement.name.lower().replace("_", "-") for requirement in INSTALL_REQUIRES}
    assert not names & {"horovod", "mpi4py"}, sorted(names)


def make_dry_run(target: str, *make_args: str, env_venv: str | None = None) -> list[str]:
    """The commands `make -n TARGET` would run, as a user's shell would start it."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    # As a user's shell would: no parent make's flags (clean_env), no venv chosen.
    env = {k: v for k, v in clean_env().items() if k not in ("VENV", "HVDTRAIN_VENV")}
    if env_venv is not None:
        env["HVDTRAIN_VENV"] = env_venv
    result = subprocess.run(["make", "-n", "-C", str(REPO), "--no-print-directory", target,
                             *make_args], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def venv_install_sh_uses(commands: list[str], env_venv: str | None) -> str:
    """The venv scripts/install.sh would install into, from the command make runs it with."""
    [line] = [line for line in commands if "scripts/install.sh" in line]
    words = shlex.split(line)
    assignments = dict(word.split("=", 1) for word in words[:words.index("bash")])
    # install.sh: HVDTRAIN_VENV from its environment, else .venv in the repository.
    return assignments.get("HVDTRAIN_VENV", env_venv or ".venv")


@pytest.mark.parametrize("chosen_by", ["make VENV=", "HVDTRAIN_VENV="])
def test_make_and_install_sh_use_the_same_venv(tmp_path, chosen_by):
    venv = str(tmp_path / "venv")  # no stamp there yet, so `make train` installs first
    if chosen_by == "make VENV=":
        commands = make_dry_run("train", f"VENV={venv}")
        env_venv = None
    else:
        commands = make_dry_run("train", env_venv=venv)
        env_venv = venv
    assert venv_install_sh_uses(commands, env_venv) == venv, commands
    [train] = [line for line in commands if "hvdtrain.cnn" in line]
    assert f"{venv}/bin/horovodrun" in train and f"{venv}/bin/python" in train, train


def test_make_install_defaults_to_the_repository_venv():
    commands = make_dry_run("install")
    assert venv_install_sh_uses(commands, None) == ".venv", commands


def test_make_tests_lanes_run_every_test_file_once_and_keep_the_clusters_together():
    # `make test` runs two lanes at once (Makefile): the single-process pass must still run
    # every test file exactly once, the mpirun pass must follow, and every file that brings up
    # a test cluster must be in the cluster lane, whose files run in order (they share the
    # cluster and take it down).
    assert any("-j2 test-clusters test-local" in line for line in make_dry_run("test"))
    lanes = {}
    for lane in ("test-clusters", "test-local"):
        script = "\n".join(make_dry_run(lane)).replace("\\\n", " ")
        [command] = [line for line in script.splitlines() if " -m pytest " in line]
        lanes[lane] = shlex.split(command)
    clusters, local = lanes["test-clusters"], lanes["test-local"]
    cluster_files = {word for word in clusters if word.startswith("tests/test_")}
    ignored = {word.removeprefix("--ignore=") for word in local if word.startswith("--ignore=")}
    assert local.count("tests/") == 1 and "mpirun" not in local, local
    # The mpirun pass (all of tests/) runs once, after the cluster files.
    assert clusters.count("tests/") == 1 and "mpirun" in clusters, clusters
    assert clusters.index("tests/") > max(clusters.index(name) for name in cluster_files)
    every_file = {str(path.relative_to(REPO)) for path in (REPO / "tests").glob("test_*.py")}
    assert cluster_files == ignored and cluster_files < every_file, (cluster_files, ignored)
    using_a_cluster = {name for name in every_file if re.search(
        r"(cluster|slurm)-local\.sh|^from cluster_helpers ", (REPO / name).read_text(), re.M)}
    assert using_a_cluster and using_a_cluster <= cluster_files, using_a_cluster - cluster_files


def installed(distribution: str) -> bool:
    try:
        version(distribution)
        return True
    except PackageNotFoundError:
        return False


@pytest.mark.integration
def test_cpu_install_has_one_tensorflow_and_no_cuda_noise():
    if not STAMP.exists():
        pytest.skip(f"{sys.prefix} was not made by scripts/install.sh")
    # A stamp without a flavor line predates flavors in it: the default, cpu.
    facts = dict(line.split("=", 1) for line in STAMP.read_text().splitlines() if "=" in line)
    if facts.get("flavor", "cpu") != "cpu":
        pytest.skip(f"flavor {facts['flavor']}: the CUDA build is meant to be there")
    assert installed("tensorflow-cpu") and not installed("tensorflow"), (
        "a cpu install must have tensorflow-cpu and not tensorflow (both write the same files): "
        f"tensorflow-cpu {installed('tensorflow-cpu')}, tensorflow {installed('tensorflow')}")
    # Listing devices is where the CUDA build looks for drivers (cuInit) on every rank.
    result = subprocess.run(
        [sys.executable, "-c", "import hvdtrain, tensorflow as tf; "
                               "print(tf.config.list_physical_devices())"],
        capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 0, result.stderr[-1500:]
    noise = [line for line in result.stderr.splitlines()
             if re.search(r"cuda|cudnn|cufft|cublas|cuinit|GPU will not be used", line, re.I)]
    assert not noise, "\n".join(noise)


@pytest.mark.integration
@pytest.mark.parametrize("extra", ["mlflow", "cpu"])
def test_installing_an_extra_never_brings_another_tensorflow(tmp_path, extra):
    # tf_keras, or any requirement naming `tensorflow`, made pip install plain tensorflow over
    # tensorflow-cpu (both own tensorflow/; every rank then printed CUDA errors). A made venv that
    # sees this venv's packages (a .pth line) holds tensorflow-cpu as a user's would; --no-index:
    # a TensorFlow pip wanted to add would be "no matching distribution", not a 600 MB download.
    if not installed("tensorflow-cpu"):
        pytest.skip("this venv has no tensorflow-cpu")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([venv / "bin" / "python", "-c", "import site; "
                                "print(site.getsitepackages()[0])"], capture_output=True,
                               text=True, check=True, timeout=60).stdout.strip())
    (site / "outer.pth").write_text(
        "".join(path + "\n" for path in sys.path if path.endswith("site-packages")))
    result = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--no-index", "--no-build-isolation",
         "--disable-pip-version-check", "-e", f"{REPO}[{extra}]"],
        capture_output=True, text=True, timeout=300, env=clean_env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    present = subprocess.run(
        [venv / "bin" / "python", "-c", "import importlib.metadata as m\n"
         "for name in ('tensorflow', 'tensorflow-cpu', 'tensorflow-gpu', 'tf_keras', 'hvdtrain'):\n"
         "    try: print(name, m.version(name))\n"
         "    except m.PackageNotFoundError: pass"],
        capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert "tensorflow-cpu" in present and "hvdtrain" in present, present
    assert "tensorflow" not in present and "tensorflow-gpu" not in present, present


@pytest.mark.parametrize("gpu_machine, flavor", [(True, "gpu"), (False, "cpu")])
def test_install_picks_the_gpu_flavor_on_a_gpu_machine(tmp_path, gpu_machine, flavor):
    # nvidia-smi answering `-L` with a GPU is what a GPU node shows; this machine has none, so
    # a stand-in answers (what is tested is install.sh's choice, shown by its plan, not CUDA).
    # On the machine without one, sinfo answers as a login node's does in a cluster with GPU
    # partitions (one GRES line per partition).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if gpu_machine:
        (bin_dir / "nvidia-smi").write_text(
            "#!/bin/sh\necho 'GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5a1c)'\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    else:
        (bin_dir / "sinfo").write_text(
            "#!/bin/sh\n[ \"$*\" = '-h -o %G' ] || exit 1\n"
            "printf '(null)\\ngpu:a100:4(S:0-1)\\ngpu:h100:8\\n'\n")
        (bin_dir / "sinfo").chmod(0o755)
    env = {k: v for k, v in clean_env(HVDTRAIN_INSTALL_PLAN="1").items()
           if k != "HVDTRAIN_TF_FLAVOR"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    plan = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True,
                          text=True, timeout=60, env=env)
    assert plan.returncode == 0, plan.stderr
    facts = dict(line.split("=", 1) for line in plan.stdout.splitlines())
    assert facts["flavor"].startswith(flavor), facts
    assert facts["tensorflow"] == ("tensorflow[and-cuda]==2.21.0" if gpu_machine
                                   else "tensorflow-cpu==2.21.0"), facts
    if gpu_machine:
        assert "nvidia-smi" in facts["flavor"] and "HVDTRAIN_TF_FLAVOR=cpu" in facts["flavor"]
    else:
        assert ("but this Slurm cluster has GPU nodes (sinfo: gpu:a100:4,gpu:h100:8): for their "
                "jobs install with HVDTRAIN_TF_FLAVOR=gpu make install") in facts["flavor"], facts
    # An explicit flavor wins, and the wheel's cache key names TensorFlow and the patches.
    explicit = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True,
                              text=True, timeout=60, env={**env, "HVDTRAIN_TF_FLAVOR": "cpu",
                                                          "HVDTRAIN_TF_VERSION": "2.18.1"})
    facts = dict(line.split("=", 1) for line in explicit.stdout.splitlines())
    assert facts["flavor"].startswith("cpu") and facts["tensorflow"] == "tensorflow-cpu==2.18.1"
    assert re.search(r"horovod-0\.28\.1-patches-[0-9a-f]{12}_tensorflow-cpu-2\.18\.1_",
                     facts["horovod"]), facts
