"""The training job across real ranks: `mpirun -np 2 pytest` runs these as 2 horovod ranks.

Under plain `pytest` the same tests run as a world of one. Every test exchanges its ranks'
results before asserting (conftest.gather_checked), so a failure fails all ranks together.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import numpy as np
import pytest
import tf_keras as keras

from conftest import LAUNCHED_RANKS, gather_checked
from hvdtrain import train
from hvdtrain.cnn import CLASSIFIER
from hvdtrain.config import TrainConfig, tiny
from hvdtrain.data import build_pipelines, list_data, shard_records
from hvdtrain.models.cnn import build_cnn
from hvdtrain.plan import make_plan

pytestmark = pytest.mark.timeout(300)


def config_in(run_dir, **changes) -> TrainConfig:
    return dataclasses.replace(tiny(), **{"run_dir": str(run_dir), "tensorboard": False,
                                          **changes})


def state_of(model) -> list[np.ndarray]:
    optimizer_variables = model.optimizer.variables
    if callable(optimizer_variables):
        optimizer_variables = optimizer_variables()
    return [v.numpy() for v in list(model.variables) + list(optimizer_variables)]


def assert_same_on_all_ranks(per_rank: list[list[np.ndarray]], what: str):
    for rank, values in enumerate(per_rank[1:], start=1):
        assert len(values) == len(per_rank[0])
        for index, (mine, theirs) in enumerate(zip(per_rank[0], values)):
            np.testing.assert_allclose(theirs, mine, rtol=1e-6, atol=1e-7,
                                       err_msg=f"{what}: rank {rank} differs at variable {index}")


def test_the_world_is_what_the_launcher_started(runtime):
    worlds = gather_checked(runtime, lambda: runtime.world)
    assert [w.size for w in worlds] == [LAUNCHED_RANKS] * LAUNCHED_RANKS
    assert sorted(w.rank for w in worlds) == list(range(LAUNCHED_RANKS))
    assert [w.is_chief for w in worlds].count(True) == 1


def test_shards_are_disjoint_and_cover_the_training_set(runtime):
    listing = list_data(TrainConfig())

    def my_ids():
        records = shard_records(listing.train, runtime.world, seed=0, by_file=False)
        return [int(index) for index, _ in records.as_numpy_iterator()]

    shards = gather_checked(runtime, my_ids)
    everything = [i for shard in shards for i in shard]
    assert len(everything) == len(set(everything)), "a sample landed on two ranks"
    assert sorted(everything) == sorted(listing.train.sources.tolist())


@pytest.mark.parametrize("extra", [1, 3])
def test_sizes_that_do_not_divide_give_every_rank_the_same_steps(runtime, extra):
    size = runtime.world.size
    samples = 4 * size + extra
    listing = list_data(TrainConfig(data="synthetic", synthetic_samples=samples,
                                    validation_fraction=0.0))

    def steps_this_rank_can_run():
        plan = make_plan(batch_size=2, batch_policy="per-worker", learning_rate=1e-3,
                         lr_scaling="linear", warmup_epochs=0, grad_accum_steps=1, epochs=1,
                         num_workers=size, num_train_samples=samples, num_validation_samples=0)
        pipelines = build_pipelines(listing, runtime.world, batch_size=2,
                                    validation_batch_size=2, validation_steps=0, seed=0,
                                    cache=True)
        delivered = sum(1 for _ in pipelines.train.take(3 * plan.steps_per_epoch))
        return plan.steps_per_epoch, delivered

    results = gather_checked(runtime, steps_this_rank_can_run)
    assert len({steps for steps, _ in results}) == 1
    assert all(delivered == 3 * steps for steps, delivered in results)


def test_uneven_data_trains_to_the_end(runtime, shared_dir):
    size = runtime.world.size
    config = config_in(shared_dir, data="synthetic", synthetic_samples=3 * size + 1,
                       validation_fraction=0.0, batch_size=1, epochs=2)
    results = gather_checked(runtime, lambda: train.run("test", config, runtime, CLASSIFIER).rows)
    assert len(results[0]) == 2  # rank 0 logged both epochs; nobody hung


def test_one_step_leaves_every_rank_identical_and_only_rank_0_writes(runtime, tmp_path):
    # Each rank gets its own run directory and its own random initial weights: the broadcast must
    # equalise them, the allreduce keep them equal, and only rank 0's directory may fill up.
    seeded = dataclasses.replace(
        CLASSIFIER, build_model=lambda listing: (
            keras.utils.set_random_seed(1000 + runtime.world.rank),
            build_cnn(listing.image_shape, len(listing.class_names)))[1])
    config = config_in(tmp_path / "run", epochs=1, steps_per_epoch=1, tensorboard=True)

    def one_step():
        result = train.run("test", config, runtime, seeded)
        files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
        return state_of(result.model), files

    results = gather_checked(runtime, one_step)
    assert_same_on_all_ranks([state for state, _ in results], "after one step")
    chief_files, other_files = results[0][1], [files for _, files in results[1:]]
    for expected in ("run/config.json", "run/metrics.csv", "run/metrics.json", "run/curves.png",
                     "run/model.keras", "run/checkpoints/checkpoint"):
        assert expected in chief_files
    assert any(name.startswith("run/tensorboard/") for name in chief_files)
    assert other_files == [[]] * (runtime.world.size - 1), "a rank other than 0 wrote files"


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


def test_compression_accumulation_and_mixed_precision_keep_ranks_in_step(runtime, shared_dir):
    config = config_in(shared_dir, epochs=2, steps_per_epoch=4, fp16_allreduce=True,
                       grad_accum_steps=2, precision="mixed_float16", export=False)

    def run():
        try:
            result = train.run("test", config, runtime, CLASSIFIER)
        finally:
            keras.mixed_precision.set_global_policy("float32")  # global: don't leak it
        schedule = train.learning_rate_schedule(result.plan, config.lr_decay)
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


def _send_usr1_once_the_run_listens():
    """SIGUSR1 to this process once hvdtrain's handler is installed (as Slurm would send it)."""
    deadline = time.monotonic() + 120
    while signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.SIG_IGN, None):
        if time.monotonic() > deadline:
            return
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGUSR1)


def test_only_rank_0_writes_in_every_path(runtime, tmp_path):
    """Autoencoder picture and exports, and a run stopped by a signal: rank 0 writes, alone."""
    from hvdtrain.autoencoder import RECONSTRUCTOR, write_reconstructions
    from hvdtrain.autoencoder import tiny as autoencoder_tiny

    def run_every_path():
        autoencoder = dataclasses.replace(autoencoder_tiny(), epochs=1,
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
