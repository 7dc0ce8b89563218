"""A horovod.tensorflow script in horovod's own style (its tensorflow2_mnist.py pattern) on Keras 3,
with no hvdtrain in it: run as N ranks, rank 0 prints ``RESULT {json}`` with what every rank saw.

Each rank starts from weights of its own seed and trains on data of its own, so only horovod's
broadcast and averages can make the ranks agree. Checked against numbers computed here by hand
from every rank's local gradients (gathered with allgather_object):
- DistributedGradientTape: the gradients are the mean of the ranks' local gradients;
- a partial tape (register_local_source): the registered variable's gradient stays this rank's
  own, divided by the world size (horovod's scale_local_gradients), the others are averaged;
- broadcast_variables of a Keras 3 model and optimizer: every rank holds rank 0's weights;
- hvd.DistributedOptimizer around a Keras 3 optimizer: apply_gradients and model.fit apply the
  averaged gradient (before horovod patch 0005 each rank applied its own, silently);
- hvd.SyncBatchNormalization: a rank's output and the moving statistics are those of one
  BatchNormalization over every rank's batch at once;
- horovod.tensorflow.keras: DistributedOptimizer and the broadcast, metric-average and warm-up
  callbacks in model.fit keep the ranks equal and warm the rate up by horovod's formula, and
  load_model gives the model back with its optimizer distributed and its state.
The first argument: a directory every rank can read, for load_model's file.
"""
import json

import numpy as np
import tensorflow as tf
import keras

import horovod.tensorflow as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()


def new_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                             keras.layers.Dense(3)])


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(100 + rank)
x = rng.normal(size=(8, 6)).astype("float32")
y = rng.integers(0, 3, 8)
result = {"keras": keras.__version__}


def local_gradients(model):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def gathered_mean(arrays):
    every = hvd.allgather_object(arrays)
    return [np.mean([ranks[i] for ranks in every], axis=0) for i in range(len(arrays))]


# 1. broadcast_variables of a Keras 3 model (and of an optimizer's variables, once built).
model = new_model(seed=rank)
optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
optimizer.build(model.trainable_variables)
hvd.broadcast_variables(model.variables, root_rank=0)
hvd.broadcast_variables(optimizer.variables, root_rank=0)
weights = hvd.allgather_object([v.numpy() for v in model.variables])
result["broadcast_identical"] = all(np.array_equal(a, b) for ranks in zip(*weights)
                                    for a, b in zip(ranks, ranks[1:]))


# 2. DistributedGradientTape, in a tf.function as horovod's examples write it.
def tape_gradients(local_sources=()):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    tape = hvd.DistributedGradientTape(tape)
    for source in local_sources:
        tape.register_local_source(source)
    return tape.gradient(loss, model.trainable_variables)


local = local_gradients(model)
mean = gathered_mean(local)
averaged = [g.numpy() for g in tf.function(tape_gradients)()]
result["tape_error"] = max(float(np.max(np.abs(a - m))) for a, m in zip(averaged, mean))
result["gradients_differ_between_ranks"] = bool(
    max(np.max(np.abs(g - m)) for g, m in zip(local, mean)) > 1e-4)

# 3. A partial tape: the last bias is this rank's own (scaled by 1/size), the rest averaged.
last_bias = model.trainable_variables[-1]
partial = [g.numpy() for g in tf.function(lambda: tape_gradients([last_bias]))()]
expected = mean[:-1] + [local[-1] / size]
result["partial_error"] = max(float(np.max(np.abs(a - e))) for a, e in zip(partial, expected))

# 4. hvd.DistributedOptimizer around a Keras 3 optimizer: apply_gradients steps with the mean.
before = [v.numpy() for v in model.trainable_variables]
distributed = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
distributed.apply_gradients(zip([tf.constant(g) for g in local], model.trainable_variables))
steps = [b - v.numpy() for b, v in zip(before, model.trainable_variables)]
result["optimizer_error"] = max(float(np.max(np.abs(s - 0.5 * m))) for s, m in zip(steps, mean))
result["optimizer_variables"] = len(distributed.variables)

# 5. ... and in model.fit, compiled by Keras: the ranks stay identical on their own data.
fitted = new_model(seed=rank)
fitted.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=loss_fn)
hvd.broadcast_variables(fitted.variables, root_rank=0)
fitted.fit(x, y, batch_size=4, epochs=2, verbose=0)
trained = hvd.allgather_object([v.numpy() for v in fitted.trainable_variables])
result["fit_max_difference"] = max(float(np.max(np.abs(a - b))) for ranks in zip(*trained)
                                   for a, b in zip(ranks, ranks[1:]))

# 6. SyncBatchNormalization: each rank's batch is normalized with the moments of all ranks'
# batches (means 3 apart), as one BatchNormalization over the global batch does, eagerly and in
# a tf.function, and the moving statistics follow the global moments.
every_batch = hvd.allgather_object(rng.normal(loc=3.0 * rank, size=(4, 5)).astype("float32"))
global_batch = np.concatenate(every_batch)
synced = hvd.SyncBatchNormalization(momentum=0.5)
reference = keras.layers.BatchNormalization(momentum=0.5)
errors = []
for call in (lambda layer, batch: layer(batch, training=True),
             tf.function(lambda layer, batch: layer(batch, training=True))):
    mine = call(synced, every_batch[rank]).numpy()
    expected = reference(global_batch, training=True).numpy()[4 * rank:4 * (rank + 1)]
    errors.append(float(np.max(np.abs(mine - expected))))
result["sync_bn_error"] = max(errors)
result["sync_bn_moving_error"] = max(
    float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    for a, b in ((synced.moving_mean, reference.moving_mean),
                 (synced.moving_variance, reference.moving_variance)))
# Keras' jit_compile="auto" reads this: a model holding the layer is not compiled with XLA on a
# GPU, where horovod's allreduce has no kernel.
from keras.src.trainers.trainer import model_supports_jit  # noqa: E402

result["sync_bn_model_supports_jit"] = model_supports_jit(keras.Sequential(
    [keras.Input((5,)), hvd.SyncBatchNormalization(), keras.layers.Dense(2)]))
local_only = keras.layers.BatchNormalization()(every_batch[rank], training=True).numpy()
result["sync_bn_differs_from_local"] = bool(np.max(np.abs(local_only - mine)) > 0.1)

# 7. horovod.tensorflow.keras, as horovod's Keras examples use it (horovod patch 0006): its
# callbacks in model.fit, then hvd.load_model of the saved model. Each rank starts from its own
# weights and trains on its own data: only the broadcast and the averages keep them equal.
import horovod.tensorflow.keras as hvd_keras  # noqa: E402
import sys  # noqa: E402


class Seen(keras.callbacks.Callback):
    """After horovod's callbacks: the logs each epoch ends with, and the rate of each batch."""

    def __init__(self):
        super().__init__()
        self.losses, self.rates = [], []

    def on_train_batch_begin(self, batch, logs=None):
        self.rates.append(float(self.model.optimizer.learning_rate.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


keras_model = new_model(seed=10 + rank)
keras_model.compile(optimizer=hvd_keras.DistributedOptimizer(
    keras.optimizers.SGD(0.02 * size, momentum=0.9)), loss=loss_fn)
seen = Seen()
warmup = hvd_keras.callbacks.LearningRateWarmupCallback(initial_lr=0.02 * size, warmup_epochs=2,
                                                        steps_per_epoch=2)
keras_model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[
    hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd_keras.callbacks.MetricAverageCallback(), warmup, seen])
weights = hvd.allgather_object([v.numpy() for v in keras_model.weights])
result["keras_fit_max_difference"] = max(float(np.max(np.abs(a - b))) for ranks in
                                         zip(*weights) for a, b in zip(ranks, ranks[1:]))
result["keras_losses"] = seen.losses  # averaged by MetricAverageCallback: equal on every rank
# The warm-up: from initial_lr / size at the first batch up to initial_lr over 2 epochs.
expected_rates = [0.02 * size / size * ((epoch + (batch + 1) / 2) * (size - 1) / 2 + 1)
                  for epoch in range(2) for batch in range(2)]
result["warmup_error"] = max(abs(r - e) for r, e in zip(seen.rates[:4], expected_rates))
result["rate_after_warmup"] = seen.rates[-1]
saved = sys.argv[1] + "/model.keras"
if rank == 0:
    keras_model.save(saved)
hvd.allreduce(tf.constant(0))  # the file is whole before any rank reads it
loaded = hvd_keras.load_model(saved)
result["loaded_optimizer"] = type(loaded.optimizer).__module__
result["loaded_iterations"] = int(loaded.optimizer.iterations.numpy())
loaded.fit(x, y, batch_size=4, epochs=1, verbose=0)
weights = hvd.allgather_object([v.numpy() for v in loaded.weights])
result["loaded_fit_max_difference"] = max(float(np.max(np.abs(a - b))) for ranks in
                                          zip(*weights) for a, b in zip(ranks, ranks[1:]))

every = hvd.allgather_object(result)
if rank == 0:
    print("RESULT " + json.dumps(every), flush=True)
