"""Keras 3 (the default) and Keras 2 (`--keras 2`): the choice at import, and hvdtrain's own
horovod integration across ranks.

A process has one Keras, chosen when conftest imports hvdtrain (HVDTRAIN_KERAS, else the default),
so the jobs here that need a given Keras say so: the collective checks in
tests/scripts/keras3_ranks.py under `mpirun -np 2`, and the CLI as users run it.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, clean_env, horovodrun, integration, run_job
from hvdtrain import _requested_keras
from hvdtrain.launch.options import LaunchOptions
from hvdtrain.launch.paths import build_launch

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("argv, env, expected", [
    ([], {}, "3"),  # what `import keras` gives on TensorFlow >= 2.16
    ([], {"TF_USE_LEGACY_KERAS": "1"}, "2"),  # ... and what it gives tf.keras there
    ([], {"HVDTRAIN_KERAS": "2"}, "2"),
    ([], {"HVDTRAIN_KERAS": "3", "TF_USE_LEGACY_KERAS": "1"}, "3"),
    (["-m", "--preset", "tiny", "--keras", "2"], {}, "2"),
    (["-m", "--keras=2"], {}, "2"),
    (["-m", "--keras", "3"], {"HVDTRAIN_KERAS": "2"}, "3"),  # the command line wins
    (["-m", "--keras", "4"], {}, "3"),  # left to the flag parser, which names the choices
    (["-m", "--keras"], {"HVDTRAIN_KERAS": "2"}, "2"),
])
def test_the_keras_is_chosen_from_the_command_line_then_the_environment(argv, env, expected):
    assert _requested_keras(argv, env) == expected


def test_the_launcher_tells_every_rank_on_every_node():
    for via in ("horovodrun", "mpirun"):
        launch = build_launch(LaunchOptions(program="hvdtrain.cnn", via=via, keras="3",
                                            hosts="node1:2,node2:2"), None, gpus=0)
        assert launch.env["HVDTRAIN_KERAS"] == "3"
        if via == "mpirun":  # remote ranks see only what -x names
            assert ("-x", "HVDTRAIN_KERAS") in zip(launch.argv, launch.argv[1:])
    keras_2 = build_launch(LaunchOptions(program="hvdtrain.cnn", hosts="node1:2", keras="2"), None,
                           gpus=0, environment={"HVDTRAIN_KERAS": "3"})
    assert keras_2.env["HVDTRAIN_KERAS"] == "2"  # said too: a launcher may have inherited 3
    # auto: what `import keras` gives where the launcher runs ...
    for environment, keras in (({}, "3"), ({"TF_USE_LEGACY_KERAS": "1"}, "2")):
        auto = build_launch(LaunchOptions(program="hvdtrain.cnn", hosts="node1:2"), None,
                            gpus=0, environment=environment)
        assert auto.env["HVDTRAIN_KERAS"] == keras and not any("Keras" in n for n in auto.notes)


def test_a_script_on_horovods_keras_api_gets_keras_3_and_one_written_for_keras_2_gets_keras_2(
        tmp_path):
    # horovod.tensorflow.keras runs on Keras 3 with hvdtrain's horovod (patches 0005, 0006):
    # horovod's own Keras example starts as `python script.py` on the default Keras.
    plain = str(REPO / "examples" / "plain_horovod.py")  # import horovod.tensorflow.keras as hvd
    launch = build_launch(LaunchOptions(program=plain, hosts="node1:2"), None, gpus=0,
                          environment={})
    assert launch.env["HVDTRAIN_KERAS"] == "3" and "hvdtrain.script" not in launch.argv
    assert not any(note.startswith("Keras 2: ") for note in launch.notes), launch.notes
    # What Keras 3 does not have: Keras 2's optimizer method variables() (horovod's
    # tensorflow2_mnist.py broadcasts opt.variables()), its compile argument
    # experimental_run_tf_function (tensorflow2_keras_mnist.py), tf_keras, horovod.keras.
    for name, source, reason in (
            ("tensorflow2_mnist.py", "import horovod.tensorflow as hvd\n"
             "hvd.broadcast_variables(opt.variables(), root_rank=0)\n",
             "calls variables(), Keras 2's optimizer method (a list in Keras 3)"),
            ("tensorflow2_keras_mnist.py", "import horovod.tensorflow.keras as hvd\n"
             "model.compile(optimizer=opt, experimental_run_tf_function=False)\n",
             "passes experimental_run_tf_function, a Keras 2 compile argument"),
            ("legacy.py", "import tf_keras as keras\n", "imports tf_keras or horovod.keras"),
            ("keras_package.py", "from horovod.keras import DistributedOptimizer\n",
             "imports tf_keras or horovod.keras")):
        script = tmp_path / name
        script.write_text(source)
        launch = build_launch(LaunchOptions(program=str(script), hosts="node1:2"), None, gpus=0,
                              environment={})
        assert launch.env["HVDTRAIN_KERAS"] == "2", name
        assert f" -m hvdtrain.script {script}" in " ".join(launch.argv), launch.argv
        assert f"Keras 2: {script} {reason} (--keras 3 to override)" in launch.notes, launch.notes
    other = tmp_path / "train.py"
    other.write_text("import keras\nimport horovod.tensorflow as hvd\n"
                     "hvd.broadcast_variables(model.variables, root_rank=0)\n")
    launch = build_launch(LaunchOptions(program=str(other), hosts="node1:2"), None, gpus=0,
                          environment={})
    assert launch.env["HVDTRAIN_KERAS"] == "3" and "hvdtrain.script" not in launch.argv
    forced = build_launch(LaunchOptions(program=str(tmp_path / "legacy.py"), hosts="node1:2",
                                        keras="3"), None, gpus=0, environment={})
    assert forced.env["HVDTRAIN_KERAS"] == "3" and "hvdtrain.script" not in forced.argv


def test_a_config_for_the_other_keras_is_refused_in_one_line():
    import dataclasses

    from hvdtrain import KERAS

    from hvdtrain.training import train
    from hvdtrain.cnn import tiny
    from hvdtrain.errors import UserError

    other = "2" if KERAS == "3" else "3"
    with pytest.raises(UserError, match=rf"this process runs Keras {KERAS} .* HVDTRAIN_KERAS="
                                        rf"{other}"):
        train.check_keras(dataclasses.replace(tiny(), keras=other))


def keras3_env(**extra: str) -> dict[str, str]:
    return clean_env(HVDTRAIN_KERAS="3", **extra)


@integration
def test_two_ranks_on_keras_3_stay_identical_resume_and_stop_cleanly(tmp_path):
    verdicts_file = tmp_path / "verdicts.json"
    # A stalled collective ends the job in a minute instead of five (a failure, not a hang).
    run_job(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable,
             str(REPO / "tests" / "scripts" / "keras3_ranks.py"), str(verdicts_file)],
            timeout=240, env=keras3_env(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="60"))
    report = json.loads(verdicts_file.read_text())
    assert report["world_size"] == 2 and report["keras"].startswith("3.")
    failed = {name: detail for name, detail in report["verdicts"].items() if detail != "ok"}
    assert not failed, "\n\n".join(f"{name}:\n{detail}" for name, detail in failed.items())
    assert set(report["verdicts"]) == {
        "no_horovod_keras_api", "one_step_from_different_initial_weights", "resume",
        "mixed_precision_accumulation_fp16_allreduce", "resumed_mixed_precision",
        "metrics_averaged", "autoencoder_batch_norm", "preemption"}


USER_MODEL = '''
import keras


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape, dtype="uint8")
    x = keras.ops.cast(inputs, "float32") / 255.0          # keras.ops: Keras 3 only
    x = keras.layers.Conv2D(8, 3, padding="same", activation="relu")(x)
    x = keras.ops.mean(x, axis=(1, 2))
    return keras.Model(inputs, keras.layers.Dense(num_classes, dtype="float32")(x))
'''


@integration
def test_a_keras_3_user_model_trains_on_two_ranks_and_its_export_loads(tmp_path):
    model_file = tmp_path / "ops_model.py"
    model_file.write_text(USER_MODEL)
    run_dir = tmp_path / "run"
    result = horovodrun(2, "hvdtrain.cnn", "--keras", "3", "--preset", "tiny", "--epochs", "2",
                        "--model", f"{model_file}:build", "--run-dir", str(run_dir))
    assert "backend horovod | 2 process(es), 2 worker(s)" in result.stdout
    assert "| Keras 3." in result.stdout
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["keras"] == "3" and config["versions"]["keras"].startswith("Keras 3.")
    assert len(json.loads((run_dir / "metrics.json").read_text())) == 2
    # The export names Keras' own optimizer, not hvdtrain's: it loads in a plain Keras 3 process.
    check = subprocess.run(
        [sys.executable, "-c", "import numpy as np, keras; "
         f"m = keras.saving.load_model('{run_dir / 'model.keras'}'); "
         "print(keras.__version__, m.predict(np.zeros((3, 8, 8, 1), 'uint8'), verbose=0).shape)"],
        capture_output=True, text=True, timeout=120, env=clean_env())
    assert check.stdout.startswith("3.") and "(3, 10)" in check.stdout, check.stderr[-2000:]


@integration
@pytest.mark.parametrize("args, message", [
    (["--backend", "tpu"], "Keras 3 (the default) runs on the horovod, single and mirrored "
                           "backends; on 'tpu' it has never run here: pass --keras 2"),
    (["--backend", "mirrored", "--steps-per-execution", "4"],
     "--steps-per-execution above 1 with --backend mirrored fails inside Keras 3: pass --keras "
     "2, or --steps-per-execution 1"),
])
def test_keras_3_where_it_cannot_run_is_one_line(tmp_path, args, message):
    result = run_job([sys.executable, "-m", "hvdtrain.cnn", "--keras", "3", *args, "--run-dir",
                      str(tmp_path / "r")], timeout=120, check=False)
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-2000:]
    assert lines[-1] == f"hvdtrain.cnn: error: {message}", lines
    assert not (tmp_path / "r").exists()


@integration
def test_a_horovod_tensorflow_script_of_the_users_own_runs_on_keras_3(tmp_path):
    """horovod's own TF2 patterns, with no hvdtrain in them (tests/scripts/horovod_tape_keras3.py):
    DistributedGradientTape died at its first step on Keras 3 ("'Variable' object has no
    attribute 'ref'", horovod#4290), hvd.DistributedOptimizer let every rank apply its own
    gradient, SyncBatchNormalization refused to be built (horovod patch 0005), and
    horovod.tensorflow.keras's LearningRateWarmupCallback died at its first batch ("module
    'keras.backend' has no attribute 'get_value'"; patch 0006). Every number below is checked
    against one computed from every rank's data by hand."""
    result = run_job(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none",
                      sys.executable, str(REPO / "tests" / "scripts" / "horovod_tape_keras3.py"),
                      str(tmp_path)],
                     timeout=240, env=keras3_env(HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="60"))
    line = next((line for line in result.stdout.splitlines() if "RESULT " in line), None)
    assert line, result.stdout[-3000:]
    every = json.loads(line.split("RESULT ", 1)[1])
    first = every[0]
    for rank, seen in enumerate(every):
        assert seen["keras"].startswith("3."), seen
        assert seen["broadcast_identical"] and seen["gradients_differ_between_ranks"], seen
        for name in ("tape_error", "partial_error", "optimizer_error", "sync_bn_error",
                     "sync_bn_moving_error"):
            assert seen[name] < 1e-5, (rank, name, seen)
        assert seen["fit_max_difference"] < 1e-6 and seen["optimizer_variables"] == 2, seen
        assert seen["sync_bn_differs_from_local"] and not seen["sync_bn_model_supports_jit"], seen
        # horovod.tensorflow.keras (patch 0006).
        assert seen["keras_fit_max_difference"] < 1e-6, seen
        assert seen["keras_losses"] == first["keras_losses"], (seen, first)
        assert seen["warmup_error"] < 1e-6 and abs(seen["rate_after_warmup"] - 0.04) < 1e-6, seen
        assert seen["loaded_optimizer"] == "horovod._keras" and seen["loaded_iterations"] == 6
        assert seen["loaded_fit_max_difference"] < 1e-6, seen
    # Momentum correction cannot work on Keras 3 (its momentum is a constant of the compiled
    # step): one line on rank 0, not a failure.
    assert result.stdout.count("LearningRateWarmupCallback: no momentum correction (the "
                               "optimizer") \
        == 1, result.stdout[-3000:]
