"""Config: presets, command-line overrides, validation, and help text from field docstrings."""
import dataclasses
import os
import json
import re

import pytest

from hvdtrain.cnn import PRESETS as CNN_PRESETS
from hvdtrain.cnn import ClassifierConfig
from hvdtrain.training.config import CacheSetting, ImageConfig, TrainConfig, parse_config
from hvdtrain.flags import field_docs
from hvdtrain.errors import UserError


def parse(*argv):
    return parse_config(list(argv), CNN_PRESETS, prog="test", description="")


@pytest.mark.parametrize("config_class", [TrainConfig, ImageConfig, ClassifierConfig])
def test_every_field_has_a_docstring(config_class):
    # Each class documents the fields it declares (they are its flags' help).
    declared = [f.name for f in dataclasses.fields(config_class)
                if f.name in config_class.__dict__.get("__annotations__", {})]
    docs = field_docs(config_class)
    assert declared and [name for name in declared if not docs.get(name)] == []


def all_presets():
    from hvdtrain import autoencoder

    return [(f"cnn:{name}", make) for name, make in CNN_PRESETS.items()] + \
        [(f"autoencoder:{name}", make) for name, make in autoencoder.PRESETS.items()]


@pytest.mark.parametrize("name, make", all_presets(), ids=[n for n, _ in all_presets()])
def test_every_shipped_preset_builds_and_writes_to_its_own_run_dir(name, make):
    config = make()  # __post_init__ validates it
    assert isinstance(config, TrainConfig)
    run_dirs = [m().run_dir for _, m in all_presets()]
    assert run_dirs.count(config.run_dir) == 1, "two presets would resume each other's runs"
    if name.endswith(":tiny"):
        assert config.epochs <= 3, "tiny presets must stay fast for tests and newcomers"


def test_preset_then_overrides():
    config = parse("--preset", "tiny", "--epochs", "7", "--batch-policy", "global",
                   "--no-tensorboard", "--fp16-allreduce")
    assert config.epochs == 7
    assert config.batch_policy == "global"
    assert config.tensorboard is False and config.fp16_allreduce is True
    assert config.run_dir == CNN_PRESETS["tiny"]().run_dir  # untouched fields keep the preset


def test_the_default_run_dir_is_the_presets_for_the_digits_and_its_own_for_other_data(
        tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert parse("--preset", "tiny").run_dir == "runs/cnn-tiny"
    assert parse("--preset", "tiny", "--data", "synthetic").run_dir == "runs/cnn-tiny-synthetic"
    pets = parse("--preset", "tiny", "--data-dir", "a/pets").run_dir
    assert re.fullmatch(r"runs/cnn-tiny-pets-[0-9a-f]{6}", pets), pets
    assert parse("--preset", "tiny", "--data-dir", f"{tmp_path}/a/pets/").run_dir == pets
    # Another folder of the same name, or the same path read as TFRecords: another directory.
    assert parse("--preset", "tiny", "--data-dir", "b/pets").run_dir != pets
    assert parse("--preset", "tiny", "--tfrecords", "a/pets").run_dir != pets
    assert parse("--data-dir", "a/pets").run_dir.startswith("runs/cnn-pets-")
    # Given, it is kept as it is.
    assert parse("--preset", "tiny", "--data-dir", "a/pets", "--run-dir",
                 "runs/cnn-tiny").run_dir == "runs/cnn-tiny"


@pytest.mark.parametrize("argv, message", [
    (["--batch-policy", "sideways"], "invalid choice"),
    (["--lr-scaling", "cubic"], "invalid choice"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--batch-size", "-4"], "--batch-size must be at least 1"),
    (["--learning-rate", "0"], "--learning-rate must be positive"),
    (["--validation-fraction", "1.5"], "--validation-fraction must be in [0, 1)"),
    (["--data-dir", "a", "--tfrecords", "b"], "either --data-dir or --tfrecords"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--epochs", "three"], "invalid int value"),
    # nan and inf pass every comparison: a learning rate of nan trained to a loss of nan.
    (["--learning-rate", "nan"], "--learning-rate must be a finite number, got nan"),
    (["--warmup-epochs", "inf"], "--warmup-epochs must be a finite number, got inf"),
    (["--cache-budget-gb", "nan"], "--cache-budget-gb must be a finite number, got nan"),
    (["--cache", "disk:"], "--cache must be memory, disk, disk:DIR, off or auto, got 'disk:'"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--epochs", "99999999999999999999"], "--epochs must be at most 2147483647"),
    (["--epochs", "-3000000000"], "--epochs must be at least 1"),
])
def test_bad_values_are_one_line_user_errors(argv, message):
    with pytest.raises(UserError) as error:
        parse(*argv)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_help_lists_flags_with_their_docs(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse("--help")
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--batch-policy" in text and "--grad-accum-steps" in text
    assert "Goyal" in text  # the --lr-scaling docstring made it into the help


def test_a_run_directorys_config_json_replays_the_run_and_the_flags_given_win(tmp_path, capsys):
    """--config FILE: a run's config.json (as train.py writes it) gives back that run's config;
    --print-config prints what --config reads, so the two round-trip."""
    ran = parse("--preset", "tiny", "--epochs", "5", "--model", "resnet50", "--no-augment",
                "--cache", "disk:/scratch")
    # --cache is parsed once, here, and recorded as the flag is written.
    assert ran.cache == CacheSetting("disk", "/scratch")
    assert ran.to_dict()["cache"] == "disk:/scratch"
    recorded = tmp_path / "config.json"
    recorded.write_text(json.dumps({"program": "hvdtrain.cnn", "config": ran.to_dict(),
                                    "plan": {"num_workers": 2}}))
    assert parse("--config", str(recorded)) == ran
    assert parse("--config", str(recorded), "--epochs", "7") == dataclasses.replace(ran, epochs=7)
    with pytest.raises(SystemExit) as exit_info:
        parse("--config", str(recorded), "--learning-rate", "0.01", "--print-config")
    assert exit_info.value.code == 0
    printed = tmp_path / "printed.json"
    printed.write_text(capsys.readouterr().out)
    assert parse("--config", str(printed)) == dataclasses.replace(ran, learning_rate=0.01)


@pytest.mark.parametrize("text, message", [
    ('{"epoch": 3}', "no flag --epoch; did you mean --epochs?"),
    ('{"epochs": "three"}', '--epochs must be an integer, got "three"'),
    ('{"augment": 1}', "--augment must be true or false, got 1"),
    ('{"lr_decay": "linear"}', '--lr-decay must be one of cosine, constant, step, got "linear"'),
    ('{"epochs": 0}', "--epochs must be at least 1, got 0"),
    ('{"cache": "ram"}', "--cache must be memory, disk, disk:DIR, off or auto, got 'ram'"),
    ('{"cache": 3}', "--cache must be a string, got 3"),
    ('[1, 2]', "holds a JSON list, not an object of flags"),
    ('{"epochs": 3', "not JSON (Expecting ',' delimiter at line 1 column 13)"),
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "mine.json"
    path.write_text(text)
    with pytest.raises(UserError) as error:
        parse("--config", str(path))
    assert str(error.value) == f"--config {path}: {message}"


def test_a_config_that_is_no_regular_file_or_too_big_is_one_line_and_never_waits(tmp_path):
    """A FIFO would block the open for a writer forever and /dev/zero never end; a huge file
    would be read whole. Each is one line naming it, at once."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    big = tmp_path / "big.json"
    big.write_text('{"epochs": 3' + " " * (2**20) + "}")
    for path, message in ((fifo, "is not a regular file"), (tmp_path, "Is a directory"),
                          ("/dev/zero", "is not a regular file"),
                          (big, f"is {big.stat().st_size} bytes; a config is a few KB")):
        with pytest.raises(UserError) as error:
            parse("--config", str(path))
        assert str(error.value).startswith(f"--config {path}: {message}"), error.value
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UserError, match="is not text"):
        parse("--config", str(binary))


@pytest.mark.parametrize("flags, message", [
    (["--momentum", "0.9"], "--momentum is for --optimizer sgd or rmsprop; adam's momentum is "
                            "its beta_1"),
    (["--optimizer", "adamw", "--nesterov"], "--nesterov is for --optimizer sgd, not adamw"),
    (["--weight-decay", "1e-4"], "Adam with decoupled weight decay is AdamW: pass --optimizer "
                                 "adamw"),
    (["--optimizer", "sgd", "--momentum", "1"], "--momentum must be in [0, 1), got 1.0"),
    (["--optimizer", "sgd", "--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--clipnorm", "1", "--global-clipnorm", "1"], "give --clipnorm (each weight's gradient) "
                                                    "or --global-clipnorm (all of them "
                                                    "together), not both"),
    (["--global-clipnorm", "0"], "--global-clipnorm must be positive, got 0.0"),
    (["--lr-decay", "step"], "--lr-decay step needs --lr-milestones, the epochs at which the "
                             "rate drops (e.g. 30,60,80)"),
    (["--lr-milestones", "30,60"], "--lr-milestones are for --lr-decay step, not cosine"),
    (["--lr-decay", "step", "--lr-milestones", "60,30"],
     "--lr-milestones must be positive epochs in increasing order, got '60,30'"),
    (["--lr-decay", "step", "--lr-milestones", "30;60"],
     "--lr-milestones must be epochs separated by commas (30,60,80), got '30;60'"),
    (["--lr-decay", "step", "--lr-milestones", "3", "--lr-gamma", "0"],
     "--lr-gamma must be positive, got 0.0"),
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1), got 1.0"),
    (["--early-stopping", "0"], "--early-stopping must be at least 1 epoch, got 0"),
    (["--profile-steps", "5:3"], "--profile-steps must be FIRST:LAST with 1 <= FIRST <= LAST, "
                                 "got '5:3'"),
    (["--profile-steps", "a:b"], "--profile-steps must be FIRST:LAST steps of the run (10:20), "
                                 "got 'a:b'"),
])
def test_optimizer_flags_that_mean_nothing_for_the_choice_are_one_line(flags, message):
    with pytest.raises(UserError) as error:
        parse(*flags)
    assert str(error.value) == message


def test_the_resnet_recipe_parses_and_its_milestones_follow_the_epochs():
    from hvdtrain.training.plan import make_plan
    from hvdtrain.training.optimizers import WarmupThenSteps

    config = parse("--optimizer", "sgd", "--nesterov", "--weight-decay", "5e-5",
                   "--label-smoothing", "0.1", "--lr-decay", "step", "--lr-milestones",
                   "30,60,80", "--epochs", "90")
    assert config.milestone_epochs() == (30.0, 60.0, 80.0)
    plans = [make_plan(batch_size=32, batch_policy="per-worker", learning_rate=0.1,
                       lr_scaling="linear", warmup_epochs=5, grad_accum_steps=1, epochs=90,
                       num_workers=workers, num_train_samples=128_000,
                       num_validation_samples=0, lr_decay="step",
                       lr_milestones=config.milestone_epochs())
             for workers in (1, 4)]
    assert [plan.lr_milestone_steps for plan in plans] == [(120_000, 240_000, 320_000),
                                                           (30_000, 60_000, 80_000)]
    assert "then x0.1 at steps 30000, 60000, 80000 (epochs 30, 60, 80)" in plans[1].describe()[2]
    plan = plans[1]
    schedule = WarmupThenSteps(plan.base_learning_rate, plan.learning_rate, plan.warmup_steps,
                               plan.lr_milestone_steps, plan.lr_gamma)
    rates = [float(schedule(step)) for step in (0, plan.warmup_steps // 2, plan.warmup_steps,
                                                 29_999, 30_000, 60_000, 80_000, 89_999)]
    assert rates == pytest.approx([0.1, 0.25, 0.4, 0.4, 0.04, 0.004, 0.0004, 0.0004])


def test_a_jobs_own_optimizer_refuses_the_flags_that_shape_the_built_in_one():
    import keras

    from hvdtrain.training.optimizers import build_optimizer

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    config = parse("--optimizer", "sgd", "--global-clipnorm", "1")
    with pytest.raises(UserError) as error:
        build_optimizer(config, 0.1, model, task_optimizer=keras.optimizers.SGD)
    assert str(error.value) == (
        "the job builds its own optimizer (Task.optimizer); --optimizer, --global-clipnorm "
        "shape(s) the built-in one: set it in the job's optimizer instead")
    with pytest.raises(UserError, match="must return a Keras optimizer, got str"):
        build_optimizer(parse(), 0.1, model, task_optimizer=lambda rate: "sgd")
    assert isinstance(build_optimizer(parse(), 0.1, model, task_optimizer=keras.optimizers.SGD),
                      keras.optimizers.SGD)


@pytest.mark.parametrize("flags, decay", [
    (["--optimizer", "adam"], 0.0),
    (["--optimizer", "adamw"], 0.004),  # Keras' default
    (["--optimizer", "sgd", "--weight-decay", "0.01"], 0.01),
    (["--optimizer", "rmsprop", "--weight-decay", "0.01"], 0.01),
])
@pytest.mark.parametrize("decay_all", [False, True])
def test_each_optimizer_decays_the_weights_it_is_told_to(flags, decay, decay_all):
    """A step of zero gradients leaves only the decoupled weight decay: every weight of two or
    more dimensions shrinks by rate x decay, a bias (or norm scale) only with
    --decay-all-weights."""
    import keras
    import numpy as np

    from hvdtrain.training.optimizers import build_optimizer

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, bias_initializer="ones")])
    config = parse(*flags, *(["--decay-all-weights"] if decay_all else []))
    optimizer = build_optimizer(config, 0.5, model)
    assert type(optimizer).__name__ == {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD",
                                        "rmsprop": "RMSprop"}[config.optimizer]
    kernel, bias = (variable.numpy() for variable in model.trainable_variables)
    optimizer.apply_gradients([(np.zeros(variable.shape, "float32"), variable)
                               for variable in model.trainable_variables])
    shrunk = 1 - 0.5 * decay
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), kernel * shrunk, rtol=1e-6)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(),
                               bias * (shrunk if decay_all else 1), rtol=1e-6)


def test_early_stopping_watches_the_validation_loss_or_the_loss_without_one():
    import keras

    from hvdtrain.cnn import CLASSIFIER
    from hvdtrain.training.fit import make_job_callbacks

    config = parse("--early-stopping", "3")
    for has_validation, monitor in ((True, "val_loss"), (False, "loss")):
        [stopping] = make_job_callbacks(config, CLASSIFIER, has_validation)
        assert isinstance(stopping, keras.callbacks.EarlyStopping)
        assert (stopping.monitor, stopping.patience) == (monitor, 3)
    assert make_job_callbacks(parse(), CLASSIFIER, True) == []
