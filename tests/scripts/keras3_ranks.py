"""hvdtrain's Keras 3 integration across real ranks: `mpirun -np 2 python keras3_ranks.py OUT.json`.

The pytest process runs Keras 2 (one Keras per process), so the Keras 3 checks run here, in a
job of their own, and tests/test_keras3.py reads the verdicts. Each check runs on every rank; the
ranks gather their results and rank 0 judges them, so a failure is reported, not a hang. The
verdicts (check name -> "ok" or what went wrong) go to OUT.json, written by rank 0.
"""
import hvdtrain  # noqa: F401  (selects Keras 3: HVDTRAIN_KERAS=3 in the environment)

import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from conftest import assert_same_on_all_ranks  # noqa: E402
from hvdtrain.training import checkpoint, train  # noqa: E402
from hvdtrain.cnn import CLASSIFIER, tiny  # noqa: E402
from hvdtrain.models.cnn import build_cnn  # noqa: E402
from hvdtrain.runtime.horovod import HorovodRuntime  # noqa: E402
from hvdtrain.runtime.keras3 import MetricAverage  # noqa: E402

assert hvdtrain.KERAS == "3" and keras.__version__.startswith("3."), keras.__version__
runtime = HorovodRuntime()
world = runtime.world
shared = runtime.broadcast_object(tempfile.mkdtemp(prefix="keras3-") if world.is_chief else None)


def config_in(name: str, **changes):
    return dataclasses.replace(tiny(), run_dir=os.path.join(shared, name), tensorboard=False,
                               rank_logs=False, **changes)


def state_of(model) -> list[np.ndarray]:
    """Every variable of the model and its optimizer (loss scale included), as arrays."""
    return [variable.numpy() for variable in checkpoint.training_state(model)]


def float32_after(run):
    try:
        return run()
    finally:
        keras.mixed_precision.set_global_policy("float32")  # global: never leak into a check


def check_one_step_from_different_initial_weights():
    seeded = dataclasses.replace(CLASSIFIER, build_model=lambda data: (
        keras.utils.set_random_seed(1000 + world.rank),
        build_cnn(data.image_shape, len(data.class_names)))[1])
    result = train.run("keras3", config_in("one-step", epochs=1, steps_per_epoch=1), runtime,
                       seeded)
    files = sorted(os.listdir(result.run_dir.path)) if world.is_chief else []
    return state_of(result.model), files


def judge_one_step(results):
    assert_same_on_all_ranks([state for state, _ in results], "after one step")
    config = json.load(open(os.path.join(shared, "one-step", "config.json")))
    assert config["versions"]["keras"].startswith("Keras 3."), config["versions"]
    assert {"model.keras", "metrics.json", "checkpoints"} <= set(results[0][1]), results[0][1]


def check_resume():
    first = state_of(train.run("keras3", config_in("resume", epochs=2), runtime,
                               CLASSIFIER).model)
    again = train.run("keras3", config_in("resume", epochs=2), runtime, CLASSIFIER)
    restored = (again.initial_epoch, state_of(again.model))
    later = train.run("keras3", config_in("resume", epochs=3), runtime, CLASSIFIER)
    return (first, restored, later.initial_epoch, [row["epoch"] for row in later.rows],
            int(later.model.optimizer.iterations.numpy()), later.plan.steps_per_epoch)


def judge_resume(results):
    first, (epoch, restored), initial_epoch, epochs_logged, iterations, steps = results[0]
    assert epoch == 2, epoch  # asked for the 2 epochs already done: restored, nothing trained
    assert_same_on_all_ranks([first] + [result[1][1] for result in results], "restored")
    assert initial_epoch == 2 and epochs_logged == [1, 2, 3], (initial_epoch, epochs_logged)
    assert iterations == 3 * steps, (iterations, steps)  # the schedule's step count carried on
    assert len({result[4] for result in results}) == 1


def check_mixed_precision_with_accumulation_and_fp16_allreduce():
    config = config_in("mixed", epochs=2, steps_per_epoch=4, fp16_allreduce=True,
                       grad_accum_steps=2, precision="mixed_float16", export=False)

    def run():
        result = train.run("keras3", config, runtime, CLASSIFIER)
        optimizer = result.model.optimizer
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer), type(optimizer)
        return (state_of(result.model), [row["loss"] for row in result.rows],
                int(optimizer.iterations.numpy()), result.plan.total_steps)

    return float32_after(run)


def judge_mixed(results):
    assert_same_on_all_ranks([state for state, *_ in results], "mixed precision")
    losses, iterations, total_steps = results[0][1:]
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    # As on the Keras 2 path: iterations advance on every backward pass, also those that only
    # accumulate, so the schedule's step count is the plan's.
    assert iterations == total_steps == 8, (iterations, total_steps)


def check_resumed_mixed_precision_keeps_the_loss_scale():
    config = config_in("mixed-resume", epochs=1, steps_per_epoch=4, grad_accum_steps=2,
                       precision="mixed_float16", export=False)

    def first_run_with_a_lowered_loss_scale():
        model = train.run("keras3", config, runtime, CLASSIFIER).model
        if world.is_chief:
            # The state a long run reaches after overflows: a scale below the initial 2**15,
            # checkpointed by rank 0 only.
            from hvdtrain.rundir import RunDir
            model.optimizer.dynamic_scale.assign(1024.0)
            checkpoint.Checkpoints(RunDir(config.run_dir, is_chief=True), model, keep=3).save(1)

    def resumed():
        result = train.run("keras3", dataclasses.replace(config, epochs=3), runtime, CLASSIFIER)
        return (result.initial_epoch, float(result.model.optimizer.dynamic_scale.numpy()),
                state_of(result.model))

    float32_after(first_run_with_a_lowered_loss_scale)
    runtime.barrier()
    return float32_after(resumed)


def judge_mixed_resume(results):
    assert [epoch for epoch, _, _ in results] == [1] * len(results)
    # Every rank continued from rank 0's restored scale (it grows only after 2000 good steps).
    assert all(scale <= 1024.0 for _, scale, _ in results), [scale for _, scale, _ in results]
    assert_same_on_all_ranks([state for _, _, state in results], "resumed mixed precision")


def check_metrics_are_averaged():
    logs = {"loss": float(world.rank), "val_accuracy": 10.0 * world.rank}
    MetricAverage(runtime.allreduce).on_epoch_end(0, logs)
    return logs


def judge_metrics(results):
    mean = (world.size - 1) / 2
    assert all(logs == {"loss": mean, "val_accuracy": 10 * mean} for logs in results), results


def _usr1_after_the_first_epoch(metrics_file: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.path.exists(metrics_file):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGUSR1)


def check_preemption_checkpoints_and_resumes():
    config = config_in("preempted", epochs=50)
    if world.is_chief:  # one rank receives the signal, as from Slurm; all must stop together
        threading.Thread(target=_usr1_after_the_first_epoch,
                         args=(os.path.join(config.run_dir, "metrics.json"),),
                         daemon=True).start()
    stopped = train.run("keras3", config, runtime, CLASSIFIER)
    done = runtime.broadcast_object(len(stopped.rows))  # rows: rank 0's metrics
    resumed = train.run("keras3", dataclasses.replace(config, epochs=done + 1), runtime,
                        CLASSIFIER)
    return (stopped.exit_code, done, resumed.initial_epoch,
            [row["epoch"] for row in resumed.rows], state_of(resumed.model))


def judge_preemption(results):
    codes = [result[0] for result in results]
    assert codes == [75] * len(results), codes  # checkpointed, "requeue me"
    _, done, initial_epoch, epochs, _ = results[0]
    assert 1 <= done < 50 and initial_epoch == done, (done, initial_epoch)
    assert epochs == list(range(1, done + 2)), epochs  # contiguous metrics
    assert_same_on_all_ranks([result[4] for result in results], "resumed after a stop")


def check_autoencoder_batch_norm_statistics():
    # Batch norm's moving statistics are not trained: identical across ranks only because
    # hvdtrain recomputes and averages them after every epoch (callbacks.BatchNormStatistics).
    from hvdtrain.autoencoder import RECONSTRUCTOR, write_reconstructions
    from hvdtrain.autoencoder import tiny as autoencoder_tiny

    config = dataclasses.replace(autoencoder_tiny(), epochs=1, rank_logs=False,
                                 run_dir=os.path.join(shared, "autoencoder"))
    result = train.run("keras3", config, runtime, RECONSTRUCTOR)
    picture = write_reconstructions(result, runtime)
    moving = [variable.numpy() for variable in result.model.non_trainable_variables]
    return state_of(result.model), moving, picture


def judge_autoencoder(results):
    assert_same_on_all_ranks([state for state, _, _ in results], "autoencoder")
    assert len(results[0][1]) == 8, len(results[0][1])  # 4 batch norms: mean and variance each
    assert results[0][2] and os.path.exists(results[0][2]), results[0][2]  # rank 0's picture


def check_horovod_keras_api_is_not_loaded():
    # horovod.tensorflow.keras needs Keras 2; the Keras 3 path uses horovod's TF collectives only.
    return sorted(name for name in sys.modules if name.startswith("horovod.tensorflow.keras")
                  or name.startswith("tf_keras"))


def judge_no_keras_2(results):
    assert results == [[]] * len(results), results


CHECKS = [
    ("no_horovod_keras_api", check_horovod_keras_api_is_not_loaded, judge_no_keras_2),
    ("one_step_from_different_initial_weights", check_one_step_from_different_initial_weights,
     judge_one_step),
    ("resume", check_resume, judge_resume),
    ("mixed_precision_accumulation_fp16_allreduce",
     check_mixed_precision_with_accumulation_and_fp16_allreduce, judge_mixed),
    ("resumed_mixed_precision", check_resumed_mixed_precision_keeps_the_loss_scale,
     judge_mixed_resume),
    ("metrics_averaged", check_metrics_are_averaged, judge_metrics),
    ("autoencoder_batch_norm", check_autoencoder_batch_norm_statistics, judge_autoencoder),
    ("preemption", check_preemption_checkpoints_and_resumes, judge_preemption),
]


def main() -> None:
    verdicts = {}
    for name, check, judge in CHECKS:
        try:
            outcome = ("ok", check())
        except Exception:  # noqa: BLE001 - reported in the verdicts, after the gather
            outcome = ("error", traceback.format_exc())
        outcomes = runtime.allgather_object(outcome)
        errors = [f"rank {rank}: {detail}" for rank, (status, detail) in enumerate(outcomes)
                  if status == "error"]
        if errors:
            verdicts[name] = "\n".join(errors)[-3000:]
            continue
        try:
            judge([value for _, value in outcomes])
            verdicts[name] = "ok"
        except AssertionError:
            verdicts[name] = traceback.format_exc()[-3000:]
    if world.is_chief:
        with open(sys.argv[1], "w") as out:
            json.dump({"world_size": world.size, "keras": keras.__version__,
                       "verdicts": verdicts}, out, indent=1)


if __name__ == "__main__":
    main()
