"""The run directory: one job at a time (a lock), and run directories behind a URL (tf.io.gfile).

Pure tier, except the last test: the lock is taken by real separate processes
(tests/scripts/rundir_lock.py), and URL run directories are exercised on TensorFlow's in-memory
``ram://`` file system, which goes through the same tf.io.gfile calls as ``gs://``. Under mpirun
every rank runs these in its own temporary directory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import hvdtrain

from conftest import VENV_BIN, clean_env, integration, one_error, run_job, small_disk_at
from hvdtrain.data.listing import split_identity
from hvdtrain.errors import UserError
from hvdtrain.rundir import (LOCK_FILE, RunDir, current_umask, ensure_writable,
                             experiment_changes)
from hvdtrain.runtime import Devices, Runtime, World
from images import make_image_folder
from processes import process_group

pytestmark = pytest.mark.timeout(300)
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def lock_holder():
    """Start tests/scripts/rundir_lock.py processes; returns (process, first line); kills them."""
    with contextlib.ExitStack() as started:
        def start(mode: str, run_dir: Path,
                  job: str | None = None) -> tuple[subprocess.Popen, str]:
            process = started.enter_context(process_group(
                [sys.executable, str(SCRIPTS / "rundir_lock.py"), mode, str(run_dir),
                 *([job] if job else [])], env=clean_env(), stdout=subprocess.PIPE, text=True))
            ready, _, _ = select.select([process.stdout], [], [], 60)
            assert ready, "the lock holder printed nothing in 60 s"
            return process, process.stdout.readline().strip()

        yield start


def try_lock(run_dir: Path) -> str:
    """What a separate process gets from RunDir.lock: 'locked' or 'refused: <problem>'."""
    result = run_job([sys.executable, str(SCRIPTS / "rundir_lock.py"), "try", str(run_dir)],
                     timeout=60)
    return result.stdout.strip()


def holder_record(run_dir: Path) -> dict:
    return json.loads((run_dir / LOCK_FILE).read_text())


def single_runtime() -> Runtime:
    """The single-process backend (a world of one: its broadcast hands back what it is given)."""
    return Runtime(World(), Devices("cpu", "test"))


# --- the lock -------------------------------------------------------------------------------------
def test_a_second_job_is_refused_in_one_line_naming_the_holder(tmp_path, lock_holder):
    holder, said = lock_holder("hold", tmp_path, "Slurm job 4242")
    assert said == "locked"

    run_dir = RunDir(tmp_path, is_chief=True)
    problem = run_dir.lock(job="Slurm job 777")
    assert problem is not None and "\n" not in problem
    assert (f"run directory {tmp_path} is in use by Slurm job 4242, pid {holder.pid} on host "
            f"{socket.gethostname()} (since ") in problem, problem
    assert "use another --run-dir" in problem
    assert holder_record(tmp_path)["pid"] == holder.pid  # the refused job wrote nothing there

    # Through the check every rank runs: the same line, as the error that exits 2.
    with pytest.raises(UserError, match=f"in use by Slurm job 4242, pid {holder.pid} "):
        ensure_writable(RunDir(tmp_path, is_chief=True), single_runtime(), bytes_needed=0)


def test_a_holder_outside_any_scheduler_is_named_by_host_and_pid(tmp_path, lock_holder):
    holder, said = lock_holder("hold", tmp_path)
    assert said == "locked"
    assert try_lock(tmp_path).startswith(
        f"refused: run directory {tmp_path} is in use by pid {holder.pid} on host "
        f"{socket.gethostname()} (since ")


def test_a_killed_holder_does_not_block_the_next_job(tmp_path, lock_holder):
    holder, said = lock_holder("hold", tmp_path, "Slurm job 4242")
    assert said == "locked"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert holder.returncode == -signal.SIGKILL
    assert holder_record(tmp_path)["pid"] == holder.pid  # its lock file is still there...

    assert try_lock(tmp_path) == "locked"  # ...and blocks nobody: the kernel dropped the lock
    run_dir = RunDir(tmp_path, is_chief=True)
    assert run_dir.lock(job="Slurm job 4243") is None and run_dir.lock_note is None
    record = holder_record(tmp_path)
    assert (record["pid"], record["host"], record["job"]) == (os.getpid(), socket.gethostname(),
                                                              "Slurm job 4243")


def test_this_process_takes_its_own_lock_again_and_keeps_others_out(tmp_path):
    assert RunDir(tmp_path, is_chief=True).lock() is None
    # A second RunDir of the same directory in this process (a test or notebook training twice)
    # is the same job.
    assert RunDir(f"{tmp_path}/", is_chief=True).lock() is None
    assert try_lock(tmp_path).startswith(f"refused: run directory {tmp_path} is in use by pid "
                                         f"{os.getpid()} on host ")


def test_a_run_dir_deleted_and_made_again_is_locked_anew(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert RunDir(run_dir, is_chief=True).lock() is None
    (run_dir / LOCK_FILE).unlink()
    run_dir.rmdir()
    run_dir.mkdir()
    assert RunDir(run_dir, is_chief=True).lock() is None
    # The lock this process holds is on the new lock file, not on the deleted one.
    assert try_lock(run_dir).startswith("refused: ")


def test_a_holder_that_has_not_written_its_name_yet_is_still_a_holder(tmp_path, lock_holder):
    _, said = lock_holder("bare", tmp_path)
    assert said == "locked"
    problem = RunDir(tmp_path, is_chief=True).lock()
    assert problem and "in use by another process (it has not written its name" in problem


def test_only_the_chief_takes_the_lock(tmp_path):
    # Rank 1 of 2, with a broadcast that hands back what it is given (rank 0's verdict: none).
    second_rank = Runtime(World(rank=1, size=2), Devices("cpu", "test"))
    assert ensure_writable(RunDir(tmp_path, is_chief=False), second_rank, 0) is None
    assert not (tmp_path / LOCK_FILE).exists()
    assert try_lock(tmp_path) == "locked"


# --- one experiment per run directory --------------------------------------------------------
DIGITS = {"model": "cnn", "data": "embedded digits, 1797 samples",
          "classes": "10 (names 29dd21f5)", "images": "8x8x1"}


def everything_in(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory``, with a file's bytes (None for a directory)."""
    return {str(path): path.read_bytes() if path.is_file() else None
            for path in sorted(directory.rglob("*"))}


def test_a_resume_of_another_experiment_is_one_line_naming_what_differs_and_writes_nothing(
        tmp_path):
    run_dir = RunDir(tmp_path / "run", is_chief=True)
    run_dir.write_json("config.json", {"config": {"epochs": 3}, "fingerprint": DIGITS})
    before = everything_in(tmp_path)
    mine = {**DIGITS, "data": "image folder, 60 samples",
            "classes": "3 (names f1bf6e47)"}
    with pytest.raises(UserError) as refused:
        ensure_writable(run_dir, single_runtime(), 0, fingerprint=mine)
    assert str(refused.value) == (
        f"run directory {run_dir.path} holds another experiment (data: image folder, 60 samples "
        "was embedded digits, 1797 samples; classes: 3 (names f1bf6e47) was 10 (names "
        "29dd21f5)): use another --run-dir, or --accept-experiment-change to train its "
        "checkpoint on with this one")
    assert everything_in(tmp_path) == before  # no lock taken, no checkpoints/ made
    # Asked for: it goes on, and says what changed.
    note = ensure_writable(run_dir, single_runtime(), 0, fingerprint=mine, accept_change=True)
    assert note.startswith(f"run directory {run_dir.path}: its experiment changed (data: image "
                           "folder, 60 samples was embedded digits, 1797 samples; classes: "), note
    assert note.endswith("going on from its checkpoint, as --accept-experiment-change asks")


def test_the_same_experiment_and_a_run_directory_without_a_fingerprint_resume():
    assert experiment_changes(DIGITS, dict(DIGITS)) == []
    assert experiment_changes(None, DIGITS) == []  # made before run directories recorded one
    assert experiment_changes({"model": "cnn"}, DIGITS) == []  # a part not recorded then
    assert experiment_changes({**DIGITS, "images": "16x16x1"}, DIGITS) == [
        "images: 8x8x1 was 16x16x1"]


def test_an_old_run_directory_is_resumed_and_a_new_one_made(tmp_path):
    old = RunDir(tmp_path / "old", is_chief=True)
    old.write_json("config.json", {"config": {"epochs": 3}})  # no fingerprint
    for run_dir in (old, RunDir(tmp_path / "new", is_chief=True)):
        assert ensure_writable(run_dir, single_runtime(), 0, fingerprint=DIGITS) is None
        assert Path(run_dir.checkpoints).is_dir()


def test_a_fingerprint_holds_what_is_trained_and_nothing_a_resume_may_change(tmp_path):
    """The run directory's record of one job, against the same job resized (other workers,
    batch, learning rate, epochs: the plan) and against other data, images and models."""
    from hvdtrain.training import start
    from hvdtrain.cnn import tiny
    from hvdtrain.data import ImageDatasets
    from hvdtrain.training.plan import make_plan

    def plan(num_workers: int, batch_size: int, epochs: int, learning_rate: float):
        return make_plan(batch_size=batch_size, batch_policy="per-worker",
                         learning_rate=learning_rate, lr_scaling="linear", warmup_epochs=0,
                         grad_accum_steps=1, epochs=epochs, num_workers=num_workers,
                         num_train_samples=1438, num_validation_samples=359)

    digits = ImageDatasets(None, None, "digits", image_shape=(8, 8, 1),
                           class_names=tuple("0123456789"),
                           identity={"split": split_identity("samples", 0.2, 42)})
    recorded = start.fingerprint("hvdtrain.cnn", tiny(), digits, plan(2, 32, 3, 3e-3))
    assert recorded == {**DIGITS, "samples": "1797, embedded digits",
                        "split": "0.2 of the samples held out for validation, seed 42"}
    resized = start.fingerprint("hvdtrain.cnn", dataclasses.replace(tiny(), epochs=9),
                                digits, plan(1, 64, 9, 1e-2))
    assert resized == recorded

    model_file = tmp_path / "models.py"
    other = {
        "samples": start.fingerprint("hvdtrain.cnn", dataclasses.replace(tiny(),
                                                                         data="synthetic"),
                                     digits, plan(2, 32, 3, 3e-3)),
        # Another seed or fraction validates on samples the checkpoint trained on.
        "split": start.fingerprint("hvdtrain.cnn", tiny(), dataclasses.replace(
            digits, identity={"split": split_identity("samples", 0.2, 7)}), plan(2, 32, 3, 3e-3)),
        "images": start.fingerprint("hvdtrain.cnn", tiny(), dataclasses.replace(
            digits, image_shape=(16, 16, 1)), plan(2, 32, 3, 3e-3)),
        "model": start.fingerprint("hvdtrain.cnn", dataclasses.replace(
            tiny(), model=f"{os.path.relpath(model_file)}:build"), digits, plan(2, 32, 3, 3e-3)),
    }
    for part, fingerprint in other.items():
        assert [change.split(":")[0] for change in experiment_changes(recorded, fingerprint)] \
            == [part]
    assert other["model"]["model"] == "models.py:build"
    # The same folder staged at another path (a node's local disk), the model file moved: the
    # same experiment.
    folder = ImageDatasets(None, None, "mine", image_shape=(8, 8, 1), class_names=("a", "b"))
    here, there = (start.fingerprint("hvdtrain.cnn", dataclasses.replace(
        tiny(), data_dir=f"{top}/mine", model=f"{top}/models.py:build"), folder,
        plan(2, 32, 3, 3e-3)) for top in ("/project", "/tmp/job-7"))
    assert here == there and here["samples"] == "1797, from image files"
    # The TFRecords converted from a folder, with its split and its (file, label) table: the
    # same experiment; the same files with two class folders swapped: not.
    table = {"split": split_identity("files", 0.1, 42), "labels": "5e1f" * 16}
    as_folder, as_records = (start.fingerprint("hvdtrain.cnn", dataclasses.replace(
        tiny(), **source), dataclasses.replace(folder, identity=table), plan(2, 32, 3, 3e-3))
        for source in ({"data_dir": "/project/mine"}, {"tfrecords": "/project/mine-shards"}))
    assert experiment_changes(as_folder, as_records) == []
    swapped = start.fingerprint("hvdtrain.cnn", dataclasses.replace(
        tiny(), data_dir="/project/mine"), dataclasses.replace(
        folder, identity={**table, "labels": "77aa" * 16}), plan(2, 32, 3, 3e-3))
    assert experiment_changes(as_folder, swapped) == [
        f"labels: (file, label) table {'77aa' * 3} was (file, label) table {'5e1f' * 3}"]
    # A run directory recorded before "samples": its "data" still counts.
    assert experiment_changes({"data": "image folder, 1797 samples"}, as_records) == [
        "data: TFRecords, 1797 samples was image folder, 1797 samples"]


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_linked_to_another_file_is_refused_and_that_file_untouched(tmp_path, link):
    """Anyone who can write to a run directory could plant .lock as a link to a file of the
    user who runs the job there: the job must not truncate and overwrite it."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (os.symlink if link == "symbolic" else os.link)(victim, run_dir / LOCK_FILE)
    with pytest.raises(UserError) as refused:
        ensure_writable(RunDir(run_dir, is_chief=True), single_runtime(), 0)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{run_dir}/{LOCK_FILE} is a {link}"), line
    assert victim.read_text() == "precious\n"


def test_an_atomic_write_opens_nothing_planted_and_syncs_before_and_after_the_rename(tmp_path):
    """The temporary file gets a fresh random name (a planted link at any name it could take
    is not followed), and the data is on disk before the rename, the rename after it: strace
    shows the order of the real system calls."""
    if not shutil.which("strace"):
        pytest.skip("strace is not installed")
    script = ("import sys\nfrom hvdtrain.rundir import RunDir\n"
              "run_dir = RunDir(sys.argv[1], is_chief=True)\n"
              "run_dir.write_json('metrics.json', [{'epoch': 1}])\n"
              "run_dir.write_with('curves.png', lambda path: open(path, 'wb').write(b'png'))\n")
    trace = tmp_path / "trace"
    run_job(["strace", "-f", "-e", "trace=openat,fsync,rename", "-o", str(trace),
             sys.executable, "-c", script, str(tmp_path)], timeout=60)
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines()
             if str(tmp_path) in line or "fsync(" in line]
    for name in ("metrics.json", "curves.png"):
        renamed = next(i for i, call in enumerate(calls)
                       if call.startswith("rename(") and f'"{tmp_path}/{name}"' in call)
        created = next(call for call in calls if call.startswith("openat(")
                       and f"/.{name}." in call and "O_CREAT" in call)
        assert "O_EXCL" in created and "O_NOFOLLOW" in created, created
        assert calls[renamed - 1].startswith("fsync("), calls[:renamed + 1]  # the file's data
        assert calls[renamed + 1].startswith("openat(") and "O_DIRECTORY" in calls[renamed + 1]
        assert calls[renamed + 2].startswith("fsync("), calls[renamed:]  # its directory
    assert json.loads((tmp_path / "metrics.json").read_text()) == [{"epoch": 1}]
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "metrics.json", "trace"]


def test_a_run_directory_that_fills_up_mid_run_is_one_line_with_a_remedy(tmp_path):
    """A real full file system (a small tmpfs, filled): MetricsLog's write at an epoch's end."""
    from hvdtrain.training.callbacks import MetricsLog, Throughput
    from hvdtrain.errors import RankError
    from hvdtrain.training.preemption import StopRequest

    with small_disk_at(tmp_path / "small-disk", "64k") as disk:
        with pytest.raises(OSError):
            with (disk / "filler").open("wb") as filler:
                while True:
                    filler.write(b"x" * 4096)
                    filler.flush()
        throughput = Throughput(global_batch_size=32)
        throughput.on_epoch_begin(0)
        throughput.on_epoch_end(0, {"loss": 1.0})
        metrics = MetricsLog(RunDir(disk, is_chief=True), [], StopRequest(), throughput)
        with pytest.raises(RankError) as refused:
            metrics.on_epoch_end(0, {"loss": 1.0})
        assert str(refused.value) == (
            f"cannot write metrics.json in {disk}: No space left on device; make room there (or "
            "pass another --run-dir), then run the job again: it resumes from its last checkpoint")
        assert os.listdir(disk) == ["filler"]  # no temporary file left


# --- local run directories keep their behaviour ---------------------------------------------------
def test_local_files_get_umask_permissions_and_leave_no_temporary_files(tmp_path):
    run_dir = RunDir(f"{tmp_path}//run/", is_chief=True)
    assert run_dir.path == f"{tmp_path}/run" and not run_dir.remote
    assert run_dir.checkpoints == f"{tmp_path}/run/checkpoints"
    run_dir.write_json("config.json", {"epochs": 3})
    run_dir.write_with("picture.png", lambda path: Path(path).write_bytes(b"png"))
    assert sorted(os.listdir(run_dir.path)) == ["config.json", "picture.png"]
    for name in ("config.json", "picture.png"):
        assert (tmp_path / "run" / name).stat().st_mode & 0o777 == 0o666 & ~current_umask()
    assert run_dir.read_json("config.json") == {"epochs": 3}
    assert run_dir.read_json("missing.json", default=[]) == []


def test_the_umask_is_read_without_being_set(monkeypatch):
    # Setting it, even for a moment, makes files other threads create meanwhile world-writable.
    def refuse(mask):
        raise AssertionError(f"current_umask() set the umask to {mask:o}")

    previous = os.umask(0o027)
    try:
        monkeypatch.setattr(os, "umask", refuse)
        assert current_umask() == 0o027
    finally:
        monkeypatch.undo()
        os.umask(previous)


def test_files_of_another_rank_are_not_written(tmp_path):
    RunDir(tmp_path, is_chief=False).write_json("config.json", {})
    assert list(tmp_path.iterdir()) == []


# --- run directories behind a URL (tf.io.gfile) -----------------------------------------------
@pytest.fixture
def url() -> str:
    """A run directory on TensorFlow's in-memory file system, new for each test."""
    return f"ram://test-{uuid.uuid4().hex}/run"


@pytest.fixture
def url_run_dir(url) -> RunDir:
    return RunDir(url, is_chief=True)


def test_a_url_keeps_its_scheme(url, url_run_dir):
    assert url_run_dir.path == url and url_run_dir.remote
    assert url_run_dir.checkpoints == f"{url}/checkpoints"
    assert url_run_dir.tensorboard == f"{url}/tensorboard"
    assert url_run_dir.model_file == f"{url}/model.keras"


def test_a_url_run_dir_is_checked_written_and_read_back(url, url_run_dir):
    import tensorflow as tf

    gfile = tf.io.gfile
    assert url_run_dir.problem(bytes_needed=2**60) is None  # no free-space figure to compare
    assert gfile.isdir(url_run_dir.checkpoints)
    rows = [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.25}]
    url_run_dir.write_json("metrics.json", rows)
    url_run_dir.write_csv("metrics.csv", rows)
    url_run_dir.write_text("notes.txt", "first")
    url_run_dir.write_text("notes.txt", "second")  # replaces
    assert url_run_dir.read_json("metrics.json") == rows
    assert url_run_dir.read_json("missing.json", default=[]) == []
    with gfile.GFile(f"{url}/metrics.csv") as file:
        assert file.read().splitlines() == ["epoch,loss", "1,0.5", "2,0.25"]
    with gfile.GFile(f"{url}/notes.txt") as file:
        assert file.read() == "second"
    # Neither the write probe nor any staged temporary file is left behind.
    assert sorted(gfile.listdir(url)) == ["checkpoints", "metrics.csv", "metrics.json",
                                          "notes.txt"]


def test_only_training_metrics_get_curves():
    from hvdtrain.plots import curve_names

    row = {"epoch": 1, "loss": 0.5, "accuracy": 0.9, "val_loss": 0.6, "val_accuracy": 0.8,
           "samples_per_sec": 900.0, "first_step_seconds": 5.0, "learning_rate": 0.001,
           "train_seconds": 1.0, "epoch_seconds": 1.2, "cpu_seconds": 2.0, "resident_mb": 700.0,
           "input_wait_seconds": 0.1, "compute_seconds": 0.9, "workers": 2}
    assert curve_names([row]) == ["loss", "accuracy"]
    assert curve_names([]) == []


def test_curves_have_whole_epochs_a_title_and_a_learning_rate_panel():
    from hvdtrain.plots import curves_figure, curves_title, pyplot

    rows = [{"epoch": epoch, "workers": 3 if epoch < 3 else 2, "loss": 1 / epoch,
             "val_loss": 1.2 / epoch, "learning_rate": 0.002 / epoch, "samples_per_sec": 9.0}
            for epoch in range(1, 5)]
    title = curves_title("cnn-tiny", rows, 64, 2)
    assert title == "cnn-tiny: 3 -> 2 worker(s), global batch 96 -> 64"
    assert curves_title("run", rows[:1], 96, 3) == "run: 3 worker(s), global batch 96"
    figure = curves_figure(rows, title)
    figure.canvas.draw()
    assert figure.get_suptitle() == title
    assert [axis.get_title() for axis in figure.axes] == ["loss", "learning rate (end of epoch)"]
    for axis in figure.axes:
        ticks = [tick for tick in axis.get_xticks() if 1 <= tick <= 4]
        assert ticks and all(float(tick).is_integer() for tick in ticks), ticks
    assert list(figure.axes[1].lines[0].get_ydata()) == [row["learning_rate"] for row in rows]
    pyplot().close(figure)
    # No learning rate in the rows (an older metrics.json): no empty panel for it.
    assert [axis.get_title() for axis in curves_figure([{"epoch": 1, "loss": 1.0}]).axes] == ["loss"]


def test_write_with_writes_locally_then_copies_into_a_url(url, url_run_dir):
    import tensorflow as tf

    from hvdtrain.plots import plot_curves

    rows = [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.25}]
    url_run_dir.write_with("curves.png", lambda path: plot_curves(rows, path))
    with tf.io.gfile.GFile(f"{url}/curves.png", "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"

    marker = uuid.uuid4().hex

    def fails_half_way(path: str) -> None:
        Path(path).write_bytes(b"half")
        raise RuntimeError("writer failed")

    with pytest.raises(RuntimeError, match="writer failed"):
        url_run_dir.write_with(f"broken-{marker}.png", fails_half_way)
    assert sorted(tf.io.gfile.listdir(url)) == ["curves.png"]
    assert not [name for name in os.listdir(tempfile.gettempdir()) if marker in name]


def test_other_ranks_write_nothing_into_a_url(url):
    import tensorflow as tf

    RunDir(url, is_chief=False).write_json("config.json", {})
    assert not tf.io.gfile.exists(f"{url}/config.json")


def test_a_url_run_dir_has_no_lock_and_says_so(url, url_run_dir):
    note = ensure_writable(url_run_dir, single_runtime(), bytes_needed=0)
    assert note and note.startswith("no run-dir lock on ram://") and url in note
    assert note == url_run_dir.lock_note


def test_an_unreachable_url_is_one_line():
    problem = RunDir("nosuchscheme://bucket/run", is_chief=True).problem()
    assert problem and problem.startswith("run directory nosuchscheme://bucket/run is not "
                                          "writable: ") and "\n" not in problem


def test_checkpoint_manager_saves_into_and_restores_from_a_url(url, url_run_dir):
    import tensorflow as tf

    assert url_run_dir.problem() is None
    weights = tf.Variable([1.0, 2.0])
    checkpoint = tf.train.Checkpoint(weights=weights)
    manager = tf.train.CheckpointManager(checkpoint, url_run_dir.checkpoints, max_to_keep=2)
    saved = manager.save()
    assert saved == f"{url}/checkpoints/ckpt-1"
    assert tf.io.gfile.exists(f"{url}/checkpoints/checkpoint")
    weights.assign([0.0, 0.0])

    reopened = tf.train.CheckpointManager(tf.train.Checkpoint(weights=weights),
                                          url_run_dir.checkpoints, max_to_keep=2)
    assert reopened.latest_checkpoint == saved
    reopened.checkpoint.restore(reopened.latest_checkpoint).assert_existing_objects_matched()
    assert weights.numpy().tolist() == [1.0, 2.0]


# --- two real jobs ---------------------------------------------------------------------------
@integration
def test_a_second_job_on_a_busy_run_dir_is_refused_and_a_killed_job_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cnn = [sys.executable, "-m", "hvdtrain.cnn", "--preset", "tiny", "--run-dir", str(run_dir)]
    with process_group([*cnn, "--epochs", "200"], env=clean_env(SLURM_JOB_ID="4242"),
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT) as first:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "checkpoint").exists():  # an epoch checkpointed
            if first.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the first job ended or never finished an epoch")
            time.sleep(0.2)
        config_before = (run_dir / "config.json").read_text()

        # A duplicate submission of the same job while the first still runs.
        second = run_job([*cnn, "--epochs", "1"], timeout=180, check=False)
        assert first.poll() is None, "the first job must still be running"
        errors = [line for line in second.stdout.splitlines() if "hvdtrain.cnn: error:" in line]
        assert second.returncode == 2 and len(errors) == 1, second.stdout[-3000:]
        assert (f"is in use by Slurm job 4242, pid {first.pid} on host {socket.gethostname()}"
                in errors[0]), errors[0]
        assert "Traceback" not in second.stdout
        assert (run_dir / "config.json").read_text() == config_before  # nothing overwritten

        epochs_done = len(json.loads((run_dir / "metrics.json").read_text()))
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()

    # The killed job's lock file stays behind; its lock does not: the rerun resumes.
    rerun = run_job([*cnn, "--epochs", str(epochs_done + 1)], timeout=240,
                    env=clean_env(SLURM_JOB_ID="4243"))
    assert "resuming from" in rerun.stdout, rerun.stdout[-3000:]
    assert json.loads((run_dir / LOCK_FILE).read_text())["job"] == "Slurm job 4243"


@pytest.mark.parametrize("plot_every_seconds", [0.0, 3600.0])
def test_curves_are_redrawn_at_most_as_often_as_asked_and_always_at_the_end(tmp_path,
                                                                          plot_every_seconds):
    # Rank 0's plotting is time every rank waits for (they move in lock-step): with a long
    # interval the plot is drawn after the first epoch and at the end, not after every epoch.
    import keras  # the Keras conftest's hvdtrain import selected, as hvdtrain.training.callbacks'
    import numpy as np

    from hvdtrain.training.callbacks import MetricsLog, Throughput
    from hvdtrain.training.preemption import StopRequest

    run_dir = RunDir(tmp_path, is_chief=True)
    curves = tmp_path / "curves.png"
    seen = []

    class RecordCurves(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(curves.stat().st_mtime_ns)

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    throughput = Throughput(global_batch_size=4)
    rows: list[dict] = []
    model.fit(np.ones((8, 2)), np.ones((8, 1)), batch_size=4, epochs=3, verbose=0,
              callbacks=[throughput, MetricsLog(run_dir, rows, StopRequest(), throughput,
                                                plot_every_seconds), RecordCurves()])
    assert len(rows) == 3 and len(json.loads((tmp_path / "metrics.json").read_text())) == 3
    redrawn = [later != earlier for earlier, later in zip(seen, seen[1:])]
    assert redrawn == ([True, True] if plot_every_seconds == 0 else [False, False])
    # At the end only what was not drawn yet is drawn again.
    assert (curves.stat().st_mtime_ns != seen[-1]) == (plot_every_seconds != 0)


def train_in_this_process(*flags: str):
    """hvdtrain.cnn's flags and training run in this pytest process (its Keras, a world of one):
    no interpreter and no TensorFlow to start for each of a test's several short runs."""
    from hvdtrain.training import train
    from hvdtrain.cnn import PRESETS, PROGRAM, classifier
    from hvdtrain.training.config import parse_config
    from hvdtrain.runtime import make_runtime

    config = parse_config(list(flags), PRESETS, prog=PROGRAM, description=None)
    try:
        return train.run(PROGRAM, config, make_runtime("single"), classifier(config.model))
    finally:
        import keras

        keras.mixed_precision.set_global_policy("float32")  # global: don't leak it


@integration
@pytest.mark.timeout(600)
def test_a_resume_of_another_split_or_labels_is_refused_and_the_folders_tfrecords_resume(
        tmp_path, capsys):
    """A resume under another seed validated on samples it had trained on (13 of 16), and one
    with two class folders swapped trained with the labels inverted, both without a word. Now
    both are refused in one line naming what changed; the TFRecords converted from the same
    folder (same split, same (file, label) table) resume the run, and so does the folder with
    a file deleted (as the epoch line invites for one that does not decode), which was refused
    as another experiment: it says so, and no remaining file changed sides."""
    from hvdtrain.tfrecords import convert

    images = make_image_folder(tmp_path / "images", classes=2, per_class=20)
    run_dir = tmp_path / "run"
    common = ["--image-size", "8", "--batch-size", "4", "--no-tensorboard", "--no-export",
              "--run-dir", str(run_dir)]
    train_in_this_process("--data-dir", str(images), "--epochs", "1", *common)
    before = everything_in(run_dir)
    with pytest.raises(UserError) as reseeded:
        train_in_this_process("--data-dir", str(images), "--epochs", "2", "--seed", "7", *common)
    assert "holds another experiment (split: 0.2 of the files held out for validation by their " \
           "names, seed 7 was 0.2 of the files held out for validation by their names, seed 42)" \
           in str(reseeded.value)
    assert "--accept-experiment-change" in str(reseeded.value)
    assert everything_in(run_dir) == before

    (images / "zero").rename(images / "swap")
    (images / "one").rename(images / "zero")
    (images / "swap").rename(images / "one")
    with pytest.raises(UserError) as swapped:
        train_in_this_process("--data-dir", str(images), "--epochs", "2", *common)
    assert "(labels: (file, label) table " in str(swapped.value)
    (images / "one").rename(images / "swap")
    (images / "zero").rename(images / "one")
    (images / "swap").rename(images / "zero")

    convert(str(images), str(tmp_path / "shards"), shards=2, validation_shards=1,
            validation_fraction=0.2, seed=42, image_size=8)
    resumed = train_in_this_process("--tfrecords", str(tmp_path / "shards"), "--epochs", "2",
                                    *common)
    assert resumed.exit_code == 0 and resumed.initial_epoch == 1
    assert [row["epoch"] for row in json.loads((run_dir / "metrics.json").read_text())] == [1, 2]

    def sides(listing) -> tuple[set, set]:
        return set(listing.train.sources.tolist()), set(listing.validation.sources.tolist())

    from hvdtrain.data.folder import list_image_folder

    split = dict(image_size=8, validation_fraction=0.2, seed=42, on_bad_image="skip")
    train_before, validation_before = sides(list_image_folder(str(images), **split))
    gone = sorted((images / "one").iterdir())[3]
    gone.unlink()
    capsys.readouterr()
    resumed = train_in_this_process("--data-dir", str(images), "--epochs", "3", *common)
    assert resumed.exit_code == 0 and resumed.initial_epoch == 2
    assert (f"run directory {run_dir}: 1 of its image folder's files are gone since it started"
            in capsys.readouterr().out)
    train_after, validation_after = sides(list_image_folder(str(images), **split))
    name = f"one/{gone.name}".encode()
    assert train_after == train_before - {name} and validation_after == validation_before - {name}
    # A relabelled file is no removal: refused as before.
    (images / "one" / sorted((images / "one").iterdir())[0].name).rename(
        images / "zero" / "moved.png")
    with pytest.raises(UserError, match=r"holds another experiment \(labels: "):
        train_in_this_process("--data-dir", str(images), "--epochs", "4", *common)


@integration
@pytest.mark.timeout(600)
def test_a_resume_under_another_precision_or_keras_names_the_flag(tmp_path):
    """The checkpoint of a mixed_float16 run (its optimizer holds a loss scale) does not fit an
    fp32 run's model, nor a Keras 2 one a Keras 3 run's: that was "cannot be read ... move the
    run directory away", of a checkpoint that is fine. Now the line names the flag."""
    run_dir = tmp_path / "run"
    common = ["--preset", "tiny", "--steps-per-epoch", "2", "--no-tensorboard", "--no-export",
              "--run-dir", str(run_dir)]
    train_in_this_process("--epochs", "1", "--precision", "mixed_float16", *common)
    with pytest.raises(UserError) as refused:
        train_in_this_process("--epochs", "2", *common)
    assert "were written with --precision mixed_float16 and this run uses fp32" in \
        str(refused.value) and "resume with --precision mixed_float16" in str(refused.value)
    # This process's Keras wrote them; the other Keras, in a process of its own, on a copy
    # (this process holds the run directory's lock until it ends).
    this, other = hvdtrain.KERAS, "3" if hvdtrain.KERAS == "2" else "2"
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    line = one_error(run_job([str(VENV_BIN / "hvdtrain"), "train", "--epochs", "2",
                              "--precision", "mixed_float16", "--keras", other, *common,
                              "--run-dir", str(copy)], timeout=240, check=False,
                             env=clean_env()), "hvdtrain train")
    assert f"were written by Keras {this} and this run is Keras {other}" in line, line
    assert f"resume with --keras {this}" in line, line


def test_a_profile_is_of_the_runs_steps_once_however_many_fits_the_run_makes(tmp_path):
    """--profile-steps 2:3 of a run that fits twice (a resume inside an epoch fits the epoch's
    rest, then the epochs after): steps 2-3 of the run, in its first fit, and no second profile
    from the second (Keras counts each fit's batches from 1). With 2 steps per call, steps 5-6
    are the third call."""
    import keras  # the Keras conftest's hvdtrain import selected, as hvdtrain.training.callbacks'
    import numpy as np

    from hvdtrain.training.callbacks import TensorBoardLog

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    features, targets = np.ones((16, 3), "float32"), np.ones((16, 1), "float32")
    board = TensorBoardLog(str(tmp_path / "tensorboard"), (2, 3))
    for fit in range(2):
        # A profile's folder is named by the second it ends in: a second one apart.
        time.sleep(1.1 * fit)
        model.fit(features, targets, batch_size=4, epochs=1, verbose=0, callbacks=[board])
    profiles = list((tmp_path / "tensorboard").rglob("*.xplane.pb"))
    assert len(profiles) == 1, profiles
    assert board.batches_before == 8
    per_call = TensorBoardLog(str(tmp_path / "other"), (5, 6), steps_per_call=2)
    assert (per_call._start_batch, per_call._stop_batch) == (3, 3)  # Keras' own profile range
