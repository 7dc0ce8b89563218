"""Faults and bad data: never hang, never lose a checkpoint, always say what is wrong.

Integration tier: every test starts its own real jobs (ranks under mpirun as horovodrun starts
them, the CLI, the launcher) and kills and cleans up everything it starts, within a time limit.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (RESUMED, clean_env, integration, mpirun_job, mpirun_ranks, one_error,
                      run_job)
from hvdtrain.launcher_env import processes
from images import make_image_folder
from processes import process_group

pytestmark = [integration, pytest.mark.timeout(600)]
SCRIPTS = Path(__file__).parent / "scripts"


def rank_pids(marker: str) -> dict[int, int]:
    """{rank: pid} of the running ranks whose command line contains ``marker``."""
    return {process.rank: process.pid for process in processes()
            if marker in " ".join(process.argv) and "-m hvdtrain.cnn" in " ".join(process.argv)
            and process.rank is not None}


@pytest.mark.parametrize("np_, victim", [(2, 1), (2, 0), (3, 2)])
def test_a_killed_rank_ends_the_job_and_a_rerun_resumes(tmp_path, np_, victim):
    run_dir = tmp_path / "run"
    command = [*mpirun_ranks(np_), sys.executable, "-m",
               "hvdtrain.cnn", "--preset", "tiny", "--epochs", "200", "--run-dir", str(run_dir)]
    with process_group(command, env=clean_env(), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True) as job:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "checkpoint").exists():  # an epoch checkpointed
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the job ended or never finished an epoch")  # the group is killed
            time.sleep(0.2)
        time.sleep(0.5)  # mid-epoch
        ranks = rank_pids(str(run_dir))
        assert sorted(ranks) == list(range(np_)), ranks
        epochs_before = len(json.loads((run_dir / "metrics.json").read_text()))
        killed_at = time.monotonic()
        os.kill(ranks[victim], signal.SIGKILL)
        output, _ = job.communicate(timeout=60)  # the whole job must be gone within 60 s
        elapsed = time.monotonic() - killed_at
        assert job.returncode != 0
        assert elapsed < 60
        # mpirun names the rank (its PID field reads 0 in OpenMPI 4.1 for a killed rank).
        assert re.search(rf"process rank {victim} with PID \d+ on node \S+ exited on signal 9",
                         output), output[-3000:]
        # mpirun SIGKILLs the other ranks as it ends, and may return while one is still being
        # torn down (on a busy machine, for a moment): gone within seconds is not outliving the
        # job. (Checked before the block ends what is left of the job's group.)
        deadline = time.monotonic() + 10
        while rank_pids(str(run_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not rank_pids(str(run_dir)), "ranks outlived the job"
    # Every rank kept its own log beside the run, the killed one too.
    for rank in range(np_):
        log = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert log.startswith(f"hvdtrain.cnn: rank {rank} of {np_} on "), log[:300]
    chief_log = (run_dir / "logs" / "rank-0.log").read_text()
    assert "placement: " in chief_log and "Epoch 1/200" in chief_log, chief_log[-2000:]
    assert "\noptimizer: Adam\n" in chief_log, chief_log[:3000]  # the banner's last line

    # The same command again resumes from the last checkpoint, losing at most one epoch.
    rerun = mpirun_job(np_, "hvdtrain.cnn", "--preset", "tiny", "--epochs",
                       str(epochs_before + 1), "--run-dir", str(run_dir))
    resumed = re.search(RESUMED, rerun.stdout)
    # At most one epoch lost: the kill may land between an epoch's metrics and its checkpoint.
    assert resumed and int(resumed.group(1)) >= epochs_before - 1, rerun.stdout[-3000:]
    assert f"done: {epochs_before + 1} epoch(s)" in rerun.stdout


# A model that trains normally on rank 0 and fails in its 30th training step on rank 1.
FAILS_ON_RANK_1 = """
import os

import keras
import tensorflow as tf


class FailsOnRank1(keras.layers.Layer):
    def build(self, input_shape):
        self.steps = self.add_weight(name="steps", shape=(), initializer="zeros", trainable=False)

    def call(self, inputs, training=None):
        # The same graph on every rank (horovod matches tensors by op name): only the limit
        # differs.
        if training:
            limit = 30.0 if os.environ.get("OMPI_COMM_WORLD_RANK") == "1" else 1e9
            self.steps.assign_add(1.0)
            tf.debugging.assert_less(self.steps, limit, message="injected failure")
        return inputs


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    features = FailsOnRank1()(keras.layers.Rescaling(1 / 255)(inputs))
    outputs = keras.layers.Dense(num_classes)(keras.layers.Flatten()(features))
    return keras.Model(inputs, outputs)
"""


def test_a_rank_that_fails_names_its_log_which_holds_the_failure(tmp_path):
    model_file = tmp_path / "failing.py"
    model_file.write_text(FAILS_ON_RANK_1)
    run_dir = tmp_path / "run"
    result = mpirun_job(2, "hvdtrain.cnn", "--preset", "tiny", "--model", f"{model_file}:build",
                        "--run-dir", str(run_dir), check=False, timeout=240)
    assert result.returncode != 0
    log = run_dir / "logs" / "rank-1.log"
    failure = [line for line in result.stdout.splitlines() if "rank 1 failed" in line]
    assert len(failure) == 1, result.stdout[-3000:]
    assert "InvalidArgumentError: assertion failed: [injected failure]" in failure[0]
    assert f"its log: {log}" in failure[0]
    # The log holds the rank's own start line and its failure line, without horovodrun's tags.
    lines = log.read_text().splitlines()
    assert lines[0].startswith("hvdtrain.cnn: rank 1 of 2 on ")
    assert any(line.startswith("hvdtrain.cnn: rank 1 failed: InvalidArgumentError: assertion "
                               "failed: [injected failure]") for line in lines), lines[-20:]


def test_a_checkpoint_interrupted_mid_write_leaves_the_previous_one_loadable(tmp_path):
    run_dir = tmp_path / "run"
    with process_group([sys.executable, str(SCRIPTS / "checkpoint_writer.py"), str(run_dir)],
                       stdout=subprocess.PIPE, text=True, env=clean_env()) as writer:
        first = writer.stdout.readline()
        assert first.startswith("first saved"), first
        checksum = float(first.split()[-1])
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / "ckpt-2_temp").exists():
            assert time.monotonic() < deadline and writer.poll() is None
            time.sleep(0.005)
        os.killpg(writer.pid, signal.SIGKILL)  # in the middle of writing checkpoint 2
        rest, _ = writer.communicate(timeout=30)
    assert "second saved" not in rest  # really interrupted, not finished
    assert not (run_dir / "checkpoints" / "ckpt-2.index").exists()
    check = (
        "import sys, numpy as np, hvdtrain, tf_keras as keras\n"
        "from hvdtrain.rundir import RunDir\nfrom hvdtrain.training.checkpoint import Checkpoints\n"
        "m = keras.Sequential([keras.Input((4000,)), keras.layers.Dense(16000)])\n"
        "m.compile(optimizer=keras.optimizers.Adam(), loss='mse')\n"
        "m.optimizer.build(m.trainable_variables)\n"
        f"epoch, path = Checkpoints(RunDir({str(run_dir)!r}, is_chief=True), m, 3)"
        ".restore_latest()\n"
        "print(epoch, path, float(np.sum(m.layers[0].kernel.numpy(), dtype=np.float64)))\n")
    restored = run_job([sys.executable, "-c", check], timeout=180).stdout.split()
    assert restored[-3:-1] == ["1", str(run_dir / "checkpoints" / "ckpt-1")]
    assert float(restored[-1]) == pytest.approx(checksum, rel=1e-6)


@pytest.mark.parametrize("np_", [1, 2, 3])
def test_every_data_set_size_finishes_or_is_refused_clearly(tmp_path, np_):
    result = run_job([*mpirun_ranks(np_), sys.executable,
                      str(SCRIPTS / "uneven_sizes.py"), str(tmp_path)], timeout=500)
    line = next(l for l in result.stdout.splitlines() if "OUTCOMES " in l)
    # raw_decode: mpirun may glue the next line's "[1,0]<stdout>:" tag onto this one.
    per_rank, _ = json.JSONDecoder().raw_decode(line.split("OUTCOMES ", 1)[1])
    chief = per_rank[0]
    assert sorted(map(int, chief)) == list(range(1, 3 * np_ + 2))
    for size, outcome in chief.items():
        # The ranks agree on every size, and a size ends one way or the other.
        assert all(rank_outcomes[size].split()[0] == outcome.split()[0]
                   for rank_outcomes in per_rank)
        if outcome.startswith("refused"):
            assert "fewer than one global batch" in outcome, outcome
        else:
            assert outcome == "finished 2 epochs", outcome
    training_samples = {int(s): int(s) - max(1, round(int(s) * 0.25)) if int(s) > 1 else 1
                        for s in chief}
    for size, outcome in chief.items():
        assert outcome.startswith("refused") == (training_samples[int(size)] < np_), (size,
                                                                                   outcome)


def test_bad_image_folders_under_two_ranks(tmp_path):
    empty_class = make_image_folder(tmp_path / "empty", classes=2, per_class=4)
    (empty_class / "nine").mkdir()
    single = make_image_folder(tmp_path / "single", classes=1, per_class=4)
    corrupt = make_image_folder(tmp_path / "corrupt", classes=2, per_class=20)
    (corrupt / "zero" / "notes.txt").write_text("not an image")
    cases = [(empty_class, [], "has no PNG/JPEG/GIF/BMP images"),
             (single, [], "only one class folder"),
             (corrupt, ["--on-bad-image", "fail"], "not PNG/JPEG/GIF/BMP images")]
    for folder, extra, message in cases:
        result = mpirun_job(2, "hvdtrain.cnn", "--data-dir", str(folder), *extra,
                            "--run-dir", str(tmp_path / "run"), check=False)
        assert message in one_error(result)
    assert not (tmp_path / "run").exists()
    # Skipping is the default: the job trains and says how many files it left out, once.
    skipped = mpirun_job(2, "hvdtrain.cnn", "--data-dir", str(corrupt), "--preset", "tiny",
                         "--epochs", "1", "--batch-size", "4", "--image-size", "8",
                         "--run-dir", str(tmp_path / "ok"))
    assert skipped.stdout.count("skipped 1 file(s)") == 1


def mixed_bad_folder(root: Path, *, unreadable_headers: bool = True) -> Path:
    """Real images plus the bad files real data sets contain: JPEGs and PNGs cut short (valid
    headers), empty files and text under an image's name (the listing trusts image extensions,
    so decoding finds all of these), and text files (which the listing finds)."""
    make_image_folder(root, classes=2, per_class=24)
    for class_dir in (root / "zero", root / "one"):
        jpeg = next(class_dir.glob("*.jpg")).read_bytes()
        png = next(class_dir.glob("*.png")).read_bytes()
        for index in range(3):
            (class_dir / f"cut-{index}.jpg").write_bytes(jpeg[:len(jpeg) // 3])
            (class_dir / f"cut-{index}.png").write_bytes(png[:len(png) // 3])
        if unreadable_headers:
            (class_dir / "empty.jpg").write_bytes(b"")
            (class_dir / "readme.png").write_text("a text file with an image's extension")
            (class_dir / "notes.txt").write_text("a text file")
    return root


@pytest.mark.timeout(900)
@pytest.mark.parametrize("np_", [1, 2, 3])
def test_undecodable_images_are_skipped_and_counted_never_a_hang(tmp_path, np_):
    folder = mixed_bad_folder(tmp_path / "data")
    flags = ["--data-dir", str(folder), "--batch-size", "4", "--image-size", "16",
             "--epochs", "2", "--no-tensorboard", "--no-export"]
    result = mpirun_job(np_, "hvdtrain.cnn", *flags, "--run-dir", str(tmp_path / "run"),
                        timeout=240)
    output = result.stdout
    # Text files are found while listing; everything with an image's name while decoding, by
    # whichever rank owns it, summed over the ranks at the end of the epoch and named.
    assert output.count("skipped 2 file(s)") == 1, output[-3000:]
    decode_lines = [l for l in output.splitlines() if "did not decode in epoch" in l]
    assert decode_lines and len(decode_lines) == len({l.split("epoch")[1] for l in decode_lines})
    skipped = sum(int(re.search(r"(\d+) sample\(s\) did not decode", l).group(1))
                  for l in decode_lines)
    # The 12 cut and 4 unreadable files, minus validation ones past the last step.
    assert 1 <= skipped <= 16
    named = {re.search(r"\(e\.g\. (\S+)\)", line).group(1) for line in decode_lines}
    assert all(re.search(r"/(cut-\d\.(jpg|png)|empty\.jpg|readme\.png)$", n) for n in named), named
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == [1, 2]
    assert sum(row.get("skipped_samples", 0) for row in rows) == skipped
    # --on-bad-image fail refuses files that only decoding finds in one line, on every rank
    # together, before the epoch's metrics or checkpoint are written.
    cut_only = mixed_bad_folder(tmp_path / "cut", unreadable_headers=False)
    refused = mpirun_job(np_, "hvdtrain.cnn", *flags[2:], "--data-dir", str(cut_only),
                         "--on-bad-image", "fail", "--run-dir", str(tmp_path / "refused"),
                         check=False, timeout=240)
    assert "did not decode in epoch 1" in one_error(refused)
    assert not (tmp_path / "refused" / "metrics.json").exists()


def test_a_stalled_rank_ends_the_job_with_one_line_not_a_hang(tmp_path):
    start = time.monotonic()
    result = run_job([*mpirun_ranks(2), sys.executable,
                      str(SCRIPTS / "stalled_rank.py")], timeout=180, check=False,
                     env=clean_env(HOROVOD_STALL_CHECK_TIME_SECONDS="2",
                                   HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="6"))
    assert result.returncode != 0
    assert time.monotonic() - start < 120
    lines = [l for l in result.stdout.splitlines() if "horovod shut the job down" in l]
    assert len(lines) == 1 and "rank 0" in lines[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
