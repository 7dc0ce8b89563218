"""The decoded-sample store behind --cache memory|disk: a new order every epoch, any number of
readers, and nothing left in TMPDIR however a rank ends.

Integration tier: real 2-rank jobs (mpirun as horovodrun runs it) on an image folder whose every
image carries its own number in its first pixel, read back by a model that records what it
trains on.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import clean_env, integration, mpirun_ranks, run_job, small_disk_at
from processes import process_group

pytestmark = [integration, pytest.mark.timeout(600)]
SCRIPTS = Path(__file__).parent / "scripts"

IMAGES = 4096  # 2,048 per rank
PER_WORKER_BATCH = 32  # a pass over a rank's share: 64 steps
STEPS_PER_EPOCH = 16  # a quarter of a pass: epochs end while the first pass is being stored
PASSES = 3

# A model that appends the numbers of the images of every training step to a file per model file
# and rank.
# The batch-norm recompute at each epoch's end also runs the model in training mode, on its own
# iterator: it sets the layers' momentum to 0 while it does, which is how it is told apart.
RECORDER = """
import os

import keras
import numpy as np
import tensorflow as tf

# A file per model file (recorder-CACHE.py: one per run of a job) and rank.
RECORD = "-".join([os.environ["HVDTRAIN_TEST_RECORD"], os.path.basename(__file__)[:-3],
                   os.environ.get("OMPI_COMM_WORLD_RANK", "0")])


class Recorder(keras.layers.Layer):
    def __init__(self, norm, **kwargs):
        super().__init__(**kwargs)
        self.norm = norm

    def call(self, inputs, training=None):
        if not training:
            return inputs

        def record(pixels):
            if self.norm.momentum:  # a training step, not the recompute
                pixels = pixels.numpy().astype(np.int64)
                numbers = pixels[:, 0, 0, 0] * 256 + pixels[:, 0, 0, 1]
                with open(RECORD, "a") as file:
                    file.write(" ".join(map(str, numbers)) + "\\n")
            return np.float32(0)

        return inputs + tf.py_function(record, [inputs], tf.float32)


def build(input_shape, num_classes):
    inputs = keras.Input(input_shape)
    norm = keras.layers.BatchNormalization()
    recorded = Recorder(norm)(inputs)
    features = norm(keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(recorded)))
    return keras.Model(inputs, keras.layers.Dense(num_classes)(features))
"""


@pytest.fixture(scope="module")
def numbered_folder(tmp_path_factory) -> Path:
    """IMAGES 8x8 PNGs in 2 classes; image n has n in its first pixel (red * 256 + green)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("numbered") / "data"
    rng = np.random.default_rng(0)
    for number in range(IMAGES):
        folder = root / f"class{number % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        pixels[0, 0, :2] = divmod(number, 256)
        Image.fromarray(pixels).save(folder / f"{number:05d}.png")
    return root


def passes_seen(record: Path) -> list[np.ndarray]:
    """The numbers one rank trained on, cut into passes over its share."""
    seen = np.array(record.read_text().split(), dtype=np.int64)
    per_pass = IMAGES // 2
    assert len(seen) == PASSES * per_pass, len(seen)
    return [seen[start:start + per_pass] for start in range(0, len(seen), per_pass)]


def spearman(first: np.ndarray, second: np.ndarray) -> float:
    """Rank correlation of where each sample came in two passes (both permutations of a share)."""
    where_first = np.argsort(first)  # the passes' positions, sample by sample (sorted numbers)
    where_second = np.argsort(second)
    return float(np.corrcoef(where_first, where_second)[0, 1])


CACHES = ["memory", "disk", "off"]


def test_every_epoch_trains_in_a_new_order_with_any_cache(numbered_folder, tmp_path):
    """One job of 2 ranks trains with each cache in turn (tests/scripts/cnn_runs.py: the ranks
    start once), each run through its own copy of the recorder, which records to its own files."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    record = tmp_path / "seen"
    epochs = PASSES * (IMAGES // 2 // PER_WORKER_BATCH) // STEPS_PER_EPOCH
    runs = []
    for cache in CACHES:
        recorder = tmp_path / f"recorder-{cache}.py"
        recorder.write_text(RECORDER)
        runs += ["--then"] * bool(runs) + [
            "--data-dir", str(numbered_folder), "--image-size", "8", "--validation-fraction", "0",
            "--model", f"{recorder}:build", "--cache", cache, "--batch-size",
            str(PER_WORKER_BATCH), "--steps-per-epoch", str(STEPS_PER_EPOCH), "--epochs",
            str(epochs), "--run-dir", str(tmp_path / f"run-{cache}"), "--no-export",
            # Keras 2: the recorder layer (a py_function beside the model's own
            # BatchNormalization, read by momentum) is written against tf_keras; the subject
            # here is the input order.
            "--keras", "2"]
    result = run_job([*mpirun_ranks(2), sys.executable, str(SCRIPTS / "cnn_runs.py"), *runs],
                     env=clean_env(TMPDIR=str(scratch), HVDTRAIN_TEST_RECORD=str(record)),
                     timeout=400)
    # Rank 0's banners and summaries, in the order the runs went.
    banners = re.findall(r"^\[1,0\]<stdout>:cache: (\w+)", result.stdout, re.MULTILINE)
    assert banners == CACHES, result.stdout[-3000:]
    for cache in CACHES:
        assert f"run-{cache}: done: {epochs} epoch(s)" in result.stdout, result.stdout[-3000:]
        shares = []
        correlations = []
        for rank in range(2):
            passes = passes_seen(Path(f"{record}-recorder-{cache}-{rank}"))
            share = np.sort(passes[0])
            # Every sample of the share once per pass: each pass is a permutation of the same
            # share.
            assert len(np.unique(share)) == len(share), cache
            assert all(np.array_equal(np.sort(seen), share) for seen in passes), cache
            shares.append(share)
            correlations += [spearman(passes[p], passes[p + 1]) for p in range(PASSES - 1)]
        # The ranks' shares are disjoint and cover the folder.
        assert np.array_equal(np.sort(np.concatenate(shares)), np.arange(IMAGES)), cache
        # Consecutive passes are uncorrelated (a random pair of permutations of 2,048:
        # |rho| ~ 0.02).
        assert max(map(abs, correlations)) < 0.1, (cache, correlations)
    # A disk cache is gone with the job (the batch-norm recompute read it while it was written).
    assert list(scratch.iterdir()) == []


def test_a_killed_ranks_disk_cache_is_removed(numbered_folder, tmp_path):
    """SIGKILL runs no exit handler: the rank's janitor removes its cache directory. Through
    the launcher, which kills what is left of the failed job: not the janitors (it did, and
    rank 0's cache stayed), and it exits only once they are done."""
    from test_faults import rank_pids

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--via", "mpirun",
               "--skip-preflight", "--", "hvdtrain.cnn", "--data-dir", str(numbered_folder),
               "--image-size", "8", "--cache", "disk", "--epochs", "100", "--batch-size", "16",
               "--no-tensorboard", "--no-export", "--run-dir", str(run_dir)]
    with process_group(command, env=clean_env(TMPDIR=str(scratch)), text=True,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as job:
        deadline = time.monotonic() + 180
        storing = []
        while len(storing) < 2:  # both ranks are storing their first pass
            if job.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the job ended or never wrote its disk cache")
            time.sleep(0.2)
            storing = [path for path in scratch.rglob("training/samples")
                       if path.stat().st_size > 0]
        ranks = rank_pids(str(run_dir))
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        output, _ = job.communicate(timeout=90)
        assert job.returncode == 137, output[-3000:]
        assert list(scratch.iterdir()) == [], [str(path) for path in scratch.rglob("*")][:10]


@pytest.fixture
def small_disk(tmp_path):
    """A real, small file system (tmpfs) for TMPDIR."""
    with small_disk_at(tmp_path / "small-disk", "4m") as mount_point:
        yield mount_point


def test_a_disk_cache_that_does_not_fit_is_one_line_at_the_start_or_when_the_disk_fills(
        numbered_folder, small_disk, tmp_path):
    """--cache disk on a node whose TMPDIR is too small, and on one whose disk fills up after the
    start (another job's files): this rank's one line, exit 2, nothing left on that disk."""
    def job(image_size: int, run_dir: Path):
        return process_group(
            [sys.executable, "-u", "-m", "hvdtrain.cnn", "--data-dir", str(numbered_folder),
             "--image-size", str(image_size), "--cache", "disk", "--epochs", "1",
             "--no-tensorboard", "--run-dir", str(run_dir)],
            env=clean_env(TMPDIR=str(small_disk)), text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)

    # 4,096 images at 64x64x3 are 50 MB decoded: refused before anything is made.
    with job(64, tmp_path / "too-big") as too_big:
        output, _ = too_big.communicate(timeout=120)
        errors = [line for line in output.splitlines() if "error" in line]
        assert too_big.returncode == 2 and len(errors) == 1, output[-3000:]
        # 50.3 MB: one rank caches every sample, the validation ones included.
        assert re.match(rf"hvdtrain\.cnn: error on rank 0: --cache disk needs 50\.3 MB in "
                        rf"{re.escape(str(small_disk))}/", errors[0]), errors[0]
        assert "which has 4.2 MB free" in errors[0] and "Traceback" not in output
        assert not (tmp_path / "too-big").exists() and list(small_disk.iterdir()) == []

    # At 8x8x3 they fit (0.8 MB); once the banner is out, the disk is filled up to its last byte.
    with job(8, tmp_path / "fills") as fills:
        lines = []
        for line in fills.stdout:
            lines.append(line)
            if line.startswith("cache: disk"):
                break
        # Unbuffered: a buffered file keeps the bytes a write could not place and raises again
        # when closed (seen where the free space was no multiple of the writes).
        with open(small_disk / "another-job", "wb", buffering=0) as filler:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    filler.write(b"\0" * 65536)
        output, _ = fills.communicate(timeout=240)
        output = "".join(lines) + output
        errors = [line for line in output.splitlines() if "error" in line]
        assert fills.returncode == 2 and len(errors) == 1, output[-3000:]
        assert errors[0].startswith(f"hvdtrain.cnn: error on rank 0: cannot write the disk cache "
                                    f"in {small_disk}/"), errors[0]
        assert "No space left on device; free space there" in errors[0]
        assert "Traceback" not in output
        assert [path.name for path in small_disk.iterdir()] == ["another-job"]
