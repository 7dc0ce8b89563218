"""Benchmarks: `python -m benchmarks <name> [options]` from the repository root (`make bench` runs
`all`). They live beside the package and are not installed with it; they measure hvdtrain as a user
runs it, and reach horovod only through hvdtrain's runtime.

    all         every comparison below, then results.json, results.md and plots in --out
    scaling     weak scaling np=2 vs np=1 (synthetic and embedded data); processes vs threads;
                two independent jobs (the machine's ceiling); a 4x larger per-worker batch
    overhead    what an idle horovod costs the compute next to it, with and without busy-polling
    tax         hvdtrain at np=1 against a plain tf_keras model.fit
    keras3      hvdtrain np=2 on Keras 3 (its own horovod integration) vs on Keras 2 (horovod's)
    xla         --jit-compile on vs off on Keras 3, np=1 and np=2 (the step split around the
                average)
    allreduce   horovod allreduce vs mpi4py (MPI controller) and over Gloo, 1-256 MiB
    mwms        hvdtrain np=2 vs MultiWorkerMirroredStrategy with 2 local workers
    input       real vs synthetic data step time; input pipeline alone vs the model
    workers     speedup against the number of workers (1, 2, 4)
    threads     the cores each thread of 2 horovod ranks, 2 independent jobs and 2 Gloo ranks use
    network     2 nodes of the local cluster, links limited to 1 Gbit/s and 100 Mbit/s: fp32,
                fp16 allreduce and a larger fusion buffer, against a step-time model (root only)
    data        image folders and TFRecords at 1k, 10k, 100k and 1.28 M files: listing, time to
                the first step and to the end of a 5-step epoch, memory per rank, steady samples/s
    decode      ImageNet-like JPEGs on one core: hvdtrain's augmented pipeline against a bare
                decode_jpeg loop (the ceiling) and keras.utils.image_dataset_from_directory
    resized     validation accuracy trained from shards converted at --max-resolution's default,
                against training from the original photos (same seeds, the same pixels judged)
    startup     seconds outside the epochs: horovodrun -np 2 true against mpirun, a tiny job
                through horovodrun and the launcher, a job's fixed costs against a hand-written
                horovod Keras recipe on the same folder
    matmul      the article's `w @ x + b` device timing on the backend's device

Variants are separate processes, interleaved, repeated (--repeats, default 5), first epochs and a
warm-up round dropped; see benchmarks/harness.py and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from hvdtrain.errors import UserError, first_line, reported
from hvdtrain.rundir import RunDir

PROGRAM = "benchmarks"


def _matmul(args) -> int:
    from benchmarks.matmul import describe, run_matmul
    from hvdtrain.runtime import make_runtime

    runtime = make_runtime(args.backend)
    result = run_matmul(runtime, batch=args.batch, repeats=args.repeats, warmup=args.warmup)
    runtime.print0(describe(result))
    if args.out:
        RunDir(args.out, is_chief=runtime.world.is_chief).write_json("matmul.json", result)
    return 0


SUITES = ("scaling", "overhead", "tax", "keras3", "xla", "allreduce", "mwms", "input", "workers", "threads",
          "network", "data", "decode", "resized", "startup")
#: Suites that write their own .json and .md (their tables are not rows of results.md).
SELF_WRITING = ("threads", "network", "data", "decode", "resized", "startup")


def _runners(quick: bool) -> dict:
    """name -> run(settings, workdir, out, log): what a suite adds to the report (its rows, the
    speedup curve, the allreduce calls); the SELF_WRITING suites write their own files."""
    from benchmarks import suite

    def rows(measure):
        return lambda settings, workdir, out, log: {"comparisons": measure(settings, workdir, log)}

    def allreduce(settings, workdir, out, log):
        rounds = suite.allreduce(settings, workdir, log)
        return {"allreduce_rounds": rounds, "comparisons": suite.allreduce_comparisons(rounds)}

    def workers(settings, workdir, out, log):
        return {"speedup": suite.speedup_vs_workers(settings, workdir, log)}

    def threads(settings, workdir, out, log):
        from benchmarks import threads as profile

        print(profile.markdown(profile.run(settings, out, log, quick=quick)))
        return {}

    def network(settings, workdir, out, log):
        from benchmarks import network as two_hosts

        result = two_hosts.run(settings, out, log)
        if result is not None:
            print(two_hosts.markdown(result))
        return {}

    def data(settings, workdir, out, log):
        from benchmarks import datascale

        print(datascale.markdown(datascale.run(settings, out, log, quick=quick)))
        return {}

    def decode(settings, workdir, out, log):
        from benchmarks import decode as pipelines

        print(pipelines.markdown(pipelines.run(settings, out, log, quick=quick)))
        return {}

    def resized(settings, workdir, out, log):
        from benchmarks import resized as accuracy

        print(accuracy.markdown(accuracy.run(settings, out, log, quick=quick)))
        return {}

    def startup(settings, workdir, out, log):
        from benchmarks import startup as fixed_costs

        print(fixed_costs.markdown(fixed_costs.run(settings, out, log, quick=quick)))
        return {}

    runners = {"scaling": rows(suite.weak_scaling), "overhead": rows(suite.horovod_overhead),
               "tax": rows(suite.framework_tax), "keras3": rows(suite.keras_3_path),
               "xla": rows(suite.xla_step),
               "allreduce": allreduce, "mwms": rows(suite.against_tf_distribute),
               "input": rows(suite.input_pipeline), "workers": workers, "threads": threads,
               "network": network, "data": data, "decode": decode,
               "resized": resized, "startup": startup}
    assert tuple(runners) == SUITES
    return runners


def _suite(args) -> int:
    import dataclasses
    import tempfile

    from benchmarks import report, suite

    settings = suite.QUICK if args.quick else suite.Settings()
    if args.repeats:
        settings = dataclasses.replace(settings, repeats=args.repeats)
    skipped = set(filter(None, (args.skip or "").split(",")))
    if skipped - set(SUITES):
        raise UserError(f"--skip: unknown comparison(s) {', '.join(sorted(skipped - set(SUITES)))}; "
                        f"choose from {', '.join(SUITES)}")
    names = tuple(n for n in SUITES if n not in skipped) if args.command == "all" \
        else (args.command,)
    out = Path(args.out)
    comparisons, speedup, allreduce_rounds = [], None, None

    def log(line: str) -> None:
        print(line, flush=True)

    runners = _runners(args.quick)
    failed = {}
    with tempfile.TemporaryDirectory(prefix="hvdtrain-bench-") as scratch:
        workdir = Path(scratch)
        for name in names:
            try:
                found = runners[name](settings, workdir, out, log)
            except suite.BenchmarkFailed as error:  # keep what the others measured
                failed[name] = str(error)
                log(f"{name} failed: {first_line(error)}")
                continue
            comparisons += found.get("comparisons", [])
            speedup = found.get("speedup", speedup)
            allreduce_rounds = found.get("allreduce_rounds", allreduce_rounds)
    if len(names) == 1 and names[0] in SELF_WRITING:
        if failed:
            raise UserError(f"the {names[0]} comparison failed: {first_line(failed[names[0]])}")
        return 0
    # The table as written, machine and all (machine() runs mpirun --version: once is enough).
    print(report.write(out, dataclasses.asdict(settings), comparisons, speedup, allreduce_rounds,
                       {"failed": failed}), end="")
    print(f"results in {out}/ (results.json, results.md, *.png)")
    if failed:
        raise UserError(f"{len(failed)} comparison(s) failed ({', '.join(failed)}); their "
                        f"commands' output is in {out}/results.json")
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROGRAM}", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    matmul = commands.add_parser("matmul", help="time w @ x + b on the selected device")
    matmul.add_argument("--batch", type=int, default=1024, help="leading dimension (default 1024)")
    matmul.add_argument("--repeats", type=int, default=10, help="timed runs (default 10)")
    matmul.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    matmul.add_argument("--backend", default="auto",
                        choices=("auto", "horovod", "tpu", "mirrored", "single"))
    matmul.add_argument("--out", help="directory for matmul.json")
    matmul.set_defaults(handler=_matmul)
    for name in ("all", *SUITES):
        command = commands.add_parser(name, help=f"run the {name} comparison(s)")
        command.add_argument("--out", default="bench-results",
                             help="results directory (default bench-results)")
        command.add_argument("--repeats", type=int, help="interleaved rounds (default 5)")
        command.add_argument("--quick", action="store_true",
                             help="tiny sizes and 1 round: checks the harness, measures nothing")
        if name == "all":
            command.add_argument("--skip", metavar="NAME[,NAME]",
                                 help="comparisons to leave out, e.g. network,data")
        else:
            command.set_defaults(skip=None)
        command.set_defaults(handler=_suite)
    args = parser.parse_args(argv)
    if getattr(args, "batch", 1) < 1 or (getattr(args, "repeats", 1) or 1) < 1:
        raise UserError("--batch and --repeats must be at least 1")
    return args.handler(args)


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))
