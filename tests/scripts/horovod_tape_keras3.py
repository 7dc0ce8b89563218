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
  BatchNormalization over every rank's batch at once.
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

every = hvd.allgather_object(result)
if rank == 0:
    print("RESULT " + json.dumps(every), flush=True)
