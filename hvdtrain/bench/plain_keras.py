"""The baseline for the framework tax: the same CNN and data in a plain tf_keras `model.fit`.

No hvdtrain runtime, no horovod, no checkpoints: one process, the same model builder, the same
arrays, the same tf.data steps (cache, shuffle, batch, repeat, prefetch), Adam at the same rate
and the same thread counts. Throughput is measured with the same callback hvdtrain uses.
"""
from __future__ import annotations

import argparse
import json
from typing import Sequence

import hvdtrain  # noqa: F401  (Keras 2 for tf_keras, like the job it is compared with)


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvdtrain.bench.plain_keras",
                                     description=__doc__)
    parser.add_argument("--data", choices=("digits", "synthetic"), default="synthetic")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1797, help="synthetic samples")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", required=True, help="where to write per-epoch metrics")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tf_keras as keras

    from hvdtrain.callbacks import Throughput
    from hvdtrain.data import load_embedded
    from hvdtrain.models.cnn import build_cnn

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    keras.utils.set_random_seed(args.seed)
    arrays = load_embedded(args.data, image_size=args.image_size,
                           synthetic_samples=args.samples, seed=args.seed)
    options = tf.data.Options()
    options.threading.private_threadpool_size = max(2, args.threads)
    dataset = (tf.data.Dataset.from_tensor_slices((arrays.images, arrays.labels))
               .cache()
               .shuffle(len(arrays.labels), seed=args.seed, reshuffle_each_iteration=True)
               .batch(args.batch_size, drop_remainder=True)
               .repeat()
               .prefetch(tf.data.AUTOTUNE)
               .with_options(options))
    model = build_cnn(arrays.images.shape[1:], len(arrays.class_names))
    model.compile(optimizer=keras.optimizers.Adam(args.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    throughput = Throughput(args.batch_size)
    rows = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rows.append({"epoch": epoch + 1, **{k: float(v) for k, v in logs.items()},
                         **throughput.timings})

    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=0,
              callbacks=[throughput, Record()])
    with open(args.json, "w") as file:
        json.dump(rows, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
