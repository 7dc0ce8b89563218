"""The model: built in the backend's scope, compiled with the distributed optimizer (XLA kept
off horovod's collectives), and what rank 0 exports once training ends."""
from __future__ import annotations

import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain import KERAS
from hvdtrain.training.config import TrainConfig
from hvdtrain.errors import UserError, as_one_line
from hvdtrain.rundir import MODEL_FILE, WEIGHTS_FILE, RunDir
from hvdtrain.runtime import Runtime
from hvdtrain.task import Datasets, Task
from hvdtrain.training.optimizers import build_optimizer


#: --jit-compile as each Keras' compile takes it. "auto" is Keras 3's own rule (XLA where
#: TensorFlow lists a GPU); tf_keras' None compiles the optimizer's update only.
KERAS_JIT_COMPILE = {"3": {"auto": "auto", "on": True, "off": False},
                     "2": {"auto": None, "on": True, "off": False}}


def build_and_compile(config: TrainConfig, runtime: Runtime, task: Task, datasets: Datasets,
                      element_spec, schedule) -> keras.Model:
    """The task's model, its variables and the optimizer's slots created, compiled with the
    distributed optimizer. ``element_spec`` is what the model trains on: (inputs, targets[, w])."""
    with runtime.scope():
        try:
            model = task.build_model(datasets)
        except ValueError as error:  # the data does not fit the model (e.g. its image size)
            raise UserError(str(error)) from None
        if not isinstance(model, keras.Model):
            raise UserError(f"the task's build_model must return a keras.Model, got "
                            f"{type(model).__name__}")
        create_variables(model, element_spec[0])
        optimizer = build_optimizer(config, schedule, model, task.optimizer)
        if KERAS == "3" and keras.mixed_precision.global_policy().name == "mixed_float16":
            # Keras 3's compile would wrap the distributed optimizer in a LossScaleOptimizer,
            # whose inf/NaN check would then come before the ranks' average (see
            # runtime/keras3.py); wrapped here, the average comes first. tf_keras' own wrapping
            # already lets horovod's optimizer average first.
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        optimizer = runtime.distribute_optimizer(
            optimizer,
            fp16_allreduce=config.fp16_allreduce, grad_accum_steps=config.grad_accum_steps)
        # Samples read from files carry a weight (0 for one that did not decode, see
        # data.pipeline.DecodeFailures): the metrics must honour it as the loss does.
        weighted = len(datasets.train.element_spec) == 3
        model.compile(optimizer=optimizer, loss=task.loss(),
                      metrics=None if weighted else task.metrics(),
                      weighted_metrics=task.metrics() if weighted else None,
                      steps_per_execution=runtime.steps_per_call(config.steps_per_execution),
                      jit_compile=KERAS_JIT_COMPILE[KERAS][config.jit_compile])
        if config.jit_compile == "on" and not model.jit_compile:
            # Keras only warns, and trains without XLA.
            raise UserError("--jit-compile on, but a layer of this model says it does not "
                            "support XLA (supports_jit = False); use --jit-compile auto or off")
        # Compiled with XLA, the step must not hold the ranks' average (its ops have no XLA
        # kernel): the runtime splits the step around it.
        split = runtime.keep_collectives_out_of_xla(model)
        if model.jit_compile:
            why = ("Keras' choice: TensorFlow lists a GPU" if config.jit_compile == "auto"
                   else "--jit-compile on")
            runtime.print0(f"xla: the training step is compiled ({why})" + (
                "; the ranks' gradient average runs between its two compiled parts" if split
                else ""))
        # Create the optimizer's slots now, so a checkpoint restores them immediately and the
        # broadcast in restore_or_start covers them.
        model.optimizer.build(model.trainable_variables)
    return model


def create_variables(model: keras.Model, input_spec) -> None:
    """Create the variables of a model that makes them at its first call (a subclassed model, a
    Sequential without an Input): call it once on a batch of zeros shaped like the data.

    The optimizer's slots, the checkpoint restore and rank 0's broadcast all need the variables
    to exist before the first step; Keras would otherwise create them inside it, on each rank
    from its own random initialisation, and the optimizer would not know them.
    """
    if model.built:
        return

    def zeros(spec):
        return tf.zeros([1, *spec.shape[1:]], spec.dtype)  # one sample: the batch size is free

    try:
        model(tf.nest.map_structure(zeros, input_spec), training=False)
    except Exception as error:  # noqa: BLE001 - the model's own code
        raise UserError(f"the model could not be built from the data's inputs {input_spec}: "
                        f"{as_one_line(error)}") from None


def seed_and_precision(config: TrainConfig, runtime: Runtime) -> str:
    """Seed this rank's random draws and set Keras' precision policy; returns the precision
    ('fp32', 'mixed_float16', 'mixed_bfloat16')."""
    # Each rank draws its own dropout masks and augmentations (seed + rank): identical draws would
    # make N ranks N copies of one sample's noise. Weights still start equal: rank 0's are
    # broadcast by restore_or_start.
    keras.utils.set_random_seed(config.seed + runtime.world.rank)
    precision = runtime.default_precision() if config.precision == "auto" else config.precision
    keras.mixed_precision.set_global_policy("float32" if precision == "fp32" else precision)
    return precision


def exported(run_dir: RunDir) -> str | None:
    """The file an earlier export wrote (model.keras or the weights), or None."""
    return next((name for name in (MODEL_FILE, WEIGHTS_FILE) if run_dir.exists(name)), None)


def export(model: keras.Model, run_dir: RunDir) -> str | None:
    """Rank 0, after the last epoch: ``model.keras``, or the weights when the model has no config.

    Every epoch and checkpoint is done by now, so nothing here may fail the run: a model that
    cannot be rebuilt from its config (a subclassed model without ``get_config``, a layer whose
    config lacks its constructor's arguments) gets ``model.weights.h5`` instead, which loads into
    the same model built in code. Returns the line saying so, or None for ``model.keras``.
    """
    try:
        run_dir.write_with(MODEL_FILE, inference_copy(model).save, suffix=".keras")
        return None
    except Exception as error:  # noqa: BLE001 - whatever the model's own code raises
        reason = as_one_line(error)
    run_dir.write_with(WEIGHTS_FILE, model.save_weights, suffix=".weights.h5")
    return (f"model: wrote {run_dir.file(WEIGHTS_FILE)}, not {MODEL_FILE}: the model cannot be "
            f"rebuilt from its config ({reason}); build it in code and load_weights() this file")


def inference_copy(model: keras.Model) -> keras.Model:
    """The model's architecture and weights, uncompiled: what ``model.keras`` holds.

    No optimizer (the distributed one is a class made on the fly) and no compile state (a job's
    own loss or metric functions would not deserialize in a serving or fine-tuning process).
    """
    if KERAS == "3":
        # Keras 3's clone_model recompiles the clone from the original's compile config. Its
        # from_config finds layer classes by registered name: the model's own classes are named
        # here, so a user's unregistered layer (defined in a --model file) rebuilds too.
        classes = {type(layer).__name__: type(layer)
                   for layer in model._flatten_layers(include_self=True, recursive=True)}
        with keras.saving.custom_object_scope(classes):
            copy = type(model).from_config(model.get_config())
    else:
        copy = keras.models.clone_model(model)
    copy.set_weights(model.get_weights())
    return copy
