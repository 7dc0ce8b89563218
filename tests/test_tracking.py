"""`--track mlflow` against a real MLflow tracking server, started on 127.0.0.1 by these tests.

A 2-rank job is stopped by a preemption signal and run again: it must end as one MLflow run with
every epoch's metrics once (the same numbers as metrics.json), the plan as parameters and the
outputs as artifacts. A missing package and an unreachable server are refused in one line before
the first step, on every rank. A server that goes silent (a TCP proxy in front of it stops
forwarding) neither stops nor stalls a job under a short stall limit, and a password in the
tracking URI reaches the server and nothing else. A resume from an older checkpoint and a copied
run directory each keep the server's history equal to their metrics.json; a tracking.json that is
not a record of a run the server has is refused in one line.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import stat
import base64
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from conftest import VENV_BIN, clean_env, integration, run_job, wait_for_first_epoch
from hvdtrain.training.config import TrainConfig
from hvdtrain.credentials import split_userinfo, without_userinfo
from hvdtrain.errors import UserError
from hvdtrain.launch.paths import Launch, describe
from hvdtrain import tracking
from hvdtrain.rundir import RunDir, current_umask
from hvdtrain.runtime.base import Devices, Runtime, World
from hvdtrain.tracking.mlflow import (EPOCH_KEY, MlflowRun, changed_params, epoch_metrics,
                                      flat_params, is_claimed_by, latest_per_step, server_uri)
from processes import process_group

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


def test_the_latest_value_of_a_step_is_the_servers_and_a_claim_names_its_directory():
    from mlflow.entities import Metric

    history = [Metric("loss", 0.9, 3000, 2), Metric("loss", 0.5, 1000, 1),
               Metric("loss", 0.7, 2000, 2)]  # step 2 logged again later (a resume)
    assert latest_per_step(history) == {1: 0.5, 2: 0.9}
    assert is_claimed_by({"claim": "b", "previous_claim": "a"}, "b")
    assert is_claimed_by({"claim": "b", "previous_claim": "a"}, "a")  # its last start failed
    assert is_claimed_by({"claim": "b"}, None)  # a run from before claims
    assert not is_claimed_by({"claim": "b", "previous_claim": "a"}, "c")  # a copy claimed it
    assert not is_claimed_by({}, "c")


def one_process() -> Runtime:
    return Runtime(World(), Devices(kind="cpu", description="cpu"))


def test_the_track_flag_takes_off_mlflow_or_a_jsonl_path():
    assert TrainConfig(track="jsonl:runs/track.jsonl").track == "jsonl:runs/track.jsonl"
    for bad in ("jsonl:", "wandb", "runs/track.jsonl"):
        with pytest.raises(ValueError, match="--track must be off, mlflow or jsonl:PATH"):
            TrainConfig(track=bad)
    tracker = tracking.start("job", TrainConfig(), one_process(), RunDir("run", is_chief=True),
                             {}, [], job=None)
    assert isinstance(tracker, tracking.NullTracker)  # --track off: calls without an `if`


def jsonl_refusal(path: Path) -> str:
    """The one line ``--track jsonl:PATH`` is refused with, before the data is read."""
    with pytest.raises(UserError) as refusal:
        tracking.check(TrainConfig(track=f"jsonl:{path}"), one_process())
    message = str(refusal.value)
    assert "\n" not in message and message.startswith(f"--track jsonl:{path}: "), message
    return message


def test_a_jsonl_path_another_user_could_have_planted_is_refused_in_one_line(tmp_path):
    """A link at PATH is never followed (its target is left as it was); a hard link, a
    directory, a device, a FIFO (without waiting for its reader), another user's file, a missing
    directory and a URL are refused, naming why."""
    target = tmp_path / "someone-elses.txt"
    target.write_text("theirs\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    assert "is a symbolic link, which hvdtrain never follows" in jsonl_refusal(link)
    assert target.read_text() == "theirs\n"
    hard = tmp_path / "hard.jsonl"
    os.link(target, hard)
    assert "is a hard link to another file" in jsonl_refusal(hard)
    assert "Is a directory" in jsonl_refusal(tmp_path)
    assert "is not a plain file" in jsonl_refusal(Path(os.devnull))
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    assert "cannot append to" in jsonl_refusal(fifo)  # at once: nobody reads it
    assert "cannot append to" in jsonl_refusal(tmp_path / "missing" / "track.jsonl")
    assert "a local file, not a URL" in jsonl_refusal("gs://bucket/track.jsonl")
    assert target.read_text() == "theirs\n"
    if os.getuid() == 0:  # only root can give a file to another user
        theirs = tmp_path / "theirs.jsonl"
        theirs.write_text("")
        os.chown(theirs, 12345, 12345)
        assert "is owned by another user (uid 12345)" in jsonl_refusal(theirs)


def test_the_jsonl_tracker_appends_each_event_once_to_a_file_of_this_user(tmp_path):
    """A new file gets the umask's mode; an existing one keeps its lines. A resumed run's
    start names the epochs it had, and only later epochs follow; the end is written once."""
    path = tmp_path / "track.jsonl"
    path.write_text('{"event": "earlier"}\n')
    path.chmod(0o600)
    config = TrainConfig(track=f"jsonl:{path}")
    tracker = tracking.start("job", config, one_process(), RunDir("run", is_chief=True),
                             {"config": {"epochs": 3}}, [{"epoch": 1, "loss": 0.9}], job="J 1")
    rows = [{"epoch": 1, "loss": 0.9}, {"epoch": 2, "loss": 0.5}]
    tracker.log_epochs(rows)
    tracker.log_epochs(rows)  # an epoch's end that brought nothing new
    with pytest.raises(RuntimeError), tracking.failure_marked(tracker):
        raise RuntimeError("training raised")
    tracker.finish("FINISHED", "model.keras")  # after the failure: nothing more
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [event["event"] for event in events] == ["earlier", "start", "epoch", "finish"]
    start, epoch, finish = events[1:]
    assert start["params"] == {"config": {"epochs": 3}} and start["epochs_done"] == 1
    assert start["job"] == "J 1" and start["run_dir"] == "run"
    assert epoch["epoch"] == 2 and epoch["metrics"] == {"loss": 0.5}
    assert finish["status"] == "FAILED" and finish["model_file"] is None
    fresh = tmp_path / "fresh.jsonl"
    tracking.check(TrainConfig(track=f"jsonl:{fresh}"), one_process())
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~current_umask()


SHORT_WRITES = """
import resource, signal, sys
from hvdtrain.tracking.jsonlines import JsonLinesTracker, open_for_append
path, limit = sys.argv[1], int(sys.argv[2])
# A disk that fills up: writes past `limit` bytes are cut short, then fail (EFBIG, not a signal).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
tracker = JsonLinesTracker(open_for_append(path), path, "run", [])
tracker.append({"event": "start", "params": {"config": {"note": "x" * 200}}})
tracker.append({"event": "epoch", "epoch": 1, "metrics": {"loss": 0.9}})
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
tracker.append({"event": "epoch", "epoch": 2, "metrics": {"loss": 0.5}})
tracker.finish("FINISHED", None)
"""


def test_a_short_write_of_the_jsonl_tracker_is_said_once_and_glues_no_lines(tmp_path):
    """On a disk that fills up, a line cut short was followed, glued, by the next append (this
    job's or another's), both lost, and nothing said. Now the cut line is one line of its own,
    the file ends with a newline, and the job says so once."""
    path = tmp_path / "track.jsonl"
    earlier = '{"event": "earlier"}\n'
    path.write_text(earlier)
    done = subprocess.run([sys.executable, "-c", SHORT_WRITES, str(path), str(len(earlier) + 60)],
                          capture_output=True, text=True, timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    said = done.stdout.splitlines()
    assert len(said) == 1 and said[0].startswith(f"hvdtrain: tracking: cannot append to {path} "
                                                 "(a short write, 60 of "), said
    text = path.read_text()
    assert text.endswith("\n")
    lines = text.splitlines()
    assert lines[0] == earlier.strip() and len(lines[1]) == 60  # the start line, cut
    assert [json.loads(line)["event"] for line in lines[2:]] == ["epoch", "finish"]
    assert json.loads(lines[2])["epoch"] == 2


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


#: The server has a venv of its own (scripts/install.sh): full mlflow brings pandas, which Keras 3
#: imports at every rank's start wherever it is importable; the job's venv holds the client only.
MLFLOW_SERVER = VENV_BIN.parent / "mlflow-server" / "bin" / "mlflow"


@contextlib.contextmanager
def running_server(home: Path, port: int) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `mlflow server` on 127.0.0.1:port (SQLite store and artifacts under ``home``):
    (its URI, its process)."""
    uri = f"http://127.0.0.1:{port}"
    with (home / "server.log").open("a") as log, process_group(
            [str(MLFLOW_SERVER), "server", "--host", "127.0.0.1", "--port", str(port),
             "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
             "--artifacts-destination", str(home / "artifacts"), "--workers", "1"],
            grace_seconds=20, stdout=log, stderr=subprocess.STDOUT, env=clean_env()) as server:
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


def metrics_rows(run_dir: Path) -> list[dict]:
    try:
        return json.loads((run_dir / "metrics.json").read_text())
    except (OSError, ValueError):  # not written yet, or being replaced
        return []


def assert_same_history(client, run_id: str, rows: list[dict], keys=("loss", "accuracy",
                                                                     "val_loss", EPOCH_KEY)):
    """The server's latest value of every step is metrics.json's, for every epoch and no other."""
    for key in keys:
        assert latest_per_step(client.get_metric_history(run_id, key)) == pytest.approx(
            {row["epoch"]: row[key] for row in rows}), key


class Link:
    """One connection through the proxy."""

    def __init__(self, client: socket.socket, server: socket.socket | None):
        self.client, self.server = client, server
        self.silenced = server is None
        self.sent = bytearray()
        """What was forwarded to the server."""

    def close(self) -> None:
        for end in (self.client, self.server):
            if end is not None:
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)
                end.close()


class FlakyProxy:
    """A TCP forwarder from 127.0.0.1 to a server, failing as servers and routes do. Silent: it
    takes connections and requests but forwards and answers nothing (a hung server, a dropped
    route). Down: nothing listens on its port and the connections it had are closed (a killed
    server). Back: it forwards again on the same port (the connections it silenced closed). It
    keeps what it forwarded to the server, on every connection it had."""

    def __init__(self, server_port: int):
        self.server_port = server_port
        self.port = free_port()
        self.silent = False
        self.links: list[Link] = []
        self.lock = threading.Lock()
        self.listener: socket.socket | None = None
        self.come_back()

    def go_silent(self) -> None:
        with self.lock:
            self.silent = True
            for link in self.links:
                link.silenced = True

    def go_down(self) -> None:
        with self.lock:
            with contextlib.suppress(OSError):  # wakes the accept (a close alone would not)
                self.listener.shutdown(socket.SHUT_RDWR)
            self.listener.close()
            for link in self.links:
                link.close()

    def come_back(self) -> None:
        with self.lock:
            self.silent = False
            for link in self.links:
                if link.silenced:
                    link.close()
            if self.listener is None or self.listener.fileno() == -1:
                self.listener = socket.create_server(("127.0.0.1", self.port))
                threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def close(self) -> None:
        self.go_down()

    def forwarded(self) -> bytes:
        with self.lock:
            return b"".join(bytes(link.sent) for link in self.links)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self.lock:
                server = None if self.silent else socket.create_connection(
                    ("127.0.0.1", self.server_port))
                link = Link(client, server)
                self.links.append(link)
            threading.Thread(target=self._pump, args=(link, True), daemon=True).start()
            if server is not None:
                threading.Thread(target=self._pump, args=(link, False), daemon=True).start()

    def _pump(self, link: Link, to_server: bool) -> None:
        source, target = (link.client, link.server) if to_server else (link.server, link.client)
        while True:
            try:
                data = source.recv(65536)
                if not data:
                    break
                if link.silenced:
                    continue  # swallowed: nobody answers
                if to_server:
                    link.sent += data
                target.sendall(data)
            except OSError:
                break
        link.close()


@integration
@pytest.mark.timeout(420)
def test_a_preempted_and_resumed_job_is_one_mlflow_run(mlflow_server, tmp_path):
    """The defaults a user gets (the digits preset, TensorBoard on, model export), 2 ranks."""
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    job = [*LAUNCH, "hvdtrain.cnn", "--epochs", "5", "--track", "mlflow", "--tracking-uri",
           mlflow_server, "--run-dir", str(run_dir)]
    with log.open("w") as sink, process_group(job, env=clean_env(), stdout=sink,
                                              stderr=subprocess.STDOUT) as launcher:
        wait_for_first_epoch(run_dir, launcher, log)
        launcher.send_signal(signal.SIGUSR1)  # Slurm's warning before the time limit
        launcher.wait(timeout=120)
        first = log.read_text()
    assert launcher.returncode == 75, first[-3000:]
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    client = client_of(mlflow_server)
    assert client.get_run(run_id).info.status == "KILLED"
    stopped_after = len(json.loads((run_dir / "metrics.json").read_text()))
    assert stopped_after < 5, first[-3000:]

    second = run_job(job, timeout=300).stdout
    assert json.loads((run_dir / "tracking.json").read_text())["run_id"] == run_id
    # One line each, rank 0's, and nothing else of MLflow's on the console; on a loaded machine
    # also hvdtrain's own note that the server took longer than a second for an epoch
    # (test_a_silent_server_... is about that one).
    experiment_id = client.get_run(run_id).info.experiment_id
    page = f"{mlflow_server}/#/experiments/{experiment_id}/runs/{run_id}"
    late = re.compile(r"^hvdtrain: tracking: MLflow at \S+ did not take epoch \d+ within 1 s; "
                      r"the job does not wait for it: ")
    first, second = ("\n".join(line for line in output.splitlines() if not late.match(line))
                     for output in (first, second))
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
                     "No module named 'mlflow'): pip install mlflow-skinny into this "
                     "environment"], result.stdout[-3000:]
    assert not run_dir.exists()


@integration
@pytest.mark.timeout(300)
def test_a_server_lost_mid_run_costs_one_line_and_the_rerun_fills_the_gap(mlflow_server,
                                                                          tmp_path):
    """The server gone after the first epoch (the proxy in front of it down: connections
    refused, those open closed): training goes on to exit 0 with one line; the server back and
    the run resumed, every epoch is in it once."""
    proxy = FlakyProxy(int(mlflow_server.rsplit(":", 1)[1]))
    uri, run_dir, log = f"http://127.0.0.1:{proxy.port}", tmp_path / "run", tmp_path / "log"
    job = [sys.executable, "-m", "hvdtrain.cnn", "--preset", "tiny", "--track", "mlflow",
           "--tracking-uri", uri, "--experiment", "lost-server", "--run-dir", str(run_dir)]
    try:
        with log.open("w") as sink, process_group([*job, "--epochs", "12"], env=clean_env(),
                                                  stdout=sink, stderr=subprocess.STDOUT) as trainer:
            wait_for_first_epoch(run_dir, trainer, log, timeout=120, poll_seconds=0.05)
            proxy.go_down()
            trainer.wait(timeout=150)
            output = log.read_text()
        assert trainer.returncode == 0, output[-3000:]
        lost = [line for line in output.splitlines() if line.startswith("hvdtrain: tracking:")]
        assert len(lost) == 1 and f"MLflow at {uri} " in lost[0] \
            and "the job does not wait for it" in lost[0], output[-3000:]
        assert "Traceback" not in output
        assert len(metrics_rows(run_dir)) == 12

        proxy.come_back()
        resumed = run_job([*job, "--epochs", "13"], timeout=120).stdout
    finally:
        proxy.close()
    assert "(resumed) in experiment 'lost-server'" in resumed, resumed[-3000:]
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    client = client_of(mlflow_server)
    steps = sorted(m.step for m in client.get_metric_history(run_id, "loss"))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert steps == list(range(1, 14))


@integration
@pytest.mark.timeout(300)
def test_a_silent_server_neither_stops_nor_stalls_training_and_its_password_stays_secret(
        mlflow_server, tmp_path):
    """2 ranks under a 10 s stall limit, the tracking URI with a user and password, through a
    proxy that goes silent after the first epoch and forwards again once every epoch is done:
    every epoch ends meanwhile, one line says so, the end of the job catches up (every epoch,
    the outputs, FINISHED), and the password goes to the server in every request and nowhere
    else: not the output, the run directory (its logs, config.json, tracking.json), the run's
    parameters and tags, nor its artifacts."""
    password, epochs = "s3cr3t-4e1f", 12
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    proxy = FlakyProxy(int(mlflow_server.rsplit(":", 1)[1]))
    proxied = f"http://127.0.0.1:{proxy.port}"
    job = [sys.executable, "-m", "hvdtrain.launch", "--np", "2", "--via", "mpirun",
           "--skip-preflight", "--stall-check-shutdown-seconds", "10",
           "--stall-check-warning-seconds", "2", "--", "hvdtrain.cnn", "--preset", "tiny",
           "--epochs", str(epochs), "--track", "mlflow", "--tracking-uri",
           f"http://alice:{password}@127.0.0.1:{proxy.port}", "--experiment", "silent-server",
           "--run-dir", str(run_dir)]
    try:
        with log.open("w") as sink, process_group(job, env=clean_env(), stdout=sink,
                                                  stderr=subprocess.STDOUT) as launcher:
            wait_for_first_epoch(run_dir, launcher, log, poll_seconds=0.05)
            proxy.go_silent()
            deadline = time.monotonic() + 90
            while (len(metrics_rows(run_dir)) < epochs and launcher.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            trained_while_silent = len(metrics_rows(run_dir))
            proxy.come_back()
            launcher.wait(timeout=120)
            output = log.read_text()
    finally:
        proxy.close()
    assert trained_while_silent == epochs, output[-3000:]
    assert launcher.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    trouble = [line for line in output.splitlines() if "hvdtrain: tracking:" in line]
    assert len(trouble) == 1 and f"MLflow at {proxied} " in trouble[0], output[-3000:]

    client = client_of(mlflow_server)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert_same_history(client, run_id, metrics_rows(run_dir))
    artifacts = {entry.path for entry in client.list_artifacts(run_id)}
    assert {"config.json", "metrics.json", "model.keras"} <= artifacts, artifacts

    # The password reached the server with every request...
    sent = proxy.forwarded()
    requests = re.findall(rb"(?:GET|POST|PUT|PATCH|DELETE) /\S* HTTP/1\.1\r\n", sent)
    credentials = re.findall(rb"\r\nAuthorization: Basic (\S+)\r\n", sent)
    assert requests and credentials == [base64.b64encode(f"alice:{password}".encode())] * len(
        requests)
    # ... and nothing else holds it.
    assert f"--tracking-uri {proxied} " in output  # the launcher's echo of the command
    assert run.data.params["config.tracking_uri"] == proxied
    assert password not in output
    assert password not in json.dumps([run.data.params, run.data.tags])
    downloaded = Path(client.download_artifacts(run_id, "", str(tmp_path / "artifacts")))
    for path in [*run_dir.rglob("*"), *downloaded.rglob("*")]:
        assert not path.is_file() or password.encode() not in path.read_bytes(), path


@integration
@pytest.mark.timeout(300)
def test_a_resume_from_an_older_checkpoint_and_a_copied_run_directory_keep_one_history_each(
        mlflow_server, tmp_path):
    """A run of 3 epochs is copied; the original, its newest checkpoint lost, resumes from
    epoch 2 and trains epoch 3 again: the server's epoch 3 is the new one. The copy, run on to 4
    epochs, finds the run claimed by the original since: it says so and logs its own history
    into a run of its own, leaving the original's alone."""
    original, copy = tmp_path / "original", tmp_path / "copy"

    def job(run_dir: Path, epochs: int) -> list[str]:
        return [sys.executable, "-m", "hvdtrain.cnn", "--preset", "tiny", "--epochs",
                str(epochs), "--track", "mlflow", "--tracking-uri", mlflow_server,
                "--experiment", "one-history", "--run-dir", str(run_dir)]

    run_job(job(original, 3), timeout=120)
    run_id = json.loads((original / "tracking.json").read_text())["run_id"]
    shutil.copytree(original, copy)
    newest = sorted((original / "checkpoints").glob("ckpt-3.*"))
    assert newest
    for path in newest:
        path.unlink()
    resumed = run_job(job(original, 3), timeout=120).stdout
    assert "2 epoch(s) done" in resumed, resumed[-3000:]
    assert f"tracking: MLflow run {run_id} (resumed)" in resumed, resumed[-3000:]
    client = client_of(mlflow_server)
    assert_same_history(client, run_id, metrics_rows(original))

    copied = run_job(job(copy, 4), timeout=120).stdout
    copy_id = json.loads((copy / "tracking.json").read_text())["run_id"]
    assert copy_id != run_id
    assert [line.split(" in experiment")[0] for line in tracking_lines(copied)] == [
        f"tracking: MLflow run {copy_id} (new: this directory is a copy of the one that logs "
        f"into run {run_id})"], copied[-3000:]
    for run_dir, epochs, tracked in ((original, 3, run_id), (copy, 4, copy_id)):
        rows = metrics_rows(run_dir)
        assert [row["epoch"] for row in rows] == list(range(1, epochs + 1))
        assert_same_history(client, tracked, rows)
        assert client.get_run(tracked).info.status == "FINISHED"


def start_in(run_dir: Path, uri: str) -> MlflowRun:
    """This process as rank 0 of a job starting its run in ``run_dir``."""
    return MlflowRun.start(RunDir(run_dir, is_chief=True), tracking_uri=uri,
                           experiment="refusals", run_name=run_dir.name, job=None, params={},
                           rows=[])


@integration
@pytest.mark.timeout(120)
def test_a_tracking_json_that_names_no_run_of_the_server_is_refused_in_one_line(
        mlflow_server, tmp_path):
    """Not a new run, silently (its history would fork), nor the server's fault: one line that
    names the file and what to do."""
    client = client_of(mlflow_server)
    kept = tmp_path / "deleted"
    kept.mkdir()
    run = start_in(kept, mlflow_server)
    run.finish("FINISHED", model_file=None)
    client.delete_run(run.run_id)
    record = json.loads((kept / "tracking.json").read_text())
    unknown = {**record, "run_id": "0" * 32}
    cases = {"empty": ("", "(not JSON, or unreadable)"),
             "list": ("[]", "(a JSON list)"),
             "no-id": (json.dumps({"tracking_uri": mlflow_server}), "(no run_id in it)"),
             "directory": (None, "(not JSON, or unreadable)"),
             "unknown": (json.dumps(unknown), f"which the server at {mlflow_server} does not "
                                              "have"),
             "deleted": (json.dumps(record), f"which is deleted on the server at {mlflow_server}: "
                                             f"restore it (mlflow runs restore --run-id "
                                             f"{run.run_id}), or remove the file")}
    for name, (content, reason) in cases.items():
        run_dir = tmp_path / name
        run_dir.mkdir(exist_ok=True)
        if content is None:
            (run_dir / "tracking.json").mkdir()
        else:
            (run_dir / "tracking.json").write_text(content)
        with pytest.raises(UserError) as refusal:
            start_in(run_dir, mlflow_server)
        message = str(refusal.value)
        assert reason in message and str(run_dir / "tracking.json") in message, (name, message)
        assert "did not take the run" not in message and "\n" not in message, (name, message)
        assert "remove it" in message or "remove the file" in message, (name, message)
    experiment = client.get_experiment_by_name("refusals")
    from mlflow.entities import ViewType

    assert [found.info.run_id for found in client.search_runs(
        [experiment.experiment_id], run_view_type=ViewType.ALL)] == [run.run_id]
