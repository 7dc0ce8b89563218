"""A job's fixed costs (issue 57): rank 0's timeline of the time outside its epochs, and no
heavy package imported that the job does not use."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import clean_env, integration, run_job
from hvdtrain.timeline import MILESTONES, PHASES, Timeline

#: What a job imports before its first step: the classifier, the training run, horovod, the
#: image files' pipelines and the model.
JOB_MODULES = ("hvdtrain.cnn", "hvdtrain.training.train", "hvdtrain.runtime.horovod",
               "hvdtrain.data.pipeline", "hvdtrain.data.folder", "hvdtrain.data.records",
               "hvdtrain.models.cnn")
#: Loaded when a job asks for them (rank 0's curves.png, --tensorboard, --track mlflow, the
#: embedded digits), never by importing it: Keras 3 imported the first and the last two on
#: every rank before hvdtrain deferred them (see hvdtrain/__init__.py). Never pandas: Keras 3
#: imports it wherever it is importable (0.2 s of a rank's start), and it came only with the
#: tests' MLflow server, which has a venv of its own (scripts/install.sh).
HEAVY = ("matplotlib", "tensorboard", "mlflow", "sklearn", "scipy.stats", "pandas")


def test_phases_are_the_time_between_the_milestones_reached():
    # No pipelines of its own (a task's datasets): the banner joins the model's phase.
    reached = {"hvdtrain_imported": 0.1, "imported": 4.1, "runtime_started": 4.7,
               "data_listed": 5.0, "model_compiled": 6.5, "run_dir_ready": 6.7}
    timeline = Timeline(origin=0.0, origin_is_process_start=True, marks=dict(reached))
    assert timeline.phases() == pytest.approx({"python": 0.1, "imports": 4.0, "runtime": 0.6,
                                               "data": 0.3, "model": 1.5, "run_dir": 0.2})
    assert timeline.describe() == ("start-up 6.7 s (python 0.1, imports 4.0, runtime 0.6, "
                                   "data 0.3, model 1.5, run dir 0.2), no training step")
    for milestone, seconds in (("first_step_done", 9.7), ("training_done", 20.0),
                               ("fit_returned", 20.5), ("exported", 21.7), ("finished", 22.0)):
        timeline.marks[milestone] = seconds
    assert timeline.describe() == (
        "start-up 9.7 s (python 0.1, imports 4.0, runtime 0.6, data 0.3, model 1.5, run dir "
        "0.2, first step 3.0); epochs 10.3 s; after training 2.0 s (train end 0.5, export 1.2, "
        "job end 0.3)")
    record = timeline.to_dict()
    assert record["startup_seconds"] == 9.7 and record["after_training_seconds"] == 2.0
    # A later job of the same process counts from its own start, and says so.
    later = Timeline(origin=0.0, origin_is_process_start=False,
                     marks={name: s for name, s in reached.items() if name != "hvdtrain_imported"})
    assert later.describe().startswith("start-up since the job started 6.7 s (imports 4.1, ")


@integration
@pytest.mark.parametrize("keras", ["3", "2"])
def test_importing_a_job_loads_no_plotting_tracking_or_scikit_learn(keras):
    code = "".join(f"import {module}\n" for module in JOB_MODULES) + (
        f"import json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=clean_env(HVDTRAIN_KERAS=keras), timeout=300)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert json.loads(imported.stdout.splitlines()[-1]) == []


@integration
def test_a_job_says_where_its_time_outside_the_epochs_went(tmp_path):
    # `python -m hvdtrain.cnn`, with a last exit handler that lists the heavy packages loaded:
    # TensorFlow's autograph reads every loaded module's __file__, which must not load the ones
    # hvdtrain deferred. The embedded digits are read from scikit-learn's file without importing
    # it (0.6-1.1 s of every rank's start); rank 0 draws curves.png.
    run_dir = tmp_path / "run"
    code = ("import atexit, json, runpy, sys\n"
            "atexit.register(lambda: print('loaded at exit:', json.dumps("
            f"[m for m in {HEAVY!r} if m in sys.modules])))\n"
            "runpy.run_module('hvdtrain.cnn', run_name='__main__', alter_sys=True)\n")
    result = run_job([sys.executable, "-c", code, "--preset", "tiny", "--epochs", "1",
                      "--steps-per-epoch", "2", "--backend", "single", "--run-dir",
                      str(run_dir)], timeout=300)
    lines = result.stdout.splitlines()
    assert lines[-1] == 'loaded at exit: ["matplotlib"]', result.stdout[-3000:]
    record = json.loads((run_dir / "timeline.json").read_text())
    assert record["origin"] == "process start"
    # Every milestone, each reached no earlier than the one before it.
    assert list(record["milestones"]) == [milestone for milestone, _ in MILESTONES]
    seconds = list(record["milestones"].values())
    assert seconds[0] >= 0 and seconds == sorted(seconds), record
    assert list(record["phases"]) == list(PHASES)
    first_step = record["milestones"]["first_step_done"]
    assert record["startup_seconds"] == pytest.approx(first_step, abs=0.01)
    # metrics.json stays a list of epochs, and its first_step_seconds is the same milestone.
    rows = json.loads((run_dir / "metrics.json").read_text())
    assert [row["epoch"] for row in rows] == [1]
    assert rows[0]["first_step_seconds"] == pytest.approx(first_step, abs=0.01)
    # One line, right after the summary, with the recorded numbers.
    timeline_lines = [index for index, line in enumerate(lines) if line.startswith("start-up ")]
    assert len(timeline_lines) == 1, result.stdout[-3000:]
    line = lines[timeline_lines[0]]
    assert lines[timeline_lines[0] - 1].startswith("done: 1 epoch(s)"), result.stdout[-3000:]
    assert line.startswith(f"start-up {record['startup_seconds']:.1f} s (python "), line
    assert f"after training {record['after_training_seconds']:.1f} s (train end " in line
