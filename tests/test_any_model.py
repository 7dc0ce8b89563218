"""Any Keras model trains and exports: subclassed models and unregistered custom layers, on both
Kerases, under 2 real ranks (integration tier: each test starts its own jobs of 2 ranks, under
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


def ranks_job(script_args: list[str], keras: str, **env: str) -> subprocess.CompletedProcess:
    return run_job([*mpirun_ranks(2), sys.executable, *script_args],
                   timeout=300, check=False, env=clean_env(HVDTRAIN_KERAS=keras, **env))


def arrays(path) -> list[np.ndarray]:
    with np.load(path) as saved:
        return [saved[f"w{index}"] for index in range(len(saved.files))]


@pytest.mark.parametrize("keras", KERASES)
def test_a_subclassed_model_trains_from_rank_0s_weights_exports_its_weights_and_resumes_idle(
        tmp_path, keras):
    run_dir = tmp_path / "run"
    job = [str(REPO / "tests" / "scripts" / "subclassed_task.py"), "--run-dir", str(run_dir),
           "--epochs", "2", "--steps-per-epoch", "4"]
    first = ranks_job(job, keras, ANY_MODEL_WEIGHTS=str(tmp_path))
    assert first.returncode == 0, first.stdout[-4000:]
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
    model_lines = [line for line in first.stdout.splitlines() if "model: wrote" in line]
    assert len(model_lines) == 1, first.stdout[-4000:]
    assert f"model: wrote {run_dir / 'model.weights.h5'}, not model.keras" in model_lines[0]
    assert "build it in code and load_weights() this file" in model_lines[0]
    assert not (run_dir / "model.keras").exists()
    assert "Traceback" not in first.stdout
    # The file loads into the model built in code, in a fresh process, and predicts as trained.
    load = subprocess.run(
        [sys.executable, "-c", "import sys, numpy as np; sys.path.insert(0, sys.argv[1]); "
         "import subclassed_task as t; m = t.WineNet(); m(np.zeros((1, t.FEATURES), 'float32')); "
         "m.load_weights(sys.argv[2]); "
         "print(all(np.allclose(a, b) for a, b in zip(m.get_weights(), "
         "list(np.load(sys.argv[3]).values()))))",
         str(REPO / "tests" / "scripts"), str(run_dir / "model.weights.h5"),
         str(tmp_path / "final-rank0.npz")],
        capture_output=True, text=True, timeout=120, env=clean_env(HVDTRAIN_KERAS=keras))
    assert load.stdout.strip() == "True", load.stderr[-3000:]

    # Run again: every epoch is done, so nothing trains and nothing is written again; exit 0.
    exported_at = (run_dir / "model.weights.h5").stat().st_mtime_ns
    again = ranks_job(job, keras)
    assert again.returncode == 0, again.stdout[-4000:]
    assert "2 of 2 epochs already done; nothing to train" in again.stdout
    assert "model: wrote" not in again.stdout
    assert (run_dir / "model.weights.h5").stat().st_mtime_ns == exported_at


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
def test_an_unregistered_custom_layer_in_a_model_file_trains_and_exports(tmp_path, keras):
    model_file = tmp_path / "custom_layer.py"
    model_file.write_text(CUSTOM_LAYER_MODEL)
    # Both models in one job (tests/scripts/cnn_runs.py: hvdtrain.cnn's flags and training run
    # for each in turn): the ranks start once.
    flags = {builder: ["--preset", "tiny", "--epochs", "1", "--model",
                       f"{model_file}:{builder}", "--run-dir", str(tmp_path / builder)]
             for builder in ("build", "build_unrebuildable")}
    result = ranks_job([str(REPO / "tests" / "scripts" / "cnn_runs.py"), *flags["build"],
                        "--then", *flags["build_unrebuildable"]], keras)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Traceback" not in result.stdout
    files = {builder: sorted(p.name for p in (tmp_path / builder).glob("model*"))
             for builder in flags}
    exported = [line for line in result.stdout.splitlines() if "model: wrote" in line]

    # Its config rebuilds it once its classes are named: model.keras, which loads wherever the
    # class is defined (custom_objects), and no line about the export.
    assert files["build"] == ["model.keras"]
    load = subprocess.run(
        [sys.executable, "-c", "import sys, numpy as np, hvdtrain, keras; sys.path.insert(0, "
         "sys.argv[1]); import custom_layer; m = keras.models.load_model(sys.argv[2], "
         "custom_objects={'Standardize': custom_layer.Standardize}, compile=False); "
         "print(m.predict(np.zeros((3, 8, 8, 1), 'uint8'), verbose=0).shape)",
         str(tmp_path), str(tmp_path / "build" / "model.keras")],
        capture_output=True, text=True, timeout=120, env=clean_env(HVDTRAIN_KERAS=keras))
    assert load.stdout.strip() == "(3, 10)", load.stderr[-3000:]

    # A layer its config cannot rebuild: the weights, one line (the only one about the export,
    # so none for the model above), exit 0.
    assert files["build_unrebuildable"] == ["model.weights.h5"], result.stdout[-3000:]
    assert len(exported) == 1 and "cannot be rebuilt from its config" in exported[0] and \
        str(tmp_path / "build_unrebuildable") in exported[0], result.stdout[-3000:]
    assert "must override `get_config()`" in exported[0], exported[0]  # Keras' reason, one line
