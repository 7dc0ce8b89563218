"""Experiment tracking (``--track mlflow``): rank 0 mirrors the run into an MLflow run.

* **One run directory, one MLflow run.** The run's id is written to ``<run_dir>/tracking.json``
  before anything is logged; a resumed run (a rerun, ``--max-restarts``, a Slurm requeue) reopens
  that run instead of starting another.
* **The tracker trails metrics.json, epoch for epoch.** An epoch is logged (step = its 1-based
  number) once its checkpoint is written; at start, every epoch metrics.json holds that the
  server lacks is logged, and one the server already has is never logged again. A preempted and
  resumed job therefore ends as one run with every epoch once, whatever moment it stopped at.
* **Rank 0 only, and never the reason a job dies mid-way.** Starting the run is checked with every
  rank waiting (a missing package or an unreachable server is one line and exit 2 before the
  first step); a failure once training runs prints one line and training goes on (metrics.json
  keeps every epoch; the next start logs what the server missed).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import keras  # the Keras hvdtrain selected on import (Keras 3 unless --keras 2)

from hvdtrain import __version__
from hvdtrain.credentials import split_userinfo, without_userinfo
from hvdtrain.errors import UserError, as_one_line
from hvdtrain.preemption import StopRequest
from hvdtrain.rundir import RunDir, is_url

#: The run directory's record of its MLflow run.
TRACKING_FILE = "tracking.json"
#: Run outputs logged as artifacts, when present (the model only once it is exported).
ARTIFACTS = ("config.json", "metrics.json", "metrics.csv", "curves.png")
#: MLflow refuses longer parameter values.
MAX_PARAM_LENGTH = 6000
#: Every metrics.json row has it (Throughput): which epochs the server has.
EPOCH_KEY = "epoch_seconds"
# MLflow's HTTP client retries a failed request 7 times with exponential back-off (minutes in
# all): rank 0 would sit in it while every other rank waits. Ending a run prints two lines of
# links, and a new SQLite store two INFO lines, in the middle of the job's output; the start line
# names the run instead. A user's own settings win.
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
                   "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
                   "MLFLOW_LOGGING_LEVEL": "WARNING"}


def import_mlflow():
    """The mlflow package, or the one-line refusal naming the extra that installs it."""
    for name, value in MLFLOW_DEFAULTS.items():  # read when mlflow is imported
        os.environ.setdefault(name, value)
    try:
        import mlflow
    except ImportError as error:
        raise UserError(f"--track mlflow needs the mlflow package ({as_one_line(error)}): pip "
                        "install 'hvdtrain[mlflow]' (or mlflow-skinny) into this "
                        "environment") from None
    return mlflow


def server_uri(given: str | None) -> str:
    """The tracking server (``given``, else MLFLOW_TRACKING_URI, else MLflow's default) without
    user-info. A user and password in it move into MLFLOW_TRACKING_USERNAME/PASSWORD, from which
    MLflow's client sends them as basic auth on every request: the URI this process goes on
    with, prints and records then holds no secret (nor does its MLFLOW_TRACKING_URI)."""
    mlflow = import_mlflow()
    uri, username, password = split_userinfo(given or mlflow.get_tracking_uri())
    if username is not None:
        os.environ["MLFLOW_TRACKING_USERNAME"] = username
    if password is not None:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
    if "MLFLOW_TRACKING_URI" in os.environ:
        os.environ["MLFLOW_TRACKING_URI"] = without_userinfo(os.environ["MLFLOW_TRACKING_URI"])
    return uri


def flat_params(sections: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """{'config': {'batch_size': 32}} -> {'config.batch_size': '32'}: MLflow's parameters are
    flat strings; nested values are written as text."""
    return {f"{section}.{key}": str(value)[:MAX_PARAM_LENGTH]
            for section, values in sections.items() for key, value in values.items()}


def epoch_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of one metrics.json row MLflow takes as metrics (the epoch is the step)."""
    return {key: float(value) for key, value in row.items()
            if key != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool)}


def changed_params(logged: Mapping[str, str], now: Mapping[str, str]) -> dict[str, str]:
    """Parameters whose value differs from what an earlier start of this run logged, as
    ``{key: 'old -> new'}``: MLflow's parameters cannot change, so these go into tags."""
    return {key: f"{logged[key]} -> {value}" for key, value in now.items()
            if key in logged and logged[key] != value}


@dataclass
class MlflowRun:
    """Rank 0's handle on this run directory's MLflow run."""

    client: Any
    run_id: str
    experiment_id: str
    tracking_uri: str
    run_dir: RunDir
    resumed: bool
    logged_epochs: set[int]
    broken: str | None = None
    """Why logging stopped in this process (the server went away), or None."""

    @classmethod
    def start(cls, run_dir: RunDir, *, tracking_uri: str | None, experiment: str,
              run_name: str, job: str | None, params: Mapping[str, str],
              rows: list[dict]) -> "MlflowRun":
        """Reopen the run ``tracking.json`` names, or create one and record it; then log the
        parameters and every row of ``rows`` the server lacks. ``UserError`` when mlflow is
        missing or the server does not take it."""
        mlflow = import_mlflow()
        uri = server_uri(tracking_uri)
        client = mlflow.MlflowClient(tracking_uri=uri)
        recorded = run_dir.read_json(TRACKING_FILE)
        try:
            if recorded:
                recorded_uri = without_userinfo(str(recorded.get("tracking_uri")))
                if recorded_uri != uri:
                    raise UserError(
                        f"{run_dir.file(TRACKING_FILE)} records MLflow run {recorded['run_id']} "
                        f"at {recorded_uri}, not at {uri}: pass --tracking-uri {recorded_uri}, "
                        "or remove the file to start a new run")
                run = client.get_run(recorded["run_id"])
                client.update_run(run.info.run_id, status="RUNNING")
                resumed = True
            else:
                run = client.create_run(_experiment_id(client, experiment), run_name=run_name,
                                        tags={"hvdtrain.version": __version__,
                                              "hvdtrain.run_dir": _absolute(run_dir.path)})
                # Recorded before anything is logged: whatever ends this process next, a rerun
                # finds the run.
                run_dir.write_json(TRACKING_FILE, {"run_id": run.info.run_id, "tracking_uri": uri,
                                                   "experiment": experiment})
                resumed = False
            started = datetime.datetime.now().isoformat(timespec="seconds")
            client.set_tag(run.info.run_id, "hvdtrain.last_start",
                           started + (f" ({job})" if job else ""))
            logged = {metric.step for metric in
                      client.get_metric_history(run.info.run_id, EPOCH_KEY)}
            tracked = cls(client, run.info.run_id, run.info.experiment_id, uri, run_dir, resumed,
                          logged)
            tracked.log_params(params)
            tracked.log_epochs(rows, on_failure="raise")
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the client raises: HTTP, auth, store
            raise UserError(_refused(uri, error)) from None
        return tracked

    def describe(self, experiment: str) -> str:
        """The banner's line; for a tracking server, the run's page."""
        where = f"at {self.tracking_uri}"
        if self.tracking_uri.startswith(("http://", "https://")):
            where = (f"at {self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/"
                     f"runs/{self.run_id}")
        return (f"tracking: MLflow run {self.run_id} ({'resumed' if self.resumed else 'new'}) "
                f"in experiment '{experiment}' {where}")

    def log_params(self, params: Mapping[str, str]) -> None:
        """New parameters as parameters; those an earlier start logged with another value (a
        resume with more epochs, another world size) as ``changed/KEY`` tags."""
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params
        fresh = [Param(key, value) for key, value in params.items() if key not in logged]
        changes = [RunTag(f"changed/{key}", text)
                   for key, text in changed_params(logged, params).items()]
        self.client.log_batch(self.run_id, params=fresh, tags=changes)

    def log_epochs(self, rows: list[dict], on_failure: str = "report") -> None:
        """Every row the server lacks, each epoch as its step. A failure raises
        (``on_failure='raise'``) or is reported once and ends this process' logging."""
        from mlflow.entities import Metric

        if self.broken:
            return
        now_ms = int(time.time() * 1000)
        new_rows = [row for row in rows if row["epoch"] not in self.logged_epochs]
        metrics = [Metric(key, value, now_ms, row["epoch"])
                   for row in new_rows for key, value in epoch_metrics(row).items()]
        if not metrics:
            return
        if on_failure == "raise":
            self.client.log_batch(self.run_id, metrics=metrics)
        elif not self._tried(lambda: self.client.log_batch(self.run_id, metrics=metrics)):
            return
        self.logged_epochs.update(row["epoch"] for row in new_rows)

    def finish(self, status: str, model_file: str | None) -> None:
        """The run's outputs as artifacts, then its status: FINISHED, or KILLED for a job stopped
        by a signal (its rerun reopens the run and sets it RUNNING again)."""
        if self.broken:
            return
        names = [*ARTIFACTS, *([model_file] if model_file else [])]
        with tempfile.TemporaryDirectory(prefix="hvdtrain-artifacts-") as scratch:
            for name in names:
                local = self._local(name, scratch)
                if local and not self._tried(lambda: self.client.log_artifact(self.run_id, local)):
                    return
        self._tried(lambda: self.client.set_terminated(self.run_id, status=status))

    def fail(self) -> None:
        """The run ended on an error: say so on the server (best effort, nothing raised)."""
        if not self.broken:
            self._tried(lambda: self.client.set_terminated(self.run_id, status="FAILED"))

    def _local(self, name: str, scratch: str) -> str | None:
        """A local path of the run directory's file ``name`` (copied for a remote run dir)."""
        path = self.run_dir.file(name)
        if not is_url(self.run_dir.path):
            return path if os.path.exists(path) else None
        import tensorflow as tf

        if not tf.io.gfile.exists(path):
            return None
        local = os.path.join(scratch, name)
        tf.io.gfile.copy(path, local, overwrite=True)
        return local

    def _tried(self, call) -> bool:
        """Run one client call; on failure print one line and log nothing more in this process."""
        try:
            call()
            return True
        except Exception as error:  # noqa: BLE001 - the job trains on whatever the server does
            self.broken = without_userinfo(as_one_line(error))
            print(f"hvdtrain: tracking: MLflow at {self.tracking_uri} failed ({self.broken}); "
                  "training goes on without it: metrics.json keeps every epoch, and the next "
                  "start of this run logs the ones the server missed", flush=True)
            return False


@contextlib.contextmanager
def failure_marked(run: MlflowRun | None) -> Iterator[None]:
    """Training inside: an exception marks the run FAILED on the server, then goes on up."""
    try:
        yield
    except BaseException:
        if run is not None:
            run.fail()
        raise


def check_available(track: str, runtime) -> None:
    """Before the data is read: refuse ``--track mlflow`` on every rank when rank 0 (the one
    that logs) cannot import mlflow, instead of after listing a large folder."""
    if track == "mlflow":
        runtime.from_chief(lambda: import_mlflow() and None)


def start(program: str, config, runtime, run_dir: RunDir, params: Mapping[str, str],
          rows: list[dict]) -> MlflowRun | None:
    """Rank 0 starts or reopens the run while every rank waits (a refusal ends them all);
    returns it on rank 0, None elsewhere or when tracking is off."""
    if config.track == "off":
        return None
    from hvdtrain.slurm import job_label

    experiment = config.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or program
    started: list[MlflowRun] = []

    def open_run() -> str:
        run = MlflowRun.start(run_dir, tracking_uri=config.tracking_uri, experiment=experiment,
                              run_name=os.path.basename(run_dir.path.rstrip("/")),
                              job=job_label(os.environ), params=params, rows=rows)
        started.append(run)
        return run.describe(experiment)

    runtime.print0(runtime.from_chief(open_run))
    return started[0] if started else None


def check_server(config, runtime) -> None:
    """Rank 0 asks the tracking server one question before the run directory is made (every
    rank waits): a server that does not answer (a wrong --tracking-uri, one that is down) is
    one line that leaves no run directory behind."""
    if config.track == "off":
        return

    def ask() -> None:
        mlflow = import_mlflow()
        uri = server_uri(config.tracking_uri)
        try:
            mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as error:  # noqa: BLE001 - whatever the client raises: HTTP, auth, store
            raise UserError(_refused(uri, error)) from None

    runtime.from_chief(ask)


def _refused(uri: str, error: BaseException) -> str:
    return (f"--track mlflow: the tracking server at {uri} did not take the run "
            f"({without_userinfo(as_one_line(error))}); check --tracking-uri or "
            "MLFLOW_TRACKING_URI, or drop --track")


def _absolute(path: str) -> str:
    return path if is_url(path) else os.path.abspath(path)


def _experiment_id(client, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # another job created it in between
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


class TrackEpochs(keras.callbacks.Callback):
    """Rank 0, after SaveCheckpoint: each completed epoch's row, once its checkpoint exists."""

    def __init__(self, run: MlflowRun, rows: list[dict], request: StopRequest):
        super().__init__()
        self.run = run
        self.rows = rows
        self.request = request

    def on_epoch_end(self, epoch, logs=None):
        if not self.request.mid_epoch:  # a cut-short epoch has no row (MetricsLog)
            self.run.log_epochs(self.rows)
