"""What hvdtrain is compared with: the same CNN and data without hvdtrain.

    python -m benchmarks.baselines plain --json F    a plain tf_keras model.fit, one process
    worker_commands(2, [...], env)                    MultiWorkerMirroredStrategy, 2 workers

Both use hvdtrain's model builder, the embedded arrays, the same tf.data steps (cache, shuffle,
batch, repeat, prefetch), Adam and the same thread counts; throughput is measured with the same
callback hvdtrain uses. Under MultiWorkerMirroredStrategy (TF_CONFIG names every worker on
localhost) each worker keeps every N-th sample, as horovod's shard does, the learning rate is
scaled linearly like hvdtrain's, and gradients are all-reduced by TensorFlow's RING collectives.
The chief writes per-epoch metrics.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Sequence

import hvdtrain  # noqa: F401  (Keras 2, as in the jobs these are compared with)


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def worker_commands(num_workers: int, args: list[str], env: dict[str, str]
                    ) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of ``num_workers`` MultiWorkerMirrored workers on localhost, to start at once.

    Each worker's TF_CONFIG names every worker's address and its own index.
    """
    addresses = [f"localhost:{port}" for port in free_ports(num_workers)]
    return [([sys.executable, "-m", "benchmarks.baselines", "mwms", *args],
             {**env, "TF_CONFIG": json.dumps({"cluster": {"worker": addresses},
                                              "task": {"type": "worker", "index": index}})})
            for index in range(num_workers)]


def run(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.baselines",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=("plain", "mwms"))
    parser.add_argument("--data", choices=("digits", "synthetic"), default="synthetic")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--samples", type=int, default=1797, help="synthetic samples")
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="before scaling")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--json", required=True, help="where the chief writes epoch metrics")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tf_keras as keras

    from hvdtrain.training.callbacks import Throughput
    from hvdtrain.data.embedded import load_embedded
    from hvdtrain.models.cnn import build_cnn

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    if args.kind == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
        is_chief = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
    else:
        strategy, is_chief = tf.distribute.get_strategy(), True
    workers = strategy.num_replicas_in_sync
    keras.utils.set_random_seed(args.seed)
    arrays = load_embedded(args.data, image_size=args.image_size,
                           synthetic_samples=args.samples, seed=args.seed)
    global_batch = args.batch_size * workers
    options = tf.data.Options()
    options.threading.private_threadpool_size = max(2, args.threads)
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = (tf.data.Dataset.from_tensor_slices((arrays.images, arrays.labels))
               .cache()
               .shuffle(len(arrays.labels), seed=args.seed, reshuffle_each_iteration=True)
               .batch(global_batch, drop_remainder=True)
               .repeat()
               .prefetch(tf.data.AUTOTUNE)
               .with_options(options))
    with strategy.scope():
        model = build_cnn(arrays.images.shape[1:], len(arrays.class_names))
        model.compile(optimizer=keras.optimizers.Adam(args.learning_rate * workers),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    throughput = Throughput(global_batch)
    rows = []

    class Record(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            rows.append(throughput.row(epoch, logs))

    model.fit(dataset, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch, verbose=0,
              callbacks=[throughput, Record()])
    if is_chief:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(run())
