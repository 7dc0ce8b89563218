"""`--track mlflow` against a real MLflow tracking server, started on 127.0.0.1 by these tests.

A 2-rank job is stopped by a preemption signal and run again: it must end as one MLflow run with
every epoch's metrics once (the same numbers as metrics.json), the plan as parameters and the
outputs as artifacts. A missing package and an unreachable server are refused in one line before
the first step, on every rank.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from conftest import VENV_BIN, clean_env, integration, run_job, wait_for_first_epoch
from hvdtrain.config import TrainConfig
from hvdtrain.credentials import split_userinfo, without_userinfo
from hvdtrain.launch.paths import Launch, describe
from hvdtrain.tracking import changed_params, epoch_metrics, flat_params, server_uri

LAUNCH = [sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--via", "mpirun",
          "--skip-preflight", "--"]


def test_parameters_are_flat_strings_and_changes_are_named():
    params = flat_params({"config": {"batch_size": 32, "data_dir": None},
                          "plan": {"learning_rate": 0.002, "notes": "x" * 7000}})
    assert params["config.batch_size"] == "32" and params["config.data_dir"] == "None"
    assert params["plan.learning_rate"] == "0.002" and len(params["plan.notes"]) == 6000
    assert changed_params({"config.epochs": "3", "world.size": "2"},
                          {"config.epochs": "4", "world.size": "2", "new": "1"}) == {
        "config.epochs": "3 -> 4"}


def test_a_row_gives_its_numbers_and_not_its_epoch():
    assert epoch_metrics({"epoch": 3, "loss": 0.5, "accuracy": 1, "note": "x", "ok": True}) == {
        "loss": 0.5, "accuracy": 1.0}


def test_a_password_in_a_url_is_left_out_of_what_is_shown_and_recorded():
    uri = "http://alice:p%40ss@mlflow.example.org:5000/"
    assert split_userinfo(uri) == ("http://mlflow.example.org:5000/", "alice", "p@ss")
    assert split_userinfo("databricks") == ("databricks", None, None)
    assert without_userinfo(f"--tracking-uri {uri} --data-dir gs://b/x?v=a@b") == (
        "--tracking-uri http://mlflow.example.org:5000/ --data-dir gs://b/x?v=a@b")
    assert TrainConfig(tracking_uri=uri).to_dict()["tracking_uri"] == (
        "http://mlflow.example.org:5000/")
    shown = describe(Launch(argv=("mpirun", "python", "-m", "hvdtrain.cnn", "--tracking-uri",
                                  uri), env={}))  # --dry-run
    assert "alice" not in shown and "p%40ss" not in shown, shown


def test_a_password_in_mlflow_tracking_uri_goes_to_mlflows_credential_variables(monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://bob:pw%21@127.0.0.1:5999")
    assert server_uri(None) == "http://127.0.0.1:5999"
    assert os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:5999"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "bob"
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "pw!"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(home: Path, port: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `mlflow server` on 127.0.0.1:port (SQLite store and artifacts under ``home``):
    (its URI, its process)."""
    uri = f"http://127.0.0.1:{port}"
    with (home / "server.log").open("a") as log:
        server = subprocess.Popen(
            [str(VENV_BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
             "--artifacts-destination", str(home / "artifacts"), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=clean_env())
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start:\n{(home / 'server.log').read_text()}")
            time.sleep(0.5)
        yield uri, server
    finally:
        stop(server)


def stop(server: subprocess.Popen, signum: int = signal.SIGTERM) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signum)
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("mlflow"), free_port()) as (uri, _):
        yield uri


def client_of(uri: str):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri)


def tracking_lines(output: str) -> list[str]:
    """The lines that speak of MLflow, but for the launcher's echo of the command."""
    return [line for line in output.splitlines()
            if "mlflow" in line.lower() and not line.startswith("hvdtrain.launch: ")]


@integration
@pytest.mark.timeout(420)
def test_a_preempted_and_resumed_job_is_one_mlflow_run(mlflow_server, tmp_path):
    """The defaults a user gets (the digits preset, TensorBoard on, model export), 2 ranks."""
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    job = [*LAUNCH, "hvdtrain.cnn", "--epochs", "5", "--track", "mlflow", "--tracking-uri",
           mlflow_server, "--run-dir", str(run_dir)]
    with log.open("w") as sink:
        launcher = subprocess.Popen(job, env=clean_env(), stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)
    try:
        wait_for_first_epoch(run_dir, launcher, log)
        launcher.send_signal(signal.SIGUSR1)  # Slurm's warning before the time limit
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    first = log.read_text()
    assert launcher.returncode == 75, first[-3000:]
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    client = client_of(mlflow_server)
    assert client.get_run(run_id).info.status == "KILLED"
    stopped_after = len(json.loads((run_dir / "metrics.json").read_text()))
    assert stopped_after < 5, first[-3000:]

    second = run_job(job, timeout=300).stdout
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run_id
    # One line each, rank 0's, and nothing else of MLflow's on the console.
    experiment_id = client.get_run(run_id).info.experiment_id
    page = f"{mlflow_server}/#/experiments/{experiment_id}/runs/{run_id}"
    assert tracking_lines(first) == [
        f"tracking: MLflow run {run_id} (new) in experiment 'hvdtrain.cnn' at {page}"
    ], first[-3000:]
    assert tracking_lines(second) == [
        f"tracking: MLflow run {run_id} (resumed) in experiment 'hvdtrain.cnn' at {page}"
    ], second[-3000:]
    assert "View run" not in first + second  # MLflow's own links, printed when a run ends

    experiment = client.get_experiment_by_name("hvdtrain.cnn")
    runs = client.search_runs([experiment.experiment_id])
    assert [run.info.run_id for run in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    rows = json.loads((run_dir / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == [1, 2, 3, 4, 5]
    for key in ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate",
                "samples_per_sec", "epoch_seconds"):
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [1, 2, 3, 4, 5], (key, history)
        assert [m.value for m in history] == pytest.approx([row[key] for row in rows]), key
    assert rows[-1]["val_accuracy"] >= 0.9
    plan = json.loads((run_dir / "config.json").read_text())["plan"]
    params = run.data.params
    assert params["world.size"] == "2" and params["plan.num_workers"] == "2"
    assert params["plan.global_batch_size"] == str(plan["global_batch_size"]) == "64"
    assert float(params["plan.learning_rate"]) == pytest.approx(plan["learning_rate"])
    assert params["config.track"] == "mlflow" and params["run.program"] == "hvdtrain.cnn"
    assert run.data.tags["mlflow.runName"] == "run"
    artifacts = {entry.path for entry in client.list_artifacts(run_id)}
    assert {"config.json", "metrics.json", "metrics.csv", "curves.png",
            "model.keras"} <= artifacts, artifacts
    # The artifact is the run directory's file, as it was at the end.
    downloaded = client.download_artifacts(run_id, "metrics.json", str(tmp_path))
    assert json.loads(Path(downloaded).read_text()) == rows


@integration
@pytest.mark.timeout(200)
def test_an_unreachable_server_is_one_line_on_every_rank_before_training(tmp_path):
    run_dir = tmp_path / "run"
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    result = run_job([*LAUNCH, "hvdtrain.cnn", "--preset", "tiny", "--track", "mlflow",
                      "--tracking-uri", closed, "--run-dir", str(run_dir)],
                     timeout=180, check=False)
    assert result.returncode == 2, result.stdout[-3000:]
    errors = [line for line in tracking_lines(result.stdout) if "--track mlflow" in line]
    assert len(errors) == 1 and f"the tracking server at {closed} did not take the run" in \
        errors[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout
    assert not run_dir.exists()  # asked before the run directory is made: nothing left
    assert time.monotonic() - started < 150


@integration
@pytest.mark.timeout(120)
def test_without_mlflow_installed_the_flag_is_refused_in_one_line(tmp_path):
    """A Python where `import mlflow` fails (a package on PYTHONPATH that raises, standing in for
    an environment without it): refused before the data is read or the run directory made."""
    missing = tmp_path / "site" / "mlflow"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError(\"No module named 'mlflow'\")\n")
    run_dir = tmp_path / "run"
    result = run_job([sys.executable, "-m", "hvdtrain.cnn", "--track", "mlflow",
                      "--run-dir", str(run_dir)], timeout=100, check=False,
                     env=clean_env(PYTHONPATH=str(tmp_path / "site")))
    assert result.returncode == 2, result.stdout[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines == ["hvdtrain.cnn: error: --track mlflow needs the mlflow package (ImportError: "
                     "No module named 'mlflow'): pip install 'hvdtrain[mlflow]' (or "
                     "mlflow-skinny) into this environment"], result.stdout[-3000:]
    assert not run_dir.exists()


@integration
@pytest.mark.timeout(300)
def test_a_server_lost_mid_run_costs_one_line_and_the_rerun_fills_the_gap(tmp_path):
    """The server killed after the first epoch: training goes on to exit 0 with one line; the
    server back (same store, same port) and the run resumed, every epoch is in it once."""
    home, port, run_dir, log = tmp_path / "server", free_port(), tmp_path / "run", tmp_path / "log"
    home.mkdir()
    job = [sys.executable, "-m", "hvdtrain.cnn", "--preset", "tiny", "--track", "mlflow",
           "--tracking-uri", f"http://127.0.0.1:{port}", "--experiment", "lost-server",
           "--run-dir", str(run_dir)]
    with running_server(home, port) as (uri, server), log.open("w") as sink:
        trainer = subprocess.Popen([*job, "--epochs", "40"], env=clean_env(), stdout=sink,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for_first_epoch(run_dir, trainer, log, timeout=120, poll_seconds=0.05)
            stop(server, signal.SIGKILL)
            trainer.wait(timeout=150)
        finally:
            if trainer.poll() is None:
                os.killpg(trainer.pid, signal.SIGKILL)
                trainer.wait()
    output = log.read_text()
    assert trainer.returncode == 0, output[-3000:]
    lost = [line for line in output.splitlines() if line.startswith("hvdtrain: tracking:")]
    assert len(lost) == 1 and f"MLflow at {uri} failed" in lost[0] \
        and "training goes on without it" in lost[0], output[-3000:]
    assert "Traceback" not in output
    assert len(json.loads((run_dir / "metrics.json").read_text())) == 40

    with running_server(home, port):
        resumed = run_job([*job, "--epochs", "41"], timeout=120).stdout
        assert "(resumed) in experiment 'lost-server'" in resumed, resumed[-3000:]
        run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
        client = client_of(uri)
        steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
        assert client.get_run(run_id).info.status == "FINISHED"
    assert steps == list(range(1, 42))
