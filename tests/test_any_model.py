"""Any Keras model trains and exports: subclassed models and unregistered custom layers, on both
Kerases, under 2 real ranks (integration tier: the test starts its own jobs of 2 ranks, under
mpirun as horovodrun starts them).

A subclassed model makes its variables at its first call; hvdtrain builds it from the data before
the optimizer's slots, the restore and rank 0's broadcast. A model that cannot be rebuilt from its
config is exported as weights, with one line saying so, and the finished run exits 0.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, clean_env, integration, mpirun_ranks, run_job

pytestmark = [integration, pytest.mark.timeout(400)]

KERASES = ["2", "3"]
JOBS = str(REPO / "tests" / "scripts" / "any_model_jobs.py")


def ranks_job(script_args: list[str], keras: str, **env: str) -> subprocess.CompletedProcess:
    return run_job([*mpirun_ranks(2), sys.executable, *script_args],
                   timeout=300, check=False, env=clean_env(HVDTRAIN_KERAS=keras, **env))


def arrays(path) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[f"w{index}"] for index in range(len(saved.files))]


CUSTOM_LAYER_MODEL = '''
import keras
import tensorflow as tf


class Standardize(keras.layers.Layer):
    """Images to zero mean and unit variance per sample; not registered as serializable."""

    def call(self, images):
        pixels = tf.cast(images, tf.float32)
        mean, variance = tf.nn.moments(pixels, axes=[1, 2, 3], keepdims=True)
        return (pixels - mean) / tf.sqrt(variance + 1e-6)


class Factor:
    def __init__(self, value):
        self.value = value


class Scale(keras.layers.Layer):
    """Built from an object Keras cannot serialize, without a get_config: its config cannot
    rebuild it (simple arguments, such as a float, Keras records by itself)."""

    def __init__(self, factor):
        super().__init__()
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor.value


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape, dtype="uint8")
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(Standardize()(inputs))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def build_unrebuildable(input_shape, num_classes):
    inputs = keras.Input(input_shape, dtype="uint8")
    x = keras.layers.Flatten()(Scale(Factor(0.5))(Standardize()(inputs)))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))
'''


@pytest.mark.parametrize("keras", KERASES)
def test_a_subclassed_model_and_an_unregistered_custom_layer_train_export_load_and_resume_idle(
        tmp_path, keras):
    """Two jobs of 2 ranks per Keras (tests/scripts/any_model_jobs.py), each running several
    checks' runs in turn so that the ranks start and import TensorFlow twice, not three times:
    the first trains the subclassed model, then the two custom-layer models (hvdtrain.cnn's
    flags and run); the second runs the subclassed one again (idle) and, in that fresh process,
    loads what the first exported."""
    run_dir = tmp_path / "run"
    subclassed = ["--run-dir", str(run_dir), "--epochs", "2", "--steps-per-epoch", "4"]
    model_file = tmp_path / "custom_layer.py"
    model_file.write_text(CUSTOM_LAYER_MODEL)
    flags = {builder: ["--preset", "tiny", "--epochs", "1", "--model",
                       f"{model_file}:{builder}", "--run-dir", str(tmp_path / builder)]
             for builder in ("build", "build_unrebuildable")}
    first = ranks_job([JOBS, *subclassed, "--then", *flags["build"],
                       "--then", *flags["build_unrebuildable"]], keras,
                      ANY_MODEL_WEIGHTS=str(tmp_path))
    assert first.returncode == 0, first.stdout[-4000:]
    assert "Traceback" not in first.stdout
    # Rank 0 prints them in the order the runs went: the subclassed model's, the unrebuildable
    # model's; none for the model that config rebuilds.
    exported = [line for line in first.stdout.splitlines() if "model: wrote" in line]
    assert len(exported) == 2, first.stdout[-4000:]

    # The subclassed model.
    assert [row["epoch"] for row in json.loads((run_dir / "metrics.json").read_text())] == [1, 2]
    # The ranks' own initialisations differ; rank 0's broadcast and the averaged updates leave
    # them identical.
    initial = [arrays(tmp_path / f"initial-rank{rank}.npz") for rank in (0, 1)]
    assert any(not np.array_equal(a, b) for a, b in zip(*initial)), "the ranks started equal"
    final = [arrays(tmp_path / f"final-rank{rank}.npz") for rank in (0, 1)]
    assert len(final[0]) == len(final[1]) == 8  # 2 dense x 2, batch norm x 4
    for mine, theirs in zip(*final):
        np.testing.assert_allclose(theirs, mine, rtol=1e-6, atol=1e-7)
    # No config to rebuild it from: the weights, and one line naming the file and why.
    assert f"model: wrote {run_dir / 'model.weights.h5'}, not model.keras" in exported[0]
    assert "build it in code and load_weights() this file" in exported[0]
    assert not (run_dir / "model.keras").exists()

    # The custom-layer models.
    files = {builder: sorted(p.name for p in (tmp_path / builder).glob("model*"))
             for builder in flags}
    # Its config rebuilds it once its classes are named: model.keras (which loads wherever the
    # class is defined: below), and no line about the export.
    assert files["build"] == ["model.keras"]
    # A layer its config cannot rebuild: the weights, one line, exit 0.
    assert files["build_unrebuildable"] == ["model.weights.h5"], first.stdout[-3000:]
    assert "cannot be rebuilt from its config" in exported[1] and \
        str(tmp_path / "build_unrebuildable") in exported[1], first.stdout[-3000:]
    assert "must override `get_config()`" in exported[1], exported[1]  # Keras' reason, one line

    # Run the subclassed model again: every epoch is done, so nothing trains and nothing is
    # written again; exit 0. Then, in this fresh process, the files load: the weights into the
    # model built in code, predicting as trained; model.keras with custom_objects.
    exported_at = (run_dir / "model.weights.h5").stat().st_mtime_ns
    again = ranks_job([JOBS, *subclassed, "--check-loads", str(run_dir / "model.weights.h5"),
                       str(tmp_path / "final-rank0.npz"), str(tmp_path),
                       str(tmp_path / "build" / "model.keras")], keras)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "2 of 2 epochs already done; nothing to train" in again.stdout
    assert "model: wrote" not in again.stdout
    assert (run_dir / "model.weights.h5").stat().st_mtime_ns == exported_at
    loads = [line.split("loads: ", 1)[1] for line in again.stdout.splitlines()
             if "loads: " in line]
    assert loads == ["subclassed weights as trained: True",
                     "custom-layer model predicts (3, 10)"], again.stdout[-3000:]
