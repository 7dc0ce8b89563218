"""Model families. Each is its own module with one ``build_*`` function; entry points pick one.

``build_classifier`` maps the classifier job's ``--model`` to one of them.
"""
from __future__ import annotations

BUILT_IN_CLASSIFIERS = ("cnn", "resnet50", "mobilenetv2", "efficientnetb0")


def build_classifier(spec: str, input_shape: tuple[int, int, int], num_classes: int):
    """``--model``: a built-in name or 'FILE.py:FUNCTION'. ValueError for anything unusable."""
    from hvdtrain.models.user import build_user_model, is_user_model

    if is_user_model(spec):
        return build_user_model(spec, input_shape, num_classes)
    if spec == "cnn":
        from hvdtrain.models.cnn import build_cnn

        return build_cnn(input_shape, num_classes)
    from hvdtrain.models.applications import APPLICATIONS, build_application

    if spec in APPLICATIONS:
        return build_application(spec, input_shape, num_classes)
    raise ValueError(f"--model must be one of {', '.join(BUILT_IN_CLASSIFIERS)} or "
                     f"FILE.py:FUNCTION, got {spec!r}")
