"""A subclassed keras.Model through the public API, as a new user writes one (tests/test_any_model.py).

Its variables appear at its first call. The job runs through ``hvdtrain.run``; afterwards each rank
writes the weights it ended with, and the weights a fresh copy of the model gets from this rank's
seed, to ``$ANY_MODEL_WEIGHTS/{final,initial}-rank{K}.npz``, so the test can check that the ranks
started apart and ended identical. The Keras is the one hvdtrain selects (``HVDTRAIN_KERAS``).
"""
import os
import sys

import hvdtrain  # first: it selects the Keras

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

FEATURES, CLASSES, SAMPLES = 13, 3, 512


class WineNet(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.logits = keras.layers.Dense(CLASSES)

    def call(self, inputs, training=False):
        return self.logits(self.norm(self.hidden(inputs), training=training))


def datasets(shard: hvdtrain.Shard) -> hvdtrain.Datasets:
    rng = np.random.default_rng(shard.seed)
    features = rng.normal(size=(SAMPLES, FEATURES)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 0.5).astype(np.int64)
    data = tf.data.Dataset.from_tensor_slices((features, labels)).shard(shard.num_shards,
                                                                       shard.rank)
    return hvdtrain.Datasets(
        train=data.batch(shard.batch_size, drop_remainder=True),
        description=f"{SAMPLES} synthetic wine-like samples, {FEATURES} features")


MODELS = []


def build_model(data: hvdtrain.Datasets) -> keras.Model:
    MODELS.append(WineNet())
    return MODELS[-1]


TASK = hvdtrain.Task(
    build_model=build_model,
    loss=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=lambda: ["accuracy"],
    datasets=datasets,
)


def weights(model: keras.Model) -> dict:
    return {f"w{index}": np.asarray(value) for index, value in enumerate(model.get_weights())}


def main(argv: list[str]) -> int:
    """The job on ``argv``, then this rank's weights to ``$ANY_MODEL_WEIGHTS`` (when set)."""
    status = hvdtrain.run(TASK, argv, name="subclassed_task")
    out = os.environ.get("ANY_MODEL_WEIGHTS")
    if out and MODELS:
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        np.savez(os.path.join(out, f"final-rank{rank}.npz"), **weights(MODELS[-1]))
        # What this rank would have started from without rank 0's broadcast: hvdtrain seeds each
        # rank's initialisation with --seed + rank (default seed 0).
        keras.utils.set_random_seed(0 + rank)
        fresh = WineNet()
        fresh(np.zeros((1, FEATURES), np.float32))
        np.savez(os.path.join(out, f"initial-rank{rank}.npz"), **weights(fresh))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
