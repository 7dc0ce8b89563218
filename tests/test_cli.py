"""The `hvdtrain` command: its commands' --help without TensorFlow, the generated reference in
docs/cli.md, --version, and one-line answers to a mistyped command or flag. The commands
training through it run in tests/test_gpus.py (`hvdtrain launch -np 2`, `hvdtrain train`)."""
from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO, clean_env, integration, run_job
from hvdtrain.cli import COMMANDS
from hvdtrain.cnn import PRESETS
from hvdtrain.training.config import describe_preset
from hvdtrain.launch.options import parse_options
from hvdtrain.launch.slurm import TEMPLATES

sys.path.insert(0, str(REPO / "scripts"))
from cli_reference import reference  # noqa: E402


@pytest.fixture
def without_tensorflow(tmp_path):
    """An environment where `import tensorflow` (and keras, tf_keras, horovod) fails."""
    for name in ("tensorflow", "keras", "tf_keras", "horovod"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    return clean_env(PYTHONPATH=f"{tmp_path}:{REPO}")


def hvdtrain(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hvdtrain", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=env)


def test_every_help_answers_without_tensorflow_and_docs_cli_md_is_what_they_say(
        without_tensorflow):
    generated = reference(without_tensorflow)
    assert generated == (REPO / "docs" / "cli.md").read_text(), \
        "docs/cli.md is stale: run python scripts/cli_reference.py"
    usages = re.findall(r"^usage: (hvdtrain(?: [a-z-]+)*)", generated, re.MULTILINE)
    expected = ["hvdtrain"]
    for name in COMMANDS:
        expected += [f"hvdtrain {name}"] + (["hvdtrain slurm render"] if name == "slurm" else [])
    assert usages == expected
    # What a preset sets, in --help (the issue: `tiny` was a name only).
    tiny = describe_preset("tiny", PRESETS["tiny"], PRESETS["default"])
    assert tiny == ("tiny: The same job in a few seconds on 2 CPU ranks, for tests and a first "
                    "look (--learning-rate 0.003, --warmup-epochs 0.5, --epochs 3, --run-dir "
                    "runs/cnn-tiny, --no-tensorboard).")
    unwrapped = " ".join(re.sub(r"-\n\s+", "-", generated).split())  # argparse breaks at "-"
    assert tiny in unwrapped
    assert "see hvdtrain." not in generated  # help points at docs, not at internal code


@pytest.mark.parametrize("args, line", [
    (["--backend", "single"], "started as 2 ranks by a launcher, but --backend single runs one "
                              "process; use --backend horovod (or auto), or start one process"),
    (["--batch-policy", "global", "--batch-size", "33"],
     "global batch 33 does not divide by 2 workers; use a multiple of 2 or --batch-policy "
     "per-worker"),
    (["--data-dir", "/nonexistent/images"], "--data-dir /nonexistent/images: no such directory"),
    (["--data-dir", "gs://bucket/images"], "--data-dir gs://bucket/images: an image folder is "
                                           "read from a file system, not a URL: copy it down "
                                           "(training reads TFRecord shards at a URL: "
                                           "--tfrecords)"),
])
def test_what_the_flags_and_the_launch_show_is_refused_before_tensorflow_loads(
        without_tensorflow, args, line):
    """Rank 0 of 2 as mpirun starts it: each rank would spend seconds importing TensorFlow
    before saying this (training/preflight.py); here TensorFlow cannot even be imported."""
    result = hvdtrain("train", *args, env={**without_tensorflow, "OMPI_COMM_WORLD_RANK": "0",
                                            "OMPI_COMM_WORLD_SIZE": "2"})
    assert result.returncode == 2 and result.stderr == f"hvdtrain train: error: {line}\n", \
        result.stderr

def test_version_names_hvdtrain_and_the_stack_without_importing_it(without_tensorflow):
    result = hvdtrain("--version", env=without_tensorflow)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    versions = {name: importlib.metadata.version(name) for name in ("keras", "horovod")}
    tensorflow = next(importlib.metadata.version(name) for name in ("tensorflow-cpu", "tensorflow")
                      if _installed(name))
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    assert result.stdout == (
        f"hvdtrain 0.1.0{f' (commit {commit})' if commit else ''}, TensorFlow {tensorflow}, "
        f"Keras {versions['keras']}, tf_keras {importlib.metadata.version('tf_keras')}, "
        f"horovod {versions['horovod']}, Python {sys.version.split()[0]}\n"), result.stdout


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.parametrize("args, line", [
    (["trian"], "hvdtrain: error: no command 'trian'; did you mean train? (commands: train, "
                "autoencoder, launch, slurm, examples, evaluate, predict, export, convert, "
                "stack, health, gpu-check; hvdtrain --help)"),
    (["export", "--run-dir", "runs/x"], "hvdtrain export: error: the following arguments are "
                                        "required: --output (see --help)"),
    (["train", "--epoch", "3"], "hvdtrain train: error: unrecognized arguments: --epoch 3; did "
                                "you mean --epochs? (see --help)"),
    # The usage was printed above the error, and convert's errors named its module.
    (["health", "--bogus"], "hvdtrain health: error: unrecognized arguments: --bogus (see --help)"),
    (["stack", "--bogus"], "hvdtrain stack: error: unrecognized arguments: --bogus (see --help)"),
    (["gpu-check", "--bogus"], "hvdtrain gpu-check: error: unrecognized arguments: --bogus (see "
                               "--help)"),
    (["convert", "--data-dir", "/nonexistent", "--out", "/nonexistent-out"],
     "hvdtrain convert: error: --data-dir /nonexistent: no such directory"),
    # Never taken for a relative path (it wrote ./gs:/bucket/shards and said gs://).
    (["convert", "--data-dir", "/nonexistent", "--out", "gs://bucket/shards"],
     "hvdtrain convert: error: --out gs://bucket/shards: this command takes file system paths, "
     "not URLs: write the shards to a file system path, then copy them up (training reads "
     "--tfrecords at a URL)"),
    (["launch", "--hostz", "a:1", "hvdtrain.cnn"], "hvdtrain.launch: error: unrecognized "
                                                   "arguments: --hostz; did you mean --hosts? "
                                                   "(see --help)"),
])
def test_a_mistyped_command_or_flag_is_one_line_with_what_was_meant(args, line,
                                                                    without_tensorflow):
    result = hvdtrain(*args, env=without_tensorflow)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == line + "\n", result.stderr


def test_every_help_fits_the_terminal_without_markup(without_tensorflow):
    """launch, health and gpu-check printed their docstrings as written: 100 columns whatever the
    terminal, with ``code`` and **bold** marks."""
    for name in COMMANDS:
        result = hvdtrain(name, "--help", env={**without_tensorflow, "COLUMNS": "60"})
        assert result.returncode == 0, result.stderr
        body = result.stdout.split("\n\n", 1)[1]  # after the usage, which argparse lays out
        assert "``" not in body and "**" not in body, (name, body)
        # A flag and its metavar are never broken; nothing else passes the width.
        too_wide = [line for line in body.splitlines()
                    if len(line) > 60 and not re.fullmatch(r"  -[-\w]+ [A-Z_]+", line)]
        assert not too_wide, (name, too_wide)


def test_hvdtrain_alone_prints_its_commands_and_exits_2(without_tensorflow):
    result = hvdtrain(env=without_tensorflow)
    assert result.returncode == 2
    assert all(re.search(rf"^  {name} +\S", result.stdout, re.MULTILINE) for name in COMMANDS)


def test_the_launcher_takes_horovodruns_np():
    assert parse_options(["-np", "3", "hvdtrain.cnn"], "").np == 3
    assert parse_options(["--np", "3", "hvdtrain.cnn"], "").np == 3


def test_the_examples_are_written_beside_a_users_files_never_over_them(tmp_path, capsys):
    from hvdtrain.errors import UserError
    from hvdtrain.shipped import run

    run([str(tmp_path / "mine")])
    written = capsys.readouterr().out.split()
    assert "my_model.py" in [path.rsplit("/", 1)[-1] for path in written]
    (tmp_path / "mine" / "my_model.py").write_text("# edited\n")
    with pytest.raises(UserError) as error:
        run([str(tmp_path / "mine")])
    assert str(error.value) == (f"{', '.join(written)} already exist(s); not overwriting: "
                                "remove them or choose another directory")
    assert (tmp_path / "mine" / "my_model.py").read_text() == "# edited\n"


@integration
@pytest.mark.timeout(400)
def test_the_wheel_works_outside_the_checkout(tmp_path):
    """hvdtrain built as a wheel and installed (no dependencies) beside this stack, used from a
    directory of its own: the templates it writes run this Python, the examples it writes are
    the repository's, a 2-rank job trains the example model file there, and without horovod it
    says how to get it without a checkout."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    site, work = tmp_path / "site", tmp_path / "project"
    # The repository's files as they are (pip builds in the tree it is given: not this one's).
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True,
                             text=True, check=True).stdout.split("\0")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    run_job([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
             "-w", str(wheels), str(source)], timeout=300, env=clean_env(PIP_NO_INDEX="1"))
    wheel = next(wheels.glob("hvdtrain-*.whl"))
    run_job([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
             "--target", str(site), str(wheel)], timeout=300, env=clean_env())
    work.mkdir()
    env = clean_env(PYTHONPATH=str(site))  # ahead of the checkout's editable install
    where = run_job([sys.executable, "-c", "import hvdtrain; print(hvdtrain.__file__)"],
                    timeout=60, env=env, cwd=work).stdout
    assert where.startswith(str(site)), where

    written = run_job([sys.executable, "-m", "hvdtrain", "slurm", "templates", "slurm"],
                      timeout=60, env=env, cwd=work).stdout.split()
    assert written == [f"slurm/{name}" for name in TEMPLATES]
    assert f'exec "${{HVDTRAIN_PYTHON:-{sys.executable}}}"' in (work / "slurm/4gpu.sh").read_text()
    # The examples, as the repository has them, and the job below trains the model file.
    written = run_job([sys.executable, "-m", "hvdtrain", "examples", "examples"],
                      timeout=60, env=env, cwd=work).stdout.split()
    shipped = sorted(path.name for path in (REPO / "examples").iterdir() if path.is_file())
    assert written == [f"examples/{name}" for name in shipped] and "my_model.py" in shipped
    assert [name for name in shipped if (work / "examples" / name).read_bytes()
            != (REPO / "examples" / name).read_bytes()] == []

    trained = run_job([sys.executable, "-m", "hvdtrain", "launch", "-np", "2", "hvdtrain.cnn",
                       "--preset", "tiny", "--epochs", "2", "--no-tensorboard", "--run-dir",
                       "run", "--track", "jsonl:track.jsonl", "--model",
                       "examples/my_model.py:build"], timeout=300, env=env, cwd=work)
    assert "done: 2 epoch(s)" in trained.stdout, trained.stdout[-3000:]
    # The JSON-lines tracker (rank 0 alone: one start): the run's parameters, each epoch's
    # metrics.json row, its end.
    rows = json.loads((work / "run" / "metrics.json").read_text())
    events = [json.loads(line) for line in (work / "track.jsonl").read_text().splitlines()]
    assert [event["event"] for event in events] == ["start", "epoch", "epoch", "finish"]
    assert events[0]["params"]["world"]["size"] == 2
    assert events[0]["params"]["config"]["track"] == "jsonl:track.jsonl"
    assert [{"epoch": event["epoch"], **event["metrics"]} for event in events[1:3]] == rows
    assert events[-1]["status"] == "FINISHED" and events[-1]["model_file"] == "model.keras"
    with zipfile.ZipFile(work / "run" / "model.keras") as exported:  # what Keras saved
        assert json.loads(exported.read("config.json"))["config"]["name"] == "my_model"

    no_horovod = tmp_path / "no-horovod"
    (no_horovod / "horovod").mkdir(parents=True)
    (no_horovod / "horovod" / "__init__.py").write_text("raise ImportError('no horovod here')\n")
    refused = run_job([sys.executable, "-m", "hvdtrain", "launch", "-np", "2", "hvdtrain.cnn"],
                      timeout=120, check=False, cwd=work,
                      env=clean_env(PYTHONPATH=f"{no_horovod}:{site}"))
    assert refused.returncode == 2 and "make install" not in refused.stdout, refused.stdout
    assert "HVDTRAIN_STACK=existing PYTHON=python bash scripts/install.sh" in refused.stdout
