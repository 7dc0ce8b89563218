"""The comparisons of `python -m benchmarks all`, each a set of interleaved real runs.

Every training variant is a separate process started exactly as a user would start it
(`horovodrun -np N python -m hvdtrain.cnn ...`, the plain Keras script, two MultiWorkerMirrored
workers), so start-up and tracing are excluded only by dropping each run's first epoch.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.harness import Comparison, interleave
from hvdtrain.launcher_env import child_env

BIN = Path(sys.executable).parent
#: The repository root. The benchmarks live beside the package, not in it, so every command they
#: start finds ``benchmarks`` through PYTHONPATH (``_env``), whatever its working directory.
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Settings:
    repeats: int = 5
    warmup: int = 1
    """Whole rounds discarded before the repeats (file caches, CPU frequency)."""
    epochs: int = 4
    """Per run; the first is tracing and warm-up, the rest are measured."""
    steps_per_epoch: int = 40
    batch_size: int = 64
    """Per worker, the same in every variant."""
    image_size: int = 32
    allreduce_sizes_mb: tuple[float, ...] = (1, 4, 16, 64, 256)
    allreduce_rounds: int = 3
    allreduce_repeats: int = 5
    workers: tuple[int, ...] = (1, 2, 4)
    overhead_seconds: float = 8
    """How long each rank of the idle-horovod comparison computes."""
    timeout: float = 900


QUICK = Settings(repeats=1, warmup=0, epochs=2, steps_per_epoch=3, batch_size=8, image_size=8,
                 allreduce_sizes_mb=(0.25, 1), allreduce_rounds=1, allreduce_repeats=2,
                 workers=(1, 2), overhead_seconds=1, timeout=300)


def _env() -> dict[str, str]:
    env = child_env()  # a benchmark run from inside a job is a job of its own
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="3",
               # mpirun hands it to local ranks, horovodrun to every rank on every host.
               PYTHONPATH=os.pathsep.join(filter(None, (str(REPO), env.get("PYTHONPATH")))))
    return env


class BenchmarkFailed(RuntimeError):
    """A measured command failed; the message ends with its output."""


def _run(argv: list[str], timeout: float, *, what: str | None = None,
         env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run one measured command: (wall seconds, its stdout), or BenchmarkFailed."""
    what = what or " ".join(argv[:6]) + " ..."
    start = time.perf_counter()
    try:
        completed = subprocess.run(argv, env=env or _env(), capture_output=True, text=True,
                                   timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchmarkFailed(f"{what} did not finish in {timeout} s") from None
    if completed.returncode:
        raise BenchmarkFailed(f"{what} exited {completed.returncode}:\n"
                              f"{(completed.stdout + completed.stderr)[-3000:]}")
    return time.perf_counter() - start, completed.stdout


def _run_together(commands: list[tuple[list[str], dict[str, str]]], timeout: float,
                  what: str) -> float:
    """Start every (argv, env) at once and wait for all: wall seconds, or BenchmarkFailed.

    The first failure ends the wait, and whatever still runs is killed: the peers of a failed
    worker would otherwise wait for it until the timeout.
    """
    start = time.perf_counter()
    processes, outputs = [], []
    try:
        for argv, env in commands:
            output = tempfile.TemporaryFile(mode="w+")  # a file: a chatty process never blocks
            outputs.append(output)
            processes.append(subprocess.Popen(argv, env=env, stdout=output,
                                              stderr=subprocess.STDOUT))
        while True:
            codes = [process.poll() for process in processes]
            for code, output in zip(codes, outputs):
                if code:
                    output.seek(0)
                    raise BenchmarkFailed(f"{what}: a process exited {code}:\n"
                                          f"{output.read()[-3000:]}")
            if all(code == 0 for code in codes):
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                raise BenchmarkFailed(f"{what} did not finish in {timeout} s")
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for output in outputs:
            output.close()


def steady_state(rows: list[dict], wall_seconds: float) -> dict:
    """Medians over the epochs after the first (which includes tracing)."""
    steady = rows[1:] or rows
    return {
        "samples_per_sec": statistics.median(r["samples_per_sec"] for r in steady),
        "cpu_per_wall": statistics.median(r["cpu_seconds"] / r["epoch_seconds"] for r in steady),
        "first_epoch_samples_per_sec": rows[0]["samples_per_sec"],
        "loss": rows[-1]["loss"],
        "process_seconds": wall_seconds,
    }


def _training_args(s: Settings, data: str, data_dir: str | None = None) -> list[str]:
    # Image files decode to 1 channel like the embedded sets, so every variant is the same model.
    source = ["--data-dir", data_dir, "--channels", "1"] if data_dir else ["--data", data]
    return [*source, "--image-size", str(s.image_size), "--validation-fraction", "0",
            "--epochs", str(s.epochs), "--steps-per-epoch", str(s.steps_per_epoch),
            "--batch-size", str(s.batch_size), "--warmup-epochs", "0", "--lr-decay", "constant",
            "--no-tensorboard", "--no-export"]


def hvdtrain_run(s: Settings, workdir: Path, *, np: int, threads: int, data: str = "synthetic",
                 data_dir: str | None = None, keras: str = "2", backend: str = "auto",
                 extra: tuple[str, ...] = ()) -> dict:
    run_dir = Path(tempfile.mkdtemp(dir=workdir))
    wall, _ = _run([str(BIN / "horovodrun"), "-np", str(np), sys.executable, "-m",
                    "hvdtrain.cnn", *_training_args(s, data, data_dir), "--keras", keras,
                    "--backend", backend, "--threads-per-worker", str(threads),
                    "--run-dir", str(run_dir), *extra], s.timeout)
    return steady_state(json.loads((run_dir / "metrics.json").read_text()), wall)


def independent_pair_run(s: Settings, workdir: Path) -> dict:
    """Two single-process jobs at once, no horovod, no communication: this machine's ceiling."""
    run_dirs = [Path(tempfile.mkdtemp(dir=workdir)) for _ in range(2)]
    wall = _run_together([([sys.executable, "-m", "hvdtrain.cnn", "--backend", "single",
                            *_training_args(s, "synthetic"), "--threads-per-worker", "1",
                            "--run-dir", str(run_dir)], _env()) for run_dir in run_dirs],
                         s.timeout, "two independent single-process jobs")
    halves = [steady_state(json.loads((d / "metrics.json").read_text()), wall) for d in run_dirs]
    return {"samples_per_sec": sum(h["samples_per_sec"] for h in halves),
            "cpu_per_wall": sum(h["cpu_per_wall"] for h in halves), "process_seconds": wall}


def overhead_run(s: Settings, workdir: Path, mode: str) -> dict:
    """Steps/s of plain numpy work in 2 ranks next to an idle horovod (benchmarks.overhead)."""
    prefix = Path(tempfile.mkdtemp(dir=workdir)) / "overhead"
    _run(["mpirun", "-np", "2", "--bind-to", "none", sys.executable, "-m",
          "benchmarks.overhead", mode, "--seconds", f"{s.overhead_seconds:g}",
          "--json", str(prefix)], s.timeout)
    ranks = [json.loads(Path(f"{prefix}.{rank}").read_text()) for rank in (0, 1)]
    return {"steps_per_sec": sum(r["steps_per_sec"] for r in ranks),
            "cpu_per_wall": sum(r["cpu_per_wall"] for r in ranks)}


def _baseline_args(s: Settings, out: Path, data: str = "synthetic") -> list[str]:
    return ["--data", data, "--image-size", str(s.image_size), "--epochs", str(s.epochs),
            "--steps-per-epoch", str(s.steps_per_epoch), "--batch-size", str(s.batch_size),
            "--threads", "1", "--json", str(out)]


def _baseline_env() -> dict[str, str]:
    # The baselines are plain tf_keras programs that reuse hvdtrain's model and throughput
    # callback: their process selects Keras 2, so those build tf_keras objects too.
    return {**_env(), "HVDTRAIN_KERAS": "2"}


def plain_keras_run(s: Settings, workdir: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=workdir)) / "metrics.json"
    wall, _ = _run([sys.executable, "-m", "benchmarks.baselines", "plain",
                    *_baseline_args(s, out)], s.timeout, env=_baseline_env())
    return steady_state(json.loads(out.read_text()), wall)


def mwms_run(s: Settings, workdir: Path, data: str = "synthetic") -> dict:
    from benchmarks.baselines import worker_commands

    out = Path(tempfile.mkdtemp(dir=workdir)) / "metrics.json"
    wall = _run_together(worker_commands(2, _baseline_args(s, out, data), _baseline_env()),
                         s.timeout, "MultiWorkerMirroredStrategy workers")
    return steady_state(json.loads(out.read_text()), wall)


def pipeline_run(s: Settings, *, data: str = "digits", data_dir: str | None = None) -> dict:
    """Samples per second the input pipeline alone delivers (one process, one thread)."""
    code = (
        "import json, sys, time, hvdtrain\n"
        "from hvdtrain.training.config import ImageConfig\n"
        "from hvdtrain.data import list_data, build_pipelines\n"
        "from hvdtrain.data.cache import CacheChoice\n"
        "from hvdtrain.runtime import World, configure_devices\n"
        "configure_devices(World(), 1)\n"
        f"config = ImageConfig(data={data!r}, data_dir={data_dir!r}, "
        f"image_size={s.image_size}, validation_fraction=0.0, channels=1)\n"
        "listing = list_data(config)\n"
        f"train = build_pipelines(listing, World(), batch_size={s.batch_size}, "
        "validation_batch_size=0, seed=0, "
        "cache=CacheChoice('memory', 'the benchmark'), threads=1).train\n"
        f"steps = {s.epochs * s.steps_per_epoch}\n"
        "iterator = iter(train)\n"
        "for _ in range(steps): next(iterator)  # first pass: decode and fill the cache\n"
        "start = time.perf_counter()\n"
        "for _ in range(steps): next(iterator)\n"
        f"print(json.dumps({{'samples_per_sec': steps * {s.batch_size} / "
        "(time.perf_counter() - start)}))\n")
    _, stdout = _run([sys.executable, "-c", code], s.timeout, what="the input pipeline alone")
    return json.loads(stdout.strip().splitlines()[-1])


def make_image_folder(root: Path, image_size: int) -> Path:
    """The embedded digits as PNG files, one folder per class: real files to decode."""
    import numpy as np
    import tensorflow as tf

    from hvdtrain.data.embedded import load_embedded

    arrays = load_embedded("digits", image_size=image_size)
    for index, (image, label) in enumerate(zip(arrays.images, arrays.labels)):
        folder = root / arrays.class_names[label]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index:05d}.png").write_bytes(tf.io.encode_png(np.asarray(image)).numpy())
    return root


# --- the comparisons ------------------------------------------------------------------------------
def weak_scaling(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    big = dataclasses.replace(s, batch_size=s.batch_size * 4,
                              steps_per_epoch=max(3, s.steps_per_epoch // 4))
    log("weak scaling, synthetic: np=2 and np=1 x 1 thread, np=1 x 2 threads, two independent "
        f"single jobs, and np=2 / np=1 at {big.batch_size} per worker")
    runs = interleave({
        "np2 x 1 thread": lambda: hvdtrain_run(s, workdir, np=2, threads=1),
        "np1 x 1 thread": lambda: hvdtrain_run(s, workdir, np=1, threads=1),
        "np1 x 2 threads": lambda: hvdtrain_run(s, workdir, np=1, threads=2),
        "2 independent np1 jobs": lambda: independent_pair_run(s, workdir),
        f"np2, {big.batch_size}/worker": lambda: hvdtrain_run(big, workdir, np=2, threads=1),
        f"np1, {big.batch_size}/worker": lambda: hvdtrain_run(big, workdir, np=1, threads=1),
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    comparisons = [
        Comparison("weak scaling (synthetic)", "samples_per_sec", "samples/s", runs,
                   "np2 x 1 thread", "np1 x 1 thread", target=1.85,
                   note=f"{s.batch_size} per worker; efficiency = ratio / 2"),
        Comparison("processes vs threads (synthetic)", "samples_per_sec", "samples/s", runs,
                   "np2 x 1 thread", "np1 x 2 threads",
                   note="2 horovod ranks of 1 thread against 1 rank with 2 intra-op threads"),
        Comparison("machine ceiling (synthetic)", "samples_per_sec", "samples/s", runs,
                   "2 independent np1 jobs", "np1 x 1 thread",
                   note="two jobs that never communicate: the most 2 cores give"),
        Comparison(f"weak scaling at {big.batch_size}/worker (synthetic)", "samples_per_sec",
                   "samples/s", runs, f"np2, {big.batch_size}/worker",
                   f"np1, {big.batch_size}/worker", target=1.85,
                   note="4x the compute per allreduce"),
    ]
    log("weak scaling, embedded digits: np=2 vs np=1, 1 thread each")
    digits = interleave({
        "np2 x 1 thread": lambda: hvdtrain_run(s, workdir, np=2, threads=1, data="digits"),
        "np1 x 1 thread": lambda: hvdtrain_run(s, workdir, np=1, threads=1, data="digits"),
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    comparisons.append(Comparison(
        "weak scaling (embedded digits)", "samples_per_sec", "samples/s", digits,
        "np2 x 1 thread", "np1 x 1 thread", target=1.85,
        note=f"digits upscaled to {s.image_size}x{s.image_size}"))
    return comparisons


def horovod_overhead(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    log("idle horovod's cost to the compute next to it (numpy work in 2 ranks)")
    runs = interleave({mode: (lambda mode=mode: overhead_run(s, workdir, mode))
                       for mode in ("none", "horovod", "horovod-busy-poll")},
                      repeats=s.repeats, warmup=0, log=log)
    return [
        Comparison("idle horovod, hvdtrain defaults", "steps_per_sec", "steps/s", runs,
                   "horovod", "none", note="1.0 = free; MPI yields while waiting"),
        Comparison("idle horovod, OpenMPI busy-polling", "steps_per_sec", "steps/s", runs,
                   "horovod-busy-poll", "none", note="why hvdtrain sets mpi_yield_when_idle=1"),
    ]


def framework_tax(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    log("framework tax: hvdtrain at np=1 (its default, the single backend, and horovod forced) "
        "against a plain tf_keras model.fit")
    runs = interleave({
        "hvdtrain np=1": lambda: hvdtrain_run(s, workdir, np=1, threads=1),
        "hvdtrain np=1, horovod": lambda: hvdtrain_run(s, workdir, np=1, threads=1,
                                                       backend="horovod"),
        "plain tf_keras": lambda: plain_keras_run(s, workdir),
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    return [Comparison("framework tax", "samples_per_sec", "samples/s", runs, "hvdtrain np=1",
                       "plain tf_keras", target=0.97,
                       note="same model, data, batch, threads; hvdtrain also checkpoints"),
            # Why `--backend auto` runs the single backend when a launcher starts one rank.
            Comparison("horovod in a world of one", "samples_per_sec", "samples/s", runs,
                       "hvdtrain np=1, horovod", "plain tf_keras",
                       note="--backend horovod under horovodrun -np 1: its thread and "
                            "per-step allreduce")]


def keras_3_path(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    log("Keras 3: hvdtrain's own horovod integration vs horovod's Keras 2 API, np=2")
    runs = interleave({
        "Keras 3 np=2": lambda: hvdtrain_run(s, workdir, np=2, threads=1, keras="3"),
        "Keras 2 np=2": lambda: hvdtrain_run(s, workdir, np=2, threads=1, keras="2"),
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    return [Comparison("Keras 3 vs Keras 2 (np=2)", "samples_per_sec", "samples/s", runs,
                       "Keras 3 np=2", "Keras 2 np=2", target=0.95,
                       note="same model, synthetic data, batch, threads; --keras 3 vs --keras 2")]


def xla_step(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    log("XLA: --jit-compile on vs off, Keras 3, np=1 (Keras' whole step) and np=2 (split)")
    runs = interleave({
        f"XLA {jit} np={np}": (lambda jit=jit, np=np: hvdtrain_run(
            s, workdir, np=np, threads=2 // np, keras="3", extra=("--jit-compile", jit)))
        for np in (1, 2) for jit in ("on", "off")
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    return [Comparison(f"XLA on vs off (np={np})", "samples_per_sec", "samples/s", runs,
                       f"XLA on np={np}", f"XLA off np={np}",
                       note=("Keras 3 compiles the whole step" if np == 1 else
                             "the step compiled in two parts, horovod's average between") +
                            "; CPU, so 'auto' is off here; epochs after the first (which "
                            "holds XLA's compile)")
            for np in (1, 2)]


def against_tf_distribute(s: Settings, workdir: Path,
                          log: Callable[[str], None]) -> list[Comparison]:
    log("against tf.distribute: hvdtrain np=2 vs MultiWorkerMirroredStrategy, 2 workers, digits")
    # Real labels, so the loss row compares learning: on random labels both stay near ln(10).
    runs = interleave({
        "hvdtrain np=2": lambda: hvdtrain_run(s, workdir, np=2, threads=1, data="digits"),
        "MultiWorkerMirrored x2": lambda: mwms_run(s, workdir, data="digits"),
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    return [
        Comparison("vs MultiWorkerMirroredStrategy", "samples_per_sec", "samples/s", runs,
                   "hvdtrain np=2", "MultiWorkerMirrored x2", target=1.2,
                   note="same model, digits, per-worker batch, threads, scaled LR"),
        Comparison("loss after the same steps", "loss", "loss", runs, "hvdtrain np=2",
                   "MultiWorkerMirrored x2", note="ratio near 1: the same training"),
    ]


def input_pipeline(s: Settings, workdir: Path, log: Callable[[str], None]) -> list[Comparison]:
    folder = str(make_image_folder(workdir / "digits-png", s.image_size))
    log("input pipeline: the same job on synthetic data, embedded digits and PNG files")
    runs = interleave({
        "synthetic": lambda: hvdtrain_run(s, workdir, np=1, threads=1, data="synthetic"),
        "digits (memory)": lambda: hvdtrain_run(s, workdir, np=1, threads=1, data="digits"),
        "digits (PNG files)": lambda: hvdtrain_run(s, workdir, np=1, threads=1,
                                                   data_dir=folder),
    }, repeats=s.repeats, warmup=s.warmup, log=log)
    log("input pipeline alone: digits in memory and PNG files")
    pipeline = interleave({
        "pipeline: digits (memory)": lambda: pipeline_run(s, data="digits"),
        "pipeline: digits (PNG files)": lambda: pipeline_run(s, data_dir=folder),
    }, repeats=s.repeats, warmup=0, log=log)
    # Step time is batch / samples-per-second, so real/synthetic step time is the inverse
    # ratio of the throughputs.
    step_times = _with_step_time(runs, s.batch_size)
    comparisons = [
        Comparison("real-data step time / synthetic", "step_seconds", "s/step", step_times,
                   "digits (PNG files)", "synthetic", target=1.05, lower_is_better=True,
                   note="PNG files decoded in the first epoch, then cached"),
        Comparison("embedded-data step time / synthetic", "step_seconds", "s/step", step_times,
                   "digits (memory)", "synthetic", target=1.05, lower_is_better=True),
    ]
    consumption = {"model consumes": runs["digits (PNG files)"],
                   "pipeline delivers": pipeline["pipeline: digits (PNG files)"]}
    comparisons.append(Comparison("pipeline headroom (PNG files)", "samples_per_sec",
                                  "samples/s", consumption, "pipeline delivers",
                                  "model consumes",
                                  note="> 1: the input pipeline is not the bottleneck"))
    return comparisons


def _with_step_time(runs: dict[str, list[dict]], batch: int) -> dict[str, list[dict]]:
    return {name: [{**m, "step_seconds": batch / m["samples_per_sec"]} for m in values]
            for name, values in runs.items()}


def speedup_vs_workers(s: Settings, workdir: Path, log: Callable[[str], None]) -> dict:
    log(f"speedup vs workers: np in {list(s.workers)}, 1 thread each")
    runs = interleave({f"np={n}": (lambda n=n: hvdtrain_run(s, workdir, np=n, threads=1))
                       for n in s.workers}, repeats=s.repeats, warmup=s.warmup, log=log)
    base = statistics.median(m["samples_per_sec"] for m in runs[f"np={s.workers[0]}"])
    return {"runs": runs, "speedup": {
        n: statistics.median(m["samples_per_sec"] for m in runs[f"np={n}"]) / base
        for n in s.workers}}


def allreduce(s: Settings, workdir: Path, log: Callable[[str], None]) -> dict:
    """hvd.allreduce vs mpi4py in the same mpirun (MPI controller), and horovod over Gloo."""
    sizes = ",".join(f"{size:g}" for size in s.allreduce_sizes_mb)
    worker = [sys.executable, "-m", "benchmarks.allreduce", "--sizes-mb", sizes,
              "--repeats", str(s.allreduce_repeats)]

    launchers = {"mpi": ["mpirun", "-np", "2", "--bind-to", "none"],
                 "gloo": [str(BIN / "horovodrun"), "--gloo", "-np", "2"]}

    def measured(controller: str) -> dict:
        out = Path(tempfile.mkdtemp(dir=workdir)) / "allreduce.json"
        _run([*launchers[controller], *worker, "--json", str(out)], s.timeout)
        return json.loads(out.read_text())

    log(f"allreduce: sizes {sizes} MiB, MPI and Gloo controllers, interleaved")
    rounds = {"mpi": [], "gloo": []}
    for round_index in range(s.allreduce_rounds):
        for name in list(launchers)[:: 1 if round_index % 2 == 0 else -1]:
            rounds[name].append(measured(name))
            log(f"  round {round_index + 1}: {name} done")
    return rounds


def allreduce_comparisons(rounds: dict) -> list[Comparison]:
    """Per size: every timed call of every round, as GB/s."""
    comparisons = []
    for size in rounds["mpi"][0]["sizes"]:
        def calls(controller: str, kind: str) -> list[dict]:
            return [{"gb_per_second": float(size) * 2**20 / seconds / 1e9}
                    for result in rounds[controller]
                    for seconds in result["sizes"][size][kind]["seconds"]]

        measurements = {"horovod (MPI)": calls("mpi", "horovod"),
                        "horovod fp16 (MPI)": calls("mpi", "horovod_fp16"),
                        "mpi4py": calls("mpi", "mpi4py"),
                        "horovod (Gloo)": calls("gloo", "horovod"),
                        "horovod fp16 (Gloo)": calls("gloo", "horovod_fp16")}
        target = 0.9 if float(size) >= 16 else None
        comparisons.append(Comparison(f"allreduce {float(size):g} MiB", "gb_per_second", "GB/s",
                                      measurements, "horovod (MPI)", "mpi4py", target=target,
                                      note="fp32, 2 ranks; target applies at 16-256 MiB"))
    return comparisons
