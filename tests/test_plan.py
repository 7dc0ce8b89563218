"""The data-parallel arithmetic (pure: no TensorFlow, no horovod)."""
import pytest

from hvdtrain.training.plan import make_plan

BASE = dict(batch_size=32, batch_policy="per-worker", learning_rate=1e-3, lr_scaling="linear",
            warmup_epochs=1.0, grad_accum_steps=1, epochs=10, num_workers=1,
            num_train_samples=1438, num_validation_samples=359)


def plan(**changes):
    return make_plan(**{**BASE, **changes})


@pytest.mark.parametrize("workers", [1, 2, 4, 64])
def test_per_worker_policy_grows_global_batch_and_scales_lr_linearly(workers):
    p = plan(num_workers=workers, num_train_samples=100_000)
    assert p.per_worker_batch_size == 32
    assert p.global_batch_size == 32 * workers
    assert p.learning_rate == pytest.approx(1e-3 * workers)
    assert p.steps_per_epoch == 100_000 // (32 * workers)


def test_global_policy_splits_the_batch_and_keeps_the_rate():
    p = plan(batch_policy="global", batch_size=64, num_workers=4)
    assert (p.per_worker_batch_size, p.global_batch_size) == (16, 64)
    assert p.learning_rate == pytest.approx(1e-3)


def test_global_batch_must_divide_by_workers():
    with pytest.raises(ValueError, match="does not divide by 3 workers"):
        plan(batch_policy="global", batch_size=64, num_workers=3)


def test_sqrt_and_none_scaling():
    assert plan(num_workers=4, lr_scaling="sqrt").learning_rate == pytest.approx(2e-3)
    assert plan(num_workers=4, lr_scaling="none").learning_rate == pytest.approx(1e-3)


def test_gradient_accumulation_scales_by_samples_per_update():
    p = plan(num_workers=2, grad_accum_steps=4, num_train_samples=10_000)
    assert p.samples_per_update == 32 * 2 * 4
    assert p.learning_rate == pytest.approx(8e-3)
    # The schedule counts steps (backward passes), as optimizer.iterations does under horovod.
    assert p.total_steps == 10 * p.steps_per_epoch


@pytest.mark.parametrize("samples, workers, steps", [(64, 1, 8), (64, 2, 4), (71, 2, 4),
                                                     (199, 3, 8), (95, 4, 2)])
def test_steps_come_from_the_global_count(samples, workers, steps):
    assert plan(num_workers=workers, batch_size=8, num_train_samples=samples).steps_per_epoch \
        == steps


def test_fewer_samples_than_one_global_batch_is_refused():
    with pytest.raises(ValueError, match="fewer than one global batch"):
        plan(num_workers=4, num_train_samples=100)


def test_warmup_is_counted_in_steps_and_ends_before_training_does():
    p = plan(num_workers=2, warmup_epochs=2, grad_accum_steps=2)
    assert p.warmup_steps == 2 * p.steps_per_epoch
    short = plan(epochs=1, warmup_epochs=5)
    assert short.warmup_steps == short.total_steps - 1


def test_validation_takes_every_sample_once_and_shrinks_its_batch_for_tiny_sets():
    p = plan(num_workers=2)  # 359 samples: shares of 180 and 179, 6 batches of 32 at most
    assert (p.validation_batch_size, p.validation_steps) == (32, 6)
    assert "validation: each of the 359 samples once, in up to 6 batch(es) of 32 per worker" in \
        p.describe()
    tiny = plan(num_workers=4, batch_size=8, num_train_samples=32, num_validation_samples=5)
    assert (tiny.validation_batch_size, tiny.validation_steps) == (2, 1)  # shares 2, 1, 1, 1
    none = plan(num_workers=4, batch_size=1, num_train_samples=8, num_validation_samples=3)
    assert (none.validation_batch_size, none.validation_steps) == (0, 0)
    assert none.describe()[-1] == ("validation: none (3 held-out sample(s), fewer than the 4 "
                                   "workers)")
    empty = plan(num_workers=1, num_validation_samples=0)
    assert empty.describe()[-1] == "validation: none (no held-out samples)"


def test_banner_states_the_numbers():
    text = "\n".join(plan(num_workers=4, num_train_samples=10_000).describe())
    assert "32 per worker x 4 workers = 128 global" in text
    assert "0.001 x 4 = 0.004" in text
    assert "steps per epoch: 78" in text



def test_a_resume_on_another_world_size_names_what_moved():
    from hvdtrain.training.plan import resize_notes

    four = plan(num_workers=4, num_train_samples=100_000)
    two = plan(num_workers=2, num_train_samples=100_000)
    assert resize_notes(four.to_dict(), two) == [
        "worker(s) 4 -> 2", "global batch 128 -> 64", "learning rate 0.004 -> 0.002",
        f"steps per epoch {four.steps_per_epoch} -> {two.steps_per_epoch}"]
    # With a global batch the update and its rate stay; only each worker's share moves.
    kept = [plan(batch_policy="global", batch_size=64, num_workers=n) for n in (4, 2)]
    assert resize_notes(kept[0].to_dict(), kept[1]) == ["worker(s) 4 -> 2",
                                                         "batch per worker 16 -> 32"]
    assert resize_notes(two.to_dict(), two) == [] and resize_notes(None, two) == []
    # The schedule's shape is a function of progress: warm-up and total steps scale with the
    # steps per epoch, so a given epoch sits at the same fraction of both.
    assert (four.warmup_steps / four.steps_per_epoch, four.total_steps / four.steps_per_epoch) \
        == (two.warmup_steps / two.steps_per_epoch, two.total_steps / two.steps_per_epoch)
