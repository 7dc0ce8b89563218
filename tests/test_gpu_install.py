"""The GPU install's toolchain (scripts/gpu_toolchain.py): a CUDA 12 toolkit and NCCL the machine
has, or else one assembled from PyPI's CUDA wheels.

No GPU, CUDA toolkit or NCCL exists on the machines these tests run on: the toolchain is made of
stand-ins (an ``nvcc`` script that answers ``--version`` as NVIDIA's does, empty library files,
an ``nccl.h`` with NCCL's version defines). What they test is the search and the verdict, not a
CUDA build. Pure tests: under ``mpirun -np 2 pytest`` both ranks run them alone.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env

SCRIPT = REPO / "scripts" / "gpu_toolchain.py"
_spec = importlib.util.spec_from_file_location("gpu_toolchain", SCRIPT)
gpu_toolchain = importlib.util.module_from_spec(_spec)
sys.modules["gpu_toolchain"] = gpu_toolchain  # its dataclass looks its module up
_spec.loader.exec_module(gpu_toolchain)


def fake_cuda(home: Path, release: str = "12.4", static_runtime: bool = True) -> Path:
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.131'\n")
    nvcc.chmod(0o755)
    (home / "lib64").mkdir()
    if static_runtime:
        (home / "lib64" / "libcudart_static.a").write_bytes(b"")
    return home


def fake_nccl(home: Path, libraries=("libnccl.so",), version=(2, 21, 5)) -> Path:
    (home / "include").mkdir(parents=True)
    (home / "include" / "nccl.h").write_text(
        "".join(f"#define NCCL_{part} {number}\n"
                for part, number in zip(("MAJOR", "MINOR", "PATCH"), version)))
    (home / "lib").mkdir()
    for library in libraries:
        (home / "lib" / library).write_bytes(b"")
    return home


def find(environ: dict[str, str]):
    """The search with no system directories: only what the test made is there."""
    return gpu_toolchain.find_toolchain({"PATH": "/bin", **environ}, cuda_homes=(),
                                        include_dirs=(), lib_dirs=())


def test_a_cuda_12_toolkit_on_path_and_nccl_by_its_variable_give_horovods_build_variables(
        tmp_path):
    cuda = fake_cuda(tmp_path / "cuda-12.4")
    nccl = fake_nccl(tmp_path / "nccl")
    found = find({"PATH": f"{cuda}/bin:/bin", "HOROVOD_NCCL_HOME": str(nccl)})
    assert found.problems == []
    assert found.build_env == {"HOROVOD_CUDA_HOME": str(cuda),
                               "HOROVOD_NCCL_INCLUDE": f"{nccl}/include",
                               "HOROVOD_NCCL_LIB": f"{nccl}/lib", "HOROVOD_NCCL_LINK": "SHARED"}
    assert found.found == [f"CUDA 12.4 ({cuda})",
                           f"NCCL 2.21.5 ({nccl}/include, {nccl}/lib, shared)"]


def test_nccl_inside_the_toolkit_and_its_static_library_are_preferred(tmp_path):
    cuda = fake_cuda(tmp_path / "cuda")
    fake_nccl(cuda, libraries=("libnccl.so", "libnccl_static.a")).joinpath("lib")
    found = find({"CUDA_HOME": str(cuda)})
    assert found.problems == []
    assert found.build_env["HOROVOD_NCCL_LINK"] == "STATIC"
    assert found.build_env["HOROVOD_NCCL_LIB"] == f"{cuda}/lib"


def test_nothing_installed_is_one_line_per_missing_piece_naming_the_fix(tmp_path):
    found = find({})
    assert len(found.problems) == 3, found.problems
    no_nvcc, no_header, no_library = found.problems
    assert no_nvcc.startswith("no nvcc (CUDA 12 toolkit) on PATH")
    assert no_header.startswith("no nccl.h (NCCL headers)")
    assert no_library.startswith("no libnccl_static.a or libnccl.so")
    assert all("module load cuda/12.x nccl" in line and "\n" not in line
               for line in found.problems)


@pytest.mark.parametrize("release", ["11.8", "13.0"])
def test_a_toolkit_that_is_not_cuda_12_is_refused_by_its_version(tmp_path, release):
    cuda = fake_cuda(tmp_path / "cuda", release=release)
    found = find({"HOROVOD_CUDA_HOME": str(cuda), "HOROVOD_NCCL_HOME":
                  str(fake_nccl(tmp_path / "nccl"))})
    assert found.problems == [f"{cuda}/bin/nvcc is CUDA {release}; TensorFlow's GPU wheels "
                              f"are CUDA 12: {gpu_toolchain.FIX}"]
    assert "HOROVOD_CUDA_HOME" not in found.build_env


def test_a_toolkit_without_its_static_runtime_is_refused(tmp_path):
    cuda = fake_cuda(tmp_path / "cuda", static_runtime=False)
    found = find({"CUDA_HOME": str(cuda), "NCCL_HOME": str(fake_nccl(tmp_path / "nccl"))})
    assert len(found.problems) == 1 and "has no libcudart_static.a" in found.problems[0]


def test_nccl_with_only_its_runtime_library_says_so(tmp_path):
    """What the nvidia-nccl-cu12 wheel (and a runtime-only libnccl2 package) has: not enough to
    link horovod against."""
    nccl = fake_nccl(tmp_path / "nccl", libraries=("libnccl.so.2",))
    found = find({"CUDA_HOME": str(fake_cuda(tmp_path / "cuda")), "HOROVOD_NCCL_HOME": str(nccl)})
    assert len(found.problems) == 1
    assert found.problems[0].startswith(f"{nccl}/lib has only libnccl.so.2")


def test_an_nccl_header_of_another_major_version_is_refused(tmp_path):
    nccl = fake_nccl(tmp_path / "nccl", version=(1, 3, 4))
    found = find({"CUDA_HOME": str(fake_cuda(tmp_path / "cuda")), "HOROVOD_NCCL_HOME": str(nccl)})
    assert found.problems == [f"{nccl}/include/nccl.h is not NCCL 2 (1.3.4): {gpu_toolchain.FIX}"]


def test_without_a_toolkit_install_sh_plans_the_cuda_wheels_and_changes_nothing(tmp_path):
    """The real search on this machine (no NCCL; a CUDA 13 toolkit on some): the GPU install
    goes on with PyPI's CUDA wheels instead of stopping, says why, and its plan touches
    nothing."""
    venv = tmp_path / "venv"
    # PYTHON: any 3.11 will do to reach the check (this one; a pyenv shim needs more of PATH).
    env = clean_env(HVDTRAIN_TF_FLAVOR="gpu", HVDTRAIN_VENV=str(venv), HVDTRAIN_INSTALL_PLAN="1",
                    HVDTRAIN_WHEEL_CACHE=str(tmp_path / "wheels"), PYTHON=sys.executable)
    expected = gpu_toolchain.find_toolchain(env).problems
    if not expected:
        pytest.skip("this machine has a CUDA 12 toolkit and NCCL: the wheels are not needed")
    result = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result
    reason = expected[0].removesuffix(f": {gpu_toolchain.FIX}")
    assert result.stderr.splitlines() == [
        f"[install] gpu: no CUDA 12 toolkit with NCCL here ({reason}); horovod's CUDA code will "
        "be compiled with PyPI's CUDA wheels"], result.stderr
    plan = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert plan["cuda"] == "PyPI wheels" and plan["tensorflow"] == "tensorflow[and-cuda]==2.21.0"
    assert not venv.exists() and not (tmp_path / "wheels").exists()


def fake_wheels(root: Path) -> tuple[Path, Path]:
    """The layout of the venv's nvidia wheels (tensorflow[and-cuda]) and of the unpacked CUDA 13
    compiler wheels, with empty files where binaries and libraries are."""
    site = root / "site-packages"
    for path in ("nvidia/cuda_runtime/include/cuda_runtime.h",
                 "nvidia/cuda_runtime/lib/libcudart_static.a",
                 "nvidia/cuda_runtime/lib/libcudart.so.12", "nvidia/cuda_runtime/__init__.py",
                 "nvidia/cuda_nvcc/include/fatbinary_section.h",
                 "nvidia/nccl/include/nccl.h", "nvidia/nccl/lib/libnccl.so.2"):
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_bytes(b"")
    compiler = root / "unpacked"
    for path in ("nvidia/cu13/bin/nvcc.profile", "nvidia/cu13/nvvm/bin/cicc",
                 "nvidia/cu13/include/crt/host_runtime.h",
                 "nvidia/cuda_cccl/include/cub/cub.cuh"):
        (compiler / path).parent.mkdir(parents=True, exist_ok=True)
        (compiler / path).write_bytes(b"")
    fake_cuda(compiler / "nvidia" / "cu13-nvcc", release="13.0")
    (compiler / "nvidia/cu13-nvcc/bin/nvcc").rename(compiler / "nvidia/cu13/bin/nvcc")
    return site, compiler


def test_a_cuda_home_is_assembled_from_the_wheels(tmp_path):
    site, compiler = fake_wheels(tmp_path)
    home = tmp_path / "home"
    found = gpu_toolchain.from_wheels(str(site), str(compiler), str(home))
    assert found.problems == []
    cuda, nccl = home / "cuda", home / "nccl"
    assert found.build_env == {
        "HOROVOD_CUDA_HOME": str(cuda), "CUDAToolkit_ROOT": str(cuda),
        "HOROVOD_NCCL_INCLUDE": f"{nccl}/include", "HOROVOD_NCCL_LIB": f"{nccl}/lib",
        "HOROVOD_NCCL_LINK": "SHARED", "HOROVOD_BUILD_CUDA_CC_LIST": "75,80,90",
        "LDFLAGS": "-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib"}
    # nvcc 13 and its crt/ headers; every other header, the runtime and NCCL are CUDA 12's.
    assert (cuda / "bin" / "nvcc").is_file() and not (cuda / "bin" / "nvcc").is_symlink()
    assert gpu_toolchain.nvcc_release(str(cuda / "bin" / "nvcc")) == (13, 0)
    assert (cuda / "include" / "crt").resolve() == compiler / "nvidia/cu13/include/crt"
    for header, wheel in (("cuda_runtime.h", site / "nvidia/cuda_runtime/include"),
                          ("cub", compiler / "nvidia/cuda_cccl/include"),
                          ("fatbinary_section.h", site / "nvidia/cuda_nvcc/include")):
        assert (cuda / "include" / header).resolve() == wheel / header
    assert not (cuda / "include" / "__init__.py").exists()
    assert (cuda / "lib64" / "libcudart_static.a").resolve() == \
        site / "nvidia/cuda_runtime/lib/libcudart_static.a"
    assert (cuda / "lib64" / "libcudart.so").resolve() == \
        site / "nvidia/cuda_runtime/lib/libcudart.so.12"
    assert (cuda / "nvvm" / "bin" / "cicc").exists()
    assert (nccl / "lib" / "libnccl.so").resolve() == site / "nvidia/nccl/lib/libnccl.so.2"
    assert (nccl / "include" / "nccl.h").exists()
    assert found.found[0].startswith("nvcc 13.0 and CUDA 12's runtime")


def test_a_missing_wheel_piece_is_one_line_each(tmp_path):
    site, compiler = fake_wheels(tmp_path)
    (site / "nvidia/cuda_runtime/lib/libcudart_static.a").unlink()
    (site / "nvidia/nccl/include/nccl.h").unlink()
    found = gpu_toolchain.from_wheels(str(site), str(compiler), str(tmp_path / "home"))
    assert [line.split(":")[0] for line in found.problems] == [
        "the CUDA runtime (nvidia-cuda-runtime-cu12) is missing",
        "NCCL's header (nvidia-nccl-cu12) is missing"]
    assert not (tmp_path / "home").exists()


def test_a_real_nvcc_s_version_is_read(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc on this machine (the stand-in's answer is tested above)")
    said = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    release = gpu_toolchain.nvcc_release(nvcc)
    assert release and f"release {release[0]}.{release[1]}," in said


def test_the_script_prints_horovods_build_variables_for_install_sh(tmp_path):
    cuda = fake_cuda(tmp_path / "cuda")
    nccl = fake_nccl(tmp_path / "nccl")
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60,
                            env={"PATH": f"{cuda}/bin:/usr/bin:/bin",
                                 "HOROVOD_NCCL_HOME": str(nccl)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"HOROVOD_CUDA_HOME={cuda}",
                                          f"HOROVOD_NCCL_INCLUDE={nccl}/include",
                                          f"HOROVOD_NCCL_LIB={nccl}/lib",
                                          "HOROVOD_NCCL_LINK=SHARED"]
    assert result.stderr.startswith("[install] gpu: CUDA 12.4")


def test_the_build_records_what_it_needs_of_a_node(tmp_path):
    """install.sh keeps gpu-build.json with the wheel and installs it beside horovod's extension;
    the launcher's preflight holds it against nvidia-smi (tests/test_gpus.py)."""
    cuda = fake_cuda(tmp_path / "cuda", release="13.0")
    out = tmp_path / "gpu-build.json"
    subprocess.run([sys.executable, str(SCRIPT), "--record", str(out),
                    f"HOROVOD_CUDA_HOME={cuda}", "HOROVOD_BUILD_CUDA_CC_LIST=75,80,90",
                    "LDFLAGS=-Wl,-rpath,$ORIGIN/x"], check=True, timeout=60)
    assert json.loads(out.read_text()) == {"cuda": "13.0", "architectures": [75, 80, 90]}
    # The node's own toolkit with nvcc's default architectures: the release alone.
    assert gpu_toolchain.build_record({"HOROVOD_CUDA_HOME": str(fake_cuda(tmp_path / "c12"))}) \
        == {"cuda": "12.4", "architectures": None}
