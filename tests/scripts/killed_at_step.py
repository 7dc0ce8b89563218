"""hvdtrain.cnn's classifier, rank 0 SIGKILLed right after global step HVDTRAIN_TEST_KILL_AT
(unset: an uninterrupted run), in the launcher's first attempt only (its restarts run to the
end). ``build`` is a model with batch norm (whose statistics two ranks recompute from training
batches at every epoch's end) and without dropout, whose masks a resumed run would draw anew
(Keras keeps their generators' state out of checkpoints); the optimizer keeps a moving average
of the weights (use_ema), which Keras copies into them as a fit ends."""
import dataclasses
import os
import signal

import hvdtrain  # first: it selects the Keras
import keras  # noqa: E402

from hvdtrain.cnn import PRESETS, classifier  # noqa: E402

KILL_AT = int(os.environ.get("HVDTRAIN_TEST_KILL_AT", "0"))
# The launcher's mark on every process of an attempt: "PID.N", N counting its restarts.
if os.environ.get("HVDTRAIN_LAUNCH_ATTEMPT", "0.0").rsplit(".", 1)[-1] != "0":
    KILL_AT = 0


class KillAt(keras.callbacks.Callback):
    """A crash: an OOM kill or a node gone, in the middle of an epoch."""

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == KILL_AT and \
                os.environ.get("OMPI_COMM_WORLD_RANK") == "0":
            os.kill(os.getpid(), signal.SIGKILL)


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    x = keras.layers.Rescaling(1 / 255)(inputs)
    x = keras.layers.Conv2D(8, 3, use_bias=False)(x)
    x = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(x))
    x = keras.layers.Flatten()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def task(config):
    made = classifier(config.model, config.label_smoothing)
    return dataclasses.replace(made, callbacks=(lambda: [KillAt()]) if KILL_AT else None,
                               optimizer=lambda rate: keras.optimizers.Adam(rate, use_ema=True))


if __name__ == "__main__":
    hvdtrain.main(task, name="hvdtrain.cnn", presets=PRESETS)
