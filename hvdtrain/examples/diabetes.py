"""Regression through hvdtrain's API: disease progression from scikit-learn's diabetes set.

The 442 patients ship inside scikit-learn (no download). Run it like any hvdtrain job:

    horovodrun -np 2 python examples/diabetes.py --epochs 60
    sbatch slurm/cpu.sh   with HVDTRAIN_MODULE=examples/diabetes.py

and it gets hvdtrain's flags (--help), banner, run directory, checkpoints, resume and preemption.
"""
import hvdtrain  # first: it selects the Keras (Keras 3; tf_keras with HVDTRAIN_KERAS=2)

import keras  # noqa: E402  (the Keras hvdtrain selected)
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from sklearn.datasets import load_diabetes  # noqa: E402

VALIDATION_PATIENTS = 88


def datasets(shard: hvdtrain.Shard) -> hvdtrain.Datasets:
    features, progression = load_diabetes(return_X_y=True)
    features = features.astype(np.float32)
    # The same split on every rank: a permutation from the job's seed.
    order = np.random.default_rng(shard.seed).permutation(len(progression))
    validation_rows, train_rows = order[:VALIDATION_PATIENTS], order[VALIDATION_PATIENTS:]
    # Targets standardised with the training rows' statistics (the loss then needs no tuning).
    mean, std = progression[train_rows].mean(), progression[train_rows].std()
    targets = ((progression - mean) / std).astype(np.float32)

    def rank_batches(rows, batch_size, shuffle):
        # Every rank must feed the same number of batches: take the same count from each shard
        # (shards of 354 rows over 4 ranks hold 89 or 88) and drop partial batches.
        per_rank = len(rows) // shard.num_shards
        data = (tf.data.Dataset.from_tensor_slices((features[rows], targets[rows]))
                .shard(shard.num_shards, shard.rank).take(per_rank))
        if shuffle:
            data = data.shuffle(per_rank, seed=shard.seed + shard.rank)
        return data.batch(batch_size, drop_remainder=True)

    return hvdtrain.Datasets(
        train=rank_batches(train_rows, shard.batch_size, shuffle=True),
        validation=rank_batches(validation_rows, shard.validation_batch_size, shuffle=False),
        description=f"scikit-learn diabetes: {len(train_rows)} train, "
                    f"{len(validation_rows)} validation patients, 10 features")


def build_model(data: hvdtrain.Datasets) -> keras.Model:
    num_features = data.train.element_spec[0].shape[-1]
    return keras.Sequential([
        keras.Input(shape=(num_features,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(1),
    ])


# The progression's standard deviation over all patients (77.0), to report errors in its units.
PROGRESSION_STD = 77.0


def error_in_progression_units(y_true, y_pred):
    """Mean absolute error in the original units (targets are standardised)."""
    errors = tf.reshape(y_true, [-1]) - tf.reshape(y_pred, [-1])
    return tf.reduce_mean(tf.abs(errors)) * PROGRESSION_STD


TASK = hvdtrain.Task(
    build_model=build_model,
    loss=lambda: keras.losses.Huber(delta=1.0),  # robust to the few extreme patients
    metrics=lambda: [error_in_progression_units],
    datasets=datasets,
)


def default() -> hvdtrain.TrainConfig:
    return hvdtrain.TrainConfig(epochs=60, batch_size=16, learning_rate=3e-3, warmup_epochs=2,
                                tensorboard=False, run_dir="runs/diabetes")


if __name__ == "__main__":
    hvdtrain.main(TASK, name="diabetes", presets={"default": default})
