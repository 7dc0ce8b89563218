"""hvdtrain: one Keras training job, data-parallel on 1, 4 or 64 GPUs (or CPU ranks, or a TPU).

Importing this package makes horovod work with Keras. This is the only place that does it:

* TensorFlow >= 2.16 ships Keras 3, and ``horovod.tensorflow.keras`` (0.28.1) needs Keras 2: it does
  ``from keras import backend`` and calls ``K.get_value``, which Keras 3 removed.
* ``TF_USE_LEGACY_KERAS=1`` makes ``tf.keras`` resolve to ``tf_keras`` (Keras 2), but horovod
  imports the top-level ``keras`` package, so ``import keras`` must also give ``tf_keras``.

Both must be in place before TensorFlow or horovod is imported, hence at package import time: every
entry point is ``python -m hvdtrain.<module>``, which runs this file first. ``import keras`` is
redirected by an import hook rather than by importing ``tf_keras`` here, so that tools which never
touch Keras (the launcher, the Slurm renderer) start in milliseconds instead of loading TensorFlow.
"""
import importlib
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

# The public API for your own training job (README "Your own training job"); everything else in
# hvdtrain is internal. Resolved on first use, so that `import hvdtrain` stays instant.
__all__ = ["Datasets", "Shard", "Task", "TrainConfig", "main", "run"]


def __getattr__(name: str):
    if name == "TrainConfig":
        from hvdtrain import config

        return config.TrainConfig
    if name in __all__:
        from hvdtrain import task

        return getattr(task, name)
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")


class _KerasIsTfKeras(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import keras`` / ``import keras.x`` -> the already-imported ``tf_keras`` / ``tf_keras.x``."""

    def __init__(self):
        self._real_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "keras" or fullname.startswith("keras."):
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = importlib.import_module("tf_keras" + spec.name[len("keras"):])
        self._real_specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system stamped the alias spec on the tf_keras module; put its own back so
        # importlib (and TensorFlow's lazy loader) keep finding tf_keras where it really is.
        module.__spec__ = self._real_specs[module.__name__]


def _select_keras_2() -> None:
    if os.environ.get("TF_USE_LEGACY_KERAS") != "1" and "tensorflow" in sys.modules:
        # Too late to switch tf.keras to Keras 2 in this process: say so instead of failing later.
        raise ImportError("hvdtrain must be imported before tensorflow (it selects Keras 2 for "
                          "horovod); import hvdtrain first or set TF_USE_LEGACY_KERAS=1")
    keras = sys.modules.get("keras")
    if keras is not None and keras is not sys.modules.get("tf_keras"):
        raise ImportError("Keras 3 was imported before hvdtrain; horovod needs Keras 2 (tf_keras). "
                          "Import hvdtrain first.")
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    # TensorFlow's C++ INFO banners, repeated by every rank, bury the lines users care about.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if not any(isinstance(finder, _KerasIsTfKeras) for finder in sys.meta_path):
        sys.meta_path.insert(0, _KerasIsTfKeras())


_select_keras_2()
