"""Which batches each rank feeds: hvdtrain's image data (listed on rank 0, planned, sharded), or
a job's own datasets (built per rank, counted, and refused unless every rank feeds the same)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from hvdtrain.training.config import ImageConfig, TrainConfig
from hvdtrain.data import ImageDatasets, build_pipelines, choose_data_cache, load_listing
from hvdtrain.errors import UserError
from hvdtrain.training.plan import TrainingPlan, make_plan, per_worker_batch
from hvdtrain.runtime import Runtime
from hvdtrain.task import Datasets, Shard, Task
from hvdtrain.timeline import Timeline
from hvdtrain.training.profile import InputWait


def image_data(config: TrainConfig, runtime: Runtime, timeline: Timeline,
               input_wait: InputWait | None = None
               ) -> tuple[TrainingPlan, ImageDatasets, tuple[str, ...]]:
    """The image data the flags name: rank 0 lists and checks it, everyone plans and shards."""
    if not isinstance(config, ImageConfig):
        raise UserError("this task reads hvdtrain's image data, which needs an ImageConfig "
                        "(or give the Task a datasets builder)")
    listing = load_listing(config, runtime)
    plan = plan_for(config, runtime, listing.train.num_samples, listing.validation.num_samples)
    timeline.mark("data_listed")
    # A process driving several replicas (tf.distribute) feeds all of them: Keras splits its
    # batch between the replicas. A horovod rank feeds exactly one.
    per_process = runtime.world.replicas_per_process
    validation_batch_size = plan.validation_batch_size * per_process
    # Each rank sizes its own cache against its node's memory: nodes may differ, and no rank
    # waits for another to decide. The banner shows rank 0's choice.
    validation_samples = (listing.samples_for_rank(listing.validation, runtime.world,
                                                   seed=config.seed, by_file=False)
                          if validation_batch_size else 0)
    cache = choose_data_cache(listing, runtime.world, config.cache,
                              budget_gb=config.cache_budget_gb,
                              validation_samples=validation_samples, augment=config.augment)
    datasets = build_pipelines(
        listing, runtime.world,
        batch_size=plan.per_worker_batch_size * per_process,
        validation_batch_size=validation_batch_size, seed=config.seed, cache=cache,
        tfrecord_sharding=config.tfrecord_sharding, augment=config.augment,
        threads=runtime.devices.threads, prefetch_to=runtime.devices.prefetch_to,
        input_wait=input_wait)
    return plan, datasets, (*listing.notes, cache.describe())


def task_data(config: TrainConfig, runtime: Runtime, task: Task,
              input_wait: InputWait | None = None
              ) -> tuple[TrainingPlan, Datasets, tuple[str, ...]]:
    """A job's own datasets: built per rank for the planned batch, then counted and agreed on."""
    world = runtime.world
    try:
        per_worker = per_worker_batch(config.batch_size, config.batch_policy, world.num_replicas)
    except ValueError as error:
        raise UserError(str(error)) from None
    batch_size = per_worker * world.replicas_per_process
    datasets = task.datasets(Shard(rank=world.rank, num_shards=world.size, batch_size=batch_size,
                                   validation_batch_size=batch_size, seed=config.seed,
                                   config=config))
    if not isinstance(datasets, Datasets):
        raise UserError(f"the task's datasets builder must return hvdtrain.Datasets, got "
                        f"{type(datasets).__name__}")
    check_elements(datasets)
    steps, validation_steps = agreed_batches(runtime, datasets, config.steps_per_epoch)
    global_batch = per_worker * world.num_replicas
    plan = plan_for(config, runtime, steps * global_batch,
                    validation_steps * global_batch)
    # Endless, so that every epoch (Keras stops each after steps_per_epoch) has its batches.
    train = datasets.train if datasets.train.cardinality() == tf.data.INFINITE_CARDINALITY \
        else datasets.train.repeat()
    if input_wait is not None:
        train = input_wait.timed(train)
    validation = datasets.validation if validation_steps else None
    return plan, dataclasses.replace(datasets, train=train, validation=validation), ()


def plan_for(config: TrainConfig, runtime: Runtime, num_train_samples: int,
             num_validation_samples: int) -> TrainingPlan:
    try:
        return make_plan(
            batch_size=config.batch_size, batch_policy=config.batch_policy,
            learning_rate=config.learning_rate, lr_scaling=config.lr_scaling,
            warmup_epochs=config.warmup_epochs, grad_accum_steps=config.grad_accum_steps,
            epochs=config.epochs, num_workers=runtime.world.num_replicas,
            num_train_samples=num_train_samples, num_validation_samples=num_validation_samples,
            steps_per_epoch=config.steps_per_epoch, lr_decay=config.lr_decay,
            lr_milestones=config.milestone_epochs(), lr_gamma=config.lr_gamma)
    except ValueError as error:
        raise UserError(str(error)) from None


def check_elements(datasets: Datasets) -> None:
    """Keras trains on (inputs, targets) or (inputs, targets, sample_weights) elements; anything
    else would end in a traceback inside fit. Every rank builds the same structure, so every rank
    refuses alike (before the first collective)."""
    for split, dataset in (("training", datasets.train), ("validation", datasets.validation)):
        if dataset is None:
            continue
        spec = dataset.element_spec
        if isinstance(spec, tuple) and len(spec) in (2, 3):
            continue
        raise UserError(f"the task's {split} dataset must yield (inputs, targets) or (inputs, "
                        f"targets, sample_weights) tuples; its elements are "
                        f"{_describe_element(spec)}")


def _describe_element(spec) -> str:
    if isinstance(spec, tf.TensorSpec):
        return f"single tensors of shape {spec.shape} ({spec.dtype.name})"
    if isinstance(spec, dict):
        return f"dicts with keys {', '.join(map(str, spec))}"
    if isinstance(spec, tuple):
        return f"tuples of {len(spec)}"
    return type(spec).__name__


def agreed_batches(runtime: Runtime, datasets: Datasets, steps_per_epoch: int | None
                   ) -> tuple[int, int]:
    """(training batches per epoch, validation batches) that every rank feeds; ``UserError`` on
    every rank when the ranks' pipelines disagree or cannot be counted.

    A collective. A rank with fewer batches would finish its epoch (or its validation) first and
    leave the others waiting in an allreduce forever, so unequal counts are refused before the
    first step. ``steps_per_epoch`` (the flag) replaces the training count: hvdtrain then repeats
    the training data and every rank takes exactly that many batches.
    """
    mine = (_cardinality(datasets.train),
            _cardinality(datasets.validation) if datasets.validation is not None else 0)
    everyone = runtime.allgather_object(mine)
    infinite, unknown = int(tf.data.INFINITE_CARDINALITY), int(tf.data.UNKNOWN_CARDINALITY)
    train_counts, validation_counts = [c[0] for c in everyone], [c[1] for c in everyone]
    if steps_per_epoch is None:
        if infinite in train_counts:
            raise UserError("the training dataset repeats forever; pass --steps-per-epoch, or "
                            "return one epoch of batches (hvdtrain repeats it)")
        _require_equal("training", train_counts, unknown)
        if train_counts[0] == 0:
            raise UserError("the training dataset has no batches (fewer samples than one batch "
                            "per rank?)")
        steps_per_epoch = train_counts[0]
    if infinite in validation_counts:
        raise UserError("the validation dataset repeats forever; it must end (it runs in full "
                        "every epoch)")
    _require_equal("validation", validation_counts, unknown)
    return steps_per_epoch, validation_counts[0]


def _cardinality(dataset: tf.data.Dataset) -> int:
    return int(dataset.cardinality())


def _require_equal(split: str, counts: list[int], unknown: int) -> None:
    if unknown in counts:
        rank = counts.index(unknown)
        raise UserError(
            f"cannot count the {split} batches of rank {rank} (a filter or a generator hides the "
            "count); declare it with dataset.apply(tf.data.experimental.assert_cardinality(N))"
            + (" or pass --steps-per-epoch" if split == "training" else ""))
    if len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
        raise UserError(
            f"the ranks' {split} datasets have different numbers of batches ({per_rank}); every "
            "rank must feed the same number (shard, then batch with drop_remainder=True and take() "
            "the smallest rank's count)"
            + (", or pass --steps-per-epoch" if split == "training" else ""))


def model_data(datasets: Datasets, task: Task
               ) -> tuple[tf.data.Dataset, tf.data.Dataset | None]:
    """(training, validation) data as the model sees it: the task's ``to_pairs`` applied."""
    train, validation = datasets.train, datasets.validation
    if task.to_pairs is not None:
        train = with_targets(train, task.to_pairs)
        validation = with_targets(validation, task.to_pairs) if validation is not None else None
    return train, validation


def with_targets(dataset: tf.data.Dataset, to_pairs: Callable) -> tf.data.Dataset:
    """Apply a task's (images, labels) -> (inputs, targets), keeping sample weights if any."""
    if len(dataset.element_spec) == 3:
        return dataset.map(lambda images, labels, weights: (*to_pairs(images, labels), weights))
    return dataset.map(to_pairs)
