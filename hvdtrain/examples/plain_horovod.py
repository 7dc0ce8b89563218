"""A plain horovod Keras script, written the way horovod's TensorFlow 2 Keras example is.

It knows nothing of hvdtrain. hvdtrain's launcher and Slurm templates run it unchanged:

    python -m hvdtrain.launch --np 2 examples/plain_horovod.py
    HVDTRAIN_MODULE=examples/plain_horovod.py sbatch slurm/cpu.sh

The only departure from horovod's example is the data: scikit-learn's 8x8 digits, which ship
inside scikit-learn, instead of MNIST, which would be a download.
"""
import numpy as np
import tensorflow as tf
import horovod.tensorflow.keras as hvd
from sklearn.datasets import load_digits

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')

digits = load_digits()
images = (digits.images[..., np.newaxis] / 16.0).astype(np.float32)
labels = digits.target.astype(np.int64)
train_images, train_labels = images[:1500], labels[:1500]
test_images, test_labels = images[1500:], labels[1500:]

dataset = tf.data.Dataset.from_tensor_slices((train_images, train_labels))
dataset = dataset.repeat().shuffle(1500, seed=hvd.rank()).batch(32)

model = tf.keras.Sequential([
    tf.keras.layers.Conv2D(32, [3, 3], activation='relu', input_shape=(8, 8, 1)),
    tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt)

model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
              optimizer=opt,
              metrics=['accuracy'])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint('./checkpoint-{epoch}.h5'))

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
model.fit(dataset, steps_per_epoch=240 // hvd.size(), callbacks=callbacks, epochs=6,
          verbose=verbose)

loss, accuracy = model.evaluate(test_images, test_labels, verbose=0)
print(f"rank {hvd.rank()} of {hvd.size()}: test accuracy {accuracy:.4f}", flush=True)
