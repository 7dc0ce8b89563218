"""`hvdtrain.launch --max-restarts N`: a failed job starts again in the same allocation, a user
error or a stop signal does not, and the restarts stop after N.

Integration tier: each test starts a real launcher (real horovodrun or mpirun, real ranks), kills
or signals real processes, and cleans up everything it starts within its time limit.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from conftest import (RESUMED, clean_env, integration, mpirun_job, mpirun_ranks, one_error,
                      run_job)
from hvdtrain.launcher_env import processes
from processes import process_group

pytestmark = [integration]
SCRIPTS = Path(__file__).parent / "scripts"
LAUNCH = [sys.executable, "-m", "hvdtrain.launch"]


def ranks_of(run_dir: Path, program: str = "hvdtrain.cnn") -> dict[int, int]:
    """{rank: pid} of the running training ranks of ``program`` writing to ``run_dir``."""
    return {process.rank: process.pid for process in processes()
            if str(run_dir) in process.argv and program in process.argv
            and process.rank is not None}


def running(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def runs_in(record: Path) -> int:
    """How many times exit_status.py was started (its rank 0 notes each run)."""
    return sum(" rank=0 " in line for line in record.read_text().splitlines())


@pytest.mark.timeout(120)
def test_a_job_that_always_fails_runs_max_restarts_plus_one_times(tmp_path):
    record = tmp_path / "runs.txt"
    result = run_job([*LAUNCH, "--np", "2", "--via", "mpirun", "--skip-preflight",
                      "--max-restarts", "2", str(SCRIPTS / "exit_status.py"), str(record), "1"],
                     timeout=100, check=False)
    assert result.returncode == 1, result.stdout[-3000:]
    assert runs_in(record) == 3, record.read_text()
    # Both ranks exit 1 at once: mpirun names the first, either one.
    lines = [re.sub(r"rank [01] failed", "rank R failed", l) for l in result.stdout.splitlines()
             if l.startswith("hvdtrain.launch: job exited")]
    assert lines == [
        "hvdtrain.launch: job exited 1: rank R failed first (exit status 1); restart 1 of 2 in 3 s "
        "(an hvdtrain job resumes from its last checkpoint)",
        "hvdtrain.launch: job exited 1: rank R failed first (exit status 1); restart 2 of 2 in 3 s "
        "(an hvdtrain job resumes from its last checkpoint)",
        "hvdtrain.launch: job exited 1: rank R failed first (exit status 1); no restarts left "
        "(--max-restarts 2)"], result.stdout[-3000:]


@pytest.mark.timeout(120)
def test_nothing_of_a_failed_attempt_runs_beside_the_next_one(tmp_path):
    """Each attempt leaves a process behind in a session of its own (mpirun does not stop it);
    the launcher must have killed it before the next attempt starts, and after the last one."""
    record = tmp_path / "runs.txt"
    try:
        result = run_job([*LAUNCH, "--np", "2", "--via", "mpirun", "--skip-preflight",
                          "--max-restarts", "1", str(SCRIPTS / "exit_status.py"), str(record),
                          "1", "--leave-behind"], timeout=100, check=False)
        lines = record.read_text().splitlines()
        leftovers = [int(line.split()[1]) for line in lines if line.startswith("leftover ")]
        assert result.returncode == 1 and runs_in(record) == 2, result.stdout[-3000:]
        assert len(leftovers) == 2, lines
        # The second attempt found the first one's leftover gone; none outlives the launcher.
        assert [l for l in lines if l.startswith("leftovers-running")] == [
            "leftovers-running 0", "leftovers-running 0"], lines
        assert not [pid for pid in leftovers if running(pid)]
    finally:
        for line in record.read_text().splitlines() if record.exists() else []:
            if line.startswith("leftover "):
                try:
                    os.kill(int(line.split()[1]), signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.mark.timeout(150)
def test_a_user_error_is_not_restarted(tmp_path):
    run_dir = tmp_path / "run"
    result = run_job([*LAUNCH, "--np", "2", "--max-restarts", "2", "--skip-preflight", "--",
                      "hvdtrain.cnn", "--batch-size", "0", "--run-dir", str(run_dir)],
                     timeout=130, check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [l for l in result.stdout.splitlines() if "hvdtrain.cnn: error:" in l]
    assert len(errors) == 1 and "--batch-size must be at least 1" in errors[0], result.stdout
    assert "restart 1" not in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "hvdtrain.launch: job exited 2 (a user error: it would fail the same way again); "
        "not restarting"), result.stdout
    assert "Primary job" not in result.stdout and "mpirun detected" not in result.stdout
    assert not run_dir.exists()


#: (signal, controller, the launcher's exit status): one stop each, in this order, on one run.
STOPS = [(signal.SIGUSR1, "mpi", 75), (signal.SIGUSR1, "gloo", 75), (signal.SIGTERM, "mpi", 143)]


def epochs_logged(run_dir: Path) -> int:
    try:
        return len(json.loads((run_dir / "metrics.json").read_text()))
    except (OSError, ValueError):  # not written yet, or being written
        return 0


@pytest.mark.timeout(600)
def test_a_stop_signal_to_the_launcher_checkpoints_stops_and_a_rerun_resumes(tmp_path):
    """What an sbatch script's trap does at the time-limit warning, or scancel, without Slurm:
    the ranks checkpoint and stop, nothing restarts (--max-restarts where the controller allows
    it), and the launcher exits only once they are done (an sbatch script that exits earlier
    would have Slurm kill the ranks in the middle of their checkpoint). A rerun resumes.

    The stops of STOPS go one after the other on one run directory: each job after the first is
    also the rerun of the stop before it, and a last short job the rerun of the last stop."""
    run_dir = tmp_path / "run"
    stopped_in = None  # the epoch the previous job stopped in
    for attempt, (signum, controller, exit_code) in enumerate(STOPS):
        log = tmp_path / f"launcher-{attempt}.log"
        # Gloo jobs cannot restart (the launcher refuses --max-restarts with --controller
        # gloo), and only horovodrun starts them; MPI jobs start through mpirun, without
        # horovodrun's own TensorFlow import (see test_a_killed_rank_is_restarted...).
        restarts = ["--max-restarts", "2"] if controller == "mpi" else []
        via = ["--via", "mpirun"] if controller == "mpi" else []
        epochs_before = epochs_logged(run_dir)
        # A file, not a pipe: ranks holding a pipe would hide in wait().
        with log.open("w") as sink, process_group(
                [*LAUNCH, "--np", "2", "--controller", controller, *via, *restarts,
                 "--skip-preflight", "--", "hvdtrain.cnn", "--preset", "tiny", "--epochs", "200",
                 "--no-tensorboard", "--run-dir", str(run_dir)],
                env=clean_env(), stdout=sink, stderr=subprocess.STDOUT) as launcher:
            # An epoch of this job's own is done: it trains (wait_for_first_epoch's test, for
            # a run directory that already holds epochs).
            deadline = time.monotonic() + 240
            while epochs_logged(run_dir) <= epochs_before:
                if launcher.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the job ended or never finished an epoch:\n"
                                f"{log.read_text()[-3000:]}")
                time.sleep(0.1)
            launcher.send_signal(signum)
            launcher.wait(timeout=120)
            ranks_left = ranks_of(run_dir)  # at the moment the launcher is gone
            output = log.read_text()
        if stopped_in is not None:
            resumed_at(output, stopped_in)
        assert launcher.returncode == exit_code, (signum, controller, output[-3000:])
        assert not ranks_left, f"ranks {ranks_left} still ran after the launcher exited"
        stopped = re.search(rf"stopped by {signal.Signals(signum).name} in epoch (\d+); "
                            "checkpoint written", output)
        assert stopped, output[-3000:]
        assert "restart 1" not in output
        stopped_in = int(stopped.group(1))
    rerun = run_job([*LAUNCH, "--np", "2", "--controller", controller, *via,
                     "--skip-preflight", "--", "hvdtrain.cnn", "--preset", "tiny",
                     "--epochs", str(stopped_in + 1), "--no-tensorboard",
                     "--run-dir", str(run_dir)], timeout=200)
    resumed_at(rerun.stdout, stopped_in)


def resumed_at(output: str, stopped_in: int) -> None:
    """The job resumed at the step it stopped in (a stop's checkpoint holds it), or at an
    epoch's end."""
    resumed = re.search(RESUMED, output)
    assert resumed and int(resumed.group(1)) >= stopped_in - 1, output[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, via", [
    ("SIGTERM", "mpirun"), ("SIGINT", "mpirun"), ("SIGTERM", "horovodrun"),
    ("the launcher killed", "mpirun")])
def test_ranks_get_all_the_time_they_need_to_stop_after_a_stop_signal(tmp_path, how, via):
    """mpirun aborts a job on SIGTERM or SIGINT and SIGKILLs its ranks 2 s later; ranks whose
    last checkpoint takes 4 s must still finish it: the launcher (and its watcher, when the
    launcher dies) sends mpirun a signal it forwards instead, to every rank (here, on one host,
    the ranks also get SIGTERM directly: each notes both)."""
    record = tmp_path / "record.txt"
    with (tmp_path / "launcher.log").open("w") as sink, process_group(
            [*LAUNCH, "--np", "2", "--via", via, "--skip-preflight",
             str(SCRIPTS / "slow_stop.py"), str(record)],
            env=clean_env(), stdout=sink, stderr=subprocess.STDOUT) as launcher:
        deadline = time.monotonic() + 90
        while not record.exists() or record.read_text().count("started") < 2:
            assert launcher.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "launcher.log").read_text()[-3000:]
            time.sleep(0.1)
        if how == "the launcher killed":
            launcher.kill()  # its watcher stops the job
            launcher.wait()
            deadline = time.monotonic() + 60
            while record.read_text().count("stopped") < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
        else:
            launcher.send_signal(getattr(signal, how))
            launcher.wait(timeout=60)
        output = (tmp_path / "launcher.log").read_text()
        lines = sorted(record.read_text().splitlines())
    assert lines == ["rank=0 got SIGTERM", "rank=0 got SIGUSR2", "rank=1 got SIGTERM",
                     "rank=1 got SIGUSR2", "started rank=0", "started rank=1", "stopped rank=0",
                     "stopped rank=1"], (lines, output[-3000:])
    if how != "the launcher killed":
        assert launcher.returncode == 128 + getattr(signal, how), output[-3000:]


def back_to_epoch(run_dir: Path, epoch: int) -> None:
    """Leave ``run_dir`` as a job that died right after epoch ``epoch``'s checkpoint would: the
    later checkpoints gone from CheckpointManager's index (TensorFlow's own call), and with them
    the epoch a resume starts at (metrics.json's later rows are dropped by the resume)."""
    import tensorflow as tf

    directory = str(run_dir / "checkpoints")
    state = tf.train.get_checkpoint_state(directory)
    kept = [index for index, path in enumerate(state.all_model_checkpoint_paths)
            if int(path.rsplit("-", 1)[1]) <= epoch]  # ckpt-N: the N-th save, after epoch N
    paths = [state.all_model_checkpoint_paths[index] for index in kept]
    assert paths and paths[-1].endswith(f"ckpt-{epoch}"), paths
    # With their timestamps, or CheckpointManager lists none of them.
    tf.compat.v1.train.update_checkpoint_state(
        directory, paths[-1], all_model_checkpoint_paths=paths,
        all_model_checkpoint_timestamps=[state.all_model_checkpoint_timestamps[i] for i in kept],
        last_preserved_timestamp=state.last_preserved_timestamp)


@pytest.mark.timeout(600)
def test_a_run_resized_mid_way_matches_an_uninterrupted_one(tmp_path):
    """A checkpoint written by 2 workers resumes on 1 (a lost node), and one written by 1 on 2
    (a requeue into a bigger allocation, under Keras 3): the same epochs, each once, each with
    the world it ran on, and the learning rate an uninterrupted run had at the same epoch (with
    a global batch the update, and so the rate, does not depend on the world)."""
    flags = ["--preset", "tiny", "--tensorboard", "--batch-policy", "global", "--batch-size",
             "32", "--warmup-epochs", "1", "--lr-decay", "cosine", "--epochs", "4"]

    def run(np_: int, run_dir: Path, *extra: str) -> str:
        return mpirun_job(np_, "hvdtrain.cnn", *flags, *extra, "--run-dir", str(run_dir),
                          timeout=240).stdout

    def rows(run_dir: Path) -> list[dict]:
        return json.loads((run_dir / "metrics.json").read_text())

    uninterrupted, shrunk, grown = tmp_path / "uninterrupted", tmp_path / "shrunk", tmp_path / "grown"
    run(2, uninterrupted)
    shutil.copytree(uninterrupted, shrunk)
    back_to_epoch(shrunk, 2)
    shrunk_output = run(1, shrunk)
    run(1, grown, "--keras", "3")
    back_to_epoch(grown, 2)
    grown_output = run(2, grown, "--keras", "3")

    assert ("2 epoch(s) done; resized: worker(s) 2 -> 1, batch per worker 16 -> 32 (the "
            "schedule follows the epochs)") in shrunk_output, shrunk_output[-3000:]
    assert ("2 epoch(s) done; resized: worker(s) 1 -> 2, batch per worker 32 -> 16 (the "
            "schedule follows the epochs)") in grown_output, grown_output[-3000:]
    expected = rows(uninterrupted)
    assert [(row["epoch"], row["workers"]) for row in expected] == [(e, 2) for e in (1, 2, 3, 4)]
    for run_dir, workers in ((shrunk, [2, 2, 1, 1]), (grown, [1, 1, 2, 2])):
        got = rows(run_dir)
        assert [(row["epoch"], row["workers"]) for row in got] == list(zip((1, 2, 3, 4),
                                                                           workers)), got
        # The rate after each epoch: warm-up to the peak, then cosine towards zero.
        assert [row["learning_rate"] for row in got] == pytest.approx(
            [row["learning_rate"] for row in expected], rel=1e-5), (got, expected)
        assert got[-1]["val_accuracy"] > 0.5, got[-1]


# --- damaged checkpoints ----------------------------------------------------------------------
def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)  # a save cut short by a full disk or a crash


def empty(path: Path) -> None:
    path.write_bytes(b"")  # a node crash after the rename, before the data reached the disk


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1  # what TensorFlow's checksums are for
    path.write_bytes(bytes(data))


CHECKPOINT_DATA = "ckpt-{}.data-00000-of-00001"


@pytest.fixture(scope="module")
def four_checkpoints(tmp_path_factory) -> Path:
    """A real run directory holding ckpt-1 to ckpt-4: the tiny preset, four epochs of 3 steps."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    mpirun_job(1, "hvdtrain.cnn", "--preset", "tiny", "--epochs", "4", "--steps-per-epoch", "3",
               "--keep-checkpoints", "4", "--no-tensorboard", "--no-export",
               "--run-dir", str(run_dir), timeout=180)
    return run_dir


def damaged_copy(run_dir: Path, tmp_path: Path, damages: dict[int, Callable]) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for number, damage in damages.items():
        damage(copy / "checkpoints" / CHECKPOINT_DATA.format(number))
    return copy


def resume(run_dir: Path, epochs: int) -> subprocess.CompletedProcess:
    """The launcher, allowed two restarts, resuming ``run_dir`` on 2 ranks."""
    return run_job([*LAUNCH, "--np", "2", "--via", "mpirun", "--max-restarts", "2",
                    "--skip-preflight", "--", "hvdtrain.cnn", "--preset", "tiny", "--epochs",
                    str(epochs), "--steps-per-epoch", "3", "--keep-checkpoints", "4",
                    "--no-tensorboard", "--no-export", "--run-dir", str(run_dir)],
                   timeout=200, check=False)


@pytest.mark.timeout(300)
def test_damaged_newest_checkpoints_are_named_and_the_next_older_one_resumes(
        four_checkpoints, tmp_path):
    # One job for the three kinds of damage: each of the three newest checkpoints is damaged in
    # its own way, and the resume names each in turn before the fourth.
    run_dir = damaged_copy(four_checkpoints, tmp_path,
                           {4: flip_a_bit, 3: empty, 2: truncate})
    result = resume(run_dir, epochs=5)
    assert result.returncode == 0, result.stdout[-4000:]
    said = [l for l in result.stdout.splitlines() if "cannot be read" in l]
    assert len(said) == 3, result.stdout[-4000:]
    for line, number in zip(said, (4, 3, 2)):
        assert f"checkpoint {run_dir}/checkpoints/ckpt-{number} cannot be read (" in line, said
        assert line.endswith("); trying the next older one"), said
    assert "DataLossError: TensorBundle at" in said[0] and "Checksum does not match" in said[0]
    assert all("IndexError: Read less bytes than requested" in line for line in said[1:]), said
    assert f"resuming from {run_dir}/checkpoints/ckpt-1: 1 epoch(s) done" in result.stdout
    assert "Traceback" not in result.stdout and "restart 1" not in result.stdout
    # The damaged ones were replaced by the next saves, and the history did not fork.
    assert [row["epoch"] for row in json.loads((run_dir / "metrics.json").read_text())] == [
        1, 2, 3, 4, 5]


@pytest.mark.timeout(200)
def test_no_readable_checkpoint_is_one_line_exit_2_and_not_restarted(four_checkpoints, tmp_path):
    run_dir = damaged_copy(four_checkpoints, tmp_path, dict.fromkeys((1, 2, 3, 4), truncate))
    result = resume(run_dir, epochs=5)
    assert result.returncode == 2, result.stdout[-4000:]
    named = [l.split("checkpoint ", 1)[1].split(" cannot be read")[0]
             for l in result.stdout.splitlines() if " cannot be read (" in l]
    assert named == [f"{run_dir}/checkpoints/ckpt-{n}" for n in (4, 3, 2, 1)], \
        result.stdout[-4000:]
    assert one_error(result).endswith(
        f"no checkpoint in {run_dir}/checkpoints can be read (each is named above): move the run "
        "directory away to start afresh, or use another --run-dir"), result.stdout[-4000:]
    assert "restart 1" not in result.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("content", ["", "garbled {\n"])
def test_a_damaged_checkpoint_index_is_rebuilt_from_the_checkpoints(four_checkpoints, tmp_path,
                                                                   content):
    """CheckpointManager's ``checkpoint`` file emptied (a node crash) failed with a traceback;
    garbled, the run started afresh beside its checkpoints (a forked history) without a word."""
    run_dir = damaged_copy(four_checkpoints, tmp_path, {})  # no checkpoint damaged
    (run_dir / "checkpoints" / "checkpoint").write_text(content)
    result = resume(run_dir, epochs=5)
    assert result.returncode == 0, result.stdout[-4000:]
    assert (f"{run_dir}/checkpoints/checkpoint cannot be read; rebuilt it from the 4 "
            "checkpoint(s) beside it") in result.stdout, result.stdout[-4000:]
    assert f"resuming from {run_dir}/checkpoints/ckpt-4: 4 epoch(s) done" in result.stdout
    assert "WARNING" not in result.stdout and "restart 1" not in result.stdout
    assert [row["epoch"] for row in json.loads((run_dir / "metrics.json").read_text())] == [
        1, 2, 3, 4, 5]


# --- a killed rank, restarted from its checkpoint within an epoch -------------------------------
@integration
@pytest.mark.timeout(400)
def test_a_killed_rank_is_restarted_and_resumes_at_its_last_step_checkpoint_as_if_never_stopped(
        tmp_path):
    """The launcher with --max-restarts 1 and --checkpoint-every-steps 5: rank 0 SIGKILLed after
    step 33 (epoch 2's 11th of 22), saying nothing; the launcher names it, restarts the job, and
    the restart loses one step: it resumes at step 10 of epoch 2 with the data where it stopped
    (its pass, in its order, from the next batch), the schedule and the optimizer state, fits the
    epoch's rest and then epoch 3, and ends with every epoch once and the weights of a run never
    stopped (deterministic ops; no dropout, whose masks Keras draws from generators no checkpoint
    holds). Those include the batch-norm statistics, which 2 ranks recompute from training
    batches at each epoch's end, read on from epoch x batches (they were taken from other
    batches after a resume: 1.3e-3 apart), and the optimizer's moving average of the weights
    (use_ema), which Keras copies into them as a fit ends (the fit of the resumed epoch's rest
    did, and epoch 3 trained on from the averages)."""
    import numpy as np

    script = SCRIPTS / "killed_at_step.py"
    flags = ["--preset", "tiny", "--epochs", "3", "--checkpoint-every-steps", "5",
             "--model", f"{script}:build"]
    env = clean_env(TF_DETERMINISTIC_OPS="1")
    never_stopped, killed = tmp_path / "never-stopped", tmp_path / "killed"
    run_job([*mpirun_ranks(2), sys.executable, str(script), *flags, "--run-dir",
             str(never_stopped)], timeout=240, env=env)
    # --via mpirun: the restart path of horovodrun without horovodrun's own TensorFlow import,
    # which costs many seconds per attempt on 2 busy cores (the user-error test uses horovodrun).
    # The kill is in the first attempt only (killed_at_step.py). A script's run directory, for
    # the launcher's line, is HVDTRAIN_RUN_DIR (as the sbatch templates set it).
    restarted = run_job(
        [*LAUNCH, "--np", "2", "--via", "mpirun", "--max-restarts", "1", "--skip-preflight",
         "--", str(script), *flags, "--run-dir", str(killed)], timeout=300, check=False,
        env={**env, "HVDTRAIN_RUN_DIR": str(killed), "HVDTRAIN_TEST_KILL_AT": "33"})
    output = restarted.stdout
    assert restarted.returncode == 0, output[-4000:]
    assert not ranks_of(killed, str(script)), "ranks outlived the job"
    restarts = re.findall(r"hvdtrain\.launch: job exited (\d+): rank 0 on (\S+) (.*); its "
                          r"log: (\S+); restart (\d) of 1", output)
    # The killed rank said nothing: the launcher names it, its host (as mpirun does), its log.
    assert restarts == [("137", socket.gethostname(), "ended on SIGKILL (killed: the "
                         "out-of-memory killer, or by hand)", f"{killed}/logs/rank-0.log",
                         "1")], output[-4000:]
    # It was killed in epoch 2, and the restart resumed at the last step checkpoint, not at the
    # last epoch's.
    assert re.search(r"resuming from \S+ckpt-\d+: 1 epoch\(s\) and 10 of 22 steps done",
                     output), output[-3000:]
    assert len(re.findall(RESUMED, output)) == 1, output[-3000:]

    def weights(run_dir: Path) -> list:
        """The arrays model.keras holds (a zip with model.weights.h5 inside)."""
        import io
        import zipfile

        import h5py

        with zipfile.ZipFile(run_dir / "model.keras") as archive, \
                h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as file:
            found = []
            file.visititems(lambda name, item: found.append(item[()]) if hasattr(item, "shape")
                            else None)
            return found

    def rows(run_dir: Path) -> list:
        return [(row["epoch"], row["learning_rate"])
                for row in json.loads((run_dir / "metrics.json").read_text())]

    # Every epoch once, none lost or logged twice, at the rate of the run never stopped.
    assert [epoch for epoch, _ in rows(killed)] == [1, 2, 3], rows(killed)
    assert rows(killed) == rows(never_stopped)
    expected, got = weights(never_stopped), weights(killed)
    assert len(got) == len(expected) > 0
    for mine, theirs in zip(got, expected):
        np.testing.assert_allclose(mine, theirs, rtol=0, atol=1e-6)
