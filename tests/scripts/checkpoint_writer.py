"""Writes a good checkpoint, then a second large one (the fault test kills it mid-write).

Usage: python tests/scripts/checkpoint_writer.py RUN_DIR
Prints 'first saved <checksum>' once the first checkpoint is complete, then 'second saved'.
"""
import sys

import hvdtrain  # noqa: F401
import numpy as np
import tf_keras as keras

from hvdtrain.rundir import RunDir
from hvdtrain.training.checkpoint import Checkpoints


def main(run_dir: str) -> None:
    keras.utils.set_random_seed(0)
    # ~64 M parameters: with Adam's two slots ~770 MB per checkpoint, long enough to be caught
    # in the middle of writing.
    model = keras.Sequential([keras.Input((4000,)), keras.layers.Dense(16000)])
    model.compile(optimizer=keras.optimizers.Adam(), loss="mse")
    model.optimizer.build(model.trainable_variables)
    checkpoints = Checkpoints(RunDir(run_dir, is_chief=True), model, keep=3)
    checkpoints.save(resume_epoch=1)
    print("first saved", float(np.sum(model.layers[0].kernel.numpy(), dtype=np.float64)),
          flush=True)
    model.layers[0].kernel.assign_add(np.ones((4000, 16000), np.float32))
    checkpoints.save(resume_epoch=2)
    print("second saved", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
