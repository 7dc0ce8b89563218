"""Train each built-in Keras application for one step under the same ranks, in one job.

Usage: horovodrun -np 2 python tests/scripts/applications.py RUN_ROOT NAME [NAME ...]
Every NAME goes through hvdtrain.cnn's flags and training run (RUN_ROOT/NAME is its run
directory), one after the other: the ranks start and import TensorFlow once, not once per model.
Exits with the first failing run's status.
"""
import sys

import hvdtrain  # noqa: F401  (selects Keras 2 before TensorFlow loads)
import tensorflow as tf
from hvdtrain import train
from hvdtrain.cnn import PRESETS, PROGRAM, classifier
from hvdtrain.config import parse_config
from hvdtrain.runtime.horovod import HorovodRuntime


def main(run_root: str, names: list[str]) -> int:
    # Without Grappler's graph rewrites, TensorFlow's own optimisation of the traced step and
    # not what this checks: 153 s -> 110 s for this job alone on 2 cores (2026-11-27), with the
    # same results (the three losses matched to the last printed digit).
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    runtime = HorovodRuntime()
    for name in names:
        # The smallest input each accepts and one step of a few synthetic images, without a
        # validation pass: most of a run is building and tracing the network, which is the check.
        argv = ["--model", name, "--image-size", "32", "--data", "synthetic",
                "--synthetic-samples", "64", "--validation-fraction", "0", "--batch-size", "8",
                "--epochs", "1", "--steps-per-epoch", "1", "--bn-recompute-batches", "1",
                "--keep-checkpoints", "1", "--no-tensorboard", "--no-export",
                "--run-dir", f"{run_root}/{name}"]
        config = parse_config(argv, PRESETS, prog=PROGRAM, description=None)
        result = train.run(PROGRAM, config, runtime, classifier(config.model))
        runtime.print0(f"{name}: {train.summary(result)}")
        if result.exit_code:
            return result.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
