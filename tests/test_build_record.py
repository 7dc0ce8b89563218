"""horovod's build checks answer from its build record (scripts/horovod-patches/0004), and the
launcher's probe asks it instead of TensorFlow; on the real horovod of the venv.

The record's own cases run on a copy of the installed horovod package, first on PYTHONPATH, so
that making its record stale or untrusted never touches the venv's.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import integration
from hvdtrain.launch.probe import MARKER, from_record, tensorflow_build_info

SITE = Path(next(p for p in sys.path if p.endswith("site-packages")
                 and (Path(p) / "horovod").is_dir()))
SUFFIX = ".build-checks.json"
#: What horovodrun --check-build asks, each as (function, its argument).
CHECKS = [("extension_available", "'tensorflow'"), ("extension_available", "'torch'"),
          ("mpi_built", ""), ("gloo_built", ""), ("nccl_built", ""), ("ddl_built", ""),
          ("ccl_built", "")]


def _env(pythonpath: Path | None = None) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(pythonpath),
                                                          env.get("PYTHONPATH"))))
    return env


def ask_checks(site: Path) -> tuple[list, str]:
    """Every build check horovodrun --check-build makes, verbose, in a new interpreter: the
    answers and what the checks printed."""
    calls = ", ".join(f"util.{name}({argument + ', ' if argument else ''}verbose=True)"
                      for name, argument in CHECKS)
    code = ("import json, horovod.common.util as util\n"
            f"assert util.__file__.startswith({str(site)!r}), util.__file__\n"
            f"print('ANSWERS', json.dumps([{calls}]))\n")
    completed = subprocess.run([sys.executable, "-c", code], env=_env(site), capture_output=True,
                               text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr
    printed, _, answers = completed.stdout.rpartition("ANSWERS ")
    return json.loads(answers), printed


@pytest.fixture
def horovod_copy(tmp_path: Path) -> tuple[Path, Path]:
    """(site, library): a copy of the installed horovod without its record, and its TF library."""
    shutil.copytree(SITE / "horovod", tmp_path / "horovod",
                    ignore=shutil.ignore_patterns("*" + SUFFIX, "__pycache__"))
    library = next((tmp_path / "horovod" / "tensorflow").glob("mpi_lib*.so"))
    return tmp_path, library


@integration
@pytest.mark.timeout(300)
def test_the_first_check_records_every_answer_and_later_ones_read_it(horovod_copy):
    site, library = horovod_copy
    record = Path(str(library) + SUFFIX)
    answers, printed = ask_checks(site)
    # No record: one child loads the extension and answers every build check at once.
    assert printed.count("Checking whether extension tensorflow was built with (every build "
                         "check)") == 1, printed
    assert answers == [True, False, True, True, 0, False, False]  # the CPU build: MPI and Gloo
    assert "Extension torch was NOT built" in printed  # its library does not exist: no child
    stat = record.stat()
    assert stat.st_uid == os.geteuid() and stat.st_mode & 0o777 == 0o644
    key = json.loads(record.read_text())["key"]
    assert key["extension"] == {"path": str(library), "size": library.stat().st_size,
                                "mtime_ns": library.stat().st_mtime_ns}
    assert key["framework"]["path"].endswith(os.path.join("tensorflow", "__init__.py"))

    # The same answers from the record, in a new interpreter, with no child at all.
    again, printed = ask_checks(site)
    assert again == answers
    assert "Checking whether" not in printed
    assert printed.count(f"(recorded in {record})") == len(CHECKS) - 1, printed


@integration
@pytest.mark.timeout(300)
def test_a_stale_or_untrusted_record_falls_back_to_the_child(horovod_copy):
    site, library = horovod_copy
    record = Path(str(library) + SUFFIX)
    answers, _ = ask_checks(site)
    # A rebuilt extension (another modification time): the child checks again, and records anew.
    os.utime(library, ns=(library.stat().st_atime_ns, library.stat().st_mtime_ns + 10**9))
    again, printed = ask_checks(site)
    assert again == answers and "Checking whether" in printed
    assert json.loads(record.read_text())["key"]["extension"]["mtime_ns"] == \
        library.stat().st_mtime_ns
    # A record others may write is not trusted (and is replaced by the owner's).
    record.chmod(0o666)
    again, printed = ask_checks(site)
    assert again == answers and "Checking whether" in printed
    assert record.stat().st_mode & 0o777 == 0o644
    # A record that is a link to elsewhere is not followed.
    elsewhere = site / "elsewhere.json"
    record.rename(elsewhere)
    record.symlink_to(elsewhere)
    again, printed = ask_checks(site)
    assert again == answers and "Checking whether" in printed


def probe(*questions: str, pythonpath: Path | None = None) -> dict:
    completed = subprocess.run([sys.executable, "-m", "hvdtrain.launch.probe", *questions],
                               env=_env(pythonpath), capture_output=True, text=True, timeout=300)
    line = next(l for l in completed.stdout.splitlines() if l.startswith(MARKER + " "))
    return json.loads(line.removeprefix(MARKER + " "))


@integration
@pytest.mark.timeout(300)
def test_the_probe_answers_from_the_record_what_tensorflow_answers(horovod_copy):
    """The launcher's one question to the ranks' Python: with the install's record, no
    TensorFlow import, and the same answer as the import gives (a horovod without a record)."""
    site, _ = horovod_copy
    recorded = probe("build", "module", "hvdtrain.nope")
    imported = probe("build", pythonpath=site)["build"]
    assert recorded["build"].pop("asked") == "record"
    assert imported.pop("asked") == "tensorflow"
    assert recorded["build"] == imported
    assert recorded["module"] == {"missing": True}
    assert probe("module", "hvdtrain.cnn") == {"module": {"missing": False}}


def test_a_gpu_build_of_tensorflow_is_always_asked():
    """TensorFlow's build facts as a GPU node's tensorflow[and-cuda] (or ROCm) has them: only its
    import can say which GPUs it can use, whatever horovod's record says."""
    here = tensorflow_build_info(str(SITE / "tensorflow"))
    assert here is not None and not here["is_cuda_build"]  # this venv: tensorflow-cpu
    checks = {"built": True, "built with MPI": True, "built with Gloo": True,
              "built with NCCL": 22703, "built with DDL": False, "built with CCL": False}
    assert from_record(here, checks, "2.21.0")["nccl"] is True
    assert from_record({**here, "is_cuda_build": True}, checks, "2.21.0") is None
    assert from_record({**here, "is_rocm_build": True}, checks, "2.21.0") is None
    assert from_record(here, None, "2.21.0") is None  # no current record
