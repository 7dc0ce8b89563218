"""The jobs of tests/test_any_model.py: each Keras starts its ranks twice (not three times, with
two more processes to load the exports).

Usage: mpirun -np 2 python tests/scripts/any_model_jobs.py SUBCLASSED_FLAGS...
           [--then CNN_FLAGS...]... [--check-loads WEIGHTS_H5 FINAL_NPZ MODEL_DIR MODEL_KERAS]

The subclassed task (subclassed_task.py: ``hvdtrain.run`` on SUBCLASSED_FLAGS, then the ranks'
weights to ``$ANY_MODEL_WEIGHTS``) runs first; then each ``--then`` group as an ``hvdtrain.cnn``
run (cnn_runs.py), on the same ranks. With ``--check-loads``, rank 0 then loads what an earlier
job exported, as a user would in a process of their own (this job's run read neither file, nor
imported custom_layer.py): the subclassed model's WEIGHTS_H5 into a WineNet built in code,
compared with the weights that run ended with (FINAL_NPZ), and MODEL_KERAS, whose model file
custom_layer.py is in MODEL_DIR, loaded with its class named in custom_objects; each prints one
``loads:`` line. Exits with the first failing run's status.
"""
import os
import sys

import subclassed_task  # first: it imports hvdtrain, which selects the Keras

import cnn_runs  # noqa: E402


def check_loads(weights_h5: str, final_npz: str, model_dir: str, model_keras: str) -> None:
    import keras
    import numpy as np

    model = subclassed_task.WineNet()
    model(np.zeros((1, subclassed_task.FEATURES), "float32"))
    model.load_weights(weights_h5)
    with np.load(final_npz) as final:
        trained = list(final.values())
    same = all(np.allclose(a, b) for a, b in zip(model.get_weights(), trained))
    print(f"loads: subclassed weights as trained: {same}", flush=True)

    sys.path.insert(0, model_dir)
    import custom_layer

    loaded = keras.models.load_model(
        model_keras, custom_objects={"Standardize": custom_layer.Standardize}, compile=False)
    shape = loaded.predict(np.zeros((3, 8, 8, 1), "uint8"), verbose=0).shape
    print(f"loads: custom-layer model predicts {shape}", flush=True)


def main(argv: list[str]) -> int:
    loads = None
    if "--check-loads" in argv:
        at = argv.index("--check-loads")
        argv, loads = argv[:at], argv[at + 1:]
        assert len(loads) == 4, loads
    first, rest = argv, []
    if "--then" in argv:
        at = argv.index("--then")
        first, rest = argv[:at], argv[at + 1:]
    status = subclassed_task.main(first)
    if status == 0 and rest:
        # Layer names, and with them horovod's names for the variables it broadcasts, count up
        # from here on every rank alike: under Keras 2 the subclassed run left rank 1's count
        # ahead of rank 0's, and the next broadcast waited for names the other rank never sent.
        subclassed_task.keras.backend.clear_session()
        status = cnn_runs.main(rest)
    if status == 0 and loads and os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
        check_loads(*loads)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
