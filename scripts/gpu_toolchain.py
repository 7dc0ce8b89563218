"""Where horovod's CUDA and NCCL build gets its compiler, headers and libraries.

``HVDTRAIN_TF_FLAVOR=gpu`` builds horovod 0.28.1 with ``HOROVOD_GPU_OPERATIONS=NCCL``, which
compiles one CUDA file and links NCCL. It needs a CUDA 12 toolkit (``nvcc``,
``libcudart_static.a``) and NCCL 2 (``nccl.h`` and ``libnccl_static.a`` or ``libnccl.so``).

1. ``gpu_toolchain.py`` (before anything is downloaded, with the system Python): a toolkit and
   NCCL the machine has (its modules, ``/usr/local/cuda``...) win; their build variables are
   printed as ``KEY=VALUE`` lines. Without them it prints ``HVDTRAIN_CUDA_FROM_WHEELS=1`` and
   says why on stderr.
2. ``gpu_toolchain.py --from-wheels DIR`` (with the venv's Python, after ``tensorflow[and-cuda]``
   is installed): assembles a toolkit in DIR from PyPI wheels alone and prints its variables.
   TensorFlow's own wheels give CUDA 12.9's runtime (``libcudart_static.a`` included) and
   headers, and NCCL (``nccl.h``, ``libnccl.so.2``: linked through a ``libnccl.so`` link, found
   at run time through an rpath into the venv). No Linux ``nvidia-cuda-nvcc-cu12`` wheel holds an
   ``nvcc`` (12.0 to 12.9: only ptxas, libnvvm and headers), so the device compiler is CUDA 13's
   (``nvidia-cuda-nvcc``, ``nvidia-nvvm``, ``nvidia-cuda-crt``, unpacked here, not installed),
   with its own ``crt/`` headers (its generated stubs need them) and every other header CUDA
   12.9's. Its device code needs an NVIDIA driver that runs CUDA 13 (R580 or newer).

Standard library only. The search and the assembly are tested with stand-ins
(tests/test_gpu_install.py); the assembly was compiled for real once (docs/stack.md). Nothing
here has run on a GPU.
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Mapping

#: Where a toolkit lives when no variable says: NVIDIA's runfile/deb default, then the distro's.
CUDA_HOMES = ("/usr/local/cuda", "/usr")
#: Where distro packages put headers and libraries (libnccl-dev, nvidia-cuda-toolkit).
SYSTEM_INCLUDE_DIRS = ("/usr/include", "/usr/local/include")
SYSTEM_LIB_DIRS = (f"/usr/lib/{platform.machine()}-linux-gnu", "/usr/lib64", "/usr/lib",
                   "/usr/local/lib")
CUDA_MAJOR = 12
#: The CUDA 13 wheels whose nvcc compiles horovod's CUDA file (docstring), and CUDA 12.9's
#: header-only CCCL (Thrust/CUB), which TensorFlow's wheels do not pull in.
CUDA_COMPILER_WHEELS = ("nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88",
                        "nvidia-cuda-crt==13.0.88", "nvidia-cuda-cccl-cu12==12.9.27")
#: Compute capabilities compiled: T4/Turing, A100/Ampere, H100/Hopper (PTX for newer); 7.5 is
#: the lowest CUDA 13 compiles for.
CUDA_ARCHITECTURES = "75,80,90"
FIX = ("load the site's modules (module load cuda/12.x nccl), set HOROVOD_CUDA_HOME / "
       "HOROVOD_NCCL_HOME, or build in a container that has them (docs/install.md, GPU machines)")


@dataclass
class Toolchain:
    """What was found: horovod's build variables, a summary, and the problems (none: buildable)."""

    build_env: dict[str, str] = field(default_factory=dict)
    found: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _dirs(environ: Mapping[str, str], *names: str) -> list[str]:
    """The directories named by these variables (colon-separated lists), in order, once each."""
    dirs = []
    for name in names:
        for path in environ.get(name, "").split(os.pathsep):
            if path and path not in dirs:
                dirs.append(path)
    return dirs


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    """(12, 4) from ``nvcc --version``'s "Cuda compilation tools, release 12.4, V12.4.131"."""
    try:
        said = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    release = re.search(r"release (\d+)\.(\d+)", said.stdout)
    return (int(release.group(1)), int(release.group(2))) if release else None


def nccl_version(header: str) -> str | None:
    """'2.21.5' from nccl.h's NCCL_MAJOR / NCCL_MINOR / NCCL_PATCH defines."""
    with open(header, errors="replace") as text:
        defines = dict(re.findall(r"^#define\s+NCCL_(MAJOR|MINOR|PATCH)\s+(\d+)", text.read(),
                                  re.MULTILINE))
    return ".".join(defines[part] for part in ("MAJOR", "MINOR", "PATCH")) if len(defines) == 3 \
        else None


def _first(dirs: list[str], name: str) -> str | None:
    return next((directory for directory in dirs
                 if os.path.exists(os.path.join(directory, name))), None)


def find_toolchain(environ: Mapping[str, str], cuda_homes: tuple[str, ...] = CUDA_HOMES,
                   include_dirs: tuple[str, ...] = SYSTEM_INCLUDE_DIRS,
                   lib_dirs: tuple[str, ...] = SYSTEM_LIB_DIRS) -> Toolchain:
    """Look where horovod's CMake would (its variables, then CUDA's, then the system's)."""
    toolchain = Toolchain()
    # CUDA: the toolkit whose bin/ has nvcc; horovod passes HOROVOD_CUDA_HOME to CMake.
    on_path = shutil.which("nvcc", path=environ.get("PATH", ""))
    homes = _dirs(environ, "HOROVOD_CUDA_HOME", "CUDA_HOME", "CUDA_PATH")
    homes += [os.path.dirname(os.path.dirname(os.path.realpath(on_path)))] if on_path else []
    homes += [home for home in cuda_homes if home not in homes]
    cuda_home = next((home for home in homes
                      if os.access(os.path.join(home, "bin", "nvcc"), os.X_OK)), None)
    if cuda_home is None:
        toolchain.problems.append(
            f"no nvcc (CUDA {CUDA_MAJOR} toolkit) on PATH, in HOROVOD_CUDA_HOME, CUDA_HOME or "
            f"{', '.join(cuda_homes)}: {FIX}")
    else:
        nvcc = os.path.join(cuda_home, "bin", "nvcc")
        release = nvcc_release(nvcc)
        if release is None or release[0] != CUDA_MAJOR:
            said = f"CUDA {release[0]}.{release[1]}" if release else "no version from --version"
            toolchain.problems.append(
                f"{nvcc} is {said}; TensorFlow's GPU wheels are CUDA {CUDA_MAJOR}: {FIX}")
        else:
            toolchain.build_env["HOROVOD_CUDA_HOME"] = cuda_home
            toolchain.found.append(f"CUDA {release[0]}.{release[1]} ({cuda_home})")
            arch = f"{platform.machine()}-linux"
            runtime_dirs = [os.path.join(cuda_home, sub) for sub in
                            ("lib64", "lib", f"targets/{arch}/lib")] + list(lib_dirs)
            if _first(runtime_dirs, "libcudart_static.a") is None:
                toolchain.problems.append(
                    f"the CUDA toolkit at {cuda_home} has no libcudart_static.a (looked in "
                    f"{', '.join(runtime_dirs[:3])}): a full toolkit has it; {FIX}")
    # NCCL: horovod's FindNCCL looks in HOROVOD_NCCL_INCLUDE / _LIB / _HOME, then the toolkit.
    nccl_homes = _dirs(environ, "HOROVOD_NCCL_HOME", "NCCL_HOME")
    toolkit = [cuda_home] if cuda_home else []
    headers = (_dirs(environ, "HOROVOD_NCCL_INCLUDE")
               + [os.path.join(home, "include") for home in nccl_homes + toolkit]
               + _dirs(environ, "CPATH") + list(include_dirs))
    libraries = (_dirs(environ, "HOROVOD_NCCL_LIB")
                 + [os.path.join(home, sub) for home in nccl_homes + toolkit
                    for sub in ("lib", "lib64")]
                 + _dirs(environ, "LIBRARY_PATH", "LD_LIBRARY_PATH") + list(lib_dirs))
    header_dir = _first(headers, "nccl.h")
    version = nccl_version(os.path.join(header_dir, "nccl.h")) if header_dir else None
    static_dir, shared_dir = _first(libraries, "libnccl_static.a"), _first(libraries, "libnccl.so")
    if header_dir is None:
        toolchain.problems.append(f"no nccl.h (NCCL headers) in HOROVOD_NCCL_INCLUDE, "
                                  f"HOROVOD_NCCL_HOME, the CUDA toolkit or {', '.join(include_dirs)}:"
                                  f" {FIX}")
    elif not version or not version.startswith("2."):
        toolchain.problems.append(f"{header_dir}/nccl.h is not NCCL 2 ({version or 'no version'})"
                                  f": {FIX}")
    if static_dir is None and shared_dir is None:
        only_runtime = _first(libraries, "libnccl.so.2")
        why = (f"{only_runtime} has only libnccl.so.2 (the runtime; the nvidia-nccl-cu12 wheel "
               "is the same): the build links libnccl_static.a or libnccl.so" if only_runtime
               else "no libnccl_static.a or libnccl.so in HOROVOD_NCCL_LIB, HOROVOD_NCCL_HOME, "
                    "the CUDA toolkit, LIBRARY_PATH, LD_LIBRARY_PATH or "
                    f"{', '.join(lib_dirs)}")
        toolchain.problems.append(f"{why}: {FIX}")
    if header_dir and version and version.startswith("2.") and (static_dir or shared_dir):
        link, library_dir = ("STATIC", static_dir) if static_dir else ("SHARED", shared_dir)
        toolchain.build_env.update(HOROVOD_NCCL_INCLUDE=header_dir, HOROVOD_NCCL_LIB=library_dir,
                                   HOROVOD_NCCL_LINK=link)
        toolchain.found.append(f"NCCL {version} ({header_dir}, {library_dir}, {link.lower()})")
    return toolchain


def from_wheels(site_packages: str, compiler: str, home: str) -> Toolchain:
    """A CUDA home in ``home`` (made) from the venv's nvidia wheels in ``site_packages`` and the
    unpacked CUDA 13 compiler wheels in ``compiler`` (their ``nvidia/cu13`` and
    ``nvidia/cuda_cccl``): links, except nvcc's bin/, which nvcc reads relative to its own real
    path."""
    toolchain = Toolchain()
    nvidia, cu13 = os.path.join(site_packages, "nvidia"), os.path.join(compiler, "nvidia", "cu13")
    needed = {"the CUDA runtime (nvidia-cuda-runtime-cu12)":
              os.path.join(nvidia, "cuda_runtime", "lib", "libcudart_static.a"),
              "NCCL's header (nvidia-nccl-cu12)": os.path.join(nvidia, "nccl", "include",
                                                              "nccl.h"),
              "NCCL's library (nvidia-nccl-cu12)": os.path.join(nvidia, "nccl", "lib",
                                                               "libnccl.so.2"),
              "nvcc (nvidia-cuda-nvcc 13)": os.path.join(cu13, "bin", "nvcc")}
    for what, path in needed.items():
        if not os.path.exists(path):
            toolchain.problems.append(f"{what} is missing: no {path} (tensorflow[and-cuda] "
                                      "installs the wheels of the first three)")
    if toolchain.problems:
        return toolchain
    cuda_home, nccl = os.path.join(home, "cuda"), os.path.join(home, "nccl")
    shutil.copytree(os.path.join(cu13, "bin"), os.path.join(cuda_home, "bin"),
                    copy_function=_link_or_copy)
    os.symlink(os.path.join(cu13, "nvvm"), os.path.join(cuda_home, "nvvm"))
    include = os.path.join(cuda_home, "include")
    os.makedirs(include)
    header_dirs = [os.path.join(nvidia, "cuda_runtime", "include"),
                   os.path.join(compiler, "nvidia", "cuda_cccl", "include"),
                   os.path.join(nvidia, "cuda_nvcc", "include")]
    for header_dir in filter(os.path.isdir, header_dirs):
        for name in os.listdir(header_dir):
            target = os.path.join(include, name)
            if name not in ("__init__.py", "__pycache__", "crt") and not os.path.lexists(target):
                os.symlink(os.path.join(header_dir, name), target)
    os.symlink(os.path.join(cu13, "include", "crt"), os.path.join(include, "crt"))
    lib64 = os.path.join(cuda_home, "lib64")
    os.makedirs(lib64)
    runtime_lib = os.path.join(nvidia, "cuda_runtime", "lib")
    for name in os.listdir(runtime_lib):
        if not name.startswith("__"):
            os.symlink(os.path.join(runtime_lib, name), os.path.join(lib64, name))
    if not os.path.lexists(os.path.join(lib64, "libcudart.so")):  # what CMake's CUDA::cudart is
        os.symlink("libcudart.so.12", os.path.join(lib64, "libcudart.so"))
    os.symlink("lib64", os.path.join(cuda_home, "lib"))
    os.makedirs(os.path.join(nccl, "lib"))
    os.symlink(os.path.join(nvidia, "nccl", "include"), os.path.join(nccl, "include"))
    os.symlink(os.path.join(nvidia, "nccl", "lib", "libnccl.so.2"),
               os.path.join(nccl, "lib", "libnccl.so"))
    release = nvcc_release(os.path.join(cuda_home, "bin", "nvcc"))
    toolchain.found.append(f"nvcc {'.'.join(map(str, release or ('?',)))} and CUDA 12's runtime, "
                           f"headers and NCCL from PyPI wheels ({home})")
    toolchain.build_env.update(
        HOROVOD_CUDA_HOME=cuda_home, CUDAToolkit_ROOT=cuda_home,
        HOROVOD_NCCL_INCLUDE=os.path.join(nccl, "include"),
        HOROVOD_NCCL_LIB=os.path.join(nccl, "lib"), HOROVOD_NCCL_LINK="SHARED",
        HOROVOD_BUILD_CUDA_CC_LIST=CUDA_ARCHITECTURES,
        # mpi_lib (site-packages/horovod/tensorflow/) finds the wheel's libnccl.so.2 at run time.
        LDFLAGS="-Wl,-rpath,$ORIGIN/../../nvidia/nccl/lib")
    return toolchain


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def download_compiler(directory: str) -> str:
    """The CUDA compiler wheels, downloaded with this Python's pip and unpacked in
    ``directory``: where ``from_wheels`` finds them."""
    import zipfile

    wheels = os.path.join(directory, "wheels")
    said = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet",
                           "download", "--no-deps", "-d", wheels, *CUDA_COMPILER_WHEELS],
                          stderr=subprocess.PIPE, text=True)
    # As install.sh's pip: a machine's non-existent extra indexes warn once per package.
    sys.stderr.writelines(line for line in said.stderr.splitlines(keepends=True)
                          if not re.match(r"WARNING: Location '.*' is ignored", line))
    said.check_returncode()
    unpacked = os.path.join(directory, "unpacked")
    for wheel in sorted(os.listdir(wheels)):
        with zipfile.ZipFile(os.path.join(wheels, wheel)) as archive:
            for member in archive.infolist():
                path = archive.extract(member, unpacked)
                mode = member.external_attr >> 16
                if mode:
                    os.chmod(path, mode & 0o777)
    return unpacked


def report(toolchain: Toolchain) -> int:
    for problem in toolchain.problems:
        print(f"install: gpu: {problem}", file=sys.stderr)
    if toolchain.problems:
        return 1
    print(f"[install] gpu: {', '.join(toolchain.found)}", file=sys.stderr)
    for name, value in toolchain.build_env.items():
        print(f"{name}={value}")
    return 0


def build_record(build_env: Mapping[str, str]) -> dict:
    """What a GPU build of horovod needs of a node, from its build variables: the CUDA release
    its device code was compiled with (which sets the oldest driver that runs it) and the
    compute capabilities it has code for (None: nvcc's default, not recorded). Installed beside
    horovod's TensorFlow extension as ``hvdtrain-gpu-build.json``; the launcher's preflight
    holds it against ``nvidia-smi`` (hvdtrain.gpus.gpu_build_problems)."""
    home = build_env.get("HOROVOD_CUDA_HOME") or build_env.get("CUDAToolkit_ROOT") or ""
    release = nvcc_release(os.path.join(home, "bin", "nvcc")) if home else None
    architectures = build_env.get("HOROVOD_BUILD_CUDA_CC_LIST")
    return {"cuda": f"{release[0]}.{release[1]}" if release else None,
            "architectures": [int(cc) for cc in architectures.split(",")] if architectures
            else None}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--record"] and len(argv) >= 2:  # --record OUT [VAR=VALUE ...]
        import json

        build_env = dict(arg.split("=", 1) for arg in argv[2:] if "=" in arg)
        with open(argv[1], "w") as out:
            json.dump(build_record(build_env), out)
        return 0
    if argv[:1] == ["--from-wheels"] and len(argv) == 2:
        import sysconfig

        try:
            compiler = download_compiler(argv[1])
        except subprocess.CalledProcessError:
            print("install: gpu: pip could not download the CUDA compiler wheels "
                  f"({', '.join(CUDA_COMPILER_WHEELS)})", file=sys.stderr)
            return 1
        return report(from_wheels(sysconfig.get_paths()["purelib"], compiler,
                                  os.path.join(argv[1], "home")))
    toolchain = find_toolchain(os.environ)
    if not toolchain.problems:
        return report(toolchain)
    # What the machine has is not enough: the wheels will do (step 2 of the docstring).
    reason = toolchain.problems[0].removesuffix(f": {FIX}")
    print(f"[install] gpu: no CUDA {CUDA_MAJOR} toolkit with NCCL here ({reason}); horovod's CUDA "
          "code will be compiled with PyPI's CUDA wheels", file=sys.stderr)
    print("HVDTRAIN_CUDA_FROM_WHEELS=1")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
