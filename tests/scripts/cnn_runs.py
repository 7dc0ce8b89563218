"""Several ``hvdtrain.cnn`` runs in one job, so that the ranks start and import TensorFlow once.

Usage: horovodrun -np 2 python tests/scripts/cnn_runs.py [--no-grappler] FLAGS... [--then FLAGS...]
Each FLAGS is what ``python -m hvdtrain.cnn`` takes (with its own --run-dir); the runs go one after
the other through its flags and training run (``hvdtrain.training.train.run``) on one horovod
runtime, and each ends with one summary line. Exits with the first failing run's status.
"""
import sys

import hvdtrain  # noqa: F401  (selects the Keras before TensorFlow loads)
import tensorflow as tf
from hvdtrain.training import train
from hvdtrain.cnn import PRESETS, PROGRAM, classifier
from hvdtrain.training.config import parse_config
from hvdtrain.runtime.horovod import HorovodRuntime
from hvdtrain.scratch import use_rank_scratch


def main(argv: list[str]) -> int:
    if argv[:1] == ["--no-grappler"]:
        # Without Grappler's graph rewrites, TensorFlow's own optimisation of the traced step,
        # which a run that only checks that a network builds and trains does not need: 153 s ->
        # 110 s for the three Keras applications on 2 cores (2026-11-27), the same losses.
        tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
        argv = argv[1:]
    runs, current = [], []
    for arg in argv:
        if arg == "--then":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    # As hvdtrain.cnn's main does (hvdtrain.training.job.main): what the runs write to temporary
    # storage (a disk cache) goes to this process's own directory, removed however it ends.
    use_rank_scratch()
    runtime = HorovodRuntime()
    for flags in runs:
        config = parse_config(flags, PRESETS, prog=PROGRAM, description=None)
        result = train.run(PROGRAM, config, runtime, classifier(config.model))
        runtime.print0(f"{config.run_dir}: {train.summary(result)}")
        if result.exit_code:
            return result.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
