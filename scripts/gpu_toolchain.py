"""Before a GPU install downloads or compiles anything: can horovod's NCCL build succeed here?

``HVDTRAIN_TF_FLAVOR=gpu`` builds horovod 0.28.1 with ``HOROVOD_GPU_OPERATIONS=NCCL``, which
compiles CUDA code and links NCCL. The ``tensorflow[and-cuda]`` wheels bring CUDA's runtime and
``libnccl.so.2`` for TensorFlow, but not what that build needs from the machine:

* a CUDA 12 toolkit: ``nvcc`` (CMake's CUDA language) and ``libcudart_static.a`` (the CUDA
  runtime CMake links a CUDA target against by default);
* NCCL 2 for building: ``nccl.h`` and a library horovod's ``FindNCCL.cmake`` links,
  ``libnccl_static.a`` or the unversioned ``libnccl.so`` (with ``HOROVOD_NCCL_LINK=SHARED``);
  the nvidia-nccl-cu12 wheel ships only ``libnccl.so.2``.

Run by scripts/install.sh with the system Python (standard library only). Prints horovod's build
variables (``KEY=VALUE`` lines) and what it found, or one line per missing piece with the usual
fix; exit status 1 then. Nothing here has run on a machine with a GPU or a real CUDA toolkit:
it is tested with stand-ins (tests/test_install.py).
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
FIX = ("load the site's modules (module load cuda/12.x nccl), set HOROVOD_CUDA_HOME / "
       "HOROVOD_NCCL_HOME, or build in a container that has them (README, GPU machines)")


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
                f"{nvcc} is {said}; TensorFlow 2.18.1's GPU wheels are CUDA {CUDA_MAJOR}: {FIX}")
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


def main() -> int:
    toolchain = find_toolchain(os.environ)
    for problem in toolchain.problems:
        print(f"install: gpu: {problem}", file=sys.stderr)
    if toolchain.problems:
        return 1
    print(f"[install] gpu: {', '.join(toolchain.found)}", file=sys.stderr)
    for name, value in toolchain.build_env.items():
        print(f"{name}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
