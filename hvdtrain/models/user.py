"""A user's own model: ``--model path/to/file.py:FUNCTION``.

``FUNCTION(input_shape, num_classes) -> keras.Model`` receives uint8 images of ``input_shape``
and returns logits. ``import keras`` in that file gets the Keras hvdtrain trains with (Keras 3,
or tf_keras through hvdtrain's import hook with ``--keras 2``). Everything that can be wrong with
the file is a ValueError of one line naming the file, raised on every rank alike (every rank loads
the same file).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Callable

from hvdtrain.errors import first_line

if TYPE_CHECKING:  # Keras (TensorFlow) loads once a model is built, not with the flags
    import keras


def is_user_model(spec: str) -> bool:
    """True for 'FILE.py:FUNCTION' (the built-in names have neither a '.py' nor a ':')."""
    path, _, function = spec.rpartition(":")
    return path.endswith(".py") and bool(function)


def load_builder(spec: str) -> Callable[..., keras.Model]:
    """The FUNCTION of 'FILE.py:FUNCTION', imported from that file."""
    path, _, function_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ValueError(f"--model {spec}: no such file {path}")
    # A module name of its own, so two model files named model.py never shadow each other.
    module_name = f"hvdtrain_user_model_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ValueError(f"--model {spec}: syntax error in {path} line {error.lineno}: "
                         f"{error.msg}") from None
    except Exception as error:  # the user's import-time code failed
        raise ValueError(f"--model {spec}: importing {path} failed: {type(error).__name__}: "
                         f"{first_line(error)}") from None
    sys.modules[module_name] = module
    builder = getattr(module, function_name, None)
    if not callable(builder):
        raise ValueError(f"--model {spec}: {path} defines no function {function_name}")
    return builder


def build_user_model(spec: str, input_shape: tuple[int, int, int],
                     num_classes: int) -> keras.Model:
    """Call the user's builder and check what it returned fits the data and the loss."""
    import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

    builder = load_builder(spec)
    try:
        model = builder(input_shape, num_classes)
    except Exception as error:
        raise ValueError(f"--model {spec}: {builder.__name__}{(input_shape, num_classes)} raised "
                         f"{type(error).__name__}: {first_line(error)}") from None
    if not isinstance(model, keras.Model):
        raise ValueError(f"--model {spec}: {builder.__name__} returned a "
                         f"{type(model).__name__}, not a model of the job's Keras "
                         f"{keras.__version__} (build it with `import keras`; --keras 2 or 3 "
                         "chooses which Keras that is)")
    output_shape = tuple(model.output_shape) if not isinstance(model.output_shape, list) else None
    if output_shape is None or output_shape[-1] != num_classes:
        raise ValueError(f"--model {spec}: the model's output shape is {model.output_shape}, but "
                         f"the data has {num_classes} classes: end in a layer of {num_classes} "
                         "logits")
    return model
