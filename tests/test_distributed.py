"""The training job across real ranks: `mpirun -np 2 pytest` runs these as 2 horovod ranks.

Under plain `pytest` (and `make test-fast`) the same tests run as a world of one, except those
that compare ranks, or train runs about what ranks do together (resume, compression, XLA, rank
0's writes, mixed precision, the plateau rate, the input wait) (`multi_rank`): they skip there.
Only the 2-rank pass runs those (`make test`, `make test-mpi`): a world of one would repeat its
runs on the same cores without the ranks they are about (and, but for gradient accumulation,
without horovod: a world of one keeps the plain optimizer). Every test exchanges its ranks'
results before asserting (conftest.gather_checked), so a failure fails all ranks together.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import threading
import time

import numpy as np
import pytest
import keras  # the Keras conftest's hvdtrain import selected

import hvdtrain

from conftest import LAUNCHED_RANKS, assert_same_on_all_ranks, gather_checked, multi_rank
from hvdtrain.training import checkpoint, train
from hvdtrain.cnn import CLASSIFIER
from hvdtrain.cnn import tiny
from hvdtrain.training.config import ImageConfig
from hvdtrain.data import build_pipelines, list_data
from hvdtrain.errors import UserError
from hvdtrain.models.cnn import build_cnn
from hvdtrain.training.plan import make_plan
from hvdtrain.training.optimizers import learning_rate_schedule

pytestmark = pytest.mark.timeout(300)


def config_in(run_dir, **changes) -> ImageConfig:
    # No rank logs: they would redirect this pytest process's own output for good.
    return dataclasses.replace(tiny(), **{"run_dir": str(run_dir), "tensorboard": False,
                                          "rank_logs": False, **changes})


def state_of(model) -> list[np.ndarray]:
    """The model's weights and the optimizer's state. Not Keras 3's dropout seed generators:
    random-number state each rank draws its own masks from (as tf_keras keeps outside its
    variables), which no checkpoint holds on either Keras."""
    optimizer_variables = model.optimizer.variables
    if callable(optimizer_variables):
        optimizer_variables = optimizer_variables()
    return [v.numpy() for v in list(model.variables) + list(optimizer_variables)
            if "seed_generator" not in getattr(v, "path", v.name)]


def test_the_world_is_what_the_launcher_started(runtime):
    worlds = gather_checked(runtime, lambda: runtime.world)
    assert [w.size for w in worlds] == [LAUNCHED_RANKS] * LAUNCHED_RANKS
    assert sorted(w.rank for w in worlds) == list(range(LAUNCHED_RANKS))
    assert [w.is_chief for w in worlds].count(True) == 1


def test_ranks_copy_through_horovods_fusion_buffer_with_checked_copies(runtime):
    # Set before hvd.init() unless the user did (tests/conftest.py leaves it unset): on a GPU
    # rank horovod then copies with cudaMemcpyAsync, which is checked, instead of its own
    # unchecked batched kernel (horovod#2230).
    values = gather_checked(runtime, lambda: os.environ.get("HOROVOD_BATCH_D2D_MEMCOPIES"))
    assert values == ["0"] * LAUNCHED_RANKS


@multi_rank
def test_shards_are_disjoint_and_cover_the_training_set(runtime):
    listing = list_data(ImageConfig())

    def my_ids():
        records = listing.shard_records(listing.train, runtime.world, seed=0, by_file=False)
        return [int(index) for index, _ in records.as_numpy_iterator()]

    shards = gather_checked(runtime, my_ids)
    everything = [i for shard in shards for i in shard]
    assert len(everything) == len(set(everything)), "a sample landed on two ranks"
    assert sorted(everything) == sorted(listing.train.sources.tolist())


@multi_rank
@pytest.mark.parametrize("extra", [1, 3])
def test_sizes_that_do_not_divide_give_every_rank_the_same_steps(runtime, extra):
    size = runtime.world.size
    samples = 4 * size + extra
    listing = list_data(ImageConfig(data="synthetic", synthetic_samples=samples,
                                    validation_fraction=0.0))

    def steps_this_rank_can_run():
        plan = make_plan(batch_size=2, batch_policy="per-worker", learning_rate=1e-3,
                         lr_scaling="linear", warmup_epochs=0, grad_accum_steps=1, epochs=1,
                         num_workers=size, num_train_samples=samples, num_validation_samples=0)
        pipelines = build_pipelines(listing, runtime.world, batch_size=2,
                                    validation_batch_size=0, seed=0)
        delivered = sum(1 for _ in pipelines.train.take(3 * plan.steps_per_epoch))
        return plan.steps_per_epoch, delivered

    results = gather_checked(runtime, steps_this_rank_can_run)
    assert len({steps for steps, _ in results}) == 1
    assert all(delivered == 3 * steps for steps, delivered in results)


@multi_rank
def test_uneven_data_trains_to_the_end(runtime, shared_dir):
    size = runtime.world.size
    config = config_in(shared_dir, data="synthetic", synthetic_samples=3 * size + 1,
                       validation_fraction=0.0, batch_size=1, epochs=2)
    results = gather_checked(runtime, lambda: train.run("test", config, runtime, CLASSIFIER).rows)
    assert len(results[0]) == 2  # rank 0 logged both epochs; nobody hung


@pytest.fixture(scope="module")
def one_step(runtime, tmp_path_factory):
    """One training step on every rank, from its own random initial weights and in its own run
    directory: every rank's (model and optimizer state, files in its directory)."""
    root = tmp_path_factory.mktemp("one-step")
    seeded = dataclasses.replace(
        CLASSIFIER, build_model=lambda data: (
            keras.utils.set_random_seed(1000 + runtime.world.rank),
            build_cnn(data.image_shape, len(data.class_names)))[1])
    config = config_in(root / "run", epochs=1, steps_per_epoch=1, tensorboard=True)

    def run():
        result = train.run("test", config, runtime, seeded)
        files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        return state_of(result.model), files

    return gather_checked(runtime, run)


@multi_rank
def test_one_step_from_different_weights_leaves_every_rank_identical(one_step):
    # The broadcast must equalise the initial weights and the allreduce keep them equal.
    assert_same_on_all_ranks([state for state, _ in one_step], "after one step")


def test_only_rank_0_writes_the_outputs_of_a_step(runtime, one_step):
    chief_files, other_files = one_step[0][1], [files for _, files in one_step[1:]]
    for expected in ("run/config.json", "run/metrics.csv", "run/metrics.json", "run/curves.png",
                     "run/model.keras", "run/checkpoints/checkpoint"):
        assert expected in chief_files
    assert any(name.startswith("run/tensorboard/") for name in chief_files)
    assert other_files == [[]] * (runtime.world.size - 1), "a rank other than 0 wrote files"


@multi_rank
def test_resume_continues_at_the_next_epoch_with_the_optimizer_state(runtime, shared_dir):
    first = gather_checked(runtime, lambda: state_of(
        train.run("test", config_in(shared_dir, epochs=2), runtime, CLASSIFIER).model))

    # Asking for the same 2 epochs again restores and trains nothing: every rank must now hold
    # exactly the weights *and* optimizer state (Adam moments, iteration count) of the first run.
    def restored_state():
        result = train.run("test", config_in(shared_dir, epochs=2), runtime, CLASSIFIER)
        return result.initial_epoch, state_of(result.model)

    restored = gather_checked(runtime, restored_state)
    assert [epoch for epoch, _ in restored] == [2] * runtime.world.size
    assert_same_on_all_ranks([first[0]] + [state for _, state in restored], "restored state")

    def continued():
        result = train.run("test", config_in(shared_dir, epochs=3), runtime, CLASSIFIER)
        return (result.initial_epoch, [row["epoch"] for row in result.rows],
                int(result.model.optimizer.iterations.numpy()), result.plan.steps_per_epoch)

    outcomes = gather_checked(runtime, continued)
    initial_epoch, epochs_logged, iterations, steps = outcomes[0]
    assert initial_epoch == 2
    assert epochs_logged == [1, 2, 3]
    assert iterations == 3 * steps  # the counter (and so the LR schedule) carried on
    assert len({o[2] for o in outcomes}) == 1


@multi_rank
def test_compression_accumulation_and_mixed_precision_keep_ranks_in_step(runtime, shared_dir):
    """The settings of a GPU job, with its batches prefetched to a device as a GPU rank's are
    (runtime.base.configure_devices: prefetch_to its GPU; here the CPU device, the same
    transformation through the same Keras fit)."""
    config = config_in(shared_dir, epochs=2, steps_per_epoch=4, fp16_allreduce=True,
                       grad_accum_steps=2, precision="mixed_float16", export=False)

    def run():
        devices = runtime.devices
        runtime.devices = dataclasses.replace(devices, prefetch_to="/cpu:0")
        try:
            result = train.run("test", config, runtime, CLASSIFIER)
        finally:
            runtime.devices = devices
            keras.mixed_precision.set_global_policy("float32")  # global: don't leak it
        schedule = learning_rate_schedule(result.plan)
        return (state_of(result.model), [row["loss"] for row in result.rows],
                int(result.model.optimizer.iterations.numpy()), result.plan,
                float(schedule(result.plan.warmup_steps)))

    results = gather_checked(runtime, run)
    assert_same_on_all_ranks([r[0] for r in results], "fp16 allreduce + accumulation")
    chief_losses, iterations, plan, peak_rate = results[0][1:]
    assert len(chief_losses) == 2 and all(np.isfinite(chief_losses))
    # The schedule counts steps, as horovod advances optimizer.iterations on every backward pass
    # (also those that only accumulate): warm-up ends at the scaled rate after its steps.
    assert iterations == 2 * 4 == plan.total_steps
    assert plan.warmup_steps == 2  # tiny preset: half an epoch
    assert peak_rate == pytest.approx(plan.learning_rate)


NO_DROPOUT_MODEL = """
from hvdtrain.models.cnn import build_cnn


def build(input_shape, num_classes):
    return build_cnn(input_shape, num_classes, dropout=0.0)
"""


@multi_rank
def test_xla_compiles_the_step_around_the_ranks_average(runtime, shared_dir):
    """--jit-compile on with a GPU job's settings (mixed_float16 and its loss scaling, fp16
    allreduce, gradient accumulation, steps_per_execution): the step is compiled in two parts
    with horovod's average between them (one XLA function holding it fails at the first step),
    the ranks stay identical, and the job agrees with --jit-compile off. Without dropout: XLA
    draws other random numbers than TensorFlow's kernels."""
    if runtime.world.is_chief:
        (shared_dir / "no_dropout.py").write_text(NO_DROPOUT_MODEL)
    runtime.barrier()
    settings = dict(epochs=1, steps_per_epoch=4, precision="mixed_float16", fp16_allreduce=True,
                    grad_accum_steps=2, steps_per_execution=2, export=False,
                    validation_fraction=0.1, model=f"{shared_dir / 'no_dropout.py'}:build")

    def run(jit_compile):
        config = config_in(shared_dir / f"jit-{jit_compile}", jit_compile=jit_compile,
                           **settings)
        try:
            result = train.run("test", config, runtime, CLASSIFIER)
        finally:
            keras.mixed_precision.set_global_policy("float32")  # global: don't leak it
        return (bool(result.model.jit_compile), state_of(result.model),
                result.rows[-1] if result.rows else None,  # rank 0 keeps the metrics
                int(result.model.optimizer.iterations.numpy()))

    if hvdtrain.KERAS == "2":  # horovod's Keras 2 optimizer averages inside the step: refused
        refused = gather_checked(runtime, lambda: pytest.raises(UserError, run, "on").value)
        assert all("--jit-compile on compiles the whole step" in str(e) for e in refused)
        return
    off, on = (gather_checked(runtime, lambda: run(jit)) for jit in ("off", "on"))
    assert [r[0] for r in off] == [False] * LAUNCHED_RANKS
    assert [r[0] for r in on] == [True] * LAUNCHED_RANKS
    assert_same_on_all_ranks([r[1] for r in on], "XLA, split around the average")
    assert on[0][3] == off[0][3] == 4
    for metric in ("loss", "val_loss"):
        assert on[0][2][metric] == pytest.approx(off[0][2][metric], rel=0.01), metric


def _send_usr1_once_the_run_listens():
    """SIGUSR1 to this process once hvdtrain's handler is installed (as Slurm would send it)."""
    deadline = time.monotonic() + 120
    while signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN, None):
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGUSR1)


@multi_rank
def test_only_rank_0_writes_in_every_path(runtime, tmp_path):
    """Autoencoder picture and exports, and a run stopped by a signal: rank 0 writes, alone."""
    from hvdtrain.autoencoder import RECONSTRUCTOR, write_reconstructions
    from hvdtrain.autoencoder import tiny as autoencoder_tiny

    def run_every_path():
        autoencoder = dataclasses.replace(autoencoder_tiny(), epochs=1, rank_logs=False,
                                          run_dir=str(tmp_path / "autoencoder"))
        write_reconstructions(train.run("test", autoencoder, runtime, RECONSTRUCTOR), runtime)
        # Only the last rank receives the signal, and early (while the data is listed): all
        # ranks must still stop together, before training, without dying of it.
        if runtime.world.rank == runtime.world.size - 1:
            threading.Thread(target=_send_usr1_once_the_run_listens, daemon=True).start()
        stopped = train.run("test", config_in(tmp_path / "stopped", epochs=50), runtime,
                            CLASSIFIER)
        files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
        return stopped.exit_code, stopped.rows, files

    results = gather_checked(runtime, run_every_path)
    assert [code for code, _, _ in results] == [75] * runtime.world.size
    assert results[0][1] == []  # stopped before the first epoch
    chief_files = results[0][2]
    assert "autoencoder/cpu.png" in chief_files and "autoencoder/model.keras" in chief_files
    assert "stopped/config.json" in chief_files
    assert "stopped/model.keras" not in chief_files  # a stopped run exports nothing
    assert [files for _, _, files in results[1:]] == [[]] * (runtime.world.size - 1)


#: The loss scale's variable: tf_keras' current_loss_scale, Keras 3's .../dynamic_scale.
LOSS_SCALE = re.compile(r"(^|/)(current_loss_scale|dynamic_scale)\b")


def loss_scale_of(model) -> float:
    """The dynamic loss scale a mixed_float16 model's optimizer currently applies."""
    scales = [v for v in checkpoint.training_state(model) if LOSS_SCALE.search(v.name)]
    assert len(scales) == 1
    return float(scales[0].numpy())


@multi_rank
@pytest.mark.parametrize("grad_accum_steps", [1, 2])
def test_a_resumed_mixed_precision_run_keeps_every_rank_identical(runtime, shared_dir,
                                                                   grad_accum_steps):
    from hvdtrain.rundir import RunDir

    run_dir = shared_dir / f"accumulate-{grad_accum_steps}"
    config = config_in(run_dir, epochs=1, steps_per_epoch=4, precision="mixed_float16",
                       grad_accum_steps=grad_accum_steps, export=False)

    def first_run_with_a_lowered_loss_scale():
        try:
            model = train.run("test", config, runtime, CLASSIFIER).model
            if runtime.world.is_chief:
                # The state a long run reaches after overflows: a loss scale below the initial
                # 2**15. Rank 0 checkpoints it, as the epoch's own checkpoint would.
                scale = [v for v in checkpoint.training_state(model)
                         if LOSS_SCALE.search(v.name)][0]
                scale.assign(1024.0)
                checkpoint.Checkpoints(RunDir(run_dir, is_chief=True), model, keep=3).save(1)
        finally:
            keras.mixed_precision.set_global_policy("float32")

    def resumed():
        try:
            result = train.run("test", dataclasses.replace(config, epochs=3), runtime,
                               CLASSIFIER)
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return (result.initial_epoch, loss_scale_of(result.model),
                [v.numpy() for v in checkpoint.training_state(result.model)])

    gather_checked(runtime, first_run_with_a_lowered_loss_scale)
    results = gather_checked(runtime, resumed)
    assert [epoch for epoch, _, _ in results] == [1] * runtime.world.size
    # Every rank continued from rank 0's restored scale (it only grows after 2000 good steps),
    # and so applied the same updates: identical weights, optimizer and loss-scale state.
    assert all(scale <= 1024.0 for _, scale, _ in results), [s for _, s, _ in results]
    assert_same_on_all_ranks([state for _, _, state in results], "resumed mixed precision")


@multi_rank
def test_ranks_draw_their_own_dropout_masks_from_the_same_weights(runtime, tmp_path):
    config = config_in(tmp_path / "run", epochs=1, steps_per_epoch=2, export=False)

    def weights_and_a_dropout_mask():
        model = train.run("test", config, runtime, CLASSIFIER).model
        dropout = next(layer for layer in model.layers
                       if isinstance(layer, keras.layers.Dropout))
        # The next mask this rank's dropout draws, from the generator training.model.seed_and_precision seeded.
        mask = dropout(np.ones((1, 4096), np.float32), training=True).numpy() != 0
        return [w.numpy() for w in model.weights], mask

    results = gather_checked(runtime, weights_and_a_dropout_mask)
    assert_same_on_all_ranks([weights for weights, _ in results], "weights")
    masks = [mask for _, mask in results]
    assert all(0.7 < mask.mean() < 0.9 for mask in masks)  # rate 0.2: a real dropout mask
    for rank, mask in enumerate(masks[1:], start=1):
        assert not np.array_equal(mask, masks[0]), f"rank {rank} drew rank 0's dropout mask"


@multi_rank
def test_steps_per_execution_runs_that_many_steps_per_call(runtime, tmp_path):
    """Keras calls the batch hooks once per execution: 8 steps in calls of 4 are 2 hooks."""
    calls = {}

    def preemption_checks_per_epoch(steps_per_execution):
        counted = []
        real = runtime.max_over_ranks
        runtime.max_over_ranks = lambda value: counted.append(value) or real(value)
        try:
            config = config_in(tmp_path / f"spe{steps_per_execution}", epochs=1,
                               steps_per_epoch=8, steps_per_execution=steps_per_execution,
                               signal_check_every_steps=1, export=False)
            result = train.run("test", config, runtime, CLASSIFIER)
        finally:
            del runtime.max_over_ranks
        # One agreement before fit, then one per batch hook.
        return len(counted) - 1, int(result.model.optimizer.iterations.numpy())

    for steps_per_execution in (1, 4):
        calls[steps_per_execution] = gather_checked(
            runtime, lambda: preemption_checks_per_epoch(steps_per_execution))
    assert all(outcome == (8, 8) for outcome in calls[1])
    assert all(outcome == (2, 8) for outcome in calls[4])


@multi_rank
def test_epoch_metrics_are_the_mean_over_ranks(runtime):
    """The sync callbacks average each epoch's metrics: every rank reports the same mean."""
    features = np.random.default_rng(runtime.world.rank).normal(size=(64, 4)).astype("float32")
    targets = features.sum(axis=1, keepdims=True) * (1 + runtime.world.rank)

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.loss = None

        def on_epoch_end(self, epoch, logs=None):
            self.loss = float(logs["loss"])

    def local_and_synced_loss():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        before, after = Record(), Record()
        model.fit(features, targets, batch_size=16, epochs=1, verbose=0,
                  callbacks=[before, *runtime.sync_callbacks(), after])
        return before.loss, after.loss

    results = gather_checked(runtime, local_and_synced_loss)
    local_losses = [before for before, _ in results]
    assert len(set(local_losses)) == runtime.world.size  # the ranks' data did differ
    for _, synced in results:
        assert synced == pytest.approx(np.mean(local_losses), rel=1e-5)


def test_a_stall_ends_the_job_by_default(runtime):
    """hvd.init() ran with a stall shutdown limit: a stuck rank can never hang the job forever."""
    from hvdtrain.runtime.horovod import STALL_SHUTDOWN_SECONDS

    limits = gather_checked(runtime, lambda: os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"])
    assert limits == [str(STALL_SHUTDOWN_SECONDS)] * runtime.world.size


def test_the_recipe_clips_and_decays_the_ranks_averaged_gradient(runtime):
    """--global-clipnorm and --weight-decay act on the gradient averaged over the ranks, in the
    compiled step Keras' fit runs: one step of SGD from rank 0's weights, each rank on its own
    batch, moves the kernel by exactly lr x clip x (mean gradient / its norm) plus the kernel's
    own decay; the bias, which is not decayed, by its share of the clipped gradient only.
    Clipped before the average, the step would be shorter (the ranks' gradients differ)."""
    from hvdtrain.training.optimizers import build_optimizer

    rate, clip, decay = 0.1, 1e-3, 0.5
    config = dataclasses.replace(tiny(), optimizer="sgd", momentum=0.0, weight_decay=decay,
                                 global_clipnorm=clip)

    def one_step():
        keras.utils.set_random_seed(7 + runtime.world.rank)  # different data per rank
        # A bias of ones: decaying it (it must not be) would move it.
        model = keras.Sequential([keras.Input((3,)),
                                  keras.layers.Dense(2, bias_initializer="ones")])
        optimizer = runtime.distribute_optimizer(build_optimizer(config, rate, model),
                                                 fp16_allreduce=False, grad_accum_steps=1)
        model.compile(optimizer=optimizer, loss="mse")
        model.optimizer.build(model.trainable_variables)
        runtime.broadcast_variables(checkpoint.training_state(model))
        inputs = np.random.default_rng(runtime.world.rank).normal(size=(8, 3)).astype("float32")
        targets = np.random.default_rng(50 + runtime.world.rank).normal(size=(8, 2)).astype(
            "float32")
        before = [v.numpy() for v in model.trainable_variables]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(targets, model(inputs))
        mine = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
        gathered = runtime.allgather_object(mine)
        model.train_on_batch(inputs, targets)
        mean = [np.mean([rank[i] for rank in gathered], axis=0) for i in range(2)]
        scale = min(1.0, clip / np.sqrt(sum(float(np.sum(g * g)) for g in mean)))
        kernel, bias = before
        expected = [kernel - rate * decay * kernel - rate * scale * mean[0],
                    bias - rate * scale * mean[1]]
        after = [v.numpy() for v in model.trainable_variables]
        return [float(np.max(np.abs(a - e))) for a, e in zip(after, expected)], scale

    results = gather_checked(runtime, one_step)
    for errors, scale in results:
        assert scale < 1, "the gradient was not clipped: the test checks nothing"
        assert max(errors) < 1e-6, results


class StopOnOneRank(keras.callbacks.Callback):
    """A job's callback that reads rank-local state: it asks the last rank alone to stop, in
    the given epoch's batch (0-based)."""

    def __init__(self, rank: int, size: int, epoch: int, batch: int):
        super().__init__()
        self.asks = rank == size - 1
        self.epoch, self.batch, self.current = epoch, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.asks and self.current == self.epoch and batch == self.batch:
            self.model.stop_training = True


@multi_rank
def test_a_stop_the_jobs_callbacks_ask_for_ends_every_rank_together(runtime, tmp_path, capsys):
    """Task(callbacks=...): a stop asked for in a batch by one rank's callback stops every rank
    after the same step (none is left in an allreduce), keeps the last whole epoch's checkpoint
    and exports nothing; EarlyStopping, on the averaged metrics, ends the run after its epoch
    with the checkpoint, the model and a line saying why (that run with Task(optimizer=...))."""
    shared = runtime.broadcast_object(str(tmp_path))
    size = runtime.world.size

    def run(name, callbacks, epochs=4, optimizer=None):
        task = dataclasses.replace(CLASSIFIER, callbacks=callbacks, optimizer=optimizer)
        config = config_in(f"{shared}/{name}", epochs=epochs, signal_check_every_steps=4)
        result = train.run("test", config, runtime, task)
        outputs = sorted(os.listdir(result.run_dir.path)) if runtime.world.is_chief else []
        return (int(result.model.optimizer.iterations.numpy()), result.plan.steps_per_epoch,
                [row["epoch"] for row in result.rows], result.exit_code, outputs,
                checkpoint_epoch(result.run_dir.checkpoints) if runtime.world.is_chief else None,
                # Names: tf_keras' optimizer classes do not pickle for the gather.
                [cls.__name__ for cls in type(result.model.optimizer).__mro__],
                state_of(result.model))

    def checkpoint_epoch(directory):
        import tensorflow as tf

        return int(tf.train.load_variable(tf.train.latest_checkpoint(directory),
                                          "resume_epoch/.ATTRIBUTES/VARIABLE_VALUE"))

    cut = gather_checked(runtime, lambda: run(
        "cut", lambda: [StopOnOneRank(runtime.world.rank, size, epoch=1, batch=1)]))
    iterations, steps, epochs, exit_code, outputs, saved_epoch, _, _ = cut[0]
    assert len({result[0] for result in cut}) == 1, cut  # every rank stopped at the same step
    # The first check (every 4 steps of the run) at or after epoch 2's second batch.
    assert iterations == -(-(steps + 2) // 4) * 4, cut
    assert epochs == [1] and exit_code == 0 and saved_epoch == 1, cut
    assert "model.keras" not in outputs, outputs

    # With the job's own optimizer (Task.optimizer), given hvdtrain's scheduled rate.
    early = gather_checked(runtime, lambda: run("early", lambda: [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=100)],
        optimizer=lambda rate: keras.optimizers.SGD(rate, momentum=0.9)))
    iterations, steps, epochs, exit_code, outputs, saved_epoch, classes, _ = early[0]
    assert "SGD" in classes, classes
    assert_same_on_all_ranks([result[-1] for result in early], "the job's own optimizer")
    assert len({result[0] for result in early}) == 1, early
    assert iterations == 2 * steps and epochs == [1, 2] and saved_epoch == 2, early
    assert exit_code == 0 and "model.keras" in outputs, early
    printed = capsys.readouterr().out
    if runtime.world.is_chief:
        assert re.search(r"stopped in epoch 2: the job's callbacks asked to stop "
                         r"\(StopOnOneRank\); the epoch was cut short: the run keeps its last "
                         r"checkpoint, \S+/cut/checkpoints/ckpt-1, and exports no model",
                         printed), printed
        assert "stopped after epoch 2: val_loss did not improve for 1 epoch(s) (EarlyStopping" \
            in printed, printed


class NanFromBatch(keras.callbacks.Callback):
    """The classifier's loss (``loss``), NaN on the last rank alone from the given batch of the
    first epoch on. The same graph on every rank (horovod matches tensors by op name): a
    variable this callback sets tells the loss."""

    def __init__(self, rank: int, size: int, batch: int):
        import tensorflow as tf

        super().__init__()
        self.asks, self.batch = rank == size - 1, batch
        self.base = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.poisoned = tf.Variable(False, trainable=False)

    def on_train_batch_begin(self, batch, logs=None):
        if self.asks and batch == self.batch:
            self.poisoned.assign(True)

    def loss(self, labels, logits):
        import tensorflow as tf

        # Times NaN, so that its gradient is NaN too (a NaN constant's would be zero); times 1
        # before (tf.where over the two products would give a NaN gradient from the start).
        return self.base(labels, logits) * tf.where(self.poisoned, float("nan"), 1.0)


@multi_rank
def test_a_nan_one_rank_caught_never_reaches_a_checkpoint(runtime, tmp_path, capsys):
    """The last rank's loss turns NaN (its TerminateOnNaN asks to stop); the averaged gradient
    carries the NaN into every rank's weights while rank 0's own loss of that step is still
    finite, and the ranks agree to stop a few steps later. Rank 0, asked for a checkpoint every
    step, writes none of NaN weights: the run keeps its last finite one and says so."""
    import tensorflow as tf

    shared = runtime.broadcast_object(str(tmp_path))
    poison = NanFromBatch(runtime.world.rank, runtime.world.size, batch=5)
    task = dataclasses.replace(CLASSIFIER, loss=lambda: poison.loss,
                               callbacks=lambda: [poison, keras.callbacks.TerminateOnNaN()])
    config = config_in(f"{shared}/nan", epochs=2, signal_check_every_steps=4,
                       checkpoint_every_steps=1, steps_per_execution=1)

    def run():
        result = train.run("test", config, runtime, task)
        if not runtime.world.is_chief:
            return result.exit_code, None, None
        latest = tf.train.latest_checkpoint(result.run_dir.checkpoints)
        reader = tf.train.load_checkpoint(latest)
        finite = all(np.isfinite(reader.get_tensor(name)).all()
                     for name, dtype in reader.get_variable_to_dtype_map().items()
                     if dtype.is_floating)
        return result.exit_code, os.path.basename(latest), finite

    results = gather_checked(runtime, run)
    exit_code, latest, finite = results[0]
    # Steps 1-5 were checkpointed; the 6th averaged a NaN into the weights (rank 0's loss is
    # NaN from the 7th on, and the ranks agree at the 8th).
    assert exit_code == 0 and latest == "ckpt-5" and finite, results
    printed = capsys.readouterr().out
    if runtime.world.is_chief:
        assert printed.count("not writing a checkpoint: the model's weights hold NaN or "
                             "infinite values; the run keeps ") == 1, printed
        assert "the loss became NaN or infinite (TerminateOnNaN)" in printed, printed


@multi_rank
def test_a_rate_reduced_on_plateau_survives_a_resume_rescaled_to_the_new_plan(runtime,
                                                                                tmp_path):
    """A job with ReduceLROnPlateau (no warm-up, --lr-decay constant) gets a rate that is the
    optimizer's own variable, which the callback sets on every rank alike (it reads the averaged
    val_loss); the checkpoint keeps it, and a resume under a plan of another scaled rate (another
    world size: the checkpoint's ckpt-N.json says what it was written under) scales it by new
    rate / old rate. With a warm-up, such a job is refused in one line."""
    shared = runtime.broadcast_object(str(tmp_path))
    config = config_in(f"{shared}/plateau", epochs=2, warmup_epochs=0, lr_decay="constant")
    task = dataclasses.replace(CLASSIFIER, callbacks=lambda: [
        keras.callbacks.ReduceLROnPlateau(factor=0.5, patience=0, min_delta=100)])

    def first():
        result = train.run("test", config, runtime, task)
        return float(np.asarray(result.model.optimizer.learning_rate)), result.plan.learning_rate

    reduced = gather_checked(runtime, first)
    assert [rate for rate, _ in reduced] == pytest.approx(  # epoch 2 reduced it, everywhere
        [reduced[0][1] * 0.5] * runtime.world.size), reduced
    if runtime.world.is_chief:  # as if the checkpoint were written by half as many workers
        [written] = (tmp_path / "plateau" / "checkpoints").glob("ckpt-2.json")
        recorded = json.loads(written.read_text())
        recorded["learning_rate"] /= 2
        written.write_text(json.dumps(recorded))
    runtime.barrier()

    def resumed():
        result = train.run("test", dataclasses.replace(config, epochs=3), runtime, task)
        return result.initial_epoch, float(np.asarray(result.model.optimizer.learning_rate))

    outcomes = gather_checked(runtime, resumed)
    # Doubled back (the callback starts afresh: its first epoch is its best so far).
    assert outcomes == [(2, pytest.approx(reduced[0][1]))] * runtime.world.size, outcomes

    def warmed_up():
        with pytest.raises(UserError, match="pass --warmup-epochs 0 --lr-decay constant"):
            train.run("test", dataclasses.replace(config, run_dir=f"{shared}/warm",
                                                  warmup_epochs=1.0), runtime, task)

    gather_checked(runtime, warmed_up)


@multi_rank
def test_each_epoch_says_how_long_its_steps_waited_for_their_batches(runtime, tmp_path):
    """metrics.json splits every epoch's training time into the steps' wait for their batches
    and the rest; a pipeline slower than the step (50 ms a batch against a step of a few) is
    input-bound, and the summary line says so; the embedded digits, decoded in memory, are not.
    """
    import time as clock

    import tensorflow as tf

    shared = runtime.broadcast_object(str(tmp_path))

    def slow_batches(shard: hvdtrain.Shard) -> hvdtrain.Datasets:
        def slowly(images, labels):
            # A decode that takes 50 ms a batch, against a step of a few: whatever prefetch
            # Keras adds overlaps one step's worth of it.
            tf.py_function(lambda: clock.sleep(0.05), [], [])
            return images, labels

        images = np.zeros((6 * shard.batch_size, 8, 8, 1), np.uint8)
        labels = np.zeros((6 * shard.batch_size,), np.int64)
        train_set = (tf.data.Dataset.from_tensor_slices((images, labels))
                     .batch(shard.batch_size, drop_remainder=True).map(slowly))
        return hvdtrain.Datasets(train_set)

    def run(name, task):
        # Two epochs: the first one's time is mostly the step's compilation.
        config = config_in(f"{shared}/{name}", epochs=2, warmup_epochs=0)
        result = train.run("test", config, runtime, task)
        return result.rows[-1] if result.rows else {}, train.summary(result)

    slow = gather_checked(runtime, lambda: run("slow", dataclasses.replace(
        CLASSIFIER, datasets=slow_batches,
        build_model=lambda data: build_cnn((8, 8, 1), 10))))[0]
    quick = gather_checked(runtime, lambda: run("quick", CLASSIFIER))[0]
    row, summary_line = slow
    assert row["input_wait_seconds"] >= 6 * 0.05 * 0.5, row
    assert row["compute_seconds"] == pytest.approx(row["train_seconds"]
                                                   - row["input_wait_seconds"]), row
    assert "\ninput-bound: the last epoch's steps waited" in summary_line, summary_line
    row, summary_line = quick
    assert 0 <= row["input_wait_seconds"] < 0.25 * row["train_seconds"], row
    assert "input-bound" not in summary_line, summary_line
