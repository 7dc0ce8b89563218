"""An API job whose ranks build datasets of different lengths (rank 0: 4 batches, rank 1: 3).

Run as `horovodrun -np 2 python uneven_task.py --run-dir DIR`: hvdtrain must refuse before the
first step, in one line, rather than let rank 0 wait forever for rank 1's fourth batch.
"""
import hvdtrain

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402


def datasets(shard: hvdtrain.Shard) -> hvdtrain.Datasets:
    samples = (4 - shard.rank) * shard.batch_size
    features = tf.random.uniform((samples, 3))
    return hvdtrain.Datasets(
        tf.data.Dataset.from_tensor_slices((features, tf.reduce_sum(features, axis=1)))
        .batch(shard.batch_size, drop_remainder=True))


TASK = hvdtrain.Task(
    build_model=lambda data: keras.Sequential([keras.Input(shape=(3,)), keras.layers.Dense(1)]),
    loss=lambda: "mse",
    datasets=datasets,
)

if __name__ == "__main__":
    hvdtrain.main(TASK)
