"""Model families: each is its own module with a ``build_*`` function, and one line of the table
below. ``build_classifier`` maps the classifier job's ``--model`` to one of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from hvdtrain.models.user import build_user_model, is_user_model

if TYPE_CHECKING:
    import keras

ClassifierBuilder = Callable[[tuple[int, int, int], int], "keras.Model"]


def _cnn(input_shape: tuple[int, int, int], num_classes: int) -> keras.Model:
    from hvdtrain.models.cnn import build_cnn

    return build_cnn(input_shape, num_classes)


def _application(name: str) -> ClassifierBuilder:
    def build(input_shape: tuple[int, int, int], num_classes: int) -> keras.Model:
        from hvdtrain.models.applications import build_application

        return build_application(name, input_shape, num_classes)
    return build


#: ``--model`` name -> ``builder(input_shape, num_classes)`` returning a model of uint8 images to
#: class logits. A new family: its module, and a line here. Each imports its module (and so
#: Keras and TensorFlow) only when it builds: the flags, and --help, need neither.
CLASSIFIERS: dict[str, ClassifierBuilder] = {
    "cnn": _cnn,
    **{name: _application(name) for name in ("resnet50", "mobilenetv2", "efficientnetb0")},
}


def build_classifier(spec: str, input_shape: tuple[int, int, int], num_classes: int):
    """``--model``: a built-in name or 'FILE.py:FUNCTION'. ValueError for anything unusable."""
    if is_user_model(spec):
        return build_user_model(spec, input_shape, num_classes)
    if spec not in CLASSIFIERS:
        raise ValueError(f"--model must be one of {', '.join(CLASSIFIERS)} or "
                         f"FILE.py:FUNCTION, got {spec!r}")
    return CLASSIFIERS[spec](input_shape, num_classes)
