"""Model families: each is its own module with a ``build_*`` function, and one line of the table
below. ``build_classifier`` maps the classifier job's ``--model`` to one of them.
"""
from __future__ import annotations

from typing import Callable

import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain.models.applications import APPLICATIONS, build_application
from hvdtrain.models.cnn import build_cnn
from hvdtrain.models.user import build_user_model, is_user_model

ClassifierBuilder = Callable[[tuple[int, int, int], int], keras.Model]

#: ``--model`` name -> ``builder(input_shape, num_classes)`` returning a model of uint8 images to
#: class logits. A new family: its module, and a line here.
CLASSIFIERS: dict[str, ClassifierBuilder] = {
    "cnn": build_cnn,
    **{name: (lambda shape, classes, name=name: build_application(name, shape, classes))
       for name in APPLICATIONS},
}


def build_classifier(spec: str, input_shape: tuple[int, int, int], num_classes: int):
    """``--model``: a built-in name or 'FILE.py:FUNCTION'. ValueError for anything unusable."""
    if is_user_model(spec):
        return build_user_model(spec, input_shape, num_classes)
    if spec not in CLASSIFIERS:
        raise ValueError(f"--model must be one of {', '.join(CLASSIFIERS)} or "
                         f"FILE.py:FUNCTION, got {spec!r}")
    return CLASSIFIERS[spec](input_shape, num_classes)
