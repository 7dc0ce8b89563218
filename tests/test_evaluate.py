"""hvdtrain evaluate's arguments, its output's name and place, and its summary, in process. A
trained run scored on 1 and 2 ranks against Keras' own evaluate is test_jobs.py's."""
from __future__ import annotations

import os

import pytest

from hvdtrain import evaluate, runmodel
from hvdtrain.cnn import ClassifierConfig
from hvdtrain.errors import UserError


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "newest"], "--checkpoint must be 'latest' or a checkpoint's number"),
    (["--data", "digits", "--data-dir", "x"], "name one data source"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--name", "../up"], "--name must be letters, digits"),
])
def test_bad_arguments_are_one_line_before_anything_is_read(argv, message):
    with pytest.raises(UserError, match=message):
        evaluate.parse(["--run-dir", "runs/x", *argv])


def test_the_output_is_named_by_split_data_and_checkpoint_and_checked_before_scoring(tmp_path):
    def path(*argv, model="runs/x/model.keras", **config):
        request = evaluate.parse(["--run-dir", str(tmp_path / "run"), *argv])
        found = evaluate.Evaluation(request, {}, ClassifierConfig(**config), runtime=None)
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
    nothing = {**result, "samples": 0, "skipped": 3, "loss": None, "accuracy": None,
               "per_class_accuracy": {"0": None}}
    assert evaluate.summary(nothing).endswith("on 2 rank(s): nothing to score")
