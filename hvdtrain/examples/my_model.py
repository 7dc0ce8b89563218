"""Your own classifier for hvdtrain: `--model examples/my_model.py:build`.

hvdtrain calls build(input_shape, num_classes) on every rank. Images arrive as uint8 tensors of
input_shape; return a keras.Model that outputs one logit per class. Everything else (sharding,
scaled learning rate, checkpoints, resume, mixed precision, metrics) is hvdtrain's.

    horovodrun -np 2 .venv/bin/python -m hvdtrain.cnn --model examples/my_model.py:build \
        --data-dir path/to/images --image-size 32
"""
import keras  # hvdtrain makes this the Keras it trains with


def build(input_shape, num_classes):
    inputs = keras.Input(shape=input_shape, dtype="uint8")
    x = keras.layers.Rescaling(1 / 255)(inputs)
    for filters in (32, 64):
        x = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.Activation("relu")(x)
        x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.2)(x)
    logits = keras.layers.Dense(num_classes, dtype="float32")(x)  # float32 under mixed precision
    return keras.Model(inputs, logits, name="my_model")
