"""Bad input to the CLI and the launcher: one line, printed once, a non-zero exit, nothing written.

Integration tier: every test starts its own real jobs (ranks under mpirun as horovodrun starts
them, the launcher); bad data (folders, undecodable files, data set sizes) is in test_faults.py.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from conftest import clean_env, integration, mpirun_job, one_error, run_job
from images import make_image_folder

pytestmark = [integration, pytest.mark.timeout(600)]


BAD_INPUT = [
    (["--data-dir", "/nonexistent/images"], "no such directory"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
    (["--batch-policy", "global", "--batch-size", "33"], "global batch 33 does not divide by 2"),
    (["--batch-size", "2000"], "fewer than one global batch"),
    (["--backend", "tpu", "--keras", "2"],
     "started as 2 ranks by a launcher, but --backend tpu runs one"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[m for _, m in BAD_INPUT])
def test_bad_input_is_one_line_printed_once_and_writes_nothing(tmp_path, args, message):
    run_dir = tmp_path / "run"
    result = mpirun_job(2, "hvdtrain.cnn", *args, "--run-dir", str(run_dir), check=False)
    assert message in one_error(result)
    assert not run_dir.exists()


def test_unwritable_or_full_run_directory_is_found_before_training(tmp_path):
    from hvdtrain.rundir import RunDir

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = mpirun_job(2, "hvdtrain.cnn", "--preset", "tiny", "--run-dir",
                        str(blocker / "run"), check=False)
    errors = [l for l in result.stdout.splitlines() if "hvdtrain.cnn: error:" in l]
    assert result.returncode != 0 and len(errors) == 1, result.stdout[-3000:]
    assert "is not writable" in errors[0] and "Epoch 1" not in result.stdout
    # Full: ask for more room than the file system has (a real statvfs, nothing faked).
    free = shutil.disk_usage(tmp_path).free
    problem = RunDir(tmp_path / "run", is_chief=True).problem(bytes_needed=free + 2**30)
    assert problem and "MiB free; checkpoints need about" in problem
    assert not (tmp_path / "run").exists()  # the refusal made nothing


def test_a_run_directory_of_another_experiment_is_one_line_and_left_as_it_was(tmp_path):
    """Other data of the same shape (the synthetic digits instead of the real ones) would resume
    the checkpoint and train on: refused by rank 0 before anything is written. A run directory
    made before they recorded what they train gets as far as its checkpoint, which does not fit
    another model (here another image size): TensorFlow would warn about every value of the
    checkpoint the model lacks, under the one line."""
    run_dir = tmp_path / "run"
    mpirun_job(1, "hvdtrain.cnn", "--preset", "tiny", "--epochs", "1", "--run-dir", str(run_dir))
    before = {path: path.read_bytes() if path.is_file() else None
              for path in sorted(run_dir.rglob("*"))}
    result = mpirun_job(2, "hvdtrain.cnn", "--preset", "tiny", "--epochs", "2", "--data",
                        "synthetic", "--run-dir", str(run_dir), check=False)
    line = one_error(result)
    assert result.returncode == 2 and line.startswith("[1,0]<"), result.stdout[-3000:]
    assert line.endswith(f"hvdtrain.cnn: error: run directory {run_dir} holds another experiment "
                         "(samples: 1797, embedded synthetic was 1797, embedded digits): use "
                         "another --run-dir, or --accept-experiment-change to train its "
                         "checkpoint on with this one"), line
    assert {path: path.read_bytes() if path.is_file() else None
            for path in sorted(run_dir.rglob("*"))} == before

    config = json.loads((run_dir / "config.json").read_text())
    del config["fingerprint"]
    (run_dir / "config.json").write_text(json.dumps(config))
    result = mpirun_job(2, "hvdtrain.cnn", "--preset", "tiny", "--image-size", "16",
                        "--run-dir", str(run_dir), check=False)
    assert "could be restored into this model" in one_error(result)
    assert "WARNING" not in result.stdout, result.stdout[-3000:]


def test_more_ranks_than_tfrecord_files(tmp_path):
    from hvdtrain.tfrecords import convert

    images = make_image_folder(tmp_path / "images", classes=2, per_class=10)
    convert(str(images), str(tmp_path / "records"), shards=2, validation_shards=1,
            validation_fraction=0.2, seed=0, image_size=8)
    result = mpirun_job(3, "hvdtrain.cnn", "--tfrecords", str(tmp_path / "records"),
                        "--batch-size", "2", "--run-dir", str(tmp_path / "run"), check=False)
    assert "3 ranks but only 2 training TFRecord file(s)" in one_error(result)


def test_launcher_refuses_horovod_without_its_tensorflow_extension(tmp_path):
    """A horovod whose TensorFlow library is absent, as a build without TensorFlow leaves it."""
    import horovod

    crippled = tmp_path / "site"
    shutil.copytree(Path(horovod.__file__).parent, crippled / "horovod")
    for library in (crippled / "horovod" / "tensorflow").glob("mpi_lib*.so"):
        library.unlink()
    result = run_job([sys.executable, "-m", "hvdtrain.launch", "--np", "1", "--",
                      "hvdtrain.cnn"], timeout=120, check=False,
                     env=clean_env(PYTHONPATH=str(crippled)))
    assert result.returncode == 2
    line = one_error(result, "hvdtrain.launch")
    assert "horovod cannot run TensorFlow jobs" in line and "make install" in line


def test_launcher_as_root_without_the_openmpi_variables(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root is refused by OpenMPI")
    env = {k: v for k, v in clean_env().items() if not k.startswith("OMPI_ALLOW")}
    result = run_job([sys.executable, "-m", "hvdtrain.launch", "--via", "mpirun", "--np", "2",
                      "--", "hvdtrain.cnn", "--run-dir", str(tmp_path / "run")], timeout=120,
                     check=False, env=env)
    assert result.returncode == 2
    assert "OMPI_ALLOW_RUN_AS_ROOT=1" in one_error(result, "hvdtrain.launch")
    assert not (tmp_path / "run").exists()
