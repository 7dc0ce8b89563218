"""``--track mlflow``: rank 0 mirrors the run into an MLflow run (a ``hvdtrain.tracking``
tracker; the only module that imports mlflow).

* **One run directory, one MLflow run, one history.** The run's id is written to
  ``<run_dir>/tracking.json`` before anything is logged; a resumed run (a rerun,
  ``--max-restarts``, a Slurm requeue) reopens that run instead of starting another. A
  ``tracking.json`` that cannot be read, or names a run the server no longer has, is refused in
  one line (never silently a new run). A copied run directory starts a run of its own: each start
  writes a fresh claim into ``tracking.json`` and onto the run (tag ``hvdtrain.run_dir_claim``),
  so of two directories holding the same ``tracking.json``, the second to start finds the run
  claimed by the other, says so in its start line and logs its own history into a new run.
* **The tracker trails metrics.json, epoch for epoch.** An epoch is logged (step = its 1-based
  number) once its checkpoint is written; at start, every epoch of metrics.json the server lacks,
  or holds with other numbers (a resume from an older checkpoint trains some epochs again), is
  logged again. MLflow keeps every value logged; the latest per step is the run's.
* **Rank 0 only, and never what stops or stalls training.** Starting the run is checked with
  every rank waiting (a missing package or an unreachable server is one line and exit 2 before
  the first step). Once training runs, a thread of rank 0 talks to the server: an epoch's end
  waits at most ``HAND_OFF_SECONDS`` for it, a server that fails or stops answering costs one line
  and is caught up with when it answers again, and the end of the job waits a bounded time for
  the rest (what the server still lacks then is logged by the next start in this directory).
* **The tracking password stays secret** (``hvdtrain.credentials``): user-info in the tracking
  URI goes into MLflow's ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, never into a line, a file or
  the run.
"""
from __future__ import annotations

import datetime
import os
import secrets
import tempfile
import threading
import time
from typing import Any, Mapping

from hvdtrain import __version__
from hvdtrain.credentials import split_userinfo, without_userinfo
from hvdtrain.errors import UserError, as_one_line
from hvdtrain.rundir import RunDir, is_url

#: The run directory's record of its MLflow run.
TRACKING_FILE = "tracking.json"
#: The run's tag naming the claim of the run directory that started it last (see the module).
CLAIM_TAG = "hvdtrain.run_dir_claim"
#: Run outputs logged as artifacts, when present (the model only once it is exported).
ARTIFACTS = ("config.json", "metrics.json", "metrics.csv", "curves.png")
#: MLflow refuses longer parameter values.
MAX_PARAM_LENGTH = 6000
#: Every metrics.json row has it (Throughput), measured anew each time an epoch is trained: the
#: server has an epoch when its latest value at that step is metrics.json's.
EPOCH_KEY = "epoch_seconds"
#: How long an epoch's end waits for the server to take the epoch (seconds); a slower server is
#: caught up with in the background.
HAND_OFF_SECONDS = 1.0
#: After a failed call, the tracker tries again at the next epoch's end or after this long.
RETRY_SECONDS = 5.0
#: How long the end of a job waits for the server to take what it lacks and the outputs, by the
#: run's final status. A stopped or failed job's other ranks wait in a collective meanwhile
#: (horovod's stall limit), and a preempted node is about to be taken away.
FINISH_SECONDS = {"FINISHED": 60.0, "KILLED": 5.0, "FAILED": 5.0}
# MLflow's HTTP client retries a failed request 7 times with exponential back-off (minutes in
# all): starting the run, every rank waits for rank 0, and at the end of a job, rank 0 waits for
# the call under way. Once training runs, the tracker's thread does its own retrying. Ending a
# run prints two lines of links, and a new SQLite store two INFO lines, in the middle of the job's
# output; the start line names the run instead. A user's own settings win.
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
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
                        "install mlflow-skinny into this environment") from None
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


def latest_per_step(history) -> dict[int, float]:
    """{step: value} of a metric's history, the latest value where a step was logged again."""
    return {metric.step: metric.value
            for metric in sorted(history, key=lambda metric: metric.timestamp)}


def read_record(run_dir: RunDir) -> dict | None:
    """``tracking.json``: None when there is none (a new run); ``UserError`` when it is there
    but is not a record of a run, which would otherwise fork this directory's history into a new
    run without a word."""
    import tensorflow as tf

    path = run_dir.file(TRACKING_FILE)
    if not tf.io.gfile.exists(path):
        return None
    record = run_dir.read_json(TRACKING_FILE)
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        what = "no run_id in it" if isinstance(record, dict) else (
            "not JSON, or unreadable" if record is None else f"a JSON {type(record).__name__}")
        raise UserError(f"{path} is not a record of this directory's MLflow run ({what}): "
                        "restore it, or remove it to log this directory into a new run")
    return record


def is_claimed_by(record: Mapping[str, Any], run_claim: str | None) -> bool:
    """True when the run's claim is this directory's (the last it wrote, or the one before, in
    case the server took a claim whose start then failed); a run without a claim is claimed by
    whoever has its tracking.json."""
    return run_claim is None or run_claim in (record.get("claim"), record.get("previous_claim"))


class MlflowRun:
    """Rank 0's handle on this run directory's MLflow run, and the thread that logs into it."""

    def __init__(self, client, run_id: str, experiment_id: str, tracking_uri: str,
                 run_dir: RunDir, started_as: str, on_server: dict[int, float]):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id
        self.tracking_uri = tracking_uri
        self.run_dir = run_dir
        self.started_as = started_as
        """How this start found it: 'new', 'resumed', or 'new: ...' for a copied directory."""
        self._changed = threading.Condition()
        # Shared with the thread, under _changed:
        self._on_server = on_server
        """{epoch: its EPOCH_KEY value} the server has."""
        self._rows: list[dict] = []
        """The rows the server should have (the latest hand-off)."""
        self._final: tuple[str, str | None] | None = None
        """(status, model file) once the job ends."""
        self._wake = False
        self._behind = False
        """The server did not take the last hand-off in time, or a call failed: epochs'
        ends stop waiting for it until it has caught up."""
        self._finished = False
        self._final_failed = False
        self._said = False

    @classmethod
    def start(cls, run_dir: RunDir, *, tracking_uri: str | None, experiment: str,
              run_name: str, job: str | None, params: Mapping[str, str],
              rows: list[dict]) -> "MlflowRun":
        """Reopen the run ``tracking.json`` names (or, for a copied directory, make its own),
        else create one and record it; then log the parameters and every row of ``rows`` the
        server lacks, and start the thread that logs the rest. ``UserError`` when mlflow is
        missing, tracking.json is not a record of a run the server has, or the server does not
        take it."""
        mlflow = import_mlflow()
        uri = server_uri(tracking_uri)
        client = mlflow.MlflowClient(tracking_uri=uri)
        record = read_record(run_dir)
        claim = secrets.token_hex(8)
        try:
            run, started_as = None, "new"
            if record:
                recorded_uri = without_userinfo(str(record.get("tracking_uri")))
                if recorded_uri != uri:
                    raise UserError(
                        f"{run_dir.file(TRACKING_FILE)} records MLflow run {record['run_id']} "
                        f"at {recorded_uri}, not at {uri}: pass --tracking-uri {recorded_uri}, "
                        "or remove the file to log this directory into a new run")
                run = _recorded_run(client, record, run_dir, uri)
                if is_claimed_by(record, run.data.tags.get(CLAIM_TAG)):
                    started_as = "resumed"
                    # The file first: a start that ends between the two still finds its claim
                    # (the previous one) on the run.
                    run_dir.write_json(TRACKING_FILE, {**_record(run, uri, experiment, claim),
                                                       "previous_claim": record.get("claim")})
                    client.set_tag(run.info.run_id, CLAIM_TAG, claim)
                    client.update_run(run.info.run_id, status="RUNNING")
                else:
                    started_as = (f"new: this directory is a copy of the one that logs into "
                                  f"run {run.info.run_id}")
                    run = None
            if run is None:
                run = client.create_run(_experiment_id(client, experiment), run_name=run_name,
                                        tags={"hvdtrain.version": __version__,
                                              "hvdtrain.run_dir": _absolute(run_dir.path),
                                              CLAIM_TAG: claim})
                # Recorded before anything is logged: whatever ends this process next, a rerun
                # finds the run.
                run_dir.write_json(TRACKING_FILE, _record(run, uri, experiment, claim))
            started = datetime.datetime.now().isoformat(timespec="seconds")
            client.set_tag(run.info.run_id, "hvdtrain.last_start",
                           started + (f" ({job})" if job else ""))
            on_server = latest_per_step(client.get_metric_history(run.info.run_id, EPOCH_KEY))
            tracked = cls(client, run.info.run_id, run.info.experiment_id, uri, run_dir,
                          started_as, on_server)
            tracked._log_params(params)
            tracked._log_rows(rows)
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the client raises: HTTP, auth, store
            raise UserError(_refused(uri, error)) from None
        tracked._rows = list(rows)
        threading.Thread(target=tracked._serve, name="hvdtrain-tracking",
                         daemon=True).start()  # never what keeps a process alive
        return tracked

    def describe(self, experiment: str) -> str:
        """The banner's line; for a tracking server, the run's page."""
        where = f"at {self.tracking_uri}"
        if self.tracking_uri.startswith(("http://", "https://")):
            where = (f"at {self.tracking_uri.rstrip('/')}/#/experiments/{self.experiment_id}/"
                     f"runs/{self.run_id}")
        return (f"tracking: MLflow run {self.run_id} ({self.started_as}) in experiment "
                f"'{experiment}' {where}")

    # --- the training thread ----------------------------------------------------------------------
    def log_epochs(self, rows: list[dict]) -> None:
        """At an epoch's end: the thread logs every row the server lacks; this waits at most
        HAND_OFF_SECONDS for it (not at all while the server is behind)."""
        with self._changed:
            self._rows = list(rows)
            self._wake = True
            self._changed.notify_all()
            if self._behind or self._changed.wait_for(lambda: self._has(rows) or self._behind,
                                                      timeout=HAND_OFF_SECONDS):
                return
            self._behind = True
        self._say(f"did not take epoch {rows[-1]['epoch']} within {HAND_OFF_SECONDS:g} s")

    def finish(self, status: str, model_file: str | None) -> None:
        """The run's outputs as artifacts, then its status: FINISHED, KILLED for a job stopped
        by a signal (its rerun reopens the run and sets it RUNNING again), or FAILED. Waits at
        most FINISH_SECONDS[status], and no longer than one attempt that fails once asked."""
        seconds = FINISH_SECONDS[status]
        with self._changed:
            if self._final is not None:
                return
            self._final = (status, model_file)
            self._wake = True
            self._changed.notify_all()
            if self._changed.wait_for(lambda: self._finished or self._final_failed,
                                      timeout=seconds):
                return
        self._say(f"did not take the run's end within {seconds:g} s")

    def fail(self) -> None:
        """The run ended on an error: say so on the server (bounded, nothing raised)."""
        self.finish("FAILED", model_file=None)

    # --- the tracker's thread ---------------------------------------------------------------------
    def _serve(self) -> None:
        """Log what the training thread hands off, in order; after a failure, try again at the
        next hand-off or after RETRY_SECONDS. Ends once the run's end is logged or failed."""
        failed = False
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._wake,
                                       timeout=RETRY_SECONDS if failed else None)
                self._wake = False
                rows, final = self._rows, self._final
            try:
                self._log_rows(rows)
                if final:
                    self._log_end(*final)
            except Exception as error:  # noqa: BLE001 - the job trains on whatever the server does
                failed = True
                with self._changed:
                    self._behind = True
                    self._final_failed = final is not None
                    self._changed.notify_all()
                self._say(f"failed ({without_userinfo(as_one_line(error))})")
                if final:
                    return
                continue
            failed = False
            with self._changed:
                self._finished = final is not None
                self._behind = self._behind and not self._has(self._rows)
                self._changed.notify_all()
            if final:
                return

    def _has(self, rows: list[dict]) -> bool:
        return all(self._on_server.get(row["epoch"]) == row[EPOCH_KEY] for row in rows)

    def _log_params(self, params: Mapping[str, str]) -> None:
        """New parameters as parameters; those an earlier start logged with another value (a
        resume with more epochs, another world size) as ``changed/KEY`` tags."""
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params
        fresh = [Param(key, value) for key, value in params.items() if key not in logged]
        changes = [RunTag(f"changed/{key}", text)
                   for key, text in changed_params(logged, params).items()]
        self.client.log_batch(self.run_id, params=fresh, tags=changes)

    def _log_rows(self, rows: list[dict]) -> None:
        """Every row the server lacks or holds with other numbers, each epoch as its step."""
        from mlflow.entities import Metric

        with self._changed:
            new_rows = [row for row in rows
                        if self._on_server.get(row["epoch"]) != row[EPOCH_KEY]]
        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, row["epoch"])
                   for row in new_rows for key, value in epoch_metrics(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        with self._changed:
            self._on_server.update((row["epoch"], row[EPOCH_KEY]) for row in new_rows)

    def _log_end(self, status: str, model_file: str | None) -> None:
        names = [*ARTIFACTS, *([model_file] if model_file else [])]
        with tempfile.TemporaryDirectory(prefix="hvdtrain-artifacts-") as scratch:
            for name in names:
                local = self._local(name, scratch)
                if local:
                    self.client.log_artifact(self.run_id, local)
        self.client.set_terminated(self.run_id, status=status)

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

    def _say(self, problem: str) -> None:
        """The one line a server in trouble costs (from either thread, once per process)."""
        with self._changed:
            if self._said:
                return
            self._said = True
        print(f"hvdtrain: tracking: MLflow at {self.tracking_uri} {problem}; the job does not "
              "wait for it: metrics.json keeps every epoch, the tracker catches up when the "
              "server answers, and what it still lacks when the job ends is logged by the next "
              "start in this run directory", flush=True)


def _record(run, uri: str, experiment: str, claim: str) -> dict:
    """tracking.json's content."""
    return {"run_id": run.info.run_id, "tracking_uri": uri, "experiment": experiment,
            "claim": claim}


def _recorded_run(client, record: Mapping[str, Any], run_dir: RunDir, uri: str):
    """The run tracking.json names; ``UserError`` when the server deleted it or never had it."""
    from mlflow.exceptions import MlflowException

    run_id, path = record["run_id"], run_dir.file(TRACKING_FILE)
    try:
        run = client.get_run(run_id)
    except MlflowException as error:
        if error.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        raise UserError(f"{path} names MLflow run {run_id}, which the server at {uri} does not "
                        "have (deleted for good?): remove the file to log this directory into "
                        "a new run") from None
    if run.info.lifecycle_stage == "deleted":
        raise UserError(f"{path} names MLflow run {run_id}, which is deleted on the server at "
                        f"{uri}: restore it (mlflow runs restore --run-id {run_id}), or remove "
                        "the file to log this directory into a new run")
    return run


def check(config) -> None:
    """Rank 0, before the data is read: mlflow importable (else one line naming the package)
    and the tracking server answering one question (a wrong --tracking-uri, a server that is
    down), so a refusal leaves no run directory behind."""
    mlflow = import_mlflow()
    uri = server_uri(config.tracking_uri)
    try:
        mlflow.MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as error:  # noqa: BLE001 - whatever the client raises: HTTP, auth, store
        raise UserError(_refused(uri, error)) from None


def start(program: str, config, run_dir: RunDir, sections: Mapping[str, Mapping[str, Any]],
          rows: list[dict], job: str | None) -> tuple[MlflowRun, str]:
    """Rank 0: the run started or reopened (``MlflowRun.start``), and its start line."""
    experiment = config.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or program
    run = MlflowRun.start(run_dir, tracking_uri=config.tracking_uri, experiment=experiment,
                          run_name=os.path.basename(run_dir.path.rstrip("/")), job=job,
                          params=flat_params(sections), rows=rows)
    return run, run.describe(experiment)


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
