"""``hvdtrain gpu-check``: the acceptance run for a new GPU node (or cluster), in about ten minutes.

Run it where the jobs will run: on a GPU node (all its GPUs), or as the body of an sbatch script
on 1-2 nodes (the launcher takes the allocation's ranks). It checks, one row each, with pass,
FAIL or "not checked" and the cause:

* **build**: TensorFlow (CUDA, cuDNN, the compute capabilities it has code for), horovod's
  ``horovodrun --check-build`` (MPI, Gloo, NCCL), what horovod's GPU build needs;
* **driver and GPUs**: ``nvidia-smi``'s GPUs, driver and compute capabilities, held against that
  build (``hvdtrain.gpus.gpu_build_problems``);
* **health**: the launcher's health check on every rank: devices, the same product on every
  rank, the job's allreduce with its values checked, a group of tensors through horovod's fusion
  buffer, and the bus bandwidth;
* **jobs**: ``cnn --preset tiny`` on every rank, under Keras 3 (XLA on; XLA off; mixed_float16
  with fp16 allreduce and gradient accumulation, and steps_per_execution, both with Keras' own
  XLA choice) and Keras 2: each must finish with a finite loss and every rank holding the same
  weights; its samples/s.

It prints the table and writes ``gpu-check.json`` and ``gpu-check.md`` into ``--out``. Exit 2 when
a row failed. On a machine without GPUs it runs on CPU ranks and says what it could not check.
It has never run on a GPU (docs/install.md).
"""
from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Sequence

from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import EXIT_USAGE, UserError, first_line
from hvdtrain.flags import OneLineParser, ProseHelpFormatter
from hvdtrain.gpus import NVIDIA_SMI_QUERY, gpu_build_problems

PROGRAM = "hvdtrain.gpucheck"
#: The training variants every rank runs, in one job per Keras: (name, Keras, extra flags).
#: XLA on and off are explicit; the others take Keras' own choice (on where TensorFlow lists a
#: GPU, off on CPU), so the default job is one of the two.
VARIANTS = (("Keras 3, XLA on", "3", ("--jit-compile", "on")),
            ("Keras 3, XLA off", "3", ("--jit-compile", "off")),
            ("Keras 3, mixed_float16 + fp16 allreduce + accumulation", "3",
             ("--precision", "mixed_float16", "--fp16-allreduce", "--grad-accum-steps", "2")),
            ("Keras 3, steps_per_execution 4", "3", ("--steps-per-execution", "4")),
            ("Keras 2", "2", ()))
#: Each variant's own flags follow these.
JOB_FLAGS = ("--preset", "tiny", "--epochs", "2", "--steps-per-epoch", "8", "--no-tensorboard",
             "--no-export")
#: Seconds for one job of variants (TensorFlow's first PTX compile on a new GPU can take long).
JOB_SECONDS = 1800


@dataclass(frozen=True)
class Row:
    check: str
    result: str
    """'pass', 'FAIL' or 'not checked'."""
    detail: str


# --- the ranks' side: python -m hvdtrain.gpucheck --ranks OUT KERAS ----------------------------
def run_variants(out: str, keras: str) -> int:
    """Every rank: each variant of this Keras in turn, through hvdtrain.cnn's flags and training
    run; rank 0 writes ``OUT/jobs-kerasK.json`` (one result per variant)."""
    import hashlib

    import numpy as np

    from hvdtrain.training import train
    from hvdtrain.cnn import PRESETS, PROGRAM as CNN, classifier
    from hvdtrain.training.config import parse_config
    from hvdtrain.errors import as_one_line
    from hvdtrain.runtime.horovod import HorovodRuntime

    runtime = HorovodRuntime()
    results = {}
    for name, variant_keras, flags in VARIANTS:
        if variant_keras != keras:
            continue
        run_dir = os.path.join(out, "jobs", re.sub(r"[^a-z0-9]+", "-", name.lower()))
        config = parse_config([*JOB_FLAGS, *flags, "--run-dir", run_dir], PRESETS, prog=CNN,
                              description=None)
        try:
            result = train.run(CNN, config, runtime, classifier(config.model))
            weights = hashlib.sha256(b"".join(np.asarray(w).tobytes()
                                              for w in result.model.trainable_weights))
            hashes = runtime.allgather_object(weights.hexdigest())
            row = result.rows[-1] if result.rows else {}
            outcome = {"exit": result.exit_code, "ranks_identical": len(set(hashes)) == 1,
                       "loss": row.get("loss"), "samples_per_sec": row.get("samples_per_sec"),
                       "xla": bool(result.model.jit_compile)}
        except Exception as error:  # noqa: BLE001 - the row says it; the next variant runs
            outcome = {"error": as_one_line(error)}
        finally:
            import keras as keras_module

            keras_module.mixed_precision.set_global_policy("float32")
        results[name] = outcome
    if runtime.world.is_chief:
        with open(os.path.join(out, f"jobs-keras{keras}.json"), "w") as file:
            json.dump(results, file)
    return 0


def job_rows(results: dict) -> list[Row]:
    """One row per variant, from the ranks' results (pure)."""
    rows = []
    for name, variant_keras, _ in VARIANTS:
        outcome = results.get(variant_keras, {}).get(name)
        if outcome is None:
            cause = results.get(f"{variant_keras}-error", "the job wrote no result")
            rows.append(Row(f"job: {name}", "FAIL", cause))
        elif "error" in outcome:
            rows.append(Row(f"job: {name}", "FAIL", outcome["error"]))
        elif outcome["exit"] or not outcome["ranks_identical"] or outcome["loss"] is None \
                or outcome["loss"] != outcome["loss"]:
            why = (f"exit {outcome['exit']}" if outcome["exit"] else
                   "the ranks hold different weights" if not outcome["ranks_identical"]
                   else f"loss {outcome['loss']}")
            rows.append(Row(f"job: {name}", "FAIL", why))
        else:
            rows.append(Row(f"job: {name}", "pass",
                            f"{outcome['samples_per_sec']:.0f} samples/s, loss "
                            f"{outcome['loss']:.3f}, ranks identical"
                            + (", step compiled with XLA" if outcome["xla"] else "")))
    return rows


# --- the driver: every check in a child process ----------------------------------------------
def _run(argv: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **(env or {})})


def build_rows(python: str) -> tuple[list[Row], dict, list[str]]:
    """The build and the node: (rows, the probe's build answer, nvidia-smi's GPU lines)."""
    from hvdtrain.launch.probe import ask

    rows = []
    answers, stderr = ask(python, ["build"], timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    build = (answers or {}).get("build") or {"error": first_line(stderr) or "no answer"}
    # TensorFlow's build facts from the file tf.sysconfig.get_build_info() reads, as the probe
    # reads them (launch/probe.py): no second import of TensorFlow.
    info = _run([python, "-c", "import importlib.util, json, os; "
                 "from hvdtrain.launch.probe import tensorflow_build_info; "
                 "spec = importlib.util.find_spec('tensorflow'); "
                 "print(json.dumps(spec and tensorflow_build_info(os.path.dirname(spec.origin))))"],
                300)
    facts = json.loads(info.stdout.strip().splitlines()[-1]) if info.returncode == 0 else None
    tensorflow = {"version": build.get("tensorflow_version"), **facts} if facts else {}
    check = _run([os.path.join(os.path.dirname(python), "horovodrun"), "--check-build"], 300)
    built = checked_build(check.stdout)
    if build.get("error") or not tensorflow:
        rows.append(Row("build", "FAIL", build.get("error") or first_line(info.stderr)))
    else:
        cuda = (f"CUDA {tensorflow.get('cuda_version')}, cuDNN {tensorflow.get('cudnn_version')}, "
                f"code for {', '.join(tensorflow.get('cuda_compute_capabilities') or [])}"
                if tensorflow.get("is_cuda_build") else "a CPU build, no CUDA")
        record = build.get("gpu_build")
        needs = (f"; horovod's GPU build: CUDA {record.get('cuda')}, code for "
                 f"{', '.join(str(a) for a in record.get('architectures') or ['nvcc default'])}"
                 if record else "")
        rows.append(Row("build", "pass", f"TensorFlow {tensorflow['version']} ({cuda}); "
                        f"horovodrun --check-build: {built or 'nothing'}{needs}"))
    try:
        smi = _run(list(NVIDIA_SMI_QUERY), 60)
        gpus = smi.stdout.splitlines() if smi.returncode == 0 else []
    except (OSError, subprocess.TimeoutExpired):
        gpus = []
    if not gpus:
        rows.append(Row("driver and GPUs", "not checked", "no nvidia-smi answer: no NVIDIA GPU "
                        "or driver on this node"))
    else:
        problems = gpu_build_problems(build.get("gpu_build") or {}, gpus)
        listed = "; ".join(f"{count} x {line}" for line, count in
                           Counter(line.strip() for line in gpus).items())
        rows.append(Row("driver and GPUs", "FAIL" if problems else "pass",
                        "; ".join(problems) or listed))
        if build.get("gpus", 0) < len(gpus):
            rows.append(Row("TensorFlow sees the GPUs", "FAIL",
                            f"nvidia-smi lists {len(gpus)}, TensorFlow {build.get('gpus', 0)}"))
    return rows, build, gpus


def checked_build(output: str) -> str:
    """horovodrun --check-build's table in one line: 'controllers MPI, Gloo; tensor operations
    NCCL, MPI, Gloo' (what is marked [X] in each section)."""
    sections: dict[str, list[str]] = {}
    section = ""
    for line in output.splitlines():
        if line.strip().startswith("Available ") and line.strip().endswith(":"):
            section = line.strip().removeprefix("Available ").removesuffix(":").lower()
        elif line.strip().startswith("[X]"):
            sections.setdefault(section, []).append(line.strip()[3:].strip())
    return "; ".join(f"{name} {', '.join(marked)}" for name, marked in sections.items())


def launcher(python: str, np: int | None, *rest: str) -> list[str]:
    return [python, "-m", "hvdtrain.launch", "--python", python,
            *(["--np", str(np)] if np else []), *rest]


def health_row(python: str, np: int | None) -> Row:
    done = _run(launcher(python, np, "--health-check-only", "hvdtrain.cnn"), 2400)
    said = [line.split("hvdtrain.health: ", 1)[1] for line in
            (done.stdout + done.stderr).splitlines() if "hvdtrain.health: " in line]
    summary = next((line for line in said if line.startswith(("ok:", "FAILED:"))), None)
    if done.returncode == 0 and summary:
        return Row("health: devices, numbers, allreduce values, fused group", "pass",
                   summary.removeprefix("ok: "))
    lines = (done.stdout + done.stderr).strip().splitlines()
    cause = "; ".join(said) or (lines[-1] if lines else f"exit {done.returncode}, no output")
    return Row("health: devices, numbers, allreduce values, fused group", "FAIL", cause)


def jobs_results(python: str, np: int | None, out: str) -> dict:
    results = {}
    for keras in dict.fromkeys(variant_keras for _, variant_keras, _ in VARIANTS):
        done = _run(launcher(python, np, "--keras", keras, "hvdtrain.gpucheck", "--ranks", out,
                             keras), JOB_SECONDS)
        path = os.path.join(out, f"jobs-keras{keras}.json")
        if os.path.exists(path):
            with open(path) as file:
                results[keras] = json.load(file)
        else:
            lines = (done.stdout + done.stderr).strip().splitlines()
            results[f"{keras}-error"] = f"exit {done.returncode}: " + (lines[-1] if lines
                                                                         else "no output")
    return results


def markdown(rows: Sequence[Row], header: str) -> str:
    lines = [f"# {header}", "", "| check | result | detail |", "|---|---|---|"]
    lines += [f"| {row.check} | {row.result} | {row.detail.replace('|', '/')} |" for row in rows]
    return "\n".join(lines) + "\n"


def table(rows: Sequence[Row]) -> str:
    width = max(len(row.check) for row in rows)
    return "\n".join(f"{row.check:<{width}}  {row.result:<11}  {row.detail}" for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--ranks"] and len(argv) == 3:
        return run_variants(argv[1], argv[2])
    parser = OneLineParser(prog=usage_name(PROGRAM), description=__doc__,
                           formatter_class=ProseHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="directory for gpu-check.json and gpu-check.md and the jobs' run "
                             "directories (default: runs/gpu-check-DATE-TIME)")
    parser.add_argument("--np", type=int, default=None,
                        help="ranks (default: one per GPU this node shows, or the Slurm "
                             "allocation's tasks; 2 CPU ranks on a node without GPUs)")
    parser.add_argument("--python", default=sys.executable,
                        help="the ranks' Python (default: this one)")
    try:
        args = parser.parse_args(argv)
    except UserError as error:
        print(f"{error_name(PROGRAM)}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    started = datetime.datetime.now(datetime.timezone.utc)
    out = os.path.abspath(args.out or os.path.join(
        "runs", f"gpu-check-{started.strftime('%Y%m%d-%H%M%S')}"))
    if os.path.exists(out) and os.listdir(out):
        print(f"{error_name(PROGRAM)}: error: --out {out} is not empty; name a new directory",
              file=sys.stderr)
        return EXIT_USAGE
    os.makedirs(out, exist_ok=True)
    rows, build, gpus = build_rows(args.python)
    in_allocation = bool(os.environ.get("SLURM_JOB_ID"))
    np = args.np or (None if in_allocation else (len(gpus) or 2))
    where = ("the Slurm allocation's ranks" if np is None else
             f"{np} GPU rank(s)" if gpus else f"{np} CPU rank(s): no GPU here")
    print(f"{PROGRAM}: {socket.gethostname()}, {where}; this takes minutes", flush=True)
    rows.append(health_row(args.python, np))
    rows += job_rows(jobs_results(args.python, np, out))
    if not gpus:
        rows.append(Row("GPU kernels, NCCL, XLA on a GPU", "not checked",
                        "no GPU here: the jobs ran on CPU ranks"))
    header = (f"hvdtrain gpu-check, {started.strftime('%Y-%m-%d %H:%M')} UTC, "
              f"{socket.gethostname()}, {where}")
    with open(os.path.join(out, "gpu-check.json"), "w") as file:
        json.dump({"header": header, "rows": [asdict(row) for row in rows]}, file, indent=1)
    with open(os.path.join(out, "gpu-check.md"), "w") as file:
        file.write(markdown(rows, header))
    print(table(rows))
    failed = [row for row in rows if row.result == "FAIL"]
    print(f"{PROGRAM}: {'FAILED' if failed else 'ok'}: {len(rows) - len(failed)} of "
          f"{len(rows)} row(s) pass or were not checkable; {os.path.join(out, 'gpu-check.md')}")
    return 2 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
