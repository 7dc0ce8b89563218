"""hvdtrain on a stack it did not install (HVDTRAIN_STACK=existing): the rules on described stacks,
the check on this venv's real one, and install.sh on an interpreter with no TensorFlow at all.

Pure tests and child processes: under ``mpirun -np 2 pytest`` each rank runs them alone.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env
from hvdtrain.stack import Stack, describe, problems

STAMP = Path(sys.prefix) / ".hvdtrain-installed"

#: A stack like the one install.sh builds: nothing to say.
PINNED = Stack(python=(3, 11), tensorflow="2.21.0", tf_keras="2.21.0", keras="3.15.1",
               horovod="0.28.1", horovod_error=None, mpi=True, gloo=True, mpirun="/usr/bin/mpirun")


def test_the_pinned_stack_has_no_problem():
    assert problems(PINNED) == []
    assert describe(PINNED) == ("TensorFlow 2.21.0, Keras 3.15.1 + tf_keras 2.21.0, horovod 0.28.1 "
                                "(MPI + Gloo), 0 GPU(s)")


def test_another_tensorflow_with_its_own_tf_keras_runs_and_says_it_is_untested():
    container = dataclasses.replace(PINNED, python=(3, 12), tensorflow="2.17.0",
                                    tf_keras="2.17.0", nccl=True, gpus=8)
    assert problems(container) == []
    assert describe(container).endswith("(MPI + Gloo + NCCL), 8 GPU(s); hvdtrain's tests run on "
                                        "TensorFlow 2.18-2.21 only")


@pytest.mark.parametrize("change, expected", [
    ({"tensorflow": None}, "no TensorFlow in this environment"),
    ({"tensorflow": "2.15.1", "tf_keras": "2.15.0"}, "TensorFlow 2.15.1: hvdtrain needs 2.16"),
    ({"tf_keras": "2.18.0", "tensorflow": "2.17.0"},
     "tf_keras 2.18.0 beside TensorFlow 2.17.0: they must match: pip install --no-deps "
     "'tf_keras==2.17.*'"),
    ({"tf_keras": None, "keras": None}, "no Keras hvdtrain can use"),
    ({"horovod": None}, "no horovod in this environment: HOROVOD_WITH_TENSORFLOW=1 pip install"),
    ({"horovod_error": "NotFoundError: undefined symbol: _ZN10tensorflow8OpKernel"},
     "horovod 0.28.1 does not load with TensorFlow 2.21.0 (NotFoundError: undefined symbol"),
    ({"mpi": False, "gloo": False}, "horovod 0.28.1 has neither MPI nor Gloo"),
    ({"gloo": False, "mpirun": None}, "horovod has only MPI, and there is no mpirun on PATH"),
    ({"gpus": 4}, "4 GPU(s) here, but horovod was built without NCCL"),
    ({"missing": ("scikit-learn", "mpi4py")},
     "hvdtrain's own requirements are missing: pip install scikit-learn mpi4py"),
    ({"python": (3, 9)}, "Python 3.9: hvdtrain runs on 3.10-3.12"),
])
def test_each_problem_is_one_line_with_its_remedy(change, expected):
    found = problems(dataclasses.replace(PINNED, **change))
    assert len(found) == 1 and found[0].startswith(expected), found
    assert "\n" not in found[0]


def test_keras_3_alone_is_usable_and_a_tested_minor_is_not_flagged():
    keras_3_only = dataclasses.replace(PINNED, tf_keras=None)
    assert problems(keras_3_only) == []
    assert "Keras 3.15.1 (no tf_keras: no --keras 2)" in describe(keras_3_only)
    for tested in ("2.18.1", "2.19.1", "2.20.0"):
        assert "only" not in describe(dataclasses.replace(PINNED, tensorflow=tested)).split(")")[-1]


def test_the_check_on_this_venvs_real_stack():
    result = subprocess.run([sys.executable, "-m", "hvdtrain.stack"], capture_output=True,
                            text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stderr
    from importlib.metadata import version

    assert result.stdout.startswith(f"hvdtrain.stack: ok: TensorFlow {version('tensorflow-cpu')}, "
                                    f"Keras {version('keras')} + tf_keras {version('tf_keras')}, "
                                    "horovod 0.28.1 (MPI + Gloo"), result.stdout


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_install_sh_existing_installs_hvdtrain_alone_and_names_what_the_stack_lacks(tmp_path):
    """A Python with no TensorFlow, horovod or numpy (a new venv of this interpreter's base):
    hvdtrain is installed into it, nothing else, and the check says what is missing."""
    base = getattr(sys, "_base_executable", sys.executable)
    stack = tmp_path / "stack"
    subprocess.run([base, "-m", "venv", str(stack)], check=True, timeout=120)
    result = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True,
                            text=True, timeout=240,
                            env=clean_env(HVDTRAIN_STACK="existing",
                                          PYTHON=str(stack / "bin" / "python")))
    assert result.returncode == 2, result
    assert result.stdout.startswith(f"[install] installing hvdtrain alone into {stack} "), result
    # The check's line alone: not setuptools' editable-install notice.
    assert result.stderr.splitlines() == [
        line for line in result.stderr.splitlines() if line.startswith("hvdtrain.stack: ")], \
        result.stderr
    assert result.stderr.splitlines()[-1].startswith(
        "hvdtrain.stack: no TensorFlow in this environment"), result.stderr
    listed = subprocess.run([stack / "bin" / "python", "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, timeout=60).stdout
    installed = {line.split("==")[0].lower() for line in listed.splitlines()}
    assert "hvdtrain" in installed and not installed & {"tensorflow", "tf-keras", "numpy"}


def test_an_unknown_stack_mode_is_one_line():
    result = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True,
                            text=True, timeout=60, env=clean_env(HVDTRAIN_STACK="ngc"))
    assert result.returncode == 1
    assert result.stderr == "install: HVDTRAIN_STACK must be pinned or existing, got 'ngc'\n"


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_install_sh_existing_builds_horovod_against_a_stack_that_has_tensorflow_alone(tmp_path):
    """A Python whose environment has this venv's TensorFlow, Keras and the rest, but no horovod
    (a TF 2.21 image someone else built): install.sh builds the patched horovod against that
    TensorFlow (from the wheel cache the venv's own install filled, same key) and installs it,
    and the check passes."""
    if "flavor=cpu" not in (STAMP.read_text() if STAMP.exists() else ""):
        pytest.skip(f"{sys.prefix} was not made by scripts/install.sh with tensorflow-cpu")
    base = getattr(sys, "_base_executable", sys.executable)
    stack, outer = tmp_path / "stack", tmp_path / "outer"
    subprocess.run([base, "-m", "venv", str(stack)], check=True, timeout=120)
    outer.mkdir()
    # Everything of this venv but horovod, hvdtrain and the venv's own pip and setuptools.
    left_out = re.compile(r"(horovod|hvdtrain|__editable__|pip|setuptools|pkg_resources|"
                          r"_distutils_hack|distutils-precedence)\b", re.I)
    site_packages = next(path for path in sys.path if path.endswith("site-packages"))
    for entry in Path(site_packages).iterdir():
        if not left_out.match(entry.name):
            (outer / entry.name).symlink_to(entry)
    [stack_site] = (stack / "lib").glob("python3.*/site-packages")
    (stack_site / "outer.pth").write_text(f"{outer}\n")
    result = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], capture_output=True,
                            text=True, timeout=540,
                            env=clean_env(HVDTRAIN_STACK="existing",
                                          PYTHON=str(stack / "bin" / "python")))
    assert result.returncode == 0, result.stdout + result.stderr
    tensorflow = importlib.metadata.version("tensorflow-cpu")  # make test-stack runs others
    assert "horovod wheel" in result.stdout and f"hvdtrain.stack: ok: TensorFlow {tensorflow}" \
        in result.stdout, result.stdout
    built = subprocess.run([stack / "bin" / "python", "-c",
                            "import horovod; print(horovod.__file__)"],
                           capture_output=True, text=True, timeout=120)
    assert built.stdout.startswith(str(stack_site)), built
