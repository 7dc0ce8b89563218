"""GPUs the scheduler gave a process, and the one line when TensorFlow sees none of them.

A job that asked for GPUs and trains on the CPU runs 10-100x slower and says nothing (the CPU
TensorFlow wheel, or a node whose driver is missing, both show TensorFlow no GPU). So a rank whose
scheduler assigned GPUs but whose TensorFlow lists none stops (``runtime.base.configure_devices``),
and the launcher asks the same before it starts anything (``launch.preflight``). The launcher
also holds horovod's GPU build against the node's driver and GPUs (``gpu_build_problems``). Nothing
here imports TensorFlow: the launcher uses it too.
"""
from __future__ import annotations

import re
from typing import Mapping, Sequence

#: The opt-out, for the rare job that wants CPU ranks on a GPU node (or a test cluster whose
#: "GPUs" are plain files): HVDTRAIN_ALLOW_CPU=1.
ALLOW_CPU = "HVDTRAIN_ALLOW_CPU"

#: What Slurm sets when a job or step got GPUs (--gres=gpu:N, --gpus, --gpus-per-node/-task):
#: counts, where 0 (or "a100:0") is none...
_SLURM_GPU_COUNTS = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK",
                     "SLURM_GPUS")
#: ...and index lists, where "0" is GPU 0.
_SLURM_GPU_INDEXES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")
#: CUDA_VISIBLE_DEVICES entries that end the list of devices: CUDA stops at the first entry that
#: is not a device ("" and "-1" hide every GPU on purpose), and Slurm sets "NoDevFiles" on a
#: step that got no GPU.
_NOT_A_DEVICE = ("", "-1", "NoDevFiles")


def visible_devices(cuda_visible_devices: str) -> list[str]:
    """The devices a CUDA_VISIBLE_DEVICES value names, as CUDA reads it (up to the first entry
    that is not a device)."""
    devices = []
    for entry in cuda_visible_devices.split(","):
        if entry.strip() in _NOT_A_DEVICE:
            break
        devices.append(entry.strip())
    return devices


def gpu_of_its_own(cuda_visible_devices: str | None) -> bool:
    """Whether the scheduler gave this process one GPU of its own (srun --gpus-per-task or
    --gpu-bind: CUDA_VISIBLE_DEVICES names a single device)."""
    return cuda_visible_devices is not None and len(visible_devices(cuda_visible_devices)) == 1


def given_gpus(env: Mapping[str, str]) -> str | None:
    """The variable that says this process was given GPUs (``NAME=value``), or None.

    CUDA_VISIBLE_DEVICES decides when it is set: it is what CUDA obeys, and one that hides every
    GPU ("", "-1", "NoDevFiles") was set on purpose, by the user or by Slurm for a step without
    GPUs, while the job's own Slurm variables stay in the environment.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return f"CUDA_VISIBLE_DEVICES={visible}" if visible_devices(visible) else None
    for name in _SLURM_GPU_COUNTS:
        value = env.get(name, "").strip()
        if value and value not in ("0", "(null)") and not value.endswith(":0"):
            return f"{name}={value}"
    for name in _SLURM_GPU_INDEXES:
        value = env.get(name, "").strip()
        if value and value != "(null)":
            return f"{name}={value}"
    return None


def cpu_allowed(env: Mapping[str, str]) -> bool:
    return env.get(ALLOW_CPU) == "1"


def not_seen(given: str, tensorflow_version: str, built_with_cuda: bool) -> str:
    """The one line for a process given GPUs (``given``) whose TensorFlow sees none."""
    if not built_with_cuda:
        cause = (f"this TensorFlow {tensorflow_version} is a CPU-only build (tensorflow-cpu): "
                 "install the GPU flavor (HVDTRAIN_TF_FLAVOR=gpu make install, or pip install "
                 f"'tensorflow[and-cuda]=={tensorflow_version}')")
    else:
        cause = (f"TensorFlow {tensorflow_version} has CUDA but found no usable GPU: the NVIDIA "
                 "driver (libcuda.so.1) is missing or too old for it, or the devices are not "
                 "mounted into this container; check `nvidia-smi` on this node")
    return (f"GPUs were given ({given}) but TensorFlow sees none: {cause}; {ALLOW_CPU}=1 runs "
            "on the CPU anyway")


#: What a GPU build of horovod needs of a node, recorded beside its TensorFlow extension by
#: scripts/install.sh (scripts/gpu_toolchain.py's build_record): the CUDA release its device code
#: was compiled with and the compute capabilities it has code for.
GPU_BUILD_RECORD = "hvdtrain-gpu-build.json"
#: The oldest Linux driver branch that runs the code of each CUDA major release (NVIDIA's CUDA
#: compatibility table; within a major release, minor-version compatibility covers the rest).
_DRIVER_FOR_CUDA = {11: 450, 12: 525, 13: 580}
#: nvidia-smi's question for every GPU: one "name, driver, compute capability" line each.
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=name,driver_version,compute_cap",
                    "--format=csv,noheader")


def runs_on(architectures: Sequence[int], compute_capability: str) -> bool:
    """Whether code built for ``architectures`` (75, 80, 90: machine code for each, PTX for the
    last, as horovod's build makes it) runs on a GPU of ``compute_capability`` ("8.6"): machine
    code runs on its own major version at an equal or higher minor; PTX is compiled by the
    driver for any newer GPU."""
    major, _, minor = compute_capability.partition(".")
    capability = int(major) * 10 + int(minor or 0)
    return capability >= max(architectures) or any(
        arch // 10 == capability // 10 and arch <= capability for arch in architectures)


def gpu_build_problems(record: Mapping, gpus: Sequence[str]) -> list[str]:
    """Why horovod's GPU build (``record``) cannot run on these GPUs (``nvidia-smi``'s lines of
    ``NVIDIA_SMI_QUERY``), one line each; empty when it can or when nothing says otherwise.

    horovod 0.28.1 does not check its own kernel launches: a kernel that cannot run on this
    driver or GPU leaves stale memory in the fusion buffer for NCCL to average, without an error
    (docs/install.md). So this is asked before the start, not found in the loss."""
    problems = []
    rows = [[part.strip() for part in line.rsplit(",", 2)] for line in gpus if line.count(",") >= 2]
    cuda = record.get("cuda")
    needed = _DRIVER_FOR_CUDA.get(int(cuda.split(".")[0])) if cuda else None
    drivers = sorted({driver for _, driver, _ in rows})
    old = [driver for driver in drivers if needed and driver.split(".")[0].isdigit()
           and int(driver.split(".")[0]) < needed]
    if old:
        problems.append(f"the NVIDIA driver {', '.join(old)} is older than horovod's GPU build "
                        f"needs (CUDA {cuda}: driver {needed} or newer): update the driver, or "
                        "build horovod with this node's CUDA toolkit (docs/install.md)")
    architectures = record.get("architectures")
    if architectures:
        built = ", ".join(f"{arch // 10}.{arch % 10}" for arch in architectures)
        lacking = sorted({(name, capability) for name, _, capability in rows
                          if re.fullmatch(r"\d+\.\d+", capability)
                          and not runs_on(architectures, capability)})
        for name, capability in lacking:
            problems.append(f"{name} (compute capability {capability}) has no code in horovod's "
                            f"GPU build (built for {built}): its kernels would not run; build "
                            "horovod with HOROVOD_BUILD_CUDA_CC_LIST naming it, with a CUDA "
                            "toolkit that supports it (docs/install.md)")
    return problems
