"""The recipe's optimizer and learning-rate schedule, as the flags (or a job's ``Task``) ask.

Horovod wraps whatever this returns (``Runtime.distribute_optimizer``): every rank's gradients
are averaged before the optimizer sees them, so whatever the optimizer does with them (clipping,
weight decay, momentum) is the same on every rank and means on 64 ranks what it means on one.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain.training.config import TrainConfig
from hvdtrain.errors import UserError
from hvdtrain.training.plan import TrainingPlan

#: Callbacks that set the optimizer's rate, which then must be a plain number.
RATE_SETTERS = ("ReduceLROnPlateau", "LearningRateScheduler")

#: Keras' own default where the flag is not given.
DEFAULT_MOMENTUM = {"sgd": 0.9, "rmsprop": 0.0}
DEFAULT_WEIGHT_DECAY = {"adamw": 0.004}

#: The flags that shape the built-in optimizer, refused when a job builds its own.
OPTIMIZER_FLAGS = ("optimizer", "momentum", "nesterov", "weight_decay", "decay_all_weights",
                   "clipnorm", "global_clipnorm")


def learning_rate_schedule(plan: TrainingPlan, settable: bool = False):
    """Linear warm-up from the base to the scaled rate (Goyal et al.), then the plan's decay:
    cosine to zero, constant, or steps at milestones. ``settable`` (a job callback sets the
    rate: ReduceLROnPlateau): a plain number, which needs no warm-up and a constant rate.

    A schedule runs inside the compiled step, unlike horovod's LearningRateWarmupCallback, a
    Python call per batch. It is a function of ``optimizer.iterations``, which a resume sets to
    the steps done (epochs x this plan's steps per epoch, and the steps of the next epoch a
    checkpoint within it holds): the rate follows the epochs on any world size.
    """
    warmup = plan.warmup_steps
    if settable:
        if plan.lr_decay != "constant" or warmup:
            raise UserError("the job's callbacks set the learning rate (ReduceLROnPlateau, "
                            "LearningRateScheduler), which a warm-up or a decay computes: pass "
                            "--warmup-epochs 0 --lr-decay constant")
        return plan.learning_rate
    if plan.lr_decay == "step":
        return WarmupThenSteps(plan.base_learning_rate if warmup else plan.learning_rate,
                               plan.learning_rate, warmup, plan.lr_milestone_steps, plan.lr_gamma)
    # Keras' CosineDecay does warm-up and decay; alpha=1 turns its decay into a constant.
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=plan.base_learning_rate if warmup else plan.learning_rate,
        decay_steps=max(1, plan.total_steps - warmup),
        alpha=0.0 if plan.lr_decay == "cosine" else 1.0,
        warmup_target=plan.learning_rate if warmup else None,
        warmup_steps=warmup,
    )


def sets_the_rate(callbacks: list) -> bool:
    """Whether one of a job's callbacks sets the optimizer's rate (Keras' own, or a subclass)."""
    return any(klass.__name__ in RATE_SETTERS for callback in callbacks
               for klass in type(callback).__mro__)


def rate_factor(written_under: dict | None, plan: TrainingPlan) -> float:
    """This plan's scaled rate over the one a checkpoint was written under (its ``ckpt-N.json``
    or an older run's config.json plan; 1 when unknown)."""
    previous = (written_under or {}).get("learning_rate")
    return plan.learning_rate / previous if previous else 1.0


def rescale_rate(optimizer, factor: float) -> None:
    """Multiply an optimizer's plain (non-schedule) learning rate by ``factor``, on every rank
    alike (the factor is rank 0's)."""
    if factor != 1.0:
        optimizer.learning_rate = float(np.asarray(optimizer.learning_rate)) * factor


class WarmupThenSteps(keras.optimizers.schedules.LearningRateSchedule):
    """``initial`` to ``peak`` linearly over ``warmup_steps`` (CosineDecay's warm-up), then
    ``peak`` times ``gamma`` to the power of the milestones passed (Goyal et al.'s ResNet-50:
    milestones at epochs 30, 60, 80, gamma 0.1)."""

    def __init__(self, initial: float, peak: float, warmup_steps: int,
                 milestones: tuple[int, ...], gamma: float):
        super().__init__()
        self.initial, self.peak, self.warmup_steps = initial, peak, warmup_steps
        self.milestones, self.gamma = tuple(milestones), gamma

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        passed = tf.reduce_sum(tf.cast(step >= tf.constant(self.milestones or (2.0**62,),
                                                           tf.float32), tf.float32))
        decayed = self.peak * tf.pow(tf.constant(self.gamma, tf.float32), passed)
        if not self.warmup_steps:
            return decayed
        warming = self.initial + (self.peak - self.initial) * step / self.warmup_steps
        return tf.where(step < self.warmup_steps, warming, decayed)

    def get_config(self):
        return {"initial": self.initial, "peak": self.peak, "warmup_steps": self.warmup_steps,
                "milestones": list(self.milestones), "gamma": self.gamma}


def build_optimizer(config: TrainConfig, learning_rate, model: keras.Model, task_optimizer=None):
    """The optimizer before horovod wraps it: the job's own (``Task.optimizer``, given the
    schedule) or the one the flags name, with its weight-decay exclusions set."""
    if task_optimizer is not None:
        given = [f"--{name.replace('_', '-')}" for name in OPTIMIZER_FLAGS
                 if getattr(config, name) != _default(config, name)]
        if given:
            raise UserError(f"the job builds its own optimizer (Task.optimizer); "
                            f"{', '.join(given)} shape(s) the built-in one: set it in the job's "
                            "optimizer instead")
        optimizer = task_optimizer(learning_rate)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise UserError(f"the task's optimizer builder must return a Keras optimizer, got "
                            f"{type(optimizer).__name__}")
        return optimizer
    name = config.optimizer
    clipping = {"clipnorm": config.clipnorm, "global_clipnorm": config.global_clipnorm}
    decay = weight_decay(config)
    if name == "adam":
        optimizer = keras.optimizers.Adam(learning_rate=learning_rate, **clipping)
    elif name == "adamw":
        optimizer = keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=decay,
                                           **clipping)
    elif name == "sgd":
        optimizer = keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum(config),
                                         nesterov=config.nesterov, weight_decay=decay or None,
                                         **clipping)
    else:
        optimizer = keras.optimizers.RMSprop(learning_rate=learning_rate,
                                             momentum=momentum(config),
                                             weight_decay=decay or None, **clipping)
    if decay and not config.decay_all_weights:
        # Biases and normalization scales and offsets are not decayed (Goyal et al.; Loshchilov
        # & Hutter's AdamW): decaying a batch norm's scale fights the normalization.
        optimizer.exclude_from_weight_decay(var_list=undecayed(model))
    return optimizer


def momentum(config: TrainConfig) -> float:
    return DEFAULT_MOMENTUM[config.optimizer] if config.momentum is None else config.momentum


def weight_decay(config: TrainConfig) -> float:
    if config.weight_decay is None:
        return DEFAULT_WEIGHT_DECAY.get(config.optimizer, 0.0)
    return config.weight_decay


def undecayed(model: keras.Model) -> list:
    """Weights of fewer than two dimensions: biases, normalization scales and offsets."""
    return [variable for variable in model.trainable_variables if len(variable.shape) < 2]


def describe_optimizer(config: TrainConfig, model: keras.Model, own: bool) -> str:
    """The banner's optimizer line."""
    if own:
        return "optimizer: the job's own (Task.optimizer), averaged over the ranks by horovod"
    name = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop"}[config.optimizer]
    parts = [name]
    if config.optimizer in DEFAULT_MOMENTUM:
        parts.append(f"momentum {momentum(config):g}" + (" (Nesterov)" if config.nesterov else ""))
    decay = weight_decay(config)
    if decay:
        skipped = 0 if config.decay_all_weights else len(undecayed(model))
        parts.append(f"weight decay {decay:g} (decoupled"
                     + (f"; {skipped} bias/norm weight(s) not decayed)" if skipped else ")"))
    if config.clipnorm is not None:
        parts.append(f"clip norm {config.clipnorm:g} per weight")
    if config.global_clipnorm is not None:
        parts.append(f"global clip norm {config.global_clipnorm:g}")
    label_smoothing = getattr(config, "label_smoothing", 0.0)
    if label_smoothing:
        parts.append(f"label smoothing {label_smoothing:g}")
    return "optimizer: " + ", ".join(parts) + (
        " (of the ranks' averaged gradients)" if config.clipnorm or config.global_clipnorm else "")


def _default(config: TrainConfig, name: str):
    field = next(f for f in dataclasses.fields(config) if f.name == name)
    return field.default
