"""The data-parallel arithmetic, in one pure function: batch sizes, learning rate, steps.

Nothing here touches TensorFlow or horovod, so every rule is unit-tested on its own and rank 0 can
print exactly what the job will do before it starts.

Conventions (docs/training.md's "Scaling" says the same for users):

* A *worker* is one model replica: a horovod rank, or one device of a tf.distribute strategy.
* ``--batch-size`` is the batch the base learning rate was tuned for. Its meaning depends on the
  batch policy: per worker (the global batch grows with workers) or for the whole job.
* One optimizer *update* consumes ``global_batch_size * grad_accum_steps`` samples. The learning
  rate is scaled by that number relative to ``--batch-size`` (linearly, by square root, or not).
* The learning-rate schedule counts *steps* (batches), as ``optimizer.iterations`` does: horovod
  advances it on every backward pass, also those that only accumulate. A resume sets that count
  to epochs done x this plan's steps per epoch (plus the steps of the next epoch a checkpoint
  within it holds), so the schedule is a function of training progress (epochs), whatever the
  world size was when the checkpoint was written.
* A resume on another world size re-plans from the same flags (``resize_notes`` says what moved):
  with ``global`` the global batch, the update size and so the learning rate stay; with
  ``per-worker`` the global batch follows the workers and the rate is rescaled by the scaling
  rule, exactly as for a fresh start at that size.
* Every worker runs the same number of steps per epoch, computed from the *global* sample count,
  so a shard that is one sample shorter than another can never leave a rank waiting.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TrainingPlan:
    num_workers: int
    """Model replicas taking part (horovod ranks x devices per rank)."""
    per_worker_batch_size: int
    """Samples each worker processes per step."""
    global_batch_size: int
    """Samples processed per step by all workers together."""
    grad_accum_steps: int
    """Steps (backward passes) per optimizer update."""
    samples_per_update: int
    """global_batch_size x grad_accum_steps: what the learning rate is scaled for."""
    base_learning_rate: float
    learning_rate: float
    """The scaled learning rate reached after warm-up."""
    lr_scale_factor: float
    steps_per_epoch: int
    """Batches per worker per epoch, identical on every worker."""
    warmup_steps: int
    """Steps over which the learning rate ramps from the base to the scaled rate."""
    total_steps: int
    validation_batch_size: int
    """Per-worker validation batch (smaller than the training batch only for tiny sets); 0
    means no validation."""
    validation_steps: int
    """Validation batches of the worker with the largest share (the last one partial): every
    validation sample is validated once per epoch, in one worker's share."""
    num_train_samples: int
    num_validation_samples: int
    lr_decay: str = "cosine"
    """After warm-up: 'cosine' (to zero at total_steps), 'constant' or 'step'."""
    lr_milestone_steps: tuple[int, ...] = ()
    """'step': the steps at which the rate is multiplied by ``lr_gamma`` (the milestone epochs
    times this plan's steps per epoch, so they stay at their epochs on any world size)."""
    lr_gamma: float = 0.1

    @property
    def samples_per_epoch(self) -> int:
        return self.steps_per_epoch * self.global_batch_size

    def describe(self) -> list[str]:
        """The start-up banner lines rank 0 prints."""
        lines = [
            f"workers: {self.num_workers}",
            f"batch: {self.per_worker_batch_size} per worker x {self.num_workers} workers = "
            f"{self.global_batch_size} global"
            + (f", x {self.grad_accum_steps} accumulation steps = {self.samples_per_update} "
               "samples per update" if self.grad_accum_steps > 1 else ""),
            f"learning rate: {self.base_learning_rate:g} x {self.lr_scale_factor:g} = "
            f"{self.learning_rate:g}"
            + (f", warm-up over {self.warmup_steps} steps" if self.warmup_steps else "")
            + f", then {self.describe_decay()}",
            f"steps per epoch: {self.steps_per_epoch} ({self.samples_per_epoch} of "
            f"{self.num_train_samples} training samples)",
        ]
        if self.validation_steps:
            lines.append(f"validation: each of the {self.num_validation_samples} samples once, "
                         f"in up to {self.validation_steps} batch(es) of "
                         f"{self.validation_batch_size} per worker")
        elif self.num_validation_samples:
            lines.append(f"validation: none ({self.num_validation_samples} held-out sample(s), "
                         f"fewer than the {self.num_workers} workers)")
        else:
            lines.append("validation: none (no held-out samples)")
        return lines

    def describe_decay(self) -> str:
        """'cosine to 0 at step 360', 'constant', 'x0.1 at steps 300, 600 (epochs 30, 60)'."""
        if self.lr_decay == "cosine":
            return f"cosine to 0 at step {self.total_steps}"
        if self.lr_decay == "step":
            epochs = ", ".join(f"{step / self.steps_per_epoch:g}"
                               for step in self.lr_milestone_steps)
            return (f"x{self.lr_gamma:g} at steps "
                    f"{', '.join(map(str, self.lr_milestone_steps))} (epochs {epochs})")
        return "constant"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: What a resume on another world size can change, as the banner names it.
RESIZE_FIELDS = (("num_workers", "worker(s)"), ("global_batch_size", "global batch"),
                 ("per_worker_batch_size", "batch per worker"),
                 ("learning_rate", "learning rate"), ("steps_per_epoch", "steps per epoch"))


def resize_notes(previous: dict | None, plan: TrainingPlan) -> list[str]:
    """What differs between the plan a checkpoint was written under (config.json's ``plan``,
    or None) and this one: ``['worker(s) 4 -> 2', 'global batch 128 -> 64', ...]``."""
    if not previous:
        return []
    current = plan.to_dict()
    return [f"{label} {previous[name]:g} -> {current[name]:g}"
            for name, label in RESIZE_FIELDS
            if name in previous and previous[name] != current[name]]


def per_worker_batch(batch_size: int, batch_policy: str, num_workers: int) -> int:
    """Samples each worker takes per step under ``batch_policy``; ``ValueError`` when impossible."""
    if num_workers < 1:
        raise ValueError(f"need at least one worker, got {num_workers}")
    if batch_policy == "per-worker":
        return batch_size
    if batch_policy == "global":
        if batch_size % num_workers:
            raise ValueError(
                f"global batch {batch_size} does not divide by {num_workers} workers; use a "
                f"multiple of {num_workers} or --batch-policy per-worker")
        return batch_size // num_workers
    raise ValueError(f"unknown batch policy {batch_policy!r}")


def make_plan(*, batch_size: int, batch_policy: str, learning_rate: float, lr_scaling: str,
              warmup_epochs: float, grad_accum_steps: int, epochs: int, num_workers: int,
              num_train_samples: int, num_validation_samples: int,
              steps_per_epoch: int | None = None, lr_decay: str = "cosine",
              lr_milestones: tuple[float, ...] = (), lr_gamma: float = 0.1) -> TrainingPlan:
    """Derive everything the job needs from the user's numbers; ``ValueError`` when impossible."""
    per_worker_batch_size = per_worker_batch(batch_size, batch_policy, num_workers)
    global_batch_size = per_worker_batch_size * num_workers
    if num_train_samples < global_batch_size:
        raise ValueError(
            f"{num_train_samples} training samples are fewer than one global batch "
            f"({per_worker_batch_size} per worker x {num_workers} workers = {global_batch_size}); "
            "use a smaller --batch-size or fewer workers")

    samples_per_update = global_batch_size * grad_accum_steps
    ratio = samples_per_update / batch_size
    lr_scale_factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[lr_scaling]

    # Every worker takes the same number of steps, derived from the global count: the shards may
    # differ by one sample, and a rank that stops early would leave the others in an allreduce.
    derived_steps = num_train_samples // global_batch_size
    steps = steps_per_epoch or derived_steps
    total_steps = max(1, epochs * steps)
    # Warm-up ends at least one step before the end, so the scaled rate is actually reached.
    warmup_steps = max(0, min(math.ceil(warmup_epochs * steps), total_steps - 1))

    # Validation takes every sample once: each worker its share (the shares differ by one
    # sample at most), the last batch partial. Unlike training it runs no collective, so a worker
    # may run one batch more than another; the epoch's metrics weigh each rank by its samples
    # (training/callbacks.py, ValidationShare). A set smaller than the workers would leave a
    # worker nothing to report: no validation then.
    largest_share = -(-num_validation_samples // num_workers)
    validation_batch_size = (min(per_worker_batch_size, largest_share)
                             if num_validation_samples >= num_workers else 0)
    validation_steps = (-(-largest_share // validation_batch_size)
                        if validation_batch_size else 0)
    return TrainingPlan(
        num_workers=num_workers,
        per_worker_batch_size=per_worker_batch_size,
        global_batch_size=global_batch_size,
        grad_accum_steps=grad_accum_steps,
        samples_per_update=samples_per_update,
        base_learning_rate=learning_rate,
        learning_rate=learning_rate * lr_scale_factor,
        lr_scale_factor=lr_scale_factor,
        steps_per_epoch=steps,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        validation_batch_size=validation_batch_size,
        validation_steps=validation_steps,
        num_train_samples=num_train_samples,
        num_validation_samples=num_validation_samples,
        lr_decay=lr_decay,
        # Epochs to steps of this plan: a milestone stays at its epoch whatever the world size.
        lr_milestone_steps=tuple(round(epoch * steps) for epoch in lr_milestones),
        lr_gamma=lr_gamma,
    )
