"""A hand-written horovod Keras recipe, the way horovod's TensorFlow 2 Keras example is written.

What ``bench startup`` holds hvdtrain's fixed costs against: the same image folder, batch size,
epochs, steps and model (the article's CNN), with nothing of hvdtrain imported. It runs on tf_keras
(horovod's Keras API needs Keras 2; on TF >= 2.16 a script of one's own points ``keras`` at
tf_keras before importing it), reads the folder with Keras' own loader, and checkpoints on rank 0.

    horovodrun -np 2 python benchmarks/recipe.py DIR --image-size 32 --epochs 4 \
        --steps-per-epoch 40 --batch-size 64 --json OUT

Rank 0 writes OUT: every epoch's seconds (on_epoch_begin to on_epoch_end) and samples/s, and the
wall-clock time (time.time()) of the first step's start and of the end of training.
"""
import argparse
import json
import os
import sys
import tempfile
import time

import tf_keras

# horovod.tensorflow.keras imports `keras`, which is Keras 3 on TensorFlow >= 2.16.
sys.modules["keras"] = tf_keras
import tensorflow as tf  # noqa: E402
import horovod.tensorflow.keras as hvd  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("data_dir")
parser.add_argument("--image-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--steps-per-epoch", type=int, default=40)
parser.add_argument("--batch-size", type=int, default=64, help="per worker")
parser.add_argument("--json", required=True)
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process); one thread per rank on
# a CPU as hvdtrain gives its ranks on a 2-core machine.
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')
else:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

# Keras' own loader; each rank keeps every size-th batch of files (horovod: shard the data).
dataset = tf_keras.utils.image_dataset_from_directory(
    args.data_dir, color_mode="grayscale", image_size=(args.image_size, args.image_size),
    batch_size=None, shuffle=True, seed=0)
num_classes = len(dataset.class_names)
dataset = (dataset.shard(hvd.size(), hvd.rank()).cache().repeat().shuffle(1000, seed=hvd.rank())
           .batch(args.batch_size).prefetch(tf.data.AUTOTUNE))

inputs = tf_keras.Input(shape=(args.image_size, args.image_size, 1))
x = tf_keras.layers.Rescaling(1.0 / 255)(inputs)
for filters in (16, 32, 64):
    x = tf_keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(x)
    x = tf_keras.layers.MaxPooling2D()(x)
x = tf_keras.layers.Flatten()(x)
x = tf_keras.layers.Dropout(0.2)(x)
x = tf_keras.layers.Dense(128, activation="relu")(x)
model = tf_keras.Model(inputs, tf_keras.layers.Dense(num_classes)(x))

# Horovod: adjust learning rate based on number of workers; add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(tf_keras.optimizers.Adam(1e-3 * hvd.size()))
model.compile(loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              optimizer=opt, metrics=["accuracy"])


class Timeline(tf_keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epochs, self.first_step = [], None

    def on_train_batch_begin(self, batch, logs=None):
        if self.first_step is None:
            self.first_step = time.time()

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.start
        self.epochs.append({"epoch_seconds": seconds, "samples_per_sec":
                            args.steps_per_epoch * args.batch_size * hvd.size() / seconds})

    def on_train_end(self, logs=None):
        self.train_end = time.time()


timeline = Timeline()
callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    timeline,
]
# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
checkpoints = tempfile.mkdtemp(prefix="recipe-")
if hvd.rank() == 0:
    callbacks.append(tf_keras.callbacks.ModelCheckpoint(
        os.path.join(checkpoints, "checkpoint-{epoch}.h5")))

model.fit(dataset, steps_per_epoch=args.steps_per_epoch, epochs=args.epochs,
          callbacks=callbacks, verbose=0)
if hvd.rank() == 0:
    with open(args.json, "w") as out:
        json.dump({"epochs": timeline.epochs, "first_step": timeline.first_step,
                   "train_end": timeline.train_end}, out)
