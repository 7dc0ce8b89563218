"""The public API (hvdtrain.Task / Shard / Datasets / main) and the examples that use it.

Collective tests run under `mpirun -np 2 pytest` as well as alone; the example jobs are
integration tests (they start their own horovodrun / launcher jobs).
"""
import io
import json
import re
import subprocess
import sys

import pytest
import tensorflow as tf

import hvdtrain
from conftest import LAUNCHED_RANKS, REPO, VENV_BIN, clean_env, gather_checked, integration, \
    mpirun_ranks, run_job
from hvdtrain.training.inputs import agreed_batches
from hvdtrain.errors import UserError

pytestmark = pytest.mark.timeout(300)


def test_only_the_documented_names_are_public():
    assert sorted(hvdtrain.__all__) == ["Datasets", "Shard", "Task", "TrainConfig", "main", "run"]
    assert all(getattr(hvdtrain, name) for name in hvdtrain.__all__)


class _Writes(io.RawIOBase):
    """A file that records each write the OS would get."""

    def __init__(self):
        self.writes = []

    def writable(self):
        return True

    def write(self, data):
        self.writes.append(bytes(data))
        return len(data)


def test_a_rank_hands_its_output_to_the_launcher_in_whole_lines():
    # horovodrun's PYTHONUNBUFFERED=1 makes stdout write through: print() is two writes (text,
    # newline), and a tag between them splits a line. Text with a newline inside is the hard case.
    file = _Writes()
    stream = hvdtrain._whole_line_stream(io.TextIOWrapper(file, encoding="utf-8",
                                                          write_through=True))
    print("banner\nrun dir: runs/cnn", file=stream)
    print("step 1", file=stream)
    assert file.writes == [b"banner\nrun dir: runs/cnn\n", b"step 1\n"]
    print("50%", end="", file=stream, flush=True)  # a progress bar's explicit flush still goes out
    assert file.writes[-1] == b"50%"
    stream.close()
    assert not file.closed  # the interpreter's own stream still owns the file


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_importing_hvdtrain_replaces_only_unbuffered_streams(unbuffered):
    env = clean_env(PYTHONUNBUFFERED=unbuffered)
    result = subprocess.run([sys.executable, "-c", "import sys, hvdtrain; "
                             "print(type(sys.stdout).__name__, type(sys.stderr).__name__)"],
                            env=env, capture_output=True, text=True, timeout=60, check=True)
    expected = "_WholeLines _WholeLines" if unbuffered else "TextIOWrapper TextIOWrapper"
    assert result.stdout.split("\n")[0] == expected, result
    with pytest.raises(AttributeError):
        hvdtrain.no_such_name  # noqa: B018


def batches(count: int) -> tf.data.Dataset:
    return tf.data.Dataset.range(count * 4).batch(4, drop_remainder=True)


def refusal_on_every_rank(runtime, datasets, steps_per_epoch=None):
    def attempt():
        try:
            return agreed_batches(runtime, datasets, steps_per_epoch)
        except UserError as error:
            return f"refused: {error}"
    return gather_checked(runtime, attempt)


def test_ranks_that_agree_get_their_counts(runtime):
    counts = refusal_on_every_rank(runtime, hvdtrain.Datasets(batches(5), batches(2)))
    assert counts == [(5, 2)] * LAUNCHED_RANKS


@pytest.mark.skipif(LAUNCHED_RANKS < 2, reason="needs ranks that disagree (mpirun -np 2)")
def test_unequal_training_batches_are_refused_on_every_rank_naming_the_counts(runtime):
    rank = runtime.world.rank
    outcomes = refusal_on_every_rank(runtime, hvdtrain.Datasets(batches(5 + rank), batches(2)))
    expected = ", ".join(f"rank {r}: {5 + r}" for r in range(LAUNCHED_RANKS))
    assert len(set(outcomes)) == 1, outcomes  # the same refusal everywhere: all ranks exit 2
    assert outcomes[0].startswith(f"refused: the ranks' training datasets have different "
                                  f"numbers of batches ({expected})")
    # --steps-per-epoch makes the training count the flag's (hvdtrain repeats the data) ...
    agreed = refusal_on_every_rank(runtime, hvdtrain.Datasets(batches(5 + rank), batches(2)), 3)
    assert agreed == [(3, 2)] * LAUNCHED_RANKS
    # ... but validation runs in full every epoch, so its counts must always agree.
    uneven_validation = refusal_on_every_rank(
        runtime, hvdtrain.Datasets(batches(5), batches(2 + rank)), 3)
    assert len(set(uneven_validation)) == 1
    assert "validation datasets have different numbers of batches" in uneven_validation[0]


def test_counts_that_cannot_be_known_are_refused_with_the_remedy(runtime):
    endless = refusal_on_every_rank(runtime, hvdtrain.Datasets(batches(5).repeat()))
    assert endless[0] == ("refused: the training dataset repeats forever; pass --steps-per-epoch, "
                          "or return one epoch of batches (hvdtrain repeats it)")
    assert refusal_on_every_rank(runtime, hvdtrain.Datasets(batches(5).repeat()), 7)[0] == (7, 0)
    filtered = batches(5).filter(lambda batch: True)
    unknown = refusal_on_every_rank(runtime, hvdtrain.Datasets(filtered))
    assert "assert_cardinality" in unknown[0] and "--steps-per-epoch" in unknown[0]
    counted = filtered.apply(tf.data.experimental.assert_cardinality(5))
    assert refusal_on_every_rank(runtime, hvdtrain.Datasets(counted))[0] == (5, 0)


# --- the examples, as users run them (integration tier) -------------------------------------------
@integration
@pytest.mark.timeout(400)
def test_diabetes_regression_through_the_api_learns_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    job = [str(VENV_BIN / "horovodrun"), "-np", "2", sys.executable,
           str(REPO / "examples" / "diabetes.py"), "--run-dir", str(run_dir)]
    first = run_job(job, timeout=300).stdout
    assert "data: scikit-learn diabetes: 354 train, 88 validation patients" in first, first[-3000:]
    assert "steps per epoch: 11" in first  # 354 rows -> 177 per rank -> 11 batches of 16
    rows = json.loads((run_dir / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == list(range(1, 61))
    # Predicting the training mean misses by 64.7 on these validation patients; scikit-learn's
    # least squares by 50.7.
    assert rows[-1]["val_error_in_progression_units"] < 55, rows[-1]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["program"] == "diabetes" and config["world"]["size"] == 2
    assert (run_dir / "model.keras").is_file()

    more = run_job(job + ["--epochs", "62"], timeout=300).stdout
    assert re.search(r"resuming from \S+: 60 epoch\(s\) done", more), more[-3000:]
    rows = json.loads((run_dir / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == list(range(1, 63))


@integration
@pytest.mark.timeout(300)
def test_the_resnet_recipe_example_trains_on_two_ranks_as_its_paper_schedules_it(tmp_path):
    """examples/resnet_recipe.py --preset tiny: SGD with Nesterov momentum, decoupled weight
    decay without the biases and norm weights, label smoothing, warm-up then x0.1 at epochs 2 and
    3, early stopping armed; with a profile of steps 3-4 on rank 0. Started as horovodrun would
    (mpirun_ranks: the recipe, not horovodrun, is the subject)."""
    run_dir = tmp_path / "run"
    output = run_job([*mpirun_ranks(2), sys.executable, str(REPO / "examples" / "resnet_recipe.py"),
                      "--preset", "tiny", "--run-dir", str(run_dir), "--profile-steps", "3:4"],
                     timeout=240).stdout
    assert ("optimizer: SGD, momentum 0.9 (Nesterov), weight decay 0.001 (decoupled; 4 "
            "bias/norm weight(s) not decayed), label smoothing 0.1") in output, output[-3000:]
    assert ("learning rate: 0.05 x 2 = 0.1, warm-up over 22 steps, then x0.1 at steps 44, 66 "
            "(epochs 2, 3)") in output, output[-3000:]
    rows = json.loads((run_dir / "metrics.json").read_text())
    # The rate each epoch ends at: the peak after warm-up, then a tenth at each milestone.
    assert [row["learning_rate"] for row in rows] == pytest.approx([0.1, 0.01, 0.001, 0.001])
    assert rows[-1]["val_accuracy"] > 0.9, rows[-1]
    for row in rows:  # every epoch splits its time into the input's wait and the rest
        assert 0 <= row["input_wait_seconds"] <= row["train_seconds"], row
    profiles = list((run_dir / "tensorboard").rglob("*.xplane.pb"))
    assert len(profiles) == 1, profiles  # rank 0's, of the steps asked for
    config = json.loads((run_dir / "config.json").read_text())
    assert config["plan"]["lr_milestone_steps"] == [44, 66], config["plan"]


@integration
@pytest.mark.timeout(200)
def test_an_api_job_whose_ranks_disagree_is_one_line_exit_2_and_writes_nothing(tmp_path):
    result = run_job([str(VENV_BIN / "horovodrun"), "-np", "2", sys.executable,
                      str(REPO / "tests" / "scripts" / "uneven_task.py"),
                      "--run-dir", str(tmp_path / "run")], timeout=180, check=False)
    errors = [line for line in result.stdout.splitlines() if "error" in line.lower()]
    assert result.returncode != 0
    assert len(errors) == 1, result.stdout[-3000:]
    assert ("uneven_task: error: the ranks' training datasets have different numbers of batches "
            "(rank 0: 4, rank 1: 3); every rank must feed the same number (shard, then batch with "
            "drop_remainder=True and take() the smallest rank's count), or pass --steps-per-epoch"
            ) in errors[0]
    assert not (tmp_path / "run").exists()


@integration
@pytest.mark.timeout(300)
def test_a_plain_horovod_keras_script_runs_unchanged_through_the_launcher(tmp_path):
    # On Keras 2 (through hvdtrain.script), as a script written for it runs; the default,
    # Keras 3, runs it from the Slurm template (test_slurm).
    result = run_job([sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--keras", "2",
                      str(REPO / "examples" / "plain_horovod.py")], timeout=280, cwd=tmp_path)
    accuracy = dict(re.findall(r"rank (\d) of 2: test accuracy ([\d.]+)", result.stdout))
    assert sorted(accuracy) == ["0", "1"], result.stdout[-3000:]
    # Broadcast at the start, averaged gradients after: both ranks hold the same model.
    assert accuracy["0"] == accuracy["1"] and float(accuracy["0"]) >= 0.9
    # Only rank 0 saved (horovod's example: ModelCheckpoint on rank 0), one file per epoch.
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint-{e}.h5"
                                                          for e in range(1, 7)]


def test_a_job_that_is_not_a_task_is_refused_before_anything_starts(tmp_path):
    # A job is a Task or a function of the parsed config returning one (the classifier's
    # --model); anything else is one line, before a runtime or a run directory exists.
    with pytest.raises(UserError, match="the job must be an hvdtrain.Task .* got str"):
        hvdtrain.run(lambda config: "not a task", ["--run-dir", str(tmp_path / "run")],
                     name="notask")
    assert not (tmp_path / "run").exists()


def test_a_model_made_at_its_first_call_gets_its_variables_or_one_line():
    import keras  # the Keras conftest's hvdtrain import selected

    from hvdtrain.training import model as model_module

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, inputs, training=False):
            return self.dense(inputs["features"])

    inputs = {"features": tf.TensorSpec([None, 4], tf.float32)}
    model = Net()
    assert not model.weights
    model_module.create_variables(model, inputs)  # nested inputs, batch size left free
    assert [tuple(w.shape) for w in model.weights] == [(4, 3), (3,)]

    class Broken(keras.Model):
        def call(self, inputs, training=False):
            raise ValueError("this model expects\nthree features")

    # One line: Keras' wrapped message (it names the layer and its call arguments) joined up.
    expected = (r"could not be built from the data's inputs .*: "
                r"ValueError: .*this model expects three features")
    with pytest.raises(UserError, match=expected) as caught:
        model_module.create_variables(Broken(), tf.TensorSpec([None, 4], tf.float32))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("elements, described", [
    (lambda: tf.data.Dataset.from_tensor_slices(tf.zeros((8, 4))), "single tensors of shape"),
    (lambda: tf.data.Dataset.from_tensor_slices({"x": tf.zeros((8, 4)), "y": tf.zeros(8)}),
     "dicts with keys x, y"),
    (lambda: tf.data.Dataset.from_tensor_slices((tf.zeros((8, 4)),) * 4), "tuples of 4"),
])
def test_a_task_dataset_of_the_wrong_elements_is_one_line(elements, described):
    from hvdtrain.training.inputs import check_elements

    with pytest.raises(UserError, match="must yield \\(inputs, targets\\) or") as refused:
        check_elements(hvdtrain.Datasets(elements().batch(2)))
    assert described in str(refused.value) and "\n" not in str(refused.value)
    # The validation split is checked too; (inputs, targets[, weights]) pass.
    pairs = tf.data.Dataset.from_tensor_slices((tf.zeros((8, 4)), tf.zeros(8))).batch(2)
    with pytest.raises(UserError, match="validation dataset"):
        check_elements(hvdtrain.Datasets(pairs, elements().batch(2)))
    triples = tf.data.Dataset.from_tensor_slices((tf.zeros((8, 4)), tf.zeros(8), tf.ones(8)))
    check_elements(hvdtrain.Datasets(pairs, triples.batch(2)))


def sums_task(callbacks=None) -> hvdtrain.Task:
    """A job of its own: a linear model learning the sums of 4 numbers, 10 batches an epoch."""
    import keras  # the Keras conftest's hvdtrain import selected

    def datasets(shard: hvdtrain.Shard) -> hvdtrain.Datasets:
        features = tf.random.stateless_normal((40, 4), seed=(1, 2))
        train = tf.data.Dataset.from_tensor_slices((features, tf.reduce_sum(features, 1)))
        return hvdtrain.Datasets(train.batch(4), description="sums")

    return hvdtrain.Task(
        build_model=lambda data: keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)]),
        loss=lambda: "mse", datasets=datasets, callbacks=callbacks)


def test_a_step_checkpoint_of_a_jobs_own_datasets_reruns_its_epoch_and_says_so(tmp_path,
                                                                              capsys):
    """A job's own datasets cannot start part-way: a checkpoint written inside an epoch (every 2
    steps; the job's callback stopped it in its 4th step) resumes at that epoch's first step,
    and the resume line says so, why, and that the weights trained on those steps already."""
    import keras  # the Keras conftest's hvdtrain import selected

    class StopInEpoch2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 10 + 4:
                self.model.stop_training = True

    argv = ["--run-dir", str(tmp_path / "run"), "--epochs", "3", "--checkpoint-every-steps",
            "2", "--signal-check-every-steps", "1", "--no-tensorboard"]
    assert hvdtrain.run(sums_task(lambda: [StopInEpoch2()]), argv, name="sums") == 0
    first = capsys.readouterr().out
    assert "stopped in epoch 2: the job's callbacks asked to stop" in first, first
    assert hvdtrain.run(sums_task(), argv, name="sums") == 0
    printed = capsys.readouterr().out
    assert re.search(r"resuming from \S+/ckpt-\d+: 1 epoch\(s\) done; it was written after 2 "
                     r"step\(s\) of epoch 2, which starts again from its first step \(a job's "
                     r"own datasets cannot start part-way\): its weights trained on those "
                     r"step\(s\) already", printed), printed
    assert "done: 3 epoch(s)" in printed, printed


def test_checkpoints_every_few_minutes_are_written_inside_the_epoch(tmp_path):
    """--checkpoint-every-minutes on rank 0's clock: at a minute's billionth, after every step
    of the epoch (9 inside it, then the epoch's own), each saying where it resumes."""
    run_dir = tmp_path / "run"
    assert hvdtrain.run(sums_task(), ["--run-dir", str(run_dir), "--epochs", "1",
                                      "--checkpoint-every-minutes", "1e-9", "--no-tensorboard"],
                        name="sums") == 0
    written = sorted(int(path.stem.split("-")[1])
                     for path in (run_dir / "checkpoints").glob("ckpt-*.index"))
    assert written[-1] == 10, written
    positions = [json.loads((run_dir / "checkpoints" / f"ckpt-{number}.json").read_text())
                 for number in written]
    assert [(where["epoch"], where["step"]) for where in positions] == [
        (0, number) if number < 10 else (1, 0) for number in written]


def test_an_ema_run_resumed_inside_an_epoch_and_stopped_after_it_exports_the_averages(
        tmp_path):
    """A job optimizer keeping a moving average of the weights (use_ema), which Keras copies
    into them as a fit ends: a run resumed inside epoch 2 fits the epoch's rest, and its job's
    callback stops it at that epoch's end. It exports what the run never stopped exports, the
    averages (the fit of the rest was not the run's last planned one: finalized after it)."""
    import dataclasses

    import keras  # the Keras conftest's hvdtrain import selected
    import numpy as np

    from hvdtrain.cnn import PRESETS, classifier
    from hvdtrain.models.cnn import build_cnn

    class StopAt(keras.callbacks.Callback):
        """Stops after the given global step (inside an epoch) or at epoch 2's end."""

        def __init__(self, step=None):
            super().__init__()
            self.step = step

        def on_train_batch_end(self, batch, logs=None):
            if self.step and int(self.model.optimizer.iterations.numpy()) == self.step:
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            if self.step is None and epoch == 1:
                self.model.stop_training = True

    def task(step=None):
        return lambda config: dataclasses.replace(
            classifier(config.model),
            build_model=lambda data: build_cnn(data.image_shape, len(data.class_names),
                                               dropout=0.0),  # masks a resume would redraw
            optimizer=lambda rate: keras.optimizers.Adam(rate, use_ema=True),
            callbacks=lambda: [StopAt(step)])

    def weights(run_dir):
        return keras.models.load_model(run_dir / "model.keras", compile=False).get_weights()

    flags = ["--preset", "tiny", "--checkpoint-every-steps", "5", "--signal-check-every-steps",
             "1"]
    never, resumed = tmp_path / "never", tmp_path / "resumed"
    assert hvdtrain.run(task(), [*flags, "--run-dir", str(never)], name="hvdtrain.cnn",
                        presets=PRESETS) == 0
    steps = json.loads((never / "config.json").read_text())["plan"]["steps_per_epoch"]
    # Stopped in epoch 2 at its 12th step: its checkpoint after the 10th is kept.
    hvdtrain.run(task(steps + 12), [*flags, "--run-dir", str(resumed)], name="hvdtrain.cnn",
                 presets=PRESETS)
    assert not (resumed / "model.keras").exists()
    assert hvdtrain.run(task(), [*flags, "--run-dir", str(resumed)], name="hvdtrain.cnn",
                        presets=PRESETS) == 0
    for mine, theirs in zip(weights(resumed), weights(never), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-5)
