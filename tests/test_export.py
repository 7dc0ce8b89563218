"""hvdtrain export's SavedModel, in process on small models: what each signature takes and gives,
the check for horovod ops, and where it writes. A trained run's export, loaded where horovod and
hvdtrain cannot be imported, is test_jobs.py's."""
from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

import hvdtrain
from hvdtrain import export
from hvdtrain.errors import UserError


def run_dir_of(tmp_path, model, program: str, **recorded):
    """A run directory as a finished job leaves it, as far as the export reads it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    model.save(run_dir / "model.keras")
    (run_dir / "config.json").write_text(json.dumps(
        {"program": program, "config": {"keras": hvdtrain.KERAS}, **recorded}))
    return run_dir


def test_the_classifiers_signature_gives_its_probabilities_and_class_names(tmp_path):
    import keras
    import tensorflow as tf

    inputs = keras.Input((4, 4, 1), dtype="uint8")
    logits = keras.layers.Dense(2)(keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(inputs)))
    model = keras.Model(inputs, logits)
    run_dir = run_dir_of(tmp_path, model, "hvdtrain.cnn", class_names=["cat", "dog"])
    output = tmp_path / "served" / "pets" / "1"  # its parents made too
    line = export.write_savedmodel(str(run_dir), str(output))
    assert line.endswith("uint8 images [batch, 4, 4, 1] in; probabilities [batch, 2] and "
                         "classes (one of 2 names) out"), line
    images = np.random.default_rng(0).integers(0, 256, (6, 4, 4, 1), dtype=np.uint8)
    served = tf.saved_model.load(str(output)).signatures["serving_default"](
        images=tf.constant(images))
    expected = tf.nn.softmax(model(images)).numpy()
    np.testing.assert_allclose(served["probabilities"].numpy(), expected, atol=1e-6)
    assert [name.decode() for name in served["classes"].numpy()] == [
        ["cat", "dog"][index] for index in expected.argmax(axis=1)]
    assert sorted(os.listdir(output.parent)) == ["1"]  # no staging directory left


def test_another_jobs_model_is_served_as_its_own_call_with_every_output_named(tmp_path):
    import keras
    import tensorflow as tf

    first, second = keras.Input((3,), name="first"), keras.Input((2,), name="second")
    joined = keras.layers.Concatenate()([first, second])
    model = keras.Model([first, second], [keras.layers.Dense(1, name="score")(joined),
                                          keras.layers.Dense(4, name="embedding")(joined)])
    run_dir = run_dir_of(tmp_path, model, "my_job")
    output = tmp_path / "served"
    output.mkdir()  # an empty directory is taken
    line = export.write_savedmodel(str(run_dir), str(output))
    assert "first float32 [batch, 3], second float32 [batch, 2] in" in line, line
    values = [np.ones((5, 3), np.float32), np.arange(10, dtype=np.float32).reshape(5, 2)]
    served = tf.saved_model.load(str(output)).signatures["serving_default"](
        first=tf.constant(values[0]), second=tf.constant(values[1]))
    expected = model(values)
    assert sorted(served) == ["embedding", "score"]
    np.testing.assert_allclose(served["score"].numpy(), np.asarray(expected[0]), atol=1e-6)
    np.testing.assert_allclose(served["embedding"].numpy(), np.asarray(expected[1]), atol=1e-6)


def test_horovods_ops_are_found_in_a_savedmodel_and_a_planted_output_or_a_url_is_refused(
        tmp_path, monkeypatch):
    import tensorflow as tf
    from horovod.tensorflow.mpi_ops import _allreduce  # the op itself: traced, never run

    module = tf.Module()
    module.average = tf.function(lambda values: _allreduce(values),
                                 input_signature=[tf.TensorSpec([2], tf.float32)])
    tf.saved_model.save(module, str(tmp_path / "with-horovod"))
    assert export._horovod_ops(str(tmp_path / "with-horovod")) == ["HorovodAllreduce"]

    (tmp_path / "theirs").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "theirs")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"program": "x", "config": {}}))
    (tmp_path / "run" / "model.keras").write_text("")
    with pytest.raises(UserError, match="link exists and is not an empty directory"):
        export.write_savedmodel(str(tmp_path / "run"), str(tmp_path / "link"))
    assert os.listdir(tmp_path / "theirs") == []
    # A URL is refused, never taken for a relative path (it wrote ./gs:/bucket/model).
    monkeypatch.chdir(tmp_path)
    for run_dir, output, message in (
            ("gs://bucket/run", "served", "--run-dir gs://bucket/run: this command takes file "
                                          "system paths, not URLs: copy it to a file system"),
            ("run", "gs://bucket/model", "--output gs://bucket/model: this command takes file "
                                         "system paths, not URLs: write to a file system path")):
        with pytest.raises(UserError, match=re.escape(message)):
            export.write_savedmodel(run_dir, output)
    assert not (tmp_path / "gs:").exists() and not (tmp_path / "served").exists()
