"""`hvdtrain export --run-dir RUN --output DIR`: a run directory's model as a TensorFlow SavedModel
that serves.

TensorFlow Serving and most serving platforms load a SavedModel; a run directory holds
``model.keras``, Keras' own format. The SavedModel written here has one signature,
``serving_default``:

* a run of the built-in classifier (``hvdtrain train``, whose models end in logits, a model file's
  too): uint8 images ``[batch, height, width, channels]`` in; ``probabilities`` (the softmax of the
  logits, float32 ``[batch, classes]``) and ``classes`` (the most probable class's name, string
  ``[batch]``) out;
* any other job's model: its own call (``training=False``), on inputs of the shapes and dtypes it
  was built for; a single output is named ``outputs``, several by the model's output names.

It holds the model's forward pass and its weights only: no optimizer, so no horovod op
(horovod#4028's exports carried them, and no serving image can load one); the written graph's ops
are read back to make sure before the directory is moved into place. One process, no ranks: run
it as a command, not under a launcher.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Sequence

import hvdtrain
from hvdtrain.cli import error_name, usage_name
from hvdtrain.errors import EXIT_USAGE, UserError, as_one_line
from hvdtrain.flags import OneLineParser
from hvdtrain.rundir import (CONFIG_FILE, COPY_IT_DOWN, COPY_IT_UP, MODEL_FILE, WEIGHTS_FILE,
                             require_file_system_path)

PROGRAM = "hvdtrain.export"
SIGNATURE = "serving_default"


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        prog=usage_name(PROGRAM),
        description="Write a run directory's model (its model.keras) as a TensorFlow SavedModel "
                    "with a serving signature, free of horovod ops: uint8 images in, "
                    "probabilities and class names out for the built-in classifier; the "
                    "model's own call for other jobs. docs/after-training.md.")
    parser.add_argument("--run-dir", required=True,
                        help="the run directory of a finished job (it holds model.keras)")
    parser.add_argument("--output", required=True,
                        help="the SavedModel's directory: a new one (or an empty one)")
    parser.add_argument("--keras", choices=("2", "3"), default=hvdtrain.KERAS,
                        help="the Keras the run trained with (it says so in one line otherwise)")
    try:
        args = parser.parse_args(argv)
        if args.keras != hvdtrain.KERAS:  # chosen on import, from the command line's --keras
            raise UserError(f"--keras {args.keras} must be on the command line that starts "
                            f"{PROGRAM} (this process runs Keras {hvdtrain.KERAS})")
        line = write_savedmodel(args.run_dir, args.output)
    except UserError as error:
        print(f"{error_name(PROGRAM)}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{error_name(PROGRAM)}: {line}")
    return 0


def write_savedmodel(run_dir: str, output: str) -> str:
    """Write ``run_dir``'s model to ``output`` (nothing there, nor any directory made for it,
    unless all of it was written); the line saying what was written."""
    require_file_system_path("--run-dir", run_dir, COPY_IT_DOWN)
    require_file_system_path("--output", output, COPY_IT_UP)
    recorded = read_run_config(run_dir)
    model_path = os.path.join(run_dir, MODEL_FILE)
    if not os.path.isfile(model_path):
        if os.path.isfile(os.path.join(run_dir, WEIGHTS_FILE)):
            raise UserError(f"{run_dir} holds the model's weights only ({WEIGHTS_FILE}: the model "
                            "cannot be rebuilt from its config): build it in code, load_weights() "
                            "that file, and save it with tf.saved_model.save")
        raise UserError(f"{run_dir} holds no {MODEL_FILE}: its job has not finished, or ran with "
                        "--no-export; run it again to its end (it resumes from its checkpoint)")
    output = os.path.abspath(output)
    if os.path.islink(output) or (os.path.lexists(output) and not (
            os.path.isdir(output) and not os.listdir(output))):
        raise UserError(f"--output {output} exists and is not an empty directory: name a new one")
    model = load_run_model(model_path, recorded)
    if not getattr(model, "inputs", None):
        raise UserError(f"the model in {model_path} was not built from inputs (a subclassed "
                        "model), so its input shapes are unknown: save it with "
                        "tf.saved_model.save and an input signature of your own")
    classes = class_names_of(recorded, model)
    # Written beside the output and renamed into place whole (over an empty directory, which
    # rename replaces): an interrupted export leaves no half a SavedModel under the name a
    # server loads, and a failed one leaves no directory it made.
    made = _missing_parents(os.path.dirname(output))
    staging = None
    try:
        os.makedirs(os.path.dirname(output), exist_ok=True)
        staging = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.",
                                   dir=os.path.dirname(output))
        signature = _save(model, classes, os.path.join(staging, "model"))
        horovod_ops = _horovod_ops(os.path.join(staging, "model"))
        if horovod_ops:  # never expected: the signature calls the model, not its optimizer
            raise UserError(f"the SavedModel would hold horovod ops ({', '.join(horovod_ops)}), "
                            "which no serving image can load; nothing was written")
        os.rename(os.path.join(staging, "model"), output)
        made = []
    except OSError as error:
        raise UserError(f"cannot write {output}: {as_one_line(error)}") from None
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
        for directory in reversed(made):  # the deepest first; each was made here, empty now
            with contextlib.suppress(OSError):
                os.rmdir(directory)
    return f"wrote {output}: a SavedModel of {model_path}, signature {SIGNATURE}: {signature}"


def _missing_parents(directory: str) -> list[str]:
    """``directory`` and those of its parents that do not exist, the outermost first."""
    missing = []
    while directory and not os.path.lexists(directory):
        missing.insert(0, directory)
        directory = os.path.dirname(directory)
    return missing


def read_run_config(run_dir: str) -> dict:
    """The run's config.json, refused in one line when it is not a run directory of this Keras."""
    path = os.path.join(run_dir, CONFIG_FILE)
    try:
        with open(path) as file:
            recorded = json.load(file)
    except FileNotFoundError:
        raise UserError(f"{run_dir} holds no {CONFIG_FILE}: not a run directory (--run-dir "
                        "names the directory a job trained in)") from None
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {path}: {as_one_line(error)}") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("config", {}), dict):
        raise UserError(f"{path} is not a run's config.json")
    keras = str(recorded.get("config", {}).get("keras", hvdtrain.KERAS))
    if keras != hvdtrain.KERAS:
        trained_on = recorded.get("versions", {}).get("keras") or f"Keras {keras}"
        raise UserError(f"{run_dir} was trained on {trained_on}: pass --keras {keras}")
    return recorded


def load_run_model(model_path: str, recorded: dict):
    """model.keras, uncompiled. A model file's layers (--model FILE.py:FUNCTION, the path as the
    job was given it) are imported when the model needs them: an unregistered layer of its own
    rebuilds from them."""
    import keras

    from hvdtrain.models.user import is_user_model, load_builder

    try:
        return keras.models.load_model(model_path, compile=False)
    except Exception as error:  # noqa: BLE001 - whatever the model's own code raises
        failure = f"cannot load {model_path}: {as_one_line(error)}"
    model_spec = str(recorded.get("config", {}).get("model") or "")
    if not is_user_model(model_spec):
        raise UserError(failure)
    try:
        module = sys.modules[load_builder(model_spec).__module__]
    except ValueError as error:
        raise UserError(f"{failure}; its layers are in the run's model file, which cannot be "
                        f"read from here: {error}") from None
    classes = {name: value for name, value in vars(module).items() if isinstance(value, type)}
    try:
        with keras.utils.custom_object_scope(classes):
            return keras.models.load_model(model_path, compile=False)
    except Exception as error:  # noqa: BLE001
        raise UserError(f"cannot load {model_path}: {as_one_line(error)}") from None


def class_names_of(recorded: dict, model) -> tuple[str, ...] | None:
    """The classes' names for the classifier's signature (numbered when the run directory did
    not record them), or None for a model that is not the built-in classifier's."""
    from hvdtrain.cnn import PROGRAM as CLASSIFIER  # its models end in class logits

    if recorded.get("program") != CLASSIFIER:
        return None
    names = recorded.get("class_names") or [str(index) for index in range(model.output_shape[-1])]
    return tuple(names)


def _save(model, classes: tuple[str, ...] | None, path: str) -> str:
    """The SavedModel at ``path``; what its signature takes and gives."""
    import tensorflow as tf

    inputs = [tf.TensorSpec(tensor.shape, tensor.dtype, name=_input_name(tensor, index))
              for index, tensor in enumerate(model.inputs)]
    serving = tf.Module()
    serving.model = model  # its variables, tracked into the SavedModel
    if classes is not None:
        spec = tf.TensorSpec(inputs[0].shape, tf.uint8, name="images")

        @tf.function(input_signature=[spec])
        def serve(images):
            logits = tf.cast(model(tf.cast(images, model.inputs[0].dtype), training=False),
                             tf.float32)
            probabilities = tf.nn.softmax(logits)
            names = tf.constant(classes)  # a constant of the graph
            return {"probabilities": probabilities,
                    "classes": tf.gather(names, tf.argmax(probabilities, axis=-1))}

        described = (f"uint8 images {_shape(spec.shape)} in; probabilities "
                     f"{_shape(model.output_shape)} and classes (one of {len(classes)} names) out")
    else:
        output_names = list(getattr(model, "output_names", None) or [])

        @tf.function(input_signature=inputs)
        def serve(*tensors):
            outputs = model(tensors[0] if len(tensors) == 1 else list(tensors), training=False)
            if isinstance(outputs, dict):
                return outputs
            if isinstance(outputs, (list, tuple)):  # a signature returns named tensors
                names = output_names if len(output_names) == len(outputs) else [
                    f"outputs_{index}" for index in range(len(outputs))]
                return dict(zip(names, outputs))
            return {"outputs": outputs}

        described = (", ".join(f"{spec.name} {spec.dtype.name} {_shape(spec.shape)}"
                               for spec in inputs) + " in; the model's outputs out")
    serving.serve = serve
    try:
        tf.saved_model.save(serving, path, signatures={SIGNATURE: serve})
    except (ValueError, TypeError) as error:  # a call TensorFlow cannot trace or save
        raise UserError(f"cannot write the model's call as a SavedModel: "
                        f"{as_one_line(error)}") from None
    return described


def _input_name(tensor, index: int) -> str:
    name = getattr(tensor, "name", "") or f"input_{index}"
    return name.split(":")[0].replace("/", "_")


def _shape(shape) -> str:
    return "[" + ", ".join("batch" if size is None else str(size) for size in shape) + "]"


def _horovod_ops(path: str) -> list[str]:
    """The names of horovod's ops the SavedModel's graph and functions hold."""
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as file:
        saved.ParseFromString(file.read())
    ops = set()
    for meta_graph in saved.meta_graphs:
        ops.update(node.op for node in meta_graph.graph_def.node)
        for function in meta_graph.graph_def.library.function:
            ops.update(node.op for node in function.node_def)
    return sorted(op for op in ops if op.startswith("Horovod"))


if __name__ == "__main__":
    sys.exit(main())
