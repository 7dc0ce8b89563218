"""hvdtrain's own horovod integration for Keras 3 (``--keras 3``), on collectives passed in.

Stock ``horovod.tensorflow.keras`` works only with Keras 2 (horovod issue 4290; hvdtrain's
build runs it on Keras 3 for users' scripts, patches 0005-0006, but hvdtrain's jobs keep the
integration they were built and measured with), so for Keras 3 the horovod backend (``runtime/horovod.py``, still the only module that imports horovod) hands the
two pieces below its TensorFlow allreduce. They do what horovod's Keras API does for Keras 2:

* ``distribute_optimizer``: the optimizer averages every gradient over the ranks before it
  updates, inside the compiled step; optionally in float16 on the wire; optionally after
  accumulating several backward passes, with the update horovod's ``backward_passes_per_step``
  makes (the mean of the accumulated gradients; ``iterations`` advances on every pass).
* ``MetricAverage``: the epoch's metrics averaged over the ranks before later callbacks read them.
* ``keep_collectives_out_of_xla``: a model whose step Keras compiles with XLA (``jit_compile``,
  which Keras' "auto" turns on wherever TensorFlow lists a GPU) keeps XLA for the step's compute
  and runs the average outside it: horovod's ops have no XLA kernel (docs/stack.md).

``Allreduce`` is ``(tensor, *, fp16_compression, name) -> tensor averaged over the ranks``.
"""
from __future__ import annotations

import types
from typing import Callable

import keras
import tensorflow as tf

Allreduce = Callable[..., tf.Tensor]


class _AveragedGradients:
    """Mixed into the class of the optimizer it distributes (``distribute_optimizer``).

    The average comes first, before anything the optimizer does with the gradients: a
    LossScaleOptimizer checks them for inf/NaN and skips the update when it finds any. On
    gradients that differ per rank, ranks could disagree, one would skip the update (and, with
    accumulation, the next allreduce) and the other wait for it forever; averaged, every rank
    decides the same.
    """

    _hvdtrain_allreduce: Allreduce
    _hvdtrain_fp16: bool
    _hvdtrain_accumulation: "_Accumulation | None"

    def build(self, variables):
        super().build(variables)
        if self._hvdtrain_accumulation is not None:
            self._hvdtrain_accumulation.create(variables)

    #: While the compiled part of a split step runs Keras' train_step (``_SplitStep``): where
    #: its optimizer call leaves the gradients, to be averaged outside XLA. None otherwise.
    _hvdtrain_capture: "types.SimpleNamespace | None" = None
    #: The base optimizer's update as an XLA function (``_CompiledUpdate``), or None: in a
    #: split step the update after the average is compiled too.
    _hvdtrain_compiled_update: "_CompiledUpdate | None" = None

    def apply(self, grads, trainable_variables=None):
        grads = [_dense(gradient) for gradient in grads]
        if self._hvdtrain_capture is not None:
            if self._hvdtrain_capture.grads is not None:
                # Each call would need an average of its own between compiled parts.
                raise ValueError("the model's train_step calls the optimizer more than once per "
                                 "step: it cannot train with XLA under horovod (use "
                                 "--jit-compile off)")
            self._hvdtrain_capture.grads = grads
            self._hvdtrain_capture.variables = trainable_variables
            return None
        accumulation = self._hvdtrain_accumulation
        variables = trainable_variables if trainable_variables is not None \
            else self._trainable_variables
        if not self.built:
            # Its variables made here, outside any compiled function of a split step.
            self.build(variables)
            self.built = True
        if accumulation is None:
            return self._hvdtrain_update(self._hvdtrain_average(grads), variables)
        passes = accumulation.add(grads)

        def update():
            # The mean over the accumulated passes and over the ranks, as horovod's
            # backward_passes_per_step with average_aggregated_gradients.
            # A variable without a gradient (unused by the loss) keeps none, as in Keras.
            mean = [None if gradient is None else total / accumulation.steps
                    for gradient, total in zip(grads, accumulation.totals())]
            self._hvdtrain_update(self._hvdtrain_average(mean), variables)
            accumulation.clear()
            return tf.constant(True)

        def accumulate_only():
            # Horovod advances the step counter on passes that only accumulate, so the learning
            # rate schedule counts backward passes on both Keras paths.
            self.iterations.assign_add(1)
            return tf.constant(False)

        # Every rank makes the same number of passes, so all take the same branch together.
        tf.cond(passes >= accumulation.steps, update, accumulate_only)

    def _hvdtrain_update(self, grads, variables):
        """The base optimizer's update of the averaged gradients (a LossScaleOptimizer's
        inf/NaN check included), compiled with XLA in a split step."""
        if self._hvdtrain_compiled_update is None:
            return super().apply(grads, variables)
        return self._hvdtrain_compiled_update(grads, variables)

    def _hvdtrain_average(self, grads):
        return [None if gradient is None else
                self._hvdtrain_allreduce(gradient, fp16_compression=self._hvdtrain_fp16,
                                         name=f"hvdtrain_gradient_{index}")
                for index, gradient in enumerate(grads)]


class _Accumulation:
    """Per-variable gradient sums and a pass counter, outside the optimizer's own variables.

    Kept out of ``optimizer.variables`` and of checkpoints, as horovod keeps its own: they are
    zero at every update, and a checkpoint is written between epochs.
    """

    def __init__(self, steps: int):
        self.steps = steps
        self._sums: list[tf.Variable] = []
        self._passes = tf.Variable(0, dtype=tf.int64, trainable=False, name="hvdtrain_passes")

    def create(self, variables) -> None:
        """One zero sum per trainable variable (gradients have their variable's shape and dtype)."""
        self._sums = [tf.Variable(tf.zeros(variable.shape, variable.dtype), trainable=False,
                                  name=f"hvdtrain_gradient_sum_{index}")
                      for index, variable in enumerate(variables)]

    def add(self, grads) -> tf.Tensor:
        """Add one backward pass; returns the passes accumulated so far."""
        for total, gradient in zip(self._sums, grads, strict=True):
            if gradient is not None:
                total.assign_add(tf.cast(gradient, total.dtype))
        return self._passes.assign_add(1)

    def totals(self) -> list:
        return [total.read_value() for total in self._sums]

    def clear(self) -> None:
        for total in self._sums:
            total.assign(tf.zeros_like(total))
        self._passes.assign(0)


def _dense(gradient):
    # Embedding gradients come as IndexedSlices; averaged and accumulated as dense tensors
    # (horovod's sparse_as_dense), which every optimizer and the loss-scale check accept.
    return tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient


def distribute_optimizer(optimizer: keras.optimizers.Optimizer, allreduce: Allreduce, *,
                         fp16_allreduce: bool, grad_accum_steps: int
                         ) -> keras.optimizers.Optimizer:
    """``optimizer``, now averaging its gradients over the ranks (the same object, a subclass).

    A subclass made on the fly (as horovod does for Keras 2) rather than a wrapper object: the
    optimizer stays what Keras expects, so ``compile`` keeps a LossScaleOptimizer given to it
    instead of wrapping it again (which would put the loss-scale check before the average), and
    its variables, checkpoints and ``iterations`` are untouched. Build a mixed_float16 model's
    LossScaleOptimizer before calling this.
    """
    if getattr(optimizer, "gradient_accumulation_steps", None):
        raise ValueError("the optimizer accumulates gradients itself (gradient_accumulation_steps);"
                         " use --grad-accum-steps instead, which averages over the ranks once "
                         "per update")
    base = type(optimizer)
    # Serialized under the base's name and module (Keras 3's clone_model recompiles the clone from
    # that, and model.keras stores it): a saved model names the plain optimizer, which loads in
    # any process, with or without horovod.
    optimizer.__class__ = type(base.__name__, (_AveragedGradients, base),
                               {"__module__": base.__module__, "__qualname__": base.__qualname__})
    optimizer._hvdtrain_allreduce = allreduce
    optimizer._hvdtrain_fp16 = fp16_allreduce
    optimizer._hvdtrain_accumulation = (_Accumulation(grad_accum_steps) if grad_accum_steps > 1
                                        else None)
    return optimizer


class _CompiledUpdate:
    """An optimizer's own update (its base class's ``apply``) as one XLA function.

    Keras variables cannot be arguments of a tf.function: it closes over the variables of its
    first call, which are the model's trainable variables on every step."""

    def __init__(self, optimizer: _AveragedGradients):
        self.variables: list | None = None
        self.function = tf.function(
            lambda grads: super(_AveragedGradients, optimizer).apply(grads, self.variables),
            jit_compile=True, reduce_retracing=True)

    def __call__(self, grads, variables):
        if self.variables is None:
            self.variables = list(variables)
        elif [id(v) for v in self.variables] != [id(v) for v in variables]:
            raise ValueError("the optimizer updates other variables than on its first step")
        return self.function(grads)


def keep_collectives_out_of_xla(model: keras.Model) -> bool:
    """Split a compiled model's train step around horovod's average (call after ``compile``);
    whether it did.

    When Keras compiles the step with XLA (``model.jit_compile``) and the optimizer averages over
    the ranks (``distribute_optimizer``), the whole step would be one XLA function holding
    horovod's allreduce, which has no XLA kernel: the first step fails ("No registered
    'HorovodAllreduce' OpKernel for XLA_GPU_JIT devices"). Instead, the step Keras builds is a
    plain tf.function holding three parts: the model class's own ``train_step`` (forward pass,
    loss and its tracker, loss scaling, gradients, metrics: Keras' semantics, or the user's own
    step) compiled with XLA, its optimizer call only handing the gradients out; horovod's average
    of them, outside XLA; the optimizer's update compiled with XLA. Evaluation and prediction
    keep Keras' own compiled steps (they hold no collective). steps_per_execution loops over the
    split step as over Keras' own. A train_step of one's own that calls the optimizer more than
    once per step is refused; one that reads the weights after its optimizer call sees them
    before the update (Keras' own step only computes its metrics from the predictions).
    """
    optimizer = model.optimizer
    if not model.jit_compile or not isinstance(optimizer, _AveragedGradients):
        return False
    class_step = type(model).train_step
    # Not a list: Keras tracks lists set on a layer or an optimizer, and would copy it.
    captured = types.SimpleNamespace(grads=None, variables=None)

    def compute(data):
        optimizer._hvdtrain_capture = captured
        try:
            logs = class_step(model, data)
        finally:
            optimizer._hvdtrain_capture = None
        if captured.grads is None:
            raise ValueError(f"{type(model).__name__}.train_step made no optimizer call: it "
                             "cannot train with XLA under horovod (use --jit-compile off)")
        grads, captured.grads = captured.grads, None
        return logs, grads

    compiled_compute = tf.function(compute, jit_compile=True, reduce_retracing=True)
    optimizer._hvdtrain_compiled_update = _CompiledUpdate(optimizer)

    def train_step(data):
        logs, grads = compiled_compute(data)
        optimizer.apply(grads, captured.variables)  # the average, then the compiled update
        return logs

    keras_make_train_function = model.make_train_function

    def make_train_function(force=False):
        if not model.jit_compile or model.optimizer is not optimizer:
            # Compiled again, without XLA or with another optimizer: Keras' own step again.
            del model.train_step, model.make_train_function
            return model.make_train_function(force)
        # Keras reads jit_compile once, as it wraps the step in its tf.function: off for the
        # outer step only, whose compiled parts are the two above.
        model.jit_compile = False
        try:
            return keras_make_train_function(force)
        finally:
            model.jit_compile = True

    model.train_step = train_step
    model.make_train_function = make_train_function
    return True


class MetricAverage(keras.callbacks.Callback):
    """The epoch's logs (training and validation metrics) averaged over the ranks, in place.

    First in the callback list, so that the checkpoint, the metrics file and early stopping read
    the job's metrics, not rank 0's shard's. One allreduce for all values, in a fixed order.
    """

    def __init__(self, allreduce: Allreduce):
        super().__init__()
        self.allreduce = allreduce

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(logs)
        values = tf.constant([float(logs[name]) for name in names], dtype=tf.float64)
        averaged = self.allreduce(values, fp16_compression=False,
                                  name="hvdtrain_epoch_metrics").numpy()
        for name, value in zip(names, averaged):
            logs[name] = float(value)
