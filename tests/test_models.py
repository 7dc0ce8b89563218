"""--model: the built-in classifiers and a user's own model file.

Pure tier: every way a user's file can be wrong is one line naming the file. Integration tier:
each built-in model trains an epoch under 2 ranks; a broken file under 2 ranks is one line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, integration, mpirun_job, mpirun_ranks, run_job
from hvdtrain.cnn import ClassifierConfig
from hvdtrain.models import build_classifier

SCRIPTS = Path(__file__).parent / "scripts"

EXAMPLE = REPO / "examples" / "my_model.py"

BROKEN_FILES = [
    ("missing", None, "no such file"),
    ("syntax", "def build(:\n", "syntax error in"),
    ("raises at import", "raise RuntimeError('no GPU here')\n",
     "importing .* failed: RuntimeError: no GPU here"),
    ("no function", "def other(shape, classes):\n    pass\n", "defines no function build"),
    ("wrong type", "def build(shape, classes):\n    return 'a model'\n", "returned a str, not"),
    ("wrong classes", "import keras\ndef build(shape, classes):\n"
                      "    i = keras.Input(shape)\n"
                      "    return keras.Model(i, keras.layers.Dense(3)(keras.layers.Flatten()(i)))\n",
     r"output shape is \(None, 3\), but the data has 10 classes"),
    ("builder raises", "def build(shape, classes):\n    raise ValueError('bad shape')\n",
     "raised ValueError: bad shape"),
]


@pytest.mark.parametrize("name, source, message", BROKEN_FILES, ids=[b[0] for b in BROKEN_FILES])
def test_a_broken_model_file_is_one_line_naming_it(tmp_path, name, source, message):
    path = tmp_path / "model.py"
    if source is not None:
        path.write_text(source)
    with pytest.raises(ValueError, match=message) as error:
        build_classifier(f"{path}:build", (8, 8, 1), 10)
    assert "\n" not in str(error.value) and str(path) in str(error.value)


def test_the_example_model_file_builds_with_the_keras_hvdtrain_runs():
    import keras  # the Keras conftest's hvdtrain import selected, as the file's `import keras`

    model = build_classifier(f"{EXAMPLE}:build", (16, 16, 3), 5)
    assert isinstance(model, keras.Model) and model.output_shape == (None, 5)


@pytest.mark.parametrize("name", ["resnet50", "mobilenetv2", "efficientnetb0"])
def test_applications_take_uint8_images_of_any_channels_and_return_logits(name):
    import numpy as np

    model = build_classifier(name, (32, 32, 1), 7)
    logits = model(np.zeros((2, 32, 32, 1), np.uint8))
    assert logits.shape == (2, 7) and logits.dtype.name == "float32"
    with pytest.raises(ValueError, match="at least 32x32.*--image-size 32"):
        build_classifier(name, (8, 8, 1), 7)


def test_model_flag_is_validated_with_the_config():
    with pytest.raises(ValueError, match="--model must be one of cnn, resnet50"):
        ClassifierConfig(model="vgg16")
    assert ClassifierConfig(model="path/to/net.py:build").model == "path/to/net.py:build"


@integration
@pytest.mark.timeout(900)
def test_builtin_applications_each_train_an_epoch(tmp_path):
    # The smallest input each accepts and one step of a few synthetic images, without a
    # validation pass: most of a run is building and tracing the network, which is the check.
    # One job per rank count trains its networks in turn (tests/scripts/cnn_runs.py: hvdtrain.cnn's
    # flags and training run per model), so the ranks start once. Under two ranks,
    # efficientnetb0: of the three it alone holds a variable that is not float (its Normalization
    # layer's int64 count), which rank 0's broadcast must carry with the float kernels and batch
    # norm statistics the others hold too; resnet50 and mobilenetv2, one rank each (what two
    # ranks add, they share with it: 45 s of CPU less on a 2-core machine). python -m
    # hvdtrain.cnn itself is run by the broken-model test below and the user-model tests.
    def runs(names):
        argv = []
        for name in names:
            argv += ["--then"] * bool(argv) + [
                "--model", name, "--image-size", "32", "--data", "synthetic",
                "--synthetic-samples", "64", "--validation-fraction", "0", "--batch-size", "8",
                "--epochs", "1", "--steps-per-epoch", "1", "--bn-recompute-batches", "1",
                "--keep-checkpoints", "1", "--no-tensorboard", "--no-export", "--run-dir",
                str(tmp_path / name)]
        return [sys.executable, str(SCRIPTS / "cnn_runs.py"), "--no-grappler", *argv]

    ranks_of = {"efficientnetb0": 2, "resnet50": 1, "mobilenetv2": 1}
    run_job([*mpirun_ranks(2), *runs(["efficientnetb0"])], timeout=600)
    run_job([*mpirun_ranks(1), *runs(["resnet50", "mobilenetv2"])], timeout=600)
    for name, ranks in ranks_of.items():
        run_dir = tmp_path / name
        rows = json.loads((run_dir / "metrics.json").read_text())
        assert rows[0]["epoch"] == 1 and rows[0]["loss"] > 0, name
        recorded = json.loads((run_dir / "config.json").read_text())
        assert recorded["config"]["model"] == name and recorded["world"]["size"] == ranks, name
        assert (run_dir / "checkpoints" / "checkpoint").is_file(), name


@integration
def test_a_broken_model_file_under_two_ranks_is_one_line_and_writes_nothing(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("def build(shape, classes):\n    return None\n")
    result = mpirun_job(2, "hvdtrain.cnn", "--model", f"{path}:build",
                        "--run-dir", str(tmp_path / "run"), check=False, timeout=200)
    errors = [l for l in result.stdout.splitlines() if "hvdtrain.cnn: error" in l]
    assert result.returncode != 0
    assert len(errors) == 1 and str(path) in errors[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert not (tmp_path / "run").exists()
