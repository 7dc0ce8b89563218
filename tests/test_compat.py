"""hvdtrain makes horovod's Keras API work on TensorFlow >= 2.16 (Keras 2 via tf_keras, with
--keras 2 / HVDTRAIN_KERAS=2)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import LAUNCHED_RANKS, VENV_BIN, gather_checked, integration, multi_rank, run_job
from hvdtrain import KERAS


def python(code: str) -> subprocess.CompletedProcess:
    """A fresh interpreter asking for Keras 2, without the selection this test process made."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env["HVDTRAIN_KERAS"] = "2"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)


@integration
def test_import_is_cheap_and_redirects_keras_to_tf_keras():
    result = python(
        "import sys, hvdtrain\n"
        "assert 'tensorflow' not in sys.modules, 'importing hvdtrain must not load TF'\n"
        "import keras, tf_keras, tensorflow as tf\n"
        "assert keras is tf_keras\n"
        "assert tf.keras.__name__.startswith('tf_keras'), tf.keras.__name__\n"
        "assert hasattr(keras.backend, 'get_value')  # Keras 2 API horovod calls\n"
        "import importlib.util; assert importlib.util.find_spec('tf_keras').name == 'tf_keras'\n"
        "print('ok')")
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


@integration
def test_importing_tensorflow_first_is_refused_with_a_reason():
    result = python("import tensorflow\nimport hvdtrain")
    assert result.returncode != 0
    assert "hvdtrain must be imported before tensorflow" in result.stderr


@multi_rank  # identical to what? to another rank's
@pytest.mark.skipif(KERAS != "2", reason="horovod's Keras API runs on Keras 2: the mpirun pass "
                                         "under HVDTRAIN_KERAS=2 (make test-stack) runs it")
def test_horovod_keras_fit_leaves_identical_weights(runtime):
    """hvd.DistributedOptimizer + Broadcast/MetricAverage callbacks in a real model.fit."""
    import horovod.tensorflow.keras as hvd
    import tensorflow as tf
    import tf_keras as keras

    def local():
        assert hvd.size() == LAUNCHED_RANKS  # 2 under `mpirun -np 2 pytest`, 1 under pytest
        keras.utils.set_random_seed(1000 + hvd.rank())  # deliberately different initial weights
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)),
                      loss="mse")
        rng = np.random.default_rng(hvd.rank())  # every rank trains on different data
        x = rng.normal(size=(64, 4)).astype("float32")
        y = x.sum(axis=1, keepdims=True)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[
            hvd.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd.callbacks.MetricAverageCallback(),
        ])
        return ([w.tolist() for w in model.get_weights()], history.history["loss"][-1],
                tf.__version__)

    results = gather_checked(runtime, local)
    weights = [r[0] for r in results]
    for rank, rank_weights in enumerate(weights[1:], start=1):
        for mine, theirs in zip(weights[0], rank_weights):
            np.testing.assert_allclose(mine, theirs, rtol=0, atol=0,
                                       err_msg=f"rank {rank} differs from rank 0")
    assert len({r[1] for r in results}) == 1, "MetricAverageCallback left different losses"


@integration
@pytest.mark.timeout(180)
def test_horovodrun_two_ranks_really_communicate():
    code = ("import hvdtrain, horovod.tensorflow as hvd, tensorflow as tf; hvd.init(); "
            "assert hvd.size() == 2; total = hvd.allreduce(tf.constant(hvd.rank() + 1.0), "
            "op=hvd.Sum); print(f'rank {hvd.rank()} of {hvd.size()} sum {float(total)}')")
    result = run_job([str(VENV_BIN / "horovodrun"), "-np", "2", sys.executable, "-c", code],
                     timeout=150)
    assert "rank 0 of 2 sum 3.0" in result.stdout
    assert "rank 1 of 2 sum 3.0" in result.stdout
