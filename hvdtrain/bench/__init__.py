"""Benchmarks: `python -m hvdtrain.bench <name> [options]` (`make bench` runs them all).

    matmul      the article's `w @ x + b` device timing on the backend's device
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from hvdtrain.errors import UserError, reported

PROGRAM = "hvdtrain.bench"


def _matmul(args) -> int:
    from hvdtrain.bench.matmul import describe, run_matmul
    from hvdtrain.runtime import make_runtime

    runtime = make_runtime(args.backend)
    result = run_matmul(runtime, batch=args.batch, repeats=args.repeats, warmup=args.warmup)
    runtime.print0(describe(result))
    if args.out and runtime.world.is_chief:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "matmul.json").write_text(json.dumps(result, indent=2) + "\n")
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
    args = parser.parse_args(argv)
    if getattr(args, "batch", 1) < 1 or getattr(args, "repeats", 1) < 1:
        raise UserError("--batch and --repeats must be at least 1")
    return args.handler(args)


def main(argv: Sequence[str] | None = None) -> None:
    with reported(PROGRAM):
        sys.exit(run(argv))
