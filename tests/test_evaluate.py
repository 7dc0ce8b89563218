"""hvdtrain evaluate's arguments, its output's name and place, its summary, what it sums and what
it refuses, in process. A trained run scored on 1 and 2 ranks against Keras' own evaluate is
test_jobs.py's."""
from __future__ import annotations

import json
import os
import re

import pytest

from hvdtrain import evaluate, runmodel
from hvdtrain.cnn import ClassifierConfig
from hvdtrain.errors import UserError

CLASSIFIER_JOB = evaluate.scored_jobs()["hvdtrain.cnn"]


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "newest"], "--checkpoint must be 'latest' or a checkpoint's number"),
    (["--data", "digits", "--data-dir", "x"], "name one data source"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--name", "../up"], "--name must be letters, digits"),
    # URLs are refused, never taken for relative paths (./gs:/b/scores.json).
    (["--output", "gs://b/scores.json"], "--output gs://b/scores.json: this command takes "
                                         "file system paths, not URLs: write to a file system"),
    (["--run-dir", "gs://b/run"], "--run-dir gs://b/run: this command takes file system paths"),
])
def test_bad_arguments_are_one_line_before_anything_is_read(argv, message):
    with pytest.raises(UserError, match=message):
        evaluate.parse(["--run-dir", "runs/x", *argv])


def test_the_output_is_named_by_split_data_and_checkpoint_and_checked_before_scoring(tmp_path):
    def path(*argv, model="runs/x/model.keras", **config):
        request = evaluate.parse(["--run-dir", str(tmp_path / "run"), *argv])
        found = evaluate.Evaluation(request, {}, ClassifierConfig(**config), runtime=None,
                                    job=CLASSIFIER_JOB)
        return os.path.relpath(found.output_path(model), tmp_path)

    assert path() == "run/evaluation-validation.json"
    assert path("--split", "all", "--checkpoint", "latest", model="run/checkpoints/ckpt-7") == \
        "run/evaluation-all-ckpt-7.json"
    photos = tmp_path / "test photos"
    assert path("--data-dir", str(photos), data_dir=str(photos)) == \
        "run/evaluation-validation-test_photos.json"
    assert path("--data", "synthetic", data="synthetic") == \
        "run/evaluation-validation-synthetic.json"
    assert path("--name", "final") == "run/evaluation-final.json"
    assert path("--output", str(tmp_path / "scores" / "a.json")) == "scores/a.json"

    runmodel.check_writable(str(tmp_path / "new" / "deeper" / "a.json"))  # made when written
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "link.json").symlink_to(tmp_path / "elsewhere.json")
    for where, message in ((tmp_path / "a-dir", "is a directory or a symlink"),
                           (tmp_path / "link.json", "is a directory or a symlink"),
                           (tmp_path / "a-file" / "a.json", "is not a writable directory")):
        with pytest.raises(UserError, match=message):
            runmodel.check_writable(str(where))
    assert not (tmp_path / "elsewhere.json").exists()


def test_the_summary_names_the_lowest_class_and_says_when_nothing_was_scored():
    result = {"samples": 359, "skipped": 2, "split": "validation", "data": "digits",
              "ranks": 2, "loss": 0.06123, "accuracy": 0.98607,
              "per_class_accuracy": {"0": 1.0, "8": 0.9459, "9": None}}
    assert evaluate.summary(result) == (
        "359 samples (2 did not decode, not scored) (validation of digits) on 2 rank(s): loss "
        "0.0612, accuracy 0.9861, lowest class 8 0.9459")
    # A job that does not classify (the autoencoder): its loss alone.
    reconstruction = {"samples": 359, "skipped": 0, "split": "validation", "data": "digits",
                      "ranks": 1, "loss": 0.00412}
    assert evaluate.summary(reconstruction) == (
        "359 samples (validation of digits) on 1 rank(s): loss 0.0041")
    nothing = {**result, "samples": 0, "skipped": 3, "loss": None, "accuracy": None,
               "per_class_accuracy": {"0": None}}
    assert evaluate.summary(nothing).endswith("on 2 rank(s): nothing to score")


def test_a_batchs_sums_are_keras_evaluates_with_the_models_own_penalties():
    """What each rank adds up, over uneven batches, is Keras' evaluate of the compiled model:
    its loss with the penalties of the layers' weight and activity regularizers (which a
    ``--model`` file may carry), and its accuracy."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu",
                                kernel_regularizer=keras.regularizers.L2(0.05),
                                activity_regularizer=keras.regularizers.L1(0.01))(inputs)
    logits = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.1))(hidden)
    model = keras.Model(inputs, logits)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, metrics=["accuracy"])
    images = np.random.default_rng(0).normal(size=(103, 6)).astype("float32")
    labels = np.random.default_rng(1).integers(0, 3, size=103)
    keras_says = model.evaluate(images, labels, batch_size=10, verbose=0, return_dict=True)

    sums = evaluate.batch_sums(model, loss, classes=3)
    loss_sum, scored, confusion = 0.0, 0.0, np.zeros((3, 3))
    for start in range(0, 103, 25):  # other batches than Keras': 25, 25, 25, 25, 3
        batch_loss, batch_scored, batch_confusion = sums(
            images[start:start + 25], labels[start:start + 25],
            np.ones(len(labels[start:start + 25]), "float32"))
        loss_sum, confusion = loss_sum + float(batch_loss), confusion + batch_confusion.numpy()
        scored += float(batch_scored)
    assert confusion.sum() == scored == 103
    assert loss_sum / 103 == pytest.approx(keras_says["loss"], rel=1e-5)
    assert np.trace(confusion) / 103 == pytest.approx(keras_says["accuracy"], abs=1e-6)
    # Without the penalties the loss is not Keras' by far more than the tolerance.
    plain = float(loss(labels, model(images, training=False)))
    assert keras_says["loss"] - plain > 0.1, (keras_says, plain)


def test_other_data_is_decoded_to_the_images_the_run_trained_on(tmp_path):
    """A run on the embedded digits has no --image-size or --channels: an image folder scored
    with it decodes to its 8x8x1 images, not the 64x64x3 files default to (which the model
    refused). A run on files keeps its own."""
    def config(recorded_config, images, data_flags):
        recorded = {"program": "hvdtrain.cnn", "config": recorded_config,
                    "fingerprint": {"images": images}}
        (tmp_path / "config.json").write_text(json.dumps(recorded))
        return runmodel.run_config(str(tmp_path), recorded, ClassifierConfig, data_flags)

    scored = config({"data": "digits"}, "8x8x1", {"data_dir": "new"})
    assert (scored.data_dir, scored.image_size, scored.channels) == ("new", 8, 1)
    assert config({"data": "digits"}, "8x8x1", None).image_size is None  # its own data
    files = config({"data_dir": "old", "image_size": 32, "channels": 3}, "32x32x3",
                   {"tfrecords": "shards"})
    assert (files.tfrecords, files.data_dir, files.image_size, files.channels) == (
        "shards", None, 32, 3)


def test_images_the_model_was_not_built_for_are_one_line(tmp_path):
    import keras

    request = evaluate.parse(["--run-dir", str(tmp_path / "run")])
    scoring = evaluate.Evaluation(request, {}, ClassifierConfig(), runtime=None,
                                  job=CLASSIFIER_JOB)
    inputs = keras.Input((8, 8, 1))
    model = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(inputs)))
    scoring.check_image_shape(model, (8, 8, 1))  # the run's own
    with pytest.raises(UserError, match=re.escape(
            "the model takes 8x8x1 images and this data decodes to 8x8x3 at the run's "
            "--image-size and --channels: score images of the kind the run trained on")):
        scoring.check_image_shape(model, (8, 8, 3))
