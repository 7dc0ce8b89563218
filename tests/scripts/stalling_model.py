"""A model file (``--model stalling_model.py:build``) whose rank HVDTRAIN_TEST_STALL_RANK stops
answering at its HVDTRAIN_TEST_STALL_AFTER-th batch and never comes back, as a rank stuck
reading from a hung file system would: the other ranks wait for it in the gradients' allreduce.
The rest of the model is a plain softmax regression."""
import os
import time

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.launcher_env import launch_rank


class StallOnce(keras.layers.Layer):
    """Passes its input through; on the chosen rank, sleeps for good at the chosen batch."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.batches = 0
        self.stall = launch_rank() == int(os.environ["HVDTRAIN_TEST_STALL_RANK"])
        self.after = int(os.environ.get("HVDTRAIN_TEST_STALL_AFTER", "30"))

    def _count(self):
        self.batches += 1
        if self.stall and self.batches >= self.after:
            print(f"rank {launch_rank()}: stalling at batch {self.batches}", flush=True)
            time.sleep(3600)
        return np.float32(0)

    def call(self, inputs):
        # A Python call inside the compiled step: it runs once per batch, on this rank.
        zero = tf.py_function(self._count, [], tf.float32)
        zero.set_shape(())
        return inputs + zero


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    features = StallOnce()(keras.layers.Rescaling(1 / 255)(inputs))
    outputs = keras.layers.Dense(num_classes)(keras.layers.Flatten()(features))
    return keras.Model(inputs, outputs)
