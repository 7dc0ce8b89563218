"""A finished run's model as the commands after training load it (``hvdtrain evaluate`` and
``hvdtrain predict``): their --keras and --checkpoint, the model file, the run's config in the
world the command was launched as, the model itself, and where its output may be written."""
from __future__ import annotations

import os
import re
from typing import Callable

import hvdtrain
from hvdtrain.errors import UserError
from hvdtrain.rundir import MODEL_FILE, RunDir


def check_model_flags(keras: str, checkpoint: str | None, program: str) -> None:
    """The --keras and --checkpoint of a command that loads a run's model."""
    if keras != hvdtrain.KERAS:
        raise UserError(f"--keras {keras} must be on the command line that starts "
                        f"{program} (this process runs Keras {hvdtrain.KERAS})")
    if checkpoint is not None and not re.fullmatch(r"latest|\d+", checkpoint):
        raise UserError(f"--checkpoint must be 'latest' or a checkpoint's number, got "
                        f"{checkpoint!r}")


def require_model_file(run_dir: str, checkpoint: str | None, *,
                       can_load_checkpoint: bool) -> None:
    """Without ``checkpoint``, the run's model.keras must be there (checked before TensorFlow
    loads); ``can_load_checkpoint``: the command can load a checkpoint instead, and says so."""
    if checkpoint is None and not os.path.isfile(os.path.join(run_dir, MODEL_FILE)):
        raise UserError(f"{run_dir} holds no {MODEL_FILE} (its job has not finished, ran with "
                        "--no-export, or its model could only be saved as weights)"
                        + (": pass --checkpoint latest" if can_load_checkpoint else ""))


def recorded_image_shape(recorded: dict) -> tuple[int, int, int] | None:
    """The run's images (height, width, channels), 'HxWxC' in its config.json's fingerprint."""
    images = str(recorded.get("fingerprint", {}).get("images", ""))
    if not re.fullmatch(r"\d+x\d+x\d+", images):
        return None
    height, width, channels = map(int, images.split("x"))
    return height, width, channels


def run_config(run_dir: str, recorded: dict, config_class: type,
               data_flags: dict | None = None):
    """The run's config (``config_class``: its job's; ``data_flags`` naming other data), as a
    command that loads its model runs it: in whatever world it was launched as (the run's
    accumulation, which keeps horovod, and its strategy are training's)."""
    from hvdtrain.training.config import read_config_file

    try:
        fields = read_config_file(os.path.join(run_dir, "config.json"), config_class)
        if data_flags:
            fields.update({"data": "digits", "data_dir": None, "tfrecords": None, **data_flags})
            # A run on embedded data has no --image-size or --channels (its images come in
            # their own): files are decoded to the images the run trained on, not 64x64x3.
            shape = recorded_image_shape(recorded)
            if shape and shape[0] == shape[1]:
                fields["image_size"] = fields.get("image_size") or shape[0]
                fields["channels"] = fields.get("channels") or shape[2]
        return config_class(**{**fields, "backend": "auto", "grad_accum_steps": 1})
    except ValueError as error:
        raise UserError(str(error)) from None


def scored_model(run_dir: str, checkpoint: str | None, recorded: dict, config, runtime,
                 build: Callable):
    """(the run's model, what it is): its ``model.keras``, or with ``checkpoint`` ('latest' or a
    number) that checkpoint's weights restored into the run's network, as ``build()`` makes it
    for the data, in the run's precision."""
    if checkpoint is None:
        from hvdtrain.export import load_run_model

        path = os.path.join(run_dir, MODEL_FILE)
        return load_run_model(path, recorded), path
    import tensorflow as tf

    from hvdtrain.training.checkpoint import checkpoint_numbers
    from hvdtrain.training.model import seed_and_precision

    directory = RunDir(run_dir, is_chief=False).checkpoints
    if checkpoint == "latest":
        path = tf.train.latest_checkpoint(directory)
    else:
        path = os.path.join(directory, f"ckpt-{checkpoint}")
        path = path if tf.io.gfile.exists(f"{path}.index") else None
    if path is None:
        kept = checkpoint_numbers(directory)
        raise UserError(f"{directory} holds no checkpoint {checkpoint} "
                        f"(it holds {', '.join(map(str, kept)) or 'none'})")
    seed_and_precision(config, runtime)  # the run's precision policy
    try:
        model = build()
    except ValueError as error:
        raise UserError(str(error)) from None
    try:
        tf.train.Checkpoint(model=model).read(path).expect_partial() \
            .assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as error:
        from hvdtrain.errors import first_line

        raise UserError(f"cannot restore {path} into the run's model: "
                        f"{first_line(error)}") from None
    return model, path


def check_writable(path: str) -> None:
    """``UserError`` unless ``path`` can be written as a file: not a directory or a symlink, and
    its nearest existing directory writable."""
    if os.path.isdir(path) or os.path.islink(path):
        raise UserError(f"--output {path} is a directory or a symlink: name a file")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {path}: {parent} is not a writable directory")


def few_names(names) -> str:
    names = list(names)
    return ", ".join(names[:5]) + (f", ... ({len(names)} classes)" if len(names) > 5 else "")
