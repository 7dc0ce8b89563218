"""One code path for every backend: single process, horovod, MirroredStrategy, TPU (integration)."""
from __future__ import annotations

import json
import sys

import pytest

from conftest import clean_env, integration, run_job

pytestmark = [integration, pytest.mark.timeout(600)]


def python_module(module: str, *args: str, check: bool = True, **env: str):
    return run_job([sys.executable, "-m", module, *args], timeout=300, check=check,
                   env=clean_env(**env))


def losses(run_dir) -> list[float]:
    return [row["loss"] for row in json.loads((run_dir / "metrics.json").read_text())]


def test_mirrored_strategy_over_two_logical_cpus_with_steps_per_execution(tmp_path):
    run_dir = tmp_path / "run"
    # Keras 2: Keras 3's multi-step function fails under MirroredStrategy (refused in one line,
    # tests/test_keras3.py); Keras 3 on this strategy trains the autoencoder below.
    result = python_module("hvdtrain.cnn", "--preset", "tiny", "--backend", "mirrored",
                           "--steps-per-execution", "4", "--keras", "2", "--run-dir", str(run_dir),
                           HVDTRAIN_CPU_REPLICAS="2")
    assert "backend mirrored | 1 process(es), 2 worker(s) | 2 logical CPU device(s)" in \
        result.stdout
    # The global batch of 64 is fed by one process and split by Keras into 32 per replica.
    assert "32 per worker x 2 workers = 64 global" in result.stdout
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["world"]["replicas_per_process"] == 2
    assert saved["config"]["steps_per_execution"] == 4
    assert saved["plan"]["steps_per_epoch"] == 1438 // 64
    rows = json.loads((run_dir / "metrics.json").read_text())
    assert len(rows) == 3 and rows[-1]["val_accuracy"] > 0.8


def test_single_backend(tmp_path):
    result = python_module("hvdtrain.cnn", "--preset", "tiny", "--epochs", "1", "--backend",
                           "single", "--run-dir", str(tmp_path / "run"))
    assert "backend single | 1 process(es), 1 worker(s)" in result.stdout


def test_tpu_backend_without_a_tpu_is_one_line_and_writes_nothing(tmp_path):
    result = python_module("hvdtrain.cnn", "--backend", "tpu", "--keras", "2", "--run-dir",
                           str(tmp_path / "run"), check=False)
    assert result.returncode == 2
    errors = [line for line in result.stdout.splitlines() if "hvdtrain.cnn: error:" in line]
    assert errors == ["hvdtrain.cnn: error: --backend tpu: no TPU found (looked for $TPU_NAME, "
                      "$COLAB_TPU_ADDR and TPU device files /dev/accel*, /dev/vfio/*)"]
    assert "Traceback" not in result.stdout
    assert not (tmp_path / "run").exists()


def reconstruction_images(run_dir) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*.png") if p.name != "curves.png")


def test_autoencoder_on_the_strategy_path_on_keras_3(tmp_path):
    run_dir = tmp_path / "run"
    result = python_module("hvdtrain.autoencoder", "--preset", "tiny", "--backend", "mirrored",
                           "--keras", "3", "--run-dir", str(run_dir), HVDTRAIN_CPU_REPLICAS="2")
    assert "backend mirrored | 1 process(es), 2 worker(s)" in result.stdout
    assert "| Keras 3." in result.stdout.splitlines()[0] or "Keras 3." in result.stdout
    history = losses(run_dir)
    assert history[-1] < history[0], history
    assert reconstruction_images(run_dir) == ["cpu.png"]


def test_matmul_benchmark_times_the_selected_device(tmp_path):
    result = python_module("benchmarks", "matmul", "--batch", "8", "--repeats", "3",
                           "--out", str(tmp_path))
    report = json.loads((tmp_path / "matmul.json").read_text())
    assert report["device_kind"] == "cpu" and len(report["seconds"]) == 3
    assert report["median_seconds"] == sorted(report["seconds"])[1]
    flops = 2 * 8 * 512 * 512 * 16 + 8 * 512 * 512
    assert report["gflops_per_second"] == pytest.approx(flops / report["median_seconds"] / 1e9)
    assert "GFLOP/s" in result.stdout
